"""Pinned (page-locked) host memory at its exact size.

``torch.empty(n, pin_memory=True)`` goes through torch's caching host allocator, which rounds
every block up to a power of two: a 1.1 GiB host group buffer takes 2 GiB of pinned RAM, so
a model's host store can pin up to twice what the memory ledger counts. Here a buffer is
ordinary memory (over-allocated by one page so a page-aligned span of the rounded size lies
inside it) registered with ``cudaHostRegister``: it pins ``ceil(n / page) * page`` bytes, and
is unregistered when the allocator closes or the buffer is freed.

Every pinned buffer of a backend comes from its one :class:`PinnedAllocator`, the pinned
*pool* (``backend.pinned``), which counts them (``live_bytes``, ``allocations``,
``peak_bytes``): what the ledger's ``"pinned"`` tier is checked against. The CUDA backend's
registers with ``cudaHostRegister``; the emulated backend's with a register that does nothing,
so both account pinned memory alike.

The pool holds at most ``budget_bytes`` (``shfx.compile(pinned=...)``) and follows a plan
(:class:`shfx.passes.pinned.PinnedPlan`: which buffers to pin when not all fit; images first,
then gradient buffers, then staging buffers). A buffer asked pinned that the plan (or the
budget) leaves out is ordinary memory, and the backend copies it through the pool's bounce
buffers (:meth:`PinnedAllocator.bounce`; ``Backend.h2d_copy``/``d2h_copy``).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

from shfx.passes.pinned import PAGE, PinnedPlan, kind_of, page_rounded
from shfx.passes.units import format_bytes

from ..errors import UsageError

__all__ = ["PinnedAllocator", "BounceSlot", "PAGE", "page_rounded", "no_register", "no_unregister"]


def no_register(ptr: int, size: int) -> None:
    """The emulated device's ``cudaHostRegister``: pins nothing (the pool still accounts it)."""


def no_unregister(ptr: int) -> None:
    """The emulated device's ``cudaHostUnregister``."""


