"""The emulated device: compute on the CPU, throttled links, a memory capacity.

The compute stream runs on the calling thread (as CUDA kernels are issued from it); each copy
stream is a worker thread with a FIFO; events are host events. A copy takes
``max(real memcpy, bytes / bandwidth)``; while both directions copy, each keeps
``duplex`` of its bandwidth. It runs every schedule on a machine with no accelerator and
gives the simulator a ground truth with known link speeds.

In its CUDA-like mode (``EmulatedDevice(cuda_like=True)``) the streams follow CUDA's execution
model through the same :class:`shfx.runtime.streams.DeviceStream` logic as the CUDA backend: a
copy task's Python runs when it is launched, on the issuing thread, and each copy in it is
enqueued on the stream's queue (a worker thread that moves the bytes later, after the waits the
launch recorded); a token is launched at once and done when the queue reaches its record; time
stamps are taken when the queue reaches them. Compute still runs where it is launched (the CPU
is the device): a compute launch waits on the host for the copies it depends on, as the GPU
would. So a host wait in the issuing path, a timing taken at launch or a per-step
synchronization shows here as it would on a GPU: as lost overlap, wrong stage times, or a
counted host sync (``backend.host_syncs``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..devices import EmulatedDevice
from .backend import Backend
from .pinned import PinnedAllocator, no_register, no_unregister
from .streams import DeviceStream, DeviceToken, InlineStream, Token, WorkerStream, current_device_stream, single_omp_thread

__all__ = ["EmulatedBackend"]

_CHUNK = 4 << 20  # bytes copied between pacing checks


class _Stamp:
    """A time stamp a stream's queue takes when it reaches it."""

    __slots__ = ("t", "token")

    def __init__(self) -> None:
        self.t: float | None = None
        self.token: Token | None = None

    def take(self) -> None:
        self.t = time.perf_counter()


class _CopyStream(DeviceStream):
    """A copy stream in the CUDA-like mode: tasks are launched on the issuing thread (their
    Python runs there); the backend's copies inside enqueue their bytes' movement on ``queue``,
    a worker thread, after the device-side waits of the launch."""

    def __init__(self, name: str):
        super().__init__(name)
        self.queue = WorkerStream(name, setup=single_omp_thread)
        self._waits = threading.local()

    def _take_waits(self) -> list[Token]:
        w = getattr(self._waits, "list", None) or []
        self._waits.list = []
        return w

    def _wait_on(self, dep: DeviceToken, ctx: Any) -> None:
        if not hasattr(self._waits, "list"):
            self._waits.list = []
        self._waits.list.append(dep)

    def enqueue(self, op: Callable[[], None], label: str = "") -> Token:
        return self.queue.submit(op, self._take_waits(), label)

    def _record(self, ctx: Any) -> Token:
        return self.enqueue(lambda: None, "record")

    def stamp(self) -> _Stamp:
        st = _Stamp()
        st.token = self.enqueue(st.take, "stamp")
        return st

    def wait_marker(self, marker: Token) -> None:
        marker.wait()

    def marker_done(self, marker: Token) -> bool:
        return marker.is_done

    def close(self) -> None:
        super().close()
        self.queue.close()


class _ComputeStream(DeviceStream):
    """The compute stream in the CUDA-like mode: a task runs where it is launched (the CPU is
    the device), after waiting for the device work it depends on."""

    def _wait_on(self, dep: DeviceToken, ctx: Any) -> None:
        dep.device_wait()

    def _record(self, ctx: Any) -> None:
        return None  # done when launched

    def stamp(self) -> float:
        return time.perf_counter()

    def wait_marker(self, marker: Any) -> None:
        pass

    def marker_done(self, marker: Any) -> bool:
        return True


