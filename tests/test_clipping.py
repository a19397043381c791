"""Exact global-norm gradient clipping (``shfx.compile(max_grad_norm=...)``,
``cm.clip_grad_norm_``): equal to eager ``torch.nn.utils.clip_grad_norm_`` followed by
``torch.optim.AdamW(fused=True)``, bitwise on the CPU (norms, losses, final state); the
deferred-update schedule (norms during backward, updates in the next forward) as a program the
verifier checks and the simulator times across the step boundary."""

from __future__ import annotations

import copy

import pytest
import torch
from zoo import ZOO, gpt_tied, loss_of, token_batch

import shfx
from shfx.cost_model.costs import CostTable, Links, StageCost
from shfx.cost_model.simulate import GRAD_NORM_RATIO, simulate
from shfx.errors import UsageError
from shfx.passes.meta import get_meta
from shfx.passes.policies import Stronghold, ZeroInfinity, ZeroOffload
from shfx.passes.program import ScheduleError, lower_actions
from shfx.passes.schedule import cold_backward_program, data_parallel_program, steady_state_program
from shfx.passes.stages import chain
from shfx.passes.verify import VerificationError, step_boundary, verify_program

ALWAYS, NEVER = 1e-3, 1e6  # max norms above and below every step's gradient norm


def _device():
    return shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None)


def run_clipped(name, window, max_norm, *, steps=3, accum=1, api="compile", norm_type=2.0, **kw):
    """Train both ways with clipping; returns (norms, eager norms, losses, eager losses, cm, model, ref)."""
    make_model, make_batch = ZOO[name] if isinstance(name, str) else name
    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model)
    cm = shfx.compile(
        model, device=_device(), window=window, optimizer=shfx.optim.AdamW(lr=1e-2, weight_decay=0.01),
        grad_accum_steps=accum, max_grad_norm=max_norm if api in ("compile", "both") else None, norm_type=norm_type, **kw,
    )  # fmt: skip
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    norms, ref_norms, losses, ref_losses = [], [], [], []
    for step in range(steps):
        for micro in range(accum):
            args, kwargs, aux = make_batch(step, micro)
            torch.manual_seed(10_000 + 100 * step + micro)
            loss = loss_of(cm(*args, **kwargs), aux) / accum
            loss.backward()
            losses.append(loss.item())
            torch.manual_seed(10_000 + 100 * step + micro)
            ref_loss = loss_of(ref(*args, **kwargs), aux) / accum
            ref_loss.backward()
            ref_losses.append(ref_loss.item())
        total = cm.clip_grad_norm_(max_norm, norm_type) if api in ("torch", "both") else None
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type))
        cm.step()
        norms.append(cm.last_grad_norm)
        if total is not None:
            assert torch.equal(total, cm.last_grad_norm)
        cm.zero_grad()
        opt.step()
        opt.zero_grad()
    return norms, ref_norms, losses, ref_losses, cm, model, ref


def assert_bitwise(model, ref):
    sd, rsd = model.state_dict(), ref.state_dict()
    assert sd.keys() == rsd.keys()
    for k in sd:
        assert torch.equal(sd[k], rsd[k]), f"{k} differs from eager"


def check(name, window, max_norm, **kw):
    norms, ref_norms, losses, ref_losses, cm, model, ref = run_clipped(name, window, max_norm, **kw)
    assert losses == ref_losses
    for n, r in zip(norms, ref_norms):
        assert n.dtype == r.dtype and n.shape == r.shape and torch.equal(n, r)
    clipped = [bool(r > max_norm) for r in ref_norms]
    assert all(clipped) if max_norm == ALWAYS else not any(clipped)  # the regime the test is about
    cm.sync()
    assert_bitwise(model, ref)
    return cm


def _grid() -> list:
    """Every zoo model x windows 1, 2, all x norm above / below the threshold; the fast subset
    (every model at window 2 clipped, gpt_tied at every window and unclipped) runs by default,
    the rest with SHFX_SLOW=1."""
    out = []
    for name in sorted(ZOO):
        for window in (1, 2, 99):
            for max_norm in (ALWAYS, NEVER):
                fast = (window == 2 and max_norm == ALWAYS) or (name == "gpt_tied" and (max_norm == ALWAYS or window == 2))
                out.append(pytest.param(name, window, max_norm, marks=() if fast else pytest.mark.slow))
    return out


