"""``cm.optimizer`` as a ``torch.optim.Optimizer``: schedulers, parameter groups, state and
state dicts, and the SGD and Adafactor host optimizers, each against eager PyTorch with the same
seed and data, bitwise (``torch.equal``) on the CPU.

The eager side runs torch's kernel that shfx runs on its flat buffers: ``AdamW(fused=True)``,
``SGD(fused=True)``, ``Adafactor(foreach=True)`` (see ``tests/equivalence.py``'s note on why
not the for-loop AdamW).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.optim import lr_scheduler as L
from zoo import ZOO, loss_of

import shfx
from shfx.errors import UsageError

LR = 1e-2
STEPS = 6


def _device():
    return shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None)


def _no_decay(name: str, p: torch.nn.Parameter) -> bool:
    return p.ndim < 2 or name.endswith(".bias")


def _groups(model: torch.nn.Module, names: bool = False) -> list[dict]:
    """No weight decay on biases and norms, a larger lr for the head (the last Linear)."""
    named = list(model.named_parameters())
    head = {n for n, _ in named[-2:]}  # the last layer's weight and bias
    pick = (lambda n, p: n) if names else (lambda n, p: p)
    return [
        {"params": [pick(n, p) for n, p in named if not _no_decay(n, p) and n not in head], "weight_decay": 0.1},
        {"params": [pick(n, p) for n, p in named if _no_decay(n, p) and n not in head], "weight_decay": 0.0},
        {"params": [pick(n, p) for n, p in named if n in head], "lr": 3 * LR, "weight_decay": 0.05},
    ]


def _group_fn(name: str, p: torch.nn.Parameter) -> dict | None:
    return {"weight_decay": 0.0} if _no_decay(name, p) else None


def train_pair(
    zoo: str,
    make_shfx,
    make_eager,
    *,
    steps: int = STEPS,
    window: int | None = 2,
    sched=None,
    plateau: bool = False,
    **compile_kw,
):
    """Train ``zoo``'s model with shfx (``make_shfx(model) -> shfx optimizer``) and eagerly
    (``make_eager(ref) -> torch optimizer``), with ``sched(opt)`` on both; returns
    ``(losses, ref_losses, lrs, cm, model, ref, opt)``."""
    make_model, make_batch = ZOO[zoo]
    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model)
    kw = {"window": window} if window is not None else {}
    cm = shfx.compile(model, device=_device(), optimizer=make_shfx(model), **kw, **compile_kw)
    opt = make_eager(ref)
    s1, s2 = (sched(cm.optimizer), sched(opt)) if sched is not None else (None, None)
    losses, ref_losses, lrs = [], [], []
    for step in range(steps):
        args, kwargs, aux = make_batch(step, 0)
        torch.manual_seed(10_000 + 100 * step)
        loss = loss_of(cm(*args, **kwargs), aux)
        loss.backward()
        torch.manual_seed(10_000 + 100 * step)
        ref_loss = loss_of(ref(*args, **kwargs), aux)
        ref_loss.backward()
        cm.step()
        cm.zero_grad()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
        lrs.append([g["lr"] for g in cm.optimizer.param_groups])
        assert lrs[-1] == [g["lr"] for g in opt.param_groups]
        if s1 is not None:
            s1.step(loss.item()) if plateau else s1.step()
            s2.step(ref_loss.item()) if plateau else s2.step()
    cm.sync()
    return losses, ref_losses, lrs, cm, model, ref, opt


def assert_bitwise(losses, ref_losses, model, ref) -> None:
    assert losses == ref_losses
    sd, rsd = model.state_dict(), ref.state_dict()
    assert sd.keys() == rsd.keys()
    for k in sd:
        assert torch.equal(sd[k], rsd[k]), k


def adamw_pair(**kw):
    return (lambda m: shfx.optim.AdamW(lr=LR, **kw)), (lambda r: torch.optim.AdamW(r.parameters(), lr=LR, fused=True, **kw))


# ---- schedulers ------------------------------------------------------------------------------
SCHEDULERS = {
    "LambdaLR": lambda o: L.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "StepLR": lambda o: L.StepLR(o, step_size=2, gamma=0.3),
    "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, T_max=STEPS),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=2 * LR, total_steps=STEPS + 1),
    "warmup+cosine": lambda o: L.SequentialLR(
        o, [L.LinearLR(o, start_factor=0.1, total_iters=2), L.CosineAnnealingLR(o, T_max=STEPS - 2)], milestones=[2]
    ),
    "ReduceLROnPlateau": lambda o: L.ReduceLROnPlateau(o, factor=0.5, patience=0, threshold=1.0),
}


@pytest.mark.parametrize("name", SCHEDULERS)
def test_scheduler_matches_eager(name, recwarn):
    make_shfx, make_eager = adamw_pair(weight_decay=0.01)
    losses, ref_losses, lrs, cm, model, ref, _ = train_pair(
        "bn_net", make_shfx, make_eager, sched=SCHEDULERS[name], plateau=name == "ReduceLROnPlateau"
    )
    assert len({tuple(x) for x in lrs}) > 1, f"{name} never changed the lr: {lrs}"
    assert_bitwise(losses, ref_losses, model, ref)
    # cm.step() goes through cm.optimizer.step(), so the scheduler saw the optimizer step first
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
    cm.close()


def test_onecycle_cycles_betas_per_group():
    # OneCycleLR writes group["betas"] each step: the host update must read it
    make_shfx, make_eager = adamw_pair()
    sched = lambda o: L.OneCycleLR(o, max_lr=2 * LR, total_steps=STEPS + 1, base_momentum=0.5, max_momentum=0.95)
    losses, ref_losses, _, cm, model, ref, _ = train_pair("gpt_tied", make_shfx, make_eager, sched=sched, steps=4)
    assert cm.optimizer.param_groups[0]["betas"][0] != 0.9
    assert_bitwise(losses, ref_losses, model, ref)
    cm.close()


def test_lr_set_by_hand_applies_to_every_group():
    make_shfx = lambda m: shfx.optim.AdamW(_groups(m), lr=LR)
    losses, _, _, cm, *_ = train_pair("bn_net", make_shfx, lambda r: torch.optim.AdamW(_groups(r), lr=LR, fused=True), steps=1)
    cm.optimizer.lr = 0.5
    assert [g["lr"] for g in cm.optimizer.param_groups] == [0.5, 0.5, 0.5]
    assert cm.optimizer.lr == 0.5
    cm.close()


# ---- parameter groups --------------------------------------------------------------------------
@pytest.mark.parametrize(  # every way on gpt_tied, the BatchNorm model by parameter list; the rest with SHFX_SLOW=1
    "zoo,how",
    [pytest.param(z, h, id=f"{z}-{h}", marks=() if z == "gpt_tied" or h == "params" else pytest.mark.slow)
     for z in ("gpt_tied", "bn_net") for h in ("params", "names", "function")],
)  # fmt: skip
def test_param_groups_match_eager(zoo, how):
    if how == "function":
        make_shfx = lambda m: shfx.optim.AdamW(lr=LR, weight_decay=0.1, groups=_group_fn)

        def make_eager(r):
            named = list(r.named_parameters())
            return torch.optim.AdamW(
                [{"params": [p for n, p in named if not _no_decay(n, p)]},
                 {"params": [p for n, p in named if _no_decay(n, p)], "weight_decay": 0.0}],
                lr=LR, weight_decay=0.1, fused=True,
            )  # fmt: skip
    else:
        make_shfx = lambda m: shfx.optim.AdamW(_groups(m, names=how == "names"), lr=LR)
        make_eager = lambda r: torch.optim.AdamW(_groups(r), lr=LR, fused=True)
    losses, ref_losses, _, cm, model, ref, opt = train_pair(zoo, make_shfx, make_eager, steps=4)
    assert_bitwise(losses, ref_losses, model, ref)
    # the groups hold the model's own parameters
    params = {id(p) for p in model.parameters()}
    assert all(id(p) in params for g in cm.optimizer.param_groups for p in g["params"])
    assert [len(g["params"]) for g in cm.optimizer.param_groups] == [len(g["params"]) for g in opt.param_groups]
    cm.close()


@pytest.mark.parametrize("policy", ["resident", "l2l"])
def test_param_groups_on_device_updated_stages(policy):
    make_shfx = lambda m: shfx.optim.AdamW(_groups(m), lr=LR)
    losses, ref_losses, _, cm, model, ref, _ = train_pair(
        "gpt_tied", make_shfx, lambda r: torch.optim.AdamW(_groups(r), lr=LR, fused=True), steps=3, window=None,
        policy=policy, sched=lambda o: L.StepLR(o, 1, 0.5),
    )  # fmt: skip
    assert_bitwise(losses, ref_losses, model, ref)
    cm.close()


def test_param_group_errors():
    make_model, make_batch = ZOO["bn_net"]
    model = make_model()
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="no parameter named 'nope'"):
        shfx.compile(model, device=_device(), optimizer=shfx.optim.AdamW([{"params": ["nope"]}]))
    model = make_model()
    opt = shfx.optim.AdamW([p for _, p in list(model.named_parameters())[:2]])
    cm = shfx.compile(model, device=_device(), optimizer=opt)
    args, kwargs, aux = make_batch(0, 0)
    with pytest.raises(UsageError, match="in no parameter group"):
        cm(*args, **kwargs)
    cm.close()
    model = make_model()
    cm = shfx.compile(model, device=_device(), optimizer=shfx.optim.AdamW())
    loss_of(cm(*args, **kwargs), aux).backward()
    cm.step()
    with pytest.raises(UsageError, match="add_param_group after the first call"):
        cm.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert len(named) == len(cm.optimizer.param_groups[0]["params"])
    cm.close()


# ---- state and state dicts --------------------------------------------------------------------
def test_state_is_views_of_the_flat_buffers():
    make_shfx, make_eager = adamw_pair()
    _, _, _, cm, model, ref, opt = train_pair("bn_net", make_shfx, make_eager, steps=2)
    runner = cm.engine.optimizer
    flats = {st.exp_avg.untyped_storage().data_ptr() for st in runner.state.values()}
    for p in model.parameters():
        st = cm.optimizer.state[p]
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and float(st["step"]) == 2
        assert st["exp_avg"].shape == p.shape
        assert st["exp_avg"].untyped_storage().data_ptr() in flats  # a view, not a copy
        torch.testing.assert_close(st["exp_avg"], opt.state[dict(zip(map(id, model.parameters()), ref.parameters()))[id(p)]]["exp_avg"], rtol=0, atol=0)
    p = next(model.parameters())
    cm.optimizer.state[p]["exp_avg"].fill_(7.0)
    g = next(g for g, st in runner.state.items() if (st.exp_avg == 7.0).any())
    assert (runner.state[g].exp_avg == 7.0).sum() == p.numel()
    cm.close()


@pytest.mark.parametrize("direction", ["eager->shfx", "shfx->eager"])
@pytest.mark.parametrize("kind", ["AdamW", "SGD", "Adafactor"])
def test_state_dict_round_trip_with_eager(kind, direction):
    """Train 3 steps on one side, move weights and optimizer state dict to the other, train 3
    more on both: bitwise the same as eager training 6 steps without a move."""
    make_shfx, make_eager = OPTIMIZERS[kind]
    make_model, make_batch = ZOO["gpt_tied"]
    torch.manual_seed(0)
    base = make_model()
    ref = copy.deepcopy(base)
    opt = make_eager(ref)
    model = copy.deepcopy(base)
    cm = shfx.compile(model, device=_device(), window=2, optimizer=make_shfx(model))

    def eager_step(step):
        args, kwargs, aux = make_batch(step, 0)
        torch.manual_seed(10_000 + 100 * step)
        loss_of(ref(*args, **kwargs), aux).backward()
        opt.step()
        opt.zero_grad()

    def shfx_step(step):
        args, kwargs, aux = make_batch(step, 0)
        torch.manual_seed(10_000 + 100 * step)
        loss_of(cm(*args, **kwargs), aux).backward()
        cm.step()
        cm.zero_grad()

    # the uninterrupted eager run
    for step in range(6):
        eager_step(step)
    want = {k: v.clone() for k, v in ref.state_dict().items()}
    # again, moving sides after 3 steps
    ref.load_state_dict(base.state_dict())
    opt = make_eager(ref)
    if direction == "eager->shfx":
        for step in range(3):
            eager_step(step)
        cm.load_state_dict(ref.state_dict())
        cm.optimizer.load_state_dict(opt.state_dict())
        for step in range(3, 6):
            shfx_step(step)
        cm.sync()
        got = model.state_dict()
    else:
        for step in range(3):
            shfx_step(step)
        ref.load_state_dict(cm.state_dict())
        opt.load_state_dict(cm.optimizer.state_dict())
        for step in range(3, 6):
            eager_step(step)
        got = ref.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    cm.close()


def test_state_dict_loaded_before_the_first_call():
    make_shfx, make_eager = adamw_pair()
    make_model, make_batch = ZOO["bn_net"]
    torch.manual_seed(0)
    ref = make_model()
    opt = make_eager(ref)
    for step in range(2):
        args, kwargs, aux = make_batch(step, 0)
        loss_of(ref(*args, **kwargs), aux).backward()
        opt.step()
        opt.zero_grad()
    model = copy.deepcopy(ref)
    cm = shfx.compile(model, device=_device(), window=2, optimizer=make_shfx(model))
    cm.optimizer.load_state_dict(opt.state_dict())  # before the store exists: applied at the first call
    for step in range(2, 4):
        args, kwargs, aux = make_batch(step, 0)
        assert loss_of(cm(*args, **kwargs), aux).backward() is None
        cm.step()
        cm.zero_grad()
        loss_of(ref(*args, **kwargs), aux).backward()
        opt.step()
        opt.zero_grad()
    cm.sync()
    assert_bitwise([], [], model, ref)
    cm.close()


@pytest.mark.parametrize("kind", ["AdamW", "SGD", "Adafactor"])
def test_a_state_dict_refused_in_the_last_stage_changes_no_stage(kind):
    # every stage is checked (the runner's check_group) before any is written: no copy of the
    # current states is kept to undo a refusal, and none is needed
    make_shfx, _ = OPTIMIZERS[kind]
    make_model, make_batch = ZOO["bn_net"]
    torch.manual_seed(0)
    model = make_model()
    cm = shfx.compile(model, device=_device(), window=2, optimizer=make_shfx(model))
    args, kwargs, aux = make_batch(0, 0)
    loss_of(cm(*args, **kwargs), aux).backward()
    cm.step()
    cm.zero_grad()
    before = copy.deepcopy(cm.optimizer.state_dict())
    bad = copy.deepcopy(before)
    for e in bad["state"].values():  # (every state of the first stages scaled: what a partial load would show)
        for k, t in e.items():
            if k != "step":
                t.add_(1.0)
    last = max(bad["state"])
    field = next(k for k in bad["state"][last] if k != "step")
    bad["state"][last][field] = torch.zeros(3, 5)
    with pytest.raises(ValueError, match=rf"{field}'? of a parameter of shape .* is \(3, 5\)"):
        cm.optimizer.load_state_dict(bad)
    after = cm.optimizer.state_dict()
    assert all(torch.equal(t, after["state"][i][k]) for i, e in before["state"].items() for k, t in e.items())
    cm.close()


# ---- SGD and Adafactor against torch -------------------------------------------------------------
OPTIMIZERS = {
    "AdamW": adamw_pair(weight_decay=0.01),
    "SGD": (
        lambda m: shfx.optim.SGD(lr=LR, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True),
        lambda r: torch.optim.SGD(r.parameters(), lr=LR, momentum=0.9, weight_decay=0.01, nesterov=True, fused=True),
    ),
    "Adafactor": (
        lambda m: shfx.optim.Adafactor(lr=LR, weight_decay=0.01),
        lambda r: torch.optim.Adafactor(r.parameters(), lr=LR, weight_decay=0.01, foreach=True),
    ),
}


@pytest.mark.parametrize(  # the GPT and the BatchNorm model by default, every zoo model with SHFX_SLOW=1
    "zoo", [z if z in ("gpt_tied", "bn_net") else pytest.param(z, marks=pytest.mark.slow) for z in ZOO]
)
@pytest.mark.parametrize("kind", ["SGD", "Adafactor"])
def test_optimizer_matches_torch_on_the_zoo(kind, zoo):
    make_shfx, make_eager = OPTIMIZERS[kind]
    losses, ref_losses, _, cm, model, ref, opt = train_pair(zoo, make_shfx, make_eager, steps=4)
    assert_bitwise(losses, ref_losses, model, ref)
    sd, rsd = cm.optimizer.state_dict(), opt.state_dict()
    assert sd["state"].keys() == rsd["state"].keys()
    for i, st in rsd["state"].items():
        assert sd["state"][i].keys() == st.keys()
        for k, v in st.items():
            assert torch.equal(sd["state"][i][k], v), (i, k)
    cm.close()


# 99: all stages. By default window 1 for both kinds and all stages for SGD; window 2 (the
# default window, which test_optimizer_matches_torch_on_the_zoo runs on gpt_tied for both kinds)
# and Adafactor at all stages with SHFX_SLOW=1
AT_WINDOWS = [(k, w) for k in ("SGD", "Adafactor") for w in (1, 2, 99)]


@pytest.mark.parametrize(
    "kind,window",
    [pytest.param(k, w, id=f"{k}-{w}", marks=() if w == 1 or (k, w) == ("SGD", 99) else pytest.mark.slow) for k, w in AT_WINDOWS],
)
def test_optimizer_matches_torch_at_windows(kind, window):
    make_shfx, make_eager = OPTIMIZERS[kind]
    losses, ref_losses, _, cm, model, ref, _ = train_pair("gpt_tied", make_shfx, make_eager, steps=4, window=window)
    assert_bitwise(losses, ref_losses, model, ref)
    assert cm.program.num_slots == min(window, len(cm.stages.stages))
    cm.close()


def test_sgd_without_momentum_and_param_groups():
    make_shfx = lambda m: shfx.optim.SGD(_groups(m), lr=LR)
    make_eager = lambda r: torch.optim.SGD(_groups(r), lr=LR, fused=True)
    losses, ref_losses, _, cm, model, ref, opt = train_pair("bn_net", make_shfx, make_eager, steps=3,
                                                            sched=lambda o: L.StepLR(o, 1, 0.5))  # fmt: skip
    assert_bitwise(losses, ref_losses, model, ref)
    assert len(cm.optimizer.state) == 0 == len(opt.state)  # torch keeps no state without momentum
    cm.close()


@pytest.mark.parametrize("kind", [pytest.param("SGD", marks=pytest.mark.slow), "Adafactor"])
def test_sgd_and_adafactor_groups_on_device_updated_stages(kind):
    """SGD and Adafactor on the device (issue 25; once refused there): parameter groups with
    their own lr and weight decay and a scheduler, on ``resident``'s device updates, bitwise."""
    pairs = {
        "SGD": (lambda m: shfx.optim.SGD(_groups(m), lr=LR, momentum=0.9),
                lambda r: torch.optim.SGD(_groups(r), lr=LR, momentum=0.9, fused=True)),
        "Adafactor": (lambda m: shfx.optim.Adafactor(_groups(m), lr=LR),
                      lambda r: torch.optim.Adafactor(_groups(r), lr=LR, foreach=True)),
    }  # fmt: skip
    losses, ref_losses, _, cm, model, ref, _ = train_pair(
        "bn_net", *pairs[kind], steps=3, window=None, policy="resident", sched=lambda o: L.StepLR(o, 1, 0.5),
    )  # fmt: skip
    assert cm.variant.device_groups
    assert_bitwise(losses, ref_losses, model, ref)
    cm.close()


