"""``shfx demo``: train a GPT that does not fit in the device's memory, on the Python standard
library's own source code, streaming a window of its stages to the device.

It needs no download and no GPU: on a machine without CUDA it runs on an
:class:`shfx.EmulatedDevice` whose memory budget is chosen *smaller* than the model's
parameter bytes (but large enough for ``window`` stages and the boundary activations), so
every step streams the stages through the device.

>>> from shfx.demo import run_demo
>>> r = run_demo(steps=2, layers=2, hidden=32, heads=2, seq=16, batch=2, max_bytes=50_000)  # doctest: +SKIP
>>> r.last_loss < r.first_loss  # doctest: +SKIP
True
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from shfx.passes.units import format_bytes, parse_bandwidth, parse_bytes

from .data import DEFAULT_MAX_BYTES, TextDataset
from .devices import CudaDevice, EmulatedDevice
from .models import GPT, GPTShape
from .optim import AdamW

__all__ = ["DemoConfig", "DemoResult", "run_demo", "default_device_memory", "estimate_device_bytes"]


@dataclass
class DemoConfig:
    """The demo's options (the defaults are ``shfx demo``'s); see :func:`run_demo`."""

    steps: int = 300
    layers: int = 12
    hidden: int = 128
    heads: int = 4
    seq: int = 128
    batch: int = 4
    window: int = 2
    device: str = "auto"
    device_memory: int | str | None = None
    h2d: str | float | None = "16GB/s"
    d2h: str | float | None = "16GB/s"
    lr: float = 2e-3
    warmup: int = 10
    seed: int = 0
    eval_interval: int = 100
    eval_batches: int = 8
    log_interval: int | None = None
    max_bytes: int = DEFAULT_MAX_BYTES
    precision: str = "float32"


@dataclass
class DemoResult:
    """What :func:`run_demo` measured.

    Attributes:
        losses: the training loss of every step.
        val_losses: ``(step, validation loss)`` pairs.
        wall_s: seconds for the whole run (data, capture, training, evaluation).
        step_s: seconds of every step (forward, backward, step, zero_grad; step 1 includes
            capturing and compiling the model).
        model_bytes: the model's parameter bytes (fp32).
        device_budget: the device memory budget in bytes (``None``: unlimited).
        stats: ``cm.stats()`` at the end.
        skipped_steps: steps the fp16 loss scaler skipped (an overflow; 0 in fp32 and bf16).
    """

    config: DemoConfig
    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    wall_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    model_bytes: int = 0
    device_budget: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    skipped_steps: int = 0

    @property
    def first_loss(self) -> float:
        return self.losses[0]

    @property
    def last_loss(self) -> float:
        return self.losses[-1]


# ---- sizing -----------------------------------------------------------------------------------


def estimate_device_bytes(cfg: GPTShape, window: int) -> dict[str, int]:
    """What training ``GPT(cfg)`` on batches of ``cfg.batch x cfg.seq`` with shfx needs on the
    device, from the planner's memory model (the memory ledger's closed form for a GPT).

    Returns a dict with ``slot`` (the largest stage's parameter bytes: a block, or the
    embedding/head stage when that is bigger), ``activation`` (one stage-boundary tensor,
    ``batch * seq * hidden`` in ``cfg.precision``), ``inputs`` (the token ids and targets, int64) and
    ``peak``: ``window`` slots, the boundary activations kept from forward to backward, the
    gradients in flight, and the inputs.

    >>> e = estimate_device_bytes(GPTShape(layers=4, hidden=128, seq=128, batch=8), window=2)
    >>> e["slot"], e["activation"]
    (793088, 524288)
    """
    from .cost_model.planner import Target, memory_model

    bd = memory_model("stronghold", cfg, Target("emulated device", 1 << 62, emulated=True), window=window)
    return {
        "slot": max(bd.slot_sizes),
        "activation": cfg.param_bytes * cfg.batch * cfg.seq * cfg.hidden,
        "inputs": 2 * 8 * cfg.batch * cfg.seq,
        "peak": bd.device_total,
    }


def default_device_memory(cfg: GPTShape, window: int) -> int:
    """The demo's device budget: ``(window + 1.5)`` of the largest stage's slot, plus the
    boundary activations and one activation of headroom, rounded up to 64 KiB. For deep enough
    models this is well below the parameter bytes, so the model does not fit but the window does.

    >>> cfg = GPTShape(layers=12, hidden=128, seq=128, batch=4)
    >>> default_device_memory(cfg, window=2) < 4 * cfg.num_params()
    True
    """
    e = estimate_device_bytes(cfg, window)
    need = int((window + 1.5) * e["slot"]) + e["peak"] - window * e["slot"] + e["activation"]
    gran = 64 << 10
    return -(-need // gran) * gran


# ---- the run ----------------------------------------------------------------------------------


def _lr_at(step: int, cfg: DemoConfig) -> float:
    """Linear warmup over ``cfg.warmup`` steps, then cosine decay to a tenth of ``cfg.lr``."""
    if cfg.warmup and step <= cfg.warmup:
        return cfg.lr * step / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    frac = min(1.0, (step - cfg.warmup) / span)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def _resolve_device(cfg: DemoConfig, budget: int) -> tuple[Any, str]:
    kind = cfg.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "emulated"
    if kind == "emulated":
        return EmulatedDevice(memory=budget, h2d=cfg.h2d, d2h=cfg.d2h), "emulated"
    if kind.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {cfg.device} was asked for, but torch.cuda.is_available() is False here; "
                "use --device emulated (or auto) to emulate an accelerator on the CPU"
            )
        index = torch.device(kind).index or 0
        return CudaDevice(index=index, memory=budget), "cuda"
    raise ValueError(f"device must be 'auto', 'emulated', 'cuda' or 'cuda:N', got {cfg.device!r}")


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _check(cfg: DemoConfig) -> None:
    for name in ("steps", "layers", "hidden", "heads", "seq", "batch", "window", "eval_batches"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if cfg.hidden % cfg.heads:
        raise ValueError(f"hidden ({cfg.hidden}) must be divisible by heads ({cfg.heads})")
    if not cfg.lr > 0:
        raise ValueError(f"lr must be > 0, got {cfg.lr}")
    if cfg.eval_interval < 0:
        raise ValueError(f"eval_interval must be >= 0 (0: only at the end), got {cfg.eval_interval}")
    parse_bandwidth(cfg.h2d, what="h2d bandwidth")
    parse_bandwidth(cfg.d2h, what="d2h bandwidth")


def run_demo(
    steps: int = DemoConfig.steps,
    layers: int = DemoConfig.layers,
    hidden: int = DemoConfig.hidden,
    heads: int = DemoConfig.heads,
    seq: int = DemoConfig.seq,
    batch: int = DemoConfig.batch,
    window: int = DemoConfig.window,
    device: str = DemoConfig.device,
    device_memory: int | str | None = None,
    h2d: str | float | None = DemoConfig.h2d,
    d2h: str | float | None = DemoConfig.d2h,
    lr: float = DemoConfig.lr,
    seed: int = DemoConfig.seed,
    eval_interval: int = DemoConfig.eval_interval,
    *,
    eval_batches: int = DemoConfig.eval_batches,
    warmup: int = DemoConfig.warmup,
    log_interval: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    precision: str = DemoConfig.precision,
    file: TextIO | None = None,
) -> DemoResult:
    """Train a byte-level GPT on the standard library's sources with shfx and print a report.

    Args:
        steps: optimizer steps.
        layers, hidden, heads: the GPT's depth, width and attention heads.
        seq, batch: tokens per sequence and sequences per step.
        window: stages resident on the device at once.
        device: ``"auto"`` (CUDA when available, else emulated), ``"emulated"``, ``"cuda"``.
        device_memory: the device budget (``"6MiB"`` or bytes); default: :func:`default_device_memory`,
            below the model's parameter bytes for the default model.
        h2d, d2h: the emulated device's link bandwidths (``"16GB/s"``; ``"inf"``: unthrottled).
        lr: peak learning rate (linear warmup over ``warmup`` steps, then cosine decay to lr/10).
        seed: seeds the model's initialisation and the batches.
        eval_interval: steps between validation losses (0: only at the end).
        eval_batches: validation batches per evaluation (the same batches every time).
        log_interval: steps between log lines (default: about 15 lines).
        max_bytes: bytes of standard-library source to read.
        precision: ``fp32`` (default), or ``bf16``/``fp16`` mixed precision (16-bit working copy
            and gradients on the device, fp32 master and AdamW states on the host; fp16 with
            dynamic loss scaling): ``shfx.compile(precision=...)``; the long names work too.
        file: where to print (default ``sys.stdout``).

    Returns:
        a :class:`DemoResult` (losses, validation losses, timings, final ``cm.stats()``).

    Raises:
        shfx.OutOfDeviceMemory: ``device_memory`` is too small for ``window`` stages.

    >>> r = run_demo(steps=3, layers=2, hidden=32, heads=2, seq=16, batch=2, max_bytes=50_000)  # doctest: +SKIP
    >>> len(r.losses)  # doctest: +SKIP
    3
    """
    import shfx  # the package's top level (compile); imported here to avoid an import cycle

    from .commands import precision_kwargs
    from .cost_model.shapes import normalize_precision, short_precision

    cfg = DemoConfig(
        steps=steps, layers=layers, hidden=hidden, heads=heads, seq=seq, batch=batch, window=window,
        device=device, device_memory=device_memory, h2d=h2d, d2h=d2h, lr=lr, warmup=min(warmup, steps // 10),
        seed=seed, eval_interval=eval_interval, eval_batches=eval_batches, log_interval=log_interval,
        max_bytes=max_bytes, precision=normalize_precision(precision),
    )  # fmt: skip
    _check(cfg)
    compile_kw = precision_kwargs(cfg.precision)
    out = file if file is not None else sys.stdout

    def say(line: str = "") -> None:
        print(line, file=out, flush=True)

    t_start = time.perf_counter()
    result = DemoResult(cfg)

    # ---- data, model, device -------------------------------------------------------------
    ds = TextDataset.from_stdlib(max_bytes=cfg.max_bytes)
    gcfg = GPTShape(
        layers=cfg.layers, heads=cfg.heads, hidden=cfg.hidden, seq=cfg.seq, vocab=ds.vocab_size, batch=cfg.batch,
        precision=cfg.precision,
    )  # fmt: skip
    torch.manual_seed(cfg.seed)
    model = GPT(gcfg)
    n_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    device_model_bytes = model_bytes * gcfg.param_bytes // 4  # the working copy the device would hold
    est = estimate_device_bytes(gcfg, cfg.window)
    budget = parse_bytes(cfg.device_memory, what="device memory") if cfg.device_memory is not None else default_device_memory(
        gcfg, cfg.window
    )
    dev, kind = _resolve_device(cfg, budget)
    result.model_bytes, result.device_budget = model_bytes, budget
    tokens_per_step = cfg.batch * cfg.seq

    say("shfx demo: a GPT that does not fit on the device, trained on Python's own standard library")
    say(f"  data     {ds.name}")
    say(f"           byte tokens (vocab 256): {len(ds.train):,} train / {len(ds.val):,} validation")
    say(
        f"  model    GPT: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, seq {cfg.seq}: "
        f"{n_params:,} params = {_mib(model_bytes)} of fp32 weights"
        + (f", trained in {short_precision(cfg.precision)} ({_mib(device_model_bytes)} on the device)" if gcfg.mixed else "")
    )
    say(f"           (weights + grads + AdamW state: {_mib(4 * model_bytes)}, before any activation)")
    say(f"  device   {dev}" + ("" if kind == "emulated" else "  [--h2d/--d2h apply to the emulated device only]"))
    verdict = (
        "the model does NOT fit; a window of stages does"
        if budget < device_model_bytes
        else "note: this budget would hold the whole model (raise --layers, or lower --batch/--seq)"
    )
    say(f"  budget   {_mib(budget)} = {100 * budget / device_model_bytes:.0f}% of the model's {_mib(device_model_bytes)}: {verdict}")
    say(
        f"           expected peak {_mib(est['peak'])}: {cfg.window} slots x {format_bytes(est['slot'])} (largest stage) "
        f"+ {cfg.layers + 2} x {format_bytes(est['activation'])} (boundary activations and a gradient) + inputs"
    )
    say(
        f"  train    {cfg.steps} steps of {cfg.batch} x {cfg.seq} = {tokens_per_step:,} tokens, AdamW lr {cfg.lr:g} "
        f"(warmup {cfg.warmup}, cosine), window {cfg.window}, seed {cfg.seed}"
    )
    say()

    cm = shfx.compile(model, device=dev, window=cfg.window, optimizer=AdamW(lr=cfg.lr, betas=(0.9, 0.95)), **compile_kw)
    try:
        gen = torch.Generator().manual_seed(cfg.seed)
        vgen = torch.Generator().manual_seed(cfg.seed + 1)
        val_batches = [ds.get_batch("val", cfg.batch, cfg.seq, vgen) for _ in range(cfg.eval_batches)]
        log_every = cfg.log_interval or max(1, round(cfg.steps / 15))
        if log_every >= 10:
            log_every = int(round(log_every / 5) * 5)

        def evaluate() -> float:
            # no_grad: shfx runs its inference program (forward only, activations freed as
            # soon as their consumers ran); dropout is 0, so train mode equals eval mode
            with torch.no_grad():
                return sum(float(cm(x, y)) for x, y in val_batches) / len(val_batches)

        prev = cm.stats()
        busy_log, tokens_log = 0.0, 0
        for step in range(1, cfg.steps + 1):
            x, y = ds.get_batch("train", cfg.batch, cfg.seq, gen)
            cm.optimizer.lr = _lr_at(step, cfg)
            if step == 1:
                say("step 1 captures the model with torch.export, splits it into stages and schedules the step program ...")
            t0 = time.perf_counter()
            loss = cm(x, y)
            loss.backward()
            cm.step()
            cm.zero_grad()
            lv = loss.detach().item()
            dt = time.perf_counter() - t0
            result.skipped_steps += bool(getattr(cm, "last_step_skipped", False))
            result.losses.append(lv)
            result.step_s.append(dt)
            busy_log += dt
            tokens_log += tokens_per_step
            if not math.isfinite(lv):
                raise FloatingPointError(f"the loss is {lv} at step {step}; lower --lr")
            st = cm.stats()
            if step == 1:
                g = cm.stages
                moved = cm.program.bytes_moved()
                say(f"  done in {dt:.1f} s")
                say(f"  stages   {len(g.stages)} ({g.method}); largest slot {format_bytes(g.slot_bytes)}"
                    + ("" if g.slot_bytes <= est["slot"] else f" (estimated {format_bytes(est['slot'])})"))
                say(f"  window   {st['window']} of {st['stages']} stages resident, {_mib(cm.engine.pool.total_bytes)} of slots")
                say(
                    f"  program  {cm.program.name}: {len(cm.program.actions())} actions per step, moves "
                    f"{format_bytes(moved['h2d'])} h2d + {format_bytes(moved['d2h'])} d2h per step"
                )
                say()
                say(f"{'step':>6} {'loss':>8} {'lr':>9} {'tok/s':>8} {'resident':>9} {'h2d/step':>11} {'d2h/step':>11} {'dev peak':>11}")
            if step == 1 or step % log_every == 0 or step == cfg.steps:
                tps = tokens_log / busy_log
                say(
                    f"{step:>6} {lv:>8.4f} {cm.optimizer.lr:>9.2e} {tps:>8,.0f} {st['window']:>4}/{st['stages']:<4} "
                    f"{format_bytes(st['bytes_h2d'] - prev['bytes_h2d']):>11} "
                    f"{format_bytes(st['bytes_d2h'] - prev['bytes_d2h']):>11} {format_bytes(st['device_bytes_peak']):>11}"
                    + ("   (includes the capture)" if step == 1 else "")
                )
            prev = st
            if (cfg.eval_interval and step % cfg.eval_interval == 0) or step == cfg.steps:
                te = time.perf_counter()
                vl = evaluate()
                result.val_losses.append((step, vl))
                say(f"{'':>6} validation loss {vl:.4f}  ({cfg.eval_batches} batches, offloaded inference forward, {time.perf_counter() - te:.1f} s)")
                prev = cm.stats()
            if step == 1 or step % log_every == 0:
                busy_log, tokens_log = 0.0, 0
        result.stats = cm.stats()
    finally:
        cm.close()

    result.wall_s = time.perf_counter() - t_start
    _summary(result, say)
    return result


def _summary(r: DemoResult, say: Any) -> None:
    cfg, s, losses = r.config, r.stats, r.losses
    k = max(1, min(10, len(losses) // 5))
    head = sum(losses[:k]) / k
    tail = sum(losses[-k:]) / k
    say()
    say(
        f"summary: loss {r.first_loss:.4f} (step 1) -> {r.last_loss:.4f} (step {len(losses)}); "
        f"mean over steps 1-{k} {head:.3f}, over steps {len(losses) - k + 1}-{len(losses)} {tail:.3f}"
        + (" -- the loss went down" if tail < head else " -- the loss did NOT go down")
    )
    if r.val_losses:
        vals = ", ".join(f"{v:.3f} (step {st})" for st, v in r.val_losses)
        say(f"  validation loss: {vals}")
    tokens = cfg.batch * cfg.seq * len(losses)
    steady = r.step_s[1:]
    speed = f", {cfg.batch * cfg.seq * len(steady) / sum(steady):,.0f} tokens/s after step 1" if steady else ""
    say(
        f"  {len(losses)} steps, {tokens:,} tokens: {sum(r.step_s):.1f} s of steps (step 1, with the capture: "
        f"{r.step_s[0]:.1f} s{speed}); whole run {r.wall_s:.1f} s"
    )
    say(
        f"  moved {format_bytes(s['bytes_h2d'])} host->device and {format_bytes(s['bytes_d2h'])} device->host; "
        f"device peak {_mib(s['device_bytes_peak'])} of a {_mib(r.device_budget or 0)} budget, for a "
        f"{_mib(r.model_bytes)} model ({s['window']} of {s['stages']} stages resident)"
    )
    if cfg.precision == "float16":
        say(f"  fp16: the loss scaler skipped {r.skipped_steps} of {len(losses)} steps (an overflow)")
