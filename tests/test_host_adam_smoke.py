"""benchmarks/host_adam.py runs to the end at tiny sizes: every section (bandwidth, variants,
optimizer pool configs, the working-copy section, the numerical check), then ``--only-copy``
adding its ``working_copy`` to the same JSON. Writes to a temp path, never to
benchmarks/results/host_adam.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "host_adam.py"

TINY = [
    "--groups", "2", "--layers", "1", "--reps", "1", "--max-rounds", "2",
    "--bw-elements", "64K", "--bw-reps", "1", "--bw-max-rounds", "2", "--cache-params", "16K",
    "--copy-sizes", "50K", "--copy-chunks", "16K", "--copy-threads", "1", "--wait-quiet", "0",
]  # fmt: skip


def run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    return subprocess.run([sys.executable, str(SCRIPT), *TINY, *extra, "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)  # fmt: skip


@pytest.mark.slow  # (the benchmark script's smoke run, ~9 s; the host AdamW's results are tested in test_host_optim*)
def test_host_adam_runs_every_section_at_tiny_sizes(tmp_path):
    out = tmp_path / "host_adam.json"
    p = run(out, "--sizes", "50K", "--config-sizes", "50K", "--configs", "1x1,2x1", "--check-size", "20K",
            "--check-steps", "2")  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert {"bandwidth", "sizes", "configs", "check", "working_copy"} <= d.keys()
    assert d["check"]["ok"] and d["check"]["bitwise_equal_fused"]
    row = d["sizes"][0]["variants"]["shfx"]
    assert row["gbs"] > 0 and row["median_s"] > 0
    assert {"1x1", "2x1"} <= d["configs"][0]["configs"].keys()
    wc = d["working_copy"]["sizes"][0]
    assert wc["working_copy_equals_master_cast"]
    assert any(k.startswith("fused (update)") for k in wc["variants"])
    assert wc["kernel_calls_per_group"]

    # --only-copy adds 'working_copy' to the existing file and keeps the rest
    p = run(out, "--only-copy")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d2 = json.loads(out.read_text())
    assert d2["check"] == d["check"]
    assert d2["working_copy"]["sizes"][0]["working_copy_equals_master_cast"]
    assert "bandwidth" in d2["working_copy"]
