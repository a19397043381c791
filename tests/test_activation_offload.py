"""Activation offload (``shfx.Offload(activations=...)``, issue 26 part 2): a stage's boundary
activations leave the device after its forward (``AO g``, d2h) and come back before its
backward (``AF g``, h2d). Golden programs, the verifier's rule, the ledger, and the runtime on
the emulated device: refused without offload, bitwise equal to eager PyTorch with it."""

from __future__ import annotations

import pytest

from shfx.passes.activations import add_activation_offload, eligible_stages, offloaded_values
from shfx.passes.features import ACTIVATION_OFFLOAD, PassRefused, activation_offload_program
from shfx.passes.ledger import replay
from shfx.passes.meta import get_meta
from shfx.passes.policies import Resident, Stronghold, ZeroOffload
from shfx.passes.program import ActionKind, ScheduleError, lower_actions
from shfx.passes.stages import chain
from shfx.passes.verify import VerificationError, verify_program

ACT = 1000


def _specs(n: int = 5):
    return chain(n, prefetch_bytes=4000, activation_bytes=ACT)


# ---- the program ------------------------------------------------------------------------------------


def test_golden_stronghold():
    p = activation_offload_program(Stronghold(window=2).program(_specs()))
    assert " ".join(p.actions()) == (
        "PF0 PF1 F0 R0 PF2 F1 R1 PF3 AO1 F2 R2 PF4 AO2 F3 F4 "
        "B4 OG4 U4 R4 PF2 AF2 B3 OG3 U3 R3 PF1 AF1 B2 OG2 U2 R2 PF0 B1 OG1 U1 R1 B0 OG0 U0 R0"
    )
    verify_program(p, "train")
    # the second forward after it waits for the offload; the fetch waits for the offload and the
    # backward two places before its own; the backward waits for the fetch
    assert "ao1" in [d.name for d in p.deps(p.find("F3"))] and "ao1" not in [d.name for d in p.deps(p.find("F2"))]
    assert [d.name for d in p.deps(p.find("AF1"))] == ["ao1", "b3"]
    assert "af1" in [d.name for d in p.deps(p.find("B1"))]
    assert get_meta(p.find("AO1")).bytes == get_meta(p.find("AF1")).bytes == ACT
    assert get_meta(p.find("AO1")).stream == "d2h" and get_meta(p.find("AF1")).stream == "h2d"
    assert p.bytes_moved()["d2h"] - Stronghold(window=2).program(_specs()).bytes_moved()["d2h"] == 2 * ACT


def test_golden_zero_offload_and_explicit_stages():
    p = activation_offload_program(ZeroOffload().program(_specs(6)), stages=(2,))
    assert " ".join(p.actions()) == "F0 F1 F2 AO2 F3 F4 F5 B5 OG5 B4 OG4 AF2 B3 OG3 B2 OG2 B1 OG1 B0 OG0 U0 U1 U2 U3 U4 U5 PF0 PF1 PF2 PF3 PF4 PF5"
    verify_program(p, "train")


def test_eligible_stages_keep_the_first_backwards():
    acts = [get_meta(n).action for n in Resident().program(_specs(5)).nodes]
    assert eligible_stages(acts, _specs(5)) == [1, 2]  # stage 0 reads no boundary value; 3, 4 come back first
    assert sorted(offloaded_values(_specs(5))) == [1, 2, 3, 4]
    with pytest.raises(ScheduleError, match=r"stages \[3\] cannot offload"):
        add_activation_offload(acts, _specs(5), [3])


def test_the_pass_runs_once():
    p = ACTIVATION_OFFLOAD(Resident().program(_specs()))
    with pytest.raises(PassRefused, match="offloads activations already"):
        ACTIVATION_OFFLOAD(p)


def test_derived_programs():
    from shfx.passes.schedule import cold_backward_program, eval_program

    p = activation_offload_program(Stronghold(window=2).program(_specs()))
    ev = eval_program(p)
    assert not any(a.startswith(("AO", "AF")) for a in ev.actions())  # an inference forward keeps nothing
    cold = cold_backward_program(p)
    assert "AF1" in cold.actions() and "AO1" not in cold.actions()
    verify_program(cold, "backward")


