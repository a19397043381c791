"""SSD store throughput against the raw throughput of the same disk.

What it measures, in one directory (``--dir``, default the system's temporary directory) on one
disk, with files of ``--size`` bytes (192 MiB by default; deleted after each measurement):

1. **raw, dd-style**: sequential O_DIRECT writes and reads of one file in large blocks (``--raw-block``,
   64 MiB), (a) with ``dd`` (``oflag=direct`` / ``iflag=direct``, ``conv=fsync``; its own reported
   time) and (b) from Python with ``os.pwritev``/``os.preadv`` on one thread from a page-aligned
   buffer (what the store's direct path does, without the store). Not fio: fio is not installed here.
2. **the store** (:class:`shfx.runtime.ssd.SSDStore`), writing then reading ``--extents`` extents
   (the m/v of a few groups) that together hold ``--size`` bytes, all requests in flight at once
   (the engine issues a window of groups ahead), for every chunk size ``--bounce`` x ``--workers``
   per direction x mode:

   * ``direct, aligned``: O_DIRECT, page-aligned tensors (chunks go straight to/from them; what
     pinned CUDA host buffers give);
   * ``direct, bounce``: O_DIRECT, tensors at torch's 64-byte alignment (every chunk copied through
     the bounce pool; what pageable CPU tensors give);
   * ``buffered``: through the page cache. Its *write* is timed until ``wait()`` returns, which is
     when the bytes are in the page cache, not on the disk (the store does not fsync: it is
     scratch), so it is also given with the ``fsync`` that puts them on the disk; its *read* is
     timed after the file's pages were dropped from the page cache (fsync, then
     ``posix_fadvise(DONTNEED)`` on the file: no root needed) and, once, with the pages still
     cached, to show the difference.
3. **caio** (``pip install caio``, optional: skipped if absent), the maintained Python binding of
   Linux AIO (``linux_aio``, libaio-style ``io_submit``) and io_uring (``linux_uring``): the same
   bytes, buffered, in 8 MiB operations, ``--caio-depth`` in flight. caio reads into buffers it
   allocates (``bytes``) and writes only from ``bytes``, so a copy each way between the tensor and
   caio's buffer is included (as the store would have to); its buffers are not aligned, so O_DIRECT
   is tried and reported.
4. **the emulated SSD**: the store throttled to two rates below the disk's (``--emulated``),
   measured throughput against the rate (it must be at or just under it).

Every number is the best of ``--reps`` repetitions (3; the store's in rounds over every
configuration, so a burst of load from other processes hits them alike); the disk and the CPUs
are shared, so the load average is recorded. Results: ``benchmarks/results/nvme.json`` (``--out``).

    python benchmarks/nvme.py                        # ~2-3 minutes on the 2-core VM
    python benchmarks/nvme.py --dir /mnt/nvme --size 1GiB --reps 3
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from shfx.passes.units import format_bytes, parse_bandwidth, parse_bytes
from shfx.runtime.ssd import SSDStore

MiB = 1 << 20


# ------------------------------------------------------------------------- helpers

def _aligned(nbytes: int) -> torch.Tensor:
    return torch.frombuffer(mmap.mmap(-1, -(-nbytes // 4096) * 4096), dtype=torch.uint8)[:nbytes]


def _unaligned(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8)
    if t.data_ptr() % 4096 == 0:  # make sure this is the bounce case
        t = torch.empty(nbytes + 64, dtype=torch.uint8)[64:]
    return t


def _drop_cache(path: str) -> None:
    """Put the file's dirty pages on the disk and drop its pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _filesystem(directory: str) -> dict:
    out = {"dir": directory}
    try:
        df = subprocess.run(["df", "-T", directory], capture_output=True, text=True, timeout=10).stdout.splitlines()[-1].split()
        out.update(device=df[0], fstype=df[1])
        dev = os.path.basename(df[0])
        for name in ("rotational", "logical_block_size"):
            p = f"/sys/block/{dev}/queue/{name}"
            if os.path.exists(p):
                out[name] = open(p).read().strip()
    except (OSError, IndexError, subprocess.SubprocessError):
        pass
    out["free_bytes"] = shutil.disk_usage(directory).free
    return out


