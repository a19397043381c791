"""The action ops step-program nodes call, one per kind of :data:`shfx.passes.actions.KINDS`.

They are markers, not kernels: the runtime's interpreter and the simulator dispatch on a
node's ``meta["shfx"]``. Calling one directly is an error. Arguments are
``(stage, *tokens)``: the stage (or parameter group) index, then the nodes to wait for.

Each is its kind's ``KINDS[kind].op``, the same object: the table makes them
(:mod:`shfx.passes.actions`), this module is where they are named (``shfx.passes.ops.prefetch``).
"""

from __future__ import annotations

from .actions import KINDS

__all__ = [info.name for info in KINDS.values()]
for _info in KINDS.values():
    globals()[_info.name] = _info.op
del _info
