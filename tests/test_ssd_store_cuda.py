"""The SSD store with pinned bounce buffers (skipped without a GPU): round trips through the
pool, whose buffers are pinned host memory, aligned for O_DIRECT."""

from __future__ import annotations

import pytest
import torch

from shfx.runtime.ssd import SSDStore

pytestmark = pytest.mark.cuda


def test_pinned_bounce_buffers_round_trip(tmp_path):
    n = 3 * 8192 + 5
    backing = torch.randint(0, 255, (n + 1,), dtype=torch.uint8)
    src = backing[1:]  # unaligned: every chunk goes through the pool
    with SSDStore(tmp_path, {"m": n}, bounce_bytes=8192, bounce_buffers=2, pin_memory=True) as store:
        store.write_from("m", src).wait()
        out = torch.empty(n + 1, dtype=torch.uint8)[1:]
        store.read_into("m", out).wait()
        assert torch.equal(out, src)
        assert store.bounce_peak_in_use >= 1
        buffers = store._bounce._free
        assert buffers and all(t.is_pinned() and t.data_ptr() % store.alignment == 0 for t, _ in buffers)
        # a pinned host tensor read back goes on to the device asynchronously
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        store.read_into("m", pinned).wait()
        assert torch.equal(pinned.cuda(non_blocking=True).cpu(), src)
