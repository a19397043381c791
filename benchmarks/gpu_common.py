"""Shared helpers of the GPU kit (``benchmarks/gpu.py``): the :class:`Kit` every part gets, the one
place that builds the emulated device, and small model builders.

A part is a function ``part_<name>(kit: Kit) -> dict`` in one of the ``benchmarks/gpu_parts_*.py``
modules; the runner calls it in its own subprocess (``gpu.py --part N``) and stores what it
returns (JSON-able: numbers, strings, lists, dicts; :func:`jsonable` converts the rest) in
``gpu_results.json``. A part must return before ``kit.deadline`` (``kit.remaining()`` seconds
from now); the runner kills it at the deadline plus a small grace.

On a CUDA machine ``kit.emulated`` is False: ``kit.device()`` is ``"cuda"`` (or
``shfx.CudaDevice(memory=...)``), tensors go to ``kit.torch_device`` (``cuda:0``). With
``--emulated`` the same code runs on the CPU: ``kit.device()`` is :func:`emulated_device` (an
``shfx.EmulatedDevice``), ``kit.torch_device`` is ``cpu``, ``kit.sync()`` does nothing, and parts
choose tiny sizes (``kit.emulated``) so the whole kit runs in about a minute on two cores.

Everything CUDA-only is guarded (``torch.cuda.is_available()``), and nothing here needs an API
newer than torch 2.11 (the GPU image's torch).
"""

from __future__ import annotations

import copy
import math
import os
import pathlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

