"""Byte layouts: host parameter groups and device slots, and the copies between them.

Each *group* is one contiguous host buffer holding the tensors a stage owns (the stage that
first uses them), in this order, every tensor aligned to :data:`ALIGN` bytes::

    [ trainable params | frozen params | buffers the forward mutates | other buffers, constants ]

That buffer is the group's *image*: what a stage's slot holds and a PREFETCH moves, each tensor
in its device dtype (:attr:`TensorInfo.dtype`). In fp32 training the image's trainable region
is also the master weights. In mixed precision (16-bit parameters on the device) the image's
parameters are the 16-bit working copy and the fp32 master weights live in a second host buffer
(:attr:`Group.master_offsets`), never sent over the link.

The trainable region is laid out in *elements*: each trainable parameter gets an element offset
(aligned to :data:`ALIGN` bytes in the narrowest dtype of the region), valid alike in the image
(in the parameter's device dtype), the fp32 master, the gradient buffer and each optimizer state,
so one optimizer call covers a whole group (padding is zero and stays zero). Parameters of one
device dtype form a :class:`Part` (a bf16 group whose BatchNorm weights stay fp32 has two). Each
copy of that region has its own dtype (:class:`CopyDtypes`), carried by the group; byte counts
everywhere come from it. A stage's *slot* holds the whole image of each group it uses entirely,
then single tensors it borrows from other groups (a tied embedding used by the head and the
tail). Transfers are lists of :class:`Copy`, merged where contiguous: one copy per stage in the
common case.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["ALIGN", "TensorInfo", "CopyDtypes", "Part", "Group", "Copy", "SlotPlan", "plan_groups", "plan_slot", "device_cast_groups", "align", "PRECISIONS", "precision_dtype", "STAGING"]

ALIGN = 64

STAGING = 2
"""Host staging buffers gradients are copied through at most (``HostStore(staging_buffers=2)``):
the ledger's ``STAGING_BUFFERS`` and the pinned plan's staging buffers."""


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
    host_dtype: torch.dtype | None = None  # the model's dtype, where the device holds a cast (mixed precision)

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
    def of(
        cls, key: str, kind: str, t: torch.Tensor, trainable: bool = False, mutable: bool = False,
        device_dtype: torch.dtype | None = None,
    ) -> TensorInfo:  # fmt: skip
        """``t``'s facts; ``device_dtype``: the dtype the device holds it in, when it is a cast."""
        if device_dtype is None or device_dtype == t.dtype:
            return cls(key, kind, tuple(t.shape), t.dtype, trainable, mutable)
        return cls(key, kind, tuple(t.shape), device_dtype, trainable, mutable, host_dtype=t.dtype)


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
        # NOTE: a backward writes the gradients over the working copy in the slot (or beside it,
        # laid out alike), so they share a dtype; the host gradient is added into the master's
        # layout, element for element
        if self.working != self.device_grad or self.grad != self.master:
            raise NotImplementedError(
                f"{self}: the device gradient must have the working copy's dtype and the host gradient the master's"
            )

    @property
    def mixed(self) -> bool:
        """Whether the device works on a cast of the master weights (mixed precision)."""
        return self.working != self.master


FP32 = CopyDtypes()

PRECISIONS = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}  # fmt: skip


