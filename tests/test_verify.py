"""The verify pass rejects hand-broken programs: one test per invariant, each breaking a
valid program by editing its graph and checking the error names the broken rule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shfx.passes.meta import get_meta, set_meta
from shfx.passes.program import Program
from shfx.passes.schedule import cold_backward_program, eval_program, schedule_window
from shfx.passes.stages import chain
from shfx.passes.verify import VerificationError, verify_program


def program(n=4, w=2, **kw) -> Program:
    return schedule_window(chain(n, **kw), w)


def drop_dep(p: Program, action: str, dep: str, phase: str | None = None) -> Program:
    node = p.find(action, phase)
    new = [a for a in node.args[1:] if str(get_meta(a).action) != dep]
    assert len(new) < len(node.args) - 1, f"{action} does not wait for {dep}"
    node.args = (node.args[0], *new)
    return p


def assert_rejects(p: Program, pattern: str, expect: str = "auto") -> None:
    with pytest.raises(VerificationError, match=pattern) as e:
        verify_program(p, expect)
    assert "->" in str(e.value) or "appears" in str(e.value) or "still resident" in str(e.value)


def test_valid_programs_pass():
    for p in (program(), program(5, 1, mutating=(2,), tied=(0, 4)), program(3, 3)):
        verify_program(p)
        verify_program(eval_program(p), "eval")
        verify_program(cold_backward_program(p), "backward")


def test_order_dependency_issued_later():
    p = program()
    f0, pf3 = p.find("F0"), p.find("PF3")
    f0.args = (*f0.args, pf3)  # F0 waits for something issued after it
    assert_rejects(p, r"F0 \(#2\) waits for PF3 \(#7\), which is issued later")


def test_residency_compute_without_prefetch_dependency():
    p = drop_dep(program(), "F2", "PF2")
    assert_rejects(p, "F2 .* does not wait for PF2")


def test_residency_compute_when_not_resident():
    p = program()
    f1 = p.find("F1")
    set_meta(f1, replace(get_meta(f1), action=type(get_meta(f1).action)(get_meta(f1).kind, 3)))
    assert_rejects(p, "F3 .* runs while stage 3 is not resident")


def test_at_most_window_slots():
    p = program(4, 2)
    p.num_slots = 1  # the same program claimed for a window of 1
    assert_rejects(p, "uses slot 1, outside 0..0")


def test_two_stages_in_one_slot():
    p = program(4, 2)
    pf2 = p.find("PF2")
    set_meta(pf2, replace(get_meta(pf2), slot=1))  # slot 1 still holds stage 1
    assert_rejects(p, "PF2 .* fills slot 1 while stage 1 still holds it")


def test_release_before_last_reader():
    p = drop_dep(program(), "R3", "OG3")
    assert_rejects(p, r"R3 .* frees slot 1 before its reader OG3")


def test_prefetch_without_waiting_for_release():
    p = drop_dep(program(), "PF2", "R0")
    assert_rejects(p, "PF2 .* reuses slot 0 without waiting for R0")


def test_update_before_grads_on_host():
    p = drop_dep(program(4, 2, tied=(0, 3)), "U0", "OG3")
    assert_rejects(p, "U0 .* reads group 0's gradients before OG3")


def test_forward_without_producer():
    p = drop_dep(program(4, 4), "F2", "F1")
    assert_rejects(p, "F2 .* reads stage 1's output but does not wait for F1")


def test_backward_without_consumer_gradient():
    p = drop_dep(program(4, 4), "B1", "B2")
    assert_rejects(p, "B1 .* needs the output gradient from stage 2")


def test_offload_grad_before_backward():
    p = drop_dep(program(), "OG2", "B2")
    assert_rejects(p, "OG2 .* does not wait for B2")


def test_offload_buffers_before_forward():
    p = drop_dep(program(4, 2, mutating=(1,)), "OB1", "F1")
    assert_rejects(p, "OB1 .* does not wait for F1")


def test_completeness_missing_backward():
    p = program(3, 3)
    b1 = p.find("B1")
    for u in list(b1.users):  # rewire users, then remove B1
        u.args = tuple(a for a in u.args if a is not b1)
    p.graph.erase_node(b1)
    assert_rejects(p, "B1 appears 0 times", expect="train")


def test_completeness_slot_left_resident():
    p = program(3, 3)
    r0 = p.find("R0")
    p.graph.erase_node(r0)
    assert_rejects(p, r"ends with stage 0 \(slot 0\) still resident")


def test_all_violations_are_listed():
    p = drop_dep(drop_dep(program(), "PF2", "R0"), "U1", "OG1")
    with pytest.raises(VerificationError) as e:
        verify_program(p)
    assert len(e.value.violations) == 2
