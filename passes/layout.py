"""Byte layouts: host parameter groups and device slots, and the copies between them.

Each *group* is one contiguous host buffer holding the tensors a stage owns (the stage that
first uses them), in this order, every tensor aligned to :data:`ALIGN` bytes::

    [ trainable params (master) | frozen params | buffers the forward mutates | other buffers, constants ]

The trainable region ``[0, trainable_bytes)`` is also the layout, element for element, of the
group's gradient buffer and optimizer states, so one optimizer call covers a whole group
(padding is zero and stays zero). Each copy of that region has its own dtype
(:class:`CopyDtypes`: host master, host gradient, optimizer state, device working copy, device
gradient), carried by the group; byte counts everywhere come from it. A stage's *slot* holds the whole region of each group it uses entirely, then
single tensors it borrows from other groups (a tied embedding used by the head and the tail).
Transfers are lists of :class:`Copy`, merged where contiguous: one copy per stage in the
common case.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["ALIGN", "TensorInfo", "CopyDtypes", "Group", "Copy", "SlotPlan", "plan_groups", "plan_slot", "align"]

ALIGN = 64


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorInfo:
    """A parameter, buffer or tensor constant the host store keeps."""

    key: str
    kind: str  # "param" | "buffer" | "constant"
    shape: tuple[int, ...]
    dtype: torch.dtype
    trainable: bool = False
    mutable: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, key: str, kind: str, t: torch.Tensor, trainable: bool = False, mutable: bool = False) -> TensorInfo:
        return cls(key, kind, tuple(t.shape), t.dtype, trainable, mutable)


@dataclass(frozen=True)
class CopyDtypes:
    """The dtype of each copy of a group's trainable region.

    Attributes:
        master: the host master weights (the region of the group's own buffer).
        grad: the host gradient buffer gradients accumulate in.
        state: each optimizer state (AdamW's m and v), on the host or on the device.
        working: the device working copy a PREFETCH puts in a slot.
        device_grad: the gradient a BACKWARD writes on the device (what an OFFLOAD_GRAD moves).
    """

    master: torch.dtype = torch.float32
    grad: torch.dtype = torch.float32
    state: torch.dtype = torch.float32
    working: torch.dtype = torch.float32
    device_grad: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        # NOTE: a slot holds the host group's bytes as they are, so the working copy and the
        # device gradient share the master's layout; a 16-bit working copy (mixed precision)
        # needs its own slot layout and a cast on the host (a later issue).
        if not (self.working == self.master == self.device_grad == self.grad):
            raise NotImplementedError(
                f"a working copy, device gradient or host gradient in another dtype than the master ({self}) is not "
                "supported yet: shfx trains in the parameters' dtype"
            )


FP32 = CopyDtypes()

_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"fp32"``."""
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class Group:
    """One host buffer: the tensors stage ``index`` owns (in the capture that planned it)."""

    index: int
    infos: tuple[TensorInfo, ...]
    offsets: dict[str, int] = field(hash=False)
    trainable_bytes: int
    mutable_range: tuple[int, int]
    nbytes: int
    dtypes: CopyDtypes = FP32

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(i.key for i in self.infos)

    @property
    def trainable_numel(self) -> int:
        """Elements of the trainable region (padding included): of the master, the gradient
        buffer and each optimizer state alike."""
        return self.trainable_bytes // self.dtypes.master.itemsize

    @property
    def grad_bytes(self) -> int:
        """Bytes of the host gradient buffer."""
        return self.trainable_numel * self.dtypes.grad.itemsize

    @property
    def state_bytes(self) -> int:
        """Bytes of one optimizer state (AdamW has two: m and v)."""
        return self.trainable_numel * self.dtypes.state.itemsize

    def trainable_spans(self) -> list[tuple[int, int]]:
        """``(element offset, numel)`` of each trainable parameter in the trainable region."""
        size = self.dtypes.master.itemsize
        return [(self.offsets[i.key] // size, i.numel) for i in self.infos if i.kind == "param" and i.trainable]

    def info(self, key: str) -> TensorInfo:
        for i in self.infos:
            if i.key == key:
                return i
        raise KeyError(key)


@dataclass(frozen=True)
class Copy:
    """One contiguous transfer between group ``group``'s host buffer (or its grad buffer,
    which shares the trainable region's offsets) and a slot."""

    group: int
    host_offset: int
    slot_offset: int
    nbytes: int


@dataclass(frozen=True)
class SlotPlan:
    """Where each tensor of a stage sits in its slot, and the copies that fill and drain it."""

    stage: int
    offsets: dict[str, int] = field(hash=False)
    prefetch: tuple[Copy, ...]
    grads: tuple[Copy, ...]
    buffers_out: tuple[Copy, ...]
    nbytes: int

    @staticmethod
    def total(copies: Iterable[Copy]) -> int:
        return sum(c.nbytes for c in copies)


def _order(info: TensorInfo) -> int:
    if info.kind == "param":
        return 0 if info.trainable else 1
    if info.mutable:
        return 2
    return 3


def plan_groups(owned: Sequence[Sequence[TensorInfo]], dtypes: CopyDtypes = FP32) -> list[Group]:
    """Given the tensors each stage owns (first-use order) and the dtypes of the copies of their
    trainable regions, lay out one host group per stage."""
    groups = []
    for gi, infos in enumerate(owned):
        for i in infos:
            if i.trainable and i.dtype != dtypes.master:
                m = dtype_name(dtypes.master)
                raise NotImplementedError(
                    f"parameter {i.key!r} is {i.dtype} and trainable; shfx keeps {m} master weights and for now trains "
                    f"{m} parameters only. Convert the model with model.float() before shfx.compile."
                )
        ordered = sorted(infos, key=_order)  # stable: keeps first-use order inside each region
        offsets: dict[str, int] = {}
        pos = 0
        trainable_end = 0
        mut = [None, None]
        for info in ordered:
            offsets[info.key] = pos
            pos = align(pos + info.nbytes)
            if info.kind == "param" and info.trainable:
                trainable_end = pos
            if info.kind != "param" and info.mutable:
                if mut[0] is None:
                    mut[0] = offsets[info.key]
                mut[1] = pos
        groups.append(
            Group(
                index=gi,
                infos=tuple(ordered),
                offsets=offsets,
                trainable_bytes=trainable_end,
                mutable_range=(mut[0] or 0, mut[1] or 0),
                nbytes=pos,
                dtypes=dtypes,
            )
        )
    return groups


def _merge(copies: list[Copy]) -> tuple[Copy, ...]:
    out: list[Copy] = []
    for c in copies:
        if (
            out
            and out[-1].group == c.group
            and out[-1].host_offset + out[-1].nbytes == c.host_offset
            and out[-1].slot_offset + out[-1].nbytes == c.slot_offset
        ):
            p = out[-1]
            out[-1] = Copy(p.group, p.host_offset, p.slot_offset, p.nbytes + c.nbytes)
        else:
            out.append(c)
    return tuple(out)


def plan_slot(
    stage: int,
    keys: Sequence[str],
    mutated: Iterable[str],
    grads: Iterable[str],
    groups: Sequence[Group],
    owner: dict[str, int],
) -> SlotPlan:
    """Lay out stage ``stage``'s slot.

    Given the tensor keys the stage uses, the buffers it mutates, the parameters it produces
    gradients for, the host groups and each key's owning group: place every group the stage
    uses entirely as one region, then the remaining tensors one by one; list the copies.
    """
    keyset = set(keys)
    mutated = set(mutated)
    grads = set(grads)
    offsets: dict[str, int] = {}
    prefetch: list[Copy] = []
    grad_copies: list[Copy] = []
    buf_copies: list[Copy] = []
    pos = 0
    whole: set[int] = set()
    seen_groups: list[int] = []
    for k in keys:
        if owner[k] not in seen_groups:
            seen_groups.append(owner[k])
    for g in seen_groups:
        grp = groups[g]
        if set(grp.keys) <= keyset:
            whole.add(g)
            base = pos
            for k in grp.keys:
                offsets[k] = base + grp.offsets[k]
            prefetch.append(Copy(g, 0, base, grp.nbytes))
            pos = align(base + grp.nbytes)
    for k in keys:
        if k in offsets:
            continue
        grp = groups[owner[k]]
        offsets[k] = pos
        prefetch.append(Copy(grp.index, grp.offsets[k], pos, grp.info(k).nbytes))
        pos = align(pos + grp.info(k).nbytes)
    # gradients: the whole trainable region of a whole group when the stage trains all of it
    for g in seen_groups:
        grp = groups[g]
        trainable = {i.key for i in grp.infos if i.kind == "param" and i.trainable}
        if g in whole and trainable and trainable <= grads:
            grad_copies.append(Copy(g, 0, offsets[grp.infos[0].key] - grp.offsets[grp.infos[0].key], grp.trainable_bytes))
            grads = grads - trainable
    for k in keys:
        if k in grads:
            grp = groups[owner[k]]
            grad_copies.append(Copy(grp.index, grp.offsets[k], offsets[k], grp.info(k).nbytes))
    # mutated buffers back to the host
    for g in seen_groups:
        grp = groups[g]
        region = {i.key for i in grp.infos if i.kind != "param" and i.mutable}
        if g in whole and region and region <= mutated:
            lo, hi = grp.mutable_range
            buf_copies.append(Copy(g, lo, offsets[grp.infos[0].key] - grp.offsets[grp.infos[0].key] + lo, hi - lo))
            mutated = mutated - region
    for k in keys:
        if k in mutated:
            grp = groups[owner[k]]
            buf_copies.append(Copy(grp.index, grp.offsets[k], offsets[k], grp.info(k).nbytes))
    return SlotPlan(
        stage=stage,
        offsets=offsets,
        prefetch=_merge(prefetch),
        grads=_merge(sorted(grad_copies, key=lambda c: (c.slot_offset))),
        buffers_out=_merge(sorted(buf_copies, key=lambda c: c.slot_offset)),
        nbytes=pos,
    )
