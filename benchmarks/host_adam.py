"""Host AdamW throughput: shfx's ``HostAdamW`` against ``torch.optim.AdamW`` and the memory-bandwidth bound.

AdamW is a streaming kernel: per fp32 parameter it reads p, g, m, v and writes p, m, v in place,
28 bytes, with a few flops (one sqrt, two divisions). On the host its speed is set by memory
bandwidth, so this measures

1. the machine's memory bandwidth with STREAM-like torch kernels over arrays far larger than the
   last-level cache (copy ``b = a``, triad ``a = b + s*c``, in-place triad ``a += s*b`` and a
   3-stream in-place kernel, ``torch._fused_sgd_`` with momentum), each at 1 thread and at all
   threads; the *STREAM bound* for AdamW is the best of these medians / 28 B. It also
   measures AdamW with its working set in cache (the compute ceiling);
2. for each model size (default 10M, 50M, 100M, 200M parameters) laid out like a model's stages:
   ``--groups`` groups (12) of GPT blocks (``--layers`` per group, 2) with parameters
   [h], [h], [3h,h], [3h], [h,h], [h], [h], [h], [4h,h], [4h], [h,4h], [h] in shfx's host store
   (flat per-group fp32 buffers), the time of one optimizer step over every group for

   * ``shfx``: ``HostAdamW.update(g)`` for every group, on this thread (what one optimizer worker
     does);
   * ``shfx per-param``: the same with one kernel view per parameter (``merge_views=False``,
     what HostAdamW did before merging adjacent parameters);
   * ``torch fused`` / ``torch foreach`` / ``torch for-loop``: ``torch.optim.AdamW`` with
     ``fused=True`` / ``foreach=True`` / ``foreach=False`` over the *same* parameter tensors
     (the store's views; grads are views of the store's grad buffers) and the same m, v buffers
     (its state is pre-filled with views of shfx's), so every variant moves the same bytes;
     for-loop only up to ``--forloop-max`` parameters (it is slow);
   * ``stream probe``: streaming kernels with little compute over the *same* buffers (fused SGD
     with momentum on p, g, m and ``v += 1e-30*g``: 32 B/param); its GB/s / 28 B is the *probe
     bound*, the main bound reported. On a VM the bandwidth reachable depends on where the
     buffers landed in (host) memory: the same kernel on different allocations of this 2-vCPU
     VM ran at ~70 or ~115 GB/s, so a bound measured on other arrays can be off by 1.6x either
     way; the probe sees the same pages as AdamW;

   interleaved (one step of each variant per round, the order rotating) after a warm-up round,
   until ``--reps`` rounds were quiet (or ``--max-rounds``), medians of the quiet rounds;
3. worker/thread configurations of shfx's optimizer pool (``--configs``, ``WxT``: W threads of a
   ``shfx.runtime.streams.PoolStream`` updating different groups in parallel, each with an
   OpenMP team of T threads, set by ``torch.set_num_threads(T)`` inside the worker, after
   which the process-wide default is restored); this runs after section 2 in the same process,
   with the pools alive throughout (more OpenMP threads changes libgomp's spin-waiting for
   every team in the process, so section 2 runs before any pool exists);
4. a numerical check at ``--check-size`` (separate copies): after ``--check-steps`` steps shfx's
   parameters and states are bitwise equal to ``torch.optim.AdamW(fused=True)``'s and to
   ``HostAdamW(merge_views=False)``'s, and within rtol 1e-5 of the for-loop AdamW's; a group
   with odd-sized parameters (scalar tails, padding) is added to the check model.

5. AdamW with a bf16 working copy of the weights (mixed precision: the device's 16-bit copy is
   refreshed from the fp32 master after every update) at ``--copy-sizes``, same model layout,
   one bf16 buffer per group: ``AdamW`` alone (28 B/param), ``AdamW + cast pass`` (then
   ``copy.copy_(master)`` per group: the master is read from DRAM a second time), the fused
   update ``HostAdamW.update`` does with a working copy
   (:func:`shfx.runtime.host_optim.fused_adamw_with_copy`: the kernel over batches of
   ``CHUNK`` elements, each batch cast into the copy while it is in the cache; 30 B/param:
   the 28 of AdamW and the 2 B copy) and the same at the other ``--copy-chunks`` sizes, the cast
   pass alone, and the stream probe as the bound (30/32 of its time); ``--only-copy`` runs the
   bandwidth test and this section only and adds them to the existing JSON as ``working_copy``.

Every round also records the share of the CPUs used by *other* processes (``/proc/stat`` minus
this process); medians are taken over the quiet rounds (others < 10%) when there are at least
3, and a section without them is marked NOISY. Each section first waits (``--wait-quiet``, up to
15 s) for a quiet second. On a shared machine read those notes before the numbers: with another
process on a core, every OpenMP fork/join can wait a whole time slice, and kernels with many
parallel regions (per-parameter calls) slow down by several times.

Run from the repository root (about 1-2 minutes on 2 cores, peak memory about 6 GB at 200M)::

    python benchmarks/host_adam.py
    python benchmarks/host_adam.py --sizes 10M,50M --reps 9
    python benchmarks/host_adam.py --configs 1x2,2x1,4x1 --config-sizes 50M
    python benchmarks/host_adam.py --skip-configs --check-size 0
    python benchmarks/host_adam.py --only-copy --copy-sizes 10M,100M

Results: ``benchmarks/results/host_adam.json`` (``--out``), with machine information.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import shfx  # noqa: E402
from shfx.passes.layout import TensorInfo, plan_groups  # noqa: E402
from shfx.runtime.emulated import EmulatedBackend  # noqa: E402
from shfx.runtime.host_optim import CHUNK, HostAdamW, _Batch, _kernel, _plan, _run  # noqa: E402
from shfx.runtime.host_store import GRAD_VALID, HostStore  # noqa: E402
from shfx.runtime.streams import PoolStream  # noqa: E402

BYTES_PER_PARAM = 28  # read p, g, m, v; write p, m, v
HP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
QUIET_SHARE = 0.10


# ---- CPU use of other processes -------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
NCPU = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _busy_s() -> float | None:
    try:
        f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        v = [int(x) for x in f]
        return (sum(v[:8]) - v[3] - v[4]) / _TICK  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        return None


class Others:
    """Share of the CPUs other processes used between ``start()`` and ``stop()``."""

    def start(self) -> None:
        self.b, self.p, self.t = _busy_s(), time.process_time(), time.perf_counter()

    def stop(self) -> float | None:
        b, p, t = _busy_s(), time.process_time(), time.perf_counter()
        if b is None or self.b is None:
            return None
        return max(0.0, ((b - self.b) - (p - self.p)) / ((t - self.t) * NCPU))


def wait_quiet(max_wait_s: float, share: float = QUIET_SHARE, window_s: float = 1.0) -> float | None:
    """Wait (up to ``max_wait_s``) for a ``window_s`` window in which other processes use less than
    ``share`` of the CPUs; return the share seen last."""
    if max_wait_s <= 0:  # --wait-quiet 0: do not wait (and do not sample a second either)
        return None
    deadline = time.perf_counter() + max_wait_s
    mon = Others()
    while True:
        mon.start()
        time.sleep(window_s)
        o = mon.stop()
        if o is None or o < share or time.perf_counter() >= deadline:
            return o


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---- memory bandwidth -------------------------------------------------------------------------------
def bandwidth(n: int, threads: list[int], reps: int, max_rounds: int) -> dict[str, Any]:
    """STREAM-like kernels on ``n``-element fp32 arrays; GB/s counted as STREAM does (bytes the
    kernel reads and writes, not the write-allocate reads of a store to a line not read)."""
    a, b, c = torch.full((n,), 1.0), torch.full((n,), 2.0), torch.full((n,), 0.5)
    kernels: dict[str, tuple[int, Callable[[], Any]]] = {
        "copy": (8, lambda: b.copy_(a)),
        "triad": (12, lambda: torch.add(b, c, alpha=0.5, out=a)),
        "inplace_triad": (12, lambda: a.add_(b, alpha=1e-12)),
        "3-stream in-place (fused SGD momentum)": (
            20,
            lambda: torch._fused_sgd_(
                [a], [b], [c], weight_decay=0.0, momentum=0.9, lr=1e-12, dampening=0.0, nesterov=False,
                maximize=False, is_first_step=False,
            ),
        ),
    }

    def with_threads(t: int, fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            torch.set_num_threads(t)
            fn()

        return run

    prev = torch.get_num_threads()
    try:
        variants = {(k, t): with_threads(t, fn) for t in threads for k, (_, fn) in kernels.items()}
        times, others = interleave(variants, reps, max_rounds)
    finally:
        torch.set_num_threads(prev)
    rounds, quiet = pick(others)
    out: dict[str, Any] = {"elements": n, "array_bytes": 4 * n, "kernels": {}, "rounds": len(others),
                           "quiet_rounds_used": quiet, "others_cpu_share_per_round": others}
    best = 0.0
    for k, (nb, _) in kernels.items():
        out["kernels"][k] = {"bytes_per_element": nb}
        for t in threads:
            ts = [times[(k, t)][i] for i in rounds]
            g = nb * n / med(ts) / 1e9
            out["kernels"][k][f"threads={t}"] = {"gbs_median": g, "gbs_max": nb * n / min(ts) / 1e9}
            best = max(best, g)
    out["best_gbs"] = best
    out["stream_triad_gbs"] = max(out["kernels"]["triad"][f"threads={t}"]["gbs_median"] for t in threads)
    del a, b, c
    return out


def adam_in_cache(n: int, threads: list[int], reps: int, max_rounds: int) -> dict[str, Any]:
    """Fused AdamW params/s with its working set (16 B/param) in the last-level cache: the
    compute ceiling, which DRAM-resident runs cannot beat."""
    bufs = [torch.randn(n) for _ in range(4)]
    bufs[3].abs_()
    step = torch.tensor(1.0)
    inner = max(10, int(2e7 // n))

    def run(t: int) -> Callable[[], None]:
        def f() -> None:
            torch.set_num_threads(t)
            for _ in range(inner):
                torch._fused_adamw_([bufs[0]], [bufs[1]], [bufs[2]], [bufs[3]], [], [step], lr=1e-6, beta1=0.9,
                                    beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)

        return f

    prev = torch.get_num_threads()
    try:
        times, others = interleave({t: run(t) for t in threads}, reps, max_rounds)
    finally:
        torch.set_num_threads(prev)
    rounds, quiet = pick(others)
    out: dict[str, Any] = {"params": n, "quiet_rounds_used": quiet, "others_cpu_share_per_round": others}
    for t in threads:
        out[f"threads={t}"] = n * inner / med([times[t][i] for i in rounds])
    return out


# ---- the model-like parameter set ------------------------------------------------------------------
def block_shapes(h: int) -> list[tuple[int, ...]]:
    return [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,)]


def hidden_for(n: int, groups: int, layers: int) -> int:
    """The hidden size (a multiple of 32) whose ``groups * layers`` GPT blocks come closest to ``n``."""
    h = math.sqrt(n / (12 * groups * layers))
    return max(32, int(round(h / 32)) * 32)


class Model:
    """Parameters in a host store: groups of GPT blocks; grads random; leaves with ``.grad`` views."""

    def __init__(self, n: int, groups: int, layers: int, seed: int = 0, extra: list[tuple[int, ...]] | None = None):
        self.h = hidden_for(n, groups, layers)
        gen = torch.Generator().manual_seed(seed)
        owned: list[list[TensorInfo]] = []
        self.params: dict[str, torch.Tensor] = {}
        self.keys_by_group: list[list[str]] = []
        for g in range(groups):
            infos, keys = [], []
            shapes = block_shapes(self.h) * layers + (list(extra) if extra and g == groups - 1 else [])
            for i, s in enumerate(shapes):
                k = f"g{g}.p{i}"
                p = torch.empty(s).normal_(generator=gen).mul_(0.02).requires_grad_()
                self.params[k] = p
                infos.append(TensorInfo.of(k, "param", p, trainable=True))
                keys.append(k)
            owned.append(infos)
            self.keys_by_group.append(keys)
        self.backend = EmulatedBackend(shfx.EmulatedDevice())
        self.store = HostStore(self.backend, plan_groups(owned), self.params, pin=False)
        self.numel = sum(p.numel() for p in self.params.values())
        self.tensors = sum(len(k) for k in self.keys_by_group)
        for g in range(groups):
            self.store.grad(g).normal_(generator=gen)
            self.store.grad_state[g] = GRAD_VALID
            for k in self.keys_by_group[g]:
                self.params[k].grad = self.store.param_grad_view(k, g)

    @property
    def groups(self) -> int:
        return len(self.keys_by_group)

    def new_grads(self, gen: torch.Generator) -> None:
        for g in range(self.groups):
            self.store.grad(g).normal_(generator=gen)

    def close(self) -> None:
        self.backend.close()


def shfx_step(opt: HostAdamW, m: Model, hp: dict) -> Callable[[], None]:
    def run() -> None:
        for g in range(m.groups):
            opt.update(g, hp)

    return run


def torch_opt(m: Model, shared: HostAdamW | None, **kw) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over the model's parameters; with ``shared``, its state is views of
    ``shared``'s m and v buffers (so it moves the same bytes without holding more copies)."""
    params = list(m.params.values())
    opt = torch.optim.AdamW(params, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"], weight_decay=HP["weight_decay"], **kw)
    if shared is not None:
        for g in range(m.groups):
            st = shared.state[g]
            grp = m.store.groups[g]
            for k in m.keys_by_group[g]:
                p = m.params[k]
                o = grp.offsets[k] // 4
                opt.state[p] = {
                    "step": torch.tensor(float(shared.steps(g)), dtype=torch.float32),
                    "exp_avg": st.exp_avg[o : o + p.numel()].view(p.shape),
                    "exp_avg_sq": st.exp_avg_sq[o : o + p.numel()].view(p.shape),
                }
    return opt


PROBE = "stream probe"
PROBE_BYTES = 32


def probe(host: HostAdamW, m: Model) -> Callable[[], None]:
    """Streaming kernels over the very buffers AdamW uses (same pages, same placement), for each
    group: fused SGD with momentum on (p, g, m) with lr 0 (reads p, g, m; writes p, m) and
    ``v += 1e-30 * g`` (reads v, g; writes v): 32 B/param in two passes, little compute. Values
    barely move (m becomes an SGD momentum, bounded), so the AdamW timings are unaffected."""

    def run() -> None:
        for g in range(m.groups):
            st = host.state[g]
            torch._fused_sgd_([m.store.master(g)], [m.store.grad(g)], [st.exp_avg], weight_decay=0.0, momentum=0.9,
                              lr=0.0, dampening=0.0, nesterov=False, maximize=False, is_first_step=False)
            st.exp_avg_sq.add_(m.store.grad(g), alpha=1e-30)

    return run


def add_ratios(table: dict[str, dict[str, Any]], rounds: list[int], n: int, ref: str,
               nbytes: dict[str, int] | None = None) -> dict[str, Any]:
    """Per-round ratios, from the runs of one round (seconds apart): each row's fraction of the
    probe bound (``28/32 * probe time / row time``; ``nbytes[row]`` instead of 28 where given)
    and its speed-up over ``ref``; medians over ``rounds``. The machine's bandwidth can change
    between rounds; within a round these hold."""
    pt = table[PROBE]["times_s"]
    rt = table[ref]["times_s"]
    for k, row in table.items():
        t = row["times_s"]
        nb = PROBE_BYTES if k == PROBE else (nbytes or {}).get(k, BYTES_PER_PARAM)
        row["fraction_of_probe_bound"] = med([nb / PROBE_BYTES * pt[i] / t[i] for i in rounds])
        row[f"speedup_vs_{ref}"] = med([rt[i] / t[i] for i in rounds])
    gbs = [PROBE_BYTES * n / pt[i] / 1e9 for i in rounds]
    return {"gbs_median": med(gbs), "gbs_min": min(gbs), "gbs_max": max(gbs),
            "params_per_s_median": med(gbs) * 1e9 / BYTES_PER_PARAM}


# ---- optimizer worker pools ---------------------------------------------------------------------------
class Pool:
    """A ``PoolStream`` of ``workers`` threads, each with an OpenMP team of ``threads``."""

    def __init__(self, workers: int, threads: int):
        self.workers, self.threads = workers, threads
        self.stream = PoolStream(f"bench-{workers}x{threads}", workers)
        prev = torch.get_num_threads()
        barrier = threading.Barrier(workers)
        seen: list[int] = []

        def setup() -> None:
            torch.get_num_threads()  # this thread's lazy OpenMP init first: it would reread the global later
            torch.set_num_threads(threads)  # this thread's team size (and, as a side effect, the global default)
            seen.append(torch.get_num_threads())
            barrier.wait()  # one setup per worker

        toks = [self.stream.submit(setup) for _ in range(workers)]
        for t in toks:
            t.wait()
        torch.set_num_threads(prev)  # restore the default for threads that initialize later (same value here)
        assert seen == [threads] * workers, seen

    def step(self, opt: HostAdamW, m: Model, hp: dict) -> Callable[[], None]:
        def run() -> None:
            toks = [self.stream.submit(lambda g=g: opt.update(g, hp)) for g in range(m.groups)]
            for t in toks:
                t.wait()
            for t in toks:
                if t.error is not None:
                    raise t.error

        return run

    def close(self) -> None:
        self.stream.close()
        for t in self.stream._threads:  # let the workers (and their OpenMP teams) finish before exit
            t.join(timeout=10)


# ---- measurement ------------------------------------------------------------------------------------
def interleave(variants: dict[Any, Callable[[], None]], reps: int, max_rounds: int) -> tuple[dict[Any, list[float]], list[float]]:
    """One call of every variant per round, the order rotating, after a warm-up round; rounds go on
    until ``reps`` of them were quiet (other processes used < QUIET_SHARE of the CPUs) or
    ``max_rounds`` were run. Returns the per-round times of each variant and the others' shares."""
    names = list(variants)
    times: dict[Any, list[float]] = {k: [] for k in names}
    others: list[float] = []
    mon = Others()
    r = 0
    while True:
        order = names[r % len(names):] + names[: r % len(names)]
        mon.start()
        for k in order:
            s = time.perf_counter()
            variants[k]()
            e = time.perf_counter() - s
            if r:
                times[k].append(e)
        o = mon.stop()
        if r:
            others.append(o if o is not None else 0.0)
        r += 1
        if r > 1 and (sum(x < QUIET_SHARE for x in others) >= reps or len(others) >= max_rounds):
            return times, others


def pick(others: list[float], need: int = 3) -> tuple[list[int], bool]:
    """The rounds to summarize: the quiet ones if there are at least ``need``, else all."""
    quiet = [i for i, o in enumerate(others) if o < QUIET_SHARE]
    return (quiet, True) if len(quiet) >= need else (list(range(len(others))), False)


def summarize(times: list[float], rounds: list[int], n: int, bound_gbs: float, nbytes: int = BYTES_PER_PARAM) -> dict[str, Any]:
    ts = [times[i] for i in rounds]
    t = med(ts)
    q = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [t, t, t]
    return {
        "median_s": t,
        "iqr_s": q[2] - q[0],
        "min_s": min(ts),
        "params_per_s": n / t,
        "bytes_per_param": nbytes,
        "gbs": nbytes * n / t / 1e9,
        "fraction_of_stream_bound": nbytes * n / t / 1e9 / bound_gbs,
        "median_all_rounds_s": med(times),
        "times_s": times,
    }


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def parse_elements(s: str) -> int:
    """A chunk size in elements, binary multiples: ``64K`` = 65536, ``1M`` = 2**20."""
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KM" else s) * mult)


def measure_variants(n: int, args, bound: float) -> dict[str, Any]:
    m = Model(n, args.groups, args.layers, seed=1)
    cfg = shfx.optim.AdamW(**HP)
    hp = cfg.hyperparams()
    host = HostAdamW(cfg, m.store)
    per_param = HostAdamW(cfg, m.store, merge_views=False)
    for g in range(m.groups):  # creates shfx's states (the torch optimizers share them)
        host.update(g, hp)
    variants: dict[str, Callable[[], None]] = {
        "shfx": shfx_step(host, m, hp),
        "shfx per-param": shfx_step(per_param, m, hp),
    }
    opts = {"torch fused": torch_opt(m, host, fused=True), "torch foreach": torch_opt(m, host, foreach=True)}
    if m.numel <= args.forloop_max:
        opts["torch for-loop"] = torch_opt(m, host, foreach=False)
    for k, o in opts.items():
        variants[k] = o.step
    variants[PROBE] = probe(host, m)
    wait_quiet(args.wait_quiet)
    times, others = interleave(variants, args.reps, args.max_rounds)
    rounds, quiet = pick(others)
    res: dict[str, Any] = {
        "requested": n,
        "params": m.numel,
        "tensors": m.tensors,
        "hidden": m.h,
        "groups": m.groups,
        "layers_per_group": args.layers,
        "views_per_group": {"shfx": len(host.state[0].views[0]), "shfx per-param": len(per_param.state[0].views[0])},
        "rounds": len(others),
        "quiet_rounds_used": quiet,
        "others_cpu_share": {"median": med(others), "max": max(others), "per_round": others},
        "variants": {k: summarize(v, rounds, m.numel, bound, PROBE_BYTES if k == PROBE else BYTES_PER_PARAM)
                     for k, v in times.items()},
        "stream_bound": {"gbs": bound, "params_per_s": bound * 1e9 / BYTES_PER_PARAM,
                         "step_s": BYTES_PER_PARAM * m.numel / (bound * 1e9)},
    }
    res["probe_bound"] = add_ratios(res["variants"], rounds, m.numel, "torch fused")
    del opts, variants
    m.close()
    return res


def measure_configs(n: int, args, bound: float, pools: dict[str, Pool]) -> dict[str, Any]:
    m = Model(n, args.groups, args.layers, seed=2)
    cfg = shfx.optim.AdamW(**HP)
    hp = cfg.hyperparams()
    host = HostAdamW(cfg, m.store)
    for g in range(m.groups):  # creates the states the probe runs over
        host.update(g, hp)
    variants = {name: pool.step(host, m, hp) for name, pool in pools.items()}
    variants[PROBE] = probe(host, m)
    REF_CONFIG = next(iter(pools))  # noqa: N806
    wait_quiet(args.wait_quiet)
    times, others = interleave(variants, args.reps, args.max_rounds)
    rounds, quiet = pick(others)
    res = {
        "params": m.numel,
        "rounds": len(others),
        "quiet_rounds_used": quiet,
        "others_cpu_share": {"median": med(others), "max": max(others), "per_round": others},
        "configs": {k: summarize(v, rounds, m.numel, bound, PROBE_BYTES if k == PROBE else BYTES_PER_PARAM)
                    for k, v in times.items()},
    }
    res["reference"] = REF_CONFIG
    res["probe_bound"] = add_ratios(res["configs"], rounds, m.numel, REF_CONFIG)
    m.close()
    return res


def check(n: int, steps: int, groups: int, layers: int) -> dict[str, Any]:
    """Separate copies: shfx, shfx per-param, torch fused, torch for-loop; same grads each step."""
    extra = [(77, 3), (3,), (1001,), (7,), (64,)]  # scalar tails and padding
    cfg = shfx.optim.AdamW(**HP)
    hp = cfg.hyperparams()
    ms = {k: Model(n, groups, layers, seed=3, extra=extra) for k in ("shfx", "per-param", "fused", "for-loop")}
    runs = {
        "shfx": HostAdamW(cfg, ms["shfx"].store),
        "per-param": HostAdamW(cfg, ms["per-param"].store, merge_views=False),
        "fused": torch_opt(ms["fused"], None, fused=True),
        "for-loop": torch_opt(ms["for-loop"], None, foreach=False),
    }
    for s in range(steps):
        for k, m in ms.items():
            m.new_grads(torch.Generator().manual_seed(100 + s))  # same grads for every copy
            o = runs[k]
            if isinstance(o, HostAdamW):
                shfx_step(o, m, hp)()
            else:
                o.step()
    ref = ms["shfx"]
    out: dict[str, Any] = {"params": ref.numel, "steps": steps, "views_per_group": len(runs["shfx"].state[0].views[0])}

    def states(k: str) -> list[torch.Tensor]:
        m, o = ms[k], runs[k]
        ps = [m.params[key].detach() for key in m.params]
        if isinstance(o, HostAdamW):
            ex = []
            for g in range(m.groups):
                st = o.state[g]
                for key in m.keys_by_group[g]:
                    off, p = m.store.groups[g].offsets[key] // 4, m.params[key]
                    ex.append((st.exp_avg[off : off + p.numel()].view(p.shape), st.exp_avg_sq[off : off + p.numel()].view(p.shape)))
        else:
            ex = [(o.state[p]["exp_avg"], o.state[p]["exp_avg_sq"]) for p in m.params.values()]
        return ps + [e[0] for e in ex] + [e[1] for e in ex]

    mine = states("shfx")
    for k in ("per-param", "fused"):
        out[f"bitwise_equal_{k}"] = all(torch.equal(a, b) for a, b in zip(mine, states(k)))
    loop = states("for-loop")
    np_ = len(ref.params)
    pa, pb = torch.cat([t.reshape(-1) for t in mine[:np_]]), torch.cat([t.reshape(-1) for t in loop[:np_]])
    d = (pa - pb).abs()
    out["forloop_params_max_abs_diff"] = d.max().item()
    big = pb.abs() >= 1e-3  # relative differences of values near 0 (cancellation) say nothing
    out["forloop_params_max_rel_diff_where_abs_ge_1e-3"] = (d[big] / pb[big].abs()).max().item() if big.any() else 0.0
    out["forloop_params_differing_fraction"] = (d != 0).float().mean().item()
    # <= 1: within torch.allclose(rtol=1e-5, atol=1e-7), the tolerance tests/test_host_optim.py uses
    out["forloop_tolerance_used"] = (d / (1e-7 + 1e-5 * pb.abs())).max().item()
    out["forloop_allclose_rtol1e-5"] = bool(torch.allclose(pa, pb, rtol=1e-5, atol=1e-7))
    out["ok"] = out["bitwise_equal_per-param"] and out["bitwise_equal_fused"] and out["forloop_allclose_rtol1e-5"]
    for m in ms.values():
        m.close()
    return out


# ---- AdamW with the 16-bit working copy (mixed precision) ---------------------------------------------
COPY_BYTES = 30  # AdamW's 28 B/param and the bf16 copy written (2 B); the master is not read again
CAST_BYTES = 6  # a separate cast pass: read the fp32 master (4 B), write the bf16 copy (2 B)
SEPARATE = "AdamW + cast pass"


def fmt_chunk(c: int) -> str:
    return f"{c >> 20}M" if c % (1 << 20) == 0 else f"{c >> 10}K" if c % (1 << 10) == 0 else str(c)


def measure_copy(n: int, args, bound: float) -> dict[str, Any]:
    """The bf16 working copy refreshed from the fp32 master after AdamW, over a model's groups
    (flat buffers of the host store, one bf16 buffer per group for the copy), per step:

    * ``AdamW``: the update alone (one kernel call per group, what HostAdamW does without a
      working copy), 28 B/param;
    * ``AdamW + cast pass``: the update, then ``copy.copy_(master)`` per group: the master is
      read again from DRAM (34 B/param moved; counted as 30, the bytes the result needs);
    * ``fused (update)``: ``HostAdamW.update`` with a working copy (``store.working_view``):
      :func:`shfx.runtime.host_optim.fused_adamw_with_copy`'s batches of :data:`CHUNK`
      elements, each batch cast while in the cache, 30 B/param;
    * ``fused chunk=C``: the same batches cut at the other ``--copy-chunks`` sizes;
    * ``AdamW cut at CHUNK, no copy``: the update's kernel calls without the casts (what cutting
      the kernel into batches costs by itself);
    * ``cast pass``: the cast alone (6 B/param);
    * the stream probe over the same buffers (32 B/param, the bound, as in section 2).

    Every variant works on the same buffers; interleaved rounds as in section 2."""
    m = Model(n, args.groups, args.layers, seed=4)
    groups = range(m.groups)
    work = [m.store.master(g).to(torch.bfloat16) for g in groups]
    m.store.working_view = lambda g, o, k: work[g][o : o + k]  # what the mixed-precision store provides
    cfg = shfx.optim.AdamW(**HP)
    hp = cfg.hyperparams()
    host = HostAdamW(cfg, m.store)  # chunk=CHUNK
    for g in groups:  # creates the states (and the batches of the working copy's update)
        host.update(g, hp)
    sts = [host.state[g] for g in groups]
    # the update's batches: per parameter group now (_State.pgs: (index, views, batches)); the
    # model here has one parameter group, so one list of batches per group
    batches = [[b for _, _, bs in st.pgs for b in (bs or [])] for st in sts]
    assert all(st.pgs and all(bs is not None for _, _, bs in st.pgs) for st in sts)
    chunks = [c for c in (parse_elements(x) for x in args.copy_chunks.split(",") if x.strip()) if c != CHUNK]
    plans = {c: [_plan(st.views, [st.step] * len(st.views[0]), st.working, c) for st in sts] for c in chunks}

    def adamw() -> None:
        for st in sts:
            st.step += 1
            _kernel(*st.views[:4], [], [st.step] * len(st.views[0]), hp, None, None)

    def cast() -> None:
        for g in groups:
            work[g].copy_(m.store.master(g))

    def separate() -> None:
        adamw()
        cast()

    def fused(c: int) -> Callable[[], None]:
        def run() -> None:
            for st, plan in zip(sts, plans[c]):
                st.step += 1
                _run(plan, hp)

        return run

    def update() -> None:
        for g in groups:
            host.update(g, hp)

    nocopy = []  # the update's batches without their casts: what cutting the kernel call costs
    for bs in batches:
        nocopy.append([])
        for b in bs:
            nb = _Batch(len(b.lists))
            nb.lists = b.lists
            nocopy[-1].append(nb)

    def chunked_adamw() -> None:
        for st, plan in zip(sts, nocopy):
            st.step += 1
            _run(plan, hp)

    fused_name = f"fused (update) chunk={fmt_chunk(CHUNK)}"
    variants: dict[str, Callable[[], None]] = {"AdamW": adamw, f"AdamW cut at {fmt_chunk(CHUNK)}, no copy": chunked_adamw,
                                               SEPARATE: separate, fused_name: update}
    for c in chunks:
        variants[f"fused chunk={fmt_chunk(c)}"] = fused(c)
    variants["cast pass"] = cast
    variants[PROBE] = probe(host, m)
    nbytes = {k: COPY_BYTES for k in variants}
    nbytes.update({"AdamW": BYTES_PER_PARAM, f"AdamW cut at {fmt_chunk(CHUNK)}, no copy": BYTES_PER_PARAM,
                   "cast pass": CAST_BYTES, PROBE: PROBE_BYTES})
    wait_quiet(args.wait_quiet)
    times, others = interleave(variants, args.reps, args.max_rounds)
    rounds, quiet = pick(others)
    update()  # the working copy is the master's cast after an update
    ok = all(torch.equal(work[g], m.store.master(g).to(torch.bfloat16)) for g in groups)
    res: dict[str, Any] = {
        "requested": n,
        "params": m.numel,
        "hidden": m.h,
        "groups": m.groups,
        "layers_per_group": args.layers,
        "working_dtype": "bfloat16",
        "threads": torch.get_num_threads(),
        "chunk_default": CHUNK,
        "views_per_group": len(sts[0].views[0]),
        "kernel_calls_per_group": {fused_name: len(batches[0]),
                                   **{f"fused chunk={fmt_chunk(c)}": len(plans[c][0]) for c in chunks}},
        "bytes_per_param": nbytes,
        "rounds": len(others),
        "quiet_rounds_used": quiet,
        "others_cpu_share": {"median": med(others), "max": max(others), "per_round": others},
        "variants": {k: summarize(v, rounds, m.numel, bound, nbytes[k]) for k, v in times.items()},
        "bound_s": {"stream_30B": COPY_BYTES * m.numel / (bound * 1e9), "stream_28B": BYTES_PER_PARAM * m.numel / (bound * 1e9)},
        "working_copy_equals_master_cast": ok,
    }
    res["probe_bound"] = add_ratios(res["variants"], rounds, m.numel, SEPARATE, nbytes)
    for k, row in res["variants"].items():  # and against the update alone
        row["time_vs_AdamW"] = med([times[k][i] / times["AdamW"][i] for i in rounds])
    m.close()
    return res


def print_copy_table(r: dict[str, Any], bound: float) -> None:
    table, pb = r["variants"], r["probe_bound"]
    print(f"  {'variant':30s} {'B/par':>5s} {'median ms':>9s} {'best ms':>8s} {'GB/s':>6s} {'% probe':>8s} "
          f"{'% STREAM':>8s} {'vs sep.':>8s} {'/AdamW':>7s}")
    for k, s in table.items():
        if k == PROBE:
            continue
        print(f"  {k:30s} {s['bytes_per_param']:5d} {s['median_s'] * 1e3:9.1f} {s['min_s'] * 1e3:8.1f} {s['gbs']:6.1f} "
              f"{s['fraction_of_probe_bound'] * 100:7.0f}% {s['fraction_of_stream_bound'] * 100:7.0f}% "
              f"{s[f'speedup_vs_{SEPARATE}']:7.2f}x {s['time_vs_AdamW']:7.2f}")
    n = r["params"]
    t = table[PROBE]["median_s"] * COPY_BYTES / PROBE_BYTES
    print(f"  {'bound: probe, 30 B/param':30s} {COPY_BYTES:5d} {t * 1e3:9.1f} {'':8s} {pb['gbs_median']:6.1f} {100:7.0f}%"
          f"            streaming {PROBE_BYTES} B/param over these buffers; {pb['gbs_min']:.0f}-{pb['gbs_max']:.0f} GB/s")
    print(f"  {'bound: STREAM, 30 B/param':30s} {COPY_BYTES:5d} {COPY_BYTES * n / bound / 1e6:9.1f} {'':8s} {bound:6.1f} "
          f"{'':8s} {100:7.0f}%")
    print(f"  (vs sep.: speed-up over '{SEPARATE}'; /AdamW: time over the update alone; both medians of per-round "
          f"ratios; working copy == master cast after an update: {r['working_copy_equals_master_cast']})")


# ---- machine info and reporting -----------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def read(p: str) -> str | None:
        try:
            return Path(p).read_text().strip()
        except OSError:
            return None

    mem = None
    try:
        mem = int(next(l for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal")).split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        pass
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shfx": getattr(shfx, "__version__", None),
        "cpu_model": cpu,
        "os_cpu_count": os.cpu_count(),
        "affinity_cpus": NCPU,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mem_total_bytes": mem,
        "l3_cache": read("/sys/devices/system/cpu/cpu0/cache/index3/size"),
        "transparent_hugepage": read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "loadavg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                            "THP_MEM_ALLOC_ENABLE") if k in os.environ},
        "parallel_info": [ln.strip() for ln in torch.__config__.parallel_info().splitlines() if ln.strip()],
    }


def quiet_note(r: dict[str, Any]) -> str:
    o = r.get("others_cpu_share_per_round") or r["others_cpu_share"]["per_round"]
    n = sum(x < QUIET_SHARE for x in o)
    if r["quiet_rounds_used"]:
        return f"medians of the {n} quiet rounds of {len(o)} (others < {QUIET_SHARE:.0%} of the CPUs)"
    return (f"NOISY: only {n} of {len(o)} rounds quiet, medians of all; others used {med(o):.0%} of the CPUs "
            f"(max {max(o):.0%})")


def fmt_row(name: str, s: dict[str, Any], ref: str) -> str:
    n_over_t = s["params_per_s"]
    return (f"  {name:22s} {s['median_s'] * 1e3:9.1f} {s['min_s'] * 1e3:8.1f} {n_over_t / 1e6:9.0f} {s['gbs']:7.1f} "
            f"{s['gbs'] * s['median_s'] / s['min_s']:7.1f} {s['fraction_of_probe_bound'] * 100:7.0f}% "
            f"{s['fraction_of_stream_bound'] * 100:7.0f}% {s[f'speedup_vs_{ref}']:8.2f}x")


def print_table(table: dict[str, dict[str, Any]], n: int, ref: str, bound: float, pb: dict[str, Any]) -> None:
    """Times, rates and per-round ratios (``% probe`` and ``vs ref``: medians of the ratios
    within each round, robust to the bandwidth changing between rounds)."""
    print(f"  {'variant':22s} {'median ms':>9s} {'best ms':>8s} {'Mparam/s':>9s} {'GB/s':>7s} {'best':>7s} "
          f"{'% probe':>8s} {'% STREAM':>8s} {'vs ' + ref:>9s}")
    for k, s in table.items():
        if k != PROBE:
            print(fmt_row(k, s, ref))
    t = table[PROBE]["median_s"] * BYTES_PER_PARAM / PROBE_BYTES
    g = pb["gbs_median"]
    print(f"  {'bound: probe':22s} {t * 1e3:9.1f} {'':8s} {n / t / 1e6:9.0f} {g:7.1f} {pb['gbs_max']:7.1f} {100:7.0f}% "
          f"{g / bound * 100:7.0f}%            streaming {PROBE_BYTES} B/param over these buffers; "
          f"{pb['gbs_min']:.0f}-{pb['gbs_max']:.0f} GB/s over the rounds")
    print(f"  {'bound: STREAM':22s} {BYTES_PER_PARAM * n / bound / 1e9 * 1e3:9.1f} {'':8s} {bound / BYTES_PER_PARAM * 1e3:9.0f} "
          f"{bound:7.1f} {'':7s} {'':8s} {100:7.0f}%            best STREAM-like kernel above (measured earlier)")


def run_copy(sizes: list[int], args, bound: float, bw: dict[str, Any]) -> dict[str, Any]:
    """Section 5 at every size; printed, and returned for the JSON."""
    out: dict[str, Any] = {
        "bytes_per_param": {"AdamW": BYTES_PER_PARAM, "AdamW + copy": COPY_BYTES, "cast pass": CAST_BYTES},
        "bound_gbs": bound,
        "chunk_default": CHUNK,
        "sizes": [],
    }
    if args.only_copy:
        out["bandwidth"] = bw
    prev = torch.get_num_threads()
    threads = [int(t) for t in args.copy_threads.split(",") if t.strip()] or [prev]
    try:
        for t in threads:
            torch.set_num_threads(t)  # this thread's OpenMP team, as in an optimizer worker of t threads
            for n in sizes:
                r = measure_copy(n, args, bound)
                out["sizes"].append(r)
                print(f"\nAdamW + bf16 working copy, {r['params'] / 1e6:.1f}M params ({r['groups']} groups, h={r['hidden']}, "
                      f"{r['views_per_group']} view(s)/group, {r['threads']} threads; kernel calls/group: "
                      + ", ".join(f"{k.split()[-1]} {v}" for k, v in r["kernel_calls_per_group"].items())
                      + f"); {quiet_note(r)}")
                print_copy_table(r, bound)
    finally:
        torch.set_num_threads(prev)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10M,50M,100M,200M", help="parameter counts, comma separated (10M, 1.5G, ...)")
    ap.add_argument("--groups", type=int, default=12, help="groups (stages) per model")
    ap.add_argument("--layers", type=int, default=2, help="GPT blocks per group")
    ap.add_argument("--reps", type=int, default=9, help="quiet measured rounds wanted per size (after one warm-up round)")
    ap.add_argument("--max-rounds", type=int, default=15, help="stop after this many rounds even if fewer were quiet")
    ap.add_argument("--forloop-max", type=parse_size, default=parse_size("50M"), help="largest size timed with the for-loop AdamW")
    ap.add_argument("--configs", default=None, help="optimizer pool configs WxT (default: 1xC,1x1,2x1,2xC... for C cores)")
    ap.add_argument("--config-sizes", default="10M,100M", help="sizes for the config sweep")
    ap.add_argument("--skip-configs", action="store_true")
    ap.add_argument("--bw-elements", type=parse_size, default=1 << 26, help="elements per array for the bandwidth test (3 arrays)")
    ap.add_argument("--bw-reps", type=int, default=5, help="quiet rounds wanted for the bandwidth and in-cache runs")
    ap.add_argument("--bw-max-rounds", type=int, default=12, help="most rounds of the bandwidth and in-cache runs")
    ap.add_argument("--cache-params", type=parse_size, default=parse_size("1M"),
                    help="params for the in-cache AdamW run (16 B each; keep it inside the last-level cache)")
    ap.add_argument("--copy-sizes", default="10M,100M", help="sizes for section 5, AdamW with the bf16 working copy ('' to skip)")
    ap.add_argument("--copy-chunks", default="128K,256K,512K,2M,4M",
                    help="other chunk sizes (elements per batch of kernel calls, K = 1024) timed in section 5 "
                         "besides the default")
    ap.add_argument("--copy-threads", default="2,1", help="intra-op threads for section 5, comma separated (each a separate run of every size)")
    ap.add_argument("--only-copy", action="store_true",
                    help="run the bandwidth test and section 5 only, and add their results to the existing --out "
                         "file as 'working_copy' (other entries kept)")
    ap.add_argument("--check-size", type=parse_size, default=parse_size("10M"), help="0 to skip the numerical check")
    ap.add_argument("--check-steps", type=int, default=3)
    ap.add_argument("--wait-quiet", type=float, default=15.0,
                    help="before each measured section, wait up to this many seconds for other processes to use < 10%% of the CPUs")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "host_adam.json"))
    args = ap.parse_args()

    t_start = time.perf_counter()
    info = machine_info()
    cores = torch.get_num_threads()
    threads = sorted({1, max(1, cores // 2), cores})
    print(f"# host AdamW: {info['cpu_model']}, {NCPU} CPUs, torch {info['torch']} ({info['cpu_capability']}), "
          f"{cores} intra-op threads, load {info['loadavg_at_start']}")

    wait_quiet(args.wait_quiet)
    bw = bandwidth(args.bw_elements, threads, reps=args.bw_reps, max_rounds=args.bw_max_rounds)
    bound = bw["best_gbs"]
    print(f"\nmemory bandwidth, {3 * 4 * args.bw_elements / 2**20:.0f} MiB working set, median GB/s, {quiet_note(bw)}:")
    for k, v in bw["kernels"].items():
        print(f"  {k:40s} " + "  ".join(f"{t} thr {v[f'threads={t}']['gbs_median']:6.1f}" for t in threads))
    cache = adam_in_cache(args.cache_params, threads, reps=args.bw_reps, max_rounds=args.bw_max_rounds)
    print(f"  bound for AdamW: best {bound:.1f} GB/s / {BYTES_PER_PARAM} B = {bound / BYTES_PER_PARAM * 1e3:.0f} Mparam/s "
          f"(STREAM triad alone: {bw['stream_triad_gbs'] / BYTES_PER_PARAM * 1e3:.0f} Mparam/s)")
    print(f"  AdamW in cache ({args.cache_params / 1e6:g}M params, {16 * args.cache_params / 2**20:.0f} MiB; compute ceiling; "
          f"{quiet_note(cache)}): " + ", ".join(f"{t} thr {cache[f'threads={t}'] / 1e6:.0f} Mparam/s" for t in threads))

    copy_res = None
    copy_sizes = [parse_size(x) for x in args.copy_sizes.split(",") if x.strip()]
    if args.only_copy:
        copy_res = run_copy(copy_sizes, args, bound, bw)
        info["loadavg_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
        info["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        info["wall_s"] = time.perf_counter() - t_start
        path = Path(args.out)
        out = json.loads(path.read_text()) if path.exists() else {}
        out["working_copy"] = {"machine": info, "args": vars(args), **copy_res}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))
        print(f"\n{info['wall_s']:.0f} s, peak RSS {info['peak_rss_bytes'] / 2**30:.1f} GiB; added 'working_copy' to {args.out}")
        if not all(r["working_copy_equals_master_cast"] for r in copy_res["sizes"]):
            sys.exit(1)
        return

    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    results = []
    for n in sizes:
        r = measure_variants(n, args, bound)
        results.append(r)
        print(f"\n{r['params'] / 1e6:.1f}M params ({r['groups']} groups x {r['layers_per_group']} GPT blocks, h={r['hidden']}, "
              f"{r['tensors']} tensors; views/group: shfx {r['views_per_group']['shfx']}, per-param "
              f"{r['views_per_group']['shfx per-param']}); {quiet_note(r)}")
        print_table(r["variants"], r["params"], "torch fused", bound, r["probe_bound"])

    configs_res = None
    if not args.skip_configs:
        spec = args.configs or ",".join(dict.fromkeys([f"1x{cores}", "1x1", f"2x{max(1, cores // 2)}", f"{cores}x1", f"2x{cores}"]))
        pools: dict[str, Pool] = {}
        for c in spec.split(","):
            w, t = (int(x) for x in c.lower().split("x"))
            pools[f"{w}x{t}"] = Pool(w, t)
        configs_res = []
        for n in [parse_size(s) for s in args.config_sizes.split(",") if s.strip()]:
            r = measure_configs(n, args, bound, pools)
            configs_res.append(r)
            print(f"\noptimizer pool configs (workers x OpenMP threads each), shfx, {r['params'] / 1e6:.1f}M params; "
                  f"{quiet_note(r)}")
            print_table(r["configs"], r["params"], r["reference"], bound, r["probe_bound"])
        for p in pools.values():
            p.close()

    if copy_sizes:
        copy_res = run_copy(copy_sizes, args, bound, bw)

    chk = None
    if args.check_size:
        chk = check(args.check_size, args.check_steps, args.groups, args.layers)
        print(f"\ncheck ({chk['params'] / 1e6:.1f}M params, {chk['steps']} steps, {chk['views_per_group']} views/group): "
              f"shfx == torch fused bitwise: {chk['bitwise_equal_fused']}; == per-param views bitwise: "
              f"{chk['bitwise_equal_per-param']}; vs for-loop: {chk['forloop_params_differing_fraction'] * 100:.2f}% of params "
              f"differ, max abs diff {chk['forloop_params_max_abs_diff']:.1e}, max rel diff (|p| >= 1e-3) "
              f"{chk['forloop_params_max_rel_diff_where_abs_ge_1e-3']:.1e}, allclose(rtol=1e-5, atol=1e-7): "
              f"{chk['forloop_allclose_rtol1e-5']} ({chk['forloop_tolerance_used'] * 100:.0f}% of the tolerance used)")

    info["loadavg_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    info["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    info["wall_s"] = time.perf_counter() - t_start
    out = {
        "machine": info,
        "args": vars(args),
        "bytes_per_param": BYTES_PER_PARAM,
        "hyperparameters": HP,
        "bandwidth": bw,
        "bound_gbs": bound,
        "bound_params_per_s": bound / BYTES_PER_PARAM * 1e9,
        "adam_in_cache_params_per_s": cache,
        "sizes": results,
        "configs": configs_res,
        "check": chk,
        "working_copy": copy_res,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\n{info['wall_s']:.0f} s, peak RSS {info['peak_rss_bytes'] / 2**30:.1f} GiB; wrote {args.out}")
    if chk is not None and not chk["ok"]:
        sys.exit(1)
    if copy_res is not None and not all(r["working_copy_equals_master_cast"] for r in copy_res["sizes"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
