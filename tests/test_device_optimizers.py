"""SGD and Adafactor on the device (issue 25): ``Resident``, ``L2L`` and
``Stronghold(resident_first=k)`` update their groups on the device with ``shfx.optim.SGD``
(``torch._fused_sgd_``, as ``torch.optim.SGD(fused=True)``) and ``shfx.optim.Adafactor``
(torch's functional ``adafactor(foreach=True)``, as ``torch.optim.Adafactor(foreach=True)``),
bitwise as eager torch with the optimizer on the model's parameters; in 16 bits as the eager
mixed-precision recipe (fp32 masters, ``master.grad = p16.grad.float()``, ``GradScaler`` in
fp16: the fused SGD takes its scale and ``found_inf``, Adafactor's gradients are unscaled first
and its step skipped on an overflow), its fp32 masters on the device.

The loops seed once and never again (data from per-step generators): both sides consume the
same random numbers in the same order.
"""

from __future__ import annotations

import pytest
import torch

import shfx
from mixed_reference import cast_inputs, make_working_copy
from test_mixed_device import _poison_next_backward  # (the same injection: the head's gradient)
from zoo import ZOO, gpt, loss_of, token_batch

POLICIES = {
    "resident": lambda: shfx.Resident(),
    "l2l": lambda: shfx.L2L(),
    "k1": lambda: shfx.Stronghold(window=2, resident_first=1),
}

# (shfx optimizer, the torch optimizer it reproduces) with the same hyperparameters
OPTIMIZERS = {
    "sgd": (
        lambda: shfx.optim.SGD(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01, fused=True),
    ),
    "nesterov": (
        lambda: shfx.optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, fused=True),
    ),
    "adafactor": (
        lambda: shfx.optim.Adafactor(lr=1e-2, weight_decay=0.01),
        lambda ps: torch.optim.Adafactor(ps, lr=1e-2, weight_decay=0.01, foreach=True),
    ),
}



def _small():
    return gpt(layers=2, tie_weights=True)


ZOO = {**ZOO, "small": (_small, token_batch)}


def eager(name: str, opt: str, precision: str, steps: int, *, max_norm: float | None = None,
          init_scale: float | None = None, inf_at: int | None = None) -> dict:  # fmt: skip
    """Eager torch, seeded once: fp32 the model itself, 16-bit the mixed-precision recipe."""
    make, batch = ZOO[name]
    torch.manual_seed(0)
    model = make()
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    work = make_working_copy(model, dtype) if dtype is not None else model
    master, working = dict(model.named_parameters()), dict(work.named_parameters())
    optimizer = OPTIMIZERS[opt][1](list(master.values()))
    scaler = None
    if dtype == torch.float16:
        scaler = torch.amp.GradScaler("cpu", **({} if init_scale is None else {"init_scale": init_scale}))
    out = {"losses": [], "skipped": [], "norms": []}
    for step in range(steps):
        args, kwargs, aux = batch(step, 0)
        if dtype is not None:
            args, kwargs = cast_inputs(args, kwargs, dtype)
        loss = loss_of(work(*args, **kwargs), aux)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        out["losses"].append(loss.detach().clone())
        if inf_at == step:
            next(iter(working.values())).grad.view(-1)[0] = float("inf")
        if dtype is not None:
            for n, p16 in working.items():
                master[n].grad = None if p16.grad is None else p16.grad.to(torch.float32, copy=True)
                p16.grad = None
        grads = [p.grad for p in master.values() if p.grad is not None]
        found_inf = not all(bool(torch.isfinite(g).all()) for g in grads)
        if max_norm is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            out["norms"].append(torch.nn.utils.clip_grad_norm_(list(master.values()), max_norm))
        if scaler is not None:
            scaler.step(optimizer)  # (SGD fused: grad_scale and found_inf; Adafactor: unscaled, skipped on inf)
            scaler.update()
        elif not (found_inf and inf_at == step):  # skip_nonfinite: the poisoned step is skipped
            optimizer.step()
        out["skipped"].append(found_inf)
        if dtype is not None:
            with torch.no_grad():
                for n, p16 in working.items():
                    p16.copy_(master[n])
        optimizer.zero_grad()
    out["master"] = {k: v.detach().clone() for k, v in master.items()}
    out["state"] = {k: {n: t.clone() for n, t in optimizer.state[p].items()} for k, p in master.items() if p in optimizer.state}
    return out


