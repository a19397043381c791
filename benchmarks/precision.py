"""Mixed precision, simulated: REFERENCE.md's GPT in fp32, bf16 and fp16 side by side.

    python benchmarks/precision.py                  # V100 profile + this machine's emulated device (~1 min)
    python benchmarks/precision.py --no-measure     # emulated device from the last JSON's measurements
    python benchmarks/precision.py --layers 96 --window 2

For STRONGHOLD's GPT (hidden 2048, 16 heads, seq 1024, batch 4, vocabulary 50304; 48 layers by
default) the analytic costs of :class:`shfx.cost_model.depth.DepthModel` and the simulator give
one stronghold step (at ``--window`` and at the window the tuner picks) in

- ``fp32``;
- ``bf16``: 16-bit working copy and gradients on the device, 2 bytes per parameter each way
  on the link, the profile's bf16 matmul rate, 40 instead of 28 host bytes per parameter
  updated (the gradient's cast, the working copy's refresh);
- ``fp16+rollback``: the same at the fp16 matmul rate, plus the step journal's rollback copy of
  each group before its host update (on by default in fp16: an overflow undoes the updates
  already run), charged as ``StageCost.rollback_s`` = ROLLBACK_COPY_RATIO x the fp32 update;
- ``fp16`` without the copies, to separate the two effects.

On two machines:

1. the ``V100-32GB-PCIe3`` profile (STRONGHOLD's; its bf16 runs on CUDA cores at the fp32
   rate: Volta has fp16 tensor cores only);
2. the emulated device on this machine: an ``EmulatedDevice()`` (25 GB/s each way) whose
   compute runs on these CPU cores, as a :class:`~shfx.cost_model.hardware.Hardware` whose rates
   are measured here: ``F.linear`` FLOP/s per dtype, memcpy bandwidth (device memory), the
   fused AdamW's bytes per second (host memory) and the ratio of the rollback copy (3 copies:
   master, m, v) to that update on one 8 M-parameter group. ``--no-measure`` reuses them
   from ``benchmarks/results/precision.json``. There REFERENCE.md's GPT takes most of an hour
   a step on the CPU, all of it compute; ``--small`` (the default) adds a GPT this machine
   trains in about a second a step (8 layers x 512, seq 256, batch 4, vocabulary 256:
   ``benchmarks/overhead.py``'s ``medium``), where the link and the host updates show, so a
   16-bit run of ``shfx compare --device emulated --precision bf16`` can be checked against it.

Writes ``benchmarks/results/precision.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from shfx.cost_model.costs import ROLLBACK_COPY_RATIO  # noqa: E402
from shfx.cost_model.depth import DepthModel  # noqa: E402
from shfx.cost_model.hardware import Hardware, get_profile  # noqa: E402
from shfx.cost_model.tune import tune_window  # noqa: E402
from shfx.devices import EmulatedDevice  # noqa: E402
from shfx.models.gpt import GPT, GPTShape  # noqa: E402
from shfx.passes.policies import policy_program  # noqa: E402
from shfx.cost_model.simulate import simulate  # noqa: E402

REF = dict(hidden=2048, heads=16, seq=1024, batch=4, vocab=50304)
SMALL = dict(hidden=512, heads=8, seq=256, batch=4, vocab=256)
SMALL_LAYERS = 8
CONFIGS = (  # (label, precision, rollback)
    ("fp32", "float32", False),
    ("bf16", "bfloat16", False),
    ("fp16+rollback", "float16", True),
    ("fp16", "float16", False),
)
OUT = ROOT / "benchmarks" / "results" / "precision.json"


# ---- this machine's emulated device, measured ---------------------------------------------------
def _median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_emulated(reps: int = 3) -> dict:
    """Rates of the CPU the emulated device computes on (see the module docstring)."""
    import torch.nn.functional as F

    flops = {}
    m, k, n = 1024, 512, 2048  # the small GPT's MLP projection (b s = 1024 tokens, h -> 4h)
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        x, w, b = torch.randn(m, k, dtype=dt), torch.randn(n, k, dtype=dt), torch.randn(n, dtype=dt)
        flops[name] = 2 * m * k * n / _median_time(lambda: F.linear(x, w, b), reps)
    src, dst = torch.ones(1 << 25), torch.empty(1 << 25)  # 128 MiB each
    memcpy_bps = 2 * src.numel() * 4 / _median_time(lambda: dst.copy_(src), reps + 2)
    del src, dst
    g = 8 * 2**20  # one group of 8 M parameters: master, gradient, m, v and the journal's copies
    p, grad, m1, v1 = (torch.rand(g) for _ in range(4))
    steps = torch.zeros(())
    copies = [torch.empty(g) for _ in range(3)]

    def update():
        steps.add_(1)
        torch._fused_adamw_([p], [grad], [m1], [v1], [], [steps], lr=1e-4, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)  # fmt: skip

    def copy():
        for c, t in zip(copies, (p, m1, v1)):
            c.copy_(t)

    upd_s = _median_time(update, reps + 4)
    copy_s = _median_time(copy, reps + 4)
    return {
        "flops": flops,
        "memcpy_bps": memcpy_bps,
        "adamw_bps": 28 * g / upd_s,
        "rollback_ratio": copy_s / upd_s,
        "group_params": g,
        "update_s": upd_s,
        "copy_s": copy_s,
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def emulated_hardware(rates: dict, device: EmulatedDevice) -> Hardware:
    """The emulated device as a hardware profile: compute and device memory are this CPU's
    (measured), the link the emulated device's."""
    return Hardware(
        name=f"emulated ({device.h2d} each way, this machine's CPU)",
        device_memory_bytes=device.memory_bytes,
        flops=dict(rates["flops"]),
        device_mem_bps=rates["memcpy_bps"],
        h2d_bps=device.h2d_bps,
        d2h_bps=device.d2h_bps,
        duplex=device.duplex,
        link_latency_s=20e-6,
        host_cores=os.cpu_count() or 1,
        host_mem_bps=rates["adamw_bps"],
        host_memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
    )


