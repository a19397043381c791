"""Activation offload: which boundary activations a stage's forward can leave on the host until
its backward, and where the copies go in a program (``Offload(activations=...)``).

A stage's *offloadable* activations are the boundary values it reads (its inputs) that no later
forward reads and whose first backward reader is the stage itself: after ``F g`` nothing on the
device needs them until ``B g``. :func:`offloaded_values` lists them per stage (the same
:class:`~shfx.passes.stages.Value` names the runtime keeps them under), :func:`add_activation_offload`
adds ``AO g`` (device -> host, on the d2h queue) and ``AF g`` (host -> device, on the h2d
queue) for the chosen stages, and :func:`eligible_stages` says which stages may be chosen.

With ``Offload(activations="nvme")`` the host holds only a *window* of
:data:`ACTIVATION_WINDOW` buffers: :func:`add_activation_spill` adds ``AW g`` (write the
stage's buffer to the SSD, freeing it) right after each ``AO g`` and ``AR g`` (read it back into
a buffer) ahead of each ``AF g``, as early as the window allows; :func:`spill_layout` says where
each value lies in a buffer, and :func:`window_buffer_bytes` how large one is.

>>> from shfx.passes.stages import chain
>>> acts = [Action.from_str(a) for a in "F0 F1 F2 F3 B3 B2 B1 B0".split()]
>>> " ".join(map(str, add_activation_offload(acts, chain(4, activation_bytes=10), [1])))
'F0 F1 AO1 F2 F3 B3 AF1 B2 B1 B0'
>>> acts = [Action.from_str(a) for a in "F0 F1 F2 F3 F4 F5 B5 B4 B3 B2 B1 B0".split()]
>>> acts = add_activation_offload(acts, chain(6, activation_bytes=10), [1, 2, 3])
>>> " ".join(map(str, add_activation_spill(acts, 1)))
'F0 F1 AO1 AW1 F2 AO2 AW2 F3 AO3 AW3 F4 F5 B5 AR3 AF3 AR2 B4 AF2 AR1 B3 AF1 B2 B1 B0'
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .actions import AF, AO, AR, AW, B, F, Action
from .stages import StageSpec, Value, backward_stages, offloaded_values

__all__ = [
    "offloaded_values", "offloaded_bytes", "eligible_stages", "add_activation_offload", "FETCH_AHEAD",
    "ACTIVATION_WINDOW", "SPILL_ALIGN", "spill_layout", "window_buffer_bytes", "add_activation_spill",
]  # fmt: skip

FETCH_AHEAD = 1
"""Backwards an ``AF g`` runs ahead of ``B g``: it is issued after, and waits for, the backward
``FETCH_AHEAD + 1`` places before ``B g`` in the backward order, so its copy overlaps the
``FETCH_AHEAD`` backwards in between and the device holds the activations of at most
``FETCH_AHEAD + 1`` offloaded stages at once. Likewise ``AO g`` is issued right after ``F g``
and the second forward after it waits for it (its copy overlaps the forward in between), and
frees the device copy as it starts."""

ACTIVATION_WINDOW = 2
"""Host buffers of ``Offload(activations="nvme")`` (its default ``activation_window``), each as
large as the largest offloaded stage's activations (:func:`window_buffer_bytes`).

NOTE: two, the fewest that overlap the SSD with the link in both directions. In the forward an
``AO g`` fills the buffer the ``AW`` two stages back emptied, so the d2h copy of one stage runs
while the previous one is written; with one buffer every ``AO`` waits for the write before it.
In the backward ``AR`` reads run one fetch ahead: the read of the next stage's activations
starts once the ``AF`` two fetches back has copied its buffer to the device, so it has about one
backward to complete before its own ``AF`` needs it (at least one backward, ``FETCH_AHEAD``, lies
between an ``AF`` and its ``B``). More buffers only help when one stage's SSD read is slower than
one backward, and then the SSD bounds the step anyway (``benchmarks/activation_offload.py``
measures 1, 2 and 3 buffers). The host then holds ``2 x`` one stage's activations however many
stages offload: the point of the tier."""

SPILL_ALIGN = 4096
"""Alignment of each value in an activation window buffer: the SSD store's block size
(:data:`shfx.runtime.ssd.MIN_ALIGNMENT`), so that with ``O_DIRECT`` a value's pages go to and from
the file without a bounce copy."""


def spill_layout(values: Sequence[Value]) -> tuple[dict[str, int], int]:
    """Where each of a stage's offloaded ``values`` lies in an activation window buffer (byte
    offsets, :data:`SPILL_ALIGN`-aligned, in order) and the bytes the buffer needs for them.

    >>> from shfx.passes.stages import Value
    >>> spill_layout([Value("a", 10), Value("b", 5000), Value("c", 4)])
    ({'a': 0, 'b': 4096, 'c': 12288}, 12292)
    """
    offsets: dict[str, int] = {}
    end = 0
    for v in values:
        at = -(-end // SPILL_ALIGN) * SPILL_ALIGN
        offsets[v.name] = at
        end = at + v.nbytes
    return offsets, end


def window_buffer_bytes(stages: Sequence[StageSpec], chosen: Iterable[int]) -> int:
    """Bytes of one activation window buffer: the largest :func:`spill_layout` of the ``chosen``
    stages' offloaded values."""
    vals = offloaded_values(stages)
    return max((spill_layout(vals[s])[1] for s in set(chosen) if s in vals), default=0)


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


def add_activation_spill(acts: Sequence[Action], window: int) -> list[Action]:
    """Given an action order with activation offload (``AO``/``AF``), send every offloaded stage's
    activations on to the SSD through ``window`` host buffers (``Offload(activations="nvme")``):
    ``AW g`` right after ``AO g`` (the buffer the ``AO`` filled goes to the SSD and is free
    again), and ``AR g`` (read them back into a buffer) ahead of ``AF g``. Reads go in the order
    of the fetches, as early as the buffers allow: the first ``window`` right after the first
    ``B`` (the backward's start: a forward alone reads nothing back), then each right after the
    ``AF`` ``window`` fetches before its own (which empties the buffer it fills). The
    lowering (:func:`shfx.passes.program.lower_actions` with ``activation_window``) gives each
    ``AO``/``AR`` the buffer freed longest ago and makes it wait for the ``AW``/``AF`` that freed it."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        from .program import ScheduleError

        raise ScheduleError(f"activations on the SSD need an activation window of at least 1 host buffer, got {window!r}")
    fetches = [a.stage for a in acts if a.kind == AF]
    then_read = {fetches[i - window]: fetches[i] for i in range(window, len(fetches))}
    first = [Action(AR, g) for g in fetches[:window]]
    out: list[Action] = []
    started = False
    for a in acts:
        out.append(a)
        if a.kind == AO:
            out.append(Action(AW, a.stage))
        elif a.kind == B and not started:
            started = True
            out += first
        elif a.kind == AF and a.stage in then_read:
            out.append(Action(AR, then_read[a.stage]))
    return out
