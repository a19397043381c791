"""Parts 1, 2, 3, 5 and 6 of the GPU kit (``benchmarks/gpu.py``; README "``gpu.py``: the kit for a
lent GPU"): environment and link/matmul speeds, the CUDA tests and equivalence with eager,
residency and traffic against the ledger, the simulator against measured steps, capacity.

Each ``part_<name>(kit)`` returns a JSON-able dict with a one-line ``"summary"``; sub-results go
through ``kit.record`` as soon as they exist, so a later crash or timeout keeps them. Every
CUDA-only call is behind ``kit.emulated`` (the emulated run: the same code on the CPU, tiny sizes).
"""

from __future__ import annotations

import copy
import math
import os
import pathlib
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict

import torch

from gpu_common import (
    GiB,
    MiB,
    Kit,
    ROOT,
    gpt_model,
    hf_llama,
    host_memory,
    jsonable,
    make_eager_optimizer,
    median,
    rss_bytes,
    shfx_step,
    token_batches,
)

import shfx

__all__ = ["part_environment", "part_equivalence", "part_residency", "part_simulator", "part_capacity", "PARTS"]


def _fmt_bps(bps: float | None) -> str:
    return "n/a" if not bps else f"{bps / 1e9:.1f} GB/s"


# ---- part 1: environment ------------------------------------------------------------------------


def _nvidia_smi() -> dict:
    fields = "name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current,clocks.max.sm,power.limit"
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=15)  # fmt: skip
        if r.returncode != 0:
            return {"error": (r.stderr or r.stdout)[-300:]}
        return {"fields": fields, "rows": [line.strip() for line in r.stdout.strip().splitlines()]}
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _copy_bps(kit: Kit, dst: torch.Tensor, src: torch.Tensor, reps: int) -> float:
    """Median bytes/s of ``dst.copy_(src)`` over ``reps`` copies after one warm-up."""
    dst.copy_(src, non_blocking=True)
    kit.sync()
    times = []
    for _ in range(reps):
        with kit.timer(events=True) as t:
            dst.copy_(src, non_blocking=True)
        times.append(t.seconds)
    return src.numel() * src.element_size() / median(times)


def _duplex(kit: Kit, dev_a, host_a, dev_b, host_b) -> dict:
    """Both directions at once on two streams: each direction's bytes/s."""
    if kit.emulated:
        return {"skipped": "emulated"}
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    nbytes = host_a.numel()
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(s1):
            dev_a.copy_(host_a, non_blocking=True)
        with torch.cuda.stream(s2):
            host_b.copy_(dev_b, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"seconds": median(times), "per_direction_bps": nbytes / median(times)}


def _matmul_flops(kit: Kit, n: int, dtype: torch.dtype, iters: int) -> float:
    g = torch.Generator(device=kit.torch_device).manual_seed(0)
    a = torch.randn(n, n, device=kit.torch_device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=kit.torch_device, dtype=dtype, generator=g)
    for _ in range(2):
        a @ b
    kit.sync()
    with kit.timer(events=True) as t:
        for _ in range(iters):
            a @ b
    return 2 * n**3 * iters / t.seconds


