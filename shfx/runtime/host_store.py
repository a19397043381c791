"""The host store: every parameter, buffer and tensor constant in flat per-group buffers.

The model's own tensors are rebound to views of these buffers (``param.data = view``), so the
model and the store share memory: ``model.state_dict()`` always reads the current master
weights, and nothing is held twice on the host. In mixed precision each group has two buffers:
its image (16-bit parameters, buffers, constants: what a PREFETCH sends) and its fp32 master
(the parameters the model sees); the host update writes both (:meth:`HostStore.working_view`),
and :meth:`HostStore.refresh_working` recasts the image after the master changed otherwise. Per group the store also keeps a flat fp32
gradient buffer laid out like the group's trainable region, created on first use, and a
per-group gradient state (none / valid) that mirrors ``p.grad is None``.

Data parallel (``dp``, :class:`shfx.runtime.data_parallel.DataParallelRuntime`): every rank
holds each group's image whole (what a PREFETCH sends; the model's parameters are views of it,
fp32), but only its shard (:func:`shfx.passes.sharding.shard_range`, ``[lo, hi)`` of the
trainable region) of the fp32 master weights (a buffer of its own), of the gradient, and of the
optimizer states: 16/N bytes per parameter besides the image. The first call broadcasts the
image from rank 0 (parameters and buffers, as DDP's constructor does) and the master shards are
read from it. :meth:`master`, :meth:`grad` and the optimizer states then cover the shard only;
:meth:`working_view` still takes group element offsets (the host update writes the shard of
the image); :meth:`shard_of` says which elements a buffer holds.

Data parallel in mixed precision (bf16): the image is the 16-bit working copy, whole on every
rank, and the model's *trainable* parameters are views of it (there is no whole fp32 master on
any rank: each holds its fp32 master shard, as DeepSpeed's ZeRO-2 does); frozen parameters keep
their whole fp32 masters (a buffer of ``master_nbytes - master_bytes``: the master layout less
its trainable region), which the model's frozen parameters view. The first call broadcasts
rank 0's fp32 masters group by group (one group's trainable region at a time), each rank keeps
its shard and casts the whole into its image, as ``p16.copy_(master)``. A group whose trainable
region mixes dtypes (BatchNorm's fp32 affine parameters, ``fp32_norms=True``) is refused.

Data parallel with a replicated optimizer (``dp.replicated``: Adafactor, whose update reads
whole rows and columns) holds everything whole, as without data parallel (:attr:`sharded` is
False: masters, gradients and states are the whole group's, the model's parameters view the
fp32 masters, ``.grad`` is exposed: the all-reduced gradient, as DDP's); only the first call's
broadcast of rank 0's weights (image and masters) differs.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import torch

from shfx.passes.layout import Group, TensorInfo

from ..errors import UsageError
from .backend import Backend

__all__ = ["HostStore", "GRAD_NONE", "GRAD_VALID"]

GRAD_NONE = 0
GRAD_VALID = 1


def _host_info(info: TensorInfo) -> TensorInfo:
    """``info`` as the model holds it (its master dtype)."""
    return dataclasses.replace(info, dtype=info.host_dtype or info.dtype, host_dtype=None)


def typed_view(buf: torch.Tensor, offset: int, info: TensorInfo) -> torch.Tensor:
    """A tensor of ``info``'s shape and dtype over ``buf[offset:offset+nbytes]`` (uint8)."""
    raw = buf[offset : offset + info.nbytes]
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=info.dtype, device=buf.device)
    return raw.view(info.dtype).view(info.shape)


