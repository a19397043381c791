"""The profiler: measure a compiled model's costs on its actual backend.

``profile_costs(cm_engine, variant, inputs)`` returns a :class:`shfx.cost_model.costs.CostTable`:

- per stage, FORWARD and BACKWARD (with recompute; without for a stage whose forward keeps its
  graph) from a timing step of a window-1 program with every action serialized, so each is
  timed alone (wall clock on the emulated device; on CUDA the host waits for each action, so
  the time includes its launch and one synchronization); on the emulated device from a
  pipelined step of the window-2 program where the device holds it (see the note in
  :func:`profile_costs`);
- the links: host->device and device->host bandwidth copying a slot-sized buffer (smaller where
  the free device memory is less), one direction at a time and both at once (the duplex factor);
- per group, the host optimizer update, run on scratch copies of the group's buffers, the
  host-side add of a staged gradient, and the same update on the device (``device_update_s``,
  for policies that keep the optimizer there).

**Rounds.** Every action is timed once per *round*, and the rounds repeat (one warm-up round,
then at least ``rounds``), so a burst of other load on the machine hits a few rounds of every
action rather than every sample of a few actions. Per action the profile keeps
:func:`low_median` of its rounds: the median of the fastest half. Other load only ever slows an
action down, so the estimate stays among the quiet rounds' values while at least about a
quarter of the rounds are quiet. When the fastest half of the rounds disagrees by more than
``tolerance`` (the profile is noisy), more rounds run, up to ``max_rounds`` or until the extra
rounds took ``budget`` times as long as the first ones. The table's ``extra["profile"]`` (a
:class:`~shfx.cost_model.costs.ProfileStats`) says how many rounds ran, how long they took, how
far apart the rounds were and whether the fast half agreed; ``extra["rounds"]`` holds every
sample and ``extra["estimates"]`` the statistic per action.

The timing steps change nothing a user can see: no optimizer update runs, buffers the forward
mutates (BatchNorm statistics) and gradients are restored afterwards, and everything runs
under :func:`forked_rng` (the profile's dropout and scratch buffers draw from forked random
streams, so a model trains with the same dropout masks as without profiling).
Results are cached per (input signature, device, model graph) in the process;
``refresh=True`` re-profiles and replaces the cached table (``cm.retune()`` does), and
``cache=False`` neither reads nor writes the cache.
"""

from __future__ import annotations

import gc
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from shfx.cost_model.costs import CostTable, Links, ProfileStats, StageCost
from shfx.passes.meta import get_meta
from shfx.passes.pipeline import Variant, probe_variant
from shfx.passes.program import ActionKind

from .runtime.engine import Engine
from .runtime.host_store import GRAD_NONE, GRAD_VALID

__all__ = ["profile_costs", "measure_links", "clear_cache", "low_median", "spread", "run_rounds", "forked_rng"]

_CACHE: dict[tuple, CostTable] = {}

# NOTE: defaults measured on a 2-core VM: the fast half of a quiet profile's rounds agrees within
# a few % of a round, so five rounds end a quiet profile (1.04-1.23x the time of the single pass
# it replaced); a burst of other load makes the fast half disagree and buys more rounds, at most
# doubling the profile's time.
ROUNDS = 5
MAX_ROUNDS = 15
TOLERANCE = 0.10
BUDGET = 1.0
# a family of actions below this share of a round is left out of the reported spread
# (microsecond actions jitter by 100% and more, and cannot move a prediction)
_MIN_SHARE = 0.05


def clear_cache() -> None:
    _CACHE.clear()


@contextmanager
def forked_rng(backend: Any = None) -> Iterator[None]:
    """Run with the user's random streams forked: the CPU generator, every initialized CUDA
    device's generator and ``backend``'s (its device's, which may initialize CUDA) are saved
    on entry and restored on exit, so whatever runs inside (the profiler's timing steps with
    their dropout, scratch buffers filled with ``torch.randn``) leaves them where they were.
    Python's ``random`` and numpy's global state are not touched by torch code and are left
    alone. Used once per tuning or profile (every entry point: :func:`profile_costs`,
    ``CompiledModel._tune``), never per step: saving costs a few kB of copies.

    >>> import torch
    >>> _ = torch.manual_seed(0); before = torch.get_rng_state()
    >>> with forked_rng():
    ...     _ = torch.randn(3)
    >>> torch.equal(torch.get_rng_state(), before)
    True
    """
    cpu = torch.get_rng_state()
    dev = backend.get_rng_state() if backend is not None else None
    # NOTE: only initialized CUDA: reading a generator would initialize CUDA on every device,
    # and one never initialized has drawn nothing (its seed is applied lazily at initialization)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    gens = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())] if cuda else []
    try:
        yield
    finally:
        if dev is not None:
            backend.set_rng_state(dev)
        for i, state in enumerate(gens):
            torch.cuda.set_rng_state(state, i)
        torch.set_rng_state(cpu)