def part_environment(kit: Kit) -> dict:
    """GPU, driver, versions, CPUs, RAM; pinned/pageable copy bandwidth; matmul FLOP/s."""
    res: dict = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": None,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "host_memory": host_memory(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        res["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001
        pass
    if not kit.emulated:
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        res["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}", "total_memory": int(props.total_memory),
                      "multiprocessors": props.multi_processor_count, "free_at_start": int(free), "total": int(total),
                      "bf16_supported": bool(torch.cuda.is_bf16_supported())}  # fmt: skip
        res["nvidia_smi"] = _nvidia_smi()
        res["device_count"] = torch.cuda.device_count()
    kit.record("environment", res)
    kit.log(f"{res.get('gpu', {}).get('name', 'emulated')}, torch {res['torch']}, CUDA {res['cuda']}, "
            f"{res['cpu_count']} CPUs, host {res['host_memory'].get('total', 0) / GiB:.0f} GiB")  # fmt: skip

    # copies: 1 GiB pinned (64 MiB emulated), median of several
    nbytes = 64 * MiB if kit.emulated else GiB
    reps = 3 if kit.emulated else 5
    links: dict = {"bytes": nbytes}
    try:
        pin = not kit.emulated
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        host.fill_(1)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=kit.torch_device)
        links["h2d_pinned_bps"] = _copy_bps(kit, dev, host, reps)
        links["d2h_pinned_bps"] = _copy_bps(kit, host, dev, reps)
        pageable = torch.ones(nbytes, dtype=torch.uint8)
        links["h2d_pageable_bps"] = _copy_bps(kit, dev, pageable, max(2, reps - 2))
        links["d2h_pageable_bps"] = _copy_bps(kit, pageable, dev, max(2, reps - 2))
        if not kit.emulated:
            half = nbytes // 2
            host2 = torch.empty(half, dtype=torch.uint8, pin_memory=True)
            dev2 = torch.empty(half, dtype=torch.uint8, device=kit.torch_device)
            d = _duplex(kit, dev[:half], host[:half], dev2, host2)
            links["duplex"] = d
            if links.get("h2d_pinned_bps") and d.get("per_direction_bps"):
                links["duplex_fraction"] = d["per_direction_bps"] / min(links["h2d_pinned_bps"], links["d2h_pinned_bps"])
            del host2, dev2
        del host, dev, pageable
    except Exception as e:  # noqa: BLE001
        links["error"] = f"{type(e).__name__}: {e}"
    kit.record("links", links)
    kit.free_cuda()

    # matmul: bf16 8192^3 (emulated: 256^3 fp32 and bf16 on the CPU)
    mm: dict = {}
    for dtype, n, iters in ((torch.bfloat16, 8192, 20), (torch.float32, 8192, 5)) if not kit.emulated else (
            (torch.bfloat16, 256, 3), (torch.float32, 256, 5)):  # fmt: skip
        if kit.remaining() < (5 if not kit.emulated else 1):
            mm[str(dtype).replace("torch.", "")] = "skipped: no time left"
            continue
        try:
            mm[str(dtype).replace("torch.", "")] = {"n": n, "flops": _matmul_flops(kit, n, dtype, iters)}
        except Exception as e:  # noqa: BLE001
            mm[str(dtype).replace("torch.", "")] = {"n": n, "error": f"{type(e).__name__}: {e}"}
    if not kit.emulated:
        mm["tf32_allowed"] = bool(torch.backends.cuda.matmul.allow_tf32)
    kit.record("matmul", mm)
    kit.free_cuda()
    bf = mm.get("bfloat16", {}).get("flops") if isinstance(mm.get("bfloat16"), dict) else None
    res.update(links=links, matmul=mm)
    res["summary"] = (f"{res.get('gpu', {}).get('name', 'CPU (emulated)')}: H2D pinned {_fmt_bps(links.get('h2d_pinned_bps'))}, "
                      f"D2H pinned {_fmt_bps(links.get('d2h_pinned_bps'))}, H2D pageable {_fmt_bps(links.get('h2d_pageable_bps'))}, "
                      + (f"bf16 matmul {bf / 1e12 if bf else float('nan'):.1f} TFLOP/s" if kit.cuda else
                         f"bf16 matmul {bf / 1e9 if bf else float('nan'):.1f} GFLOP/s (CPU)"))  # fmt: skip
    return res


# ---- part 2: CUDA tests and equivalence -----------------------------------------------------------


def _cuda_test_files() -> list[str]:
    out = []
    for p in sorted((ROOT / "tests").glob("test_*.py")):
        try:
            if "pytest.mark.cuda" in p.read_text():
                out.append(str(p.relative_to(ROOT)))
        except OSError:
            pass
    return out


