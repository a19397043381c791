"""How well the simulator predicts shfx on the emulated device, and whether the tuner picks well.

What is measured. One GPT (``shfx.models.GPT``) is trained on ``shfx.EmulatedDevice`` at three
link speeds chosen from the model's own measured costs so that they really are

* ``compute``-bound: a stage's PREFETCH takes ~0.1x its FORWARD,
* ``balanced``: a PREFETCH takes ~1x a FORWARD,
* ``link``-bound: a PREFETCH takes ~4x a FORWARD

(``--ratios``; or give bandwidths with ``--links``), and at every window W = 1 .. number of
stages. Per link speed the costs are profiled ONCE with ``shfx.profiler.profile_costs`` on that
device (what ``window="auto"`` uses), and every W is predicted with
``shfx.cost_model.simulate(cm.program, costs)``. Per (link, W) row the script reports the predicted
and the measured step time (median of the measured steps; ``cm.engine.step_times``: first
train forward -> end of ``cm.step()``), the error, the predicted bottleneck, the predicted slot
pool (``timeline.slot_bytes``) against the runtime's (``pool.total_bytes``,
which must be equal), and the predicted peak device memory (plus the inputs, as the tuner
counts them) against ``cm.backend.peak_bytes`` (information: the simulator leaves out some of
what the emulated device accounts).

Then the tuner: per link speed a model compiled with ``window="auto"`` (a fresh profile, taken
at its first call as a user's would be), its chosen W, its measured step time against the best
measured fixed W (target: within 5%), and whether it picks W <= 2 on the fast link and a larger
W on the slow one.

Done-criteria (from the issue): |error| <= 10% on every row, slot pool exact, tuner within 5%.

How it copes with a shared machine. All compiled models live at once and the measured steps are
interleaved: in every round each configuration runs ``--burst`` steps, in a fresh random order,
so drift and bursts of other load spread over all rows alike; the medians are reported with
their interquartile range. The load average (start, end) and the share of the CPUs other
processes used during the measurement are written with the results; rerun on a quiet machine
when those are high. After the measurement each link speed is profiled again (uncached) to
show how much the profile itself moves.

The analysis (per row, from the traces of the measured steps, ``cm.engine.trace``, with
:mod:`shfx.cost_model.trace`): how long
the step spends outside any action (before the first, after the last), the forward->backward
transition, the hand-off latency of each action (its start minus the moment its stream and its
dependencies were free), and the compute time in the measured run against the profile. Two
replays of the simulator locate the error: ``in situ`` uses the durations the actions actually
had in that run (so the rest of the error is what the simulator does not model: hand-offs,
transitions, issue overhead) and ``in situ + overheads`` also adds the measured per-action
hand-off latency, the transition and the lead/tail outside the actions.

Run from the repository root::

    python benchmarks/sim_accuracy.py            # all W at 3 link speeds, ~3-5 min on 2 cores
    python benchmarks/sim_accuracy.py --quick    # W in {1, 2, 4, N}, 6 steps, ~1-2 min (longer under load)
    python benchmarks/sim_accuracy.py --size 8,192,64,4 --steps 30
    python benchmarks/sim_accuracy.py --links 4GB/s,400MB/s,100MB/s --windows 1,2,3,8

Results go to ``benchmarks/results/sim_accuracy.json`` (``--out``), with machine information.
"""

from __future__ import annotations

import argparse
import copy
import gc
import datetime as _dt
import json
import os
import platform
import random
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import shfx  # noqa: E402
from shfx.cost_model.costs import CostTable, Links, StageCost  # noqa: E402
from shfx.cost_model.simulate import Timeline, simulate  # noqa: E402
from shfx.cost_model.trace import StepTrace, analyse_steps, compute_vs_profile, idle_before, in_situ_costs  # noqa: E402
from shfx.passes.capture import flatten_inputs  # noqa: E402
from shfx.passes.program import ActionKind, Program  # noqa: E402
from shfx.passes.units import format_bandwidth, parse_bandwidth  # noqa: E402
from shfx.models import GPT, GPTShape  # noqa: E402
from shfx.profiler import clear_cache, profile_costs  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")

TARGET_ERROR = 0.10  # |predicted / measured - 1| per row
TARGET_TUNER = 0.05  # the tuner's choice vs the best measured W
LINK_NAMES = ("compute", "balanced", "link")
DEFAULT_RATIOS = (0.1, 1.0, 4.0)  # a block's PREFETCH time / its FORWARD time
MEMORY = "2GiB"  # every window fits: the tuner chooses by time only
LR = 1e-4
COLD_GAP_S = 0.010  # the cold probe's PREFETCH time of a block
IDLE_S = 0.004  # what-if cold-start rule: compute after >= this idle gap runs at its cold cost


# ---- configurations ---------------------------------------------------------------------------
@dataclass
class Row:
    """One compiled model: a link speed and a window (an int, or "auto")."""

    link: str
    bps: float
    window: int | str
    cm: Any = None
    times: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    others: list[float] = field(default_factory=list)  # per step: share of the CPUs other processes used
    traces: list[StepTrace] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.link}/W={self.window}"


