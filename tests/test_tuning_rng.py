"""Tuning and profiling leave the user's random state alone: ``window="auto"``, the NVMe tier's
``host_window="auto"``, ``cm.report()`` and ``cm.retune()`` run the model for measurement
(dropout draws from the global generators), and a model with dropout must still train
bitwise as with a fixed window and as eager PyTorch.

NOTE: every run seeds ONCE, before its first step, and never between steps: reseeding before
each step (what the equivalence tests do) hides draws made by the tuner at the first call.
The profiler's process-wide cache is emptied per test, so every run here really profiles.
(``recompute`` is left at its default, ``"auto"``: early stop and full recompute both draw
eager's masks for this model.)"""

from __future__ import annotations

import functools

import pytest
import torch
from zoo import gpt_dropout, loss_of, token_batch

import shfx
from shfx import profiler

STEPS = 3
LR, WD = 1e-2, 0.01


def _device() -> shfx.EmulatedDevice:
    return shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None)


def _train(model, call, step_fn, between=None):
    """``STEPS`` steps with one seed at the start; (losses, the CPU RNG state right after the
    first forward, the model's state)."""
    torch.manual_seed(1234)
    losses, rng_after_first = [], None
    for step in range(STEPS):
        if between is not None and step:
            between(step)
        args, kwargs, aux = token_batch(step)
        loss = loss_of(call(*args, **kwargs), aux)
        if step == 0:
            rng_after_first = torch.get_rng_state()
        loss.backward()
        step_fn()
        losses.append(loss.detach().clone())
    return losses, rng_after_first


@functools.cache
def eager():
    torch.manual_seed(0)
    model = gpt_dropout()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)

    def step() -> None:
        opt.step()
        opt.zero_grad()

    losses, rng = _train(model, model, step)
    return losses, rng, {k: v.clone() for k, v in model.state_dict().items()}


def run_shfx(between=None, **kw):
    torch.manual_seed(0)
    model = gpt_dropout()
    cm = shfx.compile(
        model, device=_device(), optimizer=shfx.optim.AdamW(lr=LR, weight_decay=WD), **kw
    )  # fmt: skip

    def step() -> None:
        cm.step()
        cm.zero_grad()

    losses, rng = _train(model, cm, step, None if between is None else lambda s: between(cm, s))
    cm.sync()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    cm.close()
    return losses, rng, state


@functools.cache
def fixed():
    return run_shfx(window=2)


def assert_same(got, want, what: str) -> None:
    losses, rng, state = got
    ref_losses, ref_rng, ref_state = want
    assert torch.equal(rng, ref_rng), f"{what}: the CPU RNG state after the first (tuning) call differs"
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), f"{what}: losses {losses} vs {ref_losses}"
    assert state.keys() == ref_state.keys()
    for k in state:
        assert torch.equal(state[k], ref_state[k]), f"{what}: {k}"


@pytest.fixture(autouse=True)
def _fresh_profile_cache(monkeypatch):
    monkeypatch.setattr(profiler, "_CACHE", {})


def test_fixed_window_is_eager():
    # the baseline the others rely on: with one seed and no reseeding, window=2 is eager
    assert_same(fixed(), eager(), "window=2 vs eager")


def test_auto_window_trains_as_a_fixed_window():
    got = run_shfx(window="auto")
    assert_same(got, fixed(), "window='auto' vs window=2")
    assert_same(got, eager(), "window='auto' vs eager")


def test_auto_host_window_trains_as_eager(tmp_path):
    off = shfx.Offload(optimizer="nvme", path=str(tmp_path / "ssd"), nvme_read="200MB/s", nvme_write="200MB/s")
    assert off.host_window == "auto"
    got = run_shfx(policy=shfx.Stronghold(window=2), offload=off)
    assert_same(got, eager(), "host_window='auto' vs eager")


def test_report_and_retune_between_steps_leave_the_masks_alone():
    calls = []

    def between(cm, step: int) -> None:
        before = torch.get_rng_state()
        rep = cm.report() if step == 1 else cm.retune()  # both profile (a fixed window: report once)
        calls.append(rep)
        assert torch.equal(torch.get_rng_state(), before), f"step {step}: profiling moved the CPU generator"

    got = run_shfx(between, window=2)
    assert len(calls) == STEPS - 1
    assert_same(got, eager(), "report()/retune() between steps vs eager")
