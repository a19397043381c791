"""Train a small GPT with shfx on an emulated device whose memory is smaller than the model.

    python examples/train_gpt.py                                   # one process
    torchrun --nproc-per-node 2 examples/train_gpt.py --window 2   # data parallel, one process per device

Shows the stage table, the step program, and the loss going down; then checks the weights
against eager PyTorch trained on the same data: ``torch.optim.AdamW`` in one process, and under
``torchrun`` eager ``DistributedDataParallel`` over the same ranks and batches (bitwise equal on
the CPU with 2 ranks: the mean of two gradients is exact in either order).

Under ``torchrun`` each process initialises ``torch.distributed`` (gloo: the CPU), gets its own
emulated device and its own batches, and compiles with ``data_parallel=True``: the gradients are
reduce-scattered across the ranks stage by stage during the backward, each rank's host optimizer
updates its 1/N shard, and the updated shards are all-gathered before the next prefetch.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist

import shfx
from shfx.data import TextDataset
from shfx.models import GPT, GPTShape


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=int, default=2, help="stages resident on the device at once")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (per rank under torchrun)")
    args = ap.parse_args(argv)

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, ranks = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    say = print if rank == 0 else (lambda *a, **k: None)

    torch.manual_seed(0)  # the same initial weights on every rank (shfx also broadcasts rank 0's)
    cfg = GPTShape(layers=6, hidden=128, heads=4, seq=64, vocab=256)
    model = GPT(cfg)
    eager = copy.deepcopy(model)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    device = shfx.EmulatedDevice(memory=int(model_bytes * 0.75), h2d="8GB/s", d2h="8GB/s")
    cm = shfx.compile(
        model, device=device, window=args.window, optimizer=shfx.optim.AdamW(lr=3e-3), data_parallel=distributed
    )
    if distributed:
        eager = torch.nn.parallel.DistributedDataParallel(eager)
    opt = torch.optim.AdamW(eager.parameters(), lr=3e-3, fused=True)

    data = TextDataset.from_stdlib(max_bytes=300_000)  # Python's own sources as bytes
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
    for step in range(args.steps):
        x, y = data.get_batch("train", args.batch, cfg.seq, gen)
        loss = cm(x, y)
        loss.backward()
        cm.step()
        cm.zero_grad()
        eager(x, y).backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            say(cm.stages.describe(), "\n")
            say(cm.program, "\n")
        if step % 5 == 0 or step == args.steps - 1:
            say(f"step {step:2d}  loss {loss.item():.4f}" + (f" (rank 0 of {ranks})" if distributed else ""))
    ref = eager.module if distributed else eager
    pairs = list(zip(model.state_dict().values(), ref.state_dict().values()))
    same = all(torch.equal(a, b) for a, b in pairs)
    what = f"eager DistributedDataParallel over {ranks} ranks" if distributed else "eager PyTorch"
    # (with more than 2 ranks gloo sums each gradient in another order than for DDP's bucket: rounding)
    diff = "" if same else f" (max |difference| {max((a - b).abs().max().item() for a, b in pairs):.1e})"
    print(
        f"{'rank %d: ' % rank if distributed else ''}model {model_bytes / 2**20:.2f} MiB on a "
        f"{device.memory_bytes / 2**20:.2f} MiB device; weights equal to {what}: {same}{diff}"
    )
    say(cm.stats())
    cm.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
