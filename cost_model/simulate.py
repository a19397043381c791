"""Discrete-event simulation of a step program: when each action runs, what it overlaps with,
how much device memory the step needs, and which resource bounds the step time.

The simulator mirrors how :class:`shfx.runtime.engine.Engine` executes a program:

- **Issue order.** ``program.nodes`` is issue order. Every stream runs its actions in that
  order, one at a time: ``compute`` (FORWARD, BACKWARD), ``h2d`` (PREFETCH, and activation
  offload's FETCH_ACTIVATIONS), ``d2h`` (OFFLOAD_BUFFERS, the copy part of OFFLOAD_GRAD, activation
  offload's OFFLOAD_ACTIVATIONS) and ``host`` (the accumulation part of OFFLOAD_GRAD). An action starts when its stream is free *and* every dependency
  (:meth:`shfx.passes.program.Program.deps`) is done, so an action whose dependencies are done still
  waits behind the previous action of its stream (a ``WorkerStream``).
- **The host optimizer** (``cpu``) is a pool of ``costs.optimizer_workers`` workers. Workers take
  CPU_STEP tasks in issue order; a worker that took a task waits for its dependencies and then
  runs it, so a task still waiting blocks its worker (a ``PoolStream``).
- **RELEASE** takes no time and is done when every dependency has finished *reading* the slot.
  OFFLOAD_GRAD has two parts, as in the runtime: the d2h copy (its end is the "reads done" a
  RELEASE waits for) and then the accumulation on one host FIFO (``accumulate_s`` of the stage
  when ``accumulate=True``, else 0); the OFFLOAD_GRAD is done, for a CPU_STEP, when that ends.
- **Updates in the next forward** (exact gradient clipping, ``Stronghold(deferred_update=True)``
  and the like: updates in phase ``"next-forward"``). The simulated step is the steady state
  (:func:`shfx.passes.schedule.steady_state_program`): the previous step's updates start at
  time 0 on the ``cpu`` pool (``step()`` started them as it returned), each PREFETCH waits for
  the updates of the groups it reads, and this step's own updates are left out (they overlap
  the next step). ``step_s`` is then the period of a training loop. A GRAD_NORM ``GN g`` takes
  :data:`GRAD_NORM_RATIO` x the group's ``update_s`` (it reads the fp32 gradient once; the
  update moves ~10x the bytes); one of a group updated on the device (``meta.device``: on the
  compute stream, charged to ``compute``) :data:`DEVICE_GRAD_NORM_RATIO` x its
  ``device_update_s``, and the deferred ``DU g`` of the previous step run first on the compute
  stream, each persistent stage's FORWARD after the update of the groups it reads.
- **Phases.** The runtime issues the backward phase only after every forward-phase action has
  finished (``Engine.forward`` waits for them before returning), so backward-phase actions start
  no earlier than the end of the forward phase (``phase_barrier=True``, the default).
- **Durations.** FORWARD: ``forward_s``. BACKWARD: ``backward_no_recompute_s`` when the stage's
  FORWARD before it in this program kept its graph (``meta.keep_graph``), else ``backward_s``.
  CPU_STEP ``U g``: ``update_s`` of the stage whose ``update_group`` is ``g``; SNAPSHOT
  ``SN g`` (rollback: the step journal's copy of the group before its update, on the same pool):
  :meth:`shfx.cost_model.costs.StageCost.rollback_copy_s`; DEVICE_STEP
  ``DU g`` (on the compute stream): its ``device_update_s``. OFFLOAD_PARAMS (``OP``) is a d2h
  copy of the owner's updated parameters; a refreshing PREFETCH of a persistent stage is an
  h2d copy like any other (it does not count as a new resident stage). Copies move
  ``meta.bytes`` over ``costs.links``: a copy of ``n > 0`` bytes first pays ``latency_s``, then
  moves its bytes at the link's rate; ``None`` bandwidth (or 0 bytes) is instantaneous.
- **Links are a fluid model.** While transfers in both directions are moving bytes, each goes at
  ``duplex`` times its bandwidth; rates change whenever a transfer starts or ends moving bytes,
  so a copy's duration depends on what it overlaps with (the emulated backend's pacing).
- **The NVMe tier** (programs with ``SR``/``SW``): reads and write-backs run on two FIFO
  queues, ``ssd_read`` and ``ssd_write``, one transfer each at a time, charged to the ``ssd``
  resource; a transfer pays ``links.ssd_latency_s`` and moves ``meta.bytes`` at
  ``ssd_read_bps``/``ssd_write_bps``, both at ``ssd_duplex`` times their rate while the other
  queue also moves bytes (the same fluid model as the link, on its own). A CPU_STEP of an SSD
  group waits for its read, the write-back for the update, a read for the write-back that freed
  its host-window buffer (the program's edges). Activations on the SSD (``AW``/``AR``,
  ``Offload(activations="nvme")``) share these two queues, in issue order: an ``AW`` moves the
  stage's offloaded bytes after its ``AO``, an ``AR`` before its ``AF``, each ``AO``/``AR`` waiting
  for the action that emptied its window buffer.
- **Data parallel** (``program.ranks = N > 1``): the collectives run on two FIFO queues,
  ``reduce`` (``RS g``) and ``gather`` (``AG g``), one collective each at a time, charged to the
  ``network`` resource. A collective of ``meta.bytes`` ``B`` is a ring
  (:func:`shfx.cost_model.costs.ring_collective_s`): it pays ``(N - 1) x links.net_latency_s``,
  then moves ``(N - 1) / N x B`` at ``links.net_bps`` (the ring's slowest link), each queue at
  ``links.net_duplex`` times that rate while the other also moves bytes (the two share the
  NIC, as the SSD's two queues share the drive). ``RS g`` waits for the OG of every stage
  sending gradients to ``g``, ``U g`` for ``RS g``, ``AG g`` for ``U g``, a PREFETCH for the
  ``AG`` of each group it reads (the program's edges). Every rank runs the same program on the
  same costs: the simulated step is any rank's.
- **Memory.** The slot pool, ``sum(program.slot_sizes())`` (each slot sized to the largest stage
  the program puts into it), the gradient buffers of slots whose stage keeps its parameters
  through the backward and the optimizer states of groups updated on the device
  (:meth:`shfx.passes.program.Program.static_device_bytes`) are constant. Each stage's
  ``activation_bytes`` is allocated at the end of its FORWARD and freed at the end of the
  BACKWARD of its earliest consumer (its own BACKWARD when nothing consumes it); when a
  consumer's BACKWARD ends, a gradient of the producer's ``activation_bytes`` is allocated (once
  per producer, at the first consumer's end) and freed at the end of the producer's BACKWARD.
  A borrowed gradient of a group updated on the device (the tail's tied embedding, when the
  head is) is allocated at the end of the borrower's BACKWARD and freed at the end of the
  owner's. At one instant, changes apply in issue order of the actions causing them, and within one
  BACKWARD's end the new input gradients are allocated before its output gradients and its
  inputs are freed (as ``Engine._backward`` does), so the peak counts both. Programs without any
  BACKWARD (inference) free a value once all its consumers' FORWARDs ended; a program without
  FORWARDs (the cold backward) starts with the activations its BACKWARDs need already allocated.
  Stages are *resident* from the start of their PREFETCH to the end of their RELEASE.

Measured overheads (optional attributes of the cost model, see :class:`shfx.cost_model.costs.CostTable`):
``dispatch_s`` is added to every FORWARD, BACKWARD and CPU_STEP (the hand-off between threads),
``phase_gap_s`` separates the forward and backward phases (returning from the model call, the
loss, ``backward()``), a compute action that starts after ``cold_idle_s`` with nothing
starting or ending costs its ``*_cold_s`` (on the emulated device an idle processor runs the
next action ~1.5x slower), and with ``cpu_contention = k > 0`` each compute action is stretched
by ``k`` x the host CPU work overlapping it (the memcpy part of copies at ``memcpy_bps``, host
updates and gradient adds), iterated to a fixed point: on the emulated device all of them share
the same cores.

What it does NOT model:

- On the emulated device, compute, copies and the host optimizer share the same CPU cores (the
  simulator treats them as independent resources), and its copies take at least a real memcpy.
- Kernel launch latency, Python issue overhead of the interpreter, autograd bookkeeping, and the
  time between the forward and the backward phase (the loss, user code).
- Allocator behaviour: fragmentation, caching, alignment; temporaries inside one stage's
  computation; the autograd graph a FORWARD with ``keep_graph`` holds; staging buffers; the
  gradient of the model's outputs handed to ``backward()``; the model's inputs on the device.
  (The runtime also keeps the model's outputs until the backward ends; here a stage nothing
  consumes frees its activations at the end of its own BACKWARD.)
- Gradient accumulation decisions per micro-batch (whether an OG copies straight into the
  gradient buffer or through a staging buffer is not known here: ``accumulate`` is all or none),
  and the micro-steps of ``grad_accum_steps > 1`` (one step is simulated). The step phase is:
  its actions (``CK0``, and with ``overlap_update=False`` every update: the updates-in-step
  pass) start once the backward's non-update actions are done (``step()`` is called after
  ``loss.backward()`` returned).
- Pinned vs pageable host memory, PCIe/NVLink topology, several copies per PREFETCH (one per
  host group region: modelled as one copy of ``meta.bytes``), and copy/compute interference on
  a real GPU's memory bandwidth.
- ``meta.cost_s`` annotations: durations always come from ``costs``.
- On the NVMe tier: the queue depth (``links.ssd_queue_depth``: the bandwidth figures are those
  reached at it), the page cache, the host memory bandwidth the copies into the host-window
  buffers take from the host optimizer, and the file system.
- With data parallel: ranks that differ (stragglers), gloo's host-side memcpy and reduction
  arithmetic, the topology beyond the ring's slowest link (a tree, several rings, NVLink), and
  the host memory bandwidth the collectives take from the host optimizer.
- The rollback copy of a group updated on the device (its slot weights and states copied to
  the host before a DEVICE_STEP): with ``rollback`` only host updates pay for their copies.

>>> from shfx.passes.stages import chain
>>> from shfx.passes.schedule import schedule_window
>>> from shfx.cost_model.costs import CostTable, Links, StageCost
>>> costs = CostTable([StageCost(1.0, 3.0, update_s=0.5)] * 4, Links(1e6, 1e6))
>>> tl = simulate(schedule_window(chain(4, prefetch_bytes=500_000), 2), costs)
>>> round(tl.step_s, 3), tl.bottleneck, tl.peak_resident
(16.5, 'compute', 2)
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from shfx.passes.features import ROLLBACK
from shfx.passes.meta import get_meta
from shfx.passes.actions import AR, AW, CK, KINDS, NR, RESOURCES, SN, STREAMS, US
from shfx.passes.ledger import Ledger, replay
from shfx.passes.program import B, F, GN, PF, R, ActionKind, ActionMeta, Program
from shfx.passes.schedule import steady_state_program
from shfx.passes.stages import StageSpec
from shfx.passes.units import format_bytes, format_seconds

from .costs import ROLLBACK_COPY_RATIO, CostModel, Links, StageCost
from .trace import Event

__all__ = [
    "simulate", "Timeline", "Event", "SimulationError", "RESOURCES", "STREAM_ORDER", "GRAD_NORM_RATIO",
    "DEVICE_GRAD_NORM_RATIO",
]  # fmt: skip

GRAD_NORM_RATIO = 0.1
"""A GRAD_NORM's duration as a fraction of its group's ``update_s``: it reads 4 bytes a parameter
(the fp32 host gradient), the update moves 40 (:func:`shfx.cost_model.costs.host_update_bytes`)."""

DEVICE_GRAD_NORM_RATIO = 4 / 28
"""A GRAD_NORM of a group updated on the device (``meta.device``: exact clipping with
``Resident`` or ``Stronghold(resident_first=k)``), on the compute stream, as a fraction of the
group's ``device_update_s``: the norm reads the 4-byte gradient once, the device AdamW reads and
writes 28 bytes a parameter (parameter, m and v read and written, the gradient read; the
analytic model's ``device_update_s`` is those bytes over the device's memory bandwidth)."""


_SSD = ("ssd_read", "ssd_write")
_NET = ("reduce", "gather")
_COPY_STREAMS = ("h2d", "d2h", *_SSD, *_NET)

STREAM_ORDER = STREAMS
"""The simulated streams (:data:`shfx.passes.actions.STREAMS`)."""
_EPS = 1e-12


class SimulationError(ValueError):
    """A program or cost model the simulator cannot run."""


@dataclass
class Timeline:
    """The result of :func:`simulate`.

    Attributes:
        program: the simulated program's name.
        events: one :class:`Event` per action, in issue order.
        step_s: the makespan: the end of the last action (updates included).
        busy_s: seconds each stream was busy (``cpu``: summed over workers; ``host``: gradient
            accumulation; ``none``: always 0).
        utilisation: ``busy_s / step_s`` (``cpu``: over ``step_s * workers``).
        workers: host optimizer workers simulated.
        slot_bytes: the constant slot pool, ``sum(program.slot_sizes())``.
        grad_buffer_bytes: device gradient buffers (``sum(program.grad_buffer_sizes())``: slots
            whose stage keeps its parameters through the backward), constant.
        device_state_bytes: optimizer states on the device (``program.device_state_bytes()``),
            constant.
        peak_device_bytes: the peak of :attr:`memory`.
        memory: ``(time, bytes)`` steps of device memory, slot pool included; several entries
            may share a time (changes at one instant, applied in order).
        peak_resident: the most stages resident at once.
        resident: ``(time, stages resident)`` steps.
        critical_path: the chain of events that determined ``step_s``, in time order.
        by_resource: seconds of the critical path per resource (:data:`RESOURCES` and ``"idle"``);
            they sum to ``step_s``.
        bottleneck: the resource with the most critical-path time.
    """

    program: str
    events: list[Event]
    step_s: float
    busy_s: dict[str, float]
    utilisation: dict[str, float]
    workers: int
    slot_bytes: int
    peak_device_bytes: int
    memory: list[tuple[float, int]]
    peak_resident: int
    resident: list[tuple[float, int]]
    critical_path: list[Event]
    by_resource: dict[str, float]
    bottleneck: str
    accumulate: bool = False
    grad_buffer_bytes: int = 0
    device_state_bytes: int = 0
    ledger: Ledger | None = field(default=None, repr=False, compare=False)
    _by_action: dict[str, list[Event]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for e in self.events:
            self._by_action.setdefault(e.action, []).append(e)

    # ---- reading -------------------------------------------------------------------------
    def event(self, action: str, phase: str | None = None, occurrence: int = 0) -> Event:
        """The event of an action string (``"F3"``); ``occurrence`` picks a repeated one (a
        stage prefetched twice has ``PF3`` twice), ``phase`` restricts the search first."""
        found = [e for e in self._by_action.get(action, []) if phase is None or e.phase == phase]
        if len(found) <= occurrence:
            where = f"occurrence {occurrence}" + (f", phase {phase}" if phase else "")
            raise KeyError(f"{action} ({where}) is not in program {self.program!r}")
        return found[occurrence]

    def stream_events(self, stream: str) -> list[Event]:
        return [e for e in self.events if e.stream == stream]

    # ---- export --------------------------------------------------------------------------
    def to_chrome_trace(self) -> dict[str, Any]:
        """The timeline in Chrome's trace event format (open in https://ui.perfetto.dev or
        chrome://tracing): one track per stream (one per worker of a multi-worker ``cpu``
        pool, so its slices nest), complete ("X") events with ``bytes`` and ``phase`` args,
        and a ``device memory`` counter track. Times are microseconds."""
        pid = 1
        tracks: list[str] = ["compute", "h2d", "d2h", "host"]
        tracks += ["cpu"] if self.workers == 1 else [f"cpu #{w}" for w in range(self.workers)]
        tracks.append("none")
        tracks += [t for t in (*_SSD, *_NET) if any(e.stream == t for e in self.events)]
        tid = {name: i + 1 for i, name in enumerate(tracks)}
        out: list[dict[str, Any]] = [
            {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"shfx simulated step: {self.program}"}}
        ]
        for name, t in tid.items():
            label = "none (releases)" if name == "none" else name
            out.append({"ph": "M", "pid": pid, "tid": t, "name": "thread_name", "args": {"name": label}})
            out.append({"ph": "M", "pid": pid, "tid": t, "name": "thread_sort_index", "args": {"sort_index": t}})

        def x(name: str, track: str, start: float, end: float, args: dict[str, Any], cat: str) -> None:
            out.append(
                {
                    "ph": "X",
                    "pid": pid,
                    "tid": tid[track],
                    "name": name,
                    "cat": cat,
                    "ts": start * 1e6,
                    "dur": max(0.0, end - start) * 1e6,
                    "args": args,
                }
            )

        for e in self.events:
            args = {"bytes": e.bytes, "phase": e.phase, "node": e.node, "waits for": list(e.deps)}
            if e.stream == "cpu":
                track = "cpu" if self.workers == 1 else f"cpu #{e.worker or 0}"
                x(e.action, track, e.start, e.end, args, "cpu")
            elif e.copy_end is not None:  # OG: the copy on d2h, the accumulation on the host FIFO
                x(e.action, "d2h", e.start, e.copy_end, args, "d2h")
                if e.host_start is not None and e.end > e.host_start:
                    acc_args = {"bytes": e.bytes, "phase": e.phase, "node": e.node}
                    x(f"{e.action} accumulate", "host", e.host_start, e.end, acc_args, "host")
            else:
                x(e.action, e.stream, e.start, e.end, args, e.stream)
        for t, b in self.memory:
            out.append({"ph": "C", "pid": pid, "name": "device memory", "ts": t * 1e6, "args": {"bytes": b}})
        for t, n in self.resident:
            out.append({"ph": "C", "pid": pid, "name": "resident stages", "ts": t * 1e6, "args": {"stages": n}})
        return {
            "traceEvents": out,
            "displayTimeUnit": "ms",
            "otherData": {
                "program": self.program,
                "step_s": self.step_s,
                "bottleneck": self.bottleneck,
                "peak_device_bytes": self.peak_device_bytes,
            },
        }

    def save_chrome_trace(self, path: str | os.PathLike[str]) -> str:
        """Write :meth:`to_chrome_trace` as JSON to ``path``; returns the path."""
        path = os.fspath(path)
        with open(path, "w") as f:
            json.dump(self.to_chrome_trace(), f)
        return path

    def summary(self) -> str:
        """A few lines: step time, bottleneck, stream utilisation, memory."""
        parts = [(k, self.by_resource.get(k, 0.0)) for k in (*RESOURCES, "idle")]
        cp = ", ".join(f"{k} {format_seconds(v)}" for k, v in parts if v > 0)
        share = self.by_resource.get(self.bottleneck, 0.0) / self.step_s if self.step_s > 0 else 0.0
        busy = ", ".join(
            f"{s} {format_seconds(self.busy_s[s])} ({self.utilisation[s]:.0%}"
            + (f" of {self.workers} workers)" if s == "cpu" and self.workers > 1 else ")")
            for s in ("compute", "h2d", "d2h", "host", "cpu", *(t for t in (*_SSD, *_NET) if self.busy_s.get(t)))
        )
        return "\n".join(
            [
                f"simulated step of {self.program!r}: {format_seconds(self.step_s)}; bottleneck: {self.bottleneck} "
                f"({share:.0%} of the critical path{': ' + cp if cp else ''})",
                f"  busy: {busy}",
                f"  device memory: peak {format_bytes(self.peak_device_bytes)} (slot pool {format_bytes(self.slot_bytes)}"
                + (f", gradient buffers {format_bytes(self.grad_buffer_bytes)}" if self.grad_buffer_bytes else "")
                + (f", optimizer states {format_bytes(self.device_state_bytes)}" if self.device_state_bytes else "")
                + f"); peak resident stages: {self.peak_resident}",
            ]
        )

    def __str__(self) -> str:
        return self.summary()


# ---- simulation ------------------------------------------------------------------------------
class _Node:
    __slots__ = (
        "i", "name", "meta", "kind", "stream", "deps", "dur", "acc", "nbytes", "forward", "step", "accumulates",
        "issued", "start", "end", "copy_end", "host_start", "worker", "stream_pred", "host_pred", "cold_dur", "cold",
    )  # fmt: skip

    def __init__(self, i: int, name: str, meta: ActionMeta, deps: list[int]):
        self.i = i
        self.name = name
        self.meta = meta
        self.kind: ActionKind = meta.kind
        self.stream: str = meta.stream
        self.accumulates = KINDS[meta.kind].accumulates  # OG: a copy, then an add on the host FIFO
        self.deps = deps
        self.dur = 0.0  # fixed duration (compute, cpu)
        self.cold_dur: float | None = None  # compute: duration after an idle stretch
        self.cold = False
        self.acc = 0.0  # OG: accumulation on the host FIFO
        self.nbytes = int(meta.bytes)
        self.forward = meta.phase == "forward"
        self.step = meta.phase == "step"  # issued by step(), once the backward's non-update actions are done
        self.issued = False
        self.start: float | None = None
        self.end: float | None = None  # done
        self.copy_end: float | None = None  # OG: reads done
        self.host_start: float | None = None
        self.worker: int | None = None
        self.stream_pred: int | None = None  # the action whose end freed this one's stream/worker
        self.host_pred: int | None = None  # OG: previous OG on the host FIFO

    @property
    def reads(self) -> float | None:
        return self.copy_end if self.accumulates else self.end


class _Copy:
    __slots__ = ("node", "direction", "bw", "latency_end", "remaining")

    def __init__(self, node: int, direction: str, bw: float, latency_end: float, nbytes: float):
        self.node = node
        self.direction = direction
        self.bw = bw
        self.latency_end = latency_end
        self.remaining = nbytes


def _check_duplex_latency(links: Links, prefix: str, full: str) -> None:
    """``links.<prefix>duplex`` in (0, 1] (1.0: ``full``) and ``links.<prefix>latency_s >= 0``
    (the host link's, the network's or the SSD's)."""
    duplex, latency = getattr(links, f"{prefix}duplex"), getattr(links, f"{prefix}latency_s")
    if not (0 < duplex <= 1):
        raise SimulationError(f"links.{prefix}duplex must be in (0, 1] (1.0: {full}), got {duplex!r}")
    if not (latency >= 0 and math.isfinite(latency)):
        raise SimulationError(f"links.{prefix}latency_s must be >= 0, got {latency!r}")


def _check_costs(program: Program, costs: CostModel) -> tuple[dict[int, StageCost], Links, int]:
    if not isinstance(program, Program):
        raise SimulationError(f"simulate() needs a shfx.passes.program.Program, got {type(program).__name__}")
    for attr in ("links", "optimizer_workers", "stage_cost"):
        if not hasattr(costs, attr):
            raise SimulationError(
                f"the cost model {type(costs).__name__} has no {attr!r}: pass a CostModel (e.g. shfx.cost_model.costs.CostTable)"
            )
    n_costs = getattr(costs, "num_stages", None)
    if isinstance(n_costs, int) and n_costs < len(program.stages):
        raise SimulationError(
            f"the cost model has costs for {n_costs} stages but program {program.name!r} has {len(program.stages)} "
            "stages; build the cost table for the same partition as the program"
        )
    workers = costs.optimizer_workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise SimulationError(f"optimizer_workers must be an int >= 1, got {workers!r}")
    links = costs.links
    for name in ("h2d_bps", "d2h_bps"):
        bw = getattr(links, name)
        if bw is not None and not (bw > 0 and math.isfinite(bw)):
            raise SimulationError(f"links.{name} must be > 0 bytes/s or None (instantaneous), got {bw!r}")
    _check_duplex_latency(links, "", "full duplex")
    ranks = getattr(program, "ranks", 1)
    if ranks > 1:
        bw = getattr(links, "net_bps", None)
        if bw is None or not (bw > 0 and math.isfinite(bw)):
            raise SimulationError(
                f"program {program.name!r} is data parallel over {ranks} ranks (RS/AG collectives), but links.net_bps is "
                f"{bw!r}: give the ring's slowest link, Links(..., net_bps=2.8e9, net_latency_s=25e-6) (a Hardware "
                "through hardware.with_data_parallel and analytic.links_of)"
            )
        _check_duplex_latency(links, "net_", "the two collective queues do not slow each other")
    ssd = getattr(program, "ssd_groups", None)
    spill = getattr(program, "activation_window", 0)
    if ssd or spill:
        what = f"optimizer states on the SSD (groups {sorted(ssd)})" if ssd else "activations on the SSD"
        for name in ("ssd_read_bps", "ssd_write_bps"):
            bw = getattr(links, name, None)
            if bw is None or not (bw > 0 and math.isfinite(bw)):
                raise SimulationError(
                    f"program {program.name!r} reads and writes {what}, but "
                    f"links.{name} is {bw!r}: give the drive's bandwidth, Links(..., ssd_read_bps=3e9, ssd_write_bps=2e9) "
                    "(a Hardware profile's ssd_read_bps/ssd_write_bps through analytic.links_of)"
                )
        _check_duplex_latency(links, "ssd_", "reads and writes do not slow each other")
    table: dict[int, StageCost] = {}
    for spec in program.stages:
        try:
            c = costs.stage_cost(spec)
        except (IndexError, KeyError) as e:
            raise SimulationError(
                f"the cost model has no cost for stage {spec.index} ({spec.name!r}) of program {program.name!r} "
                f"({len(program.stages)} stages): {e}"
            ) from None
        for f in ("forward_s", "backward_s", "backward_no_recompute_s", "update_s", "accumulate_s", "device_update_s",
                  "rollback_s"):
            v = getattr(c, f, 0.0)
            v = 0.0 if v is None else v
            if not (v >= 0 and math.isfinite(v)):
                raise SimulationError(f"stage {spec.index} ({spec.name!r}) has {f}={v!r}; costs must be finite and >= 0")
        table[spec.index] = c
    return table, links, workers


class _Sim:
    def __init__(
        self, program: Program, costs: CostModel, accumulate: bool, phase_barrier: bool, extra: dict[int, float] | None = None,
        rollback: float | None = None,
    ):
        self.program = program
        self.rollback = rollback  # None: no rollback copies; else the ratio for stages without rollback_s
        self.extra = extra or {}  # node index -> seconds added to a compute action (CPU sharing)
        self.table, self.links, self.workers = _check_costs(program, costs)
        self.cold_idle_s = getattr(costs, "cold_idle_s", None)
        self.dispatch_s = float(getattr(costs, "dispatch_s", 0.0) or 0.0)
        self.phase_gap_s = float(getattr(costs, "phase_gap_s", 0.0) or 0.0)
        self.accumulate = accumulate
        self.phase_barrier = phase_barrier
        self.specs: dict[int, StageSpec] = {s.index: s for s in program.stages}
        fx_nodes = program.nodes
        index = {n: i for i, n in enumerate(fx_nodes)}
        self.nodes: list[_Node] = []
        for i, n in enumerate(fx_nodes):
            deps = []
            for d in program.deps(n):
                if d not in index:
                    raise SimulationError(
                        f"action {get_meta(n).action} waits for node {d.name!r}, which is not an action of the program"
                    )
                if index[d] >= i:
                    raise SimulationError(
                        f"action {get_meta(n).action} waits for {get_meta(d).action}, which is issued after it; "
                        "dependencies must come earlier in issue order"
                    )
                deps.append(index[d])
            self.nodes.append(_Node(i, n.name, get_meta(n), deps))
        self._set_durations()

    # ---- durations -------------------------------------------------------------------------
    def _set_durations(self) -> None:
        owner: dict[int, StageCost] = {}
        for s in self.program.stages:
            if s.update_group is not None and s.update_group not in owner:
                owner[s.update_group] = self.table[s.index]
        last_forward: dict[int, _Node] = {}
        for nd in self.nodes:
            k, s = nd.kind, nd.meta.stage
            if k == CK:  # the step's gate: a norm of one value per parameter, a comparison
                nd.dur = self.dispatch_s
                continue
            if k in (AW, AR):  # a stage's activations over the drive
                if s not in self.table:
                    raise SimulationError(f"action {nd.meta.action}: program {self.program.name!r} has no stage {s}")
                continue
            if KINDS[k].moves in _SSD or KINDS[k].moves in _NET:  # a copy: its bytes over the drive or the network
                if k != NR and s not in owner:  # (NR0: one per step, not a group's)
                    raise SimulationError(
                        f"action {nd.meta.action}: no stage of program {self.program.name!r} owns parameter group {s}"
                    )
                continue
            if KINDS[k].update:
                if s not in owner:
                    raise SimulationError(
                        f"action {nd.meta.action}: no stage of program {self.program.name!r} owns parameter group {s}"
                    )
                info = KINDS[k]
                if k == GN and nd.meta.device:  # a reduction over the gradient in device memory
                    nd.dur = DEVICE_GRAD_NORM_RATIO * owner[s].device_update_s + self.dispatch_s
                    continue
                if k in (GN, US):  # one pass over the fp32 gradient (US: read and written)
                    nd.dur = GRAD_NORM_RATIO * (2 if k == US else 1) * owner[s].update_s + self.dispatch_s
                    continue
                if k == SN:  # the journal's copy of the group (part of its update's task before it was an action)
                    nd.dur = owner[s].rollback_copy_s(ROLLBACK_COPY_RATIO if self.rollback is None else self.rollback)
                    if s in self.program.ssd_groups:  # master only (4 of the 12 bytes per parameter): the
                        nd.dur /= 3  # states' undo is their previous version on the SSD (shfx.runtime.ssd_window)
                    continue
                add = self.extra.get(nd.i, 0.0) if info.stream == "compute" else 0.0
                nd.dur = getattr(owner[s], info.cost, 0.0) + self.dispatch_s + add
                continue
            if s not in self.table:
                raise SimulationError(f"action {nd.meta.action}: program {self.program.name!r} has no stage {s}")
            c = self.table[s]
            add = self.extra.get(nd.i, 0.0)
            if k == F:
                nd.dur = c.forward_s + self.dispatch_s + add
                nd.cold_dur = None if c.forward_cold_s is None else c.forward_cold_s + self.dispatch_s + add
                last_forward[s] = nd
            elif k == B:
                f = last_forward.get(s)
                kept = f is not None and f.meta.keep_graph
                nd.dur = (c.backward_no_recompute_s if kept else c.backward_s) + self.dispatch_s + add
                cold = c.backward_kept_cold_s if kept else c.backward_cold_s
                nd.cold_dur = None if cold is None else cold + self.dispatch_s + add
            elif nd.accumulates:
                nd.acc = c.accumulate_s if self.accumulate else 0.0

    def _bandwidth(self, direction: str) -> float | None:
        if direction in _NET:
            return self.links.net_bps
        if direction in _SSD:
            return self.links.ssd_read_bps if direction == "ssd_read" else self.links.ssd_write_bps
        return self.links.h2d_bps if direction == "h2d" else self.links.d2h_bps

    def _latency(self, direction: str) -> float:
        if direction in _NET:  # a ring's N - 1 steps
            return (self.program.ranks - 1) * self.links.net_latency_s
        return self.links.ssd_latency_s if direction in _SSD else self.links.latency_s

    def _moved(self, direction: str, nbytes: int) -> float:
        """Bytes a copy moves at its bandwidth: a ring collective's ``(N - 1) / N`` of its buffer."""
        if direction in _NET:
            n = self.program.ranks
            return (n - 1) / n * nbytes
        return float(nbytes)

    # ---- the event loop --------------------------------------------------------------------
    def run(self) -> None:
        nodes = self.nodes
        queues: dict[str, deque[int]] = {s: deque() for s in STREAMS if s != "none"}
        readers: dict[int, list[int]] = {}  # node -> the RELEASEs waiting for its reads
        missing: dict[int, int] = {}  # RELEASE -> dependencies still reading
        ready_r: list[int] = []  # RELEASEs whose dependencies finished reading
        last_on: dict[str, int] = {}
        for nd in nodes:
            if nd.stream == "none":
                missing[nd.i] = len(nd.deps)
                for d in nd.deps:
                    readers.setdefault(d, []).append(nd.i)
                if not nd.deps:
                    ready_r.append(nd.i)
                continue
            if nd.stream not in queues:
                raise SimulationError(f"action {nd.meta.action} runs on unknown stream {nd.stream!r}")
            queues[nd.stream].append(nd.i)
            if nd.stream != "cpu":
                nd.stream_pred = last_on.get(nd.stream)
                last_on[nd.stream] = nd.i
            if nd.accumulates:
                queues["host"].append(nd.i)
                nd.host_pred = last_on.get("host")
                last_on["host"] = nd.i

        fwd_left = sum(1 for nd in nodes if nd.forward)
        # step() runs after loss.backward() returned, which waits for the backward's actions but
        # its updates: the step phase is issued then
        bwd_left = sum(1 for nd in nodes if nd.meta.phase == "backward" and not KINDS[nd.kind].update)
        step_issued = not self.phase_barrier
        self.barrier = 0.0
        self.last_forward: int | None = None
        backward_issued = False
        for nd in nodes:
            nd.issued = (nd.forward or not self.phase_barrier) and not (nd.step and self.phase_barrier)

        busy: dict[str, bool] = {"compute": False, "host": False}
        copies: dict[str, _Copy | None] = dict.fromkeys(_COPY_STREAMS)
        running: list[tuple[float, int, str]] = []  # (end, node, part) of fixed-duration work
        held: list[int | None] = [None] * self.workers  # task a worker took
        worker_last: list[int | None] = [None] * self.workers  # its last finished task
        worker_free: list[float] = [0.0] * self.workers
        left = len(nodes)
        now = 0.0
        quiet = 0.0  # the longest stretch with nothing starting or ending since compute last ended
        barrier_pending = False

        def done(j: int) -> bool:
            return nodes[j].end is not None

        def reads_now(j: int) -> None:
            for r in readers.get(j, ()):
                missing[r] -= 1
                if missing[r] == 0:
                    ready_r.append(r)

        def finish(j: int) -> None:
            nonlocal left, fwd_left, bwd_left
            nd = nodes[j]
            nd.end = now
            left -= 1
            if nd.meta.phase == "backward" and not KINDS[nd.kind].update:
                bwd_left -= 1
            if not nd.accumulates:  # an OG's reads ended with its copy
                reads_now(j)
            if nd.forward:
                fwd_left -= 1
                if self.last_forward is None or nodes[self.last_forward].end <= now:
                    self.last_forward = j

        def start_copy(j: int, direction: str) -> None:
            nd = nodes[j]
            nd.start = now
            bw = self._bandwidth(direction)
            if bw is None or nd.nbytes == 0:
                end_copy(j)
            else:
                copies[direction] = _Copy(j, direction, bw, now + self._latency(direction), self._moved(direction, nd.nbytes))

        def end_copy(j: int) -> None:
            nd = nodes[j]
            if nd.accumulates:
                nd.copy_end = now
                reads_now(j)
            else:
                finish(j)

        while left:
            progress = True
            while progress:
                progress = False
                if not backward_issued and fwd_left == 0 and not barrier_pending:
                    if self.phase_gap_s > 0 and self.phase_barrier:
                        barrier_pending = True  # the backward is issued after the gap
                        running.append((now + self.phase_gap_s, -1, "barrier"))
                    else:
                        backward_issued = True
                        self.barrier = now
                        for nd in nodes:
                            nd.issued = nd.issued or not nd.step
                        progress = True
                if backward_issued and not step_issued and bwd_left == 0:
                    step_issued = True
                    for nd in nodes:
                        nd.issued = True
                    progress = True
                # RELEASE: a join of its dependencies' reads
                batch = ready_r[:]
                ready_r.clear()
                for j in batch:  # finishing one may make more ready (appended to ready_r)
                    if nodes[j].issued:
                        nodes[j].start = now
                        finish(j)
                        progress = True
                    else:
                        ready_r.append(j)
                # compute FIFO
                q = queues["compute"]
                if not busy["compute"] and q and nodes[q[0]].issued and all(done(d) for d in nodes[q[0]].deps):
                    j = q.popleft()
                    nodes[j].start = now
                    busy["compute"] = True
                    if self.cold_idle_s is not None and nodes[j].cold_dur is not None and quiet >= self.cold_idle_s:
                        nodes[j].dur = nodes[j].cold_dur  # the processor sat idle long enough to slow down
                        nodes[j].cold = True
                    running.append((now + nodes[j].dur, j, "compute"))
                    progress = True
                # copy FIFOs
                for direction in _COPY_STREAMS:
                    q = queues[direction]
                    while copies[direction] is None and q and nodes[q[0]].issued and all(done(d) for d in nodes[q[0]].deps):
                        start_copy(q.popleft(), direction)
                        progress = True
                # host FIFO: OG accumulation after its copy
                q = queues["host"]
                if not busy["host"] and q and nodes[q[0]].copy_end is not None:
                    j = q.popleft()
                    nodes[j].host_start = now
                    busy["host"] = True
                    running.append((now + nodes[j].acc, j, "host"))
                    progress = True
                # cpu pool: idle workers take tasks in issue order, then wait for their deps
                q = queues["cpu"]
                for w in range(self.workers):
                    if held[w] is None and q and nodes[q[0]].issued:
                        j = q.popleft()
                        held[w] = j
                        nodes[j].worker = w
                        prev = worker_last[w]
                        nodes[j].stream_pred = prev if prev is not None and worker_free[w] >= now else None
                        progress = True
                for w in range(self.workers):
                    j = held[w]
                    if j is not None and nodes[j].start is None and all(done(d) for d in nodes[j].deps):
                        nodes[j].start = now
                        running.append((now + nodes[j].dur, j, "cpu"))
                        progress = True
            if not left:
                break

            # the next event: a fixed end, a copy's latency end, or a copy's bytes done
            rates = self._rates(copies, now)
            t_next = math.inf
            for end, _, _ in running:
                t_next = min(t_next, end)
            for c in copies.values():
                if c is None:
                    continue
                if now < c.latency_end:
                    t_next = min(t_next, c.latency_end)
                else:
                    t_next = min(t_next, now + c.remaining / rates[c.direction])
            if t_next == math.inf:
                waiting = [str(nd.meta.action) for nd in nodes if nd.end is None]
                raise SimulationError(
                    f"program {self.program.name!r} cannot finish: {', '.join(waiting[:12])}"
                    f"{' ...' if len(waiting) > 12 else ''} wait for each other (a dependency that its stream can never run)"
                )
            dt = t_next - now
            quiet = max(quiet, dt)
            tol = _EPS * max(1.0, t_next)
            finished_copies = []
            for c in copies.values():
                if c is None or now < c.latency_end:
                    continue
                if now + c.remaining / rates[c.direction] <= t_next + tol:
                    finished_copies.append(c)
                else:
                    c.remaining -= rates[c.direction] * dt
            now = t_next
            for c in finished_copies:
                copies[c.direction] = None
                end_copy(c.node)
            still = []
            for end, j, part in running:
                if end <= now + tol:
                    if part == "barrier":
                        barrier_pending = False
                        backward_issued = True
                        self.barrier = now
                        for nd in nodes:
                            nd.issued = nd.issued or not nd.step
                    elif part == "compute":
                        busy["compute"] = False
                        quiet = 0.0
                        finish(j)
                    elif part == "host":
                        busy["host"] = False
                        finish(j)
                    else:
                        w = nodes[j].worker
                        assert w is not None
                        held[w] = None
                        worker_last[w] = j
                        worker_free[w] = now
                        finish(j)
                else:
                    still.append((end, j, part))
            running[:] = still

    def _rates(self, copies: dict[str, _Copy | None], now: float) -> dict[str, float]:
        moving = {d: c is not None and now >= c.latency_end for d, c in copies.items()}
        both = moving["h2d"] and moving["d2h"]
        both_ssd = moving["ssd_read"] and moving["ssd_write"]
        both_net = moving["reduce"] and moving["gather"]

        def share(d: str) -> float:
            if d in _NET:
                return self.links.net_duplex if both_net else 1.0
            if d in _SSD:
                return self.links.ssd_duplex if both_ssd else 1.0
            return self.links.duplex if both else 1.0

        return {d: c.bw * share(d) for d, c in copies.items() if c is not None}

    # ---- results -----------------------------------------------------------------------------
    def events(self) -> list[Event]:
        out = []
        for nd in self.nodes:
            assert nd.start is not None and nd.end is not None
            out.append(
                Event(
                    node=nd.name,
                    action=str(nd.meta.action),
                    phase=nd.meta.phase,
                    stream=nd.stream,
                    start=nd.start,
                    end=nd.end,
                    bytes=nd.nbytes,
                    copy_end=nd.copy_end if nd.accumulates else None,
                    host_start=nd.host_start if nd.accumulates else None,
                    worker=nd.worker,
                    deps=tuple(self.nodes[d].name for d in nd.deps),
                )
            )
        return out

    def busy(self, step_s: float) -> tuple[dict[str, float], dict[str, float]]:
        busy = dict.fromkeys(STREAMS, 0.0)
        for nd in self.nodes:
            assert nd.start is not None and nd.end is not None
            if nd.accumulates:
                assert nd.copy_end is not None and nd.host_start is not None
                busy["d2h"] += nd.copy_end - nd.start
                busy["host"] += nd.end - nd.host_start
            elif nd.stream != "none":
                busy[nd.stream] += nd.end - nd.start
        util = {}
        for s, b in busy.items():
            cap = step_s * (self.workers if s == "cpu" else 1)
            util[s] = b / cap if cap > 0 else 0.0
        return busy, util

    def memory(self, step_s: float) -> tuple[Ledger, list[tuple[float, int]]]:
        """The ledger's device changes on the timeline: setup (and, for a cold backward, what
        the forward left) at 0, the model's inputs when the forward starts, the output
        gradients when the backward phase is issued, each action's changes when it ends, the
        rest freed when the last non-update action of the phase ends."""
        led = replay(self.program)
        nodes = self.nodes
        by_name = {nd.name: nd for nd in nodes}
        last_end = max((nd.end for nd in nodes if not KINDS[nd.kind].update), default=0.0)
        has_f = any(nd.kind == F for nd in nodes)
        initial = 0
        changes: list[tuple[float, int, int, int]] = []  # (time, entry, change, delta)
        for i, e in enumerate(led.entries):
            dev = [c.nbytes for c in e.changes if c.tier == "device"]
            if e.event == "setup" or (e.event == "forward start" and not has_f):
                initial += sum(dev)
                continue
            if e.node is not None:
                t = by_name[e.node].end
            elif e.event == "forward start":
                t = 0.0
            elif e.event == "backward start":
                t = self.barrier if has_f else 0.0
            else:  # end
                t = last_end
            assert t is not None
            changes += [(t, i, j, d) for j, d in enumerate(dev) if d]
        changes.sort(key=lambda c: c[:3])
        cur = initial
        memory = [(0.0, cur)]
        for t, _, _, d in changes:
            cur += d
            memory.append((t, cur))
        return led, memory

    def resident(self) -> list[tuple[float, int]]:
        changes: list[tuple[float, int]] = []
        open_pf: dict[int, _Node] = {}
        for nd in self.nodes:
            if nd.kind == PF and nd.meta.refresh:
                continue  # a persistent stage, resident all along
            if nd.kind == PF:
                assert nd.start is not None
                changes.append((nd.start, +1))
                open_pf[nd.meta.stage] = nd
            elif nd.kind == R and nd.meta.stage in open_pf:
                assert nd.end is not None
                changes.append((nd.end, -1))
                del open_pf[nd.meta.stage]
        changes.sort()  # at one instant, releases (-1) before prefetches (+1)
        cur = len(self.program.persistent)
        out = [(0.0, cur)]
        for t, d in changes:
            cur += d
            out.append((t, cur))
        return out

    def critical_path(self, events: list[Event]) -> tuple[list[Event], dict[str, float]]:
        by = dict.fromkeys((*RESOURCES, "idle"), 0.0)
        nodes = self.nodes
        if not nodes:
            return [], by
        # the last action to finish; a RELEASE ending at the same instant only joins it
        cur: int | None = max(range(len(nodes)), key=lambda i: (nodes[i].end, nodes[i].kind != R, i))
        mode = "done"
        path: list[int] = []

        def time_of(j: int, m: str) -> float:
            nd = nodes[j]
            t = nd.reads if m == "reads" else nd.end
            assert t is not None
            return t

        while cur is not None:
            nd = nodes[cur]
            path.append(cur)
            assert nd.start is not None and nd.end is not None
            if nd.kind == R:
                cands = [(time_of(d, "reads"), d, "reads") for d in nd.deps]
            else:
                if nd.accumulates:
                    assert nd.copy_end is not None and nd.host_start is not None
                    if mode == "done":
                        by["host optimizer"] += nd.end - nd.host_start
                        hp = nd.host_pred
                        if hp is not None and nd.host_start > nd.copy_end and time_of(hp, "done") >= nd.host_start - _EPS:
                            cur, mode = hp, "done"
                            continue
                        by["idle"] += max(0.0, nd.host_start - nd.copy_end)
                    by["link"] += nd.copy_end - nd.start
                else:
                    by[nd.meta.resource] += nd.end - nd.start
                cands = [(time_of(d, "done"), d, "done") for d in nd.deps]
                sp = nd.stream_pred
                if sp is not None:
                    # the d2h stream is free again when an OG's copy ends, not its accumulation
                    m = "reads" if nd.stream == "d2h" else "done"
                    cands.append((time_of(sp, m), sp, m))
            if not nd.forward and self.phase_barrier and self.barrier > 0 and self.last_forward is not None:
                cands.append((self.barrier, self.last_forward, "done"))
            best: tuple[float, int, str] | None = None
            for c in cands:  # deps first: on a tie the dependency is the reason
                if best is None or c[0] > best[0]:
                    best = c
            if best is None:
                by["idle"] += nd.start
                cur = None
            else:
                by["idle"] += max(0.0, nd.start - best[0])
                cur, mode = best[1], best[2]
        path.reverse()
        return [events[i] for i in path], by


def _with_cpu_sharing(program, costs, accumulate, phase_barrier, sim, events, k, rollback=None):
    """Stretch each compute action by ``k`` x the host CPU work that overlaps it (the memcpy
    part of copies at ``costs.memcpy_bps``, host updates, gradient adds), to a fixed point.

    NOTE: on the emulated device the "device" compute, the copies and the host optimizer share
    the same cores; a real accelerator copies by DMA and computes elsewhere (``cpu_contention``
    is 0 there)."""
    memcpy = getattr(costs, "memcpy_bps", None)
    extra: dict[int, float] = {}
    index = {nd.name: nd.i for nd in sim.nodes}
    for _ in range(8):
        cpu: list[tuple[float, float]] = []
        for e in events:
            if e.stream in ("h2d", "d2h") and e.bytes and memcpy:
                cpu.append((e.start, min(e.copy_end if e.copy_end is not None else e.end, e.start + e.bytes / memcpy)))
            elif e.stream == "cpu":
                cpu.append((e.start, e.end))
            if e.host_start is not None and e.end > e.host_start:
                cpu.append((e.host_start, e.end))
        new = {}
        for e in events:
            if e.stream == "compute":
                stolen = sum(max(0.0, min(b, e.end) - max(a, e.start)) for a, b in cpu)
                if stolen > 0:
                    new[index[e.node]] = k * stolen
        if all(abs(new.get(i, 0.0) - extra.get(i, 0.0)) < 1e-7 for i in set(new) | set(extra)):
            break
        extra = new
        sim = _Sim(program, costs, accumulate, phase_barrier, extra, rollback)
        sim.run()
        events = sim.events()
    return sim, events


def _rollback_ratio(rollback: bool | float) -> float | None:
    """``simulate``'s ``rollback`` as the ratio for stages without ``rollback_s`` (None: off)."""
    if isinstance(rollback, bool):
        return ROLLBACK_COPY_RATIO if rollback else None
    if not isinstance(rollback, (int, float)) or not (rollback >= 0 and math.isfinite(rollback)):
        raise SimulationError(
            f"rollback must be True, False or a ratio >= 0 of the update time, got {rollback!r}"
        )
    return float(rollback)


def simulate(
    program: Program, costs: CostModel, *, accumulate: bool = False, phase_barrier: bool = True, rollback: bool | float = False
) -> Timeline:
    """Simulate one step of ``program`` with ``costs`` (see the module docstring for the model).

    Args:
        program: a step program (:func:`shfx.passes.schedule.schedule_window`,
            :func:`shfx.passes.program.lower_actions`, ...).
        costs: per-stage costs, links and host optimizer workers
            (:class:`shfx.cost_model.costs.CostTable` or any :class:`shfx.cost_model.costs.CostModel`).
        accumulate: gradients accumulate into an existing fp32 buffer (each OFFLOAD_GRAD pays
            ``accumulate_s`` on the host FIFO); False: the first backward after ``zero_grad``.
        phase_barrier: backward-phase actions wait until every forward-phase action is done,
            as the runtime issues the backward only after the forward returned.
        rollback: the step journal keeps a rollback copy of each group before its host update
            (``shfx.compile(rollback=True)``, the default in fp16): a program without the
            copies gets them (:data:`shfx.passes.features.ROLLBACK`: ``SN g`` before each
            ``U g``, on the same pool). Each SNAPSHOT takes its stage's ``rollback_s``, or, for a
            stage without one, a ratio of its ``update_s``:
            :data:`shfx.cost_model.costs.ROLLBACK_COPY_RATIO` with ``True`` (and for a program
            that has SNAPSHOTs already, with ``False``), the number given with a float (e.g.
            one measured by ``benchmarks/rollback.py``).

    Raises:
        SimulationError: the cost model lacks stages of the program, has negative or
            non-finite costs, or the program cannot finish.

    >>> from shfx.passes.program import lower_actions
    >>> from shfx.passes.stages import chain
    >>> from shfx.cost_model.costs import CostTable, Links, StageCost
    >>> p = lower_actions(["PF0", "F0", "B0", "OG0", "U0", "R0"], chain(1, prefetch_bytes=10**6), 1)
    >>> tl = simulate(p, CostTable([StageCost(1.0, 3.0, update_s=0.5)], Links(1e6, 2e6)))
    >>> [(e.action, e.start, e.end) for e in tl.events]  # doctest: +NORMALIZE_WHITESPACE
    [('PF0', 0.0, 1.0), ('F0', 1.0, 2.0), ('B0', 2.0, 4.0), ('OG0', 4.0, 4.5), ('U0', 4.5, 5.0),
     ('R0', 4.5, 4.5)]
    """
    ratio = _rollback_ratio(rollback)
    if isinstance(program, Program):  # (anything else: _Sim says what it needs)
        if ratio is not None and not any(get_meta(n).kind == SN for n in program.nodes):
            program = ROLLBACK(program)  # (the pass: a program without the journal's copies gains them)
        program = steady_state_program(program)  # updates deferred to the next forward: the steady state
    sim = _Sim(program, costs, accumulate, phase_barrier, rollback=ratio)
    sim.run()
    events = sim.events()
    k = float(getattr(costs, "cpu_contention", 0.0) or 0.0)
    if k > 0:
        sim, events = _with_cpu_sharing(program, costs, accumulate, phase_barrier, sim, events, k, ratio)
    step_s = max((e.end for e in events), default=0.0)
    busy, util = sim.busy(step_s)
    led, memory = sim.memory(step_s)
    static = led.static("device")
    resident = sim.resident()
    path, by = sim.critical_path(events)
    bottleneck = max(RESOURCES, key=lambda r: (by[r], -RESOURCES.index(r)))
    return Timeline(
        program=program.name,
        events=events,
        step_s=step_s,
        busy_s=busy,
        utilisation=util,
        workers=sim.workers,
        slot_bytes=static.get("parameters (slots)", 0),
        peak_device_bytes=max(b for _, b in memory),
        memory=memory,
        peak_resident=max(n for _, n in resident),
        resident=resident,
        critical_path=path,
        by_resource=by,
        bottleneck=bottleneck,
        accumulate=accumulate,
        grad_buffer_bytes=static.get("gradients", 0),
        device_state_bytes=static.get("optimizer states", 0),
        ledger=led,
    )
