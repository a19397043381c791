"""Which bf16 rounding slows the demo GPT down? An fp32 run with bf16 rounding at chosen places.

The model computes in fp32; before each forward the weights are copied from an fp32 master
(``torch.optim.AdamW(fused=True)`` updates the master), rounded to bf16 where the variant says so:

- ``none``: no rounding (the fp32 run);
- ``w``: every weight (what the 16-bit working copy does to the weights, without 16-bit compute);
- ``wln``: only the LayerNorm parameters; ``wnoln``: every weight except them
  (``shfx.compile(fp32_norms=True)``'s working copy);
- ``+g``: the gradients handed to the master are rounded too; ``+lin``/``+ln``/``+emb``: the
  outputs of Linear/LayerNorm/Embedding modules are rounded (their gradients then are as well).

Prints, per variant and seed, the mean loss of the last 20 of 300 steps and the step at which the
smoothed loss first falls below 3.0 (leaving the early plateau), as in ``loss_curve.py`` (same data,
model, learning-rate schedule and seeds).

    python benchmarks/bf16_rounding.py --variants none,w,wln,wnoln --seeds 0,1,2,3   # ~1 min a run on 1 core
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from shfx.data import TextDataset
from shfx.demo import DemoConfig, _lr_at
from shfx.models import GPT, GPTShape


def run(variant: str, seed: int, ds: TextDataset, steps: int = 300) -> tuple[float, int | None]:
    cfg = DemoConfig(steps=steps, layers=4, hidden=128, heads=4, seq=64, batch=8, lr=DemoConfig.lr,
                     warmup=min(DemoConfig.warmup, steps // 10))  # fmt: skip
    torch.manual_seed(seed)
    model = GPT(GPTShape(layers=4, heads=4, hidden=128, seq=64, vocab=ds.vocab_size, batch=8))
    master = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=cfg.lr, betas=(0.9, 0.95), fused=True)
    kinds = set(variant.split("+"))

    def rnd(t: torch.Tensor) -> torch.Tensor:
        return t.bfloat16().float()

    for m in model.modules():
        if ("lin" in kinds and isinstance(m, nn.Linear)) or ("ln" in kinds and isinstance(m, nn.LayerNorm)) or (
            "emb" in kinds and isinstance(m, nn.Embedding)
        ):
            m.register_forward_hook(lambda mod, inp, out: rnd(out))
    gen, losses = torch.Generator().manual_seed(seed), []
    for step in range(1, steps + 1):
        x, y = ds.get_batch("train", cfg.batch, cfg.seq, gen)
        with torch.no_grad():
            for (name, p), m in zip(model.named_parameters(), master):
                norm = ".ln_" in name or "ln_f" in name
                rounded = "w" in kinds or ("wln" in kinds and norm) or ("wnoln" in kinds and not norm)
                p.copy_(rnd(m) if rounded else m)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        model.zero_grad()
        loss = model(x, y)
        loss.backward()
        for p, m in zip(model.parameters(), master):
            m.grad = rnd(p.grad) if "g" in kinds else p.grad.clone()
        opt.step()
        losses.append(loss.item())
    smooth = [sum(losses[max(0, i - 19) : i + 1]) / len(losses[max(0, i - 19) : i + 1]) for i in range(steps)]
    left = next((i + 1 for i, v in enumerate(smooth) if v < 3.0), None)
    return sum(losses[-20:]) / len(losses[-20:]), left


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="none,w,wln,wnoln")
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    ds = TextDataset.from_stdlib()
    print(f"{'variant':>16} {'seed':>5} {'loss (last 20)':>15} {'below 3.0 at':>13}")
    for seed in (int(s) for s in args.seeds.split(",")):
        for v in args.variants.split(","):
            final, left = run(v, seed, ds, args.steps)
            print(f"{v:>16} {seed:5d} {final:15.4f} {str(left):>13}", flush=True)


if __name__ == "__main__":
    main()
