"""Activation offload to the SSD (``shfx.Offload(activations="nvme")``, issue 26 part 2): a stage's
offloaded activations go on from a host window buffer to the SSD (``AW g``) and come back into
one ahead of their fetch (``AR g``), so host RAM holds ``activation_window`` buffers however many
stages offload. Golden programs, the lowering's and the verifier's rules, the ledger, the
simulator, and the runtime on the emulated device and SSD: bitwise equal to eager PyTorch
(seeded once, dropout on), host memory bounded by the window, SSD bytes equal to the activations'."""

from __future__ import annotations

import copy

import pytest
import torch
from faults import fail_nth_ssd_read
from zoo import seeded_steps

import shfx
from shfx.models import GPT, GPTShape
from shfx.passes.activations import ACTIVATION_WINDOW, add_activation_spill, offloaded_values, spill_layout, window_buffer_bytes
from shfx.passes.features import activation_offload_program
from shfx.passes.ledger import replay
from shfx.passes.meta import get_meta
from shfx.passes.policies import Stronghold
from shfx.passes.program import ActionKind, ScheduleError, lower_actions
from shfx.passes.schedule import cold_backward_program, eval_program
from shfx.passes.stages import chain
from shfx.passes.verify import VerificationError, verify_program

ACT = 1000


def _specs(n: int = 6):
    return chain(n, prefetch_bytes=4000, activation_bytes=ACT)


def _program(n: int = 6, window: int = 2):
    return activation_offload_program(Stronghold(window=2).program(_specs(n)), window=window)


# ---- the program ------------------------------------------------------------------------------------


def test_golden_stronghold():
    p = _program()
    assert " ".join(p.actions()) == (
        "PF0 PF1 F0 R0 PF2 F1 R1 PF3 AO1 AW1 F2 R2 PF4 AO2 AW2 F3 R3 PF5 AO3 AW3 F4 F5 "
        "B5 AR3 AR2 OG5 U5 R5 PF3 AF3 AR1 B4 OG4 U4 R4 PF2 AF2 B3 OG3 U3 R3 PF1 AF1 B2 OG2 U2 R2 PF0 B1 OG1 U1 R1 B0 OG0 U0 R0"
    )
    verify_program(p, "train")
    deps = lambda a: [d.name for d in p.deps(p.find(a))]  # noqa: E731
    # the window's buffers go round: AO3 fills the one AW1 emptied (AO2 took the other), so the
    # d2h copy of one stage overlaps the SSD write of the one before
    assert [get_meta(p.find(a)).buffer for a in ("AO1", "AO2", "AO3")] == [0, 1, 0]
    assert deps("AO3") == ["f3", "aw1"] and deps("AW1") == ["ao1"]
    # a read waits for its stage's write and for the fetch that emptied its buffer; the fetch for the read
    assert deps("AR1") == ["aw1", "af3"]
    assert deps("AF1") == ["ar1", "b3"] and "af1" in deps("B1")
    assert get_meta(p.find("AW1")).stream == "ssd_write" and get_meta(p.find("AR1")).stream == "ssd_read"
    moved = p.bytes_moved()
    assert moved["ssd_write"] == moved["ssd_read"] == 3 * ACT  # every offloaded byte once each way
    assert p.activation_window == 2 and "activations on the SSD through 2 host buffers" in p.format()


def test_more_buffers_read_further_ahead():
    acts = [get_meta(n).action for n in activation_offload_program(Stronghold(window=2).program(_specs(8))).nodes]
    one = " ".join(map(str, add_activation_spill(acts, 1)))
    three = " ".join(map(str, add_activation_spill(acts, 3)))
    assert "B7 AR5 " in one and "AF5 AR4 " in one  # each read after the fetch before it
    assert "B7 AR5 AR4 AR3 " in three and "AF5 AR2 " in three
    with pytest.raises(ScheduleError, match="at least 1 host buffer"):
        add_activation_spill(acts, 0)


def test_derived_programs():
    p = _program()
    ev = eval_program(p)
    assert not any(a.startswith(("AO", "AW", "AR", "AF")) for a in ev.actions())
    verify_program(ev, "eval")
    cold = cold_backward_program(p)  # reads what its forward wrote
    assert "AR1" in cold.actions() and "AW1" not in cold.actions() and cold.activation_window == 2
    verify_program(cold, "backward")


