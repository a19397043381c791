"""The planner's tiers beyond host RAM (issue 26, part 4): parameters, gradients and optimizer
states on the SSD with host windows (``stronghold+nvme-all``), activation offload
(``+act-host``, ``+act-nvme``), their step time, and the 175B check on the RTX 4090 profile.
Closed forms against hand counts from the profile's figures; nothing runs, no wall clock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shfx.cost_model.beyond_ram import LOHAN_175B, step_traffic, tier_step
from shfx.cost_model.hardware import PROFILES
from shfx.cost_model.planner import BEYOND_RAM_TIERS, largest_trainable, memory_model, plan
from shfx.cost_model.shapes import GPTShape

# GPT-3 175B (96 layers, hidden 12288, 96 heads, context 2048, vocab 50257), bf16, batch 4
GPT3 = GPTShape(layers=96, hidden=12288, heads=96, seq=2048, batch=4, vocab=50257, precision="bf16")
# the 4090 with 256 GB of host RAM (LoHan's) and a 4 TB SSD: `shfx plan --host 256GB --ssd 4TB`
RTX = replace(PROFILES["RTX4090-24GB"], host_memory_bytes=256 * 10**9, ssd_bytes=4 * 10**12)

h, s, b, V, L = GPT3.hidden, GPT3.seq, GPT3.batch, GPT3.vocab, GPT3.layers
N_BLOCK = 12 * h * h + 13 * h  # one block's parameters (h % 32 == 0: no alignment padding in fp32 or bf16)
P = L * N_BLOCK + (V + s) * h + 2 * h  # every parameter (the embedding tied to the head)
SLOT = L * N_BLOCK + (V + s) * h + (2 * h + V * h)  # what the slots hold: the tail borrows wte
PAGED = L * N_BLOCK + 2 * h  # the groups whose image lives on the SSD: the blocks and the tail's own (the head's is borrowed)
HEAD = (V + s) * h
A = b * s * h * 2  # one boundary activation, bf16


def test_the_175b_gpt_is_the_preset():
    assert GPT3.num_params() == P and 174e9 < P < 175e9


def test_175b_fits_the_4090_only_with_the_tiers_beyond_ram():
    # everything in host RAM: 18 B/param on the host, 3 TB
    host_only = memory_model("stronghold", GPT3, RTX)
    assert not host_only.fits() and host_only.binding() == "host: optimizer states (m, v)"
    # shfx's NVMe tier (m, v and the masters on the SSD) still keeps the gradient and the image in RAM
    nvme = memory_model("stronghold", GPT3, RTX, nvme=True, nvme_masters=True)
    assert not nvme.fits() and nvme.binding().startswith("host: ")
    # everything on the SSD: the host fits, the device's boundary activations do not
    all_ssd = memory_model("stronghold", GPT3, RTX, **BEYOND_RAM_TIERS["nvme-all"])
    assert all_ssd.host_total < RTX.host_memory_bytes and all_ssd.ssd_total < RTX.ssd_bytes
    assert not all_ssd.fits() and all_ssd.binding() == "device: activations (checkpoints)"
    # and with activation offload it trains; the device is the tightest tier, on a block's recompute
    for tier in ("nvme-all+act-host", "nvme-all+act-nvme"):
        bd = memory_model("stronghold", GPT3, RTX, **BEYOND_RAM_TIERS[tier])
        assert bd.fits(), tier
        assert bd.binding() == "device: working set (one block)"


def test_the_plan_rows_name_the_limiting_term():
    p = plan(GPT3, RTX, policies=["stronghold"], tiers=list(BEYOND_RAM_TIERS))
    rows = {r.policy: r for r in p.rows}
    assert list(rows) == ["stronghold", "stronghold+nvme-all", "stronghold+nvme-all+act-host", "stronghold+nvme-all+act-nvme"]
    assert rows["stronghold"].layers < L and rows["stronghold"].binding == "host: optimizer states (m, v)"
    assert rows["stronghold+nvme-all"].layers < L
    assert rows["stronghold+nvme-all"].binding.startswith("device: ")
    for tier in ("stronghold+nvme-all+act-host", "stronghold+nvme-all+act-nvme"):
        assert rows[tier].layers >= L and rows[tier].binding.startswith("ssd: "), rows[tier]
    # one layer more than the largest does not fit, and what it overflows is the row's binding
    r = rows["stronghold+nvme-all+act-host"]
    over = memory_model("stronghold", GPT3.with_layers(r.layers + 1), RTX, **BEYOND_RAM_TIERS["nvme-all+act-host"])
    assert not over.fits() and over.binding() == r.binding
    assert largest_trainable("stronghold", GPT3, RTX, **BEYOND_RAM_TIERS["nvme-all+act-host"]).layers == r.layers
    # the tier rows' own options (shfx plan --host-window)
    three = plan(GPT3, RTX, policies=["stronghold"], tiers=["nvme-all"], tier_options={"host_window": 3}).row("stronghold+nvme-all")
    assert three.breakdown.settings["host_window"] == 3 and three.breakdown.host["SSD host window"] == 3 * 16 * N_BLOCK + 4 * (three.layers + 2)


def test_all_ssd_host_and_ssd_bytes_are_the_hand_count():
    bd = memory_model("stronghold", GPT3, RTX, window=2, host_window=2, **BEYOND_RAM_TIERS["nvme-all"])
    groups = L + 2
    # host: the tied head stays (its bf16 image and fp32 gradient); 2 host-window buffers of the
    # largest group (a block): its fp32 master, m, v (the SSD read) and its fp32 gradient; a
    # 4-byte step counter per group; max(1, min(W, l + 2 - W)) + 1 = 3 image buffers of a
    # block's bf16 image; 2 pinned staging buffers of a block's fp32 size; the tail's bf16
    # gradient of the tied embedding waiting for the head's
    assert bd.settings["image_window"] == 3
    head = 2 * HEAD + 4 * HEAD
    window = 2 * (12 + 4) * N_BLOCK + 4 * groups
    images = 3 * 2 * N_BLOCK
    staging = 2 * 4 * N_BLOCK
    pending = 2 * V * h
    assert bd.host["SSD host window"] == window and bd.host["SSD image window"] == images
    assert bd.host["gradient staging (pinned)"] == staging
    assert bd.host_total == head + window + images + staging + pending
    # SSD: every fp32 master 4 and m, v 8 bytes per parameter; the paged groups' bf16 images 2
    assert {k: v for k, v in bd.ssd.items() if v} == {
        "master parameters (fp32)": 4 * P, "optimizer states (m, v)": 8 * P, "working copy (16-bit)": 2 * PAGED,
    }  # fmt: skip
    # the host does not grow with the model: only the step counters do
    assert memory_model("stronghold", GPT3.with_layers(2 * L), RTX, **BEYOND_RAM_TIERS["nvme-all"]).host_total == bd.host_total + 4 * L


def _ledger_of_param_tier(fam: GPTShape, window: int, host_window: int):
    """The ledger of the real parameter-tier program (``Offload(params="nvme", gradients="nvme",
    optimizer="nvme")``) of ``fam``: its static host and SSD terms and its device peak."""
    import torch

    from shfx.models import GPT
    from shfx.passes.ledger import replay
    from shfx.passes.pipeline import PipelineOptions, compile_variant
    from shfx.passes.policies import Stronghold

    with torch.device("meta"):
        model = GPT(fam)
        idx = torch.zeros(fam.batch, fam.seq, dtype=torch.long)
    pol = Stronghold(window=window, nvme=True, host_window=host_window, nvme_masters=fam.mixed)
    opts = PipelineOptions(policy=pol, verify=False, precision=fam.precision, plan_only=True, param_tier=True)
    v = compile_variant(model, (idx, idx), {}, opts)
    led = replay(
        v.programs[0], programs=v.programs, group_bytes=[g.host_master_bytes for g in v.graph.groups],
        working_bytes=[g.working_bytes for g in v.graph.groups],
    )  # fmt: skip
    return v.programs[0], led


@pytest.mark.parametrize(  # (512: the head is the largest group; the 16-bit variants under SHFX_SLOW)
    "precision,vocab", [pytest.param("bf16", 64, marks=pytest.mark.slow), ("fp32", 64), pytest.param("bf16", 512, marks=pytest.mark.slow)]
)
def test_the_all_ssd_closed_form_is_the_ledgers_parameter_tier(precision, vocab):
    """memory_model(nvme_all=True) is the ledger's replay of the parameter tier's real program,
    byte for byte, on a grid of sizes, windows and host windows (h % 32 == 0: no padding)."""
    from shfx.cost_model.planner import Target

    emu = Target("emulated", 1 << 40, emulated=True)
    for layers, window, host_window in ((3, 2, 2), (5, 1, 1), (6, 3, 3), (4, 4, 2)):
        fam = GPTShape(hidden=32, heads=2, seq=16, batch=2, vocab=vocab, layers=layers, precision=precision)
        prog, led = _ledger_of_param_tier(fam, window, host_window)
        bd = memory_model("stronghold", fam, emu, window=window, host_window=host_window, **BEYOND_RAM_TIERS["nvme-all"])
        where = (precision, vocab, layers, window, host_window)
        assert bd.settings["image_window"] == prog.image_window, where
        assert {k: v for k, v in bd.host.items() if v} == {k: v for k, v in led.static("host").items() if v}, where
        assert {k: v for k, v in bd.ssd.items() if v} == {k: v for k, v in led.static("ssd").items() if v}, where
        assert {k: v for k, v in bd.device.items() if v} == {k: v for k, v in led.terms_at_peak("device").items() if v}, where


@pytest.mark.parametrize("precision", [pytest.param("bf16", marks=pytest.mark.slow), "fp32"])
def test_step_traffic_is_the_programs_bytes(precision):
    """step_traffic's SSD and PCIe bytes are the real programs' (Program.bytes_moved) for the
    NVMe tier and the parameter tier."""
    import torch

    from shfx.models import GPT
    from shfx.passes.pipeline import PipelineOptions, compile_variant
    from shfx.passes.policies import Stronghold

    for layers, window in ((3, 2), (6, 3)):
        fam = GPTShape(hidden=32, heads=2, seq=16, batch=2, vocab=64, layers=layers, precision=precision)
        with torch.device("meta"):
            model = GPT(fam)
            idx = torch.zeros(fam.batch, fam.seq, dtype=torch.long)
        for tier in (None, "nvme", "nvme-all"):
            masters = fam.mixed and tier == "nvme-all"
            pol = Stronghold(window=window, nvme=tier is not None, host_window=2, nvme_masters=masters)
            opts = PipelineOptions(policy=pol, verify=False, precision=precision, plan_only=True, param_tier=tier == "nvme-all")
            moved = compile_variant(model, (idx, idx), {}, opts).programs[0].bytes_moved()
            t = step_traffic(fam, tier, window=window, nvme_masters=masters)
            want = {"h2d": t.h2d_bytes, "d2h": t.d2h_bytes} | ({"ssd_read": t.ssd_read_bytes, "ssd_write": t.ssd_write_bytes} if tier else {})
            assert moved == want, (precision, layers, window, tier)


OFFLOADED = 8 * b * s + (L - 1) * A  # the head's token ids and the first l - 1 blocks' inputs


def test_activation_offload_bytes_are_the_hand_count():
    W = 2
    on_device = memory_model("stronghold", GPT3, RTX, window=W, **BEYOND_RAM_TIERS["nvme-all"])
    to_host = memory_model("stronghold", GPT3, RTX, window=W, **BEYOND_RAM_TIERS["nvme-all+act-host"])
    to_ssd = memory_model("stronghold", GPT3, RTX, window=W, **BEYOND_RAM_TIERS["nvme-all+act-nvme"])
    inputs, loss = 8 * b * s * 2, 4  # token ids and targets (int64), the fp32 loss
    assert on_device.device["activations (checkpoints)"] == inputs + (L + 1) * A + loss
    assert on_device.device["activation gradients"] == loss + A
    # every stage but the last block and the tail sends its backward's inputs to the host: the
    # peak keeps the last block's and the tail's, the loss, and two boundary gradients
    assert to_host.device["activations (checkpoints)"] == 2 * A + loss
    assert to_host.device["activation gradients"] == 2 * A
    assert to_host.host["offloaded activations"] == OFFLOADED
    assert to_host.host_total == on_device.host_total + OFFLOADED
    # to the SSD through the activation window's two buffers of one activation
    assert to_ssd.host_total == on_device.host_total + 2 * A
    assert to_ssd.ssd_total == on_device.ssd_total + OFFLOADED


@pytest.mark.parametrize("precision,loss_in_model", [pytest.param("bf16", True, marks=pytest.mark.slow), ("fp32", False)])
def test_activation_offload_is_the_ledgers(precision, loss_in_model):
    """memory_model(activations="host"/"nvme") is the ledger's replay of the activation-offload
    program (PipelineOptions(activations=...), shfx.passes.activations) on a grid (l >= 2): with
    "nvme" the host holds the window's two buffers of one activation, the SSD every value."""
    import torch

    from shfx.cost_model.planner import Target
    from shfx.models import GPT
    from shfx.passes.ledger import replay
    from shfx.passes.pipeline import PipelineOptions, compile_variant
    from shfx.passes.policies import Stronghold

    emu = Target("emulated", 1 << 40, emulated=True)
    for layers, window in ((2, 1), (4, 2), (6, 3)):
        fam = GPTShape(hidden=32, heads=2, seq=16, batch=2, vocab=64, layers=layers, precision=precision, loss_in_model=loss_in_model)
        with torch.device("meta"):
            model = GPT(fam)
            idx = torch.zeros(fam.batch, fam.seq, dtype=torch.long)
        for acts in ("host", "nvme"):
            opts = PipelineOptions(policy=Stronghold(window=window), verify=False, precision=precision, plan_only=True, activations=acts)
            v = compile_variant(model, (idx, idx) if loss_in_model else (idx,), {}, opts)
            led = replay(
                v.programs[0], programs=v.programs, group_bytes=[g.host_master_bytes for g in v.graph.groups],
                working_bytes=[g.working_bytes for g in v.graph.groups],
            )  # fmt: skip
            bd = memory_model("stronghold", fam, emu, window=window, activations=acts)
            where = (precision, loss_in_model, layers, window, acts)
            assert {k: x for k, x in bd.device.items() if x} == {k: x for k, x in led.terms_at_peak("device").items() if x}, where
            assert {k: x for k, x in bd.host.items() if x} == {k: x for k, x in led.static("host").items() if x}, where
            assert {k: x for k, x in bd.ssd.items() if x} == {k: x for k, x in led.static("ssd").items() if x}, where
        # and the step's copies are the program's
        moved = v.programs[0].bytes_moved()
        t = step_traffic(fam, "nvme-all+act-host", window=window)
        plain = step_traffic(fam, "nvme-all", window=window)
        assert (moved["h2d"], moved["d2h"]) == (t.h2d_bytes, t.d2h_bytes), where
        a = fam.batch * fam.seq * fam.hidden * fam.param_bytes  # one boundary activation of this model
        assert t.h2d_bytes - plain.h2d_bytes == t.d2h_bytes - plain.d2h_bytes == 8 * fam.batch * fam.seq + (layers - 1) * a


