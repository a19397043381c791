"""The optimizer on the device, for policies that keep it there (``resident``, ``l2l``, the
first stages of ``stronghold``).

AdamW states (m, v) of a group live on the device, laid out like the group's trainable region;
an update runs ``torch._fused_adamw_`` on the stage's parameters in its slot and the gradients
in the slot's gradient buffer, with the same per-parameter (merged) views as the host
optimizer, so results are bitwise those of the host update on the emulated device.
"""

from __future__ import annotations

import torch

from shfx.passes.layout import Group

from .backend import Backend
from .host_optim import _spans

__all__ = ["DeviceAdamW"]

STATES = "optimizer states"  # the memory-ledger term


class _DevState:
    __slots__ = ("step", "m", "v", "spans", "group")

    def __init__(self, backend: Backend, group: Group):
        dt = group.dtypes.state
        self.m = backend.alloc_device(group.state_bytes, f"optimizer state 0 of group {group.index}", STATES).view(dt)
        self.v = backend.alloc_device(group.state_bytes, f"optimizer state 1 of group {group.index}", STATES).view(dt)
        self.group = group.index
        self.m.zero_()
        self.v.zero_()
        self.step = torch.zeros((), dtype=torch.float32, device=backend.device)
        self.spans = _spans(group.trainable_spans())


class DeviceAdamW:
    """Device-side AdamW states per group; ``update`` steps one group in place."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.state: dict[int, _DevState] = {}

    def ensure(self, groups: list[Group]) -> None:
        """Allocate the states of ``groups`` now (they are the steady state's memory: a budget
        that cannot hold them fails at the first forward, not in the middle of a step)."""
        for g in groups:
            if g.index not in self.state and g.trainable_bytes:
                self.state[g.index] = _DevState(self.backend, g)

    def update(self, group: Group, params: torch.Tensor, grads: torch.Tensor, hp: dict) -> None:
        """Step ``group`` given views over its trainable region in the slot (``params``, the
        working dtype) and in the gradient buffer (``grads``, the device gradient dtype), both
        laid out like the host group."""
        if hp["amsgrad"]:
            raise NotImplementedError("amsgrad is not supported by the device-side optimizer")
        st = self.state.get(group.index)
        if st is None:
            st = self.state[group.index] = _DevState(self.backend, group)
        if not st.spans:
            return
        st.step += 1
        views = [[t[o : o + k] for o, k in st.spans] for t in (params, grads, st.m, st.v)]
        torch._fused_adamw_(
            *views,
            [],
            [st.step] * len(st.spans),
            lr=hp["lr"],
            beta1=hp["beta1"],
            beta2=hp["beta2"],
            weight_decay=hp["weight_decay"],
            eps=hp["eps"],
            amsgrad=False,
            maximize=hp["maximize"],
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
