"""The capacity planner: formulas against REFERENCE.md, the closed-form slot layout against the
step programs, the search against brute force, and the predicted boundary against the runtime
(the largest size trains, one layer more raises OutOfDeviceMemory)."""

from __future__ import annotations

import csv
import json
from dataclasses import replace

import pytest
import zoo
import torch
import torch.nn.functional as F

import shfx
from shfx.cost_model.analytic import repeat_blocks
from shfx.cost_model.hardware import PROFILES, get_profile
from shfx.passes.policies import make_policy, policy_names, policy_program
from shfx.cost_model.planner import (
    Target,
    largest_trainable,
    memory_for_model,
    memory_model,
    plan,
    plan_for_model,
)
from shfx.passes.schedule import cold_backward_program, eval_program
from shfx.models import GPT, GPTShape

REF = GPTShape(hidden=2048, heads=16, seq=1024, batch=4, vocab=50304)
V100 = "V100-32GB-PCIe3"
SMALL = GPTShape(hidden=32, heads=2, seq=16, batch=2, vocab=64)
HUGE = Target("no limit", 1 << 50)
EMU = Target("emulated", 1 << 40, emulated=True)


# ---- formulas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("h,a,s,V,L", [(2048, 16, 1024, 50304, 48), (32, 2, 16, 64, 3), (48, 4, 24, 100, 5)])
def test_num_params_matches_gpt_config(h, a, s, V, L):
    fam = GPTShape(hidden=h, heads=a, seq=s, batch=1, vocab=V, layers=L)
    cfg = GPTShape(vocab=V, seq=s, layers=L, heads=a, hidden=h, bias=True, tie_weights=True)
    assert fam.num_params() == cfg.num_params()
    assert fam.params_per_layer == 12 * h * h + 13 * h


def test_reference_formulas():
    """REFERENCE.md: 12h^2+13h per layer; 16 bytes per parameter with AdamW (fp32 and mixed);
    with full recompute only the layer input is kept, 2sbh bytes at 16-bit (double for fp32)."""
    h, s, b, V, a = 2048, 1024, 4, 50304, 16
    fam = REF.with_layers(48)
    P = fam.num_params()
    assert P == 48 * (12 * h * h + 13 * h) + V * h + s * h + 2 * h == 2522320896
    res = memory_model("resident", fam, V100)
    # every tensor of this shape is 64-byte aligned; the tail's slot also holds a copy of wte
    assert res.device["parameters (slots)"] == 4 * (P + V * h) == res.device["gradients"]
    assert res.device["optimizer states"] == 8 * P
    mixed = memory_model("resident", replace(fam, precision="bfloat16"), V100)
    assert mixed.device["parameters (slots)"] + mixed.device["gradients"] + mixed.device["optimizer states"] == 16 * P + 4 * V * h
    sh = memory_model("stronghold", fam, V100)
    host = sh.host
    assert host["master parameters (fp32)"] + host["gradients (fp32)"] + host["optimizer states (m, v)"] == 16 * P
    one_more = memory_model("stronghold", REF.with_layers(49), V100)
    assert one_more.device["activations (checkpoints)"] - sh.device["activations (checkpoints)"] == 2 * s * b * h * 2
    no_ckpt = GPTShape(hidden=h, heads=a, seq=s, batch=b, vocab=V, layers=48, checkpointing=False)
    per_layer = memory_model("stronghold", no_ckpt.with_layers(49), V100).device["activations (checkpoints)"] - memory_model(
        "stronghold", no_ckpt, V100
    ).device["activations (checkpoints)"]
    assert per_layer == pytest.approx(s * b * h * (34 + 5 * a * s / h) * 2, abs=1)
    # the working set: the larger of a block's activations and the tail's logits (x3)
    assert sh.device["working set (one block)"] == max(int(s * b * h * (34 + 5 * a * s / h) * 2), 3 * 4 * b * s * V)
    assert sh.device["workspace"] == 512 * 2**20 and sh.device["allocator slack"] == 0


