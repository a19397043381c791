"""How long a profile takes and how steady its prediction is, on a quiet machine and under other
load; and the window decisions of a measured profile (checked on fixed costs in the tests).

Part 1: one GPT (``--size``, default 6 layers, hidden 256, seq 128, batch 8: 8 stages) on an
``EmulatedDevice`` with a ``--link`` link, compiled with a fixed window (``--window``); its
measured step time (median of ``--steps`` steps) is the reference. Then, per load condition,
``--profiles`` uncached profiles (``shfx.profiler.profile_costs(..., cache=False)``): the time
each took, its rounds and steadiness, and the step it predicts at that window (the simulator on
the compiled program) against the measured one. Conditions: ``quiet``; ``bursts`` (two other
processes, together busy for ``--burst`` seconds then idle for twice that: both cores taken
for a third of the time, each burst longer than a profile's steps of one kind);
``sustained`` (two processes busy throughout). Other load slows compute, not the emulated link,
so a profile taken under it predicts too slow a step; the rounds keep the quiet rounds' costs
while there are some, and nothing can while the load lasts the whole profile (the report's
drift detector and ``cm.retune()`` are for that).

Part 2 (quiet only): ``window="auto"`` on the tests' tiny GPT at 10 MB/s and unthrottled, as
``tests/test_tune.py`` did before its decisions moved to fixed costs: the slow link should be
link-bound, want a window at least as deep as the fast one, and W=1 should be >= 1.2x slower.

    python benchmarks/profiling.py                       # ~2-3 min on 2 cores
    python benchmarks/profiling.py --conditions quiet --profiles 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import shfx
from shfx.cost_model import simulate
from shfx.models import GPT, GPTShape
from shfx.passes.units import format_seconds
from shfx.profiler import profile_costs

BURNER = """
import sys, time
busy, idle, delay = map(float, sys.argv[1:])
time.sleep(delay)
while True:
    t = time.perf_counter() + busy
    while time.perf_counter() < t:
        pass
    time.sleep(idle)
"""


class Load:
    """Two other CPU-bound processes for the duration of a ``with`` block (none for ``quiet``)."""

    def __init__(self, kind: str, burst: float):
        self.kind, self.burst = kind, burst
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Load:
        if self.kind == "bursts":
            b = self.burst
            self.procs = [subprocess.Popen([sys.executable, "-c", BURNER, str(b), str(2 * b), "0"]) for _ in range(2)]
        elif self.kind == "sustained":
            self.procs = [subprocess.Popen([sys.executable, "-c", BURNER, "1e9", "0", "0"]) for _ in range(2)]
        elif self.kind != "quiet":
            raise ValueError(f"unknown load condition {self.kind!r}: use quiet, bursts or sustained")
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--size", default="6,256,128,8", help="layers,hidden,seq,batch")
    ap.add_argument("--link", default="2GB/s", help="emulated h2d and d2h bandwidth")
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="measured steps (after 3 warm-up)")
    ap.add_argument("--profiles", type=int, default=6, help="profiles per load condition")
    ap.add_argument("--conditions", default="quiet,bursts,sustained")
    ap.add_argument("--burst", type=float, default=2.0, help="seconds the bursting processes are busy (then idle 2x that)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "profiling.json"), help="JSON output ('' for none)")
    return ap.parse_args(argv)


def part1(args: argparse.Namespace, log) -> dict[str, Any]:
    layers, hidden, seq, batch = (int(v) for v in args.size.split(","))
    torch.manual_seed(0)
    model = GPT(GPTShape(vocab=256, seq=seq, layers=layers, heads=max(1, hidden // 64), hidden=hidden, dropout=0.0))
    dev = shfx.EmulatedDevice(memory="8GiB", h2d=args.link, d2h=args.link)
    cm = shfx.compile(model, device=dev, window=args.window, optimizer=shfx.optim.AdamW())
    x = torch.randint(0, 256, (batch, seq))
    y = torch.randint(0, 256, (batch, seq))
    for _ in range(3 + args.steps):
        cm(x, y).backward()
        cm.step()
        cm.zero_grad()
    measured = statistics.median(cm.engine.step_times[3:])
    log(f"part 1: GPT {args.size} on {dev}, W={args.window}: measured step {format_seconds(measured)} (median of {args.steps})")
    out: dict[str, Any] = {"measured_step_s": measured, "conditions": {}}
    for cond in args.conditions.split(","):
        rows = []
        with Load(cond, args.burst):
            for _ in range(args.profiles):
                t0 = time.perf_counter()
                costs = profile_costs(cm.engine, cm.variant, [x, y], cache=False)
                took = time.perf_counter() - t0
                pred = simulate(cm.program, costs).step_s
                st = costs.extra["profile"]
                rows.append({"seconds": took, "steps": took / measured, "rounds": st.rounds, "steady": st.steady,
                             "spread": st.spread, "predicted_s": pred, "predicted_over_measured": pred / measured})  # fmt: skip
        ratios = [r["predicted_over_measured"] for r in rows]
        secs = [r["seconds"] for r in rows]
        log(
            f"  {cond:<9} profile {statistics.median(secs):.2f} s ({statistics.median(secs) / measured:.1f} steps; "
            f"max {max(secs):.2f} s), rounds {[r['rounds'] for r in rows]}, steady {sum(r['steady'] for r in rows)}/{len(rows)}; "
            f"predicted / measured: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}"
        )
        out["conditions"][cond] = rows
    cm.close()
    return out


def part2(log) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from zoo import gpt_tied, token_batch

    res: dict[str, Any] = {}
    for name, bw in (("slow", "10MB/s"), ("fast", None)):
        torch.manual_seed(0)
        cm = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(memory="64MiB", h2d=bw, d2h=bw), window="auto", optimizer=shfx.optim.AdamW())
        (x, y), _, _ = token_batch(0)
        for _ in range(3):
            cm(x, y).backward()
            cm.step()
            cm.zero_grad()
        rep = cm.report()
        res[name] = {
            "window": rep.window, "bottleneck": rep.tune.chosen.bottleneck,
            "w1_over_chosen": rep.tune.row(1).step_s / rep.tune.chosen.step_s, "measured_s": rep.measured_median_s,
            "predicted_s": rep.predicted_s, "profile": rep.profile.summary() if rep.profile else None,
        }  # fmt: skip
        cm.close()
    s, f = res["slow"], res["fast"]
    ok = s["bottleneck"] == "link" and s["window"] >= f["window"] and s["w1_over_chosen"] > 1.2
    res["ok"] = ok
    log(
        f"part 2: tiny GPT, window=auto: 10 MB/s -> W={s['window']} ({s['bottleneck']}-bound, W=1 {s['w1_over_chosen']:.2f}x); "
        f"unthrottled -> W={f['window']} ({f['bottleneck']}-bound): {'as expected' if ok else 'NOT as expected (was the machine busy?)'}"
    )
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load0 = os.getloadavg()
    lines: list[str] = []

    def log(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    log(f"load average at start {load0[0]:.2f}; torch threads {torch.get_num_threads()}")
    p1 = part1(args, log)
    p2 = part2(log)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        info = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                "load_start": load0, "load_end": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
        Path(args.out).write_text(json.dumps({"args": vars(args), "machine": info, "part1": p1, "part2": p2, "log": lines}, indent=2))
        print(f"wrote {args.out}")
    return 0 if p2["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
