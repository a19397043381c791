"""The action ops step-program nodes call.

They are markers, not kernels: the runtime's interpreter and the simulator dispatch on a
node's ``meta["shfx"]``. Calling one directly is an error. Arguments are
``(stage, *tokens)``: the stage (or parameter group) index, then the nodes to wait for.
"""

from __future__ import annotations

__all__ = [
    "prefetch",
    "forward",
    "offload_buffers",
    "release",
    "backward",
    "offload_grad",
    "cpu_step",
    "device_step",
    "offload_params",
]


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


prefetch = _marker("prefetch", "PF: copy a stage's working params and buffers host -> its device slot.")
forward = _marker("forward", "F: run a stage; keep only its boundary outputs.")
offload_buffers = _marker("offload_buffers", "OB: copy buffers the forward mutated device -> host.")
release = _marker("release", "R: the stage's slot may be reused once every reader is done.")
backward = _marker("backward", "B: recompute a stage, then grads of its inputs and params.")
offload_grad = _marker("offload_grad", "OG: copy a stage's param grads device -> host, accumulating.")
cpu_step = _marker("cpu_step", "U: host optimizer update of one parameter group.")
device_step = _marker("device_step", "DU: optimizer update of one parameter group on the device.")
offload_params = _marker("offload_params", "OP: copy a stage's updated params device -> host.")
