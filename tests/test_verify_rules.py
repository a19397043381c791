"""The rule-per-invariant verifier reports exactly what the single-function verifier it replaced
did: the same messages in the same order, for valid and deliberately broken programs of every
policy over a grid. ``_old_verify`` is a frozen copy of that function (commit 3723575), kept here
only for this comparison."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Literal

import pytest
import torch.fx as fx

from shfx.passes.actions import KINDS
from shfx.passes.meta import get_meta, set_meta
from shfx.passes.policies import schedule_l2l, schedule_resident, schedule_stronghold, schedule_zero_infinity, schedule_zero_offload
from shfx.passes.program import B, DU, F, OB, OG, OP, PF, R, U, Action, ActionKind, Program
from shfx.passes.schedule import cold_backward_program, eval_program
from shfx.passes.stages import chain, consumers_of
from shfx.passes.verify import RULES, VerificationError, data_flow, verify_program

# ---- the frozen copy ---------------------------------------------------------------------------
_SLOTTED = {k for k, i in KINDS.items() if i.slotted and not i.update}
_READERS = {k for k, i in KINDS.items() if i.reads_slot and not i.update}


def _old_verify(program: Program, expect: Literal["auto", "train", "eval", "backward"] = "auto") -> Program:
    """Check ``program``'s invariants; return it unchanged or raise :class:`VerificationError`.

    ``expect`` selects the completeness rules: ``"train"`` (forward and backward of every
    stage), ``"eval"`` (forward only), ``"backward"`` (backward only, e.g. the cold
    backward), ``"auto"`` (guess from the actions present).
    """
    nodes = program.nodes
    index = {n: i for i, n in enumerate(nodes)}
    stages = {s.index: s for s in program.stages}
    consumers = consumers_of(list(program.stages))
    bad: list[tuple[fx.Node | None, str]] = []

    def act(n: fx.Node) -> str:
        return f"{get_meta(n).action} (#{index[n]})"

    # 1. order and acyclicity; ancestors as bitsets in issue order.
    # NOTE: two relations. ``anc``: n waits (transitively) for d to start and finish using
    # device memory. ``done``: n waits for d's every effect. They differ at RELEASE: a
    # RELEASE waits only until an OFFLOAD_GRAD has *read* the slot (its copy), not until the
    # gradients are accumulated on the host, so a path through a RELEASE does not make an
    # update wait for that OFFLOAD_GRAD.
    anc: dict[fx.Node, int] = {}
    done: dict[fx.Node, int] = {}
    for n in nodes:
        a = dn = 0
        is_release = get_meta(n).kind == R
        for d in program.deps(n):
            if d not in index:
                bad.append((n, f"{act(n)} waits for {d.name!r}, which is not an action of this program"))
                continue
            if index[d] >= index[n]:
                bad.append((n, f"{act(n)} waits for {act(d)}, which is issued later (deadlock or cycle)"))
                continue
            a |= anc[d] | (1 << index[d])
            dn |= done[d] | (0 if (is_release and KINDS[get_meta(d).kind].accumulates) else 1 << index[d])
        anc[n] = a
        done[n] = dn

    def waits(n: fx.Node, d: fx.Node) -> bool:
        return bool(anc[n] >> index[d] & 1)

    def waits_done(n: fx.Node, d: fx.Node) -> bool:
        return bool(done[n] >> index[d] & 1)

    # 2./3. residency and slot reuse, walking in issue order; persistent stages start resident
    # (loaded before the step: no PF to wait for)
    resident: dict[int, tuple[int, fx.Node | None, list[fx.Node]]] = {
        st: (k, None, []) for k, st in enumerate(program.persistent)
    }  # stage -> (slot, PF, readers)
    slot_holder: dict[int, int] = {k: st for k, st in enumerate(program.persistent)}  # slot -> stage
    last_release: dict[int, fx.Node] = {}
    last: dict[tuple[ActionKind, int], fx.Node] = {}
    owner_of = {st.update_group: st.index for st in program.stages if st.update_group is not None}
    dev_groups = program.device_groups()
    for n in nodes:
        m = get_meta(n)
        k, s = m.kind, m.stage
        if k in _SLOTTED:
            if s not in stages:
                bad.append((n, f"{act(n)} names stage {s}, but the program has stages 0..{len(stages) - 1}"))
                continue
            if m.slot is None or not (0 <= m.slot < program.num_slots):
                bad.append((n, f"{act(n)} uses slot {m.slot}, outside 0..{program.num_slots - 1}"))
                continue
        if k == PF:
            if s in resident:
                if s not in program.persistent:
                    bad.append((n, f"{act(n)} prefetches stage {s}, which is already resident in slot {resident[s][0]}"))
                    continue
                slot, _, readers = resident[s]  # a refresh of a persistent stage's slot
                if m.slot != slot:
                    bad.append((n, f"{act(n)} refreshes stage {s} into slot {m.slot}, but it is in slot {slot}"))
                for r in readers:
                    if not waits(n, r):
                        bad.append((n, f"{act(n)} overwrites stage {s}'s slot before its reader {act(r)} is done"))
                resident[s] = (slot, n, [])
                last[(k, s)] = n
                continue
            if m.slot in slot_holder:
                bad.append((n, f"{act(n)} fills slot {m.slot} while stage {slot_holder[m.slot]} still holds it"))
            if m.slot in last_release and not waits(n, last_release[m.slot]):
                bad.append((n, f"{act(n)} reuses slot {m.slot} without waiting for {act(last_release[m.slot])}, which freed it"))
            resident[s] = (m.slot, n, [])
            slot_holder[m.slot] = s
            if len(resident) > program.num_slots:
                bad.append((n, f"{act(n)} makes {len(resident)} stages resident; the window allows {program.num_slots}"))
        elif k in _READERS or k == R:
            if s not in resident:
                bad.append((n, f"{act(n)} runs while stage {s} is not resident"))
                continue
            slot, pf, readers = resident[s]
            if m.slot != slot:
                bad.append((n, f"{act(n)} uses slot {m.slot}, but stage {s} is in slot {slot}"))
            if pf is not None and not waits(n, pf):
                bad.append((n, f"{act(n)} does not wait for {act(pf)}, which fills stage {s}'s slot"))
            if k == R and s in program.persistent:
                bad.append((n, f"{act(n)} releases stage {s}, which is persistent (resident across steps)"))
            if k == R:
                for r in readers:
                    if not waits(n, r):
                        bad.append((n, f"{act(n)} frees slot {slot} before its reader {act(r)} is done"))
                del resident[s]
                slot_holder.pop(slot, None)
                last_release[slot] = n
            else:
                readers.append(n)
        # 4. data flow
        if k == F:
            for p in stages[s].producers:
                fp = last.get((F, p))
                if fp is None or not waits(n, fp):
                    bad.append((n, f"{act(n)} reads stage {p}'s output but does not wait for F{p}"))
        elif k == B:
            for c in consumers[s]:
                bc = last.get((B, c))
                if bc is None or not waits(n, bc):
                    bad.append((n, f"{act(n)} needs the output gradient from stage {c} but does not wait for B{c}"))
        elif k == OG:
            bs = last.get((B, s))
            if bs is None or not waits(n, bs):
                bad.append((n, f"{act(n)} copies stage {s}'s gradients but does not wait for B{s}"))
        elif k == OB:
            fs = last.get((F, s))
            if fs is None or not waits(n, fs):
                bad.append((n, f"{act(n)} copies stage {s}'s mutated buffers but does not wait for F{s}"))
        elif k == OP:
            du = last.get((DU, stages[s].update_group))
            if du is None or not waits(n, du):
                bad.append((n, f"{act(n)} copies stage {s}'s parameters back before DU{stages[s].update_group} updated them"))
        # 5. grads on the host (device) before the update reads them
        elif k == DU:
            own = owner_of.get(s)
            if own is None:
                bad.append((n, f"{act(n)} updates group {s}, which no stage owns"))
            elif own not in resident:
                bad.append((n, f"{act(n)} updates group {s} on the device while its stage {own} is not resident"))
            else:
                slot, pf, readers = resident[own]
                if m.slot != slot:
                    bad.append((n, f"{act(n)} uses slot {m.slot}, but stage {own} is in slot {slot}"))
                readers.append(n)
            for st in program.stages:
                if s in st.grad_groups:
                    b = last.get((B, st.index))
                    if b is None or not waits(n, b):
                        bad.append((n, f"{act(n)} reads group {s}'s gradients before B{st.index} produced stage {st.index}'s"))
        elif k == U:
            owners = [st.index for st in program.stages if st.update_group == s]
            if not owners:
                bad.append((n, f"{act(n)} updates group {s}, which no stage owns"))
            if s in dev_groups:
                bad.append((n, f"{act(n)} updates group {s} on the host, but DU{s} updates it on the device"))
            for st in program.stages:
                if s in st.grad_groups:
                    og = last.get((OG, st.index))
                    if og is None or not waits_done(n, og):
                        bad.append((n, f"{act(n)} reads group {s}'s gradients before OG{st.index} has put stage {st.index}'s on the host"))
        last[(k, s)] = n

    # 6. completeness
    kinds = {get_meta(n).kind for n in nodes}
    if expect == "auto":
        expect = "train" if (F in kinds and B in kinds) else ("backward" if B in kinds else "eval")
    counts: dict[tuple[ActionKind, int], int] = {}
    for n in nodes:
        m = get_meta(n)
        counts[(m.kind, m.stage)] = counts.get((m.kind, m.stage), 0) + 1
    need: list[tuple[ActionKind, int]] = []
    if expect in ("train", "eval"):
        need += [(F, s) for s in stages]
    if expect in ("train", "backward"):
        need += [(B, s) for s in stages]
        # a stage's gradients go to the host when any group it sends them to is updated there
        need += [(OG, s) for s, st in stages.items() if st.has_grads and (st.grad_groups - dev_groups)]
        need += [
            (DU if st.update_group in dev_groups else U, st.update_group)
            for st in stages.values()
            if st.update_group is not None and not (program.updates_outside and st.update_group not in dev_groups)
        ]
    for key in need:
        c = counts.get(key, 0)
        if c != 1:
            bad.append((None, f"{key[0].value}{key[1]} appears {c} times; a {expect} program needs it exactly once"))
    left = {s: v for s, v in resident.items() if s not in program.persistent}
    if expect in ("train", "eval", "backward") and left:
        held = ", ".join(f"stage {s} (slot {sl})" for s, (sl, _, _) in sorted(left.items()))
        bad.append((None, f"the program ends with {held} still resident; release every slot but the persistent stages'"))
    if bad:
        raise VerificationError(program, bad)
    return program


# ---- programs, valid and broken ----------------------------------------------------------------
def grid_programs() -> list[tuple[Program, str]]:
    """Every policy's train, eval and cold-backward programs over chain(1..5), tied and untied,
    windows 1..3, resident_first 0..n (as tests/test_policies.py verifies them)."""
    out = []
    for n in range(1, 6):
        for tied in (None, (0, n - 1)) if n > 1 else (None,):
            specs = chain(n, tied=tied, mutating=(0,))
            progs = [schedule_resident(specs), schedule_l2l(specs), schedule_zero_offload(specs)]
            progs += [schedule_zero_offload(specs, delayed_update=True), schedule_zero_infinity(specs)]
            progs += [schedule_stronghold(specs, w, resident_first=k) for w in (1, 2, 3) for k in range(n + 1)]
            for p in progs:
                out += [(p, "train"), (eval_program(p), "eval"), (cold_backward_program(p), "backward")]
    return out


def _set_args(node: fx.Node, deps: list[fx.Node]) -> None:
    node.args = (node.args[0], *deps)


def drop_edge(p: Program, rng: random.Random) -> None:
    nodes = [n for n in p.nodes if p.deps(n)]
    if nodes:
        n = rng.choice(nodes)
        deps = p.deps(n)
        deps.pop(rng.randrange(len(deps)))
        _set_args(n, deps)


def late_edge(p: Program, rng: random.Random) -> None:
    nodes = p.nodes
    i = rng.randrange(len(nodes))
    _set_args(nodes[i], [*p.deps(nodes[i]), rng.choice(nodes[i:])])


def foreign_edge(p: Program, rng: random.Random) -> None:
    n = rng.choice(p.nodes)
    stranger = fx.Graph().call_function(print, (0,))  # an action of no program
    set_meta(stranger, get_meta(rng.choice(p.nodes)))
    _set_args(n, [*p.deps(n), stranger])


def swap(p: Program, rng: random.Random) -> None:
    nodes = p.nodes
    if len(nodes) > 1:
        i, j = sorted(rng.sample(range(len(nodes)), 2))
        a, b = nodes[i], nodes[j]
        before_b = b.prev
        a.prepend(b)
        if before_b is not a:
            before_b.append(a)


def delete(p: Program, rng: random.Random) -> None:
    n = rng.choice(p.nodes)
    for u in list(n.users):
        u.args = tuple(a for a in u.args if a is not n)
    p.graph.erase_node(n)


def reslot(p: Program, rng: random.Random) -> None:
    n = rng.choice(p.nodes)
    set_meta(n, replace(get_meta(n), slot=rng.choice([None, *range(-1, p.num_slots + 1)])))


def restage(p: Program, rng: random.Random) -> None:
    n = rng.choice(p.nodes)
    m = get_meta(n)
    set_meta(n, replace(m, action=Action(m.kind, rng.randrange(-1, len(p.stages) + 1))))


def rekind(p: Program, rng: random.Random) -> None:
    n = rng.choice(p.nodes)
    m = get_meta(n)
    set_meta(n, replace(m, action=Action(rng.choice(list(ActionKind)), m.stage)))


def fewer_slots(p: Program, rng: random.Random) -> None:
    p.num_slots = rng.randrange(max(p.num_slots, 1))


MUTATIONS = [drop_edge, drop_edge, drop_edge, swap, swap, swap, late_edge, foreign_edge, delete, reslot, restage, rekind, fewer_slots]


def outcome(verify, p: Program, expect: str) -> tuple[str, list[str] | None, str] | None:
    """What ``verify`` did: None (accepted) or the exception's type, violations and text."""
    try:
        verify(p, expect)
    except Exception as e:  # whatever either raises, compared as is
        return type(e).__name__, getattr(e, "violations", None), str(e)
    return None


