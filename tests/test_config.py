"""shfx.config: compile()'s options made once into a frozen, normalised Config; the conflict
table refuses each combination it lists with its reason and fix, and accepts one it does not."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn as nn

import shfx
from shfx.config import CONFLICTS, Config
from shfx.errors import ConfigConflict, UsageError
from shfx.passes.policies import FunctionPolicy


def _config(**kw) -> Config:
    return Config.from_args(**{"device": "emulated", **kw})


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])


def test_frozen():
    c = _config(optimizer=shfx.optim.AdamW())
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.rollback = True  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.policy = shfx.Resident()  # type: ignore[misc]


def test_made_once_and_the_engine_is_built_from_it(monkeypatch):
    made = []
    from_args = Config.from_args.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(Config, "from_args", classmethod(lambda cls, **kw: made.append(kw) or from_args(cls, **kw)))
    cm = shfx.compile(
        _net(), device=shfx.EmulatedDevice(), optimizer=shfx.optim.AdamW(lr=1e-3), blocks=False, num_stages=4,
        max_grad_norm=1.0, recompute="full", grad_accum_steps=2,
    )  # fmt: skip
    for _ in range(2):
        cm(torch.randn(2, 8)).sum().backward()
    cm.step()
    cm.zero_grad()
    assert len(made) == 1
    c = cm.config
    assert c is cm.config and isinstance(c, Config)
    eng = cm.engine
    assert (eng.grad_accum_steps, eng.recompute, eng.overlap_update, eng.scaler) == (2, "full", True, None)
    assert eng.clip == (1.0, 2.0) and len(eng.clip_order) == 8  # every parameter, in the model's order
    assert cm.policy is c.policy and c.policy.deferred_update
    cm.close()


@pytest.mark.parametrize("given", ["bf16", "bfloat16", "BF16", torch.bfloat16])
def test_precision_aliases(given):
    c = _config(precision=given)
    assert (c.precision, c.working_dtype, c.scaler, c.skip_nonfinite) == ("bf16", torch.bfloat16, None, False)


def test_fp16_brings_its_scaler_skipping_and_rollback():
    c = _config(precision="float16", optimizer=shfx.optim.AdamW())
    assert c.precision == "fp16" and isinstance(c.scaler, shfx.LossScaler)
    assert c.skip_nonfinite and c.rollback  # an overflowing step is skipped, the overlapped updates undone
    c = _config(precision="fp16", overlap_update=False)
    assert c.skip_nonfinite and not c.rollback  # the updates start after the check: nothing to undo


def test_window_and_policy_resolution():
    assert _config().policy == shfx.Stronghold(window=2)
    assert _config(window=3).policy == shfx.Stronghold(window=3)
    assert _config(policy="stronghold", window="auto").window == "auto"
    assert _config(policy="resident").policy == shfx.Resident() and _config(policy="resident").window is None
    assert _config(policy=shfx.ZeroInfinity(lookahead=2)).policy == shfx.ZeroInfinity(lookahead=2)

    def fn(specs, window):  # a function policy
        raise AssertionError

    pol = _config(policy=fn, window=3).policy
    assert isinstance(pol, FunctionPolicy) and pol.window == 3
    with pytest.raises(ValueError, match="policy 'resident' has no window"):
        _config(policy="resident", window=2)


def test_other_normalisations(tmp_path):
    c = _config()
    assert isinstance(c.device, shfx.EmulatedDevice) and c.dynamic == "auto" and c.rollback is False
    assert _config(dynamic=None).dynamic == "auto"
    assert Config.from_args(device="cuda:1").device == shfx.CudaDevice(index=1)  # nothing started: no GPU needed
    assert _config(skip_nonfinite=True).rollback is True  # overlapped updates are undone on a skip
    assert _config(skip_nonfinite=True, overlap_update=False).rollback is False
    # exact clipping turns on the policy's deferred update (with overlapped updates only)
    opt = shfx.optim.AdamW()
    assert _config(optimizer=opt, max_grad_norm=1.0, policy=shfx.ZeroOffload()).policy == shfx.ZeroOffload(deferred_update=True)
    assert _config(optimizer=opt, max_grad_norm=1.0, overlap_update=False).policy == shfx.Stronghold(window=2)
    # an NVMe Offload spec sets the policy's tier
    off = shfx.Offload(optimizer="nvme", path=str(tmp_path), host_window=3)
    pol = _config(optimizer=opt, offload=off, policy=shfx.ZeroInfinity()).policy
    assert (pol.nvme, pol.host_window) == (True, 3)
    pol = _config(optimizer=opt, offload=shfx.Offload(optimizer="nvme", path=str(tmp_path))).policy
    assert (pol.nvme, pol.host_window) == (True, "auto")


def _triggers(tmp_path) -> dict[str, dict]:
    """Per row of the conflict table, options that have that conflict (and no earlier one)."""
    opt = shfx.optim.AdamW
    nvme = dict(optimizer="nvme", path=str(tmp_path))
    return {
        "scaler without fp16": dict(precision="bf16", scaler=shfx.LossScaler()),
        "fp32_norms in fp32": dict(fp32_norms=True),
        "fp16 overlapped without rollback": dict(precision="fp16", rollback=False),
        "clipping without an optimizer": dict(max_grad_norm=1.0),
        "clipping with updates during the backward": dict(optimizer=opt(), max_grad_norm=1.0, policy="resident"),
        "clipping with device updates (resident_first)": dict(
            optimizer=opt(), max_grad_norm=1.0, policy=shfx.Stronghold(window=2, resident_first=1)
        ),
        "clipping with a delayed update": dict(optimizer=opt(), max_grad_norm=1.0, policy=shfx.ZeroOffload(delayed_update=True)),
        "skip_nonfinite with a delayed update": dict(skip_nonfinite=True, policy=shfx.ZeroOffload(delayed_update=True)),
        "skip_nonfinite overlapped without rollback": dict(skip_nonfinite=True, rollback=False),
        "NVMe policy without an Offload spec": dict(optimizer=opt(), policy=shfx.Stronghold(nvme=True, host_window=1)),
        "NVMe tier without an optimizer": dict(offload=shfx.Offload(**nvme)),
        "NVMe tier with rollback": dict(optimizer=opt(), offload=shfx.Offload(**nvme), rollback=True),
        "host window given twice": dict(
            optimizer=opt(), offload=shfx.Offload(**nvme, host_window=3), policy=shfx.Stronghold(nvme=True, host_window=2)
        ),
    }


def test_every_row_has_a_trigger(tmp_path):
    assert list(_triggers(tmp_path)) == [row.name for row in CONFLICTS]


@pytest.mark.parametrize("row", CONFLICTS, ids=[row.name for row in CONFLICTS])
def test_each_conflict_is_refused_with_its_reason_and_fix(tmp_path, row):
    kw = _triggers(tmp_path)[row.name]
    with pytest.raises(ConfigConflict) as e:
        _config(**kw)
    assert e.value.conflict is row
    assert isinstance(e.value, ValueError) and isinstance(e.value, UsageError)  # as the checks it replaced raised
    msg = str(e.value)
    assert row.reason.split("{")[0] in msg and msg.endswith(f"; {row.fix}"), msg  # "<reason>; <fix>"
    # the same through shfx.compile, before anything starts
    with pytest.raises(ConfigConflict, match=re.escape(row.fix)):
        shfx.compile(_net(), device=shfx.EmulatedDevice(), **kw)


def test_a_combination_not_in_the_table_is_accepted(tmp_path):
    accepted = [
        # fp16 whose updates start in step(): nothing to roll back
        dict(precision="fp16", overlap_update=False, rollback=False, optimizer=shfx.optim.AdamW()),
        # clipping with updates in step() (a policy updating on the device is refused by the
        # updates-in-step pass at the first call: tests/test_features.py)
        dict(optimizer=shfx.optim.AdamW(), max_grad_norm=1.0, overlap_update=False, policy="zero-infinity"),
        # mixed precision, norms in fp32, clipping, skipping, ZeRO-Offload's deferred schedule
        dict(precision="bf16", fp32_norms=True, optimizer=shfx.optim.AdamW(), max_grad_norm=0.5,
             norm_type=float("inf"), skip_nonfinite=True, policy=shfx.ZeroOffload()),  # fmt: skip
        # the NVMe tier with clipping, the host window given once
        dict(optimizer=shfx.optim.AdamW(), max_grad_norm=1.0, policy=shfx.ZeroInfinity(nvme=True, host_window=2),
             offload=shfx.Offload(optimizer="nvme", path=str(tmp_path))),  # fmt: skip
    ]
    for kw in accepted:
        c = _config(**kw)
        assert not [row.name for row in CONFLICTS if row.applies(c)]
    cm = shfx.compile(_net(), device=shfx.EmulatedDevice(), blocks=False, num_stages=4, **accepted[2])
    assert cm.config.policy == shfx.ZeroOffload(deferred_update=True)
    cm(torch.randn(2, 8)).float().sum().backward()
    cm.step()
    cm.close()


def test_replace_checks_the_table_again():
    c = _config(skip_nonfinite=True)
    assert c.replace(overlap_update=False, rollback=False).rollback is False
    with pytest.raises(ConfigConflict, match="needs rollback=True"):
        c.replace(rollback=False)


def test_argument_errors_say_what_was_given():
    for kw, match in [
        (dict(recompute="some"), "recompute must be 'auto', 'early-stop' or 'full', got 'some'"),
        (dict(tune_tolerance=1.5), r"tune_tolerance must be in \[0, 1\), got 1.5"),
        (dict(grad_accum_steps=0), "grad_accum_steps must be an int >= 1, got 0"),
        (dict(precision="int8"), "precision must be 'fp32', 'bf16' or 'fp16'"),
        (dict(window=0), "window must be >= 1"),
        (dict(max_captures=0), "max_captures must be an int >= 1"),
        (dict(device="cpu"), "device='cpu' is not supported"),
        (dict(optimizer=shfx.optim.AdamW(), max_grad_norm=float("inf")), "max_grad_norm must be finite"),
    ]:
        with pytest.raises(ValueError, match=match):
            _config(**kw)
    for kw, match in [
        (dict(optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)), "optimizer must be shfx.optim.AdamW"),
        (dict(precision="fp16", scaler=1.0), "scaler must be a shfx.LossScaler, got float"),
        (dict(offload="nvme"), "offload must be a shfx.Offload"),
        (dict(data_parallel="yes"), "data_parallel must be True, False or shfx.DataParallel"),
        (dict(dynamic=[1]), "dynamic must be 'auto'"),
    ]:
        with pytest.raises(TypeError, match=match):
            _config(**kw)
