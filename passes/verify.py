"""The verify pass: invariants every step program must satisfy before it runs.

``verify_program(program)`` raises :class:`VerificationError` listing each broken invariant
with the offending action. It checks the program as a graph (it does not trust the policy or
the lowering that built it), one rule per invariant (:data:`RULES`, in this order):

1. **order**: every dependency is issued before its dependent (a CUDA stream cannot wait
   for an event that is not recorded yet) and the dependency graph is acyclic.
2. **residency**: every compute/copy action on a stage runs while the stage holds a slot,
   waits (transitively) for the PREFETCH that filled the slot, and slots stay in
   ``0..num_slots-1``.
3. **slot reuse**: a slot holds one stage at a time, so at most ``num_slots`` stages are
   resident at any point; a RELEASE waits for every reader of its slot, and a PREFETCH into a
   slot waits for the RELEASE that freed it.
4. **data flow**: F waits for its producers' F; B waits for the B of its consumers that run
   one (:func:`~shfx.passes.stages.backward_stages`).
5. **grads before update**: a CPU_STEP waits for the OFFLOAD_GRAD of every stage that sends
   gradients to its group.
6. **completeness**: train programs run F of every stage once and B once of every stage whose
   backward has work (a frozen bottom may run none), OG once per stage sending
   gradients to a host-updated group, exactly one update (U on the host or DU on the device) per
   trainable group, and end with every slot released except the persistent stages'.
7. **step boundary** (programs whose updates run in the next forward, exact gradient
   clipping): the updates in phase ``"next-forward"`` end the program, are CPU_STEPs or
   DEVICE_STEPs, and each waits for every GRAD_NORM; every trainable group has one GRAD_NORM
   (on the device, after its last BACKWARD, for a group updated there), no update runs in the
   backward; and in the steady state (:func:`shfx.passes.schedule.steady_state_program`) every
   PREFETCH of a stage waits for the previous step's update of each group it reads, and every
   action on a stage reading a host group runs on weights prefetched in this step (a persistent
   stage is refreshed first), so no prefetch reads weights whose update has not finished.

8. **ssd tier**: see :func:`ssd_tier`.
9. **data parallel** (:func:`data_parallel`): with ``program.ranks > 1`` every host-updated
   group's gradient is reduced exactly once per backward (one ``RS g``, after and waiting for
   the OFFLOAD_GRAD of every stage sending it gradients), every ``U g``/``GN g`` waits for
   ``RS g``, every ``U g`` is followed by exactly one ``AG g`` that waits for it, and every
   later PREFETCH of a stage reading ``g`` waits for that ``AG g`` (across the step boundary
   too, in the steady state); a group updated on the device has one ``RS g`` (an all-reduce of
   its device gradient) after its contributors' BACKWARDs, which its ``GN g`` and ``DU g``
   wait for, and no ``AG g``; no ``RS``/``AG`` with one rank.

10. **activation offload** (:func:`activation_offload`): an ``AO s`` follows ``F s`` and waits
    for it, before the first BACKWARD, once per stage, on a stage with offloadable activations;
    an ``AF s`` comes after the ``AO s`` and waits for it; the ``B s`` of an offloaded stage waits
    for the ``AF s`` issued since (no ``B`` of an offloaded stage without its fetch), and its
    forward keeps no graph (the backward recomputes from the fetched inputs).
11. **parameter tier**: see :func:`param_tier`.
12. **activations on the SSD** (:func:`activation_spill`): with ``program.activation_window`` the
    offloaded activations pass through that many host buffers: an ``AO``/``AR`` fills a buffer
    in range that no stage holds, waiting for the ``AW``/``AF`` that emptied it; an ``AW`` writes
    the buffer its ``AO`` filled and waits for it; an ``AR`` waits for the ``AW`` of its stage (in
    this program) and an ``AF`` for the ``AR`` (or ``AO``) that filled its buffer; the program ends
    with every buffer empty.

Persistent stages (``program.persistent``) start resident in slots ``0..k-1``; a PREFETCH of
one refreshes its slot and must wait for every reader since; a DEVICE_STEP reads the slot of the
stage owning its group and waits for the BACKWARD of every stage sending it gradients; an
OFFLOAD_PARAMS waits for the DEVICE_STEP of its stage's group.

A rule is a function of a :class:`ProgramView` (the program's issue order, reachability and
residency, computed once) yielding ``(action or None, message)``:

>>> [rule.__name__ for rule in RULES]
['order', 'residency', 'slot_reuse', 'data_flow', 'grads_before_update', 'completeness', 'step_boundary', 'ssd_tier', 'data_parallel', 'activation_offload', 'param_tier', 'activation_spill']
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch.fx as fx

from .meta import get_meta
from .actions import KINDS
from .program import AG, B, CK, DU, F, GN, NR, OB, OG, OP, PF, RS, R, SN, SR, SW, U, US, ActionKind, Program, ScheduleError
from .actions import AF, AO, AR, AW
from .actions import PD, PR, PW
from .stages import backward_stages, consumers_of

__all__ = ["verify_program", "VerificationError", "ProgramView", "RULES"]

# kinds whose slot is their own stage's (a DEVICE_STEP names the slot of its group's owner)
_SLOTTED = {k for k, i in KINDS.items() if i.slotted and not i.update}
_READERS = {k for k, i in KINDS.items() if i.reads_slot and not i.update}

Violation = tuple[fx.Node | None, str]


class VerificationError(ScheduleError):
    """A step program broke one or more invariants; ``.violations`` lists them."""

    def __init__(self, program: Program, violations: list[Violation]):
        self.violations = [msg for _, msg in violations]
        first = next((n for n, _ in violations if n is not None), None)
        listed = "\n".join(f"  - {m}" for m in self.violations[:12])
        more = f"\n  ... and {len(self.violations) - 12} more" if len(self.violations) > 12 else ""
        super().__init__(
            f"step program {program.name!r} breaks {len(self.violations)} invariant(s):\n{listed}{more}\n\n"
            + program.format(mark=first)
        )


@dataclass(frozen=True)
class Hold:
    """A stage's hold on a slot, as the residency walk found it just before an action."""

    slot: int
    fill: fx.Node | None  # the PREFETCH that filled it; None: persistent, loaded before the step
    readers: tuple[fx.Node, ...]  # the actions that read it since


@dataclass(frozen=True)
class Fill:
    """What a PREFETCH of a stage that is not resident finds in the slot it fills."""

    holder: int | None  # the stage still holding the slot
    freed_by: fx.Node | None  # the last RELEASE of the slot
    resident: int  # stages resident once it has filled it


