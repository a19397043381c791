"""Failures a user can cause through the API are clean (issue 9): what PyTorch code does to the
model and its gradients between calls is honoured exactly as eager would (bitwise), or refused
with a UsageError that says what to do; dropped compiled models free their threads; bad device
specifications, a second backward and a clamped window say so."""

from __future__ import annotations

import copy
import gc
import threading
import time

import pytest
import torch
import torch.nn as nn

import shfx

LR, WD = 1e-2, 0.01


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.fc = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    """Four repeated blocks (four stages) and a head; returns the loss."""

    def __init__(self, h: int = 16, n: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList([Block(h) for _ in range(n)])
        self.head = nn.Linear(h, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).pow(2).mean()


def batch(step: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + micro))


def pair(**kw):
    """(cm, model, eager copy, eager fused AdamW), same initial weights."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    kw.setdefault("window", 2)
    cm = shfx.compile(
        model, device=shfx.EmulatedDevice(memory="64MiB", h2d=None, d2h=None),
        optimizer=shfx.optim.AdamW(lr=LR, weight_decay=WD), **kw,
    )  # fmt: skip
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    return cm, model, ref, opt


def assert_bitwise(model: nn.Module, ref: nn.Module) -> None:
    sd, rsd = model.state_dict(), ref.state_dict()
    assert sd.keys() == rsd.keys()
    for k in sd:
        torch.testing.assert_close(sd[k], rsd[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


# ---- 14: smaller ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("memory", ["-1GiB", -1, 0, "0", "0.1B", float("nan"), float("inf"), "1e400", "1e400GiB"])
def test_device_memory_must_be_a_positive_finite_size(memory):
    with pytest.raises(ValueError, match=r"EmulatedDevice memory must be (> 0|a finite number)"):
        shfx.EmulatedDevice(memory=memory)
    with pytest.raises(ValueError, match=r"CudaDevice memory must be (> 0|a finite number)"):
        shfx.CudaDevice(memory=memory)


@pytest.mark.parametrize("bw", ["-1GB/s", -1.0, 0, "0GB/s", float("nan"), "1e400GB/s"])
def test_bandwidth_must_be_a_positive_finite_rate(bw):
    with pytest.raises(ValueError, match=r"EmulatedDevice h2d bandwidth must be (> 0|a finite number)"):
        shfx.EmulatedDevice(h2d=bw)
    with pytest.raises(ValueError, match=r"EmulatedDevice d2h bandwidth must be (> 0|a finite number)"):
        shfx.EmulatedDevice(d2h=bw)


def test_device_specs_still_accepted():
    d = shfx.EmulatedDevice(memory="1.5KiB", h2d=float("inf"), d2h="inf")
    assert d.memory_bytes == 1536 and d.h2d_bps is None and d.d2h_bps is None
    assert shfx.EmulatedDevice(memory=1, h2d="800MiB/s").h2d_bps == 800 * 2**20
    with pytest.raises(ValueError, match=r"duplex must be in \(0, 1\]: a number"):
        shfx.EmulatedDevice(duplex="half")
