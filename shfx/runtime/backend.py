"""The backend interface the interpreter runs on: streams, copies, device memory, RNG.

Two implementations: :class:`shfx.runtime.emulated.EmulatedBackend` (CPU compute, throttled
links, a memory capacity; every schedule runs and is testable without an accelerator) and
:class:`shfx.runtime.cuda.CudaBackend` (CUDA streams and events, pinned host memory).

Streams: ``compute`` (stage forward/backward), ``h2d`` and ``d2h`` (copies), ``host`` (a host
FIFO for gradient accumulation) and ``cpu`` (the host optimizer's thread pool). Each has
``submit(fn, deps, label) -> Token``. Under data parallel also ``reduce`` and ``gather``
(:meth:`Backend.add_collective_streams`): one FIFO per queue of collectives, so each runs its
collectives in program order.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shfx.passes.units import format_bytes

from ..errors import OutOfDeviceMemory
from .streams import DeviceStream, PoolStream, WorkerStream, current_device_stream, single_omp_thread

__all__ = ["Backend", "MemoryEvent"]


@dataclass(frozen=True)
class MemoryEvent:
    """One device reservation (``nbytes > 0``) or release (``< 0``) that a recording saw:
    during which event of the step (an action string such as ``"F3"``, or ``"setup"``,
    ``"forward start"``, ``"backward start"``, ``"end"``), under which memory-ledger term
    (:data:`shfx.passes.ledger.DEVICE_TERMS`), for what."""

    event: str
    term: str
    what: str
    nbytes: int


def _optimizer_pool(workers: int, threads: int | None = None) -> PoolStream:
    """The host optimizer's pool. With several workers each gets ``cores // workers`` intra-op
    threads, so the pool never oversubscribes the cores (``benchmarks/host_adam.py``: 2
    workers x 1 thread beat 2 x 2 by 5-15% on 2 cores).

    NOTE: ``torch.set_num_threads`` inside a worker sets that thread's OpenMP team size, but it
    also rewrites the process default that threads initialising later start from (the compute
    stream, say); the first ``get_num_threads`` call pins the worker's own settings before the
    change, and the default is restored afterwards."""
    cores = torch.get_num_threads()
    per_worker = threads if threads is not None else max(1, cores // workers)
    if workers == 1 and per_worker >= cores:
        return PoolStream("cpu", 1)

    def setup() -> None:
        torch.get_num_threads()
        torch.set_num_threads(per_worker)

    pool = PoolStream("cpu", workers, setup=setup)
    torch.set_num_threads(cores)
    return pool


class Backend:
    """Common state: memory accounting and transfer counters.

    Subclasses set ``name``, ``device``, the streams, and implement the copies, allocation
    and RNG access.
    """

    name = "abstract"
    device: torch.device
    capacity_bytes: int | None = None

    #: intra-op threads of each host optimizer worker (None: cores // workers)
    optimizer_threads: int | None = None

    def __init__(self, optimizer_workers: int = 1):
        self._lock = threading.Lock()
        self._event = threading.local()  # which event of the step the calling thread is in
        self._log: list[MemoryEvent] | None = None
        self.used_bytes = 0
        self.peak_bytes = 0
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self.copies_h2d = 0
        self.copies_d2h = 0
        cores = torch.get_num_threads()
        self.host = WorkerStream("host", setup=single_omp_thread)
        self.cpu = _optimizer_pool(optimizer_workers, self.optimizer_threads)
        torch.set_num_threads(cores)
        self.compute: Any = None
        self.h2d: Any = None
        self.d2h: Any = None
        self.reduce: Any = None  # data parallel's queues (add_collective_streams)
        self.gather: Any = None

    def add_collective_streams(self) -> None:
        """Data parallel: the ``reduce`` (gradient reduce-scatter) and ``gather`` (weights'
        all-gather) queues, each a FIFO worker running its collectives in program order."""
        if self.reduce is None:
            cores = torch.get_num_threads()
            self.reduce = WorkerStream("reduce", setup=single_omp_thread)
            self.gather = WorkerStream("gather", setup=single_omp_thread)
            torch.set_num_threads(cores)  # (single_omp_thread: the constructing thread restores it)

    # ---- memory accounting ---------------------------------------------------------------
    @contextlib.contextmanager
    def during(self, event: str) -> Iterator[None]:
        """Reservations the calling thread makes in this block belong to ``event`` (an action
        string, or a phase event) in a recording (:meth:`recording`)."""
        prev = getattr(self._event, "name", None)
        self._event.name = event
        try:
            yield
        finally:
            self._event.name = prev

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[MemoryEvent]]:
        """Record every device reservation and release made inside the block, with its term and
        the event it belongs to; yields the list it fills (what the memory ledger is checked
        against)."""
        log: list[MemoryEvent] = []
        prev, self._log = self._log, log
        try:
            yield log
        finally:
            self._log = prev

    def reserve(self, nbytes: int, what: str, term: str = "other", key: str | None = None) -> None:
        """Account ``nbytes`` of device memory for ``what`` under the memory-ledger ``term``
        (``key``: its name in the ledger, default ``what``); raise :class:`OutOfDeviceMemory`
        past capacity."""
        with self._lock:
            if self.capacity_bytes is not None and self.used_bytes + nbytes > self.capacity_bytes:
                raise OutOfDeviceMemory(
                    f"out of device memory allocating {format_bytes(nbytes)} for {what}: "
                    f"{format_bytes(self.used_bytes)} of {format_bytes(self.capacity_bytes)} in use on {self.describe()}, "
                    f"{format_bytes(self.capacity_bytes - self.used_bytes)} free. Use a smaller window, a smaller "
                    "batch or sequence, more stages (smaller blocks), or a device with more memory.",
                    needed_bytes=nbytes,
                    used_bytes=self.used_bytes,
                    capacity_bytes=self.capacity_bytes,
                    what=what,
                )
            self.used_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
            if self._log is not None and nbytes:
                self._log.append(MemoryEvent(getattr(self._event, "name", None) or "setup", term, key or what, nbytes))

    def unreserve(self, nbytes: int, what: str = "", term: str = "other") -> None:
        with self._lock:
            self.used_bytes -= nbytes
            if self._log is not None and nbytes:
                self._log.append(MemoryEvent(getattr(self._event, "name", None) or "setup", term, what, -nbytes))

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.used_bytes

    def count_copy(self, direction: str, nbytes: int) -> None:
        with self._lock:
            if direction == "h2d":
                self.bytes_h2d += nbytes
                self.copies_h2d += 1
            else:
                self.bytes_d2h += nbytes
                self.copies_d2h += 1

    # ---- to implement --------------------------------------------------------------------
    def alloc_device(self, nbytes: int, what: str, term: str = "other") -> torch.Tensor:
        """A device buffer of ``nbytes`` bytes for ``what`` (reserved under ``term``)."""
        raise NotImplementedError

    def free_device(self, t: torch.Tensor, what: str = "", term: str = "other") -> None:
        self.unreserve(t.numel() * t.element_size(), what, term)

    #: the pinned pool (:class:`shfx.runtime.pinned.PinnedAllocator`): every pinned host buffer
    #: of the backend comes from it
    pinned: Any = None

    def alloc_host(self, nbytes: int, pin: bool, what: str = "") -> torch.Tensor:
        """A zeroed uint8 host buffer of ``nbytes`` for ``what`` (the pinned plan's name:
        ``"image g"``, ``"gradient g"``, ``"staging"``); with ``pin``, from the pinned pool,
        which pins it if the plan and budget allow (else it is ordinary memory, copied through
        the pool's bounce buffers)."""
        if pin and self.pinned is not None:
            return self.pinned.take(nbytes, what)
        return torch.zeros(nbytes, dtype=torch.uint8)

    @property
    def pinned_bytes(self) -> int:
        """Host bytes the pinned pool holds (page-rounded sizes of live buffers)."""
        return self.pinned.live_bytes if self.pinned is not None else 0

    # ---- copies of host memory the pool did not pin: through its bounce buffers ---------------
    def _bounced(self, host: torch.Tensor) -> bool:
        """Whether a copy to or from ``host`` goes through the pool's bounce buffers: the pool has
        some (not every buffer is pinned), and ``host`` is not in a pinned buffer."""
        pool = self.pinned
        return pool is not None and pool.bounces and host.numel() > 0 and not pool.owns(host)

    def _raw_copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor, cast: bool = False) -> Any:
        """One uncounted copy on the calling copy stream (``cast``: ``d2h_copy_cast``'s); returns
        a marker :meth:`_wait_copy` waits for (None: already done)."""
        raise NotImplementedError

    def _wait_copy(self, marker: Any) -> None:
        """Wait on the host until the copy of ``marker`` (:meth:`_raw_copy`) is done."""

    def _bounce_copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor, cast: bool = False) -> None:
        """``dst.copy_(src)`` across the link with the host side in ordinary memory, in chunks
        through the pool's pinned bounce buffers of ``direction`` (two, alternating).

        Host to device: each chunk is copied into a bounce buffer on the host (after the copy
        that last read that buffer is done), then sent from it. Device to host: each chunk is
        copied into a bounce buffer, and the previous chunk moved on the host from its bounce
        buffer into ``dst`` meanwhile; the call returns once ``dst`` holds every byte.

        NOTE: the device-to-host direction waits on the host for each chunk (the bytes must be
        in the bounce buffer before the host can move them), and a host-to-device copy longer
        than two chunks waits for its earlier chunks to have left their bounce buffer (which
        waits for whatever the copy stream waits on: the slot's release): a bounced copy costs
        the issuing thread those waits, and an extra host memcpy in both directions. The plan
        pins what every step moves first (images, gradient buffers), so only a budget too small
        for them pays."""
        host = dst if direction == "d2h" else src
        self.count_copy(direction, host.numel() * host.element_size())
        d, s = dst.reshape(-1), src.reshape(-1)
        if d.data_ptr() != dst.data_ptr() or s.data_ptr() != src.data_ptr() or not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError(f"{direction} copy through the bounce buffers needs contiguous tensors")
        elt = host.dtype
        with self.pinned.bounce(direction) as slots:
            step = max(1, self.pinned.bounce_bytes // host.element_size())
            n = d.numel()
            pending: tuple[Any, torch.Tensor, torch.Tensor] | None = None
            for i, o in enumerate(range(0, n, step)):
                m = min(step, n - o)
                slot = slots[i % len(slots)]
                buf = slot.buf[: m * host.element_size()].view(elt)
                if direction == "h2d":
                    self._wait_copy(slot.marker)  # the copy that last read this buffer
                    buf.copy_(s[o : o + m])
                    slot.marker = self._raw_copy("h2d", d[o : o + m], buf)
                    continue
                marker = self._raw_copy("d2h", buf, s[o : o + m], cast)
                if pending is not None:
                    self._drain(pending)
                pending = (marker, buf, d[o : o + m])
            if pending is not None:
                self._drain(pending)

    def _drain(self, pending: tuple[Any, torch.Tensor, torch.Tensor]) -> None:
        marker, buf, out = pending
        self._wait_copy(marker)
        out.copy_(buf)

    def h2d_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy host -> device; called from inside an ``h2d`` stream task."""
        raise NotImplementedError

    def d2h_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy device -> host; called from inside a ``d2h`` stream task."""
        raise NotImplementedError

    def d2h_copy_cast(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy device ``src`` into host ``dst`` of another dtype (a 16-bit gradient into the fp32
        host gradient: exact), the cast done on the device: the link carries ``dst``'s bytes
        and the host does no per-element work. Called from inside a ``d2h`` stream task."""
        raise NotImplementedError

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def get_rng_state(self) -> Any:
        raise NotImplementedError

    def set_rng_state(self, state: Any) -> None:
        raise NotImplementedError

    def synchronize(self) -> None:
        pass

    # ---- CUDA's execution model (shfx.runtime.streams.DeviceStream) -----------------------------
    def stamp(self) -> Any:
        """A time stamp of the point the calling task has reached: a host clock reading in host
        work and where device work runs as it is launched; on a device stream that queues its
        work (CUDA, the emulated CUDA-like copies), a record the device takes when it gets there.
        :meth:`stamp_times` turns stamps into host ``perf_counter`` seconds."""
        s = current_device_stream()
        return s.stamp() if s is not None else time.perf_counter()

    def stamp_times(self, stamps: list[Any]) -> list[float]:
        """Host ``perf_counter`` seconds of ``stamps`` (waits for the device to reach them)."""
        return [float(s) for s in stamps]

    def _device_streams(self) -> list[Any]:
        return [s for s in (self.compute, self.h2d, self.d2h) if isinstance(s, DeviceStream)]

    @property
    def host_syncs(self) -> int:
        """Host waits for device work from the issuing thread (the user's), over all streams
        with CUDA's execution model (0 on the emulated device's default mode)."""
        return sum(s.host_syncs for s in self._device_streams())

    @property
    def deferred_launches(self) -> int:
        """Device tasks launched by a stream's launcher thread because a dependency was host work
        not done yet (or device work not launched): what would have been a host wait in the
        issuing path."""
        return sum(s.deferred for s in self._device_streams())

    def unthrottled(self) -> contextlib.AbstractContextManager[None]:
        """Copies in the block run at the device's full speed (the emulated device's pacing is
        off, so the profiler times compute that no throttled copy slows); a no-op on CUDA."""
        return contextlib.nullcontext()

    def describe(self) -> str:
        return self.name

    def close(self) -> None:
        for s in (self.compute, self.h2d, self.d2h, self.host, self.cpu, self.reduce, self.gather):
            if s is not None and hasattr(s, "close"):
                s.close()
        if self.pinned is not None:
            self.pinned.close()