class ProgramView:
    """What the rules read about one program, computed once.

    Attributes:
        program, expect: what :func:`verify_program` was given.
        nodes, index: the actions in issue order, and each one's position.
        stages: stage index -> :class:`StageSpec`.
        owner_of: parameter group -> the stage owning it.
        device_groups: the groups updated on the device (``program.device_groups()``).
        anc, done: the two reachability relations (see :meth:`waits`, :meth:`waits_done`).
        hold: per slotted action (and DEVICE_STEP of an owned group) that the residency walk
            reached, the hold of its stage (the group owner's) just before it; None: not resident.
        fills: per PREFETCH of a stage that is not resident, what it finds in its slot.
        unplaced: the actions the residency walk could not place (an unknown stage, a slot out
            of range, a PREFETCH of a non-persistent stage already resident, a reader of a stage
            not resident); the residency rule reports them and the later rules skip them.
        resident_at_end: stage -> slot for every stage resident after the last action.
    """

    def __init__(self, program: Program, expect: str = "auto"):
        self.program = program
        self.expect = expect
        self.nodes = program.nodes
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.stages = {s.index: s for s in program.stages}
        self.owner_of = {st.update_group: st.index for st in program.stages if st.update_group is not None}
        self.device_groups = program.device_groups()
        # NOTE: two relations. ``anc``: n waits (transitively) for d to start and finish using
        # device memory. ``done``: n waits for d's every effect. They differ at RELEASE: a
        # RELEASE waits only until an OFFLOAD_GRAD has *read* the slot (its copy), not until the
        # gradients are accumulated on the host, so a path through a RELEASE does not make an
        # update wait for that OFFLOAD_GRAD.
        # Both are bitsets over issue positions; the edges the order rule rejects are left out.
        self.anc: dict[fx.Node, int] = {}
        self.done: dict[fx.Node, int] = {}
        for n in self.nodes:
            a = dn = 0
            is_release = get_meta(n).kind == R
            for d in program.deps(n):
                if self.index.get(d, len(self.nodes)) >= self.index[n]:
                    continue
                a |= self.anc[d] | (1 << self.index[d])
                dn |= self.done[d] | (0 if (is_release and KINDS[get_meta(d).kind].accumulates) else 1 << self.index[d])
            self.anc[n] = a
            self.done[n] = dn
        self.hold: dict[fx.Node, Hold | None] = {}
        self.fills: dict[fx.Node, Fill] = {}
        self.unplaced: set[fx.Node] = set()
        self._placed: dict[tuple[ActionKind, int], list[int]] = {}
        self.resident_at_end = {s: h.slot for s, h in self._walk().items()}

    def _walk(self) -> dict[int, Hold]:
        """Walk the actions in issue order tracking which stage holds which slot; persistent
        stages start resident (loaded before the step: no PREFETCH to wait for)."""
        program = self.program
        held = {st: Hold(k, None, ()) for k, st in enumerate(program.persistent)}  # stage -> hold
        holder = {k: st for k, st in enumerate(program.persistent)}  # slot -> stage
        freed_by: dict[int, fx.Node] = {}  # slot -> the last RELEASE of it
        for i, n in enumerate(self.nodes):
            m = get_meta(n)
            k, s = m.kind, m.stage
            if k in _SLOTTED and (s not in self.stages or not self.slot_in_range(m.slot)):
                self.unplaced.add(n)
                continue
            if k == DU and s in self.owner_of:
                own = self.owner_of[s]
                h = self.hold[n] = held.get(own)
                if h is not None:
                    held[own] = Hold(h.slot, h.fill, (*h.readers, n))
            elif k == PF:
                h = self.hold[n] = held.get(s)
                if h is None:
                    self.fills[n] = Fill(holder.get(m.slot), freed_by.get(m.slot), len(held) + 1)
                    held[s] = Hold(m.slot, n, ())
                    holder[m.slot] = s
                elif s in program.persistent:  # a refresh of its slot
                    held[s] = Hold(h.slot, n, ())
                else:
                    self.unplaced.add(n)
                    continue
            elif k in _READERS or k == R:
                h = self.hold[n] = held.get(s)
                if h is None:
                    self.unplaced.add(n)
                    continue
                if k == R:
                    del held[s]
                    holder.pop(h.slot, None)
                    freed_by[h.slot] = n
                else:
                    held[s] = Hold(h.slot, h.fill, (*h.readers, n))
            self._placed.setdefault((k, s), []).append(i)
        return held

    def act(self, n: fx.Node) -> str:
        """How messages name an action: ``F3 (#12)``."""
        return f"{get_meta(n).action} (#{self.index[n]})"

    def slot_in_range(self, slot: int | None) -> bool:
        return slot is not None and 0 <= slot < self.program.num_slots

    def waits(self, n: fx.Node, d: fx.Node) -> bool:
        """``n`` waits (transitively) for ``d`` to be done with device memory."""
        return bool(self.anc[n] >> self.index[d] & 1)

    def waits_done(self, n: fx.Node, d: fx.Node) -> bool:
        """``n`` waits (transitively) for every effect of ``d``."""
        return bool(self.done[n] >> self.index[d] & 1)

    def last(self, kind: ActionKind, stage: int, before: fx.Node) -> fx.Node | None:
        """The latest placed action ``kind`` of ``stage`` (of a group, for an update) issued
        before ``before``, or None."""
        at = self._placed.get((kind, stage), [])
        j = bisect_left(at, self.index[before])
        return self.nodes[at[j - 1]] if j else None


Rule = Callable[[ProgramView], Iterable[Violation]]


def order(v: ProgramView) -> Iterator[Violation]:
    """1. Every dependency is an action of the program issued before its dependent (so the
    dependency graph is acyclic)."""
    for n in v.nodes:
        for d in v.program.deps(n):
            if d not in v.index:
                yield n, f"{v.act(n)} waits for {d.name!r}, which is not an action of this program"
            elif v.index[d] >= v.index[n]:
                yield n, f"{v.act(n)} waits for {v.act(d)}, which is issued later (deadlock or cycle)"


