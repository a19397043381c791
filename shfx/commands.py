"""What the ``shfx`` commands other than ``demo`` do (the CLI only parses arguments)."""

from __future__ import annotations

import sys
from typing import Any, TextIO

import torch

from shfx.cost_model.analytic import plan_inputs
from shfx.cost_model.hardware import get_profile
from shfx.cost_model.report import WindowReport
from shfx.cost_model.tune import tune_window
from shfx.passes.units import format_bytes

from .models import GPT, GPTShape

__all__ = ["tune_gpt", "gpt_plan_inputs"]


def gpt_plan_inputs(shape: GPTShape, hardware) -> tuple:
    """Stage specs and analytic costs of the built-in GPT at ``shape.layers`` (one meta capture
    of a two-block model, its blocks repeated)."""
    return plan_inputs(
        lambda n: GPT(shape.with_layers(n)),
        lambda: (torch.zeros(shape.batch, shape.seq, dtype=torch.long),) * 2,
        blocks="transformer.h",
        layers=shape.layers,
        hardware=hardware,
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
    steps with ``window="auto"``).

    >>> rep = tune_gpt(GPTShape(layers=48, hidden=2048, heads=16, seq=1024, batch=4, vocab=50304),
    ...                hardware="V100-32GB-PCIe3")  # doctest: +SKIP
    """
    out = file if file is not None else sys.stdout
    if hardware is not None:
        hw = get_profile(hardware)
        specs, costs = gpt_plan_inputs(shape, hw)
        tune = tune_window(specs, costs, capacity_bytes=hw.device_memory_bytes, tolerance=tolerance)
        rep = WindowReport(tune, tune.window, hw.describe(), "analytic")
        params = shape.num_params()
        print(f"GPT {shape.layers} layers, hidden {shape.hidden}, seq {shape.seq}, batch {shape.batch}: {params / 1e9:.2f} B params "
              f"({format_bytes(4 * params)} fp32 weights); analytic model, nothing runs", file=out)
        print(rep, file=out)
        return rep
    import shfx

    torch.manual_seed(seed)
    model = GPT(shape)
    cm = shfx.compile(model, device=device, window="auto", optimizer=shfx.optim.AdamW(lr=1e-4), tune_tolerance=tolerance)
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
    print(f"GPT {shape.layers} layers, hidden {shape.hidden}, seq {shape.seq}, batch {shape.batch}: {params / 1e6:.1f} M params; "
          f"profiled and measured ({steps} steps)", file=out)
    print(rep, file=out)
    return rep