def _run_pytest(kit: Kit, files: list[str], timeout: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "--maxfail=5", "-rfE", *files]
    # (COLUMNS: pytest's short summary cuts each failure's message to the terminal's width)
    env = dict(os.environ, COLUMNS="400", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])))
    t0 = time.perf_counter()
    # NOTE: in the part's own process group, so the runner's kill of a timed-out part takes
    # pytest (and the GPU memory it holds) with it
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.kill()
        try:
            out, _ = proc.communicate(timeout=10)
        except (subprocess.TimeoutExpired, ValueError):
            out = b""
    text = (out or b"").decode("utf-8", "replace")
    counts: dict = {}
    for line in reversed(text.splitlines()):  # the summary line: "3 passed, 1 skipped in 2.1s"
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", line)
        if found and (" in " in line or line.startswith("=")):
            counts = {k: int(v) for v, k in found}
            break
    if not counts:  # killed before the summary: count the progress characters of -q
        progress = "".join(m.group(2) for m in (re.fullmatch(r"(\S+\.py )?([.FEsxX]+)\s*(\[\s*\d+%\])?", line.strip())
                                                for line in text.splitlines()) if m)  # fmt: skip
        names = {".": "passed", "F": "failed", "E": "errors", "s": "skipped", "x": "xfailed", "X": "xpassed"}
        for ch in progress:
            counts[names[ch]] = counts.get(names[ch], 0) + 1
        if counts:
            counts["incomplete"] = True
    lines = text.splitlines()
    failed_lines = [line[:400] for line in lines if line.startswith(("FAILED", "ERROR"))]
    errors = [line[:300] for line in lines if line.startswith("E ")][:60]  # the failures' assertions
    return {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "timed_out": timed_out, "counts": counts,
            "seconds": round(time.perf_counter() - t0, 1), "failed": failed_lines[:20], "errors": errors,
            "tail": text[-2500:]}  # fmt: skip


def _mixed_eager(make_model, make_batch, loss_fn, steps: int, dtype: torch.dtype, device: torch.device,
                 lr: float, wd: float, host_optimizer: bool = False) -> tuple[list[float], dict]:  # fmt: skip
    """The eager recipe (tests/mixed_reference.py) on ``device``: fp32 masters with fused AdamW,
    a ``dtype`` working copy; fp32 when ``dtype`` is fp32. Returns (losses, master weights).

    ``host_optimizer``: the masters and the fused AdamW on the CPU (gradients copied there in
    fp32, the updated weights copied back): the recipe shfx runs. Without it the update runs
    on ``device`` (CUDA's fused AdamW: other arithmetic than the CPU's, a few fp32 ulps)."""
    torch.manual_seed(0)
    master_model = make_model()
    if not host_optimizer:
        master_model = master_model.to(device)
    work = master_model if (dtype == torch.float32 and not host_optimizer) else copy.deepcopy(master_model).to(device)
    if dtype != torch.float32:
        for p in work.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)
    master = dict(master_model.named_parameters())
    working = dict(work.named_parameters())
    separate = work is not master_model
    opt = make_eager_optimizer(master_model, lr=lr, weight_decay=wd)
    losses = []
    for step in range(steps):
        torch.manual_seed(10_000 + 100 * step)
        loss = loss_fn(work, make_batch(step))
        loss.backward()
        losses.append(float(loss.detach().float()))
        if separate:
            for n, p16 in working.items():
                if p16.grad is not None:
                    master[n].grad = p16.grad.float().to(master[n].device)
                    p16.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        if separate:
            with torch.no_grad():
                for n, p16 in working.items():
                    p16.copy_(master[n])
    return losses, {n: p.detach().float().cpu() for n, p in master.items()}