@pytest.mark.parametrize("name,window,max_norm", _grid())
def test_clipped_training_is_eager_clip_then_fused_adamw(name, window, max_norm):
    cm = check(name, window, max_norm)
    assert any(get_meta(n).phase == "next-forward" for n in cm.program.nodes), "the deferred schedule ran"
    cm.close()


@pytest.mark.parametrize("window", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_clipping_with_gradient_accumulation(window):
    check("gpt_dropout", window, ALWAYS, accum=3).close()


def test_clipping_with_gradient_accumulation_without_overlap():
    check("gpt_tied", 2, ALWAYS, accum=2, overlap_update=False).close()


# It was quarantined to the slow run as "a race in cm.clip_grad_norm_ with the deferred update"
# (weights differing about one run in three under load). The race was the test's: with the
# deferred schedule, step() returns while the last step's updates still run, and the two runs'
# models were compared without cm.sync() (check() syncs): under load the second run's last
# updates had not all landed. 50 runs in a row pass with the sync (session 22's note).
@pytest.mark.parametrize("api", ["torch", "both"])
def test_the_torch_style_call_equals_compile_time_clipping(api):
    """cm.clip_grad_norm_ between backward() and step(): same norms, same weights as
    max_grad_norm= (checked against eager, bitwise, by check())."""
    kw = {} if api == "both" else {"overlap_update": False}
    check("gpt_tied", 2, ALWAYS, api=api, **kw).close()
    a = run_clipped("gpt_tied", 2, ALWAYS, api=api, **kw)
    b = run_clipped("gpt_tied", 2, ALWAYS, api="compile")
    a[4].sync()  # the last step's updates (deferred: step() returned while they ran)
    b[4].sync()
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert_bitwise(a[5], b[5])
    a[4].close()
    b[4].close()


def test_inf_norm():
    check("gpt_tied", 2, ALWAYS, norm_type=float("inf")).close()


@pytest.mark.parametrize("policy", [ZeroOffload(), ZeroInfinity()])
def test_other_policies_deferred(policy):
    cm = check("gpt_tied", None, ALWAYS, policy=policy)
    assert "deferred update" in cm.program.name
    cm.close()


def test_torch_style_call_refused_when_updates_ran_in_backward():
    torch.manual_seed(0)
    model = gpt_tied()
    cm = shfx.compile(model, device=_device(), window=2, optimizer=shfx.optim.AdamW(lr=1e-2))
    (x, y), _, _ = token_batch(0)
    cm(x, y).backward()
    with pytest.raises(UsageError, match="max_grad_norm"):
        cm.clip_grad_norm_(1.0)
    cm.step()
    cm.close()


def test_bad_arguments_are_refused():
    model = gpt_tied()
    with pytest.raises(ValueError, match="max_grad_norm must be a number > 0"):
        shfx.compile(model, device=_device(), optimizer=shfx.optim.AdamW(), max_grad_norm=-1.0)
    for overlap in (True, False):  # L2L: its streamed stages' gradients leave the device before the norm is known
        with pytest.raises(ValueError, match="policy 'l2l'.*one-stage window"):
            shfx.compile(model, device=_device(), optimizer=shfx.optim.AdamW(), max_grad_norm=1.0, policy="l2l",
                         overlap_update=overlap)  # fmt: skip
    with pytest.raises(ValueError, match="choose one"):
        ZeroOffload(delayed_update=True, deferred_update=True)


class _SlowUpdates:
    """Makes every host update wait on an event, so a test can see what waits for them."""

    def __init__(self, cm):
        import threading

        self.gate = threading.Event()
        opt = cm.engine.optimizer
        self.orig = opt.update
        gate = self.gate

        def update(*a, **k):
            assert gate.wait(30), "the test never opened the gate"
            return self.orig(*a, **k)

        opt.update = update


@pytest.mark.parametrize("reader", ["state_dict", "eval_forward", "sync"])
def test_pending_updates_are_awaited_by_readers(reader):
    """step() returns with the updates still running; whatever reads the weights waits for
    them: state_dict() equals the eager weights after the step, an eval forward its output."""
    torch.manual_seed(0)
    model = gpt_tied()
    ref = copy.deepcopy(model)
    cm = shfx.compile(model, device=_device(), window=2, optimizer=shfx.optim.AdamW(lr=1e-2), max_grad_norm=ALWAYS)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    (x, y), _, _ = token_batch(0)
    cm(x, y).backward()
    ref(x, y).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), ALWAYS)
    opt.step()
    slow = _SlowUpdates(cm)
    cm.step()  # returns: the updates wait on the gate
    assert cm.engine.deferred, "step() returned before its updates ran"
    import threading

    threading.Timer(0.2, slow.gate.set).start()
    if reader == "state_dict":
        sd = cm.state_dict()
        assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
    elif reader == "sync":
        cm.sync()
        assert_bitwise(model, ref)
    else:
        with torch.no_grad():
            out = cm(x, y)
            expect = ref(x, y)
        assert torch.equal(out, expect)
    assert not cm.engine.deferred
    cm.close()