def residency(v: ProgramView) -> Iterator[Violation]:
    """2. An action using its stage's slot names a stage of the program and a slot in
    ``0..num_slots-1``; it runs while the stage is resident, in the slot the stage holds, and
    waits for the PREFETCH that filled it. A PREFETCH loads a stage that is not resident, or
    refreshes a persistent stage in its slot; a persistent stage is never released. A
    DEVICE_STEP runs while the stage owning its group is resident, in that stage's slot."""
    persistent = v.program.persistent
    for n in v.nodes:
        m = get_meta(n)
        k, s = m.kind, m.stage
        if k in _SLOTTED and s not in v.stages:
            yield n, f"{v.act(n)} names stage {s}, but the program has stages 0..{len(v.stages) - 1}"
        elif k in _SLOTTED and not v.slot_in_range(m.slot):
            yield n, f"{v.act(n)} uses slot {m.slot}, outside 0..{v.program.num_slots - 1}"
        elif k == PF and (h := v.hold[n]) is not None:
            if s not in persistent:
                yield n, f"{v.act(n)} prefetches stage {s}, which is already resident in slot {h.slot}"
            elif m.slot != h.slot:
                yield n, f"{v.act(n)} refreshes stage {s} into slot {m.slot}, but it is in slot {h.slot}"
        elif k in _READERS or k == R:
            h = v.hold[n]
            if h is None:
                yield n, f"{v.act(n)} runs while stage {s} is not resident"
                continue
            if m.slot != h.slot:
                yield n, f"{v.act(n)} uses slot {m.slot}, but stage {s} is in slot {h.slot}"
            if h.fill is not None and not v.waits(n, h.fill):
                yield n, f"{v.act(n)} does not wait for {v.act(h.fill)}, which fills stage {s}'s slot"
            if k == R and s in persistent:
                yield n, f"{v.act(n)} releases stage {s}, which is persistent (resident across steps)"
        elif k == DU and s in v.owner_of:
            own, h = v.owner_of[s], v.hold[n]
            if h is None:
                yield n, f"{v.act(n)} updates group {s} on the device while its stage {own} is not resident"
            elif m.slot != h.slot:
                yield n, f"{v.act(n)} uses slot {m.slot}, but stage {own} is in slot {h.slot}"


def slot_reuse(v: ProgramView) -> Iterator[Violation]:
    """3. A PREFETCH fills a slot no stage holds (so at most ``num_slots`` stages are resident)
    and waits for the RELEASE that freed it; a RELEASE, and a PREFETCH refreshing a persistent
    stage's slot, wait for every reader of the slot since it was filled."""
    for n in v.nodes:
        if n in v.unplaced:
            continue
        m = get_meta(n)
        k, s = m.kind, m.stage
        if k == PF and n in v.fills:
            f = v.fills[n]
            if f.holder is not None:
                yield n, f"{v.act(n)} fills slot {m.slot} while stage {f.holder} still holds it"
            if f.freed_by is not None and not v.waits(n, f.freed_by):
                yield n, f"{v.act(n)} reuses slot {m.slot} without waiting for {v.act(f.freed_by)}, which freed it"
            if f.resident > v.program.num_slots:
                yield n, f"{v.act(n)} makes {f.resident} stages resident; the window allows {v.program.num_slots}"
        elif k == PF:
            for r in v.hold[n].readers:
                if not v.waits(n, r):
                    yield n, f"{v.act(n)} overwrites stage {s}'s slot before its reader {v.act(r)} is done"
        elif k == R:
            h = v.hold[n]
            for r in h.readers:
                if not v.waits(n, r):
                    yield n, f"{v.act(n)} frees slot {h.slot} before its reader {v.act(r)} is done"


def data_flow(v: ProgramView) -> Iterator[Violation]:
    """4. F waits for its producers' F and B for its consumers' B; an OFFLOAD_GRAD waits for its
    stage's B, an OFFLOAD_BUFFERS for its F, an OFFLOAD_PARAMS for the DEVICE_STEP of its group."""
    consumers = consumers_of(list(v.program.stages))
    backward = backward_stages(list(v.program.stages))

    def waits_for(n: fx.Node, kind: ActionKind, stage: int | None) -> bool:
        d = v.last(kind, stage, n)
        return d is not None and v.waits(n, d)

    for n in v.nodes:
        if n in v.unplaced:
            continue
        m = get_meta(n)
        k, s = m.kind, m.stage
        if k == F:
            for p in v.stages[s].producers:
                if not waits_for(n, F, p):
                    yield n, f"{v.act(n)} reads stage {p}'s output but does not wait for F{p}"
        elif k == B:
            for c in consumers[s]:
                if c in backward and not waits_for(n, B, c):
                    yield n, f"{v.act(n)} needs the output gradient from stage {c} but does not wait for B{c}"
        elif k == OG and not waits_for(n, B, s):
            yield n, f"{v.act(n)} copies stage {s}'s gradients but does not wait for B{s}"
        elif k == OB and not waits_for(n, F, s):
            yield n, f"{v.act(n)} copies stage {s}'s mutated buffers but does not wait for F{s}"
        elif k == OP:
            g = v.stages[s].update_group
            if not waits_for(n, DU, g):
                yield n, f"{v.act(n)} copies stage {s}'s parameters back before DU{g} updated them"


def grads_before_update(v: ProgramView) -> Iterator[Violation]:
    """5. An update names a group some stage owns; a group updated on the device has no
    CPU_STEP; a CPU_STEP waits for the OFFLOAD_GRAD (all of its effects: the accumulation on the
    host too) and a DEVICE_STEP for the BACKWARD of every stage sending gradients to its group.
    With rollback (SNAPSHOTs), every CPU_STEP waits for the SNAPSHOT of its group, taken once;
    with fp16's UNSCALEs, every reader of a host gradient (GN, SN, U) waits for its group's."""
    unscales = {get_meta(n).stage: n for n in v.nodes if get_meta(n).kind == US}
    if unscales:
        for n in v.nodes:
            m = get_meta(n)
            if m.kind in (GN, SN, U) and (m.stage not in unscales or not v.waits_done(n, unscales[m.stage])):
                yield n, f"{v.act(n)} reads group {m.stage}'s gradient before US{m.stage} unscaled it"
    snaps = [n for n in v.nodes if get_meta(n).kind == SN]
    if snaps:
        taken: dict[int, fx.Node] = {}
        for n in snaps:
            g = get_meta(n).stage
            if g in taken:
                yield n, f"{v.act(n)} copies group {g} a second time in one step"
            taken[g] = n
        for n in v.nodes:
            m = get_meta(n)
            if m.kind == U and (m.stage not in taken or not v.waits_done(n, taken[m.stage])):
                yield n, f"{v.act(n)} updates group {m.stage} before the step journal copied it (SN{m.stage}): a failed step could not be undone"
        updated = {get_meta(n).stage for n in v.nodes if get_meta(n).kind == U}
        for g, n in taken.items():
            if g not in updated:
                yield n, f"{v.act(n)} copies group {g}, which no CPU_STEP of the program updates"
    for n in v.nodes:
        m = get_meta(n)
        k, g = m.kind, m.stage
        if k not in (DU, U, GN):
            continue
        if g not in v.owner_of:
            yield n, f"{v.act(n)} updates group {g}, which no stage owns"
        on_device = k == DU or (k == GN and m.device)
        if k == U and g in v.device_groups:
            yield n, f"{v.act(n)} reads group {g}'s gradients on the host, but DU{g} updates it on the device"
        if k == GN and (g in v.device_groups) != m.device:
            where = "on the device" if m.device else "on the host"
            yield n, f"{v.act(n)} norms group {g}'s gradients {where}, but the group is updated {'on the host' if m.device else 'on the device (DU)'}"
        for st in v.program.stages:
            if g not in st.grad_groups:
                continue
            if on_device:
                b = v.last(B, st.index, n)
                if b is None or not v.waits(n, b):
                    yield n, f"{v.act(n)} reads group {g}'s gradients before B{st.index} produced stage {st.index}'s"
            else:
                og = v.last(OG, st.index, n)
                if og is None or not v.waits_done(n, og):
                    yield n, f"{v.act(n)} reads group {g}'s gradients before OG{st.index} has put stage {st.index}'s on the host"