def _equivalence_one(kit: Kit, arch: str, precision: str, window, steps: int, size: dict) -> dict:
    lr, wd = 1e-3, 0.01
    dev = kit.torch_device
    L, H, heads, S, V, B = size["layers"], size["hidden"], size["heads"], size["seq"], size["vocab"], size["batch"]
    make_batch = token_batches(V, S, B, dev)
    if arch == "gpt":
        def make_model():
            return gpt_model(L, H, heads, S, V)[0]

        def loss_fn(m, batch):
            return m(*batch)
    else:
        def make_model():
            return hf_llama(L, H, heads, S, V)

        def loss_fn(m, batch):
            return m(input_ids=batch[0], labels=batch[1]).loss

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = make_model()
    n_stages = L + 2
    w = n_stages if window == "all" else window
    cm = shfx.compile(model, device=kit.device(), window=w, optimizer=shfx.optim.AdamW(lr=lr, weight_decay=wd),
                      precision=precision)  # fmt: skip
    losses = []
    try:
        for step in range(steps):
            torch.manual_seed(10_000 + 100 * step)
            loss = loss_fn(cm, make_batch(step))
            loss.backward()
            cm.step()
            cm.zero_grad()
            losses.append(float(loss.detach().float()))
        cm.sync()
        got = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    finally:
        cm.close()
    # the reference: eager forward/backward on the device, the update on the host as shfx does
    # it (bitwise expected where the kernels are deterministic); and, for the record, against
    # the update on the device (CUDA's fused AdamW)
    ref_losses, ref = _mixed_eager(make_model, make_batch, loss_fn, steps, dtype, dev, lr, wd,
                                   host_optimizer=not kit.emulated)  # fmt: skip
    dl = max(abs(a - b) for a, b in zip(losses, ref_losses))

    def weight_diff(ref: dict) -> tuple[float, bool]:
        dw, bitwise = 0.0, True
        for n, t in ref.items():
            if not torch.equal(got[n], t):
                bitwise = False
                dw = max(dw, float((got[n] - t).abs().max()))
        return dw, bitwise

    dw, bitwise_w = weight_diff(ref)
    out = {"arch": arch, "precision": precision, "window": window, "stages": n_stages, "steps": steps,
           "reference": "eager on the device, AdamW on the host" if not kit.emulated else "eager",
           "losses": losses, "eager_losses": ref_losses, "max_loss_diff": dl, "max_weight_diff": dw,
           "bitwise_losses": losses == ref_losses, "bitwise_weights": bitwise_w,
           "finite": all(math.isfinite(x) for x in losses)}  # fmt: skip
    if not kit.emulated:
        dev_losses, dev_ref = _mixed_eager(make_model, make_batch, loss_fn, steps, dtype, dev, lr, wd)
        dwd, bwd = weight_diff(dev_ref)
        out["vs_device_adamw"] = {"max_loss_diff": max(abs(a - b) for a, b in zip(losses, dev_losses)),
                                  "max_weight_diff": dwd, "bitwise_weights": bwd}  # fmt: skip
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def part_equivalence(kit: Kit) -> dict:
    """The CUDA tests (pytest -m cuda), then shfx vs the eager recipe for a GPT and a HF Llama."""
    res: dict = {}
    files = _cuda_test_files()
    if kit.emulated:  # the same code path, a cheap selection (they skip without CUDA)
        files = files[:1]
    share = kit.remaining() * (0.25 if kit.emulated else 0.5)
    if files and share > (3 if kit.emulated else 5):
        res["pytest"] = _run_pytest(kit, files, share)
        c = res["pytest"]["counts"]
        kit.log(f"pytest -m cuda: {c} in {res['pytest']['seconds']} s{' (TIMED OUT)' if res['pytest']['timed_out'] else ''}")
    else:
        res["pytest"] = {"skipped": f"{len(files)} files, {share:.0f} s"}
    kit.record("pytest", res["pytest"])

    size = (dict(layers=2, hidden=64, heads=2, seq=16, vocab=64, batch=2) if kit.emulated
            else dict(layers=3, hidden=256, heads=4, seq=128, vocab=512, batch=4))  # fmt: skip
    runs = []
    # first every model, precision and window once (what a short run must not miss), then the rest
    first = [("gpt", "fp32", 2), ("llama", "bf16", 2), ("gpt", "bf16", 1), ("llama", "fp32", 1),
             ("gpt", "fp32", "all"), ("llama", "bf16", "all")]  # fmt: skip
    rest = [(a, p, w) for p in ("fp32", "bf16") for a in ("gpt", "llama") for w in (2, 1, "all") if (a, p, w) not in first]
    order = first[:4] if kit.emulated else first + rest  # emulated: the code paths, in seconds
    per_run = 0.0
    for arch, precision, window in order:
        if kit.remaining() < max(1.0 if kit.emulated else 3.0, 1.5 * per_run + 1.0):
            runs.append({"arch": arch, "precision": precision, "window": window, "skipped": "no time left"})
            continue
        t0 = time.perf_counter()
        try:
            r = _equivalence_one(kit, arch, precision, window, 3, size)
        except Exception as e:  # noqa: BLE001
            r = {"arch": arch, "precision": precision, "window": window, "error": f"{type(e).__name__}: {e}"[:500]}
        per_run = max(per_run, time.perf_counter() - t0)
        runs.append(r)
        kit.record("equivalence", runs)
        kit.log(f"{arch} {precision} W={window}: " + (r.get("error") or
                f"loss diff {r['max_loss_diff']:.2e}, weight diff {r['max_weight_diff']:.2e}, bitwise {r['bitwise_weights']}"))  # fmt: skip
        kit.free_cuda()
    res["equivalence"] = runs
    res["size"] = size
    done = [r for r in runs if "max_loss_diff" in r]
    errors = [r for r in runs if "error" in r]
    tol = {"fp32": 1e-4, "bf16": 5e-2}
    close = [r for r in done if r["max_loss_diff"] <= tol[r["precision"]] and r["finite"]]
    c = res["pytest"].get("counts", {})
    skipped = len(runs) - len(done) - len(errors)
    res["summary"] = (f"pytest -m cuda {c or ('skipped: ' + str(res['pytest'].get('skipped', '?')))}; equivalence "
                      f"{len(close)}/{len(done)} run close ({sum(r['bitwise_weights'] for r in done)} bitwise), "
                      f"{len(errors)} errors, {skipped} not run (time), "
                      f"max fp32 loss diff {max([r['max_loss_diff'] for r in done if r['precision'] == 'fp32'] or [0]):.1e}")  # fmt: skip
    return res


