"""Fine-tune a Hugging Face causal LM with shfx: the whole trainer's recipe, end to end.

    pip install transformers
    python examples/finetune_hf.py                                   # Llama from a config, emulated device
    python examples/finetune_hf.py --arch gpt2 --layers 8 --hidden 256
    python examples/finetune_hf.py --steps 60 --save-every 20 --checkpoint-dir ckpt --stop-after 40
    python examples/finetune_hf.py --steps 60 --save-every 20 --checkpoint-dir ckpt --resume
    python examples/finetune_hf.py --device cuda --layers 24 --hidden 1024

The model is built from a ``transformers`` config (``LlamaConfig`` or ``GPT2Config``; random
weights, nothing is downloaded) and trained on token sequences drawn from a fixed random Markov
chain (a bigram table made from ``--seed``), so the loss has somewhere to go: from about
``ln(vocab)`` towards the chain's entropy, printed as the floor. No tokenizer, no data set.

The recipe, as a Hugging Face user writes it:

- AdamW with two parameter groups: weight decay on the weights of linear layers and embeddings,
  none on biases and normalization weights (:func:`param_groups`);
- ``transformers.get_cosine_schedule_with_warmup`` on ``cm.optimizer``;
- gradient clipping by the global norm (``shfx.compile(max_grad_norm=...)``: exact, and the
  host update stays overlapped);
- gradient accumulation: ``--grad-accum K`` micro-batches per step, each loss divided by K;
- a checkpoint every ``--save-every N`` steps to ``<checkpoint-dir>/latest`` (atomic, with the
  scheduler, the RNG states, and the step and data position in ``extra``), and ``--resume``,
  which continues from it exactly: the same losses and weights, to the bit, as a run that never
  stopped (``tests/test_example_hf.py`` checks this across processes).

By default the device is ``shfx.EmulatedDevice`` with a memory capacity below the model's
weight bytes (``--device-memory``, default :func:`default_device_memory`), so the blocks really
stream through it; ``--device cuda`` trains on a GPU. :func:`main` is importable: ``main(argv) -> dict`` returns
the per-step losses, learning rates and gradient norms (and the final weights).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

import torch
from torch import nn

import shfx
import shfx.checkpoint
from shfx.passes.units import parse_bytes

__all__ = ["MarkovData", "build_model", "default_device_memory", "main", "model_config", "param_groups", "parse_args"]

# what a checkpoint must agree on to be resumed (the model, the data, the schedule)
_RESUME_KEYS = (
    "arch", "layers", "hidden", "heads", "vocab", "seq", "batch", "grad_accum", "dropout", "seed", "steps", "warmup",
)  # fmt: skip


# ---- data -------------------------------------------------------------------------------------


class MarkovData:
    """Token sequences from a fixed random first-order Markov chain.

    Every token has ``branching`` possible successors (a random subset of the vocabulary) with
    random probabilities; the table is made from ``seed``. Batch ``i`` is a function of
    ``(seed, i)`` alone, so the data position of a run is one integer (``next_batch``), which
    is what a checkpoint stores.

    >>> data = MarkovData(vocab=16, seq=8, batch=2, seed=0)
    >>> data.batch(3).shape, torch.equal(data.batch(3), data.batch(3))
    (torch.Size([2, 8]), True)
    >>> 0 < data.entropy() < math.log(16)
    True
    """

    def __init__(self, vocab: int, seq: int, batch: int, seed: int, branching: int = 4) -> None:
        if branching > vocab:
            raise ValueError(f"branching ({branching}) must be at most vocab ({vocab})")
        self.vocab, self.seq, self.batch_size, self.seed = vocab, seq, batch, seed
        g = torch.Generator().manual_seed(seed)
        table = torch.zeros(vocab, vocab, dtype=torch.float64)
        for t in range(vocab):
            nxt = torch.randperm(vocab, generator=g)[:branching]
            w = torch.rand(branching, generator=g, dtype=torch.float64) + 0.25
            table[t, nxt] = w / w.sum()
        self.table = table

    def batch(self, index: int) -> torch.Tensor:
        """Batch ``index``: ``(batch, seq)`` int64 token ids; the first token uniform."""
        g = torch.Generator().manual_seed((self.seed << 32) + index)
        ids = torch.empty(self.batch_size, self.seq, dtype=torch.long)
        ids[:, 0] = torch.randint(0, self.vocab, (self.batch_size,), generator=g)
        for t in range(1, self.seq):
            ids[:, t] = torch.multinomial(self.table[ids[:, t - 1]], 1, generator=g).squeeze(1)
        return ids

    def entropy(self) -> float:
        """The chain's entropy rate (nats per token, under its stationary distribution): the
        loss a perfect bigram model approaches (the first token of a sequence costs more)."""
        pi = torch.full((self.vocab,), 1.0 / self.vocab, dtype=torch.float64)
        for _ in range(200):
            pi = pi @ self.table
        p = self.table
        row = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(1)
        return float(pi @ row)


# ---- model ------------------------------------------------------------------------------------


def model_config(args: argparse.Namespace) -> Any:
    """The ``transformers`` config for ``--arch`` (imported here: an optional dependency)."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - the test skips without it
        raise SystemExit("this example needs Hugging Face transformers: pip install transformers") from e
    if args.arch == "llama":
        return transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
            max_position_embeddings=args.seq, attention_dropout=args.dropout, tie_word_embeddings=False,
        )  # fmt: skip
    return transformers.GPT2Config(
        vocab_size=args.vocab, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads, n_positions=args.seq,
        resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout,
        bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1,
    )  # fmt: skip


