"""The profiler's rounds and statistic on synthetic samples, a profile with injected bursts of
load, and the cache. No assertion here depends on how fast the machine is: bursts are sleeps
far longer than the tiny model's actions, and the round logic runs on a fake clock."""

from __future__ import annotations

import dataclasses
import itertools
import statistics

import pytest
import torch
from zoo import gpt_dropout, gpt_tied, token_batch

import shfx
import shfx.profiler as profiler
from shfx.cost_model.costs import ProfileStats
from shfx.profiler import low_median, profile_costs, run_rounds, spread


class FakeClock:
    """A clock that each sample advances by a fixed step."""

    def __init__(self, step: float = 1.0):
        self.t = 0.0
        self.step = step

    def __call__(self) -> float:
        return self.t

    def tick(self) -> None:
        self.t += self.step


def sampler(values, clock: FakeClock | None = None, key: str = "F0", family: str = "compute"):
    it = iter(values)

    def sample() -> dict[str, float]:
        if clock is not None:
            clock.tick()
        return {key: next(it)}

    return sample, (lambda k: family)


def test_low_median_and_spread():
    quiet = [0.010, 0.0102, 0.0099, 0.0101]
    bursts = [0.05, 0.09, 0.04]
    assert low_median(quiet + bursts) == pytest.approx(statistics.median(sorted(quiet)[:4]))
    assert low_median(quiet) <= statistics.median(quiet)
    assert low_median([3.0]) == 3.0
    assert spread([1.0] * 5) == 0.0 and spread([1.0, 1.0, 2.0, 2.0]) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        low_median([])


@pytest.mark.parametrize("burst_rounds", [(), (0,), (1, 3), (0, 2, 4)])
def test_bursts_in_a_few_rounds_leave_the_quiet_cost(burst_rounds):
    """Up to 3 of 5 rounds slowed 5x: the estimate is a quiet round's, and five rounds do."""
    quiet = [0.0100, 0.0101, 0.0099, 0.0102, 0.0100]
    values = [0.02] + [5 * q if i in burst_rounds else q for i, q in enumerate(quiet)]  # warm-up first
    sample, family = sampler(values)
    est, samples, stats = run_rounds(sample, family)
    assert min(quiet) <= est["F0"] <= max(quiet)
    assert stats.rounds == 5 and stats.steady
    assert samples["F0"] == values[1:]  # the warm-up round is not kept


def test_a_noisy_profile_takes_more_rounds_until_the_fast_half_agrees():
    """Four of the first five rounds slowed: more rounds run until enough quiet ones."""
    values = [0.02] + [0.05, 0.01, 0.06, 0.05, 0.07] + [0.01] * 10
    clock = FakeClock()
    sample, family = sampler(values, clock)
    est, samples, stats = run_rounds(sample, family, clock=clock)
    assert est["F0"] == pytest.approx(0.01)
    assert stats.steady and stats.rounds == 6  # the second quiet round: low_median of 6 is the 2nd fastest


def test_extra_rounds_stop_at_the_time_budget():
    """A profile that never steadies stops when the extra rounds took as long as the first
    ones (budget=1.0), and says it was not steady."""
    values = itertools.cycle([0.01, 0.05, 0.09, 0.03, 0.07])
    clock = FakeClock(step=1.0)  # every round takes 1 s
    sample, family = sampler(values, clock)
    _, _, stats = run_rounds(sample, family, rounds=5, max_rounds=100, budget=1.0, clock=clock)
    assert not stats.steady
    assert stats.rounds == 11  # warm-up + 5 rounds = 6 s; 6 more seconds of extra rounds
    assert stats.seconds <= 2 * 6 + 1e-9
    clock = FakeClock(step=1.0)
    _, _, capped = run_rounds(sampler(values, clock)[0], family, rounds=5, max_rounds=8, budget=100.0, clock=clock)
    assert capped.rounds == 8 and not capped.steady
    assert "noisy" in capped.summary()


def test_noise_in_a_small_family_does_not_make_a_profile_noisy():
    """Microsecond actions (a tiny model's gradient adds) jitter by 100% and more; measured
    against a whole round that cannot move a prediction, so five rounds do."""
    sums = iter([(0.02, 1e-5)] + [(0.010, 1e-5), (0.010, 5e-5), (0.0101, 2e-5), (0.0099, 9e-5), (0.010, 1e-5)])

    def sample() -> dict[str, float]:
        f, a = next(sums)
        return {"F0": f, "add 0": a}

    fam = {"F0": "compute", "add 0": "host"}
    est, _, stats = run_rounds(sample, fam.get)
    assert stats.rounds == 5 and stats.steady
    assert est["add 0"] == pytest.approx(1e-5)
    assert set(stats.spread) == {"compute"}  # families under 5% of a round are not reported


