"""Train a small GPT with shfx on an emulated device whose memory is smaller than the model.

    python examples/train_gpt.py

Shows the stage table, the step program, and the loss going down; then checks the weights
against eager PyTorch trained on the same data (they are bitwise equal on the CPU).
"""

from __future__ import annotations

import copy

import torch

import shfx
from shfx.data import TextDataset
from shfx.models import GPT, GPTShape


def main() -> None:
    torch.manual_seed(0)
    cfg = GPTShape(layers=6, hidden=128, heads=4, seq=64, vocab=256)
    model = GPT(cfg)
    eager = copy.deepcopy(model)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    device = shfx.EmulatedDevice(memory=int(model_bytes * 0.75), h2d="8GB/s", d2h="8GB/s")
    cm = shfx.compile(model, device=device, window=2, optimizer=shfx.optim.AdamW(lr=3e-3))
    opt = torch.optim.AdamW(eager.parameters(), lr=3e-3, fused=True)

    data = TextDataset.from_stdlib(max_bytes=300_000)  # Python's own sources as bytes
    gen = torch.Generator().manual_seed(1)
    for step in range(40):
        x, y = data.get_batch("train", 8, cfg.seq, gen)
        loss = cm(x, y)
        loss.backward()
        cm.step()
        cm.zero_grad()
        eager(x, y).backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            print(cm.stages.describe(), "\n")
            print(cm.program, "\n")
        if step % 5 == 0 or step == 39:
            print(f"step {step:2d}  loss {loss.item():.4f}")
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), eager.state_dict().values()))
    print(f"\nmodel {model_bytes / 2**20:.2f} MiB on a {device.memory_bytes / 2**20:.2f} MiB device; "
          f"weights equal to eager PyTorch: {same}")
    print(cm.stats())
    cm.close()


if __name__ == "__main__":
    main()
