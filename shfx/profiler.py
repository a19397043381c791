"""The profiler: measure a compiled model's costs on its actual backend.

``profile_costs(cm_engine, variant, inputs)`` returns a :class:`shfx.cost_model.costs.CostTable`:

- per stage, FORWARD and BACKWARD (with recompute; without for a stage whose forward keeps its
  graph) from one timing step of a window-1 program with every action serialized, so each is
  timed alone (wall clock on the emulated device; on CUDA the host waits for each action, so
  the time includes its launch and one synchronization);
- the links: host->device and device->host bandwidth copying a slot-sized buffer, one
  direction at a time and both at once (the duplex factor);
- per group, the host optimizer update, run on scratch copies of the group's buffers, the
  host-side add of a staged gradient, and the same update on the device (``device_update_s``,
  for policies that keep the optimizer there).

The timing step changes nothing a user can see: no optimizer update runs, buffers the forward
mutates (BatchNorm statistics), gradients and the RNG states are restored afterwards.
Results are cached per (input signature, device) in the process.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import torch

from shfx.cost_model.costs import CostTable, Links, StageCost
from shfx.passes.meta import get_meta
from shfx.passes.program import ActionKind
from shfx.passes.pipeline import Variant, with_policy
from shfx.passes.policies import Stronghold

from .runtime.engine import Engine
from .runtime.host_store import GRAD_NONE, GRAD_VALID

__all__ = ["profile_costs", "measure_links", "clear_cache"]

_CACHE: dict[tuple, CostTable] = {}


def clear_cache() -> None:
    _CACHE.clear()


def _timed(fn, repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after one warm-up."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure_links(engine: Engine, nbytes: int, repeats: int = 3) -> Links:
    """The backend's copies as ``latency + bytes / bandwidth`` per direction (fitted from two
    sizes around ``nbytes``), and the duplex factor (both directions at once)."""
    b = engine.backend
    small = max(1 << 16, int(nbytes))
    large = 4 * small
    dev = b.alloc_device(2 * large, "profiling buffer")
    host = b.alloc_host(2 * large, engine.store.pin)
    before = (b.bytes_h2d, b.bytes_d2h, b.copies_h2d, b.copies_d2h)
    try:

        def one(stream, copy, dst, src) -> float:
            return _timed(lambda: stream.submit(lambda: copy(dst, src)).wait(), repeats)

        fit = {}
        for name, stream, copy, a, c in (
            ("h2d", b.h2d, b.h2d_copy, dev, host),
            ("d2h", b.d2h, b.d2h_copy, host, dev),
        ):
            t_small = one(stream, copy, a[:small], c[:small])
            t_large = one(stream, copy, a[:large], c[:large])
            if t_large - t_small <= 1e-6:  # no measurable bandwidth: latency only
                fit[name] = (None, t_small)
            else:
                bps = (large - small) / (t_large - t_small)
                fit[name] = (bps, max(0.0, t_small - small / bps))

        def both() -> None:
            t1 = b.h2d.submit(lambda: b.h2d_copy(dev[:large], host[:large]))
            t2 = b.d2h.submit(lambda: b.d2h_copy(host[large:], dev[large:]))
            t1.wait()
            t2.wait()

        t_both = _timed(both, repeats)
    finally:
        b.bytes_h2d, b.bytes_d2h, b.copies_h2d, b.copies_d2h = before  # not the model's traffic
        b.free_device(dev)
    latency = (fit["h2d"][1] + fit["d2h"][1]) / 2
    if fit["h2d"][0] is None or fit["d2h"][0] is None:
        duplex = 1.0
    else:
        alone = max(large / fit["h2d"][0], large / fit["d2h"][0])
        duplex = min(1.0, max(0.05, alone / max(t_both - latency, 1e-9)))
    return Links(fit["h2d"][0], fit["d2h"][0], duplex=round(duplex, 3), latency_s=latency)


def _update_s(engine: Engine, g: int, repeats: int) -> tuple[float, float]:
    """Host optimizer update and gradient add for group ``g``, on scratch buffers."""
    grp = engine.store.groups[g]
    n = grp.trainable_numel
    if n == 0:
        return 0.0, 0.0
    t_update = engine.optimizer.time_update(g, engine.optimizer.config.hyperparams(), repeats) if engine.optimizer else 0.0
    a, c = torch.zeros(n, dtype=grp.dtypes.grad), torch.zeros(n, dtype=grp.dtypes.device_grad)
    return t_update, _timed(lambda: a.add_(c), repeats)


def _device_update_s(engine: Engine, g: int, repeats: int) -> float:
    """AdamW of group ``g`` on the device (``DEVICE_STEP``), on scratch device tensors. A group
    too large for four scratch copies in the free device memory is timed on a slice and scaled
    by its size (the update is elementwise, linear in the number of parameters)."""
    from .errors import OutOfDeviceMemory

    grp = engine.store.groups[g]
    n, dt = grp.trainable_numel, grp.dtypes
    if n == 0:
        return 0.0
    b = engine.backend
    part = n
    while True:
        bufs: list[torch.Tensor] = []
        try:
            for d in (dt.working, dt.device_grad, dt.state, dt.state):
                bufs.append(b.alloc_device(d.itemsize * part, "profiling the device optimizer").view(d))
            for t in bufs:
                t.zero_()
            p, gr, m, v = ([t] for t in bufs)
            step = [torch.zeros((), dtype=torch.float32, device=b.device)]

            def adam(p=p, gr=gr, m=m, v=v, step=step) -> None:
                torch._fused_adamw_(p, gr, m, v, [], step, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)

            def run() -> None:
                b.compute.submit(adam).wait()
                b.synchronize()

            return _timed(run, repeats) * (n / part)
        except OutOfDeviceMemory:
            if part <= 1 << 14:
                raise
            part //= 8
        finally:
            for t in bufs:
                b.free_device(t.view(torch.uint8))


class _Snapshot:
    """What a timing step may change and must give back: RNG states, gradient buffers and
    their state, and buffers the forward mutates."""

    def __init__(self, engine: Engine, variant: Variant):
        self.engine = engine
        st = engine.store
        self.cpu_rng = torch.get_rng_state()
        self.dev_rng = engine.backend.get_rng_state()
        self.grad_state = list(st.grad_state)
        self.grads = {g: st.grad(g).clone() for g, s in enumerate(st.grad_state) if s == GRAD_VALID}
        self.buffers = []
        for stage in variant.graph.stages:
            for c in stage.slot.buffers_out:
                region = st.group_bytes(c.group)[c.host_offset : c.host_offset + c.nbytes]
                self.buffers.append((region, region.clone()))

    def __enter__(self) -> _Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def restore(self) -> None:
        st = self.engine.store
        torch.set_rng_state(self.cpu_rng)
        self.engine.backend.set_rng_state(self.dev_rng)
        for region, saved in self.buffers:
            region.copy_(saved)
        for g, saved in self.grads.items():
            st.grad(g).copy_(saved)
        st.grad_state[:] = self.grad_state
        for g, keys in self.engine.param_keys_by_group.items():
            if st.grad_state[g] == GRAD_NONE:
                for _, p in keys:
                    p.grad = None


def profile_costs(engine: Engine, variant: Variant, inputs: list[torch.Tensor], *, repeats: int = 3, cache: bool = True) -> CostTable:
    """Measure stage, link and optimizer costs of ``variant`` on ``engine``'s backend."""
    key = (variant.signature, engine.backend.describe(), len(variant.graph.stages))
    if cache and key in _CACHE:
        return _CACHE[key]
    specs = variant.graph.specs
    probe = with_policy(variant, Stronghold(window=1))
    program = probe.train
    if engine.pending_updates:
        raise RuntimeError("cannot profile while an optimizer update is pending; call cm.step() first")
    snap = _Snapshot(engine, variant)
    emulated = engine.backend.name == "emulated"
    warm: dict[str, list[float]] = {}
    pipelined: dict[str, list[float]] = {}
    gaps: list[float] = []
    with engine.profiling(), snap:
        engine.ensure_pool(probe.slot_sizes)
        # NOTE: compute is timed with copies unthrottled, so no compute action follows an idle
        # stretch. (When compute ran on a worker thread, an action after ~4 ms of idle ran ~1.5x
        # slower and was profiled that way; compute now runs on the calling thread and the
        # slowdown is gone (benchmarks/sim_accuracy.py), so no cold costs are taken. The
        # simulator still accepts them: StageCost.*_cold_s and CostTable.cold_idle_s.)
        with engine.backend.unthrottled():
            for _ in range(repeats + 1):
                outs, ctx = engine.forward(probe, inputs, grad=True, serial=True)
                grads = [
                    torch.ones_like(o) if variant.graph.values[v].differentiable else None
                    for o, v in zip(outs, variant.graph.outputs)
                ]
                engine.backward(ctx, grads, profile=True)
                for e in engine.trace:
                    warm.setdefault(f"{e.action}@{e.phase}", []).append(e.end - e.start)
                fwd_end = max(e.end for e in engine.trace if e.phase == "forward")
                bwd_start = min(e.start for e in engine.trace if e.phase == "backward")
                gaps.append(bwd_start - fwd_end)
        # NOTE: compute timed alone runs 3-12% faster than inside a pipelined step, where copy,
        # host and optimizer threads share the processor (benchmarks/sim_accuracy.py); so the
        # compute costs come from pipelined steps of the window-2 program (no update), the
        # serialized step above giving the phase gap. Measured with the device's real links.
        if emulated and len(specs) > 1:
            pipe_v = with_policy(variant, Stronghold(window=2))
            engine.ensure_pool(pipe_v.slot_sizes)
            for _ in range(2 * repeats + 1):  # more steps: the median rides out short bursts of other load
                outs, ctx = engine.forward(pipe_v, inputs, grad=True)
                grads = [
                    torch.ones_like(o) if variant.graph.values[v].differentiable else None
                    for o, v in zip(outs, variant.graph.outputs)
                ]
                engine.backward(ctx, grads, profile=True, serial=False)
                for e in engine.trace:
                    if e.stream == "compute":
                        pipelined.setdefault(f"{e.action}@{e.phase}", []).append(e.end - e.start)
    keep = {get_meta(n).stage for n in program.nodes if get_meta(n).kind == ActionKind.FORWARD and get_meta(n).keep_graph}

    def med(d: dict[str, list[float]], name: str) -> float | None:
        xs = d.get(name, [])
        return statistics.median(xs[1:] if len(xs) > 1 else xs) if xs else None  # drop the warm-up

    links = measure_links(engine, variant.graph.slot_bytes)
    costs = []
    compute = pipelined or warm
    for st in specs:
        f = med(compute, f"F{st.index}@forward") or 0.0
        b = med(compute, f"B{st.index}@backward") or 0.0
        upd, add = _update_s(engine, st.update_group, 3) if st.update_group is not None else (0.0, 0.0)
        dev_upd = _device_update_s(engine, st.update_group, 3) if st.update_group is not None and engine.optimizer else 0.0
        kept = {"backward_s": b + f, "backward_kept_s": b} if st.index in keep else {"backward_s": b}
        costs.append(StageCost(forward_s=f, update_s=upd, accumulate_s=add, device_update_s=dev_upd, **kept))
    table = CostTable(
        costs,
        links,
        optimizer_workers=_workers(engine),
        source=f"profiled on {engine.backend.describe()}",
        extra={"durations": warm, "pipelined": pipelined},
        dispatch_s=_dispatch_s(engine) if emulated else 0.0,
        phase_gap_s=statistics.median(gaps) if gaps else 0.0,
    )
    if cache:
        _CACHE[key] = table
    return table


def _dispatch_s(engine: Engine, hops: int = 40) -> float:
    """Median hand-off of one action between two streams (issue, wake-up, completion)."""
    b = engine.backend
    noop = lambda: None  # noqa: E731
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        tok = None
        for i in range(hops):
            stream = b.compute if i % 2 else b.h2d
            tok = stream.submit(noop, [tok] if tok is not None else [])
        tok.wait()
        times.append((time.perf_counter() - t0) / hops)
    return statistics.median(times)


def _workers(engine: Engine) -> int:
    cpu: Any = engine.backend.cpu
    return len(getattr(cpu, "_threads", [None]))