def test_the_tiers_are_refused_where_not_modelled():
    with pytest.raises(ValueError, match="'stronghold' policy with resident_first=0"):
        memory_model("zero-offload", GPT3, RTX, nvme_all=True)
    with pytest.raises(ValueError, match="'stronghold' policy with resident_first=0"):
        memory_model("stronghold", GPT3, RTX, resident_first=1, activations="host")
    with pytest.raises(ValueError, match="needs checkpointing=True"):
        memory_model("stronghold", replace(GPT3, checkpointing=False), RTX, activations="host")
    with pytest.raises(ValueError, match="activations must be None, 'host' or 'nvme'"):
        memory_model("stronghold", GPT3, RTX, activations="auto")
    with pytest.raises(ValueError, match="unknown tier"):
        plan(GPT3, RTX, policies=["stronghold"], tiers=["nvme-everything"])


# ---- the step time --------------------------------------------------------------------------------


def _block_forward_s(hw) -> float:
    """A block's FORWARD on ``hw`` by hand: its matmuls (QKV, projection, MLP: 24 b s h^2, attention
    scores and values 4 b s^2 h) at the bf16 rate, its other ops' bytes (8 b s h + 4 b s elements,
    written and read) at the device memory bandwidth."""
    return (24 * b * s * h * h + 4 * b * s * s * h) / hw.flops["bfloat16"] + 2 * 2 * (8 * b * s * h + 4 * b * s) / hw.device_mem_bps


