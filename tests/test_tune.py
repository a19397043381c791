"""The window tuner on synthetic costs, the report, and window="auto" end to end."""

from __future__ import annotations

import json

import pytest
import torch
from zoo import gpt_tied, token_batch

import shfx
from shfx.cost_model.costs import CostTable, Links, StageCost
from shfx.cost_model.tune import NoWindowFits, tune_window
from shfx.passes.stages import chain

MB = 1 << 20


def costs(bps, n=8, f=0.01, b=0.03, u=0.002):
    return CostTable([StageCost(f, b, update_s=u)] * n, Links(bps, bps))


def specs(n=8, act=1 * MB):
    return chain(n, prefetch_bytes=10 * MB, activation_bytes=act)


def test_fast_link_picks_a_small_window():
    r = tune_window(specs(), costs(100e9))  # a 10 MB stage moves in 0.1 ms, computes in 10 ms
    assert r.window in (1, 2)
    assert r.chosen.bottleneck == "compute"
    assert "compute-bound" in r.reason


def test_slow_link_picks_a_larger_window():
    fast = tune_window(specs(), costs(100e9)).window
    r = tune_window(specs(), costs(2e9))  # 5 ms per transfer: hidden only with a deeper window
    assert r.window > fast
    smaller = r.row(r.window - 1)
    assert smaller.step_s > r.chosen.step_s * 1.02
    assert f"W={r.window - 1} would be" in r.reason


def test_choice_is_smallest_within_tolerance_of_best():
    r = tune_window(specs(), costs(2e9), tolerance=0.02)
    best = min(x.step_s for x in r.rows)
    assert r.chosen.step_s <= best * 1.02
    assert all(x.step_s > best * 1.02 for x in r.rows if x.window < r.window)
    loose = tune_window(specs(), costs(2e9), tolerance=0.5)
    assert loose.window <= r.window


def test_budget_excludes_large_windows():
    full = tune_window(specs(), costs(1e9))
    cap = full.row(3).peak_device_bytes
    r = tune_window(specs(), costs(1e9), capacity_bytes=cap)
    assert r.window <= 3 and all(not x.fits for x in r.rows if x.window > 3)
    assert "does not fit" in r.reason


def test_no_window_fits():
    with pytest.raises(NoWindowFits, match="even W=1 needs"):
        tune_window(specs(), costs(1e9), capacity_bytes=1 * MB)


def test_host_optimizer_bound_is_reported():
    r = tune_window(specs(), costs(100e9, u=0.2))  # updates far slower than backward
    assert r.chosen.bottleneck == "host optimizer"


def test_auto_window_end_to_end(tmp_path):
    """window="auto" on the emulated device: profiles, tunes, trains, reports."""
    chosen = {}
    for name, bw in (("slow", "10MB/s"), ("fast", None)):  # slow: link-bound even on a loaded machine
        torch.manual_seed(0)
        cm = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(memory="64MiB", h2d=bw, d2h=bw), window="auto", optimizer=shfx.optim.AdamW())
        (x, y), _, _ = token_batch(0)
        for _ in range(3):
            cm(x, y).backward()
            cm.step()
            cm.zero_grad()
        rep = cm.report()
        chosen[name] = rep.window
        assert cm.program.num_slots == rep.window
        assert len(rep.measured_s) == 3 and rep.measured_median_s > 0
        text = str(rep)
        assert "window=auto" in text and "<- chosen" in text and "measured:" in text
        if name == "slow":
            assert rep.tune.chosen.bottleneck == "link"
            # one slot cannot overlap any transfer: clearly slower than the choice
            assert rep.tune.row(1).step_s > 1.2 * rep.tune.chosen.step_s
            trace = json.loads(open(rep.save_trace(tmp_path / "trace.json")).read())
            assert trace["traceEvents"]
            rep.save_json(tmp_path / "report.json")
        cm.close()
    # NOTE: >=, not >: how much W=3 gains over W=2 on the slow link (~3% here, against a 2%
    # tolerance) depends on compute speed, which other processes on the machine change
    assert chosen["slow"] >= chosen["fast"] >= 1


def test_report_for_a_fixed_window():
    torch.manual_seed(0)
    cm = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(memory="64MiB"), window=2, optimizer=shfx.optim.AdamW())
    (x, y), _, _ = token_batch(0)
    cm(x, y).backward()
    cm.step()
    rep = cm.report()
    assert rep.window == 2 and rep.how == "fixed"
    assert "set by the user" in str(rep)
    cm.close()


def test_auto_window_budget_too_small():
    torch.manual_seed(0)
    cm = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(memory="8KiB"), window="auto")
    (x, y), _, _ = token_batch(0)
    with pytest.raises(shfx.OutOfDeviceMemory, match="too small for one stage"):
        cm(x, y)
    cm.close()


def test_invalid_auto_arguments():
    with pytest.raises(ValueError, match="window must be an int >= 1 or 'auto'"):
        shfx.compile(gpt_tied(), window="big")
    with pytest.raises(ValueError, match="tune_tolerance"):
        shfx.compile(gpt_tied(), window="auto", tune_tolerance=2)


def test_shfx_tune_cli_analytic(capsys, tmp_path):
    from shfx.cli import main

    code = main(["tune", "--hardware", "V100-32GB-PCIe3", "--layers", "16", "--hidden", "1024", "--heads", "16",
                 "--seq", "512", "--batch", "2", "--vocab", "8192", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0
    assert "analytic: nothing runs" in out and "<- chosen" in out and "chose window" in out
    assert json.loads((tmp_path / "r.json").read_text())["chosen"] >= 1


def test_shfx_tune_cli_emulated(capsys):
    from shfx.cli import main

    code = main(["tune", "--device", "emulated", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16",
                 "--batch", "2", "--steps", "2", "--h2d", "200MB/s", "--d2h", "200MB/s"])
    out = capsys.readouterr().out
    assert code == 0 and "window=auto" in out and "measured:" in out


def test_report_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from shfx.cost_model.report import WindowReport

    r = tune_window(specs(), costs(2e9), capacity_bytes=200 * MB)
    rep = WindowReport(r, r.window, "synthetic", "auto", [0.1, 0.1])
    path = rep.plot(tmp_path / "w.png")
    assert (tmp_path / "w.png").stat().st_size > 1000 and path.endswith("w.png")


def test_profiling_gives_back_device_memory():
    torch.manual_seed(0)
    cm = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(memory="64MiB"), window=1, optimizer=shfx.optim.AdamW())
    (x, y), _, _ = token_batch(0)
    cm(x, y).backward()
    cm.step()
    pool = list(cm.engine.pool.sizes)
    used = cm.backend.used_bytes
    cm.report()  # profiles with a window-2 program
    assert cm.engine.pool.sizes == pool and cm.backend.used_bytes == used
    cm.close()