def test_lowering_refuses():
    tier = dict(num_slots=6, persistent=tuple(range(6)))
    order = "F0 F1 AO1 AW1 F2 F3 F4 F5 B5 B4 B3 AR1 AF1 B2 B1 B0".split()
    lower_actions(order, _specs(), activation_window=1, **tier)
    with pytest.raises(ScheduleError, match=r"on the SSD; read them first \(AR1\)"):
        lower_actions([a for a in order if a != "AR1"], _specs(), activation_window=1, **tier)
    with pytest.raises(ScheduleError, match=r"stage 1's activations are in window buffer 0 already"):
        lower_actions([a for a in order if a != "AW1"], _specs(), activation_window=2, **tier)
    with pytest.raises(ScheduleError, match=r"keeps offloaded activations in host RAM \(activation_window=0\)"):
        lower_actions(order, _specs(), **tier)
    with pytest.raises(ScheduleError, match=r"all 1 activation window buffers are in use"):
        lower_actions("F0 F1 AO1 F2 AO2".split(), _specs(), activation_window=1, **tier)


# ---- the verifier's rule (12) -----------------------------------------------------------------------


def _without(p, action, dep):
    n = p.find(action)
    n.args = tuple(a for a in n.args if getattr(a, "name", None) != dep)
    return p


def test_verifier_names_a_missing_wait():
    with pytest.raises(VerificationError, match=r"AF1 \(#\d+\) does not wait for AR1 \(#\d+\): it would copy a buffer still being filled"):
        verify_program(_without(_program(), "AF1", "ar1"), "train")
    with pytest.raises(VerificationError, match=r"AR3 \(#\d+\) does not wait for AW3 .*still being written"):
        verify_program(_without(_program(), "AR3", "aw3"), "train")
    with pytest.raises(VerificationError, match=r"AO3 \(#\d+\) does not wait for AW1 .*before it is emptied"):
        verify_program(_without(_program(), "AO3", "aw1"), "train")
    with pytest.raises(VerificationError, match=r"AW1 \(#\d+\) does not wait for AO1"):
        verify_program(_without(_program(), "AW1", "ao1"), "train")


def test_verifier_names_a_buffer_clash():
    p = _program()
    ar = p.find("AR2")  # move AR2 into the buffer AR3 holds
    from dataclasses import replace

    from shfx.passes.meta import set_meta

    set_meta(ar, replace(get_meta(ar), buffer=get_meta(p.find("AR3")).buffer))
    with pytest.raises(VerificationError, match=r"AR2 .* fills activation window buffer \d while stage 3's activations still hold it"):
        verify_program(p, "train")


# ---- the ledger and the simulator -------------------------------------------------------------------------


def test_ledger_host_holds_the_window_the_ssd_the_activations():
    for n in (8, 16):
        specs = chain(n, prefetch_bytes=4000, activation_bytes=ACT)
        host = activation_offload_program(Stronghold(window=2).program(specs))
        ssd = activation_offload_program(Stronghold(window=2).program(specs), window=2)
        a, b = replay(host), replay(ssd)
        offloaded = a.static("host")["offloaded activations"]
        assert offloaded == (n - 3) * ACT  # every eligible stage's, in host RAM
        assert b.static("host")["offloaded activations"] == 2 * ACT  # two buffers, however many stages
        assert b.static("ssd") == {"offloaded activations": offloaded}
        assert a.peak() == b.peak()  # the device sees the same copies
    vals = offloaded_values(specs)
    assert window_buffer_bytes(specs, vals) == ACT
    assert spill_layout([*vals[1], *vals[2]]) == ({"s0:out": 0, "s1:out": 4096}, 4096 + ACT)