def compiled(name: str, opt: str, precision: str, steps: int, policy, *, max_norm: float | None = None,
             init_scale: float | None = None, inf_at: int | None = None, **kw) -> dict:  # fmt: skip
    """shfx with the same seed, data and hyperparameters, seeded once."""
    make, batch = ZOO[name]
    torch.manual_seed(0)
    model = make()
    if init_scale is not None:
        kw["scaler"] = shfx.LossScaler(init_scale=init_scale)
    if inf_at is not None and precision != "fp16":
        kw["skip_nonfinite"] = True
    cm = shfx.compile(
        model, device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None), policy=policy, precision=precision,
        optimizer=OPTIMIZERS[opt][0](), max_grad_norm=max_norm, **kw,
    )  # fmt: skip
    out = {"losses": [], "skipped": [], "norms": [], "cm": cm, "model": model}
    for step in range(steps):
        args, kwargs, aux = batch(step, 0)
        loss = loss_of(cm(*args, **kwargs), aux)
        if inf_at == step:
            _poison_next_backward(cm)
        loss.backward()
        out["losses"].append(loss.detach().clone())
        cm.step()
        out["skipped"].append(cm.last_step_skipped)
        if max_norm is not None:
            cm.sync()
            out["norms"].append(cm.last_grad_norm.clone())
        cm.zero_grad()
    cm.sync()
    out["master"] = {k: v.detach().clone() for k, v in model.named_parameters()}
    by_name = {id(p): k for k, p in model.named_parameters()}
    out["state"] = {by_name[id(p)]: {n: t.clone() for n, t in s.items()} for p, s in cm.optimizer.state.items()}
    return out


def _assert_same(got: dict, ref: dict) -> None:
    assert len(got["losses"]) == len(ref["losses"])
    for i, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert torch.equal(a, b), (i, got["losses"], ref["losses"])
    assert got["skipped"] == ref["skipped"]
    for i, (a, b) in enumerate(zip(got["norms"], ref["norms"])):
        assert torch.equal(a, b), (i, got["norms"], ref["norms"])
    assert got["master"].keys() == ref["master"].keys()
    for k, v in ref["master"].items():
        assert got["master"][k].dtype == torch.float32
        assert torch.equal(got["master"][k], v), k
    # cm.optimizer.state (device states for the groups updated there) is torch's
    assert got["state"].keys() == ref["state"].keys()
    for k, st in ref["state"].items():
        assert got["state"][k].keys() == st.keys(), k
        for n, t in st.items():
            assert torch.equal(got["state"][k][n].cpu(), t), (k, n)


def _run(name, opt, precision, policy, steps=4, **kw):
    ref = eager(name, opt, precision, steps, **kw)
    got = compiled(name, opt, precision, steps, POLICIES[policy](), **kw)
    try:
        _assert_same(got, ref)
    finally:
        got["cm"].close()
    got["ref"] = ref
    return got


GRID = [(p, o, q) for p in POLICIES for o in OPTIMIZERS for q in ("fp32", "bf16", "fp16")]


@pytest.mark.slow
@pytest.mark.parametrize("policy,opt,precision", GRID)
def test_device_updates_with_sgd_and_adafactor_everywhere(policy, opt, precision):
    _run("small", opt, precision, policy, **({"init_scale": 1024.0} if precision == "fp16" else {}))


# ---- the defaults: one case of each thing, a few seconds ------------------------------------------
def test_sgd_fp16_overflow_rolls_back_device_and_host_updates():
    """SGD (dampening, weight decay) in fp16 with resident_first=1: the device group's fp32
    master and momentum on the device, the fused kernel skipping on the device flag; an inf in
    the head's gradient at step 1 (the step's last backward) skips the step on every side, the
    groups already updated rolled back, as GradScaler with torch.optim.SGD(fused=True)."""
    got = _run("small", "sgd", "fp16", "k1", steps=3, init_scale=1024.0, inf_at=1)
    assert got["skipped"] == [False, True, False]


def test_adafactor_skip_nonfinite_rolls_back_l2l_updates():
    """Adafactor on L2L's streamed stages (each updated in the backward, its 16-bit-free fp32
    slot copied back by OP): a poisoned step with skip_nonfinite is skipped, the updates that
    already ran undone from the journal's copies of the factored states and per-parameter steps."""
    got = _run("small", "adafactor", "fp32", "l2l", steps=3, inf_at=1)
    assert got["skipped"] == [False, True, False]


def test_adafactor_bf16_clipping_on_the_device_is_exact():
    """bf16, Resident: the widened gradient multiplied by the clip coefficient in DU, Adafactor
    on the device's fp32 masters: norms and weights bitwise clip_grad_norm_ + torch's Adafactor."""
    got = _run("small", "adafactor", "bf16", "resident", steps=3, max_norm=0.05)
    assert all(n > 0.05 for n in got["ref"]["norms"])  # (the clip bites)


