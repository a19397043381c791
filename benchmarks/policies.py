"""The policies side by side on a link-bound emulated device: real steps, same model.

What is measured: one GPT (``shfx.models.GPT``, same seed, same batch) trained with each policy
(``resident``, ``l2l``, ``zero-offload``, ``zero-infinity``, ``stronghold``) on the same
``EmulatedDevice`` whose host<->device link is throttled (``--link``, default 100 MB/s each
way) so that a block's PREFETCH takes several times its FORWARD: the link, not compute, bounds
every policy that streams. The device is large enough for every policy (``--memory``), so they
are compared at equal model size. ``shfx.compare`` does the work: it profiles the model once
(the costs do not depend on the policy), simulates each policy's program, then compiles one
model per policy and steps them in turn (one step of each, the order rotating every round) so
load from other processes lands on all of them.

Reported per policy: measured step time (median, IQR, min; ``cm.engine.step_times``: first
forward to the end of ``cm.step()``), its ratio to stronghold's, the simulator's prediction
and its error, the bytes copied per step each way (backend counters; checked equal to the
program's), peak device memory measured (``backend.peak_bytes``) and predicted.

Expected when the link is the bottleneck: stronghold faster than zero-infinity (one stage of
lookahead, every stage fetched twice, host updates after the backward) and l2l (one slot: every
copy serialized with compute, parameters copied back after each update).

    python benchmarks/policies.py                 # ~1-2 min on 2 cores
    python benchmarks/policies.py --steps 20 --link 50MB/s
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import shfx
from shfx.passes.units import format_bytes, format_seconds

EXPECTED_SLOWER = ("zero-infinity", "l2l")  # than stronghold, when link-bound


def _iqr(xs: list[float]) -> float:
    if len(xs) < 4:
        return max(xs) - min(xs)
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--link", default="100MB/s", help="emulated h2d and d2h bandwidth")
    ap.add_argument("--memory", default="256MiB", help="emulated device memory (enough for every policy)")
    ap.add_argument("--window", type=int, default=2, help="stronghold's window")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per policy (interleaved)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--threads", type=int, default=1,
        help="torch threads (0: leave as is); 1 keeps compute immune to other processes taking a core (see README)",
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "policies.json"), help="JSON output ('' for none)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = shfx.EmulatedDevice(memory=args.memory, h2d=args.link, d2h=args.link)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    res = shfx.compare(
        shfx.GPTShape(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, batch=args.batch),
        window=args.window,
        device=device,
        steps=args.steps,
        warmup=args.warmup,
    )
    elapsed = time.perf_counter() - t0
    load1 = os.getloadavg()
    print(res.table())
    print()

    sh = res.row("stronghold").measured
    rows = []
    for r in res.rows:
        p, m = r.predicted, r.measured
        if m is None:
            rows.append({"policy": r.label, "fits": False, "reason": r.reason})
            continue
        rows.append(
            {
                "policy": r.label,
                "fits": True,
                "measured_s": m.step_s,
                "iqr_s": _iqr(list(m.step_times_s)),
                "min_s": min(m.step_times_s),
                "step_times_s": list(m.step_times_s),
                "ratio_to_stronghold": m.step_s / sh.step_s if sh else None,
                "predicted_s": p.step_s,
                "error": (p.step_s / m.step_s - 1) if p.step_s else None,
                "bottleneck": p.bottleneck,
                "h2d_bytes": m.h2d_bytes,
                "d2h_bytes": m.d2h_bytes,
                "bytes_as_predicted": (m.h2d_bytes, m.d2h_bytes) == (p.h2d_bytes, p.d2h_bytes),
                "peak_device_bytes": m.peak_device_bytes,
                "predicted_device_bytes": p.device_bytes,
            }
        )
    head = f"{'policy':<16} {'measured':>10} {'IQR':>9} {'x stronghold':>12} {'predicted':>10} {'error':>7} {'bound':<8} {'h2d/step':>10} {'d2h/step':>10} {'device peak':>11} {'predicted':>10}"
    print(head)
    for row in rows:
        if not row["fits"]:
            print(f"{row['policy']:<16} does not fit: {row['reason']}")
            continue
        print(
            f"{row['policy']:<16} {format_seconds(row['measured_s']):>10} {format_seconds(row['iqr_s']):>9} "
            f"{row['ratio_to_stronghold']:>12.2f} {format_seconds(row['predicted_s']):>10} {100 * row['error']:>+6.0f}% "
            f"{row['bottleneck']:<8} {format_bytes(row['h2d_bytes']):>10} {format_bytes(row['d2h_bytes']):>10} "
            f"{format_bytes(row['peak_device_bytes']):>11} {format_bytes(row['predicted_device_bytes']):>10}"
        )
    print()
    by = {r["policy"].split()[0]: r for r in rows if r["fits"]}
    verdicts = {}
    for other in EXPECTED_SLOWER:
        if "stronghold" in by and other in by:
            verdicts[other] = by[other]["measured_s"] > by["stronghold"]["measured_s"]
            print(
                f"stronghold faster than {other}: {'yes' if verdicts[other] else 'NO'} "
                f"({format_seconds(by['stronghold']['measured_s'])} vs {format_seconds(by[other]['measured_s'])}, "
                f"predicted {format_seconds(by['stronghold']['predicted_s'])} vs {format_seconds(by[other]['predicted_s'])})"
            )
    if not all(r["bytes_as_predicted"] for r in rows if r["fits"]):
        print("WARNING: bytes copied per step differ from the programs' for some policy")
    print(f"elapsed {elapsed:.0f} s; load average {load0[0]:.2f} at start, {load1[0]:.2f} at end")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "benchmark": "policies",
            "args": vars(args),
            "device": str(device),
            "expected_order_held": verdicts,
            "rows": rows,
            "compare": res.to_dict(),
            "machine": {
                "torch": torch.__version__,
                "torch_threads": torch.get_num_threads(),
                "python": platform.python_version(),
                "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                "loadavg_at_start": load0,
                "loadavg_at_end": load1,
                "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            },
            "elapsed_s": elapsed,
        }
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {out}")
    return 0 if all(verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
