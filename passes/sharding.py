"""The data-parallel sharding rule: which elements of a group's flat buffers a rank owns.

One function decides it for every user (the memory ledger and planner, the sharded host store
and optimizer, the collectives, checkpoints): group ``g``'s trainable region has ``T`` elements (padding
included); ``chunk = ceil(T / N)`` rounded up to a multiple of :data:`SHARD_ALIGN` elements;
rank ``r`` owns ``[r * chunk, min(T, (r + 1) * chunk))`` (possibly empty: a small group on many
ranks). The collectives run over ``N * chunk`` elements (the last shard zero-padded).

NOTE: the design's rule is ``chunk = ceil(T / N)``; it is rounded up to 16 elements here because
``torch._fused_adamw_`` rounds an element differently in its vector body and its scalar tail
(``shfx.runtime.host_optim``): a shard boundary must fall at a multiple of 16 elements from
the start of every parameter it cuts for the sharded update to be bitwise the one of
``torch.optim.AdamW(fused=True)`` over whole parameters. Parameters start 64-byte aligned in a
group (:data:`shfx.passes.layout.ALIGN`, 16 fp32 elements), so a chunk of a multiple of 16
elements cuts every parameter at such a point. (On the 2-core test VM the kernel happened to
give the same bits for unaligned cuts too: tests/test_data_parallel.py also passes with
``SHARD_ALIGN = 1`` there, so it cannot show the alignment is needed; it costs at most 15
elements of padding per group and rank.)

In bf16 the same element ranges cut the 16-bit image and local gradient too (16 elements are 32
bytes there): only the fp32 kernel's positions need the alignment; the reduce-scatter, the
all-gather and the master's cast into the image are element by element.

>>> shard_range(100, 0, 2), shard_range(100, 1, 2)
((0, 64), (64, 100))
>>> [shard_range(20, r, 4) for r in range(4)]
[(0, 16), (16, 20), (20, 20), (20, 20)]
"""

from __future__ import annotations

__all__ = ["SHARD_ALIGN", "shard_chunk", "shard_range", "shard_numel"]

#: elements a shard's length is a multiple of (but the last one's): 16 fp32 = one 64-byte cache line
SHARD_ALIGN = 16


def shard_chunk(total: int, ranks: int) -> int:
    """Elements per rank of a group of ``total`` trainable elements over ``ranks`` ranks (the
    padded collectives move ``ranks * chunk``)."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    per = -(-total // ranks)
    return -(-per // SHARD_ALIGN) * SHARD_ALIGN


def shard_range(total: int, rank: int, ranks: int) -> tuple[int, int]:
    """``[lo, hi)``: the elements of a group of ``total`` trainable elements that rank ``rank``
    of ``ranks`` owns (its master weights, gradient and optimizer states)."""
    if not 0 <= rank < ranks:
        raise ValueError(f"rank must be in [0, {ranks}), got {rank}")
    chunk = shard_chunk(total, ranks)
    lo = min(total, rank * chunk)
    return lo, min(total, lo + chunk)


def shard_numel(total: int, ranks: int, rank: int = 0) -> int:
    """Elements rank ``rank`` owns of a group of ``total`` (:func:`shard_range`); rank 0 owns
    the most, ``min(total, chunk)``.

    >>> shard_numel(100, 2), shard_numel(100, 2, rank=1), shard_numel(20, 4, rank=3)
    (64, 36, 0)
    """
    lo, hi = shard_range(total, rank, ranks)
    return hi - lo