class EmulatedBackend(Backend):
    name = "emulated"
    # the host optimizer shares the cores with the emulated device's compute: one OpenMP
    # thread per worker keeps a single multi-threaded pool in the process (the compute's)
    optimizer_threads = 1

    def __init__(self, spec: EmulatedDevice | None = None, optimizer_workers: int = 1):
        super().__init__(optimizer_workers)
        self.spec = spec or EmulatedDevice()
        self.device = torch.device("cpu")
        self.capacity_bytes = self.spec.memory_bytes
        self._bw = {"h2d": self.spec.h2d_bps, "d2h": self.spec.d2h_bps}
        self._active = {"h2d": 0, "d2h": 0}
        self.throttle = True  # the profiler times compute with copies unthrottled
        cores = torch.get_num_threads()
        # NOTE: compute runs on the caller's thread and its OpenMP pool; copy threads get one
        # OpenMP thread each, so the process keeps a single multi-threaded pool (see
        # streams.single_omp_thread for why that matters).
        self.cuda_like = bool(self.spec.cuda_like)
        if self.cuda_like:
            self.compute = _ComputeStream("compute")
            self.h2d = _CopyStream("h2d")
            self.d2h = _CopyStream("d2h")
        else:
            self.compute = InlineStream("compute")
            self.h2d = WorkerStream("h2d", setup=single_omp_thread)
            self.d2h = WorkerStream("d2h", setup=single_omp_thread)
        torch.set_num_threads(cores)
        # NOTE: the same pool as CUDA's with a register that pins nothing: the emulated device
        # accounts pinned memory alike (budget, plan, bounce buffers), and its copies of
        # buffers left unpinned go through the same bounce path (Backend._bounce_copy)
        self.pinned = PinnedAllocator(no_register, no_unregister)

    def describe(self) -> str:
        return str(self.spec)

    @contextlib.contextmanager
    def unthrottled(self) -> Iterator[None]:
        prev, self.throttle = self.throttle, False
        try:
            yield
        finally:
            self.throttle = prev

    def alloc_device(self, nbytes: int, what: str, term: str = "other") -> torch.Tensor:
        self.reserve(nbytes, what, term)
        return torch.zeros(nbytes, dtype=torch.uint8)

    def _copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor, nbytes: int | None = None, count: bool = True) -> Token | None:
        """The copy, counted (``count``); returns the token of its bytes' movement in the CUDA-like
        mode (None: done)."""
        if count:
            self.count_copy(direction, src.numel() * src.element_size() if nbytes is None else nbytes)
        s = current_device_stream()
        if isinstance(s, _CopyStream):  # CUDA-like: the bytes move when the stream's queue gets there
            throttle = self.throttle
            return s.enqueue(lambda: self._move(direction, dst, src, throttle), f"{direction} copy")
        self._move(direction, dst, src, self.throttle)
        return None

    def _raw_copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor, cast: bool = False) -> Token | None:
        return self._copy(direction, dst, src, count=False)

    def _wait_copy(self, marker: Any) -> None:
        if marker is not None:
            marker.wait()

    def _move(self, direction: str, dst: torch.Tensor, src: torch.Tensor, throttle: bool) -> None:
        """``dst.copy_(src)`` (a cast on the way where the dtypes differ: ``d2h_copy_cast``),
        throttled in chunks of about :data:`_CHUNK` of ``dst``'s bytes: what crosses the link."""
        bw = self._bw[direction]
        if bw is None or not throttle:
            dst.copy_(src)
            return
        other = "d2h" if direction == "h2d" else "h2d"
        d, s = dst.reshape(-1), src.reshape(-1)
        size = d.element_size()
        step = max(1, _CHUNK // size)
        self._active[direction] += 1
        try:
            due = time.perf_counter()
            for off in range(0, d.numel(), step):
                m = min(step, d.numel() - off)
                d[off : off + m].copy_(s[off : off + m])
                rate = bw * (self.spec.duplex if self._active[other] > 0 else 1.0)
                due += m * size / rate
                now = time.perf_counter()
                if due > now:
                    time.sleep(due - now)
        finally:
            self._active[direction] -= 1

    def h2d_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._bounced(src):  # host memory the pinned pool did not pin: through its bounce buffers
            self._bounce_copy("h2d", dst, src)
            return
        self._copy("h2d", dst, src)

    def d2h_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._bounced(dst):
            self._bounce_copy("d2h", dst, src)
            return
        self._copy("d2h", dst, src)

    def d2h_copy_cast(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.numel() != src.numel():
            raise ValueError(f"d2h_copy_cast: {dst.numel()} host elements for {src.numel()} device elements")
        if self._bounced(dst):
            self._bounce_copy("d2h", dst, src, cast=True)
            return
        self._copy("d2h", dst, src, nbytes=dst.numel() * dst.element_size())

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device.type == "cpu" else t.cpu()

    def stamp_times(self, stamps: list[Any]) -> list[float]:
        out = []
        for st in stamps:
            if isinstance(st, _Stamp):
                st.token.wait()
                st = st.t
            out.append(st)
        return out

    def get_rng_state(self) -> Any:
        return torch.get_rng_state()

    def set_rng_state(self, state: Any) -> None:
        torch.set_rng_state(state)