class HostStore:
    """Flat host buffers for the groups of a stage layout, bound to the model's tensors."""

    def __init__(
        self,
        backend: Backend,
        groups: Sequence[Group],
        tensors: dict[str, torch.Tensor],
        pin: bool = True,
        staging_buffers: int = 2,
        dp: Any = None,
        paged: Sequence[int] = (),
        spill: Any = None,
    ):
        self.backend = backend
        self.groups = list(groups)
        self.pin = pin
        # the parameter tier (Offload(params="nvme")): groups whose image, fp32 master (the
        # trainable region) and gradient live on the SSD; ``spill(g, image, master)`` writes a
        # group's initial values there as the store lays it out, one group at a time
        self.paged = frozenset(paged)
        if self.paged and (dp is not None or spill is None):
            raise ValueError("paged groups need a spill function (the SSD store) and no data parallel")
        self._paged_master: dict[int, torch.Tensor] = {}  # paged group -> its master in a host-window buffer
        self._paged_grad: dict[int, torch.Tensor] = {}  # paged group -> its gradient in a host-window buffer
        self.paged_keys: dict[str, int] = {}  # key of a tensor in a paged group's image -> the group
        if dp is not None:
            _check_dp_parts(self.groups)
        replicated = dp is not None and dp.replicated
        if replicated:
            dp, bcast = None, dp  # laid out as without data parallel; rank 0's weights broadcast at the end
        self.buffers: list[torch.Tensor | None] = [
            None if g.index in self.paged else backend.alloc_host(g.nbytes, pin, f"image {g.index}") for g in self.groups
        ]  # (a paged group's are made one at a time below, written to the SSD and dropped)
        # mixed precision: the fp32 masters (never sent over the link: not pinned); under data
        # parallel only their frozen part (the trainable region is sharded: master_shards), at
        # byte ``master_base[g]`` of the group's master layout
        self.master_base = [g.master_bytes if dp is not None and g.separate_master else 0 for g in self.groups]
        self.masters = [
            torch.zeros(g.master_nbytes - base, dtype=torch.uint8)
            if g.separate_master and g.master_nbytes > base and g.index not in self.paged else None
            for g, base in zip(self.groups, self.master_base)
        ]
        self.tensors: dict[str, torch.Tensor] = {}
        self._casts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.groups]  # (image, master) views
        sources: dict[str, torch.Tensor] = {}  # data parallel, mixed: the trainable parameters' fp32 values
        for g in self.groups:
            if g.index in self.paged:  # (laid out in plain memory for the SSD, one group at a time)
                self.buffers[g.index] = torch.zeros(g.nbytes, dtype=torch.uint8)
                if g.separate_master:
                    self.masters[g.index] = torch.zeros(g.master_nbytes, dtype=torch.uint8)
            for info in g.infos:
                view = typed_view(self.buffers[g.index], g.offsets[info.key], info)
                src = tensors[info.key]
                if dp is not None and info.key in g.master_offsets and info.kind == "param" and info.trainable:
                    # its master is sharded (below): the model's parameter is its 16-bit working copy
                    sources[info.key] = src.detach()
                    with torch.no_grad():
                        view.copy_(src.detach())
                elif info.key in g.master_offsets:
                    mview = typed_view(self.masters[g.index], g.master_offsets[info.key] - self.master_base[g.index], _host_info(info))
                    with torch.no_grad():
                        mview.copy_(src.detach())
                        view.copy_(mview)
                    self._casts[g.index].append((view, mview))
                    view = mview  # the model sees its master
                else:
                    with torch.no_grad():
                        view.copy_(src.detach())
                if not info.key.startswith("<constant>"):
                    src.data = view  # the model's tensor now lives in the store
                self.tensors[info.key] = view
            if g.index in self.paged:
                self._spill(g, tensors, spill)
        if self.paged:
            _return_freed_memory()  # (the model's own tensors of paged groups are freed: give the pages back)
        # data parallel: (lo, hi) per group, and the fp32 master shards (the image is the
        # model's fp32 weights and what PF sends; each rank updates its shard of it)
        self.shards: list[tuple[int, int]] | None = None
        self.master_shards: list[torch.Tensor] = []
        if dp is not None:
            # every rank starts from rank 0's weights and buffers (and frozen fp32 masters)
            dp.broadcast(self.buffers + [m for m in self.masters if m is not None])
            self.shards = [dp.shard(g) for g in self.groups]
            self.master_shards = [torch.empty(hi - lo, dtype=g.dtypes.master) for g, (lo, hi) in zip(self.groups, self.shards)]
            for g in self.groups:
                if g.separate_master and g.trainable_numel:
                    # mixed precision: rank 0's fp32 trainable masters, one group at a time; this
                    # rank keeps its shard, and the image is their cast (p16.copy_(master))
                    whole = torch.zeros(g.trainable_numel, dtype=g.dtypes.master)
                    for info in g.infos:
                        if info.key in sources:
                            e = g.master_offsets[info.key] // g.dtypes.master.itemsize
                            whole[e : e + info.numel].copy_(sources[info.key].reshape(-1))
                    dp.broadcast([whole])
                    lo, hi = self.shards[g.index]
                    self.master_shards[g.index].copy_(whole[lo:hi])
                    with torch.no_grad():
                        self.image_trainable(g.index).copy_(whole)
                else:  # fp32: the image is the model's weights; the master shards are read from it
                    self.refresh_working(g.index)
            sources.clear()
        if replicated:  # every rank starts from rank 0's image and fp32 masters (the whole masters: replicated)
            bcast.broadcast(self.buffers + [m for m in self.masters if m is not None])
        self._grads: list[torch.Tensor | None] = [None] * len(self.groups)
        self.grad_state = [GRAD_NONE] * len(self.groups)
        self._staging_free: list[torch.Tensor] = []
        self._staging_count = 0
        self.staging_bytes = 0  # host bytes of the staging buffers allocated so far
        self._staging_max = max(1, staging_buffers)
        self._staging_cv = threading.Condition()
        self._grads_lock = threading.Lock()

    # ---- the parameter tier: paged groups ------------------------------------------------------
    def _spill(self, g: Group, tensors: dict[str, torch.Tensor], spill: Any) -> None:
        """Group ``g`` laid out: its image and trainable master go to the SSD (``spill``), the
        host keeps only its frozen parameters' fp32 masters (mixed precision); the model's
        other tensors of the group become placeholders (the values are on the SSD: read them
        with ``cm.state_dict()``)."""
        i = g.index
        image = self.buffers[i]
        master = self.masters[i]
        spill(i, image, master[: g.master_bytes] if master is not None else None)
        frozen = None
        if master is not None and g.master_nbytes > g.master_bytes:
            frozen = master[g.master_bytes :].clone()  # (mixed precision: frozen parameters' fp32 masters stay)
        self.master_base[i] = g.master_bytes if master is not None else 0
        self.masters[i] = frozen
        self._casts[i] = []
        for info in g.infos:
            key = info.key
            if key in g.master_offsets and frozen is not None and g.master_offsets[key] >= g.master_bytes:
                view = typed_view(frozen, g.master_offsets[key] - g.master_bytes, _host_info(info))
                tensors[key].data = view
                self.tensors[key] = view
                continue
            self.tensors.pop(key, None)
            self.paged_keys[key] = i
            if not key.startswith("<constant>"):
                t = tensors[key]
                t.data = placeholder(t.shape, t.dtype)
        self.buffers[i] = None

    def page_in(self, g: int, image: torch.Tensor) -> None:
        """Paged group ``g``'s image is in ``image`` (an image-window buffer) until :meth:`page_out`."""
        self.buffers[g] = image

    def page_out(self, g: int) -> None:
        self.buffers[g] = None

    def page_state(self, g: int, master: torch.Tensor | None, grad: torch.Tensor, valid: bool = False) -> None:
        """Paged group ``g``'s fp32 master (mixed precision; None in fp32, where the image is the
        master) and gradient are these host-window views until :meth:`unpage_state`; ``valid``:
        ``grad`` holds the gradient accumulated so far (read back from the SSD), which the
        gradient's copy adds to."""
        if master is not None:
            self._paged_master[g] = master
        self._paged_grad[g] = grad
        self.grad_state[g] = GRAD_VALID if valid else GRAD_NONE

    def unpage_state(self, g: int, keep_grad: bool = False) -> None:
        """The window buffer goes: the gradient was used by the update, or (``keep_grad``:
        gradient accumulation) written to the SSD, where it stays the group's gradient."""
        self._paged_master.pop(g, None)
        self._paged_grad.pop(g, None)
        if not keep_grad:
            self.grad_state[g] = GRAD_NONE

    def _paged_out(self, g: int, what: str) -> RuntimeError:
        from shfx.passes.program import ScheduleError

        return ScheduleError(
            f"group {g}'s {what} is on the SSD (Offload(params='nvme')), not in a host-window buffer: the program misses "
            "the parameter tier's read (PR/SR) before this use"
        )

    # ---- views ---------------------------------------------------------------------------
    def group_bytes(self, g: int) -> torch.Tensor:
        buf = self.buffers[g]
        if buf is None:
            raise self._paged_out(g, "image")
        return buf

    @property
    def sharded(self) -> bool:
        """Whether the masters, gradients and optimizer states are this rank's shards (data parallel)."""
        return self.shards is not None

    def shard_of(self, g: int) -> tuple[int, int]:
        """``[lo, hi)``: the elements of group ``g``'s trainable region that :meth:`master`,
        :meth:`grad` and the optimizer states hold (all of them without data parallel)."""
        if self.shards is None:
            return 0, self.groups[g].trainable_numel
        return self.shards[g]

    def image_trainable(self, g: int) -> torch.Tensor:
        """Group ``g``'s whole trainable region in the image, in the working dtype (data
        parallel's working copy: fp32, or bf16 in mixed precision)."""
        grp = self.groups[g]
        return self.buffers[g][: grp.trainable_bytes].view(grp.dtypes.working)

    def master(self, g: int) -> torch.Tensor:
        """The trainable region of group ``g`` (the master weights, padding included), in the
        master dtype; under data parallel this rank's shard of it (:meth:`shard_of`)."""
        if self.shards is not None:
            return self.master_shards[g]
        grp = self.groups[g]
        if g in self.paged and grp.separate_master:
            m = self._paged_master.get(g)
            if m is None:
                raise self._paged_out(g, "fp32 master")
            return m
        if grp.separate_master:
            return self.masters[g][: grp.master_bytes].view(grp.dtypes.master)
        return self.group_bytes(g)[: grp.trainable_bytes].view(grp.dtypes.master)

    def working_view(self, g: int, elem: int, numel: int) -> torch.Tensor | None:
        """Elements ``[elem, elem + numel)`` of group ``g``'s working copy (the image's trainable
        region, in the device dtype of the part holding them), or None when the image is the
        master (fp32 training)."""
        grp = self.groups[g]
        if self.shards is not None:  # data parallel: the image is the working copy (fp32 or 16-bit)
            return self.image_trainable(g)[elem : elem + numel]
        if not grp.separate_master:
            return None
        for p in grp.parts:
            if p.elem <= elem and elem + numel <= p.elem + p.numel:
                size = p.dtype.itemsize
                lo = p.offset + (elem - p.elem) * size
                return self.group_bytes(g)[lo : lo + numel * size].view(p.dtype)
        raise ValueError(f"elements [{elem}, {elem + numel}) of group {g} span parts of different dtypes")

    def refresh_working(self, g: int | None = None) -> None:
        """Recast the working copy of group ``g`` (every group: None) from its master: after the
        master changed other than by the host update (load_state_dict, a rollback).

        Data parallel: the model's trainable weights are the image, so whatever changed them
        wrote the image: the master shards are read back from it instead (in mixed precision
        the 16-bit values widened: :meth:`set_master_shards` keeps fp32 values' bits); a
        frozen parameter's image is recast from its fp32 master."""
        if self.shards is not None:
            with torch.no_grad():
                for gi in range(len(self.groups)) if g is None else (g,):
                    for view, mview in self._casts[gi]:  # (mixed precision: frozen parameters)
                        view.copy_(mview)
                    lo, hi = self.shards[gi]
                    self.master_shards[gi].copy_(self.image_trainable(gi)[lo:hi])
            return
        with torch.no_grad():
            for gi in range(len(self.groups)) if g is None else (g,):
                for view, mview in self._casts[gi]:
                    view.copy_(mview)

    def working_from_master_shards(self, g: int) -> None:
        """Data parallel, the other direction of :meth:`refresh_working`: this rank's shard of
        group ``g``'s image recast from its master shard (and frozen parameters' images from
        their masters), after a load wrote the masters; the other ranks' shards come with an
        all-gather (:meth:`shfx.runtime.data_parallel.DataParallelRuntime.refresh_masters`)."""
        if self.shards is None:
            raise RuntimeError("working_from_master_shards is for data parallel's sharded masters")
        lo, hi = self.shards[g]
        with torch.no_grad():
            for view, mview in self._casts[g]:
                view.copy_(mview)
            self.image_trainable(g)[lo:hi].copy_(self.master_shards[g])

    def set_master_shards(self, values: dict[str, torch.Tensor]) -> list[str]:
        """Data parallel in mixed precision: this rank's fp32 master shards from whole fp32
        ``values`` of trainable parameters (``{key: tensor}``; a state dict's), the range of
        each that the shard holds, exactly (:meth:`refresh_working` reads them from the 16-bit
        image). Returns the keys set; other keys are ignored."""
        if self.shards is None:
            raise RuntimeError("set_master_shards is for data parallel's sharded masters")
        done = []
        with torch.no_grad():
            for grp in self.groups:
                if not grp.separate_master:
                    continue
                lo, hi = self.shards[grp.index]
                size = grp.dtypes.master.itemsize
                for info in grp.infos:
                    t = values.get(info.key)
                    if t is None or not (info.kind == "param" and info.trainable):
                        continue
                    e = grp.master_offsets[info.key] // size
                    a, b = max(e, lo), min(e + info.numel, hi)
                    if a < b:
                        self.master_shards[grp.index][a - lo : b - lo].copy_(t.detach().reshape(-1)[a - e : b - e])
                    done.append(info.key)
        return done

    def grad(self, g: int) -> torch.Tensor:
        """Group ``g``'s flat gradient buffer in the host gradient dtype (created zeroed on first use)."""
        if g in self.paged:
            t = self._paged_grad.get(g)
            if t is None:
                raise self._paged_out(g, "gradient")
            return t
        t = self._grads[g]
        if t is None:
            # NOTE: under a lock: two threads using it first at once (the NVMe tier's SSD read
            # building the update's views, a gradient copy) must get the same buffer
            with self._grads_lock:
                t = self._grads[g]
                if t is None:
                    grp = self.groups[g]
                    lo, hi = self.shard_of(g)
                    nbytes = grp.grad_bytes if self.shards is None else (hi - lo) * grp.dtypes.grad.itemsize
                    t = self.backend.alloc_host(nbytes, self.pin, f"gradient {g}").view(grp.dtypes.grad)
                    self._grads[g] = t
        return t

    def grad_bytes(self, g: int) -> torch.Tensor:
        return self.grad(g).view(torch.uint8)

    def param_grad_view(self, key: str, owner: int) -> torch.Tensor:
        if self.shards is not None:  # pragma: no cover - .grad is not exposed under data parallel
            raise RuntimeError(f"data parallel shards the gradients: {key!r} has no whole gradient on this rank")
        g = self.groups[owner]
        info = g.info(key)
        if g.separate_master:  # laid out as the master
            return typed_view(self.grad_bytes(owner), g.master_offsets[key], _host_info(info))
        return typed_view(self.grad_bytes(owner), g.offsets[key], info)

    @property
    def host_bytes(self) -> int:
        n = sum(b.numel() for i, b in enumerate(self.buffers) if b is not None and i not in self.paged)
        n += sum(b.numel() for b in self.masters if b is not None)
        n += sum(t.numel() * t.element_size() for t in self.master_shards)
        n += sum(t.numel() * t.element_size() for t in self._grads if t is not None)
        return n

    # ---- staging for accumulating gradients ----------------------------------------------------
    def acquire_staging(self, nbytes: int, wait: bool = True) -> torch.Tensor:
        """A host buffer of at least ``nbytes`` for a gradient copy that must be added, not
        copied, into the gradient buffer. Blocks while all are in use; with ``wait=False`` (the
        caller holds one already and would wait for itself) allocates one more instead."""
        with self._staging_cv:
            while True:
                for i, b in enumerate(self._staging_free):
                    if b.numel() >= nbytes:
                        return self._staging_free.pop(i)
                if self._staging_count < self._staging_max or not wait:
                    self._staging_count += 1
                    return self._new_staging(nbytes)
                if self._staging_free:  # free ones are all too small: replace one
                    self.staging_bytes -= self._staging_free.pop(0).numel()
                    return self._new_staging(nbytes)
                self._staging_cv.wait()

    def ensure_staging(self, n: int) -> None:
        """Allocate staging buffers until ``n`` exist (the ledger's count for the program: its
        host memory is then what the ledger says from the first step, whichever copies happen
        to overlap), and allow at least ``n`` at once."""
        with self._staging_cv:
            self._staging_max = max(self._staging_max, n)
            while self._staging_count < n:
                self._staging_count += 1
                self._staging_free.append(self._new_staging(0))

    def _new_staging(self, nbytes: int) -> torch.Tensor:
        size = max(nbytes, max((g.grad_bytes for g in self.groups), default=nbytes))
        self.staging_bytes += size
        return self.backend.alloc_host(size, self.pin, "staging")

    def release_staging(self, buf: torch.Tensor) -> None:
        with self._staging_cv:
            self._staging_free.append(buf)
            self._staging_cv.notify()


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``; nothing elsewhere):
    after the parameter tier moved the model's tensors to the SSD, their memory would otherwise
    stay in the process's resident set as free heap."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # (not glibc)
        pass


