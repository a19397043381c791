"""Feature passes: program-to-program functions that add one feature to a step program, each
stating what it requires of the program it is given and what it ensures of the one it returns
(as torch.fx's ``PassBase.requires`` / ``ensures``). They compose: the pipeline runs them in
order on a policy's program, checking each pass's conditions (and, when asked, the whole
verifier after each), so a combination works when each pass's requirements hold, and a
refusal names the pass that cannot run, the condition, and the fix.

>>> from shfx.passes.stages import chain
>>> from shfx.passes.policies import Stronghold
>>> p = run_passes(Stronghold(window=2).program(chain(3)), [(EXACT_CLIPPING, {}), (DATA_PARALLEL, {"ranks": 2})])
>>> " ".join(p.actions("step")), " ".join(p.actions("next-forward"))
('NR0 CK0', 'U0 AG0 U1 AG1 U2 AG2')
>>> " ".join(EXACT_CLIPPING(Stronghold(window=2, resident_first=1).program(chain(3))).actions()[-11:])
'R2 B1 OG1 GN1 R1 B0 GN0 CK0 DU0 U1 U2'
>>> from shfx.passes.policies import L2L
>>> EXACT_CLIPPING(L2L().program(chain(2)))
Traceback (most recent call last):
  ...
shfx.passes.features.PassRefused: exact-clipping cannot run on 'l2l': it requires every group updated on the device owned by a persistent stage (its gradient waits for the gate in that stage's gradient buffer), but groups [0, 1] are updated on the device by streamed stages, whose gradients leave the device with their slot (OP, R) before the total norm is known. Fix: use policy='resident' or Stronghold(resident_first=...) (persistent device stages), or a policy updating on the host
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .actions import AF, AG, AO, CK, DU, GN, NR, OG, OP, PF, RS, SN, SR, SW, U, US, Action
from .activations import add_activation_offload, add_activation_spill, eligible_stages
from .lowering import add_collectives, add_deferred_updates, add_leading_refresh, add_ssd_transfers, last_contributors
from .meta import get_meta
from .program import Program, ScheduleError, lower_actions

__all__ = [
    "Condition", "FeaturePass", "PassRefused", "run_passes", "feature_passes", "EXACT_CLIPPING", "DATA_PARALLEL",
    "UPDATES_IN_STEP", "ROLLBACK", "DELAYED_UPDATE", "clip_program", "updates_in_step", "data_parallel_program",
    "rollback_program", "delayed_update", "LOSS_SCALING", "loss_scaling_program", "ACTIVATION_OFFLOAD",
    "activation_offload_program",
]  # fmt: skip


class PassRefused(ScheduleError):
    """A feature pass whose requirement does not hold for the program it was given."""


@dataclass(frozen=True)
class Condition:
    """One requirement or guarantee of a pass: ``check(program)`` returns None when it holds,
    else what is wrong (in words); ``fix`` says what to change when a requirement fails."""

    what: str
    check: Callable[[Program], str | None]
    fix: str = ""


@dataclass(frozen=True)
class FeaturePass:
    """A program-to-program pass with its pre- and postconditions.

    Calling it checks ``requires`` on the input (a failure raises :class:`PassRefused` naming
    the pass, the condition and its fix), runs ``transform(program, **options)``, then checks
    ``ensures`` on the output (a failure is the pass's bug: :class:`ScheduleError`)."""

    name: str
    requires: tuple[Condition, ...]
    ensures: tuple[Condition, ...]
    transform: Callable[..., Program]
    doc: str = ""

    def __call__(self, program: Program, **options: Any) -> Program:
        for c in self.requires:
            why = c.check(program)
            if why is not None:
                fix = f" Fix: {c.fix}" if c.fix else ""
                raise PassRefused(f"{self.name} cannot run on {program.name!r}: it requires {c.what}, but {why}.{fix}")
        out = self.transform(program, **options)
        for c in self.ensures:
            why = c.check(out)
            if why is not None:
                raise ScheduleError(f"pass {self.name} broke its guarantee on {out.name!r}: {c.what}, but {why}")
        return out


def run_passes(
    program: Program, passes: Iterable[tuple[FeaturePass, dict]], verify: Callable[[Program], None] | None = None
) -> Program:
    """Run ``(pass, options)`` in order; with ``verify`` (the verifier,
    :func:`shfx.passes.verify.verify_program`) every program in between is checked, so a broken
    invariant names the pass that broke it."""
    for p, options in passes:
        program = p(program, **options)
        if verify is not None:
            try:
                verify(program)
            except ScheduleError as e:
                raise ScheduleError(f"after pass {p.name}: {e}") from e
    return program


# ---- conditions ---------------------------------------------------------------------------------


def _host_updates_only(p: Program) -> str | None:
    dev = sorted(p.device_groups())
    return None if not dev else f"groups {dev} are updated on the device (DU)"


def _updates_in_program(p: Program) -> str | None:
    if p.updates_delayed or p.updates_outside:
        return "its updates run during the next step, one step stale (ZeRO-Offload's delayed update)"
    return None


def _not_clipped(p: Program) -> str | None:
    return "it clips already (it has gradient norms GN)" if any(get_meta(n).kind == GN for n in p.nodes) else None


def _one_rank(p: Program) -> str | None:
    return None if p.ranks == 1 else f"it is data parallel already ({p.ranks} ranks)"


def _deferred_behind_gate(p: Program) -> str | None:
    tail = [n for n in p.nodes if get_meta(n).phase == "next-forward"]
    if not tail or any(get_meta(n).phase != "next-forward" for n in p.nodes[p.nodes.index(tail[0]):]):
        return "the deferred updates do not end the program"
    gate = p.find("CK0")
    for n in tail:
        if get_meta(n).kind in (U, DU) and gate not in p.deps(n):
            return f"{get_meta(n).action} does not wait for the gate CK0"
    return None


def _collectives(p: Program) -> str | None:
    if p.ranks < 2:
        return f"it runs on {p.ranks} rank"
    groups = {st.update_group for st in p.stages if st.update_group is not None}
    reduced = sorted(get_meta(n).stage for n in p.nodes if get_meta(n).kind == RS)
    if reduced != sorted(groups):
        return f"the trainable groups are {sorted(groups)}, the reductions RS {reduced}"
    nodes = p.nodes
    for i, n in enumerate(nodes):
        m = get_meta(n)
        if m.kind == U and not (i + 1 < len(nodes) and get_meta(nodes[i + 1]).action == Action(AG, m.stage)):
            return f"{m.action} is not followed by AG{m.stage}"
    return None


def _gated(p: Program) -> str | None:
    groups = {st.update_group for st in p.stages if st.update_group is not None}
    norms = sorted(get_meta(n).stage for n in p.nodes if get_meta(n).kind == GN)
    if norms != sorted(groups):
        return f"the trainable groups are {sorted(groups)}, the gradient norms {norms}"
    if p.actions("step")[-1:] != ["CK0"]:
        return f"the step phase is {p.actions('step')}, not ending with the gate CK0"
    return None


_HOST_ONLY = Condition(
    "every parameter group updated on the host", _host_updates_only,
    "use Stronghold(resident_first=0), ZeroOffload or ZeroInfinity",
)  # fmt: skip


def _device_gradients_stay(p: Program) -> str | None:
    owner = {st.update_group: st.index for st in p.stages if st.update_group is not None}
    streamed = sorted(g for g in p.device_groups() if owner.get(g) not in p.persistent)
    if streamed:
        return (
            f"groups {streamed} are updated on the device by streamed stages, whose gradients leave the device with "
            "their slot (OP, R) before the total norm is known"
        )
    return None


# NOTE: a true limit, not a missing pass: keeping the gradients of streamed device-updated
# stages (L2L) until the gate would hold every stage's gradient on the device (the window is
# one stage), and updating them after it would fetch every stage a second time
_DEVICE_GRADIENTS_STAY = Condition(
    "every group updated on the device owned by a persistent stage (its gradient waits for the gate in that stage's "
    "gradient buffer)", _device_gradients_stay,
    "use policy='resident' or Stronghold(resident_first=...) (persistent device stages), or a policy updating on the host",
)  # fmt: skip


# ---- exact gradient clipping --------------------------------------------------------------------


def _with_norms(program: Program, skip: tuple = ()) -> list[Action]:
    """The program's actions without the kinds in ``skip`` (and the refreshing prefetches), with
    ``GN g`` where group ``g``'s gradient is complete: after the ``OG`` of its last contributor
    for a host group, after the ``B`` of its last contributor for a group updated on the device
    (normed there, in its persistent owner's gradient buffer, where the ``DU`` reads it)."""
    stages = list(program.stages)
    dev = program.device_groups()
    order = [get_meta(n).stage for n in program.nodes if get_meta(n).kind.value == "B"]
    last = last_contributors(stages, order)
    acts: list[Action] = []
    for n in program.nodes:
        m = get_meta(n)
        if m.kind in skip or (m.kind == PF and m.refresh):
            continue
        acts.append(m.action)
        if m.kind == OG:
            acts += [Action(GN, g) for g in last.get(m.stage, []) if g not in dev]
        elif m.kind.value == "B":
            acts += [Action(GN, g) for g in last.get(m.stage, []) if g in dev]
    return acts


def clip_program(program: Program, name: str | None = None) -> Program:
    """Exact global-norm gradient clipping with the update overlapped: the program's updates
    (``U g`` during or after the backward, with their SSD reads and write-backs and the refresh
    of persistent stages after them; ``DU g`` on the device) become ``GN g`` right after the
    ``OG`` of group ``g``'s last gradient contributor (its norms, as soon as its gradient is on
    the host), or, for a group updated on the device, right after that contributor's ``B`` (its
    norms on the device, over the gradient waiting in its persistent owner's slot); then the
    step's gate ``CK0`` (phase ``"step"``) and every ``U g`` / ``DU g`` in forward order (phase
    ``"next-forward"``: ``step()`` starts them, the next forward's prefetches wait for them),
    the persistent stages reading host groups refreshed at the start of the program, and the
    SSD transfers placed again around the deferred updates.

    >>> from shfx.passes.stages import chain
    >>> from shfx.passes.policies import Resident
    >>> " ".join(clip_program(Resident().program(chain(3))).actions())
    'F0 F1 F2 B2 GN2 B1 GN1 B0 GN0 CK0 DU0 DU1 DU2'
    """
    stages = list(program.stages)
    dev = frozenset(program.device_groups())
    acts = _with_norms(program, skip=(U, DU, SR, SW))
    acts = add_deferred_updates(acts, stages, dev)
    acts = add_leading_refresh(acts, stages, program.persistent, dev)
    if program.ssd_groups:
        acts = add_ssd_transfers(acts, program.ssd_groups, program.host_window)
    return lower_actions(
        acts, stages, program.num_slots, name=name or f"{program.name}, deferred update", persistent=program.persistent,
        **program.tier,
    )  # fmt: skip


EXACT_CLIPPING = FeaturePass(
    "exact-clipping",
    requires=(
        _DEVICE_GRADIENTS_STAY,
        Condition("updates that finish within the step", _updates_in_program, "use ZeroOffload() (not delayed_update=True)"),
        Condition("a program that does not clip yet", _not_clipped, "apply exact-clipping once"),
        Condition("one rank (clip before the data-parallel pass: it adds the norms' reduction)", _one_rank,
                  "run exact-clipping before data-parallel"),
    ),
    ensures=(
        Condition("one GN per trainable group and the gate CK0 ending the step phase", _gated),
        Condition("the deferred updates wait for the gate and end the program", _deferred_behind_gate),
    ),
    transform=clip_program,
    doc="GN per group during the backward (on the device for a device group), the gate CK0 in step(), clipped U's and "
    "DU's in the next forward",
)  # fmt: skip


# ---- updates in step() ---------------------------------------------------------------------------


def updates_in_step(program: Program, clip: bool = False) -> Program:
    """The updates run in ``step()`` (``overlap_update=False``: PyTorch code may read and edit
    ``p.grad`` between ``backward()`` and ``step()``): every update (``U``, ``DU``, with their SSD
    reads and write-backs) and the refresh of the persistent stages after them leave the
    backward; the step phase is the gate ``CK0`` (the clip coefficient when ``clip`` or when
    ``cm.clip_grad_norm_()`` was called; with ``clip``, ``GN g`` after each group's last gradient
    during the backward, on the device for a group updated there), then the updates in their
    order, then the refreshes, each waiting for what it reads."""
    stages = list(program.stages)
    updates = [get_meta(n).action for n in program.nodes if get_meta(n).kind in (U, DU)]
    refresh = [get_meta(n).action for n in program.nodes if get_meta(n).kind == PF and get_meta(n).refresh]
    if clip:
        acts = _with_norms(program, skip=(U, DU, SR, SW))
    else:
        acts = [get_meta(n).action for n in program.nodes
                if get_meta(n).kind not in (U, DU, SR, SW) and not (get_meta(n).kind == PF and get_meta(n).refresh)]  # fmt: skip
    acts += [Action(CK, 0)] + updates + refresh
    if program.ssd_groups:
        acts = add_ssd_transfers(acts, program.ssd_groups, program.host_window, at_updates=True)
    return lower_actions(
        acts, stages, program.num_slots, name=program.name, persistent=program.persistent,
        **(program.tier | {"updates_in_step": True}),
    )  # fmt: skip


def _no_copyback(p: Program) -> str | None:
    ops = [str(get_meta(n).action) for n in p.nodes if get_meta(n).kind == OP]
    return f"it copies device-updated stages back during the backward ({', '.join(ops)})" if ops else None


def _in_step(p: Program) -> str | None:
    if not p.updates_in_step:
        return "the program is not marked updates_in_step"
    for n in p.nodes:
        m = get_meta(n)
        if m.kind in (U, DU, SR, SW, AG, CK, NR) and m.phase != "step":
            return f"{m.action} runs in phase {m.phase!r}"
    return None


UPDATES_IN_STEP = FeaturePass(
    "updates-in-step",
    requires=(
        Condition("updates that finish within the step", _updates_in_program, "use ZeroOffload() (not delayed_update=True)"),
        Condition("a program that does not clip yet", _not_clipped, "apply one clipping pass"),
        Condition("one rank (run it before data-parallel)", _one_rank, "run updates-in-step before data-parallel"),
        Condition(
            "no device-updated stage copied back during the backward", _no_copyback,
            "use grad_accum_steps=1 and overlap_update=True, or resident_first stages that stay resident",
        ),
    ),
    ensures=(Condition("every update, SSD transfer and the gate in phase 'step'", _in_step),),
    transform=updates_in_step,
    doc="the gate CK0, then every update and refresh, in step() (overlap_update=False)",
)  # fmt: skip


# ---- data parallel ------------------------------------------------------------------------------


def data_parallel_program(program: Program, ranks: int) -> Program:
    """The train program ``program`` run by ``ranks`` data-parallel processes: its actions with
    :func:`~shfx.passes.lowering.add_collectives` (``RS g`` as soon as group ``g``'s local
    gradient is complete, ``AG g`` after each ``U g``; a group updated on the device is
    replicated: ``RS g`` all-reduces its device gradient before its ``GN g`` and ``DU g``),
    lowered again with ``ranks`` (the waits of :func:`~shfx.passes.program.lower_actions`). Any
    policy's program, a user's too (the delayed update's: ``RS g`` in the backward, ``U g`` and
    ``AG g`` in phase ``"delayed"``); with ``ranks == 1`` the program is returned as it is.

    >>> from shfx.passes.policies import Resident, ZeroOffload
    >>> from shfx.passes.stages import chain
    >>> " ".join(data_parallel_program(Resident().program(chain(2)), 2).actions())
    'F0 F1 B1 RS1 DU1 B0 RS0 DU0'
    >>> p = data_parallel_program(ZeroOffload(delayed_update=True).program(chain(2)), 2)
    >>> " ".join(p.actions("backward")), " ".join(p.actions("delayed"))
    ('B1 OG1 RS1 B0 OG0 RS0', 'U0 AG0 U1 AG1')

    >>> from shfx.passes.stages import chain
    >>> from shfx.passes.policies import Stronghold
    >>> p = data_parallel_program(Stronghold(window=2).program(chain(2)), 2)
    >>> " ".join(p.actions())
    'PF0 PF1 F0 F1 B1 OG1 RS1 U1 AG1 R1 B0 OG0 RS0 U0 AG0 R0'
    >>> [d.name for d in p.deps(p.find("U1"))]
    ['og1', 'rs1']
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1 (data-parallel processes), got {ranks!r}")
    if ranks == 1:
        return program
    if program.ranks != 1:
        raise ValueError(f"program {program.name!r} is already data parallel ({program.ranks} ranks)")
    acts = add_collectives([get_meta(n).action for n in program.nodes], program.stages)
    tier = program.tier | {"ranks": ranks}
    prog = lower_actions(acts, program.stages, program.num_slots, name=program.name, persistent=program.persistent, **tier)
    prog.updates_outside = program.updates_outside
    return prog


DATA_PARALLEL = FeaturePass(
    "data-parallel",
    requires=(Condition("one rank", _one_rank, "apply data-parallel once"),),
    ensures=(Condition("every group's gradient reduced once, every host update gathered right after it", _collectives),),
    transform=data_parallel_program,
    doc="RS g after a host group's last OG (a device group's last B: its gradient all-reduced), AG g after each U g, "
    "NR0 before the gate",
)


# ---- the delayed update ----------------------------------------------------------------------------


def delayed_update(program: Program) -> Program:
    """ZeRO-Offload's delayed parameter update (``ZeroOffload(delayed_update=True)``, one step
    stale, not eager-equivalent by design): the program's host updates (with their SSD
    transfers) move to phase ``"delayed"`` at its end: ``step()`` starts them and returns, they
    run during the next step's forward and backward (which train on the weights before them),
    and each gradient copy of the next step waits for the update reading the same host buffer.
    Before them, in phase ``"step"``, the persistent stages are refreshed with the weights the
    previous step's updates wrote (``step()`` waits for those first).

    >>> from shfx.passes.stages import chain
    >>> from shfx.passes.policies import ZeroOffload
    >>> p = delayed_update(ZeroOffload().program(chain(2)))
    >>> " ".join(p.actions("backward")), " ".join(p.actions("step")), " ".join(p.actions("delayed"))
    ('B1 OG1 B0 OG0', 'PF0 PF1', 'U0 U1')
    """
    acts: list[Action] = []
    updates: list[Action] = []
    for n in program.nodes:
        m = get_meta(n)
        if m.kind in (SR, SW, SN) or (m.kind == PF and m.refresh):
            continue
        (updates if m.kind in (U, US) else acts).append(m.action)
    persistent = [s for s in program.persistent if program.stages[s].update_group is not None or program.stages[s].grad_groups]
    acts += [Action(PF, s) for s in persistent] + updates
    if program.ssd_groups:
        acts = add_ssd_transfers(acts, program.ssd_groups, program.host_window)
    return lower_actions(
        acts, program.stages, program.num_slots, name=program.name, persistent=program.persistent,
        **(program.tier | {"updates_delayed": True}),
    )  # fmt: skip


def _delayed(p: Program) -> str | None:
    if not p.updates_delayed:
        return "the program is not marked updates_delayed"
    for n in p.nodes:
        m = get_meta(n)
        if m.kind in (U, SR, SW, SN, DU, OP) and m.phase != "delayed":
            return f"{m.action} runs in phase {m.phase!r}"
    return None


DELAYED_UPDATE = FeaturePass(
    "delayed-update",
    requires=(
        _HOST_ONLY,
        Condition("updates that finish within the step", _updates_in_program, "apply delayed-update once"),
        Condition("a program that does not clip", _not_clipped, "drop max_grad_norm, or use ZeroOffload() (exact clipping)"),
        Condition("one rank (run it before data-parallel)", _one_rank, "run delayed-update before data-parallel"),
        Condition("updates after the backward", lambda p: None if not p.updates_in_step else "they run in step()",
                  "apply delayed-update instead of updates-in-step"),
    ),
    ensures=(Condition("every update and SSD transfer in phase 'delayed'", _delayed),),
    transform=delayed_update,
    doc="the refresh of the persistent stages in step(), then the host updates running during the next step",
)  # fmt: skip


# ---- rollback ------------------------------------------------------------------------------------


def rollback_program(program: Program) -> Program:
    """Every step all-or-nothing (``shfx.compile(rollback=True)``): before each host update
    ``U g`` the step journal copies group ``g``'s master weights, step counter and optimizer
    states (``SN g``, on the update's pool, in the update's phase, waiting for what the update
    waits for; the update waits for it), so a step that fails, is interrupted or is skipped can
    be put back exactly. The copies are actions: the simulator times them, the ledger counts
    their buffers (``rollback copies``). A device update (``DU g``) copies its slot region inside
    its own action (on the device's stream, not a host action). A group whose optimizer states
    are on the SSD (the NVMe tier) is copied without them (master and step only): the SSD keeps
    the states' previous version until the step commits (:mod:`shfx.runtime.ssd_window`).

    >>> from shfx.passes.stages import chain
    >>> from shfx.passes.policies import Stronghold
    >>> " ".join(rollback_program(Stronghold(window=2).program(chain(2))).actions())
    'PF0 PF1 F0 F1 B1 OG1 SN1 U1 R1 B0 OG0 SN0 U0 R0'

    Under data parallel, a program whose host updates run during the backward (the overlap,
    not clipped: no gate before them) ends with ``NR0``, the step's verdict: it waits for every
    update, copy, unscale and all-gather of the step (whether they failed or not: each rank's
    all-gathers run even when its own update failed, so the collectives still match) and agrees
    every rank's outcome (a non-finite gradient, an fp16 overflow, a failed update) with one MAX
    all-reduce, so every rank commits the step or every rank undoes it, its own shards from the
    copies and the whole groups' images with one all-gather each (:mod:`shfx.runtime.journal`).
    A program with a gate (clipping, or the updates in ``step()``) has agreed the finite check
    before any update already.

    >>> p = rollback_program(data_parallel_program(Stronghold(window=2).program(chain(2)), 2))
    >>> " ".join(p.actions()[-6:])
    'RS0 SN0 U0 AG0 R0 NR0'
    >>> sorted(d.name for d in p.deps(p.find("NR0")))
    ['ag0', 'ag1', 'sn0', 'sn1', 'u0', 'u1']
    """
    acts: list[Action] = []
    for n in program.nodes:
        m = get_meta(n)
        if m.kind == U:
            acts.append(Action(SN, m.stage))
        acts.append(m.action)
    if _needs_verdict(program):
        acts.append(Action(NR, 0))
    return _relowered(program, acts)


def _needs_verdict(p: Program) -> bool:
    """Data parallel with host updates during the backward (nothing agreed before them)."""
    return p.ranks > 1 and any(get_meta(n).kind == U and get_meta(n).phase == "backward" for n in p.nodes)


def _relowered(program: Program, acts: list[Action]) -> Program:
    """``acts`` lowered for ``program``'s stages, slots, name, persistent stages and tier."""
    prog = lower_actions(acts, program.stages, program.num_slots, name=program.name, persistent=program.persistent, **program.tier)
    prog.updates_outside = program.updates_outside
    return prog


def _no_snapshots(p: Program) -> str | None:
    return "it copies its groups already (SN)" if any(get_meta(n).kind == SN for n in p.nodes) else None


def _snapshotted(p: Program) -> str | None:
    nodes = p.nodes
    for n in nodes:
        m = get_meta(n)
        if m.kind == U:
            snap = [d for d in p.deps(n) if get_meta(d).action == Action(SN, m.stage)]
            if not snap:
                return f"{m.action} does not wait for SN{m.stage}"
            if get_meta(snap[0]).phase != m.phase:
                return f"SN{m.stage} runs in phase {get_meta(snap[0]).phase!r}, {m.action} in {m.phase!r}"
    return None


def _agreed(p: Program) -> str | None:
    if p.ranks < 2 or not any(get_meta(n).phase == "backward" and get_meta(n).kind == U for n in p.nodes):
        return None
    last = get_meta(p.nodes[-1])
    if last.kind != NR or last.phase != "backward":
        return f"it ends with {last.action}, not with the step's verdict NR0"
    waits = set(p.deps(p.nodes[-1]))
    missing = [str(get_meta(n).action) for n in p.nodes if get_meta(n).kind in (U, AG, SN) and n not in waits]
    return f"NR0 does not wait for {', '.join(missing)}" if missing else None


ROLLBACK = FeaturePass(
    "rollback",
    requires=(
        Condition("a program that does not copy its groups yet", _no_snapshots, "apply rollback once"),
    ),
    ensures=(
        Condition("every host update waiting for its group's copy SN, in the same phase", _snapshotted),
        Condition("data parallel with updates during the backward: the step's verdict NR0 last, waiting for every "
                  "update, copy and all-gather", _agreed),
    ),
    transform=rollback_program,
    doc="SN g (the journal's copy) before each host update U g; under data parallel with updates during the backward, "
    "NR0 (every rank's outcome, agreed) ending the step",
)  # fmt: skip


# ---- loss scaling (fp16) ---------------------------------------------------------------------------


def loss_scaling_program(program: Program) -> Program:
    """fp16's loss scaling: before the first action that reads group ``g``'s gradient in the
    step (its norm ``GN g``, the journal's copy ``SN g``, its update ``U g`` or device update
    ``DU g``), ``US g`` checks the scaled gradient is finite and divides it by the loss scale (as
    ``GradScaler.unscale_``), in that action's phase, waiting for what it waits for; the
    gradient's readers wait for it. (The check is the step's gate's where the gate has a norm:
    clipping, and the in-``step()`` finite check's with ``overlap_update=False``.) A group
    updated on the device is checked on the compute stream, in its owner's slot (a device flag
    that ``step()`` reads with every other group's verdict: one skip decision for the step);
    its 16-bit gradient cannot hold the unscaled values, so the division by the scale is made
    where its fp32 gradient is (its ``GN`` and ``DU``).

    >>> from shfx.passes.stages import chain
    >>> from shfx.passes.policies import Stronghold
    >>> " ".join(loss_scaling_program(Stronghold(window=2).program(chain(2))).actions())
    'PF0 PF1 F0 F1 B1 OG1 US1 U1 R1 B0 OG0 US0 U0 R0'
    >>> " ".join(loss_scaling_program(Stronghold(window=2, resident_first=1).program(chain(3))).actions()[-4:])
    'R1 B0 US0 DU0'
    """
    acts: list[Action] = []
    done: set[int] = set()
    for n in program.nodes:
        m = get_meta(n)
        if m.kind in (GN, SN, U, DU) and m.stage not in done:
            acts.append(Action(US, m.stage))
            done.add(m.stage)
        acts.append(m.action)
    return _relowered(program, acts)


def _not_unscaled(p: Program) -> str | None:
    return "it unscales its gradients already (US)" if any(get_meta(n).kind == US for n in p.nodes) else None


def _unscaled_first(p: Program) -> str | None:
    seen: set[int] = set()
    for n in p.nodes:
        m = get_meta(n)
        if m.kind == US:
            seen.add(m.stage)
        elif m.kind in (GN, SN, U, DU):
            if m.stage not in seen:
                return f"{m.action} reads group {m.stage}'s gradient before US{m.stage}"
            if not any(get_meta(d).action == Action(US, m.stage) for d in p.deps(n)):
                return f"{m.action} does not wait for US{m.stage}"
    return None


LOSS_SCALING = FeaturePass(
    "loss-scaling",
    requires=(
        Condition("a program that does not unscale yet", _not_unscaled, "apply loss-scaling once"),
        Condition("a program without the journal's copies yet (run it before rollback)",
                  lambda p: "it has them (SN)" if any(get_meta(n).kind == SN for n in p.nodes) else None,
                  "run loss-scaling before rollback"),
    ),
    ensures=(Condition("every reader of a gradient after its group's US, waiting for it", _unscaled_first),),
    transform=loss_scaling_program,
    doc="US g (finite check, divide by the loss scale) before the first reader of group g's gradient (on the device "
    "for a group updated there)",
)  # fmt: skip


# ---- activation offload ------------------------------------------------------------------------------


def activation_offload_program(program: Program, stages: tuple[int, ...] | None = None, window: int = 0) -> Program:
    """``Offload(activations="host")``: the boundary activations of ``stages`` (default: every
    stage that may, :func:`~shfx.passes.activations.eligible_stages`) leave the device after
    their forward and come back before their backward: ``AO g`` on the d2h queue right after
    ``F g`` (its copy overlaps the next forward; the forward after that waits for it and frees
    the device copy as it starts), ``AF g`` on the h2d queue after the backward two places before ``B g``
    (waiting for it: its copy overlaps the backward in between), ``B g`` waiting for ``AF g``
    (:func:`~shfx.passes.activations.add_activation_offload`). Such a stage is recomputed from its
    inputs alone in its backward (it keeps no graph). With ``window`` (``Offload(activations="nvme")``)
    the activations go on to the SSD through ``window`` host buffers: ``AW g`` after ``AO g``,
    ``AR g`` ahead of ``AF g`` (:func:`~shfx.passes.activations.add_activation_spill`).

    >>> from shfx.passes.stages import chain
    >>> from shfx.passes.policies import Resident
    >>> " ".join(activation_offload_program(Resident().program(chain(5, activation_bytes=64))).actions())
    'F0 F1 AO1 F2 AO2 F3 F4 B4 DU4 AF2 B3 DU3 AF1 B2 DU2 B1 DU1 B0 DU0'
    >>> " ".join(activation_offload_program(Resident().program(chain(5, activation_bytes=64)), window=2).actions())
    'F0 F1 AO1 AW1 F2 AO2 AW2 F3 F4 B4 AR2 AR1 DU4 AF2 B3 DU3 AF1 B2 DU2 B1 DU1 B0 DU0'
    """
    acts = [get_meta(n).action for n in program.nodes]
    chosen = eligible_stages(acts, program.stages) if stages is None else stages
    acts = add_activation_offload(acts, program.stages, chosen)
    if not window:
        return _relowered(program, acts)
    prog = lower_actions(
        add_activation_spill(acts, window), program.stages, program.num_slots, name=program.name,
        persistent=program.persistent, **(program.tier | {"activation_window": window}),
    )  # fmt: skip
    prog.updates_outside = program.updates_outside
    return prog


def _not_offloading(p: Program) -> str | None:
    return "it offloads activations already (AO)" if any(get_meta(n).kind == AO for n in p.nodes) else None


def _fetched_before_backward(p: Program) -> str | None:
    offloaded: set[int] = set()
    fetched: dict[int, object] = {}
    for n in p.nodes:
        m = get_meta(n)
        if m.kind == AO:
            offloaded.add(m.stage)
        elif m.kind == AF:
            if m.stage not in offloaded:
                return f"{m.action} fetches activations no AO{m.stage} offloaded"
            fetched[m.stage] = n
        elif m.kind.value == "B" and m.stage in offloaded:
            if fetched.get(m.stage) not in p.deps(n):
                return f"{m.action} does not wait for AF{m.stage}"
            offloaded.discard(m.stage)
    return f"stages {sorted(offloaded)} are offloaded and never fetched back" if offloaded else None


ACTIVATION_OFFLOAD = FeaturePass(
    "activation-offload",
    requires=(Condition("a program that does not offload activations yet", _not_offloading, "apply activation-offload once"),),
    ensures=(Condition("every offloaded stage's backward waiting for its fetch AF", _fetched_before_backward),),
    transform=activation_offload_program,
    doc="AO g right after F g (d2h, waited for by the second forward after it), AF g two backwards ahead of B g (h2d): the stage's boundary "
    "activations wait on the host (window > 0: on the SSD, AW g after AO g and AR g ahead of AF g through that many host buffers)",
)


def feature_passes(
    *, clip: bool = False, ranks: int = 1, updates_in_step: bool = False, rollback: bool = False, loss_scaling: bool = False,
    activations: str | tuple[int, ...] | None = None, activation_window: int = 0,
) -> list[tuple[FeaturePass, dict]]:  # fmt: skip
    """The feature passes a configuration asks for, in the order they compose: ``clip`` (exact
    clipping), ``updates_in_step`` (``overlap_update=False``: the updates in ``step()``, clipped
    there with ``clip``), ``ranks`` (data parallel), ``loss_scaling`` (fp16: the unscale and
    finite check), ``rollback`` (the journal's copies), ``activations`` (activation offload:
    ``"host"`` every eligible stage, a tuple the stages chosen; None or ``"device"``: none;
    ``"nvme"`` every eligible stage, on the SSD through ``activation_window`` host buffers)."""
    out: list[tuple[FeaturePass, dict]] = []
    if updates_in_step:
        out.append((UPDATES_IN_STEP, {"clip": clip}))
    elif clip:
        out.append((EXACT_CLIPPING, {}))
    if ranks > 1:
        out.append((DATA_PARALLEL, {"ranks": ranks}))
    if loss_scaling:
        out.append((LOSS_SCALING, {}))
    if rollback:
        out.append((ROLLBACK, {}))
    if activations not in (None, "device") and activations != ():
        # ("auto" builds every eligible stage's offload: the compiled model narrows it from the
        # costs, shfx.cost_model.offload_choice)
        every = activations in ("host", "auto", "nvme")
        opts: dict = {"stages": None if every else tuple(activations)}
        if activation_window:
            opts["window"] = activation_window
        elif activations == "nvme":
            from .activations import ACTIVATION_WINDOW

            opts["window"] = ACTIVATION_WINDOW
        out.append((ACTIVATION_OFFLOAD, opts))
    return out

