"""examples/train_gpt.py, as the README runs it: one process, and under torchrun with 2 ranks
(data parallel; the example itself checks the weights against eager DDP and prints it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], timeout: float) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


@pytest.mark.slow  # (the same loop as the demo and tests/test_equivalence.py, without torchrun)
def test_one_process():
    out = _run([sys.executable, str(EXAMPLE), "--steps", "3"], timeout=300)
    assert "weights equal to eager PyTorch: True" in out


def test_torchrun_two_ranks():
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
        str(EXAMPLE), "--window", "2", "--steps", "3",
    ]  # fmt: skip
    out = _run(cmd, timeout=300)
    assert "rank 0: model" in out and "rank 1: model" in out, out[-2000:]
    assert out.count("weights equal to eager DistributedDataParallel over 2 ranks: True") == 2, out[-2000:]
    assert "RS" in out and "AG" in out  # rank 0 printed the data-parallel program
