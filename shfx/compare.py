"""The policies side by side: predicted and measured step time, memory and traffic of one GPT.

:func:`compare` builds one GPT, turns it into the step program of every policy
(``shfx.passes.policies``) and, per policy,

- **predicts** (always): the simulator's step time and bottleneck, device memory (the larger
  of the simulated peak and the memory model of ``shfx.cost_model.planner``), host memory (the
  memory model), and the bytes one step moves each way (``Program.bytes_moved``). The costs
  come from a profile of the model on the device (costs do not depend on the policy, so one
  profile serves all), or, with ``hardware=``, from the analytic model of a named profile
  (nothing is built: the model is captured on the meta device, so any size works);
- **measures** (on a device, unless ``measure=False``): a few real training steps after a
  warm-up, the median step time (``cm.engine.step_times``: first forward to the end of
  ``cm.step()``), the backend's device memory peak over the measured steps
  (``cm.backend.peak_bytes``), the bytes copied per step (``cm.backend.bytes_h2d`` /
  ``bytes_d2h``), and host memory (the host store, gradients and host AdamW states). The
  policies' steps are interleaved (one step of each in turn, the order rotating), so load from
  other processes lands on all of them.

A policy that does not fit says why instead of giving numbers: predicted from its device memory
against the device's capacity (and, with a hardware profile, its host memory against the
host's RAM); measured from the :class:`shfx.OutOfDeviceMemory` its run raised.

>>> import shfx
>>> res = shfx.compare(shfx.GPTShape(layers=48, hidden=2048, heads=16, seq=1024, batch=4, vocab=50304),
...                    hardware="V100-32GB-PCIe3")  # doctest: +SKIP
>>> print(res.table())  # doctest: +SKIP
"""

from __future__ import annotations

import csv
import io
import statistics
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from shfx.passes.units import format_bytes, format_seconds

__all__ = ["compare", "CompareResult", "PolicyResult", "Predicted", "Measured"]


@dataclass(frozen=True)
class Predicted:
    """What the cost model says one step of a policy costs.

    Attributes:
        step_s: simulated step time (None when the simulation failed: see ``error``).
        bottleneck: the resource with most critical-path time (``compute``, ``link``, ``host optimizer``).
        device_bytes: device memory the policy needs: the memory model's total
            (``shfx.cost_model.planner``: the memory ledger's peak, and on real hardware the
            CUDA workspace and the working set of the stage being computed on top).
        peak_device_bytes: the simulated peak (the ledger's peak on the timeline; None: the
            simulation failed).
        host_bytes: host memory (``shfx.cost_model.planner``): fp32 weights of every group, plus the
            gradients and AdamW states of the groups updated on the host, staging buffers and
            the pending tied-embedding gradient.
        ssd_bytes: what zero-infinity spills to an SSD (hardware profiles with one; else 0).
        memory: the memory model's terms, ``{"device": {term: bytes}, "host": {...}, "ssd": {...}}``.
        h2d_bytes, d2h_bytes: bytes one step moves each way (the program's copies).
        fits: whether it fits the device (and the host, when its RAM is known).
        reason: why it does not fit, in words (None when it fits).
        error: why the simulation failed, when it did.
    """

    step_s: float | None
    bottleneck: str | None
    device_bytes: int
    peak_device_bytes: int | None
    host_bytes: int
    ssd_bytes: int
    memory: dict[str, dict[str, int]]
    h2d_bytes: int
    d2h_bytes: int
    fits: bool
    reason: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Measured:
    """What running a policy on the device measured.

    Attributes:
        step_s: median of ``step_times_s``.
        step_times_s: every measured step (after the warm-up).
        peak_device_bytes: ``backend.peak_bytes`` over the measured steps.
        host_bytes: the host store (weights, gradients) plus the host AdamW states.
        h2d_bytes, d2h_bytes: bytes copied per step (backend counters over the measured steps / steps).
    """

    step_s: float
    step_times_s: tuple[float, ...]
    peak_device_bytes: int
    host_bytes: int
    h2d_bytes: int
    d2h_bytes: int