# ---- the verifier's rule ------------------------------------------------------------------------------


def test_verifier_rejects_a_backward_without_its_fetch():
    good = "F0 F1 AO1 F2 F3 F4 B4 DU4 B3 DU3 AF1 B2 DU2 B1 DU1 B0 DU0"
    p = lower_actions(good.split(), _specs(), num_slots=5, persistent=(0, 1, 2, 3, 4))
    verify_program(p, "train")
    # lowering refuses it ...
    with pytest.raises(ScheduleError, match=r"on the host \(AO1\); fetch them first \(AF1\)"):
        lower_actions(good.replace("AF1 ", "").split(), _specs(), num_slots=5, persistent=(0, 1, 2, 3, 4))
    # ... and the verifier catches a hand-edited graph: B1 no longer waits for AF1
    b1 = p.find("B1")
    b1.args = tuple(a for a in b1.args if getattr(a, "name", None) != "af1")
    with pytest.raises(VerificationError, match=r"B1 \(#\d+\) does not wait for AF1"):
        verify_program(p, "train")


def test_verifier_rejects_an_offload_never_fetched():
    good = "F0 F1 AO1 F2 F3 F4 B4 DU4 B3 DU3 AF1 B2 DU2 B1 DU1 B0 DU0"
    p = lower_actions(good.split(), _specs(), num_slots=5, persistent=(0, 1, 2, 3, 4))
    b1 = p.find("B1")
    af1 = p.find("AF1")
    b1.args = tuple(a for a in b1.args if a is not af1)
    p.graph.erase_node(af1)
    with pytest.raises(VerificationError, match=r"on the host: no AF1 before it fetched them"):
        verify_program(p, "train")


# ---- the ledger ------------------------------------------------------------------------------------------


def test_ledger_counts_only_the_activations_in_flight():
    specs = chain(8, prefetch_bytes=4000, activation_bytes=ACT)
    base = Resident().program(specs)
    off = activation_offload_program(base)
    a, b = replay(base), replay(off)
    acts_a = a.terms_at_peak()["activations (checkpoints)"]
    acts_b = b.terms_at_peak()["activations (checkpoints)"]
    assert acts_a == 8 * ACT  # every stage's output until the backward
    assert acts_b <= 5 * ACT  # the in-flight stages only
    assert a.peak() - b.peak() == acts_a - acts_b
    host = b.static("host").get("offloaded activations", 0)
    assert host == len(eligible_stages([get_meta(n).action for n in base.nodes], specs)) * ACT


# ---- the runtime: refused without offload, bitwise with it ------------------------------------------------

import copy  # noqa: E402

import torch  # noqa: E402

import shfx  # noqa: E402
from shfx.models import GPT, GPTShape  # noqa: E402
from zoo import seeded_steps  # noqa: E402

SHAPE = GPTShape(vocab=64, seq=512, layers=6, heads=2, hidden=16, dropout=0.1)
BATCH = 4
STEPS = 3


def _long_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(SHAPE)


def _batches(n: int):
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randint(0, SHAPE.vocab, (BATCH, SHAPE.seq), generator=g), torch.randint(0, SHAPE.vocab, (BATCH, SHAPE.seq), generator=g))
        for _ in range(n)
    ]


def _compile(model, memory, activations="device", **link):
    offload = shfx.Offload(activations=activations) if activations != "device" else None
    device = shfx.EmulatedDevice(memory=memory, **(link or {"h2d": None, "d2h": None}))
    return shfx.compile(model, device=device, window=2, optimizer=shfx.optim.AdamW(lr=1e-2), offload=offload)


@pytest.fixture(scope="module")
def peaks():
    """Device peaks (the memory ledger's) of one step with and without activation offload, on an
    unbounded device."""
    out = {}
    x, y = _batches(1)[0]
    for acts in ("device", "host"):
        cm = _compile(_long_gpt(), "8GiB", acts)
        cm(x, y)  # (the forward builds the variant; no step needed)
        led = cm.variant.ledger()
        out[acts] = (led.peak(), led.terms_at_peak()["activations (checkpoints)"], led.static("host").get("offloaded activations", 0))
        cm.close()
    return out


