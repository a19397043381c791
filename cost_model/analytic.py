"""The analytic cost model: costs on hardware you do not have.

Per stage, one run of its graph on fake tensors counts matmul-class FLOPs
(``torch.utils.flop_counter``) and the bytes written by every other op; on a
:class:`shfx.cost_model.hardware.Hardware` profile

- FORWARD = matmul FLOPs / achieved FLOP/s + 2 x other bytes / device memory bandwidth,
- BACKWARD = 3 x FORWARD with recompute (forward again, then about twice its work), 2 x without,
- CPU_STEP = 28 bytes per trainable parameter / host memory bandwidth (AdamW reads p, g, m, v and
  writes p, m, v), the gradient add 12 bytes per parameter,
- copies over the profile's links.

:func:`repeat_blocks` turns the specs and costs of a model captured with a few blocks into those
of the same model with any number of blocks, so what-if studies at billions of parameters need
neither the memory nor the capture time of the full model (see :func:`plan_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shfx.passes.partition import StageGraph
from shfx.passes.stages import StageSpec, Value

from .costs import CostTable, Links, StageCost
from .hardware import Hardware, get_profile

__all__ = ["StageWork", "stage_work", "analytic_costs", "repeat_blocks", "links_of", "plan_inputs"]

_MATMUL = {
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "matmul",
    "linear",
    "convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
}


_ATTENTION = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
}


def _counted_by_flop_counter(func) -> bool:
    from torch.utils.flop_counter import flop_registry

    return func.overloadpacket in flop_registry or func in flop_registry


@dataclass(frozen=True)
class StageWork:
    """What one FORWARD of a stage does: matmul-class FLOPs and bytes written by other ops."""

    flops: float
    other_bytes: float


class _BytesMode(TorchDispatchMode):
    """Sums the bytes written by ops that are not matmul-class, and the FLOPs of
    ``scaled_dot_product_attention`` (the FLOP counter only knows its fused backends)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.attention_flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _ATTENTION and not _counted_by_flop_counter(func):
            q, k = args[0], args[1]  # [..., Lq, E], [..., Lk, E]
            batch = q.numel() // (q.shape[-2] * q.shape[-1])
            self.attention_flops += 4 * batch * q.shape[-2] * k.shape[-2] * q.shape[-1]  # QK^T and PV
        if name not in _MATMUL and not func.is_view:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
        return out


def stage_work(graph: StageGraph) -> list[StageWork]:
    """Count each stage's forward work on fake tensors (no memory, no real compute)."""
    from torch._subclasses import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    out = []
    for st in graph.stages:
        with FakeTensorMode(allow_non_fake_inputs=True):
            args = [torch.empty(graph.tensors[k].shape, dtype=graph.tensors[k].dtype) for k in st.params + st.buffers]
            args += [torch.empty(graph.values[v].shape, dtype=graph.values[v].dtype) for v in st.inputs]
            counter = FlopCounterMode(display=False)
            with counter, torch.no_grad(), _BytesMode() as bm:
                st.gm(*args)
        out.append(StageWork(float(counter.get_total_flops() + bm.attention_flops), float(bm.bytes)))
    return out


def links_of(hw: Hardware) -> Links:
    return Links(hw.h2d_bps, hw.d2h_bps, duplex=hw.duplex, latency_s=hw.link_latency_s)


def analytic_costs(
    graph: StageGraph, hardware: Hardware | str, *, dtype: str = "float32", optimizer_workers: int = 1
) -> CostTable:
    """Costs of ``graph``'s stages on ``hardware`` (see the module docstring)."""
    hw = get_profile(hardware)
    rate = hw.matmul_flops(dtype)
    works = stage_work(graph)
    costs = []
    for st, w in zip(graph.stages, works):
        fwd = w.flops / rate + 2.0 * w.other_bytes / hw.device_mem_bps
        n_train = sum(graph.tensors[k].numel for k in graph.tensors if graph.owner[k] == st.index and graph.tensors[k].trainable)
        costs.append(
            StageCost(
                forward_s=fwd,
                backward_s=3.0 * fwd,
                backward_kept_s=2.0 * fwd,
                update_s=28.0 * n_train / hw.host_mem_bps,
                device_update_s=28.0 * n_train / hw.device_mem_bps,
                accumulate_s=12.0 * n_train / hw.host_mem_bps,
            )
        )
    return CostTable(
        costs,
        links_of(hw),
        optimizer_workers=optimizer_workers,
        source=f"analytic: {hw.name}, {dtype}",
        extra={"work": works},
    )


