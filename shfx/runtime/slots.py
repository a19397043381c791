"""The device slot pool: ``W`` preallocated flat buffers, each sized for the largest stage the
step programs put into it (``Program.slot_sizes``).

A stage's parameters and buffers are views into its slot (built once per slot and stage and
cached), so the steady state allocates nothing. Which slot a stage uses, and when it may be
reused, is decided by the step program (its PREFETCH/RELEASE edges), not by the pool.
"""

from __future__ import annotations

import torch

from shfx.passes.partition import Stage, StageGraph

from .backend import Backend
from .host_store import typed_view

__all__ = ["SlotPool"]

SLOTS = "parameters (slots)"  # the memory-ledger term


class SlotPool:
    def __init__(self, backend: Backend, sizes: list[int]):
        self.backend = backend
        self.sizes: list[int] = []
        self.slots: list[torch.Tensor] = []
        self._views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.resize(sizes)

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def slot_bytes(self) -> int:
        """The largest slot."""
        return max(self.sizes, default=0)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def resize(self, sizes: list[int]) -> None:
        """Grow the pool so slot ``k`` holds at least ``sizes[k]`` bytes (slots only grow;
        a slot that must grow is reallocated, the others are kept)."""
        want = [max(a, b) for a, b in zip(sizes + [0] * len(self.sizes), self.sizes + [0] * len(sizes))]
        want = want[: max(len(sizes), len(self.sizes))]
        if want == self.sizes:
            return
        for k, n in enumerate(want):
            if k < len(self.slots) and self.sizes[k] >= n:
                continue
            if k < len(self.slots):
                self.backend.free_device(self.slots[k], f"slot {k}", SLOTS)
                self.sizes[k] = 0
                self.slots[k] = torch.empty(0, dtype=torch.uint8)
            else:
                self.slots.append(torch.empty(0, dtype=torch.uint8))
                self.sizes.append(0)
            self.slots[k] = self.backend.alloc_device(n, f"slot {k}", SLOTS)
            self.sizes[k] = n
        self._views.clear()

    def set_sizes(self, sizes: list[int]) -> None:
        """Make the pool exactly ``sizes`` (free slots beyond them, reallocate those whose size
        differs): what a temporary enlargement (the profiler's) gives back."""
        for k in range(len(sizes), len(self.slots)):
            if self.sizes[k]:
                self.backend.free_device(self.slots[k], f"slot {k}", SLOTS)
        self.slots, self.sizes = self.slots[: len(sizes)], self.sizes[: len(sizes)]
        for k, n in enumerate(sizes):
            if k < len(self.sizes) and self.sizes[k] == n:
                continue
            if k < len(self.sizes):
                if self.sizes[k]:
                    self.backend.free_device(self.slots[k], f"slot {k}", SLOTS)
                self.slots[k], self.sizes[k] = torch.empty(0, dtype=torch.uint8), 0
            else:
                self.slots.append(torch.empty(0, dtype=torch.uint8))
                self.sizes.append(0)
            if n:
                self.slots[k] = self.backend.alloc_device(n, f"slot {k}", SLOTS)
            self.sizes[k] = n
        self._views.clear()

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
        for k, (t, n) in enumerate(zip(self.slots, self.sizes)):
            if n:
                self.backend.free_device(t, f"slot {k}", SLOTS)
        self.slots = []
        self.sizes = []
        self._views.clear()