def test_simulator_puts_the_transfers_on_the_ssd_queues():
    from shfx.cost_model.costs import CostTable, Links, StageCost
    from shfx.cost_model.simulate import SimulationError, simulate

    specs = chain(8, prefetch_bytes=1000, activation_bytes=10**6)
    host = activation_offload_program(Stronghold(window=2).program(specs))
    ssd = activation_offload_program(Stronghold(window=2).program(specs), window=2)
    costs = lambda rate: CostTable([StageCost(0.01, 0.02, update_s=1e-3)] * 8, Links(1e9, 1e9, ssd_read_bps=rate, ssd_write_bps=rate))  # noqa: E731
    with pytest.raises(SimulationError, match=r"activations on the SSD, but links.ssd_read_bps is None"):
        simulate(ssd, CostTable([StageCost(0.01, 0.02)] * 8, Links(1e9, 1e9)))
    fast, slow = simulate(ssd, costs(1e9)), simulate(ssd, costs(2e7))
    assert fast.step_s == pytest.approx(simulate(host, costs(1e9)).step_s)  # a fast SSD hides behind compute
    assert slow.step_s > 2 * fast.step_s and slow.bottleneck == "ssd"  # 50 ms a stage: the SSD is the step
    aw = [e for e in fast.events if e.action.startswith("AW")]
    assert aw and all(e.stream == "ssd_write" for e in aw)


# ---- the runtime ------------------------------------------------------------------------------------------

SHAPE = GPTShape(vocab=64, seq=128, layers=4, heads=2, hidden=16, dropout=0.1)
STEPS = 3


def _batches(n: int = STEPS, batch: int = 2, seq: int = SHAPE.seq):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, SHAPE.vocab, (batch, seq), generator=g), torch.randint(0, SHAPE.vocab, (batch, seq), generator=g)) for _ in range(n)]


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(SHAPE)


def _compile(model, tmp_path, activations="nvme", **kw):
    offload = {"activations": activations} if activations != "device" else None
    if offload is not None and activations == "nvme":
        offload["path"] = str(tmp_path / "act")
    offload = {**(offload or {}), **kw.pop("offload", {})} or None
    return shfx.compile(model, device=shfx.EmulatedDevice(memory="1GiB", h2d=None, d2h=None), window=2,
                        optimizer=shfx.optim.AdamW(lr=1e-2), offload=shfx.Offload(**offload) if offload else None, **kw)  # fmt: skip


def _spilled(cm) -> int:
    return sum(get_meta(n).bytes for n in cm.program.nodes if get_meta(n).kind == ActionKind.ACTIVATION_WRITE)


def _window_bytes(cm) -> int:
    """The window's buffers as the program sizes them: the largest offloaded stage's, each."""
    stages = {get_meta(n).stage for n in cm.program.nodes if get_meta(n).kind == ActionKind.ACTIVATION_WRITE}
    return cm.program.activation_window * window_buffer_bytes(cm.program.stages, stages)


def test_trains_bitwise_with_eager_fp32(tmp_path):
    model = _model()
    ref = copy.deepcopy(model)
    batches = _batches()
    cm = _compile(model, tmp_path)
    try:
        losses = seeded_steps(cm, cm, batches)
        w = cm.engine.activation_window
        per_step = _spilled(cm)
        assert per_step > 0 and cm.program.count(ActionKind.ACTIVATION_READ) == cm.program.count(ActionKind.ACTIVATION_WRITE) > 2
        # the SSD moved every offloaded byte once each way per step, as the program says
        assert w.bytes_written == w.bytes_read == STEPS * per_step
        assert cm.program.bytes_moved()["ssd_write"] == per_step
        # host memory: the window, never more than its buffers held, nothing in the per-value stash
        led = cm.variant.ledger()
        window = led.static("host")["offloaded activations"]
        assert w.host_bytes == window == _window_bytes(cm) and cm.program.activation_window == ACTIVATION_WINDOW
        assert 1 <= w.peak_held <= ACTIVATION_WINDOW and w.held() == 0
        assert cm.engine.activation_stash.allocated_bytes == 0
        assert led.static("ssd")["offloaded activations"] == per_step < window * 3
        assert cm.engine.host_bytes() == sum(led.static("host").values())
        # the trace has the transfers, with their bytes
        traced = [e for e in cm.engine.trace if e.action.startswith(("AW", "AR"))]
        assert sum(e.bytes for e in traced if e.action.startswith("AW")) == per_step
        cm.sync()
    finally:
        cm.close()
    ref_losses = seeded_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True), batches)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    for (k, p), (_, q) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(p, q), k


