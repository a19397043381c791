"""Derived programs: the inference forward and the "cold" backward of a train program, as
pure passes over it. (The policies that build train programs are :mod:`shfx.passes.policies`;
``schedule_window``, ``window_actions`` and ``check_window`` are re-exported here.)
"""

from __future__ import annotations

from dataclasses import replace

from .lowering import check_window
from .meta import get_meta, set_meta
from .policies import schedule_window, window_actions
from .program import PF, R, Action, Program, lower_actions

__all__ = [
    "eval_program",
    "cold_backward_program",
    "resident_after_forward",
    "schedule_window",
    "window_actions",
    "check_window",
]


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
    for n in prog.nodes:
        m = get_meta(n)
        if m.phase != "backward":
            set_meta(n, replace(m, phase="backward"))
    prog.updates_outside = program.updates_outside
    return prog