def test_all_ssd_step_traffic_is_the_hand_count():
    t = step_traffic(GPT3, "nvme-all", window=2)
    # each paged image read for the forward's prefetch and for the backward's prefetch and
    # update, written back after the update; every group's fp32 master, m and v read and written
    # by its update
    assert t.ssd == {"image": (2 * 2 * PAGED, 2 * PAGED), "master, m, v": (12 * P, 12 * P)}
    assert (t.ssd_read_bytes, t.ssd_write_bytes) == (4 * PAGED + 12 * P, 2 * PAGED + 12 * P)
    # PCIe: the bf16 image of each stage in the forward and again in the backward but for the
    # tail and the last block (the window resident at the turn); gradients back: fp32 for the
    # blocks and the tail's own LayerNorm (cast on the device), bf16 for the tied embedding's
    assert t.h2d_bytes == 2 * (2 * SLOT - (2 * h + V * h) - N_BLOCK)
    assert t.d2h_bytes == 4 * (L * N_BLOCK + 2 * h) + 2 * ((V + s) * h + V * h)
    # updates not overlapped with the backward: the fp32 gradient is written and read back
    slow = step_traffic(GPT3, "nvme-all", overlap_updates=False)
    assert (slow.ssd_read_bytes, slow.ssd_write_bytes) == (t.ssd_read_bytes + 4 * P, t.ssd_write_bytes + 4 * P)
    # activations to the SSD and back, and over PCIe both ways
    act = step_traffic(GPT3, "nvme-all+act-nvme")
    assert act.ssd["activations"] == (OFFLOADED, OFFLOADED)
    assert act.h2d_bytes == t.h2d_bytes + OFFLOADED and act.d2h_bytes == t.d2h_bytes + OFFLOADED
    # shfx's NVMe tier: m and v each way (and the masters with nvme_masters); fp32's tier beyond
    # RAM: m and v (the image is the master)
    assert step_traffic(GPT3, "nvme").ssd == {"m, v": (8 * P, 8 * P)}
    assert step_traffic(GPT3, "nvme", nvme_masters=True).ssd == {"master, m, v": (12 * P, 12 * P)}
    assert step_traffic(replace(GPT3, precision="fp32"), "nvme-all").ssd == {"image": (2 * 4 * PAGED, 4 * PAGED), "m, v": (8 * P, 8 * P)}
    assert step_traffic(GPT3).ssd == {}


