"""The optimizer on the device, for policies that keep it there (``resident``, ``l2l``, the
first stages of ``stronghold``).

AdamW states (m, v) of a group live on the device, laid out like the group's trainable region;
an update runs ``torch._fused_adamw_`` on the stage's parameters in its slot and the gradients
in the slot's gradient buffer, with the same per-parameter (merged) views as the host
optimizer (one kernel call per parameter group), so results are bitwise those of the host
update on the emulated device. Only :class:`shfx.optim.AdamW` runs here; another optimizer with a
policy that updates stages on the device is refused at the first call (:meth:`DeviceAdamW.ensure`).

Mixed precision (bf16/fp16): a group's fp32 master weights live on the device too, beside its
m and v (counted with them, ledger term ``optimizer states``), laid out like the host master
(element offsets). An update is the eager recipe's: the 16-bit gradient widened to fp32
(``master.grad = p16.grad.float()``, part by part: a BatchNorm part stays fp32), divided by the
loss scale (fp16) and multiplied by the clip coefficient where asked, AdamW on the fp32 master,
then the 16-bit working copy in the slot rebuilt from it (``p16.copy_(master)``). The widened
gradient is a transient of the group's size (4 B/param of one group, on the compute stream).
The device master is the newer copy: the host master (the model's parameters) is written from
it by :meth:`DeviceAdamW.sync_masters` (``cm.sync()``, ``state_dict``, checkpoints; the
residency's ``sync_to_host``), and read into it again when the host weights change
(:meth:`DeviceAdamW.invalidate_masters`: a load, ``p.data = t``).
"""

from __future__ import annotations

from typing import Any

import torch

from shfx.passes.layout import Group

from ..errors import UsageError
from .backend import Backend
from .host_optim import _hp_of, _layout, _spans

__all__ = ["DeviceAdamW", "widen", "master_label"]

STATES = "optimizer states"  # the memory-ledger term


def master_label(g: int) -> str:
    """The allocation name of group ``g``'s fp32 master weights on the device."""
    return f"master weights (fp32) of group {g}"


class _DevState:
    __slots__ = ("step", "m", "v", "spans", "group", "master")

    def __init__(self, backend: Backend, group: Group, config: Any = None):
        dt = group.dtypes.state
        self.m = backend.alloc_device(group.state_bytes, f"optimizer state 0 of group {group.index}", STATES).view(dt)
        self.v = backend.alloc_device(group.state_bytes, f"optimizer state 1 of group {group.index}", STATES).view(dt)
        self.group = group.index
        self.m.zero_()
        self.v.zero_()
        # mixed precision: the fp32 master on the device (read from the host master before the
        # first update: DeviceAdamW.stale)
        self.master: torch.Tensor | None = None
        if group.dtypes.mixed:
            self.master = backend.alloc_device(group.master_bytes, master_label(group.index), STATES).view(group.dtypes.master)
        self.step = torch.zeros((), dtype=torch.float32, device=backend.device)
        # per parameter group: (index, views' spans), as the host optimizer's
        self.spans = [(k, sp) for k, s in _layout(config, group) if (sp := _spans(s))]


