"""Fine-tuning the top quarter of a GPT vs training all of it, side by side (interleaved).

    python benchmarks/frozen.py                      # GPT 8 x 256, window 2, 6 GB/s link, 20 steps
    python benchmarks/frozen.py --layers 12 --hidden 384 --link 2GB/s

"Bottom 3/4 frozen": the embeddings and the first 3/4 of the blocks have ``requires_grad=False``
(the head's tied weight stays trainable only if the embedding is: the model is untied here).
Both models are compiled with stronghold at the same window on the same emulated device and
stepped alternately; the table gives the median measured step time (``engine.step_times``), the
bytes each step moves per direction (the backend's counters over the measured steps, divided
by the steps; equal to ``Program.bytes_moved``), the number of BACKWARD actions the program
runs, the ledger's device peak and the host memory the runtime holds (weights, gradients,
optimizer states). Writes ``benchmarks/results/frozen.json``.

NOTE: on the emulated device the "device" compute and the host optimizer share the CPU cores,
so a step's time is mostly compute; the frozen model saves the backward of the frozen blocks
(their recompute and their gradients), their gradient copies and their host updates.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics

import torch

import shfx
from shfx.models.gpt import GPT, GPTShape
from shfx.passes.actions import B
from shfx.passes.meta import get_meta


def _model(shape: GPTShape, frozen_blocks: int) -> GPT:
    torch.manual_seed(0)
    m = GPT(shape)
    if frozen_blocks:
        frozen = ("transformer.wte", "transformer.wpe") + tuple(f"transformer.h.{i}." for i in range(frozen_blocks))
        for n, p in m.named_parameters():
            if n.startswith(frozen):
                p.requires_grad_(False)
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--link", default="6GB/s", help="emulated h2d and d2h bandwidth")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/frozen.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    shape = GPTShape(vocab=256, seq=a.seq, layers=a.layers, heads=max(1, a.hidden // 64), hidden=a.hidden, tie_weights=False)
    configs = {"all trainable": 0, "bottom 3/4 frozen": (3 * a.layers) // 4}
    cms = {
        name: shfx.compile(
            _model(shape, k), device=shfx.EmulatedDevice(memory="4GiB", h2d=a.link, d2h=a.link),
            policy=shfx.Stronghold(window=a.window), optimizer=shfx.optim.AdamW(lr=1e-4),
        )  # fmt: skip
        for name, k in configs.items()
    }
    x = torch.randint(0, 256, (a.batch, a.seq), generator=torch.Generator().manual_seed(1))
    start: dict[str, tuple[int, int]] = {}
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            start = {n: (cm.backend.bytes_h2d, cm.backend.bytes_d2h) for n, cm in cms.items()}
        for name in (list(cms) if i % 2 == 0 else list(cms)[::-1]):  # alternate who goes first
            cm = cms[name]
            cm(x, x).backward()
            cm.step()
            cm.zero_grad()
    rows = []
    for name, cm in cms.items():
        t = cm.engine.step_times[a.warmup :]
        h2d = (cm.backend.bytes_h2d - start[name][0]) // a.steps
        d2h = (cm.backend.bytes_d2h - start[name][1]) // a.steps
        assert {"h2d": h2d, "d2h": d2h} == cm.program.bytes_moved(), name
        rows.append({
            "config": name, "frozen_blocks": configs[name], "median_step_ms": statistics.median(t) * 1e3,
            "min_step_ms": min(t) * 1e3, "h2d_bytes_per_step": h2d, "d2h_bytes_per_step": d2h,
            "backward_actions": sum(1 for n in cm.program.nodes if get_meta(n).kind == B),
            "stages": len(cm.program.stages), "device_peak_bytes": cm.variant.ledger().peak(),
            "host_bytes": cm.engine.host_bytes(),
        })  # fmt: skip
        cm.close()
    base = rows[0]["median_step_ms"]
    print(f"GPT {a.layers} x {a.hidden}, seq {a.seq}, batch {a.batch}, stronghold W={a.window}, link {a.link}, {a.steps} steps")
    print(f"{'config':<18} {'step ms':>8} {'x':>6} {'h2d/step':>10} {'d2h/step':>10} {'B':>3} {'dev peak':>10} {'host':>10}")
    for r in rows:
        print(
            f"{r['config']:<18} {r['median_step_ms']:8.1f} {r['median_step_ms'] / base:6.2f} {r['h2d_bytes_per_step']:10d} "
            f"{r['d2h_bytes_per_step']:10d} {r['backward_actions']:3d} {r['device_peak_bytes']:10d} {r['host_bytes']:10d}"
        )
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "machine": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__, "rows": rows}, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
