"""Data parallel on the emulated device: 1 vs 2 vs 4 ranks, measured, with the simulator's
prediction and the memory ledger's host bytes beside each.

What it runs. For each rank count N (``--ranks``, default 1,2,4) N processes are spawned (gloo
over loopback, one emulated device each, one torch thread each), and every one trains the same
GPT (``--size layers,hidden,seq,batch``) with ``shfx.compile(..., window=W,
data_parallel=N > 1)`` on its own batches for ``--steps`` steps. Per rank it reports:

* **host memory**: the runtime's own count (``cm.engine.host_bytes()``: the host store, the
  AdamW shards, staging and collective buffers), the memory ledger's prediction for one rank
  (``cm.variant.ledger().peak("host")``, the per-rank host terms), and the issue's formula
  ``image + 16 B/param / N`` (fp32: the whole fp32 image every rank holds, plus master,
  gradient, m and v shards; one rank without data parallel: 16 B/param, the image is the master); and the process's RSS growth from before compile to the end;
* **step time**: the median of the measured steps after ``--warmup`` (``cm.engine.step_times``:
  first forward of a step -> end of ``cm.step()``), and the samples/s of all ranks together;
* **predicted step time**: the simulator on the rank's data-parallel program
  (``shfx.cost_model.simulate(cm.program, costs)``) with costs profiled on that rank (a
  one-rank compile of the same model on the same device, ``shfx.profiler.profile_costs``, taken
  while the other ranks profile too, so under the same CPU sharing) and the network rate and
  latency measured with gloo between the same processes (reduce-scatters of two sizes, fitted
  to the ring formula ``t = (N-1)/N * B / bw + (N-1) * lat``); then, to locate the error, the
  simulator replayed with each action's measured duration (``in situ``, the collectives at the
  network rate they had) and with the measured hand-offs, lead and tail added
  (``shfx.cost_model.trace.in_situ_costs``, as ``benchmarks/sim_accuracy.py`` does).

The machine this was written on has 2 cores: at 4 ranks the processes share them, so a rank's
compute is slower than at 1 rank; the prediction profiles under the same sharing, so it is
comparable to the measurement, but the scaling is the machine's, not the method's.

    python benchmarks/data_parallel.py                    # ~3-6 minutes on the 2-core VM
    python benchmarks/data_parallel.py --ranks 1,2 --steps 6 --size 4,128,64,4

Results: ``benchmarks/results/data_parallel.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe_network(ranks: int, sizes: tuple[int, int] = (1 << 16, 1 << 23), reps: int = 5) -> tuple[float, float]:
    """(bytes/s, latency per ring step) of gloo between the ranks, fitted to the ring formula
    from the median time of reduce-scatters of two sizes (per-rank bytes)."""
    if ranks == 1:
        return float("inf"), 0.0
    times = []
    for n in sizes:
        x = torch.ones(n // 4 // ranks * ranks)
        out = torch.empty(x.numel() // ranks)
        ts = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.reduce_scatter_tensor(out, x)
            ts.append(time.perf_counter() - t0)
        times.append(statistics.median(ts))
    f = (ranks - 1) / ranks
    (b0, b1), (t0, t1) = sizes, times
    per_byte = max((t1 - t0) / (f * (b1 - b0)), 1e-12)
    lat = max((t0 - f * b0 * per_byte) / (ranks - 1), 0.0)
    return 1.0 / per_byte, lat


def _worker(rank: int, ranks: int, port: int, args: argparse.Namespace, q: Any) -> None:
    torch.set_num_threads(1)
    import shfx
    from shfx.cost_model import simulate
    from shfx.cost_model.trace import StepTrace, analyse_steps, in_situ_costs
    from shfx.models import GPT, GPTShape
    from shfx.profiler import profile_costs

    layers, hidden, seq, batch = args.size
    if ranks > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=ranks)
    cfg = GPTShape(layers=layers, hidden=hidden, heads=max(1, hidden // 64), seq=seq, vocab=256, dropout=0.0)
    torch.manual_seed(0)
    model = GPT(cfg)
    twin = copy.deepcopy(model)
    nparams = sum(p.numel() for p in model.parameters())

    def device() -> Any:
        return shfx.EmulatedDevice(memory=args.memory, h2d=args.link, d2h=args.link)

    gen = torch.Generator().manual_seed(100 + rank)

    def data() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, 256, (batch, seq), generator=gen), torch.randint(0, 256, (batch, seq), generator=gen)

    rss0 = _rss()
    cm = shfx.compile(model, device=device(), window=args.window, optimizer=shfx.optim.AdamW(lr=1e-3),
                      data_parallel=ranks > 1)  # fmt: skip
    losses, traces = [], []
    for i in range(args.steps):
        x, y = data()
        loss = cm(x, y)
        loss.backward()
        cm.step()
        end = time.perf_counter()
        if i >= args.warmup:
            traces.append(StepTrace(cm.engine.last_step_window[0], end, list(cm.engine.trace)))
        cm.zero_grad()
        losses.append(loss.item())
    measured = sorted(cm.engine.step_times[args.warmup :])
    host = cm.engine.host_bytes()
    ledger = cm.variant.ledger().peak("host")
    rss1 = _rss()
    bps, lat = _probe_network(ranks)

    # the prediction: costs profiled on a one-rank compile of the same model on this rank
    one = shfx.compile(twin, device=device(), window=args.window, optimizer=shfx.optim.AdamW(lr=1e-3))
    x, y = data()
    one(x, y).backward()
    one.step()
    one.zero_grad()
    costs = profile_costs(one.engine, one.variant, [x, y], refresh=True)
    if ranks > 1:
        costs = costs.with_links(__import__("dataclasses").replace(costs.links, net_bps=bps, net_latency_s=lat))
    predicted = simulate(cm.program, costs).step_s
    # where the error is (as benchmarks/sim_accuracy.py): the simulator with each action's measured
    # duration (in situ; for RS/AG the network rate of the measured collectives), then with the
    # measured hand-offs between threads and the step's lead and tail added too
    a = analyse_steps(cm.program, traces)
    insitu = simulate(cm.program, in_situ_costs(cm.program, costs, traces, overheads=False)).step_s
    with_ovh = simulate(cm.program, in_situ_costs(cm.program, costs, traces, overheads=True)).step_s + a.lead_s + a.tail_s
    one.close()
    row = {
        "rank": rank, "ranks": ranks, "params": nparams,
        "host_bytes": host, "ledger_host_bytes": ledger,
        # (one rank: no data parallel, the fp32 image is the master: 16 B/param)
        "formula_bytes": 16 * nparams if ranks == 1 else 4 * nparams + 16 * nparams / ranks,
        "rss_growth_bytes": rss1 - rss0,
        "step_s": measured[len(measured) // 2] if measured else None,
        "step_iqr_s": [measured[len(measured) // 4], measured[(3 * len(measured)) // 4]] if measured else None,
        "predicted_s": predicted, "in_situ_s": insitu, "in_situ_overheads_s": with_ovh,
        "net_bps": None if ranks == 1 else bps, "net_latency_s": None if ranks == 1 else lat,
        "reduce_bytes": cm.program.bytes_moved().get("reduce", 0),
        "last_loss": losses[-1],
    }
    cm.close()
    q.put(row)
    if ranks > 1:
        dist.barrier()
        dist.destroy_process_group()


def run(ranks: int, args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, ranks, port, args, q)) for r in range(ranks)]
    for p in procs:
        p.start()
    rows = []
    deadline = time.monotonic() + args.timeout
    while len(rows) < ranks and time.monotonic() < deadline:
        if not q.empty():
            rows.append(q.get())
        elif any(p.exitcode not in (None, 0) for p in procs):
            break
        else:
            time.sleep(0.2)
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    if len(rows) < ranks:
        raise RuntimeError(f"{ranks} ranks: only {len(rows)} reported (exit codes {[p.exitcode for p in procs]})")
    return sorted(rows, key=lambda r: r["rank"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--size", default="8,256,64,4", help="layers,hidden,seq,batch (batch per rank)")
    p.add_argument("--window", type=int, default=2)
    p.add_argument("--link", default="2GB/s", help="the emulated host<->device link each way")
    p.add_argument("--memory", default="1GiB", help="the emulated device's memory")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one rank count may take")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "data_parallel.json"))
    args = p.parse_args(argv)
    args.size = tuple(int(v) for v in args.size.split(","))
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "python": sys.version.split()[0]},
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "load_before": os.getloadavg(),
        "runs": {},
    }  # fmt: skip
    print(f"# data parallel on the emulated device: GPT {args.size} (layers, hidden, seq, batch per rank), W={args.window}, "
          f"link {args.link}, {args.steps} steps\n")  # fmt: skip
    print("| ranks | host bytes/rank (runtime) | ledger | image + 16/N B/param | RSS growth | step (median) | "
          "predicted | pred/meas | in situ (+ overheads) | samples/s (all ranks) | network (fitted) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = None
    for n in (int(v) for v in args.ranks.split(",")):
        rows = run(n, args)
        out["runs"][str(n)] = rows
        r0 = rows[0]
        step = statistics.median(r["step_s"] for r in rows)
        pred = statistics.median(r["predicted_s"] for r in rows)
        ins = statistics.median(r["in_situ_s"] for r in rows)
        ovh = statistics.median(r["in_situ_overheads_s"] for r in rows)
        sps = n * args.size[3] / step
        base = base or sps
        net = "-" if n == 1 else f"{r0['net_bps'] / 1e9:.2f} GB/s, {r0['net_latency_s'] * 1e6:.0f} us"
        mib = 2**20
        print(f"| {n} | {r0['host_bytes'] / mib:.1f} MiB | {r0['ledger_host_bytes'] / mib:.1f} MiB | "
              f"{r0['formula_bytes'] / mib:.1f} MiB | {r0['rss_growth_bytes'] / mib:.0f} MiB | {step * 1e3:.0f} ms | "
              f"{pred * 1e3:.0f} ms | {pred / step:.2f} | {ins * 1e3:.0f} ({ovh * 1e3:.0f}) ms | {sps:.1f} ({sps / base:.2f}x) | "
              f"{net} |")  # fmt: skip
    out["load_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"\nload average before/after: {out['load_before'][0]:.1f} / {out['load_after'][0]:.1f}; wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
