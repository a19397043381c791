"""Data parallel in the passes and the cost model (issue 13): the verifier's rule 9, the
ledger's per-rank host terms, the network links and the ring formula, the simulator's two
collective queues, the in-situ costs, the planner's closed form against the ledger and
``shfx plan --ranks``. The runtime's own tests are in tests/test_data_parallel.py."""

from __future__ import annotations


import pytest
import zoo

from shfx.cost_model.analytic import links_of, repeat_blocks
from shfx.cost_model.costs import CostTable, Links, StageCost, ring_collective_s
from shfx.cost_model.hardware import NETWORKS, PROFILES, get_network, with_data_parallel
from shfx.cost_model.simulate import SimulationError, simulate
from shfx.cost_model.trace import Event, in_situ_costs
from shfx.passes.ledger import DP_COLLECTIVE, DP_IMAGE, STAGING_BUFFERS, replay, shard_chunk, shard_numel, shard_range
from shfx.passes.meta import get_meta
from shfx.passes.policies import Resident, Stronghold, ZeroInfinity, ZeroOffload
from shfx.passes.program import Program, lower_actions
from shfx.passes.schedule import cold_backward_program, data_parallel_program, eval_program, steady_state_program
from shfx.passes.stages import chain
from shfx.passes.verify import RULES, VerificationError, data_parallel, verify_program


def dp(policy=None, n: int = 4, ranks: int = 2, specs=None) -> Program:
    policy = Stronghold(window=2) if policy is None else policy
    return data_parallel_program(policy.program(chain(n) if specs is None else specs), ranks)


def drop_dep(p: Program, action: str, dep: str, occurrence: int = 0) -> Program:
    node = [n for n in p.nodes if str(get_meta(n).action) == action][occurrence]
    new = [a for a in node.args[1:] if str(get_meta(a).action) != dep]
    assert len(new) < len(node.args) - 1, f"{action} does not wait for {dep}"
    node.args = (node.args[0], *new)
    return p


def drop_action(p: Program, action: str) -> Program:
    """Remove ``action`` from the graph, its dependents waiting for what it waited for."""
    node = p.find(action)
    for user in list(node.users):
        args = [a for a in user.args[1:] if a is not node]
        args += [d for d in node.args[1:] if d not in args]
        user.args = (user.args[0], *args)
    p.graph.erase_node(node)
    return p


def assert_rejects(p: Program, pattern: str) -> None:
    with pytest.raises(VerificationError, match=pattern):
        verify_program(p, "train")


# ---- the verifier's rule 9 ---------------------------------------------------------------------


def test_the_rule_is_registered_after_the_nvme_rule():
    names = [r.__name__ for r in RULES]
    assert names.index("ssd_tier") + 1 == names.index("data_parallel") and RULES[names.index("data_parallel")] is data_parallel


@pytest.mark.parametrize("ranks", [2, 3, 8])
@pytest.mark.parametrize(
    "policy",
    [Stronghold(window=1), Stronghold(window=2), Stronghold(window=2, deferred_update=True), ZeroOffload(), ZeroInfinity(),
     ZeroInfinity(lookahead=2, deferred_update=True)],
    ids=str,
)
def test_valid_data_parallel_programs_pass(policy, ranks):
    for specs in (chain(4), chain(5, tied=(0, 4), mutating=(1,))):
        p = data_parallel_program(policy.program(specs), ranks)
        verify_program(p, "train")
        verify_program(eval_program(p), "eval")
        verify_program(cold_backward_program(p), "backward")
        verify_program(steady_state_program(p), "auto", rules=[data_parallel])


def test_reduce_waits_for_every_contributor():
    # removing the edge
    assert_rejects(drop_dep(dp(), "RS2", "OG2"), r"RS2 \(#\d+\) does not wait for OG2")
    # the tied embedding: stage 4 sends gradients to group 0 too
    p = dp(n=5, specs=chain(5, tied=(0, 4)))
    assert_rejects(drop_dep(p, "RS0", "OG4"), r"RS0 \(#\d+\) does not wait for OG4")