def test_offload_cuts_the_device_peak(peaks):
    (dev, dev_acts, _), (off, off_acts, host) = peaks["device"], peaks["host"]
    assert off < dev and off_acts < dev_acts / 2
    assert host > 0


def test_refused_without_offload_trains_bitwise_with_it(peaks):
    cap = (peaks["device"][0] + peaks["host"][0]) // 2  # between the in-flight and all activations
    x, y = _batches(1)[0]
    cm = _compile(_long_gpt(), cap)
    with pytest.raises(shfx.OutOfDeviceMemory, match=r"activations='host'"):
        cm(x, y)
    assert cm.backend.used_bytes == 0  # refused before anything of the step was allocated
    cm.close()

    batches = _batches(STEPS)
    model = _long_gpt()
    ref = copy.deepcopy(model)
    cm = _compile(model, cap, "host")
    losses = seeded_steps(cm, cm, batches)
    assert cm.backend.peak_bytes <= cap
    assert any(a.startswith("AO") for a in cm.variant.train.actions())
    cm.sync()
    ref_losses = seeded_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True), batches)
    for a, b in zip(losses, ref_losses):
        assert torch.equal(a, b)
    for (k, p), (_, q) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(p, q), k
    cm.close()


def test_runtime_reservations_are_the_ledger():
    """The runtime's device reservations, action by action, are the ledger's (AO frees, AF puts
    back), and its host buffers are the ledger's ``offloaded activations``."""
    from test_ledger import _by_event, _compare

    x, y = _batches(1)[0]
    cm = _compile(_long_gpt(), "8GiB", "host")
    try:
        with cm.backend.recording() as log:
            cm(x, y).backward()
            cm.step()
        led = cm.variant.ledger()
        runtime = _by_event((e.event, e.term, e.what, e.nbytes) for e in log)
        ledger = _by_event((e.event, c.term, c.what, c.nbytes) for e in led.entries for c in e.changes if c.tier == "device")
        _compare(runtime, {k: v for k, v in ledger.items() if v}, "activation offload")
        assert any(k.startswith("AF") for k in runtime)  # (an AO reserves nothing: the F waiting for it frees)
        assert cm.engine.host_bytes() == sum(led.static("host").values())
    finally:
        cm.close()


# ---- the simulator against the emulated device --------------------------------------------------------------

SIM_SHAPE = GPTShape(vocab=64, seq=512, layers=6, heads=2, hidden=16, dropout=0.0)


def _measured_and_predicted(bw: float, steps: int = 6, profiled: bool = False) -> tuple[float, float, float]:
    """Median measured step time of ``steps`` steps with activation offload on an emulated device
    whose links move ``bw`` bytes/s, and the simulator's step time of the same program with the
    links at ``bw`` and each stage's compute as it ran in those steps (its median duration in the
    runtime's own trace, with the measured hand-offs: :func:`~shfx.cost_model.trace.in_situ_costs`):
    the copies, AO/AF included, are the simulator's to place and time. With ``profiled`` the
    costs are instead profiled on the backend after the steps (``shfx.profiler.profile_costs``,
    as ``window="auto"`` does; fresh, not from the process's cache). Returns (measured, predicted, link share: the
    busier link's bytes over its rate, over the measured step)."""
    import dataclasses
    import statistics

    from shfx.cost_model.costs import CostTable, Links, StageCost
    from shfx.cost_model.simulate import simulate
    from shfx.cost_model.trace import in_situ_costs

    torch.manual_seed(0)
    cm = _compile(GPT(SIM_SHAPE), "8GiB", "host", h2d=bw, d2h=bw)
    g = torch.Generator().manual_seed(3)
    traces = []
    try:
        for i in range(steps + 1):
            x = torch.randint(0, SIM_SHAPE.vocab, (2, SIM_SHAPE.seq), generator=g)
            cm(x, x).backward()
            cm.step()
            cm.zero_grad()
            if i:  # (the first step captures and allocates)
                t0, t1 = cm.engine.last_step_window
                traces.append((t0, t1, list(cm.engine.trace)))
        program = cm.program
        assert program.count(ActionKind.OFFLOAD_ACTIVATIONS) >= 4
        n = len(program.stages)
        base = CostTable([StageCost(0.0, 0.0, update_s=1e-3)] * n, Links(bw, bw))
        costs = in_situ_costs(program, base, traces, overheads=True)
        # (the links at their configured rate, with the per-copy hand-off the steps showed)
        links = dataclasses.replace(costs.links, h2d_bps=bw, d2h_bps=bw, duplex=cm.backend.spec.duplex)
        costs = CostTable(costs.costs, links, source="in situ compute and hand-offs, configured link rates")
        if profiled:
            from shfx.profiler import profile_costs

            costs = profile_costs(cm.engine, cm.variant, [x, x], cache=False)
        predicted = simulate(program, costs).step_s
        measured = statistics.median(t1 - t0 for t0, t1, _ in traces)
        moved = program.bytes_moved()
        # (the copies' share of the quietest step: other load on the machine stretches compute,
        # not the throttled copies, and would shrink a share of the median step)
        quietest = min(t1 - t0 for t0, t1, _ in traces)
        return measured, predicted, max(moved["h2d"], moved["d2h"]) / bw / quietest
    finally:
        cm.close()


