"""The analytic cost model: costs on hardware you do not have.

Per stage, one run of its graph on fake tensors counts matmul-class FLOPs
(``torch.utils.flop_counter``) and the bytes written by every other op; on a
:class:`shfx.cost_model.hardware.Hardware` profile

- FORWARD = matmul FLOPs / achieved FLOP/s + 2 x other bytes / device memory bandwidth,
- BACKWARD = 3 x FORWARD with recompute (forward again, then about twice its work), 2 x without,
  less the parameter-gradient matmuls of its frozen parameters (their share of the forward's
  FLOPs); a stage that runs no backward at all (a frozen bottom) has no BACKWARD in the program,
- CPU_STEP = 28 bytes per trainable parameter / host memory bandwidth (AdamW reads p, g, m, v and
  writes p, m, v), the gradient add 12 bytes per parameter,
- copies over the profile's links.

Mixed precision (``precision="bfloat16"``/``"float16"``, what ``shfx.compile(precision=...)``
trains): matmuls at the profile's 16-bit rate, the other ops' bytes and every copy at 2 bytes
per element (:func:`precision_specs` turns an fp32 capture's stage specs into the 16-bit
model's), CPU_STEP 40 bytes per parameter (:func:`shfx.cost_model.costs.host_update_bytes`: the
gradient's cast and the working copy's refresh on top of AdamW). Every stage also carries the
host time of the step journal's rollback copy of its group (``StageCost.rollback_s``,
:data:`shfx.cost_model.costs.ROLLBACK_COPY_RATIO` x the fp32 update), which the simulator
charges when asked to (``simulate(..., rollback=True)``: fp16's default).

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

from .costs import ROLLBACK_COPY_RATIO, CostTable, Links, StageCost, host_accumulate_bytes, host_update_bytes
from .hardware import Hardware, get_profile
from .shapes import PRECISIONS, normalize_precision

__all__ = [
    "StageWork", "stage_work", "analytic_costs", "repeat_blocks", "links_of", "plan_inputs", "precision_specs",
    "matmul_dtype", "ssd_bound_s",
]

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
    """What one FORWARD of a stage does: matmul-class FLOPs and bytes written by other ops
    (``float_bytes`` of them floating point: what a 16-bit model writes half of)."""

    flops: float
    other_bytes: float
    float_bytes: float = 0.0


class _BytesMode(TorchDispatchMode):
    """Sums the bytes written by ops that are not matmul-class, and the FLOPs of
    ``scaled_dot_product_attention`` (the FLOP counter only knows its fused backends)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.float_bytes = 0
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
                    if t.dtype.is_floating_point:
                        self.float_bytes += t.numel() * t.element_size()
        return out


_COUNT_DEVICE = torch.device("cpu")


def _counting_graph(gm):
    """``gm`` as the fake run executes it: every device its ops name (``arange(..., device=meta)``
    of a model captured on the meta device for planning, ``cuda`` after the compile pipeline's
    retarget) set to the CPU, where the fake inputs live. Fake tensors refuse an op whose inputs
    sit on two devices (torch 2.11: "found two different devices cpu, meta"), and one device for
    every capture makes the count the CPU trace's wherever the model was captured (a meta
    ``scaled_dot_product_attention`` picks another kernel than the CPU's)."""
    from shfx.passes.retarget import device_arguments, retarget_device

    if device_arguments(gm) <= {_COUNT_DEVICE}:
        return gm
    return retarget_device(gm, _COUNT_DEVICE, source=None)