def completeness(v: ProgramView) -> Iterator[Violation]:
    """6. F (train, eval) and B (train, backward) of every stage exactly once; in train and
    backward programs OG once per stage sending gradients to a host-updated group and one update
    per trainable group (U, or DU for a device group; the host updates may be left to the runtime,
    ``program.updates_outside``); at the end only the persistent stages are resident."""
    expect = v.expect
    kinds = {get_meta(n).kind for n in v.nodes}
    if expect == "auto":
        expect = "train" if (F in kinds and B in kinds) else ("backward" if B in kinds else "eval")
    counts: dict[tuple[ActionKind, int], int] = {}
    for n in v.nodes:
        m = get_meta(n)
        counts[(m.kind, m.stage)] = counts.get((m.kind, m.stage), 0) + 1
    stages, dev_groups = v.stages, v.device_groups
    need: list[tuple[ActionKind, int]] = []
    if expect in ("train", "eval"):
        need += [(F, s) for s in stages]
    if expect in ("train", "backward"):
        back = backward_stages(list(stages.values()))
        need += [(B, s) for s in stages if s in back]
        # a stage's gradients go to the host when any group it sends them to is updated there
        need += [(OG, s) for s, st in stages.items() if st.has_grads and (st.grad_groups - dev_groups)]
        need += [
            (DU if st.update_group in dev_groups else U, st.update_group)
            for st in stages.values()
            if st.update_group is not None and not (v.program.updates_outside and st.update_group not in dev_groups)
        ]
    for key in need:
        c = counts.get(key, 0)
        if c != 1:
            yield None, f"{key[0].value}{key[1]} appears {c} times; a {expect} program needs it exactly once"
    if expect in ("train", "backward"):
        for s in stages:  # a stage with no backward work may still run one (a hand-written order)
            if s not in back and counts.get((B, s), 0) > 1:
                yield None, f"B{s} appears {counts[(B, s)]} times; a {expect} program runs it at most once"
    left = {s: slot for s, slot in v.resident_at_end.items() if s not in v.program.persistent}
    if expect in ("train", "eval", "backward") and left:
        held = ", ".join(f"stage {s} (slot {slot})" for s, slot in sorted(left.items()))
        yield None, f"the program ends with {held} still resident; release every slot but the persistent stages'"


def step_boundary(v: ProgramView) -> Iterator[Violation]:
    """7. Updates deferred to the next forward (exact gradient clipping): they end the program,
    are CPU_STEPs or DEVICE_STEPs waiting for every GRAD_NORM (the clip coefficient needs every
    norm); each trainable group has one GRAD_NORM and no update runs before the step ends; across the step boundary
    (the steady state), a PREFETCH of a stage waits for the previous update of every group it
    reads, and each action on a stage that reads a host group uses weights prefetched in this
    step (a persistent stage is refreshed first)."""
    from .schedule import groups_read, steady_state_program  # (schedule imports this module's siblings)

    tail = [n for n in v.nodes if get_meta(n).phase == "next-forward"]
    norms = [n for n in v.nodes if get_meta(n).kind == GN]
    gates = [n for n in v.nodes if get_meta(n).kind in (CK, NR)]
    for n in gates:  # the step's gate (and data parallel's norm reduction): after every norm
        for d in norms:
            if not v.waits_done(n, d):
                yield n, f"{v.act(n)} does not wait for {v.act(d)}: the total norm needs every gradient's norm"
    if v.program.ranks > 1 and any(get_meta(n).kind == CK for n in gates) and not any(get_meta(n).kind == NR for n in gates):
        yield None, "the step's gate CK0 of a data-parallel program needs NR0 first (every rank's norms and finite checks combined)"
    if not tail:
        stepped = [n for n in v.nodes if get_meta(n).kind in (U, DU) and get_meta(n).phase == "step"]
        if norms and stepped:  # clipping with the updates in step(): each waits for every norm
            for n in stepped:
                for d in norms:
                    if not v.waits_done(n, d):
                        yield n, f"{v.act(n)} does not wait for {v.act(d)}: the clip coefficient needs every gradient's norm"
            return
        for n in norms:
            yield n, f"{v.act(n)} computes a gradient norm, but no update after it runs in the next forward or in step()"
        return
    first = v.index[tail[0]]
    for n in v.nodes[first:]:
        m = get_meta(n)
        if m.phase != "next-forward":
            yield n, f"{v.act(n)} comes after the deferred updates, which must end the program"
        elif m.kind in (SR, SW, AG, SN, US):
            continue  # the unscales and the journal's copies before the deferred updates, the NVMe tier's reads and write-backs of the deferred updates (rule 8), data parallel's all-gathers
        elif m.kind not in (U, DU):
            yield n, (
                f"{v.act(n)} is deferred to the next forward, but only updates (CPU_STEPs, DEVICE_STEPs, the CPU_STEPs' "
                "SSD reads and writes and all-gathers) may be"
            )
        else:
            for d in norms:
                if not v.waits_done(n, d):
                    yield n, f"{v.act(n)} does not wait for {v.act(d)}: the clip coefficient needs every gradient's norm"
    for n in v.nodes[:first]:
        if get_meta(n).kind in (U, DU):
            yield n, f"{v.act(n)} updates during the step, before the norm of every gradient is known"
    groups = sorted({st.update_group for st in v.stages.values() if st.update_group is not None})
    counts = {g: sum(1 for n in norms if get_meta(n).stage == g) for g in groups}
    for g, c in counts.items():
        if c != 1:
            yield None, f"GN{g} appears {c} times; a program deferring its updates needs it exactly once per trainable group"
    steady = steady_state_program(v.program)
    # (with data parallel a PF waits for the all-gather after the update: the later one wins)
    prev = {get_meta(n).stage: n for n in steady.nodes if n.name.endswith("_prev") and get_meta(n).kind in (U, AG)}
    sv = ProgramView(steady, "auto")
    fetched: set[int] = set()
    # (a backward-only program, the cold backward, follows this step's forward: that refreshed)
    with_forward = any(get_meta(n).kind == F for n in v.nodes)
    for n in steady.nodes:
        m = get_meta(n)
        if n.name.endswith("_prev") or m.kind not in _SLOTTED | {PF}:
            continue
        reads = groups_read(steady, m.stage) - v.device_groups if m.stage in v.stages else set()
        if m.kind == PF:
            for g in sorted(reads):
                if g in prev and not sv.waits_done(n, prev[g]):
                    yield v.program.find(str(m.action)), (
                        f"{m.action} copies group {g}'s weights but does not wait for the previous step's U{g} "
                        "(it would read weights whose update has not finished)"
                    )
            fetched.add(m.stage)
        elif reads and m.kind != R and m.stage not in fetched and with_forward:
            yield None, (
                f"{m.action} uses stage {m.stage}'s weights before any PREFETCH of it in this step: they predate the "
                f"previous step's update of group(s) {sorted(reads)} (refresh the slot first)"
            )
            fetched.add(m.stage)  # reported once per stage


