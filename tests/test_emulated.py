"""The emulated device: throttled copies, duplex coupling, memory capacity."""

from __future__ import annotations

import time

import pytest
import torch

import shfx
from shfx.runtime.emulated import EmulatedBackend


def test_copy_takes_bytes_over_bandwidth():
    b = EmulatedBackend(shfx.EmulatedDevice(memory="1GiB", h2d="1GB/s", d2h="1GB/s"))
    src = torch.ones(20_000_000, dtype=torch.uint8)
    dst = torch.empty_like(src)
    t0 = time.perf_counter()
    b.h2d_copy(dst, src)
    dt = time.perf_counter() - t0
    assert dt >= 0.02 * 0.98  # 20 MB at 1 GB/s
    assert torch.equal(dst, src) and b.bytes_h2d == 20_000_000 and b.copies_h2d == 1
    b.close()


def test_half_duplex_slows_concurrent_copies():
    b = EmulatedBackend(shfx.EmulatedDevice(memory="1GiB", h2d="2GB/s", d2h="2GB/s", duplex=0.5))
    n = 40_000_000
    a1, a2, c1, c2 = (torch.zeros(n, dtype=torch.uint8) for _ in range(4))
    t0 = time.perf_counter()
    t1 = b.h2d.submit(lambda: b.h2d_copy(a1, a2))
    t2 = b.d2h.submit(lambda: b.d2h_copy(c1, c2))
    t1.wait()
    t2.wait()
    both = time.perf_counter() - t0
    assert both >= 0.03  # alone each would take 20 ms; sharing the link makes it ~40 ms
    b.close()


def test_capacity_raises_with_need_and_room():
    b = EmulatedBackend(shfx.EmulatedDevice(memory="1KiB"))
    b.reserve(600, "first")
    with pytest.raises(shfx.OutOfDeviceMemory) as e:
        b.reserve(600, "second thing")
    assert "600 B for second thing" in str(e.value) and "424 B free" in str(e.value)
    assert e.value.needed_bytes == 600 and e.value.used_bytes == 600 and e.value.capacity_bytes == 1024
    b.unreserve(600)
    assert b.used_bytes == 0 and b.peak_bytes == 600
    b.close()


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"memory": "lots"}, "cannot read EmulatedDevice memory"),
        ({"h2d": "12GB"}, "bytes per second"),
        ({"d2h": -1}, "must be > 0"),
        ({"duplex": 0}, "duplex must be in"),
    ],
)
def test_bad_device_specs(kw, match):
    with pytest.raises(ValueError, match=match):
        shfx.EmulatedDevice(**kw)


def test_unthrottled_and_describe():
    d = shfx.EmulatedDevice(memory="512MiB", h2d=None, d2h="inf")
    assert d.h2d_bps is None and d.d2h_bps is None
    assert str(d) == "emulated device (512.0 MiB, h2d unthrottled, d2h unthrottled)"