@dataclass
class PolicyResult:
    """One policy's row.

    Attributes:
        policy: the policy name (``"stronghold"``, ``"l2l"``, ...).
        label: the row's name, with the window of stronghold (``"stronghold W=2 k=1"``).
        slots: device slots the program uses (window plus persistent stages).
        predicted: the prediction.
        measured: the measurement (None when not measured or it did not fit).
        measure_error: why the run failed (the out-of-memory message), when it did.
    """

    policy: str
    label: str
    slots: int
    predicted: Predicted | None = None
    measured: Measured | None = None
    measure_error: str | None = None

    @property
    def fits(self) -> bool:
        """Measured when the policy ran (or failed to), else predicted."""
        if self.measured is not None:
            return True
        if self.measure_error is not None:
            return False
        return bool(self.predicted and self.predicted.fits)

    @property
    def reason(self) -> str | None:
        """Why the policy does not fit (measured first), else None."""
        if self.fits:
            return None
        return self.measure_error or (self.predicted.reason if self.predicted else None)


@dataclass
class CompareResult:
    """The result of :func:`compare`: one :class:`PolicyResult` per policy.

    ``table()`` formats it, ``to_dict()`` / ``to_csv()`` export it; ``row("l2l")`` gets one.
    """

    model: str
    params: int
    stages: int
    device: str
    capacity_bytes: int | None
    host_capacity_bytes: int | None
    costs: str
    rows: list[PolicyResult]
    steps: int = 0
    warmup: int = 0
    notes: list[str] = field(default_factory=list)
    precision: str = "float32"

    def row(self, name: str) -> PolicyResult:
        """The row of a policy, by label or policy name (the first match)."""
        for r in self.rows:
            if r.label == name:
                return r
        for r in self.rows:
            if r.policy == name:
                return r
        raise KeyError(f"no policy {name!r} in this comparison (have {', '.join(r.label for r in self.rows)})")

    @property
    def measured(self) -> bool:
        return any(r.measured is not None or r.measure_error is not None for r in self.rows)

    # ---- formatting ---------------------------------------------------------------------------
    def table(self) -> str:
        """The comparison as a text table, under a header saying what was compared where; a
        policy that does not fit shows why (in a footnote when only one side says so)."""
        lines = [
            f"{self.model}: {self.params / 1e6:,.2f} M params, {self.stages} stages",
            f"device: {self.device}" + ("" if self.capacity_bytes is not None else " (no memory budget: every policy fits)"),
            f"costs: {self.costs}",
        ]
        measured = self.measured
        halves_head = [["step", "bound", "device", "host", "h2d/step", "d2h/step"]]
        if measured:
            halves_head.append(["step", "device", "host", "h2d/step", "d2h/step"])
        notes: list[str] = []

        def note(text: str) -> str:
            notes.append(text)
            return f"does not fit [{len(notes)}]"

        # a row: (label, halves) where a half is a list of cells or one string spanning the half,
        # or (label, text) for a policy that fits nowhere
        body: list[tuple[str, list[list[str] | str] | str]] = []
        for r in self.rows:
            p, m = r.predicted, r.measured
            if not r.fits and not (p is not None and p.fits):
                body.append((r.label, f"does not fit: {r.reason}"))
                continue
            halves: list[list[str] | str] = []
            if p is None:
                halves.append("n/a")
            elif not p.fits:
                halves.append(note(f"{r.label}, predicted: {p.reason}"))
            else:
                step = format_seconds(p.step_s) if p.step_s is not None else "n/a"
                dev = format_bytes(p.device_bytes)
                halves.append([step, p.bottleneck or "n/a", dev, format_bytes(p.host_bytes), format_bytes(p.h2d_bytes), format_bytes(p.d2h_bytes)])
                if p.error:
                    notes.append(f"{r.label}, predicted: the simulation failed: {p.error}")
            if measured:
                if m is not None:
                    halves.append([format_seconds(m.step_s), format_bytes(m.peak_device_bytes), format_bytes(m.host_bytes),
                                   format_bytes(m.h2d_bytes), format_bytes(m.d2h_bytes)])
                elif r.measure_error is not None:
                    halves.append(note(f"{r.label}, measured: {r.measure_error}"))
                else:
                    halves.append("not run")
            body.append((r.label, halves))

        label_w = max(len("policy"), *(len(lab) for lab, _ in body))
        widths: list[list[int]] = []
        for h, head in enumerate(halves_head):
            cells = [hv[h] for _, hv in body if isinstance(hv, list) and isinstance(hv[h], list)]
            w = [max(len(head[i]), *(len(c[i]) for c in cells)) for i in range(len(head))]
            spans = [len(hv[h]) for _, hv in body if isinstance(hv, list) and isinstance(hv[h], str)]
            total = sum(w) + 2 * (len(w) - 1)
            w[-1] += max(0, max(spans, default=0) - total)  # a spanning cell fits in its half
            widths.append(w)

        def half_width(h: int) -> int:
            return sum(widths[h]) + 2 * (len(widths[h]) - 1)

        def fmt_half(h: int, cells: list[str] | str) -> str:
            if isinstance(cells, str):
                return cells.ljust(half_width(h))
            return "  ".join(c.rjust(w) if h or i != 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths[h])))

        titles = ["predicted"]
        if measured:
            titles.append(f"measured, median of {self.steps} steps" if self.steps else "measured")
        lines.append("")
        lines.append(" " * label_w + "  " + "   ".join(f" {t} ".center(half_width(h), "-") for h, t in enumerate(titles)))
        lines.append(("policy".ljust(label_w) + "  " + "   ".join(fmt_half(h, hd) for h, hd in enumerate(halves_head))).rstrip())
        for label, hv in body:
            if isinstance(hv, str):
                width = max(80, label_w + 2 + sum(half_width(h) + 3 for h in range(len(halves_head))))
                lines += textwrap.wrap(f"{label.ljust(label_w)}  {hv}", width, subsequent_indent=" " * (label_w + 2))
            else:
                lines.append((label.ljust(label_w) + "  " + "   ".join(fmt_half(h, c) for h, c in enumerate(hv))).rstrip())
        if notes or self.notes:
            lines.append("")
            for i, t in enumerate(notes, 1):
                lines += textwrap.wrap(f"[{i}] {t}", 100, subsequent_indent="    ")
            lines += self.notes
        return "\n".join(lines)

    __str__ = table

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain JSON-able values."""
        out = {k: v for k, v in asdict(self).items() if k != "rows"}
        out["rows"] = []
        for r in self.rows:
            d = asdict(r)
            d["fits"] = r.fits
            d["reason"] = r.reason
            if d["measured"] is not None:
                d["measured"]["step_times_s"] = list(d["measured"]["step_times_s"])
            out["rows"].append(d)
        return out

    def to_csv(self) -> str:
        """One line per policy: ``policy, label, fits, reason, pred_*, meas_*`` (bytes, seconds)."""
        cols = [
            "policy", "label", "slots", "fits", "reason",
            "pred_step_s", "pred_bottleneck", "pred_device_bytes", "pred_host_bytes", "pred_h2d_bytes", "pred_d2h_bytes",
            "meas_step_s", "meas_peak_device_bytes", "meas_host_bytes", "meas_h2d_bytes", "meas_d2h_bytes",
        ]  # fmt: skip
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(cols)
        for r in self.rows:
            p, m = r.predicted, r.measured
            w.writerow(
                [r.policy, r.label, r.slots, r.fits, r.reason or ""]
                + ([p.step_s, p.bottleneck, p.device_bytes, p.host_bytes, p.h2d_bytes, p.d2h_bytes] if p else [""] * 6)
                + ([m.step_s, m.peak_device_bytes, m.host_bytes, m.h2d_bytes, m.d2h_bytes] if m else [""] * 5)
            )
        return buf.getvalue()


# ---- building programs -----------------------------------------------------------------------


def _configure(policy: Any, window: int | str, resident_first: int) -> Any:
    """A policy object from a name (or an object) with stronghold's window and k applied where
    the policy has them."""
    from shfx.passes.policies import make_policy

    pol = make_policy(policy)
    opts = pol.options()
    if "window" in opts and isinstance(policy, str):
        pol = pol.replace(window=window)
    if "resident_first" in opts and isinstance(policy, str):
        pol = pol.replace(resident_first=resident_first)
    return pol


def _label(policy: Any, program: Any) -> str:
    """The row's name: the policy's, with stronghold's window and k."""
    if policy.name != "stronghold":
        return policy.name
    k = len(program.persistent)
    return f"stronghold W={program.num_slots - k}" + (f" k={k}" if policy.resident_first else "")