def test_the_175b_step_adds_up_from_the_profiles_figures():
    hw = PROFILES["RTX4090-24GB"]
    st = tier_step(GPT3, hw, "nvme-all+act-host", window=2)
    t = st.traffic
    # the SSD's time: reads at 7 GB/s and writes at 6 GB/s, one after the other (ssd_duplex 0.5:
    # running both at once gains nothing)
    assert hw.ssd_duplex == 0.5
    assert st.ssd_s == pytest.approx((4 * PAGED + 12 * P) / 7e9 + (2 * PAGED + 12 * P) / 6e9, rel=1e-12)
    # PCIe at 25 GB/s each way, the activations included
    assert st.h2d_s == pytest.approx((2 * (2 * SLOT - (2 * h + V * h) - N_BLOCK) + OFFLOADED) / 25e9, rel=1e-12)
    assert st.d2h_s == pytest.approx(t.d2h_bytes / 25e9, rel=1e-12)
    # compute: a block's forward and its backward (recompute + 2 forwards' work) L times, then the
    # head's and the tail's (the tail's forward keeps its graph: its backward does not recompute)
    f_block = _block_forward_s(hw)
    f_head = 2 * 2 * (2 * b * s * h + s * h) / hw.device_mem_bps + 2 * 8 * s / hw.device_mem_bps
    f_tail = 2 * b * s * h * V / hw.flops["bfloat16"] + 2 * 2 * (2 * b * s * V + b * s * h + 2 * b * s + 2) / hw.device_mem_bps
    assert st.compute_s == pytest.approx(L * 4 * f_block + 4 * f_head + 3 * f_tail, rel=1e-9)
    # the host AdamW: 30 bytes per parameter (28 + the bf16 image's refresh) at 100 GB/s
    assert st.host_update_s == pytest.approx(30 * P / hw.host_mem_bps, rel=1e-9)
    # the step: the longer of the window's pipeline and the SSD; here the single SSD binds
    assert st.step_s == max(st.pipeline_s, st.ssd_s) == st.ssd_s
    assert st.bottleneck == "ssd" and st.resources["ssd"] == max(st.resources.values())
    assert st.pipeline_s >= st.compute_s
    # the offloaded activations' copies hide behind the compute: same pipeline as without them
    assert st.pipeline_s == pytest.approx(tier_step(GPT3, hw, "nvme-all", window=2).pipeline_s, rel=1e-9)
    # everything in RAM: no SSD term, compute-bound on this card
    ram = tier_step(GPT3, hw, None)
    assert ram.ssd_s == 0 and ram.step_s == ram.pipeline_s and ram.bottleneck == "compute"


