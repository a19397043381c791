"""What the five STRONGHOLD experiments (``examples/paper/*.py``) share.

Two modes, the same tables:

- **simulation** (default): the GPT of ``shared/REFERENCE.md`` (hidden 2048, 16 heads, sequence
  1024, micro-batch 4, vocabulary 50304, fp32 unless ``--precision bf16|fp16``, activation
  checkpointing per layer) on a named
  hardware profile (``--hardware``, :data:`shfx.cost_model.hardware.PROFILES`). Sizes come from the
  memory planner (:mod:`shfx.cost_model.planner`); step times from the analytic costs of one
  meta-device capture repeated to any depth (:class:`shfx.cost_model.depth.DepthModel`) and the
  simulator (:func:`shfx.cost_model.simulate.simulate`) run on each policy's step program.
- **real** (``--real``): a small GPT (hidden 64, 4 heads, sequence 32, batch 4, vocabulary 256)
  trained by shfx on :class:`shfx.EmulatedDevice` with a small memory budget and throttled
  links, so offloading matters. Step times are the median (``--stat``) of a few measured steps
  after a warm-up (``cm.engine.step_times``: first forward to the end of ``cm.step()``), the
  configurations of one table stepped in turn; sizes are found by trying (a run that raises
  :class:`shfx.OutOfDeviceMemory` does not fit).

NOTE: the emulated device has no host-RAM limit, but STRONGHOLD's largest model is bound by
host RAM (90 GB). ``--host-memory`` emulates one: a run whose host bytes (what the runtime
allocates on the host, plus the host AdamW states) exceed it after its first step does not fit.

Throughput is reported as tokens/s (batch x sequence per step), samples/s, and model TFLOP/s
(per device) = 6 x parameters x tokens / step time, as REFERENCE.md counts it (with activation
recompute the device actually executes ~8 N FLOPs per token, so hardware utilisation is 4/3 of it).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from shfx.cost_model.depth import DepthModel  # noqa: E402
from shfx.cost_model.hardware import PROFILES, Hardware, get_profile  # noqa: E402
from shfx.cost_model.planner import GPTShape, Target, largest_trainable, memory_model  # noqa: E402
from shfx.cost_model.shapes import normalize_precision, short_precision  # noqa: E402
from shfx.passes.policies import make_policy, policy_names  # noqa: E402
from shfx.passes.program import ScheduleError  # noqa: E402
from shfx.passes.units import format_bandwidth, format_bytes, parse_bandwidth, parse_bytes  # noqa: E402

__all__ = [
    "POLICIES", "BASELINES", "PAPER_NAME", "REFERENCE", "SMALL", "REAL_DEVICE", "OUT", "GiB", "MiB",
    "Setup", "Run", "Table", "Clock", "parse_args", "int_list", "num_params", "largest_layers", "run_policy",
    "run_policies", "largest_tried", "throughput", "save_plot", "finish",
]

OUT = ROOT / "examples" / "out" / "paper"
POLICIES: tuple[str, ...] = policy_names()  # the registry's order: the baselines, then stronghold
BASELINES: tuple[str, ...] = POLICIES[:-1]
PAPER_NAME = {
    "resident": "Megatron-LM",
    "l2l": "L2L",
    "zero-offload": "ZeRO-Offload",
    "zero-infinity": "ZeRO-Infinity",
    "stronghold": "STRONGHOLD",
}
REFERENCE = {"hidden": 2048, "heads": 16, "seq": 1024, "batch": 4, "vocab": 50304}
"""STRONGHOLD's artifact GPT (REFERENCE.md), simulation mode's default."""
SMALL = {"hidden": 64, "heads": 4, "seq": 32, "batch": 4, "vocab": 256}
"""The GPT ``--real`` trains: the reference's proportions (b s = 2 h, so a layer's checkpointed
activation is to its parameters as in the reference), 0.05 M parameters per layer."""
REAL_DEVICE = {"device_memory": "4MiB", "host_memory": "16MiB", "link": "400MB/s"}
"""``--real``'s emulated machine: resident fits a few layers, stronghold tens; a block's copy
(0.2 MB) takes 0.5 ms at 400 MB/s, about twice its forward on two cores: a window of 1-2 leaves
copies exposed, W >= 3-4 hides most of them (experiment 5)."""
GiB, MiB = 2**30, 2**20


# ---- setup -----------------------------------------------------------------------------------
@dataclass
class Setup:
    """Everything an experiment needs from the command line.

    Attributes:
        real: measure on the emulated device instead of simulating.
        family: the GPT (layers set per run).
        hardware: the profile simulated (its memory replaced by ``--device-memory`` and
            ``--host-memory`` when given).
        target: what the planner checks sizes against: ``hardware``, or (``real``) the emulated
            device with the emulated host budget.
        window, resident_first: STRONGHOLD's window and refinement (first k stages resident
            with their optimizer on the device).
        device: the emulated device (``real``).
        host_budget_bytes: the emulated host RAM (``real``; None: no limit).
        steps, warmup, stat, threads: measured and warm-up steps per run, the statistic over the
            measured steps, and the compute's OpenMP threads (``real``).
        workspace_bytes: the GPU workspace the planner reserves (None: its default).
        max_layers: the largest layer count searched.
        out: output folder; plot: write PNGs.
    """

    real: bool
    family: GPTShape
    hardware: Hardware
    target: Hardware | Target
    window: int
    resident_first: int
    out: Path
    plot: bool
    max_layers: int
    device: Any = None
    host_budget_bytes: int | None = None
    steps: int = 10
    stat: str = "median"
    threads: int | None = None
    workspace_bytes: int | None = None
    warmup: int = 2
    argv: list[str] = field(default_factory=list)
    _cache: dict = field(default_factory=dict, repr=False)  # shared by dataclasses.replace copies

    @property
    def mode(self) -> str:
        return "real" if self.real else "simulation"

    def kw(self, policy: str) -> dict[str, int]:
        """window / resident_first for ``policy`` (only stronghold takes them)."""
        return {"window": self.window, "resident_first": self.resident_first if policy == "stronghold" else 0}

    def policy(self, name: str):
        """The policy object of ``name`` with this setup's window and k (only stronghold takes them)."""
        if name != "stronghold":
            return make_policy(name)
        return make_policy(name, window=self.window, resident_first=self.resident_first)

    def label(self, policy: str) -> str:
        if policy != "stronghold":
            return policy
        return f"stronghold(W={self.window}" + (f",k={self.resident_first})" if self.resident_first else ")")

    def memory_kw(self, policy: str) -> dict[str, Any]:
        """The planner's options for ``policy`` (on the emulated target it leaves out what the
        emulated device does not see by itself: GPU workspace, temporaries inside a stage)."""
        kw: dict[str, Any] = self.kw(policy)
        if self.workspace_bytes is not None:
            kw["workspace_bytes"] = self.workspace_bytes
        return kw

    def depth(self) -> DepthModel:
        """Specs and analytic costs for any layer count (captured once, on the meta device)."""
        if "depth" not in self._cache:
            from shfx.models.gpt import GPT

            f = self.family
            self._cache["depth"] = DepthModel(
                lambda n: GPT(gpt_config(f, n)),
                lambda: (torch.zeros(f.batch, f.seq, dtype=torch.long),) * 2,
                blocks="transformer.h",
                hardware=self.hardware,
                precision=f.precision,  # fp16: with the step journal's rollback copies, as shfx.compile keeps them
            )
        return self._cache["depth"]

    def describe(self) -> str:
        f = self.family
        gpt = f"GPT hidden {f.hidden}, {f.heads} heads, seq {f.seq}, batch {f.batch}, vocab {f.vocab}, {short_precision(f.precision)}"
        sh = f"stronghold W={self.window}, k={self.resident_first}"
        if self.real:
            return (f"real: {self.device}, host budget {format_bytes(self.host_budget_bytes or 0)}; {gpt}; {sh}; "
                    f"{self.stat} of {self.steps} steps after {self.warmup} warm-up, interleaved; "
                    f"{self.threads} compute thread(s)")
        hw = self.hardware
        return (f"simulation: {hw.name} ({format_bytes(hw.device_memory_bytes)} device, "
                f"{format_bytes(hw.host_memory_bytes)} host, h2d {format_bandwidth(hw.h2d_bps)}); {gpt}; {sh}")

    def meta(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "hardware": asdict(self.hardware) if not self.real else None,
            "target": asdict(self.target) if isinstance(self.target, Target) else self.target.name,
            "family": asdict(self.family),
            "window": self.window,
            "resident_first": self.resident_first,
            "device": str(self.device) if self.device is not None else None,
            "host_budget_bytes": self.host_budget_bytes,
            "steps": self.steps,
            "stat": self.stat,
            "threads": self.threads,
            "workspace_bytes": self.workspace_bytes,
            "warmup": self.warmup,
            "argv": self.argv,
            "throughput": "tokens/s = batch x seq / step; TFLOP/s = 6 x params x tokens / step",
            "load_average": _load(),
            "cpus": os.cpu_count(),
        }


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def gpt_config(family: GPTShape, layers: int) -> GPTShape:
    return family.with_layers(layers)


