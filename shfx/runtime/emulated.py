"""The emulated device: compute on the CPU, throttled links, a memory capacity.

The compute stream runs on the calling thread (as CUDA kernels are issued from it); each copy
stream is a worker thread with a FIFO; events are host events. A copy takes
``max(real memcpy, bytes / bandwidth)``; while both directions copy, each keeps
``duplex`` of its bandwidth. It runs every schedule on a machine with no accelerator and
gives the simulator a ground truth with known link speeds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from ..devices import EmulatedDevice
from .backend import Backend
from .streams import InlineStream, WorkerStream, single_omp_thread

__all__ = ["EmulatedBackend"]

_CHUNK = 4 << 20  # bytes copied between pacing checks


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
        self.compute = InlineStream("compute")
        self.h2d = WorkerStream("h2d", setup=single_omp_thread)
        self.d2h = WorkerStream("d2h", setup=single_omp_thread)
        torch.set_num_threads(cores)

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

    def alloc_host(self, nbytes: int, pin: bool) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)

    def _copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        n = src.numel() * src.element_size()
        bw = self._bw[direction]
        self.count_copy(direction, n)
        if bw is None or not self.throttle:
            dst.copy_(src)
            return
        other = "d2h" if direction == "h2d" else "h2d"
        d = dst.view(torch.uint8).reshape(-1)
        s = src.view(torch.uint8).reshape(-1)
        self._active[direction] += 1
        try:
            due = time.perf_counter()
            for off in range(0, n, _CHUNK):
                m = min(_CHUNK, n - off)
                d[off : off + m].copy_(s[off : off + m])
                rate = bw * (self.spec.duplex if self._active[other] > 0 else 1.0)
                due += m / rate
                now = time.perf_counter()
                if due > now:
                    time.sleep(due - now)
        finally:
            self._active[direction] -= 1

    def h2d_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._copy("h2d", dst, src)

    def d2h_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._copy("d2h", dst, src)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device.type == "cpu" else t.cpu()

    def get_rng_state(self) -> Any:
        return torch.get_rng_state()

    def set_rng_state(self, state: Any) -> None:
        torch.set_rng_state(state)
