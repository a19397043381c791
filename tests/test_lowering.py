"""The lowering passes (shfx.passes.lowering), one golden test each, and policies as data."""

from __future__ import annotations

import pytest

import shfx
from shfx.passes.lowering import (
    add_buffer_offloads,
    add_grad_offloads,
    add_param_copyback,
    add_prefetch_release,
    add_refresh,
    add_updates_after_backward,
    add_updates_in_backward,
    compute_order,
)
from shfx.passes.pipeline import PipelineOptions, compile_variant
from shfx.passes.policies import POLICIES, FunctionPolicy, Placement, Policy, lower_policy, make_policy, schedule_window
from shfx.passes.program import ScheduleError
from shfx.passes.stages import chain


def s(acts) -> str:
    return " ".join(map(str, acts))


def test_compute_order():
    assert s(compute_order(chain(3))) == "F0 F1 F2 B2 B1 B0"


def test_add_buffer_offloads():
    specs = chain(3, mutating=(0, 2))
    assert s(add_buffer_offloads(compute_order(specs), specs)) == "F0 OB0 F1 F2 OB2 B2 B1 B0"


def test_add_grad_offloads_skips_device_groups():
    specs = chain(3)
    assert s(add_grad_offloads(compute_order(specs), specs, frozenset())) == "F0 F1 F2 B2 OG2 B1 OG1 B0 OG0"
    assert s(add_grad_offloads(compute_order(specs), specs, frozenset({1}))) == "F0 F1 F2 B2 OG2 B1 B0 OG0"


def test_add_updates_in_backward_after_the_last_contributor():
    specs = chain(3, tied=(0, 2))  # stage 2 also sends gradients to group 0
    acts = add_grad_offloads(compute_order(specs), specs, frozenset({0}))
    # group 0's last contributor is stage 0 (backward order 2, 1, 0): DU0 after B0
    assert s(add_updates_in_backward(acts, specs, frozenset({0}))) == "F0 F1 F2 B2 OG2 U2 B1 OG1 U1 B0 DU0"


def test_add_param_copyback_needs_the_owner_last():
    specs = chain(2)
    dev = frozenset({0, 1})
    acts = add_updates_in_backward(compute_order(specs), specs, dev)
    assert s(add_param_copyback(acts, specs, dev, persistent=())) == "F0 F1 B1 DU1 OP1 B0 DU0 OP0"
    assert s(add_param_copyback(acts, specs, dev, persistent=(0, 1))) == "F0 F1 B1 DU1 B0 DU0"
    # stage 0 also sends gradients to group 2: group 2's last contributor (B0) is not its owner,
    # so the update cannot run while stage 2 is resident
    tied = chain(3, tied=(2, 0))
    acts = add_updates_in_backward(compute_order(tied), tied, dev | {2})
    with pytest.raises(ScheduleError, match="l2l: stage 2's group 2 also gets gradients from an earlier stage"):
        add_param_copyback(acts, tied, dev | {2}, persistent=(), policy="l2l")


def test_add_prefetch_release_window_and_lookahead():
    specs = chain(4)
    acts = compute_order(specs)
    # STRONGHOLD: the last `keep` stages stay resident from forward into backward
    assert s(add_prefetch_release(acts, specs, streamed=range(4), slots=2, keep=2)) == (
        "PF0 PF1 F0 R0 PF2 F1 R1 PF3 F2 F3 B3 R3 PF1 B2 R2 PF0 B1 R1 B0 R0"
    )
    # ZeRO-Infinity: every use fetched again, in order, as slots free up
    assert s(add_prefetch_release(acts, specs, streamed=range(4), slots=2, keep=0)) == (
        "PF0 PF1 F0 R0 PF2 F1 R1 PF3 F2 R2 F3 R3 PF3 PF2 B3 R3 PF1 B2 R2 PF0 B1 R1 B0 R0"
    )
    # persistent stages (not streamed) get no PF/R
    assert s(add_prefetch_release(acts, specs, streamed=(2, 3), slots=1, keep=1)) == (
        "PF2 F0 F1 F2 R2 PF3 F3 B3 R3 PF2 B2 R2 B1 B0"
    )
    with pytest.raises(ScheduleError, match="at least one slot"):
        add_prefetch_release(acts, specs, streamed=(0,), slots=0, keep=0)


def test_add_updates_after_backward_and_refresh():
    specs = chain(3)
    acts = add_updates_after_backward(compute_order(specs), specs, frozenset({1}))
    assert s(acts) == "F0 F1 F2 B2 B1 B0 U0 U2"
    assert s(add_refresh(acts, (0, 1, 2))) == "F0 F1 F2 B2 B1 B0 U0 U2 PF0 PF1 PF2"


def test_registry_and_options():
    assert list(POLICIES) == ["resident", "l2l", "zero-offload", "zero-infinity", "stronghold"]
    assert make_policy("stronghold", window=3) == shfx.Stronghold(window=3)
    with pytest.raises(ValueError, match="has no option lookahead .its options: deferred_update, delayed_update"):
        make_policy("zero-offload", lookahead=2)
    with pytest.raises(ValueError, match="unknown policy 'fast'"):
        make_policy("fast")
    assert shfx.Stronghold(window="auto", resident_first="auto").auto == ("window", "resident_first")
    with pytest.raises(ScheduleError, match="leaves window to the tuner"):
        shfx.Stronghold(window="auto").program(chain(2))
    assert shfx.ZeroInfinity(lookahead=2).program(chain(4)).num_slots == 3


def test_a_new_policy_is_one_class():
    """The docs' example policy: stream every stage with one slot and update on the host after
    the backward (L2L's residency, ZeRO-Infinity's updates) is a placement, nothing more."""
    from dataclasses import dataclass
    from typing import ClassVar

    @dataclass(frozen=True)
    class OneSlot(Policy):
        name: ClassVar[str] = "one-slot"

        def placement(self, stages):
            return Placement((), tuple(range(len(stages))), 1, 1, frozenset(), "after-backward")

    p = lower_policy(OneSlot(), chain(3))
    assert " ".join(p.actions()) == "PF0 F0 R0 PF1 F1 R1 PF2 F2 B2 OG2 R2 PF1 B1 OG1 R1 PF0 B0 OG0 R0 U0 U1 U2"


def test_function_policies_still_work():
    p = FunctionPolicy(schedule_window, window=2)
    assert p.program(chain(3)).actions() == schedule_window(chain(3), 2).actions()


def test_pipeline_verifies_after_every_pass():
    """verify_each_pass checks the stage specs after partitioning and each program as it is
    built; the variant records the passes that built it."""
    import torch

    from zoo import gpt_tied, token_batch

    (x, y), _, _ = token_batch(0)
    v = compile_variant(gpt_tied(), (x, y), {}, PipelineOptions(policy="stronghold", window=2, verify_each_pass=True))
    assert v.passes == ("capture", "partition", "lower", "derive", "verify")
    assert v.policy == shfx.Stronghold(window=2)
    with pytest.raises(ScheduleError, match="no chooser"):
        compile_variant(gpt_tied(), (x, y), {}, PipelineOptions(policy="stronghold", window="auto"))
    del torch
