"""The CUDA backend: torch.cuda streams and events, pinned host memory, async copies.

Device streams are issued from the calling thread: an action's Python runs at issue time and
enqueues GPU work on its stream, after making the stream wait (``wait_event``) for every
dependency recorded on another stream; its completion is a CUDA event recorded right after.
A dependency on host work (gradient accumulation, an optimizer update) is waited for on the
host before the dependent is issued. Compute runs on the caller's current stream, so user
code before and after the model call is ordered with it as in eager PyTorch; copies run on
two dedicated streams.

Steady state allocates nothing: slots and host buffers are allocated once; events are small
host objects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..devices import CudaDevice
from .backend import Backend
from .streams import JoinToken, Token, skipped

__all__ = ["CudaBackend", "CudaToken", "CudaStream"]


class CudaToken(Token):
    """Completion of GPU work: a CUDA event recorded after it."""

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event, label: str = ""):
        super().__init__(label)
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()

    @property
    def is_done(self) -> bool:
        return bool(self.event.query())


def _stream_wait(stream: torch.cuda.Stream, tok: Token) -> None:
    if isinstance(tok, CudaToken):
        stream.wait_event(tok.event)
    elif isinstance(tok, JoinToken):
        for p in tok.parts:
            _stream_wait(stream, p)
    else:  # host work: wait on the host before issuing
        tok.wait()
        if tok.error is not None:
            raise skipped(tok)


class CudaStream:
    """A CUDA stream (``None``: the caller's current stream at issue time)."""

    def __init__(self, name: str, device: torch.device, stream: torch.cuda.Stream | None):
        self.name = name
        self.device = device
        self.stream = stream

    def current(self) -> torch.cuda.Stream:
        return self.stream if self.stream is not None else torch.cuda.current_stream(self.device)

    def submit(self, fn: Callable[[], None], deps: Sequence[Token] = (), label: str = "") -> Token:
        s = self.current()
        for d in deps:
            _stream_wait(s, d)
        with torch.cuda.stream(s):
            fn()
        ev = torch.cuda.Event()
        ev.record(s)
        return CudaToken(ev, label)

    def close(self) -> None:
        pass


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

    def describe(self) -> str:
        return f"{torch.cuda.get_device_name(self.device)} ({self.spec})"

    def alloc_device(self, nbytes: int, what: str, term: str = "other") -> torch.Tensor:
        self.reserve(nbytes, what, term)
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError:
            self.unreserve(nbytes, what, term)
            raise

    def alloc_host(self, nbytes: int, pin: bool) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        t.zero_()
        return t

    def h2d_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.count_copy("h2d", src.numel() * src.element_size())
        dst.copy_(src, non_blocking=True)

    def d2h_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.count_copy("d2h", src.numel() * src.element_size())
        dst.copy_(src, non_blocking=True)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def get_rng_state(self) -> Any:
        return torch.cuda.get_rng_state(self.device)

    def set_rng_state(self, state: Any) -> None:
        torch.cuda.set_rng_state(state, self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
