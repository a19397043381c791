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

``--nvme`` runs the rows of ``Offload(activations="nvme")`` instead (and updates only the
``"nvme"`` key of the JSON): at one link rate (``--nvme-link``, default 8 MB/s, where the host
variant's copies hide behind compute), the host variant and the SSD variant at each emulated SSD
rate (``--ssd-rates``, reads and writes alike) with the default window, and the windows 1 and 3
at the middle rate; each row the measured median step, the simulator's prediction from a fresh
profile with the links and the SSD at their emulated rates, and from each stage's compute as it ran
in the measured steps (``in_situ_costs``, as ``tests/test_activation_offload.py`` does; against the
median and, for the profiled one, against the
quietest step: on a shared machine other load stretches compute, not the throttled copies), the
host bytes of the offloaded
activations (the window's buffers, and the most held at once) and the SSD bytes per step.
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


def _run_nvme(shape, batch: int, acts: str, bw: float, ssd_bps: float | None, window: int | None, steps: int, path: str) -> dict:
    """One run of the ``--nvme`` rows: ``acts`` ``"host"`` or ``"nvme"`` (through ``window``
    buffers on an emulated SSD of ``ssd_bps`` each way, under ``path``) at link rate ``bw``."""
    import dataclasses

    import shfx
    from shfx.cost_model.simulate import simulate
    from shfx.models import GPT
    from shfx.profiler import profile_costs

    torch.manual_seed(0)
    if acts == "nvme":
        offload = shfx.Offload(activations="nvme", path=path, nvme_read=ssd_bps, nvme_write=ssd_bps, activation_window=window)
    else:
        offload = shfx.Offload(activations=acts)
    cm = shfx.compile(GPT(shape), device=shfx.EmulatedDevice(memory="8GiB", h2d=bw, d2h=bw), window=2,
                      optimizer=shfx.optim.AdamW(lr=1e-2), offload=offload)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    traces = []
    try:
        for i in range(steps + 1):
            x = torch.randint(0, shape.vocab, (batch, shape.seq), generator=g)
            cm(x, x).backward()
            cm.step()
            cm.zero_grad()
            if i:  # (the first step captures and allocates)
                t0, t1 = cm.engine.last_step_window
                traces.append((t0, t1, list(cm.engine.trace)))
        led = cm.variant.ledger()
        w = cm.engine.activation_window
        out = {
            "activations": acts, "link_bps": bw, "ssd_bps": ssd_bps, "window": cm.program.activation_window or None,
            "measured_step_s": statistics.median(cm.engine.step_times[1:]),
            "quietest_step_s": min(cm.engine.step_times[1:]),
            "offloaded_host_bytes": led.static("host").get("offloaded activations", 0),
            "runtime_offload_host_bytes": w.host_bytes if w is not None else cm.engine.activation_stash.allocated_bytes,
            "most_buffers_held": w.peak_held if w is not None else None,
            "ssd_bytes_per_step": led.static("ssd").get("offloaded activations", 0),
            "ssd_written_read_bytes": [w.bytes_written, w.bytes_read] if w is not None else None,
            "moved_bytes": cm.program.bytes_moved(),
        }  # fmt: skip
        costs = profile_costs(cm.engine, cm.variant, [x, x], cache=False)
        if ssd_bps is not None:
            costs = costs.with_links(dataclasses.replace(costs.links, ssd_read_bps=ssd_bps, ssd_write_bps=ssd_bps))
        tl = simulate(cm.program, costs)
        out |= {"predicted_step_s": tl.step_s, "error": tl.step_s / out["measured_step_s"] - 1, "bottleneck": tl.bottleneck,
                "error_vs_quietest": tl.step_s / out["quietest_step_s"] - 1}  # fmt: skip
        # the same program with each stage's compute as it ran in these steps (the test's in-situ
        # costs): the copies and SSD transfers at their emulated rates are the simulator's to place
        from shfx.cost_model.costs import CostTable, Links, StageCost
        from shfx.cost_model.trace import in_situ_costs

        n = len(cm.program.stages)
        base = CostTable([StageCost(0.0, 0.0, update_s=1e-3)] * n, Links(bw, bw))
        situ = in_situ_costs(cm.program, base, traces, overheads=True)
        links = dataclasses.replace(situ.links, h2d_bps=bw, d2h_bps=bw, duplex=cm.backend.spec.duplex,
                                    ssd_read_bps=ssd_bps, ssd_write_bps=ssd_bps)  # fmt: skip
        situ = CostTable(situ.costs, links, source="in situ compute and hand-offs, emulated rates")
        out["predicted_in_situ_step_s"] = simulate(cm.program, situ).step_s
        out["error_in_situ"] = out["predicted_in_situ_step_s"] / out["measured_step_s"] - 1
        return out
    finally:
        cm.close()


def main_nvme(args) -> dict:
    """The ``--nvme`` rows (see the module docstring), merged into the results JSON."""
    import tempfile

    from shfx.models import GPTShape
    from shfx.passes.activations import ACTIVATION_WINDOW
    from shfx.passes.units import parse_bandwidth

    shape = GPTShape(vocab=64, seq=args.seq, layers=args.layers, heads=2, hidden=args.hidden, dropout=0.0)
    bw = parse_bandwidth(args.nvme_link)
    ssd = [parse_bandwidth(r.strip()) for r in args.ssd_rates.split(",")]
    rows = []
    load = [os.getloadavg()[0]]  # (a shared machine: other jobs stretch compute, not the throttled copies)
    with tempfile.TemporaryDirectory(prefix="shfx-act-bench-") as path:
        runs = [("host", None, None)] + [("nvme", r, ACTIVATION_WINDOW) for r in ssd]
        runs += [("nvme", ssd[len(ssd) // 2], w) for w in (1, 3)]
        for acts, r, w in runs:
            row = _run_nvme(shape, args.batch, acts, bw, r, w, args.steps, path)
            rows.append(row)
            print(f"{acts} ssd {r} window {w}: measured {row['measured_step_s']:.3f} s (quietest {row['quietest_step_s']:.3f} s) "
                  f"predicted {row['predicted_step_s']:.3f} s ({row['error']:+.1%}, {row['bottleneck']}), in situ "
                  f"{row['predicted_in_situ_step_s']:.3f} s ({row['error_in_situ']:+.1%}); host bytes {row['runtime_offload_host_bytes']}, "
                  f"ssd bytes/step {row['ssd_bytes_per_step']}", flush=True)  # fmt: skip
    res = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            res = json.load(f)
    res["nvme"] = {"shape": {k: getattr(args, k) for k in ("seq", "hidden", "layers", "batch", "steps", "nvme_link", "ssd_rates")},
                   "command": "python benchmarks/activation_offload.py --nvme", "cores": os.cpu_count(),
                   "load_average_1min_before_after": load + [os.getloadavg()[0]], "rows": rows}  # fmt: skip
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    return res


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
    p.add_argument("--nvme", action="store_true", help="the rows of activations='nvme' only (the 'nvme' key of the JSON)")
    p.add_argument("--nvme-link", default="8MB/s")
    p.add_argument("--ssd-rates", default="2MB/s,8MB/s,32MB/s")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # (small compute; a second thread only adds contention on a shared machine)
    if args.nvme:
        return main_nvme(args)
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
