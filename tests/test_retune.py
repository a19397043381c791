"""cm.retune(): re-profile and re-tune between steps, rebuild the programs when the choice
changes, and go on training exactly like eager PyTorch.

The profiles are synthetic (``shfx.profiler.profile_costs`` monkeypatched to return fixed
costs), so which window or k the tuner picks does not depend on the machine's load."""

from __future__ import annotations

import copy

import pytest
import torch
from equivalence import assert_same_state
from zoo import gpt_tied, loss_of, token_batch

import shfx
import shfx.profiler
from shfx.cost_model.costs import CostTable, Links, ProfileStats, StageCost

LR, WD = 1e-2, 0.01


def fast_link(specs):
    """Compute-bound: a shallow window (W <= 2)."""
    return CostTable([StageCost(3e-4, 9e-4, update_s=5e-5)] * len(specs), Links(25e9, 25e9, latency_s=1e-4), source="synthetic: fast link")


def slow_link(specs):
    """A 10 MB/s link: link-bound, a deep window (W >= 3)."""
    return CostTable([StageCost(3e-4, 9e-4, update_s=5e-5)] * len(specs), Links(10e6, 10e6, latency_s=1e-4), source="synthetic: slow link")


def slow_host(specs):
    """Host updates 10x a backward, device updates cheap: keeping first stages with their
    optimizer on the device (k >= 1) pays."""
    return CostTable(
        [StageCost(3e-4, 9e-4, update_s=9e-3, device_update_s=1e-5)] * len(specs), Links(25e9, 25e9), source="synthetic: slow host"
    )


class FakeProfiler:
    """Stands in for shfx.profiler.profile_costs; returns ``costs(specs)``, ``costs`` settable."""

    def __init__(self, costs):
        self.costs = costs
        self.calls: list[dict] = []

    def __call__(self, engine, variant, inputs, **kw):
        self.calls.append(kw)
        table = self.costs(variant.graph.specs)
        table.extra["profile"] = ProfileStats(5, 0.1, {"compute": 0.01}, True)
        return table


def train(cm, ref, opt, steps, start, losses, ref_losses):
    for step in range(start, start + steps):
        args, kwargs, aux = token_batch(step)
        torch.manual_seed(10_000 + step)
        loss = loss_of(cm(*args, **kwargs), aux)
        loss.backward()
        losses.append(loss.item())
        torch.manual_seed(10_000 + step)
        ref_loss = loss_of(ref(*args, **kwargs), aux)
        ref_loss.backward()
        ref_losses.append(ref_loss.item())
        cm.step()
        cm.zero_grad()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize(
    "policy,before,after",
    [
        (shfx.Stronghold(window="auto"), fast_link, slow_link),
        (shfx.Stronghold(window="auto"), slow_link, fast_link),
        (shfx.Stronghold(window="auto", resident_first="auto"), fast_link, slow_host),  # host -> device optimizer
        (shfx.Stronghold(window="auto", resident_first="auto"), slow_host, fast_link),  # device -> host optimizer
    ],
    ids=["deeper", "shallower", "k-up", "k-down"],
)
def test_retune_changes_the_program_and_trains_like_eager(monkeypatch, policy, before, after):
    fake = FakeProfiler(before)
    monkeypatch.setattr(shfx.profiler, "profile_costs", fake)
    torch.manual_seed(0)
    model = gpt_tied()
    ref = copy.deepcopy(model)
    cm = shfx.compile(
        model, device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None), policy=policy,
        optimizer=shfx.optim.AdamW(lr=LR, weight_decay=WD),
    )  # fmt: skip
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    losses: list[float] = []
    ref_losses: list[float] = []
    train(cm, ref, opt, 3, 0, losses, ref_losses)
    old_program, old_report = cm.program, cm.report()
    old_choice = (old_report.tune.resident_first, old_report.window)

    fake.costs = after
    rep = cm.retune()
    assert fake.calls[-1] == {"refresh": True}  # the cache is bypassed and replaced
    new_choice = (rep.tune.resident_first, rep.window)
    assert new_choice != old_choice
    assert cm.report() is rep and rep.how == "auto" and rep.tune.source.startswith("synthetic: ")
    assert cm.program is not old_program
    assert cm.program.persistent == tuple(range(rep.tune.resident_first))
    assert cm.program.num_slots == rep.tune.resident_first + rep.window
    assert rep.steps_s == [] and "no steps yet" in str(rep)

    train(cm, ref, opt, 3, 3, losses, ref_losses)
    assert len(rep.steps_s) == 3 and len(old_report.steps_s) == 6
    assert losses == ref_losses
    cm.sync()
    assert_same_state(model, ref, rtol=0, atol=0)
    stats = cm.stats()
    assert stats["window"] == cm.program.num_slots
    cm.close()


