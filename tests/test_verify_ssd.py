"""The verifier's NVMe-tier rule (8, ``ssd_tier``) rejects hand-broken programs: one test per
invariant, each breaking a valid SSD program by editing its graph (or lowering a hand-written
order without the lowering's checks in the way) and checking the message names what broke."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shfx.passes.meta import get_meta, set_meta
from shfx.passes.policies import Stronghold, ZeroInfinity
from shfx.passes.program import Program, ScheduleError, lower_actions
from shfx.passes.schedule import cold_backward_program, eval_program, steady_state_program
from shfx.passes.stages import chain
from shfx.passes.verify import RULES, VerificationError, ssd_tier, verify_program


def program(h: int = 2, **kw) -> Program:
    return Stronghold(window=2, nvme=True, host_window=h, **kw).program(chain(4))


def drop_dep(p: Program, action: str, dep: str) -> Program:
    node = p.find(action)
    new = [a for a in node.args[1:] if str(get_meta(a).action) != dep]
    assert len(new) < len(node.args) - 1, f"{action} does not wait for {dep}"
    node.args = (node.args[0], *new)
    return p


def assert_rejects(p: Program, pattern: str) -> VerificationError:
    with pytest.raises(VerificationError, match=pattern) as e:
        verify_program(p, "train")
    return e.value


def test_the_rule_is_registered_eighth():
    assert RULES[7] is ssd_tier  # (rule 9, data parallel, follows it: tests/test_data_parallel_plan.py)


@pytest.mark.parametrize("h", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "policy",
    [
        lambda h: Stronghold(window=2, nvme=True, host_window=h),
        lambda h: Stronghold(window=1, resident_first=1, nvme=True, host_window=h),
        lambda h: Stronghold(window=2, deferred_update=True, nvme=True, host_window=h),
        lambda h: ZeroInfinity(nvme=True, host_window=h),
        lambda h: ZeroInfinity(lookahead=2, deferred_update=True, nvme=True, host_window=h),
    ],
)
def test_valid_ssd_programs_pass(policy, h):
    for specs in (chain(4), chain(5, tied=(0, 4), mutating=(1,))):
        p = policy(h).program(specs)
        verify_program(p, "train")
        verify_program(eval_program(p), "eval")
        verify_program(cold_backward_program(p), "backward")
        verify_program(steady_state_program(p), "auto", rules=[ssd_tier])


def test_update_before_its_read():
    p = drop_dep(program(), "U2", "SR2")
    assert_rejects(p, r"U2 \(#\d+\) does not wait for SR2 \(#\d+\): it would update a state still being read")


def test_update_without_any_read():
    # a hand-written order: U1 with its state still on the SSD (the lowering refuses it, so
    # build a valid program and delete the read)
    p = program(h=4)
    sr = p.find("SR1")
    for u in list(sr.users):
        u.args = tuple(a for a in u.args if a is not sr)
    p.graph.erase_node(sr)
    e = assert_rejects(p, r"U1 \(#\d+\) updates group 1, whose optimizer state is on the SSD: no SR1 brought it to the host")
    assert any("SR1 appears 0 times" in v for v in e.violations)


def test_buffer_reused_before_its_write_back():
    p = program(h=1)  # SR2 reuses the buffer SW3 freed
    p = drop_dep(p, "SR2", "SW3")
    assert_rejects(p, r"SR2 \(#\d+\) reuses host-window buffer 0 before SW3 \(#\d+\) has written its state back")


def test_more_groups_on_the_host_than_the_window():
    p = program(h=2)
    p.host_window = 1  # the program's buffers now exceed the window it claims
    e = assert_rejects(p, r"reads into host-window buffer 1, outside 0..0")
    p = program(h=2)
    n = p.find("SR2")
    set_meta(n, replace(get_meta(n), buffer=0))  # two groups' reads in buffer 0 at once
    e = assert_rejects(p, r"SR2 \(#\d+\) fills host-window buffer 0 while group 3's state still holds it")
    assert any("writes back from buffer 1, but SR2 read group 2's state into buffer 0" in v for v in e.violations)


def test_window_count_is_checked_even_with_distinct_buffers():
    p = lower_actions(
        "PF0 F0 B0 SR0 OG0 U0 SW0 R0".split(), chain(1), 1, ssd_groups={0}, host_window=1
    )
    verify_program(p, "train")
    p.host_window = 0  # no buffer at all
    assert_rejects(p, r"SR0 \(#\d+\) reads into host-window buffer 0, outside 0..-1")


def test_write_back_before_the_update():
    p = drop_dep(program(), "SW3", "U3")
    assert_rejects(p, r"SW3 \(#\d+\) does not wait for U3 \(#\d+\): it would write back a state being updated")


def test_write_back_of_a_state_not_on_the_host():
    p = program(h=4)
    sw, u = p.find("SW0"), p.find("U0")
    u.prepend(sw)  # the write-back now comes before the update (the edge stays: order rule too)
    e = assert_rejects(p, r"SW0 \(#\d+\) writes back group 0's state before U0 has updated it")
    assert any("issued later" in v for v in e.violations)


def test_state_left_on_the_host():
    p = program(h=4)
    sw = p.find("SW1")
    for u in list(sw.users):
        u.args = tuple(a for a in u.args if a is not sw)
    p.graph.erase_node(sw)
    assert_rejects(p, r"the program ends with group 1's state still on the host \(buffer \d\); write it back \(SW1\)")


def test_transfers_only_for_host_updated_groups_on_the_ssd():
    # group 0 is updated on the device (resident_first=1): its state is there
    p = Stronghold(window=1, resident_first=1, nvme=True, host_window=1).program(chain(3))
    n = p.find("SR2")
    set_meta(n, replace(get_meta(n), action=replace(get_meta(n).action, stage=0)))
    assert_rejects(p, r"SR0 \(#\d+\) moves group 0's optimizer state, but DU0 updates it on the device")
    # a group not placed on the SSD
    p = program()
    p.ssd_groups = frozenset({0, 1, 2})
    assert_rejects(p, r"SR3 \(#\d+\) moves group 3's optimizer state, which is not placed on the SSD \(only groups \[0, 1, 2\] are\)")


def test_read_and_write_exactly_once():
    p = program(h=4)
    sr = p.find("SR2")
    dup = p.graph.node_copy(sr)
    dup.name = "sr2_again"
    sr.append(dup)
    assert_rejects(p, r"reads group 2's state again while it is on the host")


def test_lowering_refuses_what_the_verifier_would():
    with pytest.raises(ScheduleError, match=r"group 0's optimizer state is on the SSD; read it first \(SR0\)"):
        lower_actions("PF0 F0 B0 OG0 U0 R0".split(), chain(1), 1, ssd_groups={0}, host_window=1)
    with pytest.raises(ScheduleError, match=r"all 1 host-window buffers are in use \(buffer 0: group 1\); write one back first"):
        lower_actions("F0 F1 SR1 SR0".split(), chain(2), 2, persistent=(0, 1), ssd_groups={0, 1}, host_window=1)
    with pytest.raises(ScheduleError, match=r"group 0's optimizer state is not placed on the SSD \(no group is"):
        lower_actions("PF0 F0 B0 SR0".split(), chain(1), 1)
    with pytest.raises(ScheduleError, match=r"needs host_window >= 1"):
        lower_actions("PF0 F0".split(), chain(1), 1, ssd_groups={0})
    with pytest.raises(ScheduleError, match=r"SW0 \(F0 B0 OG0 SR0 \[SW0\]\): it needs U0 \(the update whose state it writes back\)"):
        lower_actions("PF0 F0 B0 OG0 SR0 SW0".split(), chain(1), 1, ssd_groups={0}, host_window=1)
    with pytest.raises(ScheduleError, match=r"it writes back group 0's state, but U0 has not updated it since SR0"):
        lower_actions("PF0 F0 B0 OG0 SR0 U0 SW0 SR0 SW0".split(), chain(1), 1, ssd_groups={0}, host_window=1)


def test_broken_ssd_programs_get_a_verification_error():
    """The mutation test of tests/test_verify_rules.py on programs with the NVMe tier (every
    update timing, host windows 1..3): a broken copy gets a VerificationError listing its
    violations, never another exception."""
    import random

    from test_verify_rules import MUTATIONS, outcome

    def buffer(p, rng):  # move an SSD action to another (maybe invalid) host-window buffer
        ns = [n for n in p.nodes if get_meta(n).buffer is not None]
        if ns:
            n = rng.choice(ns)
            set_meta(n, replace(get_meta(n), buffer=rng.choice([None, *range(-1, p.host_window + 1)])))

    programs = []
    for n in (2, 3, 4):
        specs = chain(n, tied=(0, n - 1), mutating=(0,))
        for h in (1, 2, 3):
            for pol in (
                Stronghold(window=2, nvme=True, host_window=h),
                Stronghold(window=1, resident_first=1, nvme=True, host_window=h),
                Stronghold(window=2, deferred_update=True, nvme=True, host_window=h),
                ZeroInfinity(nvme=True, host_window=h),
            ):
                p = pol.program(specs)
                programs += [(p, "train"), (cold_backward_program(p), "backward")]
    rng = random.Random(12)
    checked = broken = 0
    for p, expect in programs:
        verify_program(p, expect)
        for _ in range(25):
            q = p.copy()
            for mutate in rng.choices(MUTATIONS + [buffer, buffer, buffer], k=rng.choice((1, 1, 2, 3))):
                mutate(q, rng)
            got = outcome(verify_program, q, rng.choice((expect, "auto")))
            checked += 1
            if got is not None:
                kind, violations, text = got
                assert kind == "VerificationError" and violations, text
                broken += 1
    assert checked == 25 * len(programs) and broken > 0.8 * checked, (checked, broken)