def test_valid_grid_programs_pass_both():
    for p, expect in grid_programs():
        assert outcome(_old_verify, p, expect) is None
        assert outcome(verify_program, p, expect) is None


def test_broken_programs_report_as_before():
    rng = random.Random(20240611)
    compared = broken = several = 0
    for p, expect in grid_programs():
        for _ in range(10):
            q = p.copy()
            for mutate in rng.choices(MUTATIONS, k=rng.choice((1, 1, 2, 3))):
                mutate(q, rng)
            exp = rng.choice((expect, "auto"))
            old, new = outcome(_old_verify, q, exp), outcome(verify_program, q, exp)
            assert new == old, f"{q.name} ({exp}):\nold: {old and old[1]}\nnew: {new and new[1]}\n{q}"
            compared += 1
            broken += old is not None
            several += old is not None and len(old[1] or ()) > 1
    assert compared == 4770 and broken > 4000 and several > 3000, (compared, broken, several)


def test_one_rule_at_a_time():
    """``rules=`` runs only some rules: a program broken only in its data flow passes every
    other rule, and the data-flow rule alone reports what the full verifier does."""
    p = schedule_stronghold(chain(4), 4)
    f1, f2 = p.find("F1"), p.find("F2")
    _set_args(f2, [d for d in p.deps(f2) if d is not f1])
    others = [r for r in RULES if r is not data_flow]
    assert verify_program(p, rules=others) is p
    for rules in ([data_flow], RULES):
        with pytest.raises(VerificationError) as e:
            verify_program(p, rules=rules)
        assert e.value.violations == ["F2 (#6) reads stage 1's output but does not wait for F1"]