def build_model(args: argparse.Namespace) -> nn.Module:
    """``LlamaForCausalLM`` or ``GPT2LMHeadModel`` from :func:`model_config`, initialised from
    ``torch.manual_seed(args.seed)`` (random weights: nothing is downloaded)."""
    import transformers

    cfg = model_config(args)
    torch.manual_seed(args.seed)
    cls = transformers.LlamaForCausalLM if args.arch == "llama" else transformers.GPT2LMHeadModel
    return cls(cfg)


def _is_norm(module: nn.Module) -> bool:
    # NOTE: torch's own norm layers by type; Hugging Face's own (LlamaRMSNorm, T5LayerNorm, ...)
    # subclass nn.Module directly, so by class name as well.
    torch_norms = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)
    return isinstance(module, torch_norms) or type(module).__name__.endswith("Norm")


def param_groups(model: nn.Module) -> tuple[list[str], list[str]]:
    """``(decay, no_decay)`` parameter names, the standard way: no weight decay on biases (a
    name ending in ``bias``) and on every parameter of a normalization module (torch's
    ``LayerNorm``/``RMSNorm``/``GroupNorm``/batch norms by type, any module whose class name ends
    in ``Norm`` - ``LlamaRMSNorm``, ``T5LayerNorm`` - by name); weight decay on the rest (linear
    and embedding weights). For Llama and GPT-2 this is the split Hugging Face's
    ``Trainer.get_decay_parameter_names`` makes. Tied weights count once.

    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> param_groups(m)
    (['0.weight'], ['0.bias', '1.weight', '1.bias'])
    """
    no_decay_ids = set()
    for module in model.modules():
        if _is_norm(module):
            no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # deduplicated: a tied weight once, by its first name
        (no_decay if name.endswith("bias") or id(p) in no_decay_ids else decay).append(name)
    return decay, no_decay


