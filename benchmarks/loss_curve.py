"""The demo model trained in fp32, bf16 and fp16 side by side: the 16-bit loss curves against
fp32's after 300 steps (issue 10's target: within 2%).

Each precision trains the demo's byte-level GPT on the standard library's sources (same seed,
same batches, the demo's learning-rate schedule) on an emulated device with a window of 2
stages; the script prints the smoothed training loss (mean of 20 steps) along the way, the
final validation loss, and their ratio to fp32's, and writes
``benchmarks/results/loss_curve.json``.

    python benchmarks/loss_curve.py                 # 300 steps, 4 layers x 128 (a few minutes a precision on 2 cores)
    python benchmarks/loss_curve.py --steps 50 --layers 2
    python benchmarks/loss_curve.py --seeds 0,1,2   # several seeds: the ratios of the mean losses too
    python benchmarks/loss_curve.py --precisions fp32,bf16,bf16+fp32norms   # LayerNorm parameters kept fp32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

import shfx
from shfx.data import TextDataset
from shfx.demo import DemoConfig, _lr_at
from shfx.models import GPT, GPTShape


def train(variant: str, args, ds: TextDataset, seed: int) -> dict:
    """One run; ``variant``: a precision, or ``"bf16+fp32norms"`` (``fp32_norms=True``)."""
    precision, _, option = variant.partition("+")
    if option not in ("", "fp32norms"):
        raise SystemExit(f"unknown option {option!r} in {variant!r} (precision[+fp32norms])")
    cfg = DemoConfig(steps=args.steps, layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                     batch=args.batch, lr=args.lr, warmup=min(DemoConfig.warmup, args.steps // 10))  # fmt: skip
    shape = GPTShape(layers=cfg.layers, heads=cfg.heads, hidden=cfg.hidden, seq=cfg.seq, vocab=ds.vocab_size, batch=cfg.batch)
    torch.manual_seed(seed)
    model = GPT(shape)
    cm = shfx.compile(
        model, device=shfx.EmulatedDevice(memory="4GiB", h2d=None, d2h=None), window=2, precision=precision, fp32_norms=option == "fp32norms",
        optimizer=shfx.optim.AdamW(lr=cfg.lr, betas=(0.9, 0.95)),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    losses, t0 = [], time.perf_counter()
    for step in range(1, cfg.steps + 1):
        x, y = ds.get_batch("train", cfg.batch, cfg.seq, gen)
        cm.optimizer.lr = _lr_at(step, cfg)
        loss = cm(x, y)
        loss.backward()
        cm.step()
        cm.zero_grad()
        losses.append(float(loss.detach().float()))
        if step % 50 == 0 or step == cfg.steps:
            print(f"  {variant:>4} step {step:4d}  loss (mean of 20) {sum(losses[-20:]) / len(losses[-20:]):.4f}", flush=True)
    vgen = torch.Generator().manual_seed(seed + 1)
    val_batches = [ds.get_batch("val", cfg.batch, cfg.seq, vgen) for _ in range(args.eval_batches)]
    with torch.no_grad():
        val = sum(float(cm(x, y).float()) for x, y in val_batches) / len(val_batches)
    skipped = cm.skipped_steps
    scale = cm.scaler.scale if cm.scaler is not None else None
    cm.close()
    return {
        "precision": variant, "seed": seed, "losses": losses, "final_train": sum(losses[-20:]) / len(losses[-20:]), "val": val,
        "skipped_steps": skipped, "loss_scale": scale, "seconds": time.perf_counter() - t0,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=DemoConfig.lr)
    p.add_argument("--seeds", default="0", help="comma-separated seeds; with several, the ratios of the means are reported too")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--precisions", default="fp32,bf16,fp16")
    p.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "loss_curve.json"))
    args = p.parse_args()
    ds = TextDataset.from_stdlib()
    seeds = [int(x) for x in args.seeds.split(",")]
    precisions = args.precisions.split(",")
    runs = [train(prec, args, ds, seed) for seed in seeds for prec in precisions]
    print(f"\n{'precision':>15} {'seed':>5} {'train (last 20)':>16} {'vs fp32':>8} {'val':>8} {'vs fp32':>8} {'skipped':>8} {'time':>7}")
    for r in runs:
        base = next(b for b in runs if b["seed"] == r["seed"] and b["precision"] == precisions[0])
        r["train_ratio"] = r["final_train"] / base["final_train"]
        r["val_ratio"] = r["val"] / base["val"]
        print(f"{r['precision']:>15} {r['seed']:5d} {r['final_train']:16.4f} {r['train_ratio']:8.4f} {r['val']:8.4f} "
              f"{r['val_ratio']:8.4f} {r['skipped_steps']:8d} {r['seconds']:6.0f}s")  # fmt: skip
        assert math.isfinite(r["final_train"])
    summary = {}
    if len(seeds) > 1:
        print(f"\nmeans over seeds {seeds}:")
        for prec in precisions:
            mine = [r for r in runs if r["precision"] == prec]
            base = [r for r in runs if r["precision"] == precisions[0]]
            tr = sum(r["final_train"] for r in mine) / sum(r["final_train"] for r in base)
            va = sum(r["val"] for r in mine) / sum(r["val"] for r in base)
            summary[prec] = {"train_ratio_of_means": tr, "val_ratio_of_means": va}
            print(f"{prec:>15} train {tr:.4f}  val {va:.4f}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"config": vars(args), "runs": runs, "summary": summary}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
