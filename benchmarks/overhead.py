"""shfx's runtime overhead on the CPU when nothing needs to be streamed.

What is measured: the wall time of one training step (forward + ``loss.backward()`` +
optimizer step + ``zero_grad``) of the same GPT (``shfx.models.GPT``), same seed, same data,
run two ways:

* ``shfx``: ``shfx.compile`` with every stage resident (``window`` >= number of stages) on an
  unthrottled emulated device (``EmulatedDevice(memory="64GiB", h2d=None, d2h=None)``): the
  copies are plain memcpys, compute runs on shfx's compute worker thread, the optimizer is the
  host AdamW (torch's fused kernel on flat per-stage buffers);
* ``eager``: plain PyTorch with every block of ``transformer.h`` wrapped in
  ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` (shfx also recomputes
  every block in backward, though in full, where torch's default early stop skips each block's
  last GEMM: ``--eager-full-recompute`` turns that off; embedding and head are not checkpointed)
  and ``torch.optim.AdamW(fused=True)``.

By default each runs in its own worker process (``--isolation process``) and the parent
alternates them step by step (the order inside each pair alternates too), so drift and the
noise of a shared machine hit both alike, while neither changes the other's threading: the
OpenMP runtime (libgomp) stops its workers from spin-waiting once a process has more OpenMP
threads than CPUs, which shfx's extra threads cause, and that would slow or speed an eager run
sharing its process. ``--isolation inprocess`` runs both in this process instead.

Reported per size, after warm-up steps: median, interquartile range and min of the per-step
wall times; process CPU time per step; the ratio of the medians (shfx / eager; target <= 1.05);
the median of the per-pair ratios; per-phase medians (forward / backward / step / zero_grad);
a breakdown of shfx's last step from ``cm.engine.trace``; the share of the CPUs other processes
used during each step pair and the ratio over the quiet pairs only; and the largest difference between
the two runs' losses (same initial weights, same data, same kernels: they should agree to
float rounding, usually exactly).

Run from the repository root (a few minutes on 2 cores)::

    python benchmarks/overhead.py                        # sizes tiny, small, medium; 20 steps
    python benchmarks/overhead.py --sizes micro,tiny,small --steps 30 --warmup 5
    python benchmarks/overhead.py --size 6,384,128,8     # custom: layers,hidden,seq,batch
    python benchmarks/overhead.py --isolation inprocess  # both in one process
    python benchmarks/overhead.py --omp-wait-policy passive   # robust to other load on the machine
    python benchmarks/overhead.py --eager-full-recompute # eager recomputes whole blocks, as shfx does

Results go to ``benchmarks/results/overhead.json`` (``--out`` to change), with machine info.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import shfx  # noqa: E402
from shfx.models import GPT, GPTShape  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")
warnings.filterwarnings("ignore", message=r"window=\d+ is more than")  # every stage resident on purpose

TARGET_RATIO = 1.05
QUIET_SHARE = 0.10  # a step pair is "quiet" if other processes used less than this share of the CPUs
LR = 1e-3
PHASES = ("forward", "backward", "step", "zero_grad")
RUNNERS = ("eager", "shfx")


@dataclass(frozen=True)
class Size:
    name: str
    n_layer: int
    n_embd: int
    seq: int
    batch: int
    n_head: int = 0  # 0: n_embd // 64

    def config(self) -> GPTShape:
        heads = self.n_head or max(1, self.n_embd // 64)
        return GPTShape(vocab=256, seq=self.seq, layers=self.n_layer, heads=heads, hidden=self.n_embd)


SIZES = {
    "tiny": Size("tiny", 2, 128, 64, 4),
    "small": Size("small", 4, 256, 128, 8),
    "medium": Size("medium", 8, 512, 256, 4),
    "large": Size("large", 12, 768, 256, 4),
    "micro": Size("micro", 8, 64, 16, 1),  # compute negligible: shows the fixed per-stage runtime cost
}


# ---- the eager baseline ------------------------------------------------------------------------
class Checkpointed(nn.Module):
    """Runs ``block`` under non-reentrant activation checkpointing.

    ``early_stop`` is torch's default: the recomputation in backward stops as soon as every
    tensor backward needs is recomputed, so a block's last ops (the MLP's output projection,
    dropout, residual add: nothing saves their results) are not run again. ``False`` recomputes
    the whole block, as shfx does.
    """

    def __init__(self, block: nn.Module, early_stop: bool = True):
        super().__init__()
        self.block = block
        self.early_stop = early_stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False, early_stop=self.early_stop)


def make_eager(model: GPT, early_stop: bool = True) -> GPT:
    """Wrap every block of ``model.transformer.h`` in :class:`Checkpointed` (in place)."""
    for i, blk in enumerate(model.transformer.h):
        model.transformer.h[i] = Checkpointed(blk, early_stop)
    return model


# ---- one runner: a model, its optimizer, the data ----------------------------------------------
def make_batches(size: Size, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed + 1)
    shape = (size.batch, size.seq)
    return [(torch.randint(0, 256, shape, generator=g), torch.randint(0, 256, shape, generator=g)) for _ in range(n)]


def weights_digest(model: nn.Module) -> str:
    h = hashlib.sha1()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.replace(".block.", ".").encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def trace_breakdown(trace: list) -> dict[str, Any]:
    """Summarize one step's ``cm.engine.trace``: time per action kind and stream, how busy the
    compute stream was and the gaps between its actions, and the span of the traced actions."""
    if not trace:
        return {}
    by_kind: dict[str, float] = {}
    by_stream: dict[str, float] = {}
    for e in trace:
        kind = "".join(c for c in e.action if c.isalpha())
        by_kind[kind] = by_kind.get(kind, 0.0) + (e.end - e.start)
        by_stream[e.stream] = by_stream.get(e.stream, 0.0) + (e.end - e.start)
    comp = sorted((e for e in trace if e.stream == "compute"), key=lambda e: e.start)
    return {
        "span_s": max(e.end for e in trace) - min(e.start for e in trace),
        "by_kind_s": by_kind,
        "by_stream_s": by_stream,
        "compute_busy_s": sum(e.end - e.start for e in comp),
        "compute_gaps_s": sum(max(0.0, b.start - a.end) for a, b in zip(comp, comp[1:])),
        "compute_actions_s": {e.action: e.end - e.start for e in comp},
    }


class Runner:
    """Builds ``kind`` ("eager" or "shfx") for ``size`` from ``seed`` and runs its steps."""

    def __init__(self, kind: str, size: Size, seed: int, total_steps: int, early_stop: bool = True):
        self.kind = kind
        cfg = size.config()
        torch.manual_seed(seed)
        model = GPT(cfg)
        self.digest = weights_digest(model)
        self.params = sum(p.numel() for p in model.parameters())
        self.batches = make_batches(size, total_steps, seed)
        self.cm = None
        if kind == "eager":
            self.model = make_eager(model, early_stop)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, fused=True)
        elif kind == "shfx":
            device = shfx.EmulatedDevice(memory="64GiB", h2d=None, d2h=None)
            # any window >= the number of stages (blocks + head + tail) keeps every stage resident
            self.cm = shfx.compile(
                model, device=device, window=cfg.layers + 16, optimizer=shfx.optim.AdamW(lr=LR),
                overlap_update=os.environ.get("SHFX_BENCH_OVERLAP", "1") == "1",
            )  # fmt: skip
            self.model = self.opt = self.cm
        else:
            raise ValueError(kind)

    def step(self, i: int) -> dict[str, Any]:
        x, y = self.batches[i]
        c0 = time.process_time()
        t0 = time.perf_counter()
        loss = self.model(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        self.opt.zero_grad()
        t4 = time.perf_counter()
        cpu = time.process_time() - c0
        return {"wall": t4 - t0, "cpu": cpu, "phases": dict(zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3))), "loss": float(loss.detach())}

    def finish(self) -> dict[str, Any]:
        out: dict[str, Any] = {"digest": self.digest, "params": self.params, "threads": torch.get_num_threads()}
        if self.cm is not None:
            out["stages"] = len(self.cm.stages.stages)
            out["window"] = self.cm.program.num_slots
            out["trace"] = trace_breakdown(self.cm.engine.trace)
            out["os_threads"] = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None
            self.cm.close()
        return out


def _worker(conn: Any, kind: str, size: Size, seed: int, total: int, threads: int | None, early_stop: bool) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")
    # every stage resident on purpose: a window larger than the stages says so, not needed here
    warnings.filterwarnings("ignore", message=r"window=\d+ is more than")
    if threads:
        torch.set_num_threads(threads)
    try:
        r = Runner(kind, size, seed, total, early_stop)
        conn.send(("ready", None))
        while True:
            cmd, arg = conn.recv()
            if cmd == "step":
                conn.send(("ok", r.step(arg)))
            elif cmd == "finish":
                conn.send(("ok", r.finish()))
                break
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # skip interpreter teardown: shfx's daemon stream threads and OpenMP pools may still be
    # alive, and tearing them down can abort noisily ("terminate called without an active exception")
    os._exit(0)


class _Remote:
    """A :class:`Runner` in a worker process (spawned, so it starts with fresh threads)."""

    def __init__(self, kind: str, size: Size, seed: int, total: int, threads: int | None, early_stop: bool):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, kind, size, seed, total, threads, early_stop), daemon=True)
        self.proc.start()
        self.kind = kind
        self._get()

    def _get(self) -> Any:
        status, val = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"{self.kind} worker failed: {val}")
        return val

    def step(self, i: int) -> dict[str, Any]:
        self.conn.send(("step", i))
        return self._get()

    def finish(self) -> dict[str, Any]:
        self.conn.send(("finish", None))
        out = self._get()
        self.proc.join(timeout=30)
        return out


# ---- measuring ---------------------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_ticks() -> int | None:
    """CPU time used by everything on the machine so far (clock ticks), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(v) - v[3] - (v[4] if len(v) > 4 else 0)  # all but idle and iowait


