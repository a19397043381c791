"""The model's own tensors after the first call: what they looked like when the host store took
them in, and the check before every call that takes in (or refuses) what the user changed since.

Functions of the model, the host store and the engine (:class:`shfx.api.CompiledModel` keeps the
record and calls these)."""

from __future__ import annotations

import torch
import torch.nn as nn

from shfx.passes.capture import Captured

from .errors import UsageError
from .runtime.engine import Engine
from .runtime.host_store import HostStore

__all__ = ["Bound", "bind_record", "check_model", "take_rebound"]

# per model tensor in the host store: (key, tensor, its data_ptr, owning module and name, and
# requires_grad for a parameter)
Bound = tuple[str, torch.Tensor, int, nn.Module | None, str, bool | None]


def bind_record(module: nn.Module, captured: Captured) -> list[Bound]:
    """What the model looks like once the store holds its tensors (see :func:`check_model`)."""
    record = []
    for key, t in [*captured.params.items(), *captured.buffers.items()]:
        mod: nn.Module | None = None
        prefix, _, attr = key.rpartition(".")
        if key in captured.params:
            try:
                mod = module.get_submodule(prefix)
            except AttributeError:
                mod = None
            if mod is not None and mod._parameters.get(attr) is not t:
                mod = None  # not reachable by its canonical name: no identity check
        record.append((key, t, t.data_ptr(), mod, attr, t.requires_grad if key in captured.params else None))
    return record


def check_model(bound: list[Bound], store: HostStore, engine: Engine) -> None:
    """Before a call: take in what the user changed in the model since the last one, or
    refuse it (nothing silently ignored).

    ``p.data = t`` (any parameter or buffer) detaches the tensor from the host store: ``t``'s
    values are copied into the store, the tensor is bound to it again and the device copies
    are refreshed (as eager would train the new values) when shape and dtype match, else it
    is refused. A parameter replaced by another object, or whose ``requires_grad`` changed
    (while grad is enabled), is refused: the stages and gradient buffers were laid out for
    the parameters and trainable set of the first call.

    Cost: per tensor a ``data_ptr``, per parameter an identity and a flag check: measured
    0.4 us a tensor on a loaded 2-core VM (a 1000-parameter model: 0.4 ms a call, against
    90 ms for its step on the emulated device)."""
    grad_on = torch.is_grad_enabled()
    rebound = []
    for key, t, ptr, mod, attr, rg in bound:
        if t.data_ptr() != ptr:
            rebound.append((key, t))
        if mod is not None and mod._parameters.get(attr) is not t:
            raise UsageError(
                f"parameter {key!r} was replaced by another object after the first call, but shfx trains the "
                f"parameters it captured (its host store holds them). Assign new values in place instead "
                f"(model.{key}.data = t, or cm.load_state_dict(...)), or compile the model again: cm.close(); "
                "cm = shfx.compile(model, ...) (the optimizer state starts fresh)."
            )
        if grad_on and rg is not None and t.requires_grad != rg:
            now = "requires_grad=False (frozen)" if rg else "requires_grad=True (trainable)"
            raise UsageError(
                f"parameter {key!r} has {now} now, but had requires_grad={rg} at the first call, when shfx laid "
                "out its stages and gradient buffers for the trainable parameters then. Set requires_grad before "
                f"the first call (or set it back: model.{key}.requires_grad_({rg})), or compile the model again: "
                "cm.close(); cm = shfx.compile(model, ...) (the optimizer state starts fresh)."
            )
    if rebound:
        take_rebound(store, engine, rebound)


def take_rebound(store: HostStore, engine: Engine, rebound: list[tuple[str, torch.Tensor]]) -> None:
    """Copy the values of tensors the user rebound (``p.data = t``) into the host store and
    bind the tensors to it again; the device copies reload before the next step."""
    for key, t in rebound:
        view = store.tensors[key]
        if t.device != view.device or t.shape != view.shape or t.dtype != view.dtype:
            raise UsageError(
                f"{key!r} was given new data after the first call ({key}.data = a tensor of shape "
                f"{tuple(t.shape)}, {t.dtype} on {t.device}), but shfx's host store holds it as shape "
                f"{tuple(view.shape)}, {view.dtype} on the CPU. Assign a tensor of the same shape and dtype on the "
                "CPU (shfx moves it to the device itself), or compile the model again: cm.close(); "
                "cm = shfx.compile(model, ...)."
            )
    engine.await_deferred()  # a running clipped update writes the store
    engine.wait_delayed()  # a running delayed update writes the store
    engine.sync_to_host()  # weights updated on the device: the host copy first, then the new values
    with torch.no_grad():
        for key, t in rebound:
            view = store.tensors[key]
            view.copy_(t.detach())
            t.data = view
    engine.invalidate_device_weights()