def test_retune_keeps_the_program_when_the_choice_stands(monkeypatch):
    fake = FakeProfiler(slow_link)
    monkeypatch.setattr(shfx.profiler, "profile_costs", fake)
    cm = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(memory="64MiB"), window="auto", optimizer=shfx.optim.AdamW())
    (x, y), _, _ = token_batch(0)
    cm(x, y).backward()
    cm.step()
    program, report = cm.program, cm.report()
    rep = cm.retune()
    assert rep is not report and rep.window == report.window
    assert cm.program is program
    cm.close()


def test_retune_with_a_fixed_window_refreshes_the_prediction(monkeypatch):
    fake = FakeProfiler(fast_link)
    monkeypatch.setattr(shfx.profiler, "profile_costs", fake)
    cm = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(memory="64MiB"), window=2, optimizer=shfx.optim.AdamW())
    (x, y), _, _ = token_batch(0)
    cm(x, y).backward()
    cm.step()
    first = cm.report()
    assert first.how == "fixed" and first.tune.source == "synthetic: fast link"
    program = cm.program
    fake.costs = slow_link
    rep = cm.retune()
    assert rep.how == "fixed" and rep.window == 2 and rep.tune.source == "synthetic: slow link"
    assert rep.predicted_s > first.predicted_s  # the slow link's prediction for the same window
    assert rep.tune.window != 2 and "the tuner would choose" in str(rep)
    assert cm.program is program  # a fixed window is the user's: not rebuilt
    cm.close()


def test_retune_refuses_in_the_middle_of_a_step():
    cm = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(memory="64MiB"), window=2, optimizer=shfx.optim.AdamW())
    with pytest.raises(shfx.UsageError, match="call the model first"):
        cm.retune()
    (x, y), _, _ = token_batch(0)
    loss = cm(x, y)
    with pytest.raises(shfx.UsageError, match=r"between steps.*cm.step\(\) first"):
        cm.retune()  # a forward waiting for its backward
    loss.backward()
    with pytest.raises(shfx.UsageError, match=r"between steps.*cm.step\(\) first"):
        cm.retune()  # the update started by backward is pending
    cm.step()
    cm.zero_grad()
    cm.close()


def test_retune_needs_a_windowed_policy():
    cm = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(memory="64MiB"), policy="resident", optimizer=shfx.optim.AdamW())
    (x, y), _, _ = token_batch(0)
    cm(x, y).backward()
    cm.step()
    with pytest.raises(shfx.UsageError, match="policy 'resident' has none"):
        cm.retune()
    cm.close()


def test_retune_profiles_again_for_real():
    """Without a fake: the new report's profile is a new one (the cached one is replaced)."""
    torch.manual_seed(0)
    cm = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(memory="64MiB", h2d="50MB/s", d2h="50MB/s"), window="auto", optimizer=shfx.optim.AdamW())
    (x, y), _, _ = token_batch(0)
    cm(x, y).backward()
    cm.step()
    cm.zero_grad()
    before = cm.report()
    rep = cm.retune()
    assert rep.profile is not None and rep.profile is not before.profile
    assert rep.first_step == 1 and cm.program.num_slots == rep.window
    cm(x, y).backward()
    cm.step()
    assert len(rep.steps_s) == 1 and len(rep.measured_s) == 2
    cm.close()


def test_the_profile_takes_the_inputs_in_16_bits():
    """Mixed precision with floating-point inputs (issue 25, found under data parallel): the
    profile's timing steps get the inputs cast to the 16-bit dtype, as a call does (they were
    given the fp32 inputs, and the first F failed: "mat1 and mat2 must have the same dtype"),
    for window="auto" at the first call and cm.report() with a fixed window (fp16; bf16 alike)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    kw = dict(device=shfx.EmulatedDevice(memory="16MiB"), precision="fp16", blocks=False, num_stages=4, overlap_update=False)
    x = torch.randn(4, 16)
    for window in ("auto", 2):
        cm = shfx.compile(copy.deepcopy(model), window=window, optimizer=shfx.optim.AdamW(), **kw)
        cm.scale_loss(cm(x).float().pow(2).mean()).backward()
        cm.step()
        assert cm.report().window == cm.program.num_slots
        cm.close()
