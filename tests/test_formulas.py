"""The closed-form formulas of :mod:`shfx.cost_model.formulas` against brute force: numeric
evaluation, the simulator's memory peaks and step times, searches over layers and windows."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import sympy as sp
import torch

from shfx.cost_model import formulas as fm
from shfx.cost_model.costs import CostTable, Links, StageCost
from shfx.cost_model.formulas import StageTimes
from shfx.cost_model.hardware import Hardware, get_profile
from shfx.cost_model.simulate import simulate
from shfx.passes.schedule import schedule_window
from shfx.passes.stages import StageSpec, chain

# A small GPT shape: formulas are checked at these numbers (bytes stay small and exact).
SMALL = dict(h=64, a=4, s=32, b=2, V=97)


def gpt_like_specs(l: int, h: int, s: int, b: int, V: int, **_) -> list[StageSpec]:
    """Stage specs of a GPT built from the formulas' byte counts: head, ``l`` blocks, tail
    (which sends gradients to the head's group too, as the tied lm_head does)."""
    counts = fm.stage_param_counts(h, s, V)
    act = int(fm.activation_bytes(b, s, h))
    specs = chain(l + 2, tied=(0, l + 1))
    out = []
    for i, sp_ in enumerate(specs):
        kind = "head" if i == 0 else "tail" if i == l + 1 else "block"
        slot = int(fm.FP32 * counts[kind]["slot"])
        out.append(
            replace(
                sp_,
                prefetch_bytes=slot,
                grad_bytes=int(fm.FP32 * counts[kind]["grad"]),
                grad_group_bytes=(),  # every gradient byte goes to the host (no device updates here)
                slot_bytes=slot,
                activation_bytes=fm.FP32 if kind == "tail" else act,  # the tail keeps the loss
            )
        )
    return out


def uniform_table(n, f, bk, u, bw, *, duplex=1.0, latency=0.0):
    return CostTable([StageCost(f, bk, update_s=u)] * n, Links(bw, bw, duplex=duplex, latency_s=latency))


# ---- parameters and memory -----------------------------------------------------------------------
def test_parameter_counts_match_a_captured_gpt():
    """Slot, gradient and activation bytes of a captured GPT equal the formulas', and its
    analytic stage costs equal gpt_stage_times (with the analytic model's FLOP count)."""
    from shfx.cost_model.analytic import plan_inputs
    from shfx.models.gpt import GPT, GPTShape

    h, a, s, b, V = (SMALL[k] for k in "hasbV")
    hw = get_profile("V100-32GB-PCIe3")
    cfg = lambda n: GPTShape(vocab=V, seq=s, layers=n, heads=a, hidden=h)  # noqa: E731
    specs, table = plan_inputs(
        lambda n: GPT(cfg(n)), lambda: (torch.zeros(b, s, dtype=torch.long),) * 2,
        blocks="transformer.h", layers=5, hardware=hw,
    )
    assert [x.name for x in specs][0] == "head" and specs[-1].name == "tail" and len(specs) == 7
    assert GPTShape(vocab=V, seq=s, layers=5, heads=a, hidden=h).num_params() == fm.params_total(5, h, s, V)
    want = gpt_like_specs(5, h, s, b, V)
    for got, exp in zip(specs, want):
        assert (got.prefetch_bytes, got.grad_bytes, got.slot_bytes) == (exp.prefetch_bytes, exp.grad_bytes, exp.slot_bytes)
        assert got.activation_bytes == exp.activation_bytes
    st = fm.gpt_stage_times(hw, h, s, b, V)  # the analytic model counts attention FLOPs too
    for i, kind in ((0, "head"), (1, "block"), (6, "tail")):
        c = table.costs[i]
        assert float(st[kind].f) == pytest.approx(c.forward_s, rel=1e-12)
        assert float(st[kind].b) == pytest.approx(c.backward_s, rel=1e-12)
        assert float(st[kind].u) == pytest.approx(c.update_s, rel=1e-12)
        assert float(st[kind].pf) == pytest.approx(table.links.time_s("h2d", specs[i].prefetch_bytes), rel=1e-12)
        assert float(st[kind].og) == pytest.approx(table.links.time_s("d2h", specs[i].grad_bytes), rel=1e-12)


def test_stage_work_counts_every_capture_on_one_device(monkeypatch):
    """The analytic model's fake run puts a stage's inputs and every tensor its ops create on
    one device (the CPU), whether the model was captured on the CPU, on the meta device (the
    planner's captures) or retargeted to CUDA by the compile pipeline, and counts the same work
    for all three. Fake tensors on torch 2.11 refuse an op whose inputs mix cpu and meta (a meta
    capture's ``arange(..., device=meta)`` into the position embedding); 2.13 runs it, so the
    test records each op's devices instead of relying on the error."""
    from torch.utils._pytree import tree_leaves

    from shfx.cost_model import analytic
    from shfx.models.gpt import GPT, GPTShape
    from shfx.passes.capture import capture_model
    from shfx.passes.partition import partition_stages
    from shfx.passes.retarget import device_arguments, retarget_device

    devices: list[set] = []

    class Recording(analytic._BytesMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            devices.append({t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)})
            return super().__torch_dispatch__(func, types, args, kwargs)

    monkeypatch.setattr(analytic, "_BytesMode", Recording)
    h, a, s, b, V = (SMALL[k] for k in "hasbV")

    def graph(device):
        with torch.device(device):
            model = GPT(GPTShape(vocab=V, seq=s, layers=2, heads=a, hidden=h))
            idx = torch.zeros(b, s, dtype=torch.long)
        return partition_stages(capture_model(model, (idx, idx)), model=model)

    on_cpu, on_meta = graph("cpu"), graph("meta")
    assert torch.device("meta") in set().union(*(device_arguments(st.gm) for st in on_meta.stages))
    on_cuda = graph("cpu")
    for st in on_cuda.stages:
        st.gm = retarget_device(st.gm, "cuda")
    want = analytic.stage_work(on_cpu)
    for g in (on_meta, on_cuda):
        devices.clear()
        assert analytic.stage_work(g) == want
        assert devices and all(d == {torch.device("cpu")} for d in devices if d)


def test_device_memory_terms_evaluate_to_hand_numbers():
    h, a, s, b, V = 2048, 16, 1024, 4, 50304
    W, l = 4, 48
    terms = {t.name: t for t in fm.device_memory_terms(W, l, h, a, s, b, V)}
    A = 4 * b * s * h
    slot = 4 * max((V + s) * h, 12 * h * h + 13 * h, 2 * h + V * h)
    assert slot == 4 * (V + s) * h  # the embedding stage is the largest
    block, tail = 4 * (12 * h * h + 13 * h), 4 * (2 * h + V * h)
    # stage i sits in slot i mod W: head (slot 0) and tail (slot 49 mod 4 = 1) each beside blocks
    assert int(terms["slot_pool"].expr) == slot + tail + (W - 2) * block
    assert int(terms["activations"].expr) == (l + 1) * A + 4
    assert int(terms["boundary_grads"].expr) == A
    assert int(terms["output_grad"].expr) == 4  # the loss's gradient, as the runtime holds it
    assert int(terms["inputs"].expr) == 2 * 8 * b * s
    block_ws = 2 * s * b * h * (34 + 5 * a * s / h)
    assert float(terms["workspace"].expr) == pytest.approx(max(block_ws, 3 * 4 * b * s * V))
    sim = slot + tail + (W - 2) * block + (l + 2) * A + 4 + 4  # ... the loss and its gradient
    assert int(fm.device_memory(W, l, h, a, s, b, V, counted_by="simulator")) == sim
    assert int(fm.device_memory(W, l, h, a, s, b, V, counted_by="emulated")) == sim + 2 * 8 * b * s
    gpu = fm.device_memory(W, l, h, a, s, b, V, counted_by="gpu", attention_scores=False, context_bytes=0)
    assert float(gpu) == pytest.approx(sim + 2 * 8 * b * s + max(2 * s * b * h * 34, 12 * b * s * V))
    # symbolic and numeric agree
    assert fm.evaluate(fm.device_memory(counted_by="simulator"), W=W, l=l, h=h, a=a, s=s, b=b, V=V) == sim
    # a window larger than the stages holds only l + 2 slots, each sized to its stage
    assert int(fm.device_memory(99, 3, h, a, s, b, V, counted_by="simulator")) == slot + 3 * block + tail + 5 * A + 4 + 4
    host = fm.host_memory(l, h, s, V)
    P = l * (12 * h * h + 13 * h) + (V + s) * h + 2 * h
    assert int(host) == 16 * P + 4 * V * h


def test_device_memory_matches_simulated_peaks():
    """The simulator's peak (slot pool + activations + boundary grads) for GPT-shaped specs is
    the formula counted by the simulator, for every window."""
    for l in (1, 3, 6):
        specs = gpt_like_specs(l, **SMALL)
        costs = CostTable([StageCost(1.0, 3.0, update_s=0.1)] * len(specs), Links(1e9, 1e9))
        for W in range(1, l + 4):
            tl = simulate(schedule_window(specs, W), costs)
            assert tl.slot_bytes == int(fm.device_memory_terms(W, l, **SMALL)[0].expr)
            assert tl.peak_device_bytes == int(fm.device_memory(W, l, **SMALL, counted_by="simulator"))


def test_slot_pool_is_sized_to_the_largest_stage():
    h, s, V = 2048, 1024, 50304
    # the head is the largest stage until 12h^2 + 13h > (V + s) h
    assert float(fm.slot_bytes(h, s, V)) == 4 * (V + s) * h
    h_cross = (V + s - 13) / 12
    assert float(fm.slot_bytes(4288, s, V)) == 4 * (12 * 4288**2 + 13 * 4288)
    assert 4275 < h_cross < 4288


# ---- step time ---------------------------------------------------------------------------------
REGIMES = {  # (t_f, t_b, t_u, link bytes/s) with 1 MB stages: t_pf = t_og = 1e6 / bw
    "compute-bound": (1.0, 3.0, 0.5, 5e6),
    "balanced": (1.0, 3.0, 0.5, 1e6),
    "link-bound": (1.0, 3.0, 0.5, 0.3e6),
    "host-bound": (1.0, 2.5, 3.0, 2e6),
}


def test_uniform_step_time_is_exact():
    """step_time(n, W, ...) equals the simulated step for chains of identical stages, every
    window, in every regime, full-duplex links (latency included in t_pf and t_og)."""
    nbytes, lat = 1_000_000, 1e-3
    for regime, (f, bk, u, bw) in REGIMES.items():
        for n in (1, 2, 3, 5, 8, 13):
            for W in range(1, n + 2):
                costs = uniform_table(n, f, bk, u, bw, latency=lat)
                tl = simulate(schedule_window(chain(n, prefetch_bytes=nbytes), W), costs)
                p = lat + nbytes / bw
                T = float(fm.step_time(n, W, f, bk, p, p, u))
                assert T == pytest.approx(tl.step_s, rel=1e-9, abs=1e-9), (regime, n, W)
                # the forward phase alone: the backward starts when it ends
                last_f = max(e.end for e in tl.events if e.phase == "forward")
                assert float(fm.forward_time(n, W, f, p)) == pytest.approx(last_f, rel=1e-9)


def test_gpt_step_time_is_exact_for_random_heterogeneous_ends():
    """step_time_gpt: head, identical blocks and a tail with their own costs and bytes, random,
    against the simulator (the tail's forward keeps its graph; it sends grads to the head's group)."""
    rng = random.Random(7)
    for _ in range(80):
        l = rng.choice([1, 2, 3, 4, 6, 9])
        n = l + 2
        W = rng.randint(1, n + 1)

        def stage():
            f = rng.uniform(0.05, 1.5)
            return dict(f=f, b=f * rng.uniform(2.0, 3.5), nb=rng.randint(1, 30) * 100_000, u=rng.uniform(0.0, 2.0))

        H, B, T = stage(), stage(), stage()
        if rng.random() < 0.5:  # an embedding-like head: big copy, no compute
            H.update(f=0.001, b=0.003)
        h2d = rng.choice([0.5e6, 1e6, 2e6])
        d2h = rng.choice([h2d, 1.5 * h2d])
        kinds = [H] + [B] * l + [T]
        specs = [
            replace(x, prefetch_bytes=k["nb"], grad_bytes=k["nb"], slot_bytes=k["nb"], grad_group_bytes=())
            for x, k in zip(chain(n, tied=(0, n - 1)), kinds)
        ]
        costs = CostTable([StageCost(k["f"], k["b"], update_s=k["u"]) for k in kinds], Links(h2d, d2h))
        tl = simulate(schedule_window(specs, W), costs)
        st = lambda k: StageTimes(k["f"], k["b"], k["nb"] / h2d, k["nb"] / d2h, k["u"])  # noqa: E731
        T_ = float(fm.step_time_gpt(l, W, st(H), st(B), st(T)))
        assert T_ == pytest.approx(tl.step_s, rel=1e-9), (l, W, H, B, T, h2d, d2h)


def test_gpt_formula_reduces_to_the_uniform_one():
    for (f, bk, u, bw) in REGIMES.values():
        p = 1e6 / bw
        st = StageTimes(f, bk, p, p, u)
        for n in (3, 5, 9):
            for W in range(1, n + 2):
                assert float(fm.step_time_gpt(n - 2, W, st, st, st)) == pytest.approx(float(fm.step_time(n, W, f, bk, p, p, u)))


def test_symbolic_gpt_step_time_lambdifies_to_the_numeric_one():
    expr = fm.step_time_gpt()
    syms = sorted(expr.free_symbols, key=str)
    fn = sp.lambdify(syms, expr, "math")
    H, B, T = StageTimes(0.001, 0.003, 0.035, 0.035, 0.049), StageTimes(0.0337, 0.101, 0.0168, 0.0168, 0.0235), StageTimes(0.0717, 0.215, 0.0343, 0.0343, 0.0)
    vals = {"l": 40, "W": 3}
    for suffix, st in (("_head", H), ("", B), ("_tail", T)):
        for field, v in zip(("f", "b", "pf", "og", "u"), (st.f, st.b, st.pf, st.og, st.u)):
            vals[f"t_{field}{suffix}"] = v
    assert fn(*[vals[x.name] for x in syms]) == pytest.approx(float(fm.step_time_gpt(40, 3, H, B, T)))


def test_half_duplex_links_are_bracketed():
    """With a coupled link (duplex < 1) the simulator lies between the full-duplex formula and
    the pessimistic one (every backward copy at the coupled rate when W >= 2); exactly on the
    full-duplex one where the link is hidden or W = 1 (a stage's gradient copy and the next
    prefetch never overlap). Where the link binds (copies longer than a backward) the gradient
    copies slow down while the n - W backward prefetches run: up to ~7% over the full-duplex
    formula at 0.85, shrinking as W grows; the pessimistic bound overshoots by under 10%."""
    worst_lo = worst_hi = 0.0
    for name, (f, bk, u, bw) in REGIMES.items():
        for n in (4, 9, 16):
            for W in range(1, n + 1, 1 if n < 16 else 3):
                tl = simulate(schedule_window(chain(n, prefetch_bytes=1_000_000), W), uniform_table(n, f, bk, u, bw, duplex=0.85, latency=0.01))
                p = 0.01 + 1e6 / bw
                st = StageTimes(f, bk, p, p, u)
                lo = float(fm.step_time(n, W, f, bk, p, p, u))
                hi = float(fm.step_time_gpt(n - 2, W, st, st, st, duplex=0.85))
                assert lo - 1e-9 <= tl.step_s <= hi + 1e-9, (name, n, W)
                worst_lo = max(worst_lo, (tl.step_s - lo) / tl.step_s)
                worst_hi = max(worst_hi, (hi - tl.step_s) / tl.step_s)
                if name in ("compute-bound", "host-bound") or W == 1:
                    assert tl.step_s == pytest.approx(lo, rel=1e-9), (name, n, W)
    assert worst_lo < 0.08 and worst_hi < 0.10


def test_steady_state_approximation():
    """step_time_steady = fill + n x period: exact when compute-bound; otherwise within a few
    percent for n >= 16 (it charges every stage the steady period; the exact step has whole
    slot cycles only and no prefetch for the last W stages of the backward)."""
    for name, (f, bk, u, bw) in REGIMES.items():
        p = 1e6 / bw
        for n in (16, 32):
            for W in range(1, n + 1):
                exact = float(fm.step_time(n, W, f, bk, p, p, u))
                approx = float(fm.step_time_steady(n, W, f, bk, p, p, u))
                if name == "compute-bound" and W >= 2:
                    assert approx == pytest.approx(exact)
                assert abs(approx - exact) / exact < 0.05, (name, n, W)


def test_step_time_grows_linearly_in_layers():
    """For a GPT the step is linear in l once l >= W: slope = the per-block period."""
    hw = get_profile("V100-32GB-PCIe3")
    st = fm.gpt_stage_times(hw, 2048, 1024, 4, 50304)
    B = st["block"]
    for W in (1, 2, 4):
        Ts = [float(fm.step_time_gpt(l, W, st["head"], B, st["tail"])) for l in (16, 32, 64, 128)]
        slopes = [(Ts[i + 1] - Ts[i]) / (L2 - L1) for i, (L1, L2) in enumerate(((16, 32), (32, 64), (64, 128)))]
        period = float(sp.Max(B.f, B.pf, (B.f + B.pf) / W) + sp.Max(B.b, B.og, B.pf, B.u, (B.b + B.og + B.pf) / W))
        for sl in slopes:
            assert sl == pytest.approx(period, rel=0.02)


# ---- solvers -----------------------------------------------------------------------------------
CASES = [  # (W, h, a, s, b, V, device bytes, host bytes): both constraints bind somewhere
    (4, 2048, 16, 1024, 4, 50304, 32 * 2**30, 90 * 2**30),
    (4, 2048, 16, 1024, 4, 50304, 6 * 2**30, 512 * 2**30),
    (2, 1024, 16, 2048, 8, 50304, 16 * 2**30, 64 * 2**30),
    (8, 4096, 32, 2048, 1, 32000, 24 * 2**30, 400 * 2**30),
    (16, 512, 8, 512, 4, 32000, 2 * 2**30, 100 * 2**30),  # the window exceeds the stages
]


@pytest.mark.parametrize("counted_by", ["simulator", "gpu"])
def test_largest_layers_matches_brute_force(counted_by):
    for case in CASES:
        _check_largest(case, counted_by)


def _check_largest(case, counted_by):
    W, h, a, s, b, V, dev, host = case
    fit = fm.largest_layers(W, h, a, s, b, V, dev, host, counted_by=counted_by)
    dev_expr = sp.lambdify([fm.l], fm.device_memory(W, fm.l, h, a, s, b, V, counted_by=counted_by))
    host_expr = sp.lambdify([fm.l], fm.host_memory(fm.l, h, s, V))
    fits = lambda L: dev_expr(L) <= dev and host_expr(L) <= host  # noqa: E731
    best = 0
    for L in range(1, 5000):
        if fits(L):
            best = L
        elif dev_expr(L) > dev and host_expr(L) > host:
            break
    assert fit.layers == best
    if best:
        assert fits(best) and not fits(best + 1)
        binding = "device" if dev_expr(best + 1) > dev else "host"
        assert fit.binding == binding


def test_largest_layers_device_bound_agrees_with_the_simulator():
    """Where the device binds, the simulated peak of the largest model fits and one more layer
    does not (simulator accounting: slot pool + activations + boundary grads)."""
    h, a, s, b, V = (SMALL[k] for k in "hasbV")
    W = 3
    dev = int(fm.device_memory(W, 20, h, a, s, b, V, counted_by="simulator")) + 1000
    fit = fm.largest_layers(W, h, a, s, b, V, dev, 10**12, counted_by="simulator")
    assert (fit.layers, fit.binding) == (20, "device")
    costs = lambda n: CostTable([StageCost(1.0, 3.0)] * n, Links(1e9, 1e9))  # noqa: E731
    peak = lambda L: simulate(schedule_window(gpt_like_specs(L, **SMALL), W), costs(L + 2)).peak_device_bytes  # noqa: E731
    assert peak(fit.layers) <= dev < peak(fit.layers + 1)


def _smallest_window_sim(n, f, bk, u, p, tol):
    costs = uniform_table(n, f, bk, u, 1e6 / p)
    resident = simulate(schedule_window(chain(n, prefetch_bytes=1_000_000), n), costs).step_s
    for W in range(1, n + 1):
        if simulate(schedule_window(chain(n, prefetch_bytes=1_000_000), W), costs).step_s <= resident * (1 + tol) + 1e-12:
            return W
    raise AssertionError


def test_smallest_hiding_window_against_the_simulator():
    """Compute-bound cases (t_pf <= t_f, t_og <= t_b): the formula's W is the smallest window
    whose simulated step equals the all-resident one; within 1% a smaller window may do
    (at n = 24 a little exposed transfer per slot cycle is under 1% of the step)."""
    n, f, bk, u = 24, 1.0, 3.0, 0.5
    for ratio, bk_ in [(r, x) for r in (0.1, 0.35, 0.5, 0.9, 1.0) for x in (bk, 2.0 * f)]:
        p = ratio * f  # t_pf = t_og
        hw = fm.smallest_hiding_window(f, bk_, p, p, u)
        assert hw.hideable
        exact = _smallest_window_sim(n, f, bk_, u, p, 1e-9)
        assert exact == min(int(hw), n)
        within = _smallest_window_sim(n, f, bk_, u, p, 0.01)
        assert within <= exact
        # and the formula-side search agrees with the simulator
        Tn = float(fm.step_time(n, n, f, bk_, p, p, u))
        formula_within = min(W for W in range(1, n + 1) if float(fm.step_time(n, W, f, bk_, p, p, u)) <= Tn * 1.01)
        assert formula_within == within


def test_hiding_window_when_transfers_dominate():
    hw = fm.smallest_hiding_window(1.0, 3.0, 2.5, 2.5)  # a prefetch longer than a forward
    assert not hw.hideable and hw.binding == "forward" and int(hw) == 4
    # symbolic form
    expr = fm.smallest_hiding_window()
    assert expr.subs({fm.t_f: 1, fm.t_b: 3, fm.t_pf: sp.Rational(1, 2), fm.t_og: sp.Rational(1, 2)}) == 2


def test_gpt_hiding_window_accounts_for_head_and_tail():
    """The reference setup: blocks alone need W=2, but the tail's prefetch (the tied embedding
    copy) is slightly longer than one block's forward, so the GPT needs W=3 to hide everything."""
    hw = get_profile("V100-32GB-PCIe3")
    st = fm.gpt_stage_times(hw, 2048, 1024, 4, 50304, attention_flops=False)
    B = st["block"]
    assert int(fm.smallest_hiding_window(B.f, B.b, B.pf, B.og, B.u)) == 2
    g = fm.gpt_hiding_window(st["head"], B, st["tail"])
    assert int(g) == 3 and g.binding == "forward"
    T = [float(fm.step_time_gpt(32, W, st["head"], B, st["tail"])) for W in (2, 3, 34)]
    assert T[0] > T[1] == pytest.approx(T[2], rel=1e-12)


def test_flops_per_iteration_matches_the_simulated_work():
    """Narayanan's FLOPs with recompute = 4 x block forward + 3 x tail forward (the tail keeps
    its graph), i.e. what the step runs."""
    h, s, b, V, L = 2048, 1024, 4, 50304, 24
    work = fm.gpt_stage_work(h, s, b, V)
    total = L * 4 * work["block"][0] + 3 * work["tail"][0]
    assert float(fm.flops_per_iteration(L, h, s, b, V)) == pytest.approx(float(total))


def test_symbolic_hardware():
    st = fm.gpt_stage_times(None)
    F = fm.HW_SYMBOLS[0]
    assert sp.simplify(st["block"].f.diff(F) * F**2 + 24 * fm.b * fm.s * fm.h**2 + 4 * fm.b * fm.s**2 * fm.h) == 0
    hw = Hardware("toy", 2**30, {"float32": 1e12}, 1e11, 1e9, 1e9, 1.0, 0.0, 1, 1e10, 2**34)
    T_sym = fm.step_time_gpt_hw(8, 2, None, 64, 32, 2, 97)
    T_num = fm.step_time_gpt_hw(8, 2, hw, 64, 32, 2, 97)
    vals = dict(zip((x.name for x in fm.HW_SYMBOLS), (1e12, 1e11, 0.0, 1e9, 1e9, 1e10)))
    assert fm.evaluate(T_sym, **vals) == pytest.approx(float(T_num))
    assert math.isfinite(float(T_num))


def test_gpt_readable_form_is_exact_when_compute_bound():
    """step_time_gpt_steady (fixed ends + l x period) equals the exact GPT formula and the
    simulator at the reference setup once the window hides the head's and tail's copies."""
    hw = get_profile("V100-32GB-PCIe3")
    st = fm.gpt_stage_times(hw, 2048, 1024, 4, 50304, attention_flops=False)
    args = (st["head"], st["block"], st["tail"])
    for L in (8, 48, 128):
        for W in (3, 4, 8):
            assert float(fm.step_time_gpt_steady(L, W, *args)) == pytest.approx(float(fm.step_time_gpt(L, W, *args)), rel=1e-12)
        # W=1 is link-bound per block: the slope is still the period, the ends differ by O(copies)
        d = float(fm.step_time_gpt(L, 1, *args) - fm.step_time_gpt_steady(L, 1, *args))
        assert abs(d) < float(st["head"].pf + st["tail"].pf + st["block"].pf + st["block"].og)


def test_device_memory_formula_is_the_planner_closed_form():
    """The sympy formula, counted as the emulated device counts (inputs included), is the
    planner's closed form for stronghold on the emulated device (itself the memory ledger's
    replay, tests/test_planner.py), at every window and depth."""
    from shfx.cost_model.planner import Target, memory_model
    from shfx.cost_model.shapes import GPTShape

    emu = Target("emulated", 1 << 40, emulated=True)
    h, a, s, b, V = (SMALL[k] for k in "hasbV")
    for l in (1, 2, 3, 6):
        shape = GPTShape(layers=l, hidden=h, heads=a, seq=s, batch=b, vocab=V)
        for W in range(1, l + 4):
            closed = memory_model("stronghold", shape, emu, window=W).device_total
            assert int(fm.device_memory(W, l, h, a, s, b, V, counted_by="emulated")) == closed, (l, W)


# ---- mixed precision ---------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_mixed_precision_analytic_costs_are_the_formulas(precision):
    """A 16-bit GPT (an fp32 capture rescaled by precision_specs): half the bytes in slots,
    copies and activations (gradient copies of untied groups carry fp32: cast on the device), the
    16-bit matmul rate, 30 B/param on the host, and a rollback copy
    of 1.46 fp32 updates per group, in the analytic model and the formulas alike; with
    rollback the formula's step time is the simulator's."""
    from shfx.cost_model.analytic import plan_inputs
    from shfx.models.gpt import GPT, GPTShape

    h, a, s, b, V = (SMALL[k] for k in "hasbV")
    hw = get_profile("V100-32GB-PCIe3")
    cfg = lambda n: GPTShape(vocab=V, seq=s, layers=n, heads=a, hidden=h)  # noqa: E731
    kw = dict(blocks="transformer.h", layers=5, hardware=hw)
    build, inputs = (lambda n: GPT(cfg(n))), (lambda: (torch.zeros(b, s, dtype=torch.long),) * 2)
    specs32, table32 = plan_inputs(build, inputs, **kw)
    specs, table = plan_inputs(build, inputs, precision=precision, **kw)
    assert precision in table.source
    for x16, x32 in zip(specs, specs32):
        assert 2 * x16.prefetch_bytes == x32.prefetch_bytes and 2 * x16.grad_bytes == x32.grad_bytes
        if x16.update_group is not None and not any(g == x16.update_group for s in specs for _, g, _ in s.borrowed_grads):
            assert x16.grad_wire_bytes_to({x16.update_group}) == x32.grad_bytes_to({x16.update_group}) > 0
        assert 2 * x16.slot_bytes == x32.slot_bytes
        # the tail's activation is the loss, in fp32 in both (the GPT computes it on logits.float())
        assert (2 * x16.activation_bytes if x16.name != "tail" else x16.activation_bytes) == x32.activation_bytes
        assert (x16.update_bytes, x16.state_bytes) == (x32.update_bytes, x32.state_bytes)  # fp32 master, m, v
    st = fm.gpt_stage_times(hw, h, s, b, V, dtype=precision)
    st_rb = fm.gpt_stage_times(hw, h, s, b, V, dtype=precision, rollback=True)
    for i, kind in ((0, "head"), (1, "block"), (6, "tail")):
        c = table.costs[i]
        assert float(st[kind].f) == pytest.approx(c.forward_s, rel=1e-12)
        assert float(st[kind].u) == pytest.approx(c.update_s, rel=1e-12)
        assert c.update_s == pytest.approx(30 / 28 * table32.costs[i].update_s, rel=1e-12)
        assert float(st_rb[kind].u - st[kind].u) == pytest.approx(c.rollback_s, rel=1e-12)
        assert c.rollback_s == pytest.approx(1.46 * table32.costs[i].update_s, rel=1e-12)
        assert float(st[kind].pf) == pytest.approx(table.links.time_s("h2d", specs[i].prefetch_bytes), rel=1e-12)
        assert float(st[kind].og) == pytest.approx(table.links.time_s("d2h", specs[i].grad_wire_bytes_to(specs[i].grad_groups)), rel=1e-12)
    assert table.costs[1].forward_s < table32.costs[1].forward_s
    full = table.with_links(replace(table.links, duplex=1.0))
    for W in (1, 2, 4):
        tl = simulate(schedule_window(specs, W), full, rollback=True)
        T = fm.step_time_gpt(5, W, st_rb["head"], st_rb["block"], st_rb["tail"])
        assert float(T) == pytest.approx(tl.step_s, rel=1e-9), W
        assert tl.step_s >= simulate(schedule_window(specs, W), full).step_s


def test_fp32_stage_times_are_unchanged_by_the_precision_parameters():
    """The fp32 formulas and costs are what they were (dtype defaults, no rollback)."""
    hw = get_profile("V100-32GB-PCIe3")
    a = fm.gpt_stage_times(hw, 2048, 1024, 4, 50304)
    b = fm.gpt_stage_times(hw, 2048, 1024, 4, 50304, dtype="float32", rollback=False)
    assert a == b
    assert a["block"].pf == hw.link_latency_s + sp.Float(4) * fm.params_block(2048) / sp.Float(hw.h2d_bps)
    with pytest.raises(ValueError, match="dtype must be one of"):
        fm.gpt_stage_times(hw, 2048, 1024, 4, 50304, dtype="int8")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_precision_specs_are_the_16_bit_capture(precision):
    """What the analytic model assumes of a 16-bit GPT (an fp32 capture rescaled by
    precision_specs) is what the compile pipeline lays out for precision= (the runtime's bytes)."""
    from shfx.cost_model.analytic import precision_specs
    from shfx.models.gpt import GPT, GPTShape
    from shfx.passes.pipeline import PipelineOptions, compile_variant

    h, a, s, b, V = (SMALL[k] for k in "hasbV")
    with torch.device("meta"):
        model = GPT(GPTShape(vocab=V, seq=s, layers=3, heads=a, hidden=h))
        idx = torch.zeros(b, s, dtype=torch.long)
    fp32 = compile_variant(model, (idx, idx), {}, PipelineOptions(verify=False)).graph.specs
    real = compile_variant(model, (idx, idx), {}, PipelineOptions(verify=False, precision=precision)).graph.specs
    assert precision_specs(fp32, precision) == list(real)