def test_the_closed_form_pipeline_is_the_simulated_program():
    """Everything in host RAM, the step is the window schedule's: the closed form tier_step uses
    equals the simulator on stronghold's real program of the same GPT (one fact, two views), with
    full-duplex links (the closed form's; the simulator also models their coupling)."""
    from shfx.commands import gpt_plan_inputs
    from shfx.cost_model.simulate import simulate
    from shfx.passes.policies import make_policy

    hw = PROFILES["RTX4090-24GB"]
    for layers, window in ((3, 2), (6, 3)):
        fam = GPTShape(layers=layers, hidden=256, heads=4, seq=128, batch=2, vocab=512, precision="bf16")
        specs, costs = gpt_plan_inputs(fam, hw)
        costs = costs.with_links(replace(costs.links, duplex=1.0))  # (the closed form's links: full duplex)
        sim = simulate(make_policy("stronghold", window=window).program(specs), costs)
        assert tier_step(fam, hw, None, window=window).pipeline_s == pytest.approx(sim.step_s, rel=1e-9)


def test_four_drives_shorten_the_ssd_bound_by_their_bandwidth():
    one, four = PROFILES["RTX4090-24GB"], PROFILES["H100-80GB-4xNVMe"]
    a, c = tier_step(GPT3, one, "nvme-all"), tier_step(GPT3, four, "nvme-all")
    assert a.traffic == c.traffic
    assert c.ssd_s == pytest.approx(a.traffic.ssd_read_bytes / 10e9 + a.traffic.ssd_write_bytes / 5e9, rel=1e-12)
    # the H100 profile with four drives is the H100 PCIe 5 profile but its SSD
    assert replace(four, name="H100-80GB-PCIe5", ssd_read_bps=PROFILES["H100-80GB-PCIe5"].ssd_read_bps,
                   ssd_write_bps=PROFILES["H100-80GB-PCIe5"].ssd_write_bps) == PROFILES["H100-80GB-PCIe5"]


