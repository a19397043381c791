"""The five STRONGHOLD experiments (examples/paper/*.py) run and write their tables.

Simulation on a tiny GPT and a 4 MiB device (fast: one meta capture, a few simulated steps);
one --real smoke run at 2 layers.
"""

from __future__ import annotations

import csv
import importlib
import json
import sys
from pathlib import Path

import pytest

PAPER = Path(__file__).resolve().parent.parent / "examples" / "paper"
TINY = ["--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "4", "--vocab", "256",
        "--device-memory", "6MiB", "--host-memory", "16MiB", "--workspace", "0", "--max-layers", "200"]


def script(name: str):
    if str(PAPER) not in sys.path:
        sys.path.insert(0, str(PAPER))
    return importlib.import_module(name)


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(
    "name,extra",
    [
        ("largest_model", []),
        ("baselines_at_their_largest", []),
        ("all_at_resident_largest", []),
        ("time_vs_layers", ["--layers", "2,4,8"]),
        ("time_vs_window", ["--layers", "6", "--windows", "1,2,3", "--ks", "0,1"]),
    ],
)
def test_script_simulates(name, extra, tmp_path):
    table = script(name).main(TINY + extra + ["--out", str(tmp_path), "--no-plot"])
    rows = read_csv(tmp_path / f"{name}_sim.csv")
    assert len(rows) == len(table.rows) > 0
    doc = json.loads((tmp_path / f"{name}_sim.json").read_text())
    assert doc["setup"]["mode"] == "simulation" and doc["columns"] == table.columns
    assert not list(tmp_path.glob("*.png"))


def test_largest_model_orders_policies(tmp_path):
    """Stronghold keeps a window of layers on the device: it trains the most layers, resident the fewest."""
    table = script("largest_model").main(TINY + ["--out", str(tmp_path), "--no-plot"])
    layers = {r["policy"].split("(")[0]: r["layers"] for r in table.records()}
    assert layers["stronghold"] >= max(layers.values())
    assert layers["resident"] == min(layers.values()) >= 1


def test_time_vs_layers_real_smoke(tmp_path):
    table = script("time_vs_layers").main(
        ["--real", "--layers", "2", "--steps", "1", "--warmup", "1", "--out", str(tmp_path), "--no-plot"]
    )
    (row,) = read_csv(tmp_path / "time_vs_layers_real.csv")
    assert row["layers"] == "2"
    assert all(float(v) > 0 for k, v in row.items() if k.startswith(("resident", "stronghold")))
    assert table.records()[0]["layers"] == 2


def test_plot_skipped_without_matplotlib(tmp_path, monkeypatch, capsys):
    common = script("common")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    setup, _ = common.parse_args("", TINY + ["--out", str(tmp_path)])
    assert common.save_plot(setup, "x", lambda ax: None) is None
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_precision_flag_simulates_16_bit(tmp_path):
    """--precision: the planner and the simulator model the 16-bit run. Resident trains at least
    as many layers in bf16 as in fp32 (16 B/param on the device either way, half the
    activations); fp16's rollback copies cost stronghold host memory that bf16 does not spend."""
    layers = {}
    for p in ("fp32", "bf16", "fp16"):
        out = tmp_path / p
        table = script("largest_model").main(TINY + ["--out", str(out), "--no-plot", "--precision", p])
        doc = json.loads((out / "largest_model_sim.json").read_text())
        assert doc["setup"]["family"]["precision"] == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[p]
        layers[p] = {r["policy"].split("(")[0]: r["layers"] for r in table.records()}
    assert layers["bf16"]["resident"] >= layers["fp32"]["resident"]
    assert layers["fp16"]["stronghold"] <= layers["bf16"]["stronghold"]
    with pytest.raises(SystemExit):
        script("largest_model").main(TINY + ["--out", str(tmp_path), "--no-plot", "--precision", "fp8"])


def test_real_16_bit_smoke(tmp_path):
    """--real --precision bf16 trains every policy, those that update on the device (resident,
    l2l, stronghold's first k) too (issue 25: fp32 masters and states on the device)."""
    table = script("time_vs_layers").main(
        ["--real", "--precision", "bf16", "--resident-first", "1", "--layers", "2", "--steps", "1", "--warmup", "1",
         "--out", str(tmp_path), "--no-plot"]  # fmt: skip
    )
    (row,) = read_csv(tmp_path / "time_vs_layers_real.csv")
    assert all(float(row[k]) > 0 for k in row if k.startswith(("zero", "stronghold", "resident", "l2l"))), row
    assert table.records()[0]["layers"] == 2
