"""GPU kit part 9, peers: the systems shfx is compared with, on the model of part 4, in one call.

For the GPT and the Hugging Face Llama of part 4 (the same size rule,
:func:`gpu_parts_speed.model_shapes`), a few training steps with each of

* **shfx**: ``shfx.compile(policy=shfx.Stronghold(window="auto"), precision="bf16")`` (the
  emulated run: a fixed window of 2, so the tuner's profile does not take the test's time);
* **fsdp2**: ``torch.distributed.fsdp.fully_shard`` on every block and the root, with
  ``CPUOffloadPolicy(pin_memory=True)`` (parameters, gradients and AdamW on the host) and
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, one rank: a process group of
  world size 1 on a local file store (NCCL on the GPU; the emulated run: gloo on the CPU, and
  without the offload policy if FSDP2 refuses it there), ``torch.optim.AdamW(fused=True)`` (or
  its default where fused refuses the sharded parameters);
* **torchao**: ``torchao.optim.CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True)`` (fp32
  weights on the GPU, bf16 autocast, AdamW on the host): only where the torchao wheel was
  carried (``.whl/``, ``benchmarks/gpu_wheels.sh``) or is installed;
* **deepspeed**: ZeRO stage 2 with ``offload_optimizer: cpu`` (DeepSpeedCPUAdam, JIT-built with
  ninja on the machine at its first use), ``bf16`` on, one process without MPI
  (``deepspeed.init_distributed`` on a local TCP store, ``RANK``/``WORLD_SIZE`` set): only where
  the deepspeed wheel was carried or is installed;

every one with per-block activation checkpointing (the same recompute as shfx's backward: 8N
FLOPs a token on the hardware, 6N counted as model FLOPs). Each reports the median step time
after a warm-up, model TFLOP/s, tokens/s, the GPU's peak allocated memory, the host's peak RSS,
and the losses; or why it could not run ("not available here: <reason>", or the error).

On the GPU every (system, model) runs in a subprocess of its own (``python gpu_parts_peers.py
--one SYSTEM ARCH``): a clean CUDA context, allocator peak and process group for each, and a crash
or hang in one costs only that one. Emulated, they run in this process (tiny, seconds). Writes
``kit.out / "peers.json"`` (also returned).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import ROOT, Kit, cuda_ok, jsonable, median  # noqa: E402
from gpu_parts_speed import (  # noqa: E402
    FLOPS_NOTE,
    LR,
    WEIGHT_DECAY,
    _Checkpointed,
    build_model,
    count_params,
    flops_fields,
    hf_checkpointing,
    model_shapes,
)

import shfx  # noqa: E402

# deepspeed first: its first run JIT-builds DeepSpeedCPUAdam (~1 min of ninja on the box), so it
# gets the largest share of the call while the most time is left
SYSTEMS = ("deepspeed", "shfx", "fsdp2", "torchao")
# shares of the call's time (a (system, model) gets its weight over the weights still to run);
# deepspeed's first run gets BUILD_WEIGHT more for the build
WEIGHTS = {"deepspeed": 1.6, "shfx": 1.0, "fsdp2": 1.0, "torchao": 0.8}
BUILD_WEIGHT = 1.5
ARCHS = ("gpt", "llama")
WHEEL_DIR = ROOT / ".whl"


# ---- the carried wheels ---------------------------------------------------------------------------


def install_wheels(kit: Kit) -> dict[str, Any]:
    """``pip install --no-deps --no-index --target <tmp> .whl/*.whl`` when there are wheels and this
    is a GPU run (or ``SHFX_PEERS_INSTALL_WHEELS=1``); returns ``{"path": target or None, ...}``.
    The target goes on ``sys.path`` here and on ``PYTHONPATH`` for the subprocesses."""
    wheels = sorted(WHEEL_DIR.glob("*.whl")) if WHEEL_DIR.is_dir() else []
    info: dict[str, Any] = {"wheels": [w.name for w in wheels], "path": None}
    if not wheels:
        info["note"] = f"no wheels in {WHEEL_DIR} (run benchmarks/gpu_wheels.sh before the GPU call)"
        return info
    if kit.emulated and os.environ.get("SHFX_PEERS_INSTALL_WHEELS") != "1":
        info["note"] = "emulated: the carried wheels are not installed (SHFX_PEERS_INSTALL_WHEELS=1 to do it)"
        return info
    target = Path(tempfile.gettempdir()) / "shfx_peer_wheels"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                        "--no-compile", "--disable-pip-version-check", "--target", str(target), *map(str, wheels)],
                       capture_output=True, text=True, timeout=180)  # fmt: skip
    info["install_s"] = time.monotonic() - t0
    info["returncode"] = p.returncode
    if p.returncode != 0:
        info["error"] = (p.stdout + p.stderr)[-2000:]
        return info
    info["path"] = str(target)
    if str(target) not in sys.path:
        sys.path.append(str(target))  # after the image's own packages: carried ones only fill gaps
    return info


# ---- one (system, model) -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _blocks(model: torch.nn.Module, arch: str) -> torch.nn.ModuleList:
    return model.transformer.h if arch == "gpt" else model.model.layers


def _checkpoint(model: torch.nn.Module, arch: str) -> None:
    """Per-block activation checkpointing, non-reentrant (blocks replaced in place for the GPT)."""
    if arch == "gpt":
        h = model.transformer.h
        for i, blk in enumerate(h):
            h[i] = _Checkpointed(blk)
    else:
        hf_checkpointing(model)


def _cuda_peak_reset(kit: Kit) -> None:
    if kit.cuda and cuda_ok():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _cuda_peak(kit: Kit) -> int | None:
    if kit.cuda and cuda_ok():
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    return None


class _Runner:
    """``step(x, y) -> loss``; ``close()``; ``info`` (what it runs with)."""

    info: dict[str, Any]

    def step(self, x, y) -> float:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        pass


class ShfxRunner(_Runner):
    def __init__(self, kit: Kit, model, arch: str, call: Callable):
        window = 2 if kit.emulated else "auto"
        self.call = call
        self.cm = shfx.compile(model, device=kit.device(), policy=shfx.Stronghold(window=window), precision="bf16",
                               optimizer=shfx.optim.AdamW(lr=LR, weight_decay=WEIGHT_DECAY))  # fmt: skip
        self.info = {"policy": f"Stronghold(window={window!r})", "precision": "bf16"}

    def step(self, x, y) -> float:
        loss = self.call(self.cm, x, y)
        loss.backward()
        self.cm.step()
        self.cm.zero_grad()
        return float(loss.detach())

    def after_first_step(self) -> None:
        self.info["window"] = self.cm.program.num_slots
        self.info["stages"] = len(self.cm.stages.stages)

    def close(self) -> None:
        self.cm.close()


class FSDP2Runner(_Runner):
    def __init__(self, kit: Kit, model, arch: str, call: Callable):
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        self.call = call
        self.kit = kit
        backend = "nccl" if kit.cuda else "gloo"
        if kit.cuda:
            torch.cuda.set_device(0)
        self._tmp = tempfile.mkdtemp(prefix="shfx_fsdp2_")
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=f"file://{self._tmp}/store", rank=0, world_size=1)
            self._owns_pg = True
        else:
            self._owns_pg = False
        _checkpoint(model, arch)
        dev_type = "cuda" if kit.cuda else "cpu"
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev_type, (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        self.info = {"backend": backend, "mixed_precision": "param bf16, reduce fp32",
                     "offload": f"CPUOffloadPolicy(pin_memory={kit.cuda})"}

        def shard(offload: bool) -> None:
            kw: dict[str, Any] = {"mesh": mesh, "mp_policy": mp}
            if offload:
                kw["offload_policy"] = CPUOffloadPolicy(pin_memory=kit.cuda)
            for blk in _blocks(model, arch):
                fully_shard(blk, **kw)
            fully_shard(model, **kw)

        try:
            shard(offload=True)
        except Exception as e:  # noqa: BLE001
            if kit.cuda:
                raise
            # emulated: the policy may refuse a CPU mesh; shard without it (a fresh model is not
            # needed: fully_shard failed before it changed the first block, or raise below)
            self.info["offload"] = f"none: CPUOffloadPolicy refused here ({type(e).__name__}: {str(e)[:200]})"
            shard(offload=False)
        # with the policy the sharded parameters stay on the host; FSDP2 copies each block's to the
        # device for its forward and backward, and the gradients back
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        try:
            self.opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
            self.info["optimizer"] = "torch.optim.AdamW(fused=True)"
        except Exception as e:  # noqa: BLE001
            self.opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
            self.info["optimizer"] = f"torch.optim.AdamW (default; fused refused: {type(e).__name__}: {str(e)[:200]})"
        self._fused_checked = False

    def step(self, x, y) -> float:
        loss = self.call(self.model, x, y)
        loss.backward()
        try:
            self.opt.step()
        except Exception as e:  # noqa: BLE001 - fused AdamW may refuse the sharded (DTensor) params
            if self._fused_checked:
                raise
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
            self.info["optimizer"] = f"torch.optim.AdamW (default; fused failed at step: {type(e).__name__}: {str(e)[:200]})"
            self.opt.step()
        self._fused_checked = True
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def close(self) -> None:
        import torch.distributed as dist

        self.opt = self.model = None
        gc.collect()
        if self._owns_pg and dist.is_initialized():
            dist.destroy_process_group()


class TorchAORunner(_Runner):
    def __init__(self, kit: Kit, model, arch: str, call: Callable):
        from torchao.optim import CPUOffloadOptimizer  # ImportError: not carried

        import torchao

        self.call = call
        _checkpoint(model, arch)
        self.model = model.to(kit.torch_device)
        self.opt = CPUOffloadOptimizer(self.model.parameters(), torch.optim.AdamW, offload_gradients=False,
                                       lr=LR, weight_decay=WEIGHT_DECAY, fused=True)  # fmt: skip
        self.dev = kit.torch_device.type
        self.info = {"torchao": getattr(torchao, "__version__", "?"), "weights": "fp32 on the GPU, bf16 autocast",
                     "optimizer": "CPUOffloadOptimizer(torch.optim.AdamW, fused=True, offload_gradients=False)"}  # fmt: skip

    def step(self, x, y) -> float:
        with torch.autocast(self.dev, dtype=torch.bfloat16):
            loss = self.call(self.model, x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return float(loss.detach())

    def close(self) -> None:
        self.opt = self.model = None


class DeepSpeedRunner(_Runner):
    def __init__(self, kit: Kit, model, arch: str, call: Callable, batch: int):
        import deepspeed  # ImportError: not carried

        for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                     "MASTER_ADDR": "127.0.0.1"}.items():  # fmt: skip
            os.environ.setdefault(k, v)
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        deepspeed.init_distributed(dist_backend="nccl" if kit.cuda else "gloo", auto_mpi_discovery=False)
        _checkpoint(model, arch)
        self.call = call
        cfg = {
            "train_batch_size": batch,
            "train_micro_batch_size_per_gpu": batch,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "contiguous_gradients": True,
                "overlap_comm": True,
                "reduce_bucket_size": 2e8,
                "allgather_bucket_size": 2e8,
            },
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "betas": [0.9, 0.999],
                                                      "eps": 1e-8}},  # fmt: skip
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        t0 = time.monotonic()
        self.engine, self.opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        self.info = {"deepspeed": deepspeed.__version__, "config": cfg, "initialize_s": time.monotonic() - t0,
                     "optimizer": type(self.opt).__name__,
                     "inner_optimizer": type(getattr(self.opt, "optimizer", None)).__name__}  # fmt: skip

    def step(self, x, y) -> float:
        loss = self.call(self.engine, x, y)
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.detach())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.destroy()
        self.engine = self.opt = None


def _unavailable(kit: Kit, system: str) -> str | None:
    """Why ``system`` cannot run here, or None."""
    if system in ("torchao", "deepspeed"):
        import importlib.util

        try:
            found = importlib.util.find_spec(system) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"not available here: {system} is not installed; carry its wheel (benchmarks/gpu_wheels.sh)"
        if not (kit.cuda and cuda_ok()):
            what = "CPUOffloadOptimizer supports CUDA and XPU devices only" if system == "torchao" else \
                "ZeRO-Offload is measured on a CUDA device (its CPU accelerator is another code path)"  # fmt: skip
            return f"not available here: no CUDA device ({what})"
    return None


def run_one(kit: Kit, system: str, arch: str) -> dict[str, Any]:
    """A few steps of ``system`` on ``arch``; the measurements or why it could not run."""
    why = _unavailable(kit, system)
    if why is not None:
        return {"status": "unavailable", "reason": why}
    s = model_shapes(kit, arch, "peers")
    model, make_batch, call = build_model(arch, s)
    pc = count_params(model)
    tokens = s["batch"] * s["seq"]
    out: dict[str, Any] = {"status": "ran", "shape": s, **pc, "tokens_per_step": tokens}
    dev = kit.torch_device

    def batch(i: int):
        x, y = make_batch(i)
        return x.to(dev), y.to(dev)

    _cuda_peak_reset(kit)
    t0 = time.monotonic()
    runner: _Runner | None = None
    try:
        if system == "shfx":
            runner = ShfxRunner(kit, model, arch, call)
        elif system == "fsdp2":
            runner = FSDP2Runner(kit, model, arch, call)
        elif system == "torchao":
            runner = TorchAORunner(kit, model, arch, call)
        elif system == "deepspeed":
            runner = DeepSpeedRunner(kit, model, arch, call, s["batch"])
        else:
            raise ValueError(f"unknown system {system!r}")
        del model
        out["setup_s"] = time.monotonic() - t0
        out.update(runner.info)
        warmup = 1 if kit.emulated else 2
        max_steps = 3 if kit.emulated else 8
        times: list[float] = []
        losses: list[float] = []
        step = 0
        for i in range(warmup + max_steps):
            if i >= warmup + 2 and kit.remaining() < (times[-1] * 1.5 + 10 if times else 10):
                out["note"] = f"stopped after {len(times)} measured steps: {kit.remaining():.0f} s left"
                break
            x, y = batch(step)
            with kit.timer() as t:
                losses.append(runner.step(x, y))
            step += 1
            if i == 0:
                out["first_step_s"] = t.seconds
                if hasattr(runner, "after_first_step"):
                    runner.after_first_step()
                    out.update(runner.info)
            if i >= warmup:
                times.append(t.seconds)
        out["steps_s"] = times
        out["losses"] = losses
        out["step_s_median"] = median(times) if times else None
        if times:
            out.update(flops_fields(pc["params"], tokens, median(times)))
        out["gpu_peak_allocated_bytes"] = _cuda_peak(kit)
    except Exception as e:  # noqa: BLE001 - recorded; the others still run
        out["status"] = "failed"
        out["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        out["traceback"] = traceback.format_exc()[-4000:]
        out["gpu_peak_allocated_bytes"] = _cuda_peak(kit)
    finally:
        if runner is not None:
            with contextlib.suppress(Exception):
                runner.close()
        out["host_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out["wall_s"] = time.monotonic() - t0
    return jsonable(out)


# ---- the part ----------------------------------------------------------------------------------


def _run_sub(kit: Kit, system: str, arch: str, limit: float, pythonpath: str | None) -> dict[str, Any]:
    """``run_one`` in a subprocess (GPU runs), killed after ``limit`` seconds."""
    with tempfile.TemporaryDirectory() as d:
        js = Path(d) / "one.json"
        env = dict(os.environ)
        if pythonpath:
            env["PYTHONPATH"] = os.pathsep.join([x for x in (env.get("PYTHONPATH"), pythonpath) if x])
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", system, arch, "--json", str(js),
               "--seconds", str(limit), "--out", str(kit.out)] + (["--emulated"] if kit.emulated else [])  # fmt: skip
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit + 15)
        except subprocess.TimeoutExpired as e:
            tail = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            return {"status": "failed", "error": f"ran past {limit + 15:.0f} s (killed)", "stdout_tail": tail[-2000:]}
        r: dict[str, Any]
        if js.exists():
            r = json.loads(js.read_text())
        else:
            r = {"status": "failed", "error": f"the subprocess exited {p.returncode} without a result"}
        r["subprocess_s"] = time.monotonic() - t0
        if p.returncode != 0 or r.get("status") == "failed":
            r["stderr_tail"] = p.stderr[-3000:]
            r["stdout_tail"] = p.stdout[-1500:]
        return r


def part_peers(kit: Kit) -> dict[str, Any]:
    """Part 9: shfx, FSDP2 + CPU offload, torchao's CPUOffloadOptimizer, DeepSpeed ZeRO-Offload."""
    res: dict[str, Any] = {"flops_note": FLOPS_NOTE, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                           "torch": torch.__version__, "emulated": kit.emulated, "models": {}}  # fmt: skip
    res["wheels"] = install_wheels(kit)
    pythonpath = res["wheels"].get("path")
    import importlib.metadata as md

    res["versions"] = {}
    for mod in ("torchao", "deepspeed", "pydantic", "pydantic-core", "hjson", "ninja", "transformers"):
        try:
            res["versions"][mod] = md.version(mod)
        except md.PackageNotFoundError:
            res["versions"][mod] = None
    if kit.cuda:
        res["gpu"] = torch.cuda.get_device_name(0)
    order = [(a, s) for a in ARCHS for s in SYSTEMS]
    weights = [WEIGHTS[s] + (BUILD_WEIGHT if (a, s) == (ARCHS[0], "deepspeed") else 0.0) for a, s in order]
    path = kit.out / "peers.json"
    for i, (arch, system) in enumerate(order):
        entry = res["models"].setdefault(arch, {})
        why = _unavailable(kit, system)  # the carried wheels are on sys.path here too
        if why is not None:
            entry[system] = {"status": "unavailable", "reason": why}
            continue
        if kit.emulated:
            entry[system] = run_one(kit, system, arch)
        else:
            # its share of what is left (the weights of the runs still to come), at least 45 s
            share = max(45.0, (kit.remaining() - 10) * weights[i] / sum(weights[i:]))
            limit = min(share, kit.remaining() - 10)
            if limit < 30:
                entry[system] = {"status": "skipped", "reason": f"out of time ({kit.remaining():.0f} s left)"}
                continue
            kit.log(f"peers: {system} on {arch}, up to {limit:.0f} s")
            entry[system] = _run_sub(kit, system, arch, limit, pythonpath)
        e = entry[system]
        kit.log(f"peers: {system} {arch}: {e.get('status')} {e.get('step_s_median')} s/step "
                f"{e.get('model_tflops')} TFLOP/s {e.get('error', '')[:200]}")  # fmt: skip
        kit.record("peers", res)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(jsonable(res), indent=1))
    # the table: per model, each system's step time and throughput against shfx's
    table = {}
    for arch, entry in res["models"].items():
        ref = (entry.get("shfx") or {}).get("step_s_median")
        table[arch] = {s: {"status": e.get("status"), "step_s": e.get("step_s_median"), "model_tflops": e.get("model_tflops"),
                           "gpu_peak_gib": (e["gpu_peak_allocated_bytes"] / 2**30) if e.get("gpu_peak_allocated_bytes") else None,
                           "throughput_vs_shfx": (ref / e["step_s_median"]) if ref and e.get("step_s_median") else None}
                       for s, e in entry.items()}  # fmt: skip
    res["table"] = table
    res["summary"] = "; ".join(
        f"{arch}: " + ", ".join(f"{s} {t['step_s']:.2f} s" if t["step_s"] else f"{s} {t['status']}" for s, t in row.items())
        for arch, row in table.items())  # fmt: skip
    out = jsonable(res)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return out


def _main() -> None:
    ap = argparse.ArgumentParser(description="one (system, model) of part 9, for part_peers' subprocesses")
    ap.add_argument("--one", nargs=2, metavar=("SYSTEM", "ARCH"), required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--out", default=str(ROOT / "out"))
    ap.add_argument("--emulated", action="store_true")
    a = ap.parse_args()
    kit = Kit(emulated=a.emulated, out=Path(a.out), deadline=time.monotonic() + a.seconds, part="9")
    system, arch = a.one
    try:
        r = run_one(kit, system, arch)
    except Exception as e:  # noqa: BLE001
        r = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    Path(a.json).write_text(json.dumps(jsonable(r)))


PARTS = {"peers": part_peers}

if __name__ == "__main__":
    _main()