def _terms(terms: dict[str, int]) -> str:
    return ", ".join(f"{k} {format_bytes(v)}" for k, v in terms.items() if v)


def _predict(
    program: Any,
    costs: Any,
    memory: Any,
    *,
    capacity_bytes: int | None,
    host_capacity_bytes: int | None,
    rollback: bool = False,
) -> Predicted:
    """Simulate ``program`` with ``costs`` (``rollback``: with the step journal's copies);
    ``memory`` is its :class:`shfx.cost_model.planner.MemoryBreakdown`."""
    from shfx.cost_model.simulate import simulate

    moved = program.bytes_moved()
    step_s = bottleneck = peak = error = None
    try:
        tl = simulate(program, costs, rollback=rollback)
        step_s, bottleneck, peak = tl.step_s, tl.bottleneck, tl.peak_device_bytes
    except Exception as e:  # noqa: BLE001 - a policy the simulator cannot run still gets its memory and traffic
        error = f"{type(e).__name__}: {e}"
    device = memory.device_total
    reasons = []
    if capacity_bytes is not None and device > capacity_bytes:
        reasons.append(
            f"needs {format_bytes(device)} of device memory ({_terms(memory.device)}), the device has "
            f"{format_bytes(capacity_bytes)}"
        )
    if host_capacity_bytes is not None and memory.host_total > host_capacity_bytes:
        reasons.append(
            f"needs {format_bytes(memory.host_total)} of host memory ({_terms(memory.host)}), the host has "
            f"{format_bytes(host_capacity_bytes)}"
        )
    return Predicted(
        step_s=step_s,
        bottleneck=bottleneck,
        device_bytes=device,
        peak_device_bytes=peak,
        host_bytes=memory.host_total,
        ssd_bytes=memory.ssd_total,
        memory={"device": dict(memory.device), "host": dict(memory.host), "ssd": dict(memory.ssd)},
        h2d_bytes=moved["h2d"],
        d2h_bytes=moved["d2h"],
        fits=not reasons,
        reason="; ".join(reasons) or None,
        error=error,
    )


