"""GPU kit parts: 4 (speed: stronghold against a resident run), 7 (host AdamW) and 8 (which
attention kernel a captured model runs). Each ``part_<name>(kit) -> dict`` runs in its own
subprocess under ``benchmarks/gpu.py``; with ``kit.emulated`` the same code paths run on the CPU
at tiny sizes (``tests/test_gpu_parts.py``).

Part 4, :func:`part_speed`. One GPT (``shfx.models.GPT``) and one Hugging Face
``LlamaForCausalLM`` (from a config, nothing downloaded), each sized by :func:`model_shapes` to
fit resident on the GPU (1-2B parameters on an 80 GiB card), trained in bf16:

* **resident**: ``shfx.compile(policy=shfx.Resident(), precision="bf16")`` when shfx accepts it;
  it refuses today (a device update would need fp32 masters beside the 16-bit copy:
  ``ScheduleError``, recorded), so the resident baseline is the eager bf16 recipe of
  ``tests/mixed_reference.py`` on the GPU, everything resident: a bf16 working copy with
  per-block activation checkpointing (``use_reentrant=False``: the same recompute as shfx's
  backward), fp32 masters and ``torch.optim.AdamW(fused=True)`` on the GPU, ``p16.copy_(p32)``
  after the step;
* **stronghold**: ``shfx.compile(policy=shfx.Stronghold(window="auto"), precision="bf16")``,
  masters and AdamW on the host.

Both stay alive; after a warm-up their steps alternate (A, B, then B, A, ...), each timed
between two synchronizations; medians. Reported: the throughput ratio stronghold/resident
(target >= 0.95), tokens/s, model TFLOP/s = 6 x params x tokens / step time (the "6N" model
count; the hardware does 8N: the backward's recompute adds a forward, and attention's own FLOPs
are not counted), the window the tuner chose and ``cm.report()`` (truncated). One more
stronghold step of the GPT is traced into ``kit.out / "trace_step.json"`` (Chrome trace format:
the runtime's measured actions, ``cm.engine.trace``, one track per stream; the simulator's
prediction of the same step; the GPU kernels torch.profiler saw, aligned to the same clock).

Part 7, :func:`part_host_adam`: ``benchmarks/host_adam.py`` (in this process), sized for ~15-20 s
on 16 cores (tiny, a few seconds, emulated): AdamW GB/s and its fraction of the bandwidth bounds.

Part 8, :func:`part_attention`: a Llama (the config's default attention, SDPA) forward+backward
through shfx and eagerly, under ``torch.profiler``: the attention-like CUDA kernels and aten ops
of each, and whether each ran a fused (flash / memory-efficient / cuDNN) attention or fell back
to the math path (softmax + batched matmuls). Emulated: the CPU ops the same way.

Environment overrides (GPU runs): ``SHFX_GPU_PARAMS`` (target parameters, e.g. ``1.5e9``),
``SHFX_GPU_TOKENS`` (tokens per step), ``SHFX_GPU_SEQ``.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import Kit, cuda_ok, gpt_model, hf_llama, jsonable, median, token_batches  # noqa: E402

import shfx  # noqa: E402
from shfx.passes.actions import Action  # noqa: E402

LR = 1e-4
WEIGHT_DECAY = 0.01


# ---- sizes (parts 4 and 9) -----------------------------------------------------------------------

# device bytes per parameter of the resident bf16 baseline: fp32 master (4), AdamW m and v (8),
# the fp32 gradient handed to AdamW (4), the bf16 working copy (2) and its gradient (2)
RESIDENT_BYTES_PER_PARAM = 20


def _env_float(name: str) -> float | None:
    v = os.environ.get(name)
    try:
        return float(v) if v else None
    except ValueError:
        return None


def model_shapes(kit: Kit, arch: str, purpose: str = "speed") -> dict[str, Any]:
    """The size rule of parts 4 (``purpose="speed"``) and 9 (``"peers"``): ``{"layers", "hidden",
    "heads", "seq", "batch", "vocab", "target_params", "why"}`` for ``arch`` ("gpt" or "llama").

    GPU: hidden 2048 (16 heads of 128), seq 2048, as many layers as make the parameter target.
    Speed: 0.35 of the free GPU memory at :data:`RESIDENT_BYTES_PER_PARAM`, between 0.5B and
    1B, 16K tokens a step (batch 8). The first GPU run (H200, benchmarks/README.md) ran out of
    memory at 2B and 32K tokens (129.7 GiB allocated: the eager baseline, which keeps its
    logits and its fp32 masters, AdamW states and gradients on the device, beside the
    stronghold run) and peaked at 83 GiB for both at 1B and 16K. Peers: 0.35B and 8K tokens
    (each system builds, warms up and measures in its own ~45 s). ``SHFX_GPU_PARAMS``,
    ``SHFX_GPU_TOKENS``, ``SHFX_GPU_SEQ`` override (speed and peers alike). Emulated: a
    2-layer model with hidden 64, seq 32, batch 2."""
    vocab = {"gpt": 50304, "llama": 32000}[arch]
    if kit.emulated:
        return {"layers": 2, "hidden": 64, "heads": 2, "seq": 32, "batch": 2, "vocab": 256,
                "target_params": None, "why": "emulated: tiny"}  # fmt: skip
    free, total = torch.cuda.mem_get_info()
    cap, default_tokens = (1.0e9, 16384) if purpose == "speed" else (0.35e9, 8192)
    target = _env_float("SHFX_GPU_PARAMS") or min(cap, max(min(0.5e9, cap), 0.35 * free / RESIDENT_BYTES_PER_PARAM))
    hidden, heads = 2048, 16
    seq = int(_env_float("SHFX_GPU_SEQ") or 2048)
    per_layer = (12 if arch == "gpt" else 10) * hidden * hidden  # llama: gpu_common.hf_llama's MLP is 2h wide, 3 matrices
    embed = vocab * hidden * (1 if arch == "gpt" else 2)  # GPT ties its head to the embedding
    layers = max(2, round((target - embed) / per_layer))
    tokens = int(_env_float("SHFX_GPU_TOKENS") or default_tokens)
    batch = max(1, tokens // seq)
    why = (f"{purpose}: 0.35 x {free / 2**30:.1f} GiB free / {RESIDENT_BYTES_PER_PARAM} B/param, at most {cap / 1e9:g}B"
           if _env_float("SHFX_GPU_PARAMS") is None else "SHFX_GPU_PARAMS")  # fmt: skip
    return {"layers": layers, "hidden": hidden, "heads": heads, "seq": seq, "batch": batch, "vocab": vocab,
            "target_params": target, "why": why, "gpu_free_bytes": free, "gpu_total_bytes": total}  # fmt: skip


def build_model(arch: str, s: dict[str, Any], seed: int = 0) -> tuple[torch.nn.Module, Callable, Callable]:
    """``(model, make_batch, call)``: the fp32 model on the CPU, ``make_batch(step) -> (x, y)``
    (on the CPU) and ``call(m, x, y) -> loss`` (the model's own way of taking a batch)."""
    if arch == "gpt":
        model, mb = gpt_model(s["layers"], s["hidden"], s["heads"], s["seq"], s["vocab"], seed, batch=s["batch"])
        return model, mb, lambda m, x, y: m(x, y)
    model = hf_llama(s["layers"], s["hidden"], s["heads"], s["seq"], s["vocab"], seed=seed)
    mb = token_batches(s["vocab"], s["seq"], s["batch"])
    return model, mb, lambda m, x, y: m(input_ids=x, labels=x).loss


def count_params(model: torch.nn.Module) -> dict[str, int]:
    ps = list(model.parameters())
    emb = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    n = sum(p.numel() for p in ps)
    return {"params": n, "params_non_embedding": n - emb}


def flops_fields(params: int, tokens: int, step_s: float) -> dict[str, float]:
    """Model TFLOP/s (6N per token) and the hardware count with the recompute (8N)."""
    if not step_s or step_s != step_s:
        return {}
    return {"tokens_per_s": tokens / step_s, "model_tflops": 6 * params * tokens / step_s / 1e12,
            "hardware_tflops_with_recompute": 8 * params * tokens / step_s / 1e12}  # fmt: skip


FLOPS_NOTE = ("model_tflops = 6 x params x tokens / step time (all parameters, embeddings included; attention's "
              "own FLOPs not counted); with activation recompute the hardware does a second forward: "
              "hardware_tflops_with_recompute = 8 x params x tokens / step time")  # fmt: skip


# ---- the resident baseline: the eager bf16 recipe, all on the device -------------------------------


class _Checkpointed(torch.nn.Module):
    """A block whose forward is recomputed in backward (``use_reentrant=False``)."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        import torch.utils.checkpoint as ckpt

        return ckpt.checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def _checkpoint_blocks(model: torch.nn.Module, arch: str) -> None:
    if arch == "gpt":
        h = model.transformer.h
        for i, blk in enumerate(h):
            h[i] = _Checkpointed(blk)
    else:  # Hugging Face: its own switch
        hf_checkpointing(model)


def hf_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant activation checkpointing of every decoder layer of a Hugging Face model:
    ``activation_checkpointing_enable`` where transformers has it (newer than the GPU image's 5.17,
    which deprecates the older name), else ``gradient_checkpointing_enable``."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def bf16_working_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy with its floating-point parameters in bf16 and its buffers as they are (RoPE's
    ``inv_freq`` stays fp32): what ``precision="bf16"`` keeps on the device
    (``tests/mixed_reference.make_working_copy``). Tied parameters stay tied."""
    work = copy.deepcopy(model)
    for p in work.parameters():
        if p.is_floating_point():
            p.data = p.data.to(torch.bfloat16)
    return work


class EagerBF16:
    """The mixed-precision recipe of ``tests/mixed_reference.py`` on ``device``: fp32 masters and
    fused AdamW there, a bf16 working copy with every block checkpointed, ``p16.copy_(p32)``
    after each step."""

    def __init__(self, model: torch.nn.Module, arch: str, device: torch.device, call: Callable):
        self.call = call
        self.master = model.to(device)
        self.work = bf16_working_copy(self.master)
        _checkpoint_blocks(self.work, arch)
        self.master.train()
        self.work.train()
        self.p32 = [p for p in self.master.parameters() if p.requires_grad]
        self.p16 = [p for p in self.work.parameters() if p.requires_grad]
        assert [p.shape for p in self.p32] == [p.shape for p in self.p16]
        self.opt = torch.optim.AdamW(self.p32, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)  # CPU too (torch >= 2.4)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.call(self.work, x, y)
        loss.backward()
        for a, b in zip(self.p32, self.p16):
            a.grad = b.grad.float()
            b.grad = None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(self.p16, self.p32)
        return float(loss.detach())

    def close(self) -> None:
        self.opt = self.master = self.work = self.p32 = self.p16 = None  # type: ignore[assignment]


class ShfxRun:
    def __init__(self, model: torch.nn.Module, kit: Kit, policy: Any, call: Callable):
        self.call = call
        self.cm = shfx.compile(model, device=kit.device(), policy=policy, precision="bf16",
                               optimizer=shfx.optim.AdamW(lr=LR, weight_decay=WEIGHT_DECAY))  # fmt: skip

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.call(self.cm, x, y)
        loss.backward()
        self.cm.step()
        self.cm.zero_grad()
        return float(loss.detach())

    def close(self) -> None:
        self.cm.close()


def _resident_runner(model, arch, kit, call) -> tuple[Any, str, str | None]:
    """shfx's Resident policy in bf16 if it accepts it (tried on a tiny probe model first so a
    refusal costs no GPU memory), else the eager bf16 recipe; ``(runner, kind, refusal)``."""
    refusal = None
    try:
        probe = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        pcm = shfx.compile(probe, device=kit.device(), policy=shfx.Resident(), precision="bf16",
                           optimizer=shfx.optim.AdamW(lr=LR), blocks=False, num_stages=2)  # fmt: skip
        pcm(torch.randn(2, 16, device=kit.torch_device)).float().sum().backward()
        pcm.step()
        pcm.close()
    except Exception as e:  # noqa: BLE001 - ScheduleError today; anything else: the same fallback
        refusal = f"{type(e).__name__}: {str(e)[:400]}"
    if refusal is None:
        return ShfxRun(model, kit, shfx.Resident(), call), "shfx Resident(), precision='bf16'", None
    return EagerBF16(model, arch, kit.torch_device, call), "eager bf16 recipe on the device (tests/mixed_reference.py), blocks checkpointed", refusal


def _interleave(kit: Kit, runners: dict[str, Any], batch: Callable, warmup: int, max_pairs: int,
                reserve_s: float) -> tuple[dict[str, list[float]], dict[str, list[float]], list[str]]:  # fmt: skip
    """Warm-up steps of each, then pairs of steps, the order swapped every pair, while
    ``kit.remaining() > reserve_s`` (at least 2 pairs when there is time). Returns per-runner
    step times, losses and notes."""
    names = list(runners)
    times: dict[str, list[float]] = {k: [] for k in names}
    losses: dict[str, list[float]] = {k: [] for k in names}
    notes: list[str] = []
    step = 0
    for _ in range(warmup):
        for k in names:
            x, y = batch(step)
            with kit.timer() as t:
                losses[k].append(runners[k].step(x, y))
            kit.log(f"  warm-up {k}: {t.seconds * 1e3:.0f} ms")
        step += 1
    last_pair_s = 0.0
    for i in range(max_pairs):
        if kit.remaining() - last_pair_s * 1.2 < reserve_s:
            notes.append(f"stopped after {i} measured pairs: {kit.remaining():.0f} s left")
            break
        s0 = time.monotonic()
        order = names if i % 2 == 0 else names[::-1]
        x, y = batch(step)
        for k in order:
            with kit.timer() as t:
                losses[k].append(runners[k].step(x, y))
            times[k].append(t.seconds)
        step += 1
        last_pair_s = time.monotonic() - s0
    return times, losses, notes


def _summary(times: list[float], params: int, tokens: int) -> dict[str, Any]:
    m = median(times)
    out: dict[str, Any] = {"step_s_median": m, "step_s_min": min(times) if times else None, "steps_s": times}
    out.update(flops_fields(params, tokens, m))
    return out


def _cuda_memory(kit: Kit) -> dict[str, int] | None:
    """``{"allocated", "peak_allocated", "reserved"}`` bytes of the CUDA caching allocator now."""
    if not kit.cuda:
        return None
    return {"allocated": torch.cuda.memory_allocated(), "peak_allocated": torch.cuda.max_memory_allocated(),
            "reserved": torch.cuda.memory_reserved()}  # fmt: skip


def speed_pair(kit: Kit, arch: str, trace_path: Path | None, reserve_s: float) -> dict[str, Any]:
    """Part 4 for one model: resident vs stronghold (window auto), interleaved."""
    s = model_shapes(kit, arch)
    kit.log(f"speed {arch}: {s}")
    t0 = time.monotonic()
    model, make_batch, call = build_model(arch, s)
    pc = count_params(model)
    tokens = s["batch"] * s["seq"]
    res: dict[str, Any] = {"arch": arch, "shape": s, **pc, "tokens_per_step": tokens}
    twin = copy.deepcopy(model)  # each run owns its weights (shfx's host store *is* the model's tensors)
    res["build_s"] = time.monotonic() - t0

    dev = kit.torch_device

    def batch(i: int):
        x, y = make_batch(i)
        return x.to(dev), y.to(dev)

    kit.reset_peak()
    t0 = time.monotonic()
    resident, kind, refusal = _resident_runner(model, arch, kit, call)
    res["resident_kind"] = kind
    res["shfx_resident_bf16_refused"] = refusal
    x, y = batch(0)
    with kit.timer() as t:
        first_loss = {"resident": resident.step(x, y)}  # as the stronghold run's first step below
    res["resident_first_step_s"] = t.seconds
    res["gpu_memory_after_resident_first_step"] = _cuda_memory(kit)  # what the baseline holds, and its peak
    kit.reset_peak()
    res["resident_setup_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    strong = ShfxRun(twin, kit, shfx.Stronghold(window="auto"), call)
    x, y = batch(0)
    with kit.timer() as t:
        first_loss["stronghold"] = strong.step(x, y)  # the capture, the tuner's profile and the first step
    res["stronghold_first_step_s"] = t.seconds
    res["gpu_memory_after_stronghold_first_step"] = _cuda_memory(kit)  # both held; the peak: capture, profile, step
    kit.reset_peak()
    res["stronghold_setup_s"] = time.monotonic() - t0
    cm = strong.cm
    rep = None
    try:
        rep = cm.report()
        res["window"] = rep.window
        res["window_how"] = rep.how
        res["stages"] = len(cm.stages.stages)
        res["predicted_step_s"] = rep.predicted_s
        res["report"] = str(rep)[:3000]
    except Exception as e:  # noqa: BLE001
        res["report"] = f"cm.report() failed: {type(e).__name__}: {e}"
        res["window"] = cm.program.num_slots
    kit.record(f"{arch}_setup", res)

    warmup = 1 if kit.emulated else 2
    times, losses, notes = _interleave(kit, {"resident": resident, "stronghold": strong}, batch, warmup,
                                       max_pairs=4 if kit.emulated else 12, reserve_s=reserve_s)  # fmt: skip
    res["notes"] = notes
    res["resident"] = _summary(times["resident"], pc["params"], tokens)
    res["stronghold"] = _summary(times["stronghold"], pc["params"], tokens)
    res["losses"] = {k: [first_loss[k]] + v for k, v in losses.items()}
    # the same weights and batches: the two bf16 runs should stay close (not bitwise: different kernels)
    res["max_loss_diff"] = max(abs(a - b) for a, b in zip(res["losses"]["resident"], res["losses"]["stronghold"]))
    pair_ratios = [a / b for a, b in zip(times["resident"], times["stronghold"])]
    res["throughput_ratio_stronghold_over_resident"] = (
        median(times["resident"]) / median(times["stronghold"]) if times["stronghold"] else None)  # fmt: skip
    res["throughput_ratio_median_of_pairs"] = median(pair_ratios) if pair_ratios else None
    res["target_ratio"] = 0.95
    res["gpu_peak_allocated_bytes_both"] = kit.peak_allocated()
    try:
        st = cm.stats()
        res["stronghold_stats"] = {k: st[k] for k in st if k in ("bytes_h2d", "bytes_d2h", "peak_bytes", "device",
                                                                  "resident_window")}  # fmt: skip
    except Exception:  # noqa: BLE001
        pass
    if trace_path is not None:
        try:
            res["trace"] = write_step_trace(kit, strong, batch(10_000), trace_path, rep)
        except Exception as e:  # noqa: BLE001
            res["trace"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-1500:]}
    resident.close()
    strong.close()
    del resident, strong, cm, model, twin
    kit.free_cuda()
    return res


# ---- the Chrome trace of one stronghold step --------------------------------------------------------

_STREAM_TRACKS = ["compute", "h2d", "d2h", "host", "cpu", "none"]


def _runtime_events(events: list, t0: float, pid: int) -> list[dict]:
    """``cm.engine.trace`` events (host ``perf_counter`` seconds) as Chrome "X" events, one track
    per stream, microseconds from ``t0``."""
    streams = list(dict.fromkeys(_STREAM_TRACKS + [e.stream for e in events]))
    tid = {s: i + 1 for i, s in enumerate(streams)}
    out: list[dict] = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": "shfx measured step (cm.engine.trace)"}},
                       {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}}]  # fmt: skip
    for s, i in tid.items():
        out.append({"ph": "M", "pid": pid, "tid": i, "name": "thread_name", "args": {"name": s}})
    for e in events:
        out.append({"ph": "X", "pid": pid, "tid": tid[e.stream], "name": e.action, "cat": e.stream,
                    "ts": (e.start - t0) * 1e6, "dur": max(0.0, e.end - e.start) * 1e6,
                    "args": {"phase": e.phase, "bytes": e.bytes}})  # fmt: skip
    return out


