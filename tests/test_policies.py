"""Every policy trains exactly like eager PyTorch; golden programs; the verifier accepts them."""

from __future__ import annotations

import pytest
import torch
from equivalence import assert_same_state, assert_trains_like_eager
from zoo import ZOO, gpt_tied, token_batch

import shfx
from shfx.passes.program import ActionKind
from shfx.passes.policies import make_policy, schedule_l2l, schedule_resident, schedule_stronghold, schedule_zero_infinity, schedule_zero_offload
from shfx.passes.schedule import cold_backward_program, eval_program
from shfx.passes.stages import chain
from shfx.passes.verify import verify_program

CASES = [
    ("resident", shfx.Resident()),
    ("l2l", shfx.L2L()),
    ("zero-offload", shfx.ZeroOffload()),
    ("zero-infinity", shfx.ZeroInfinity()),
    ("stronghold", shfx.Stronghold(window=2, resident_first=1)),
    ("stronghold", shfx.Stronghold(window=2, resident_first=2)),
]


def _policy_grid() -> list:
    """Every zoo model x every policy; the fast subset (every policy on gpt_tied, whose tied
    head is borrowed across stages, and every model under Stronghold(resident_first=1)) runs by
    default, the rest with SHFX_SLOW=1."""
    out = []
    for name in sorted(ZOO):
        for policy, pol in CASES:
            pid = f"{policy}{getattr(pol, 'resident_first', '')}"
            fast = name == "gpt_tied" or pid == "stronghold1"
            out.append(pytest.param(name, policy, pol, id=f"{name}-{pid}", marks=() if fast else pytest.mark.slow))
    return out


@pytest.mark.parametrize("name,policy,pol", _policy_grid())
def test_policy_trains_like_eager(name, policy, pol):
    make_model, make_batch = ZOO[name]
    _, _, cm, model, ref = assert_trains_like_eager(make_model, make_batch, window=None, steps=4, policy=pol)
    assert policy in cm.program.name
    cm.close()
    assert_same_state(model, ref)  # close() copied device-updated weights back


@pytest.mark.parametrize("policy", [shfx.Resident(), shfx.ZeroOffload(), shfx.Stronghold(window=2, resident_first=2)])
def test_policy_gradient_accumulation(policy):
    _, _, cm, _, _ = assert_trains_like_eager(gpt_tied, token_batch, window=None, steps=3, accum=3, policy=policy)
    cm.close()


def test_l2l_refuses_deferred_updates():
    # (a conflict row since issue 25: refused at compile, with its reason and fix)
    for kw in (dict(grad_accum_steps=2), dict(overlap_update=False)):
        with pytest.raises(shfx.errors.ConfigConflict, match="policy 'l2l'.*one stage resident"):
            shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(), policy="l2l", optimizer=shfx.optim.AdamW(), **kw)


def test_resident_state_dict_syncs_device_weights():
    """The resident policy updates weights on the device; state_dict() reads them back."""
    import copy

    torch.manual_seed(0)
    model = gpt_tied()
    ref = copy.deepcopy(model)
    cm = shfx.compile(model, device=shfx.EmulatedDevice(), policy="resident", optimizer=shfx.optim.AdamW(lr=1e-2))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    (x, y), _, _ = token_batch(0)
    cm(x, y).backward()
    cm.step()
    ref(x, y).backward()
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sd = cm.state_dict()  # syncs
    assert any(not torch.equal(before[k], sd[k]) for k in sd)  # the host was stale until now
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=0)
    # new weights on the host are loaded onto the device before the next step
    cm.load_state_dict(before)
    cm.zero_grad()
    cm(x, y).backward()
    cm.step()
    cm.close()