def stage_work(graph: StageGraph) -> list[StageWork]:
    """Count each stage's forward work on fake tensors (no memory, no real compute), all on the
    CPU (:func:`_counting_graph`)."""
    from torch._subclasses import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    out = []
    for st in graph.stages:
        gm = _counting_graph(st.gm)
        with FakeTensorMode(allow_non_fake_inputs=True):

            def fake(shape, dtype):
                return torch.empty(shape, dtype=dtype, device=_COUNT_DEVICE)

            args = [fake(graph.tensors[k].shape, graph.tensors[k].dtype) for k in st.params + st.buffers]
            args += [fake(graph.values[v].shape, graph.values[v].dtype) for v in st.inputs]
            counter = FlopCounterMode(display=False)
            with counter, torch.no_grad(), _BytesMode() as bm:
                gm(*args)
        out.append(StageWork(float(counter.get_total_flops() + bm.attention_flops), float(bm.bytes), float(bm.float_bytes)))
    return out


def links_of(hw: Hardware) -> Links:
    """The links of a hardware profile: the host<->device link, and the NVMe drive when the
    profile has one (``ssd_read_bps``/``ssd_write_bps`` > 0; its duplex and queue depth from the
    profile), and with data parallel (``hw.ranks > 1``) the ring's slowest link
    (:meth:`~shfx.cost_model.hardware.Hardware.collective_link`) as the network."""
    net_bps, net_latency_s = hw.collective_link()
    return Links(
        hw.h2d_bps, hw.d2h_bps, duplex=hw.duplex, latency_s=hw.link_latency_s,
        ssd_read_bps=hw.ssd_read_bps or None, ssd_write_bps=hw.ssd_write_bps or None,
        ssd_duplex=hw.ssd_duplex, ssd_latency_s=hw.ssd_latency_s, ssd_queue_depth=hw.ssd_queue_depth,
        net_bps=net_bps, net_latency_s=net_latency_s,
    )  # fmt: skip


def ssd_bound_s(read_bytes: float, write_bytes: float, links: Links) -> float:
    """The NVMe tier's term of the analytic model: the least time the drive needs for one
    step's SSD traffic (``Program.bytes_moved()``'s ``"ssd_read"`` and ``"ssd_write"``), a lower
    bound on the steady-state step time that binds when the SSD is the bottleneck.

    Reads alone take ``x = read_bytes / ssd_read_bps``, writes alone ``y = write_bytes /
    ssd_write_bps``; while both run each keeps ``d = ssd_duplex`` of its rate, so overlapping
    them for ``t`` seconds saves ``(2d - 1) t`` and the best is ``x + y - (2d - 1) min(x, y) / d``
    for ``d > 1/2`` (``max(x, y)`` at ``d = 1``), ``x + y`` otherwise (per-request latency not
    counted).

    >>> l = Links(None, None, ssd_read_bps=3e9, ssd_write_bps=2e9)
    >>> ssd_bound_s(3e9, 2e9, l), ssd_bound_s(3e9, 2e9, Links(None, None, ssd_read_bps=3e9, ssd_write_bps=2e9, ssd_duplex=0.5))
    (1.0, 2.0)
    """
    if not read_bytes and not write_bytes:
        return 0.0
    if links.ssd_read_bps is None or links.ssd_write_bps is None:
        raise ValueError("ssd_bound_s needs the links' SSD bandwidth (Links(ssd_read_bps=..., ssd_write_bps=...))")
    x, y, d = read_bytes / links.ssd_read_bps, write_bytes / links.ssd_write_bps, links.ssd_duplex
    return x + y - (2 * d - 1) * min(x, y) / d if d > 0.5 else x + y


def matmul_dtype(precision: str, dtype: str | None = None) -> str:
    """The dtype whose FLOP/s a stage's matmuls run at: ``dtype`` when given (``"tf32"``), else
    the precision's own (``"bf16"`` -> ``"bfloat16"``)."""
    return normalize_precision(precision) if dtype is None else dtype


def _capture_element_bytes(graph: StageGraph) -> int:
    """Bytes per element of the captured model's floating-point parameters (4 for an fp32
    capture, 2 for one captured in 16-bit); 4 when it has none."""
    sizes = {t.dtype.itemsize for t in graph.tensors.values() if t.kind == "param" and t.dtype.is_floating_point}
    return max(sizes, default=4)


