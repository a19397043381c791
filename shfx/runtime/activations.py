"""Activation offload at run time: the host buffers that hold a stage's boundary activations
between its forward and its backward (``AO g`` / ``AF g``, :mod:`shfx.passes.activations`).

The buffers are pinned host memory (``backend.alloc_host(n, pin=True)``), kept in a free list
by shape and dtype and reused every step: the steady state allocates nothing. A step context
takes one per offloaded value at its ``AO`` and gives it back at its ``AF`` (or when the
context is released, a failed or abandoned step included), so two live contexts (a forward
whose backward runs cold after another forward) never share one.

With ``Offload(activations="nvme")`` the copies pass through :class:`ActivationWindow` instead:
a few buffers the program hands out, emptied onto the SSD (``AW``) and filled again (``AR``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from shfx.passes.activations import offloaded_values

from .ssd import wait_all

__all__ = ["ActivationStash", "ActivationWindow"]


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


class ActivationWindow:
    """``Offload(activations="nvme")``: the host buffers offloaded activations pass through on
    their way to the SSD and back, and the SSD stores that hold them.

    The program says which buffer each action uses (``ActionMeta.buffer``,
    :func:`shfx.passes.activations.add_activation_spill`): ``AO g`` copies the stage's offloaded
    values device -> its buffer (each at its :func:`~shfx.passes.activations.spill_layout`
    offset), ``AW g`` writes them to the SSD and frees the buffer, ``AR g`` reads them into a
    buffer, ``AF g`` copies them host -> device and frees it. So host RAM holds
    ``activation_window`` buffers however many stages offload (:attr:`host_bytes`;
    :attr:`peak_held` counts the most held at once, as measured).

    The SSD file: one :class:`~shfx.runtime.ssd.SSDStore` per set of extents, one extent per
    offloaded value (``("activation", name)``, its bytes), made the first time a train program
    needs it (:meth:`prepare`: each input shape whose activations differ gets its own file, its
    space checked before anything is allocated), under the ``Offload`` spec's ``path`` at its
    emulated rates, and closed with the engine. NOTE: a store of its own rather than extents in
    the NVMe tier's: that one is laid out from the host store's groups at the first call, before
    any variant's activation sizes are known, and is not made at all without the optimizer on
    the SSD; the two share the SSD queues (the tier's read and write streams when it exists),
    so their transfers run in issue order as the simulator assumes.

    Each value has one extent: a forward's ``AW`` overwrites what an earlier forward of the same
    shape wrote. Its ``AR`` checks that the extent still holds its own context's values and
    refuses otherwise (two forwards with grad before the first one's backward: not built).
    """

    def __init__(self, backend: Any, offload: Any):
        self.backend = backend
        self.spec = offload  # (the Offload spec: path and emulated rates)
        self.buffers: list[torch.Tensor] = []
        self._holder: list[tuple[int, int] | None] = []  # buffer -> (context id, stage) holding it
        self._lock = threading.Lock()
        self._stores: dict[tuple, Any] = {}  # extents -> its SSDStore
        # id(train program) -> (its store's key, stage -> (value, offset in a buffer, extent bytes) of each value)
        self._of: dict[int, tuple[tuple, dict[int, tuple[tuple[str, int, int], ...]]]] = {}
        self._written: dict[tuple[tuple, str], int] = {}  # (store, value) -> the context whose values the extent holds
        self._streams: tuple[Any, Any] | None = None
        self.peak_held = 0  # the most buffers held at once

    # ---- setup ------------------------------------------------------------------------------------
    def prepare(self, program: Any) -> None:
        """Buffers and an SSD store for ``program`` (a train program with ``activation_window``):
        at least that many buffers of :func:`~shfx.passes.activations.window_buffer_bytes`, and
        a store with an extent per value its ``AW`` actions write (made once per set of extents)."""
        if id(program) in self._of or not program.activation_window:
            return
        from shfx.passes.actions import AR, AW
        from shfx.passes.activations import spill_layout, window_buffer_bytes
        from shfx.passes.meta import get_meta

        from .ssd import SSDStore

        vals = offloaded_values(program.stages)
        spilled = sorted({get_meta(n).stage for n in program.nodes if get_meta(n).kind in (AW, AR)})
        extents = {("activation", v.name): v.nbytes for s in spilled for v in vals.get(s, ())}
        key = tuple(sorted((name, n) for (_, name), n in extents.items()))
        if key not in self._stores and extents:
            off = self.spec
            self._stores[key] = SSDStore(off.path, extents, read_bps=off.read_bps, write_bps=off.write_bps)
        self._ensure(program.activation_window, window_buffer_bytes(program.stages, spilled))
        layout = {s: spill_layout(vals[s])[0] for s in spilled}
        self._of[id(program)] = (key, {s: tuple((v.name, layout[s][v.name], v.nbytes) for v in vals[s]) for s in spilled})

    def _ensure(self, count: int, nbytes: int) -> None:
        with self._lock:
            if any(h is not None for h in self._holder) and (len(self.buffers) < count or any(b.numel() < nbytes for b in self.buffers)):
                raise RuntimeError("the activation window grows while a step holds its buffers: run the new input shape between steps")
            if any(b.numel() < nbytes for b in self.buffers):  # (a larger shape: every buffer made again)
                self.buffers, self._holder = [], []
            while len(self.buffers) < count:
                self.buffers.append(self.backend.alloc_host(nbytes, True, f"activation window {len(self.buffers)}"))
                self._holder.append(None)

    def streams(self) -> tuple[Any, Any]:
        """The read and write queues of the window's own (without the NVMe tier's)."""
        if self._streams is None:
            from .streams import WorkerStream

            self._streams = (WorkerStream("ssd_read"), WorkerStream("ssd_write"))
        return self._streams

    @property
    def host_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    @property
    def bytes_read(self) -> int:
        return sum(s.bytes_read for s in self._stores.values())

    @property
    def bytes_written(self) -> int:
        return sum(s.bytes_written for s in self._stores.values())

    # ---- the actions --------------------------------------------------------------------------------
    def _claim(self, ctx: Any, stage: int, b: int) -> None:
        with self._lock:
            if not 0 <= b < len(self.buffers):
                raise RuntimeError(f"activation window buffer {b} does not exist: the window has {len(self.buffers)}")
            if self._holder[b] is not None:
                raise RuntimeError(
                    f"activation window buffer {b} still holds stage {self._holder[b][1]}'s activations when stage {stage}'s "
                    "need it (the program must write or fetch those first)"
                )
            self._holder[b] = (ctx.id, stage)
            self.peak_held = max(self.peak_held, sum(h is not None for h in self._holder))

    def _free(self, b: int) -> None:
        with self._lock:
            self._holder[b] = None

    def _views(self, program: Any, stage: int, b: int, ctx: Any) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(name, extent, view)`` of each of ``stage``'s values in buffer ``b``: the bytes its
        SSD extent holds, and the value shaped as in ``ctx`` (its device copy, or the host copy an
        earlier action made). NOTE: a dynamic capture's extents are sized at the top of its
        ranges; a smaller value is the front of its extent, which moves whole (the program's
        bytes are those of the top of the ranges too)."""
        out = []
        for name, at, nbytes in self._of[id(program)][1][stage]:
            like = ctx.values.get(name)
            if like is None:
                like = ctx.host_values[name]
            raw = self.buffers[b][at : at + nbytes]
            used = like.numel() * like.element_size()
            if used > nbytes:
                raise RuntimeError(f"activation {name!r} has {used} bytes, more than its {nbytes}-byte SSD extent")
            view = raw[:used].view(like.dtype).view(like.shape) if used else torch.empty(like.shape, dtype=like.dtype)
            out.append((name, raw, view))
        return out

    def offload(self, ctx: Any, program: Any, stage: int, b: int) -> None:
        """``AO``: the stage's values device -> buffer ``b`` (d2h, exact); the device copies stay
        until the forward waiting for this ``AO`` starts (as without the SSD)."""
        self._claim(ctx, stage, b)
        for name, _, view in self._views(program, stage, b, ctx):
            self.backend.d2h_copy(view, ctx.values[name])
            ctx.host_values[name] = view

    def write(self, ctx: Any, program: Any, stage: int, b: int) -> None:
        """``AW``: buffer ``b`` to the stage's extents; the buffer is free once every write
        completed (or failed: the step fails, nothing waits for the buffer)."""
        key, stages = self._of[id(program)]
        store = self._stores[key]
        try:
            wait_all([store.write_from(("activation", name), raw) for name, raw, _ in self._views(program, stage, b, ctx)])
            with self._lock:
                for name, _, _ in stages[stage]:
                    self._written[(key, name)] = ctx.id
        finally:
            self._free(b)

    def read(self, ctx: Any, program: Any, stage: int, b: int) -> None:
        """``AR``: the stage's extents into buffer ``b``; refused when a later forward's ``AW``
        overwrote them. A failed read frees the buffer before raising."""
        key, stages = self._of[id(program)]
        with self._lock:
            stale = [name for name, _, _ in stages[stage] if self._written.get((key, name)) != ctx.id]
        if stale:
            from ..errors import UsageError

            raise UsageError(
                f"stage {stage}'s offloaded activations on the SSD ({', '.join(map(repr, stale))}) were overwritten by a later "
                "forward's: with Offload(activations='nvme') each value has one place on the SSD, so a forward with grad must "
                "run its backward before the next forward with grad (run the other one under torch.no_grad(), or use "
                "activations='host')"
            )
        store = self._stores[key]
        self._claim(ctx, stage, b)
        try:
            views = self._views(program, stage, b, ctx)
            wait_all([store.read_into(("activation", name), raw) for name, raw, _ in views])
        except BaseException:
            self._free(b)
            raise
        for name, _, view in views:
            ctx.host_values[name] = view

    def fetch(self, ctx: Any, program: Any, stage: int, b: int, compute_stream: Any = None) -> None:
        """``AF``: the stage's values buffer ``b`` -> new device tensors (h2d, exact, kept under
        the names and term the forward kept them), then the buffer is free (on CUDA the copy is
        queued; what fills the buffer next waits for this action: an ``AR`` on the host for its
        token, an ``AO`` through the compute stream, as :meth:`ActivationStash.fetch` says)."""
        b_ = self.backend
        try:
            for name, _, _ in self._of[id(program)][1][stage]:
                host = ctx.host_values.pop(name)
                dev = torch.empty(host.shape, dtype=host.dtype, device=b_.device)
                if compute_stream is not None:
                    dev.record_stream(compute_stream)
                b_.h2d_copy(dev, host)
                ctx.put(name, dev)
        finally:
            self._free(b)

    def release(self, ctx: Any) -> None:
        """Free every buffer ``ctx`` still holds (a failed or abandoned step, a dropped forward)."""
        with self._lock:
            for i, h in enumerate(self._holder):
                if h is not None and h[0] == ctx.id:
                    self._holder[i] = None

    def held(self) -> int:
        """Buffers held now."""
        with self._lock:
            return sum(h is not None for h in self._holder)

    def close(self) -> None:
        """Stop the window's own queues and delete the stores' files."""
        try:
            if self._streams is not None:
                for s in self._streams:
                    s.close()
        finally:
            for s in self._stores.values():
                s.close()
            self._stores.clear()