# ---- measuring -------------------------------------------------------------------------------


class _Run:
    """One policy's compiled model, stepped in turn with the others."""

    def __init__(self, row: PolicyResult, cm: Any, x: Any, y: Any):
        self.row, self.cm, self.x, self.y = row, cm, x, y
        self.times: list[float] = []
        self.h2d = self.d2h = 0
        self.error: str | None = None

    def step(self, measure: bool) -> None:
        from .errors import OutOfDeviceMemory

        if self.error is not None:
            return
        b = self.cm.backend
        h0, d0 = b.bytes_h2d, b.bytes_d2h
        try:
            self.cm(self.x, self.y).backward()
            self.cm.step()
        except OutOfDeviceMemory as e:
            self.error = str(e)
            self.close()
            return
        if measure:
            self.times.append(self.cm.engine.step_times[-1])
            self.h2d += b.bytes_h2d - h0
            self.d2h += b.bytes_d2h - d0
        self.cm.zero_grad()

    def result(self) -> Measured | None:
        if self.error is not None or not self.times:
            return None
        b, n = self.cm.backend, len(self.times)
        opt = self.cm.engine.optimizer
        states = sum(
            t.numel() * t.element_size()
            for st in (opt.state.values() if opt is not None else ())
            for t in (st.exp_avg, st.exp_avg_sq, st.max_exp_avg_sq)
            if t is not None
        )
        return Measured(
            step_s=statistics.median(self.times),
            step_times_s=tuple(self.times),
            peak_device_bytes=b.peak_bytes,
            host_bytes=self.cm.stats()["host_bytes"] + states,
            h2d_bytes=round(self.h2d / n),
            d2h_bytes=round(self.d2h / n),
        )

    def close(self) -> None:
        if self.cm is not None:
            _close(self.cm)
            self.cm = None