def test_next_forward_prefetch_waits_for_the_update():
    """The next training forward starts while the updates run; its prefetches wait for them,
    so the step after trains on the updated weights (bitwise like eager)."""
    torch.manual_seed(0)
    model = gpt_tied()
    ref = copy.deepcopy(model)
    cm = shfx.compile(model, device=_device(), window=2, optimizer=shfx.optim.AdamW(lr=1e-2), max_grad_norm=ALWAYS)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    slow = None
    for step in range(2):
        (x, y), _, _ = token_batch(step)
        if slow is not None:
            import threading

            threading.Timer(0.2, slow.gate.set).start()
        loss = cm(x, y)
        loss.backward()
        ref_loss = ref(x, y)
        ref_loss.backward()
        assert loss.item() == ref_loss.item()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), ALWAYS)
        if slow is None:
            slow = _SlowUpdates(cm)
        cm.step()
        cm.zero_grad()
        opt.step()
        opt.zero_grad()
    slow.gate.set()
    cm.sync()
    assert_bitwise(model, ref)
    cm.close()


# ---- the program shape -------------------------------------------------------------------


def test_golden_deferred_programs():
    assert " ".join(Stronghold(window=2, deferred_update=True).program(chain(3)).actions()) == (
        "PF0 PF1 F0 R0 PF2 F1 F2 B2 OG2 GN2 R2 PF0 B1 OG1 GN1 R1 B0 OG0 GN0 R0 CK0 U0 U1 U2"
    )
    assert " ".join(ZeroOffload(deferred_update=True).program(chain(2)).actions()) == (
        "PF0 PF1 F0 F1 B1 OG1 GN1 B0 OG0 GN0 CK0 U0 U1"
    )
    p = Stronghold(window=2, deferred_update=True).program(chain(3))
    assert p.actions("step") == ["CK0"]  # the gate: total norm, clip coefficient, finite check
    assert p.actions("next-forward") == ["U0", "U1", "U2"]
    assert {d.name for d in p.deps(p.find("CK0"))} == {"gn0", "gn1", "gn2"}
    assert all({d.name for d in p.deps(p.find(f"U{g}"))} == {"ck0"} for g in range(3))
    cold = cold_backward_program(p)
    assert cold.actions("step") == ["CK0"]
    assert cold.actions("next-forward") == ["U0", "U1", "U2"]
    verify_program(cold, "backward")
    # data parallel: every rank's norms combined (NR0) before the gate, an all-gather after each update
    dp = data_parallel_program(p, 2)
    assert dp.actions("step") == ["NR0", "CK0"]
    assert dp.actions("next-forward") == ["U0", "AG0", "U1", "AG1", "U2", "AG2"]
    assert {d.name for d in dp.deps(dp.find("NR0"))} == {"gn0", "gn1", "gn2"}
    assert "nr0" in {d.name for d in dp.deps(dp.find("CK0"))}
    verify_program(dp)


def test_steady_state_makes_prefetches_wait_for_the_previous_updates():
    p = steady_state_program(Stronghold(window=2, deferred_update=True).program(chain(3)))
    assert " ".join(p.actions()) == "U0 U1 U2 PF0 PF1 F0 R0 PF2 F1 F2 B2 OG2 GN2 R2 PF0 B1 OG1 GN1 R1 B0 OG0 GN0 R0 CK0"
    for pf in [n for n in p.nodes if get_meta(n).kind.value == "PF"]:
        s = get_meta(pf).stage
        assert f"u{s}_prev" in {d.name for d in p.deps(pf)}


