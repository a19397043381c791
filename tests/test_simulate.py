"""The step-program simulator against hand-computed timelines.

Units are chosen so times are exact: links move 1e6 bytes/s, so a 1e6-byte copy takes 1 s.
"""

from __future__ import annotations

import json
import random

import pytest

from shfx.cost_model.costs import CostTable, Links, StageCost
from shfx.cost_model.simulate import Event, SimulationError, Timeline, simulate
from shfx.passes.meta import get_meta
from shfx.passes.program import ActionKind as K
from shfx.passes.program import lower_actions
from shfx.passes.schedule import cold_backward_program, eval_program, schedule_window
from shfx.passes.stages import StageSpec, chain

MB = 10**6
LINK = Links(1e6, 1e6)


def table(n: int, fwd=1.0, bwd=3.0, kept=None, upd=0.0, acc=0.0, links=LINK, workers=1) -> CostTable:
    return CostTable([StageCost(fwd, bwd, kept, upd, acc)] * n, links, optimizer_workers=workers)


def times(tl: Timeline, *actions: str) -> list[tuple[float, float]]:
    return [(round(tl.event(a).start, 9), round(tl.event(a).end, 9)) for a in actions]


def independent(*prefetch: int, buffers: tuple[int, ...] = ()) -> list[StageSpec]:
    """Stages that read nothing from each other and have no trainable parameters."""
    return [
        StageSpec(i, f"s{i}", prefetch_bytes=b, buffer_out_bytes=buffers[i] if i < len(buffers) else 0, slot_bytes=b)
        for i, b in enumerate(prefetch)
    ]


def overlapping(events: list[Event]) -> list[tuple[str, str]]:
    spans = sorted((e.start, e.end, e.action) for e in events if e.end > e.start)
    return [(a[2], b[2]) for a, b in zip(spans, spans[1:]) if b[0] < a[1] - 1e-12]