def test_resident_first_validation():
    with pytest.raises(ValueError, match="policy 'resident' has no option resident_first"):
        make_policy("resident", resident_first=1)
    with pytest.raises(ValueError, match="resident_first must be"):
        shfx.Stronghold(resident_first=-1)
    # policy options live on the policy object: shfx.compile says where
    with pytest.raises(TypeError, match=r"option of the policy now: pass policy=shfx.Stronghold\(window=2, resident_first=1\)"):
        shfx.compile(gpt_tied(), resident_first=1)
    with pytest.raises(ValueError, match="policy 'resident' has no window"):
        shfx.compile(gpt_tied(), policy="resident", window=2)
    with pytest.raises(ValueError, match="disagrees with Stronghold"):
        shfx.compile(gpt_tied(), policy=shfx.Stronghold(window=3), window=2)


GOLDEN = {
    "resident": "F0 F1 F2 F3 B3 DU3 B2 DU2 B1 DU1 B0 DU0",
    "l2l": "PF0 F0 R0 PF1 F1 R1 PF2 F2 R2 PF3 F3 B3 DU3 OP3 R3 PF2 B2 DU2 OP2 R2 PF1 B1 DU1 OP1 R1 PF0 B0 DU0 OP0 R0",
    "zero-offload": "F0 F1 F2 F3 B3 OG3 B2 OG2 B1 OG1 B0 OG0 U0 U1 U2 U3 PF0 PF1 PF2 PF3",
    "zero-infinity": "PF0 PF1 F0 R0 PF2 F1 R1 PF3 F2 R2 F3 R3 PF3 PF2 B3 OG3 R3 PF1 B2 OG2 R2 PF0 B1 OG1 R1 B0 OG0 R0 U0 U1 U2 U3",
    "stronghold": "PF0 PF1 F0 R0 PF2 F1 R1 PF3 F2 F3 B3 OG3 U3 R3 PF1 B2 OG2 U2 R2 PF0 B1 OG1 U1 R1 B0 OG0 U0 R0",
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_policy_programs(name):
    p = make_policy(name, **({"window": 2} if name == "stronghold" else {})).program(chain(4))
    assert " ".join(p.actions()) == GOLDEN[name]
    verify_program(p, "train")
    verify_program(eval_program(p), "eval")
    verify_program(cold_backward_program(p), "backward")


def test_golden_stronghold_resident_first_with_tied_head():
    """The first stage (the head, owning the tied embedding) stays resident and is updated on the
    device after the tail's and its own backward; the tail sends the host only its own grads."""
    specs = chain(4, tied=(0, 3))
    p = schedule_stronghold(specs, 2, resident_first=1)
    assert " ".join(p.actions()) == "PF1 PF2 F0 F1 R1 PF3 F2 F3 B3 OG3 U3 R3 PF1 B2 OG2 U2 R2 B1 OG1 U1 R1 B0 DU0"
    assert p.persistent == (0,) and p.device_groups() == {0}
    og3 = p.find("OG3")
    assert og3.meta["shfx"].bytes == specs[3].grad_bytes_to({3}) < specs[3].grad_bytes
    verify_program(p)


def test_policies_verify_over_a_grid():
    for n in range(1, 6):
        for tied in ((None, (0, n - 1)) if n > 1 else (None,)):
            specs = chain(n, tied=tied, mutating=(0,))
            progs = [schedule_resident(specs), schedule_l2l(specs), schedule_zero_offload(specs), schedule_zero_infinity(specs)]
            progs += [schedule_stronghold(specs, w, resident_first=k) for w in (1, 2, 3) for k in range(n + 1)]
            for p in progs:
                verify_program(p, "train")
                verify_program(eval_program(p), "eval")
                verify_program(cold_backward_program(p), "backward")


def test_memory_footprints_differ_as_expected():
    """Same model, different device footprints: resident holds every stage plus gradients and
    optimizer states; l2l one slot plus every group's optimizer states; zero-infinity two slots."""
    specs = chain(6, prefetch_bytes=100, grad_bytes=100)
    res, l2l, zinf = schedule_resident(specs), schedule_l2l(specs), schedule_zero_infinity(specs)
    assert sum(res.slot_sizes()) == 600 and sum(res.grad_buffer_sizes()) == 600 and res.device_state_bytes() == 1200
    assert sum(l2l.slot_sizes()) == 100 and sum(l2l.grad_buffer_sizes()) == 100 and l2l.device_state_bytes() == 1200
    assert sum(zinf.slot_sizes()) == 200 and zinf.device_state_bytes() == 0


def test_resident_first_auto_tunes_k_and_trains_like_eager():
    """resident_first="auto": the tuner simulates every (k, W) pair; the chosen program trains
    exactly like eager and the report says which k and why."""
    _, _, cm, model, ref = assert_trains_like_eager(
        gpt_tied, token_batch, window=None, steps=3, policy=shfx.Stronghold(window="auto", resident_first="auto"),
        device=shfx.EmulatedDevice(memory="256MiB", h2d="50MB/s", d2h="50MB/s"),
    )  # fmt: skip
    rep = cm.report()
    k = rep.tune.resident_first
    assert {r.resident_first for r in rep.tune.rows} == set(range(len(cm.variant.graph.stages)))
    assert cm.program.persistent == tuple(range(k))
    assert cm.program.num_slots == k + rep.window
    text = str(rep)
    assert f"chose resident_first={k}, window {rep.window}" in text
    cm.close()
    assert_same_state(model, ref)


def test_tuner_keeps_first_stages_when_host_updates_bind():
    """With a slow host optimizer, keeping the first stage on the device hides its update."""
    from shfx.cost_model.costs import CostTable, Links, StageCost
    from shfx.cost_model.tune import tune_window

    specs = chain(6, prefetch_bytes=2000, grad_bytes=2000)
    costs = CostTable([StageCost(1.0, 3.0, update_s=2.5, device_update_s=0.1)] * 6, Links(4000.0, 4000.0))
    r = tune_window(specs, costs, resident_first=range(4))
    assert r.resident_first >= 1
    assert r.chosen.step_s < min(x.step_s for x in r.rows if x.resident_first == 0)
    assert "saves" in r.reason
    # a budget that only fits k=0 leaves k=0
    k0 = max(x.peak_device_bytes for x in r.rows if x.resident_first == 0 and x.window <= 2)
    r2 = tune_window(specs, costs, resident_first=range(4), capacity_bytes=k0)
    assert r2.resident_first == 0 and r2.chosen.fits
    with pytest.raises(ValueError, match="resident_first values must be in 0..5"):
        tune_window(specs, costs, resident_first=[7])


# ---- ZeRO-Offload's delayed parameter update -----------------------------------------------


def _eager_delayed(ref, make_batch, steps, lr=1e-2, weight_decay=0.01):
    """Eager PyTorch with a one-step delayed update: the update with step i's gradients is
    applied after step i+1's backward (step i+1 trains on the weights before it)."""
    from zoo import loss_of

    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=weight_decay, fused=True)
    params = [p for p in ref.parameters() if p.requires_grad]
    losses, prev = [], None
    for step in range(steps):
        args, kwargs, aux = make_batch(step, 0)
        torch.manual_seed(10_000 + 100 * step)
        loss = loss_of(ref(*args, **kwargs), aux)
        loss.backward()
        losses.append(loss.item())
        cur = [p.grad.clone() if p.grad is not None else None for p in params]
        if prev is not None:
            for p, g in zip(params, prev):
                p.grad = g
            opt.step()
        prev = cur
        opt.zero_grad()
    for p, g in zip(params, prev):
        p.grad = g
    opt.step()  # the last step's update, which close() waits for
    return losses