@pytest.fixture(scope="module")
def _one_thread():
    """On a shared 2-core machine another process holding a core makes 2-thread OpenMP compute
    several times slower (benchmarks/README.md); the test's compute is small anyway."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("bw", [1e6, 2e6], ids=["1MB/s", "2MB/s"])
def test_simulator_predicts_the_step_with_offload(bw, _one_thread):
    measured, predicted, link_share = _measured_and_predicted(bw)
    assert link_share > 0.4  # the copies (the offloads among them) are much of the step
    assert predicted == pytest.approx(measured, rel=0.10), (measured, predicted)


@pytest.mark.slow  # (two profiles: ~40 s)
@pytest.mark.parametrize("bw", [1e6, 2e6], ids=["1MB/s", "2MB/s"])
def test_simulator_predicts_the_step_with_offload_from_a_profile(bw, _one_thread):
    measured, predicted, _ = _measured_and_predicted(bw, profiled=True)
    assert predicted == pytest.approx(measured, rel=0.10), (measured, predicted)


# ---- "auto": the stages chosen from the costs -------------------------------------------------------------


def test_auto_takes_the_hidden_stages_first():
    from shfx.cost_model.costs import CostTable, Links, StageCost
    from shfx.cost_model.offload_choice import choose_activation_offload, exposed_copy_s

    specs = chain(8, prefetch_bytes=100, activation_bytes=10**6)
    p = Resident().program(specs)
    # a copy takes 10 ms; only stage 4's forward and backward (20 and 40 ms) cover stage 3's copies
    costs = CostTable([StageCost(0.02, 0.04) if i == 4 else StageCost(0.005, 0.01) for i in range(8)], Links(1e8, 1e8))
    assert exposed_copy_s(p, costs, 3) == 0.0 and exposed_copy_s(p, costs, 2) == pytest.approx(0.005 + 0.0)
    peak = replay(p).peak()
    assert choose_activation_offload(p, costs, peak) == ()  # it fits: nothing offloaded
    assert choose_activation_offload(p, costs, peak - 10**6) == (3,)
    assert len(choose_activation_offload(p, costs, peak - 2 * 10**6)) == 2
    everything = choose_activation_offload(p, costs, 0)  # nothing fits: every eligible stage
    assert everything == tuple(eligible_stages([get_meta(n).action for n in p.nodes], specs))


@pytest.mark.slow  # (the profile behind the choice: ~2 min on 2 loaded cores)
def test_auto_offloads_what_the_budget_needs(peaks):
    cap = (peaks["device"][0] + peaks["host"][0]) // 2
    x, y = _batches(1)[0]
    cm = _compile(_long_gpt(), cap, "auto")
    try:
        cm(x, y).backward()
        cm.step()
        chosen = [get_meta(n).stage for n in cm.program.nodes if get_meta(n).kind == ActionKind.OFFLOAD_ACTIVATIONS]
        eligible = eligible_stages([get_meta(n).action for n in cm.program.nodes], cm.program.stages)
        assert chosen and set(chosen) <= set(eligible)
        assert cm.variant.ledger().peak() <= cap and cm.backend.peak_bytes <= cap
    finally:
        cm.close()


def test_auto_with_room_offloads_nothing():
    x, y = _batches(1)[0]
    cm = _compile(_long_gpt(), "8GiB", "auto")  # room for everything: nothing offloaded (and nothing profiled)
    try:
        cm(x, y).backward()
        cm.step()
        assert cm.program.count(ActionKind.OFFLOAD_ACTIVATIONS) == 0
    finally:
        cm.close()


def test_nvme_activations_need_a_path():
    """``"nvme"`` runs (tests/test_activation_nvme.py); it needs the directory of its SSD file."""
    with pytest.raises(ValueError, match=r"activations='nvme'\) needs a path"):
        _compile(_long_gpt(), "8GiB", "nvme")


def test_cuda_like_streams_bitwise():
    """The emulated device's CUDA-like mode (copies enqueued on stream queues, launched where
    issued, as on a GPU): the offload's cross-stream waits hold, and training stays bitwise."""
    batches = _batches(2)
    model = _long_gpt()
    ref = copy.deepcopy(model)
    device = shfx.EmulatedDevice(memory="8GiB", h2d="1GB/s", d2h="1GB/s", cuda_like=True)
    cm = shfx.compile(model, device=device, window=2, optimizer=shfx.optim.AdamW(lr=1e-2), offload=shfx.Offload(activations="host"))
    torch.manual_seed(5)
    losses = []
    for x, y in batches:
        loss = cm(x, y)
        loss.backward()
        cm.step()
        cm.zero_grad()
        losses.append(loss.detach().clone())
    assert cm.program.count(ActionKind.OFFLOAD_ACTIVATIONS) > 0
    cm.sync()
    cm.close()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    torch.manual_seed(5)
    for (x, y), got in zip(batches, losses):
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert torch.equal(loss, got)
    for (k, p), (_, q) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(p, q), k