@pytest.mark.slow
@pytest.mark.parametrize("opt", ["sgd", "nesterov", "adafactor"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_fp16_overflow_with_device_updates_everywhere(policy, opt):
    got = _run("small", opt, "fp16", policy, steps=4, init_scale=1024.0, inf_at=2)
    assert got["skipped"] == [False, False, True, False]


@pytest.mark.slow
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("policy,precision", [("resident", "fp32"), ("k1", "bf16"), ("k1", "fp16")])
def test_clipping_with_device_updates_everywhere(policy, precision, opt):
    got = _run("small", opt, precision, policy, steps=3, max_norm=0.05,
               **({"init_scale": 1024.0} if precision == "fp16" else {}))  # fmt: skip
    assert all(n > 0.05 for n in got["ref"]["norms"])


def _switch(cm, policy) -> None:
    """What cm.retune() does when the tuner picks another resident_first: the variant rebuilt
    with ``policy``, the optimizer states of the groups changing sides moved (take/put)."""
    import dataclasses

    from shfx.passes.pipeline import with_policy

    v = cm.variant
    new = dataclasses.replace(with_policy(v, policy), passes=v.passes)
    cm.engine.replace_variant(v, new)
    for sig, x in list(cm._variants.items()):
        if x is v:
            cm._variants[sig] = new
    if cm._last is v:
        cm._last = new


@pytest.mark.parametrize("opt,precision", [("adafactor", "fp32"), pytest.param("sgd", "bf16", marks=pytest.mark.slow),
                                           pytest.param("nesterov", "fp32", marks=pytest.mark.slow),
                                           pytest.param("adafactor", "bf16", marks=pytest.mark.slow)])  # fmt: skip
def test_states_move_between_host_and_device_runners(opt, precision):
    """resident_first 0 -> 1 -> 0 between steps (as a retune that changes it): the head's group
    moves from the host runner to the device runner (its states, per-parameter steps included,
    taken from one and put into the other) and back, its device state saved and loaded in
    torch's format on the way; training is eager torch's throughout."""
    steps = 6
    ref = eager("small", opt, precision, steps)
    make, batch = ZOO["small"]
    torch.manual_seed(0)
    model = make()
    k0, k1 = shfx.Stronghold(window=2, resident_first=0), shfx.Stronghold(window=2, resident_first=1)
    cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None), policy=k0,
                      precision=precision, optimizer=OPTIMIZERS[opt][0]())  # fmt: skip
    losses = []
    try:
        for step in range(steps):
            if step in (2, 4):
                _switch(cm, k1 if step == 2 else k0)
                assert bool(cm.variant.device_groups) == (step == 2)
            if step == 3:  # the device group's state through state_dict and back (load_group into the device state)
                sd = cm.optimizer.state_dict()
                sd = {"state": {i: {n: t.clone() for n, t in e.items()} for i, e in sd["state"].items()},
                      "param_groups": sd["param_groups"]}  # fmt: skip
                cm.optimizer.load_state_dict(sd)
            args, kwargs, aux = batch(step, 0)
            loss = loss_of(cm(*args, **kwargs), aux)
            loss.backward()
            losses.append(loss.detach().clone())
            cm.step()
            cm.zero_grad()
        cm.sync()
        assert all(torch.equal(a, b) for a, b in zip(losses, ref["losses"])), (losses, ref["losses"])
        for k, p in model.named_parameters():
            assert torch.equal(p.detach(), ref["master"][k]), k
    finally:
        cm.close()


LEDGER = [(p, o, q) for p in POLICIES for o, q in (("sgd", "fp32"), ("adafactor", "bf16"), ("adafactor", "fp32"), ("sgd", "fp16"))]


@pytest.mark.parametrize(
    "policy,opt,precision", [c if c == ("k1", "adafactor", "bf16") else pytest.param(*c, marks=pytest.mark.slow) for c in LEDGER]
)
def test_device_states_are_the_ledgers(policy, opt, precision):
    """The device runners' reservations are the ledger's with the optimizer's states
    (``cm.optimizer.host_states``): SGD one momentum buffer per device group, Adafactor one
    buffer of factored second moments (``factored states of group g``), beside the fp32 master
    in 16 bits; with rollback the journal's host copies (per-parameter steps too) are the
    ledger's ``rollback copies``."""
    from test_ledger import _by_event, _compare

    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for policy in (POLICIES[policy](),):
        torch.manual_seed(0)
        cm = shfx.compile(_small(), device=shfx.EmulatedDevice(memory="64MiB"), policy=policy, precision=precision,
                          optimizer=OPTIMIZERS[opt][0](), rollback=True)  # fmt: skip
        try:
            with cm.backend.recording() as log:
                cm(x, x).backward()
                cm.step()
            cm.zero_grad()
            cm(x, x).backward()  # (the journal copies a group's states from its second update on)
            cm.step()
            states = cm.optimizer.host_states(cm.variant.graph.groups)
            led = cm.variant.ledger(rollback=True, optimizer=states)
            where = f"{cm.program.name} with {opt} in {precision}"
            runtime = _by_event((e.event, e.term, e.what, e.nbytes) for e in log)
            ledger = _by_event((e.event, c.term, c.what, c.nbytes) for e in led.entries for c in e.changes if c.tier == "device")
            _compare(runtime, {k: v for k, v in ledger.items() if v}, where)
            assert cm.backend.peak_bytes == led.peak(), where
            static = led.static("device")
            dev = [g for g in cm.variant.graph.groups if g.index in cm.variant.device_groups and g.trainable_bytes]
            per = states.per_element * sum(g.state_bytes for g in dev) + sum(states.whole_bytes(g.index) for g in dev)
            assert static["optimizer states"] == per + sum(g.master_bytes for g in dev if g.dtypes.mixed), where
            assert per < 2 * sum(g.state_bytes for g in dev)  # less than AdamW's m and v
            assert led.static("host")["rollback copies"] == cm.engine.journal.host_bytes, where
        finally:
            cm.close()