@pytest.mark.parametrize("name", ["gpt_tied", "gpt_dropout", "bn_net"])
def test_zero_offload_delayed_update_matches_eager_delayed(name):
    import copy

    from zoo import loss_of

    make_model, make_batch = ZOO[name]
    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model)
    plain = copy.deepcopy(model)
    cm = shfx.compile(
        model, device=shfx.EmulatedDevice(memory="256MiB"), policy=shfx.ZeroOffload(delayed_update=True),
        optimizer=shfx.optim.AdamW(lr=1e-2, weight_decay=0.01),
    )  # fmt: skip
    losses = []
    for step in range(4):
        args, kwargs, aux = make_batch(step, 0)
        torch.manual_seed(10_000 + 100 * step)
        loss = loss_of(cm(*args, **kwargs), aux)
        loss.backward()
        losses.append(loss.item())
        cm.step()  # returns while the update runs
        cm.zero_grad()
    # the delayed-update pass: the updates in phase "delayed" (step() starts them), the refresh in "step"
    prog = cm.program
    assert "delayed update" in prog.name and prog.count(ActionKind.CPU_STEP, "delayed") == prog.count(ActionKind.CPU_STEP) > 0
    assert prog.count(ActionKind.CPU_STEP, "backward") == 0 and prog.actions("step") == [f"PF{s}" for s in prog.persistent]
    cm.close()
    ref_losses = _eager_delayed(ref, make_batch, 4)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=0)
    assert_same_state(model, ref, rtol=0, atol=0)
    # not the undelayed trajectory: step 1 trains on the initial weights
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    plain_losses = []
    for step in range(2):
        args, kwargs, aux = make_batch(step, 0)
        torch.manual_seed(10_000 + 100 * step)
        loss = loss_of(plain(*args, **kwargs), aux)
        loss.backward()
        plain_losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    assert losses[0] == plain_losses[0] and losses[1] != plain_losses[1]


