"""Retarget a stage graph traced on the CPU to another device.

The model is captured on the CPU (its weights live there); ops that create tensors carry the
device they were traced with (``arange(..., device=cpu)``). Given a graph module and a device,
return a copy whose device arguments name that device. ``source`` picks which device arguments
change (the CPU's by default; ``None``: every one, e.g. a graph traced on the meta device brought
back to the CPU for the analytic cost model's fake run).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx as fx

__all__ = ["retarget_device", "device_arguments"]


def _matches(d: torch.device, source: str | None) -> bool:
    return source is None or d.type == source


def _swap(v: Any, device: torch.device, source: str | None = "cpu") -> Any:
    if isinstance(v, torch.device) and _matches(v, source):
        return device
    if isinstance(v, (list, tuple)):
        return type(v)(_swap(x, device, source) for x in v)
    return v


def device_arguments(gm: fx.GraphModule) -> set[torch.device]:
    """The devices ``gm``'s nodes (in submodules too) name in their arguments
    (``arange(..., device=meta)``): where the graph was traced, empty when no op creates a tensor."""
    found: set[torch.device] = set()

    def visit(v: Any) -> None:
        if isinstance(v, torch.device):
            found.add(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)

    for mod in gm.modules():
        if isinstance(mod, fx.GraphModule):
            for node in mod.graph.nodes:
                visit(node.args)
                for k, v in node.kwargs.items():
                    visit(torch.device(v) if k == "device" and isinstance(v, str) else v)
    return found


def retarget_device(gm: fx.GraphModule, device: torch.device | str, source: str | None = "cpu") -> fx.GraphModule:
    """A copy of ``gm`` with every ``source`` device argument (in submodules too) set to ``device``
    (``source=None``: every device argument)."""
    device = torch.device(device)
    new = copy.deepcopy(gm)
    for mod in new.modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        for node in mod.graph.nodes:
            node.args = tuple(_swap(a, device, source) for a in node.args)
            kw = dict(node.kwargs)
            for k, v in kw.items():
                if k == "device" and isinstance(v, str) and _matches(torch.device(v), source):
                    kw[k] = device
                else:
                    kw[k] = _swap(v, device, source)
            node.kwargs = kw
        mod.recompile()
    return new