def analytic_costs(
    graph: StageGraph,
    hardware: Hardware | str,
    *,
    dtype: str | None = None,
    optimizer_workers: int = 1,
    precision: str = "float32",
) -> CostTable:
    """Costs of ``graph``'s stages on ``hardware`` (see the module docstring).

    ``precision``: what the stages compute in (``fp32``, ``bf16``, ``fp16`` or the long names);
    an fp32 capture of a model trained in 16-bit has its non-matmul bytes halved. ``dtype``:
    the matmul rate's dtype when it is not the precision's (``"tf32"``)."""
    hw = get_profile(hardware)
    precision = normalize_precision(precision)
    dtype = matmul_dtype(precision, dtype)
    rate = hw.matmul_flops(dtype)
    works = stage_work(graph)
    scale = PRECISIONS[precision] / _capture_element_bytes(graph)
    upd, acc = float(host_update_bytes(precision)), float(host_accumulate_bytes(precision))
    costs = []
    for st, w in zip(graph.stages, works):
        other = w.other_bytes if scale == 1 else w.other_bytes + (scale - 1) * w.float_bytes
        fwd = w.flops / rate + 2.0 * other / hw.device_mem_bps
        n_train = sum(graph.tensors[k].numel for k in graph.tensors if graph.owner[k] == st.index and graph.tensors[k].trainable)
        # NOTE: a backward is the recompute, the input gradients and the parameter gradients
        # (each about a forward); frozen parameters get no gradient (autograd skips those
        # matmuls), so the frozen share of the stage's parameters takes its share of the
        # forward's FLOPs off (attention's FLOPs counted in, a slight overestimate of the saving)
        used = sum(graph.tensors[k].numel for k in st.params)
        frozen = used - sum(graph.tensors[k].numel for k in st.params if k in st.trainable)
        no_param_grads = (frozen / used if used else 0.0) * w.flops / rate
        costs.append(
            StageCost(
                forward_s=fwd,
                backward_s=3.0 * fwd - no_param_grads,
                backward_kept_s=2.0 * fwd - no_param_grads,
                update_s=upd * n_train / hw.host_mem_bps,
                device_update_s=28.0 * n_train / hw.device_mem_bps,
                accumulate_s=acc * n_train / hw.host_mem_bps,
                rollback_s=ROLLBACK_COPY_RATIO * host_update_bytes() * n_train / hw.host_mem_bps,
            )
        )
    what = dtype if precision == "float32" else precision + ("" if dtype == precision else f", {dtype} matmuls")
    return CostTable(
        costs,
        links_of(hw),
        optimizer_workers=optimizer_workers,
        source=f"analytic: {hw.name}, {what}",
        extra={"work": works, "precision": precision},
    )


