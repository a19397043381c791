"""The streaming checkpoint save and load: what lives on the SSD (the parameter tier's images and
fp32 masters, the NVMe tier's optimizer states) is written and read one group at a time, never
the whole model in host RAM.

**Save.** The state dict handed to ``torch.distributed.checkpoint.save`` holds a meta tensor (a
*placeholder*) of the shape and dtype of each such tensor: DCP plans from shapes, dtypes and
properties, so the plan and the metadata are those of a save of the read tensors, and the
checkpoint is the same format. :class:`StreamingSavePlanner` orders the plan so that each
group's items are consecutive, and its :meth:`~StreamingSavePlanner.resolve_data`, which the
writer calls for one item at a time, reads the item's group (:class:`GroupReads`) when the
writer reaches its first item and drops it when the writer moves on. Held at once: one group's
tensors and the copy of the item being written.

**Load.** :class:`CheckpointReader` reads a few keys at a time into tensors the caller gives
(views of a group's buffers), one ``torch.distributed.checkpoint.load`` of exactly those keys
per call, the metadata read once. ``shfx.checkpoint`` calls it once per group, after checking
everything against the metadata (names, shapes), and writes the group to the SSD
before the next. Held at once: the caller's targets and DCP's copy of the item being read.

NOTE: one load per group, not one load whose planner writes each group out as its items
arrive: ``FileSystemReader`` reads the items file by file, so the items of a group saved in
several files (data parallel's ranks) would not arrive together.

NOTE: what torch's ``FileSystemWriter`` keeps (torch 2.13, ``filesystem.py``): with
``thread_count=1`` it writes the plan's items in order into one file, asking ``resolve_data``
for each item just before writing it (``_SerialCpuLoader``; ``per_thread_copy_ahead=0`` keeps
it from the loader that resolves ahead and sorts by size on a machine with CUDA). It keeps a
reference to every tensor it wrote until the file is closed (``tensor_dict``, for its
safetensors format), and clones a tensor that does not own exactly its storage (a view). So
the writer gets a copy that this planner owns, and the planner frees that copy's storage
(``untyped_storage().resize_(0)``) when the writer asks for the next item, the previous one
being written by then: the reference DCP keeps then holds no memory. A tensor that owns its
storage (a parameter of an eager model, a staging buffer) goes to the writer as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

__all__ = ["CheckpointReader", "GroupReads", "StreamingLoadPlanner", "StreamingSavePlanner", "writer"]


@dataclasses.dataclass(frozen=True)
class GroupReads:
    """Where the placeholders' values come from. ``group_of``: each placeholder's flattened
    DCP key (``model.<name>``, ``optimizer.state.<name>.<field>``) -> its group (any hashable
    id); ``read(group)``: the values of every key of that group, CPU tensors (views of one read
    of the group are fine: the planner copies the item being written)."""

    group_of: Mapping[str, Hashable]
    read: Callable[[Hashable], Mapping[str, torch.Tensor]]


class StreamingSavePlanner(DefaultSavePlanner):
    """A ``DefaultSavePlanner`` whose state dict may hold placeholders (meta tensors) that
    ``reads`` (:class:`GroupReads`) reads one group at a time while the writer writes them.
    Attributes for a caller that measures: ``groups_read`` (each group read, in order)."""

    def __init__(self, reads: GroupReads | None = None):
        super().__init__()
        self.reads = reads or GroupReads({}, lambda group: {})
        self.groups_read: list[Hashable] = []
        self._group: Hashable | None = None
        self._values: Mapping[str, torch.Tensor] = {}
        self._handed: torch.Tensor | None = None

    def create_local_plan(self) -> SavePlan:
        """DCP's plan, each group's items moved up to its first one (stable: a plan whose
        groups are already consecutive, the model's own order, is unchanged)."""
        plan = super().create_local_plan()
        first: dict[Hashable, int] = {}
        rank = []
        for i, item in enumerate(plan.items):
            group = self.reads.group_of.get(item.index.fqn)
            rank.append(i if group is None else first.setdefault(group, i))
        order = sorted(range(len(plan.items)), key=lambda i: (rank[i], i))
        self.plan = dataclasses.replace(plan, items=[plan.items[i] for i in order])
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        self.release_copy()
        fqn = write_item.index.fqn
        group = self.reads.group_of.get(fqn)
        if group is None:
            value = super().resolve_data(write_item)
            if value.is_meta:
                raise RuntimeError(f"the checkpoint's {fqn!r} is a placeholder that no group of the streaming save reads")
            value = value.detach()
            if value.device.type == "cpu" and value.untyped_storage().nbytes() == value.nbytes:
                return value  # (its own storage: the writer keeps a reference, no copy)
        else:
            if group != self._group:
                self._drop_group()
                self._values = self.reads.read(group)
                self._group = group
                self.groups_read.append(group)
            value = self._values[fqn]
        self._handed = torch.empty(value.shape, dtype=value.dtype)
        self._handed.copy_(value)
        return self._handed

    def release_copy(self) -> None:
        """Free the storage of the copy the writer got last (written by now)."""
        if self._handed is not None:
            self._handed.untyped_storage().resize_(0)
            self._handed = None

    def _drop_group(self) -> None:
        self._group, self._values = None, {}

    def release(self) -> None:
        """After the write (or its failure): nothing held."""
        self.release_copy()
        self._drop_group()


def writer(path: str):
    """The storage writer a streaming save needs (one thread, items resolved one at a time as
    they are written): shfx's writer (:func:`shfx.checkpoint_format._writer`) without copy-ahead."""
    from .checkpoint_format import _writer

    return _writer(path, per_thread_copy_ahead=0)


# ---- loading ---------------------------------------------------------------------------------------
class StreamingLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner over a flat state dict of flattened keys (``model.<name>``,
    ``optimizer.state.<name>.<field>``) that are a few of the checkpoint's: nothing to flatten,
    and no pass over the checkpoint's other keys (the default planner's check for checkpoints
    older than torch 2.4 looks at every key of the metadata on each load). Each tensor is read
    (``torch.load`` of its bytes) and copied into its target in place."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)


class _CachedReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read from the file once, however many loads."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._metadata: Any = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class CheckpointReader:
    """A checkpoint's tensors read into given tensors in place, a few keys at a time: each
    :meth:`read` is one ``torch.distributed.checkpoint.load`` of exactly the keys given, the
    metadata read once. Attributes for a caller that measures: ``loads`` (the keys of each
    call, in order)."""

    def __init__(self, path: str, no_dist: bool = True) -> None:
        self.path = path
        self.no_dist = no_dist
        self._reader = _CachedReader(path)
        self.loads: list[list[str]] = []

    @property
    def metadata(self) -> Mapping[str, Any]:
        """DCP's metadata by flattened key (``TensorStorageMetadata``: ``size``, ``properties.dtype``)."""
        return self._reader.read_metadata().state_dict_metadata

    def read(self, targets: Mapping[str, torch.Tensor]) -> None:
        """Read the checkpoint's value of each flattened key into its target (same shape; DCP
        casts to the target's dtype)."""
        import torch.distributed.checkpoint as dcp

        if not targets:
            return
        self.loads.append(list(targets))
        with torch.no_grad():
            dcp.load(dict(targets), storage_reader=self._reader, planner=StreamingLoadPlanner(), no_dist=self.no_dist)