def test_lohan_figure_is_cited_not_invented():
    # exactly as the artifact's evaluation_data.md gives Figure 7(b), and no step time (not published)
    f = LOHAN_175B
    assert f.step_s is None and "step time: not published" in f.lines()[1]
    assert "github.com/RC4ML/LoHan" in f.source and "evaluation_data.md, Figure 7(b)" in f.source
    assert f.tflops == 86.9 and f.other_batches == ((8, 52.6), (32, None))
    assert (f.family.layers, f.family.heads, f.family.hidden, f.family.batch) == (96, 96, 12288, 16)
    assert "12x Intel D7-P5510 3.84 TB SSDs in RAID-0" in f.setup and "768 GB DDR4" in f.setup
    assert "arXiv 2403.06504v2, abstract" in f.lines()[0] and "256 GB main memory" in f.lines()[0]
    # what is not the artifact's own words says so: seq 1024 and fp16 are its script's defaults
    assert (f.family.seq, f.family.precision) == (1024, "float16") and "main.py defaults" in f.note
    # the derived step: the published rate over a FLOP count, shfx's (recompute included) or 6 N b s
    fb, sb = f.family.batch, f.family.seq
    flops = 96 * fb * sb * L * h * h * (1 + sb / (6 * h) + V / (16 * L * h))  # REFERENCE.md, full recompute
    assert f.implied_step_s() == pytest.approx(flops / 86.9e12, rel=1e-12)
    assert f.implied_step_s(flops="6N") == pytest.approx(6 * f.family.num_params() * fb * sb / 86.9e12, rel=1e-12)
    assert f"= {flops / 86.9e12:.0f} s" in f.derived() and "(not published)" in f.derived()