def test_reference_plan():
    p = plan(REF, V100)
    got = {r.policy: (r.layers, r.binding) for r in p.rows}
    assert got == {
        "resident": (33, "device: optimizer states"),
        "l2l": (66, "device: optimizer states"),
        "zero-offload": (67, "device: parameters (slots) + gradients"),
        "zero-infinity": (116, "host: optimizer states (m, v)"),
        "stronghold": (116, "host: optimizer states (m, v)"),
    }
    for r in p.rows:
        assert r.breakdown.fits(V100)
        assert not memory_model(r.policy, REF.with_layers(r.layers + 1), V100).fits(V100)
    # without the host limit, stronghold's device allows ~8x more layers: activations bind
    dev_only = largest_trainable("stronghold", REF, Target("V100 device", get_profile(V100).device_memory_bytes))
    assert dev_only.layers > 800 and dev_only.binding == "device: activations (checkpoints)"


def test_monotone():
    kinds = ("hidden", "seq", "batch", "vocab")
    for pol in policy_names():
        base = memory_model(pol, REF.with_layers(40), V100)
        for k in kinds:
            bigger = memory_model(pol, replace(REF, layers=40, **{k: getattr(REF, k) * 2}), V100)
            assert bigger.device_total >= base.device_total, (pol, k)
            assert bigger.host_total >= base.host_total, (pol, k)
        # more layers never need less host memory; more device memory never trains fewer layers
        assert memory_model(pol, REF.with_layers(41), V100).host_total > base.host_total
        hw = get_profile(V100)
        small = largest_trainable(pol, REF, hw).layers
        large = largest_trainable(pol, REF, Target("bigger", 2 * hw.device_memory_bytes, 2 * hw.host_memory_bytes)).layers
        assert large >= small
    rows = [largest_trainable("stronghold", replace(REF, batch=b), Target("dev", 32 << 30)).layers for b in (1, 4, 16)]
    assert rows[0] >= rows[1] >= rows[2]


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown policy 'megatron'.*resident, l2l, zero-offload, zero-infinity, stronghold"):
        memory_model("megatron", REF, V100)
    with pytest.raises(ValueError, match="unknown policy"):
        plan(REF, V100, policies=("stronghold", "nope"))
    for bad in ({"hidden": 0}, {"heads": -1}, {"seq": 0}, {"batch": 0}, {"vocab": 0}, {"layers": 0}):
        with pytest.raises(ValueError, match="must be a positive int"):
            replace(REF, **bad)
    with pytest.raises(ValueError, match="divisible"):
        GPTShape(hidden=30, heads=4, seq=8, batch=1)
    with pytest.raises(ValueError, match="precision"):
        replace(REF, precision="int8")
    with pytest.raises(ValueError, match="refinement of the 'stronghold' policy"):
        memory_model("resident", REF, V100, resident_first=1)
    with pytest.raises(ValueError, match="window must be a positive int"):
        memory_model("stronghold", REF, V100, window=0)
    with pytest.raises(ValueError, match="allocator_slack"):
        memory_model("stronghold", REF, V100, allocator_slack=1.5)
    with pytest.raises(ValueError, match="max_layers"):
        largest_trainable("stronghold", REF, V100, max_layers=0)
    with pytest.raises(KeyError, match="unknown hardware profile"):
        memory_model("stronghold", REF, "TPU")
    with pytest.raises(TypeError, match="hardware must be"):
        memory_model("stronghold", REF, 12)
    with pytest.raises(KeyError, match="no row for policy 'l2l'"):
        plan(REF, V100, policies=("stronghold",)).row("l2l")


def test_zero_layers_explains_why():
    row = largest_trainable("resident", SMALL, Target("tiny", 100_000, emulated=True))
    assert row.layers == 0 and row.params == 0
    assert row.binding == "device: optimizer states"
    assert row.breakdown.family.layers == 1 and not row.breakdown.fits()


