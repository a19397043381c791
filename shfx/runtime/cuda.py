"""The CUDA backend: torch.cuda streams and events, pinned host memory, async copies.

Device streams follow :class:`shfx.runtime.streams.DeviceStream`: an action's Python runs when it
is launched and enqueues GPU work on its stream, after the stream waits on the device
(``wait_event``) for every dependency recorded on another stream; its completion is a CUDA event
recorded right after (blocking events: a host wait sleeps instead of spinning, so a waiting
thread leaves the cores to the host optimizer). A dependency on host work not done yet (a
gradient accumulation, an optimizer update) never blocks the issuing thread: the action and the
later work of that stream are launched by the stream's launcher thread once it is done, so only
that stream waits. Compute runs on the caller's current stream (taken when the action is
issued), so user code before and after the model call is ordered with it as in eager PyTorch;
copies run on two dedicated streams.

Stage times come from CUDA events (:meth:`CudaBackend.stamp`), not from the host clock around a
launch. Pinned host memory is allocated at its exact size (page-rounded): ordinary memory
registered with ``cudaHostRegister`` (:mod:`shfx.runtime.pinned`), not the caching host
allocator, which rounds each block up to a power of two; every pinned buffer comes from the
backend's one pool (``self.pinned``), within ``shfx.compile(pinned=...)``, and a host buffer
the pool left unpinned is copied through its bounce buffers (``Backend._bounce_copy``).

Steady state allocates nothing: slots and host buffers are allocated once; events are small
host objects.

NOTE: no ``record_stream`` is needed: a copy stream reads and writes on the device only slot
and gradient-buffer memory the backend allocated once (:meth:`CudaBackend.alloc_device`) and
whose reuse the program orders with RELEASE dependencies; no tensor the caching allocator could
hand to another stream crosses streams (``tests/test_cuda_like.py`` checks this on the emulated
device's CUDA-like mode).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..devices import CudaDevice
from . import pinned
from .backend import Backend
from .streams import DeviceStream, DeviceToken

__all__ = ["CudaBackend", "CudaStream", "new_event"]


def new_event(timing: bool = False) -> torch.cuda.Event:
    """A CUDA event that a host wait sleeps on (``blocking=True``) rather than spins."""
    return torch.cuda.Event(enable_timing=timing, blocking=True)


class CudaStream(DeviceStream):
    """A CUDA stream (``None``: the caller's current stream when the action is issued)."""

    def __init__(self, name: str, device: torch.device, stream: torch.cuda.Stream | None):
        super().__init__(name)
        self.device = device
        self.stream = stream

    def current(self) -> torch.cuda.Stream:
        return self.stream if self.stream is not None else torch.cuda.current_stream(self.device)

    def _capture(self) -> torch.cuda.Stream:
        return self.current()

    def _wait_on(self, dep: DeviceToken, ctx: torch.cuda.Stream) -> None:
        ctx.wait_event(dep.marker)

    def _run(self, fn: Callable[[], None], ctx: torch.cuda.Stream) -> None:
        # (the device too: a launcher thread starts on device 0, whatever the user's is)
        with torch.cuda.device(self.device), torch.cuda.stream(ctx):
            fn()

    def _record(self, ctx: torch.cuda.Stream) -> torch.cuda.Event:
        ev = new_event()
        ev.record(ctx)
        return ev

    def stamp(self) -> torch.cuda.Event:
        ev = new_event(timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def wait_marker(self, marker: torch.cuda.Event) -> None:
        marker.synchronize()

    def marker_done(self, marker: torch.cuda.Event) -> bool:
        return bool(marker.query())


#: device bytes of d2h_copy_cast's scratch: a gradient is cast to fp32 and copied out in
#: chunks of this size (32 MiB: each copy long enough to run at the link's rate, the scratch
#: small beside the planner's workspace reserve, which it is counted in)
CAST_CHUNK_BYTES = 32 << 20


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, spec: CudaDevice | None = None, optimizer_workers: int = 1):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "device='cuda' was requested but torch.cuda.is_available() is False on this machine; "
                "use shfx.EmulatedDevice(...) to run on the CPU"
            )
        super().__init__(optimizer_workers)
        self.spec = spec or CudaDevice()
        self.device = torch.device("cuda", self.spec.index)
        free, total = torch.cuda.mem_get_info(self.device)
        self.capacity_bytes = self.spec.memory_bytes  # a soft budget; None: the allocator decides
        self.total_bytes = total
        self.compute = CudaStream("compute", self.device, None)
        self.h2d = CudaStream("h2d", self.device, torch.cuda.Stream(self.device))
        self.d2h = CudaStream("d2h", self.device, torch.cuda.Stream(self.device))
        self.pinned = pinned.PinnedAllocator()  # the pinned pool (its budget and plan: shfx.compile(pinned=...))
        self._cast_scratch: torch.Tensor | None = None  # d2h_copy_cast's chunk (CAST_CHUNK_BYTES)

    def describe(self) -> str:
        return f"{torch.cuda.get_device_name(self.device)} ({self.spec})"

    def alloc_device(self, nbytes: int, what: str, term: str = "other") -> torch.Tensor:
        self.reserve(nbytes, what, term)
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError:
            self.unreserve(nbytes, what, term)
            raise

    def h2d_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._bounced(src):  # host memory the pinned pool did not pin: through its bounce buffers
            self._bounce_copy("h2d", dst, src)
            return
        self.count_copy("h2d", src.numel() * src.element_size())
        dst.copy_(src, non_blocking=True)

    def d2h_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._bounced(dst):
            self._bounce_copy("d2h", dst, src)
            return
        self.count_copy("d2h", src.numel() * src.element_size())
        dst.copy_(src, non_blocking=True)

    def d2h_copy_cast(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.numel() != src.numel():
            raise ValueError(f"d2h_copy_cast: {dst.numel()} host elements for {src.numel()} device elements")
        if self._bounced(dst):
            self._bounce_copy("d2h", dst, src, cast=True)
            return
        self.count_copy("d2h", dst.numel() * dst.element_size())
        self._cast_into(dst, src)

    def _cast_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # NOTE: torch's own CPU<->GPU copy between dtypes converts on the CPU; here each chunk is
        # cast into a small device scratch (CAST_CHUNK_BYTES, the d2h stream's alone: its
        # copies and casts run in stream order, so a chunk's cast waits for the previous
        # chunk's copy out of it) and copied from there (pinned, asynchronous)
        if dst.dtype == src.dtype:
            dst.copy_(src, non_blocking=True)
            return
        scratch = self._cast_scratch
        if scratch is None:  # allocated inside the first d2h task: on the d2h stream, used only there
            scratch = self._cast_scratch = torch.empty(CAST_CHUNK_BYTES, dtype=torch.uint8, device=self.device)
        step = CAST_CHUNK_BYTES // dst.element_size()
        tmp_all = scratch.view(dst.dtype)
        n = dst.numel()
        for o in range(0, n, step):
            m = min(step, n - o)
            tmp = tmp_all[:m]
            tmp.copy_(src[o : o + m])
            dst[o : o + m].copy_(tmp, non_blocking=True)

    def _raw_copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor, cast: bool = False) -> torch.cuda.Event:
        if cast:
            self._cast_into(dst, src)
        else:
            dst.copy_(src, non_blocking=True)
        ev = new_event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _wait_copy(self, marker: Any) -> None:
        if marker is not None:
            marker.synchronize()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def get_rng_state(self) -> Any:
        return torch.cuda.get_rng_state(self.device)

    def set_rng_state(self, state: Any) -> None:
        torch.cuda.set_rng_state(state, self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    # ---- time stamps: CUDA events, resolved to the host clock when read ----------------------
    def stamp_times(self, stamps: list[Any]) -> list[float]:
        events = [s for s in stamps if isinstance(s, torch.cuda.Event)]
        if not events:
            return [float(s) for s in stamps]
        for ev in events:
            ev.synchronize()
        now = new_event(timing=True)
        now.record(torch.cuda.current_stream(self.device))
        now.synchronize()
        t_now = time.perf_counter()
        return [t_now - s.elapsed_time(now) / 1e3 if isinstance(s, torch.cuda.Event) else float(s) for s in stamps]

