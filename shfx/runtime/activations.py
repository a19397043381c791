"""Activation offload at run time: the host buffers that hold a stage's boundary activations
between its forward and its backward (``AO g`` / ``AF g``, :mod:`shfx.passes.activations`).

The buffers are pinned host memory (``backend.alloc_host(n, pin=True)``), kept in a free list
by shape and dtype and reused every step: the steady state allocates nothing. A step context
takes one per offloaded value at its ``AO`` and gives it back at its ``AF`` (or when the
context is released, a failed or abandoned step included), so two live contexts (a forward
whose backward runs cold after another forward) never share one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from shfx.passes.activations import offloaded_values

__all__ = ["ActivationStash"]


class ActivationStash:
    """The host buffers of one engine's offloaded activations (see the module docstring)."""

    def __init__(self, backend: Any):
        self.backend = backend
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._names: dict[tuple[int, int], tuple[str, ...]] = {}  # (id(program), stage) -> value names
        self.allocated_bytes = 0  # host bytes allocated so far (reused across steps)

    def names(self, program: Any, stage: int) -> tuple[str, ...]:
        """The values an ``AO``/``AF`` of ``stage`` moves in ``program`` (the train program's
        stages: the same names the step context keeps them under)."""
        key = (id(program), stage)
        got = self._names.get(key)
        if got is None:
            got = tuple(v.name for v in offloaded_values(program.stages).get(stage, ()))
            self._names[key] = got
        return got

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A host buffer of ``like``'s shape and dtype (a free one, else a new pinned one)."""
        key = (tuple(like.shape), like.dtype)
        with self._lock:
            free = self._free.get(key)
            if free:
                return free.pop()
        nbytes = like.numel() * like.element_size()
        raw = self.backend.alloc_host(nbytes, True)
        with self._lock:
            self.allocated_bytes += nbytes
        return raw[:nbytes].view(like.dtype).view(like.shape) if nbytes else torch.empty(like.shape, dtype=like.dtype)

    def give_back(self, bufs: Sequence[torch.Tensor]) -> None:
        """Return host buffers for reuse."""
        with self._lock:
            for b in bufs:
                self._free.setdefault((tuple(b.shape), b.dtype), []).append(b)

    def frees_at(self, program: Any, stage: int) -> tuple[str, ...]:
        """The values whose device copies the ``F`` of ``stage`` in ``program`` frees as it
        starts: those of the ``AO`` actions it waits for (:func:`shfx.passes.program.lower_actions`)."""
        key = (id(program), -1 - stage)
        got = self._names.get(key)
        if got is None:
            from shfx.passes.actions import AO, F
            from shfx.passes.meta import get_meta

            node = next((n for n in program.nodes if get_meta(n).kind == F and get_meta(n).stage == stage), None)
            aos = [get_meta(d).stage for d in program.deps(node) if get_meta(d).kind == AO] if node is not None else []
            got = tuple(name for s in aos for name in self.names(program, s))
            self._names[key] = got
        return got

    def offload(self, ctx: Any, names: Sequence[str]) -> None:
        """``AO``: copy each value device -> a host buffer (d2h, exact). The device copy stays
        until the forward waiting for this ``AO`` starts (:meth:`free_device_copies`), where the
        memory ledger frees it too."""
        copy = self.backend.d2h_copy
        for name in names:
            dev = ctx.values[name]
            host = self.take(dev)
            copy(host, dev)
            ctx.host_values[name] = host

    @staticmethod
    def free_device_copies(ctx: Any, names: Sequence[str]) -> None:
        """At the start of an ``F``: the device copies of the values its ``AO`` dependencies
        copied to the host are dropped (the context's reservations go with them)."""
        for name in names:
            if name in ctx.host_values:
                ctx.drop(name)

    def fetch(self, ctx: Any, names: Sequence[str], compute_stream: Any = None) -> None:
        """``AF``: copy each value host -> a new device tensor (h2d, exact), kept under the same
        name and term as the forward kept it; the host buffer is free again.

        NOTE: on CUDA the copy is asynchronous; the buffer can be taken again only by a later
        ``AO``, which waits for a forward, which the compute stream orders after the backward
        that waited for this copy. The device tensor is allocated on the h2d stream and read and
        freed by the compute stream (``compute_stream``, the CUDA stream the step's compute runs
        on): ``record_stream`` keeps the caching allocator from handing its block to the next
        fetch before the backward's kernels are done with it (the one tensor of the runtime that
        crosses streams this way; ``shfx/runtime/cuda.py``'s note)."""
        b = self.backend
        for name in names:
            host = ctx.host_values[name]
            dev = torch.empty(host.shape, dtype=host.dtype, device=b.device)
            if compute_stream is not None:
                dev.record_stream(compute_stream)
            b.h2d_copy(dev, host)
            ctx.put(name, dev)
            ctx.host_values.pop(name, None)
            self.give_back([host])