def num_params(family: GPTShape, layers: int) -> int:
    """Parameters (the tied embedding counted once), as :class:`shfx.models.gpt.GPTShape` counts them."""
    return gpt_config(family, layers).num_params()


def int_list(text: str) -> list[int]:
    """``"8:129:8"`` (a range, stop excluded) or ``"1,2,4"`` -> ints."""
    if ":" in text:
        return list(range(*(int(x) for x in text.split(":"))))
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(
    description: str,
    argv: Sequence[str] | None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> tuple[Setup, argparse.Namespace]:
    """The common command line (plus ``extra``'s arguments); returns the setup and the namespace."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real", action="store_true",
                   help="train a small GPT on the emulated device and measure (default: simulate the reference setup)")
    p.add_argument("--hardware", default="V100-32GB-PCIe3", choices=sorted(PROFILES),
                   help="simulated hardware profile (default: %(default)s, STRONGHOLD's machine)")
    p.add_argument("--window", type=int, default=4, help="stronghold's window W (default: %(default)s)")
    p.add_argument("--resident-first", type=int, default=1, metavar="K",
                   help="stronghold's first K stages resident with their optimizer on the device (default: %(default)s)")
    for name in ("hidden", "heads", "seq", "batch", "vocab"):
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"GPT {name} (default: {REFERENCE[name]} simulated, {SMALL[name]} with --real)")
    p.add_argument("--device-memory", default=None,
                   help=f"device memory (default: the profile's; {REAL_DEVICE['device_memory']} with --real)")
    p.add_argument("--host-memory", default=None,
                   help=f"host RAM (default: the profile's; {REAL_DEVICE['host_memory']} with --real)")
    p.add_argument("--workspace", default=None,
                   help="GPU context and library workspace the planner reserves (default: 512MiB simulated, 0 with --real)")
    p.add_argument("--link", default=REAL_DEVICE["link"], help="--real: emulated h2d and d2h bandwidth (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="--real: measured steps per run (default: %(default)s)")
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="--real: step time statistic over the measured steps (default: %(default)s; min is "
                        "steadier on a loaded machine)")
    p.add_argument("--threads", type=int, default=1,
                   help="--real: torch intra-op threads of the emulated device's compute (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="--real: warm-up steps per run (default: %(default)s)")
    p.add_argument("--max-layers", type=int, default=None,
                   help="largest layer count searched (default: 100000 simulated, 48 with --real)")
    p.add_argument("--precision", default="fp32", metavar="{fp32,bf16,fp16}",
                   help="fp32 (default), or mixed precision bf16/fp16 (16-bit on the device, fp32 master and AdamW "
                        "states on the host; fp16 with the step journal's rollback copies); float32/bfloat16/float16 too")
    p.add_argument("--out", type=Path, default=OUT, help="output folder (default: examples/out/paper)")
    p.add_argument("--no-plot", action="store_true", help="do not write a PNG")
    if extra is not None:
        extra(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    if a.window < 1 or a.resident_first < 0:
        p.error("--window must be >= 1 and --resident-first >= 0")
    try:
        precision = normalize_precision(a.precision)
    except ValueError as e:
        p.error(f"--precision: {e}")
    shape = SMALL if a.real else REFERENCE
    family = GPTShape(**{k: getattr(a, k) if getattr(a, k) is not None else v for k, v in shape.items()}, precision=precision)
    hw = get_profile(a.hardware)
    dev_mem = a.device_memory or (REAL_DEVICE["device_memory"] if a.real else None)
    host_mem = a.host_memory or (REAL_DEVICE["host_memory"] if a.real else None)
    if dev_mem is not None:
        hw = replace(hw, device_memory_bytes=parse_bytes(dev_mem, what="--device-memory"))
    if host_mem is not None:
        hw = replace(hw, host_memory_bytes=parse_bytes(host_mem, what="--host-memory"))
    setup = Setup(
        real=a.real,
        family=family,
        hardware=hw,
        target=hw,
        window=a.window,
        resident_first=a.resident_first,
        out=a.out,
        plot=not a.no_plot,
        max_layers=a.max_layers or (48 if a.real else 100_000),
        steps=a.steps,
        stat=a.stat,
        warmup=a.warmup,
        argv=argv,
        workspace_bytes=None if a.workspace is None else parse_bytes(a.workspace, what="--workspace"),
    )
    if a.real:
        import shfx

        setup.threads = max(1, a.threads)
        bw = parse_bandwidth(a.link, what="--link")
        setup.device = shfx.EmulatedDevice(memory=hw.device_memory_bytes, h2d=bw, d2h=bw)
        setup.host_budget_bytes = hw.host_memory_bytes
        setup.target = Target(str(setup.device), hw.device_memory_bytes, hw.host_memory_bytes, 0, emulated=True)
    return setup, a


# ---- one run: simulated or measured ---------------------------------------------------------
@dataclass
class Run:
    """One policy at one size.

    ``step_s`` is None when it does not fit (``why`` says what ran out). Simulated runs carry the
    simulator's bottleneck and peak (which leaves out GPU workspace), plus the planner's device
    total; measured runs the device peak and host bytes the backend saw.
    """

    policy: str
    layers: int
    params: int
    step_s: float | None
    fits: bool
    why: str = ""
    bottleneck: str = ""
    peak_device_bytes: int | None = None
    planned_device_bytes: int | None = None
    host_bytes: int | None = None
    step_times: list[float] = field(default_factory=list)


def throughput(setup: Setup, run: Run) -> dict[str, float | None]:
    """tokens/s, samples/s and model TFLOP/s (6 N per token) of a run; None when it did not fit."""
    if run.step_s is None or run.step_s <= 0:
        return {"tokens_per_s": None, "samples_per_s": None, "tflops": None}
    f = setup.family
    tokens = f.batch * f.seq
    return {
        "tokens_per_s": tokens / run.step_s,
        "samples_per_s": f.batch / run.step_s,
        "tflops": 6.0 * run.params * tokens / run.step_s / 1e12,
    }


def _plan(setup: Setup, policy: str, layers: int):
    return memory_model(policy, setup.family.with_layers(layers), setup.target, **setup.memory_kw(policy))


def largest_layers(setup: Setup, policy: str):
    """The planner's largest trainable size of ``policy`` (a ``PlanRow``: ``.layers``, ``.binding``...)."""
    return largest_trainable(policy, setup.family, setup.target, max_layers=setup.max_layers,
                             **setup.memory_kw(policy))


def run_policy(setup: Setup, policy: str, layers: int, *, steps: int | None = None, warmup: int | None = None,
               force: bool = False) -> Run:
    """Simulate (or, with ``--real``, measure) one step of ``policy`` at ``layers``.

    Simulated: a size the planner says does not fit gets no step time unless ``force``.
    Measured: a size that raises :class:`shfx.OutOfDeviceMemory` or exceeds the host budget
    does not fit."""
    if setup.real:
        return run_policies([(setup, policy, layers)], steps=steps, warmup=warmup)[0]
    params = num_params(setup.family, layers)
    mm = _plan(setup, policy, layers)
    fits = bool(mm.fits(setup.target))
    why = "" if fits else mm.binding(setup.target)
    if not fits and not force:
        return Run(policy, layers, params, None, False, why, planned_device_bytes=int(mm.device_total))
    tl = setup.depth().simulate(layers, policy, **setup.kw(policy))
    return Run(policy, layers, params, tl.step_s, fits, why, bottleneck=tl.bottleneck,
               peak_device_bytes=int(tl.peak_device_bytes), planned_device_bytes=int(mm.device_total),
               host_bytes=int(mm.host_total))


def run_policies(items: Sequence[tuple[Setup, str, int]], *, steps: int | None = None,
                 warmup: int | None = None) -> list[Run]:
    """:func:`run_policy` for each ``(setup, policy, layers)``.

    ``--real``: every configuration is compiled and warmed up first, then the measured steps are
    interleaved (one step of each in turn, the order rotating), so load from other processes on
    a shared machine lands on all of them alike rather than on whichever ran during a burst."""
    if not items or not items[0][0].real:
        return [run_policy(s, p, n) for s, p, n in items]
    base = items[0][0]
    steps = base.steps if steps is None else steps
    warmup = base.warmup if warmup is None else warmup
    # NOTE: the emulated device computes on the calling thread's OpenMP team. On a shared
    # machine a team of 2 on 2 cores waits at every parallel region for a member another process
    # descheduled: steps of this small GPT went from ~8 ms to ~0.3 s per stage with one busy
    # neighbour. One thread is as fast here when the machine is quiet, and steady when it is not.
    threads = torch.get_num_threads()
    torch.set_num_threads(base.threads or threads)
    trials = []
    try:
        for s, p, n in items:
            trials.append(_Trial(s, p, n))
        for t in trials:
            t.start(max(1, warmup))
        live = [t for t in trials if t.failed is None]
        for i in range(steps):
            for t in live[i % len(live):] + live[: i % len(live)] if live else []:
                t.step()
        return [t.result() for t in trials]
    finally:
        for t in trials:
            t.close()
        torch.set_num_threads(threads)


class _Trial:
    """One policy at one size on the emulated device: compiled, warmed up, stepped, closed."""

    def __init__(self, setup: Setup, policy: str, layers: int):
        import shfx
        from shfx.commands import precision_kwargs
        from shfx.models.gpt import GPT

        self.setup, self.policy, self.layers = setup, policy, layers
        self.params = num_params(setup.family, layers)
        f = setup.family
        torch.manual_seed(0)
        self.x = torch.randint(0, f.vocab, (f.batch, f.seq))
        self.y = torch.randint(0, f.vocab, (f.batch, f.seq))
        self.cm = shfx.compile(GPT(gpt_config(f, layers)), device=setup.device, policy=setup.policy(policy),
                               optimizer=shfx.optim.AdamW(lr=1e-4), **precision_kwargs(f.precision))
        self.failed: Run | None = None
        self.times: list[float] = []
        self.closed = False

    def _one(self) -> bool:
        """One training step; False (and ``failed`` set) when it ran out of memory."""
        import shfx

        if self.failed is not None:
            return False
        cm = self.cm
        try:
            loss = cm(self.x, self.y)
            loss.backward()
            cm.step()
            cm.zero_grad()
        except ScheduleError as e:  # a program shfx cannot run for this setup: reported as not run
            self.failed = self._run(None, False, f"not run in {short_precision(self.setup.family.precision)}: {e}")
            self.close()
            return False
        except shfx.OutOfDeviceMemory as e:
            if e.used_bytes:
                need = f"{format_bytes(e.used_bytes)} in use + {format_bytes(e.needed_bytes)} > {format_bytes(e.capacity_bytes)}"
            else:
                need = f"needs {format_bytes(e.needed_bytes)} of {format_bytes(e.capacity_bytes)}"
            self.failed = self._run(None, False, f"device memory ({need})")
            self.close()
            return False
        return True

    def start(self, warmup: int) -> None:
        for i in range(warmup):
            if not self._one():
                return
            budget = self.setup.host_budget_bytes
            if i == 0 and budget is not None and (host := _host_bytes(self.cm)) > budget:
                self.failed = self._run(None, False, f"host memory ({format_bytes(host)} > {format_bytes(budget)}, emulated)")
                self.close()
                return

    def step(self) -> None:
        if self._one():
            self.times.append(self.cm.engine.step_times[-1])

    def _run(self, step_s: float | None, fits: bool, why: str = "") -> Run:
        return Run(self.policy, self.layers, self.params, step_s, fits, why,
                   peak_device_bytes=int(self.cm.backend.peak_bytes), host_bytes=_host_bytes(self.cm),
                   step_times=list(self.times))

    def result(self) -> Run:
        if self.failed is not None:
            return self.failed
        stat = min if self.setup.stat == "min" else statistics.median
        return self._run(stat(self.times) if self.times else None, True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.cm.close()


def _host_bytes(cm) -> int:
    """Host bytes shfx holds for ``cm`` (``engine.host_bytes()``: weights, gradients, AdamW
    states, staging and pending-gradient buffers; 0 before the first call)."""
    import shfx

    try:
        return cm.engine.host_bytes()
    except shfx.UsageError:  # never called: nothing allocated yet
        return 0


def largest_tried(setup: Setup, policy: str, start: int, *, log: Callable[[str], None] = print) -> tuple[int, Run | None, list[Run]]:
    """``--real``: the largest layer count in 1..max_layers at which ``policy`` trains, found by
    trying (two steps each): from ``start`` (the planner's prediction), up or down one at a time,
    then in growing strides, then bisecting. Returns (layers, the failing run just above, all runs);
    layers is 0 when not even one layer fits. Assumes fitting is monotone in the layer count (the
    planner's search does not: which slot the tail shares can let a model fit when one layer
    less does not, see :func:`shfx.cost_model.planner.largest_trainable`)."""
    tried: dict[int, Run] = {}

    def ok(n: int) -> bool:
        if n not in tried:
            r = run_policy(setup, policy, n, steps=0, warmup=2)
            tried[n] = r
            log(f"    {setup.label(policy)} at {n} layers: " + ("trains" if r.fits else f"does not fit ({r.why})"))
        return tried[n].fits

    lo_cap, hi_cap = 1, setup.max_layers
    n = max(lo_cap, min(start, hi_cap))
    if ok(n):
        lo, stride = n, 1
        while lo < hi_cap and ok(min(lo + stride, hi_cap)):
            lo, stride = min(lo + stride, hi_cap), stride * 2
        hi = min(lo + stride, hi_cap) if lo < hi_cap else hi_cap + 1
    else:
        hi, stride = n, 1
        while hi > lo_cap and not ok(max(hi - stride, lo_cap)):
            hi, stride = max(hi - stride, lo_cap), stride * 2
        lo = max(hi - stride, lo_cap) if hi > lo_cap else 0
    while hi - lo > 1:  # lo trains (or is 0), hi does not (or is past the cap)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    runs = [tried[k] for k in sorted(tried)]
    return lo, tried.get(lo + 1), runs


# ---- output ---------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        a = abs(v)
        if a == 0:
            return "0"
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.1f}"
        if a >= 1:
            return f"{v:.3f}" if a < 10 else f"{v:.2f}"
        return f"{v:.4f}" if a >= 0.001 else f"{v:.3g}"
    return str(v)


@dataclass
class Table:
    """A result table: printed, written as CSV and JSON (rows as dicts, plus the setup)."""

    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *row: Any) -> None:
        if len(row) != len(self.columns):
            raise ValueError(f"row has {len(row)} cells, the table {len(self.columns)} columns")
        self.rows.append(list(row))

    def text(self) -> str:
        cells = [[_fmt(c) for c in r] for r in self.rows]
        widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(self.columns)]
        line = "  ".join(h.rjust(w) for h, w in zip(self.columns, widths))
        out = [self.title, line, "-" * len(line)]
        out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
        out += [f"  {n}" for n in self.notes]
        return "\n".join(out)

    def markdown(self) -> str:
        out = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        out += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in self.rows]
        return "\n".join(out)

    def records(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, r)) for r in self.rows]

    def write(self, setup: Setup, name: str, **extra: Any) -> tuple[Path, Path]:
        """``<out>/<name>_<sim|real>.csv`` and ``.json``; returns both paths."""
        setup.out.mkdir(parents=True, exist_ok=True)
        stem = f"{name}_{'real' if setup.real else 'sim'}"
        csv_path, json_path = setup.out / f"{stem}.csv", setup.out / f"{stem}.json"
        with csv_path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(self.columns)
            w.writerows([["" if c is None else c for c in r] for r in self.rows])
        doc = {"title": self.title, "setup": setup.meta(), "columns": self.columns, "rows": self.records(),
               "notes": self.notes, **extra}
        json_path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        return csv_path, json_path


