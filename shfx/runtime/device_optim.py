"""The optimizer on the device, for policies that keep it there (``resident``, ``l2l``, the
first stages of ``stronghold``).

AdamW states (m, v) of a group live on the device, laid out like the group's trainable region;
an update runs ``torch._fused_adamw_`` on the stage's parameters in its slot and the gradients
in the slot's gradient buffer, with the same per-parameter (merged) views as the host
optimizer (one kernel call per parameter group), so results are bitwise those of the host
update on the emulated device. Only :class:`shfx.optim.AdamW` runs here; another optimizer with a
policy that updates stages on the device is refused at the first call (:meth:`DeviceAdamW.ensure`).
"""

from __future__ import annotations

from typing import Any

import torch

from shfx.passes.layout import Group

from ..errors import UsageError
from .backend import Backend
from .host_optim import _hp_of, _layout, _spans

__all__ = ["DeviceAdamW"]

STATES = "optimizer states"  # the memory-ledger term


class _DevState:
    __slots__ = ("step", "m", "v", "spans", "group")

    def __init__(self, backend: Backend, group: Group, config: Any = None):
        dt = group.dtypes.state
        self.m = backend.alloc_device(group.state_bytes, f"optimizer state 0 of group {group.index}", STATES).view(dt)
        self.v = backend.alloc_device(group.state_bytes, f"optimizer state 1 of group {group.index}", STATES).view(dt)
        self.group = group.index
        self.m.zero_()
        self.v.zero_()
        self.step = torch.zeros((), dtype=torch.float32, device=backend.device)
        # per parameter group: (index, views' spans), as the host optimizer's
        self.spans = [(k, sp) for k, s in _layout(config, group) if (sp := _spans(s))]


class DeviceAdamW:
    """Device-side AdamW states per group; ``update`` steps one group in place."""

    def __init__(self, backend: Backend, config: Any = None):
        self.backend = backend
        self.config = config  # the shfx.optim optimizer (its parameter groups)
        self.state: dict[int, _DevState] = {}

    def ensure(self, groups: list[Group], host: Any = None) -> None:
        """Allocate the states of ``groups`` now (they are the steady state's memory: a budget
        that cannot hold them fails at the first forward, not in the middle of a step); states
        the host optimizer ``host`` holds for them (a state dict loaded before the first call)
        move here."""
        if groups and self.config is not None and not getattr(self.config, "on_device", True):
            name = type(self.config).__name__
            raise UsageError(
                f"this policy updates stage(s) {', '.join(str(g.index) for g in groups)} on the device, but "
                f"shfx.optim.{name} runs on the host only. Use a policy that updates every stage on the host "
                "(policy='stronghold' with resident_first=0, 'zero-offload') or shfx.optim.AdamW."
            )
        for g in groups:
            if g.index not in self.state and g.trainable_bytes:
                self.state[g.index] = _DevState(self.backend, g, self.config)
                moved = host.take(g.index) if host is not None and g.index in host.state else None
                if moved is not None:
                    self.put(g, *moved)

    def update(self, group: Group, params: torch.Tensor, grads: torch.Tensor, hp: dict, found_inf: torch.Tensor | None = None) -> None:
        """Step ``group`` given views over its trainable region in the slot (``params``, the
        working dtype) and in the gradient buffer (``grads``, the device gradient dtype), both
        laid out like the host group. ``found_inf``: a device flag (1.0: the gradient holds inf
        or NaN) that makes the update a no-op on the device, step count included, without the
        host reading it (as ``GradScaler`` steps fused AdamW)."""
        if _hp_of(hp, 0)["amsgrad"]:
            raise NotImplementedError("amsgrad is not supported by the device-side optimizer")
        st = self.state.get(group.index)
        if st is None:
            st = self.state[group.index] = _DevState(self.backend, group, self.config)
        if not st.spans:
            return
        if found_inf is None:
            st.step += 1
        else:
            st.step += 1 - found_inf
        for k, spans in st.spans:
            h = _hp_of(hp, k)
            views = [[t[o : o + n] for o, n in spans] for t in (params, grads, st.m, st.v)]
            torch._fused_adamw_(
                *views,
                [],
                [st.step] * len(spans),
                lr=h["lr"],
                beta1=h["beta1"],
                beta2=h["beta2"],
                weight_decay=h["weight_decay"],
                eps=h["eps"],
                amsgrad=False,
                maximize=h["maximize"],
                found_inf=found_inf,
            )

    def take(self, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Group ``g``'s ``(step, m, v)`` copied to the host, its device states freed (the group
        is updated on the host from now on); None when it has none."""
        st = self.state.pop(g, None)
        if st is None:
            return None
        out = (st.step.cpu(), st.m.cpu(), st.v.cpu())
        self.backend.free_device(st.m.view(torch.uint8), f"optimizer state 0 of group {g}", STATES)
        self.backend.free_device(st.v.view(torch.uint8), f"optimizer state 1 of group {g}", STATES)
        return out

    def put(self, group: Group, step: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        """Take over group ``group``'s states from the host (it is updated on the device from now on)."""
        self.ensure([group])
        st = self.state[group.index]
        st.step.copy_(step)
        st.m.copy_(m)
        st.v.copy_(v)

    def close(self) -> None:
        for st in self.state.values():
            self.backend.free_device(st.m.view(torch.uint8), f"optimizer state 0 of group {st.group}", STATES)
            self.backend.free_device(st.v.view(torch.uint8), f"optimizer state 1 of group {st.group}", STATES)
        self.state.clear()