def test_run_rounds_validates_its_arguments():
    with pytest.raises(ValueError, match="rounds"):
        run_rounds(lambda: {}, lambda k: None, rounds=5, max_rounds=3)


def _compiled(model=gpt_tied, h2d=None):
    torch.manual_seed(0)
    cm = shfx.compile(model(), device=shfx.EmulatedDevice(memory="64MiB", h2d=h2d, d2h=h2d), window=2, optimizer=shfx.optim.AdamW())
    (x, y), _, _ = token_batch(0)
    cm(x, y).backward()
    cm.step()
    cm.zero_grad()
    return cm, [x, y]


def test_a_profile_with_injected_bursts_keeps_the_quiet_costs(monkeypatch):
    """Every BACKWARD of every other round is made to read 10 s longer (a burst of other load,
    injected into the trace the profiler reads: no sleeping, and far beyond anything other load
    does to the tiny model). Half the rounds, or one more, read the burst: a plain median over
    them (the old statistic) would be half the burst or all of it; the costs stay far below."""
    cm, inputs = _compiled()
    burst = 10.0
    calls = {"backward": 0}
    backward = cm.engine.backward

    def bursty_backward(*a, **k):
        out = backward(*a, **k)
        rnd = calls["backward"] // 2  # a round: one serialized and one pipelined step; 0 = warm-up
        calls["backward"] += 1
        if rnd % 2 == 1:
            tr = cm.engine.trace
            tr[:] = [dataclasses.replace(e, end=e.end + burst) if e.action.startswith("B") else e for e in tr]
        return out

    monkeypatch.setattr(cm.engine, "backward", bursty_backward)
    costs = profile_costs(cm.engine, cm.variant, inputs, cache=False)
    monkeypatch.undo()
    stats = costs.extra["profile"]
    assert isinstance(stats, ProfileStats) and stats.rounds >= 5 and calls["backward"] == 2 * (stats.rounds + 1)
    for c in costs.costs:
        assert 0 < c.backward_s < 1.0
    slowed = [x for x in costs.extra["rounds"]["pipelined B1@backward"] if x >= burst]
    assert len(slowed) == (stats.rounds + 1) // 2  # rounds 1, 3, 5, ... (0 is the warm-up)
    cm.close()


def test_profile_records_how_steady_it_was():
    cm, inputs = _compiled(h2d="50MB/s")
    costs = profile_costs(cm.engine, cm.variant, inputs, cache=False)
    stats = costs.extra["profile"]
    assert stats.rounds >= 5 and stats.seconds > 0 and stats.spread and set(stats.spread) <= {"compute", "links", "host"}
    assert all(len(v) == stats.rounds for v in costs.extra["rounds"].values())
    assert f"{stats.rounds} rounds" in stats.summary()
    rep = cm.report()
    assert rep.profile is not None and "profile: " in str(rep)
    cm.close()


ONE_ROUND = dict(rounds=1, max_rounds=1)


def test_cache_refresh_and_bypass():
    profiler.clear_cache()
    cm, inputs = _compiled()
    first = profile_costs(cm.engine, cm.variant, inputs, **ONE_ROUND)
    assert profile_costs(cm.engine, cm.variant, inputs) is first
    fresh = profile_costs(cm.engine, cm.variant, inputs, refresh=True, **ONE_ROUND)
    assert fresh is not first and profile_costs(cm.engine, cm.variant, inputs) is fresh  # replaced
    bypass = profile_costs(cm.engine, cm.variant, inputs, cache=False, **ONE_ROUND)
    assert bypass is not fresh and profile_costs(cm.engine, cm.variant, inputs) is fresh  # not stored
    cm.close()
    # another model with the same input signature and stage count has its own entry
    other, inputs = _compiled(gpt_dropout)
    assert profile_costs(other.engine, other.variant, inputs, **ONE_ROUND) is not fresh
    other.close()
    profiler.clear_cache()


def test_profiling_leaves_the_current_program():
    """The pipelined timing steps run the window-2 program; the engine's current one is given back."""
    cm, inputs = _compiled()
    current = cm.engine.current
    profile_costs(cm.engine, cm.variant, inputs, cache=False, **ONE_ROUND)
    assert cm.engine.current is current
    cm.close()
