"""The pinned pool on a real GPU (skipped without one): what ``tests/test_pinned_pool.py`` checks on
the emulated device and with recorders, with ``cudaHostRegister`` and CUDA events: every
pinned buffer is one of the pool's registrations, a small budget (one-page bounce buffers)
trains bitwise as the default, and the pool holds what the ledger's pinned tier says."""

from __future__ import annotations

import pytest
import torch
from test_pinned_pool import _no_torch_pinning
from zoo import gpt, gpt_tied, token_batch

import shfx
from shfx.passes import pinned as plan_mod
from shfx.passes.pinned import PAGE

pytestmark = pytest.mark.cuda


def _run(model_fn, precision, **kw):
    torch.manual_seed(0)
    model = model_fn(layers=4) if model_fn is gpt else model_fn()
    cm = shfx.compile(model, device="cuda", window=2, optimizer=shfx.optim.AdamW(lr=1e-2), precision=precision, **kw)
    registered = []
    pool = cm.backend.pinned
    real = pool._register
    pool._register = lambda p, n: (registered.append(n), real(p, n))[1]
    losses = []
    for i in range(4):
        (x, y), _, _ = token_batch(i)
        loss = cm(x.cuda(), y.cuda())
        loss.backward()
        cm.step()
        cm.zero_grad()
        losses.append(loss.detach().cpu())
    torch.cuda.synchronize()
    state = {k: v.detach().cpu().clone() for k, v in cm.state_dict().items()}
    return cm, losses, state, registered


@pytest.mark.parametrize("model_fn,precision", [(gpt, "fp32"), (gpt, "bf16"), (gpt_tied, "fp32")], ids=["fp32", "bf16", "tied"])
def test_small_pinned_budget_on_cuda_trains_bitwise_and_pins_only_from_the_pool(monkeypatch, model_fn, precision):
    monkeypatch.setattr(plan_mod, "BOUNCE_CHUNK_BYTES", PAGE)
    _no_torch_pinning(monkeypatch)
    ref, a, sa, reg_a = _run(model_fn, precision)
    small, b, sb, reg_b = _run(model_fn, precision, pinned=16 * PAGE)
    try:
        assert all(torch.equal(x, y) for x, y in zip(a, b)), (a, b)
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        for cm, reg in ((ref, reg_a), (small, reg_b)):
            pool = cm.backend.pinned
            assert len(reg) == pool.allocations and sum(reg) == pool.live_bytes == cm.backend.pinned_bytes
            assert cm.backend.pinned_bytes == cm.variant.ledger(pinned=pool.plan).peak("pinned") == cm.stats()["pinned_planned_bytes"]
        assert small.backend.pinned.bounced_copies > 0 and ref.backend.pinned.bounced_copies == 0
        assert small.backend.pinned_bytes <= 16 * PAGE
    finally:
        ref.close()
        small.close()
