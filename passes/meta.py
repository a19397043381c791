"""Typed access to the one metadata key shfx puts on FX nodes: ``node.meta["shfx"]``.

Every pass reads and writes node metadata through these helpers; nothing else sets
attributes on ``fx.Node``.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

__all__ = ["KEY", "get_meta", "set_meta", "has_meta"]

KEY = "shfx"


def has_meta(node: fx.Node) -> bool:
    return KEY in node.meta


def get_meta(node: fx.Node) -> Any:
    try:
        return node.meta[KEY]
    except KeyError:
        raise KeyError(f"node {node.name!r} ({node.op} {node.target}) has no shfx metadata") from None


def set_meta(node: fx.Node, value: Any) -> None:
    node.meta[KEY] = value