# ---- one machine, every precision ----------------------------------------------------------------
def study(hw: Hardware, dims: dict, layers: int, window: int, rollback_ratio: float | None) -> list[dict]:
    rows = []
    for label, precision, rollback in CONFIGS:
        shape = GPTShape(**dims, layers=layers, precision=precision)
        dm = DepthModel(
            lambda n, s=shape: GPT(s.with_layers(n)), lambda: (torch.zeros(dims["batch"], dims["seq"], dtype=torch.long),) * 2,
            blocks="transformer.h", hardware=hw, precision=precision, rollback=rollback,
        )  # fmt: skip
        specs, costs = dm.at(layers)
        if rollback_ratio is not None:  # this machine's measured copy/update ratio instead of the stored one
            costs = replace(costs, costs=[replace(c, rollback_s=rollback_ratio / ROLLBACK_COPY_RATIO * c.rollback_s)
                                          for c in costs.costs])  # fmt: skip
        prog = policy_program("stronghold", specs, window, 0)
        tl = simulate(prog, costs, rollback=rollback)
        moved = prog.bytes_moved()
        tune = tune_window(specs, costs, capacity_bytes=hw.device_memory_bytes, rollback=rollback)
        block = costs.costs[1]
        rows.append({
            "config": label, "precision": precision, "rollback": rollback,
            "matmul_flops": hw.matmul_flops(precision),
            "step_s": tl.step_s, "bottleneck": tl.bottleneck,
            "critical_path_s": {k: v for k, v in tl.by_resource.items() if v},
            "h2d_bytes": moved["h2d"], "d2h_bytes": moved["d2h"],
            "block_forward_s": block.forward_s, "block_update_s": block.update_s,
            "block_rollback_s": block.rollback_copy_s() if rollback else 0.0,
            "tuned_window": tune.window, "tuned_step_s": tune.chosen.step_s, "tuned_bottleneck": tune.chosen.bottleneck,
        })  # fmt: skip
    return rows