# (1) ------------------------------------------------------------------------------------------
def test_window_1_is_serial():
    p = schedule_window(chain(3, prefetch_bytes=MB, grad_bytes=MB // 2), 1)
    tl = simulate(p, table(3, kept=2.0))
    # 5 prefetches, 3 forwards, B2 keeps its graph (2 s) + B1, B0 recompute (3 s), 3 grad copies
    assert tl.step_s == pytest.approx(5 * 1.0 + 3 * 1.0 + (2.0 + 3.0 + 3.0) + 3 * 0.5)
    assert overlapping(tl.events) == []
    assert tl.event("B2").duration == pytest.approx(2.0)
    assert sum(tl.by_resource.values()) == pytest.approx(tl.step_s)


# (2), (3) ---------------------------------------------------------------------------------------
def test_prefetch_hidden_behind_compute():
    # chain(3), W=2, no grads: PF0 PF1 F0 R0 PF2 F1 F2 B2 R2 PF0 B1 R1 B0 R0
    p = schedule_window(chain(3, prefetch_bytes=MB // 2, grad_bytes=0), 2)
    assert " ".join(p.actions()) == "PF0 PF1 F0 R0 PF2 F1 F2 B2 R2 PF0 B1 R1 B0 R0"
    tl = simulate(p, table(3, fwd=1.0, bwd=2.0))
    assert times(tl, "PF0", "PF1", "F0", "R0", "PF2", "F1", "F2") == [
        (0, 0.5), (0.5, 1.0), (0.5, 1.5), (1.5, 1.5), (1.5, 2.0), (1.5, 2.5), (2.5, 3.5)
    ]  # fmt: skip
    assert times(tl, "B2", "B1", "B0") == [(3.5, 4.5), (4.5, 6.5), (6.5, 8.5)]  # B2 kept its graph
    assert tl.event("PF0", occurrence=1).start == pytest.approx(4.5)  # after R2, hidden behind B1
    assert tl.step_s == pytest.approx(8.5)
    assert tl.utilisation["compute"] == pytest.approx(8.0 / 8.5)


def test_transfer_longer_than_compute_is_exposed():
    p = schedule_window(chain(3, prefetch_bytes=2 * MB, grad_bytes=0), 2)
    tl = simulate(p, table(3, fwd=1.0, bwd=2.0))
    assert times(tl, "PF0", "PF1", "F0", "PF2", "F1", "F2", "B2") == [
        (0, 2), (2, 4), (2, 3), (4, 6), (4, 5), (6, 7), (7, 8)
    ]  # fmt: skip
    assert tl.event("PF0", occurrence=1).end == pytest.approx(10.0)
    assert times(tl, "B1", "B0") == [(8, 10), (10, 12)]
    assert tl.step_s == pytest.approx(12.0)


# (4) --------------------------------------------------------------------------------------------
def test_waits_for_dependencies_on_other_streams():
    p = lower_actions(["PF0", "F0", "B0", "OG0", "U0", "R0"], chain(1, prefetch_bytes=MB, grad_bytes=MB // 2), 1)
    costs = table(1, fwd=1.0, bwd=3.0, kept=2.0, upd=0.5, acc=0.25)
    tl = simulate(p, costs)
    assert times(tl, "PF0", "F0", "B0", "OG0", "U0", "R0") == [(0, 1), (1, 2), (2, 4), (4, 4.5), (4.5, 5), (4.5, 4.5)]
    # accumulating: the OG is done after its host part; U waits for it, R only for the copy
    tl = simulate(p, costs, accumulate=True)
    og = tl.event("OG0")
    assert (og.copy_end, og.host_start, og.end) == pytest.approx((4.5, 4.5, 4.75))
    assert times(tl, "U0", "R0") == [(4.75, 5.25), (4.5, 4.5)]
    assert tl.busy_s["host"] == pytest.approx(0.25) and tl.busy_s["d2h"] == pytest.approx(0.5)


def test_backward_waits_for_the_forward_phase():
    # OB1 (forward phase) ends after F1; the runtime issues the backward only then
    stages = [
        StageSpec(0, prefetch_bytes=MB),
        StageSpec(1, producers=frozenset({0}), prefetch_bytes=MB, buffer_out_bytes=3 * MB),
    ]
    p = lower_actions(["PF0", "PF1", "F0", "F1", "OB1", "B1", "B0", "R1", "R0"], stages, 2)
    tl = simulate(p, table(2, fwd=1.0, bwd=2.0))
    assert tl.event("OB1").end == pytest.approx(6.0)  # F1 2..3, OB1 moves 3 MB: 3..6
    assert tl.event("B1").start == pytest.approx(tl.event("OB1").end)
    free = simulate(p, table(2, fwd=1.0, bwd=2.0), phase_barrier=False)
    assert free.event("B1").start == pytest.approx(free.event("F1").end)


# (5) --------------------------------------------------------------------------------------------
def test_stream_fifo():
    # F1's only dependency (PF1) is done at 0.5, but F0 is ahead of it on the compute stream
    p = lower_actions(["PF1", "PF0", "F0", "F1", "B1", "R1", "B0", "R0"], independent(2 * MB, MB // 2), 2)
    tl = simulate(p, table(2, fwd=1.0, bwd=2.0))
    assert times(tl, "PF1", "PF0", "F0", "F1") == [(0, 0.5), (0.5, 2.5), (2.5, 3.5), (3.5, 4.5)]
    # PF0 is itself behind PF1 on h2d; F1's start is explained by its stream predecessor F0
    path = [e.action for e in tl.critical_path]
    assert path[:4] == ["PF1", "PF0", "F0", "F1"]


# (6) --------------------------------------------------------------------------------------------
def test_duplex_simultaneous_transfers_share_the_link():
    stages = independent(MB, MB, buffers=(MB,))
    p = lower_actions(["PF0", "F0", "OB0", "PF1"], stages, 2)
    half = Links(1e6, 1e6, duplex=0.5)
    tl = simulate(p, table(2, fwd=0.0, links=half))
    # OB0 and PF1 both start at 1.0 and each moves 1 MB at 0.5 MB/s
    assert times(tl, "PF0", "OB0", "PF1") == [(0, 1), (1, 3), (1, 3)]
    full = simulate(p, table(2, fwd=0.0))
    assert times(full, "OB0", "PF1") == [(1, 2), (1, 2)]


def test_duplex_partial_overlap():
    stages = independent(MB, 2 * MB, buffers=(MB,))
    p = lower_actions(["PF0", "F0", "OB0", "PF1"], stages, 2)
    half = Links(1e6, 1e6, duplex=0.5)
    # PF1 1.0..1.5 alone (0.5 MB), OB0 and PF1 share 1.5..3.5 (1 MB each), PF1 alone 3.5..4.0
    tl = simulate(p, table(2, fwd=0.5, links=half))
    assert times(tl, "F0", "OB0", "PF1") == [(1, 1.5), (1.5, 3.5), (1, 4)]
    # OB0 ends first while both run at half speed: PF1 then speeds up
    tl = simulate(p, table(2, fwd=0.0, links=half))
    assert times(tl, "OB0", "PF1") == [(1, 3), (1, 4)]


def test_latency_and_instant_links():
    p = lower_actions(["PF0", "F0"], independent(MB), 1)
    tl = simulate(p, table(1, links=Links(1e6, 1e6, latency_s=0.25)))
    assert times(tl, "PF0", "F0") == [(0, 1.25), (1.25, 2.25)]
    tl = simulate(p, table(1, links=Links(None, None, latency_s=0.25)))
    assert times(tl, "PF0", "F0") == [(0, 0), (0, 1)]


# (7) --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "order, workers, expected",
    [
        (["U1", "U0"], 1, {"U1": (2, 4), "U0": (4, 6)}),
        (["U1", "U0"], 2, {"U1": (2, 4), "U0": (3, 5)}),
        # U0 is taken first and waits for OG0 (3.0): it blocks the only worker, U1 waits behind it
        (["U0", "U1"], 1, {"U0": (3, 5), "U1": (5, 7)}),
        (["U0", "U1"], 2, {"U0": (3, 5), "U1": (2, 4)}),
    ],
)
def test_cpu_pool(order, workers, expected):
    acts = ["PF0", "PF1", "F0", "F1", "B1", "OG1", "B0", "OG0", *order, "R1", "R0"]
    p = lower_actions(acts, chain(2), 2)
    costs = table(2, fwd=0.5, bwd=1.0, kept=1.0, upd=2.0, links=Links(None, None), workers=workers)
    tl = simulate(p, costs)
    assert times(tl, "B1", "B0") == [(1, 2), (2, 3)]
    assert dict(zip(expected, times(tl, *expected))) == expected
    assert tl.step_s == pytest.approx(max(e for _, e in expected.values()))
    assert tl.utilisation["cpu"] == pytest.approx(4.0 / (tl.step_s * workers))
    assert {e.worker for e in tl.stream_events("cpu")} == set(range(workers))


# (8) --------------------------------------------------------------------------------------------
def test_keep_graph_makes_the_last_backward_cheaper():
    stages = chain(3, prefetch_bytes=MB, grad_bytes=0)
    costs = table(3, fwd=1.0, bwd=3.0, kept=1.5, links=Links(None, None))
    kept = simulate(schedule_window(stages, 3), costs)
    assert kept.event("B2").duration == pytest.approx(1.5)
    assert kept.event("B1").duration == pytest.approx(3.0)
    acts = schedule_window(stages, 3).actions()
    cold = simulate(lower_actions(acts, stages, 3, keep_graph=False), costs)
    assert cold.event("B2").duration == pytest.approx(3.0)
    assert cold.step_s - kept.step_s == pytest.approx(1.5)
    # default backward_kept_s: backward_s - forward_s
    assert simulate(schedule_window(stages, 3), table(3, fwd=1.0, bwd=3.0)).event("B2").duration == pytest.approx(2.0)
    # the cold backward has no forward: every backward recomputes
    cb = simulate(cold_backward_program(schedule_window(stages, 3)), costs)
    assert cb.event("B2").duration == pytest.approx(3.0)


# (9) --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("w", [1, 2, 3])
def test_memory_and_resident_peak(w):
    P, A = 1000, 100
    p = schedule_window(chain(3, prefetch_bytes=P, activation_bytes=A), w)
    tl = simulate(p, table(3))
    assert tl.slot_bytes == w * P
    # forward end: 3 activations; the backward starts with the gradient of the model's output
    # (s2's, handed to backward()); B2's end adds the gradient of s1's output before it frees
    # that gradient and the activation of s1 (its earliest consumer is 2): 5 at once. (Before
    # the memory ledger the simulator left the output's gradient out, unlike the runtime: 4.)
    assert tl.peak_device_bytes == w * P + 5 * A
    assert tl.memory[0] == (0.0, w * P)
    assert tl.memory[-1][1] == w * P  # everything freed by the end of B0
    assert tl.peak_resident == w
    assert tl.resident[-1][1] == 0
    f2 = tl.event("F2").end
    fwd_end = tl.memory.index((f2, w * P + 3 * A))  # F2's output allocated; the backward starts after it
    assert max(b for _, b in tl.memory[: fwd_end + 1]) == w * P + 3 * A


def test_memory_of_derived_programs():
    P, A = 1000, 100
    train = schedule_window(chain(3, prefetch_bytes=P, activation_bytes=A), 2)
    ev = simulate(eval_program(train), table(3))
    # inference: s0 freed when F1 ends (after F1's output is allocated): at most 2 values + the output
    assert ev.peak_device_bytes == 2 * P + 2 * A
    assert ev.memory[-1][1] == 2 * P
    cold = simulate(cold_backward_program(train), table(3))
    assert cold.memory[0] == (0.0, 2 * P + 3 * A)  # the forward's activations are already there
    assert cold.memory[-1][1] == 2 * P


def test_slot_bytes_default_to_zero():
    stages = [StageSpec(0, prefetch_bytes=MB), StageSpec(1, producers=frozenset({0}), prefetch_bytes=MB)]
    tl = simulate(lower_actions(["PF0", "PF1", "F0", "F1", "B1", "R1", "B0", "R0"], stages, 2), table(2))
    assert tl.slot_bytes == 0 and tl.peak_device_bytes == 0


# (10) -------------------------------------------------------------------------------------------
def _contiguous(path: list[Event]) -> bool:
    return all(
        min(abs(b.start - a.end), abs(b.start - a.reads_end)) < 1e-9 or b.action.startswith("R")
        for a, b in zip(path, path[1:])
    )


@pytest.mark.parametrize(
    "costs, expected",
    [
        (table(6, fwd=1.0, bwd=3.0, upd=0.1, links=Links(1e8, 1e8)), "compute"),
        (table(6, fwd=0.01, bwd=0.03, upd=0.01, links=Links(1e5, 1e5)), "link"),
        (table(6, fwd=0.01, bwd=0.03, upd=5.0, links=Links(1e8, 1e8)), "host optimizer"),
    ],
)
def test_critical_path_and_bottleneck(costs, expected):
    tl = simulate(schedule_window(chain(6, prefetch_bytes=MB), 2), costs)
    assert tl.bottleneck == expected
    path = tl.critical_path
    assert path[-1].end == pytest.approx(tl.step_s)
    assert path[0].start == pytest.approx(0.0)
    assert _contiguous(path)
    assert sum(tl.by_resource.values()) == pytest.approx(tl.step_s)
    assert tl.by_resource["idle"] == pytest.approx(0.0, abs=1e-9)
    assert expected in tl.summary()


def test_critical_path_compute_bound_is_the_compute_chain():
    tl = simulate(schedule_window(chain(3, prefetch_bytes=MB // 2, grad_bytes=0), 2), table(3, fwd=1.0, bwd=2.0))
    assert [e.action for e in tl.critical_path] == ["PF0", "F0", "F1", "F2", "B2", "B1", "B0"]
    assert tl.by_resource["compute"] == pytest.approx(8.0) and tl.by_resource["link"] == pytest.approx(0.5)


# (11) -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [1, 2])
def test_chrome_trace(tmp_path, workers):
    p = schedule_window(chain(4, prefetch_bytes=MB, activation_bytes=1000), 2)
    tl = simulate(p, table(4, upd=0.5, acc=0.1, workers=workers), accumulate=True)
    path = tl.save_chrome_trace(tmp_path / "trace.json")
    with open(path) as f:
        trace = json.load(f)
    assert trace == json.loads(json.dumps(tl.to_chrome_trace()))
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert len(set(names.values())) == len(names)  # one tid per track
    cpu = ["cpu"] if workers == 1 else [f"cpu #{w}" for w in range(workers)]
    assert sorted(names.values()) == sorted(["compute", "h2d", "d2h", "host", "none (releases)", *cpu])
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == len(tl.events) + sum(1 for e in tl.events if e.action.startswith("OG"))
    for e in xs:
        track = names[e["tid"]]
        act = e["name"].split()[0]
        stream = tl.event(act).stream
        expect = "host" if e["name"].endswith("accumulate") else stream
        assert track.split()[0] == expect
        assert e["dur"] >= 0 and {"bytes", "phase"} <= set(e["args"])
    mem = [e for e in events if e["ph"] == "C" and e["name"] == "device memory"]
    assert max(e["args"]["bytes"] for e in mem) == tl.peak_device_bytes
    # each track's slices nest (none overlap without containing), as the viewers need
    for tid in names:
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in xs if e["tid"] == tid and e["dur"] > 0)
        assert all(b[0] >= a[1] - 1e-6 for a, b in zip(spans, spans[1:]))


# (12) -------------------------------------------------------------------------------------------
def test_step_time_in_window():
    n = 8
    stages = chain(n, prefetch_bytes=MB, grad_bytes=MB // 4)  # PF 1 s, OG 0.25 s

    def steps(links: Links) -> list[float]:
        costs = table(n, fwd=0.25, bwd=0.5, upd=0.1, links=links)
        return [simulate(schedule_window(stages, w), costs).step_s for w in range(1, n + 1)]

    slow = steps(LINK)  # a prefetch (1 s) takes longer than a backward (0.5 s)
    assert all(b <= a + 1e-9 for a, b in zip(slow, slow[1:])), slow
    assert all(b < a - 0.1 for a, b in zip(slow[:5], slow[1:6])), slow  # each slot hides more
    # W=8: 8 prefetches, F7, B7 (kept 0.25 s), 7 more backwards, OG0, U0; W>=6 hides the rest
    assert slow[-1] == pytest.approx(8.0 + 0.25 + 0.25 + 7 * 0.5 + 0.25 + 0.1)
    assert slow[5:] == pytest.approx([slow[-1]] * 3)
    fast = steps(Links(8e6, 8e6))  # a prefetch (0.125 s) hides behind a forward from W=2 on
    assert fast[0] > fast[1] + 1.0
    assert fast[1:] == pytest.approx([fast[1]] * (n - 1))


# errors ------------------------------------------------------------------------------------------
def test_errors():
    p = schedule_window(chain(4), 2)
    with pytest.raises(SimulationError, match="costs for 2 stages but program .* has 4 stages"):
        simulate(p, table(2))
    with pytest.raises(SimulationError, match="optimizer_workers"):
        simulate(p, table(4, workers=0))
    with pytest.raises(SimulationError, match="duplex"):
        simulate(p, table(4, links=Links(1e6, 1e6, duplex=0.0)))
    with pytest.raises(SimulationError, match="h2d_bps"):
        simulate(p, table(4, links=Links(0.0, 1e6)))
    with pytest.raises(SimulationError, match="forward_s"):
        simulate(p, table(4, fwd=-1.0))
    with pytest.raises(SimulationError, match="Program"):
        simulate(p.actions(), table(4))  # type: ignore[arg-type]
    bad = schedule_window(chain(2), 2)
    f0 = bad.find("F0")
    f0.args = (*f0.args, bad.find("F1"))  # a dependency issued later
    with pytest.raises(SimulationError, match="F0 waits for F1, which is issued after it"):
        simulate(bad, table(2))


def test_empty_and_summary():
    tl = simulate(lower_actions([], chain(1), 1), table(1))
    assert tl.step_s == 0.0 and tl.events == [] and tl.critical_path == []
    tl = simulate(schedule_window(chain(2), 2), table(2))
    s = tl.summary()
    assert "simulated step" in s and "bottleneck" in s and "peak resident stages: 2" in s


# the event loop against a one-pass recurrence (exact when the links are full duplex) -----------
def _reference(p, costs, accumulate):
    """start = max(stream free, dependencies done, backward issued); the cpu pool's workers take
    tasks in issue order. Valid without duplex coupling: every duration is then fixed."""
    nodes = p.nodes
    idx = {n: i for i, n in enumerate(nodes)}
    owner = {s.update_group: costs.costs[s.index] for s in p.stages if s.update_group is not None}
    end, reads, free = {}, {}, {"compute": 0.0, "h2d": 0.0, "d2h": 0.0, "host": 0.0}
    workers = [0.0] * costs.optimizer_workers
    take = 0.0
    kept: dict[int, bool] = {}
    fwd = [i for i, n in enumerate(nodes) if get_meta(n).phase == "forward"]
    out = {}
    for i, n in enumerate(nodes):
        m = get_meta(n)
        issue = 0.0 if m.phase == "forward" else max((end[j] for j in fwd), default=0.0)
        deps = [idx[d] for d in p.deps(n)]
        c = costs.costs[m.stage] if m.kind != K.CPU_STEP else owner[m.stage]
        if m.kind == K.RELEASE:
            t = max([issue] + [reads[j] for j in deps])
            end[i] = reads[i] = t
            out[i] = (t, t)
            continue
        ready = max([issue] + [end[j] for j in deps])
        if m.kind == K.CPU_STEP:
            w = min(range(len(workers)), key=lambda k: workers[k])
            take = max(issue, take, workers[w])
            s = max(take, ready)
            end[i] = reads[i] = workers[w] = s + c.update_s
            out[i] = (s, end[i])
            continue
        s = max(free[m.stream], ready)
        if m.kind == K.FORWARD:
            d = c.forward_s
            kept[m.stage] = m.keep_graph
        elif m.kind == K.BACKWARD:
            d = c.backward_no_recompute_s if kept.get(m.stage) else c.backward_s
        else:
            d = costs.links.time_s(m.stream, m.bytes)
        free[m.stream] = reads[i] = s + d
        end[i] = s + d
        if m.kind == K.OFFLOAD_GRAD:
            hs = max(free["host"], s + d)
            end[i] = free["host"] = hs + (c.accumulate_s if accumulate else 0.0)
        out[i] = (s, end[i])
    return [out[i] for i in range(len(nodes))]


@pytest.mark.parametrize("seed", range(12))
def test_event_loop_matches_the_recurrence(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    stages = chain(
        n,
        prefetch_bytes=rng.randint(1, 4) * MB // 2,
        grad_bytes=rng.choice([0, MB // 4, MB]),
        mutating=tuple(i for i in range(n) if rng.random() < 0.3),
        tied=(0, n - 1) if n > 2 and rng.random() < 0.5 else None,
    )
    costs = CostTable(
        [
            StageCost(rng.uniform(0.1, 2), rng.uniform(0.5, 4), None, rng.uniform(0, 3), rng.uniform(0, 0.5))
            for _ in range(n)
        ],
        Links(rng.choice([None, 1e6, 3e6]), rng.choice([None, 1e6, 2e6]), 1.0, rng.choice([0.0, 0.01])),
        optimizer_workers=rng.randint(1, 3),
    )
    accumulate = rng.random() < 0.5
    p = schedule_window(stages, rng.randint(1, n))
    for prog in (p, cold_backward_program(p)):
        tl = simulate(prog, costs, accumulate=accumulate)
        got = [t for e in tl.events for t in (e.start, e.end)]
        assert got == pytest.approx([t for se in _reference(prog, costs, accumulate) for t in se], abs=1e-9)
        assert sum(tl.by_resource.values()) == pytest.approx(tl.step_s)


def test_cold_rule_and_cpu_sharing_are_opt_in():
    """A compute action after `cold_idle_s` with nothing running costs its cold cost; with
    `cpu_contention` compute stretches by the host CPU work overlapping it."""
    from shfx.passes.program import lower_actions
    from shfx.passes.stages import chain

    specs = chain(2, prefetch_bytes=1000)
    prog = lower_actions(["PF0", "F0", "PF1", "F1", "B1", "OG1", "U1", "R1", "B0", "OG0", "U0", "R0"], specs, 2)
    base = [StageCost(1.0, 3.0, update_s=0.5, forward_cold_s=1.5, backward_cold_s=4.5)] * 2
    slow = CostTable(base, Links(100.0, 100.0))  # every copy takes 10 s: compute waits, idle
    assert simulate(prog, slow).step_s == simulate(prog, CostTable([StageCost(1.0, 3.0, update_s=0.5)] * 2, Links(100.0, 100.0))).step_s
    cold = CostTable(base, Links(100.0, 100.0), cold_idle_s=4.0)
    f1 = simulate(prog, cold).event("F1")
    assert f1.end - f1.start == 1.5  # F1 waited 10 s for its prefetch: cold
    fast = CostTable([StageCost(1.0, 3.0, update_s=2.0)] * 2, Links(None, None))
    shared = CostTable([StageCost(1.0, 3.0, update_s=2.0)] * 2, Links(None, None), cpu_contention=0.5)
    b0_fast, b0_shared = simulate(prog, fast).event("B0"), simulate(prog, shared).event("B0")
    # U1 (2 s on the host) overlaps B0 (3 s): B0 stretches by 0.5 x the overlap
    assert b0_shared.duration > b0_fast.duration
    assert b0_shared.duration <= b0_fast.duration + 0.5 * 2.0 + 1e-9


# ---- policies: device updates, parameter copy-back, persistent stages, static memory ----------


def test_device_step_takes_device_update_s_on_compute():
    from shfx.passes.policies import schedule_resident

    p = schedule_resident(chain(2, prefetch_bytes=100, grad_bytes=100))
    costs = CostTable([StageCost(1.0, 3.0, backward_kept_s=2.0, update_s=9.0, device_update_s=0.5)] * 2, Links(None, None))
    tl = simulate(p, costs)
    # F0 F1 B1 DU1 B0 DU0 on one stream: 1 + 1 + 2 (F1 kept its graph) + 0.5 + 3 (recompute) + 0.5
    assert tl.step_s == pytest.approx(8.0)
    du1 = tl.event("DU1")
    assert du1.stream == "compute" and du1.end - du1.start == pytest.approx(0.5)
    assert tl.by_resource["compute"] == pytest.approx(8.0) and tl.bottleneck == "compute"
    # everything resident all step, gradient buffers and optimizer states on the device
    assert tl.peak_resident == 2 and tl.grad_buffer_bytes == 200 and tl.device_state_bytes == 400
    assert tl.memory[0][1] == 200 + 200 + 400 == p.static_device_bytes()


def test_l2l_copies_updated_params_back():
    from shfx.passes.policies import schedule_l2l

    p = schedule_l2l(chain(2, prefetch_bytes=1000, grad_bytes=1000))
    costs = CostTable([StageCost(1.0, 3.0, backward_kept_s=2.0, device_update_s=0.25)] * 2, Links(1000.0, 1000.0))
    tl = simulate(p, costs)
    op1 = tl.event("OP1")
    assert op1.stream == "d2h" and op1.end - op1.start == pytest.approx(1.0)  # update_bytes at 1000 B/s
    assert op1.start == pytest.approx(tl.event("DU1").end)
    assert tl.peak_resident == 1 and tl.device_state_bytes == 2 * 2 * 1000


def test_zero_offload_refresh_is_a_copy_not_a_new_resident_stage():
    from shfx.passes.policies import schedule_zero_offload

    p = schedule_zero_offload(chain(3, prefetch_bytes=1000, grad_bytes=1000))
    tl = simulate(p, CostTable([StageCost(1.0, 3.0, update_s=0.5)] * 3, Links(1000.0, 1000.0)))
    assert tl.peak_resident == 3
    refresh = [e for e in tl.events if e.action.startswith("PF")]
    assert len(refresh) == 3 and all(e.start >= tl.event("U2").end - 1e-9 or e.start >= tl.event("U0").end for e in refresh)
    assert tl.busy_s["h2d"] == pytest.approx(3.0)


def test_policies_order_when_link_bound():
    """Same model, slow link: stronghold (overlapped window, host updates during the backward)
    beats zero-infinity (lookahead 1, updates after the backward) and l2l (serial, both ways)."""
    from shfx.passes.policies import policy_names, policy_program

    specs = chain(8, prefetch_bytes=2000, grad_bytes=2000)
    costs = CostTable([StageCost(1.0, 3.0, update_s=1.0, device_update_s=0.1)] * 8, Links(1000.0, 1000.0))
    t = {name: simulate(policy_program(name, specs, 3), costs).step_s for name in policy_names()}
    assert t["stronghold"] < t["zero-infinity"] < t["l2l"]
    assert t["resident"] < t["stronghold"]


def test_borrowed_gradient_of_a_device_group_waits_on_the_device():
    """resident with a tied head and tail: the tail's gradient of the head's weight (50 bytes)
    is held from the end of the tail's backward to the end of the head's, as the runtime does."""
    from shfx.passes.policies import schedule_resident

    p = schedule_resident(chain(3, tied=(0, 2), prefetch_bytes=100, grad_bytes=100))
    tl = simulate(p, CostTable([StageCost(1.0, 3.0)] * 3, Links(None, None)))
    b2, b0 = tl.event("B2"), tl.event("B0")
    assert tl.memory[0] == (0.0, p.static_device_bytes())
    assert (b2.end, p.static_device_bytes() + 50) in tl.memory
    assert tl.memory[-1] == (b0.end, p.static_device_bytes())


# ---- the step journal's rollback copies -----------------------------------------------------------


def test_rollback_copies_lengthen_each_host_update():
    """With rollback each CPU_STEP waits for the journal's copy of its group, a SNAPSHOT action
    the rollback pass adds (ROLLBACK_COPY_RATIO x update_s, or the stage's own rollback_s, or
    the ratio given): hand-computed on one stage."""
    from shfx.cost_model.costs import ROLLBACK_COPY_RATIO

    p = lower_actions(["PF0", "F0", "B0", "OG0", "U0", "R0"], chain(1, prefetch_bytes=MB), 1)
    costs = CostTable([StageCost(1.0, 3.0, update_s=0.5)], LINK)
    off = simulate(p, costs)
    assert times(off, "U0") == [(5.0, 5.5)] and off.step_s == 5.5
    on = simulate(p, costs, rollback=True)
    copy = round(5.0 + ROLLBACK_COPY_RATIO * 0.5, 9)
    assert times(on, "SN0") == [(5.0, copy)] and times(on, "U0") == [(copy, round(copy + 0.5, 9))]
    assert [e.action for e in on.events if e.stream == "cpu"] == ["SN0", "U0"]
    assert on.by_resource["host optimizer"] == pytest.approx(0.5 * (1 + ROLLBACK_COPY_RATIO))
    assert simulate(p, costs, rollback=2.0).step_s == pytest.approx(6.5)
    assert simulate(p, costs, rollback=0.0).step_s == off.step_s
    own = CostTable([StageCost(1.0, 3.0, update_s=0.5, rollback_s=0.25)], LINK)
    assert simulate(p, own, rollback=True).step_s == pytest.approx(5.75)
    assert simulate(p, own).step_s == off.step_s  # rollback_s costs nothing unless rollback is on
    # a program that has its copies already (compiled with rollback=True) is timed with them
    from shfx.passes.features import ROLLBACK

    assert simulate(ROLLBACK(p), own).step_s == pytest.approx(5.75)
    assert simulate(ROLLBACK(p), costs, rollback=2.0).step_s == pytest.approx(6.5)
    with pytest.raises(SimulationError, match="rollback must be"):
        simulate(p, costs, rollback=-1.0)
    with pytest.raises(SimulationError, match="rollback_s"):
        simulate(p, CostTable([StageCost(1.0, 3.0, update_s=0.5, rollback_s=-1.0)], LINK), rollback=True)


def test_rollback_copies_can_make_the_host_the_bottleneck():
    """Updates that hide behind the backward without copies may not with them."""
    specs = chain(6, prefetch_bytes=MB // 10)
    costs = table(6, fwd=1.0, bwd=2.0, upd=1.5)
    off = simulate(schedule_window(specs, 3), costs)
    on = simulate(schedule_window(specs, 3), costs, rollback=True)
    assert off.bottleneck == "compute" and on.bottleneck == "host optimizer"
    assert on.step_s > off.step_s


# ---- the NVMe tier -----------------------------------------------------------------------------


def _ssd_links(read=4e6, write=1e6, **kw) -> Links:
    return Links(1e6, 2e6, ssd_read_bps=read, ssd_write_bps=write, **kw)


def test_ssd_transfers_by_hand():
    """One stage, state 1 MB (SR/SW move m and v: 2 MB): PF0 0-1, F0 1-2 (keeps its graph),
    B0 2-4; SR0 starts when the backward is issued (2) and reads 2 MB at 4 MB/s: 2-2.5; OG0
    4-4.5; U0 waits for both: 4.5-5; SW0 writes 2 MB at 1 MB/s: 5-7. The critical path ends in
    the write-back: 2 s of ssd."""
    p = lower_actions(["PF0", "F0", "B0", "SR0", "OG0", "U0", "SW0", "R0"], chain(1, prefetch_bytes=10**6), 1,
                      ssd_groups={0}, host_window=1)  # fmt: skip
    tl = simulate(p, CostTable([StageCost(1.0, 3.0, update_s=0.5)], _ssd_links()))
    got = {e.action: (e.start, e.end, e.stream) for e in tl.events}
    assert got["SR0"] == (2.0, 2.5, "ssd_read") and got["U0"] == (4.5, 5.0, "cpu") and got["SW0"] == (5.0, 7.0, "ssd_write")
    assert tl.step_s == 7.0
    assert tl.by_resource == {"compute": 3.0, "link": 1.5, "host optimizer": 0.5, "ssd": 2.0, "network": 0.0, "idle": 0.0}
    assert tl.busy_s["ssd_read"] == 0.5 and tl.busy_s["ssd_write"] == 2.0
    assert "ssd_read" in tl.summary() and "ssd 2.00 s" in tl.summary()
    tracks = {e["args"]["name"] for e in tl.to_chrome_trace()["traceEvents"] if e.get("name") == "thread_name"}
    assert {"ssd_read", "ssd_write"} <= tracks
    # a latency per request, and nothing about the SSD in a program without the tier
    tl = simulate(p, CostTable([StageCost(1.0, 3.0, update_s=0.5)], _ssd_links(ssd_latency_s=0.25)))
    assert tl.event("SW0").end == 5.0 + 0.25 + 2.0  # SR0 ends at 2.75 (hidden behind B0)
    plain = simulate(schedule_window(chain(2), 1), CostTable([StageCost(1.0, 3.0, update_s=0.5)] * 2, Links(1e6, 1e6)))
    assert "ssd" not in plain.summary() and plain.by_resource["ssd"] == 0.0


def test_ssd_reads_and_writes_share_the_drive():
    """Two groups, host window 2: SR0 and SR1 queue on ssd_read; the write-back of one and the
    read of nothing overlap with ssd_duplex d: at d=0.5 a write running beside a read goes at
    half speed."""
    from shfx.passes.policies import ZeroInfinity

    specs = chain(2, prefetch_bytes=10**6)
    p = ZeroInfinity(nvme=True, host_window=1).program(specs)
    costs = lambda d: CostTable([StageCost(0.0, 0.0, update_s=0.0)] * 2, Links(None, None, ssd_read_bps=2e6, ssd_write_bps=2e6, ssd_duplex=d))  # noqa: E731
    # H=1: SR1 waits for SW0, so nothing overlaps: 4 transfers of 1 s
    assert simulate(p, costs(1.0)).step_s == pytest.approx(4.0)
    assert simulate(p, costs(0.5)).step_s == pytest.approx(4.0)
    # H=2: SR0, SR1 back to back (0-1, 1-2); SW0 (after U0 at 1) runs beside SR1
    p2 = ZeroInfinity(nvme=True, host_window=2).program(specs)
    assert simulate(p2, costs(1.0)).step_s == pytest.approx(3.0)
    assert simulate(p2, costs(0.5)).step_s > simulate(p2, costs(1.0)).step_s


def test_ssd_bound_is_a_lower_bound_that_binds_when_the_ssd_dominates():
    from shfx.cost_model.analytic import ssd_bound_s
    from shfx.passes.policies import Stronghold, ZeroInfinity

    specs = chain(6, prefetch_bytes=10**6)
    for d in (0.5, 0.8, 1.0):
        links = Links(1e9, 1e9, ssd_read_bps=1e6, ssd_write_bps=0.5e6, ssd_duplex=d)
        costs = CostTable([StageCost(0.01, 0.03, update_s=0.01)] * 6, links)
        for pol in (Stronghold(window=2, nvme=True, host_window=h) for h in (1, 3, 6)):
            p = pol.program(specs)
            moved = p.bytes_moved()
            bound = ssd_bound_s(moved["ssd_read"], moved["ssd_write"], links)
            tl = simulate(p, costs)
            assert tl.step_s >= bound - 1e-9
            assert tl.bottleneck == "ssd"
        # zero-infinity with the host window as wide as the model comes within the compute of the bound
        tl = simulate(ZeroInfinity(nvme=True, host_window=6).program(specs), costs)
        moved = ZeroInfinity(nvme=True, host_window=6).program(specs).bytes_moved()
        assert tl.step_s <= ssd_bound_s(moved["ssd_read"], moved["ssd_write"], links) + 12 * (0.01 + 0.03 + 0.01) + 2.0


def test_ssd_program_needs_ssd_links():
    from shfx.passes.policies import Stronghold

    p = Stronghold(window=2, nvme=True, host_window=1).program(chain(2))
    with pytest.raises(SimulationError, match=r"links.ssd_read_bps is None: give the drive's bandwidth"):
        simulate(p, CostTable([StageCost(1.0, 3.0)] * 2, Links(1e6, 1e6)))
    with pytest.raises(SimulationError, match=r"links.ssd_duplex must be in \(0, 1\]"):
        simulate(p, CostTable([StageCost(1.0, 3.0)] * 2, _ssd_links(ssd_duplex=0)))