@pytest.mark.parametrize("policy", [Stronghold(window=1, deferred_update=True), Stronghold(window=2, deferred_update=True),
                                    Stronghold(window=4, deferred_update=True), ZeroOffload(deferred_update=True),
                                    ZeroInfinity(deferred_update=True)])  # fmt: skip
@pytest.mark.parametrize("n", [1, 3, 5])
def test_deferred_programs_verify(policy, n):
    verify_program(policy.program(chain(n)))


def _violations(acts, n=3, persistent=(), slots=2):
    prog = lower_actions(acts, chain(n), slots, persistent=persistent)
    with pytest.raises(VerificationError) as e:
        verify_program(prog)
    return str(e.value)


def test_verifier_refuses_a_persistent_stage_used_with_stale_weights():
    """ZeroOffload's deferred program without the leading refresh: the forward would read weights
    from before the previous step's update."""
    acts = ZeroOffload(deferred_update=True).program(chain(2)).actions()[2:]
    msg = _violations(acts, n=2, persistent=(0, 1))
    assert "F0 uses stage 0's weights before any PREFETCH of it in this step" in msg


def test_verifier_refuses_a_norm_without_deferred_updates():
    acts = ["PF0", "F0", "B0", "OG0", "GN0", "U0", "R0"]
    with pytest.raises(Exception, match="must end the program"):
        prog = lower_actions(acts, chain(1), 1)
    acts = ["PF0", "F0", "B0", "OG0", "GN0", "R0"]
    msg = _violations(acts, n=1, slots=1)
    assert "no update after it runs in the next forward" in msg


def test_verifier_refuses_an_update_before_every_norm():
    """A deferred update that does not wait for every GN (its edge to the gate removed by hand),
    and a gate that does not."""
    prog = Stronghold(window=2, deferred_update=True).program(chain(3))
    u0, ck0 = prog.find("U0"), prog.find("CK0")
    u0.args = tuple(a for a in u0.args if a is not ck0)
    with pytest.raises(VerificationError, match="U0 .* does not wait for GN0"):
        verify_program(prog, rules=[step_boundary])
    prog = Stronghold(window=2, deferred_update=True).program(chain(3))
    ck0, gn1 = prog.find("CK0"), prog.find("GN1")
    ck0.args = tuple(a for a in ck0.args if a is not gn1)
    with pytest.raises(VerificationError, match="CK0 .* does not wait for GN1"):
        verify_program(prog, rules=[step_boundary])


def test_verifier_refuses_a_prefetch_that_does_not_wait_for_the_update(monkeypatch):
    """If the steady state's PF of a stage did not wait for the previous update of its group,
    the step-boundary rule names it."""
    import shfx.passes.schedule as schedule

    real = schedule.steady_state_program

    def broken(program):
        p = real(program)
        pf = p.find("PF1")
        pf.args = tuple(a for a in pf.args if not getattr(a, "name", "").endswith("_prev"))
        return p

    monkeypatch.setattr(schedule, "steady_state_program", broken)
    prog = Stronghold(window=2, deferred_update=True).program(chain(3))
    with pytest.raises(VerificationError, match="PF1 copies group 1's weights but does not wait for the previous step's U1"):
        verify_program(prog, rules=[step_boundary])


# ---- the simulator, on fixed synthetic costs -----------------------------------------------


def _costs(update_s, n=4):
    return CostTable([StageCost(1.0, 3.0, update_s=update_s)] * n, Links(1e6, 1e6))


def test_simulator_overlaps_the_updates_with_the_next_forward():
    """Updates that fit behind the forward cost the clipped step only its norms; the
    previous step's updates run at the start of the step, each before its stage's prefetch."""
    prog = Stronghold(window=2, deferred_update=True).program(chain(4, prefetch_bytes=500_000))
    tl = simulate(prog, _costs(0.5))
    base = simulate(Stronghold(window=2).program(chain(4, prefetch_bytes=500_000)), _costs(0.5))
    assert tl.event("U0").start == 0.0 and tl.event("U0").end <= tl.event("PF0").start
    assert tl.event("U3").end <= tl.event("PF3").start
    # the unclipped step ends with U0 after OG0; the clipped one with GN0 (0.1 x update_s), and
    # its first prefetch waits for the previous step's U0: the difference is the norm
    assert tl.event("PF0").start == pytest.approx(0.5)
    assert tl.step_s == pytest.approx(base.step_s + GRAD_NORM_RATIO * 0.5)
    assert tl.bottleneck == "compute"