def test_an_optimizer_without_a_device_runner_refuses_device_updates():
    class HostOnlySGD(shfx.optim.SGD):
        on_device = False

    make_model, make_batch = ZOO["bn_net"]
    model = make_model()
    cm = shfx.compile(model, device=_device(), policy="resident", optimizer=HostOnlySGD(lr=LR))
    args, kwargs, _ = make_batch(0, 0)
    with pytest.raises(UsageError, match="shfx.optim.HostOnlySGD runs on the host only"):
        cm(*args, **kwargs)
    cm.close()


# ---- mixed precision and the step journal ---------------------------------------------------
@pytest.mark.parametrize("kind", ["SGD", "Adafactor"])
def test_bf16_working_copy(kind):
    """bf16 with fp32 masters: the eager recipe of tests/mixed_reference.py with torch's
    optimizer on the masters, then the cast into the working copy."""
    from mixed_reference import cast_inputs, make_working_copy

    make_shfx, make_eager = OPTIMIZERS[kind]
    make_model, make_batch = ZOO["gpt_tied"]
    torch.manual_seed(0)
    master = make_model()
    work = make_working_copy(master, torch.bfloat16)
    model = copy.deepcopy(master)
    cm = shfx.compile(model, device=_device(), window=2, precision="bf16", optimizer=make_shfx(model))
    opt = make_eager(master)
    mp, wp = dict(master.named_parameters()), dict(work.named_parameters())
    for step in range(3):
        args, kwargs, aux = make_batch(step, 0)
        torch.manual_seed(10_000 + 100 * step)
        loss = loss_of(cm(*args, **kwargs), aux)
        loss.backward()
        cm.step()
        cm.zero_grad()
        a, k = cast_inputs(args, kwargs, torch.bfloat16)
        torch.manual_seed(10_000 + 100 * step)
        ref_loss = loss_of(work(*a, **k), aux)
        ref_loss.backward()
        for n, p in wp.items():
            mp[n].grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for n, p in wp.items():
                p.copy_(mp[n])
        assert loss.item() == ref_loss.item()
    for n, p in model.named_parameters():
        assert torch.equal(p, mp[n]), n
    cm.close()