def ssd_tier(v: ProgramView) -> Iterator[Violation]:
    """8. The NVMe tier: an SSD_READ or SSD_WRITE names a group some stage owns, updated on the
    host and placed on the SSD (``program.ssd_groups``); reads fill a buffer in
    ``0..host_window-1`` that no group holds, waiting for the SSD_WRITE that freed it, so at most
    ``host_window`` groups' states are on the host; a CPU_STEP of an SSD group waits for the read
    that brought its state (all of it: the read's end); an SSD_WRITE writes back from the buffer
    its read filled and waits for the group's update since that read; a train program reads and
    writes each SSD group exactly once (when it runs the host updates) and ends with every
    state back on the SSD."""
    p = v.program
    ssd, hw = p.ssd_groups, p.host_window
    held: dict[int, tuple[int | None, fx.Node]] = {}  # group -> (buffer, its SR)
    holder: dict[int, int] = {}  # buffer -> group
    freed_by: dict[int, fx.Node] = {}  # buffer -> the SW that freed it
    updated: dict[int, fx.Node] = {}  # group -> its U since its SR
    counts: dict[tuple[ActionKind, int], int] = {}
    for n in v.nodes:
        m = get_meta(n)
        k, g = m.kind, m.stage
        if k in (SR, SW):
            counts[(k, g)] = counts.get((k, g), 0) + 1
            if g not in v.owner_of:
                yield n, f"{v.act(n)} moves group {g}'s optimizer state, but no stage owns group {g}"
                continue
            if g in v.device_groups:
                yield n, f"{v.act(n)} moves group {g}'s optimizer state, but DU{g} updates it on the device (its state is there)"
                continue
            if g not in ssd:
                where = f"only groups {sorted(ssd)} are" if ssd else "no group is"
                yield n, f"{v.act(n)} moves group {g}'s optimizer state, which is not placed on the SSD ({where})"
                continue
        if k == SR:
            b = m.buffer
            if b is None or not 0 <= b < hw:
                yield n, f"{v.act(n)} reads into host-window buffer {b}, outside 0..{hw - 1}"
                continue
            if g in held:
                yield n, f"{v.act(n)} reads group {g}'s state again while it is on the host (buffer {held[g][0]})"
                continue
            if b in holder:
                yield n, f"{v.act(n)} fills host-window buffer {b} while group {holder[b]}'s state still holds it"
            elif b in freed_by and not v.waits_done(n, freed_by[b]):
                yield n, f"{v.act(n)} reuses host-window buffer {b} before {v.act(freed_by[b])} has written its state back"
            held[g] = (b, n)
            holder[b] = g
            updated.pop(g, None)
            if len(held) > hw:
                yield n, f"{v.act(n)} puts {len(held)} groups' states on the host; the host window allows {hw}"
        elif k == U and g in ssd:
            if g not in held:
                yield n, f"{v.act(n)} updates group {g}, whose optimizer state is on the SSD: no SR{g} brought it to the host"
                continue
            if not v.waits_done(n, held[g][1]):
                yield n, f"{v.act(n)} does not wait for {v.act(held[g][1])}: it would update a state still being read"
            updated[g] = n
        elif k == SW:
            if g not in held:
                yield n, f"{v.act(n)} writes back group {g}'s state, which is not on the host (no SR{g} before it)"
                continue
            b, _ = held.pop(g)
            holder.pop(b, None)
            if m.buffer != b:
                yield n, f"{v.act(n)} writes back from buffer {m.buffer}, but SR{g} read group {g}'s state into buffer {b}"
            u = updated.pop(g, None)
            if u is None:
                yield n, f"{v.act(n)} writes back group {g}'s state before U{g} has updated it"
            elif not v.waits_done(n, u):
                yield n, f"{v.act(n)} does not wait for {v.act(u)}: it would write back a state being updated"
            if b is not None:
                freed_by[b] = n
    for g, (b, _) in sorted(held.items()):
        yield None, f"the program ends with group {g}'s state still on the host (buffer {b}); write it back (SW{g})"
    runs_updates = any(get_meta(n).kind == U for n in v.nodes)
    if runs_updates and not p.updates_outside:
        for g in sorted(ssd - v.device_groups):
            for k in (SR, SW):
                c = counts.get((k, g), 0)
                if c != 1:
                    yield None, f"{k.value}{g} appears {c} times; a program updating group {g} on the SSD tier needs it exactly once"