def test_the_option():
    off = shfx.Offload(activations="host")  # valid without a path: nothing goes to the SSD
    assert not off.uses_nvme and str(off) == "Offload(host, activations on the host)"
    with pytest.raises(ValueError, match="activations must be 'device', 'host', 'nvme' or 'auto'"):
        shfx.Offload(activations="ssd")
    cm = _compile(_long_gpt(), "8GiB", "host")
    try:
        assert cm.config.pipeline_options().activations == "host"
    finally:
        cm.close()


@pytest.mark.slow  # (window="auto" profiles: ~70 s on 2 loaded cores)
def test_window_auto_profiles_with_offload(peaks):
    """The tuner's probe programs offload as the training does: without it the window-1 probe
    overflows the budget the offloaded training fits."""
    cap = (peaks["device"][0] + peaks["host"][0]) // 2
    x, y = _batches(1)[0]
    device = shfx.EmulatedDevice(memory=cap, h2d=None, d2h=None)
    cm = shfx.compile(_long_gpt(), device=device, window="auto", optimizer=shfx.optim.AdamW(lr=1e-2),
                      offload=shfx.Offload(activations="host"))  # fmt: skip
    try:
        cm(x, y).backward()
        cm.step()
        assert cm.program.count(ActionKind.OFFLOAD_ACTIVATIONS) > 0 and cm.backend.peak_bytes <= cap
    finally:
        cm.close()


# ---- with the other features: the same run with and without offload, bitwise ------------------------------

SMALL = GPTShape(vocab=64, seq=64, layers=4, heads=2, hidden=16, dropout=0.1)
COMBOS = {
    "clipping": {"max_grad_norm": 0.5},
    "accumulation": {"grad_accum_steps": 2},
    "bf16": {"precision": "bf16"},
    "zero-offload": {"policy": "zero-offload"},
    "steps-in-step": {"overlap_update": False, "rollback": True},
}