def placeholder(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """What the model's own tensor of a paged group holds: one element broadcast to its shape
    (no memory), NaN for floating point (a forward of the model itself gives NaN, not numbers
    that look right); its values are on the SSD."""
    fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
    return torch.full((1,), fill, dtype=dtype).expand(tuple(shape))


def _check_dp_parts(groups: Sequence[Group]) -> None:
    """Data parallel reduces and gathers a group's trainable region in one dtype: refuse a
    group whose region mixes dtypes (mixed precision keeping some parameters fp32)."""
    for g in groups:
        dts = sorted({str(p.dtype).removeprefix("torch.") for p in g.parts if p.numel})
        if len(dts) > 1:
            fp32 = [i.key for i in g.infos if i.kind == "param" and i.trainable and i.dtype == torch.float32]
            raise UsageError(
                f"data_parallel does not support a stage whose trainable parameters have different dtypes on the "
                f"device: stage {g.index} holds {' and '.join(dts)} parameters ({', '.join(map(repr, fp32[:3]))}"
                f"{' ...' if len(fp32) > 3 else ''} kept fp32: BatchNorm's affine parameters, or LayerNorm/RMSNorm with "
                "fp32_norms=True). Data parallel reduce-scatters and all-gathers a stage's trainable region as one "
                "tensor of one dtype, and the ranks' shards cut it by elements; reducing each dtype's part apart is "
                "not built yet. Use precision='fp32' with data_parallel, or a model without fp32-kept parameters "
                "(fp32_norms=False)."
            )
