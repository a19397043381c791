"""The pinned-memory plan: which host buffers the one pinned pool page-locks, within a budget.

Page-locked (pinned) host memory is what lets a copy between host and device run
asynchronously at the link's full rate, but the kernel can neither swap nor reclaim it, and
pinning the whole host store is the most reported host-memory failure of offloading systems.
So every pinned buffer of a backend comes from one pool (``shfx.runtime.pinned``) holding at
most ``shfx.compile(pinned=...)`` bytes, and this plan says which buffers it pins:

1. the *images*, what every PREFETCH copies to the device (the parameters in the device dtype,
   buffers, constants: one per group), in group order;
2. the host gradient buffers, what every OFFLOAD_GRAD lands in, in group order;
3. the staging buffers a gradient is added through (accumulation, a borrowed gradient, data
   parallel's local gradients).

Each buffer is pinned if it fits in what is left (first fit, in that order); the others stay
ordinary memory, and their copies go through :data:`BOUNCE_BUFFERS` pinned *bounce buffers*
of at most :data:`BOUNCE_CHUNK_BYTES` each (two per direction: one is filled while the other
crosses the link), which the plan reserves first whenever not everything fits. A budget
smaller than those bounce buffers is refused (:attr:`PinnedPlan.too_small`) before training,
with the number of bytes needed. The fp32 masters of mixed precision, the optimizer states and
the NVMe tier's window never cross the link and are never pinned.

Sizes are page-rounded (``cudaHostRegister`` pins whole pages): the plan's
:attr:`~PinnedPlan.pinned_bytes` is what the runtime's pool reports as ``live_bytes`` once every
planned buffer exists, to the byte (``tests/test_pinned_pool.py``).

>>> MiB = 1 << 20
>>> plan = plan_pinned([("image 0", 16 * MiB), ("image 1", 16 * MiB), ("gradient 0", 16 * MiB)], budget_bytes=40 * MiB)
>>> [n for n, _ in plan.pinned], [n for n, _ in plan.unpinned], plan.bounce_buffers, plan.bounce_bytes // MiB
(['image 0'], ['image 1', 'gradient 0'], 4, 4)
>>> plan.pinned_bytes // MiB, plan.minimum_bytes // MiB, plan_pinned(plan.pinned, 8 * MiB).too_small
(32, 16, True)
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from .layout import STAGING

__all__ = [
    "PAGE",
    "BOUNCE_BUFFERS",
    "BOUNCE_CHUNK_BYTES",
    "DEFAULT_RAM_FRACTION",
    "PINNED_TERMS",
    "PinnedPlan",
    "default_pinned_bytes",
    "page_rounded",
    "pinned_candidates",
    "plan_pinned",
    "plan_for_groups",
    "physical_ram_bytes",
]

PAGE = mmap.PAGESIZE

BOUNCE_BUFFERS = 4
"""Pinned bounce buffers of the pool when not every buffer fits: two per direction (one is
filled from, or emptied into, an ordinary buffer while the other crosses the link)."""

BOUNCE_CHUNK_BYTES = 4 << 20
"""The most each bounce buffer holds (4 MiB: a copy that long runs at the link's rate, the four
of them small beside any budget worth having); smaller when the largest buffer is smaller."""

DEFAULT_RAM_FRACTION = 0.25
"""``pinned=None`` / ``"auto"``: a quarter of the physical RAM. The pinned buffers are the
images and gradients (at most half of the 16 bytes per parameter of fp32 AdamW training, 6 of
the 18 in mixed precision), and the rest of the host (masters, optimizer states, the OS, the
data loader) needs ordinary memory the kernel can reclaim; CUDA's guide warns that pinning too
much degrades the whole system. A quarter pins everything for models whose store fits in half
the RAM, and the bounce path keeps larger ones training."""

LATER_TERMS = ("offloaded activations",)
"""Host terms of buffers that cross the link but are made after the plan (activation offload's,
chosen from the costs after the host store exists): pinned if they fit beside what the plan
reserves, in the order they are made."""

PINNED_TERMS = ("pinned buffers", "bounce buffers")
"""The ledger's ``"pinned"`` tier, term by term: a view of the host memory (each byte is also
in a host term), the part of it page-locked."""


def page_rounded(nbytes: int, page: int = PAGE) -> int:
    """``nbytes`` rounded up to whole pages (at least one)."""
    return -(-max(nbytes, 1) // page) * page


def physical_ram_bytes() -> int:
    """The machine's physical RAM in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_pinned_bytes() -> int:
    """The default pinned budget: :data:`DEFAULT_RAM_FRACTION` of the physical RAM, whole pages."""
    return int(physical_ram_bytes() * DEFAULT_RAM_FRACTION) // PAGE * PAGE


def kind_of(name: str) -> str:
    """The pool's key of a buffer name: staging buffers are interchangeable (``"staging 1"`` ->
    ``"staging"``), and so are the parameter tier's window buffers (``"image window 0"`` ->
    ``"image window"``); images and gradients are per group (``"image 3"``)."""
    if name.startswith("staging"):
        return "staging"
    head, _, tail = name.rpartition(" ")
    return head if head.endswith(" window") and tail.isdigit() else name