def _proc_ticks(pids: list[int]) -> int:
    n = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
            n += int(st[11]) + int(st[12])
        except (OSError, IndexError, ValueError):
            pass
    return n


def summarize(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
    return {
        "median": statistics.median(s),
        "p25": q[0],
        "p75": q[2],
        "iqr": q[2] - q[0],
        "min": s[0],
        "max": s[-1],
        "mean": statistics.fmean(s),
        "stdev": statistics.stdev(s) if len(s) >= 2 else 0.0,
    }


def bench_size(
    size: Size, steps: int, warmup: int, seed: int, isolation: str, threads: int | None, verbose: bool, early_stop: bool = True
) -> dict[str, Any]:
    total = warmup + steps
    if isolation == "process":
        runners: dict[str, Any] = {k: _Remote(k, size, seed, total, threads, early_stop) for k in RUNNERS}
    else:
        runners = {k: Runner(k, size, seed, total, early_stop) for k in RUNNERS}
    rec: dict[str, list[dict[str, Any]]] = {k: [] for k in RUNNERS}
    losses: dict[str, list[float]] = {k: [] for k in RUNNERS}
    pids = [os.getpid()] + ([runners[k].proc.pid for k in RUNNERS] if isolation == "process" else [])
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    others: list[float] = []  # per measured pair: share of the CPUs used by other processes
    for i in range(total):
        b0, p0, t0 = _busy_ticks(), _proc_ticks(pids), time.perf_counter()
        for k in RUNNERS if i % 2 == 0 else RUNNERS[::-1]:
            r = runners[k].step(i)
            losses[k].append(r["loss"])
            if i >= warmup:
                rec[k].append(r)
        b1, p1, t1 = _busy_ticks(), _proc_ticks(pids), time.perf_counter()
        if i >= warmup and b0 is not None and b1 is not None:
            others.append(max(0.0, ((b1 - b0) - (p1 - p0)) / _TICK / ((t1 - t0) * ncpu)))
        if verbose and i >= warmup:
            print(
                f"  [{size.name}] step {i - warmup + 1:3d}/{steps}: eager {rec['eager'][-1]['wall'] * 1e3:8.1f} ms  "
                f"shfx {rec['shfx'][-1]['wall'] * 1e3:8.1f} ms  loss {losses['eager'][-1]:.4f}",
                file=sys.stderr,
            )
    info = {k: runners[k].finish() for k in RUNNERS}
    walls = {k: [r["wall"] for r in rec[k]] for k in RUNNERS}
    stats = {k: summarize(walls[k]) for k in RUNNERS}
    res: dict[str, Any] = {
        "size": asdict(size),
        "params": info["eager"]["params"],
        "stages": info["shfx"]["stages"],
        "window": info["shfx"]["window"],
        "same_initial_weights": info["eager"]["digest"] == info["shfx"]["digest"],
        "steps": steps,
        "warmup": warmup,
        "ratio_of_medians": stats["shfx"]["median"] / stats["eager"]["median"],
        "median_pair_ratio": statistics.median(a / b for a, b in zip(walls["shfx"], walls["eager"])),
        "ratio_of_mins": stats["shfx"]["min"] / stats["eager"]["min"],
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses["shfx"], losses["eager"])),
        "losses": losses,
        "others_cpu_share": summarize(others) if others else None,
        "others_cpu_share_per_pair": others,
    }
    # the pairs during which other processes used under QUIET_SHARE of the CPUs
    quiet = [j for j, o in enumerate(others) if o < QUIET_SHARE]
    res["quiet_pairs"] = len(quiet)
    if len(quiet) >= 3:
        qe = statistics.median(walls["eager"][j] for j in quiet)
        qs = statistics.median(walls["shfx"][j] for j in quiet)
        res["quiet"] = {"eager_median_s": qe, "shfx_median_s": qs, "ratio_of_medians": qs / qe}
    else:
        res["quiet"] = None
    for k in RUNNERS:
        res[k] = {
            "step_s": stats[k],
            "cpu_s_median": statistics.median(r["cpu"] for r in rec[k]),
            "phases_median_s": {p: statistics.median(r["phases"][p] for r in rec[k]) for p in PHASES},
            "times_s": walls[k],
        }
    res["shfx"]["last_step_trace"] = info["shfx"].get("trace", {})
    res["shfx"]["os_threads"] = info["shfx"].get("os_threads")
    return res