def test_delayed_update_state_dict_waits_without_moving_the_device():
    """state_dict() mid-training includes the running update; the device keeps the weights
    before it until the next step(), so the trajectory is unchanged."""
    import copy

    torch.manual_seed(0)
    model = gpt_tied()
    ref = copy.deepcopy(model)
    cm = shfx.compile(model, device=shfx.EmulatedDevice(), policy=shfx.ZeroOffload(delayed_update=True), optimizer=shfx.optim.AdamW(lr=1e-2, weight_decay=0.01))
    (x, y), _, _ = token_batch(0)
    losses = []
    for step in range(3):
        args, kwargs, aux = token_batch(step, 0)
        torch.manual_seed(10_000 + 100 * step)
        from zoo import loss_of

        loss = loss_of(cm(*args, **kwargs), aux)
        loss.backward()
        losses.append(loss.item())
        cm.step()
        sd = cm.state_dict()  # waits for the delayed update
        assert sd.keys() == model.state_dict().keys()
        cm.zero_grad()
    cm.close()
    assert losses == _eager_delayed(ref, token_batch, 3)
    assert_same_state(model, ref, rtol=0, atol=0)


def test_delayed_update_needs_zero_offload():
    with pytest.raises(ValueError, match="policy 'stronghold' has no option delayed_update"):
        make_policy("stronghold", delayed_update=True)
    with pytest.raises(TypeError, match=r"pass policy=shfx.ZeroOffload\(delayed_update=True\)"):
        shfx.compile(gpt_tied(), policy="stronghold", delayed_update=True)


def test_capacity_check_counts_gradient_buffers_and_device_states():
    """resident needs slots + gradient buffers + optimizer states on the device: a budget that
    holds the slots alone is refused up front, naming the policy and every term."""
    from shfx.models.gpt import GPT, GPTShape

    cfg = GPTShape(vocab=64, seq=16, layers=2, heads=2, hidden=32)
    torch.manual_seed(0)
    probe = shfx.compile(GPT(cfg), device=shfx.EmulatedDevice(), policy="resident", optimizer=shfx.optim.AdamW())
    idx = torch.zeros(2, 16, dtype=torch.long)
    probe(idx, idx)
    prog = probe.program
    slots = sum(prog.slot_sizes())
    assert sum(prog.grad_buffer_sizes()) == slots  # every stage keeps its params through the backward
    assert prog.device_state_bytes() == 2 * sum(s.update_bytes for s in prog.stages)  # AdamW m and v
    assert prog.static_device_bytes() == 2 * slots + prog.device_state_bytes()
    probe.close()
    cm = shfx.compile(GPT(cfg), device=shfx.EmulatedDevice(memory=slots + 1024), policy="resident", optimizer=shfx.optim.AdamW())
    with pytest.raises(shfx.OutOfDeviceMemory, match=r"policy 'resident' needs 4 slots .* gradient buffers and .* optimizer states"):
        cm(idx, idx)
    cm.close()