# ------------------------------------------------------------------------- 1. raw

def raw_dd(directory: str, size: int, block: int, reps: int) -> dict | None:
    if shutil.which("dd") is None:
        return None
    path = os.path.join(directory, "shfx-bench-dd.bin")
    count = max(1, size // block)
    res = {"tool": f"dd bs={block // MiB}M count={count} oflag=direct conv=fsync / iflag=direct", "write": [], "read": []}
    try:
        for _ in range(reps):
            for kind, cmd in (
                ("write", ["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}", "oflag=direct", "conv=fsync"]),
                ("read", ["dd", f"if={path}", "of=/dev/null", f"bs={block}", "iflag=direct"]),
            ):
                t0 = time.perf_counter()
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                wall = time.perf_counter() - t0
                if out.returncode != 0:
                    res["error"] = out.stderr.strip().splitlines()[-1]
                    return res
                m = re.search(r"copied, ([0-9.]+) s", out.stderr)
                res[kind].append(_gbps(count * block, float(m.group(1)) if m else wall))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return res


def raw_python(directory: str, size: int, block: int, reps: int) -> dict:
    path = os.path.join(directory, "shfx-bench-raw.bin")
    buf = mmap.mmap(-1, block)
    buf.write(os.urandom(MiB) * (block // MiB))
    res = {"tool": f"os.pwritev/os.preadv, O_DIRECT, {block // MiB} MiB blocks, one thread", "write": [], "read": []}
    try:
        for _ in range(reps):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
                t0 = time.perf_counter()
                for off in range(0, size, block):
                    os.pwritev(fd, [buf], off)
                os.fsync(fd)
                res["write"].append(_gbps(size, time.perf_counter() - t0))
                t0 = time.perf_counter()
                for off in range(0, size, block):
                    os.preadv(fd, [buf], off)
                res["read"].append(_gbps(size, time.perf_counter() - t0))
            finally:
                os.close(fd)
                os.unlink(path)
    except OSError as e:
        res["error"] = f"{type(e).__name__}: {e}"
    return res


# ------------------------------------------------------------------------- 2. the store

def _extents(size: int, n: int) -> dict:
    per = size // n
    return {(("m", "v")[i % 2], i // 2): per for i in range(n)}


def store_run(directory: str, size: int, n_extents: int, mode: str, chunk: int, workers: int, reps: int, cached_read: bool = False) -> dict:
    extents = _extents(size, n_extents)
    direct = mode.startswith("direct")
    make = _aligned if mode == "direct, aligned" else _unaligned
    tensors = {k: make(n) for k, n in extents.items()}
    for t in tensors.values():
        t.fill_(7)
    total = sum(extents.values())
    res = {"mode": mode, "chunk_bytes": chunk, "workers": workers, "write": [], "read": []}
    if not direct:
        res["write_fsync"] = []
        if cached_read:
            res["read_cached"] = []
    for _ in range(reps):
        with SSDStore(directory, extents, direct=direct, workers=workers, bounce_buffers=max(2, workers), bounce_bytes=chunk) as store:
            if store.direct != direct:
                res["error"] = f"O_DIRECT refused in {directory}"
                return res
            t0 = time.perf_counter()
            for r in [store.write_from(k, t) for k, t in tensors.items()]:
                r.wait()
            res["write"].append(_gbps(total, time.perf_counter() - t0))
            if not direct:
                _fsync(store.file_path)
                res["write_fsync"].append(_gbps(total, time.perf_counter() - t0))
                if cached_read:
                    t0 = time.perf_counter()
                    for r in [store.read_into(k, t) for k, t in tensors.items()]:
                        r.wait()
                    res["read_cached"].append(_gbps(total, time.perf_counter() - t0))
                _drop_cache(store.file_path)
            t0 = time.perf_counter()
            for r in [store.read_into(k, t) for k, t in tensors.items()]:
                r.wait()
            res["read"].append(_gbps(total, time.perf_counter() - t0))
            assert store.bytes_read == (2 if cached_read and not direct else 1) * total and store.bytes_written == total
            res["bounce_bytes_allocated"] = store.bounce_allocated_bytes
    return res


# ------------------------------------------------------------------------- 3. caio

def caio_run(directory: str, size: int, backend: str, depth: int, chunk: int, reps: int, direct: bool = False) -> dict:
    import caio  # noqa: F401  (optional)

    mod = __import__(f"caio.{backend}", fromlist=["Context", "Operation"])
    path = os.path.join(directory, f"shfx-bench-caio-{backend}.bin")
    src = torch.full((size,), 7, dtype=torch.uint8)
    dst = torch.empty(size, dtype=torch.uint8)
    dst_np = dst.numpy()
    res = {"backend": backend, "depth": depth, "chunk_bytes": chunk, "direct": direct, "write": [], "read": []}

    def run(make_op, on_done) -> None:
        ctx = mod.Context(depth)
        offsets = list(range(0, size, chunk))
        inflight = {}
        deadline = time.perf_counter() + 120
        while offsets or inflight:
            while offsets and len(inflight) < depth:
                off = offsets.pop(0)
                op = make_op(off)
                op.set_callback(lambda result, off=off: inflight.pop(off) and on_done(off, result))
                inflight[off] = op
                ctx.submit(op)
            if hasattr(ctx, "flush"):
                ctx.flush()
            if backend == "linux_aio":
                ctx.process_events(max_requests=depth, min_requests=1, timeout=1)
            else:
                try:
                    ctx.poll()
                except BlockingIOError:
                    pass
                if not ctx.process_events():
                    time.sleep(0.0001)
            if time.perf_counter() > deadline:
                raise TimeoutError(f"caio {backend} did not complete in 120 s")

    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)
    ops = {}
    try:
        os.posix_fallocate(fd, 0, size)
        for _ in range(reps):
            results = []

            def write_op(off):
                payload = src[off : off + chunk].numpy().tobytes()  # caio writes only from bytes: one copy
                return mod.Operation.write(payload, fd, off)

            t0 = time.perf_counter()
            run(write_op, lambda off, r: results.append(r))
            if any(r < 0 for r in results if isinstance(r, int)):
                raise OSError(-min(results), os.strerror(-min(results)))
            os.fsync(fd)
            res["write"].append(_gbps(size, time.perf_counter() - t0))
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

            def read_op(off):
                op = mod.Operation.read(chunk, fd, off)
                ops[off] = op
                return op

            def read_done(off, result):
                if isinstance(result, int) and result < 0:
                    raise OSError(-result, os.strerror(-result))
                data = ops.pop(off).get_value()  # caio's own buffer: copy it into the tensor
                dst_np[off : off + len(data)] = np.frombuffer(data, dtype=np.uint8)

            t0 = time.perf_counter()
            run(read_op, read_done)
            res["read"].append(_gbps(size, time.perf_counter() - t0))
        if not torch.equal(src, dst):
            res["error"] = "read back differs from what was written"
    except Exception as e:  # noqa: BLE001 (reported, not fatal: an optional backend)
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        os.close(fd)
        os.unlink(path)
    return res


# ------------------------------------------------------------------------- 4. emulated

def emulated_run(directory: str, size: int, n_extents: int, bps: float) -> dict:
    extents = _extents(size, n_extents)
    total = sum(extents.values())
    tensors = {k: _unaligned(n) for k, n in extents.items()}
    res = {"rate_bps": bps}
    with SSDStore.emulated(extents, read_bps=bps, write_bps=bps, dir=directory) as store:
        t0 = time.perf_counter()
        for r in [store.write_from(k, t) for k, t in tensors.items()]:
            r.wait()
        res["write_bps"] = total / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for r in [store.read_into(k, t) for k, t in tensors.items()]:
            r.wait()
        res["read_bps"] = total / (time.perf_counter() - t0)
    res["write_over_rate"] = res["write_bps"] / bps
    res["read_over_rate"] = res["read_bps"] / bps
    return res


# ------------------------------------------------------------------------- main

# ---- the tier in training (--tier) ---------------------------------------------------------------

_TIER_CHILD = r"""
import json, resource, sys, time, torch, shfx
from shfx.models import GPT, GPTShape
cfg = json.loads(sys.argv[1])
torch.manual_seed(0)
model = GPT(GPTShape(vocab=256, seq=32, layers=cfg["layers"], heads=8, hidden=cfg["hidden"], dropout=0.0))
off = None
if cfg["nvme"]:
    off = shfx.Offload(optimizer="nvme", path=cfg["dir"], host_window=cfg["host_window"],
                       nvme_read=cfg["rate"], nvme_write=cfg["rate"])
cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="4GiB", h2d=None, d2h=None), policy=shfx.Stronghold(window=2),
                  optimizer=shfx.optim.AdamW(lr=1e-3), offload=off, recompute="full", rollback=cfg.get("rollback", False))
g = torch.Generator().manual_seed(1)
times = []
for step in range(cfg["steps"]):
    x = torch.randint(0, 256, (2, 32), generator=g); y = torch.randint(0, 256, (2, 32), generator=g)
    t0 = time.perf_counter()
    cm(x, y).backward(); cm.step(); cm.zero_grad()
    times.append(time.perf_counter() - t0)
eng = cm._engine
states = sum(grp.state_bytes * 2 for grp in cm._store.groups if grp.trainable_bytes)
out = {"step_s": times, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
       "host_bytes": eng.host_bytes(), "store_host_bytes": cm._store.host_bytes, "states_bytes": states,
       "window_bytes": eng.ssd.host_bytes if eng.ssd is not None else 0,
       "journal_bytes": eng.journal.host_bytes,
       "ssd_file_bytes": sum(e.padded_bytes for e in eng.ssd.ssd.extents.values()) if eng.ssd is not None else 0,
       "groups": sum(1 for grp in cm._store.groups if grp.trainable_bytes),
       "ssd": {k: v for k, v in cm.variant.train.bytes_moved().items() if k.startswith("ssd")}}
cm.close()
print("RESULT " + json.dumps(out))
"""


def _tier_child(cfg: dict) -> dict:
    import subprocess

    # NOTE: OMP_WAIT_POLICY=passive: with libgomp's default (idle workers spin) the host-only run's
    # optimizer-pool team spins on the 2 cores the compute needs (its steps measured 3.4 s against
    # 0.43 s passive), while the tier's extra I/O threads push libgomp into passive waits: the
    # comparison would measure the spin policy, not the tier
    env = dict(os.environ, OMP_WAIT_POLICY="passive", PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _TIER_CHILD, json.dumps(cfg)], capture_output=True, text=True, env=env, check=False)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the measurement failed: {r.stderr[-2000:]}")
    return json.loads(line[7:])


def tier(argv: list[str]) -> dict:
    """``--tier``: the NVMe tier in training, each run in a fresh process (its peak RSS is its own):
    (``--tier --params``: the parameter tier, :mod:`benchmarks.param_tier`, with its arguments;
    ``--tier --activations``: activation offload, :mod:`benchmarks.activation_offload`)
    a GPT trained host-only, and with its AdamW states on the SSD store (host window 1) unthrottled
    and on the emulated SSD at the given rates; peak RSS and median step time of each."""
    if "--activations" in argv:  # activation offload (boundary activations in host RAM): its own script
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import activation_offload

        return activation_offload.main([a for a in argv if a not in ("--tier", "--activations")])
    if "--params" in argv:  # the parameter tier (params, gradients and states on the SSD): its own script
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import param_tier

        return param_tier.main([a for a in argv if a not in ("--tier", "--params")])
    p = argparse.ArgumentParser(description="the NVMe tier in training: host RSS and step time")
    p.add_argument("--tier", action="store_true")
    p.add_argument("--dir", default=None)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rates", default="1GB/s,300MB/s")
    p.add_argument("--predict-rates", default="50MB/s,20MB/s", help="emulated SSD rates of the predicted-vs-measured runs")
    p.add_argument("--rollback", action="store_true",
                   help="also each run with rollback=True (the journal's copies; with the tier: two SSD versions of the states)")
    p.add_argument("--out", default=None, help="default results/nvme_tier.json (--rollback: nvme_rollback.json)")
    args = p.parse_args(argv)
    args.out = args.out or os.path.join(os.path.dirname(__file__), "results", "nvme_rollback.json" if args.rollback else "nvme_tier.json")
    work = tempfile.mkdtemp(prefix="shfx-nvme-tier-", dir=args.dir)
    base = {"layers": args.layers, "hidden": args.hidden, "steps": args.steps, "dir": work, "host_window": 1, "rate": None}
    runs = [("host RAM", {**base, "nvme": False}), ("NVMe, unthrottled", {**base, "nvme": True})]
    runs += [(f"NVMe, emulated {r}", {**base, "nvme": True, "rate": r}) for r in args.rates.split(",") if r]
    if args.rollback:  # each run beside the same with rollback=True, alternated
        runs = [x for name, cfg in runs for x in ((name, cfg), (f"{name}, rollback", {**cfg, "rollback": True}))]
    out: dict = {"config": base, "load_before": os.getloadavg(), "runs": []}
    try:
        for name, cfg in runs:
            r = _tier_child(cfg)
            r["name"] = name
            out["runs"].append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["load_after"] = os.getloadavg()
    host = out["runs"][0]
    med = lambda xs: sorted(xs[1:])[len(xs[1:]) // 2]  # noqa: E731 - steps after the first
    print(f"# GPT {args.layers} layers x {args.hidden} hidden, {host['groups']} host-updated groups, AdamW states "
          f"{format_bytes(host['states_bytes'])}; SSD per step: {out['runs'][1]['ssd']}\n")
    print("| run | peak RSS | RSS vs host RAM | states in RAM (window) | rollback copies (RAM) | SSD file | median step | vs host RAM |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in out["runs"]:
        print(f"| {r['name']} | {format_bytes(r['peak_rss_bytes'])} | {format_bytes(r['peak_rss_bytes'] - host['peak_rss_bytes'])} "
              f"| {format_bytes(r['window_bytes'] or r['states_bytes'])} | {format_bytes(r['journal_bytes'])} "
              f"| {format_bytes(r['ssd_file_bytes'])} | {med(r['step_s']) * 1e3:.0f} ms | {med(r['step_s']) / med(host['step_s']):.2f}x |")
    if args.rollback:  # (the predicted-vs-measured runs are --tier's)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"\nload average before/after: {out['load_before'][0]:.1f} / {out['load_after'][0]:.1f}; wrote {args.out}")
        return out
    out["predicted"] = []
    print("\n## predicted (the simulator, with the emulated SSD's rates) vs measured step time, GPT 6 x 256, W=2, H=2\n")
    print("| SSD rate | SSD bytes per step (r / w) | predicted | measured (median) | measured / predicted |\n| --- | --- | --- | --- | --- |")
    for rate in args.predict_rates.split(","):
        r = _predicted_vs_measured(rate)
        out["predicted"].append(r)
        print(f"| {rate} | {format_bytes(r['ssd_read'])} / {format_bytes(r['ssd_write'])} | {r['predicted_s'] * 1e3:.0f} ms | "
              f"{r['measured_s'] * 1e3:.0f} ms | {r['measured_s'] / r['predicted_s']:.3f} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"\nload average before/after: {out['load_before'][0]:.1f} / {out['load_after'][0]:.1f}; wrote {args.out}")
    return out


def _predicted_vs_measured(rate: str, steps: int = 7) -> dict:
    """The tuner's predicted step time (profiled compute, the emulated SSD's rates) against the
    median measured step (after the first) of a GPT whose step is SSD-bound at ``rate``."""
    import shfx
    from shfx.models import GPT, GPTShape

    torch.manual_seed(0)
    model = GPT(GPTShape(vocab=256, seq=32, layers=6, heads=8, hidden=256, dropout=0.0))
    work = tempfile.mkdtemp(prefix="shfx-nvme-predict-")
    try:
        cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="1GiB"), optimizer=shfx.optim.AdamW(),
                          policy=shfx.Stronghold(window=2),
                          offload=shfx.Offload(optimizer="nvme", path=work, nvme_read=rate, nvme_write=rate, host_window=2))  # fmt: skip
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x, y = torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g)
            cm(x, y).backward()
            cm.step()
            cm.zero_grad()
        t = cm.report().tune
        times = sorted(cm.engine.step_times[1:] if hasattr(cm, "engine") else cm._engine.step_times[1:])
        moved = cm.variant.train.bytes_moved()
        cm.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"rate": rate, "predicted_s": t.row(t.window, t.resident_first).step_s, "measured_s": times[len(times) // 2],
            "ssd_read": moved["ssd_read"], "ssd_write": moved["ssd_write"]}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if "--tier" in argv:
        return tier(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: the system's temporary directory)")
    p.add_argument("--size", default="192MiB", help="bytes written and read per measurement")
    p.add_argument("--extents", type=int, default=8, help="extents the store's bytes are split into (m/v of size/2 groups)")
    p.add_argument("--bounce", default="1MiB,8MiB,32MiB", help="chunk (bounce buffer) sizes")
    p.add_argument("--workers", default="1,2,4", help="threads per direction")
    p.add_argument("--modes", default="direct, aligned;direct, bounce;buffered", help="';'-separated store modes")
    p.add_argument("--raw-block", default="64MiB")
    p.add_argument("--caio-depth", type=int, default=8)
    p.add_argument("--emulated", default="50MB/s,150MB/s", help="emulated SSD rates (below the disk's)")
    p.add_argument("--emulated-size", default="32MiB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "nvme.json"))
    args = p.parse_args(argv)

    size = parse_bytes(args.size, what="--size", positive=True)
    work = tempfile.mkdtemp(prefix="shfx-nvme-bench-", dir=args.dir)
    t_start = time.perf_counter()
    out: dict = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "filesystem": _filesystem(work),
            "mem_available_bytes": _meminfo("MemAvailable"),
        },
        "size_bytes": size,
        "load_before": os.getloadavg(),
    }
    print(f"# SSD store benchmark in {work} ({out['machine']['filesystem'].get('fstype', '?')} on "
          f"{out['machine']['filesystem'].get('device', '?')}), {format_bytes(size)} per measurement, best of {args.reps}")
    try:
        block = parse_bytes(args.raw_block, what="--raw-block", positive=True)
        out["raw"] = [r for r in (raw_dd(work, size, block, args.reps), raw_python(work, size, block, args.reps)) if r]
        print("\n## raw sequential throughput of the disk (GB/s)\n")
        print(f"| tool | write | read |\n| --- | --- | --- |")
        for r in out["raw"]:
            print(f"| {r['tool']} | {_best(r['write'])} | {_best(r['read'])} |" + (f" {r['error']}" if "error" in r else ""))

        out["store"] = []
        print("\n## SSDStore (GB/s; buffered write: until wait() / with fsync; buffered read: page cache dropped)\n")
        print("| mode | chunk | workers | write | read | bounce allocated |\n| --- | --- | --- | --- | --- | --- |")
        configs = [
            (mode, parse_bytes(c, what="--bounce", positive=True), int(w))
            for mode in args.modes.split(";") for c in args.bounce.split(",") for w in args.workers.split(",")
        ]
        rows: dict = {}
        for rep in range(args.reps):  # rounds over every configuration, so a burst of load hits them alike
            for i, (mode, chunk, w) in enumerate(configs):
                cached = rep == 0 and mode == "buffered" and all(m != "buffered" for m, _, _ in configs[:i])
                r = store_run(work, size, args.extents, mode, chunk, w, 1, cached_read=cached)
                if i not in rows:
                    rows[i] = r
                else:
                    for key in ("write", "read", "write_fsync"):
                        if key in r:
                            rows[i][key] += r[key]
        for i in range(len(configs)):
            r = rows[i]
            out["store"].append(r)
            write = _best(r["write"]) + (f" / {_best(r['write_fsync'])}" if "write_fsync" in r else "")
            read = _best(r["read"]) + (f" (cached: {_best(r['read_cached'])})" if "read_cached" in r else "")
            print(f"| {r['mode']} | {format_bytes(r['chunk_bytes'])} | {r['workers']} | {write} | {read} | "
                  f"{format_bytes(r.get('bounce_bytes_allocated', 0))} |" + (f" {r['error']}" if "error" in r else ""))

        out["caio"] = []
        try:
            import caio

            out["caio_version"] = getattr(caio, "__version__", "?")
        except ImportError:
            print("\n(caio not installed: pip install caio to compare Linux AIO / io_uring)")
        else:
            print(f"\n## caio {out['caio_version']} (GB/s; buffered, 8 MiB ops, depth {args.caio_depth}, copies included)\n")
            print("| backend | O_DIRECT | write (fsync) | read |\n| --- | --- | --- | --- |")
            for backend in ("linux_aio", "linux_uring"):
                for direct in (False, True):
                    r = caio_run(work, size, backend, args.caio_depth, 8 * MiB, args.reps if not direct else 1, direct=direct)
                    out["caio"].append(r)
                    print(f"| {backend} | {direct} | {_best(r['write'])} | {_best(r['read'])} |" + (f" {r['error']}" if "error" in r else ""))

        out["emulated"] = []
        print("\n## emulated SSD (SSDStore.emulated): measured vs the rate\n")
        print("| rate | write | read | write / rate | read / rate |\n| --- | --- | --- | --- | --- |")
        esize = parse_bytes(args.emulated_size, what="--emulated-size", positive=True)
        for rate_s in args.emulated.split(","):
            bps = parse_bandwidth(rate_s)
            r = emulated_run(work, esize, args.extents, bps)
            out["emulated"].append(r)
            print(f"| {rate_s} | {r['write_bps'] / 1e6:.1f} MB/s | {r['read_bps'] / 1e6:.1f} MB/s | {r['write_over_rate']:.3f} | {r['read_over_rate']:.3f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["load_after"] = os.getloadavg()
    out["seconds"] = time.perf_counter() - t_start
    _summary(out)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"\nload average before/after: {out['load_before'][0]:.1f} / {out['load_after'][0]:.1f}; "
          f"{out['seconds']:.0f} s; wrote {args.out}")
    return out


def _best(values: list[float]) -> str:
    return f"{max(values):.3f}" if values else "-"


def _meminfo(field: str) -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _summary(out: dict) -> None:
    """The best of each family, and how the store compares with the raw disk."""
    def best(rows, key):
        rows = [r for r in rows if r.get(key) and "error" not in r]
        return max(rows, key=lambda r: max(r[key]), default=None)

    summary = {}
    raw_w, raw_r = best(out.get("raw", []), "write"), best(out.get("raw", []), "read")
    for mode in {r["mode"] for r in out.get("store", [])}:
        rows = [r for r in out["store"] if r["mode"] == mode]
        key_w = "write_fsync" if mode == "buffered" else "write"
        bw, br = best(rows, key_w), best(rows, "read")
        if bw and br:
            summary[mode] = {
                "write_GBps": max(bw[key_w]), "write_config": (bw["chunk_bytes"], bw["workers"]),
                "read_GBps": max(br["read"]), "read_config": (br["chunk_bytes"], br["workers"]),
            }
            if raw_w and raw_r:
                summary[mode]["write_over_raw"] = max(bw[key_w]) / max(raw_w["write"])
                summary[mode]["read_over_raw"] = max(br["read"]) / max(raw_r["read"])
    for r in out.get("caio", []):
        if "error" not in r and r["write"]:
            summary[f"caio {r['backend']}"] = {"write_GBps": max(r["write"]), "read_GBps": max(r["read"])}
    if raw_w and raw_r:
        summary["raw"] = {"write_GBps": max(raw_w["write"]), "write_tool": raw_w["tool"], "read_GBps": max(raw_r["read"]), "read_tool": raw_r["tool"]}
    out["summary"] = summary
    print("\n## summary (best configuration of each; buffered writes with fsync)\n")
    for name, s in summary.items():
        extra = f"  ({s['write_over_raw']:.2f} / {s['read_over_raw']:.2f} of raw)" if "write_over_raw" in s else ""
        print(f"- {name}: write {s['write_GBps']:.3f} GB/s, read {s['read_GBps']:.3f} GB/s{extra}")


if __name__ == "__main__":
    main()