def precision_dtype(precision: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` (or ``"bfloat16"``, ``torch.bfloat16``) -> ``torch.bfloat16``; the device's
    working dtype of a precision."""
    if isinstance(precision, torch.dtype) and precision in PRECISIONS.values():
        return precision
    if isinstance(precision, str) and precision.lower() in PRECISIONS:
        return PRECISIONS[precision.lower()]
    raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16' (or float32, bfloat16, float16), got {precision!r}")


def copy_dtypes(precision: str | torch.dtype) -> CopyDtypes:
    """The copies of a precision: fp32 master, gradients and states on the host; the working
    copy and device gradients in the precision's dtype."""
    w = precision_dtype(precision)
    return CopyDtypes(working=w, device_grad=w)


@dataclass(frozen=True)
class Part:
    """A run of the trainable region whose parameters share one device dtype: elements
    ``[elem, elem + numel)`` of the master, gradient and states are bytes
    ``[offset, offset + numel * dtype.itemsize)`` of the image."""

    elem: int
    numel: int
    offset: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"fp32"``."""
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class Group:
    """One host buffer, the *image*: the tensors stage ``index`` owns (in the capture that
    planned it), each in its device dtype; in mixed precision also the fp32 master of its
    parameters (``master_offsets``: byte offsets in a second buffer of ``master_nbytes``)."""

    index: int
    infos: tuple[TensorInfo, ...]
    offsets: dict[str, int] = field(hash=False)
    trainable_bytes: int
    mutable_range: tuple[int, int]
    nbytes: int
    dtypes: CopyDtypes = FP32
    parts: tuple[Part, ...] = ()
    master_offsets: dict[str, int] = field(default_factory=dict, hash=False)
    master_nbytes: int = 0

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(i.key for i in self.infos)

    @property
    def trainable_numel(self) -> int:
        """Elements of the trainable region (padding included): of the master, the gradient
        buffer and each optimizer state alike."""
        return sum(p.numel for p in self.parts)

    @property
    def separate_master(self) -> bool:
        """Whether the master weights are a buffer of their own (mixed precision), not the image."""
        return self.master_nbytes > 0

    @property
    def master_bytes(self) -> int:
        """Bytes of the master weights' trainable region (what the host update reads and writes)."""
        return self.trainable_numel * self.dtypes.master.itemsize

    @property
    def param_end(self) -> int:
        """Image bytes of the parameters (trainable and frozen); buffers and constants follow."""
        return min((self.offsets[i.key] for i in self.infos if i.kind != "param"), default=self.nbytes)

    @property
    def working_bytes(self) -> int:
        """Host bytes of the parameters' working copy kept beside a separate master (0 when the
        image is the master)."""
        return self.param_end if self.separate_master else 0

    @property
    def host_master_bytes(self) -> int:
        """Host bytes of the master copy of the group: its master weights, frozen parameters,
        buffers and constants (everything but the separate working copy)."""
        return self.master_nbytes + self.nbytes - self.param_end if self.separate_master else self.nbytes

    @property
    def grad_bytes(self) -> int:
        """Bytes of the host gradient buffer."""
        return self.trainable_numel * self.dtypes.grad.itemsize

    @property
    def state_bytes(self) -> int:
        """Bytes of one optimizer state (AdamW has two: m and v)."""
        return self.trainable_numel * self.dtypes.state.itemsize

    @property
    def part_starts(self) -> tuple[int, ...]:
        """Element offsets where a part after the first begins (an update's views never span one)."""
        return tuple(p.elem for p in self.parts[1:])

    def part_at(self, offset: int) -> Part:
        """The part holding image byte ``offset`` of the trainable region."""
        for p in self.parts:
            if p.offset <= offset < p.offset + p.nbytes:
                return p
        raise KeyError(f"byte {offset} is outside group {self.index}'s trainable region")

    def elements(self, offset: int, nbytes: int) -> list[tuple[Part, int, int, int]]:
        """The image bytes ``[offset, offset + nbytes)`` of the trainable region as
        ``(part, first element, numel, byte offset in the range)`` per part they cover."""
        out = []
        end = offset + nbytes
        for p in self.parts:
            lo, hi = max(offset, p.offset), min(end, p.offset + p.nbytes)
            if lo < hi:
                size = p.dtype.itemsize
                out.append((p, p.elem + (lo - p.offset) // size, (hi - lo) // size, lo - offset))
        return out

    def trainable_spans(self) -> list[tuple[int, int]]:
        """``(element offset, numel)`` of each trainable parameter in the trainable region."""
        out = []
        for i in self.infos:
            if i.kind == "param" and i.trainable:
                p = self.part_at(self.offsets[i.key])
                out.append((p.elem + (self.offsets[i.key] - p.offset) // p.dtype.itemsize, i.numel))
        return out

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


def _order(info: TensorInfo) -> tuple[int, int]:
    if info.kind == "param":
        # trainable parameters by device dtype, narrowest first: one part per dtype
        return (0, info.dtype.itemsize) if info.trainable else (1, 0)
    if info.mutable:
        return (2, 0)
    return (3, 0)


def plan_groups(owned: Sequence[Sequence[TensorInfo]], dtypes: CopyDtypes = FP32) -> list[Group]:
    """Given the tensors each stage owns (first-use order) and the dtypes of the copies of their
    trainable regions, lay out one host group per stage.

    A trainable parameter must have the master dtype on the host; on the device it has its
    :attr:`TensorInfo.dtype` (the working dtype, or the master's for a parameter kept in full
    precision, such as a BatchNorm weight in mixed precision)."""
    groups = []
    for gi, infos in enumerate(owned):
        for i in infos:
            if i.trainable and (i.host_dtype or i.dtype) != dtypes.master:
                m = dtype_name(dtypes.master)
                raise NotImplementedError(
                    f"parameter {i.key!r} is {i.host_dtype or i.dtype} and trainable; shfx keeps {m} master weights "
                    f"and trains {m} parameters (precision='bf16' or 'fp16' puts 16-bit copies on the device). "
                    "Convert the model with model.float() before shfx.compile."
                )
        ordered = sorted(infos, key=_order)  # stable: keeps first-use order inside each region
        trainable = [i for i in ordered if i.kind == "param" and i.trainable]
        sizes = {i.dtype.itemsize for i in trainable} | {dtypes.master.itemsize}
        unit = max(1, ALIGN // min(sizes))  # elements: ALIGN bytes in the narrowest copy
        offsets: dict[str, int] = {}
        parts: list[Part] = []
        elems: dict[str, int] = {}
        elem = 0
        pos = 0
        for info in trainable:
            if not parts or parts[-1].dtype != info.dtype:
                if parts:
                    p = parts[-1]
                    parts[-1] = Part(p.elem, elem - p.elem, p.offset, p.dtype)
                    pos = align(p.offset + (elem - p.elem) * p.dtype.itemsize)
                parts.append(Part(elem, 0, pos, info.dtype))
            p = parts[-1]
            offsets[info.key] = p.offset + (elem - p.elem) * p.dtype.itemsize
            elems[info.key] = elem
            elem = (elem + info.numel + unit - 1) // unit * unit
        if parts:
            p = parts[-1]
            parts[-1] = Part(p.elem, elem - p.elem, p.offset, p.dtype)
            pos = align(p.offset + (elem - p.elem) * p.dtype.itemsize)
        trainable_end = pos
        mut = [None, None]
        for info in ordered[len(trainable) :]:
            offsets[info.key] = pos
            pos = align(pos + info.nbytes)
            if info.kind != "param" and info.mutable:
                if mut[0] is None:
                    mut[0] = offsets[info.key]
                mut[1] = pos
        # mixed precision: the fp32 master of every trainable parameter (element for element
        # as in the image) and of every frozen parameter the device holds a cast of
        master_offsets: dict[str, int] = {}
        mpos = 0
        if dtypes.mixed:
            msize = dtypes.master.itemsize
            master_offsets = {k: e * msize for k, e in elems.items()}
            mpos = align(elem * msize)
            for info in ordered[len(trainable) :]:
                if info.host_dtype is not None:
                    master_offsets[info.key] = mpos
                    mpos = align(mpos + info.numel * info.host_dtype.itemsize)
        elif any(i.host_dtype is not None for i in infos):
            raise NotImplementedError("a tensor cast for the device in a group without mixed-precision dtypes")
        groups.append(
            Group(
                index=gi,
                infos=tuple(ordered),
                offsets=offsets,
                trainable_bytes=trainable_end,
                mutable_range=(mut[0] or 0, mut[1] or 0),
                nbytes=pos,
                dtypes=dtypes,
                parts=tuple(parts),
                master_offsets=master_offsets,
                master_nbytes=mpos,
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


def device_cast_groups(groups: Sequence[Group], slots: Iterable[SlotPlan]) -> frozenset[int]:
    """Groups whose gradient an OFFLOAD_GRAD casts to the host gradient's dtype on the device and
    copies straight into the host gradient (or, under gradient accumulation, into an fp32
    staging buffer that is added): mixed-precision groups whose whole trainable region one
    copy of one stage sends. Exact: a 16-bit value widens to fp32 exactly, and
    ``grad.add_(g16)`` adds the same widened value. The host does no per-element work for them
    and holds no 16-bit staging buffer; the link carries the fp32 bytes
    (``StageSpec.grad_wire_bytes``).

    A group with more than one contribution (a tied weight another stage borrows) keeps the
    16-bit path: autograd sums the contributions in the device dtype, which the host does the
    same way before casting. Data parallel keeps it for every group (the reduce-scatter sums
    16-bit gradients): the runtime and the lowering apply this in one process only."""
    copies: dict[int, list[Copy]] = {}
    for sp in slots:
        for c in sp.grads:
            copies.setdefault(c.group, []).append(c)
    out = set()
    for g, cs in copies.items():
        grp = groups[g]
        if (
            grp.dtypes.mixed
            and grp.trainable_bytes
            and len(cs) == 1
            and cs[0].host_offset == 0
            and cs[0].nbytes == grp.trainable_bytes
        ):
            out.add(g)
    return frozenset(out)


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