class _MixedEager:
    """Eager PyTorch's bf16 recipe (tests/mixed_reference.py, seeded once here): a 16-bit working
    copy runs forward and backward, fused AdamW updates the fp32 master, the copy is refreshed."""

    def __init__(self, master: torch.nn.Module):
        from mixed_reference import make_working_copy

        self.work = make_working_copy(master, torch.bfloat16)
        self.pairs = list(zip(master.parameters(), self.work.parameters()))
        self.opt = torch.optim.AdamW(master.parameters(), lr=1e-2, fused=True)

    def __call__(self, x, y):
        return self.work(x, y)

    def step(self):
        for m, w in self.pairs:
            m.grad, w.grad = w.grad.float(), None
        self.opt.step()
        with torch.no_grad():
            for m, w in self.pairs:
                w.copy_(m)

    def zero_grad(self):
        self.opt.zero_grad()


def test_trains_bitwise_with_eager_bf16(tmp_path):
    model = _model()
    ref = copy.deepcopy(model)
    batches = _batches()
    cm = _compile(model, tmp_path, precision="bf16")
    try:
        losses = seeded_steps(cm, cm, batches)
        assert cm.engine.activation_window.bytes_read == STEPS * _spilled(cm)
        cm.sync()
    finally:
        cm.close()
    eager = _MixedEager(ref)
    ref_losses = seeded_steps(eager, eager, batches)
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(losses, ref_losses))
    for (k, p), (_, q) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(p, q), k


# (the parameter tier holds the optimizer states on the SSD too; the optimizer tier alone, ~5 s, runs with SHFX_SLOW=1)
@pytest.mark.parametrize("tier", [pytest.param("optimizer", marks=pytest.mark.slow), "params"])
def test_with_the_nvme_tiers(tmp_path, tier):
    """With the optimizer states (or the parameter tier) on the SSD too: the activations share
    the tier's SSD queues, in issue order; training is the all-in-RAM run's, bitwise."""
    extra = {"optimizer": "nvme", "host_window": 1} if tier == "optimizer" else {
        "params": "nvme", "gradients": "nvme", "optimizer": "nvme", "host_window": 1}  # fmt: skip
    batches = _batches(2)
    runs = []
    for acts in ("device", "nvme"):
        model = _model()
        off = {"path": str(tmp_path / acts), **extra}
        cm = _compile(model, tmp_path, acts, offload=off)
        try:
            losses = seeded_steps(cm, cm, batches)
            if acts == "nvme":
                assert cm.engine.ssd is not None and cm.engine.activation_window.bytes_read == 2 * _spilled(cm) > 0
                assert cm.engine.activation_window._streams is None  # (the tier's queues, not its own)
            runs.append((losses, {k: v.clone() for k, v in cm.state_dict().items()}))
        finally:
            cm.close()
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


def test_a_failing_read_names_its_action_and_holds_no_buffer(tmp_path, monkeypatch):
    from shfx.errors import ActionError

    model = _model()
    ref = copy.deepcopy(model)
    batches = _batches(2)
    # (rollback: the updates the backward ran before the read failed are undone)
    cm = _compile(model, tmp_path, rollback=True)
    cm_ref = _compile(ref, tmp_path, "device", rollback=True)
    try:
        for c in (cm, cm_ref):
            seeded_steps(c, c, batches[:1])
        fail_nth_ssd_read(monkeypatch, 2)
        loss = cm(*batches[1])
        with pytest.raises(ActionError, match=r"AR\d+") as e:
            loss.backward()
        assert e.value.action.startswith("AR")
        monkeypatch.undo()
        assert cm.engine.activation_window.held() == 0  # every window buffer free again
        cm.zero_grad()
        # the failed backward changed no weight: the next step is the reference's
        for c in (cm, cm_ref):
            seeded_steps(c, c, batches[1:], seed=3)
        sd, ref_sd = cm.state_dict(), cm_ref.state_dict()
        assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)
    finally:
        cm.close()
        cm_ref.close()