class BounceSlot:
    """One pinned bounce buffer and the marker of the last copy in or out of it (a CUDA event,
    an emulated stream token, or None: done)."""

    __slots__ = ("buf", "marker")

    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self.marker: Any = None


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
    """The pinned pool: exact-size pinned host buffers within a budget (see the module docstring).

    ``register``/``unregister`` default to ``cudaHostRegister``/``cudaHostUnregister``; the
    emulated backend passes :func:`no_register`/:func:`no_unregister`, tests recorders to check
    the sizes on a machine without CUDA. ``budget_bytes``: the most it pins (None: no limit).

    >>> pool = PinnedAllocator(no_register, no_unregister, budget_bytes=2 * PAGE)
    >>> a, b = pool.take(PAGE, "image 0"), pool.take(PAGE + 1, "image 1")
    >>> pool.owns(a), pool.owns(b), pool.live_bytes == PAGE, pool.unpinned_allocations
    (True, False, True, 1)
    """

    def __init__(
        self,
        register: Callable[[int, int], None] | None = None,
        unregister: Callable[[int], None] | None = None,
        budget_bytes: int | None = None,
    ):
        self._register = register or _cudart_register
        self._unregister = unregister or _cudart_unregister
        # NOTE: reentrant: a buffer's finalizer (_release) may run inside a locked block when an
        # allocation there triggers the garbage collector; the blocks iterate over copies
        self._lock = threading.RLock()
        self._live: dict[int, tuple[int, weakref.finalize, str]] = {}  # ptr -> (registered bytes, finalizer, pool key)
        self._planned: set[int] = set()  # the live buffers the plan counts (and the bounce buffers)
        self.allocations = 0
        self.peak_bytes = 0
        self.budget_bytes = budget_bytes
        self.plan: PinnedPlan | None = None
        self._taken: Counter[str] = Counter()  # live pinned buffers per planned key
        self._bounce: dict[str, list[BounceSlot]] = {}
        self._bounce_locks = {"h2d": threading.Lock(), "d2h": threading.Lock()}
        self.unpinned_allocations = 0  # buffers asked pinned, given ordinary memory
        self.unpinned_bytes = 0
        self.bounced_copies = 0  # copies that went through the bounce buffers

    @property
    def live_bytes(self) -> int:
        with self._lock:
            return sum(n for n, _, _ in list(self._live.values()))

    def alloc(self, nbytes: int, key: str = "", planned: bool = False) -> torch.Tensor:
        """A zeroed uint8 host tensor of ``nbytes`` bytes whose pages are pinned (whatever the
        budget: :meth:`take` decides)."""
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
            self._live[ptr] = (size, fin, key)
            if planned:
                self._planned.add(ptr)
            self.allocations += 1
            self.peak_bytes = max(self.peak_bytes, sum(n for n, _, _ in list(self._live.values())))
        return span[:nbytes]

    # ---- the budget and the plan ----------------------------------------------------------------
    def set_plan(self, plan: PinnedPlan) -> None:
        """Follow ``plan`` from now on (buffers allocated before keep their pages): refuse it if
        the budget is below its minimum, and allocate its bounce buffers (two per direction)."""
        if plan.too_small:
            raise UsageError(
                f"pinned={format_bytes(plan.budget_bytes)} is too small: the pinned pool needs at least "
                f"{format_bytes(plan.minimum_bytes)} ({plan.minimum_bytes} bytes) for this model: "
                f"{plan.bounce_buffers} bounce buffers of {format_bytes(plan.bounce_bytes)} through which the host buffers "
                f"that are not pinned are copied. Pass shfx.compile(..., pinned={plan.minimum_bytes}) or more "
                f"(pinning all {len(plan.unpinned)} buffers that cross the link takes "
                f"{format_bytes(sum(page_rounded(n, plan.page) for _, n in plan.unpinned))}), or pin_memory=False to pin nothing"
            )
        self.plan = plan
        self.budget_bytes = plan.budget_bytes
        have = sum(len(v) for v in self._bounce.values())
        if plan.bounce_buffers and (have < plan.bounce_buffers or any(s.buf.numel() < plan.bounce_bytes for v in self._bounce.values() for s in v)):
            per = plan.bounce_buffers // 2
            self._bounce = {d: [BounceSlot(self.alloc(plan.bounce_bytes, "bounce", planned=True)) for _ in range(per)] for d in ("h2d", "d2h")}

    def take(self, nbytes: int, what: str = "") -> torch.Tensor:
        """A zeroed uint8 host buffer of ``nbytes`` asked pinned for ``what`` (``"image g"``,
        ``"gradient g"``, ``"staging"``, ...): pinned if the plan pins it, or else if it fits
        beside what the plan reserves (a buffer the plan does not know, or leaves out only
        because the budget is full); else ordinary memory, which the backend copies through
        the bounce buffers (where the plan pinned everything it has none: a buffer made later
        that does not fit is copied from pageable memory, as with ``pin_memory=False``)."""
        size = page_rounded(nbytes)
        key = kind_of(what)
        with self._lock:
            live = sum(n for n, _, _ in list(self._live.values()))
            plan, budget = self.plan, self.budget_bytes
            planned = plan is not None and self._taken[key] < plan.count(key)
            if planned:
                pin = budget is None or live + size <= budget
            elif budget is None:
                pin = True
            else:  # a buffer the plan does not pin (or one more than it counts): beside what it reserves and is not allocated yet
                reserved = 0
                if plan is not None:
                    reserved = max(0, plan.pinned_bytes - sum(self._live[p][0] for p in list(self._planned) if p in self._live))
                pin = live + size + reserved <= budget
            if pin and planned:
                self._taken[key] += 1
        if pin:
            return self.alloc(nbytes, key, planned=planned)
        t = torch.zeros(nbytes, dtype=torch.uint8)
        with self._lock:
            self.unpinned_allocations += 1
            self.unpinned_bytes += nbytes
        return t

    @property
    def bounces(self) -> bool:
        """Whether the pool has bounce buffers (some buffer is not pinned)."""
        return bool(self._bounce)

    @property
    def bounce_bytes(self) -> int:
        return min((s.buf.numel() for v in self._bounce.values() for s in v), default=0)

    @contextlib.contextmanager
    def bounce(self, direction: str) -> Iterator[list[BounceSlot]]:
        """The bounce buffers of ``direction`` (``"h2d"``/``"d2h"``), held by the caller for one copy."""
        with self._bounce_locks[direction]:
            self.bounced_copies += 1
            yield self._bounce[direction]

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes lie inside one live buffer of this allocator (pinned by it:
        ``Tensor.is_pinned()`` does not report registered memory on every torch)."""
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        with self._lock:
            return any(p <= lo and hi <= p + n for p, (n, _, _) in list(self._live.items()))

    def _release(self, ptr: int) -> None:
        with self._lock:
            item = self._live.pop(ptr, None)
            if ptr in self._planned:
                self._planned.discard(ptr)
                if self._taken[item[2]] > 0:
                    self._taken[item[2]] -= 1
        if item is not None:
            try:
                self._unregister(ptr)
            except Exception:  # noqa: BLE001 - at interpreter shutdown CUDA may be gone
                pass

    def close(self) -> None:
        """Unregister every live buffer (they stay valid ordinary memory)."""
        with self._lock:
            items = list(self._live.items())
        for ptr, (_, fin, _) in items:
            fin.detach()
            self._release(ptr)
