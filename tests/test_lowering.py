"""The lowering passes (shfx.passes.lowering), one golden test each, and policies as data."""

from __future__ import annotations

import pytest
import torch

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


# ---- the NVMe tier ---------------------------------------------------------------------------


def test_add_ssd_transfers_reads_ahead_within_the_host_window():
    from shfx.passes.actions import Action
    from shfx.passes.lowering import add_ssd_transfers

    acts = [Action.from_str(a) for a in "F0 F1 F2 B2 OG2 U2 B1 OG1 U1 B0 OG0 U0".split()]
    # H=1: each read right after the write-back of the group leaving the window
    assert s(add_ssd_transfers(acts, {0, 1, 2}, 1)) == "F0 F1 F2 B2 SR2 OG2 U2 SW2 SR1 B1 OG1 U1 SW1 SR0 B0 OG0 U0 SW0"
    # H=2: two reads at the start of the backward, the third after the first write-back
    assert s(add_ssd_transfers(acts, {0, 1, 2}, 2)) == "F0 F1 F2 B2 SR2 SR1 OG2 U2 SW2 SR0 B1 OG1 U1 SW1 B0 OG0 U0 SW0"
    # H >= groups: every read at the start of the backward
    assert s(add_ssd_transfers(acts, {0, 1, 2}, 5)) == "F0 F1 F2 B2 SR2 SR1 SR0 OG2 U2 SW2 B1 OG1 U1 SW1 B0 OG0 U0 SW0"
    # only the groups placed on the SSD
    assert s(add_ssd_transfers(acts, {1}, 1)) == "F0 F1 F2 B2 SR1 OG2 U2 B1 OG1 U1 SW1 B0 OG0 U0"
    assert add_ssd_transfers(acts, set(), 1) == acts
    with pytest.raises(ScheduleError, match=r"groups \[3\] are placed on the SSD but the program has no host update"):
        add_ssd_transfers(acts, {3}, 1)


def test_ssd_programs_of_every_update_timing():
    """Golden programs with the NVMe tier: updates during the backward (stronghold), after it
    (zero-infinity), deferred to the next forward (exact clipping) and with groups on the device
    (stronghold k=1: its group has no SSD transfers). Without the tier the programs are those of
    the docstrings, unchanged."""
    golden = {
        shfx.Stronghold(window=2, nvme=True, host_window=1):
            "PF0 PF1 F0 R0 PF2 F1 F2 B2 SR2 OG2 U2 SW2 SR1 R2 PF0 B1 OG1 U1 SW1 SR0 R1 B0 OG0 U0 SW0 R0",
        shfx.Stronghold(window=2, resident_first=1, nvme=True, host_window=2):
            "PF1 PF2 F0 F1 F2 B2 SR2 SR1 OG2 U2 SW2 R2 B1 OG1 U1 SW1 R1 B0 DU0",
        shfx.Stronghold(window=2, deferred_update=True, nvme=True, host_window=2):
            "PF0 PF1 F0 R0 PF2 F1 F2 B2 OG2 GN2 R2 PF0 B1 OG1 GN1 R1 B0 OG0 GN0 R0 CK0 SR0 SR1 U0 SW0 SR2 U1 SW1 U2 SW2",
        shfx.ZeroInfinity(nvme=True, host_window=1):
            "PF0 PF1 F0 R0 PF2 F1 R1 F2 R2 PF2 PF1 B2 SR0 OG2 R2 PF0 B1 OG1 R1 B0 OG0 R0 U0 SW0 SR1 U1 SW1 SR2 U2 SW2",
    }  # fmt: skip
    for pol, want in golden.items():
        p = pol.program(chain(3))
        assert " ".join(p.actions()) == want, pol
        phases = {str(shfx.passes.meta.get_meta(n).action): shfx.passes.meta.get_meta(n).phase for n in p.nodes}
        # the transfers run with the updates, never in the forward (under gradient accumulation
        # only the backward completing a step issues them: KINDS[...].update)
        assert all(ph != "forward" for a, ph in phases.items() if a[:2] in ("SR", "SW")), pol
    assert " ".join(shfx.Stronghold(window=2).program(chain(3)).actions()) == (
        "PF0 PF1 F0 R0 PF2 F1 F2 B2 OG2 U2 R2 PF0 B1 OG1 U1 R1 B0 OG0 U0 R0"
    )
    from shfx.passes.actions import KINDS, SR, SW

    assert KINDS[SR].update and KINDS[SW].update
    assert (KINDS[SR].stream, KINDS[SW].stream, KINDS[SR].resource, KINDS[SW].resource) == ("ssd_read", "ssd_write", "ssd", "ssd")