def test_a_second_forward_before_the_backward_is_refused_at_its_read(tmp_path):
    from shfx.errors import ActionError

    cm = _compile(_model(), tmp_path, grad_accum_steps=2)
    try:
        (x, y), (x2, y2) = _batches(2)
        l1 = cm(x, y)
        with torch.no_grad():  # an inference forward writes nothing to the SSD: the backward still runs
            cm(x2, y2)
        l1.backward()
        l1, l2 = cm(x, y), cm(x2, y2)  # the second overwrote the first's activations on the SSD
        with pytest.raises(ActionError, match=r"overwritten by a later forward's.*run its backward before the next forward"):
            l1.backward()
        assert cm.engine.activation_window.held() == 0
    finally:
        cm.close()


def test_a_new_input_shape_gets_its_own_extents(tmp_path):
    cm = _compile(_model(), tmp_path, dynamic=False)
    try:
        for seq in (64, 128):
            x, y = _batches(1, seq=seq)[0]
            cm(x, y).backward()
            cm.step()
            cm.zero_grad()
        w = cm.engine.activation_window
        assert len(w._stores) == 2 and w.held() == 0
        assert w.host_bytes == _window_bytes(cm)
    finally:
        cm.close()


def test_cuda_like_streams_bitwise(tmp_path):
    """The emulated device's CUDA-like mode (copies queued on stream queues, launched where
    issued): the window's waits hold across the host-side SSD queues."""
    model = _model()
    ref = copy.deepcopy(model)
    batches = _batches(2)
    device = shfx.EmulatedDevice(memory="1GiB", h2d="1GB/s", d2h="1GB/s", cuda_like=True)
    cm = shfx.compile(model, device=device, window=2, optimizer=shfx.optim.AdamW(lr=1e-2),
                      offload=shfx.Offload(activations="nvme", path=str(tmp_path), nvme_read="200MB/s", nvme_write="200MB/s"))  # fmt: skip
    try:
        losses = seeded_steps(cm, cm, batches)
        cm.sync()
    finally:
        cm.close()
    ref_losses = seeded_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True), batches)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))


def test_the_option_and_its_refusals(tmp_path):
    with pytest.raises(ValueError, match=r"activations='nvme'\) needs a path"):
        shfx.Offload(activations="nvme")
    with pytest.raises(ValueError, match="activation_window .* needs activations='nvme'"):
        shfx.Offload(activations="host", activation_window=2)
    with pytest.raises(ValueError, match="activation_window must be an int >= 1"):
        shfx.Offload(activations="nvme", path=str(tmp_path), activation_window=0)
    with pytest.raises(ValueError, match="only the activations are on it"):
        shfx.Offload(activations="nvme", path=str(tmp_path), host_window=2)
    off = shfx.Offload(activations="nvme", path=str(tmp_path), activation_window=3)
    assert not off.uses_nvme and "activations on NVMe through 3 host buffers" in str(off)
    cm = _compile(_model(), tmp_path, offload={"activation_window": 3})
    try:
        assert cm.config.pipeline_options().activations == "nvme"
        x, y = _batches(1)[0]
        cm(x, y).backward()
        cm.step()
        assert cm.program.activation_window == 3 and cm.engine.activation_window.peak_held <= 3
    finally:
        cm.close()
    import dataclasses

    from shfx.config import Config, check_supported

    c = Config.from_args(device="emulated", optimizer=shfx.optim.AdamW(lr=1e-2), offload=off)  # (no process group needed)
    with pytest.raises(shfx.UsageError, match=r"activations='nvme'.*not run yet with data_parallel"):
        check_supported(dataclasses.replace(c, data_parallel=shfx.DataParallel()))


@pytest.mark.slow  # (window="auto" profiles: ~20 s)
def test_window_auto_simulates_the_ssd(tmp_path):
    """The tuner simulates each window's program with its AW/AR on the SSD at the spec's rates
    (it needs them: without, the simulator refuses a program with SSD transfers)."""
    x, y = _batches(1)[0]
    cm = shfx.compile(_model(), device=shfx.EmulatedDevice(memory="1GiB", h2d="100MB/s", d2h="100MB/s"), window="auto",
                      optimizer=shfx.optim.AdamW(lr=1e-2),
                      offload=shfx.Offload(activations="nvme", path=str(tmp_path), nvme_read="50MB/s", nvme_write="50MB/s"))  # fmt: skip
    try:
        cm(x, y).backward()
        cm.step()
        assert cm.program.count(ActionKind.ACTIVATION_WRITE) > 0
    finally:
        cm.close()
