"""shfx's side of the mixed-precision equivalence: train with ``shfx.compile(precision=...)``
exactly as :func:`mixed_reference.train_mixed_eager` trains eagerly (same seeds, data, loss,
hyperparameters), and return the same record."""

from __future__ import annotations

from collections.abc import Callable

import torch

import shfx

from mixed_reference import bits_of


def train_mixed_shfx(
    make_model: Callable[[], torch.nn.Module],
    make_batch: Callable,
    precision: str,
    steps: int,
    *,
    window: int | str = 2,
    lr: float = 1e-2,
    weight_decay: float = 0.01,
    grad_accum: int = 1,
    seed: int = 0,
    loss_fn: Callable | None = None,
    inject_inf: dict[int, str] | None = None,
    scale_outside: bool = False,
    device=None,
    **compile_kwargs,
) -> dict:
    """``scale_outside``: fp16, scale the loss with ``cm.scale_loss(loss)`` (a loss computed
    outside the model) instead of letting backward scale the model's output gradients."""
    if loss_fn is None:
        from zoo import loss_of as loss_fn
    torch.manual_seed(seed)
    model = make_model()
    cm = shfx.compile(
        model, device=device or shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None), window=window,
        optimizer=shfx.optim.AdamW(lr=lr, weight_decay=weight_decay), grad_accum_steps=grad_accum,
        precision=precision, **compile_kwargs,
    )  # fmt: skip
    out: dict = {"losses": [], "loss_bits": [], "skipped": [], "scales": []}
    for step in range(steps):
        for micro in range(grad_accum):
            args, kwargs, aux = make_batch(step, micro)
            torch.manual_seed(10_000 + 100 * step + micro)
            loss = loss_fn(cm(*args, **kwargs), aux) / grad_accum
            (cm.scale_loss(loss) if scale_outside else loss).backward()
            out["losses"].append(loss.item())
            out["loss_bits"].append(bits_of(loss))
        if inject_inf and step in inject_inf:
            raise NotImplementedError("inject through tests/faults.py")
        cm.step()
        out["skipped"].append(cm.last_step_skipped)
        out["scales"].append(cm.scaler.scale if cm.scaler is not None else None)
        cm.zero_grad()
    cm.sync()
    out["master"] = {k: v.detach().clone() for k, v in model.named_parameters()}
    out["cm"] = cm
    out["model"] = model
    return out