def test_ssd_bytes_come_from_the_stage_specs():
    """An SSD read or write moves the group's optimizer states (2 x state_bytes, AdamW's m and
    v in the layout's state dtype) and, with nvme_masters, its master (update_bytes)."""
    from dataclasses import replace as dc_replace

    from shfx.passes.meta import get_meta

    specs = [dc_replace(sp, state_bytes=3000 + sp.index) for sp in chain(3, prefetch_bytes=1000)]
    for masters in (False, True):
        p = shfx.Stronghold(window=2, nvme=True, host_window=2, nvme_masters=masters).program(specs)
        got = {str(get_meta(n).action): get_meta(n).bytes for n in p.nodes if str(get_meta(n).action)[:2] in ("SR", "SW")}
        want = {f"{k}{g}": 2 * (3000 + g) + (1000 if masters else 0) for g in range(3) for k in ("SR", "SW")}
        assert got == want
        assert p.bytes_moved()["ssd_read"] == p.bytes_moved()["ssd_write"] == sum(want.values()) // 2


def test_nvme_policy_fields():
    pol = shfx.Stronghold(nvme=True)
    assert pol.auto == ("host_window",) and shfx.Stronghold().auto == ()
    assert repr(shfx.Stronghold()) == "Stronghold(window=2, resident_first=0, deferred_update=False)"
    assert "host_window=3" in repr(shfx.ZeroInfinity(nvme=True, host_window=3))
    with pytest.raises(ScheduleError, match="leaves host_window to the tuner"):
        pol.program(chain(3))
    with pytest.raises(ValueError, match=r"host_window must be an int >= 1 or 'auto' \(in Stronghold\(...\)\), got 0"):
        shfx.Stronghold(nvme=True, host_window=0)
    with pytest.raises(ValueError, match="nvme_masters=True.*needs nvme=True"):
        shfx.ZeroInfinity(nvme_masters=True)
    with pytest.raises(TypeError, match=r"Stronghold\(nvme=...\) must be True or False"):
        shfx.Stronghold(nvme=1)
    # the window clamps to the groups on the SSD; names say the tier
    p = shfx.Stronghold(window=2, nvme=True, host_window=9).program(chain(3))
    assert (p.host_window, p.name) == (3, "stronghold(W=2, nvme H=3)")
    assert shfx.ZeroInfinity(nvme=True, host_window=1).program(chain(3)).name == "zero-infinity(nvme H=1)"


def test_compile_runs_the_nvme_tier_only_with_an_offload_spec():
    # (the runtime runs it since issue 12 part 3: tests/test_nvme_runtime.py; without a spec saying
    # where the SSD store lives a policy asking for the tier is refused up front)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(shfx.errors.UsageError, match="offload=shfx.Offload"):
        shfx.compile(model, policy=shfx.Stronghold(nvme=True, host_window=1), optimizer=shfx.optim.AdamW())
    # planning builds the same programs
    opts = PipelineOptions(policy=shfx.Stronghold(nvme=True, host_window=1), plan_only=True)
    v = compile_variant(model, (torch.randn(3, 4),), {}, opts)
    assert v.train.ssd_groups and v.train.count(shfx.passes.actions.SR) == len(v.train.ssd_groups)