# (the fast run keeps clipping and bf16; the others, ~30 s together, run with SHFX_SLOW=1)
@pytest.mark.parametrize("name", [n if n in ("clipping", "bf16") else pytest.param(n, marks=pytest.mark.slow) for n in COMBOS])
def test_offload_changes_nothing_with_other_features(name):
    kw = dict(COMBOS[name])
    accum = kw.get("grad_accum_steps", 1)
    if "policy" not in kw:
        kw["window"] = 2
    g = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, SMALL.vocab, (2, SMALL.seq), generator=g) for _ in range(2 * accum)]
    states, losses = [], []
    for acts in ("device", "host"):
        torch.manual_seed(0)
        model = GPT(SMALL)
        offload = shfx.Offload(activations=acts) if acts != "device" else None
        cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="1GiB"), optimizer=shfx.optim.AdamW(lr=1e-2),
                          offload=offload, **kw)  # fmt: skip
        torch.manual_seed(1)
        got = []
        for i, x in enumerate(batches):
            loss = cm(x, x)
            loss.backward()
            got.append(loss.detach().float())
            if (i + 1) % accum == 0:
                cm.step()
                cm.zero_grad()
        if acts == "host":
            assert cm.program.count(ActionKind.OFFLOAD_ACTIVATIONS) > 0, cm.program.actions()
        cm.sync()
        cm.close()
        losses.append(torch.stack(got))
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    assert torch.equal(losses[0], losses[1])
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


def test_two_forwards_then_one_backward():
    """The first forward's backward runs cold (another forward came between): its cold program
    fetches what that forward offloaded, from host buffers the second forward did not take."""
    shape = GPTShape(vocab=64, seq=64, layers=4, heads=2, hidden=16, dropout=0.0)
    g = torch.Generator().manual_seed(11)
    xs = [torch.randint(0, 64, (2, 64), generator=g) for _ in range(2)]
    res = []
    for acts in ("device", "host"):
        torch.manual_seed(0)
        model = GPT(shape)
        cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="1GiB"), window=2, optimizer=shfx.optim.AdamW(lr=1e-2),
                          grad_accum_steps=2, offload=shfx.Offload(activations=acts) if acts != "device" else None)  # fmt: skip
        l1, l2 = cm(xs[0], xs[0]), cm(xs[1], xs[1])
        (l1 + l2).backward()
        cm.step()
        cm.zero_grad()
        cm.sync()
        cm.close()
        res.append((torch.stack([l1.detach(), l2.detach()]), {k: v.clone() for k, v in model.state_dict().items()}))
    assert torch.equal(res[0][0], res[1][0])
    assert all(torch.equal(res[0][1][k], res[1][1][k]) for k in res[0][1])


@pytest.mark.slow  # (2 spawned ranks: ~1 min)
def test_two_ranks_with_offload_match_ddp_bitwise(tmp_path):
    """Data parallel with activation offload: 2 ranks against eager DDP, bitwise (the harness of
    tests/test_data_parallel.py)."""
    from test_data_parallel import _check_ddp_results, _spawn

    configs = [dict(name="gpt_tied", window=2, offload=shfx.Offload(activations="host"))]
    results = _spawn(tmp_path, 2, "ddp", timeout_s=240, configs=configs)
    _check_ddp_results(results, configs, 2)


def test_profile_cache_tells_slow_links_apart():
    """Found measuring the offload's step time at 1 and 2 MB/s: the profile cache keyed an
    emulated device by its description, which rounds both to '0.00 GB/s'."""
    from types import SimpleNamespace

    from shfx.profiler import _cache_key
    from shfx.runtime.emulated import EmulatedBackend

    variant = SimpleNamespace(signature="sig", graph=SimpleNamespace(stages=[0, 1]), captured=SimpleNamespace(gm=SimpleNamespace(code="c")))
    keys = []
    for bw in ("1MB/s", "2MB/s"):
        b = EmulatedBackend(shfx.EmulatedDevice(memory="1GiB", h2d=bw, d2h=bw))
        keys.append(_cache_key(SimpleNamespace(backend=b), variant))
        b.close()
    assert keys[0] != keys[1]