def _close(cm: Any) -> None:
    """Close a compiled model (its stream threads are joined: a short-lived ``shfx compare``
    exits cleanly)."""
    cm.close()


def _available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _resolve_device(device: Any) -> Any:
    import torch

    from .devices import CudaDevice, EmulatedDevice

    if device is None:
        return CudaDevice() if torch.cuda.is_available() else EmulatedDevice()
    if isinstance(device, str):
        if device == "emulated":
            return EmulatedDevice()
        d = torch.device(device)
        if d.type == "cuda":
            return CudaDevice(index=d.index or 0)
        raise ValueError(f"device must be 'emulated', 'cuda', 'cuda:N', an EmulatedDevice or a CudaDevice, got {device!r}")
    if not isinstance(device, (EmulatedDevice, CudaDevice)):
        raise TypeError(f"device must be an EmulatedDevice or a CudaDevice, got {type(device).__name__}")
    return device


def _unbudgeted(device: Any) -> Any:
    """The same device without its memory budget, to profile costs whatever fits."""
    from dataclasses import replace

    from .devices import EmulatedDevice

    if isinstance(device, EmulatedDevice):
        return replace(device, memory="1TiB")  # accounting only: emulated memory is host RAM used on demand
    return replace(device, memory=None)


# ---- the comparison --------------------------------------------------------------------------


