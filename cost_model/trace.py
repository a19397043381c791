"""Step traces: one event type for the simulator's timeline and the runtime's measured trace.

An :class:`Event` is one action of a step program: what it is (``action``, ``phase``,
``stream``), when it ran (``start``, ``end``) and, for an OFFLOAD_GRAD, when its two parts ran
(the copy on ``d2h`` until ``copy_end``, the accumulation on the ``host`` FIFO from
``host_start`` to ``end``). :func:`shfx.cost_model.simulate.simulate` puts one per node on its
:class:`~shfx.cost_model.simulate.Timeline` (seconds from the step start, ``node`` and ``deps``
filled in); the runtime's interpreter appends one per executed action to ``engine.trace``
(host ``time.perf_counter()`` seconds, in completion order, ``node`` None and ``deps`` empty:
it does not know them when it records). The runtime traces an OFFLOAD_GRAD's copy only: its
event has no ``copy_end`` and ends when the copy ends (its ``reads_end``, what a RELEASE waits
for); the accumulation on the host FIFO is not traced.

The analysis of measured steps against a program (what ``benchmarks/sim_accuracy.py`` reports):

- :func:`match_trace`: which traced event is which node of the program;
- :func:`step_events`: a measured step as the simulator's timeline has it (one event per node,
  in issue order, ``node`` and ``deps`` filled in, seconds from the step start), so measured
  and simulated steps compare event by event;
- :func:`analyse_step` and :func:`analyse_steps`: where a step's time went outside what the
  simulator models (before the first action, after the last, the forward->backward
  transition, the hand-off latency of each action) and how busy compute was;
- :func:`in_situ_costs`: a cost table whose durations are the ones the actions had in the
  measured steps (simulate it to see what is left of the error once the costs are right);
- :func:`idle_before` and :func:`compute_vs_profile`: the compute actions that followed an idle
  stretch (the CPUs asleep on the emulated device), and how their durations compare with a
  profile.

>>> from shfx.passes.program import lower_actions
>>> from shfx.passes.stages import chain
>>> p = lower_actions(["PF0", "F0", "B0", "OG0", "U0", "R0"], chain(1, prefetch_bytes=100), 1)
>>> trace = [Event("PF0", "forward", "h2d", 10.0, 11.0, 100), Event("F0", "forward", "compute", 11.5, 12.5),
...          Event("B0", "backward", "compute", 13.0, 16.0), Event("OG0", "backward", "d2h", 16.25, 17.0),
...          Event("U0", "backward", "cpu", 17.0, 18.0)]
>>> [(e.node, e.start, e.end) for e in step_events(p, trace, 10.0)]
[('pf0', 0.0, 1.0), ('f0', 1.5, 2.5), ('b0', 3.0, 6.0), ('og0', 6.25, 7.0), ('u0', 7.0, 8.0), ('r0', 7.0, 7.0)]
>>> a = analyse_step(p, trace, 10.0, 18.5)
>>> a.lead_s, a.tail_s, a.transition_s, a.waits["FORWARD"], a.waits["OFFLOAD_GRAD"]
(0.0, 0.5, 0.5, (0.5,), (0.25,))
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

from shfx.passes.meta import get_meta
from shfx.passes.program import ActionKind, Program

from .costs import CostTable, StageCost

if TYPE_CHECKING:
    import torch.fx as fx

__all__ = [
    "Event",
    "StepTrace",
    "match_trace",
    "step_events",
    "StepAnalysis",
    "analyse_step",
    "StepsAnalysis",
    "analyse_steps",
    "in_situ_costs",
    "idle_before",
    "ComputeVsProfile",
    "compute_vs_profile",
]


@dataclass(frozen=True)
class Event:
    """One action of a step, simulated or measured.

    Attributes:
        action: the action string, e.g. ``"PF3"``.
        phase: ``"forward"`` or ``"backward"``.
        stream: ``"compute"``, ``"h2d"``, ``"d2h"``, ``"cpu"`` or ``"none"`` (an OFFLOAD_GRAD
            is on ``"d2h"``; its accumulation part runs on the ``"host"`` FIFO).
        start: when the action started: seconds from the start of the step (simulated, or a
            view of a measured step), or host ``perf_counter`` seconds (the runtime's trace).
        end: when the action is done (for OG: its accumulation on the host FIFO ended).
        bytes: bytes the action moves over the link.
        copy_end: OG only: the end of its d2h copy (when a RELEASE stops waiting for it).
            None for a measured OG whose accumulation was not traced: ``end`` is the copy's.
        host_start: OG only: when its accumulation started on the host FIFO.
        worker: CPU_STEP only: the host optimizer worker that ran it (None when not known).
        node: the FX node's name (unique in the program); None in the runtime's trace.
        deps: the node names it waited for; empty in the runtime's trace.
    """

    action: str
    phase: str
    stream: str
    start: float
    end: float
    bytes: int = 0
    copy_end: float | None = None
    host_start: float | None = None
    worker: int | None = None
    node: str | None = None
    deps: tuple[str, ...] = ()

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def reads_end(self) -> float:
        """When the action stopped reading its slot (what a RELEASE waits for)."""
        return self.copy_end if self.copy_end is not None else self.end

    @property
    def kind(self) -> ActionKind:
        return ActionKind(self.action.rstrip("0123456789"))


class StepTrace(NamedTuple):
    """One measured step: when it started and ended (``time.perf_counter()`` seconds, as the
    events) and the runtime's trace of it (``list(engine.trace)``)."""

    start: float
    end: float
    events: Sequence[Event]


_COMPUTE = (ActionKind.FORWARD, ActionKind.BACKWARD)


def _median(xs: Sequence[float], default: float = 0.0) -> float:
    return statistics.median(xs) if xs else default


def match_trace(program: Program, events: Iterable[Event]) -> dict[fx.Node, Event]:
    """The traced event of each node of ``program``.

    The ``i``-th node with a given action and phase (``"PF3"`` in the backward) gets the
    ``i``-th event with that action and phase, in trace order: actions of one stream complete
    in issue order, and a repeated action runs on one stream. RELEASE nodes (never traced) and
    nodes with no event (updates deferred to ``step()``, a step cut short) are left out; events
    no node claims (another program's) are ignored.

    It does not check that the trace is of this program: a trace of another program with the
    same action strings matches as well.
    """
    by: dict[tuple[str, str], list[Event]] = {}
    for e in events:
        by.setdefault((e.action, e.phase), []).append(e)
    seen: dict[tuple[str, str], int] = {}
    out: dict[fx.Node, Event] = {}
    for n in program.nodes:
        m = get_meta(n)
        k = (str(m.action), m.phase)
        i = seen.get(k, 0)
        seen[k] = i + 1
        lst = by.get(k, [])
        if m.kind != ActionKind.RELEASE and i < len(lst):
            out[n] = lst[i]
    return out


class _Times:
    """When each node of a measured step was done and stopped reading its slot: its event's
    ``end`` and ``reads_end``; a RELEASE when every dependency stopped reading; ``start`` for
    a node with no event."""

    def __init__(self, program: Program, ev_of: Mapping[fx.Node, Event], start: float):
        self.program, self.ev_of, self.start = program, ev_of, start
        self._done: dict[fx.Node, float] = {}
        self._reads: dict[fx.Node, float] = {}

    def done(self, n: fx.Node) -> float:
        t = self._done.get(n)
        if t is None:
            if get_meta(n).kind == ActionKind.RELEASE:
                t = max((self.reads(d) for d in self.program.deps(n)), default=self.start)
            else:
                e = self.ev_of.get(n)
                t = e.end if e is not None else self.start
            self._done[n] = t
        return t

    def reads(self, n: fx.Node) -> float:
        t = self._reads.get(n)
        if t is None:
            e = self.ev_of.get(n)
            t = e.reads_end if e is not None else self.done(n)
            self._reads[n] = t
        return t


def step_events(program: Program, events: Iterable[Event], start: float) -> list[Event]:
    """A measured step as a simulated :class:`~shfx.cost_model.simulate.Timeline` has its
    events: one per node of ``program`` that has an event (:func:`match_trace`), in issue
    order, with ``node`` and ``deps`` filled in and times in seconds from ``start`` (the step's
    start). A RELEASE, which the runtime does not trace, takes no time and happens when every
    dependency stopped reading its slot (``reads_end``).

    Measured events have no host optimizer ``worker``, and an OFFLOAD_GRAD has no
    ``copy_end``/``host_start`` unless the trace had them (the runtime traces its copy only).
    """
    ev_of = match_trace(program, events)
    times = _Times(program, ev_of, start)
    out: list[Event] = []
    for n in program.nodes:
        m = get_meta(n)
        e = ev_of.get(n)
        deps = tuple(d.name for d in program.deps(n))
        if e is not None:
            out.append(
                Event(
                    e.action,
                    e.phase,
                    e.stream,
                    e.start - start,
                    e.end - start,
                    e.bytes,
                    copy_end=None if e.copy_end is None else e.copy_end - start,
                    host_start=None if e.host_start is None else e.host_start - start,
                    worker=e.worker,
                    node=n.name,
                    deps=deps,
                )
            )
        elif m.kind == ActionKind.RELEASE:
            t = times.done(n) - start
            out.append(Event(str(m.action), m.phase, m.stream, t, t, node=n.name, deps=deps))
    return out


@dataclass(frozen=True)
class StepAnalysis:
    """Where one measured step's time went outside what the simulator models.

    Attributes:
        lead_s: from the step's start to the first traced action (the model call, inputs).
        tail_s: from the last traced action to the step's end (``step()`` returning).
        transition_s: from the end of the forward phase to the start of the first backward
            action that waited for nothing else (returning from the model call, the loss,
            ``backward()``); 0 when no backward action waited only for the phase.
        waits: per action kind (``"FORWARD"``, ``"PREFETCH"``, ...), the hand-off latency of
            each of its actions, in issue order: its start minus the moment its stream and its
            dependencies were free (never negative).
        compute_busy_s: seconds the compute stream ran FORWARDs and BACKWARDs.
    """

    lead_s: float
    tail_s: float
    transition_s: float
    waits: Mapping[str, tuple[float, ...]]
    compute_busy_s: float


def analyse_step(program: Program, events: Sequence[Event], start: float, end: float) -> StepAnalysis | None:
    """Analyse one measured step of ``program`` (``events``: its trace, ``start``/``end``: the
    step's bounds, on the events' clock); None when no event matches a node.

    An action's stream is free when the previous action on it ended (an OFFLOAD_GRAD's copy
    frees ``d2h`` at its ``reads_end``); a dependency is done at its ``end`` (a RELEASE when
    its dependencies stopped reading). A backward action that was ready before the forward
    phase ended waited for the phase, not for a hand-off: the earliest of them gives the
    transition. Lead and tail count every event, matched or not.

    It does not model several host optimizer workers (a CPU_STEP's stream is free when the
    previous CPU_STEP ended, though another worker may have been idle: such waits come out
    low, never negative), and does not count the wait of an OFFLOAD_GRAD's accumulation on the
    host FIFO (the runtime does not trace it).
    """
    ev_of = match_trace(program, events)
    if not ev_of:
        return None
    fwd_end = max((e.end for n, e in ev_of.items() if get_meta(n).phase == "forward"), default=start)
    times = _Times(program, ev_of, start)
    free: dict[str, float] = {}
    waits: dict[str, list[float]] = {}
    first_bwd: float | None = None
    for n in program.nodes:
        e = ev_of.get(n)
        if e is None:
            continue
        m = get_meta(n)
        ready = max([times.done(d) for d in program.deps(n)] + [free.get(e.stream, start)])
        if m.phase == "backward" and ready <= fwd_end:
            first_bwd = e.start if first_bwd is None else min(first_bwd, e.start)
        else:
            waits.setdefault(m.kind.name, []).append(max(0.0, e.start - ready))
        free[e.stream] = e.reads_end
    return StepAnalysis(
        lead_s=min(e.start for e in events) - start,
        tail_s=end - max(e.end for e in events),
        transition_s=(first_bwd - fwd_end) if first_bwd is not None else 0.0,
        waits={k: tuple(v) for k, v in waits.items()},
        compute_busy_s=sum(e.end - e.start for n, e in ev_of.items() if get_meta(n).kind in _COMPUTE),
    )


@dataclass(frozen=True)
class StepsAnalysis:
    """:func:`analyse_step` over several steps of one program.

    Attributes:
        steps: the steps analysed (those with a matching event).
        lead_s, tail_s, transition_s, compute_busy_s: medians over the steps (0 with none).
        handoff_median_s: per action kind, the median hand-off latency of its actions.
        handoff_per_step_s: per action kind, the summed hand-off latency per step.
    """

    steps: int
    lead_s: float
    tail_s: float
    transition_s: float
    compute_busy_s: float
    handoff_median_s: Mapping[str, float]
    handoff_per_step_s: Mapping[str, float]


def analyse_steps(program: Program, traces: Iterable[tuple[float, float, Sequence[Event]]]) -> StepsAnalysis:
    """:func:`analyse_step` of each measured step (:class:`StepTrace` or ``(start, end,
    events)``), summarised by medians; steps no event of which matches are left out."""
    per = [a for a in (analyse_step(program, ev, t0, t1) for t0, t1, ev in traces) if a is not None]
    waits: dict[str, list[float]] = {}
    for a in per:
        for k, v in a.waits.items():
            waits.setdefault(k, []).extend(v)
    n = max(1, len(per))
    return StepsAnalysis(
        steps=len(per),
        lead_s=_median([a.lead_s for a in per]),
        tail_s=_median([a.tail_s for a in per]),
        transition_s=_median([a.transition_s for a in per]),
        compute_busy_s=_median([a.compute_busy_s for a in per]),
        handoff_median_s={k: _median(v) for k, v in waits.items()},
        handoff_per_step_s={k: sum(v) / n for k, v in waits.items()},
    )


def _kept_stages(program: Program) -> set[int]:
    """Stages whose FORWARD keeps its graph (their BACKWARD does not recompute)."""
    return {get_meta(n).stage for n in program.nodes if get_meta(n).kind == ActionKind.FORWARD and get_meta(n).keep_graph}


def in_situ_costs(
    program: Program, costs: CostTable, traces: Iterable[tuple[float, float, Sequence[Event]]], *, overheads: bool
) -> CostTable:
    """``costs`` with each action's cost replaced by what it took in the measured steps.

    Per stage, FORWARD and BACKWARD take their median measured duration (a stage that never
    ran keeps its cost; a stage whose FORWARD keeps its graph gets it as ``backward_kept_s``);
    the links' bandwidths are the median rate of the measured PREFETCH (h2d) and OFFLOAD_GRAD
    copies (d2h) after the links' latency. With ``overheads``, the measured hand-offs
    (:func:`analyse_step`) are added too: each kind's median hand-off to its FORWARDs,
    BACKWARDs and CPU_STEPs, the median of PREFETCH's and OFFLOAD_GRAD's to the links' latency,
    and the median transition to the last stage's FORWARD. Simulating the result shows what of
    the error is left once the costs are the measured ones.

    With data parallel (``program.ranks = N > 1``) the network's bandwidth is the median rate
    of the measured collectives (``RS``/``AG``: ``(N - 1) / N`` of their bytes after the ring's
    ``N - 1`` latencies, :func:`~shfx.cost_model.costs.ring_collective_s`); the links' SSD and
    network fields are kept otherwise.

    It does not replace the host update, accumulation or device update costs, nor the
    ``duplex`` factor, nor compute durations per occurrence (a stage run twice gets one
    median); the step's lead and tail are not costs of any action (add them to the simulated
    step time).
    """
    traces = list(traces)
    f: dict[int, list[float]] = {}
    b: dict[int, list[float]] = {}
    pf_rate: list[float] = []
    og_rate: list[float] = []
    net_rate: list[float] = []
    ranks = program.ranks
    lat = costs.links.latency_s
    net_lat = (ranks - 1) * costs.links.net_latency_s
    handoff: dict[str, list[float]] = {}
    trans: list[float] = []
    for t0, t_end, events in traces:
        for e in events:
            k = e.action.rstrip("0123456789")
            s = int(e.action[len(k) :]) if e.action[len(k) :] else -1
            if k == "F":
                f.setdefault(s, []).append(e.end - e.start)
            elif k == "B":
                b.setdefault(s, []).append(e.end - e.start)
            elif k == "PF" and e.bytes:
                pf_rate.append(e.bytes / max(e.end - e.start - lat, 1e-6))
            elif k == "OG" and e.bytes:  # the copy: up to reads_end
                og_rate.append(e.bytes / max(e.reads_end - e.start - lat, 1e-6))
            elif k in ("RS", "AG") and e.bytes and ranks > 1:  # a ring moves (N - 1) / N of the buffer
                net_rate.append((ranks - 1) / ranks * e.bytes / max(e.end - e.start - net_lat, 1e-6))
        if overheads:
            a = analyse_step(program, events, t0, t_end)
            if a:
                for kind, ws in a.waits.items():
                    handoff.setdefault(kind, []).extend(ws)
                trans.append(a.transition_s)
    keep = _kept_stages(program)
    h = {k: _median(v) for k, v in handoff.items()}
    n_last = max((get_meta(n).stage for n in program.nodes if get_meta(n).kind == ActionKind.FORWARD), default=0)
    out = []
    for i, c in enumerate(costs.costs):
        fs = _median(f.get(i, []), c.forward_s) + h.get("FORWARD", 0.0) + (_median(trans) if i == n_last else 0.0)
        bs = _median(b.get(i, []), c.backward_s if i not in keep else c.backward_no_recompute_s) + h.get("BACKWARD", 0.0)
        upd = c.update_s + h.get("CPU_STEP", 0.0)
        if i in keep:
            out.append(StageCost(fs, bs + fs, backward_kept_s=bs, update_s=upd, accumulate_s=c.accumulate_s))
        else:
            out.append(StageCost(fs, bs, update_s=upd, accumulate_s=c.accumulate_s))
    links = replace(
        costs.links,
        h2d_bps=_median(pf_rate, costs.links.h2d_bps or 0.0) or costs.links.h2d_bps,
        d2h_bps=_median(og_rate, costs.links.d2h_bps or 0.0) or costs.links.d2h_bps,
        latency_s=lat + _median([h[k] for k in ("PREFETCH", "OFFLOAD_GRAD") if k in h]),
        net_bps=_median(net_rate, costs.links.net_bps or 0.0) or costs.links.net_bps,
    )
    return CostTable(out, links, optimizer_workers=costs.optimizer_workers, source="in situ")


def idle_before(events: Iterable[Event], marks: Iterable[float], start: float) -> list[tuple[Event, float]]:
    """Per compute event, in start order: the longest stretch before it, since the previous
    compute action ended (``start`` for the first), in which nothing happened: no time in
    ``marks`` (the starts and ends of every action, on any stream) falls inside it.

    On the emulated device that is how long the CPUs slept (a copy sleeps while it waits for
    its bandwidth budget), after which compute runs slower for a while. It does not know
    about work outside the traced actions (the interpreter issuing, the user's code).
    """
    marks = sorted(marks)
    out = []
    prev = start
    for e in sorted((e for e in events if e.stream == "compute"), key=lambda e: e.start):
        inner = [m for m in marks if prev < m < e.start]
        pts = [prev, *inner, e.start]
        out.append((e, max((b - a for a, b in zip(pts, pts[1:])), default=0.0)))
        prev = e.end
    return out


@dataclass(frozen=True)
class ComputeVsProfile:
    """Measured duration / profiled cost of compute actions (see :func:`compute_vs_profile`).

    Attributes:
        after_busy_ratio: the median ratio of those no idle stretch preceded (None: none).
        after_busy_n: how many.
        after_idle_ratio: the median ratio of those an idle stretch preceded (None: none).
        after_idle_n: how many.
    """

    after_busy_ratio: float | None
    after_busy_n: int
    after_idle_ratio: float | None
    after_idle_n: int


def compute_vs_profile(
    program: Program,
    traces: Iterable[tuple[float, float, Sequence[Event]]],
    profile: CostTable,
    idle_s: float,
    min_cost_s: float = 1e-3,
) -> ComputeVsProfile:
    """How long the compute actions of the measured steps took against ``profile``: each
    FORWARD's and BACKWARD's duration over its stage's profiled cost (``backward_kept_s`` for
    a stage whose FORWARD keeps its graph), for actions costing at least ``min_cost_s``, split
    by whether a stretch of at least ``idle_s`` in which no action started or ended preceded
    it since the previous compute action (:func:`idle_before`).

    It does not tell a slow action from a disturbed one (another process holding a CPU).
    """
    keep = _kept_stages(program)
    after_busy: list[float] = []
    after_idle: list[float] = []
    for t0, _, events in traces:
        marks = [t0] + [t for e in events for t in (e.start, e.end)]
        for e, gap in idle_before(events, marks, t0):
            i = int(e.action[1:])
            c = profile.costs[i]
            ref = c.forward_s if e.action[0] == "F" else (c.backward_no_recompute_s if i in keep else c.backward_s)
            if ref >= min_cost_s:
                (after_idle if gap >= idle_s else after_busy).append((e.end - e.start) / ref)
    return ComputeVsProfile(
        after_busy_ratio=_median(after_busy) if after_busy else None,
        after_busy_n=len(after_busy),
        after_idle_ratio=_median(after_idle) if after_idle else None,
        after_idle_n=len(after_idle),
    )