def test_zero_infinity_spills_to_ssd():
    hw = PROFILES[V100]
    no_ssd = largest_trainable("zero-infinity", REF, hw)
    with_ssd = largest_trainable("zero-infinity", REF, replace(hw, ssd_bytes=2 * 10**12))
    assert with_ssd.layers > no_ssd.layers
    bd = with_ssd.breakdown
    assert bd.ssd and bd.ssd["optimizer states (m, v)"] == 2 * bd.ssd["master parameters (fp32)"]
    assert bd.host["optimizer states (m, v)"] == 0
    # other policies never use the SSD
    assert not largest_trainable("stronghold", REF, replace(hw, ssd_bytes=2 * 10**12)).breakdown.ssd


# ---- the closed-form layout against the step programs --------------------------------------------


@pytest.fixture(scope="module")
def template():
    """A captured two-block GPT (meta device) whose block stage repeat_blocks copies to any depth."""
    # vocab 512 > 12h + 11: the tail's slot (with the tied embedding) is larger than a block's
    return {fam: zoo.capture_gpt_template(fam) for fam in (SMALL, GPTShape(hidden=32, heads=2, seq=16, batch=2, vocab=512))}


def _program_layout(policy, specs, window, k):
    from shfx.passes.ledger import pool_sizes

    train = policy_program(policy, specs, window, k)
    slots, grads = pool_sizes((train, eval_program(train), cold_backward_program(train)))
    return slots, grads, train.device_state_bytes()


def test_layout_matches_programs(template):
    for fam, graph in template.items():
        for L in range(1, 9):
            specs, _ = repeat_blocks(graph.specs, None, range(1, 3), L)
            for policy in policy_names():
                for window in (1, 2, 3, 4) if policy == "stronghold" else (2,):
                    for k in (0, 1, 2, 3) if policy == "stronghold" else (0,):
                        bd = memory_model(policy, fam.with_layers(L), EMU, window=window, resident_first=k)
                        want = _program_layout(policy, specs, window, k)
                        got = (bd.slot_sizes, bd.grad_buffer_sizes, bd.device["optimizer states"])
                        assert got == want, (fam.vocab, L, policy, window, k)


def test_memory_for_model_matches_family(template):
    """The generic path (real stages, programs, boundary values replayed) equals the GPT closed form."""
    fam = SMALL.with_layers(2)
    graph = template[SMALL]
    for policy, kw in [(p, {}) for p in policy_names()] + [("stronghold", {"resident_first": 1, "window": 3})]:
        want = memory_model(policy, fam, EMU, **kw)
        got = memory_for_model(policy, None, (), EMU, graph=graph, **kw)
        assert got.device == want.device, policy
        assert got.host == want.host, policy
        assert (got.slot_sizes, got.grad_buffer_sizes) == (want.slot_sizes, want.grad_buffer_sizes)


def test_search_matches_brute_force():
    """Memory is not monotone in layers when the tail's slot is larger than a block's: the search
    must still find the largest size that fits."""
    fam = GPTShape(hidden=32, heads=2, seq=16, batch=2, vocab=512)
    cases = [("stronghold", {"window": 2}, True), ("stronghold", {"window": 3}, True), ("zero-infinity", {}, True),
             ("stronghold", {"window": 2, "resident_first": 1}, False), ("l2l", {}, False)]
    for policy, kw, dips in cases:
        totals = [memory_model(policy, fam.with_layers(L), EMU, **kw).device_total for L in range(1, 90)]
        assert any(b < a for a, b in zip(totals, totals[1:])) == dips, (policy, kw)
        for cap in sorted(set(totals[5:40:3])):
            tgt = Target("emulated", cap, emulated=True)
            brute = max((L for L, t in enumerate(totals, start=1) if t <= cap), default=0)
            assert largest_trainable(policy, fam, tgt, **kw).layers == brute, (policy, kw, cap)


def test_max_layers_caps_the_search():
    row = largest_trainable("stronghold", SMALL, Target("big", 1 << 40, emulated=True), max_layers=50)
    assert row.layers == 50 and "max_layers" in row.binding


