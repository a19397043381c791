"""The optimizer on the device, for policies that keep it there (``resident``, ``l2l``, the
first stages of ``stronghold``).

AdamW states (m, v) of a group live on the device, laid out like the group's trainable region;
an update runs ``torch._fused_adamw_`` on the stage's parameters in its slot and the gradients
in the slot's gradient buffer, with the same per-parameter (merged) views as the host
optimizer (one kernel call per parameter group), so results are bitwise those of the host
update on the emulated device. :class:`DeviceSGD` and :class:`DeviceAdafactor` run
:class:`shfx.optim.SGD` and :class:`shfx.optim.Adafactor` the same way (their host runners'
kernels and views on device tensors: SGD's momentum buffer, Adafactor's factored second moments
in one flat device buffer and its per-parameter steps on the host, as torch keeps them);
:func:`device_runner_for` picks one by the optimizer. An optimizer none of them runs is refused
at the first call with a policy that updates stages on the device (:meth:`DeviceAdamW.ensure`).

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

__all__ = ["DeviceAdamW", "DeviceSGD", "DeviceAdafactor", "device_runner_for", "widen", "master_label"]

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

    def tensors(self) -> list[torch.Tensor]:
        """What an update overwrites (the step first): what the step journal copies."""
        return [self.step, self.m, self.v]

    def restored(self) -> None:
        """The journal or a load wrote the tensors (nothing of them is cached on the host)."""


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


# ---- the other optimizers on the device (SGD, Adafactor) ------------------------------------------
# NOTE: one view per parameter, as their host runners (shfx.runtime.host_optim) take them: the
# same kernel calls over the same views on device tensors, so results are bitwise the host's
# (and torch's) on the emulated device, and torch's on a GPU.


def _param_shapes(group: Group) -> dict[int, tuple[int, ...]]:
    """Element offset -> shape of each trainable parameter of ``group``."""
    keys = [i for i in group.infos if i.kind == "param" and i.trainable]
    return {o: tuple(info.shape) for info, (o, _) in zip(keys, group.trainable_spans())}


def _nonempty(config: Any, group: Group) -> list[tuple[int, list[tuple[int, int]]]]:
    """``[(param group index, [(offset, numel)])]`` of the group's non-empty parameters (the
    host runners' per-parameter views, :func:`shfx.runtime.host_optim._param_views`' order)."""
    out = []
    for k, spans in _layout(config, group):
        spans = [(o, n) for o, n in spans if n]
        if spans:
            out.append((k, spans))
    return out


class _DevSGDState:
    """SGD's state of one group on the device: its momentum buffer (laid out like the group's
    trainable region), the step count (a device scalar: torch's first-step test) and, in mixed
    precision, the fp32 master.

    ``first``: whether the next update is the first (``torch._fused_sgd_``'s ``is_first_step``,
    a host bool), as far as the host knows without reading the device: None after an update a
    device ``found_inf`` may have skipped while it was the first, or after a rollback or load
    (the next update reads the step count, once)."""

    __slots__ = ("step", "momentum_buffer", "spans", "group", "master", "first", "allocs")

    def __init__(self, backend: Backend, group: Group, config: Any = None):
        label = f"optimizer state 0 of group {group.index}"
        self.momentum_buffer = backend.alloc_device(group.state_bytes, label, STATES).view(group.dtypes.state)
        self.momentum_buffer.zero_()
        self.allocs = [(self.momentum_buffer, label)]
        self.group = group.index
        self.master = _alloc_master(backend, group, self.allocs)
        self.step = torch.zeros((), dtype=torch.float32, device=backend.device)
        self.first: bool | None = True
        self.spans = _nonempty(config, group)

    def tensors(self) -> list[torch.Tensor]:
        """What an update overwrites (the step first): what the step journal copies."""
        return [self.step, self.momentum_buffer]

    def restored(self) -> None:
        """The journal or a load wrote the tensors: the first-step test reads the step again."""
        self.first = None


class _DevAdafactorState:
    """Adafactor's state of one group on the device: the factored second moments of every
    parameter (row and column vectors of a matrix, the full second moment of a vector) in one
    flat device buffer, in the host runner's order and shapes, and one step per parameter, as
    torch keeps them: host scalars (torch's Adafactor keeps its steps on the CPU and reads
    them there whatever the parameters' device); in mixed precision the fp32 master."""

    __slots__ = ("steps", "factors", "pgs", "index", "group", "master", "allocs")

    def __init__(self, backend: Backend, group: Group, config: Any = None):
        from .host_optim import _factor_views, _factored_numel

        shapes = _param_shapes(group)
        lay = _nonempty(config, group)
        size = sum(_factored_numel(shapes[o]) for _, spans in lay for o, _ in spans)
        dt = group.dtypes.state
        label = f"factored states of group {group.index}"
        self.factors = backend.alloc_device(size * dt.itemsize, label, STATES).view(dt)
        self.factors.zero_()
        self.allocs = [(self.factors, label)]
        self.group = group.index
        self.master = _alloc_master(backend, group, self.allocs)
        self.steps: list[torch.Tensor] = []
        self.index: dict[int, tuple[int, int]] = {}  # element offset -> (position in pgs, in its lists)
        self.pgs = []
        pos = 0
        for k, spans in lay:
            rows, cols, variances, steps = [], [], [], []
            for o, _ in spans:
                r, c, v, pos = _factor_views(self.factors, pos, shapes[o])
                self.index[o] = (len(self.pgs), len(rows))
                rows.append(r)
                cols.append(c)
                variances.append(v)
                self.steps.append(torch.zeros((), dtype=torch.float32))
                steps.append(self.steps[-1])
            self.pgs.append((k, [shapes[o] for o, _ in spans], spans, rows, cols, variances, steps))

    @property
    def step(self) -> torch.Tensor:
        return self.steps[0] if self.steps else torch.zeros(())

    def views_at(self, off: int) -> tuple[torch.Tensor, Any, Any, Any]:
        """``(step, row_var, col_var, variance)`` of the parameter at element ``off``."""
        i, j = self.index[off]
        _, _, _, rows, cols, variances, steps = self.pgs[i]
        return steps[j], rows[j], cols[j], variances[j]

    def tensors(self) -> list[torch.Tensor]:
        return [*self.steps, self.factors]

    def restored(self) -> None:
        pass


def _alloc_master(backend: Backend, group: Group, allocs: list) -> torch.Tensor | None:
    """Mixed precision: group ``group``'s fp32 master on the device (None in fp32)."""
    if not group.dtypes.mixed:
        return None
    master = backend.alloc_device(group.master_bytes, master_label(group.index), STATES).view(group.dtypes.master)
    allocs.append((master, master_label(group.index)))
    return master


class _DeviceRunner(DeviceAdamW):
    """What :class:`DeviceAdamW` does per group (states created at the first update or
    :meth:`ensure`, the device masters of mixed precision, ``take``/``put``), for an optimizer
    whose state class is ``_state_class`` and whose kernel call is :meth:`_step`."""

    _state_class: Any = None

    def _new(self, group: Group) -> Any:
        st = self.state[group.index] = self._state_class(self.backend, group, self.config)
        if st.master is not None:
            self.stale.add(group.index)
        return st

    def update(
        self, group: Group, params: torch.Tensor, grads: torch.Tensor, hp: Any, found_inf: torch.Tensor | None = None,
        wide: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """As :meth:`DeviceAdamW.update`, with this optimizer's kernel."""
        st = self.state.get(group.index)
        if st is None:
            st = self._new(group)
        if not (st.spans if hasattr(st, "spans") else st.pgs):
            return
        working = None
        if st.master is not None:
            self.load_master(group.index)
            if wide is None:
                raise RuntimeError(f"group {group.index} is mixed precision: its update needs the fp32 gradient (wide=)")
            working, params, grads = params, st.master, wide
        self._step(st, params, grads, hp, found_inf)
        if working is not None:
            with torch.no_grad():
                for p in group.parts:  # p16.copy_(master), part by part
                    working[p.offset : p.offset + p.nbytes].view(p.dtype).copy_(st.master[p.elem : p.elem + p.numel])
            self.dirty.add(group.index)

    def _step(self, st: Any, params: torch.Tensor, grads: torch.Tensor, hp: Any, found_inf: torch.Tensor | None) -> None:
        raise NotImplementedError

    def take(self, g: int) -> tuple[torch.Tensor, ...] | None:
        """Group ``g``'s states copied to the host, in the order its host runner's ``put``
        takes them, its device states freed; None when it has none."""
        st = self.state.pop(g, None)
        if st is None:
            return None
        out = self._export(st)
        if st.master is not None:
            if g in self.dirty:
                self._write_host_master(g, st.master)
            self.dirty.discard(g)
            self.stale.discard(g)
        self._free(st)
        return out

    def _export(self, st: Any) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _free(self, st: Any) -> None:
        for t, label in st.allocs:
            self.backend.free_device(t.view(torch.uint8), label, STATES)

    def put(self, group: Group, *states: torch.Tensor) -> None:
        """Take over group ``group``'s states from its host runner (its ``take``'s tuple)."""
        self.ensure([group])
        st = self.state[group.index]
        self._import(st, states)
        st.restored()

    def _import(self, st: Any, states: tuple[torch.Tensor, ...]) -> None:
        raise NotImplementedError


class DeviceSGD(_DeviceRunner):
    """SGD on the device: ``torch._fused_sgd_`` (``torch.optim.SGD(fused=True)``'s kernel)
    per parameter group over per-parameter views of the parameters (or the fp32 master), the
    gradient and the momentum buffer on the device; a device ``found_inf`` makes it a no-op
    there (the step count included), as ``GradScaler`` steps the fused SGD."""

    _state_class = _DevSGDState

    def _step(self, st: _DevSGDState, params, grads, hp, found_inf) -> None:
        first = st.first
        if first is None:  # NOTE: a device read, only until a step is known to have landed
            first = int(st.step.item()) == 0
        for k, spans in st.spans:
            h = _hp_of(hp, k)
            bufs = [st.momentum_buffer[o : o + n] for o, n in spans] if h["momentum"] != 0 else []
            torch._fused_sgd_(
                [params[o : o + n] for o, n in spans], [grads[o : o + n] for o, n in spans], bufs,
                weight_decay=h["weight_decay"], momentum=h["momentum"], lr=h["lr"], dampening=h["dampening"],
                nesterov=h["nesterov"], maximize=h["maximize"], is_first_step=first, found_inf=found_inf,
            )  # fmt: skip
        if found_inf is None:
            st.step += 1
            st.first = False
        else:
            st.step += 1 - found_inf
            st.first = None if first else False  # (a skipped first step leaves the next one first)

    def _export(self, st: _DevSGDState) -> tuple[torch.Tensor, ...]:
        return st.step.cpu(), st.momentum_buffer.cpu()

    def _import(self, st: _DevSGDState, states) -> None:
        step, buf = states
        st.step.copy_(step)
        st.momentum_buffer.copy_(buf)


class DeviceAdafactor(_DeviceRunner):
    """Adafactor on the device: torch's functional ``adafactor(foreach=True)`` (what
    ``torch.optim.Adafactor(foreach=True)`` runs) per parameter group over views in each
    parameter's shape of the parameters (or the fp32 master) and the gradient on the device,
    and of the device buffer of factored second moments.

    NOTE: torch's Adafactor takes no ``found_inf`` (``GradScaler`` unscales its gradients and
    skips its ``step()``): a device ``found_inf`` is read on the host here, where torch's
    Adafactor reads its step counts and each parameter's norms anyway."""

    _state_class = _DevAdafactorState

    def _step(self, st: _DevAdafactorState, params, grads, hp, found_inf) -> None:
        from torch.optim._adafactor import adafactor

        if found_inf is not None and bool(found_inf.item()):
            return
        for k, shapes, spans, rows, cols, variances, steps in st.pgs:
            h = _hp_of(hp, k)
            adafactor(
                [params[o : o + n].view(sh) for (o, n), sh in zip(spans, shapes)],
                [grads[o : o + n].view(sh) for (o, n), sh in zip(spans, shapes)],
                rows, cols, variances, steps, foreach=True, d=h["d"], lr=h["lr"], beta2_decay=h["beta2_decay"],
                weight_decay=h["weight_decay"], eps1=h["eps1"], eps2=h["eps2"], maximize=h["maximize"],
            )  # fmt: skip

    def _export(self, st: _DevAdafactorState) -> tuple[torch.Tensor, ...]:
        steps = torch.stack(st.steps) if st.steps else torch.zeros(0)
        return steps, st.factors.cpu()

    def _import(self, st: _DevAdafactorState, states) -> None:
        steps, factors = states
        for i, s in enumerate(st.steps):
            s.copy_(steps[i])
        st.factors.copy_(factors)


#: the device runners by the name of the host runner (``shfx.optim.HostOptimizer.host_runner``)
_DEVICE_RUNNERS: dict[str, type] = {"adamw": DeviceAdamW, "sgd": DeviceSGD, "adafactor": DeviceAdafactor}


def device_runner_for(backend: Backend, config: Any = None, store: Any = None) -> DeviceAdamW:
    """The device runner of optimizer ``config`` (:class:`DeviceAdamW` for an unknown one,
    whose :meth:`DeviceAdamW.ensure` refuses an optimizer that does not run on the device)."""
    cls = _DEVICE_RUNNERS.get(getattr(config, "host_runner", None), DeviceAdamW)
    return cls(backend, config, store)