def test_reduce_exactly_once():
    assert_rejects(drop_action(dp(), "RS1"), r"U1 \(#\d+\) reads group 1's gradient, but no RS1 before it")
    # twice: lowered by hand (the lowering takes any order)
    acts = "PF0 PF1 F0 F1 B1 OG1 RS1 RS1 U1 AG1 R1 B0 OG0 RS0 U0 AG0 R0".split()
    p = lower_actions(acts, chain(2), 2, ranks=2)
    assert_rejects(p, "RS1 appears 2 times")


def test_reduce_before_a_contributor_is_rejected():
    p = dp(n=2, specs=chain(2))
    og1, rs1 = p.find("OG1"), p.find("RS1")
    og1.prepend(rs1)  # issue RS1 before the OG it waits for (the lowering would refuse this order)
    with pytest.raises(VerificationError) as e:
        verify_program(p, "train", rules=[data_parallel])
    msg = str(e.value)
    assert "RS1 (#5) reduces group 1's gradient before OG1 (stage 1 sends gradients to it) has run" in msg
    assert "OG1 (#6) sends gradients to group 1 after RS1 (#5) reduced it" in msg


def test_update_and_norm_wait_for_the_reduction():
    assert_rejects(drop_dep(dp(), "U3", "RS3"), r"U3 \(#\d+\) does not wait for RS3")
    p = dp(Stronghold(window=2, deferred_update=True))
    assert_rejects(drop_dep(p, "GN1", "RS1"), r"GN1 \(#\d+\) does not wait for RS1")


def test_every_update_has_one_gather_that_waits_for_it():
    assert_rejects(drop_dep(dp(), "AG2", "U2"), r"AG2 \(#\d+\) does not wait for U2")
    assert_rejects(drop_action(dp(), "AG2"), r"U2 \(#\d+\) is not followed by an AG2")
    acts = "PF0 PF1 F0 F1 B1 OG1 RS1 U1 AG1 AG1 R1 B0 OG0 RS0 U0 AG0 R0".split()
    assert_rejects(lower_actions(acts, chain(2), 2, ranks=2), r"AG1 \(#\d+\) gathers group 1 again after U1")


def test_a_later_prefetch_waits_for_the_gather():
    # ZeroOffload prefetches every stage after the updates: PF0 must wait for AG0
    assert_rejects(drop_dep(dp(ZeroOffload()), "PF0", "AG0"), r"PF0 \(#\d+\) copies group 0's weights but does not wait for AG0")


def test_the_next_steps_prefetch_waits_for_the_deferred_gather():
    p = dp(Stronghold(window=2, deferred_update=True))
    steady = steady_state_program(p)
    node = steady.find("PF1")
    prev = [a for a in node.args[1:] if a.name.endswith("_prev")]
    assert [get_meta(a).action for a in prev] and all(get_meta(a).kind.value == "AG" for a in prev)
    verify_program(steady, "auto", rules=[data_parallel])
    # drop the cross-step edge: the steady state's PF1 reads an image still being gathered
    node.args = (node.args[0], *[a for a in node.args[1:] if not a.name.endswith("_prev")])
    with pytest.raises(VerificationError, match=r"PF1 \(#\d+\) copies group 1's weights but does not wait for AG1"):
        verify_program(steady, "auto", rules=[data_parallel])


def test_collectives_need_ranks_and_device_updates_are_all_reduced_first():
    p = dp()
    p.ranks = 1
    with pytest.raises(VerificationError, match=r"RS3 \(#\d+\) is a data-parallel collective, but the program runs on one rank"):
        verify_program(p, "train", rules=[data_parallel])
    # a device-updated group is replicated: RS g (its device gradient all-reduced) after its last
    # B, before its DU g; no AG
    r = data_parallel_program(Resident().program(chain(3)), 2)
    assert " ".join(r.actions()) == "F0 F1 F2 B2 RS2 DU2 B1 RS1 DU1 B0 RS0 DU0"
    verify_program(r, "train")
    assert get_meta(r.find("RS1")).stream == "reduce" and get_meta(r.find("RS1")).bytes == 2 * chain(3)[1].grad_bytes_to({1})
    bare = Resident().program(chain(3))
    bare.ranks = 2
    with pytest.raises(VerificationError, match=r"DU2 \(#\d+\) reads group 2's device gradient, but no RS2 before it"):
        verify_program(bare, "train", rules=[data_parallel])