# the repository root on sys.path: the kit runs from a checkout without installing shfx
ROOT = pathlib.Path(__file__).resolve().parent.parent
for _p in (str(ROOT), str(ROOT / "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import shfx  # noqa: E402

__all__ = [
    "Kit",
    "emulated_device",
    "gpt_model",
    "token_batches",
    "hf_llama",
    "hf_gpt2",
    "eager_step",
    "shfx_step",
    "make_eager_optimizer",
    "median",
    "jsonable",
    "host_memory",
    "rss_bytes",
    "cuda_ok",
    "GiB",
    "MiB",
]

GiB = 1 << 30
MiB = 1 << 20


def cuda_ok() -> bool:
    """True when torch sees a usable CUDA device (never raises)."""
    try:
        return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except Exception:  # noqa: BLE001 - a broken driver is "no CUDA"
        return False


def emulated_device(memory: str | int | None = None) -> shfx.EmulatedDevice:
    """THE emulated device of the kit: ``shfx.EmulatedDevice(memory=memory or "4GiB")`` with
    unthrottled copies (the kit measures shfx's own costs on the CPU, not a modelled link), in
    its CUDA-like mode (``cuda_like=True``: the same launch/stream-wait logic as the CUDA
    backend, so the emulated run walks the code path the GPU run will)."""
    return shfx.EmulatedDevice(memory=memory if memory is not None else "4GiB", h2d=None, d2h=None, cuda_like=True)


class _Timer:
    """``with kit.timer() as t: ...``; then ``t.seconds``. ``events=True`` (CUDA only): the time
    between two CUDA events on the current stream (GPU time of the work queued inside), else
    wall time between two ``synchronize()`` calls (everything, host threads included)."""

    def __init__(self, cuda: bool, events: bool):
        self.cuda = cuda
        self.events = events and cuda
        self.seconds = float("nan")

    def __enter__(self) -> "_Timer":
        if self.cuda:
            torch.cuda.synchronize()
        if self.events:
            self._a = torch.cuda.Event(enable_timing=True)
            self._b = torch.cuda.Event(enable_timing=True)
            self._a.record()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.events:
            self._b.record()
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        self.seconds = self._a.elapsed_time(self._b) / 1e3 if self.events else wall


@dataclass
class Kit:
    """What a part gets: where to write, when to stop, which device.

    Attributes:
        emulated: True: a CPU run (tiny sizes, :func:`emulated_device`).
        out: the results folder (at most 8 files come back from a lent GPU machine: parts write
            into ``gpu_results.json`` through their return value, not files of their own, except
            ``trace_step.json`` and ``peers.json``).
        deadline: ``time.monotonic()`` by which the part must return.
        part: the part's number (for the log).
        notes: lines :meth:`note` collected (they go into the part's entry).
        partial: what :meth:`record` saved so far: the part's results if it fails or is killed
            later (the runner reads them from ``result_path``).
    """

    emulated: bool
    out: pathlib.Path
    deadline: float
    part: str = ""
    notes: list = field(default_factory=list)
    partial: dict = field(default_factory=dict)
    result_path: pathlib.Path | None = None

    def remaining(self) -> float:
        """Seconds left until the deadline (may be negative)."""
        return self.deadline - time.monotonic()

    @property
    def cuda(self) -> bool:
        return not self.emulated

    def device(self, memory: str | int | None = None) -> Any:
        """What to pass as ``shfx.compile(device=...)``: ``"cuda"``, ``shfx.CudaDevice(memory=...)``
        with a budget, or (emulated) :func:`emulated_device` ``(memory)``."""
        if self.emulated:
            return emulated_device(memory)
        return "cuda" if memory is None else shfx.CudaDevice(memory=memory)

    @property
    def torch_device(self) -> torch.device:
        """Where inputs and eager references live: ``cuda:0`` or ``cpu``."""
        return torch.device("cpu") if self.emulated else torch.device("cuda", 0)

    def log(self, msg: str) -> None:
        """Print (flushed) and append to ``out/gpu_log.txt``."""
        line = f"[{time.strftime('%H:%M:%S')}]{f' part {self.part}:' if self.part else ''} {msg}"
        print(line, flush=True)
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            with open(self.out / "gpu_log.txt", "a") as f:
                f.write(line + "\n")
        except OSError:
            pass

    def note(self, msg: str) -> None:
        """A line for the part's ``notes`` in the results (also logged)."""
        self.notes.append(msg)
        self.log(msg)

    def record(self, key: str, value: Any) -> None:
        """Keep ``value`` as ``partial[key]`` and write the partial results to ``result_path`` at
        once, so a later crash, hang or timeout of the part still leaves them in the results."""
        self.partial[key] = jsonable(value)
        if self.result_path is None:
            return
        try:
            import json

            tmp = self.result_path.with_name(self.result_path.name + ".tmp")
            tmp.write_text(json.dumps({"status": "partial", "results": self.partial, "notes": self.notes}))
            os.replace(tmp, self.result_path)
        except (OSError, TypeError, ValueError):
            pass

    def sync(self) -> None:
        """``torch.cuda.synchronize()`` on CUDA, nothing emulated."""
        if not self.emulated and cuda_ok():
            torch.cuda.synchronize()

    def timer(self, events: bool = False) -> _Timer:
        """A context manager measuring seconds correctly: ``with kit.timer() as t: ...; t.seconds``
        (wall time between synchronizations; ``events=True``: CUDA event time, for pure GPU work)."""
        return _Timer(cuda=not self.emulated and cuda_ok(), events=events)

    def reset_peak(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()`` (after a sync and ``empty_cache``), or nothing."""
        if not self.emulated and cuda_ok():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_allocated(self) -> int | None:
        """``torch.cuda.max_memory_allocated()`` or None (emulated)."""
        if not self.emulated and cuda_ok():
            torch.cuda.synchronize()
            return int(torch.cuda.max_memory_allocated())
        return None

    def free_cuda(self) -> None:
        """Collect garbage and return cached CUDA blocks (between sub-runs of a part)."""
        import gc

        gc.collect()
        if not self.emulated and cuda_ok():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


# ---- models -------------------------------------------------------------------------------


def gpt_model(layers: int, hidden: int, heads: int, seq: int, vocab: int, seed: int = 0, *,
              batch: int = 2, device: torch.device | str = "cpu", dropout: float = 0.0, tie_weights: bool = True):  # fmt: skip
    """``(model, make_batch)``: a ``shfx.models.GPT`` on the CPU (seeded with ``seed``), called as
    ``model(x, y)`` -> the mean loss; ``make_batch(step) -> (x, y)`` token tensors of ``batch``
    sequences on ``device`` (deterministic per step)."""
    from shfx.models import GPT, GPTShape

    torch.manual_seed(seed)
    model = GPT(GPTShape(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, batch=batch,
                         dropout=dropout, tie_weights=tie_weights))  # fmt: skip
    return model, token_batches(vocab, seq, batch, device)


def token_batches(vocab: int, seq: int, batch: int, device: torch.device | str = "cpu"):
    """``make_batch(step) -> (x, y)``: random tokens, the same for a step whatever the device."""

    def make_batch(step: int):
        g = torch.Generator().manual_seed(1000 + 17 * step)
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = torch.randint(0, vocab, (batch, seq), generator=g)
        return x.to(device), y.to(device)

    return make_batch


def hf_llama(layers: int, hidden: int, heads: int, seq: int, vocab: int, dtype: torch.dtype = torch.float32,
             seed: int = 0) -> torch.nn.Module:  # fmt: skip
    """A ``transformers.LlamaForCausalLM`` from a config (random weights, nothing downloaded), in
    ``dtype`` (the config's default attention), on the CPU; call it as ``model(input_ids=x, labels=x).loss``."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
        attention_dropout=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def hf_gpt2(layers: int, hidden: int, heads: int, seq: int, vocab: int, dtype: torch.dtype = torch.float32,
            seed: int = 0) -> torch.nn.Module:  # fmt: skip
    """A ``transformers.GPT2LMHeadModel`` from a config (no dropout, nothing downloaded)."""
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=vocab - 1, eos_token_id=vocab - 1,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg).to(dtype)


# ---- steps --------------------------------------------------------------------------------


def make_eager_optimizer(model: torch.nn.Module, lr: float = 1e-3, weight_decay: float = 0.01):
    """``torch.optim.AdamW(fused=True)``: the kernel shfx's optimizer matches (tests/equivalence.py)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                             weight_decay=weight_decay, fused=True)  # fmt: skip


def eager_step(model: torch.nn.Module, opt, batch: tuple, loss_fn=None) -> float:
    """One eager step (forward, backward, ``opt.step()``, ``zero_grad``); returns the loss."""
    out = model(*batch)
    loss = loss_fn(out) if loss_fn is not None else out
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def shfx_step(cm, batch: tuple, loss_fn=None) -> float:
    """One shfx step (``cm(*batch)``, backward, ``cm.step()``, ``cm.zero_grad()``); returns the loss."""
    out = cm(*batch)
    loss = loss_fn(out) if loss_fn is not None else out
    loss.backward()
    cm.step()
    cm.zero_grad()
    return float(loss.detach())


def deepcopy_to(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A deep copy of ``model`` on ``device`` (the eager reference)."""
    return copy.deepcopy(model).to(device)


# ---- small utilities ------------------------------------------------------------------------


def median(xs) -> float:
    xs = sorted(float(x) for x in xs)
    if not xs:
        return float("nan")
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def jsonable(x: Any) -> Any:
    """``x`` with tensors, dtypes, paths, tuples and non-finite floats turned into JSON values."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [jsonable(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, torch.Tensor):
        return jsonable(x.detach().cpu().tolist()) if x.numel() <= 64 else f"tensor{tuple(x.shape)}"
    try:
        import numpy as np

        if isinstance(x, np.generic):
            return jsonable(x.item())
    except ImportError:
        pass
    return str(x)


def host_memory() -> dict:
    """``{"total": bytes, "available": bytes}`` of host RAM (psutil, else /proc/meminfo; {} if neither)."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return {"total": int(vm.total), "available": int(vm.available)}
    except Exception:  # noqa: BLE001
        pass
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0]) * 1024
        return {"total": info["MemTotal"], "available": info.get("MemAvailable", info["MemFree"])}
    except Exception:  # noqa: BLE001
        return {}


def rss_bytes() -> int | None:
    """This process's resident set size (psutil, else /proc/self/statm)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except Exception:  # noqa: BLE001
        return None