# ---- part 3: residency and traffic --------------------------------------------------------------


def _by_event(changes) -> dict:
    out: dict = defaultdict(list)
    for event, term, what, nbytes in changes:
        out[event].append((term, what, nbytes))
    return out


def _reservations_match(log, led) -> dict:
    """The first step's device reservations against the ledger's replay (tests/test_ledger.py)."""
    runtime = _by_event((e.event, e.term, e.what, e.nbytes) for e in log)
    ledger = _by_event((e.event, c.term, c.what, c.nbytes) for e in led.entries for c in e.changes if c.tier == "device")
    ledger = {k: v for k, v in ledger.items() if v}
    bad = []
    for event in sorted(set(runtime) | set(ledger)):
        a, b = runtime.get(event, []), ledger.get(event, [])
        same = Counter(a) == Counter(b) if event in ("setup", "end") else a == b
        if not same:
            bad.append(event)
    return {"events": len(ledger), "mismatched_events": bad[:20], "equal": not bad}


def part_residency(kit: Kit) -> dict:
    """Device peak (torch allocator) vs the ledger, bytes moved per step vs the program, host
    bytes vs the ledger's host terms, process RSS; for a GPT at W=2 and W=all."""
    if kit.emulated:
        size = dict(layers=3, hidden=64, heads=2, seq=32, vocab=128, batch=2)
    else:
        size = dict(layers=6, hidden=1024, heads=16, seq=512, vocab=8192, batch=4)
    base, make_batch = gpt_model(size["layers"], size["hidden"], size["heads"], size["seq"], size["vocab"],
                                 batch=size["batch"], device=kit.torch_device)  # fmt: skip
    n_stages = size["layers"] + 2
    res: dict = {"size": size, "stages": n_stages, "runs": []}
    for window in (2, n_stages):
        if kit.remaining() < (1.5 if kit.emulated else 5):
            res["runs"].append({"window": window, "skipped": "no time left"})
            continue
        r: dict = {"window": window}
        rss0 = rss_bytes()
        kit.reset_peak()
        cm = shfx.compile(copy.deepcopy(base), device=kit.device(), window=window, optimizer=shfx.optim.AdamW(lr=1e-4))
        try:
            backend = getattr(cm, "backend", None) or cm.engine.backend
            batch = make_batch(0)
            with backend.recording() as log:
                shfx_step(cm, batch)
            led = cm.variant.ledger()
            r["first_step_reservations_vs_ledger"] = _reservations_match(log, led)
            shfx_step(cm, make_batch(1))
            kit.sync()
            kit.reset_peak()
            backend.reset_peak()
            h0, d0 = backend.bytes_h2d, backend.bytes_d2h
            sync0, defer0 = getattr(backend, "host_syncs", 0), getattr(backend, "deferred_launches", 0)
            with kit.timer() as t:
                loss = shfx_step(cm, make_batch(2))
            moved = {"h2d": backend.bytes_h2d - h0, "d2h": backend.bytes_d2h - d0}
            program = cm.program.bytes_moved()
            host_static = led.static("host")
            r.update(
                step_s=t.seconds, loss=loss,
                torch_max_allocated=kit.peak_allocated(),
                backend_peak=backend.peak_bytes, ledger_peak=led.peak(),
                ledger_terms_at_peak=led.terms_at_peak(),
                bytes_moved=moved, program_bytes_moved=program, bytes_equal=moved == dict(program),
                host_bytes=cm.engine.host_bytes(), ledger_host_bytes=sum(host_static.values()), ledger_host_terms=host_static,
                rss_before=rss0, rss_after=rss_bytes(),
                # pinned host bytes (CUDA: page-rounded, cudaHostRegister'ed; the ledger counts exact bytes)
                pinned_bytes=getattr(backend, "pinned_bytes", None),
                # host waits for device work from the issuing thread in one step (forward, backward, step()):
                # step()'s waits only, by construction; launches a host dependency sent to a launcher thread
                host_syncs_per_step=getattr(backend, "host_syncs", 0) - sync0,
                deferred_launches_per_step=getattr(backend, "deferred_launches", 0) - defer0,
            )  # fmt: skip
            r["backend_peak_equals_ledger"] = r["backend_peak"] == r["ledger_peak"]
            r["host_equals_ledger"] = r["host_bytes"] == r["ledger_host_bytes"]
            if r["torch_max_allocated"] is not None and r["ledger_peak"]:
                r["torch_over_ledger"] = r["torch_max_allocated"] / r["ledger_peak"]
            if kit.cuda:
                try:
                    pinned = all(b.is_pinned() for b in cm.engine.store.buffers)
                    r["store_pinned"] = pinned
                except Exception as e:  # noqa: BLE001
                    r["store_pinned"] = f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001
            r["error"] = f"{type(e).__name__}: {e}"[:800]
        finally:
            cm.close()
            del cm
            kit.free_cuda()
        res["runs"].append(r)
        kit.record("runs", res["runs"])
        kit.log(f"W={window}: " + (r.get("error") or f"ledger peak {r['ledger_peak'] / MiB:.1f} MiB, backend "
                f"{r['backend_peak'] / MiB:.1f}, torch {(r['torch_max_allocated'] or 0) / MiB:.1f}; bytes equal {r['bytes_equal']}; "
                f"host {r['host_bytes'] / MiB:.1f} MiB (ledger {r['ledger_host_bytes'] / MiB:.1f})"))  # fmt: skip
    ok = [r for r in res["runs"] if "ledger_peak" in r]
    res["summary"] = "; ".join(
        f"W={r['window']}: torch/ledger peak {r.get('torch_over_ledger', float('nan')):.2f}, backend==ledger {r['backend_peak_equals_ledger']}, "
        f"bytes==program {r['bytes_equal']}, host==ledger {r['host_equals_ledger']}" for r in ok
    ) or "no run finished"  # fmt: skip
    return res