def save_plot(setup: Setup, name: str, draw: Callable[[Any], None], *, size: tuple[float, float] = (6.4, 3.6)) -> Path | None:
    """Draw with ``draw(ax)`` into ``<out>/<name>_<sim|real>.png`` if matplotlib is installed."""
    if not setup.plot:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot; pip install matplotlib to get one)")
        return None
    setup.out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=size)
    draw(ax)
    ax.set_title(ax.get_title(), fontsize=10)
    fig.tight_layout()
    path = setup.out / f"{name}_{'real' if setup.real else 'sim'}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


class Clock:
    """Wall time of a script, for its last line."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __str__(self) -> str:
        return f"{time.perf_counter() - self.t0:.1f} s"


def finish(setup: Setup, table: Table, name: str, clock: Clock, plot: Path | None, runs: Sequence[Run] = (),
           **extra: Any) -> None:
    """Print the table, write its CSV and JSON (with every run, measured step times included)."""
    if runs:
        extra["runs"] = [asdict(r) for r in runs]
    if setup.real and (load := _load()):
        busy = load[0] > (os.cpu_count() or 1)
        table.notes.append(f"load average at the end {load[0]:.1f} on {os.cpu_count()} CPUs"
                           + (": the machine was busy, rerun when it is quiet" if busy else ""))
    print(table.text())
    csv_path, json_path = table.write(setup, name, elapsed_s=round(time.perf_counter() - clock.t0, 2), **extra)
    print(f"\nwrote {csv_path}, {json_path.name}" + (f", {plot.name}" if plot else "") + f"; {clock}")