def test_simulator_charges_updates_that_do_not_fit():
    """An update longer than the time before its stage's prefetch delays the forward: the
    simulator says the host optimizer bounds the step."""
    prog = Stronghold(window=2, deferred_update=True).program(chain(4, prefetch_bytes=500_000))
    tl = simulate(prog, _costs(3.0))
    assert tl.event("PF0").start == pytest.approx(3.0)  # waits for U0
    assert tl.bottleneck == "host optimizer"
    assert tl.step_s > simulate(Stronghold(window=2).program(chain(4, prefetch_bytes=500_000)), _costs(3.0)).step_s


def test_fp16_overflow_skips_the_clipped_step():
    """fp16: the norm is of the unscaled gradient; an overflow (inf norm) skips the step and
    backs the scale off, without updating anything."""
    torch.manual_seed(0)
    model = gpt_tied()
    cm = shfx.compile(model, device=_device(), window=2, optimizer=shfx.optim.AdamW(lr=1e-2), precision="fp16",
                      max_grad_norm=1.0, scaler=shfx.LossScaler(init_scale=2.0**60))  # fmt: skip
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (x, y), _, _ = token_batch(0)
    cm(x, y).backward()
    cm.step()
    assert cm.last_step_skipped and not bool(torch.isfinite(cm.last_grad_norm))
    assert cm.scaler.scale < 2.0**60
    assert all(torch.equal(v, before[k]) for k, v in cm.state_dict().items())
    cm.close()


# ---- mixed precision ------------------------------------------------------------------------