# ---- part 5: simulator vs measured --------------------------------------------------------------


def _costs_dict(costs) -> dict | str:
    """The profiled cost table, JSON-able (stages and links; not the profile's raw samples)."""
    import dataclasses

    try:
        out = {}
        for f in dataclasses.fields(costs):
            if f.name == "extra":
                continue
            v = getattr(costs, f.name)
            if isinstance(v, (list, tuple)):
                v = [dataclasses.asdict(x) if dataclasses.is_dataclass(x) else x for x in v]
            elif dataclasses.is_dataclass(v):
                v = dataclasses.asdict(v)
            out[f.name] = jsonable(v)
        return out
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}; {str(costs)[:2000]}"


def part_simulator(kit: Kit) -> dict:
    """Measured step time at every window W against the simulator's prediction from one profile."""
    from shfx.cost_model.simulate import simulate
    from shfx.profiler import profile_costs

    if kit.emulated:
        size = dict(layers=2, hidden=64, heads=2, seq=32, vocab=128, batch=2)
        warm, steps = 1, 3
    else:
        size = dict(layers=4, hidden=2048, heads=16, seq=1024, vocab=8192, batch=4)
        warm, steps = 2, 4
    base, make_batch = gpt_model(size["layers"], size["hidden"], size["heads"], size["seq"], size["vocab"],
                                 batch=size["batch"], device=kit.torch_device)  # fmt: skip
    n = size["layers"] + 2
    windows = [1, 2, n] + ([] if kit.emulated else [w for w in range(3, n)])
    res: dict = {"size": size, "stages": n, "rows": []}
    batch = make_batch(0)
    costs = None
    per_w = 0.0
    for w in windows:
        if kit.remaining() < max(1.0 if kit.emulated else 3.0, 1.3 * per_w):
            res["rows"].append({"window": w, "skipped": "no time left"})
            continue
        t0 = time.perf_counter()
        row: dict = {"window": w}
        cm = shfx.compile(copy.deepcopy(base), device=kit.device(), window=w, optimizer=shfx.optim.AdamW(lr=1e-4))
        try:
            for _ in range(warm):
                shfx_step(cm, batch)
            if costs is None:
                tp = time.perf_counter()
                costs = profile_costs(cm.engine, cm.variant, list(batch))
                res["profile_seconds"] = round(time.perf_counter() - tp, 2)
                with_summary = getattr(costs, "extra", {}).get("profile") if hasattr(costs, "extra") else None
                res["profile"] = str(with_summary.summary()) if with_summary is not None and hasattr(with_summary, "summary") else None
                res["costs"] = _costs_dict(costs)
            walls = []
            for _ in range(steps):
                with kit.timer() as t:
                    shfx_step(cm, batch)
                walls.append(t.seconds)
            engine_times = list(cm.engine.step_times[-steps:])
            tl = simulate(cm.program, costs)
            row.update(measured_s=median(engine_times), measured_wall_s=median(walls), predicted_s=tl.step_s,
                       steps=steps, engine_times=engine_times)  # fmt: skip
            row["ratio"] = row["measured_s"] / tl.step_s if tl.step_s else None
            row["predicted_peak_device"] = getattr(tl, "peak_device_bytes", None)
            row["backend_peak"] = cm.backend.peak_bytes
            for attr in ("bottleneck", "by_resource", "busy_s"):
                if hasattr(tl, attr):
                    row[attr] = jsonable(getattr(tl, attr))
            if w == 2:
                try:
                    res["report_w2"] = str(cm.report())[-3000:]
                except Exception as e:  # noqa: BLE001
                    res["report_w2"] = f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:800]
        finally:
            cm.close()
            del cm
            kit.free_cuda()
        per_w = max(per_w, time.perf_counter() - t0)
        res["rows"].append(row)
        kit.record("rows", res["rows"])
        kit.log(f"W={w}: " + (row.get("error") or f"measured {row['measured_s'] * 1e3:.1f} ms, predicted "
                f"{row['predicted_s'] * 1e3:.1f} ms, ratio {row['ratio']:.2f}"))  # fmt: skip
    ok = sorted((r for r in res["rows"] if r.get("ratio")), key=lambda r: r["window"])
    res["summary"] = "measured/predicted " + ", ".join(f"W{r['window']} {r['ratio']:.2f}" for r in ok) if ok else "no W measured"
    return res