# ---- the runtime: the predicted boundary is the real one -------------------------------------------


def _host_bytes(cm) -> int:
    return cm.engine.host_bytes()


def _train(policy: str, fam: GPTShape, device: shfx.EmulatedDevice, steps: int = 2, **kw) -> tuple[int, int]:
    """Train ``steps`` steps (the second reuses everything the first allocated); return the
    device peak and the host bytes."""
    torch.manual_seed(0)
    cfg = GPTShape(vocab=fam.vocab, seq=fam.seq, layers=fam.layers, heads=fam.heads, hidden=fam.hidden)
    cm = shfx.compile(GPT(cfg), device=device, policy=make_policy(policy, **kw), optimizer=shfx.optim.AdamW())
    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, fam.vocab, (fam.batch, fam.seq), generator=g)
            y = torch.randint(0, fam.vocab, (fam.batch, fam.seq), generator=g)
            if fam.loss_in_model:
                loss = cm(x, y)
            else:
                loss = F.cross_entropy(cm(x).reshape(-1, fam.vocab), y.reshape(-1))
            loss.backward()
            cm.step()
            cm.zero_grad()
        return cm.backend.peak_bytes, _host_bytes(cm)
    finally:
        cm.close()


BOUNDARY = [
    ("resident", {}, SMALL),
    ("l2l", {}, SMALL),
    ("zero-offload", {}, SMALL),
    ("zero-infinity", {}, SMALL),
    ("stronghold", {"window": 2}, SMALL),
    ("stronghold", {"window": 2, "resident_first": 1}, SMALL),
    ("stronghold", {"window": 3}, GPTShape(hidden=32, heads=2, seq=16, batch=2, vocab=96, loss_in_model=False)),
]


@pytest.mark.parametrize("policy,kw,fam", BOUNDARY, ids=[f"{p}-{'-'.join(f'{k}{v}' for k, v in kw.items())}-{f.vocab}" for p, kw, f in BOUNDARY])
def test_predicted_boundary_is_the_runtime_boundary(policy, kw, fam):
    # a budget a little above what two layers need: the planner says how many layers fit
    cap = memory_model(policy, fam.with_layers(2), EMU, **kw).device_total + 64
    device = shfx.EmulatedDevice(memory=cap, h2d=None, d2h=None)
    row = largest_trainable(policy, fam, device, **kw)
    assert 2 <= row.layers <= 4
    peak, host = _train(policy, fam.with_layers(row.layers), device, **kw)
    assert peak == row.breakdown.device_total  # byte-exact
    assert host == row.breakdown.host_total
    with pytest.raises(shfx.OutOfDeviceMemory):
        _train(policy, fam.with_layers(row.layers + 1), device, **kw)


def test_plan_for_model(template):
    torch.manual_seed(0)
    model = GPT(GPTShape(vocab=64, seq=16, layers=2, heads=2, hidden=32))
    x = torch.zeros(2, 16, dtype=torch.long)
    fam = SMALL.with_layers(2)
    cap = memory_model("zero-offload", fam, EMU).device_total  # zero-offload fits exactly; resident and l2l do not
    p = plan_for_model(model, (x, x), Target("emulated", cap, emulated=True))
    fits = {r.policy: r.layers > 0 for r in p.rows}
    assert fits == {"resident": False, "l2l": False, "zero-offload": True, "zero-infinity": True, "stronghold": True}
    assert "GPT (4 stages" in p.table()


# ---- presentation and the CLI ------------------------------------------------------------------------


def test_plan_exports(tmp_path):
    p = plan(SMALL, shfx.EmulatedDevice(memory="300KiB"))
    text = str(p)
    for pol in policy_names():
        assert pol in text
    d = p.to_dict()
    assert json.loads(json.dumps(d))["rows"][4]["policy"] == "stronghold"
    assert d["hardware"]["emulated"] and d["settings"]["workspace_bytes"] == 0
    rows = list(csv.DictReader(open(p.to_csv(tmp_path / "plan.csv"))))
    assert [r["policy"] for r in rows] == list(policy_names())
    r = rows[4]
    terms = sum(int(v) for k, v in r.items() if k.startswith("device:"))
    assert terms == int(r["device_bytes"]) == p.row("stronghold").breakdown.device_total
    assert "activations (checkpoints)" in str(p.row("stronghold").breakdown)


