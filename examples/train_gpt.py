"""Train a small GPT with shfx on an emulated device whose memory is smaller than the model.

    python examples/train_gpt.py                                   # one process
    torchrun --nproc-per-node 2 examples/train_gpt.py --window 2   # data parallel, one process per device
    torchrun --nproc-per-node 2 examples/train_gpt.py --precision bf16 --max-grad-norm 1.0 --nvme /tmp/shfx-nvme
                                                                   # + bf16, exact clipping, AdamW states on an SSD

Shows the stage table, the step program, and the loss going down; then checks the weights
against eager PyTorch trained on the same data: ``torch.optim.AdamW(fused=True)`` in one
process, and under ``torchrun`` eager ``DistributedDataParallel`` over the same ranks and
batches (bitwise equal on the CPU with 2 ranks: the mean of two gradients is exact in either
order). It prints the largest difference and exits with status 1 when the weights differ (with
more than 2 ranks, gloo's ring sums in another order than for DDP's bucket: then only a
difference above ``--tolerance`` fails).

``--precision bf16`` checks against the eager mixed-precision recipe (under ``torchrun``, the
recipe under DDP): DDP on a bf16 copy of the model (it multiplies each bf16 gradient by 1/N and
SUM-all-reduces it in bf16), fp32 master weights with ``master.grad = p16.grad.float()``,
``clip_grad_norm_`` on the masters' reduced gradients (``--max-grad-norm``), fused AdamW on the
masters, ``p16.copy_(master)``. shfx's model then holds the bf16 working copy (compared with the
eager bf16 copy) and, under data parallel, each rank its shard of the fp32 masters (compared
with the eager masters' range). ``--nvme DIR`` keeps AdamW's states on the NVMe tier
(``shfx.Offload(optimizer="nvme", path=DIR)``: each rank its shard's states in its own file
there); the numbers do not change.

Under ``torchrun`` each process initialises ``torch.distributed`` (gloo: the CPU), gets its own
emulated device and its own batches, and compiles with ``data_parallel=True``: the gradients are
reduce-scattered across the ranks stage by stage during the backward, each rank's host optimizer
updates its 1/N shard, and the updated shards are all-gathered before the next prefetch.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

import shfx
from shfx.data import TextDataset
from shfx.models import GPT, GPTShape


def _working_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The eager recipe's 16-bit model: a copy with its floating-point parameters in ``dtype``
    (a tied parameter cast once, so it stays tied)."""
    work = copy.deepcopy(model)
    for p in work.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return work


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=int, default=2, help="stages resident on the device at once")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (per rank under torchrun; 8, --small 4)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--max-grad-norm", type=float, default=None, help="clip the gradients' total norm (exactly)")
    ap.add_argument("--nvme", metavar="DIR", default=None, help="AdamW's states on the NVMe tier, its file(s) in DIR")
    ap.add_argument("--small", action="store_true", help="a tiny GPT (4 layers, hidden 64, seq 32): a quick check")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="largest weight difference accepted with more than 2 ranks (with 2 or 1: bitwise)")  # fmt: skip
    args = ap.parse_args(argv)
    args.batch = args.batch or (4 if args.small else 8)

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, ranks = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    say = print if rank == 0 else (lambda *a, **k: None)
    bf16 = args.precision == "bf16"

    torch.manual_seed(0)  # the same initial weights on every rank (shfx also broadcasts rank 0's)
    if args.small:
        cfg = GPTShape(layers=4, hidden=64, heads=2, seq=32, vocab=256)
    else:
        cfg = GPTShape(layers=6, hidden=128, heads=4, seq=64, vocab=256)
    model = GPT(cfg)
    masters = copy.deepcopy(model)  # eager: the model itself (fp32), or the fp32 masters of the bf16 recipe
    work = _working_copy(masters, torch.bfloat16) if bf16 else masters  # what eager runs forward and backward
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    device = shfx.EmulatedDevice(memory=int(model_bytes * (0.9 if args.small else 0.75)), h2d="8GB/s", d2h="8GB/s")
    cm = shfx.compile(
        model, device=device, window=args.window, optimizer=shfx.optim.AdamW(lr=args.lr), data_parallel=distributed,
        precision=args.precision, max_grad_norm=args.max_grad_norm,
        offload=shfx.Offload(optimizer="nvme", path=args.nvme) if args.nvme else None,
    )  # fmt: skip
    eager = torch.nn.parallel.DistributedDataParallel(work) if distributed else work
    opt = torch.optim.AdamW(masters.parameters(), lr=args.lr, fused=True)
    pairs16 = list(zip(work.parameters(), masters.parameters())) if bf16 else []

    data = TextDataset.from_stdlib(max_bytes=60_000 if args.small else 300_000)  # Python's own sources as bytes
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
    for step in range(args.steps):
        x, y = data.get_batch("train", args.batch, cfg.seq, gen)
        loss = cm(x, y)
        loss.backward()
        cm.step()
        cm.zero_grad()
        eager(x, y).backward()  # (DDP: each gradient * 1/N, SUM all-reduce, in the model's dtype)
        for p16, p in pairs16:  # the bf16 recipe: the reduced bf16 gradients, widened, on the fp32 masters
            p.grad = None if p16.grad is None else p16.grad.float()
            p16.grad = None
        if args.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(masters.parameters(), args.max_grad_norm)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p16, p in pairs16:
                p16.copy_(p)
        if step == 0:
            say(cm.stages.describe(), "\n")
            say(cm.program, "\n")
        if step % 5 == 0 or step == args.steps - 1:
            say(f"step {step:2d}  loss {loss.item():.4f}" + (f" (rank 0 of {ranks})" if distributed else ""))

    # the weights: shfx's model holds fp32 weights, or in bf16 the bf16 working copy (its trainable
    # parameters) beside fp32 ones; each compared with the eager tensor of its dtype
    sd, wsd, msd = cm.state_dict(), work.state_dict(), masters.state_dict()
    pairs = [(k, sd[k], wsd[k] if sd[k].dtype == wsd[k].dtype else msd[k]) for k in sd]
    dp = cm.engine.dp
    if dp is not None:  # (bf16) this rank's shard of the fp32 masters against the eager masters' range
        params = dict(masters.named_parameters())
        pairs += [(f"master {k}[{lo}:{hi}]", v, params[k].detach().flatten()[lo:hi]) for k, (_, lo, hi, v) in dp.master_pieces().items()]
    diffs = {k: (a.float() - b.float()).abs().max().item() if a.numel() else 0.0 for k, a, b in pairs}
    worst = max(diffs, key=diffs.get)
    same = all(torch.equal(a, b) for _, a, b in pairs)
    what = f"eager DistributedDataParallel over {ranks} ranks" if distributed else "eager PyTorch"
    recipe = ", ".join(
        s for s in (args.precision, args.max_grad_norm and f"max_grad_norm={args.max_grad_norm:g}", args.nvme and "NVMe tier") if s
    )
    print(
        f"{'rank %d: ' % rank if distributed else ''}model {model_bytes / 2**20:.2f} MiB on a "
        f"{device.memory_bytes / 2**20:.2f} MiB device ({recipe}); weights equal to {what}: {same} "
        f"(max |difference| {diffs[worst]:.1e}{'' if same else ' at ' + worst})"
    )
    say(cm.stats())
    cm.close()
    if distributed:
        dist.destroy_process_group()
    # bitwise expected in one process and with 2 ranks; with more, gloo's ring sums in another
    # order than DDP's bucket: rounding, within --tolerance
    ok = same or (ranks > 2 and diffs[worst] <= args.tolerance)
    if not ok:
        print(f"MISMATCH{' on rank %d' % rank if distributed else ''}: {worst} differs by {diffs[worst]:.3e}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
