"""Data parallel, simulated: REFERENCE.md's GPT on 1, 2, 4 and 8 V100s.

    python benchmarks/data_parallel_sim.py                 # ~1 min on 2 cores: nothing runs, all analytic
    python benchmarks/data_parallel_sim.py --layers 48 --window 2

STRONGHOLD's setup (hidden 2048, 16 heads, seq 1024, micro-batch 4 per rank, vocabulary 50304,
fp32, activation checkpointing per layer) on the ``V100-32GB-PCIe3`` profile (32 GiB, 90 GiB
host RAM per node), the ``stronghold`` policy (``--window``, every group updated on the host, as
data parallel needs), each rank with its own batch (weak scaling: N ranks train N x 4 samples a
step). Three topologies:

- ``1 node``: N V100s in one machine, no NVLink: the ring runs over PCIe 3 (12 GB/s, REFERENCE.md),
  the node's 90 GiB host RAM shared by its N ranks;
- ``N nodes, 25GbE`` and ``N nodes, 100GbE``: one V100 per machine, the ring over the network
  (2.8 GB/s and 11 GB/s achieved, :data:`shfx.cost_model.hardware.NETWORKS`), 90 GiB per rank.

For each (topology, N): the largest trainable model per rank (the planner's closed form, the
host terms one rank's: 16/N bytes per parameter of sharded master, gradient and AdamW states
plus the whole fp32 image), and one simulated step (the analytic costs, the program with the
collectives: ``RS g`` after each group's gradient, ``AG g`` after its update, on a network
resource with the ring formula) at a fixed size (``--layers``, default 32: the largest the
8-rank single node fits) and at the topology's largest size: step time, samples/s, speedup
over one rank and scaling efficiency (speedup / N) at the fixed size.

What it does not model: see :mod:`shfx.cost_model.simulate` (no stragglers, the ring's slowest
link only, the host memory bandwidth the collectives take). Writes
``benchmarks/results/data_parallel_sim.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shfx.commands import gpt_plan_inputs  # noqa: E402
from shfx.cost_model.hardware import NETWORKS, with_data_parallel  # noqa: E402
from shfx.cost_model.planner import largest_trainable  # noqa: E402
from shfx.cost_model.simulate import simulate  # noqa: E402
from shfx.models.gpt import GPTShape  # noqa: E402
from shfx.passes.policies import Stronghold  # noqa: E402
from shfx.passes.schedule import data_parallel_program  # noqa: E402

REF = GPTShape(hidden=2048, heads=16, seq=1024, batch=4, vocab=50304)
PROFILE = "V100-32GB-PCIe3"
OUT = ROOT / "benchmarks" / "results" / "data_parallel_sim.json"
TOPOLOGIES = (("1 node (PCIe 3)", None), ("N nodes, 25GbE", "25gbe"), ("N nodes, 100GbE", "100gbe"))


def hardware(ranks: int, network: str | None):
    if network is None:
        return with_data_parallel(PROFILE, ranks)
    return with_data_parallel(PROFILE, ranks, nodes=ranks, network=network)


def step(layers: int, hw, window: int) -> dict:
    specs, costs = gpt_plan_inputs(REF.with_layers(layers), hw)
    tl = simulate(data_parallel_program(Stronghold(window=window).program(specs), hw.ranks), costs)
    return {
        "layers": layers,
        "params": REF.with_layers(layers).num_params(),
        "step_s": tl.step_s,
        "samples_per_s": hw.ranks * REF.batch / tl.step_s,
        "bottleneck": tl.bottleneck,
        "critical_path_s": {k: v for k, v in tl.by_resource.items() if v > 0},
        "busy_s": {k: tl.busy_s[k] for k in ("compute", "h2d", "d2h", "cpu", "reduce", "gather") if tl.busy_s.get(k)},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32, help="the fixed size the scaling is measured at")
    ap.add_argument("--window", type=int, default=2, help="stronghold's window")
    ap.add_argument("--ranks", default="1,2,4,8")
    a = ap.parse_args()
    t0 = time.perf_counter()
    rows = []
    base: dict | None = None
    for label, net in TOPOLOGIES:
        for n in [int(x) for x in a.ranks.split(",")]:
            if n == 1 and base is not None:
                rows.append(dict(base, topology=label))
                continue
            hw = hardware(n, net)
            big = largest_trainable("stronghold", REF, hw, window=a.window)
            fixed = step(a.layers, hw, a.window) if a.layers <= big.layers else None
            largest = step(big.layers, hw, a.window) if big.layers else None
            bps, lat = hw.collective_link()
            row = {
                "topology": label, "ranks": n, "nodes": hw.nodes, "ranks_per_node": hw.ranks_per_node,
                "ring_bps": bps, "ring_latency_s": lat,
                "largest_layers": big.layers, "largest_params": big.params, "largest_binding": big.binding,
                "host_bytes_per_rank": big.breakdown.host_total, "fixed": fixed, "largest": largest,
            }  # fmt: skip
            rows.append(row)
            if n == 1:
                base = row
    assert base is not None and base["fixed"] is not None, "the fixed size must fit one rank"
    for r in rows:
        if r["fixed"] is not None:
            r["fixed"]["speedup"] = r["fixed"]["samples_per_s"] / base["fixed"]["samples_per_s"]
            r["fixed"]["efficiency"] = r["fixed"]["speedup"] / r["ranks"]

    print(f"REFERENCE.md's GPT (hidden 2048, 16 heads, seq 1024, batch 4 per rank, fp32) on {PROFILE}, stronghold W={a.window}; "
          "simulated, nothing runs")
    print(f"networks: {', '.join(f'{k} {v.bps / 1e9:.1f} GB/s, {v.latency_s * 1e6:.0f} us' for k, v in NETWORKS.items())}; "
          "intra-node PCIe 3 12 GB/s, 10 us\n")
    head = (f"{'topology':<18} {'N':>2}  {'step @' + str(a.layers) + 'L':>10} {'samples/s':>9} {'speedup':>7} {'eff.':>5} "
            f"{'bound':>8}   {'largest':>7} {'params':>8} {'step':>8} {'samples/s':>9}  limited by")
    print(head)
    for r in rows:
        f, g = r["fixed"], r["largest"]
        fixed = (f"{f['step_s']:>9.2f}s {f['samples_per_s']:>9.2f} {f['speedup']:>7.2f} {f['efficiency']:>5.0%} {f['bottleneck']:>8}"
                 if f else f"{'-':>10} {'-':>9} {'-':>7} {'-':>5} {'-':>8}")
        big = (f"{r['largest_layers']:>7} {r['largest_params'] / 1e9:>7.2f}B {g['step_s']:>7.2f}s {g['samples_per_s']:>9.2f}"
               if g else f"{0:>7} {'-':>8} {'-':>8} {'-':>9}")
        print(f"{r['topology']:<18} {r['ranks']:>2}  {fixed}   {big}  {r['largest_binding']}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "model": {"hidden": REF.hidden, "heads": REF.heads, "seq": REF.seq, "batch_per_rank": REF.batch, "vocab": REF.vocab,
                  "precision": REF.precision},
        "hardware": PROFILE, "policy": f"stronghold(window={a.window})", "fixed_layers": a.layers,
        "networks": {k: {"bps": v.bps, "latency_s": v.latency_s} for k, v in NETWORKS.items()},
        "rows": rows, "seconds": time.perf_counter() - t0,
    }, indent=2) + "\n")  # fmt: skip
    print(f"\njson: {OUT.relative_to(ROOT)} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
