"""examples/train_gpt.py, as the README runs it: one process, and under torchrun with 2 ranks
(data parallel; the example itself checks the weights against eager DDP, prints the largest
difference and exits with status 1 on a mismatch)."""

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


def _torchrun(*args: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
        str(EXAMPLE), *args,
    ]  # fmt: skip


def test_torchrun_two_ranks_bf16_clipping_nvme(tmp_path):
    """The composition of issue 25 under torchrun (2 ranks, a tiny GPT, 3 steps): bf16 with fp32
    masters, exact clipping (max_grad_norm) and AdamW's states on the NVMe tier (each rank its
    own file under tmp_path), bitwise equal to the eager bf16 recipe under DDP: each rank's bf16
    weights and its shard of the fp32 masters (the example exits 1 otherwise)."""
    cmd = _torchrun("--small", "--steps", "3", "--precision", "bf16", "--max-grad-norm", "0.05", "--nvme", str(tmp_path))
    out = _run(cmd, timeout=300)
    assert "rank 0: model" in out and "rank 1: model" in out, out[-2000:]
    assert out.count("(bf16, max_grad_norm=0.05, NVMe tier); weights equal to eager DistributedDataParallel over 2 ranks: True") == 2, out[-2000:]
    assert "max |difference| 0.0e+00" in out
    assert "RS" in out and "AG" in out and "NR0" in out and "SR" in out  # rank 0's program: collectives, the norms' reduce, SSD reads


@pytest.mark.slow  # (the README's command at its size; the default suite runs the tiny composition above)
def test_torchrun_two_ranks():
    out = _run(_torchrun("--window", "2", "--steps", "3"), timeout=300)
    assert "rank 0: model" in out and "rank 1: model" in out, out[-2000:]
    assert out.count("weights equal to eager DistributedDataParallel over 2 ranks: True") == 2, out[-2000:]
    assert "RS" in out and "AG" in out  # rank 0 printed the data-parallel program