# ---- the ledger ----------------------------------------------------------------------------------


def test_sharding_rule():
    """chunk = ceil(T / N) rounded up to 16 elements; rank r owns [r chunk, min(T, (r+1) chunk))."""
    assert [shard_chunk(100, n) for n in (1, 2, 3, 4, 7, 200)] == [112, 64, 48, 32, 16, 16]
    for total in (0, 1, 15, 16, 17, 100, 1000, 1001):
        for ranks in (1, 2, 3, 4, 8):
            spans = [shard_range(total, r, ranks) for r in range(ranks)]
            assert spans[0][0] == 0 and spans[-1][1] == total and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert all((hi - lo) % 16 == 0 for lo, hi in spans if hi < total), spans  # cuts at multiples of 16
            assert max(hi - lo for lo, hi in spans) == shard_numel(total, ranks) <= shard_chunk(total, ranks)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_host_terms_per_rank_by_hand(ranks):
    """Three groups of 250 fp32 elements (1000 bytes): chunk = ceil(250 / N) rounded up to 16;
    rank r's masters, gradients and m, v are 4 n bytes per group (n: the elements it owns), the
    image whole (1000 per group), two staging buffers and the all-gather's output of the padded
    length N chunk, its send chunk and the reduce-scatter's chunk."""
    p = dp(n=3, ranks=ranks, specs=chain(3, prefetch_bytes=1000))
    c = {2: 128, 3: 96, 4: 64}[ranks]
    for rank in range(ranks):
        n = min(250, (rank + 1) * c) - min(250, rank * c)
        want = {
            "master parameters (fp32)": 3 * 4 * n,
            DP_IMAGE: 3000,
            "gradients (fp32)": 3 * 4 * n,
            "optimizer states (m, v)": 2 * 3 * 4 * n,
            "gradient staging (pinned)": STAGING_BUFFERS * ranks * c * 4,
            DP_COLLECTIVE: ranks * c * 4 + 2 * c * 4,
        }
        assert replay(p, rank=rank).static("host") == {k: v for k, v in want.items() if v}, rank
    # the ranks' shards tile the groups: 16 bytes per parameter over all ranks, as one rank has
    total = sum(replay(p, rank=r).static("host").get(t, 0) for r in range(ranks) for t in ("master parameters (fp32)", "gradients (fp32)", "optimizer states (m, v)"))
    one = replay(Stronghold(window=2).program(chain(3, prefetch_bytes=1000))).static("host")
    assert one == {"master parameters (fp32)": 3000, "gradients (fp32)": 3000, "optimizer states (m, v)": 6000}
    assert total == sum(one.values())


def test_host_terms_of_device_groups_per_rank():
    """A group updated on the device (resident_first=1) is replicated: on the host its image and
    the master shard the store lays out, no gradient or state; the all-reduce's host scratch of
    its gradient (a GPU's) among the collective buffers."""
    from shfx.passes.ledger import host_terms

    p = data_parallel_program(Stronghold(window=2, resident_first=1).program(chain(3, prefetch_bytes=1000)), 2)
    host = replay(p, rank=0).static("host")
    n = 128  # shard_numel(250, 2, 0)
    assert host == {
        "master parameters (fp32)": 3 * 4 * n, DP_IMAGE: 3000, "gradients (fp32)": 2 * 4 * n,
        "optimizer states (m, v)": 2 * 2 * 4 * n, "gradient staging (pinned)": STAGING_BUFFERS * 2 * n * 4,
        DP_COLLECTIVE: 2 * n * 4 + 2 * n * 4 + 250 * 4,
    }  # fmt: skip
    # in 16 bits: the working copy is the image, the master shard is the store's (the device master
    # is all-gathered from the shards), no refusal
    terms = host_terms(chain(2), {0}, ranks=2, working_bytes=[100, 100])
    assert not any(c.term == DP_IMAGE for c in terms)


# ---- links and the ring formula --------------------------------------------------------------------


def test_ring_formula():
    assert ring_collective_s(8e9, 1, 1e9, 1.0) == 0.0
    assert ring_collective_s(8e9, 2, 1e9, 0.5) == 4.0 + 0.5
    assert ring_collective_s(8e9, 8, 2e9, 1e-3) == pytest.approx(3.5 + 7e-3)