# ---- reporting ----------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    git: dict[str, Any] = {}
    try:  # read-only: which code was measured
        import subprocess

        run = lambda *c: subprocess.run(["git", *c], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()  # noqa: E731
        git = {"commit": run("rev-parse", "HEAD"), "dirty": bool(run("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shfx": shfx.__version__,
        "git": git,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "os_cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu,
        "platform": platform.platform(),
        "loadavg_at_start": load,
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ},
        "parallel_info": [ln.strip() for ln in torch.__config__.parallel_info().splitlines() if ln.strip()],
    }


def print_table(results: list[dict[str, Any]]) -> None:
    ms = 1e3
    head = (
        f"{'size':8s} {'L':>3s} {'h':>5s} {'seq':>4s} {'B':>3s} {'stg':>3s} | {'eager med':>9s} {'IQR':>7s} {'min':>7s} | "
        f"{'shfx med':>9s} {'IQR':>7s} {'min':>7s} | {'ratio':>6s} {'pair':>6s} {'mins':>6s} | {'cpu e/s':>11s} | {'max|dloss|':>10s}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        s, e, f = r["size"], r["eager"]["step_s"], r["shfx"]["step_s"]
        cpu = f"{r['eager']['cpu_s_median'] * ms:.0f}/{r['shfx']['cpu_s_median'] * ms:.0f}"
        flag = "" if r["ratio_of_medians"] <= TARGET_RATIO else "  > target"
        oth = f"{r['others_cpu_share']['median'] * 100:5.0f}%" if r["others_cpu_share"] else "     -"
        qt = f"{r['quiet']['ratio_of_medians']:.3f} ({r['quiet_pairs']})" if r["quiet"] else f"- ({r['quiet_pairs']})"
        print(
            f"{s['name']:8s} {s['n_layer']:3d} {s['n_embd']:5d} {s['seq']:4d} {s['batch']:3d} {r['stages']:3d} | "
            f"{e['median'] * ms:7.1f}ms {e['iqr'] * ms:5.1f}ms {e['min'] * ms:5.1f}ms | "
            f"{f['median'] * ms:7.1f}ms {f['iqr'] * ms:5.1f}ms {f['min'] * ms:5.1f}ms | "
            f"{r['ratio_of_medians']:6.3f} {r['median_pair_ratio']:6.3f} {r['ratio_of_mins']:6.3f} | {cpu:>11s} | {oth} {qt:>11s} | "
            f"{r['max_loss_diff']:10.2e}{flag}"
        )
    print("  ratio = median(shfx) / median(eager); pair = median of per-step shfx/eager; mins = min/min;")
    print("  cpu e/s = process CPU ms per step, eager/shfx (median); others = median share of the CPUs other")
    print(f"  processes used during a step pair; quiet = ratio of medians over the pairs with others < {QUIET_SHARE:.0%} (count)")
    print()
    print("per-phase medians (ms), eager -> shfx:")
    for r in results:
        e, f = r["eager"]["phases_median_s"], r["shfx"]["phases_median_s"]
        print(f"  {r['size']['name']:8s} " + "  ".join(f"{p} {e[p] * ms:.1f} -> {f[p] * ms:.1f}" for p in PHASES))
    print()
    print("shfx's last step from cm.engine.trace (ms): span, compute-stream busy time and gaps, time per action kind")
    for r in results:
        t = r["shfx"]["last_step_trace"]
        if t:
            kinds = "  ".join(f"{k} {v * ms:.1f}" for k, v in sorted(t["by_kind_s"].items()))
            print(
                f"  {r['size']['name']:8s} span {t['span_s'] * ms:.1f}  busy {t['compute_busy_s'] * ms:.1f}  "
                f"gaps {t['compute_gaps_s'] * ms:.1f}  | {kinds}"
            )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,small,medium", help=f"comma-separated presets from {sorted(SIZES)} ('' for none; default tiny,small,medium)")
    ap.add_argument("--size", action="append", default=[], metavar="L,H,SEQ,BATCH", help="a custom size (repeatable)")
    ap.add_argument("--steps", type=int, default=20, help="measured steps per size and runner (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in the runners (default: torch's default)")
    ap.add_argument("--isolation", choices=("process", "inprocess"), default="process", help="a worker process per runner (default) or both in this process")
    ap.add_argument(
        "--omp-wait-policy",
        choices=("inherit", "passive"),
        default="inherit",
        help="OMP_WAIT_POLICY for the worker processes (default: inherit this environment's); passive keeps idle "
        "OpenMP workers from spinning, which makes results far less sensitive to other load on the machine",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "overhead.json"), help="JSON output ('' for none)")
    ap.add_argument(
        "--eager-full-recompute",
        action="store_true",
        help="eager checkpointing without early stop (recomputes whole blocks, like shfx); default: torch's default (early stop)",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="print every step")
    ap.add_argument(
        "--no-overlap",
        action="store_true",
        help="compile shfx with overlap_update=False (host updates after the backward, as eager; on the emulated "
        "device the updates otherwise share the cores with the backward's compute)",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if getattr(args, "no_overlap", False):
        os.environ["SHFX_BENCH_OVERLAP"] = "0"  # inherited by the spawned runner processes
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [SIZES[n.strip()] for n in args.sizes.split(",") if n.strip()]
    for spec in args.size:
        L, h, seq, b = (int(v) for v in spec.split(","))
        sizes.append(Size(f"L{L}h{h}s{seq}b{b}", L, h, seq, b))
    if not sizes:
        raise SystemExit("no sizes: use --sizes and/or --size")
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    if args.omp_wait_policy != "inherit":
        if args.isolation != "process":
            raise SystemExit("--omp-wait-policy needs --isolation process (set OMP_WAIT_POLICY before starting python instead)")
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()  # read by the spawned workers' OpenMP runtime
    info = machine_info()
    print(
        f"torch {info['torch']}, {info['torch_threads']} threads, {info['cpu_model']}, {info['affinity_cpus']} CPUs, "
        f"load {info['loadavg_at_start']}; {args.steps} steps after {args.warmup} warm-up, alternating, "
        f"isolation={args.isolation}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}"
    )
    results = []
    for size in sizes:
        t = time.perf_counter()
        results.append(
            bench_size(size, args.steps, args.warmup, args.seed, args.isolation, args.threads, args.verbose, not args.eager_full_recompute)
        )
        print(f"  {size.name}: done in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    print()
    print_table(results)
    worst = max(r["ratio_of_medians"] for r in results)
    print()
    if not all(r["same_initial_weights"] for r in results):
        print("WARNING: the two runners did not start from the same weights")
    busy = [r["size"]["name"] for r in results if r["others_cpu_share"] and r["others_cpu_share"]["median"] >= QUIET_SHARE]
    if busy:
        print(
            f"WARNING: other processes used >= {QUIET_SHARE:.0%} of the CPUs during most steps of {', '.join(busy)}: "
            "those numbers say more about the machine than about shfx (see the quiet column); rerun on a quiet "
            "machine or with --omp-wait-policy passive"
        )
    print(f"max loss difference {max(r['max_loss_diff'] for r in results):.3e}")
    print(f"worst ratio of medians {worst:.3f} (target <= {TARGET_RATIO}): {'OK' if worst <= TARGET_RATIO else 'ABOVE TARGET'}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        info["loadavg_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
        doc = {"benchmark": "overhead", "target_ratio": TARGET_RATIO, "args": vars(args), "machine": info, "results": results}
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