class DeviceAdamW:
    """Device-side AdamW states per group; ``update`` steps one group in place."""

    def __init__(self, backend: Backend, config: Any = None, store: Any = None):
        self.backend = backend
        self.config = config  # the shfx.optim optimizer (its parameter groups)
        self.store = store  # the host store (mixed precision: the host masters)
        self.state: dict[int, _DevState] = {}
        self.stale: set[int] = set()  # device masters older than the host's: read before the next update
        self.dirty: set[int] = set()  # device masters newer than the host's: written back by sync_masters

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
                self._new(g)
                moved = host.take(g.index) if host is not None and g.index in host.state else None
                if moved is not None:
                    self.put(g, *moved)

    def _new(self, group: Group) -> _DevState:
        st = self.state[group.index] = _DevState(self.backend, group, self.config)
        if st.master is not None:
            self.stale.add(group.index)
        return st

    def update(
        self, group: Group, params: torch.Tensor, grads: torch.Tensor, hp: dict, found_inf: torch.Tensor | None = None,
        wide: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """Step ``group`` given views over its trainable region in the slot (``params``, the
        working dtype) and in the gradient buffer (``grads``, the device gradient dtype), both
        laid out like the host group. ``found_inf``: a device flag (1.0: the gradient holds inf
        or NaN) that makes the update a no-op on the device, step count included, without the
        host reading it (as ``GradScaler`` steps fused AdamW).

        Mixed precision: ``params`` and ``grads`` are the raw bytes of the region (its parts
        have their own dtypes), ``wide`` the fp32 gradient (:func:`widen`, unscaled and clipped
        by the caller); AdamW steps the device master, then the working copy is its cast."""
        if _hp_of(hp, 0)["amsgrad"]:
            raise NotImplementedError("amsgrad is not supported by the device-side optimizer")
        st = self.state.get(group.index)
        if st is None:
            st = self._new(group)
        if not st.spans:
            return
        if st.master is not None:
            self.load_master(group.index)
            if wide is None:
                raise RuntimeError(f"group {group.index} is mixed precision: its update needs the fp32 gradient (wide=)")
            working, params, grads = params, st.master, wide
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
        if st.master is not None:
            with torch.no_grad():
                for p in group.parts:  # p16.copy_(master), part by part
                    working[p.offset : p.offset + p.nbytes].view(p.dtype).copy_(st.master[p.elem : p.elem + p.numel])
            self.dirty.add(group.index)

    # ---- mixed precision: the device masters ----------------------------------------------------
    def load_master(self, g: int) -> None:
        """Read group ``g``'s host master into its device master if the device's is older."""
        if g not in self.stale:
            return
        st = self.state[g]
        if self.store.sharded:  # (data parallel: the host holds a shard; gather_masters reads the whole)
            raise RuntimeError(f"group {g}'s device master was not gathered from the ranks' master shards before its update")
        self.backend.h2d_copy(st.master, self.store.master(g))
        self.stale.discard(g)

    def gather_masters(self, dp: Any) -> None:
        """Data parallel (the host's fp32 masters sharded): the device masters older than the
        host's read from the whole master, all-gathered from every rank's shard (collective:
        every rank calls it at the same point; nothing to do once they are current)."""
        if not self.store.sharded:
            return
        for g in sorted(g for g in self.stale if self.state[g].master is not None):
            self.backend.h2d_copy(self.state[g].master, dp.whole_master(g))
            self.stale.discard(g)

    def _write_host_master(self, g: int, master: torch.Tensor) -> None:
        """The device master ``master`` of group ``g`` into the host's (data parallel: the range
        of this rank's shard of it)."""
        lo, hi = self.store.shard_of(g)
        self.backend.d2h_copy(self.store.master(g), master[lo:hi] if self.store.sharded else master)

    def invalidate_masters(self) -> None:
        """The host masters changed (a load, ``p.data = t``): the device masters are read from
        them again before their next update."""
        self.dirty.clear()
        self.stale.update(g for g, st in self.state.items() if st.master is not None)

    def sync_masters(self) -> None:
        """Write the device masters newer than the host's into the host masters (the model's
        parameters); called from a ``d2h`` task or with the device idle."""
        for g in sorted(self.dirty):
            self._write_host_master(g, self.state[g].master)
        self.dirty.clear()

    def master_of(self, g: int) -> torch.Tensor | None:
        """Group ``g``'s fp32 master on the device (mixed precision; None otherwise or before
        its state exists), current (read from the host first if older)."""
        st = self.state.get(g)
        if st is None or st.master is None:
            return None
        self.load_master(g)
        return st.master

    def take(self, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Group ``g``'s ``(step, m, v)`` copied to the host, its device states freed (the group
        is updated on the host from now on); None when it has none."""
        st = self.state.pop(g, None)
        if st is None:
            return None
        out = (st.step.cpu(), st.m.cpu(), st.v.cpu())
        if st.master is not None:  # (the caller synced the masters to the host first)
            if g in self.dirty:
                self.backend.d2h_copy(self.store.master(g), st.master)
            self.dirty.discard(g)
            self.stale.discard(g)
        self._free(st)
        return out

    def _free(self, st: _DevState) -> None:
        g = st.group
        self.backend.free_device(st.m.view(torch.uint8), f"optimizer state 0 of group {g}", STATES)
        self.backend.free_device(st.v.view(torch.uint8), f"optimizer state 1 of group {g}", STATES)
        if st.master is not None:
            self.backend.free_device(st.master.view(torch.uint8), master_label(g), STATES)

    def put(self, group: Group, step: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        """Take over group ``group``'s states from the host (it is updated on the device from now on)."""
        self.ensure([group])
        st = self.state[group.index]
        st.step.copy_(step)
        st.m.copy_(m)
        st.v.copy_(v)

    def close(self) -> None:
        for st in self.state.values():
            self._free(st)
        self.state.clear()
        self.stale.clear()
        self.dirty.clear()


def widen(group: Group, grads: torch.Tensor, scale: torch.Tensor | None = None, coef: torch.Tensor | None = None) -> torch.Tensor:
    """Mixed precision: group ``group``'s device gradient (``grads``: the raw bytes of its
    trainable region in the gradient buffer, each part in its dtype) as a new fp32 tensor laid
    out like the master (``master.grad = p16.grad.float()``), divided by the loss ``scale``
    (fp16, as the host's unscale and the fused kernel's ``grad_scale``) and multiplied by the
    clip ``coef`` (as ``clip_grad_norm_``'s ``_foreach_mul_``) when given."""
    out = torch.empty(group.trainable_numel, dtype=group.dtypes.master, device=grads.device)
    for p in group.parts:
        out[p.elem : p.elem + p.numel].copy_(grads[p.offset : p.offset + p.nbytes].view(p.dtype))
    if scale is not None:
        out.div_(scale.to(out.device))
    if coef is not None:
        out.mul_(coef.to(out.device))
    return out