def model_config(size: tuple[int, int, int, int]) -> GPTShape:
    layers, hidden, seq, _ = size
    return GPTShape(vocab=256, seq=seq, layers=layers, heads=max(1, hidden // 64), hidden=hidden)


def make_batch(size: tuple[int, int, int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    shape = (size[3], size[2])
    return torch.randint(0, 256, shape, generator=g), torch.randint(0, 256, shape, generator=g)


def device(bps: float | None) -> shfx.EmulatedDevice:
    return shfx.EmulatedDevice(memory=MEMORY, h2d=bps, d2h=bps)


def compile_row(base: GPT, bps: float | None, window: int | str) -> Any:
    return shfx.compile(copy.deepcopy(base), device=device(bps), window=window, optimizer=shfx.optim.AdamW(lr=LR))


def train_step(row: Row, batch: tuple[torch.Tensor, torch.Tensor], record: bool) -> None:
    cm = row.cm
    if record:
        cm.backend.reset_peak()
    with Others() as o:
        loss = cm(*batch)
        loss.backward()
        cm.step()
        end = time.perf_counter()
    if record:
        t = cm.engine.step_times[-1]
        row.times.append(t)
        row.peaks.append(cm.backend.peak_bytes)
        row.traces.append(StepTrace(end - t, end, list(cm.engine.trace)))
        row.others.append(o.share if o.share is not None else 0.0)
    cm.zero_grad()


# ---- machine load -----------------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_NCPU = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
QUIET = 0.10  # a step is "quiet" when other processes used less than this share of the CPUs


def _busy_ticks() -> int | None:
    """CPU time used by everything on the machine so far (clock ticks), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(v) - v[3] - (v[4] if len(v) > 4 else 0)


def _own_ticks() -> int:
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            st = f.read().rsplit(")", 1)[1].split()
        return int(st[11]) + int(st[12])
    except (OSError, IndexError, ValueError):
        return 0


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


class Others:
    """Share of the CPUs that other processes used while the block ran (from /proc/stat)."""

    def __enter__(self) -> Others:
        self.b0, self.o0, self.t0 = _busy_ticks(), _own_ticks(), time.perf_counter()
        self.share: float | None = None
        return self

    def __exit__(self, *exc: Any) -> None:
        b1, o1, t1 = _busy_ticks(), _own_ticks(), time.perf_counter()
        if self.b0 is not None and b1 is not None and t1 > self.t0:
            self.share = max(0.0, (b1 - self.b0 - (o1 - self.o0)) / _TICK / ((t1 - self.t0) * _NCPU))


def wait_quiet(timeout_s: float) -> tuple[float, float | None]:
    """Wait (up to ``timeout_s``) until other processes use < QUIET of the CPUs over 0.5 s;
    returns (seconds waited, the last share)."""
    t0 = time.perf_counter()
    share = None
    while True:
        with Others() as o:
            time.sleep(0.5)
        share = o.share
        if share is None or share < QUIET or time.perf_counter() - t0 >= timeout_s:
            return time.perf_counter() - t0, share


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shfx": getattr(shfx, "__version__", "?"),
        "torch_threads": torch.get_num_threads(),
        "os_cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu,
        "platform": platform.platform(),
        "loadavg_at_start": loadavg(),
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY") if k in os.environ},
    }


# ---- statistics -------------------------------------------------------------------------------
def summarize(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
    return {"median": statistics.median(s), "p25": q[0], "p75": q[2], "min": s[0], "max": s[-1], "n": len(s)}


def quiet_times(row: Row, steps: int) -> list[float]:
    """The step times measured while other processes used < QUIET of the CPUs; empty when
    fewer than a third of the steps (at least 3) were quiet."""
    xs = [t for t, o in zip(row.times, row.others) if o < QUIET]
    return xs if len(xs) >= max(3, steps // 3) else []


def med(xs: list[float], default: float = 0.0) -> float:
    return statistics.median(xs) if xs else default


# ---- link speeds ------------------------------------------------------------------------------
def block_stages(graph: Any) -> list[int]:
    """The stages with the largest slot (the transformer blocks)."""
    big = max(s.prefetch_bytes for s in graph.specs)
    return [s.index for s in graph.specs if s.prefetch_bytes == big]


def nice(bps: float) -> float:
    """Round to 2 significant digits."""
    e = 10 ** (len(str(int(bps))) - 2)
    return round(bps / e) * e


def quiet_profile(cm: Any, inputs: list[torch.Tensor], tries: int, wait_s: float, cache: bool = False) -> tuple[CostTable, list[dict[str, Any]]]:
    """``profile_costs`` taken in a quiet moment: wait for one (up to ``wait_s``), watch the
    other processes during the profile and take it again if they were busy (at most ``tries``);
    returns the quietest profile and the attempts. A profile is a snapshot of ~1 s: taken while
    another process holds a CPU, every compute cost comes out ~1.5x too high."""
    best: tuple[float, CostTable] | None = None
    attempts: list[dict[str, Any]] = []
    for k in range(tries):
        waited, _ = wait_quiet(wait_s)
        with Others() as o:
            c = profile_costs(cm.engine, cm.variant, inputs, cache=cache and k == 0)
        share = o.share or 0.0
        attempts.append({"waited_s": waited, "others_cpu_share": share})
        if best is None or share < best[0]:
            best = (share, c)
        if share < QUIET:
            break
    assert best is not None
    return best[1], attempts


def choose_links(cm: Any, inputs: list[torch.Tensor], ratios: tuple[float, ...], args: argparse.Namespace, log) -> tuple[list[float], dict[str, Any]]:
    """Bandwidths that make a block's PREFETCH take ``ratio`` x its FORWARD, from a profile of
    ``cm`` on an unthrottled emulated device."""
    costs, attempts = quiet_profile(cm, inputs, args.tries, args.quiet_wait)
    g = cm.variant.graph
    blocks = block_stages(g)
    fwd = med([costs.costs[i].forward_s for i in blocks])
    bwd = med([costs.costs[i].backward_s for i in blocks])
    nbytes = g.specs[blocks[0]].prefetch_bytes
    bws = [nice(nbytes / (r * fwd)) for r in ratios]
    info = {
        "block_forward_s": fwd,
        "block_backward_s": bwd,
        "block_prefetch_bytes": nbytes,
        "ratios": list(ratios),
        "bandwidths_Bps": bws,
        "attempts": attempts,
    }
    log(
        f"calibration: a block's forward {fwd * 1e3:.2f} ms, backward (with recompute) {bwd * 1e3:.2f} ms, "
        f"prefetch {nbytes / 2**20:.2f} MiB -> " + ", ".join(f"{r:g}x: {format_bandwidth(b)}" for r, b in zip(ratios, bws))
    )
    return bws, info


def mixed_costs(warm: CostTable, cold: CostTable, links: Links, cold_f: set[int], cold_b: set[int]) -> CostTable:
    """Warm stage costs, except the cold ones' FORWARD / BACKWARD from ``cold``."""
    out = []
    for i, (w, c) in enumerate(zip(warm.costs, cold.costs)):
        f = c.forward_s if i in cold_f else w.forward_s
        src = c if i in cold_b else w
        out.append(StageCost(f, src.backward_s, backward_kept_s=src.backward_kept_s, update_s=w.update_s, accumulate_s=w.accumulate_s))
    return CostTable(out, links, optimizer_workers=warm.optimizer_workers, source="what-if")


def simulate_cold_start(program: Program, warm: CostTable, cold: CostTable, links: Links, idle_s: float) -> tuple[Timeline, int]:
    """What a simulator with a cold-start rule would predict: a compute action that starts after
    the compute stream idled >= ``idle_s`` takes its cold cost (emulated with the public API by
    iterating to a fixed point: per stage, its FORWARD and its BACKWARD are cold or warm).
    Returns the timeline and the number of cold actions."""
    cold_f: set[int] = set()
    cold_b: set[int] = set()
    tl = simulate(program, mixed_costs(warm, cold, links, cold_f, cold_b))
    for _ in range(8):
        nf: set[int] = set()
        nb: set[int] = set()
        marks = [0.0]
        for e in tl.events:
            marks += [e.start, e.end] + [t for t in (e.copy_end, e.host_start) if t is not None]
        for e, gap in idle_before(tl.events, marks, 0.0):
            if gap >= idle_s:
                (nf if e.kind == ActionKind.FORWARD else nb).add(int(e.action.lstrip("FB")))
        if nf == cold_f and nb == cold_b:
            break
        cold_f, cold_b = nf, nb
        tl = simulate(program, mixed_costs(warm, cold, links, cold_f, cold_b))
    return tl, len(cold_f) + len(cold_b)


# ---- the analysis of measured traces (shfx.cost_model.trace) -----------------------------------
def analyse_row(row: Row, costs: CostTable, tl: Timeline, steps: int, warm: CostTable, idle_s: float) -> dict[str, Any]:
    """A row's measured steps (its quiet ones, when enough were quiet) against its program and
    profile, as the results file has them."""
    program = row.cm.program
    traces = row.traces
    if quiet_times(row, steps):
        traces = [t for t, o in zip(row.traces, row.others) if o < QUIET]
    a = analyse_steps(program, traces)
    insitu = simulate(program, in_situ_costs(program, costs, traces, overheads=False)).step_s
    with_ovh = simulate(program, in_situ_costs(program, costs, traces, overheads=True)).step_s + a.lead_s + a.tail_s
    return {
        "lead_s": a.lead_s,
        "tail_s": a.tail_s,
        "transition_s": a.transition_s,
        "handoff_median_s": dict(a.handoff_median_s),
        "handoff_total_s": dict(a.handoff_per_step_s),
        "compute_busy_measured_s": a.compute_busy_s,
        "compute_busy_predicted_s": tl.busy_s["compute"],
        "compute_vs_warm_profile": asdict(compute_vs_profile(program, traces, warm, idle_s)),
        "pred_in_situ_s": insitu,
        "pred_in_situ_overheads_s": with_ovh,
    }


# ---- the run ------------------------------------------------------------------------------------
def parse_size(s: str) -> tuple[int, int, int, int]:
    parts = tuple(int(x) for x in s.split(","))
    if len(parts) != 4:
        raise argparse.ArgumentTypeError("--size is layers,hidden,seq,batch")
    return parts  # type: ignore[return-value]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=(6, 256, 64, 4), help="layers,hidden,seq,batch (default 6,256,64,4)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per configuration (default 20; --quick 6)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured steps per configuration (default 3; --quick 2)")
    p.add_argument("--burst", type=int, default=2, help="consecutive steps per configuration in each round (default 2)")
    p.add_argument("--ratios", default=None, help="PREFETCH/FORWARD time ratios of the 3 links (default 0.1,1,4)")
    p.add_argument("--links", default=None, help="bandwidths instead of ratios, e.g. 4GB/s,400MB/s,100MB/s")
    p.add_argument("--windows", default=None, help="windows to run, e.g. 1,2,4,8 (default all; --quick 1,2,4,N)")
    p.add_argument("--no-auto", action="store_true", help="skip the window='auto' runs")
    p.add_argument("--quick", action="store_true", help="fewer windows and steps (~1 minute)")
    p.add_argument("--tries", type=int, default=3, help="profiles to take at most when other processes disturb one (default 3)")
    p.add_argument("--quiet-wait", type=float, default=None, help="seconds to wait for a quiet machine before a profile (default 10; --quick 3)")
    p.add_argument("--wait-budget", type=float, default=None, help="seconds the measurement may wait in total for other processes to go quiet (default 60; --quick 15)")
    p.add_argument("--topup-budget", type=float, default=None, help="seconds of extra rounds for configurations with too few quiet steps (default 60; --quick 10)")
    p.add_argument("--idle", type=float, default=IDLE_S, help=f"what-if cold-start rule: idle gap (s) after which compute is cold (default {IDLE_S})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sim_accuracy.json"))
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    a.steps = a.steps if a.steps is not None else (6 if a.quick else 20)
    a.warmup = a.warmup if a.warmup is not None else 2 if a.quick else 3
    a.quiet_wait = a.quiet_wait if a.quiet_wait is not None else 3.0 if a.quick else 10.0
    a.wait_budget = a.wait_budget if a.wait_budget is not None else 15.0 if a.quick else 60.0
    a.topup_budget = a.topup_budget if a.topup_budget is not None else 10.0 if a.quick else 60.0
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    info = machine_info()
    log(f"torch {info['torch']}, {info['torch_threads']} threads, {info['affinity_cpus']} CPUs; load average {info['loadavg_at_start']}")
    torch.manual_seed(args.seed)
    size = args.size
    base = GPT(model_config(size))
    batch = make_batch(size, args.seed)
    inputs = flatten_inputs(batch, {}, True)[0]

    # two probes for the what-if analysis (and the calibration): W=1 on an unthrottled device
    # (compute profiled "warm": no idle gap before any action) and on a link slow enough that
    # every compute action follows an idle gap of COLD_GAP_S (profiled "cold")
    warm_probe = Row("warm probe", 0.0, 1, compile_row(base, None, 1))
    for _ in range(args.warmup):
        train_step(warm_probe, batch, False)
    graph = warm_probe.cm.variant.graph
    n_stages = len(graph.stages)
    specs = graph.specs
    block_bytes = specs[block_stages(graph)[0]].prefetch_bytes
    if args.links:
        bws = [float(parse_bandwidth(x)) for x in args.links.split(",")]
        cal = {"bandwidths_Bps": bws, "given": True}
    else:
        ratios = tuple(float(x) for x in args.ratios.split(",")) if args.ratios else DEFAULT_RATIOS
        bws, cal = choose_links(warm_probe.cm, inputs, ratios, args, log)
    names = list(LINK_NAMES) if len(bws) == 3 else [f"link{i}" for i in range(len(bws))]
    cold_bps = nice(block_bytes / COLD_GAP_S)
    cold_probe = Row("cold probe", cold_bps, 1, compile_row(base, cold_bps, 1))
    for _ in range(args.warmup):
        train_step(cold_probe, batch, False)

    # build every configuration; they stay alive so their steps can be interleaved
    rows: list[Row] = []
    if args.windows:
        windows = sorted({min(int(w), n_stages) for w in args.windows.split(",")})
    elif args.quick:
        windows = sorted({1, 2, min(4, n_stages), n_stages})
    else:
        windows = list(range(1, n_stages + 1))
    for name, bps in zip(names, bws):
        for w in windows:
            rows.append(Row(name, bps, w))
    log(f"GPT {size[0]} layers, hidden {size[1]}, seq {size[2]}, batch {size[3]}: {n_stages} stages; "
        f"links {', '.join(f'{n} {format_bandwidth(b)}' for n, b in zip(names, bws))}; windows {windows}")
    for r in rows:
        r.cm = compile_row(base, r.bps, r.window)
        for _ in range(args.warmup):
            train_step(r, batch, False)
    # The compiled models hold millions of Python objects (their FX graphs); a full collection
    # then takes long enough to disturb a timed action. Collect once and move them to the
    # permanent generation, then warm up again (a collection hands memory back to the OS).
    t_gc = time.perf_counter()
    gc.collect()
    gc_full_s = time.perf_counter() - t_gc
    gc.freeze()
    for r in rows + [warm_probe, cold_probe]:
        train_step(r, batch, False)
    log(f"compiled and warmed up {len(rows)} fixed-window configurations (a full gc took {gc_full_s * 1e3:.0f} ms; frozen)")

    # one profile per link speed (the first one is cached, as window="auto" and cm.report() use
    # it; a disturbed one is retaken, see quiet_profile)
    costs: dict[str, CostTable] = {}
    prof_info: dict[str, Any] = {}
    for name in names:
        r = next(x for x in rows if x.link == name)
        costs[name], prof_info[name] = quiet_profile(r.cm, inputs, args.tries, args.quiet_wait, cache=True)
        c = costs[name]
        blocks = block_stages(r.cm.variant.graph)
        log(
            f"profile {name} (W={r.window}, others {100 * prof_info[name][-1]['others_cpu_share']:.0f}%, "
            f"{len(prof_info[name])} tries): block F {med([c.costs[i].forward_s for i in blocks]) * 1e3:.2f} ms, "
            f"B {med([c.costs[i].backward_s for i in blocks]) * 1e3:.2f} ms; h2d {format_bandwidth(c.links.h2d_bps)}, "
            f"d2h {format_bandwidth(c.links.d2h_bps)}, latency {c.links.latency_s * 1e6:.0f} us, duplex {c.links.duplex}"
        )
    probes: dict[str, CostTable] = {}
    for pr in (warm_probe, cold_probe):
        probes[pr.link], prof_info[pr.link] = quiet_profile(pr.cm, inputs, args.tries, args.quiet_wait)
        c = probes[pr.link]
        log(
            f"profile {pr.link} ({'unthrottled' if not pr.bps else format_bandwidth(pr.bps)}): block F "
            f"{med([c.costs[i].forward_s for i in block_stages(graph)]) * 1e3:.2f} ms, "
            f"B {med([c.costs[i].backward_s for i in block_stages(graph)]) * 1e3:.2f} ms"
        )

    # the tuner: a fresh model per link speed, profiled at its first call
    autos: list[Row] = []
    if not args.no_auto:
        for name, bps in zip(names, bws):
            attempts = []
            for k in range(args.tries):
                waited, _ = wait_quiet(args.quiet_wait)
                clear_cache()  # its own profile, taken at the first call as a user's would be
                r = Row(name, bps, "auto")
                with Others() as o:
                    r.cm = compile_row(base, bps, "auto")
                    train_step(r, batch, False)  # capture, profile, tune, first step
                attempts.append({"waited_s": waited, "others_cpu_share": o.share, "chose": r.cm.program.num_slots})
                if (o.share or 0) < QUIET or k == args.tries - 1:
                    break
                r.cm.close()
            prof_info[f"{name}/auto"] = attempts
            for _ in range(args.warmup):
                train_step(r, batch, False)
            autos.append(r)
            log(
                f"window='auto' on the {name} link chose W={r.cm.program.num_slots} (others "
                f"{100 * (attempts[-1]['others_cpu_share'] or 0):.0f}% during its profile, {len(attempts)} tries)"
            )

    # measure: rounds of bursts, interleaved in a fresh random order per round
    everything = rows + autos
    gc_pauses: list[tuple[int, float]] = []
    gc_t0 = [0.0]

    def on_gc(phase: str, gc_info: dict[str, int]) -> None:
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            gc_pauses.append((gc_info["generation"], time.perf_counter() - gc_t0[0]))

    gc.callbacks.append(on_gc)
    rng = random.Random(args.seed)
    busy0, own0, wall0 = _busy_ticks(), _own_ticks(), time.perf_counter()
    load_during = [loadavg()]
    rounds = -(-args.steps // args.burst)
    waiting = {"budget_s": args.wait_budget, "waited_s": 0.0, "extra_rounds": 0}
    last_share = [0.0]

    def burst(r: Row, n: int) -> None:
        # after a step that other processes disturbed, wait (within the budget) for quiet
        if last_share[0] >= QUIET and waiting["waited_s"] < args.wait_budget:
            w, _ = wait_quiet(min(5.0, args.wait_budget - waiting["waited_s"]))
            waiting["waited_s"] += w
        # no gc.collect() here: a full collection before a step makes that step ~20% slower
        # (freed memory goes back to the OS and the step faults it in again)
        for _ in range(n):
            train_step(r, batch, True)
            last_share[0] = r.others[-1]

    for k in range(rounds):
        order = everything[:]
        rng.shuffle(order)
        for r in order:
            burst(r, min(args.burst, args.steps - len(r.times)))
        if args.verbose or k == rounds - 1 or k % max(1, rounds // 4) == 0:
            log(f"round {k + 1}/{rounds} done; load average {loadavg()}")
        load_during.append(loadavg())
    # top up the configurations with too few quiet steps, within the time budget
    t_top = time.perf_counter()
    while time.perf_counter() - t_top < args.topup_budget:
        short = [r for r in everything if sum(o < QUIET for o in r.others) < (2 * args.steps) // 3]
        if not short:
            break
        rng.shuffle(short)
        for r in short:
            if time.perf_counter() - t_top >= args.topup_budget:
                break
            burst(r, args.burst)
        waiting["extra_rounds"] += 1
    if waiting["extra_rounds"]:
        log(f"{waiting['extra_rounds']} extra rounds for configurations with too few quiet steps; load average {loadavg()}")
    busy1, own1, wall1 = _busy_ticks(), _own_ticks(), time.perf_counter()
    gc.callbacks.remove(on_gc)
    ncpu = info["affinity_cpus"] or os.cpu_count() or 1
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    others_share = None
    if busy0 is not None and busy1 is not None:
        others_share = max(0.0, (busy1 - busy0 - (own1 - own0)) / tick / ((wall1 - wall0) * ncpu))
    own_share = (own1 - own0) / tick / ((wall1 - wall0) * ncpu)

    # re-profile each link (uncached) after the measurement: how much does a profile move?
    reprof: dict[str, CostTable] = {}
    for name in names:
        r = next(x for x in rows if x.link == name)
        waited, _ = wait_quiet(args.quiet_wait)
        with Others() as o:
            reprof[name] = profile_costs(r.cm.engine, r.cm.variant, inputs, cache=False)
        prof_info[f"{name}/reprofile"] = [{"waited_s": waited, "others_cpu_share": o.share}]

    # predictions and rows
    reserve = sum(t.numel() * t.element_size() for t in inputs)
    out_rows: list[dict[str, Any]] = []
    for r in rows:
        cm = r.cm
        tl = simulate(cm.program, costs[r.link])
        tl2 = simulate(cm.program, reprof[r.link])
        m_all = summarize(r.times)
        quiet = quiet_times(r, args.steps)
        m = summarize(quiet) if quiet else m_all
        pool = cm.engine.pool.total_bytes
        a = analyse_row(r, costs[r.link], tl, args.steps, probes["warm probe"], args.idle)
        links = costs[r.link].links
        tl_warm = simulate(cm.program, CostTable(probes["warm probe"].costs, links, optimizer_workers=costs[r.link].optimizer_workers))
        tl_cs, n_cold = simulate_cold_start(cm.program, probes["warm probe"], probes["cold probe"], links, args.idle)
        out_rows.append(
            {
                "link": r.link,
                "bandwidth_Bps": r.bps,
                "window": cm.program.num_slots,
                "predicted_s": tl.step_s,
                "predicted_reprofile_s": tl2.step_s,
                "measured": m,
                "measured_over": "quiet steps" if quiet else "all steps",
                "measured_s": m["median"],
                "error": tl.step_s / m["median"] - 1,
                "others_cpu_share_median": med(r.others),
                "measured_all": m_all,
                "error_all": tl.step_s / m_all["median"] - 1,
                "error_reprofile": tl2.step_s / m["median"] - 1,
                "what_if": {
                    "warm_compute_s": tl_warm.step_s,
                    "warm_compute_error": tl_warm.step_s / m["median"] - 1,
                    "cold_start_s": tl_cs.step_s,
                    "cold_start_error": tl_cs.step_s / m["median"] - 1,
                    "cold_actions": n_cold,
                },
                "bottleneck": tl.bottleneck,
                "by_resource_s": tl.by_resource,
                "busy_s": tl.busy_s,
                "slot_pool_predicted": tl.slot_bytes,
                "slot_pool_actual": pool,
                "slot_pool_exact": tl.slot_bytes == pool,
                "peak_predicted": tl.peak_device_bytes + reserve,
                "peak_measured": max(r.peaks),
                "peak_measured_min": min(r.peaks),
                "analysis": a,
                "step_times_s": r.times,
            }
        )

    # the tuner
    tuner: list[dict[str, Any]] = []
    for r in autos:
        rep = r.cm.report()
        chosen = rep.window
        fixed = [x for x in out_rows if x["link"] == r.link]
        best = min(fixed, key=lambda x: x["measured_s"])
        at_chosen = next((x for x in fixed if x["window"] == chosen), None)
        quiet = quiet_times(r, args.steps)
        m = summarize(quiet or r.times)
        tuner.append(
            {
                "link": r.link,
                "bandwidth_Bps": r.bps,
                "chosen": chosen,
                "predicted_s": rep.predicted_s,
                "predicted_by_window_s": {row.window: row.step_s for row in rep.tune.rows},
                "reason": rep.tune.reason,
                "measured_auto": m,
                "measured_fixed_at_chosen_s": at_chosen["measured_s"] if at_chosen else None,
                "best_measured_window": best["window"],
                "best_measured_s": best["measured_s"],
                "vs_best": m["median"] / best["measured_s"] - 1,
                "vs_best_fixed": (at_chosen["measured_s"] / best["measured_s"] - 1) if at_chosen else None,
                "within_5pct": m["median"] <= best["measured_s"] * (1 + TARGET_TUNER)
                or (at_chosen is not None and at_chosen["measured_s"] <= best["measured_s"] * (1 + TARGET_TUNER)),
            }
        )

    info["loadavg_at_end"] = loadavg()
    info["loadavg_during"] = load_during
    info["others_cpu_share_during_measurement"] = others_share
    info["measurement_waiting"] = waiting
    info["gc_during_measurement"] = {
        f"gen{g}": {"count": sum(1 for x, _ in gc_pauses if x == g), "total_s": sum(t for x, t in gc_pauses if x == g),
                    "max_s": max((t for x, t in gc_pauses if x == g), default=0.0)}
        for g in (0, 1, 2)
    }
    info["gc_full_collection_before_freeze_s"] = gc_full_s
    info["quiet_steps"] = sum(o < QUIET for r in everything for o in r.others)
    info["measured_steps"] = sum(len(r.others) for r in everything)
    info["own_cpu_share_during_measurement"] = own_share
    ok_err = all(abs(x["error"]) <= TARGET_ERROR for x in out_rows)
    ok_slot = all(x["slot_pool_exact"] for x in out_rows)
    ok_tune = all(t["within_5pct"] for t in tuner) if tuner else None
    shape = None
    if len(tuner) == 3:
        shape = tuner[0]["chosen"] <= 2 and tuner[2]["chosen"] > 2
    def spread(errs: list[float]) -> dict[str, float]:
        a = sorted(abs(e) for e in errs)
        return {"median_abs": statistics.median(a), "max_abs": a[-1], "within_10pct": sum(e <= TARGET_ERROR for e in a)}

    summary = {
        "rows_measured_over_quiet_steps": sum(x["measured_over"] == "quiet steps" for x in out_rows),
        "error": spread([x["error"] for x in out_rows]),
        "error_reprofile": spread([x["error_reprofile"] for x in out_rows]),
        "error_in_situ": spread([x["analysis"]["pred_in_situ_s"] / x["measured_s"] - 1 for x in out_rows]),
        "error_in_situ_overheads": spread([x["analysis"]["pred_in_situ_overheads_s"] / x["measured_s"] - 1 for x in out_rows]),
        "error_what_if_warm": spread([x["what_if"]["warm_compute_error"] for x in out_rows]),
        "error_what_if_warm_cold_start": spread([x["what_if"]["cold_start_error"] for x in out_rows]),
        "max_abs_error": max(abs(x["error"]) for x in out_rows),
        "rows_within_10pct": sum(abs(x["error"]) <= TARGET_ERROR for x in out_rows),
        "rows": len(out_rows),
        "all_within_10pct": ok_err,
        "slot_pool_exact": ok_slot,
        "tuner_within_5pct": ok_tune,
        "tuner_small_W_fast_link_large_W_slow_link": shape,
    }
    disturbed = {
        k: round(v[-1]["others_cpu_share"], 2)
        for k, v in {**prof_info, **({"calibration": cal["attempts"]} if "attempts" in cal else {})}.items()
        if min(a["others_cpu_share"] or 0.0 for a in v) >= QUIET
    }
    summary["disturbed_profiles"] = disturbed
    print_table(out_rows, tuner, info, summary)
    if disturbed:
        print(
            "WARNING: other processes used >= 10% of the CPUs during every try of these profiles (share): "
            + ", ".join(f"{k} {100 * v:.0f}%" for k, v in disturbed.items())
            + ". Their compute costs are too high (up to ~1.5x); rerun on a quieter machine."
        )
    doc = {
        "benchmark": "sim_accuracy",
        "args": {k: v for k, v in vars(args).items()},
        "machine": info,
        "model": {"layers": size[0], "hidden": size[1], "seq": size[2], "batch": size[3], "stages": n_stages},
        "stages": [
            {"index": s.index, "name": s.name, "prefetch_bytes": s.prefetch_bytes, "grad_bytes": s.grad_bytes, "activation_bytes": s.activation_bytes}
            for s in specs
        ],
        "calibration": cal,
        "links": {n: b for n, b in zip(names, bws)},
        "profile_attempts": prof_info,
        "profiles": {n: table_dict(costs[n]) for n in names},
        "probe_profiles": {n: table_dict(c) for n, c in probes.items()},
        "cold_probe_bandwidth_Bps": cold_bps,
        "reprofiles": {n: table_dict(reprof[n]) for n in names},
        "rows": out_rows,
        "tuner": tuner,
        "summary": summary,
        "wall_s": time.perf_counter() - t_start,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    log(f"wrote {args.out}")
    for r in everything + [warm_probe, cold_probe]:
        r.cm.close()
    return 0


def table_dict(c: CostTable) -> dict[str, Any]:
    return {
        "stages": [
            {"forward_s": s.forward_s, "backward_s": s.backward_s, "backward_kept_s": s.backward_kept_s, "update_s": s.update_s}
            for s in c.costs
        ],
        "links": {"h2d_bps": c.links.h2d_bps, "d2h_bps": c.links.d2h_bps, "duplex": c.links.duplex, "latency_s": c.links.latency_s},
        "optimizer_workers": c.optimizer_workers,
    }


def print_table(rows: list[dict[str, Any]], tuner: list[dict[str, Any]], info: dict[str, Any], summary: dict[str, Any]) -> None:
    ms = 1e3
    print()
    print(
        f"load average start {info['loadavg_at_start']}, end {info['loadavg_at_end']}; other processes used "
        f"{100 * (info['others_cpu_share_during_measurement'] or 0):.0f}% of the CPUs during the measurement"
    )
    head = (
        f"{'link':<9}{'W':>3} {'pred ms':>8} {'meas ms':>8} {'IQR ms':>12} {'error':>7} {'others':>6} "
        f"{'bottleneck':<11} {'slot pool MiB pred/actual':>26} {'peak MiB pred/meas':>19}"
    )
    print(head)
    print("-" * len(head))
    for x in rows:
        m = x["measured"]
        slot = f"{x['slot_pool_predicted'] / 2**20:.2f}/{x['slot_pool_actual'] / 2**20:.2f}{' ok' if x['slot_pool_exact'] else ' !!'}"
        print(
            f"{x['link']:<9}{x['window']:>3} {x['predicted_s'] * ms:8.1f} {x['measured_s'] * ms:8.1f} "
            f"{m['p25'] * ms:5.1f}-{m['p75'] * ms:<6.1f} {100 * x['error']:+6.1f}% {100 * x['others_cpu_share_median']:5.0f}% "
            f"{x['bottleneck']:<11} {slot:>26} {x['peak_predicted'] / 2**20:9.2f}/{x['peak_measured'] / 2**20:<9.2f}"
        )
    print(
        f"meas: median step time over the steps where other processes used < {100 * QUIET:.0f}% of the CPUs (all steps "
        "when fewer than a third were); IQR over the same steps; others: median share of the CPUs other processes "
        "used during a step; peak: predicted peak + the inputs, as the tuner counts it, vs cm.backend.peak_bytes."
    )
    print()
    print("where the error comes from (errors vs meas; compute ratios: measured duration / warm profiled cost)")
    head = (
        f"{'link':<9}{'W':>3} {'error':>7} {'all st.':>7} {'reprof':>7} {'in situ':>8} {'+ovh':>7} {'warm':>7} {'warm+cold':>9} "
        f"{'after busy':>11} {'after idle':>11} {'trans ms':>8} {'hand-off ms':>11} {'lead+tail':>9}"
    )
    print(head)
    print("-" * len(head))

    def ratio(v: float | None, n: int) -> str:
        return f"{v:.2f} ({n:>2})" if v is not None else "   -     "

    for x in rows:
        a = x["analysis"]
        w = x["what_if"]
        cv = a["compute_vs_warm_profile"]
        ho = sum(a["handoff_total_s"].values())
        print(
            f"{x['link']:<9}{x['window']:>3} {100 * x['error']:+6.1f}% {100 * x['error_all']:+6.1f}% {100 * x['error_reprofile']:+6.1f}% "
            f"{100 * (a['pred_in_situ_s'] / x['measured_s'] - 1):+7.1f}% {100 * (a['pred_in_situ_overheads_s'] / x['measured_s'] - 1):+6.1f}% "
            f"{100 * w['warm_compute_error']:+6.1f}% {100 * w['cold_start_error']:+8.1f}% "
            f"{ratio(cv['after_busy_ratio'], cv['after_busy_n']):>11} {ratio(cv['after_idle_ratio'], cv['after_idle_n']):>11} "
            f"{a['transition_s'] * ms:8.2f} {ho * ms:11.2f} {(a['lead_s'] + a['tail_s']) * ms:9.2f}"
        )
    print(
        "all st.: error vs the median of all steps; reprof: with a second profile taken after the measurement; "
        "in situ: the simulator replayed with the durations the actions had in the measured run; +ovh: in situ plus "
        "the measured hand-off latencies, forward->backward transition and lead/tail; warm: compute costs profiled "
        "on an unthrottled device (no idle gap before an action); warm+cold: warm, plus the cold-start rule (a "
        "compute action that follows >= 4 ms in which no action started or ended costs what the cold probe "
        "measured); after busy / after idle: per compute action, measured / warm profiled duration when no / some "
        "stretch of >= 4 ms without any action starting or ending preceded it (count); trans: forward->backward transition; hand-off: summed start latencies of actions "
        "whose stream and dependencies were free; lead+tail: step time before the first and after the last action."
    )
    if tuner:
        print()
        print(
            f"{'link':<9} {'chosen W':>8} {'pred ms':>8} {'auto meas ms':>12} {'vs best':>8} {'fixed W ms':>10} {'vs best':>8} "
            f"{'best W':>6} {'best ms':>8}  within 5%"
        )
        for t in tuner:
            fx = t["measured_fixed_at_chosen_s"]
            vf = "-" if t["vs_best_fixed"] is None else f"{100 * t['vs_best_fixed']:+.1f}%"
            print(
                f"{t['link']:<9} {t['chosen']:>8} {t['predicted_s'] * ms:8.1f} {t['measured_auto']['median'] * ms:12.1f} "
                f"{100 * t['vs_best']:+7.1f}% {'-' if fx is None else format(fx * ms, '.1f'):>10} {vf:>8} "
                f"{t['best_measured_window']:>6} {t['best_measured_s'] * ms:8.1f}  {'yes' if t['within_5pct'] else 'NO'}"
            )
        print(
            "auto meas: the window='auto' model (its own profile, taken at its first call); fixed W: the fixed-window "
            "model with the chosen W; best: the fastest fixed window measured; within 5%: either is."
        )
    print()
    print("|error| median / max / rows within 10%: " + "; ".join(
        f"{k.replace('error_', '') if k != 'error' else 'prediction'} {100 * v['median_abs']:.1f}% / {100 * v['max_abs']:.1f}% / {v['within_10pct']}"
        for k, v in summary.items() if k.startswith("error")
    ))
    print(
        f"measured over quiet steps: {summary['rows_measured_over_quiet_steps']}/{summary['rows']} rows ({info['quiet_steps']}/"
        f"{info['measured_steps']} steps quiet; waited {info['measurement_waiting']['waited_s']:.0f} s for quiet, "
        f"{info['measurement_waiting']['extra_rounds']} extra rounds); gc during the measurement: " + ", ".join(
            f"{k} {v['count']}x {1e3 * v['total_s']:.0f} ms (max {1e3 * v['max_s']:.1f})" for k, v in info["gc_during_measurement"].items()
        )
    )
    print(
        f"rows within 10%: {summary['rows_within_10pct']}/{summary['rows']} (max |error| {100 * summary['max_abs_error']:.1f}%); "
        f"slot pool exact: {summary['slot_pool_exact']}; tuner within 5%: {summary['tuner_within_5pct']}; "
        f"tuner W<=2 on the fast link and W>2 on the slow one: {summary['tuner_small_W_fast_link_large_W_slow_link']}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