def test_lohan_comparison_at_this_setup_and_at_its_own():
    step = tier_step(GPT3, PROFILES["RTX4090-24GB"], "nvme-all+act-host")
    flops = 96 * b * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    assert step.tflops(GPT3) == pytest.approx(flops / step.step_s / 1e12, rel=1e-12)
    at = flops / 86.9e12
    line = LOHAN_175B.compare(step, GPT3)
    assert f"predicted {step.step_s:.0f} s (bottleneck ssd)" in line and f"would be a {at:.0f} s step here" in line
    assert f"{(step.traffic.ssd_read_bytes + step.traffic.ssd_write_bytes) / at / 1e9:.0f} GB/s of SSD bandwidth" in line
    # at LoHan's batch, sequence and precision, on one SSD and on its twelve drives
    one, twelve = LOHAN_175B.at_setup("nvme-all+act-host")
    for line, name in ((one, "RTX4090-24GB"), (twelve, "RTX4090-24GB-12xNVMe")):
        st = tier_step(LOHAN_175B.family, PROFILES[name], "nvme-all+act-host")
        assert f"on {name} (" in line and f"predicted {st.step_s:.0f} s (bottleneck {st.bottleneck})" in line
        assert f"{st.tflops(LOHAN_175B.family):.1f} TFLOP/s vs LoHan's 86.9 ({LOHAN_175B.implied_step_s():.0f} s" in line
    a = tier_step(LOHAN_175B.family, PROFILES["RTX4090-24GB"], "nvme-all+act-host")
    c = tier_step(LOHAN_175B.family, PROFILES["RTX4090-24GB-12xNVMe"], "nvme-all+act-host")
    assert a.bottleneck == "ssd" and c.bottleneck == "compute" and a.traffic == c.traffic