def data_parallel(v: ProgramView) -> Iterator[Violation]:
    """9. Data parallel (``program.ranks > 1``): each host-updated group's gradient is reduced
    across the ranks exactly once per backward: one ``RS g`` in a program that runs the
    OFFLOAD_GRADs of ``g``'s contributors (none in one that runs none), issued after and
    waiting for the OFFLOAD_GRAD of every stage sending gradients to ``g``; every ``U g`` and
    ``GN g`` waits for ``RS g`` (the rank's shard of the reduced gradient); every ``U g`` is
    followed by exactly one ``AG g`` (before the next ``U g``) that waits for it; and every
    PREFETCH of a stage reading ``g`` issued after an ``AG g`` waits for it, in the program and
    across the step boundary (the steady state, :func:`~shfx.passes.schedule.steady_state_program`,
    whose previous step's all-gathers a PREFETCH waits for). A group updated on the device is
    replicated: one ``RS g`` (the all-reduce of its device gradient) per backward that runs its
    contributors' BACKWARDs, after and waiting for each of them, no BACKWARD sending it
    gradients after it, ``GN g`` and ``DU g`` waiting for it, and no ``AG g``. With one rank, no
    ``RS``/``AG``."""
    from .schedule import groups_read, steady_state_program

    p = v.program
    if p.ranks <= 1:
        for n in v.nodes:
            if get_meta(n).kind in (RS, AG):
                yield n, f"{v.act(n)} is a data-parallel collective, but the program runs on one rank (ranks=1)"
        return
    host = {g for g in v.owner_of if g not in v.device_groups}
    dev = {g for g in v.owner_of if g in v.device_groups}
    contributors = {g: [s for s, st in v.stages.items() if g in st.grad_groups] for g in host | dev}
    backs: dict[int, list[fx.Node]] = {}  # stage -> its Bs so far
    reduced: dict[int, fx.Node] = {}  # group -> its RS
    updated: dict[int, tuple[fx.Node, int]] = {}  # group -> (its last U, AGs after it)
    gathered: dict[int, fx.Node] = {}  # group -> its last AG
    ogs: dict[int, list[fx.Node]] = {}  # stage -> its OGs so far
    counts: dict[int, int] = {}
    for n in v.nodes:
        m = get_meta(n)
        k, g = m.kind, m.stage
        if k == B:
            backs.setdefault(g, []).append(n)
            for h in v.stages[g].grad_groups if g in v.stages else ():
                if h in dev and h in reduced:
                    yield n, f"{v.act(n)} sends gradients to group {h} after {v.act(reduced[h])} all-reduced it: they are left out"
        elif k in (DU, GN) and g in dev:
            if n.name.endswith("_prev"):  # the steady state's previous-step update: reduced in that step
                pass
            elif g not in reduced:
                yield n, f"{v.act(n)} reads group {g}'s device gradient, but no RS{g} before it all-reduced it across the {p.ranks} ranks"
            elif not v.waits_done(n, reduced[g]):
                yield n, f"{v.act(n)} does not wait for {v.act(reduced[g])}: it would read a gradient not yet all-reduced"
        elif k == OG:
            ogs.setdefault(g, []).append(n)
            for h in v.stages[g].grad_groups if g in v.stages else ():
                if h in host and h in reduced:
                    yield n, f"{v.act(n)} sends gradients to group {h} after {v.act(reduced[h])} reduced it: they are left out"
        elif k == RS:
            counts[g] = counts.get(g, 0) + 1
            if g in dev:  # (replicated: the device gradient all-reduced after every contributor's B)
                for j in contributors[g]:
                    if not backs.get(j):
                        yield n, f"{v.act(n)} all-reduces group {g}'s gradient before B{j} (stage {j} sends gradients to it) has run"
                    elif not v.waits_done(n, backs[j][-1]):
                        yield n, f"{v.act(n)} does not wait for {v.act(backs[j][-1])}: it would reduce a gradient still being computed"
                reduced[g] = n
                continue
            if g not in host:
                yield n, f"{v.act(n)} reduces group {g}'s gradient, but no stage owns it"
                continue
            for j in contributors[g]:
                if not ogs.get(j):
                    yield n, f"{v.act(n)} reduces group {g}'s gradient before OG{j} (stage {j} sends gradients to it) has run"
                elif not v.waits_done(n, ogs[j][-1]):
                    yield n, f"{v.act(n)} does not wait for {v.act(ogs[j][-1])}: it would reduce a gradient still being copied"
            reduced[g] = n
        elif k in (U, GN) and g in host:
            if n.name.endswith("_prev"):  # the steady state's previous-step update: reduced in that step
                pass
            elif g not in reduced:
                yield n, f"{v.act(n)} reads group {g}'s gradient, but no RS{g} before it reduced it across the {p.ranks} ranks"
            elif not v.waits_done(n, reduced[g]):
                yield n, f"{v.act(n)} does not wait for {v.act(reduced[g])}: it would read a gradient not yet reduced"
            if k == U:
                if g in updated and updated[g][1] == 0:
                    yield updated[g][0], f"{v.act(updated[g][0])} is not followed by an AG{g}: the other ranks never see its shard"
                updated[g] = (n, 0)
        elif k == AG:
            if g in dev:
                yield n, f"{v.act(n)} gathers group {g}, but DU{g} updates it whole on every rank (nothing to gather)"
                continue
            if g not in updated:
                yield n, f"{v.act(n)} gathers group {g}'s shards, but no U{g} before it updated them"
                continue
            u, c = updated[g]
            updated[g] = (u, c + 1)
            if c:
                yield n, f"{v.act(n)} gathers group {g} again after {v.act(u)}; each update needs exactly one AG{g}"
            elif not v.waits_done(n, u):
                yield n, f"{v.act(n)} does not wait for {v.act(u)}: it would gather a shard still being updated"
            gathered[g] = n
        elif k == PF:
            for h in sorted(groups_read(p, g) & set(gathered)):
                if not v.waits_done(n, gathered[h]):
                    yield n, f"{v.act(n)} copies group {h}'s weights but does not wait for {v.act(gathered[h])} (a stale image)"
    for g, (u, c) in sorted(updated.items()):
        if c == 0:
            yield u, f"{v.act(u)} is not followed by an AG{g}: the other ranks never see its shard"
    for g in sorted(host | dev):
        sends = any((backs if g in dev else ogs).get(j) for j in contributors[g])
        c = counts.get(g, 0)
        if sends and c != 1:
            yield None, f"RS{g} appears {c} times; each backward reduces group {g}'s gradient exactly once"
    steady = steady_state_program(p)
    if steady is p:
        return
    prev = {get_meta(n).stage: n for n in steady.nodes if n.name.endswith("_prev") and get_meta(n).kind == AG}
    sv = ProgramView(steady, "auto")
    for n in steady.nodes:
        m = get_meta(n)
        if m.kind != PF or n.name.endswith("_prev"):
            continue
        for h in sorted(groups_read(steady, m.stage) & set(prev)):
            if not sv.waits_done(n, prev[h]):
                yield p.find(str(m.action)), (
                    f"{m.action} copies group {h}'s weights but does not wait for the previous step's AG{h} "
                    "(it would read an image whose all-gather has not finished)"
                )