@dataclass(frozen=True)
class PinnedPlan:
    """Which host buffers the pinned pool page-locks (:func:`plan_pinned`).

    Attributes:
        budget_bytes: the pool's budget (None: no budget, everything pinned).
        pinned: ``(name, bytes)`` of the buffers pinned, in priority order (names as the
            runtime allocates them: ``"image g"``, ``"gradient g"``, ``"staging i"``).
        unpinned: those left in ordinary memory (their copies go through the bounce buffers).
        bounce_buffers, bounce_bytes: how many bounce buffers, and the bytes of each (page-rounded).
        minimum_bytes: the smallest budget that trains (the bounce buffers; or everything, when
            that is smaller).
        page: the page size the sizes are rounded to.
    """

    budget_bytes: int | None
    pinned: tuple[tuple[str, int], ...]
    unpinned: tuple[tuple[str, int], ...] = ()
    bounce_buffers: int = 0
    bounce_bytes: int = 0
    minimum_bytes: int = 0
    page: int = PAGE

    @property
    def too_small(self) -> bool:
        """Whether the budget is below :attr:`minimum_bytes` (refused before training)."""
        return self.budget_bytes is not None and self.budget_bytes < self.minimum_bytes

    @property
    def bounce_total_bytes(self) -> int:
        return self.bounce_buffers * self.bounce_bytes

    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes once every planned buffer exists: the pinned buffers (page-rounded)
        and the bounce buffers."""
        return sum(page_rounded(n, self.page) for _, n in self.pinned) + self.bounce_total_bytes

    def count(self, key: str) -> int:
        """How many buffers of pool key ``key`` (:func:`kind_of`) are pinned."""
        return sum(1 for n, _ in self.pinned if kind_of(n) == key)

    def plans(self, key: str) -> bool:
        """Whether the plan knows buffers of key ``key`` (pinned or not)."""
        return any(kind_of(n) == key for n, _ in self.pinned + self.unpinned)

    def changes(self, host: Sequence | None = None) -> list[tuple[str, str, str, int]]:
        """The ledger's ``"pinned"`` tier (:data:`PINNED_TERMS`) as ``(tier, term, what, nbytes)``
        rows (the fields of :class:`~shfx.passes.ledger.Change`, which the ledger makes of them).
        ``host``: the setup's host changes of a program (:func:`shfx.passes.ledger.host_terms`):
        then only the gradient and staging buffers that program allocates are counted (the plan
        reserves them for every trainable group, whichever are updated on the host)."""
        grads: dict[int, int] | None = None
        staging: list[int] | None = None
        if host is not None:  # (their sizes as the program allocates them: data parallel's are shards)
            grads = {}
            for c in host:
                m = re.search(r"group (\d+)$", c.what)
                if c.term == "gradients (fp32)" and m:
                    grads[int(m.group(1))] = c.nbytes
            staging = [c.nbytes for c in host if c.term == "gradient staging (pinned)"]
        out = []
        for name, n in self.pinned:
            per_group = re.fullmatch(r"gradient (\d+)", name)
            if grads is not None and per_group:
                g = int(per_group.group(1))
                if g not in grads:
                    continue
                n = grads[g]
            if staging is not None and kind_of(name) == "staging":
                if not staging:
                    continue
                n = staging.pop(0)
            out.append(("pinned", PINNED_TERMS[0], name, page_rounded(n, self.page)))
        out += [("pinned", PINNED_TERMS[1], f"bounce buffer {i}", self.bounce_bytes) for i in range(self.bounce_buffers)]
        # the link buffers the plan does not know (made after it): pinned, in order, while they
        # fit beside all it reserves (shfx.runtime.pinned.PinnedAllocator.take)
        used = self.pinned_bytes
        for c in host or ():
            if c.term in LATER_TERMS and c.nbytes > 0:
                n = page_rounded(c.nbytes, self.page)
                if self.budget_bytes is None or used + n <= self.budget_bytes:
                    used += n
                    out.append(("pinned", PINNED_TERMS[0], c.what, n))
        return out

    def describe(self) -> str:
        from .units import format_bytes

        budget = "no budget" if self.budget_bytes is None else f"budget {format_bytes(self.budget_bytes)}"
        s = f"pinned {format_bytes(self.pinned_bytes)} ({budget}): {len(self.pinned)} buffers"
        if self.unpinned:
            s += (f", {len(self.unpinned)} in ordinary memory ({format_bytes(sum(n for _, n in self.unpinned))}) "
                  f"copied through {self.bounce_buffers} bounce buffers of {format_bytes(self.bounce_bytes)}")  # fmt: skip
        return s


def pinned_candidates(
    images: Sequence[int], gradients: Sequence[int], staging: int = 0, staging_bytes: int = 0, *,
    image_windows: int = 0, image_window_bytes: int = 0, gradient_windows: int = 0, gradient_window_bytes: int = 0,
) -> list[tuple[str, int]]:  # fmt: skip
    """The buffers that cross the link, in the order they get pinned: the image of every group
    (``images[g]`` bytes; 0: none, a group the parameter tier keeps on the SSD) and the
    parameter tier's ``image_windows`` buffers its images are read into; the gradient buffer of
    every group with one (``gradients[g] > 0``) and the tier's ``gradient_windows``; then
    ``staging`` staging buffers of ``staging_bytes``."""
    out = [(f"image {g}", n) for g, n in enumerate(images) if n]
    out += [(f"image window {i}", image_window_bytes) for i in range(image_windows if image_window_bytes else 0)]
    out += [(f"gradient {g}", n) for g, n in enumerate(gradients) if n]
    out += [(f"gradient window {i}", gradient_window_bytes) for i in range(gradient_windows if gradient_window_bytes else 0)]
    out += [(f"staging {i}", staging_bytes) for i in range(staging if staging_bytes else 0)]
    return out


def plan_pinned(
    candidates: Sequence[tuple[str, int]], budget_bytes: int | None, *, page: int = PAGE, chunk_bytes: int | None = None
) -> PinnedPlan:
    """Given the buffers that cross the link (``(name, bytes)`` in priority order:
    :func:`pinned_candidates`) and a budget (None: none), the plan of the pool: everything
    pinned if it all fits; else :data:`BOUNCE_BUFFERS` bounce buffers reserved first (each the
    smaller of ``chunk_bytes``, default :data:`BOUNCE_CHUNK_BYTES`, and the largest buffer,
    page-rounded), then each buffer pinned if
    it fits in what is left (first fit). A budget below the bounce buffers gives a plan that is
    :attr:`~PinnedPlan.too_small` (nothing pinned; the caller refuses it)."""
    sizes = [(name, n) for name, n in candidates if n > 0]
    total = sum(page_rounded(n, page) for _, n in sizes)
    if budget_bytes is None or total <= budget_bytes:
        return PinnedPlan(budget_bytes, tuple(sizes), minimum_bytes=0, page=page)
    chunk_bytes = BOUNCE_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    bounce = min(page_rounded(chunk_bytes, page), page_rounded(max(n for _, n in sizes), page))
    minimum = min(BOUNCE_BUFFERS * bounce, total)
    if budget_bytes < minimum:
        return PinnedPlan(budget_bytes, (), tuple(sizes), BOUNCE_BUFFERS, bounce, minimum, page)
    left = budget_bytes - BOUNCE_BUFFERS * bounce
    pinned, unpinned = [], []
    for name, n in sizes:
        if page_rounded(n, page) <= left:
            left -= page_rounded(n, page)
            pinned.append((name, n))
        else:
            unpinned.append((name, n))
    return PinnedPlan(budget_bytes, tuple(pinned), tuple(unpinned), BOUNCE_BUFFERS, bounce, minimum, page)


def plan_for_groups(
    groups: Sequence, budget_bytes: int | None, *, data_parallel: bool = False, paged: Sequence[int] = (),
    image_window: int = 0, gradient_window: int = 0, page: int = PAGE, chunk_bytes: int | None = None,
) -> PinnedPlan:  # fmt: skip
    """The plan of a host store laid out as ``groups`` (:class:`shfx.passes.layout.Group`), made
    before any of its buffers exists: every group's image (``nbytes``), the gradient buffer of
    every group with a trainable region (``grad_bytes``) and :data:`~shfx.passes.layout.STAGING`
    staging buffers of the largest one (``data_parallel``: one more, the buffer a borrowed
    gradient is copied through beside the local gradients' buffers). With the parameter tier
    (``Offload(params="nvme")``), the ``paged`` groups have no image or gradient buffer of their
    own: their images are read into ``image_window`` buffers (of the largest paged image) and
    their gradients land in ``gradient_window`` buffers (of the largest paged gradient), which
    take their places in the order.

    NOTE: the host store is laid out at the first call, before the tuner or the policy says
    which groups are updated on the device and how many staging buffers the program uses, so
    the plan reserves a gradient buffer for every trainable group and the most staging buffers
    any program uses; :meth:`PinnedPlan.changes` counts those a program allocates."""

    paged = set(paged)
    grads = [g.grad_bytes if g.trainable_numel else 0 for g in groups]
    staging = STAGING + (1 if data_parallel else 0)
    cands = pinned_candidates(
        [0 if g.index in paged else g.nbytes for g in groups], [0 if g in paged else n for g, n in enumerate(grads)],
        staging, max(grads, default=0),
        image_windows=image_window, image_window_bytes=max((g.nbytes for g in groups if g.index in paged), default=0),
        gradient_windows=gradient_window,
        gradient_window_bytes=max((g.trainable_numel * g.dtypes.grad.itemsize for g in groups if g.index in paged), default=0),
    )  # fmt: skip
    return plan_pinned(cands, budget_bytes, page=page, chunk_bytes=chunk_bytes)