def test_cli_plan(tmp_path, capsys):
    from shfx.cli import main

    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "V100-32GB-PCIe3" in out and "stronghold" in out and "116" in out
    args = ["plan", "--emulated", "--device-memory", "300KiB", "--hidden", "32", "--heads", "2", "--seq", "16",
            "--batch", "2", "--vocab", "64", "--layers", "2", "--policies", "resident,stronghold",
            "--resident-first", "1", "--csv", str(tmp_path / "p.csv"), "--json", str(tmp_path / "p.json")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "emulated device" in out and "at 2 layers" in out
    data = json.loads((tmp_path / "p.json").read_text())
    assert [r["policy"] for r in data["rows"]] == ["resident", "stronghold"]
    assert data["settings"]["resident_first"] == 1
    assert (tmp_path / "p.csv").read_text().startswith("policy,layers,params")
    assert main(["plan", "--hardware", "A100-80GB-PCIe4", "--host-memory", "64GiB", "--ssd", "1TB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hardware"]["ssd_bytes"] == 10**12
    assert main(["plan", "--emulated"]) == 1
    assert "--emulated needs --device-memory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--policies", "megatron"])
    assert "expected a comma-separated list of policies" in capsys.readouterr().err


def test_resident_first_auto_picks_the_k_that_trains_most():
    """STRONGHOLD's k chosen under the budget: on the reference setup the host binds, and the
    first k stages need 4 instead of 16 host bytes per parameter, so k > 0 trains more layers
    until their optimizer states fill the device."""
    from shfx.cost_model.planner import largest_trainable

    fam = GPTShape(hidden=2048, heads=16, seq=1024, batch=4, vocab=50304)
    auto = largest_trainable("stronghold", fam, "V100-32GB-PCIe3", resident_first="auto")
    k = auto.breakdown.settings["resident_first"]
    k0 = largest_trainable("stronghold", fam, "V100-32GB-PCIe3", resident_first=0)
    assert k > 0 and auto.layers > k0.layers
    same = largest_trainable("stronghold", fam, "V100-32GB-PCIe3", resident_first=k)
    assert same.layers == auto.layers
    for kk in (k - 1, k + 1):
        assert largest_trainable("stronghold", fam, "V100-32GB-PCIe3", resident_first=kk).layers <= auto.layers
    p = plan(fam, "V100-32GB-PCIe3", resident_first="auto")
    assert p.row("stronghold").layers == auto.layers and f"stronghold k={k}" in p.table()
    with pytest.raises(ValueError, match="'auto' is for the 'stronghold' policy"):
        largest_trainable("l2l", fam, "V100-32GB-PCIe3", resident_first="auto")


def test_closed_form_is_the_ledger_at_many_sizes(template):
    """The GPT closed form (memory_model) is a fast path of the memory ledger: at every depth,
    for every policy, window and k, its device terms at the peak and its host terms are the
    ledger's replay of the program built from the repeated blocks' specs."""
    from shfx.passes.ledger import replay
    from shfx.passes.pipeline import build_programs

    for fam, graph in template.items():
        blocks = range(1, 3)
        for L in (1, 2, 3, 4, 5, 7, 10):
            specs, _ = repeat_blocks(graph.specs, None, blocks, L)
            for policy, kw in [(p, {}) for p in ("resident", "l2l", "zero-offload", "zero-infinity")] + [
                ("stronghold", {"window": w, "resident_first": k}) for w in (1, 2, 3) for k in (0, 1, 2)
            ]:
                want = memory_model(policy, fam.with_layers(L), EMU, **kw)
                progs = build_programs(specs, make_policy(policy, **kw), verify=False)
                led = replay(progs[0], programs=progs)
                dev = {k: v for k, v in led.terms_at_peak("device").items() if v}
                assert dev == {k: v for k, v in want.device.items() if v}, (fam.vocab, L, policy, kw)
                assert led.static("host") == {k: v for k, v in want.host.items() if v}, (fam.vocab, L, policy, kw)