def test_the_12_drive_profile_is_the_4090_with_lohans_drives():
    p = PROFILES["RTX4090-24GB-12xNVMe"]
    assert (p.ssd_read_bps, p.ssd_write_bps) == (12 * 6.5e9, 12 * 3.4e9)
    assert replace(p, name="RTX4090-24GB", ssd_read_bps=7e9, ssd_write_bps=6e9) == PROFILES["RTX4090-24GB"]


# ---- shfx plan ------------------------------------------------------------------------------------


def test_cli_plan_shows_the_175b_gpt_trainable_on_the_4090(capsys):
    from shfx.cli import main

    args = ["plan", "--hardware", "RTX4090-24GB", "--host", "256GB", "--ssd", "4TB", "--precision", "bf16", "--seq", "2048"]
    assert main(args + ["--model", "gpt3-175b", "--policies", "stronghold", "--tiers", "nvme-all,nvme-all+act-host"]) == 0
    out = capsys.readouterr().out
    assert "GPT hidden 12288, 96 heads, seq 2048, batch 4, vocab 50257, bfloat16" in out
    assert "238.4 GiB host" in out  # 256 GB = 256e9 bytes
    table = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.startswith("stronghold") and ln.split()[1].isdigit()}
    assert int(table["stronghold+nvme-all+act-host"][1]) >= 96 and int(table["stronghold"][1]) < 96
    at96 = out.split("stronghold rows at 96 layers (174.6 B params")[1].split("published:")[0]
    lines = {ln.split()[0]: ln for ln in at96.splitlines() if ln.strip().startswith("stronghold")}
    assert "does not fit (over: host: optimizer states (m, v))" in lines["stronghold:"]
    assert "does not fit (over: device: activations (checkpoints))" in lines["stronghold+nvme-all:"]
    row = lines["stronghold+nvme-all+act-host:"]
    step = tier_step(GPT3, PROFILES["RTX4090-24GB"], "nvme-all+act-host", window=2)
    assert "fits (tightest: device: working set (one block))" in row and f"step {step.step_s:.1f} s (bottleneck ssd)" in row
    assert "published: LoHan (arXiv 2403.06504v2, abstract)" in out and "step time: not published" in out
    assert "published: LoHan (github.com/RC4ML/LoHan" in out and "86.9 TFLOP/s at batch 16 x seq 1024" in out
    assert "LoHan's step, derived (not published): " in out
    assert "stronghold+nvme-all+act-host, this setup: predicted " in out and "LoHan's 86.9 would be a " in out
    assert "stronghold+nvme-all+act-host, at LoHan's setup (batch 16 x seq 1024, float16) on RTX4090-24GB (" in out
    assert "stronghold+nvme-all+act-host, at LoHan's setup (batch 16 x seq 1024, float16) on RTX4090-24GB-12xNVMe (" in out
    # updates not overlapped: the gradients' SSD round trip in the step
    assert main(args + ["--model", "gpt3-175b", "--policies", "stronghold", "--tiers", "nvme-all+act-host", "--no-overlap-updates"]) == 0
    slow = tier_step(GPT3, PROFILES["RTX4090-24GB"], "nvme-all+act-host", window=2, overlap_updates=False)
    assert slow.step_s > step.step_s and f"step {slow.step_s:.1f} s (bottleneck ssd)" in capsys.readouterr().out
    # GiB works too, and without --ssd there are no tier rows
    assert main(args[:4] + ["256GiB", "--precision", "bf16", "--policies", "stronghold"]) == 0
    out = capsys.readouterr().out
    assert "256.0 GiB host" in out and "nvme-all" not in out
    assert main(["plan", "--tiers", "nvme-all"]) == 1
    assert "--tiers puts parameters, gradients and optimizer states on the SSD: give --ssd" in capsys.readouterr().err
