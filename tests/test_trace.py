"""Step traces (shfx.cost_model.trace): one event type for the simulator's timeline and the
runtime's trace, and the analysis of measured steps against hand-computed figures.

Synthetic times are binary fractions, so every figure is exact.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

import shfx
import shfx.cost_model
from shfx.cost_model.costs import CostTable, Links, StageCost
from shfx.cost_model.simulate import Event as SimulatedEvent
from shfx.cost_model.simulate import simulate
from shfx.cost_model.trace import (
    ComputeVsProfile,
    Event,
    StepAnalysis,
    StepTrace,
    analyse_step,
    analyse_steps,
    compute_vs_profile,
    idle_before,
    in_situ_costs,
    match_trace,
    step_events,
)
from shfx.passes.meta import get_meta
from shfx.passes.program import ActionKind, lower_actions
from shfx.passes.schedule import schedule_window
from shfx.passes.stages import chain

from zoo import gpt, token_batch

MB = 10**6

# 2 stages, 2 slots; F1 keeps its graph. Waits for: F1 <- PF1, F0; B1 <- PF1, F1; OG1 <- B1;
# U1 <- OG1; R1 <- F1, B1, OG1; B0 <- PF0, F0, B1; OG0 <- B0; U0 <- OG0; R0 <- F0, B0, OG0.
ACTIONS = ["PF0", "F0", "PF1", "F1", "B1", "OG1", "U1", "R1", "B0", "OG0", "U0", "R0"]


def program():
    return lower_actions(ACTIONS, chain(2, prefetch_bytes=100, grad_bytes=50), num_slots=2)


def ev(action: str, stream: str, start: float, end: float, nbytes: int = 0, **kw) -> Event:
    phase = "forward" if action in ("PF0", "F0", "PF1", "F1") else "backward"
    return Event(action, phase, stream, start, end, nbytes, **kw)


T0, T_END = 100.0, 120.0


def trace(f0: float = 2.0, shift: float = 0.0) -> list[Event]:
    """One step from T0, in completion order, as the runtime traces it (``f0``: F0's duration,
    its start fixed; ``shift``: added to every time)."""
    events = [
        ev("PF0", "h2d", 101.0, 103.0, 100),  # waits 1.0 (h2d free at the step start)
        ev("F0", "compute", 103.25, 103.25 + f0),  # 0.25 after PF0
        ev("PF1", "h2d", 103.5, 105.5, 100),  # 0.5 after PF0 freed h2d
        ev("F1", "compute", 106.0, 108.0),  # 0.5 after PF1 (the later of PF1, F0)
        ev("B1", "compute", 109.0, 113.0),  # ready at 108.0, the forward's end: the transition
        ev("OG1", "d2h", 113.5, 114.5, 50),  # 0.5 after B1
        ev("U1", "cpu", 115.0, 116.0),  # 0.5 after OG1
        ev("B0", "compute", 113.25, 117.25),  # 0.25 after B1
        ev("OG0", "d2h", 117.5, 118.0, 50),  # 0.25 after B0
        ev("U0", "cpu", 118.0, 119.0),  # 0 after OG0
    ]
    return [replace(e, start=e.start + shift, end=e.end + shift) for e in events]


# ---- one event type -----------------------------------------------------------------------------
def test_simulated_and_measured_events_are_one_type():
    assert SimulatedEvent is Event and shfx.cost_model.Event is Event
    p = schedule_window(chain(3, prefetch_bytes=MB, grad_bytes=MB // 2), 2)
    tl = simulate(p, CostTable([StageCost(1.0, 3.0, update_s=0.5)] * 3, Links(1e6, 1e6)))
    assert {type(e) for e in tl.events} == {Event}
    cm = shfx.compile(gpt(), device=shfx.EmulatedDevice(memory="64MiB", h2d="2GB/s", d2h="2GB/s"), window=2,
                      optimizer=shfx.optim.AdamW(lr=1e-3))  # fmt: skip
    (x, y), _, _ = token_batch(0)
    cm(x, y).backward()
    cm.step()
    assert cm.engine.trace and {type(e) for e in cm.engine.trace} == {Event}
    e = next(e for e in cm.engine.trace if e.action.startswith("OG"))
    assert (e.node, e.deps, e.copy_end, e.kind, e.reads_end) == (None, (), None, ActionKind.OFFLOAD_GRAD, e.end)
    cm.close()


def test_a_runtime_trace_maps_onto_the_program():
    cm = shfx.compile(gpt(), device=shfx.EmulatedDevice(memory="64MiB", h2d="2GB/s", d2h="2GB/s"), window=2,
                      optimizer=shfx.optim.AdamW(lr=1e-3))  # fmt: skip
    for step in range(2):
        (x, y), _, _ = token_batch(step)
        cm(x, y).backward()
        cm.step()
        end = time.perf_counter()
        cm.zero_grad()
    # the step's own clock: a start derived from a time taken after step() returned
    # (end - step_times[-1]) is later than the real one, and on a loaded machine after PF0 began
    start = cm.engine.last_step_window[0]
    p, events = cm.program, list(cm.engine.trace)
    matched = match_trace(p, events)
    assert set(matched) == {n for n in p.nodes if get_meta(n).kind != ActionKind.RELEASE}
    assert all(str(get_meta(n).action) == e.action and get_meta(n).phase == e.phase for n, e in matched.items())

    view = step_events(p, events, start)
    n_stages = len(cm.variant.graph.stages)
    tl = simulate(p, CostTable([StageCost(1e-3, 3e-3, update_s=1e-3)] * n_stages, Links(2e9, 2e9)))
    assert [e.node for e in view] == [n.name for n in p.nodes] == [e.node for e in tl.events]
    assert [(e.action, e.phase, e.stream, e.deps) for e in view] == [(e.action, e.phase, e.stream, e.deps) for e in tl.events]
    by = {e.node: e for e in view}
    for e in view:  # the measured step respects the program: every action starts after what it waits for
        assert 0.0 <= e.start <= e.end <= end - start
        assert all(e.start >= by[d].end for d in e.deps), e.action
    for stream in ("compute", "h2d", "d2h"):  # one action at a time, in issue order
        on = [e for e in view if e.stream == stream]
        assert all(b.start >= a.end for a, b in zip(on, on[1:]))

    a = analyse_step(p, events, start, end)
    assert a is not None and a.lead_s >= 0 and a.tail_s >= 0 and a.transition_s >= 0
    assert all(w >= 0 for ws in a.waits.values() for w in ws)
    assert sum(len(ws) for ws in a.waits.values()) <= len(matched)
    assert 0 < a.compute_busy_s <= end - start
    cm.close()


# ---- matching and the timeline view -----------------------------------------------------------------
def test_match_trace_by_action_phase_and_occurrence():
    p = schedule_window(chain(3), 1)  # PF1 R1 PF0 R0 occur in both phases
    events = [Event(str(get_meta(n).action), get_meta(n).phase, get_meta(n).stream, float(i), i + 0.5)
              for i, n in enumerate(p.nodes) if get_meta(n).kind != ActionKind.RELEASE]  # fmt: skip
    u0 = next(e for e in events if e.action == "U0")
    events.remove(u0)  # an update deferred to step(): not traced
    events.append(Event("U7", "backward", "cpu", 50.0, 51.0))  # not of this program
    matched = match_trace(p, events[::-1])  # the order of different actions does not matter
    assert {n.name: (e.action, e.start) for n, e in matched.items()} == {
        n.name: (str(get_meta(n).action), float(i))
        for i, n in enumerate(p.nodes)
        if get_meta(n).kind != ActionKind.RELEASE and n.name != "u0"
    }


def test_step_events_is_a_timeline_view():
    p = program()
    view = step_events(p, trace(), T0)
    assert [(e.node, e.start, e.end, e.deps) for e in view] == [
        ("pf0", 1.0, 3.0, ()),
        ("f0", 3.25, 5.25, ("pf0",)),
        ("pf1", 3.5, 5.5, ()),
        ("f1", 6.0, 8.0, ("pf1", "f0")),
        ("b1", 9.0, 13.0, ("pf1", "f1")),
        ("og1", 13.5, 14.5, ("b1",)),
        ("u1", 15.0, 16.0, ("og1",)),
        ("r1", 14.5, 14.5, ("f1", "b1", "og1")),  # when the last reader (OG1) stopped reading
        ("b0", 13.25, 17.25, ("pf0", "f0", "b1")),
        ("og0", 17.5, 18.0, ("b0",)),
        ("u0", 18.0, 19.0, ("og0",)),
        ("r0", 18.0, 18.0, ("f0", "b0", "og0")),
    ]
    assert view[5].bytes == 50 and view[7].stream == "none"


def test_step_events_of_a_simulated_trace_is_the_timeline():
    p = schedule_window(chain(4, prefetch_bytes=MB, grad_bytes=MB // 2), 2)
    costs = CostTable([StageCost(1.0, 3.0, update_s=0.5, accumulate_s=0.25)] * 4, Links(1e6, 1e6))
    tl = simulate(p, costs, accumulate=True)
    # as the runtime would record it: no releases, no node names or dependencies, completion order
    measured = sorted((replace(e, node=None, deps=(), worker=None) for e in tl.events if e.stream != "none"), key=lambda e: e.end)
    assert step_events(p, measured, 0.0) == [replace(e, worker=None) for e in tl.events]


# ---- the analysis of one step ---------------------------------------------------------------------
def test_analyse_step_by_hand():
    a = analyse_step(program(), trace(), T0, T_END)
    assert a == StepAnalysis(
        lead_s=1.0,  # PF0 started 1 s after the step
        tail_s=1.0,  # U0 ended 1 s before it
        transition_s=1.0,  # B1 was ready when F1 ended (108) and started at 109
        waits={
            "PREFETCH": (1.0, 0.5),
            "FORWARD": (0.25, 0.5),
            "OFFLOAD_GRAD": (0.5, 0.25),
            "CPU_STEP": (0.5, 0.0),
            "BACKWARD": (0.25,),
        },
        compute_busy_s=12.0,
    )
    assert analyse_step(program(), [Event("U9", "backward", "cpu", 1.0, 2.0)], 0.0, 3.0) is None


def test_analyse_step_with_the_accumulation_traced():
    # OG1 as the simulator has it: copy 113.5-114.5 on d2h, accumulation 114.75-115.5 on the host
    events = trace()
    events[5] = replace(events[5], end=115.5, copy_end=114.5, host_start=114.75)
    events[6] = replace(events[6], start=115.75, end=116.0)
    a = analyse_step(program(), events, T0, T_END)
    assert a is not None
    assert a.waits["CPU_STEP"] == (0.25, 0.0)  # U1 waits for the accumulation, not the copy
    assert a.waits["OFFLOAD_GRAD"] == (0.5, 0.25)  # the copy freed d2h at 114.5 for OG0
    assert [e.start for e in step_events(program(), events, T0) if e.node == "r1"] == [14.5]  # reads ended with the copy


def test_a_simulated_step_has_no_hand_offs():
    p = schedule_window(chain(4, prefetch_bytes=MB, grad_bytes=MB // 2), 2)
    costs = CostTable([StageCost(1.0, 3.0, update_s=0.5, accumulate_s=0.25)] * 4, Links(1e6, 1e6), phase_gap_s=0.5)
    tl = simulate(p, costs, accumulate=True)
    a = analyse_step(p, tl.events, 0.0, tl.step_s)
    assert a is not None
    assert (a.lead_s, a.tail_s) == (0.0, 0.0)
    assert a.transition_s == pytest.approx(0.5)  # the simulated phase gap
    assert all(w == pytest.approx(0.0, abs=1e-12) for ws in a.waits.values() for w in ws)
    assert a.compute_busy_s == pytest.approx(tl.busy_s["compute"])


def test_analyse_steps_summarises_by_medians():
    steps = [StepTrace(T0, T_END, trace()), StepTrace(T0 + 1000, T_END + 1000 + 2.0, trace(shift=1000.0)),
             (0.0, 1.0, [Event("U9", "backward", "cpu", 0.0, 1.0)])]  # fmt: skip
    s = analyse_steps(program(), steps)
    assert (s.steps, s.lead_s, s.tail_s, s.transition_s, s.compute_busy_s) == (2, 1.0, 2.0, 1.0, 12.0)
    assert s.handoff_median_s == {"PREFETCH": 0.75, "FORWARD": 0.375, "OFFLOAD_GRAD": 0.375, "CPU_STEP": 0.25, "BACKWARD": 0.25}
    assert s.handoff_per_step_s == {"PREFETCH": 1.5, "FORWARD": 0.75, "OFFLOAD_GRAD": 0.75, "CPU_STEP": 0.5, "BACKWARD": 0.25}
    empty = analyse_steps(program(), [])
    assert (empty.steps, empty.lead_s, empty.handoff_median_s) == (0, 0.0, {})


# ---- in situ costs ----------------------------------------------------------------------------------
PROFILE = CostTable([StageCost(9.0, 9.0, update_s=0.5, accumulate_s=0.125)] * 2, Links(1e3, 1e3), optimizer_workers=2)


def test_in_situ_costs_take_the_measured_durations():
    steps = [(T0, T_END, trace()), (T0 + 1000, T_END + 1000, trace(f0=3.0, shift=1000.0))]
    c = in_situ_costs(program(), PROFILE, steps, overheads=False)
    assert list(c.costs) == [
        StageCost(2.5, 4.0, update_s=0.5, accumulate_s=0.125),  # F0: median of 2 and 3
        StageCost(2.0, 6.0, backward_kept_s=4.0, update_s=0.5, accumulate_s=0.125),  # F1 keeps its graph
    ]
    # PF: 100 B in 2 s; OG: 50 B in 1 s and in 0.5 s
    assert (c.links, c.optimizer_workers, c.source) == (Links(50.0, 75.0), 2, "in situ")


def test_in_situ_costs_with_overheads():
    c = in_situ_costs(program(), PROFILE, [(T0, T_END, trace())], overheads=True)
    # + the median hand-off of each kind; the transition goes to the last FORWARD (F1)
    assert list(c.costs) == [
        StageCost(2.375, 4.25, update_s=0.75, accumulate_s=0.125),
        StageCost(3.375, 7.625, backward_kept_s=4.25, update_s=0.75, accumulate_s=0.125),
    ]
    assert c.links == Links(50.0, 75.0, latency_s=0.5625)  # median of PREFETCH's 0.75 and OFFLOAD_GRAD's 0.375


def test_in_situ_costs_keep_what_was_not_measured():
    c = in_situ_costs(program(), PROFILE, [], overheads=True)
    assert list(c.costs) == [StageCost(9.0, 9.0, update_s=0.5, accumulate_s=0.125),
                             StageCost(9.0, 9.0, backward_kept_s=0.0, update_s=0.5, accumulate_s=0.125)]  # fmt: skip
    assert c.links == PROFILE.links


# ---- idle stretches ---------------------------------------------------------------------------------
def test_idle_before_and_compute_vs_profile():
    events = trace()
    marks = [T0] + [t for e in events for t in (e.start, e.end)]
    got = [(e.action, gap) for e, gap in idle_before(events, marks, T0)]
    # F0: 100 -> 101 -> 103 -> 103.25; F1: 105.25 -> 105.5 -> 106; B1: 108 -> 109; B0: 113 -> 113.25
    assert got == [("F0", 2.0), ("F1", 0.5), ("B1", 1.0), ("B0", 0.25)]
    profile = CostTable([StageCost(1.0, 3.0, backward_kept_s=2.0)] * 2, Links(None, None))
    r = compute_vs_profile(program(), [(T0, T_END, events)], profile, idle_s=0.75)
    # after an idle stretch: F0 2/1, B1 4/2 (kept graph); after busy: F1 2/1, B0 4/3
    assert r == ComputeVsProfile(after_busy_ratio=pytest.approx(5 / 3), after_busy_n=2, after_idle_ratio=2.0, after_idle_n=2)
    r = compute_vs_profile(program(), [(T0, T_END, events)], profile, idle_s=0.75, min_cost_s=2.5)
    assert r == ComputeVsProfile(after_busy_ratio=4 / 3, after_busy_n=1, after_idle_ratio=None, after_idle_n=0)