def test_collective_link_is_the_slowest_of_the_ring():
    v100 = PROFILES["V100-32GB-PCIe3"]
    assert v100.collective_link() == (None, 0.0)
    one_node = with_data_parallel(v100, 8)
    assert one_node.collective_link() == (12e9, 10e-6)  # PCIe 3 between the V100s
    for net in ("25gbe", "100gbe"):
        n = get_network(net)
        assert with_data_parallel(v100, 8, nodes=8, network=net).collective_link() == (n.bps, n.latency_s)
    mixed = with_data_parallel(v100, 8, nodes=2, network="100gbe")
    assert mixed.collective_link() == (min(12e9, NETWORKS["100gbe"].bps), max(10e-6, NETWORKS["100gbe"].latency_s))
    assert links_of(one_node).net_bps == 12e9 and links_of(v100).net_bps is None
    with pytest.raises(ValueError, match="do not spread evenly"):
        with_data_parallel(v100, 6, nodes=4, network="25gbe")
    with pytest.raises(ValueError, match="need a network"):
        with_data_parallel(v100, 8, nodes=2)
    with pytest.raises(KeyError, match="unknown network 'ib'"):
        get_network("ib")


# ---- the simulator ---------------------------------------------------------------------------------


def _costs(n: int, **links) -> CostTable:
    return CostTable([StageCost(1.0, 3.0, update_s=0.5)] * n, Links(1e6, 1e6, **links))


def test_collectives_by_hand():
    """Two stages of 1 MB, 4 ranks, network 1 MB/s, 0.1 s per ring step: a collective takes
    3 x 0.1 + 3/4 x 1 = 1.05 s. PF0 0-1, PF1 1-2, F0 1-2, F1 2-3, B1 3-5, OG1 5-6, RS1 6-7.05,
    U1 7.05-7.55, AG1 7.55-8.6; B0 5-8, OG0 8-9, RS0 9-10.05, U0 10.05-10.55, AG0 10.55-11.6.
    The critical path: compute 6, link 3 (PF0, OG1... OG0), host 0.5, network 2.1."""
    p = dp(n=2, ranks=4, specs=chain(2, prefetch_bytes=10**6))
    tl = simulate(p, _costs(2, net_bps=1e6, net_latency_s=0.1))
    got = {e.action: (round(e.start, 9), round(e.end, 9), e.stream) for e in tl.events}
    assert got["RS1"] == (6.0, 7.05, "reduce") and got["U1"] == (7.05, 7.55, "cpu") and got["AG1"] == (7.55, 8.6, "gather")
    assert got["RS0"] == (9.0, 10.05, "reduce") and got["AG0"] == (10.55, 11.6, "gather")
    assert tl.step_s == pytest.approx(11.6)
    by = {k: round(v, 9) for k, v in tl.by_resource.items()}
    assert by == {"compute": 6.0, "link": 3.0, "host optimizer": 0.5, "ssd": 0.0, "network": 2.1, "idle": 0.0}
    assert tl.busy_s["reduce"] == pytest.approx(2.1) and "reduce" in tl.summary()
    # the same durations as the formula
    assert got["RS1"][1] - got["RS1"][0] == pytest.approx(Links(None, None, net_bps=1e6, net_latency_s=0.1).collective_time_s(10**6, 4))


def test_reduce_of_a_stage_overlaps_the_backward_of_the_one_before():
    p = dp(n=4, ranks=8, specs=chain(4, prefetch_bytes=10**6))
    tl = simulate(p, _costs(4, net_bps=2e6, net_latency_s=0.01))
    for s in (3, 2, 1):
        rs, b = tl.event(f"RS{s}"), tl.event(f"B{s - 1}", phase="backward")
        assert rs.start < b.end and rs.end > b.start, (s, rs, b)