# ---- mixed precision and the step journal's rollback copies -----------------------------------


def test_rollback_copies_closed_form_is_the_ledger(template):
    """With rollback on, the closed form's host terms (the journal's copies included) are the
    ledger's replay with ``rollback=True`` (fp32: the precision both can see today)."""
    from shfx.passes.ledger import replay
    from shfx.passes.pipeline import build_programs

    for fam, graph in template.items():
        for L in (1, 3, 4):
            specs, _ = repeat_blocks(graph.specs, None, range(1, 3), L)
            for policy, kw in [(p, {}) for p in ("resident", "l2l", "zero-offload", "zero-infinity")] + [
                ("stronghold", {"window": 2, "resident_first": k}) for k in (0, 1)
            ]:
                want = memory_model(policy, fam.with_layers(L), EMU, rollback=True, **kw)
                assert want.host["rollback copies"] > 0
                progs = build_programs(specs, make_policy(policy, **kw), verify=False)
                led = replay(progs[0], programs=progs, rollback=True)
                assert led.static("host") == {k: v for k, v in want.host.items() if v}, (fam.vocab, L, policy, kw)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_mixed_precision_bytes_per_parameter(precision):
    """The design of issue 10 (notes: 16-bit working copy and gradients on the device, fp32
    master, gradients, m and v on the host plus the 16-bit image prefetches send; fp16 keeps the
    step journal's rollback copies by default), at the reference shape, where every tensor is
    64-byte aligned so the counts are exact."""
    h, V, L = 2048, 50304, 48
    fam = replace(REF, precision=precision, layers=L)
    P = fam.num_params()
    e = 4 if precision == "fp32" else 2
    sh = memory_model("stronghold", fam, V100)
    # device: W=2 slots of 16-bit parameters, the streamed stages' gradients written over them
    assert sh.slot_sizes == (e * (V + 1024) * h, e * (V * h + 2 * h))  # head's slot; the tail's (with wte), not a block's
    assert sh.device["gradients"] == 0 and sh.device["optimizer states"] == 0
    host = sh.host
    assert host["master parameters (fp32)"] == host["gradients (fp32)"] == 4 * P
    assert host["optimizer states (m, v)"] == 8 * P
    assert host["working copy (16-bit)"] == (0 if e == 4 else 2 * P)
    assert host["pending tied gradient"] == e * V * h
    groups = L + 2
    assert host["rollback copies"] == (12 * P + 4 * groups if precision == "fp16" else 0)
    assert sh.settings["rollback"] == (precision == "fp16")
    # rollback can be asked for or turned off at any precision
    assert memory_model("stronghold", fam, V100, rollback=False).host["rollback copies"] == 0
    assert memory_model("stronghold", fam, V100, rollback=True).host["rollback copies"] == 12 * P + 4 * groups
    # resident keeps everything on the device: 2 + 2 B/param and fp32 master + m + v (REFERENCE.md's 16)
    res = memory_model("resident", fam, V100)
    if e == 2:
        assert res.device["parameters (slots)"] == res.device["gradients"] == 2 * (P + V * h)
        assert res.device["optimizer states"] == 12 * P
        assert res.host["working copy (16-bit)"] == 2 * P  # the image every group keeps beside its master