def activation_offload(v: ProgramView) -> Iterator[Violation]:
    """10. Activation offload: ``AO s`` after and waiting for ``F s``, before the first BACKWARD,
    once per stage, on a stage with offloadable activations (:func:`~shfx.passes.activations.offloaded_values`);
    ``AF s`` after and waiting for ``AO s`` (a program with ``F s``; a cold backward fetches what
    its forward offloaded); the ``B s`` of an offloaded stage waits for an ``AF s`` issued since,
    and its ``F s`` keeps no graph."""
    kinds = {get_meta(n).kind for n in v.nodes}
    if AO not in kinds and AF not in kinds:
        return
    from .activations import offloaded_values

    vals = offloaded_values(v.program.stages)
    forwards: dict[int, fx.Node] = {}
    offloaded: dict[int, fx.Node] = {}  # stage -> its AO (activations on the host)
    fetched: dict[int, fx.Node] = {}  # stage -> its AF not read by its B yet
    seen_b = False
    for n in v.nodes:
        m = get_meta(n)
        k, s = m.kind, m.stage
        if k == F:
            forwards[s] = n
        elif k == AO:
            if s not in vals:
                yield n, f"{v.act(n)} offloads stage {s}'s activations, but stage {s} keeps none from its forward to its backward"
            if seen_b:
                yield n, f"{v.act(n)} comes after the first BACKWARD: an offload follows its stage's forward"
            f = forwards.get(s)
            if f is None:
                yield n, f"{v.act(n)} offloads stage {s}'s activations before F{s} made them"
            elif not v.waits(n, f):
                yield n, f"{v.act(n)} does not wait for {v.act(f)}: it would copy activations the forward still reads"
            if s in offloaded:
                yield n, f"{v.act(n)} offloads stage {s}'s activations a second time"
            offloaded[s] = n
        elif k == AF:
            ao = offloaded.get(s)
            if ao is None and s in forwards:
                yield n, f"{v.act(n)} fetches stage {s}'s activations, but no AO{s} before it offloaded them"
            elif ao is not None and not v.waits_done(n, ao):
                yield n, f"{v.act(n)} does not wait for {v.act(ao)}: it would fetch a copy not yet complete"
            if s in fetched:
                yield n, f"{v.act(n)} fetches stage {s}'s activations again before B{s} read them"
            fetched[s] = n
        elif k == B:
            seen_b = True
            if s in offloaded or (s in fetched and s not in forwards):
                af = fetched.pop(s, None)
                if af is None:
                    yield n, f"{v.act(n)} reads stage {s}'s activations, which are on the host: no AF{s} before it fetched them"
                elif not v.waits_done(n, af):
                    yield n, f"{v.act(n)} does not wait for {v.act(af)}: it would read activations still being fetched"
                f = forwards.get(s)
                if f is not None and get_meta(f).keep_graph:
                    yield f, f"{v.act(f)} keeps its graph, but its stage's activations are offloaded (it must be recomputed)"
                offloaded.pop(s, None)
    for s, n in sorted(offloaded.items()):
        if any(get_meta(x).kind == B for x in v.nodes):
            yield n, f"{v.act(n)} offloads stage {s}'s activations and nothing fetches them back for B{s} (AF{s})"


def param_tier(v: ProgramView) -> Iterator[Violation]:
    """11. The parameter tier (``program.ssd_images``): a PARAM_READ, PARAM_DROP or PARAM_WRITE
    names a group whose image is on the SSD; a read fills an image buffer in
    ``0..image_window-1`` that no group holds, waiting for the drop or write that freed it; a
    PREFETCH of the stage owning such a group and the group's CPU_STEP wait for the read that
    brought its image (all of it); a drop waits for every prefetch that read the image since and
    follows no update of it, a write waits for the update; an OFFLOAD_GRAD sending gradients to
    such a group waits for the SSD_READ that brought its host-window buffer; the program ends with
    every image buffer free."""
    p = v.program
    paged, iw = p.ssd_images, p.image_window
    if not paged and not any(get_meta(n).kind in (PR, PD, PW) for n in v.nodes):
        return
    owner = {st.index: st.update_group for st in p.stages if st.update_group in paged}
    held: dict[int, tuple[int | None, fx.Node, list[fx.Node]]] = {}  # group -> (buffer, PR, PFs since)
    holder: dict[int, int] = {}
    freed_by: dict[int, fx.Node] = {}
    updated: dict[int, fx.Node] = {}
    states: dict[int, fx.Node] = {}  # group -> its SR (the host-window buffer its gradient lands in)
    for n in v.nodes:
        m = get_meta(n)
        k, g = m.kind, m.stage
        if k in (PR, PD, PW) and g not in paged:
            yield n, f"{v.act(n)} moves group {g}'s image, which is not on the SSD (ssd_images {sorted(paged)})"
            continue
        if k == SR:
            states[g] = n
        elif k == SW:
            states.pop(g, None)
        if k == PR:
            b = m.buffer
            if b is None or not 0 <= b < iw:
                yield n, f"{v.act(n)} reads into image buffer {b}, outside 0..{iw - 1}"
                continue
            if g in held:
                yield n, f"{v.act(n)} reads group {g}'s image again while it is on the host (buffer {held[g][0]})"
                continue
            if b in holder:
                yield n, f"{v.act(n)} fills image buffer {b} while group {holder[b]}'s image still holds it"
            elif b in freed_by and not v.waits_done(n, freed_by[b]):
                yield n, f"{v.act(n)} reuses image buffer {b} before {v.act(freed_by[b])} has freed it"
            held[g] = (b, n, [])
            holder[b] = g
            updated.pop(g, None)
        elif k == PF and m.stage in owner:
            g = owner[m.stage]
            if g not in held:
                yield n, f"{v.act(n)} prefetches group {g}'s image, which is on the SSD: no PR{g} brought it to the host"
                continue
            if not v.waits_done(n, held[g][1]):
                yield n, f"{v.act(n)} does not wait for {v.act(held[g][1])}: it would copy an image still being read"
            held[g][2].append(n)
        elif k == U and g in paged:
            if g not in held:
                yield n, f"{v.act(n)} updates group {g}, whose image is on the SSD: no PR{g} brought it to the host"
                continue
            if not v.waits_done(n, held[g][1]):
                yield n, f"{v.act(n)} does not wait for {v.act(held[g][1])}: it would write an image still being read"
            updated[g] = n
        elif k == OG:
            for g2 in sorted(set(p.stages[m.stage].grad_groups) & paged):
                sr = states.get(g2)
                if sr is None or not v.waits_done(n, sr):
                    yield n, f"{v.act(n)} copies group {g2}'s gradient into its host-window buffer, but does not wait for the SR{g2} that brings it"
        elif k in (PD, PW):
            if g not in held:
                yield n, f"{v.act(n)} frees group {g}'s image buffer, but the image is not on the host (no PR{g} before it)"
                continue
            b, _, readers = held.pop(g)
            holder.pop(b, None)
            if m.buffer != b:
                yield n, f"{v.act(n)} frees image buffer {m.buffer}, but PR{g} read group {g}'s image into buffer {b}"
            for r in readers:
                if not v.waits_done(n, r):
                    yield n, f"{v.act(n)} does not wait for {v.act(r)}: it would free an image still being copied"
            u = updated.pop(g, None)
            if k == PD and u is not None:
                yield n, f"{v.act(n)} drops group {g}'s image after {v.act(u)} updated it: write it back (PW{g})"
            elif k == PW and u is None:
                yield n, f"{v.act(n)} writes back group {g}'s image, but no U{g} updated it since its read"
            elif k == PW and not v.waits_done(n, u):
                yield n, f"{v.act(n)} does not wait for {v.act(u)}: it would write back an image being updated"
            if b is not None:
                freed_by[b] = n
    for g, (b, _, _) in sorted(held.items()):
        yield None, f"the program ends with group {g}'s image still in image buffer {b}; free it (PD{g}) or write it back (PW{g})"


