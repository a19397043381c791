"""Retarget a stage graph traced on the CPU to another device.

The model is captured on the CPU (its weights live there); ops that create tensors carry the
device they were traced with (``arange(..., device=cpu)``). Given a graph module and a device,
return a copy whose device arguments name that device.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx as fx

__all__ = ["retarget_device"]


def _swap(v: Any, device: torch.device) -> Any:
    if isinstance(v, torch.device) and v.type == "cpu":
        return device
    if isinstance(v, (list, tuple)):
        return type(v)(_swap(x, device) for x in v)
    return v


def retarget_device(gm: fx.GraphModule, device: torch.device | str) -> fx.GraphModule:
    """A copy of ``gm`` with every ``cpu`` device argument (in submodules too) set to ``device``."""
    device = torch.device(device)
    new = copy.deepcopy(gm)
    for mod in new.modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        for node in mod.graph.nodes:
            node.args = tuple(_swap(a, device) for a in node.args)
            kw = dict(node.kwargs)
            for k, v in kw.items():
                if k == "device" and isinstance(v, str) and torch.device(v).type == "cpu":
                    kw[k] = device
                else:
                    kw[k] = _swap(v, device)
            node.kwargs = kw
        mod.recompile()
    return new