def test_precision_names_are_normalised_one_way():
    from shfx.cost_model.shapes import normalize_precision, short_precision

    for short, long in (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")):
        assert normalize_precision(short) == normalize_precision(long) == long
        assert short_precision(long) == short_precision(short) == short
        assert GPTShape(precision=short) == GPTShape(precision=long)
        assert GPTShape(precision=short).precision == long
    with pytest.raises(ValueError, match="fp32, bf16, fp16"):
        GPTShape(precision="tf32")


def test_fp16_trains_fewer_layers_than_bf16_on_a_host_bound_machine():
    """fp16's rollback copies (12 B/param) bind the host where bf16 stops at 18 B/param."""
    rows = {p: largest_trainable("stronghold", replace(REF, precision=p), V100) for p in ("bf16", "fp16")}
    assert rows["bf16"].binding == "host: optimizer states (m, v)"
    assert rows["fp16"].binding == "host: rollback copies"
    assert rows["fp16"].layers < rows["bf16"].layers
    assert largest_trainable("stronghold", replace(REF, precision="fp16"), V100, rollback=False).layers == rows["bf16"].layers


_POLICIES_16 = (("stronghold", {"window": 2}), ("stronghold", {"window": 3}), ("zero-offload", {}), ("zero-infinity", {}),
                ("resident", {}), ("l2l", {}), ("stronghold", {"window": 2, "resident_first": 1}))  # fmt: skip


# (the default run: one host-updating policy and one with a device group; every policy in the slow run)
@pytest.mark.parametrize(
    "policies", [_POLICIES_16[::6], pytest.param(_POLICIES_16[1:6], marks=pytest.mark.slow)], ids=["sample", "rest"]
)
def test_closed_form_is_the_ledger_in_16_bit(policies):
    """In bf16 and fp16 the GPT closed form is the ledger of the real 16-bit capture (the
    compile pipeline's precision=), for every policy: the 16-bit image, two staging buffers for
    the casts, the 16-bit loss and pending gradient, fp16's rollback copies, and for the groups
    updated on the device their fp32 master beside m and v (l2l's too: its slots are 16-bit)."""
    fam = GPTShape(hidden=32, heads=2, seq=16, batch=2, vocab=64, layers=3)
    with torch.device("meta"):
        model = GPT(fam)
        idx = torch.zeros(fam.batch, fam.seq, dtype=torch.long)
    for precision in ("bf16", "fp16"):
        for policy, kw in policies:
            want = memory_model(policy, replace(fam, precision=precision), EMU, **kw)
            got = memory_for_model(policy, model, (idx, idx), EMU, precision=precision, **kw)
            assert got.device == want.device, (precision, policy, kw)
            assert got.host == want.host, (precision, policy, kw)
            assert (got.host["rollback copies"] > 0) == (precision == "fp16") == got.settings["rollback"]
    assert memory_for_model("stronghold", model, (idx, idx), EMU, precision="fp16", rollback=False).host["rollback copies"] == 0


def test_cli_plan_precision(capsys):
    from shfx.cli import main

    outs = []
    for name in ("fp16", "float16"):
        assert main(["plan", "--precision", name, "--policies", "stronghold"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and "float16" in outs[0] and "host: rollback copies" in outs[0]
    assert main(["plan", "--precision", "bf16", "--policies", "stronghold", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["family"]["precision"] == "bfloat16" and data["rows"][0]["host"]["rollback copies"] == 0


# ---- the NVMe tier -------------------------------------------------------------------------------


def test_nvme_closed_form_is_the_ledger(template):
    """With the NVMe tier the GPT closed form's host and SSD terms (states on the SSD, the host
    window's buffers on the host) are the ledger's replay of the program with SSD reads and
    writes, at several depths, windows and host windows."""
    from shfx.passes.ledger import SSD_TERMS, replay
    from shfx.passes.pipeline import build_programs

    for fam, graph in template.items():
        for L in (1, 2, 5):
            specs, _ = repeat_blocks(graph.specs, None, range(1, 3), L)
            for pol in [shfx.Stronghold(window=w, resident_first=k, nvme=True, host_window=h) for w in (1, 2) for k in (0, 1) for h in (1, 2, 3)] + [
                shfx.ZeroInfinity(nvme=True, host_window=h) for h in (1, 4)
            ] + [shfx.ZeroOffload(nvme=True, host_window=h) for h in (1, 3)]:
                want = memory_model(pol, fam.with_layers(L), EMU)
                progs = build_programs(specs, pol, verify=False)
                led = replay(progs[0], programs=progs)
                assert led.static("host") == {k: v for k, v in want.host.items() if v}, (fam.vocab, L, pol)
                assert {**dict.fromkeys(SSD_TERMS, 0), **led.static("ssd")} == want.ssd, (fam.vocab, L, pol)
                dev = {k: v for k, v in led.terms_at_peak("device").items() if v}
                assert dev == {k: v for k, v in want.device.items() if v}


def test_nvme_closed_form_is_the_ledger_in_16_bit_with_masters():
    fam = GPTShape(hidden=32, heads=2, seq=16, batch=2, vocab=64, layers=3)
    with torch.device("meta"):
        model = GPT(fam)
        idx = torch.zeros(fam.batch, fam.seq, dtype=torch.long)
    for precision in ("bf16", "fp16"):
        for pol in (shfx.Stronghold(window=2, nvme=True, host_window=2, nvme_masters=True), shfx.ZeroInfinity(nvme=True, host_window=1)):
            want = memory_model(pol, replace(fam, precision=precision), EMU)
            got = memory_for_model(pol, model, (idx, idx), EMU, precision=precision)
            assert (got.host, got.ssd, got.device) == (want.host, want.ssd, want.device), (precision, pol)
            assert got.settings["nvme"] and got.settings["host_window"] == pol.host_window
    with pytest.raises(ValueError, match="nvme_masters=True needs mixed precision"):
        memory_model(shfx.Stronghold(nvme=True, nvme_masters=True), fam, EMU)


def test_nvme_tier_doubles_stronghold_on_the_reference_setup():
    """STRONGHOLD's setup with a 2 TB NVMe: the tier takes the AdamW states (8 of 16 B/param) off
    the host; what binds then is the fp32 master and gradient (4 + 4 B/param)."""
    hw = replace(get_profile(V100), ssd_bytes=2 * 10**12)
    host_only = largest_trainable("stronghold", REF, hw)
    tier = largest_trainable(shfx.Stronghold(nvme=True, host_window=2), REF, hw)
    assert (host_only.layers, host_only.binding) == (116, "host: optimizer states (m, v)")
    assert tier.policy == "stronghold+nvme" and tier.layers > 1.9 * host_only.layers
    assert tier.binding == "host: master parameters (fp32) + gradients (fp32)"
    assert tier.breakdown.ssd["optimizer states (m, v)"] == 2 * tier.breakdown.host["master parameters (fp32)"] - 2 * (
        tier.breakdown.host["master parameters (fp32)"] - tier.breakdown.host["gradients (fp32)"]
    )
    # a small SSD binds instead, named as the SSD's term
    small = largest_trainable(shfx.Stronghold(nvme=True, host_window=2), REF, replace(hw, ssd_bytes=20 * 2**30))
    assert small.binding == "ssd: optimizer states (m, v)" and small.layers < host_only.layers


def test_cli_plan_ssd_rows(capsys):
    from shfx.cli import main

    assert main(["plan", "--ssd", "2TB"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line and line.split()[0] in policy_names() + ("stronghold+nvme", "zero-infinity+nvme")}
    assert "stronghold+nvme" in rows and "zero-infinity+nvme" in rows
    assert "NVMe tier: host window 2" in out
    assert rows["stronghold"].split()[1] == "116" and "host: master parameters (fp32) + gradients (fp32)" in rows["stronghold+nvme"]
    assert main(["plan", "--ssd", "2TB", "--host-window", "4", "--policies", "stronghold", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in data["rows"]] == ["stronghold", "stronghold+nvme"]
    assert data["rows"][1]["settings"]["host_window"] == 4
    assert main(["plan", "--nvme-masters"]) == 1
    assert "--nvme-masters puts master weights on the NVMe tier, which needs --ssd" in capsys.readouterr().err