def repeat_blocks(
    specs: Sequence[StageSpec], costs: Sequence[StageCost] | None, blocks: range, n: int
) -> tuple[list[StageSpec], list[StageCost] | None]:
    """Specs (and costs) of the same model with ``n`` copies of its block stage.

    Given stage specs where ``blocks`` are identical repeated blocks (at least one), return the
    specs with ``n`` blocks: stages before the blocks unchanged, every block a copy of the last
    captured block reading the stage before it (and the head stages it read), stages after the
    blocks shifted, their reads of the last block moved to the new last block. Host groups
    follow their stages (a tail borrowing the head's tied weight still does). Boundary values
    (``StageSpec.inputs``/``outputs``) follow: block ``j`` reads block ``j-1``'s outputs (block 0
    what the first captured block reads) and the head's values the template reads; the stages
    after the blocks read the new last block's outputs.
    """
    if not blocks or blocks.start < 0 or blocks.stop > len(specs):
        raise ValueError(f"blocks {blocks} must be a non-empty range of stage indices within 0..{len(specs) - 1}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    first, last = blocks.start, blocks.stop - 1
    shift = n - len(blocks)
    tpl = specs[last]

    def remap(i: int, new_index: int | None = None, rel_to: int | None = None) -> int:
        if i < first:
            return i
        if i <= last:  # a block: keep its distance from the reference
            if rel_to is None:
                raise AssertionError
            return new_index - (rel_to - i)
        return i + shift

    out: list[StageSpec] = list(specs[:first])
    for j in range(n):
        idx = first + j
        prods = frozenset(p for p in (remap(p, idx, tpl.index) for p in tpl.producers) if 0 <= p < idx)
        def block_group(g: int, idx: int = idx) -> int:
            return g if g < first else idx - (tpl.index - g) if g <= last else g + shift

        groups = frozenset(block_group(g) for g in tpl.grad_groups)
        out.append(
            replace(
                tpl,
                index=idx,
                name=f"block.{j}",
                producers=prods,
                grad_groups=frozenset(g for g in groups if g >= 0),
                grad_group_bytes=tuple((block_group(g), b) for g, b in tpl.grad_group_bytes if block_group(g) >= 0),
                update_group=None if tpl.update_group is None else idx,
            )
        )
    new_last = first + n - 1
    for st in specs[last + 1 :]:
        idx = st.index + shift
        prods = frozenset(p if p < first else (new_last - (last - p) if p <= last else p + shift) for p in st.producers)
        def tail_group(g: int) -> int:
            return g if g < first else (new_last - (last - g) if g <= last else g + shift)

        groups = frozenset(tail_group(g) for g in st.grad_groups)
        out.append(
            replace(
                st,
                index=idx,
                producers=prods,
                grad_groups=groups,
                grad_group_bytes=tuple((tail_group(g), b) for g, b in st.grad_group_bytes),
                update_group=None if st.update_group is None else st.update_group + shift,
            )
        )
    if any(s.outputs for s in specs):
        out = _repeat_values(specs, out, first, last, n)
    new_costs = None
    if costs is not None:
        new_costs = list(costs[:first]) + [costs[last]] * n + list(costs[last + 1 :])
    return out, new_costs


def _repeat_values(specs: Sequence[StageSpec], out: list[StageSpec], first: int, last: int, n: int) -> list[StageSpec]:
    """The boundary values of :func:`repeat_blocks`' specs: each block's outputs get their own
    names, reads of the captured blocks' outputs go to the new blocks', and every value's
    consumers are recomputed from who reads it."""
    tpl = specs[last]
    shift = n - (last - first + 1)
    block_outs = [[replace(v, name=f"{v.name}#{j}", producer=first + j) for v in tpl.outputs] for j in range(n)]

    def moved(v: Value) -> Value:
        """A value read by a stage after the blocks: the captured block's output -> the new one's."""
        if first <= v.producer <= last:
            j = n - 1 - (last - v.producer)
            k = [w.name for w in specs[v.producer].outputs].index(v.name)
            return block_outs[max(j, 0)][k] if k < len(block_outs[max(j, 0)]) else v
        return replace(v, producer=v.producer + shift) if v.producer > last else v

    ins: list[tuple[Value, ...]] = []
    outs: list[tuple[Value, ...]] = []
    for st in out:
        i = st.index
        if i < first:
            ins.append(specs[i].inputs)
            outs.append(specs[i].outputs)
        elif i < first + n:
            j = i - first
            own = tuple(v for v in (specs[first].inputs if j == 0 else tpl.inputs) if v.producer < first)
            ins.append(own + (tuple(block_outs[j - 1]) if j else tuple(v for v in specs[first].inputs if v.producer >= first)))
            outs.append(tuple(block_outs[j]))
        else:
            src = specs[i - shift]
            ins.append(tuple(moved(v) for v in src.inputs))
            outs.append(tuple(replace(v, producer=i) for v in src.outputs))
    readers: dict[str, set[int]] = {}
    for i, vs in enumerate(ins):
        for v in vs:
            readers.setdefault(v.name, set()).add(i)

    def fix(v: Value) -> Value:
        return replace(v, consumers=tuple(sorted(c for c in readers.get(v.name, ()) if c != v.producer)))

    result = []
    for st, i_vs, o_vs in zip(out, ins, outs):
        model_inputs = tuple(fix(v) for v in st.model_inputs)
        result.append(replace(st, inputs=tuple(fix(v) for v in i_vs), outputs=tuple(fix(v) for v in o_vs), model_inputs=model_inputs))
    return result


def plan_inputs(
    build: Callable[[int], torch.nn.Module],
    inputs: Callable[[], tuple],
    *,
    blocks: str,
    layers: int,
    hardware: Hardware | str,
    dtype: str = "float32",
    template_layers: int = 2,
) -> tuple[list[StageSpec], CostTable]:
    """Stage specs and analytic costs of ``build(layers)`` without building it.

    ``build(n)`` makes the model with ``n`` blocks (it is called on the meta device with
    ``template_layers``); ``inputs()`` returns its example arguments (meta tensors are fine);
    ``blocks`` names the block container. The captured template's block stage is repeated to
    ``layers`` blocks by :func:`repeat_blocks`.
    """
    from shfx.passes.capture import capture_model
    from shfx.passes.partition import partition_stages

    with torch.device("meta"):
        model = build(template_layers)
        args = inputs()
    graph = partition_stages(capture_model(model, args), model=model, blocks=blocks)
    nblocks = sum(1 for s in graph.stages if s.name.startswith(blocks + "."))
    first = next(s.index for s in graph.stages if s.name.startswith(blocks + "."))
    table = analytic_costs(graph, hardware, dtype=dtype)
    specs, costs = repeat_blocks(graph.specs, table.costs, range(first, first + nblocks), layers)
    return specs, replace(table, costs=costs, source=table.source + f", {layers} blocks")