def low_median(xs: Sequence[float]) -> float:
    """The median of the fastest half of ``xs`` (the lowest ``ceil(n / 2)`` values), about
    their lower quartile: samples slowed by other load (which only ever slows a timing down)
    do not move it while at least about a quarter of them are quiet.

    >>> low_median([1.0, 5.0, 1.1, 4.0, 0.9])
    1.0
    """
    if not xs:
        raise ValueError("low_median of no samples")
    s = sorted(xs)
    return statistics.median(s[: (len(s) + 1) // 2])


def spread(xs: Sequence[float]) -> float:
    """How far apart samples are: the median of the slower half over the median of the faster
    half, minus 1 (about upper over lower quartile); 0.0 for fewer than two samples.

    >>> round(spread([1.0, 1.0, 1.2, 1.2]), 3)
    0.2
    """
    if len(xs) < 2:
        return 0.0
    s = sorted(xs)
    lo = statistics.median(s[: (len(s) + 1) // 2])
    hi = statistics.median(s[len(s) // 2 :])
    return hi / lo - 1 if lo > 0 else 0.0


def run_rounds(
    sample: Callable[[], dict[str, float]],
    family: Callable[[str], str | None],
    *,
    rounds: int = ROUNDS,
    max_rounds: int = MAX_ROUNDS,
    tolerance: float = TOLERANCE,
    budget: float = BUDGET,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[dict[str, float], dict[str, list[float]], ProfileStats]:
    """Run ``sample`` (one round: seconds per action) once to warm up, then at least
    ``rounds`` times, and more while the profile is noisy; return per action the
    :func:`low_median` of its rounds, every round's samples, and how steady it was.

    ``family`` puts an action in a family (``"compute"``, ``"links"``, ``"host"``; None: none).
    The profile is *steady* when, for every family, the fastest half of the rounds agrees: its
    median is within ``tolerance`` of a round's time (all families) above the fastest round
    (``low_median(f) - min(f) <= tolerance * low_median(round totals)``); then the estimates
    come from quiet rounds, and what noise is left moves a step's cost by less than
    ``tolerance``. While it is not, more rounds run, up to ``max_rounds`` and as long as the
    extra rounds take at most ``budget`` times what the warm-up and the first ``rounds`` took.
    The garbage collector is off during the rounds (as ``timeit`` does): a full collection of
    a compiled model's graphs takes long enough to disturb a round.

    >>> import itertools
    >>> load = itertools.cycle([1.0, 1.0, 9.0])  # every third round hit by a burst
    >>> est, samples, stats = run_rounds(lambda: {"F0": 0.01 * next(load)}, lambda k: "compute")
    >>> round(est["F0"], 6), stats.rounds, stats.steady
    (0.01, 5, True)
    """
    if rounds < 1 or max_rounds < rounds:
        raise ValueError(f"need 1 <= rounds <= max_rounds, got rounds={rounds}, max_rounds={max_rounds}")
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        return _rounds(sample, family, rounds, max_rounds, tolerance, budget, clock)
    finally:
        if gc_was_on:
            gc.enable()


def _rounds(
    sample: Callable[[], dict[str, float]],
    family: Callable[[str], str | None],
    rounds: int,
    max_rounds: int,
    tolerance: float,
    budget: float,
    clock: Callable[[], float],
) -> tuple[dict[str, float], dict[str, list[float]], ProfileStats]:
    t0 = clock()
    sample()  # warm-up: first touches, lazy allocations, kernel loads
    samples: dict[str, list[float]] = {}
    totals: list[dict[str, float]] = []
    base_s: float | None = None
    steady = False
    while True:
        one = sample()
        tot: dict[str, float] = {}
        for k, v in one.items():
            samples.setdefault(k, []).append(v)
            f = family(k)
            if f is not None:
                tot[f] = tot.get(f, 0.0) + v
        totals.append(tot)
        n = len(totals)
        if n < rounds:
            continue
        if base_s is None:
            base_s = clock() - t0
        steady = _steady(totals, tolerance)
        elapsed = clock() - t0
        per_round = elapsed / (n + 1)
        if steady or n >= max_rounds or elapsed + per_round > (1 + budget) * base_s:
            break
    stats = ProfileStats(
        rounds=len(totals),
        seconds=clock() - t0,
        spread={f: spread([t.get(f, 0.0) for t in totals]) for f in _families(totals)},
        steady=steady,
        tolerance=tolerance,
    )
    return {k: low_median(v) for k, v in samples.items()}, samples, stats


def _families(totals: list[dict[str, float]]) -> list[str]:
    """The families that make up at least ``_MIN_SHARE`` of a (fast) round."""
    lows = {f: low_median([t.get(f, 0.0) for t in totals]) for f in sorted({f for t in totals for f in t})}
    whole = sum(lows.values())
    return [f for f, v in lows.items() if whole <= 0 or v >= _MIN_SHARE * whole]


def _steady(totals: list[dict[str, float]], tolerance: float) -> bool:
    fams = sorted({f for t in totals for f in t})
    whole = low_median([sum(t.values()) for t in totals])
    for f in fams:
        xs = [t.get(f, 0.0) for t in totals]
        if low_median(xs) - min(xs) > tolerance * whole:
            return False
    return True


# ---- the links -------------------------------------------------------------------------------------
class _LinkProbe:
    """Copies of a slot-sized buffer and of four times that, each direction alone and both at
    once; :meth:`sample` times each once, :meth:`fit` turns samples into :class:`Links`.

    The device buffer (``2 * large`` bytes) is allocated by each :meth:`sample` and freed after
    it, so it never sits beside a timing step's activations; the first sample sizes it to the
    device memory free then (the sizes stay for the later samples: :meth:`fit` needs one pair).
    """

    KEYS = ("link h2d small", "link h2d large", "link d2h small", "link d2h large", "link both")
    #: the smallest ``small`` copy shrunk to fit the free device memory
    MIN_SMALL_BYTES = 1 << 10

    def __init__(self, engine: Engine, nbytes: int):
        self.engine = engine
        self.small = max(1 << 16, int(nbytes))
        self.large = 4 * self.small
        self.host: torch.Tensor | None = None

    @contextmanager
    def buffers(self) -> Iterator[_LinkProbe]:
        """Samples taken inside leave the backend's copy counters as they were (not the
        model's traffic); the host buffer lives until the block ends."""
        b = self.engine.backend
        before = (b.bytes_h2d, b.bytes_d2h, b.copies_h2d, b.copies_d2h)
        try:
            yield self
        finally:
            b.bytes_h2d, b.bytes_d2h, b.copies_h2d, b.copies_d2h = before
            self.host = None

    def _fit_free_memory(self) -> None:
        """Shrink the two sizes (keeping ``large = 4 * small``) so that the buffer fits the
        device memory free now.

        NOTE: a slot-sized probe can be several times what the training itself holds beyond its
        slots (a window-1 program holds one slot); on a device the training just fits, such a
        probe refused the tuner's profile (the NVMe tier's ``host_window="auto"``, issue 25).
        Smaller copies fit the same ``latency + bytes / bandwidth`` line, with less weight on the
        bandwidth: on so full a device the window is bound by memory, not by the link."""
        b = self.engine.backend
        if b.capacity_bytes is None:
            return
        free = b.capacity_bytes - b.used_bytes
        if 2 * self.large > free:
            self.small = max(self.MIN_SMALL_BYTES, free // 8)
            self.large = 4 * self.small

    def sample(self) -> dict[str, float]:
        b = self.engine.backend
        if self.host is None:
            self._fit_free_memory()
            self.host = b.alloc_host(2 * self.large, self.engine.store.pin, "link probe")  # (pinned beside the plan: shfx.runtime.pinned)
        dev = b.alloc_device(2 * self.large, "profiling buffer (the tuner's link probe)")
        try:
            return self._timed(dev, self.host)
        finally:
            b.free_device(dev)

    def _timed(self, dev: torch.Tensor, host: torch.Tensor) -> dict[str, float]:
        b, small, large = self.engine.backend, self.small, self.large

        def timed(fn: Callable[[], None]) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        def both() -> None:
            t1 = b.h2d.submit(lambda: b.h2d_copy(dev[:large], host[:large]))
            t2 = b.d2h.submit(lambda: b.d2h_copy(host[large:], dev[large:]))
            t1.wait()
            t2.wait()

        return {
            "link h2d small": timed(lambda: b.h2d.submit(lambda: b.h2d_copy(dev[:small], host[:small])).wait()),
            "link h2d large": timed(lambda: b.h2d.submit(lambda: b.h2d_copy(dev[:large], host[:large])).wait()),
            "link d2h small": timed(lambda: b.d2h.submit(lambda: b.d2h_copy(host[:small], dev[:small])).wait()),
            "link d2h large": timed(lambda: b.d2h.submit(lambda: b.d2h_copy(host[:large], dev[:large])).wait()),
            "link both": timed(both),
        }

    def fit(self, est: dict[str, float]) -> Links:
        """``latency + bytes / bandwidth`` per direction from the two sizes, and the duplex
        factor from both directions at once."""
        small, large = self.small, self.large
        fit: dict[str, tuple[float | None, float]] = {}
        for d in ("h2d", "d2h"):
            t_small, t_large = est[f"link {d} small"], est[f"link {d} large"]
            if t_large - t_small <= 1e-6:  # no measurable bandwidth: latency only
                fit[d] = (None, t_small)
            else:
                bps = (large - small) / (t_large - t_small)
                fit[d] = (bps, max(0.0, t_small - small / bps))
        latency = (fit["h2d"][1] + fit["d2h"][1]) / 2
        h2d, d2h = fit["h2d"][0], fit["d2h"][0]
        if h2d is None or d2h is None:
            duplex = 1.0
        else:
            alone = max(large / h2d, large / d2h)
            duplex = min(1.0, max(0.05, alone / max(est["link both"] - latency, 1e-9)))
        return Links(h2d, d2h, duplex=round(duplex, 3), latency_s=latency)


def measure_links(engine: Engine, nbytes: int, repeats: int = ROUNDS) -> Links:
    """The backend's copies as ``latency + bytes / bandwidth`` per direction (fitted from two
    sizes around ``nbytes``), and the duplex factor (both directions at once): one warm-up
    round, then ``repeats`` rounds, each size and direction's :func:`low_median`."""
    probe = _LinkProbe(engine, nbytes)
    with probe.buffers():
        est, _, _ = run_rounds(probe.sample, lambda k: "links", rounds=repeats, max_rounds=repeats)
    return probe.fit(est)


# ---- optimizer updates ---------------------------------------------------------------------------
class _HostProbe:
    """The host optimizer update and the gradient add of every group, on scratch buffers
    shared by the groups of the same dtypes (sized for the largest: as much memory as timing
    the largest group alone, allocated once for all rounds)."""

    def __init__(self, engine: Engine, groups: Sequence[int]):
        self.engine = engine
        st = engine.store
        self.groups = [g for g in groups if st.groups[g].trainable_numel]
        self.opt = engine.optimizer
        self.hp = self.opt.config.hyperparams() if self.opt is not None else {}
        largest: dict[tuple, int] = {}
        for g in self.groups:
            grp = st.groups[g]
            key = self._key(g)
            if key not in largest or grp.trainable_numel > st.groups[largest[key]].trainable_numel:
                largest[key] = g
        self.scratch: dict[tuple, list[torch.Tensor]] = {}
        self.addend: dict[tuple, torch.Tensor] = {}
        for key, g in largest.items():
            grp = st.groups[g]
            if self.opt is not None:
                self.scratch[key] = self.opt.scratch(g)
            else:
                self.scratch[key] = [torch.empty(0), torch.zeros(grp.trainable_numel, dtype=grp.dtypes.grad)]
            self.addend[key] = torch.zeros(grp.trainable_numel, dtype=grp.dtypes.device_grad)

    def _key(self, g: int) -> tuple:
        dt = self.engine.store.groups[g].dtypes
        return (dt.master, dt.grad, dt.state, dt.device_grad, dt.working)

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for g in self.groups:
            n = self.engine.store.groups[g].trainable_numel
            key = self._key(g)
            scratch = self.scratch[key]
            if self.opt is not None:
                out[f"update {g}"] = self.opt.time_update_on(g, self.hp, scratch)
            a, c = scratch[1][:n], self.addend[key][:n]
            t0 = time.perf_counter()
            a.add_(c)
            out[f"add {g}"] = time.perf_counter() - t0
        return out


_MIN_DEVICE_UPDATE_NUMEL = 256  # the smallest slice :func:`_device_update_sample` times


def _device_update_sample(engine: Engine, g: int) -> float:
    """One AdamW of group ``g`` on the device (``DEVICE_STEP``), on scratch device tensors
    allocated for it. A group too large for four scratch copies in the free device memory is
    timed on a slice and scaled by its size (the update is elementwise, linear in the number
    of parameters); the first slice tried is what the free device memory holds.

    NOTE: this sample is for the tuner's device-update choices, which a full device cannot take
    anyway; it must not refuse the profile of a training that updates on the host (issue 25),
    so the slice goes down to ``_MIN_DEVICE_UPDATE_NUMEL`` elements."""
    from .errors import OutOfDeviceMemory

    grp = engine.store.groups[g]
    n, dt = grp.trainable_numel, grp.dtypes
    if n == 0:
        return 0.0
    b = engine.backend
    part = n
    if b.capacity_bytes is not None:
        per_elem = dt.working.itemsize + dt.device_grad.itemsize + 2 * dt.state.itemsize
        part = max(1, min(n, (b.capacity_bytes - b.used_bytes) // per_elem))
    while True:
        bufs: list[torch.Tensor] = []
        try:
            for d in (dt.working, dt.device_grad, dt.state, dt.state):
                bufs.append(b.alloc_device(d.itemsize * part, "profiling the device optimizer").view(d))
            for t in bufs:
                t.zero_()
            p, gr, m, v = ([t] for t in bufs)
            step = [torch.zeros((), dtype=torch.float32, device=b.device)]
            b.synchronize()
            t0 = time.perf_counter()
            b.compute.submit(
                lambda: torch._fused_adamw_(
                    p, gr, m, v, [], step, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8,
                    amsgrad=False, maximize=False,
                )  # fmt: skip
            ).wait()
            b.synchronize()
            return (time.perf_counter() - t0) * (n / part)
        except OutOfDeviceMemory:
            if part <= _MIN_DEVICE_UPDATE_NUMEL:
                raise
            part = max(_MIN_DEVICE_UPDATE_NUMEL, part // 8)
        finally:
            for t in bufs:
                b.free_device(t.view(torch.uint8))


def _dispatch_sample(engine: Engine, hops: int = 40) -> float:
    """The hand-off of one action between two streams (issue, wake-up, completion), averaged
    over ``hops`` hand-offs."""
    b = engine.backend
    noop = lambda: None  # noqa: E731
    t0 = time.perf_counter()
    tok = None
    for i in range(hops):
        stream = b.compute if i % 2 else b.h2d
        tok = stream.submit(noop, [tok] if tok is not None else [])
    tok.wait()
    return (time.perf_counter() - t0) / hops


class _Snapshot:
    """What a timing step may change and must give back: gradient buffers and their state,
    buffers the forward mutates, and the engine's current variant (the RNG states:
    :func:`forked_rng`, around the whole profile)."""

    def __init__(self, engine: Engine, variant: Variant):
        self.engine = engine
        st = engine.store
        self.grad_state = list(st.grad_state)
        # (a paged group's gradient lives in its window buffer during its step only: none to keep)
        self.grads = {g: st.grad(g).clone() for g, s in enumerate(st.grad_state) if s == GRAD_VALID and g not in st.paged}
        self.current = engine.current
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
        for region, saved in self.buffers:
            region.copy_(saved)
        for g, saved in self.grads.items():
            st.grad(g).copy_(saved)
        st.grad_state[:] = self.grad_state
        for g, keys in self.engine.param_keys_by_group.items():
            if st.grad_state[g] == GRAD_NONE:
                for _, p in keys:
                    p.grad = None
        self.engine.current = self.current  # a pipelined timing step made its program current


def _timing_step(
    engine: Engine, variant: Variant, program_variant: Variant, inputs: list[torch.Tensor], serial: bool
) -> dict[str, list[float]]:
    """One forward and backward of ``program_variant`` without an update; seconds per traced
    action (``"F3@forward"``), compute actions only unless ``serial``, and, for a serialized
    step, the gap between the forward and the backward phase (``"gap"``)."""
    outs, ctx = engine.forward(program_variant, inputs, grad=True, serial=serial)
    grads = [
        torch.ones_like(o) if variant.graph.values[v].differentiable else None
        for o, v in zip(outs, variant.graph.outputs)
    ]
    engine.backward(ctx, grads, profile=True, serial=serial)
    out: dict[str, list[float]] = {}
    for e in engine.trace:
        if serial or e.stream == "compute":
            out.setdefault(f"{e.action}@{e.phase}", []).append(e.end - e.start)
    if serial:
        fwd_end = max(e.end for e in engine.trace if e.phase == "forward")
        bwd_start = min(e.start for e in engine.trace if e.phase == "backward")
        out["gap"] = [bwd_start - fwd_end]
    return out


def _cache_key(engine: Engine, variant: Variant) -> tuple:
    # NOTE: the graph's code is part of the key: two models with the same input signature and
    # stage count (a GPT with and without dropout) have different costs. So is an emulated
    # device's spec itself: its description rounds link rates to 0.01 GB/s (1 and 2 MB/s alike).
    spec = getattr(engine.backend, "spec", None)
    return (variant.signature, engine.backend.describe(), repr(spec), len(variant.graph.stages), hash(variant.captured.gm.code))


def profile_costs(
    engine: Engine,
    variant: Variant,
    inputs: list[torch.Tensor],
    *,
    rounds: int = ROUNDS,
    max_rounds: int = MAX_ROUNDS,
    tolerance: float = TOLERANCE,
    budget: float = BUDGET,
    cache: bool = True,
    refresh: bool = False,
) -> CostTable:
    """Measure stage, link and optimizer costs of ``variant`` on ``engine``'s backend.

    Args:
        rounds, max_rounds, tolerance, budget: the rounds (module docstring, :func:`run_rounds`).
        cache: read and write the process-wide cache (per input signature, device and graph).
        refresh: re-profile even when cached, and replace the cached table.

    Example (``cm`` compiled and called once)::

        costs = profile_costs(cm.engine, cm.variant, [x, y], refresh=True)
        print(costs.extra["profile"].summary())   # 5 rounds in 0.41 s; ... (steady)
    """
    key = _cache_key(engine, variant)
    if cache and not refresh and key in _CACHE:
        return _CACHE[key]
    if engine.pending_updates:
        raise RuntimeError("cannot profile while an optimizer update is pending; call cm.step() first")
    with forked_rng(engine.backend):  # the timing steps' dropout, the host probe's scratch (torch.randn)
        table = _profile(engine, variant, inputs, rounds, max_rounds, tolerance, budget)
    if cache or refresh:
        _CACHE[key] = table
    return table


def _profile(
    engine: Engine, variant: Variant, inputs: list[torch.Tensor], rounds: int, max_rounds: int, tolerance: float, budget: float
) -> CostTable:
    """:func:`profile_costs`' measurement (run under :func:`forked_rng`)."""
    specs = variant.graph.specs
    # NOTE: one-rank probes, also under data parallel: a timing step reduces nothing (its local
    # gradients are dropped, shfx.runtime.gradients), so each rank profiles on its own, as many
    # rounds as it needs, without a collective that the other ranks would have to match
    # (the parameter tier: the probes keep its groups on the SSD, one host-window buffer and the
    # fewest image buffers: their reads are actions as in training, their backward updates nothing)
    probe = probe_variant(variant, 1)
    program = probe.train
    tier = bool(program.ssd_images)
    emulated = engine.backend.name == "emulated"
    # NOTE: compute timed alone runs 3-12% faster than inside a pipelined step, where copy,
    # host and optimizer threads share the processor (benchmarks/sim_accuracy.py); so on the
    # emulated device the compute costs come from pipelined steps of the window-2 program (no
    # update), measured with the device's real links, and the serialized step gives the gap.
    # With the parameter tier the compute costs come from the serialized step (as on CUDA): the
    # window-2 probe would hold more image buffers than a window-1 training may have room for
    # in its host budget.
    pipe_v = probe_variant(variant, 2) if emulated and len(specs) > 1 and not tier else None
    cap = engine.backend.capacity_bytes
    if pipe_v is not None and cap is not None and pipe_v.ledger().peak("device") > cap:
        # NOTE: a device with room for one slot but not two (the training runs window 1):
        # the compute costs come from the serialized step, as on CUDA, rather than refusing
        # the profile for memory the training does not need.
        pipe_v = None
    groups = [st.update_group for st in specs if st.update_group is not None]
    device_groups = groups if engine.optimizer is not None else []
    compute_src = "pipelined" if pipe_v is not None else "serial"

    def family(k: str) -> str | None:
        if k.startswith("link "):
            return "links"
        if k.startswith(("update ", "add ")):
            return "host"
        if k == "gap" or k.startswith("device update ") or re.fullmatch(rf"{compute_src} [FB]\d+@\w+", k):
            return "compute"
        return None

    links = _LinkProbe(engine, variant.graph.slot_bytes)
    host = _HostProbe(engine, groups)

    def one_round() -> dict[str, float]:
        out: dict[str, float] = {}
        # NOTE: the serialized step runs with copies unthrottled, so no compute action follows
        # an idle stretch. (When compute ran on a worker thread, an action after ~4 ms of idle
        # ran ~1.5x slower and was profiled that way; compute now runs on the calling thread
        # and the slowdown is gone (benchmarks/sim_accuracy.py), so no cold costs are taken.
        # The simulator still accepts them: StageCost.*_cold_s and CostTable.cold_idle_s.)
        with engine.backend.unthrottled():
            for k, xs in _timing_step(engine, variant, probe, inputs, serial=True).items():
                out[k if k == "gap" else f"serial {k}"] = statistics.median(xs)
        if pipe_v is not None:
            for k, xs in _timing_step(engine, variant, pipe_v, inputs, serial=False).items():
                out[f"pipelined {k}"] = statistics.median(xs)
        out.update(links.sample())
        out.update(host.sample())
        for g in device_groups:
            out[f"device update {g}"] = _device_update_sample(engine, g)
        if emulated:
            out["dispatch"] = _dispatch_sample(engine)
        return out

    with engine.profiling(), _Snapshot(engine, variant), links.buffers():
        engine.ensure_pool((pipe_v or probe).slot_sizes)
        if tier:  # (the training's windows are at least the probe's: nothing new in a later profile)
            engine.ssd.ensure(program.host_window)
            engine.ssd.ensure_images(program.image_window)
        est, samples, stats = run_rounds(
            one_round, family, rounds=rounds, max_rounds=max_rounds, tolerance=tolerance, budget=budget
        )  # fmt: skip
    keep = {get_meta(n).stage for n in program.nodes if get_meta(n).kind == ActionKind.FORWARD and get_meta(n).keep_graph}
    costs = []
    for st in specs:
        f = est.get(f"{compute_src} F{st.index}@forward", 0.0)
        b = est.get(f"{compute_src} B{st.index}@backward", 0.0)
        g = st.update_group
        upd = est.get(f"update {g}", 0.0) if g is not None else 0.0
        add = est.get(f"add {g}", 0.0) if g is not None else 0.0
        dev_upd = est.get(f"device update {g}", 0.0) if g is not None else 0.0
        kept = {"backward_s": b + f, "backward_kept_s": b} if st.index in keep else {"backward_s": b}
        costs.append(StageCost(forward_s=f, update_s=upd, accumulate_s=add, device_update_s=dev_upd, **kept))
    return CostTable(
        costs,
        links.fit(est),
        optimizer_workers=_workers(engine),
        source=f"profiled on {engine.backend.describe()}",
        extra={"profile": stats, "rounds": samples, "estimates": est},
        dispatch_s=est.get("dispatch", 0.0),
        phase_gap_s=est.get("gap", 0.0),
    )


def _workers(engine: Engine) -> int:
    cpu: Any = engine.backend.cpu
    return len(getattr(cpu, "_threads", [None]))