def activation_spill(v: ProgramView) -> Iterator[Violation]:
    """12. Activations on the SSD (``program.activation_window``, ``Offload(activations="nvme")``):
    every ``AO``, ``AW``, ``AR`` and ``AF`` names a buffer in ``0..activation_window-1``; an
    ``AO`` or ``AR`` fills one no stage holds, waiting for the ``AW``/``AF`` that emptied it (so
    at most ``activation_window`` stages' activations are in host RAM); an ``AW`` empties the
    buffer its ``AO`` filled, waiting for it (it writes the copy); an ``AR`` waits for its stage's
    ``AW`` when the program has one (it reads what was written); an ``AF`` empties the buffer its
    ``AR`` (or ``AO``) filled, waiting for it; ``AW``/``AR`` only with a window; the program ends
    with every buffer empty."""
    p = v.program
    aw = p.activation_window
    kinds = (AO, AW, AR, AF)
    if not aw:
        for n in v.nodes:
            if get_meta(n).kind in (AW, AR):
                yield n, f"{v.act(n)} moves activations on the SSD, but the program has no activation window (activation_window=0)"
        return
    held: dict[int, tuple[int, fx.Node]] = {}  # stage -> (buffer, the AO or AR that filled it)
    holder: dict[int, int] = {}  # buffer -> stage
    freed_by: dict[int, fx.Node] = {}  # buffer -> the AW or AF that emptied it
    written: dict[int, fx.Node] = {}  # stage -> its AW
    for n in v.nodes:
        m = get_meta(n)
        k, s = m.kind, m.stage
        if k not in kinds:
            continue
        b = m.buffer
        if b is None or not 0 <= b < aw:
            yield n, f"{v.act(n)} uses activation window buffer {b}, outside 0..{aw - 1}"
            continue
        if k in (AO, AR):
            if s in held:
                yield n, f"{v.act(n)} puts stage {s}'s activations in buffer {b}, but they are in buffer {held[s][0]} already"
                continue
            if b in holder:
                yield n, f"{v.act(n)} fills activation window buffer {b} while stage {holder[b]}'s activations still hold it"
            elif b in freed_by and not v.waits_done(n, freed_by[b]):
                yield n, f"{v.act(n)} does not wait for {v.act(freed_by[b])}: it would fill buffer {b} before it is emptied"
            if k == AR and s in written and not v.waits_done(n, written[s]):
                yield n, f"{v.act(n)} does not wait for {v.act(written[s])}: it would read activations still being written"
            held[s] = (b, n)
            holder[b] = s
            continue
        got = held.get(s)
        if got is None:
            what = "write" if k == AW else "fetch"
            yield n, f"{v.act(n)} would {what} stage {s}'s activations from a window buffer, but none holds them (no AO{s} or AR{s} before it)"
            continue
        filled_b, filled = got
        if b != filled_b:
            yield n, f"{v.act(n)} empties buffer {b}, but {v.act(filled)} put stage {s}'s activations in buffer {filled_b}"
        if k == AW and get_meta(filled).kind != AO:
            yield n, f"{v.act(n)} writes stage {s}'s activations, but {v.act(filled)} read them from the SSD (nothing to write)"
        if not v.waits_done(n, filled):
            yield n, f"{v.act(n)} does not wait for {v.act(filled)}: it would copy a buffer still being filled"
        del held[s]
        holder.pop(filled_b, None)
        freed_by[filled_b] = n
        if k == AW:
            written[s] = n
    for s, (b, _) in sorted(held.items()):
        yield None, f"the program ends with stage {s}'s activations still in activation window buffer {b}; write them (AW{s}) or fetch them (AF{s})"


RULES: tuple[Rule, ...] = (
    order, residency, slot_reuse, data_flow, grads_before_update, completeness, step_boundary, ssd_tier, data_parallel,
    activation_offload, param_tier, activation_spill,
)
"""The rules :func:`verify_program` runs by default, one per invariant, numbered as above."""


def verify_program(
    program: Program,
    expect: Literal["auto", "train", "eval", "backward"] = "auto",
    rules: Sequence[Rule] = RULES,
) -> Program:
    """Check ``program``'s invariants; return it unchanged or raise :class:`VerificationError`.

    ``expect`` selects the completeness rules: ``"train"`` (forward and backward of every
    stage), ``"eval"`` (forward only), ``"backward"`` (backward only, e.g. the cold
    backward), ``"auto"`` (guess from the actions present). ``rules`` checks only some
    invariants (e.g. ``rules=[residency]``).

    Violations are listed ordering first (the other rules read the graph without the edges
    it rejects), then those at actions in issue order (at one action, in rule order), then
    those of the program as a whole.
    """
    view = ProgramView(program, expect)
    found: list[tuple[tuple[int, int, int], Violation]] = []
    for rank, rule in enumerate(rules):
        for node, msg in rule(view):
            where = (0, 0) if rule is order else (2, 0) if node is None else (1, view.index[node])
            found.append(((*where, rank), (node, msg)))
    if found:
        raise VerificationError(program, [v for _, v in sorted(found, key=lambda f: f[0])])
    return program
