"""What rollback costs: the step journal's copies (shfx.compile(rollback=True)) side by side.

    python benchmarks/rollback.py                 # GPT 4 x 256, 20 interleaved steps
    python benchmarks/rollback.py --layers 8 --hidden 512 --steps 12

Two measurements, both in one process:

1. per group, the host update alone (``HostAdamW.update``) against the copy the journal makes
   before it (``StepJournal.before_host_update``): time of each, median of ``--repeats``;
2. whole training steps of the same model compiled with rollback off and on, interleaved
   (stronghold, window 2, unthrottled emulated device), median step time of each and ratio.

The host memory the copies take is printed too (the ledger's "rollback copies" term: 12 bytes
per fp32 parameter, 16 for a group updated on the device). Writes
``benchmarks/results/rollback.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

import shfx
from shfx.models.gpt import GPT, GPTShape


def _compile(shape: GPTShape, rollback: bool) -> shfx.CompiledModel:
    torch.manual_seed(0)
    return shfx.compile(
        GPT(shape), device=shfx.EmulatedDevice(memory="4GiB", h2d=None, d2h=None), policy=shfx.Stronghold(window=2),
        optimizer=shfx.optim.AdamW(), rollback=rollback,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/rollback.json")
    a = ap.parse_args()
    shape = GPTShape(vocab=256, seq=a.seq, layers=a.layers, heads=max(1, a.hidden // 64), hidden=a.hidden)
    cms = {False: _compile(shape, False), True: _compile(shape, True)}
    x = torch.randint(0, 256, (a.batch, a.seq), generator=torch.Generator().manual_seed(1))
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(a.warmup + a.steps):
        for rb in ((False, True) if i % 2 == 0 else (True, False)):  # alternate who goes first
            cm = cms[rb]
            t0 = time.perf_counter()
            cm(x, x).backward()
            cm.step()
            cm.zero_grad()
            if i >= a.warmup:
                times[rb].append(time.perf_counter() - t0)
    off, on = statistics.median(times[False]), statistics.median(times[True])

    eng = cms[True].engine
    hp = eng.optimizer.config.hyperparams()
    groups = []
    for g, grp in enumerate(eng.store.groups):
        if not grp.trainable_bytes:
            continue
        upd, cp = [], []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            eng.journal.saved.discard(("host", g))
            eng.journal.before_host_update(g)
            t1 = time.perf_counter()
            eng.optimizer.update(g, hp)
            t2 = time.perf_counter()
            cp.append(t1 - t0)
            upd.append(t2 - t1)
        eng.journal.rollback(None)  # the timing updates are undone as well
        groups.append({"group": g, "params": grp.trainable_numel, "update_ms": statistics.median(upd) * 1e3,
                       "copy_ms": statistics.median(cp) * 1e3})  # fmt: skip
    copies = eng.journal.host_bytes
    led = cms[True].variant.ledger(rollback=True).static("host")
    host_off = sum(cms[False].variant.ledger().static("host").values())

    print(f"GPT {a.layers} x {a.hidden}, seq {a.seq}, batch {a.batch}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"{'group':>5} {'params':>10} {'update ms':>10} {'copy ms':>8} {'copy/update':>11}")
    for r in groups:
        print(f"{r['group']:>5} {r['params']:>10} {r['update_ms']:>10.3f} {r['copy_ms']:>8.3f} {r['copy_ms'] / r['update_ms']:>11.2f}")
    tot_u = sum(r["update_ms"] for r in groups)
    tot_c = sum(r["copy_ms"] for r in groups)
    print(f"{'all':>5} {sum(r['params'] for r in groups):>10} {tot_u:>10.3f} {tot_c:>8.3f} {tot_c / tot_u:>11.2f}")
    print(f"step, median of {a.steps}: rollback off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms, ratio {on / off:.3f}")
    print(f"host memory: {host_off / 2**20:.1f} MiB without rollback, + {led['rollback copies'] / 2**20:.1f} MiB of copies "
          f"(journal holds {copies / 2**20:.1f} MiB)")  # fmt: skip
    for cm in cms.values():
        cm.close()
    if a.out:
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({
                "benchmark": "rollback", "args": vars(a), "machine": {"cpus": os.cpu_count(), "load": os.getloadavg(),
                "torch": torch.__version__, "python": platform.python_version()},
                "groups": groups, "step_ms": {"off": off * 1e3, "on": on * 1e3, "ratio": on / off},
                "host_bytes": {"without": host_off, "rollback_copies": led["rollback copies"]},
            }, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