def test_the_two_queues_share_the_network():
    """A slow network (a collective 2.5 s): AG2 (after U2) runs while RS1 reduces; with
    net_duplex 0.5 each goes at half the rate while both move bytes, so both take longer than
    alone and the step too."""
    p = dp(n=3, ranks=2, specs=chain(3, prefetch_bytes=10**6))
    alone = simulate(p, _costs(3, net_bps=0.2e6, net_duplex=1.0))
    shared = simulate(p, _costs(3, net_bps=0.2e6, net_duplex=0.5))
    ag2, rs1 = alone.event("AG2"), alone.event("RS1")
    assert ag2.start < rs1.end and rs1.start < ag2.end  # they overlap
    assert ag2.end - ag2.start == pytest.approx(2.5) and rs1.end - rs1.start == pytest.approx(2.5)
    for a in ("AG2", "RS1"):
        assert shared.event(a).end - shared.event(a).start > 2.5 + 1e-9
    assert shared.step_s > alone.step_s


def test_a_data_parallel_program_needs_a_network():
    with pytest.raises(SimulationError, match=r"data parallel over 2 ranks .* links.net_bps is None"):
        simulate(dp(), _costs(4))


def test_the_trace_draws_the_collective_lanes():
    tl = simulate(dp(n=2, ranks=2, specs=chain(2, prefetch_bytes=10**6)), _costs(2, net_bps=1e6))
    trace = tl.to_chrome_trace()["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    assert {"reduce", "gather"} <= set(tracks.values())
    on = {e["name"]: tracks[e["tid"]] for e in trace if e.get("ph") == "X"}
    assert on["RS0"] == "reduce" and on["AG1"] == "gather"
    plain = simulate(Stronghold(window=2).program(chain(2)), _costs(2)).to_chrome_trace()["traceEvents"]
    assert not {"reduce", "gather"} & {e["args"]["name"] for e in plain if e.get("name") == "thread_name"}


def test_in_situ_costs_take_the_measured_network_rate():
    """A measured RS of 1 MB over 4 ranks that took 0.3 + 1.5 s: (3/4 MB) / 1.5 s = 0.5 MB/s."""
    p = dp(n=2, ranks=4, specs=chain(2, prefetch_bytes=10**6))
    costs = _costs(2, net_bps=1e6, net_latency_s=0.1, ssd_read_bps=5e6)
    ev = [Event("RS1", "backward", "reduce", 10.0, 11.8, 10**6), Event("AG1", "backward", "gather", 12.0, 13.8, 10**6)]
    got = in_situ_costs(p, costs, [(10.0, 14.0, ev)], overheads=False)
    assert got.links.net_bps == pytest.approx(0.5e6) and got.links.net_latency_s == 0.1
    assert got.links.ssd_read_bps == 5e6  # kept


# ---- the planner ---------------------------------------------------------------------------------

import torch  # noqa: E402

from shfx.cost_model.planner import Target, largest_trainable, memory_for_model, memory_model, plan  # noqa: E402
from shfx.models import GPT, GPTShape  # noqa: E402
from shfx.passes.pipeline import build_programs  # noqa: E402
from shfx.passes.policies import make_policy  # noqa: E402

REF = GPTShape(hidden=2048, heads=16, seq=1024, batch=4, vocab=50304)
V100 = "V100-32GB-PCIe3"
EMU = Target("emulated", 1 << 40, emulated=True)
SMALL = GPTShape(hidden=32, heads=2, seq=16, batch=2, vocab=64)


@pytest.fixture(scope="module")
def template():
    """A captured two-block GPT (meta device) whose block stage repeat_blocks copies to any depth."""
    # vocab 512: the tail's slot is larger than a block's; hidden 33: groups not multiples of N
    return {fam: zoo.capture_gpt_template(fam) for fam in (SMALL, GPTShape(hidden=33, heads=3, seq=16, batch=2, vocab=512))}


def test_closed_form_is_the_ledger_with_data_parallel(template):
    """The GPT closed form with ``ranks`` is the ledger's replay of the data-parallel program
    (built from the repeated blocks' specs) at several depths, ranks and policies: device terms
    at the peak and host terms per rank."""
    for fam, graph in template.items():
        for L in (1, 2, 5):
            specs, _ = repeat_blocks(graph.specs, None, range(1, 3), L)
            for ranks in (2, 3, 4, 8):
                # (resident, l2l, resident_first: groups updated on the device, replicated)
                pols = [("zero-offload", {}), ("zero-infinity", {})] + [("stronghold", {"window": w}) for w in (1, 2, 3)]
                pols += [("resident", {}), ("l2l", {}), ("stronghold", {"window": 2, "resident_first": 1})]
                for policy, kw in pols:
                    for rollback in (False, True):
                        want = memory_model(policy, fam.with_layers(L), EMU, ranks=ranks, rollback=rollback, **kw)
                        progs = build_programs(specs, make_policy(policy, **kw), verify=True, ranks=ranks)
                        assert progs[0].ranks == ranks
                        led = replay(progs[0], programs=progs, rollback=rollback)
                        where = (fam.vocab, L, ranks, policy, kw, rollback)
                        assert led.static("host") == {k: v for k, v in want.host.items() if v}, where
                        dev = {k: v for k, v in led.terms_at_peak("device").items() if v}
                        assert dev == {k: v for k, v in want.device.items() if v}, where


def test_closed_form_is_the_ledger_with_the_nvme_tier(template):
    """The NVMe tier (issue 25), on one rank and per rank with data parallel, with and without
    rollback: the states (each rank's shards) on the SSD, the host window's buffers of the
    largest (shard) and the step counters in RAM; with rollback the journal copies masters and
    steps, and the SSD holds the states' previous version too."""
    fam, graph = next(iter(template.items()))
    specs, _ = repeat_blocks(graph.specs, None, range(1, 3), 3)
    for ranks in (1, 2, 3):
        for policy in ("zero-infinity", "stronghold"):
            for rollback in (False, True):
                kw = dict(nvme=True, host_window=2) | ({"window": 2} if policy == "stronghold" else {})
                want = memory_model(policy, fam.with_layers(3), EMU, ranks=ranks, rollback=rollback, **kw)
                progs = build_programs(specs, make_policy(policy, **kw), verify=True, ranks=ranks)
                led = replay(progs[0], programs=progs, rollback=rollback)
                where = (ranks, policy, rollback)
                assert led.static("host") == {k: v for k, v in want.host.items() if v}, where
                assert led.static("ssd") == {k: v for k, v in want.ssd.items() if v}, where


def test_closed_form_is_the_ledger_with_device_groups_accumulating(template):
    """Data parallel with ``grad_accum_steps > 1`` (issue 25): each group updated on the device
    keeps the sum of its all-reduced micro-step gradients in an fp32 accumulator on the device
    (4 B/param, term ``gradients``), in fp32 too (one process in fp32 accumulates in the
    gradient buffer): the closed form equals the ledger's replay, per rank."""
    fam, graph = next(iter(template.items()))
    specs, _ = repeat_blocks(graph.specs, None, range(1, 3), 2)
    for policy, kw in (("resident", {}), ("stronghold", {"window": 2, "resident_first": 1})):
        want = memory_model(policy, fam.with_layers(2), EMU, ranks=2, grad_accum_steps=2, **kw)
        progs = build_programs(specs, make_policy(policy, **kw), verify=True, ranks=2)
        led = replay(progs[0], programs=progs, grad_accum_steps=2)
        assert led.static("host") == {k: v for k, v in want.host.items() if v}, policy
        assert {k: v for k, v in led.terms_at_peak("device").items() if v} == {k: v for k, v in want.device.items() if v}, policy
        owners = {s.update_group: s for s in progs[0].stages if s.update_group is not None}
        accs = {c.what: c.nbytes for c in led.changes("device") if c.what.startswith("gradient accumulator")}
        assert accs == {f"gradient accumulator (fp32) of group {g}": owners[g].update_bytes for g in sorted(progs[0].device_groups())}
        one = memory_model(policy, fam.with_layers(2), EMU, grad_accum_steps=2, **kw)
        assert want.device["gradients"] - one.device["gradients"] == sum(accs.values()), policy


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp16", marks=pytest.mark.slow)])  # (fp16: the slow run)
def test_closed_form_is_the_captured_models_ledger_in_16_bit(precision):
    """In mixed precision the image stays the 16-bit working copy; the fp32 master, gradient and
    states are sharded: the closed form equals memory_for_model's replay of the real capture."""
    fam = GPTShape(hidden=32, heads=2, seq=16, batch=2, vocab=64, layers=3, precision=precision)
    with torch.device("meta"):
        model = GPT(fam)
        idx = torch.zeros(fam.batch, fam.seq, dtype=torch.long)
    for ranks in (2, 4):
        want = memory_model("stronghold", fam, EMU, ranks=ranks)
        got = memory_for_model("stronghold", model, (idx, idx), EMU, precision=precision, ranks=ranks)
        assert got.host == want.host, (precision, ranks)
        assert got.host["working copy (16-bit)"] > 0 and got.host[DP_IMAGE] == 0
    # groups updated on the device in 16 bits (replicated: the device masters all-gathered from the
    # fp32 master shards; fp16: the journal's whole copies of them), per rank
    for policy, kw in (("resident", {}), ("stronghold", {"window": 2, "resident_first": 1})):
        want = memory_model(policy, fam, EMU, ranks=2, **kw)
        got = memory_for_model(policy, model, (idx, idx), EMU, precision=precision, ranks=2, **kw)
        assert (got.host, got.device) == (want.host, want.device), (precision, policy)


def test_host_bytes_per_parameter_fall_as_16_over_n():
    """Master, gradient, m and v: 16 bytes per parameter on one rank, ~16/N per rank with N."""
    fam = REF.with_layers(40)
    one = memory_model("stronghold", fam, V100)
    n_params = fam.num_params()
    state = lambda bd: sum(bd.host[k] for k in ("master parameters (fp32)", "gradients (fp32)", "optimizer states (m, v)"))  # noqa: E731
    assert state(one) / n_params == pytest.approx(16, rel=1e-3)
    for ranks in (2, 4, 8):
        bd = memory_model("stronghold", fam, V100, ranks=ranks)
        assert state(bd) / n_params == pytest.approx(16 / ranks, rel=1e-3)
        assert bd.host[DP_IMAGE] == one.host["master parameters (fp32)"]  # the fp32 image, whole on every rank
        assert bd.device == one.device


def test_data_parallel_with_device_updates():
    """resident, l2l and resident_first=k per rank: the device terms those of one process (the
    device states whole on every rank), on the host the image whole and a master shard for
    every group; in mixed precision too."""
    fam = REF.with_layers(4)
    for policy, kw in (("resident", {}), ("l2l", {}), ("stronghold", {"resident_first": 2})):
        one, bd = memory_model(policy, fam, V100, **kw), memory_model(policy, fam, V100, ranks=4, **kw)
        assert bd.device == one.device, policy
        assert bd.host[DP_IMAGE] == one.host["master parameters (fp32)"], policy
    # in 16 bits too (the device masters all-gathered from the shards): the device terms one process's
    fam16 = GPTShape(hidden=64, heads=2, seq=16, batch=2, vocab=64, layers=2, precision="bf16")
    assert memory_model("resident", fam16, V100, ranks=2).device == memory_model("resident", fam16, V100).device
    with pytest.raises(ValueError, match="disagrees with the target's 8 ranks"):
        memory_model("stronghold", REF.with_layers(4), with_data_parallel(V100, 8), ranks=4)


def test_plan_for_ranks_and_nodes():
    """One node of 8 shares 90 GiB among 8 ranks, each holding the whole image: fewer layers
    than one rank; 8 nodes of 1 each have 90 GiB for 1/8 of the states: more. The policies
    updating on the device are left out and said so."""
    one = plan(REF, V100)
    node = plan(REF, with_data_parallel(V100, 8))
    nodes = plan(REF, with_data_parallel(V100, 8, nodes=8, network="25gbe"))
    assert [r.policy for r in node.rows] == ["zero-offload", "zero-infinity", "stronghold"]
    assert node.settings["not data parallel"] == ["resident", "l2l"] and "left out" in node.table()
    assert node.row("stronghold").layers < one.row("stronghold").layers < nodes.row("stronghold").layers
    assert node.hardware.host_bytes == one.hardware.host_bytes // 8 and node.hardware.ranks == 8
    # the largest size fits per rank, one more does not (the search against the memory model)
    for p in (node, nodes):
        r = p.row("stronghold")
        bd = memory_model("stronghold", REF.with_layers(r.layers + 1), p.hardware)
        assert r.breakdown.fits() and not bd.fits()
        assert r.breakdown.host_total * p.hardware.ranks_per_node <= get_profile_host(V100)
    auto = largest_trainable("stronghold", REF, with_data_parallel(V100, 4), resident_first="auto")
    assert auto.breakdown.settings["resident_first"] == 0


def get_profile_host(name: str) -> int:
    return PROFILES[name].host_memory_bytes


def test_cli_plan_ranks(capsys):
    from shfx.cli import main

    small = ["--hidden", "64", "--heads", "2", "--seq", "32", "--batch", "2", "--vocab", "128", "--max-layers", "40"]
    assert main(["plan", "--ranks", "4", "--nodes", "2", "--network", "100gbe", "--layers", "3", *small]) == 0
    out = capsys.readouterr().out
    assert "data parallel over 4 ranks" in out and "left out" in out and "resident, l2l" in out
    assert "simulated step at the largest size (4 ranks x batch 2 = 8 samples per step)" in out
    steps = [line for line in out.splitlines() if "samples/s" in line]
    assert [line.split()[0] for line in steps] == ["zero-offload", "zero-infinity", "stronghold"]
    assert "at 3 layers" in out and "parameter image (whole)" in out
    assert main(["plan", "--nodes", "2"]) == 1
    assert "give --ranks too" in capsys.readouterr().err
    assert main(["plan", "--ranks", "4", "--nodes", "2"]) == 1
    assert "need a network" in capsys.readouterr().err
    assert main(["plan", "--ranks", "2", "--emulated", "--device-memory", "1GiB"]) == 1
    assert "--ranks needs a hardware profile" in capsys.readouterr().err


@pytest.mark.parametrize("ranks", [2, 8])
@pytest.mark.parametrize(
    "policy",
    [Stronghold(window=1), Stronghold(window=3), Stronghold(window=2, deferred_update=True), ZeroOffload(), ZeroInfinity()],
    ids=str,
)
def test_simulated_data_parallel_steps_keep_the_invariants(policy, ranks):
    """Over policies and ranks: the critical path's resources sum to the step, the network's
    busy time is the ring formula summed over the collectives (alone or slowed by sharing), and
    every edge of the program is respected (RS after its OGs, U after RS, AG after U)."""
    specs = chain(5, prefetch_bytes=10**6, tied=(0, 4))
    p = data_parallel_program(policy.program(specs), ranks)
    links = dict(net_bps=0.5e6, net_latency_s=0.01)
    tl = simulate(p, _costs(5, **links))
    assert sum(tl.by_resource.values()) == pytest.approx(tl.step_s)
    alone = Links(None, None, **links)
    for e in tl.events:
        if e.stream in ("reduce", "gather"):
            assert e.end - e.start >= alone.collective_time_s(e.bytes, ranks) - 1e-9
            assert e.end - e.start <= alone.collective_time_s(e.bytes, ranks, both=True) + 1e-9
        ends = {d: tl.events[[x.node for x in tl.events].index(d)].end for d in e.deps}
        if e.stream != "none":
            assert all(e.start >= t - 1e-9 for t in ends.values()), e
    if "deferred" not in str(policy):
        assert tl.by_resource["network"] > 0


def test_tune_window_with_data_parallel():
    """A slow network makes every window pay the collectives that end the step: the tuned
    step is longer with 8 ranks than with one, the window the tuner picks still fits, and the
    rows' programs are data parallel (network time on their critical path)."""
    from shfx.cost_model.tune import tune_window

    specs = chain(6, prefetch_bytes=10**6)
    costs = _costs(6, net_bps=0.5e6, net_latency_s=0.01)
    one = tune_window(specs, costs)
    dp8 = tune_window(specs, costs, ranks=8)
    assert dp8.rows[0].timeline.step_s > one.rows[0].timeline.step_s
    assert all(r.by_resource["network"] > 0 for r in dp8.rows) and all(r.by_resource["network"] == 0 for r in one.rows)
    assert dp8.policy.resident_first == 0
    with pytest.raises(ValueError, match="ranks must be an int >= 1"):
        tune_window(specs, costs, ranks=0)
