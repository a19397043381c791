"""What exact gradient clipping costs: clipped (deferred-update schedule) against unclipped
training, predicted and measured.

    python benchmarks/clipping.py                       # simulator (V100, REFERENCE.md's GPT) + emulated device
    python benchmarks/clipping.py --steps 10 --layers 4 --hidden 256

Two parts:

1. **Simulator**, STRONGHOLD's setup on a V100 (``V100-32GB-PCIe3``, GPT hidden 2048, 16 heads,
   seq 1024, batch 4, fp32, ``--sim-layers`` layers, analytic costs): the step time of
   ``Stronghold(window=W)`` against ``Stronghold(window=W, deferred_update=True)`` (what
   ``max_grad_norm`` turns on) for several windows, and with the host optimizer slowed down
   (``--host-slowdown``) to show where the update no longer fits behind compute.
2. **Emulated device**, the same GPT family at a small size: median step time of unclipped and
   ``max_grad_norm=1.0`` training, interleaved in one process (``--steps`` after
   ``--warmup``), with a throttled link so the window schedule matters.

Prints a table and writes ``benchmarks/results/clipping.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import replace

import torch

import shfx
from shfx.commands import gpt_plan_inputs
from shfx.cost_model.shapes import GPTShape
from shfx.cost_model.simulate import simulate
from shfx.models.gpt import GPT
from shfx.passes.policies import Stronghold


def simulated(layers: int, windows: list[int], slowdowns: list[float]) -> list[dict]:
    shape = GPTShape(vocab=50304, seq=1024, layers=layers, heads=16, hidden=2048, batch=4)
    specs, costs = gpt_plan_inputs(shape, "V100-32GB-PCIe3")
    rows = []
    for slow in slowdowns:
        table = replace(costs, costs=[replace(c, update_s=c.update_s * slow) for c in costs.costs])
        for w in windows:
            base = simulate(Stronghold(window=w).program(specs), table)
            clip = simulate(Stronghold(window=w, deferred_update=True).program(specs), table)
            rows.append({
                "layers": layers, "window": w, "host_slowdown": slow,
                "update_s_total": sum(c.update_s for c in table.costs),
                "unclipped_s": base.step_s, "clipped_s": clip.step_s, "ratio": clip.step_s / base.step_s,
                "bottleneck_unclipped": base.bottleneck, "bottleneck_clipped": clip.bottleneck,
            })  # fmt: skip
    return rows


def measured(a: argparse.Namespace) -> dict:
    shape = GPTShape(vocab=256, seq=a.seq, layers=a.layers, heads=max(1, a.hidden // 64), hidden=a.hidden)

    def build(clip: float | None) -> shfx.CompiledModel:
        torch.manual_seed(0)
        return shfx.compile(
            GPT(shape), device=shfx.EmulatedDevice(memory="4GiB", h2d=a.link, d2h=a.link), window=a.window,
            optimizer=shfx.optim.AdamW(lr=1e-4), max_grad_norm=clip,
        )  # fmt: skip

    cms = {"unclipped": build(None), "clipped": build(1.0)}
    x = torch.randint(0, 256, (a.batch, a.seq), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {k: [] for k in cms}
    # NOTE: with clipping step() returns before its updates finish (the next forward waits for
    # them), so a step is not timed alone: each round runs --run consecutive steps per model and
    # takes their time (the last step's updates awaited by sync()) over --run; models alternate.
    for i in range(a.warmup + a.steps):
        order = list(cms) if i % 2 == 0 else list(reversed(cms))
        for k in order:
            cm = cms[k]
            t0 = time.perf_counter()
            for _ in range(a.run):
                cm(x, x).backward()
                cm.step()
                cm.zero_grad()
            cm.sync()
            if i >= a.warmup:
                times[k].append((time.perf_counter() - t0) / a.run)
    for cm in cms.values():
        cm.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"shape": str(shape), "median_s": med,
            "ratio": med["clipped"] / med["unclipped"], "samples": times}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sim-layers", type=int, default=32)
    ap.add_argument("--windows", default="1,2,4,8")
    ap.add_argument("--host-slowdown", default="1,4,16", help="update_s multipliers for the simulator")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--link", default="2GB/s")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--run", type=int, default=3, help="consecutive steps timed together")
    ap.add_argument("--skip-measure", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/clipping.json")
    a = ap.parse_args()
    sim = simulated(a.sim_layers, [int(w) for w in a.windows.split(",")], [float(s) for s in a.host_slowdown.split(",")])
    print(f"simulator: V100-32GB-PCIe3, GPT {a.sim_layers} x 2048 (16 heads, seq 1024, batch 4, fp32), analytic costs")
    print(f"{'W':>3} {'host x':>6} {'updates s':>9} {'unclipped s':>11} {'clipped s':>9} {'ratio':>6}  bottleneck (clipped)")
    for r in sim:
        print(f"{r['window']:>3} {r['host_slowdown']:>6g} {r['update_s_total']:>9.3f} {r['unclipped_s']:>11.3f} "
              f"{r['clipped_s']:>9.3f} {r['ratio']:>6.3f}  {r['bottleneck_clipped']}")  # fmt: skip
    meas = None
    if not a.skip_measure:
        meas = measured(a)
        m = meas["median_s"]
        print(f"\nemulated device: GPT {a.layers} x {a.hidden}, seq {a.seq}, batch {a.batch}, W={a.window}, link {a.link}; "
              f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")  # fmt: skip
        print(f"step, median of {a.steps}: unclipped {m['unclipped'] * 1e3:.1f} ms, clipped {m['clipped'] * 1e3:.1f} ms, "
              f"ratio {meas['ratio']:.3f}")  # fmt: skip
    if a.out:
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({
                "benchmark": "clipping", "args": vars(a), "machine": {"cpus": os.cpu_count(), "load": os.getloadavg(),
                "torch": torch.__version__, "python": platform.python_version()},
                "simulated": sim, "measured": meas,
            }, f, indent=2, default=str)  # fmt: skip


if __name__ == "__main__":
    main()
