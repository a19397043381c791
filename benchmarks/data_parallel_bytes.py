"""Data parallel in fp32 and in bf16 on the emulated device: the bytes each rank moves, counted.

What it runs. 2 spawned processes (gloo over loopback, one emulated device and one torch thread
each) train the same GPT (``--size layers,hidden,seq,batch``) with ``shfx.compile(...,
window=W, data_parallel=True, max_grad_norm=1.0)``, first in fp32 then in bf16 (fp32 masters),
for ``--steps`` steps after one warm-up step. Per rank and per step it reports, from the
runtime's own counters (never from timings):

* **gradient bytes**: off the device (the backend's ``bytes_d2h``: every OG's copy of a stage's
  gradient into the host's local buffer, in the device dtype) and into the reduce-scatters
  (``cm.engine.dp.bytes_moved["reduce"]``: each group's local buffer, ``N * chunk`` elements,
  padding included);
* the weights' all-gathers (``"gather"``) and NR0's norms (``"norm"``: clipping's per-parameter
  norms and finite flags, fp32 in both precisions);
* the step program's static bytes per step (``cm.program.bytes_moved()``: the unpadded groups);
* **host bytes per rank**: the runtime's (``cm.engine.host_bytes()``) against the memory ledger's
  static host terms of the rank (``cm.variant.ledger(rank=r).static("host")``, summed), and the
  state terms alone (image, masters, gradient, states: the runtime's less its staging and
  collective buffers, which the ledger's constant terms bound: the runtime allocates its
  local-gradient buffers and the queues' scratch as the groups need them, the ledger counts
  the most they may take).

    python benchmarks/data_parallel_bytes.py                  # ~1 minute on the 2-core VM
    python benchmarks/data_parallel_bytes.py --size 4,128,64,4 --steps 2

Results: ``benchmarks/results/data_parallel_bytes.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data_parallel import _free_port  # noqa: E402

STATE_TERMS = (
    "parameter image (whole)", "working copy (16-bit)", "master parameters (fp32)", "gradients (fp32)",
    "optimizer states (m, v)", "SSD host window",
)  # fmt: skip


def _measure(rank: int, precision: str, args: argparse.Namespace) -> dict:
    import shfx
    from shfx.models import GPT, GPTShape

    layers, hidden, seq, batch = args.size
    cfg = GPTShape(layers=layers, hidden=hidden, heads=max(1, hidden // 64), seq=seq, vocab=256, dropout=0.0)
    torch.manual_seed(0)
    model = GPT(cfg)
    nparams = sum(p.numel() for p in model.parameters())
    cm = shfx.compile(
        model, device=shfx.EmulatedDevice(memory=args.memory, h2d=None, d2h=None), window=args.window,
        optimizer=shfx.optim.AdamW(lr=1e-3), precision=precision, max_grad_norm=1.0, data_parallel=True,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(100 + rank)
    backend, dp = None, None

    def step() -> None:
        x = torch.randint(0, 256, (batch, seq), generator=gen)
        y = torch.randint(0, 256, (batch, seq), generator=gen)
        cm(x, y).backward()
        cm.step()
        cm.zero_grad()

    step()  # warm-up: the first call's capture and broadcast
    cm.sync()
    backend, dp = cm._backend, cm.engine.dp
    d2h0, moved0 = backend.bytes_d2h, dict(dp.bytes_moved)
    for _ in range(args.steps):
        step()
    cm.sync()  # (the last step's overlapped updates and all-gathers)
    per_step = {k: (v - moved0[k]) / args.steps for k, v in dp.bytes_moved.items()}
    store = cm._store
    static = cm.variant.ledger(rank=rank).static("host")
    host = cm.engine.host_bytes()
    buffers = store.staging_bytes + cm.engine.gradients.pending_host_bytes + dp.buffer_bytes
    row = {
        "precision": precision, "rank": rank, "params": nparams, "steps": args.steps,
        "d2h_per_step": (backend.bytes_d2h - d2h0) / args.steps,
        "reduce_per_step": per_step["reduce"], "gather_per_step": per_step["gather"], "norm_per_step": per_step["norm"],
        "program": cm.program.bytes_moved(),
        "host_bytes": host, "ledger_host_bytes": sum(static.values()), "ledger_terms": static,
        "host_state_bytes": host - buffers, "ledger_state_bytes": sum(static.get(t, 0) for t in STATE_TERMS),
        "host_buffer_bytes": buffers, "ledger_buffer_bytes": sum(v for t, v in static.items() if t not in STATE_TERMS),
    }  # fmt: skip
    cm.close()
    return row


def _worker(rank: int, ranks: int, port: int, args: argparse.Namespace, q: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        for precision in args.precisions:
            q.put(_measure(rank, precision, args))
            dist.barrier()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})
        raise
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.ranks, port, args, q)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    want = args.ranks * len(args.precisions)
    rows: list[dict] = []
    deadline = time.monotonic() + args.timeout
    while len(rows) < want and time.monotonic() < deadline:
        if not q.empty():
            rows.append(q.get())
            if "error" in rows[-1]:
                break
        elif any(p.exitcode not in (None, 0) for p in procs):
            break
        else:
            time.sleep(0.2)
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    errors = [r for r in rows if "error" in r]
    if errors or len(rows) < want:
        raise RuntimeError(f"only {len(rows)} of {want} results (errors {errors}, exit codes {[p.exitcode for p in procs]})")
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--size", default="8,256,64,4", help="layers,hidden,seq,batch (batch per rank)")
    p.add_argument("--window", type=int, default=2)
    p.add_argument("--memory", default="1GiB", help="the emulated device's memory")
    p.add_argument("--steps", type=int, default=3, help="steps counted, after one warm-up step")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "data_parallel_bytes.json"))
    args = p.parse_args(argv)
    args.size = tuple(int(v) for v in args.size.split(","))
    args.precisions = args.precisions.split(",")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    rows = run(args)
    out: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "python": sys.version.split()[0]},
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": sorted(rows, key=lambda r: (args.precisions.index(r["precision"]), r["rank"])),
        "wall_s": time.perf_counter() - t0,
    }  # fmt: skip
    kib = 1024
    print(f"# data parallel, {args.ranks} ranks, emulated device: GPT {args.size} (layers, hidden, seq, batch per rank), "
          f"W={args.window}, max_grad_norm=1.0; bytes per rank per step (counted over {args.steps} steps)\n")  # fmt: skip
    print("| precision | rank | d2h (gradients) | reduce-scatter | all-gather | NR0 | program d2h / RS | "
          "host bytes (runtime) | ledger (static host) | state terms: runtime / ledger | buffers: runtime / ledger's bound |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in out["rows"]:
        pr = r["program"]
        print(f"| {r['precision']} | {r['rank']} | {r['d2h_per_step'] / kib:.1f} KiB | {r['reduce_per_step'] / kib:.1f} KiB | "
              f"{r['gather_per_step'] / kib:.1f} KiB | {r['norm_per_step'] / kib:.1f} KiB | "
              f"{pr['d2h'] / kib:.1f} / {pr['reduce'] / kib:.1f} KiB | {r['host_bytes']:,} | {r['ledger_host_bytes']:,} | "
              f"{r['host_state_bytes']:,} / {r['ledger_state_bytes']:,} | {r['host_buffer_bytes']:,} / {r['ledger_buffer_bytes']:,} |")  # fmt: skip
    ratios = {}
    if {"fp32", "bf16"} <= set(args.precisions):
        by = {(r["precision"], r["rank"]): r for r in out["rows"]}
        for k in ("d2h_per_step", "reduce_per_step", "gather_per_step", "norm_per_step"):
            ratios[k] = [by["bf16", i][k] / by["fp32", i][k] for i in range(args.ranks)]
        out["bf16_over_fp32"] = ratios
        print("\nbf16 / fp32 per rank: " + ", ".join(f"{k.removesuffix('_per_step')} {'/'.join(f'{v:.3f}' for v in vs)}"
                                                     for k, vs in ratios.items()))  # fmt: skip
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"wrote {args.out} ({out['wall_s']:.0f} s)")
    return out


if __name__ == "__main__":
    main()