# ---- the run ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="finetune_hf.py",
        description="Fine-tune a Hugging Face causal LM (built from a config) with shfx: AdamW with parameter "
        "groups, warmup + cosine, clipping, gradient accumulation, checkpoints and exact resume.",
    )
    m = p.add_argument_group("model (random weights from a transformers config; no download)")
    m.add_argument("--arch", choices=("llama", "gpt2"), default="llama")
    m.add_argument("--layers", type=int, default=8)
    m.add_argument("--hidden", type=int, default=128)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--vocab", type=int, default=64)
    m.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    m.add_argument("--dropout", type=float, default=0.0, help="attention (and, GPT-2, residual/embedding) dropout")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=40, help="optimizer steps (the schedule's length)")
    t.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    t.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    t.add_argument("--lr", type=float, default=1e-2, help="peak learning rate")
    t.add_argument("--warmup", type=int, default=4, help="linear warmup steps, then cosine decay to 0")
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm (0: no clipping)")
    t.add_argument("--seed", type=int, default=0, help="seeds the weights, the Markov table and the batches")
    t.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    c = p.add_argument_group("checkpoints")
    c.add_argument("--save-every", type=int, default=0, metavar="N", help="save every N steps (0: never)")
    c.add_argument("--checkpoint-dir", default=None, metavar="D", help="checkpoints go to D/latest")
    c.add_argument("--resume", action="store_true", help="continue from D/latest exactly")
    c.add_argument("--stop-after", type=int, default=None, metavar="S",
                   help="stop after step S, as if the job were interrupted (the schedule still spans --steps)")  # fmt: skip
    d = p.add_argument_group("device")
    d.add_argument("--device", default="emulated", help="'emulated' (default) or 'cuda' / 'cuda:N'")
    d.add_argument("--device-memory", default=None,
                   help="device budget ('8MiB', bytes); default (emulated): window + 1 blocks and the activations; "
                   "CUDA: the card's memory")  # fmt: skip
    d.add_argument("--window", type=int, default=2, help="stages resident on the device at once")
    d.add_argument("--h2d", default="8GB/s", help="emulated host-to-device bandwidth")
    d.add_argument("--d2h", default="8GB/s", help="emulated device-to-host bandwidth")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="write losses, lrs, grad norms and the final state_dict here (torch.save)")
    o.add_argument("--quiet", action="store_true", help="no per-step log")
    args = p.parse_args(argv)

    for name in ("layers", "hidden", "heads", "vocab", "seq", "steps", "batch", "grad_accum", "window"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.hidden % args.heads:
        p.error(f"--hidden ({args.hidden}) must be divisible by --heads ({args.heads})")
    if args.vocab < 4:
        p.error(f"--vocab must be >= 4 (the Markov chain has 4 successors per token), got {args.vocab}")
    if not 0 <= args.warmup <= args.steps:
        p.error(f"--warmup must be between 0 and --steps ({args.steps}), got {args.warmup}")
    if args.save_every < 0:
        p.error(f"--save-every must be >= 0 (0: never), got {args.save_every}")
    if (args.save_every or args.resume) and not args.checkpoint_dir:
        p.error("--save-every and --resume need --checkpoint-dir D (the checkpoint is D/latest)")
    if args.stop_after is not None and not 1 <= args.stop_after <= args.steps:
        p.error(f"--stop-after must be between 1 and --steps ({args.steps}), got {args.stop_after}")
    return args


def default_device_memory(model: nn.Module, args: argparse.Namespace) -> int:
    """The default device budget: ``window + 1`` slots of the largest block's weights, plus an
    allowance for activations (a boundary tensor per stage, a block's recomputed
    intermediates, the logits and their gradient; fp32, the micro-batch's tokens), rounded up
    to 64 KiB. For the default sizes this is 75% of the weight bytes (a step's peak is 51%):
    the model does not fit, a window of its blocks does. Small models, whose activations weigh
    as much as their weights, get a budget above the weights (the log says so); pass
    ``--device-memory``. (shfx raises ``OutOfDeviceMemory`` naming what to change if a step
    needs more.)"""
    blocks = model.model.layers if args.arch == "llama" else model.transformer.h
    block_bytes = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks)
    tokens = args.batch * args.seq
    act = 4 * tokens * ((args.layers + 2) * args.hidden + 4 * args.hidden + 2 * args.vocab)
    gran = 64 << 10
    return -(-((args.window + 1) * block_bytes + act) // gran) * gran


def _make_device(args: argparse.Namespace, budget: int) -> Any:
    if args.device == "emulated":
        return shfx.EmulatedDevice(memory=budget, h2d=args.h2d, d2h=args.d2h)
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {args.device}: torch.cuda.is_available() is False here; use --device emulated")
        index = torch.device(args.device).index or 0
        return shfx.CudaDevice(index=index, memory=budget) if args.device_memory is not None else f"cuda:{index}"
    raise SystemExit(f"--device must be 'emulated', 'cuda' or 'cuda:N', got {args.device!r}")


def _checkpoint_path(args: argparse.Namespace) -> str:
    return os.path.join(args.checkpoint_dir, "latest")


def _check_resume(args: argparse.Namespace, config: dict[str, Any]) -> None:
    """Refuse ``--resume`` without a checkpoint, or from one made with other settings, before
    anything is built."""
    path = _checkpoint_path(args)
    if not os.path.exists(path):
        raise SystemExit(f"--resume: no checkpoint at {path} (run with --save-every N --checkpoint-dir "
                         f"{args.checkpoint_dir} first, or drop --resume to start fresh)")  # fmt: skip
    saved = shfx.checkpoint.read_info(path)["extra"]
    if not isinstance(saved, dict) or "config" not in saved:
        raise SystemExit(f"--resume: {path} was not saved by this example (its extra has no 'config'); "
                         "load it with cm.load_checkpoint in your own loop")  # fmt: skip
    differ = {k: (saved["config"].get(k), v) for k, v in config.items() if saved["config"].get(k) != v}
    if differ:
        raise SystemExit("--resume: the checkpoint was made with other settings; pass the same flags: "
                         + ", ".join(f"--{k.replace('_', '-')} {a} (now {b})" for k, (a, b) in differ.items()))  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the example; returns ``{"steps", "losses", "lrs", "grad_norms"}`` (lists, one entry per
    step this run trained: step numbers from 1), ``"state_dict"`` (the final weights, copies),
    ``"start_step"`` (0, or the checkpoint's step with ``--resume``), ``"loss_floor"`` (the
    data's entropy rate), ``"model_bytes"``, ``"device_memory"``, ``"stats"`` (``cm.stats()``)
    and ``"seconds"``. With ``--out`` the same is written with ``torch.save``."""
    import transformers

    args = parse_args(argv)
    config = {k: getattr(args, k) for k in _RESUME_KEYS}
    if args.resume:
        _check_resume(args, config)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    t_start = time.perf_counter()

    data = MarkovData(args.vocab, args.seq, args.batch, args.seed)
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = default_device_memory(model, args) if args.device_memory is None else parse_bytes(
        args.device_memory, what="--device-memory"
    )  # fmt: skip
    device = _make_device(args, budget)

    decay, no_decay = param_groups(model)
    optimizer = shfx.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )  # fmt: skip
    cm = shfx.compile(
        model, device=device, window=args.window, optimizer=optimizer,
        max_grad_norm=args.max_grad_norm or None, grad_accum_steps=args.grad_accum,
    )  # fmt: skip
    sched = transformers.get_cosine_schedule_with_warmup(cm.optimizer, args.warmup, args.steps)

    say(f"{type(model).__name__}: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}: "
        f"{n_params:,} params = {model_bytes / 2**20:.2f} MiB of fp32 weights")  # fmt: skip
    fits = "the model does NOT fit, a window of its blocks does" if budget < model_bytes else (
        "note: this budget holds the whole model (raise --layers or lower --device-memory)"
    )  # fmt: skip
    if isinstance(device, str):  # CUDA without --device-memory: the card's memory, no budget
        budget = None
        say(f"device   {device}")
    else:
        say(f"device   {device}: {100 * budget / model_bytes:.0f}% of the weights, {fits}")
    say(f"groups   weight decay {args.weight_decay:g}: {len(decay)} tensors; none: {len(no_decay)} (biases, norms)")
    say(f"recipe   AdamW lr {args.lr:g}, warmup {args.warmup} + cosine over {args.steps} steps, clip "
        f"{args.max_grad_norm or 'off'}, {args.grad_accum} x {args.batch} x {args.seq} tokens per step")  # fmt: skip
    say(f"data     Markov chain over {args.vocab} tokens, 4 successors each: loss floor ~{data.entropy():.3f} "
        f"(uniform: {math.log(args.vocab):.3f})")  # fmt: skip
    say()

    stop = args.stop_after if args.stop_after is not None else args.steps
    steps, losses, lrs, grad_norms = [], [], [], []
    start_step, next_batch = 0, 0
    try:
        if args.resume:
            extra = cm.load_checkpoint(_checkpoint_path(args), scheduler=sched)  # before the first call is fine
            start_step, next_batch = extra["step"], extra["next_batch"]
            say(f"resumed  from {_checkpoint_path(args)}: step {start_step}, next batch {next_batch}")
            if start_step >= stop:
                say(f"nothing to train: the checkpoint is at step {start_step}, this run stops at {stop}")
        for step in range(start_step, stop):
            lr = cm.optimizer.param_groups[0]["lr"]  # the rate this step's update uses
            step_loss = torch.zeros(())
            for _ in range(args.grad_accum):
                ids = data.batch(next_batch)
                next_batch += 1
                loss = cm(input_ids=ids, labels=ids).loss / args.grad_accum
                loss.backward()
                step_loss += loss.detach()
            cm.step()
            cm.zero_grad()
            sched.step()
            norm = cm.last_grad_norm
            steps.append(step + 1)
            losses.append(step_loss.item())
            lrs.append(lr)
            grad_norms.append(float(norm) if norm is not None else float("nan"))
            say(f"step {step + 1:4d}/{args.steps}  loss {losses[-1]:.4f}  lr {lr:.2e}  grad norm {grad_norms[-1]:.3f}")
            if args.save_every and (step + 1) % args.save_every == 0:
                extra = {"step": step + 1, "next_batch": next_batch, "config": config}
                cm.save_checkpoint(_checkpoint_path(args), extra=extra, scheduler=sched)
                say(f"saved    {_checkpoint_path(args)} (step {step + 1}, next batch {next_batch})")
        state = {k: v.detach().clone() for k, v in cm.state_dict().items()}
        stats = cm.stats()
    finally:
        cm.close()

    seconds = time.perf_counter() - t_start
    result = {
        "steps": steps, "losses": losses, "lrs": lrs, "grad_norms": grad_norms, "state_dict": state,
        "start_step": start_step, "loss_floor": data.entropy(), "model_bytes": model_bytes, "device_memory": budget,
        "stats": stats, "seconds": seconds,
    }  # fmt: skip
    if losses:
        k = max(1, min(5, len(losses) // 2))
        say(f"\n{len(losses)} steps in {seconds:.1f} s: loss {sum(losses[:k]) / k:.3f} (first {k}) -> "
            f"{sum(losses[-k:]) / k:.3f} (last {k}), floor ~{result['loss_floor']:.3f}; "
            f"device peak {stats['device_bytes_peak'] / 2**20:.2f} MiB for {model_bytes / 2**20:.2f} MiB of weights, "
            f"{stats['bytes_h2d'] / 2**20:.1f} MiB host->device")  # fmt: skip
    if args.out:
        torch.save({k: v for k, v in result.items() if k != "stats"}, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
