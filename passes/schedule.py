"""Derived programs: the inference forward, the "cold" backward and the steady state (updates
deferred to the next forward) of a train program, as pure passes over it. (The policies that build train programs are :mod:`shfx.passes.policies`;
``schedule_window``, ``window_actions`` and ``check_window`` are re-exported here.)
"""

from __future__ import annotations

from dataclasses import replace

from .features import data_parallel_program
from .lowering import add_param_transfers, check_window, image_window_needed
import torch.fx as fx

from .meta import get_meta, set_meta
from .policies import schedule_window, window_actions
from .program import AG, DU, OG, PF, RS, R, U, Action, F, Program, lower_actions

__all__ = [
    "eval_program",
    "cold_backward_program",
    "resident_after_forward",
    "deferred_updates",
    "groups_read",
    "steady_state_program",
    "data_parallel_program",
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
    # (an inference forward keeps nothing for a backward: no activation offload)
    acts = [get_meta(n).action for n in program.phase_nodes("forward") if get_meta(n).kind.value not in ("AO", "AW")]
    acts += [Action(R, s) for s in resident_after_forward(program) if s not in program.persistent]
    ev = lower_actions(
        acts, program.stages, program.num_slots, name=f"{program.name}/eval", keep_graph=False, persistent=program.persistent,
        **program.tier,
    )
    ev.updates_outside = program.updates_outside
    return ev


def cold_backward_program(program: Program) -> Program:
    """Backward variant for when the forward's resident stages were evicted in between
    (another forward ran before this backward): prefetch them again first.

    Given a train program, prepend PF for each stage the forward leaves resident, in the order
    of the slots they held, so each lands in the same slot (slot sizes stay those of the train
    program); the step phase and the updates deferred to the next forward stay at the end.
    """
    back = [get_meta(n).action for n in program.nodes if get_meta(n).phase in ("backward", "step", "next-forward", "delayed")]
    acts = [Action(PF, s) for s in resident_after_forward(program) if s not in program.persistent] + back
    if program.ssd_images:  # (the parameter tier: the reads for the leading prefetches too, placed again)
        acts = [a for a in acts if a.kind.value not in ("PR", "PD", "PW")]
        need = image_window_needed(acts, program.stages, program.ssd_images)
        tier = program.tier | {"image_window": max(program.image_window, need)}
        acts = add_param_transfers(acts, program.stages, program.ssd_images, tier["image_window"])
    else:
        tier = program.tier
    # The leading PFs belong to the backward phase: lowering starts in "forward" until the
    # first B, so mark them by lowering and then fixing the phase.
    prog = lower_actions(
        acts, program.stages, program.num_slots, name=f"{program.name}/cold-backward", keep_graph=False,
        persistent=program.persistent, **tier,
    )  # fmt: skip
    for n in prog.nodes:
        m = get_meta(n)
        if m.phase == "forward":
            set_meta(n, replace(m, phase="backward"))
    prog.updates_outside = program.updates_outside
    return prog


def deferred_updates(program: Program) -> list[fx.Node]:
    """The updates that run in the next step (phase ``"next-forward"``: exact gradient clipping;
    ``"delayed"``: ZeRO-Offload's delayed update), in issue order; empty for other programs."""
    return [n for n in program.nodes if get_meta(n).phase in ("next-forward", "delayed")]


def groups_read(program: Program, stage: int) -> set[int]:
    """The trainable groups whose weights a PREFETCH of ``stage`` copies (owned and borrowed)."""
    if not 0 <= stage < len(program.stages):  # (a broken program: the verifier's residency rule names it)
        return set()
    st = program.stages[stage]
    return set(st.grad_groups) | ({st.update_group} if st.update_group is not None else set())


def steady_state_program(program: Program) -> Program:
    """One step of a program whose updates run in the next forward, as it runs between two
    others: the previous step's updates first (``step()`` started them as it returned; they
    wait for nothing of this step), every PREFETCH of a stage waiting for the previous updates
    of the groups it reads, and this step's own updates left out (they belong to the next
    step). The previous updates are in phase ``"forward"`` (the runtime's backward starts after
    them); with the NVMe tier their SSD reads and writes come along, keeping the waits among
    them. With the delayed update (phase ``"delayed"``) the forward does not wait for them (it
    trains on the weights before them): each gradient copy waits for the previous update of the
    groups it writes, and the refresh in phase ``"step"`` for every group its stage reads. A
    program without deferred updates is returned as it is.

    The simulator times this program (:func:`shfx.cost_model.simulate.simulate`) and the
    verifier checks the step boundary on it (:func:`shfx.passes.verify.verify_program`).

    >>> from shfx.passes.stages import chain
    >>> from shfx.passes.policies import Stronghold
    >>> p = steady_state_program(Stronghold(window=2, deferred_update=True).program(chain(3)))
    >>> " ".join(p.actions())
    'U0 U1 U2 PF0 PF1 F0 R0 PF2 F1 F2 B2 OG2 GN2 R2 PF0 B1 OG1 GN1 R1 B0 OG0 GN0 R0 CK0'
    >>> [d.name for d in p.deps(p.find("PF2"))]
    ['r0', 'u2_prev']
    """
    tail = deferred_updates(program)
    if not tail:
        return program
    graph = fx.Graph()
    prev: dict[int, fx.Node] = {}
    prev_update: dict[int, fx.Node] = {}  # group -> the previous step's U (not its AG)
    in_tail: dict[fx.Node, fx.Node] = {}
    for n in tail:
        m = get_meta(n)
        deps = tuple(in_tail[d] for d in program.deps(n) if d in in_tail)  # (SR -> U -> SW; not the GNs)
        node = graph.create_node("call_function", n.target, (m.stage, *deps), {}, name=f"{n.name}_prev")
        set_meta(node, replace(m, phase="forward"))
        in_tail[n] = node
        if m.kind in (U, AG, DU):  # (with data parallel the all-gather after the update is what a PF waits for)
            prev[m.stage] = node
        if m.kind == U:
            prev_update[m.stage] = node
    env: dict[fx.Node, fx.Node] = {}
    dev = program.device_groups()
    for n in program.nodes:
        m = get_meta(n)
        if m.phase in ("next-forward", "delayed"):
            continue
        # (an edge to a later or unknown action, or into the deferred tail, has no counterpart
        # here; the verifier's order and step-boundary rules report such programs)
        deps = [env[d] for d in program.deps(n) if d in env]
        if m.kind == PF:
            deps += [prev[g] for g in sorted(groups_read(program, m.stage)) if g in prev]
        elif m.kind == F and m.stage in program.persistent:  # a slot a deferred DU updated in place
            deps += [prev[g] for g in sorted(groups_read(program, m.stage) & dev) if g in prev]
        elif m.kind == OG and program.updates_delayed:  # the delayed update reads the buffer the copy writes
            deps += [prev[g] for g in sorted(program.stages[m.stage].grad_groups) if g in prev]
        elif m.kind == RS and program.updates_delayed:  # (data parallel: the reduction writes the shard the update reads)
            deps += [prev_update[m.stage]] if m.stage in prev_update else []
        node = graph.create_node("call_function", n.target, (m.stage, *deps), {}, name=n.name)
        set_meta(node, m)
        env[n] = node
    graph.output(None)
    return Program(graph, program.stages, program.num_slots, f"{program.name}/steady", program.persistent, **program.tier)
