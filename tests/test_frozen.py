"""Frozen parameters (``requires_grad=False``): fine-tuning only some layers trains exactly like
eager PyTorch (bitwise: losses, trained and frozen weights, buffers) and is cheaper: a frozen
parameter has no gradient buffer and no optimizer state, a fully frozen stage sends no gradient
bytes and gets no OFFLOAD_GRAD or update, and a stage below which nothing needs a gradient
runs no backward at all (no BACKWARD, no prefetch for one, its activations not kept)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from equivalence import run_pair
from mixed_reference import train_mixed_eager
from mixed_shfx import train_mixed_shfx
from test_ledger import _by_event, _compare
from zoo import ZOO, token_batch

import shfx
from shfx.cost_model.costs import CostTable, Links, StageCost
from shfx.cost_model.simulate import simulate
from shfx.passes.actions import B, OG, PF, U
from shfx.passes.meta import get_meta
from shfx.passes.stages import StageSpec, backward_stages, chain

ALL = 99
H = "transformer.h"
# which parameters a fine-tuning freezes, by name prefix (the zoo GPTs have 3 blocks)
FREEZE = {
    "bottom": ("transformer.wte", "transformer.wpe", f"{H}.0.", f"{H}.1."),  # embeddings + first blocks
    "top": (f"{H}.2.", "transformer.ln_f", "lm_head"),
    "middle": (f"{H}.1.",),
    "bias": (f"{H}.1.attn.c_attn.bias",),
}


def frozen(make_model, prefixes):
    def make():
        m = make_model()
        for n, p in m.named_parameters():
            if n.startswith(prefixes):
                p.requires_grad_(False)
        return m

    return make


def first_half_frozen(make_model):
    """Freeze the first half of a model's parameters (in registration order)."""

    def make():
        m = make_model()
        ps = list(m.parameters())
        for p in ps[: len(ps) // 2]:
            p.requires_grad_(False)
        return m

    return make


def assert_bitwise_like_eager(make, batch, window, steps=3, **kw):
    torch.manual_seed(0)
    before = {k: v.clone() for k, v in make().state_dict().items()}
    losses, ref_losses, cm, model, ref = run_pair(make, batch, window=window, steps=steps, **kw)
    try:
        assert losses == ref_losses
        sd, rsd = model.state_dict(), ref.state_dict()
        assert sd.keys() == rsd.keys()
        for k in sd:
            assert torch.equal(sd[k], rsd[k]), k
        frozen_keys = [n for n, p in model.named_parameters() if not p.requires_grad]
        trained = [n for n, p in model.named_parameters() if p.requires_grad]
        assert frozen_keys and trained
        for n in frozen_keys:  # untouched, not even by weight decay
            assert torch.equal(sd[n], before[n]), n
            assert dict(model.named_parameters())[n].grad is None
        assert any(not torch.equal(sd[n], before[n]) for n in trained)
    except BaseException:
        cm.close()
        raise
    return cm, model


GPT_CASES = [(m, f, w) for m, f in [("gpt_mask", "bottom"), ("gpt_mask", "top"), ("gpt_mask", "middle"),
             ("gpt_tied", "bias"), ("gpt_dropout", "bottom"), ("gpt_tied", "middle")] for w in (1, 2, ALL)]  # fmt: skip


def _fast_first(cases: list, fast) -> list:
    """The cases, those ``fast`` does not pick marked slow (SHFX_SLOW=1 runs them)."""
    return [pytest.param(*c, id="-".join(str(x) for x in c), marks=() if fast(c) else pytest.mark.slow) for c in cases]


# fast: every freezing at window 2, and the frozen bottom at window 1 (all stages: SHFX_SLOW=1)
@pytest.mark.parametrize("name,which,window", _fast_first(GPT_CASES, lambda c: c[2] == 2 or c == ("gpt_mask", "bottom", 1)))
def test_gpt_fine_tuning_trains_like_eager_bitwise(name, which, window):
    make, batch = ZOO[name]
    cm, _ = assert_bitwise_like_eager(frozen(make, FREEZE[which]), batch, window)
    cm.close()


ZOO_CASES = [(n, w) for n in ("skip_cnn", "bn_net", "hf_style") for w in (1, 2, ALL)]


@pytest.mark.parametrize("name,window", _fast_first(ZOO_CASES, lambda c: c[1] == 2))
def test_zoo_models_with_their_first_half_frozen_train_like_eager(name, window):
    make, batch = ZOO[name]
    cm, _ = assert_bitwise_like_eager(first_half_frozen(make), batch, window)
    cm.close()


def test_gradient_accumulation_with_a_frozen_bottom():
    cm, _ = assert_bitwise_like_eager(frozen(ZOO["gpt_dropout"][0], FREEZE["bottom"]), token_batch, 2, accum=2)
    cm.close()


BF16_CASES = [("gpt_mask", "bottom", 1), ("gpt_mask", "bottom", ALL), ("gpt_tied", "middle", 2), ("gpt_mask", "top", 2),
              ("gpt_tied", "bias", 2)]  # fmt: skip


# fast: a frozen bottom at window 1 and a frozen middle at window 2 (the fp32 test above runs every
# freezing); the other three cases with SHFX_SLOW=1
BF16_FAST = {("gpt_mask", "bottom", 1), ("gpt_tied", "middle", 2)}


@pytest.mark.parametrize(
    "name,which,window",
    [pytest.param(*c, id="{}-{}-W{}".format(*c), marks=() if c in BF16_FAST else pytest.mark.slow) for c in BF16_CASES],
)
def test_bf16_fine_tuning_trains_like_the_eager_recipe(name, which, window):
    make, batch = ZOO[name]
    make = frozen(make, FREEZE[which])
    ref = train_mixed_eager(make, batch, "bf16", 3)
    got = train_mixed_shfx(make, batch, "bf16", 3, window=window)
    try:
        assert got["loss_bits"] == ref["loss_bits"]
        for k, v in ref["master"].items():
            assert torch.equal(got["master"][k], v), k
        torch.manual_seed(0)
        init = dict(make().named_parameters())
        for n, p in got["model"].named_parameters():
            if not p.requires_grad:
                assert torch.equal(p, init[n]), n
    finally:
        got["cm"].close()


def _gpt(which: str | None, **kw):
    torch.manual_seed(0)
    m = ZOO["gpt_mask"][0]()
    return frozen(lambda: m, FREEZE[which])() if which else m


def _compile(model, **kw):
    kw.setdefault("device", shfx.EmulatedDevice(memory="64MiB"))
    kw.setdefault("optimizer", shfx.optim.AdamW(lr=1e-2))
    return shfx.compile(model, **kw)


def _frozen_stages(cm) -> list[int]:
    """Stages none of whose parameters (own or borrowed) is trainable."""
    return [st.index for st in cm.variant.graph.stages if st.params and not st.trainable]


def test_a_frozen_stage_moves_no_gradient_bytes_and_has_no_gradient_or_optimizer_state():
    x, y = token_batch(0)[0]
    got = {}
    for which in (None, "bottom"):
        cm = _compile(_gpt(which), window=2)
        cm(x, y).backward()  # the first step: setup, then one step; measure the second
        cm.step()
        cm.zero_grad()
        d2h, h2d = cm.backend.bytes_d2h, cm.backend.bytes_h2d
        cm(x, y).backward()
        cm.step()
        cm.zero_grad()
        prog, specs = cm.program, cm.program.stages
        moved = {"d2h": cm.backend.bytes_d2h - d2h, "h2d": cm.backend.bytes_h2d - h2d}
        assert moved == prog.bytes_moved()  # the program's bytes are what the link carried, exactly
        og = [get_meta(n) for n in prog.nodes if get_meta(n).kind == OG]
        assert moved["d2h"] == sum(m.bytes for m in og) == sum(s.grad_bytes for s in specs if s.has_grads)
        got[which] = (cm, moved)
    cm_full, full = got[None]
    cm, moved = got["bottom"]
    frozen_stages = _frozen_stages(cm)
    assert frozen_stages == [0, 1, 2]  # head (embeddings), blocks 0 and 1
    acts = cm.program.actions()
    for s in frozen_stages:
        assert cm.program.stages[s].grad_bytes == 0 and cm.program.stages[s].update_group is None
        assert f"OG{s}" not in acts and f"U{s}" not in acts
    # the gradient bytes saved are exactly the frozen stages' (their slots' trainable regions)
    assert full["d2h"] - moved["d2h"] == sum(cm_full.program.stages[s].grad_bytes for s in frozen_stages) > 0
    # host: no gradient buffer, no optimizer state for a frozen group; the runtime is the ledger
    st = cm.engine.store
    for s in frozen_stages:
        assert st.groups[s].trainable_numel == 0 and st.groups[s].grad_bytes == 0
        assert s not in cm.engine.optimizer.state
    host = cm.variant.ledger().static("host")
    host_full = cm_full.variant.ledger().static("host")
    per_group = sum(cm_full.engine.store.groups[s].trainable_bytes for s in frozen_stages)
    assert host_full["gradients (fp32)"] - host["gradients (fp32)"] == per_group
    assert host_full["optimizer states (m, v)"] - host["optimizer states (m, v)"] == 2 * per_group
    assert cm.engine.host_bytes() == sum(host.values())
    assert cm_full.engine.host_bytes() - cm.engine.host_bytes() == 3 * per_group
    cm.close()
    cm_full.close()


def test_a_frozen_bias_has_no_gradient_or_optimizer_state():
    """A partly frozen stage: its group's trainable region (gradient, m, v) leaves the bias out."""
    x, y = token_batch(0)[0]
    sizes = {}
    for which in (None, "bias"):
        cm = _compile(_gpt(which), window=2)
        cm(x, y).backward()
        cm.step()
        g = cm.variant.graph.stages[2].index  # block 1's stage owns group 2
        sizes[which] = (cm.engine.store.groups[g].trainable_numel, cm.engine.optimizer.state[g].exp_avg.numel(),
                        cm.engine.store.grad(g).numel(), cm.engine.host_bytes() == sum(cm.variant.ledger().static("host").values()))  # fmt: skip
        cm.close()
    bias = 3 * 32  # c_attn.bias of hidden 32
    assert sizes["bias"][0] == sizes["bias"][1] == sizes["bias"][2] == sizes[None][0] - bias
    assert sizes["bias"][3] and sizes[None][3]


def test_stages_below_which_nothing_needs_a_gradient_run_no_backward():
    """A frozen bottom: no B (and no prefetch for one) for the head and blocks 0-1; the trace
    of the step shows none ran, and the activations of the frozen stages are not kept."""
    x, y = token_batch(0)[0]
    cm = _compile(_gpt("bottom"), window=2)
    cm(x, y).backward()
    cm.step()
    assert cm.program.actions() == [
        "PF0", "PF1", "F0", "R0", "PF2", "F1", "R1", "PF3", "F2", "R2", "PF4", "F3", "F4",
        "B4", "OG4", "U4", "R4", "B3", "OG3", "U3", "R3",
    ]  # fmt: skip
    ran = Counter(e.action for e in cm.engine.trace)
    assert {lbl for lbl in ran if lbl.startswith("B")} == {"B3", "B4"}
    assert ran["PF0"] == ran["PF1"] == ran["PF2"] == 1  # prefetched for the forward only
    assert cm.engine.trace and sorted(backward_stages(cm.program.stages)) == [3, 4]
    # the ledger of the step (what the runtime reserved, checked event by event below) keeps
    # no activation of a frozen stage into the backward
    led = cm.variant.ledger()
    at_backward = next(i for i, e in enumerate(led.entries) if e.event == "backward start")
    held = Counter()
    for e in led.entries[:at_backward]:
        for c in e.changes:
            if c.tier == "device" and c.term == "activations (checkpoints)":
                held[c.what] += c.nbytes
    kept = {w for w, n in held.items() if n}
    full = _compile(_gpt(None), window=2)
    full(x, y).backward()
    full_led = full.variant.ledger()
    at_b = next(i for i, e in enumerate(full_led.entries) if e.event == "backward start")
    full_held = Counter()
    for e in full_led.entries[:at_b]:
        for c in e.changes:
            if c.tier == "device" and c.term == "activations (checkpoints)":
                full_held[c.what] += c.nbytes
    assert kept < {w for w, n in full_held.items() if n}
    assert len(full.program.phase_nodes("backward")) > len(cm.program.phase_nodes("backward"))
    full.close()
    cm.close()


def test_a_frozen_top_still_runs_its_backward_for_the_input_gradient():
    """A frozen stage above trainable ones runs its backward (the gradient flows through it),
    but sends nothing to the host and has no update."""
    x, y = token_batch(0)[0]
    cm = _compile(_gpt("top"), window=2)
    cm(x, y).backward()
    cm.step()
    acts = cm.program.actions()
    assert all(f"B{s}" in acts for s in range(5))
    for s in _frozen_stages(cm):
        assert f"OG{s}" not in acts and f"U{s}" not in acts
    cm.close()


POLICIES = [shfx.Resident(), shfx.L2L(), shfx.ZeroOffload(), shfx.ZeroInfinity(), shfx.Stronghold(window=1),
            shfx.Stronghold(window=2, resident_first=1), shfx.Stronghold(window=3)]  # fmt: skip


@pytest.mark.parametrize("which", ["bottom", pytest.param("middle", marks=pytest.mark.slow)])  # (middle: 6 s, slow run)
def test_runtime_reservations_are_the_ledger_with_frozen_stages(which):
    """Every policy: the runtime's device reservations of a step with frozen stages equal the
    ledger's replay event by event, the simulator's peak is the ledger's, the host is its setup."""
    x, y = token_batch(0)[0]
    for policy in POLICIES:
        cm = _compile(_gpt(which), policy=policy)
        try:
            with cm.backend.recording() as log:
                cm(x, y).backward()
                cm.step()
            led = cm.variant.ledger()
            runtime = _by_event((e.event, e.term, e.what, e.nbytes) for e in log)
            ledger = _by_event((e.event, c.term, c.what, c.nbytes) for e in led.entries for c in e.changes if c.tier == "device")
            _compare(runtime, {k: v for k, v in ledger.items() if v}, f"{cm.program.name} ({which})")
            assert cm.backend.peak_bytes == led.peak()
            n = len(cm.program.stages)
            costs = CostTable([StageCost(1.0, 2.0, update_s=0.5, device_update_s=0.1)] * n, Links(1e6, 1e6))
            assert simulate(cm.program, costs).peak_device_bytes == led.peak()
            assert cm.engine.host_bytes() == sum(led.static("host").values())
        finally:
            cm.close()


def test_the_simulator_sees_no_backward_time_for_a_frozen_bottom():
    """On synthetic specs: two frozen stages at the bottom of five run no backward, so the
    simulated step is shorter by their backward time and prefetches."""
    full = chain(5, prefetch_bytes=1 << 20)
    bottom = [StageSpec(0, "s0", prefetch_bytes=1 << 20, slot_bytes=1 << 20),
              StageSpec(1, "s1", producers=frozenset({0}), prefetch_bytes=1 << 20, slot_bytes=1 << 20)] + full[2:]  # fmt: skip
    assert sorted(backward_stages(bottom)) == [2, 3, 4]
    costs = CostTable([StageCost(1.0, 2.0, update_s=0.5)] * 5, Links(1e9, 1e9))
    from shfx.passes.policies import schedule_window

    t_full = simulate(schedule_window(full, 2), costs).step_s
    prog = schedule_window(bottom, 2)
    assert [a for a in prog.actions() if a.startswith(("B", "OG", "U"))] == ["B4", "OG4", "U4", "B3", "OG3", "U3", "B2", "OG2", "U2"]
    t_frozen = simulate(prog, costs).step_s
    assert t_frozen <= t_full - 2 * 2.0


def test_a_fully_frozen_model_keeps_every_backward():
    """Nothing trainable: nothing is cut (eager refuses that backward too)."""
    specs = [StageSpec(0), StageSpec(1, producers=frozenset({0}))]
    assert backward_stages(specs) == {0, 1}


def test_changing_requires_grad_after_the_first_call_is_refused():
    x, y = token_batch(0)[0]
    model = _gpt("bottom")
    cm = _compile(model, window=2)
    cm(x, y).backward()
    cm.step()
    cm.zero_grad()
    model.transformer.wte.weight.requires_grad_(True)
    with pytest.raises(shfx.UsageError, match=r"transformer\.wte\.weight.*requires_grad"):
        cm(x, y)
    model.transformer.wte.weight.requires_grad_(False)  # set back: goes on
    cm(x, y).backward()
    cm.step()
    cm.close()


def test_lowering_gives_a_frozen_bottom_no_backward_golden():
    bottom = [StageSpec(0, "s0", prefetch_bytes=1, slot_bytes=1),
              StageSpec(1, "s1", producers=frozenset({0}), prefetch_bytes=1, slot_bytes=1)] + chain(3, prefetch_bytes=1)[2:]  # fmt: skip
    from shfx.passes.policies import schedule_window
    from shfx.passes.verify import verify_program

    prog = verify_program(schedule_window(bottom, 2))
    assert " ".join(prog.actions()) == "PF0 PF1 F0 R0 PF2 F1 R1 F2 B2 OG2 U2 R2"
    assert sum(1 for n in prog.nodes if get_meta(n).kind in (PF,)) == 3
    assert [get_meta(n).kind for n in prog.nodes].count(B) == 1
    assert [get_meta(n).kind for n in prog.nodes].count(U) == 1


def test_analytic_backward_leaves_out_frozen_parameter_gradients():
    """The analytic cost model: a fully frozen stage's backward is the recompute and the input
    gradient (2 forwards, 1 when its graph is kept); a trainable one's stays 3 (2)."""
    from shfx.cost_model.analytic import analytic_costs

    x, y = token_batch(0)[0]
    costs = {}
    for which in (None, "top"):
        cm = _compile(_gpt(which), window=2)
        cm(x, y).backward()
        costs[which] = (analytic_costs(cm.variant.graph, "A100-80GB-PCIe4"), _frozen_stages(cm))
        cm.close()
    full, _ = costs[None]
    top, frozen_stages = costs["top"]
    assert frozen_stages == [3, 4]
    for s, (a, b) in enumerate(zip(full.costs, top.costs)):
        assert a.forward_s == b.forward_s
        if s in frozen_stages:
            assert b.backward_s < a.backward_s and b.backward_kept_s < a.backward_kept_s
            assert b.backward_s >= 2 * b.forward_s - 1e-15
        else:
            assert (a.backward_s, a.backward_kept_s) == (b.backward_s, b.backward_kept_s) == (3 * a.forward_s, 2 * a.forward_s)


@pytest.mark.parametrize("window", [1, 2, ALL])
def test_cold_backward_with_a_frozen_bottom(window):
    """Two forwards, then one backward through both losses (the second forward evicted what the
    first kept): the cold backward of a frozen bottom trains like eager, bitwise."""
    make = frozen(ZOO["gpt_mask"][0], FREEZE["bottom"])
    torch.manual_seed(0)
    model = make()
    import copy

    ref = copy.deepcopy(model)
    cm = _compile(model, window=window, grad_accum_steps=2)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, fused=True)
    (x1, y1), _, _ = token_batch(0)
    (x2, y2), _, _ = token_batch(1)
    for _ in range(2):
        (cm(x1, y1) + cm(x2, y2)).backward()
        cm.step()
        cm.zero_grad()
        (ref(x1, y1) + ref(x2, y2)).backward()
        opt.step()
        opt.zero_grad()
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    cm.close()