def _mixed_eager_clipped(precision, steps, max_norm):
    """tests/mixed_reference.py's recipe with clipping of the fp32 master gradients before the
    step (fp16: ``scaler.unscale_(opt)`` first, as the PyTorch AMP recipe clips)."""
    from mixed_reference import make_working_copy, working_dtype

    dtype = working_dtype(precision)
    torch.manual_seed(0)
    model = gpt_tied()
    work = make_working_copy(model, dtype)
    master, working = dict(model.named_parameters()), dict(work.named_parameters())
    opt = torch.optim.AdamW(list(master.values()), lr=1e-2, weight_decay=0.01, fused=True)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    norms = []
    for step in range(steps):
        opt.zero_grad()
        (x, y), _, _ = token_batch(step)
        torch.manual_seed(10_000 + 100 * step)
        loss = loss_of(work(x, y), {})
        (scaler.scale(loss) if scaler is not None else loss).backward()
        for n, p16 in working.items():
            master[n].grad = p16.grad.to(torch.float32, copy=True)
            p16.grad = None
        if scaler is not None:
            scaler.unscale_(opt)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        with torch.no_grad():
            for n, p16 in working.items():
                p16.copy_(master[n])
    return norms, {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_clipping_is_the_amp_recipe(precision):
    from mixed_shfx import train_mixed_shfx

    ref_norms, ref_master = _mixed_eager_clipped(precision, 3, ALWAYS)
    out = train_mixed_shfx(gpt_tied, token_batch, precision, 3, window=2, max_grad_norm=ALWAYS)
    cm = out["cm"]
    assert not any(out["skipped"])
    assert torch.equal(cm.last_grad_norm, ref_norms[-1])
    for k, v in ref_master.items():
        assert torch.equal(out["master"][k], v), f"{k} differs from the eager AMP recipe"
    cm.close()


def test_lowering_passes_golden():
    from shfx.passes.lowering import add_deferred_updates, add_grad_norms, add_leading_refresh, compute_order
    from shfx.passes.program import ScheduleError

    specs = chain(3)
    acts = add_grad_norms(compute_order(specs), specs, frozenset())
    assert " ".join(map(str, acts)) == "F0 F1 F2 B2 GN2 B1 GN1 B0 GN0"
    assert " ".join(map(str, add_deferred_updates(acts, specs))).endswith("GN0 CK0 U0 U1 U2")
    assert " ".join(map(str, add_leading_refresh(acts, specs, (0, 1), frozenset()))).startswith("PF0 PF1 F0")
    with pytest.raises(ScheduleError, match="groups \\[0\\] are updated on the device"):
        add_grad_norms(compute_order(specs), specs, frozenset({0}))


# ---- groups updated on the device (Resident, Stronghold(resident_first=k)) --------------------


def _device_grid() -> list:
    """Every zoo model x Resident, Stronghold(resident_first=1 at W=2, 2 at W=1) x the update
    overlapped (the deferred schedule) or in step() x norm above / below the threshold; gpt_tied
    clipped with Resident and resident_first=1, each way, runs by default, the rest with SHFX_SLOW=1."""
    out = []
    policies = [("resident", shfx.Resident()), ("k1", shfx.Stronghold(window=2, resident_first=1)),
                ("k2w1", shfx.Stronghold(window=1, resident_first=2))]  # fmt: skip
    for name in sorted(ZOO):
        for pid, policy in policies:
            for overlap in (True, False):
                for max_norm in (ALWAYS, NEVER):
                    fast = name == "gpt_tied" and pid in ("resident", "k1") and max_norm == ALWAYS
                    out.append(pytest.param(name, policy, overlap, max_norm, marks=() if fast else pytest.mark.slow,
                                            id=f"{name}-{pid}-{'overlap' if overlap else 'in_step'}-{max_norm:g}"))  # fmt: skip
    return out


@pytest.mark.parametrize("name,policy,overlap,max_norm", _device_grid())
def test_clipping_with_device_updates_is_eager_clip_then_fused_adamw(name, policy, overlap, max_norm):
    """Groups updated on the device are normed there (GN on the compute stream, over the
    gradient waiting in the persistent stage's gradient buffer), counted in the gate's total,
    and updated after it (DU scaled by the coefficient): bitwise eager clip_grad_norm_ + fused
    AdamW (norms, losses, weights), 3 steps without reseeding between them."""
    cm = check(name, None, max_norm, policy=policy, overlap_update=overlap)
    prog = cm.program
    dev = prog.device_groups()
    assert dev
    norms = {get_meta(n).stage: get_meta(n) for n in prog.nodes if get_meta(n).kind.value == "GN"}
    assert all(norms[g].device and norms[g].stream == "compute" for g in dev)
    phase = "next-forward" if overlap else "step"
    assert {get_meta(n).stage for n in prog.phase_nodes(phase) if get_meta(n).kind.value == "DU"} == dev
    cm.close()


def test_clipping_with_device_updates_and_gradient_accumulation():
    check("gpt_dropout", None, ALWAYS, accum=2, policy=shfx.Stronghold(window=2, resident_first=1)).close()


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False])
def test_clipping_with_device_updates_accumulation_resident(overlap):
    check("gpt_tied", None, ALWAYS, accum=3, policy="resident", overlap_update=overlap).close()


@pytest.mark.parametrize("policy", [shfx.Resident(), pytest.param(shfx.Stronghold(window=2, resident_first=1), marks=pytest.mark.slow)])
def test_the_torch_style_call_with_device_updates(policy):
    """cm.clip_grad_norm_() between backward() and step() (overlap_update=False): the device
    groups' norms computed at the call, from their gradient in the slot; eager's bits."""
    check("gpt_tied", None, ALWAYS, api="torch", policy=policy, overlap_update=False).close()


@pytest.mark.slow
def test_inf_norm_with_device_updates():
    check("gpt_tied", None, ALWAYS, norm_type=float("inf"), policy="resident").close()


