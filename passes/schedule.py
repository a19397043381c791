"""Schedule policies: each turns stage specs into a step program (one rewrite pass each),
plus the passes that derive the inference and the "cold" backward variants of a program.

A policy only decides the *order* of actions; :func:`shfx.passes.program.lower_actions` adds the
dependency edges and slots, and :func:`shfx.passes.verify.verify_program` checks the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .meta import get_meta
from .program import B, F, OB, OG, PF, R, U, Action, ActionKind, Program, ScheduleError, lower_actions
from .stages import StageSpec

__all__ = [
    "schedule_window",
    "window_actions",
    "eval_program",
    "cold_backward_program",
    "resident_after_forward",
    "POLICIES",
    "check_window",
]



def check_window(window: object, num_stages: int) -> int:
    """Validate a window and clamp it to the number of stages (W > stages means all resident)."""
    if isinstance(window, bool) or not isinstance(window, int):
        raise ValueError(
            f"window must be an int >= 1 (the number of stages resident on the device at once), got {window!r}"
        )
    if window < 1:
        raise ValueError(f"window must be >= 1 (stages resident on the device at once), got {window}")
    return min(window, num_stages)


def _update_order(stages: Sequence[StageSpec], backward_order: Sequence[int]) -> dict[int, list[int]]:
    """Stage index -> the groups whose last gradient contribution is that stage's OG."""
    last_contributor: dict[int, int] = {}
    for s in backward_order:
        for g in stages[s].grad_groups:
            last_contributor[g] = s  # later in backward order overwrites: the last one wins
    out: dict[int, list[int]] = {}
    for g, s in last_contributor.items():
        if any(st.update_group == g for st in stages):
            out.setdefault(s, []).append(g)
    return {s: sorted(gs) for s, gs in out.items()}


def window_actions(stages: Sequence[StageSpec], window: int) -> list[Action]:
    """The stronghold window order: at most ``window`` stages resident.

    Given N stages and W slots: prefetch the first W; in forward, after F i release stage i
    and prefetch stage i+W into its slot, except for the last W stages, which stay resident for
    the start of backward. Backward runs N-1..0; after B i its grads go to the host (OG i), the
    host update of every group whose grads are then complete starts (U), the slot is released
    and stage i-W is prefetched into it.
    """
    n = len(stages)
    w = check_window(window, n)
    acts: list[Action] = [Action(PF, i) for i in range(w)]
    for i in range(n):
        acts.append(Action(F, i))
        if stages[i].mutates_buffers:
            acts.append(Action(OB, i))
        if i < n - w:
            acts.append(Action(R, i))
            acts.append(Action(PF, i + w))
    order = list(range(n - 1, -1, -1))
    updates = _update_order(stages, order)
    for i in order:
        acts.append(Action(B, i))
        if stages[i].has_grads:
            acts.append(Action(OG, i))
        acts.extend(Action(U, g) for g in updates.get(i, []))
        acts.append(Action(R, i))
        if i - w >= 0:
            acts.append(Action(PF, i - w))
    return acts


def schedule_window(stages: Sequence[StageSpec], window: int) -> Program:
    """The "stronghold" policy: a sliding window of ``window`` resident stages.

    >>> from shfx.passes.stages import chain
    >>> " ".join(schedule_window(chain(3), 2).actions())
    'PF0 PF1 F0 R0 PF2 F1 F2 B2 OG2 U2 R2 PF0 B1 OG1 U1 R1 B0 OG0 U0 R0'
    """
    stages = _checked(stages)
    w = check_window(window, len(stages))
    return lower_actions(window_actions(stages, w), stages, w, name=f"stronghold(W={w})")


def _checked(stages: Sequence[StageSpec]) -> list[StageSpec]:
    stages = list(stages)
    if not stages:
        raise ScheduleError("a program needs at least one stage")
    for i, s in enumerate(stages):
        if s.index != i:
            raise ScheduleError(f"stage specs must be indexed 0..n-1 in order; position {i} holds stage {s.index}")
    return stages


def resident_after_forward(program: Program) -> list[int]:
    """Stages still resident when the forward phase ends, in slot order (persistent ones too)."""
    held: dict[int, int] = {st: k for k, st in enumerate(program.persistent)}
    for n in program.phase_nodes("forward"):
        m = get_meta(n)
        if m.kind == PF:
            held[m.stage] = m.slot
        elif m.kind == R:
            held.pop(m.stage, None)
    return [s for s, _ in sorted(held.items(), key=lambda kv: kv[1])]


def eval_program(program: Program) -> Program:
    """Inference variant: the forward phase, then release every stage still resident.

    Given a train program, add a RELEASE for each stage the forward leaves resident; nothing
    is kept for a backward.
    """
    acts = [get_meta(n).action for n in program.phase_nodes("forward")]
    acts += [Action(R, s) for s in resident_after_forward(program) if s not in program.persistent]
    ev = lower_actions(
        acts, program.stages, program.num_slots, name=f"{program.name}/eval", keep_graph=False, persistent=program.persistent
    )
    ev.updates_outside = program.updates_outside
    return ev


def cold_backward_program(program: Program) -> Program:
    """Backward variant for when the forward's resident stages were evicted in between
    (another forward ran before this backward): prefetch them again first.

    Given a train program, prepend PF for each stage the forward leaves resident, in the order
    of the slots they held, so each lands in the same slot (slot sizes stay those of the train
    program).
    """
    back = [get_meta(n).action for n in program.phase_nodes("backward")]
    acts = [Action(PF, s) for s in resident_after_forward(program) if s not in program.persistent] + back
    # The leading PFs belong to the backward phase: lowering starts in "forward" until the
    # first B, so mark them by lowering and then fixing the phase.
    prog = lower_actions(
        acts, program.stages, program.num_slots, name=f"{program.name}/cold-backward", keep_graph=False,
        persistent=program.persistent,
    )  # fmt: skip
    from dataclasses import replace

    from .meta import set_meta

    for n in prog.nodes:
        m = get_meta(n)
        if m.phase != "backward":
            set_meta(n, replace(m, phase="backward"))
    prog.updates_outside = program.updates_outside
    return prog


def __getattr__(name: str):
    if name == "POLICIES":  # the registry lives with the policies (shfx.passes.policies)
        from .policies import POLICIES

        return POLICIES
    raise AttributeError(name)