def precision_specs(specs: Sequence[StageSpec], precision: str, *, captured_bytes: int = 4) -> list[StageSpec]:
    """The stage specs of a model captured with ``captured_bytes`` per floating-point element
    (an fp32 capture: 4) when it trains in ``precision``: what the device holds and the links
    carry (slots, prefetches, gradient copies, boundary activations and their gradients) is
    rescaled to the working dtype; what the host's optimizer holds (``update_bytes``,
    ``state_bytes``: the fp32 master, gradient and AdamW states) and the buffers (which keep
    their dtype) are not. The specs are returned unchanged when the dtypes agree.

    NOTE: a model with large floating-point buffers inside a group's image, or boundary values
    that are not floating point, is approximated (every byte of a prefetch and a boundary value
    produced by a stage is taken as floating point); the GPT has neither (the model's token ids
    are its only integer tensors and are not rescaled). A scalar output of the model (a loss)
    keeps its fp32: models compute the loss in fp32 (``logits.float()``), as the GPT does.

    >>> from shfx.passes.stages import chain
    >>> s = precision_specs(chain(2, prefetch_bytes=1024, activation_bytes=64), "bf16")
    >>> s[0].prefetch_bytes, s[0].grad_bytes, s[0].activation_bytes, s[0].update_bytes, s[0].state_bytes
    (512, 512, 32, 1024, 1024)
    """
    e = PRECISIONS[normalize_precision(precision)]
    if e == captured_bytes:
        return list(specs)

    def sc(n: int) -> int:
        return n * e // captured_bytes

    # mixed precision casts the gradient of every group no other stage borrows from on the
    # device (shfx.passes.layout.device_cast_groups): its copy carries the fp32 bytes
    borrowed = {g for st in specs for _, g, _ in st.borrowed_grads}

    def wire(st: StageSpec) -> tuple[tuple[int, int], ...]:
        if e >= 4:
            return ()
        pairs = st.grad_group_bytes or (((st.update_group, st.grad_bytes),) if st.update_group is not None else ())
        return tuple((g, n * 4 // captured_bytes) for g, n in pairs if g not in borrowed and g == st.update_group)

    def is_loss(v: Value) -> bool:
        return v.output and v.producer >= 0 and v.nbytes == captured_bytes

    def value(v: Value) -> Value:
        return v if v.producer < 0 or is_loss(v) else replace(v, nbytes=sc(v.nbytes))

    def activations(st: StageSpec) -> int:
        loss = sum(v.nbytes for v in st.outputs if is_loss(v))
        return sc(st.activation_bytes - loss) + loss

    return [
        replace(
            st,
            prefetch_bytes=sc(st.prefetch_bytes),
            image_bytes=sc(st.image_bytes),
            grad_bytes=sc(st.grad_bytes),
            slot_bytes=sc(st.slot_bytes),
            activation_bytes=activations(st),
            grad_group_bytes=tuple((g, sc(n)) for g, n in st.grad_group_bytes),
            grad_wire_bytes=wire(st),
            borrowed_grads=tuple((k, g, sc(n)) for k, g, n in st.borrowed_grads),
            inputs=tuple(value(v) for v in st.inputs),
            outputs=tuple(value(v) for v in st.outputs),
            state_bytes=st.state_bytes,
            # (a group updated on the device keeps its fp32 master there in mixed precision)
            device_master_bytes=st.update_bytes if st.update_group is not None and e < 4 else 0,
        )
        for st in specs
    ]


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
                grad_wire_bytes=tuple((block_group(g), b) for g, b in tpl.grad_wire_bytes if block_group(g) >= 0),
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
                grad_wire_bytes=tuple((tail_group(g), b) for g, b in st.grad_wire_bytes),
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
    dtype: str | None = None,
    template_layers: int = 2,
    precision: str = "float32",
) -> tuple[list[StageSpec], CostTable]:
    """Stage specs and analytic costs of ``build(layers)`` without building it.

    ``build(n)`` makes the model with ``n`` blocks (it is called on the meta device with
    ``template_layers``); ``inputs()`` returns its example arguments (meta tensors are fine);
    ``blocks`` names the block container. The captured template's block stage is repeated to
    ``layers`` blocks by :func:`repeat_blocks`. ``precision``: the model trains in it (its fp32
    capture's specs rescaled by :func:`precision_specs`, costs at its rates); ``dtype``: the
    matmul rate's dtype when not the precision's.
    """
    from shfx.passes.capture import capture_model
    from shfx.passes.partition import partition_stages

    with torch.device("meta"):
        model = build(template_layers)
        args = inputs()
    graph = partition_stages(capture_model(model, args), model=model, blocks=blocks)
    nblocks = sum(1 for s in graph.stages if s.name.startswith(blocks + "."))
    first = next(s.index for s in graph.stages if s.name.startswith(blocks + "."))
    table = analytic_costs(graph, hardware, dtype=dtype, precision=precision)
    template = precision_specs(graph.specs, precision, captured_bytes=_capture_element_bytes(graph))
    specs, costs = repeat_blocks(template, table.costs, range(first, first + nblocks), layers)
    return specs, replace(table, costs=costs, source=table.source + f", {layers} blocks")
