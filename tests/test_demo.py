"""``shfx demo`` end to end (a tiny config through the CLI) and the stdlib byte dataset."""

from __future__ import annotations

import math
import re

import pytest
import torch

from shfx.cli import build_parser, main
from shfx.data import TextDataset, read_sources, stdlib_source_files
from shfx.demo import default_device_memory, estimate_device_bytes
from shfx.models import GPTShape

TINY = ["--layers", "4", "--hidden", "64", "--heads", "2", "--seq", "32", "--batch", "2", "--data-bytes", "200kB"]
_MIB = r"([0-9.]+) MiB"


def test_demo_cli_trains_a_model_larger_than_the_device(capsys):
    rc = main(["demo", "--steps", "8", "--eval-interval", "4", "--eval-batches", "2", "--lr", "1e-2", "--seed", "0", *TINY])
    out = capsys.readouterr().out
    assert rc == 0, out

    # the budget is printed, and it is below the model's parameter bytes
    m = re.search(rf"budget\s+{_MIB} = \d+% of the model's {_MIB}: the model does NOT fit", out)
    assert m, out
    budget, model = float(m.group(1)), float(m.group(2))
    assert budget < model

    # one row per logged step (all 8 here): finite losses, 2 of 6 stages resident, bytes moved
    rows = re.findall(r"^\s+(\d+)\s+([-+0-9.naif]+)\s+\S+\s+[0-9,]+\s+2/6\s+[0-9.]+ [KM]iB", out, re.M)
    assert [int(s) for s, _ in rows] == list(range(1, 9)), out
    losses = [float(v) for _, v in rows]
    assert all(math.isfinite(v) for v in losses)
    assert re.search(r"program\s+stronghold\(W=2\): \d+ actions per step", out)
    assert len(re.findall(r"validation loss \d+\.\d+", out)) == 2

    # the summary: first -> last loss, and the loss went down
    s = re.search(r"^summary: loss ([0-9.]+) \(step 1\) -> ([0-9.]+) \(step 8\).*the loss went down$", out, re.M)
    assert s, out
    assert float(s.group(2)) < float(s.group(1))
    assert float(s.group(1)) == pytest.approx(losses[0], abs=1e-4)
    peak = re.search(rf"device peak {_MIB} of a {_MIB} budget", out)
    assert peak and float(peak.group(1)) <= float(peak.group(2)) == budget


def test_demo_cli_reports_a_budget_too_small(capsys):
    rc = main(["demo", "--steps", "1", "--device-memory", "300KiB", *TINY])
    err = capsys.readouterr().err
    assert rc == 1
    assert "shfx demo: error:" in err and "window=2 needs 2 slots" in err


def test_demo_parser_flags():
    a = build_parser().parse_args(
        ["demo", "--steps", "3", "--device", "emulated", "--device-memory", "8MiB", "--h2d", "1GB/s", "--d2h", "inf", "--window", "3"]
    )
    assert (a.steps, a.device, a.device_memory, a.h2d, a.d2h, a.window) == (3, "emulated", 8 << 20, "1GB/s", "inf", 3)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--steps", "0"])


def test_default_budget_is_below_the_model_but_holds_the_window():
    cfg = GPTShape(layers=12, heads=4, hidden=128, seq=128, batch=4)
    budget = default_device_memory(cfg, window=2)
    est = estimate_device_bytes(cfg, window=2)
    assert est["slot"] == 4 * cfg.params_per_layer
    assert est["peak"] + est["slot"] < budget < 4 * cfg.num_params()


# ---- shfx.data ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_ds() -> TextDataset:
    return TextDataset.from_stdlib(max_bytes=300_000)


def test_stdlib_files_sorted_and_capped(small_ds):
    files = stdlib_source_files()
    assert files and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert len(small_ds) == 300_000
    assert len(small_ds.train) + len(small_ds.val) == 300_000 and len(small_ds.val) == 30_000
    # deterministic: the same bytes every time, starting with the first file in sorted order
    again = read_sources(files, 300_000)
    assert bytes(small_ds.tokens.tolist()) == again
    assert again.startswith(files[0].read_bytes()[:100])


def test_get_batch_shapes_shift_and_determinism(small_ds):
    x, y = small_ds.get_batch("train", 4, 64, torch.Generator().manual_seed(7))
    assert x.shape == y.shape == (4, 64) and x.dtype == y.dtype == torch.int64
    assert int(x.min()) >= 0 and int(x.max()) <= 255
    assert torch.equal(x[:, 1:], y[:, :-1])
    # y is the next byte of the corpus: find each row in the training split
    train = small_ds.train.to(torch.int64)
    for row_x, row_y in zip(x, y):
        starts = (train[: len(train) - 64] == row_x[0]).nonzero().flatten()
        assert any(torch.equal(train[s : s + 65], torch.cat([row_x, row_y[-1:]])) for s in starts.tolist())
    x2, y2 = small_ds.get_batch("train", 4, 64, torch.Generator().manual_seed(7))
    assert torch.equal(x, x2) and torch.equal(y, y2)
    xv, _ = small_ds.get_batch("val", 2, 16, torch.Generator().manual_seed(7))
    assert xv.shape == (2, 16)
    with pytest.raises(ValueError, match="split must be"):
        small_ds.get_batch("test", 1, 8)


def test_no_source_files_is_a_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("not python")
    with pytest.raises(FileNotFoundError, match=r"no Python source files \(\*\.py\) found"):
        TextDataset.from_stdlib(root=tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        stdlib_source_files(tmp_path / "missing")


# ---- mixed precision -------------------------------------------------------------------------------


def test_demo_precision_flag_takes_either_name():
    for name, want in (("bf16", "bfloat16"), ("float16", "float16"), ("fp32", "float32")):
        assert build_parser().parse_args(["demo", "--precision", name]).precision == want
    assert build_parser().parse_args(["demo"]).precision == "float32"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--precision", "half"])


def test_16_bit_budget_is_half_the_slot():
    cfg = GPTShape(layers=12, heads=4, hidden=128, seq=128, batch=4)
    e32 = estimate_device_bytes(cfg, window=2)
    e16 = estimate_device_bytes(GPTShape(layers=12, heads=4, hidden=128, seq=128, batch=4, precision="bf16"), window=2)
    assert 2 * e16["slot"] == e32["slot"] and 2 * e16["activation"] == e32["activation"]


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp16", marks=pytest.mark.slow)])  # (fp16: the slow run)
def test_demo_cli_trains_in_16_bit(capsys, precision):
    rc = main(["demo", "--steps", "8", "--eval-interval", "0", "--eval-batches", "1", "--lr", "1e-2", "--seed", "0",
               "--precision", precision, *TINY, "--layers", "6"])  # fmt: skip (6: the 16-bit model outgrows the budget)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"trained in {precision}" in out and "the model does NOT fit" in out
    assert re.search(r"^summary: loss .* -- the loss went down$", out, re.M), out
    assert ("the loss scaler skipped" in out) == (precision == "fp16")
