"""The SSD store: a scratch file of fixed extents, read and written asynchronously.

The NVMe tier keeps the host optimizer's states (AdamW ``m`` and ``v``) and optionally the fp32
master weights of each group on an SSD, and moves one group's copies into host RAM ahead of its
update and back after it. :class:`SSDStore` is the part that talks to the disk:

* **one preallocated file** per store (``os.posix_fallocate``), holding each *extent* (a key such
  as ``("m", group)``, ``("v", group)``, ``("master", group)`` and its size in bytes) at an offset
  aligned to the filesystem's block size (at least 4096 B); the space is checked before anything
  is allocated (:func:`check_space`) and a full disk raises :class:`shfx.errors.SSDSpaceError`
  naming the path, the bytes needed and available;
* **asynchronous requests**: :meth:`SSDStore.read_into` / :meth:`SSDStore.write_from` return an
  :class:`SSDRequest` at once; ``request.wait()`` returns when the bytes are in the tensor (read)
  or in the file (write), or raises :class:`shfx.errors.SSDIOError` naming the key, the file
  offset and the path. Reads and writes run on two thread pools of their own (``workers`` threads
  each, ``os.preadv`` / ``os.pwritev``, which release the GIL), each request split into
  ``bounce_bytes`` chunks so that several threads share one large extent;
* **direct I/O where the filesystem allows it** (``direct="auto"``: opened with ``O_DIRECT``,
  probed with one aligned read; a filesystem that refuses it gets buffered I/O, and
  ``store.direct`` says which is used). With ``O_DIRECT`` a chunk whose memory address and
  length are aligned goes straight to or from the tensor's memory; the others go through a
  bounded pool of aligned *bounce buffers* (``bounce_buffers`` x ``bounce_bytes`` at most, pinned
  with ``pin_memory=True`` so a later device copy can be asynchronous), so the host memory the
  store itself uses for I/O is bounded by the pool, not by the extents. Buffered I/O reads and
  writes the tensor's memory directly (through a ``memoryview`` of its numpy array) and needs
  no bounce buffer;
* **an emulated SSD** (``read_bps`` / ``write_bps``, or :meth:`SSDStore.emulated`): the same real
  file, with each request taking at least ``nbytes / bps`` seconds, requests of one direction
  served one after the other like one device queue (request *i* completes no earlier than
  ``max(its submission, the previous request's completion) + nbytes / bps``), so schedules and
  budgets can be tested at a known bandwidth on any machine;
* **scratch for one run**: :meth:`SSDStore.close` (also run when the store is garbage collected
  or the interpreter exits, through ``weakref.finalize``) waits for the requests in flight,
  closes the file and deletes it. Writes are not fsynced: nothing in the file outlives the run.

Requests on one key are not reordered: a request on a key whose write is still in flight (or a
write of a key being read) raises a :class:`ValueError` saying which request to wait for, so a
key is never read back (or overwritten) before its write completed. Reads of one key may overlap.
The tensor given to a request belongs to it until ``wait()`` returned: the caller keeps a host
buffer alive and untouched until then (the engine's host window).

Why a thread pool over ``os.preadv``/``os.pwritev`` and not Linux AIO or io_uring: measured on
this project's machine (``benchmarks/nvme.py``), caio's bindings of both were 2-3x slower, because
they read into buffers they allocate and write only from ``bytes`` (a copy each way) and those
buffers are not aligned for O_DIRECT; the pool moves bytes straight between the tensor (or an
aligned bounce buffer) and the file.

>>> import torch
>>> store = SSDStore.emulated({("m", 0): 40, ("v", 0): 40}, read_bps=None, write_bps=None)
>>> store.write_from(("m", 0), torch.arange(10, dtype=torch.float32)).wait()
>>> out = torch.empty(10)
>>> store.read_into(("m", 0), out).wait()
>>> out.tolist() == list(range(10)), store.bytes_written, store.bytes_read
(True, 40, 40)
>>> store.close()
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch

from shfx.errors import SSDIOError, SSDSpaceError
from shfx.offload import Offload
from shfx.passes.layout import Group
from shfx.passes.units import format_bytes, parse_bandwidth, parse_bytes

__all__ = ["SSDStore", "SSDRequest", "Extent", "check_space", "group_extents", "wait_all", "MIN_ALIGNMENT"]

MIN_ALIGNMENT = 4096
"""Extents start at multiples of max(this, the filesystem's block size); direct I/O needs it."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass(frozen=True)
class Extent:
    """Where one key lives in the store's file: ``nbytes`` at ``offset``, padded to
    ``padded_bytes`` (a multiple of the alignment)."""

    key: Hashable
    offset: int
    nbytes: int
    padded_bytes: int


def wait_all(requests: Sequence[Any], errors: Sequence[BaseException] = ()) -> None:
    """Wait for every request, then raise the first error (of ``errors``, those of issuing them,
    then of the requests): none is left in flight, which would block the next request on its key."""
    errors = list(errors)
    for r in requests:
        try:
            r.wait()
        except BaseException as e:  # noqa: BLE001 - every request ends before raising
            errors.append(e)
    if errors:
        raise errors[0]


def check_space(path: str | os.PathLike, nbytes: int) -> int:
    """Raise :class:`shfx.errors.SSDSpaceError` unless the filesystem holding ``path`` (a file or
    directory that exists, or the nearest existing parent) has ``nbytes`` free; return the free bytes.

    >>> check_space(tempfile.gettempdir(), 0) >= 0
    True
    """
    probe = os.path.abspath(os.fspath(path))
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    free = shutil.disk_usage(probe).free
    if nbytes > free:
        raise _space_error(os.fspath(path), nbytes, free)
    return free


def group_extents(
    groups: Sequence[Group], *, states: Sequence[str] | Callable[[Group], Sequence[tuple[str, int]]] = ("m", "v"),
    master: bool = False, versions: int = 1,
) -> dict:  # fmt: skip
    """The extents the NVMe tier needs for host-updated groups (:class:`shfx.passes.layout.Group`):
    ``(name, group.index) -> group.state_bytes`` for each optimizer state in ``states`` (AdamW's
    ``m`` and ``v``; a function ``group -> [(name, nbytes)]`` instead gives each group's states
    and their sizes: SGD's ``momentum``, Adafactor's ``factors``, data parallel's shards,
    :meth:`shfx.runtime.ssd_window.SSDWindow.extents`) and, with ``master`` (``Offload(params="nvme")``),
    ``("master", group.index) -> group.master_bytes`` (the trainable region of the master weights
    the host update reads and writes). In group order, states before the master.

    ``versions=2`` (the tier with ``rollback=True``, :class:`shfx.runtime.ssd_window.SSDWindow`):
    each state has a second extent ``(name, group.index, 1)``, so a step's write-back goes to the
    version the last committed step did not write, and undoing the step is keeping the other.

    >>> from shfx.passes.layout import TensorInfo, plan_groups
    >>> groups = plan_groups([[TensorInfo("w", "param", (16, 4), torch.float32, trainable=True)]])
    >>> group_extents(groups, master=True)
    {('m', 0): 256, ('v', 0): 256, ('master', 0): 256}
    >>> list(group_extents(groups, versions=2))
    [('m', 0), ('v', 0), ('m', 0, 1), ('v', 0, 1)]
    >>> group_extents(groups, states=lambda g: [("momentum", g.state_bytes)])
    {('momentum', 0): 256}
    """
    if versions not in (1, 2):
        raise ValueError(f"versions must be 1 or 2, got {versions!r}")
    out: dict = {}
    for g in groups:
        sized = list(states(g)) if callable(states) else [(name, g.state_bytes) for name in states]
        for name, nbytes in sized:
            out[(name, g.index)] = nbytes
        if versions == 2:
            for name, nbytes in sized:
                out[(name, g.index, 1)] = nbytes
        if master:
            out[("master", g.index)] = g.master_bytes
    return out


def _space_error(path: str, needed: int, available: int, why: str = "") -> SSDSpaceError:
    return SSDSpaceError(
        f"not enough space for the SSD store in {path}: it needs {needed} bytes ({format_bytes(needed)}) "
        f"and the filesystem has {available} bytes ({format_bytes(available)}) free{why}; free space there, "
        f"point the store's path (shfx.Offload(path=...)) at a larger disk, or keep fewer copies on it "
        f"(e.g. params='host')",
        path=path,
        needed_bytes=needed,
        available_bytes=available,
    )


class SSDRequest:
    """One asynchronous read or write of one key. ``wait()`` returns when it completed or
    raises the :class:`shfx.errors.SSDIOError` of its first failed chunk; ``is_done`` polls."""

    __slots__ = ("kind", "key", "nbytes", "error", "_event", "_io_done", "_remaining", "_lock", "_deadline")

    def __init__(self, kind: Literal["read", "write"], key: Hashable, nbytes: int):
        self.kind = kind
        self.key = key
        self.nbytes = nbytes
        self.error: BaseException | None = None
        self._event = threading.Event()  # complete, as the caller sees it
        self._io_done = threading.Event()  # the bytes moved (an emulated SSD completes it later)
        self._remaining = 0
        self._lock = threading.Lock()
        self._deadline: float | None = None

    def wait(self, timeout: float | None = None) -> None:
        """Block until the request completed; raise its error if it failed. With ``timeout``
        (seconds), raise ``TimeoutError`` if it has not completed by then."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"SSD {self.kind} of {self.key!r} ({self.nbytes} bytes) did not complete in {timeout} s")
        if self.error is not None:
            raise self.error

    @property
    def is_done(self) -> bool:
        return self._event.is_set()

    def __repr__(self) -> str:
        state = "failed" if self.error is not None else "done" if self.is_done else "in flight"
        return f"SSDRequest({self.kind} {self.key!r}, {self.nbytes} bytes, {state})"


class _BouncePool:
    """At most ``count`` aligned buffers of ``nbytes`` each, allocated on first use.
    ``allocated_bytes`` counts every byte it ever allocated; ``peak_in_use`` the most handed out at once."""

    def __init__(self, count: int, nbytes: int, align: int, pin: bool, pool: Any = None):
        self.count, self.nbytes, self.align, self.pin = count, nbytes, align, pin
        self.pool = pool  # a backend's pinned pool (shfx.runtime.pinned.PinnedAllocator): pin through it
        self._free: list[tuple[torch.Tensor, memoryview]] = []
        self._cond = threading.Condition()
        self.allocated = 0
        self.allocated_bytes = 0
        self.in_use = 0
        self.peak_in_use = 0

    def acquire(self) -> tuple[torch.Tensor, memoryview]:
        with self._cond:
            while not self._free and self.allocated >= self.count:
                self._cond.wait()
            if self._free:
                buf = self._free.pop()
            else:
                buf = self._allocate()
                self.allocated += 1
                self.allocated_bytes += self.nbytes
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
            return buf

    def release(self, buf: tuple[torch.Tensor, memoryview]) -> None:
        with self._cond:
            self._free.append(buf)
            self.in_use -= 1
            self._cond.notify()

    def _allocate(self) -> tuple[torch.Tensor, memoryview]:
        if self.pin and self.pool is not None:
            # the pool's pinned buffers are page-aligned (its ordinary ones need not be): taken
            # again with room to align a view in it when not aligned
            t = self.pool.take(self.nbytes, "ssd bounce")
            if t.data_ptr() % self.align:
                del t
                raw = self.pool.take(self.nbytes + self.align, "ssd bounce")
                self.allocated_bytes += self.align
                skip = -raw.data_ptr() % self.align
                t = raw[skip : skip + self.nbytes]
        elif self.pin:
            # NOTE: the CUDA host allocator's blocks (cudaHostAlloc) are page-aligned; should one not
            # be, the buffer is taken again with room to align a view in it (counted as allocated).
            t = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            if t.data_ptr() % self.align:
                del t
                raw = torch.empty(self.nbytes + self.align, dtype=torch.uint8, pin_memory=True)
                self.allocated_bytes += self.align
                skip = -raw.data_ptr() % self.align
                t = raw[skip : skip + self.nbytes]
        else:
            # anonymous mmap: page-aligned, exactly nbytes (a multiple of the alignment)
            t = torch.frombuffer(mmap.mmap(-1, self.nbytes), dtype=torch.uint8)
        return t, memoryview(t.numpy())


class _State:
    """Everything the worker threads and the finalizer touch (not the store itself, so an
    unreferenced store is collected and its file deleted)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fd = -1
        self.file_path = ""
        self.remove_dir: str | None = None
        self.pools: dict[str, ThreadPoolExecutor] = {}
        self.throttlers: dict[str, _Throttle] = {}
        self.closed = False
        self.bytes_read = 0
        self.bytes_written = 0
        self.reads = 0
        self.writes = 0
        self.inflight: dict[Hashable, list[SSDRequest]] = {}
        self.direct = False
        self.alignment = MIN_ALIGNMENT
        self.bounce: _BouncePool | None = None

    def finished(self, req: SSDRequest) -> None:
        """Mark ``req`` complete (after its throttle deadline, if any); count it if it succeeded."""
        with self.lock:
            if req.error is None:
                if req.kind == "read":
                    self.bytes_read += req.nbytes
                    self.reads += 1
                else:
                    self.bytes_written += req.nbytes
                    self.writes += 1
            pending = self.inflight.get(req.key)
            if pending is not None:
                pending.remove(req)
                if not pending:
                    del self.inflight[req.key]
        req._event.set()

    def run_chunk(self, fn, req, extent, u8, mv, start, length, throttle) -> None:
        try:
            if req.error is None:
                fn(u8, mv, extent.offset + start, start, length)
        except BaseException as e:  # noqa: BLE001 (surfaces on wait())
            with req._lock:
                if req.error is None:
                    req.error = SSDIOError(
                        f"SSD {req.kind} of {req.key!r} failed at file offset {extent.offset + start} "
                        f"({length} of its {extent.nbytes} bytes) in {self.file_path}: {type(e).__name__}: {e}",
                        key=req.key,
                        offset=extent.offset + start,
                        path=self.file_path,
                    )
                    req.error.__cause__ = e
        self.chunk_done(req, throttle)

    def chunk_done(self, req: SSDRequest, throttle: _Throttle | None) -> None:
        with req._lock:
            req._remaining -= 1
            last = req._remaining <= 0
        if not last:
            return
        if throttle is None:
            self.finished(req)
        else:
            req._io_done.set()  # the throttle's thread completes it at its deadline

    def direct_ok(self, u8: torch.Tensor, start: int, length: int) -> bool:
        a = self.alignment
        return (u8.data_ptr() + start) % a == 0 and length % a == 0

    def read_chunk(self, u8, mv, offset, start, length) -> None:
        fd = self.fd
        if not self.direct or self.direct_ok(u8, start, length):
            _read_full(fd, mv[start : start + length], offset)
        else:
            padded = -(-length // self.alignment) * self.alignment
            buf = self.bounce.acquire()
            try:
                _read_full(fd, buf[1][:padded], offset)
                u8[start : start + length].copy_(buf[0][:length])
            finally:
                self.bounce.release(buf)

    def write_chunk(self, u8, mv, offset, start, length) -> None:
        fd = self.fd
        if not self.direct or self.direct_ok(u8, start, length):
            _write_full(fd, mv[start : start + length], offset)
        else:
            padded = -(-length // self.alignment) * self.alignment
            buf = self.bounce.acquire()
            try:
                buf[0][:length].copy_(u8[start : start + length])
                _write_full(fd, buf[1][:padded], offset)  # the tail past length is the extent's padding
            finally:
                self.bounce.release(buf)

    def close(self) -> None:
        if threading.current_thread().name.startswith("shfx-ssd-"):
            # NOTE: reached when a worker drops the last reference to a store; a thread cannot
            # join its own pool, so the closing happens on a thread of its own.
            threading.Thread(target=self.close, name="ssd-close").start()
            return
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for pool in self.pools.values():
            pool.shutdown(wait=True)
        for throttle in self.throttlers.values():
            throttle.stop()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.file_path:
            try:
                os.unlink(self.file_path)
            except FileNotFoundError:
                pass
        if self.remove_dir is not None:
            shutil.rmtree(self.remove_dir, ignore_errors=True)


class _Throttle:
    """One direction of an emulated SSD: a FIFO thread that completes each request no earlier
    than its deadline (computed at submission, like one device queue)."""

    def __init__(self, bps: float, state: _State, name: str):
        self.bps = bps
        self.busy_until = 0.0
        self._queue: queue.SimpleQueue[SSDRequest | None] = queue.SimpleQueue()
        self._state = state
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def deadline(self, nbytes: int) -> float:
        """Called with the state's lock held, in submission order."""
        start = max(time.perf_counter(), self.busy_until)
        self.busy_until = start + nbytes / self.bps
        return self.busy_until

    def put(self, req: SSDRequest) -> None:
        self._queue.put(req)

    def _run(self) -> None:
        while True:
            req = self._queue.get()
            if req is None:
                return
            req._io_done.wait()
            while (remaining := req._deadline - time.perf_counter()) > 0:  # a sleep may end a hair early
                time.sleep(remaining)
            self._state.finished(req)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()


class SSDStore:
    """A scratch file of fixed extents on an SSD, read and written asynchronously.

    Args:
        path: the directory the scratch file is created in (made if missing), e.g. an NVMe mount.
        extents: an ordered mapping ``key -> nbytes``; each key gets its own aligned region.
        direct: ``"auto"`` (O_DIRECT where the filesystem accepts it, else buffered), ``True``
            (O_DIRECT or an error), ``False`` (buffered, through the page cache).
        workers: threads per direction (reads and writes each have their own pool).
        bounce_buffers, bounce_bytes: the bounce pool (used with O_DIRECT for chunks whose memory
            or length is not aligned) and the chunk size every request is split into;
            ``bounce_bytes`` is rounded up to a multiple of the alignment.
        read_bps, write_bps: emulated SSD bandwidth per direction (bytes/s or ``"3GB/s"``);
            ``None``: as fast as the disk.
        pin_memory: pin the bounce buffers (needs CUDA, or a pool: ``pinned``).
        pinned: the pinned pool the bounce buffers come from with ``pin_memory`` (a backend's
            ``backend.pinned``, so that every pinned buffer of a backend is one of its pool's,
            within its budget: a buffer that does not fit is ordinary memory); None: torch's
            pinned allocator (CUDA).

    Attributes: ``direct`` (bool, what is used), ``alignment``, ``file_path``, ``file_bytes``,
    ``extents`` (key -> :class:`Extent`), counters ``bytes_read``, ``bytes_written``, ``reads``,
    ``writes`` (completed requests and their bytes, padding excluded),
    ``bounce_allocated_bytes`` and ``bounce_peak_in_use``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        extents: Mapping[Hashable, int],
        *,
        direct: bool | Literal["auto"] = "auto",
        workers: int = 2,
        bounce_buffers: int = 4,
        bounce_bytes: int | str = "8MiB",
        read_bps: float | str | None = None,
        write_bps: float | str | None = None,
        pin_memory: bool = False,
        pinned: Any = None,
    ):
        if direct not in (True, False, "auto"):
            raise ValueError(f"SSDStore direct must be True, False or 'auto', got {direct!r}")
        for name, value in (("workers", workers), ("bounce_buffers", bounce_buffers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SSDStore {name} must be an int >= 1, got {value!r}")
        if not isinstance(extents, Mapping) or not extents:
            raise ValueError(
                f"SSDStore extents must be a non-empty mapping key -> nbytes, e.g. {{('m', 0): 4096}}, got {extents!r}"
            )
        if pin_memory and pinned is None and not torch.cuda.is_available():
            raise ValueError("SSDStore pin_memory=True needs CUDA (pinned host memory); this torch has none: pass pin_memory=False")
        self._read_bps = parse_bandwidth(read_bps, what="SSDStore read_bps")
        self._write_bps = parse_bandwidth(write_bps, what="SSDStore write_bps")
        chunk = parse_bytes(bounce_bytes, what="SSDStore bounce_bytes", positive=True)

        directory = os.path.abspath(os.fspath(path))
        self.path = directory
        self.alignment = _alignment(directory)
        self.chunk_bytes = -(-chunk // self.alignment) * self.alignment
        self.extents: dict[Hashable, Extent] = {}
        offset = 0
        for key, nbytes in extents.items():
            if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
                raise ValueError(f"SSDStore extent {key!r} must have an int number of bytes >= 0, got {nbytes!r}")
            padded = -(-nbytes // self.alignment) * self.alignment
            self.extents[key] = Extent(key, offset, nbytes, padded)
            offset += padded
        self.file_bytes = max(offset, self.alignment)

        self._state = state = _State()
        self._finalizer = weakref.finalize(self, state.close)
        check_space(directory, self.file_bytes)
        os.makedirs(directory, exist_ok=True)
        state.file_path = os.path.join(directory, f"shfx-{os.getpid()}-{uuid.uuid4().hex[:12]}.ssd")
        self._direct_arg = direct
        try:
            self.direct = self._open(direct)
            self._allocate()
        except BaseException:
            self.close()
            raise
        self.file_path = state.file_path
        self._bounce = _BouncePool(bounce_buffers, self.chunk_bytes, self.alignment, pin_memory, pinned)
        state.direct, state.alignment, state.bounce = self.direct, self.alignment, self._bounce
        state.pools = {
            "read": ThreadPoolExecutor(workers, thread_name_prefix="shfx-ssd-read"),
            "write": ThreadPoolExecutor(workers, thread_name_prefix="shfx-ssd-write"),
        }
        for kind, bps in (("read", self._read_bps), ("write", self._write_bps)):
            if bps is not None:
                state.throttlers[kind] = _Throttle(bps, state, f"shfx-ssd-{kind}-throttle")

    @classmethod
    def emulated(
        cls,
        extents: Mapping[Hashable, int],
        read_bps: float | str | None = "3GB/s",
        write_bps: float | str | None = "2GB/s",
        *,
        dir: str | None = None,
        **kwargs,
    ) -> SSDStore:
        """An emulated SSD: the store in a fresh temporary directory (under ``dir``, default the
        system's), throttled to ``read_bps`` / ``write_bps``; the directory goes with ``close()``."""
        tmp = tempfile.mkdtemp(prefix="shfx-ssd-", dir=dir)
        try:
            store = cls(tmp, extents, read_bps=read_bps, write_bps=write_bps, **kwargs)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        store._state.remove_dir = tmp
        return store

    @classmethod
    def from_offload(cls, offload: Offload, extents: Mapping[Hashable, int], **kwargs) -> SSDStore:
        """The store an :class:`shfx.Offload` spec asks for: under ``offload.path``, throttled to
        its ``nvme_read`` / ``nvme_write`` when given (an emulated SSD on that directory)."""
        if not offload.uses_nvme:
            raise ValueError(f"{offload} puts nothing on NVMe: there is no SSD store to make (set optimizer='nvme' or params='nvme')")
        return cls(offload.path, extents, read_bps=offload.read_bps, write_bps=offload.write_bps, **kwargs)

    # -- opening -------------------------------------------------------------------------

    def _open(self, direct: bool | Literal["auto"]) -> bool:
        state = self._state
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        if direct and _O_DIRECT:
            try:
                state.fd = os.open(state.file_path, flags | _O_DIRECT, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                if direct is True:
                    raise self._direct_refused(e) from e
            else:
                return True
        elif direct is True:
            raise ValueError(f"SSDStore direct=True: this platform has no O_DIRECT; use direct='auto' or False")
        state.fd = os.open(state.file_path, flags, 0o600)
        return False

    def _direct_refused(self, e: OSError) -> ValueError:
        return ValueError(
            f"SSDStore direct=True: the filesystem of {self.path} refuses O_DIRECT ({e.strerror}); "
            f"use direct='auto' (falls back to buffered I/O) or direct=False, or a path on a disk filesystem"
        )

    def _allocate(self) -> None:
        state = self._state
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(state.fd, 0, self.file_bytes)
            else:  # pragma: no cover (macOS, Windows)
                os.ftruncate(state.fd, self.file_bytes)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                free = shutil.disk_usage(self.path).free
                why = " (preallocating the file failed: no space left on device; a quota or another process may hold the rest)"
                raise _space_error(self.path, self.file_bytes, free, why) from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
                raise
            os.ftruncate(state.fd, self.file_bytes)
        if self.direct:
            # Some filesystems accept O_DIRECT at open and refuse it on the first request: probe one block.
            probe = mmap.mmap(-1, self.alignment)
            try:
                os.preadv(state.fd, [probe], 0)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                os.close(state.fd)
                state.fd = os.open(state.file_path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
                if self._direct_arg is True:
                    raise self._direct_refused(e) from e
                self.direct = False
            finally:
                probe.close()

    # -- requests ------------------------------------------------------------------------

    def read_into(self, key: Hashable, out: torch.Tensor) -> SSDRequest:
        """Read extent ``key`` into ``out`` (a contiguous CPU tensor of exactly its bytes),
        asynchronously: do not touch ``out`` before ``request.wait()`` returned."""
        return self._submit("read", key, out)

    def write_from(self, key: Hashable, src: torch.Tensor) -> SSDRequest:
        """Write ``src`` (a contiguous CPU tensor of exactly the extent's bytes) to extent ``key``,
        asynchronously: do not modify ``src`` before ``request.wait()`` returned."""
        return self._submit("write", key, src)

    def _submit(self, kind: Literal["read", "write"], key: Hashable, tensor: torch.Tensor) -> SSDRequest:
        state = self._state
        extent = self.extents.get(key)
        if extent is None:
            known = list(self.extents)
            shown = ", ".join(map(repr, known[:8])) + (", ..." if len(known) > 8 else "")
            raise KeyError(f"SSDStore has no extent {key!r}; its keys are {shown}")
        what = "out" if kind == "read" else "src"
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"SSDStore.{'read_into' if kind == 'read' else 'write_from'} needs a tensor as {what}, got {type(tensor).__name__}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(
                f"SSD {kind} of {key!r}: {what} must be a contiguous CPU tensor, got one on {tensor.device} "
                f"(contiguous: {tensor.is_contiguous()}); pass a host buffer (e.g. the group's flat state)"
            )
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != extent.nbytes:
            raise ValueError(
                f"SSD {kind} of {key!r}: the extent holds {extent.nbytes} bytes and {what} has {nbytes} "
                f"({tuple(tensor.shape)} {tensor.dtype}); pass a tensor of exactly the extent's bytes"
            )
        req = SSDRequest(kind, key, nbytes)
        u8 = tensor.detach().reshape(-1).view(torch.uint8)
        mv = memoryview(u8.numpy())
        chunks = [(start, min(self.chunk_bytes, nbytes - start)) for start in range(0, nbytes, self.chunk_bytes)]
        req._remaining = len(chunks)
        fn = state.read_chunk if kind == "read" else state.write_chunk
        # NOTE: registered and queued under the lock, so close() (which sets `closed` under it and
        # then drains the pools) either refuses the request or runs all of it.
        with state.lock:
            if state.closed:
                raise ValueError(f"SSD {kind} of {key!r}: the store ({self.path}) is closed")
            pending = state.inflight.get(key, [])
            clash = next((r for r in pending if r.kind == "write" or kind == "write"), None)
            if clash is not None:
                raise ValueError(
                    f"SSD {kind} of {key!r} issued while a {clash.kind} of it is in flight: "
                    f"wait() for that request first (requests on one key are not reordered)"
                )
            state.inflight.setdefault(key, []).append(req)
            throttle = state.throttlers.get(kind)
            if throttle is not None:
                req._deadline = throttle.deadline(nbytes)
                throttle.put(req)
            for start, length in chunks:
                state.pools[kind].submit(state.run_chunk, fn, req, extent, u8, mv, start, length, throttle)
        if not chunks:
            state.chunk_done(req, throttle)
        return req

    # -- state ---------------------------------------------------------------------------

    @property
    def bytes_read(self) -> int:
        return self._state.bytes_read

    @property
    def bytes_written(self) -> int:
        return self._state.bytes_written

    @property
    def reads(self) -> int:
        return self._state.reads

    @property
    def writes(self) -> int:
        return self._state.writes

    @property
    def read_bps(self) -> float | None:
        return self._read_bps

    @property
    def write_bps(self) -> float | None:
        return self._write_bps

    @property
    def bounce_allocated_bytes(self) -> int:
        return self._bounce.allocated_bytes if hasattr(self, "_bounce") else 0

    @property
    def bounce_peak_in_use(self) -> int:
        return self._bounce.peak_in_use if hasattr(self, "_bounce") else 0

    @property
    def closed(self) -> bool:
        return self._state.closed

    def close(self) -> None:
        """Wait for the requests in flight, close the file and delete it (idempotent)."""
        self._finalizer()

    def __enter__(self) -> SSDStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "O_DIRECT" if getattr(self, "direct", False) else "buffered"
        return f"SSDStore({self.path!r}, {len(self.extents)} extents, {format_bytes(self.file_bytes)}, {mode})"


def _alignment(directory: str) -> int:
    probe = directory
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        block = os.statvfs(probe).f_bsize
    except (OSError, AttributeError):  # pragma: no cover
        block = MIN_ALIGNMENT
    block = block if 0 < block <= (1 << 20) and block & (block - 1) == 0 else MIN_ALIGNMENT
    return max(MIN_ALIGNMENT, block)


def _read_full(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise EOFError(f"end of file after {done} of {len(buf)} bytes")
        done += n


def _write_full(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.pwritev(fd, [buf[done:]], offset + done)
        if n == 0:
            raise OSError(errno.EIO, f"pwritev wrote 0 of {len(buf) - done} bytes")
        done += n
