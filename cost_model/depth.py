"""Specs, analytic costs and simulated steps of a model at any depth, from one capture.

A what-if study over layer counts (STRONGHOLD's experiments vary only the number of layers)
should not build, capture or cost the model once per size: :class:`DepthModel` captures a
small version on the meta device once (:func:`shfx.cost_model.analytic.plan_inputs`) and repeats its
block stage to any number of blocks (:func:`shfx.cost_model.analytic.repeat_blocks`). Programs of any
policy of :mod:`shfx.passes.policies` are built from those specs (:func:`shfx.passes.policies.policy_program`)
and simulated with those costs.

>>> import torch
>>> class Net(torch.nn.Module):
...     def __init__(self, n):
...         super().__init__()
...         self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(n))
...     def forward(self, x):
...         for b in self.blocks:
...             x = b(x)
...         return x.sum()
>>> dm = DepthModel(Net, lambda: (torch.zeros(2, 8),), blocks="blocks", hardware="V100-32GB-PCIe3")
>>> specs, costs = dm.at(40)
>>> len(specs), len(costs.costs)
(40, 40)
>>> dm.simulate(40, "resident").step_s > 0
True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from shfx.passes.policies import policy_program
from shfx.passes.program import Program
from shfx.passes.stages import StageSpec

from .analytic import plan_inputs, repeat_blocks
from .costs import CostTable, Links
from .hardware import Hardware, get_profile
from .shapes import normalize_precision
from .simulate import Timeline, simulate

__all__ = ["DepthModel"]


class DepthModel:
    """Stage specs and analytic costs of ``build(n)`` for any ``n`` blocks, from one capture.

    Args:
        build: ``build(n)`` makes the model with ``n`` blocks (called once, on the meta device).
        inputs: returns its example arguments (meta tensors are fine).
        blocks: module path of the repeated blocks (e.g. ``"transformer.h"``).
        hardware: a :class:`shfx.cost_model.hardware.Hardware` or a profile name.
        dtype: the dtype whose FLOP/s the analytic model uses (default: the precision's).
        template_layers: blocks in the captured template (at least 2).
        precision: what the model trains in (``fp32``, ``bf16``, ``fp16`` or the long names):
            16-bit specs move and hold half the bytes on the device and the links, and compute
            at the profile's 16-bit rate (:func:`shfx.cost_model.analytic.plan_inputs`).
        rollback: :meth:`simulate` charges the step journal's rollback copies (default: on for
            fp16, as ``shfx.compile`` does).
    """

    def __init__(
        self,
        build: Callable[[int], torch.nn.Module],
        inputs: Callable[[], tuple],
        *,
        blocks: str,
        hardware: Hardware | str,
        dtype: str | None = None,
        template_layers: int = 2,
        precision: str = "float32",
        rollback: bool | None = None,
    ):
        self.hw = get_profile(hardware)
        self.precision = normalize_precision(precision)
        self.rollback = self.precision == "float16" if rollback is None else bool(rollback)
        self.specs, self.table = plan_inputs(
            build, inputs, blocks=blocks, layers=template_layers, hardware=self.hw, dtype=dtype, precision=self.precision
        )
        idx = [s.index for s in self.specs if s.name.startswith("block.")]
        if not idx or idx != list(range(idx[0], idx[-1] + 1)):
            raise ValueError(f"expected consecutive block stages named 'block.*', got {[s.name for s in self.specs]}")
        self.blocks = range(idx[0], idx[-1] + 1)

    @property
    def extra_stages(self) -> int:
        """Stages that are not blocks (a GPT's head and tail: 2)."""
        return len(self.specs) - len(self.blocks)

    def at(self, layers: int, links: Links | None = None) -> tuple[list[StageSpec], CostTable]:
        """Specs and costs with ``layers`` blocks (``links`` replaces the profile's links)."""
        specs, costs = repeat_blocks(self.specs, self.table.costs, self.blocks, layers)
        table = replace(self.table, costs=costs, source=f"{self.table.source.rsplit(', ', 1)[0]}, {layers} blocks")
        return specs, table if links is None else table.with_links(links)

    def program(self, layers: int, policy: str = "stronghold", window: int = 2, resident_first: int = 0) -> Program:
        specs, _ = self.at(layers)
        return policy_program(policy, specs, window, resident_first)

    def simulate(
        self,
        layers: int,
        policy: str = "stronghold",
        window: int = 2,
        resident_first: int = 0,
        links: Links | None = None,
    ) -> Timeline:
        """One simulated step of ``policy`` at ``layers`` blocks (:func:`shfx.cost_model.simulate.simulate`)."""
        specs, table = self.at(layers, links)
        return simulate(policy_program(policy, specs, window, resident_first), table, rollback=self.rollback)
