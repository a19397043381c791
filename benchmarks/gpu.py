"""The GPU kit: everything a rare lent GPU (one H100/H200, ~15 minutes in all) should measure, in
ONE command. README "``gpu.py``: the kit for a lent GPU" says what each part measures.

    python benchmarks/gpu.py --budget 420 --out DIR            # parts 1..8 on CUDA
    python benchmarks/gpu.py --peers --budget 240 --out DIR    # part 9 (the peers), a second call
    python benchmarks/gpu.py --emulated --budget 90 --out DIR  # the same code paths on the CPU
    python benchmarks/gpu.py --parts 1,3 ...                   # some parts only

Each part runs in its own subprocess (``gpu.py --part N --deadline T --out DIR``) with a timeout
that is its share of the time left, so a CUDA crash, a hang or an out-of-memory in one part
never loses the others: a part that fails or times out is recorded with the tail of its output
and the runner goes on. ``DIR/gpu_results.json`` (environment + one entry per part: status
ok/failed/timeout/skipped, seconds, results, error tail) is rewritten after every part;
``DIR/gpu_log.txt`` collects every part's log lines. The runner ends with a short table.

A part is ``part_<name>(kit) -> dict`` (``benchmarks/gpu_common.Kit``) in the module the table
``PARTS`` names; a module may also define ``PARTS = {number: function}`` to say which of its
functions is which part. A part's dict may hold ``"summary"``: one line for the final table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

RESULTS = "gpu_results.json"
LOG = "gpu_log.txt"
MAX_FILES = 8  # what may come back from the lent machine
FAULT_ENV = "SHFX_GPU_KIT_FAULT"  # tests: "3:raise,5:hang,6:crash"


@dataclass(frozen=True)
class Part:
    number: int
    name: str
    module: str
    functions: tuple  # candidate function names, first found wins (after the module's PARTS table)
    share: float  # planned seconds out of 420 (parts 1-8) / 400 (part 9) on the GPU
    minimum: float  # seconds below which it is skipped (at --budget 420; scaled with the budget)
    emu_share: float  # planned seconds out of 90 with --emulated (a process start is ~3 s of it)


PARTS = {
    1: Part(1, "environment", "gpu_parts_core", ("part_environment",), 25, 8, 6),
    2: Part(2, "cuda tests + equivalence", "gpu_parts_core", ("part_equivalence",), 90, 20, 15),
    3: Part(3, "residency + traffic", "gpu_parts_core", ("part_residency",), 40, 10, 11),
    4: Part(4, "step speed", "gpu_parts_speed", ("part_speed",), 110, 25, 18),
    5: Part(5, "simulator vs measured", "gpu_parts_core", ("part_simulator",), 45, 12, 11),
    6: Part(6, "capacity", "gpu_parts_core", ("part_capacity",), 45, 12, 8),
    7: Part(7, "host adam", "gpu_parts_speed", ("part_host_adam",), 30, 8, 9),
    8: Part(8, "attention kernels", "gpu_parts_speed", ("part_attention",), 25, 8, 14),
    9: Part(9, "peers", "gpu_parts_peers", ("part_peers",), 380, 60, 80),
}
MAIN_PARTS = [1, 2, 3, 4, 5, 6, 7, 8]
PLANNED_BUDGET = 420.0


_IMPORT_S: float | None = None


def _import_seconds() -> float:
    """Seconds this process took to import torch and shfx (imports them the first time)."""
    global _IMPORT_S
    if _IMPORT_S is None:
        t0 = time.perf_counter()
        try:
            import torch  # noqa: F401

            import shfx  # noqa: F401
        except Exception:  # noqa: BLE001 - the parts will say what is wrong
            pass
        _IMPORT_S = time.perf_counter() - t0
    return _IMPORT_S


def cuda_ok() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except Exception:  # noqa: BLE001
        return False


# ---- the child: one part --------------------------------------------------------------------


def resolve(part: Part):
    """The part's function: ``module.PARTS[number]``, else the first of ``part.functions`` the
    module has, else (a module holding several parts) its ``part_*`` functions in source order,
    matched to the numbers of the parts that module holds."""
    import importlib
    import inspect

    mod = importlib.import_module(part.module)
    table = getattr(mod, "PARTS", None)
    if isinstance(table, dict):  # {4: fn} or {"speed": fn} (the function's name without "part_")
        keys = [part.number, str(part.number)] + [n.removeprefix("part_") for n in part.functions]
        for key in keys:
            if callable(table.get(key)):
                return table[key]
    for name in part.functions:
        fn = getattr(mod, name, None)
        if callable(fn):
            return fn
    fns = [f for n, f in vars(mod).items() if n.startswith("part_") and inspect.isfunction(f) and f.__module__ == mod.__name__]
    fns.sort(key=lambda f: f.__code__.co_firstlineno)
    claimed = {getattr(mod, n) for p in PARTS.values() if p.module == part.module for n in p.functions if hasattr(mod, n)}
    free = [f for f in fns if f not in claimed]
    numbers = [p.number for p in PARTS.values() if p.module == part.module]
    unresolved = [n for n in numbers if not any(hasattr(mod, c) for c in PARTS[n].functions)]
    if part.number in unresolved and len(free) == len(unresolved):
        return free[unresolved.index(part.number)]
    raise AttributeError(f"{part.module} has no function for part {part.number} (tried {', '.join(part.functions)}; "
                         f"its part_* functions: {[f.__name__ for f in fns]}; or define PARTS = {{{part.number}: fn}})")  # fmt: skip


def inject_fault(number: int) -> None:
    """Tests: ``SHFX_GPU_KIT_FAULT="3:raise,5:hang,6:crash"`` makes those parts fail that way."""
    for item in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        n, _, kind = item.partition(":")
        if n.strip() != str(number):
            continue
        if kind == "hang":
            while True:
                time.sleep(1)
        if kind == "crash":
            os.abort()
        raise RuntimeError(f"injected fault in part {number} ({FAULT_ENV})")


def run_child(args: argparse.Namespace) -> int:
    from gpu_common import Kit, jsonable

    number = int(args.part)
    part = PARTS[number]
    out = pathlib.Path(args.out)
    result_path = pathlib.Path(args.result) if args.result else None
    deadline = time.monotonic() + (args.deadline - time.time() if args.deadline else 60.0)
    kit = Kit(emulated=args.emulated, out=out, deadline=deadline, part=str(number), result_path=result_path)
    entry: dict = {"status": "failed"}
    t0 = time.perf_counter()
    try:
        kit.log(f"{part.name}: start, {kit.remaining():.0f} s to its deadline")
        inject_fault(number)
        fn = resolve(part)
        results = fn(kit)
        entry = {"status": "ok", "function": f"{part.module}.{fn.__name__}", "results": jsonable(results or {})}
    except BaseException as e:  # noqa: BLE001 - everything is recorded
        tb = traceback.format_exc()
        entry = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:2000], "error_tail": tb[-4000:],
                 "results": kit.partial}  # fmt: skip
        kit.log(f"FAILED: {type(e).__name__}: {str(e)[:300]}")
    entry["notes"] = kit.notes
    entry["seconds_in_part"] = round(time.perf_counter() - t0, 3)
    if result_path is not None:
        try:
            result_path.write_text(json.dumps(entry, default=str))
        except (OSError, TypeError, ValueError) as e:
            result_path.write_text(json.dumps({"status": "failed", "error": f"results not JSON: {e}"}))
    else:
        print(json.dumps(entry, default=str, indent=1))
    kit.log(f"{part.name}: {entry['status']} in {entry['seconds_in_part']:.1f} s")
    return 0 if entry["status"] == "ok" else 1


# ---- the runner ---------------------------------------------------------------------------


def environment_summary(emulated: bool) -> dict:
    """What the runner knows without touching the GPU (part 1 measures the rest)."""
    env: dict = {
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "emulated": emulated,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": platform.node(),
        "cpus": os.cpu_count(),
        "argv": sys.argv,
    }
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda_build"] = torch.version.cuda
    except Exception as e:  # noqa: BLE001
        env["torch"] = f"import failed: {e}"
    from importlib import metadata

    for mod in ("transformers", "accelerate", "numpy", "psutil", "pytest"):
        try:  # without importing them (transformers takes seconds)
            env[mod] = metadata.version(mod)
        except Exception:  # noqa: BLE001
            env[mod] = None
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                           timeout=10).stdout.strip() or None  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()  # fmt: skip
        env["git_dirty"] = bool(dirty)
    except Exception:  # noqa: BLE001
        env["git_commit"] = None
    # a lent machine gets a copy of the working tree without .git: the command can name the
    # commit (SHFX_GIT_COMMIT=<hash>), and the digest of the sources identifies it in any case
    env["git_commit_given"] = os.environ.get("SHFX_GIT_COMMIT")
    env["source_digest"] = source_digest()
    return env


def source_digest() -> str | None:
    """sha256 over the package's and the benchmarks' ``.py`` files (paths and contents), the
    same on any copy of one commit: ``python benchmarks/gpu.py --digest`` prints it here."""
    import hashlib

    h = hashlib.sha256()
    try:
        for folder in ("shfx", "passes", "cost_model", "benchmarks"):
            for p in sorted((ROOT / folder).rglob("*.py")):
                h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
        return h.hexdigest()[:16]
    except OSError:
        return None


def write_json(path: pathlib.Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def _tail(path: pathlib.Path, n: int = 3000) -> str:
    try:
        data = path.read_bytes()
        return data[-n:].decode("utf-8", "replace")
    except OSError:
        return ""


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError, OSError):
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def run_part(part: Part, timeout: float, out: pathlib.Path, emulated: bool, scratch: pathlib.Path) -> dict:
    """Run one part in a subprocess (its own process group), at most ``timeout`` seconds."""
    grace = min(8.0, max(1.5, 0.1 * timeout))
    deadline = time.time() + timeout - grace
    result_path = scratch / f"part{part.number}.json"
    log_path = scratch / f"part{part.number}.out"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(HERE / "gpu.py"), "--part", str(part.number), "--deadline", f"{deadline:.3f}",
           "--out", str(out), "--result", str(result_path)] + (["--emulated"] if emulated else [])  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(HERE), env.get("PYTHONPATH", "")]))
    env.setdefault("CUDA_MODULE_LOADING", "LAZY")
    if emulated:
        # the emulated run checks code paths, not speed: one OpenMP thread per process keeps it
        # seconds on a small shared machine (idle OpenMP workers spinning against shfx's stream
        # threads and other processes made steps 10-100x slower under load)
        env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    status = None
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        except OSError as e:
            return {"status": "failed", "seconds": 0.0, "error": f"could not start: {e}"}
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc, status = None, "timeout"
        else:
            _kill_group(proc)  # stray grandchildren (pytest's workers, ...)
    seconds = time.perf_counter() - t0
    entry: dict = {}
    try:
        entry = json.loads(result_path.read_text())
    except (OSError, ValueError):
        pass
    if status == "timeout" and entry.get("status") in ("ok", "failed"):
        entry["note"] = "the part had returned; its process was killed while exiting"
    elif status == "timeout":
        entry["status"] = "timeout"
        entry["error"] = f"killed after {timeout:.0f} s (its share of the budget)"
    elif entry.get("status") not in ("ok", "failed"):
        entry["status"] = "failed"
        entry["error"] = f"the part's process ended with code {rc} and no result" + (
            f" (signal {-rc})" if isinstance(rc, int) and rc < 0 else "")  # fmt: skip
    entry.setdefault("results", {})
    entry["returncode"] = rc
    entry["seconds"] = round(seconds, 2)
    entry["timeout_s"] = round(timeout, 1)
    if entry["status"] != "ok":
        entry["output_tail"] = _tail(log_path)
    return entry


def _table(parts: dict) -> str:
    rows = [f"{'part':<4} {'name':<26} {'status':<8} {'seconds':>7}  summary"]
    for key, e in parts.items():
        res = e.get("results") if isinstance(e.get("results"), dict) else {}
        summary = res.get("summary") or e.get("error") or e.get("why") or ""
        rows.append(f"{key:<4} {e.get('name', ''):<26} {e.get('status', ''):<8} {e.get('seconds', 0):>7.1f}  {str(summary)[:150]}")
    return "\n".join(rows)


def run_all(args: argparse.Namespace) -> int:
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    budget = float(args.budget)
    if args.parts:
        numbers = sorted({int(x) for x in args.parts.split(",") if x.strip()})
        bad = [n for n in numbers if n not in PARTS]
        if bad:
            print(f"gpu.py: no part {bad}; parts are {sorted(PARTS)}", file=sys.stderr)
            return 2
    else:
        numbers = [9] if args.peers else list(MAIN_PARTS)
    def share(n: int) -> float:
        return PARTS[n].emu_share if args.emulated else PARTS[n].share

    planned = sum(share(n) for n in numbers)
    scale = budget / planned

    path = out / RESULTS
    data: dict = {}
    if path.exists():  # a second call into the same folder (--peers) adds its parts
        try:
            data = json.loads(path.read_text())
        except ValueError:
            data = {}
    data.setdefault("kit", {})
    data["kit"][("peers" if args.peers else "main") + "_call"] = {"budget_s": budget, "parts": numbers}
    # what starting a part's process costs, roughly: importing torch and shfx, as this process
    # did (seconds; longer with a CUDA build, and on a loaded machine); every part gets it on top
    # of its share
    startup = min(15.0, 1.0 + 1.2 * _import_seconds())
    data["kit"]["part_startup_estimate_s"] = round(startup, 2)
    data["environment"] = data.get("environment") or environment_summary(args.emulated)
    data.setdefault("parts", {})
    write_json(path, data)
    print(f"gpu.py: {'emulated (CPU)' if args.emulated else 'CUDA'}, budget {budget:.0f} s, parts {numbers}, out {out}", flush=True)

    scratch = pathlib.Path(tempfile.mkdtemp(prefix="shfx_gpu_kit_"))
    reserve = 2.0
    for i, n in enumerate(numbers):
        part = PARTS[n]
        left = budget - (time.monotonic() - start) - reserve
        shares = sum(share(m) for m in numbers[i:])
        # its process start, and its share of what is left after the starts of the parts still to
        # run: what earlier parts did not use flows to the later ones
        work_left = max(0.0, left - startup * (len(numbers) - i))
        timeout = min(max(0.0, left), startup + work_left * share(n) / shares)
        minimum = startup + (1.0 if args.emulated else part.minimum * scale)
        entry: dict
        if timeout < minimum:
            entry = {"status": "skipped", "seconds": 0.0, "results": {},
                     "why": f"needs at least {minimum:.0f} s, {max(left, 0):.0f} s left of the budget"}  # fmt: skip
        else:
            print(f"part {n} ({part.name}): up to {timeout:.0f} s ...", flush=True)
            try:
                entry = run_part(part, timeout, out, args.emulated, scratch)
            except Exception as e:  # noqa: BLE001 - the runner never dies of one part
                entry = {"status": "failed", "seconds": 0.0, "results": {}, "error": f"runner: {type(e).__name__}: {e}"}
        entry = {"name": part.name, **entry}
        data["parts"][str(n)] = entry
        write_json(path, data)
        res = entry.get("results") if isinstance(entry.get("results"), dict) else {}
        line = res.get("summary") or entry.get("error") or entry.get("why") or ""
        print(f"part {n} ({part.name}): {entry['status']} in {entry.get('seconds', 0):.1f} s  {str(line)[:200]}", flush=True)
        if entry["status"] != "ok" and entry.get("output_tail"):
            print("    " + entry["output_tail"][-800:].replace("\n", "\n    "), flush=True)

    files = sorted(p.name for p in out.iterdir())
    data["kit"]["files"] = files
    data["kit"]["seconds"] = round(time.monotonic() - start, 1)
    if len(files) > MAX_FILES:
        data["kit"]["warning"] = f"{len(files)} files in {out}: only {MAX_FILES} come back from a lent machine"
    write_json(path, data)
    print()
    print(_table({k: v for k, v in data["parts"].items() if int(k) in numbers}))
    counts: dict = {}
    for n in numbers:
        s = data["parts"][str(n)]["status"]
        counts[s] = counts.get(s, 0) + 1
    print(f"gpu.py: {counts} in {time.monotonic() - start:.0f} s; results {path}; files {files}", flush=True)
    if "warning" in data["kit"]:
        print("gpu.py: WARNING " + data["kit"]["warning"])
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=PLANNED_BUDGET, help="seconds for all the parts (default 420)")
    p.add_argument("--out", default="gpu_out", help="results folder (default ./gpu_out)")
    p.add_argument("--parts", default=None, help="comma-separated part numbers (default 1-8; 9 with --peers)")
    p.add_argument("--peers", action="store_true", help="run part 9 (the peers: a second call)")
    p.add_argument("--emulated", action="store_true", help="run on the CPU with shfx.EmulatedDevice, tiny sizes")
    p.add_argument("--digest", action="store_true", help="print the digest of the sources (results' source_digest) and exit")
    p.add_argument("--part", type=int, help=argparse.SUPPRESS)  # the child
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # time.time() by which to return
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.digest:
        print(source_digest())
        return 0
    if args.part is None:
        _import_seconds()  # before anything else imports torch: the runner's estimate of a part's start
    if not args.emulated and not cuda_ok():
        print("gpu.py: needs CUDA (torch.cuda.is_available() is False here); "
              "`python benchmarks/gpu.py --emulated` runs the same parts on the CPU", flush=True)  # fmt: skip
        return 0
    if args.part is not None:
        rc = run_child(args)
        # skip the interpreter's teardown (CUDA contexts, thread pools: seconds, or a hang after
        # a CUDA error); the results are written
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