def _fmt_s(x: float) -> str:
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def table(name: str, rows: list[dict], window: int) -> str:
    base = rows[0]["step_s"]
    head = (f"{'':<14} {'matmul':>11} {'step W=' + str(window):>10} {'vs fp32':>8} {'bound':<15} {'host opt.':>9} "
            f"{'h2d/step':>9} {'d2h/step':>9} {'U+copy/block':>13} {'tuned':>16}")  # fmt: skip
    out = [name, head, "-" * len(head)]
    for r in rows:
        host = r["critical_path_s"].get("host optimizer", 0.0) / r["step_s"]
        upd = r["block_update_s"] + r["block_rollback_s"]
        out.append(
            f"{r['config']:<14} {r['matmul_flops'] / 1e12:>7.3g} TF/s {_fmt_s(r['step_s']):>10} {r['step_s'] / base:>7.2f}x "
            f"{r['bottleneck']:<15} {100 * host:>8.0f}% {r['h2d_bytes'] / 2**30:>5.1f} GiB {r['d2h_bytes'] / 2**30:>5.1f} GiB "
            f"{_fmt_s(upd):>13} {'W=' + str(r['tuned_window']) + ' ' + _fmt_s(r['tuned_step_s']):>16}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each measurement of the emulated device")
    ap.add_argument("--no-measure", action="store_true", help="reuse the emulated device's rates from --out")
    ap.add_argument("--no-small", dest="small", action="store_false",
                    help="leave out the small GPT on the emulated device")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    if a.no_measure:
        rates = json.loads(a.out.read_text())["emulated_rates"]
    else:
        rates = measure_emulated(a.reps)
    dev = EmulatedDevice()
    emu = emulated_hardware(rates, dev)
    ref = f"REFERENCE.md's GPT, {a.layers} layers"
    machines = [
        (f"{ref} on the V100-32GB-PCIe3 profile", get_profile("V100-32GB-PCIe3"), None, REF, a.layers),
        (f"{ref} on the emulated device ({dev.h2d} each way, this CPU's measured rates)", emu, rates["rollback_ratio"],
         REF, a.layers),
    ]  # fmt: skip
    if a.small:
        machines.append((f"GPT {SMALL_LAYERS} x {SMALL['hidden']}, seq {SMALL['seq']}, batch {SMALL['batch']}, vocab "
                         f"{SMALL['vocab']} on the emulated device", emu, rates["rollback_ratio"], SMALL, SMALL_LAYERS))
    print(f"REFERENCE.md's GPT: hidden 2048, 16 heads, seq 1024, batch 4, vocab 50304, {a.layers} layers "
          f"({GPTShape(**REF, layers=a.layers).num_params() / 1e9:.2f} B params); stronghold, one step simulated")
    fl = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in rates["flops"].items())
    print(f"emulated device's CPU: matmul GFLOP/s {fl}; memcpy {rates['memcpy_bps'] / 1e9:.1f} GB/s; fused AdamW "
          f"{rates['adamw_bps'] / 1e9:.1f} GB/s (28 B/param); rollback copy / update {rates['rollback_ratio']:.2f} "
          f"(stored: {ROLLBACK_COPY_RATIO})\n")
    results = []
    for name, hw, ratio, dims, layers in machines:
        rows = study(hw, dims, layers, a.window, ratio)
        print(table(name, rows, a.window) + "\n")
        results.append({"machine": name, "hardware": asdict(hw), "shape": dict(dims, layers=layers), "rows": rows})
    wall = time.perf_counter() - t0
    print(f"{wall:.1f} s")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": "precision", "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
        "machine": {"cpus": os.cpu_count(), "load": os.getloadavg(), "torch": torch.__version__,
                    "python": platform.python_version()},
        "emulated_rates": rates, "rollback_copy_ratio_used": ROLLBACK_COPY_RATIO, "results": results, "wall_s": wall,
    }  # fmt: skip
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