def compare(
    shape: Any,
    *,
    policies: Sequence[Any] | None = None,
    window: int | str = 2,
    resident_first: int = 0,
    hardware: Any = None,
    device: Any = None,
    measure: bool = True,
    steps: int = 3,
    warmup: int = 1,
    interleave: bool = True,
    lr: float = 1e-4,
    seed: int = 0,
) -> CompareResult:
    """Compare the policies on one GPT: predicted everywhere, measured where it runs.

    Args:
        shape: the GPT and its batch (:class:`shfx.GPTShape`; ``shfx.models.GPT``, tied embedding),
            and its ``precision``: fp32, or bf16/fp16 mixed precision (predicted with 16-bit
            copies and rates, fp16 with the step journal's rollback copies; run with
            ``shfx.compile(precision=...)``).
        policies: policy names or ``shfx.Policy`` objects, in table order (default: every
            registered policy, :func:`shfx.passes.policies.policy_names`).
        window: stronghold's window (int), or ``"auto"``: the tuner's choice from the predicted
            costs (``shfx.cost_model.tune.tune_window``), for policies given by name; the other
            policies have a fixed slot count.
        resident_first: stronghold's first k stages resident with their optimizer on the device
            (for a policy given by name).
        hardware: a profile name (``"V100-32GB-PCIe3"``) or ``shfx.cost_model.hardware.Hardware``:
            predict with the analytic model, nothing is built or run (any size).
        device: where to profile and measure (``shfx.EmulatedDevice(...)``, ``shfx.CudaDevice``,
            ``"emulated"``, ``"cuda"``; default CUDA when available, else emulated). Ignored with
            ``hardware``.
        measure: run ``warmup`` + ``steps`` training steps per policy (False: predict only, from
            the profile).
        interleave: step the policies in turn (needs every policy's model in host memory at
            once; when that does not fit in the available RAM they run one after the other).
        lr, seed: AdamW learning rate; seed of the weights and the batch.

    Returns:
        a :class:`CompareResult`.

    >>> import shfx
    >>> res = shfx.compare(shfx.GPTShape(layers=2, hidden=32, heads=2, seq=16, batch=2),
    ...                    device=shfx.EmulatedDevice(memory="64MiB", h2d="1GB/s", d2h="1GB/s"))  # doctest: +SKIP
    >>> res.row("stronghold").measured.step_s  # doctest: +SKIP
    0.0123
    """
    import torch

    from shfx.cost_model.planner import Target, as_target, memory_for_model, memory_model
    from shfx.cost_model.shapes import GPTShape, short_precision

    from .commands import precision_kwargs
    from shfx.passes.schedule import check_window

    from .devices import EmulatedDevice

    from shfx.passes.policies import policy_names

    policies = list(policy_names() if policies is None else policies)
    if not policies:
        raise ValueError("policies must name at least one policy")
    if isinstance(resident_first, bool) or not isinstance(resident_first, int) or resident_first < 0:
        raise ValueError(f"resident_first must be an int >= 0, got {resident_first!r}")
    if window != "auto":
        check_window(window, 1 << 30)
    configured = [_configure(p, window, resident_first) for p in policies]
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    if not isinstance(shape, GPTShape):
        raise TypeError(f"compare() takes a shfx.GPTShape (layers, hidden, heads, seq, batch, vocab), got {shape!r}")
    cfg = shape
    model_name = (
        f"GPT {shape.layers} layers, hidden {shape.hidden}, heads {shape.heads}, seq {shape.seq}, batch {shape.batch}, "
        f"vocab {shape.vocab}"
    )
    rollback = shape.rollback_default
    if shape.mixed:
        model_name += f", {short_precision(shape.precision)}" + (" (rollback copies)" if rollback else "")

    def make_inputs() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g)
        return x, torch.roll(x, -1, dims=1)

    notes: list[str] = []
    if hardware is not None:
        from shfx.cost_model.hardware import get_profile

        from .commands import gpt_plan_inputs

        hw = get_profile(hardware)
        specs, costs = gpt_plan_inputs(shape, hw)
        capacity, host_capacity, where, source = hw.device_memory_bytes, hw.host_memory_bytes, hw.describe(), costs.source
        params = cfg.num_params()
        measure = False
        device_obj = None
        def memory(policy: Any) -> Any:
            return memory_model(policy, shape, hw)
    else:
        compile_kw = precision_kwargs(shape.precision)
        device_obj = _resolve_device(device)
        params = cfg.num_params()
        avail = _available_host_bytes()
        need = 20 * params  # weights, gradients, AdamW states and a little more, per model in memory
        if avail is not None and need > avail:
            raise ValueError(
                f"the model ({params / 1e6:,.0f} M params) needs about {format_bytes(need)} of host memory to profile "
                f"and run, and {format_bytes(avail)} is available; predict it with hardware=... (--hardware) instead"
            )
        if measure and interleave and avail is not None and need * len(policies) > avail:
            interleave = False
            notes.append("policies ran one after the other: their models do not fit in host memory together")
        graph, costs = _profile(device_obj, cfg, make_inputs, lr, seed, compile_kw)
        specs = graph.specs
        capacity = device_obj.memory_bytes
        if capacity is None:  # a CudaDevice without a budget: the card's memory
            capacity = torch.cuda.get_device_properties(device_obj.index).total_memory
        host_capacity = None
        where, source = str(device_obj), costs.source
        target = as_target(device_obj) if isinstance(device_obj, EmulatedDevice) else Target(where, capacity)

        def memory(policy: Any) -> Any:
            return memory_for_model(policy, None, (), target, graph=graph, precision=shape.precision)

    rows: list[PolicyResult] = []
    programs: dict[str, Any] = {}
    on_device: list[str] = []  # 16-bit: policies updating on the device, which shfx.compile does not run yet
    for pol in configured:
        if pol.auto:
            pol, why = _auto_window(specs, costs, pol, capacity, rollback)
            if why:
                notes.append(f"{pol.name}: {why}")
        program = pol.program(specs)
        row = PolicyResult(pol.name, _label(pol, program), program.num_slots)
        row.predicted = _predict(
            program, costs, memory(pol), capacity_bytes=capacity, host_capacity_bytes=host_capacity, rollback=rollback
        )
        rows.append(row)
        programs[row.label] = pol
        if shape.mixed and program.device_groups():
            on_device.append(row.label)
    if on_device:
        notes.append(
            f"{', '.join(on_device)}: update{'s' if len(on_device) == 1 else ''} parameter groups on the device, which "
            f"shfx.compile(precision={short_precision(shape.precision)!r}) does not run yet: predicted only"
        )
    if measure:
        runnable = [r for r in rows if r.label not in on_device]
        _measure(runnable, programs, device_obj, cfg, make_inputs, lr, seed, steps, warmup, interleave, compile_kw)
    return CompareResult(
        model=model_name,
        params=params,
        stages=len(specs),
        device=where,
        capacity_bytes=capacity,
        host_capacity_bytes=host_capacity,
        costs=source,
        rows=rows,
        steps=steps if measure else 0,
        warmup=warmup if measure else 0,
        notes=notes,
        precision=shape.precision,
    )