def action_summary(events: list) -> dict[str, Any]:
    """From one step's ``cm.engine.trace``: busy milliseconds per stream, and per action kind
    (PF, F, B, OG, U, ...) the count and median milliseconds (the first GPU run's trace showed
    OG at ~28 ms and U at ~31 ms per 100 MB stage: what to look at first)."""
    busy: dict[str, float] = {}
    kinds: dict[str, list[float]] = {}
    for e in events:
        ms = max(0.0, e.end - e.start) * 1e3
        busy[e.stream] = busy.get(e.stream, 0.0) + ms
        kinds.setdefault(Action.from_str(e.action).kind.value, []).append(ms)
    return {"busy_ms_by_stream": {k: round(v, 2) for k, v in busy.items()},
            "actions_ms": {k: {"count": len(v), "median_ms": round(median(v), 3)} for k, v in sorted(kinds.items())}}  # fmt: skip


def write_step_trace(kit: Kit, run: ShfxRun, xy: tuple, path: Path, rep: Any) -> dict[str, Any]:
    """One stronghold step under ``torch.profiler``; writes ``path`` (Chrome trace JSON) with the
    runtime's measured actions (pid 1), the simulator's prediction of the step at the window in
    use (pid 2, from the step's start) and the profiler's GPU kernels and copies (pid 3; CPU ops
    of the aten level when emulated), aligned on a marker recorded at the step's start."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kit.cuda and cuda_ok() else [])
    x, y = xy
    kit.sync()
    with profile(activities=acts) as prof:
        t_start = time.perf_counter()
        with record_function("shfx_step_start"):
            pass
        with kit.timer() as t:
            run.step(x, y)
    events = list(run.cm.engine.trace)
    t0 = min([t_start] + [e.start for e in events])
    out = _runtime_events(events, t0, 1)
    info: dict[str, Any] = {"step_s": t.seconds, "runtime_events": len(events), **action_summary(events)}
    if rep is not None:
        try:
            sim = rep.tune.row(rep.window).timeline.to_chrome_trace()["traceEvents"]
            for e in sim:
                e["pid"] = 2
                if e.get("name") == "process_name":
                    e["args"] = {"name": f"shfx simulated step (W={rep.window}), from the measured step's start"}
                if "ts" in e:
                    e["ts"] = e["ts"] + (t_start - t0) * 1e6
            out += sim
            info["simulated_events"] = len(sim)
            info["predicted_step_s"] = rep.predicted_s
        except Exception as e:  # noqa: BLE001
            info["simulated_error"] = f"{type(e).__name__}: {e}"
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "prof.json")
        prof.export_chrome_trace(p)
        with open(p) as f:
            pt = json.load(f)
    raw = pt.get("traceEvents", pt) if isinstance(pt, dict) else pt
    marker = next((e for e in raw if e.get("name") == "shfx_step_start" and "ts" in e), None)
    cats = {"kernel", "gpu_memcpy", "gpu_memset"} if kit.cuda else {"cpu_op"}
    keep = [e for e in raw if e.get("ph") == "X" and e.get("cat") in cats]
    cap = 40_000
    info["profiler_events"] = len(keep)
    info["profiler_events_kept"] = min(cap, len(keep))
    if marker is not None:
        off = (t_start - t0) * 1e6 - float(marker["ts"])
        threads: dict[Any, int] = {}
        out.append({"ph": "M", "pid": 3, "name": "process_name",
                    "args": {"name": "torch.profiler: " + ("GPU kernels and copies" if kit.cuda else "CPU ops")}})  # fmt: skip
        for e in keep[:cap]:
            tid = threads.setdefault((e.get("pid"), e.get("tid")), len(threads) + 1)
            out.append({"ph": "X", "pid": 3, "tid": tid, "name": str(e.get("name"))[:120], "cat": e.get("cat"),
                        "ts": float(e["ts"]) + off, "dur": float(e.get("dur", 0.0))})  # fmt: skip
        for (p_, t_), tid in threads.items():
            out.append({"ph": "M", "pid": 3, "tid": tid, "name": "thread_name", "args": {"name": f"{p_}/{t_}"}})
    else:
        info["profiler_note"] = "no start marker in the profiler's trace: its events are left out"
    doc = {"traceEvents": out, "displayTimeUnit": "ms",
           "otherData": {"what": "one shfx stronghold step: measured actions (pid 1), simulated (pid 2), profiler (pid 3)",
                         "program": " ".join(run.cm.program.actions())[:4000], "step_s": t.seconds}}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    info["path"] = str(path)
    info["bytes"] = path.stat().st_size
    return info


def part_speed(kit: Kit) -> dict[str, Any]:
    """Part 4: stronghold (window auto) vs resident, bf16, GPT then Llama, interleaved steps."""
    out: dict[str, Any] = {"flops_note": FLOPS_NOTE, "target_ratio": 0.95, "models": {}}
    plan = [("gpt", kit.out / "trace_step.json"), ("llama", None)]
    for i, (arch, trace) in enumerate(plan):
        left = len(plan) - i - 1
        # the next model needs ~45 s on the GPU; keep that, and stop measuring this one in time
        reserve = (5.0 if kit.emulated else 45.0) * left + (1.0 if kit.emulated else 8.0)
        if kit.remaining() < reserve + (2.0 if kit.emulated else 25.0):
            out["models"][arch] = {"skipped": f"out of time ({kit.remaining():.0f} s left)"}
            continue
        try:
            r = speed_pair(kit, arch, trace, reserve)
        except Exception as e:  # noqa: BLE001 - the other model still runs
            r = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            kit.free_cuda()
        out["models"][arch] = r
        kit.record(arch, r)
    ratios = {a: r.get("throughput_ratio_stronghold_over_resident") for a, r in out["models"].items()}
    out["throughput_ratio"] = ratios
    out["meets_target"] = {a: (v is not None and v >= 0.95) for a, v in ratios.items()}
    bits = []
    for a, r in out["models"].items():
        if ratios.get(a) is None:
            bits.append(f"{a}: {r.get('skipped') or (r.get('error') or '?')[:80]}")
            continue
        sh = r["stronghold"]
        bits.append(f"{a} {r['params'] / 1e9:.2f}B: stronghold/resident {ratios[a]:.3f} (W={r.get('window')}), "
                    f"{sh.get('model_tflops', float('nan')):.1f} model TFLOP/s, {sh.get('tokens_per_s', float('nan')):.0f} tok/s")  # fmt: skip
    out["summary"] = "; ".join(bits)
    return out


# ---- part 7: host AdamW ---------------------------------------------------------------------------


def host_adam_args(kit: Kit, out_json: Path) -> list[str]:
    """host_adam.py's arguments: tiny when emulated (~3 s), ~15-20 s on a 16-core box otherwise."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if kit.emulated:
        a = ["--sizes", "50K", "--groups", "2", "--layers", "1", "--reps", "1", "--max-rounds", "2",
             "--config-sizes", "50K", "--configs", "1x1,2x1", "--bw-elements", "64K", "--bw-reps", "1",
             "--bw-max-rounds", "2", "--cache-params", "16K", "--copy-sizes", "50K", "--copy-chunks", "16K",
             "--copy-threads", "1", "--check-size", "20K", "--check-steps", "2", "--wait-quiet", "0"]  # fmt: skip
    else:
        # ~15-20 s at ~50 GB/s: the box is ours alone (no waiting for quiet), for-loop AdamW skipped
        half = max(1, cores // 2)
        a = ["--sizes", "20M,100M", "--reps", "5", "--max-rounds", "7", "--forloop-max", "0",
             "--config-sizes", "50M", "--configs", f"1x{cores},2x{half},4x{max(1, cores // 4)},{cores}x1",
             "--bw-elements", "64M", "--bw-reps", "3", "--bw-max-rounds", "5", "--cache-params", "1M",
             "--copy-sizes", "100M", "--copy-chunks", "256K,4M", "--copy-threads", str(cores),
             "--check-size", "5M", "--check-steps", "2", "--wait-quiet", "0"]  # fmt: skip
    return a + ["--out", str(out_json)]


def summarize_host_adam(d: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of host_adam.py's JSON."""
    out: dict[str, Any] = {"stream_bound_gbs": d.get("bound_gbs"), "cpu": d.get("machine", {}).get("cpu_model"),
                           "threads": d.get("machine", {}).get("torch_threads"), "sizes": []}  # fmt: skip
    for r in d.get("sizes") or []:
        v = r["variants"]
        row = {"params": r["params"], "quiet": r["quiet_rounds_used"], "probe_bound_gbs": r["probe_bound"]["gbs_median"]}
        for k in ("shfx", "torch fused", "torch foreach"):
            if k in v:
                row[k] = {"gbs": v[k]["gbs"], "median_s": v[k]["median_s"],
                          "fraction_of_stream_bound": v[k]["fraction_of_stream_bound"],
                          "fraction_of_probe_bound": v[k]["fraction_of_probe_bound"]}  # fmt: skip
        out["sizes"].append(row)
    if out["sizes"]:
        big = out["sizes"][-1]["shfx"]
        out["adamw_gbs"] = big["gbs"]
        out["adamw_fraction_of_stream_bound"] = big["fraction_of_stream_bound"]
        out["adamw_fraction_of_probe_bound"] = big["fraction_of_probe_bound"]
    cfgs = []
    for r in d.get("configs") or []:
        cfgs.append({"params": r["params"], **{k: {"gbs": c["gbs"], "fraction_of_probe_bound": c["fraction_of_probe_bound"]}
                                                for k, c in r["configs"].items()}})  # fmt: skip
    out["configs"] = cfgs
    wc = (d.get("working_copy") or {}).get("sizes") or []
    out["working_copy"] = [{"params": r["params"], "threads": r["threads"],
                            "equals_master_cast": r["working_copy_equals_master_cast"],
                            **{k: {"gbs": v["gbs"], "fraction_of_probe_bound": v["fraction_of_probe_bound"]}
                               for k, v in r["variants"].items()}} for r in wc]  # fmt: skip
    chk = d.get("check") or {}
    out["check_ok"] = chk.get("ok")
    return out


def part_host_adam(kit: Kit) -> dict[str, Any]:
    """Part 7: benchmarks/host_adam.py, in this process (torch and shfx are imported already: a
    subprocess would spend seconds importing them again), its JSON to a temp file."""
    import contextlib
    import io

    import host_adam

    with tempfile.TemporaryDirectory() as d:
        js = Path(d) / "host_adam.json"
        args = host_adam_args(kit, js)
        buf = io.StringIO()
        argv, prev_threads = sys.argv, torch.get_num_threads()
        t0 = time.monotonic()
        code: Any = 0
        try:
            sys.argv = ["host_adam.py", *args]
            with contextlib.redirect_stdout(buf):
                host_adam.main()
        except SystemExit as e:  # main() exits 1 when its checks fail
            code = e.code
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:],
                    "stdout_tail": buf.getvalue()[-2000:]}  # fmt: skip
        finally:
            sys.argv = argv
            torch.set_num_threads(prev_threads)
        out: dict[str, Any] = {"returncode": code or 0, "wall_s": time.monotonic() - t0, "args": args[:-2]}
        if not js.exists():
            out["error"] = "no JSON written"
            out["stdout_tail"] = buf.getvalue()[-3000:]
            return out
        out.update(summarize_host_adam(json.loads(js.read_text())))
        out["stdout_tail"] = buf.getvalue()[-2500:]
        if "adamw_gbs" in out:
            out["summary"] = (f"HostAdamW {out['adamw_gbs']:.1f} GB/s at {out['sizes'][-1]['params'] / 1e6:.0f}M params: "
                              f"{out['adamw_fraction_of_stream_bound']:.0%} of STREAM ({out['stream_bound_gbs']:.0f} GB/s), "
                              f"{out['adamw_fraction_of_probe_bound']:.0%} of the probe bound; check ok: {out['check_ok']}")  # fmt: skip
        return out