# ---- part 6: capacity ---------------------------------------------------------------------------


def _previous_results(kit: Kit) -> dict:
    try:
        import json

        return json.loads((kit.out / "gpu_results.json").read_text()).get("parts", {})
    except Exception:  # noqa: BLE001
        return {}


def part_capacity(kit: Kit) -> dict:
    """The planner's largest GPT for this device and host, then a model of the largest size that
    fits the time and ~70% of free host RAM, trained 3 steps: peak device memory, host bytes,
    step time, losses finite."""
    from shfx.cost_model.planner import Target, largest_trainable
    from shfx.models import GPTShape

    hm = host_memory()
    avail = hm.get("available") or 8 * GiB
    res: dict = {"host_memory": hm}
    if kit.emulated:
        dev = kit.device("24MiB")
        device_bytes = dev.memory_bytes
        family = GPTShape(layers=1, hidden=64, heads=2, seq=32, vocab=128, batch=2, precision="float32")
        host_cap = 3 * MiB  # a tiny "host": a few layers, the run stays seconds
        res["device"] = str(dev)
    else:
        free, total = torch.cuda.mem_get_info()
        device_bytes = int(free)
        family = GPTShape(layers=1, hidden=2048, heads=16, seq=1024, vocab=32000, batch=4, precision="bfloat16")
        # the time and RAM the kit can spend on it: ~16-18 bytes of host per parameter (fp32 master,
        # gradient, m, v), the CPU init, pinning the store and 3 steps of a host AdamW within the
        # part's share: at most 12 GiB (~0.7 B parameters), less when less time is left
        host_cap = int(min(0.7 * avail, 12 * GiB, max(1 * GiB, (kit.remaining() - 10) * 0.35 * GiB)))
        res["device"] = {"free": int(free), "total": int(total)}
    policy = "stronghold"
    # 1) this machine: the whole free device memory and host RAM
    full = largest_trainable(policy, family, Target("this machine", device_bytes, int(avail), emulated=kit.emulated), window=2)
    res["largest_for_this_machine"] = full.to_dict()
    kit.record("largest_for_this_machine", res["largest_for_this_machine"])
    kit.log(f"planner: largest {family.hidden}-wide GPT for this machine: {full.layers} layers, {full.params / 1e9:.2f} B params "
            f"(limited by {full.binding})")  # fmt: skip
    # the built-in profile of this card, if there is one, for comparison (its RAM is the profile's)
    try:
        from shfx.cost_model.hardware import PROFILES

        gpu_name = "" if kit.emulated else torch.cuda.get_device_properties(0).name
        prof = next((n for n in PROFILES if n.split("-")[0] and n.split("-")[0] in gpu_name), None)
        if prof is not None:
            res["largest_for_profile"] = {"profile": prof, **largest_trainable(policy, family, prof, window=2).to_dict()}
    except Exception as e:  # noqa: BLE001
        res["largest_for_profile"] = f"{type(e).__name__}: {e}"
    # 2) what the kit builds: within host_cap
    target = Target("kit", device_bytes, int(min(host_cap, avail)), emulated=kit.emulated)
    row = largest_trainable(policy, family, target, window=2)
    if row.layers < full.layers:
        kit.note(f"scaled down from {full.layers} to {row.layers} layers: host budget {target.host_bytes / GiB:.2f} GiB "
                 f"(70% of free host RAM and the time a part has)")  # fmt: skip
    res["built"] = row.to_dict()
    kit.record("built", res["built"])
    if row.layers < 1:
        res["summary"] = f"planner: not even one layer fits the kit's budget ({row.binding})"
        return res
    L = row.layers
    t0 = time.perf_counter()
    model, make_batch = gpt_model(L, family.hidden, family.heads, family.seq, family.vocab, batch=family.batch,
                                  device=kit.torch_device)  # fmt: skip
    res["build_seconds"] = round(time.perf_counter() - t0, 2)
    kit.log(f"built {L} layers ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params) in {res['build_seconds']} s")
    kit.reset_peak()
    precision = "bf16" if family.precision == "bfloat16" else "fp32"
    device = kit.device(device_bytes) if kit.emulated else kit.device()
    cm = shfx.compile(model, device=device, window=2, optimizer=shfx.optim.AdamW(lr=1e-4), precision=precision,
                      pin_memory=kit.cuda)  # fmt: skip
    losses, times = [], []
    try:
        for step in range(3):
            if kit.remaining() < 2 * (max(times) if times else 1.0):
                kit.note(f"stopped after {step} steps: no time left")
                break
            with kit.timer() as t:
                losses.append(shfx_step(cm, make_batch(step)))
            times.append(t.seconds)
            kit.record("losses", losses)
        led = cm.variant.ledger()
        res.update(
            layers=L, params=sum(p.numel() for p in model.parameters()), losses=losses, step_s=times,
            losses_finite=all(math.isfinite(x) for x in losses) and bool(losses),
            torch_max_allocated=kit.peak_allocated(), backend_peak=cm.backend.peak_bytes, ledger_peak=led.peak(),
            planner_device_total=row.breakdown.device_total, planner_host_total=row.breakdown.host_total,
            host_bytes=cm.engine.host_bytes(), rss=rss_bytes(),
        )  # fmt: skip
    finally:
        cm.close()
    res["summary"] = (f"largest here: {full.layers} x {family.hidden} ({full.params / 1e9:.2f} B params, {full.binding}); "
                      f"trained {L} layers ({res.get('params', 0) / 1e6:.0f} M) {len(losses)} steps, "
                      f"median {median(times) if times else float('nan'):.2f} s, finite {res.get('losses_finite')}, "
                      f"host {res.get('host_bytes', 0) / GiB:.2f} GiB (planner {row.breakdown.host_total / GiB:.2f})")  # fmt: skip
    return res


PARTS = {1: part_environment, 2: part_equivalence, 3: part_residency, 5: part_simulator, 6: part_capacity}

if __name__ == "__main__":  # one part by hand: python benchmarks/gpu_parts_core.py 3 [--emulated]
    import tempfile

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    emu = "--emulated" in sys.argv or not torch.cuda.is_available()
    k = Kit(emulated=emu, out=pathlib.Path(tempfile.mkdtemp()), deadline=time.monotonic() + 120, part=str(n))
    print(jsonable(PARTS[n](k)).get("summary"))