def _auto_window(specs, costs, policy, capacity, rollback: bool = False) -> tuple[Any, str]:
    """The tuner's choice for ``policy``'s ``"auto"`` fields from the predicted costs."""
    from shfx.cost_model.tune import NoWindowFits, tune_window

    try:
        t = tune_window(specs, costs, capacity_bytes=capacity, policy=policy, rollback=rollback)
    except NoWindowFits:
        return policy.replace(window=1, **({"resident_first": 0} if policy.resident_first == "auto" else {})), "no window fits the device; showing W=1"
    return t.policy, f"window {t.window} chosen by the tuner"


def _profile(device: Any, cfg: Any, make_inputs: Callable, lr: float, seed: int, compile_kw: dict | None = None) -> tuple[Any, Any]:
    """The partitioned GPT (a ``StageGraph``) and its costs profiled on ``device`` without its
    memory budget (costs do not depend on the policy, and a policy that does not fit is still
    predicted)."""
    import torch

    import shfx

    from .models import GPT
    from .profiler import profile_costs

    torch.manual_seed(seed)
    cm = shfx.compile(GPT(cfg), device=_unbudgeted(device), policy=shfx.Stronghold(window=2), optimizer=shfx.optim.AdamW(lr=lr),
                      **(compile_kw or {}))  # fmt: skip
    try:
        x, y = make_inputs()
        cm(x, y).backward()
        cm.step()
        cm.zero_grad()
        costs = profile_costs(cm.engine, cm.variant, [x, y])
        graph = cm.stages
    finally:
        _close(cm)
    return graph, costs


def _measure(rows, programs, device, cfg, make_inputs, lr, seed, steps, warmup, interleave, compile_kw=None) -> None:
    import gc

    import torch

    import shfx

    from .errors import OutOfDeviceMemory
    from .models import GPT

    x, y = make_inputs()

    def start(row: PolicyResult) -> _Run | None:
        torch.manual_seed(seed)
        try:
            cm = shfx.compile(GPT(cfg), device=device, policy=programs[row.label], optimizer=shfx.optim.AdamW(lr=lr),
                              **(compile_kw or {}))  # fmt: skip
        except OutOfDeviceMemory as e:
            row.measure_error = str(e)
            return None
        run = _Run(row, cm, x, y)
        for _ in range(max(1, warmup)):  # the first step captures (and loads persistent stages)
            run.step(measure=False)
        if run.error is None:
            run.cm.backend.reset_peak()
        return run

    def finish(run: _Run) -> None:
        run.row.measured = run.result()
        run.row.measure_error = run.error
        run.close()

    runs: list[_Run] = []
    try:
        if interleave:
            runs += [r for r in (start(row) for row in rows) if r is not None]
            for i in range(steps if runs else 0):
                for run in runs[i % len(runs) :] + runs[: i % len(runs)]:  # a rotating order
                    run.step(measure=True)
            for run in runs:
                finish(run)
        else:
            for row in rows:
                run = start(row)
                if run is not None:
                    runs.append(run)
                    for _ in range(steps):
                        run.step(measure=True)
                    finish(run)
                    gc.collect()
    finally:
        for run in runs:
            run.close()