@pytest.mark.parametrize("kind", ["AdamW", "SGD", "Adafactor"])
def test_journal_rolls_back_every_optimizer(kind):
    """The journal saves what each optimizer's update overwrites: update every group after
    saving, roll back, and weights and state dict are as before, bitwise."""
    make_model, make_batch = ZOO["gpt_tied"]
    torch.manual_seed(0)
    model = make_model()
    cm = shfx.compile(model, device=_device(), window=2, overlap_update=False, rollback=True,
                      optimizer=OPTIMIZERS[kind][0](model))  # fmt: skip
    for step in range(2):
        args, kwargs, aux = make_batch(step, 0)
        loss_of(cm(*args, **kwargs), aux).backward()
        if step == 0:
            cm.step()
            cm.zero_grad()
    eng = cm.engine
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = {i: {k: v.clone() for k, v in s.items()} for i, s in cm.optimizer.state_dict()["state"].items()}
    hp = cm.optimizer.hyperparams()
    groups = [g for g, grp in enumerate(eng.store.groups) if grp.trainable_bytes]
    for g in groups:
        eng.journal.before_host_update(g)
        eng.optimizer.update(g, hp)
    assert any(not torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert eng.journal.rollback(eng.pool.region if eng.pool is not None else None) == groups
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    after = cm.optimizer.state_dict()["state"]
    for i, s in state.items():
        for k, v in s.items():
            assert torch.equal(after[i][k], v), (i, k)
    cm.step()  # the real step still applies
    cm.close()
