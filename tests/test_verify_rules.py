"""The rule-per-invariant verifier on every policy's programs over a grid, and on thousands of
deliberately broken copies of them: valid programs pass, broken ones get a VerificationError
listing each violation (never another exception), and one rule can run alone.

(When the rules replaced the single-function verifier, this file compared the two on the same
4770 broken programs, message for message, with a frozen copy of the old function; they were
identical, and the copy was removed so the tree keeps one verifier.)"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch.fx as fx

from shfx.passes.meta import get_meta, set_meta
from shfx.passes.policies import schedule_l2l, schedule_resident, schedule_stronghold, schedule_zero_infinity, schedule_zero_offload
from shfx.passes.program import Action, ActionKind, Program
from shfx.passes.schedule import cold_backward_program, eval_program
from shfx.passes.stages import chain
from shfx.passes.verify import RULES, VerificationError, data_flow, verify_program

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


def test_valid_grid_programs_pass():
    for p, expect in grid_programs():
        assert outcome(verify_program, p, expect) is None


def test_broken_programs_get_a_verification_error():
    rng = random.Random(20240611)
    checked = broken = several = 0
    for p, expect in grid_programs():
        for _ in range(10):
            q = p.copy()
            for mutate in rng.choices(MUTATIONS, k=rng.choice((1, 1, 2, 3))):
                mutate(q, rng)
            got = outcome(verify_program, q, rng.choice((expect, "auto")))
            checked += 1
            if got is not None:
                kind, violations, text = got
                assert kind == "VerificationError" and violations, text
                assert all(v in text for v in violations[:12])
                broken += 1
                several += len(violations) > 1
    assert checked == 4770 and broken > 4000 and several > 3000, (checked, broken, several)


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
