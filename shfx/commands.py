"""What the ``shfx`` commands other than ``demo`` do (the CLI only parses arguments)."""

from __future__ import annotations

import sys
from typing import Any, TextIO

import torch

from shfx.cost_model.analytic import plan_inputs
from shfx.cost_model.hardware import get_profile
from shfx.cost_model.report import WindowReport
from shfx.cost_model.shapes import short_precision
from shfx.cost_model.tune import tune_window
from shfx.passes.units import format_bytes

from . import models
from .models import GPTShape

__all__ = ["tune_gpt", "gpt_plan_inputs", "precision_kwargs"]


def precision_kwargs(precision: str) -> dict[str, str]:
    """The keywords that make ``shfx.compile`` train in ``precision`` (any of ``fp32 bf16 fp16``
    or the long names): none for fp32 (the default, so an fp32 run compiles exactly as before
    mixed precision), else ``{"precision": "bf16"}`` / ``{"precision": "fp16"}``.

    >>> precision_kwargs("float32"), precision_kwargs("bfloat16")
    ({}, {'precision': 'bf16'})
    """
    from shfx.cost_model.shapes import normalize_precision, short_precision

    if normalize_precision(precision) == "float32":
        return {}
    return {"precision": short_precision(precision)}


def gpt_plan_inputs(shape: GPTShape, hardware) -> tuple:
    """Stage specs and analytic costs of the built-in GPT at ``shape.layers`` in
    ``shape.precision`` (one meta capture of a two-block model, its blocks repeated)."""
    return plan_inputs(
        lambda n: models.GPT(shape.with_layers(n)),  # looked up at the call: a patched shfx.models.GPT is used
        lambda: (torch.zeros(shape.batch, shape.seq, dtype=torch.long),) * 2,
        blocks="transformer.h",
        layers=shape.layers,
        hardware=hardware,
        precision=shape.precision,
    )


def tune_gpt(
    shape: GPTShape,
    *,
    hardware: str | None = None,
    device: Any = None,
    steps: int = 5,
    tolerance: float = 0.02,
    seed: int = 0,
    file: TextIO | None = None,
) -> WindowReport:
    """The window report for a GPT: predicted on a named hardware profile (``hardware``, the
    analytic model, nothing runs), or profiled and measured on ``device`` (``steps`` training
    steps with ``window="auto"``), in ``shape.precision`` (fp16: with the step journal's
    rollback copies, as ``shfx.compile`` keeps them).

    >>> rep = tune_gpt(GPTShape(layers=48, hidden=2048, heads=16, seq=1024, batch=4, vocab=50304),
    ...                hardware="V100-32GB-PCIe3")  # doctest: +SKIP
    """
    out = file if file is not None else sys.stdout
    if hardware is not None:
        hw = get_profile(hardware)
        specs, costs = gpt_plan_inputs(shape, hw)
        tune = tune_window(specs, costs, capacity_bytes=hw.device_memory_bytes, tolerance=tolerance, rollback=shape.rollback_default)
        rep = WindowReport(tune, tune.window, hw.describe(), "analytic")
        params = shape.num_params()
        weights = f"{format_bytes(4 * params)} fp32 weights"
        if shape.mixed:
            weights += (f", {format_bytes(shape.param_bytes * params)} {short_precision(shape.precision)} on the device"
                        + (", rollback copies on" if shape.rollback_default else ""))
        print(f"GPT {shape.layers} layers, hidden {shape.hidden}, seq {shape.seq}, batch {shape.batch}: {params / 1e9:.2f} B params "
              f"({weights}); analytic model, nothing runs", file=out)
        print(rep, file=out)
        return rep
    import shfx

    kwargs = precision_kwargs(shape.precision)
    torch.manual_seed(seed)
    model = models.GPT(shape)
    cm = shfx.compile(model, device=device, window="auto", optimizer=shfx.optim.AdamW(lr=1e-4), tune_tolerance=tolerance,
                      **kwargs)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    try:
        for _ in range(max(1, steps)):
            x = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=gen)
            cm(x, x).backward()
            cm.step()
            cm.zero_grad()
        rep = cm.report()
    finally:
        cm.close()
    params = sum(p.numel() for p in model.parameters())
    prec = f", {short_precision(shape.precision)}" if shape.mixed else ""
    print(f"GPT {shape.layers} layers, hidden {shape.hidden}, seq {shape.seq}, batch {shape.batch}{prec}: {params / 1e6:.1f} M params; "
          f"profiled and measured ({steps} steps)", file=out)
    print(rep, file=out)
    return rep