def test_golden_programs_with_device_updates():
    from shfx.passes.features import UPDATES_IN_STEP
    from shfx.passes.policies import L2L, Resident

    p = Resident(deferred_update=True).program(chain(3))
    assert p.name == "resident(deferred update)"
    assert " ".join(p.actions()) == "F0 F1 F2 B2 GN2 B1 GN1 B0 GN0 CK0 DU0 DU1 DU2"
    assert p.actions("next-forward") == ["DU0", "DU1", "DU2"]
    for g in range(3):
        gn = get_meta(p.find(f"GN{g}"))
        assert gn.device and gn.stream == "compute" and gn.slot == g  # its stage's gradient buffer
        assert {d.name for d in p.deps(p.find(f"GN{g}"))} == {f"b{g}"}
        assert {d.name for d in p.deps(p.find(f"DU{g}"))} == {f"b{g}", "ck0"}
    verify_program(p)
    verify_program(cold_backward_program(p), "backward")
    steady = steady_state_program(p)
    assert " ".join(steady.actions()) == "DU0 DU1 DU2 F0 F1 F2 B2 GN2 B1 GN1 B0 GN0 CK0"
    assert "du1_prev" in {d.name for d in steady.deps(steady.find("F1"))}  # the slot DU1 updated in place
    k1 = Stronghold(window=2, resident_first=1, deferred_update=True).program(chain(4))
    assert " ".join(k1.actions()) == (
        "PF1 PF2 F0 F1 R1 PF3 F2 F3 B3 OG3 GN3 R3 PF1 B2 OG2 GN2 R2 B1 OG1 GN1 R1 B0 GN0 CK0 DU0 U1 U2 U3"
    )
    assert not get_meta(k1.find("GN1")).device and get_meta(k1.find("GN0")).device
    verify_program(k1)
    ins = UPDATES_IN_STEP(Resident().program(chain(2)), clip=True)
    assert " ".join(ins.actions()) == "F0 F1 B1 GN1 B0 GN0 CK0 DU1 DU0"
    assert ins.actions("step") == ["CK0", "DU1", "DU0"]
    assert all("ck0" in {d.name for d in ins.deps(ins.find(f"DU{g}"))} for g in range(2))
    verify_program(ins)
    from shfx.passes.lowering import add_grad_norms, compute_order

    with pytest.raises(ScheduleError, match="streamed stages \\(L2L\\)"):
        add_grad_norms(compute_order(chain(2)), chain(2), frozenset({0, 1}), ())


def test_l2l_refuses_clipping_saying_why():
    from shfx.passes.features import EXACT_CLIPPING, PassRefused
    from shfx.passes.policies import L2L

    with pytest.raises(PassRefused, match="streamed stages, whose gradients leave the device with their slot"):
        EXACT_CLIPPING(L2L().program(chain(2)))
    with pytest.raises(ScheduleError, match="its owner, stage 0, is streamed"):
        lower_actions(["PF0", "F0", "B0", "GN0", "CK0", "DU0", "OP0", "R0"], chain(1), 1)


def test_simulator_charges_a_device_norm_to_the_compute_stream():
    """A GN of a device group is a reduction over the gradient in device memory: on the compute
    stream, DEVICE_GRAD_NORM_RATIO x the group's device update; the previous step's deferred
    DU's run first on the compute stream (the steady state)."""
    from shfx.cost_model.simulate import DEVICE_GRAD_NORM_RATIO
    from shfx.passes.policies import Resident

    costs = CostTable([StageCost(1.0, 3.0, update_s=0.5, device_update_s=0.28)] * 3, Links(1e6, 1e6))
    tl = simulate(Resident(deferred_update=True).program(chain(3)), costs)
    base = simulate(Resident().program(chain(3)), costs)
    gn = tl.event("GN1")
    assert gn.stream == "compute" and gn.end - gn.start == pytest.approx(DEVICE_GRAD_NORM_RATIO * 0.28)
    assert tl.event("DU0").start == 0.0 and tl.event("F0").start == pytest.approx(3 * 0.28)  # (one compute stream)
    assert tl.step_s == pytest.approx(base.step_s + 3 * DEVICE_GRAD_NORM_RATIO * 0.28)
    assert tl.bottleneck == "compute"


def test_ledger_counts_the_device_gradients_held_until_the_gate():
    """A device group's gradient waits for the gate in its persistent stage's gradient buffer,
    which the ledger holds for the whole step (setup): the clipped program needs no device
    memory the unclipped one does not, and no more at its peak."""
    from shfx.passes.ledger import replay
    from shfx.passes.policies import Resident

    for policy in (Resident(), Stronghold(window=2, resident_first=1)):
        base = policy.program(chain(4))
        clipped = policy.replace(deferred_update=True).program(chain(4))
        held = sum(clipped.stages[s].slot_bytes for s in clipped.persistent)
        lb, lc = replay(base), replay(clipped)
        assert lc.static()["gradients"] == lb.static()["gradients"] >= held
        assert lc.peak() == lb.peak()
