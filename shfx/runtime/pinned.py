"""Pinned (page-locked) host memory at its exact size.

``torch.empty(n, pin_memory=True)`` goes through torch's caching host allocator, which rounds
every block up to a power of two: a 1.1 GiB host group buffer takes 2 GiB of pinned RAM, so
a model's host store can pin up to twice what the memory ledger counts. Here a buffer is
ordinary memory (over-allocated by one page so a page-aligned span of the rounded size lies
inside it) registered with ``cudaHostRegister``: it pins ``ceil(n / page) * page`` bytes, and
is unregistered when the allocator closes or the buffer is freed.

Every pinned buffer of the CUDA backend comes from one :class:`PinnedAllocator`, which counts
them (``live_bytes``, ``allocations``): what the ledger's host terms are checked against.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections.abc import Callable

import torch

__all__ = ["PinnedAllocator", "PAGE", "page_rounded"]

PAGE = mmap.PAGESIZE


def page_rounded(nbytes: int) -> int:
    return -(-max(nbytes, 1) // PAGE) * PAGE


def _cudart_register(ptr: int, size: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    code = int(getattr(err, "value", err))
    if code != 0:
        raise RuntimeError(
            f"cudaHostRegister of {size} bytes failed with CUDA error {code}: the host cannot pin that much memory "
            "(see `ulimit -l`), or pass shfx.compile(..., pin_memory=False)"
        )


def _cudart_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class PinnedAllocator:
    """Exact-size pinned host buffers (see the module docstring).

    ``register``/``unregister`` default to ``cudaHostRegister``/``cudaHostUnregister``; tests
    pass recorders to check the sizes on a machine without CUDA."""

    def __init__(
        self,
        register: Callable[[int, int], None] | None = None,
        unregister: Callable[[int], None] | None = None,
    ):
        self._register = register or _cudart_register
        self._unregister = unregister or _cudart_unregister
        self._lock = threading.Lock()
        self._live: dict[int, tuple[int, weakref.finalize]] = {}  # ptr -> (registered bytes, finalizer)
        self.allocations = 0
        self.peak_bytes = 0

    @property
    def live_bytes(self) -> int:
        with self._lock:
            return sum(n for n, _ in self._live.values())

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A zeroed uint8 host tensor of ``nbytes`` bytes whose pages are pinned."""
        size = page_rounded(nbytes)
        raw = torch.empty(size + PAGE, dtype=torch.uint8)
        off = (-raw.data_ptr()) % PAGE
        span = raw[off : off + size]
        span.zero_()  # touch every page before pinning (and the buffer starts zeroed, as before)
        ptr = span.data_ptr()
        self._register(ptr, size)
        holder = span.untyped_storage()
        fin = weakref.finalize(holder, self._release, ptr)
        with self._lock:
            self._live[ptr] = (size, fin)
            self.allocations += 1
            self.peak_bytes = max(self.peak_bytes, sum(n for n, _ in self._live.values()))
        return span[:nbytes]

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes lie inside one live buffer of this allocator (pinned by it:
        ``Tensor.is_pinned()`` does not report registered memory on every torch)."""
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        with self._lock:
            return any(p <= lo and hi <= p + n for p, (n, _) in self._live.items())

    def _release(self, ptr: int) -> None:
        with self._lock:
            item = self._live.pop(ptr, None)
        if item is not None:
            try:
                self._unregister(ptr)
            except Exception:  # noqa: BLE001 - at interpreter shutdown CUDA may be gone
                pass

    def close(self) -> None:
        """Unregister every live buffer (they stay valid ordinary memory)."""
        with self._lock:
            items = list(self._live.items())
        for ptr, (_, fin) in items:
            fin.detach()
            self._release(ptr)
