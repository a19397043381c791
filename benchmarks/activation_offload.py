"""Activation offload (``shfx.Offload(activations="host")``): a long-sequence GPT on the emulated
device, with and without its checkpointed boundary activations offloaded to host RAM.

Measured per run (one process, runs in sequence):

- the memory ledger's device peak and its activations at the peak, the emulated device's measured
  peak, and the host bytes of the offloaded activations (the ledger's ``offloaded activations``);
- with a device budget between the two peaks: whether the step without offload is refused at
  the first call, and whether the offloaded run trains;
- at each link rate (``--rates``): the median step time with offload, measured, and the
  simulator's prediction from a fresh profile of the backend (``shfx.profiler.profile_costs``),
  and the same for the run without offload (where the device has room) for the copies' cost.

Usage: ``python benchmarks/activation_offload.py [--seq 512 --hidden 16 --layers 6 --batch 2
--rates 1MB/s,2MB/s,8MB/s --steps 6]`` (writes ``results/activation_offload.json``).
``benchmarks/nvme.py --tier --activations`` runs it too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch


def _run(shape, batch: int, acts: str, memory, bw: float | None, steps: int) -> dict:
    import shfx
    from shfx.cost_model.simulate import simulate
    from shfx.models import GPT
    from shfx.passes.actions import ActionKind
    from shfx.profiler import profile_costs

    torch.manual_seed(0)
    offload = shfx.Offload(activations=acts) if acts != "device" else None
    cm = shfx.compile(GPT(shape), device=shfx.EmulatedDevice(memory=memory, h2d=bw, d2h=bw), window=2,
                      optimizer=shfx.optim.AdamW(lr=1e-2), offload=offload)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    out: dict = {"activations": acts, "link_bps": bw}
    try:
        x = None
        for _ in range(steps + 1):
            x = torch.randint(0, shape.vocab, (batch, shape.seq), generator=g)
            cm(x, x).backward()
            cm.step()
            cm.zero_grad()
    except shfx.OutOfDeviceMemory as e:
        cm.close()
        return out | {"refused": str(e).split(". ")[0]}
    led = cm.variant.ledger()
    out |= {
        "ledger_device_peak_bytes": led.peak(),
        "ledger_activations_at_peak_bytes": led.terms_at_peak()["activations (checkpoints)"],
        "measured_device_peak_bytes": cm.backend.peak_bytes,
        "offloaded_host_bytes": led.static("host").get("offloaded activations", 0),
        "offloaded_stages": [get for get in cm.program.actions() if get.startswith("AO")],
        "moved_bytes": cm.program.bytes_moved(),
        "measured_step_s": statistics.median(cm.engine.step_times[1:]),
    }
    if bw is not None:
        costs = profile_costs(cm.engine, cm.variant, [x, x], cache=False)
        out["predicted_step_s"] = simulate(cm.program, costs).step_s
        out["error"] = out["predicted_step_s"] / out["measured_step_s"] - 1
    out["offloads"] = cm.program.count(ActionKind.OFFLOAD_ACTIVATIONS)
    cm.close()
    return out


def main(argv: list[str] | None = None) -> dict:
    from shfx.models import GPTShape
    from shfx.passes.units import parse_bandwidth

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rates", default="1MB/s,2MB/s,8MB/s")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "activation_offload.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # (small compute; a second thread only adds contention on a shared machine)
    shape = GPTShape(vocab=64, seq=args.seq, layers=args.layers, heads=2, hidden=args.hidden, dropout=0.0)
    room = {a: _run(shape, args.batch, a, "8GiB", None, 2) for a in ("device", "host")}
    cap = (room["device"]["ledger_device_peak_bytes"] + room["host"]["ledger_device_peak_bytes"]) // 2
    budget = {a: _run(shape, args.batch, a, cap, None, 2) for a in ("device", "host")}
    rates = []
    for r in args.rates.split(","):
        bw = parse_bandwidth(r.strip())
        rates.append({a: _run(shape, args.batch, a, "8GiB", bw, args.steps) for a in ("device", "host")})
        h, d = rates[-1]["host"], rates[-1]["device"]
        print(f"{r}: with offload measured {h['measured_step_s']:.3f} s predicted {h['predicted_step_s']:.3f} s "
              f"({h['error']:+.1%}); without {d['measured_step_s']:.3f} s predicted {d['predicted_step_s']:.3f} s", flush=True)  # fmt: skip
    res = {"shape": vars(args) | {"vocab": 64, "heads": 2}, "room": room, "budget_bytes": cap, "at_budget": budget, "rates": rates}
    print(f"device peak without offload {room['device']['ledger_device_peak_bytes']} B, with {room['host']['ledger_device_peak_bytes']} B "
          f"({room['host']['offloaded_host_bytes']} B on the host); at {cap} B: without -> "
          f"{budget['device'].get('refused', 'trains')}, with -> {budget['host'].get('refused', 'trains')}")  # fmt: skip
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
