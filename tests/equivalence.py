"""The equivalence helper: train a model with shfx and with eager PyTorch, same seed and data,
and compare losses and final state (parameters and buffers).

NOTE: the eager side uses ``torch.optim.AdamW(fused=True)``, the kernel shfx's host
optimizer runs on its flat buffers. The default for-loop AdamW differs from it by about one
ulp per step, and Adam turns one-ulp differences in parameters whose true gradient is zero
(the key bias of attention: softmax ignores it) into full ``lr``-sized steps of different
sign, so over several steps the comparison would measure that chaos, not shfx.
``tests/test_host_optim.py`` checks shfx's AdamW against the for-loop AdamW directly.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

import shfx

RTOL, ATOL = 1e-5, 1e-7


def run_pair(
    make_model: Callable[[], torch.nn.Module],
    make_batch: Callable,
    *,
    window: int,
    steps: int = 5,
    accum: int = 1,
    loss_fn: Callable | None = None,
    lr: float = 1e-2,
    weight_decay: float = 0.01,
    device=None,
    seed: int = 0,
    **compile_kwargs,
):
    """Train ``steps`` optimizer steps both ways; returns (shfx losses, eager losses, cm, model, ref)."""
    from zoo import loss_of

    loss_fn = loss_fn or loss_of
    torch.manual_seed(seed)
    model = make_model()
    ref = copy.deepcopy(model)
    device = device or shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None)
    cm = shfx.compile(
        model,
        device=device,
        window=window,
        optimizer=shfx.optim.AdamW(lr=lr, weight_decay=weight_decay),
        grad_accum_steps=accum,
        **compile_kwargs,
    )
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=weight_decay, fused=True)
    losses, ref_losses = [], []
    for step in range(steps):
        for micro in range(accum):
            args, kwargs, aux = make_batch(step, micro)
            torch.manual_seed(10_000 + 100 * step + micro)
            loss = loss_fn(cm(*args, **kwargs), aux) / accum
            loss.backward()
            losses.append(loss.item())
            torch.manual_seed(10_000 + 100 * step + micro)
            ref_loss = loss_fn(ref(*args, **kwargs), aux) / accum
            ref_loss.backward()
            ref_losses.append(ref_loss.item())
        cm.step()
        cm.zero_grad()
        opt.step()
        opt.zero_grad()
    cm.sync()  # weights a policy updates on the device back into the model's own tensors
    return losses, ref_losses, cm, model, ref


def assert_same_state(model: torch.nn.Module, ref: torch.nn.Module, rtol: float = RTOL, atol: float = ATOL) -> None:
    sd, rsd = model.state_dict(), ref.state_dict()
    assert sd.keys() == rsd.keys()
    for k in sd:
        torch.testing.assert_close(sd[k], rsd[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def assert_trains_like_eager(make_model, make_batch, **kw) -> tuple:
    losses, ref_losses, cm, model, ref = run_pair(make_model, make_batch, **kw)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    assert_same_state(model, ref)
    return losses, ref_losses, cm, model, ref
