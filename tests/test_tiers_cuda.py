"""The tiers beyond device memory on a real GPU (skipped without one; the GPU kit's part 2 runs
every ``pytest -m cuda`` file): what ``tests/test_param_tier.py`` and
``tests/test_activation_offload.py`` check on the emulated device, with CUDA streams, events and
``cudaHostRegister``. Each compares shfx with the tier against shfx without it on the same GPU
(the same kernels in the same order), so equality is bitwise; dropout draws from the user's
stream, seeded once.

The bodies take the device as an argument: ``python tests/test_tiers_cuda.py`` runs them on the
emulated device (a check of the tests themselves where no GPU is)."""

from __future__ import annotations

import sys
import tempfile

import pytest
import torch
from zoo import gpt, seeded_steps, token_batch

import shfx

pytestmark = pytest.mark.cuda


def _batches(n: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    on = "cuda" if device == "cuda" else "cpu"
    return [tuple(t.to(on) for t in token_batch(i)[0]) for i in range(n)]


def _train(device, precision, offload=None, steps=3, **kw):
    torch.manual_seed(0)
    cm = shfx.compile(gpt(layers=4, dropout=0.1), device=device, policy=shfx.Stronghold(window=2),
                      optimizer=shfx.optim.AdamW(lr=1e-2, weight_decay=0.01), precision=precision, offload=offload, **kw)  # fmt: skip
    registered: list[int] = []
    pool = cm.backend.pinned
    real = pool._register
    pool._register = lambda p, n: (registered.append(n), real(p, n))[1]
    losses = [x.cpu() for x in seeded_steps(cm, cm, _batches(steps, device))]
    if device == "cuda":
        torch.cuda.synchronize()
    state = {k: v.detach().cpu().clone() for k, v in cm.state_dict().items()}
    return cm, losses, state, registered


def check_parameter_tier(device, precision: str, path: str) -> None:
    tier = shfx.Offload(params="nvme", gradients="nvme", optimizer="nvme", path=path, host_window=1)
    ref, a, sa, _ = _train(device, precision)
    cm, b, sb, registered = _train(device, precision, tier)
    try:
        assert all(torch.equal(x, y) for x, y in zip(a, b)), (a, b)
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        w = cm.engine.ssd
        assert w.paged and all(cm.backend.pinned.owns(t) for t in w.images)  # the image buffers: pinned, the pool's
        pool = cm.backend.pinned
        assert len(registered) == pool.allocations and sum(registered) == pool.live_bytes == cm.backend.pinned_bytes
        assert cm.engine.host_bytes() == sum(cm.variant.ledger().static("host").values())
        assert not w.image_at and not w.where  # every buffer free between steps
    finally:
        ref.close()
        cm.close()


def check_activation_offload(device, precision: str, path: str | None = None) -> None:
    """``path``: the activations go on to the SSD there (``activations="nvme"``), else host RAM."""
    ref, a, sa, _ = _train(device, precision)
    off = shfx.Offload(activations="nvme", path=path) if path else shfx.Offload(activations="host")
    cm, b, sb, _ = _train(device, precision, off)
    try:
        assert any(str(x).startswith("AW" if path else "AO") for x in cm.program.actions())
        assert all(torch.equal(x, y) for x, y in zip(a, b)), (a, b)
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert cm.backend.peak_bytes < ref.backend.peak_bytes  # the boundary activations left the device
    finally:
        ref.close()
        cm.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_parameter_tier_on_cuda_trains_bitwise_as_all_in_ram(tmp_path, precision):
    check_parameter_tier("cuda", precision, str(tmp_path))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("where", ["host", "nvme"])
def test_activation_offload_on_cuda_trains_bitwise_with_less_device_memory(tmp_path, precision, where):
    check_activation_offload("cuda", precision, str(tmp_path) if where == "nvme" else None)


if __name__ == "__main__":  # the bodies on the emulated device
    for p in ("fp32", "bf16"):
        check_parameter_tier(shfx.EmulatedDevice(memory="64MiB", h2d=None, d2h=None), p, tempfile.mkdtemp())
        check_activation_offload(shfx.EmulatedDevice(memory="64MiB", h2d=None, d2h=None), p)
        check_activation_offload(shfx.EmulatedDevice(memory="64MiB", h2d=None, d2h=None), p, tempfile.mkdtemp())
    print("ok", file=sys.stderr)
