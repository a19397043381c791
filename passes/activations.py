"""Activation offload: which boundary activations a stage's forward can leave on the host until
its backward, and where the copies go in a program (``Offload(activations=...)``).

A stage's *offloadable* activations are the boundary values it reads (its inputs) that no later
forward reads and whose first backward reader is the stage itself: after ``F g`` nothing on the
device needs them until ``B g``. :func:`offloaded_values` lists them per stage (the same
:class:`~shfx.passes.stages.Value` names the runtime keeps them under), :func:`add_activation_offload`
adds ``AO g`` (device -> host, on the d2h queue) and ``AF g`` (host -> device, on the h2d
queue) for the chosen stages, and :func:`eligible_stages` says which stages may be chosen.

>>> from shfx.passes.stages import chain
>>> acts = [Action.from_str(a) for a in "F0 F1 F2 F3 B3 B2 B1 B0".split()]
>>> " ".join(map(str, add_activation_offload(acts, chain(4, activation_bytes=10), [1])))
'F0 F1 AO1 F2 F3 B3 AF1 B2 B1 B0'
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .actions import AF, AO, B, F, Action
from .stages import StageSpec, backward_stages, offloaded_values

__all__ = ["offloaded_values", "offloaded_bytes", "eligible_stages", "add_activation_offload", "FETCH_AHEAD"]

FETCH_AHEAD = 1
"""Backwards an ``AF g`` runs ahead of ``B g``: it is issued after, and waits for, the backward
``FETCH_AHEAD + 1`` places before ``B g`` in the backward order, so its copy overlaps the
``FETCH_AHEAD`` backwards in between and the device holds the activations of at most
``FETCH_AHEAD + 1`` offloaded stages at once. Likewise ``AO g`` is issued right after ``F g``
and the second forward after it waits for it (its copy overlaps the forward in between), and
frees the device copy as it starts."""




def offloaded_bytes(stages: Sequence[StageSpec], stage: int) -> int:
    """Bytes an ``AO`` (and the ``AF``) of ``stage`` moves."""
    return sum(v.nbytes for v in offloaded_values(stages).get(stage, ()))


def _backward_order(acts: Sequence[Action]) -> list[int]:
    return [a.stage for a in acts if a.kind == B]


def eligible_stages(acts: Sequence[Action], stages: Sequence[StageSpec]) -> list[int]:
    """The stages whose activations a program with actions ``acts`` may offload, in forward
    order: those with offloadable values (:func:`offloaded_values`) except the first
    ``FETCH_AHEAD + 1`` of the backward order. NOTE: those are the stages whose backward comes
    (nearly) right after their forward: their fetch could not start before the backward does,
    so offloading them would only add copies at the point where the device is fullest."""
    order = _backward_order(acts)
    early = set(order[: FETCH_AHEAD + 1])
    vals = offloaded_values(stages)
    fwd = [a.stage for a in acts if a.kind == F]
    return [s for s in fwd if s in vals and s in order and s not in early]


def add_activation_offload(acts: Sequence[Action], stages: Sequence[StageSpec], chosen: Iterable[int]) -> list[Action]:
    """Given an action order and the stages whose activations go to the host, add ``AO g``
    at the end of the trailer of ``F g`` (the second forward after it waits for it and frees
    the device copy: :func:`shfx.passes.program.lower_actions`), and ``AF g`` at the end of the trailer
    of the backward ``FETCH_AHEAD + 1`` places before ``B g`` in the backward order (it waits for
    that backward, so in the backward the device holds at most ``FETCH_AHEAD + 1`` offloaded
    stages' activations). A stage that is not eligible (:func:`eligible_stages`) is refused."""
    acts = list(acts)
    chosen = sorted(set(chosen))
    ok = set(eligible_stages(acts, stages))
    bad = [s for s in chosen if s not in ok]
    if bad:
        from .program import ScheduleError

        raise ScheduleError(
            f"stages {bad} cannot offload their activations: only stages {sorted(ok)} have boundary activations "
            f"that wait on the device from their forward to their backward (the first {FETCH_AHEAD + 1} of the "
            "backward order keep theirs)"
        )
    order = _backward_order(acts)
    ao_after: dict[int, list[Action]] = {}  # forward stage -> AOs at the end of its trailer
    af_after: dict[int, list[Action]] = {}  # backward stage -> AFs at the end of its trailer
    for g in chosen:
        ao_after.setdefault(g, []).append(Action(AO, g))
        af_after.setdefault(order[order.index(g) - FETCH_AHEAD - 1], []).append(Action(AF, g))
    out: list[Action] = []
    pending: list[Action] = []
    for a in acts:
        if a.kind in (F, B):
            out += pending
            pending = []
        out.append(a)
        if a.kind == F:
            pending = list(ao_after.get(a.stage, []))
        elif a.kind == B:
            pending = list(af_after.get(a.stage, []))
    return out + pending