# ---- part 8: the attention kernel -----------------------------------------------------------------

_ATTN = re.compile(r"flash|fmha|cudnn|efficient|sdpa|scaled_dot|attention|softmax|bmm|gemm|matmul", re.I)
_FUSED = re.compile(r"flash|fmha|efficient_attention|cudnn_attention|cudnn.*(sdpa|attn|mha|fort)|sdpa|scaled_dot_product_(flash|efficient|cudnn)", re.I)
_MATH_SOFTMAX = re.compile(r"(?<!log)(?<!log_)softmax", re.I)


def _profile_kernels(kit: Kit, fn: Callable[[], None]) -> dict[str, Any]:
    """Run ``fn`` under ``torch.profiler`` (CPU, and CUDA when there): the attention-like CUDA
    kernel names and aten ops with their counts, and a verdict."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kit.cuda and cuda_ok() else [])
    kit.sync()
    with profile(activities=acts, record_shapes=True) as prof:
        fn()
        kit.sync()
    # the input shapes of the SDPA calls: a 4th input (an explicit attention mask) rules out the
    # flash kernels on CUDA (the memory-efficient or math path takes it)
    sdpa_shapes: dict[str, list] = {}
    try:
        for a in prof.key_averages(group_by_input_shape=True):
            if a.key in ("aten::scaled_dot_product_attention",) or "scaled_dot_product" in a.key and "backward" not in a.key:
                sdpa_shapes.setdefault(a.key, []).append({"shapes": [list(x) if isinstance(x, (list, tuple)) else x
                                                                     for x in (a.input_shapes or [])][:5],
                                                          "count": a.count})  # fmt: skip
    except Exception as e:  # noqa: BLE001 - only a diagnostic
        sdpa_shapes["error"] = [f"{type(e).__name__}: {e}"]
    kernels: dict[str, int] = {}
    ops: dict[str, int] = {}
    cuda_type = getattr(torch.autograd.DeviceType, "CUDA", None)
    for e in prof.events():
        name = e.name
        if not _ATTN.search(name):
            continue
        if getattr(e, "device_type", None) == cuda_type and cuda_type is not None:
            kernels[name[:160]] = kernels.get(name[:160], 0) + 1
        elif name.startswith("aten::"):
            ops[name] = ops.get(name, 0) + 1
    sdpa_ops = {k: v for k, v in ops.items() if "scaled_dot_product" in k or "flash_attention" in k
                or "efficient_attention" in k or "cudnn_attention" in k}  # fmt: skip
    fused_ops = [k for k in sdpa_ops if re.search(r"flash|efficient|cudnn", k) and "math" not in k]
    math_ops = [k for k in sdpa_ops if "math" in k]
    softmax_ops = [k for k in ops if _MATH_SOFTMAX.search(k) and "log_softmax" not in k]
    fused_kernels = [k for k in kernels if _FUSED.search(k)]
    softmax_kernels = [k for k in kernels if _MATH_SOFTMAX.search(k) and "LogSoftMax" not in k and "log_softmax" not in k]
    fused = bool(fused_ops or fused_kernels)
    math = bool(math_ops or ((softmax_ops or softmax_kernels) and not fused))
    verdict = "fused" if fused and not math else "math" if math and not fused else "both" if fused else "unknown"
    return {
        "cuda_kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:40]),
        "aten_ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:40]),
        "fused_attention_ops": fused_ops,
        "fused_attention_kernels": fused_kernels[:20],
        "math_attention_ops": math_ops,
        "softmax_ops": softmax_ops,
        "softmax_kernels": softmax_kernels[:20],
        "sdpa_input_shapes": sdpa_shapes,
        "sdpa_with_mask": any(len(d["shapes"]) > 3 and d["shapes"][3] not in ([], None)
                              for k, v in sdpa_shapes.items() if k == "aten::scaled_dot_product_attention" for d in v),
        "verdict": verdict,
    }


def part_attention(kit: Kit) -> dict[str, Any]:
    """Part 8: which attention a captured Llama runs through shfx, against the same model eagerly."""
    if kit.emulated:
        s = {"layers": 2, "hidden": 64, "heads": 2, "seq": 64, "batch": 2, "vocab": 256}
    else:
        s = {"layers": 4, "hidden": 1024, "heads": 8, "seq": 1024, "batch": 4, "vocab": 32000}
    model = hf_llama(s["layers"], s["hidden"], s["heads"], s["seq"], s["vocab"])
    attn_impl = getattr(model.config, "_attn_implementation", None)
    eager = bf16_working_copy(model).to(kit.torch_device)
    make_batch = token_batches(s["vocab"], s["seq"], s["batch"], kit.torch_device)
    out: dict[str, Any] = {"shape": s, "attn_implementation": attn_impl, "dtype": "bfloat16"}
    cm = shfx.compile(model, device=kit.device(), precision="bf16", window=2, optimizer=shfx.optim.AdamW(lr=LR))

    def shfx_fb(i: int) -> Callable[[], None]:
        def run() -> None:
            x, _ = make_batch(i)
            cm(input_ids=x, labels=x).loss.backward()
            cm.step()
            cm.zero_grad()

        return run

    def eager_fb(i: int) -> Callable[[], None]:
        def run() -> None:
            x, _ = make_batch(i)
            eager(input_ids=x, labels=x).loss.backward()
            eager.zero_grad(set_to_none=True)

        return run

    try:
        shfx_fb(0)()  # the capture and a first step outside the profile
        eager_fb(0)()
        out["shfx"] = _profile_kernels(kit, shfx_fb(1))
        out["eager"] = _profile_kernels(kit, eager_fb(1))
    finally:
        cm.close()
    out["same_verdict"] = out["shfx"]["verdict"] == out["eager"]["verdict"]
    out["both_fused"] = out["shfx"]["verdict"] == "fused" and out["eager"]["verdict"] == "fused"
    out["summary"] = (f"shfx: {out['shfx']['verdict']}, eager: {out['eager']['verdict']}"
                      + ("" if out["same_verdict"] else " (shfx differs from eager: check the capture of SDPA)")
                      + f"; SDPA attn_mask: shfx {out['shfx']['sdpa_with_mask']}, eager {out['eager']['sdpa_with_mask']}")  # fmt: skip
    return jsonable(out)


PARTS = {"speed": part_speed, "host_adam": part_host_adam, "attention": part_attention}
