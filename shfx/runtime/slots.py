"""The device slot pool: ``W`` preallocated flat buffers, each sized for the largest stage.

A stage's parameters and buffers are views into its slot (built once per slot and stage and
cached), so the steady state allocates nothing. Which slot a stage uses, and when it may be
reused, is decided by the step program (its PREFETCH/RELEASE edges), not by the pool.
"""

from __future__ import annotations

import torch

from passes.partition import Stage, StageGraph

from .backend import Backend
from .host_store import typed_view

__all__ = ["SlotPool"]


class SlotPool:
    def __init__(self, backend: Backend, num_slots: int, slot_bytes: int):
        self.backend = backend
        self.num_slots = 0
        self.slot_bytes = 0
        self.slots: list[torch.Tensor] = []
        self._views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.resize(num_slots, slot_bytes)

    def resize(self, num_slots: int, slot_bytes: int) -> None:
        """Grow the pool to at least ``num_slots`` slots of at least ``slot_bytes``."""
        if num_slots <= self.num_slots and slot_bytes <= self.slot_bytes:
            return
        num_slots = max(num_slots, self.num_slots)
        slot_bytes = max(slot_bytes, self.slot_bytes)
        for t in self.slots:
            self.backend.free_device(t)
        self.slots = []
        self._views.clear()
        try:
            for i in range(num_slots):
                self.slots.append(self.backend.alloc_device(slot_bytes, f"device slot {i} of {num_slots}"))
        except BaseException:
            for t in self.slots:
                self.backend.free_device(t)
            self.slots = []
            self.num_slots = self.slot_bytes = 0
            raise
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes

    def region(self, slot: int, offset: int, nbytes: int) -> torch.Tensor:
        return self.slots[slot][offset : offset + nbytes]

    def views(self, slot: int, stage: Stage, graph: StageGraph) -> dict[str, torch.Tensor]:
        """Typed views of ``stage``'s tensors in ``slot``."""
        key = (slot, id(stage))
        v = self._views.get(key)
        if v is None:
            buf = self.slots[slot]
            v = {k: typed_view(buf, off, graph.tensors[k]) for k, off in stage.slot.offsets.items()}
            self._views[key] = v
        return v

    def close(self) -> None:
        for t in self.slots:
            self.backend.free_device(t)
        self.slots = []
        self._views.clear()
        self.num_slots = self.slot_bytes = 0
