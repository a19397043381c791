"""The action ops step-program nodes call, one per kind of :data:`shfx.passes.actions.KINDS`.

They are markers, not kernels: the runtime's interpreter and the simulator dispatch on a
node's ``meta["shfx"]``. Calling one directly is an error. Arguments are
``(stage, *tokens)``: the stage (or parameter group) index, then the nodes to wait for.
"""

from __future__ import annotations

from .actions import KINDS


def _marker(name: str, doc: str):
    def op(stage: int, *tokens: object) -> object:
        raise RuntimeError(
            f"shfx.passes.ops.{name} is a step-program marker; run a program with the shfx runtime "
            "(shfx.compile) or simulate it with shfx.cost_model.simulate"
        )

    op.__name__ = op.__qualname__ = name
    op.__module__ = __name__
    op.__doc__ = doc
    return op


__all__ = [info.name for info in KINDS.values()]
for _info in KINDS.values():
    globals()[_info.name] = _marker(_info.name, f"{_info.kind.value}: {_info.doc}.")
del _info
