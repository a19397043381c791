"""16-bit precision with updates on the device (issue 25): ``Resident``, ``L2L`` and
``Stronghold(resident_first=k)`` in bf16 and fp16 train like the eager mixed-precision recipe
(``tests/mixed_reference.py``: a 16-bit working copy, fp32 masters and fused AdamW on them,
``master.grad = p16.grad.float()``, ``p16.copy_(master)``; fp16 with ``GradScaler``), the device
holding each group's fp32 master beside its m and v.

The loops here seed once and never again (the data comes from per-step generators, dropout
draws from the global stream as it goes): both sides consume the same random numbers in the
same order.
"""

from __future__ import annotations

import copy

import pytest
import torch

import shfx
from mixed_reference import bits_of, cast_inputs, make_working_copy
from zoo import ZOO, loss_of

POLICIES = {
    "resident": lambda: shfx.Resident(),
    "l2l": lambda: shfx.L2L(),
    "k1": lambda: shfx.Stronghold(window=2, resident_first=1),
}
LR, WD = 1e-2, 0.01


def eager(name: str, precision: str, steps: int, *, seed: int = 0, max_norm: float | None = None,
          init_scale: float | None = None, inf_at: int | None = None) -> dict:  # fmt: skip
    """The eager recipe, seeded once."""
    make, batch = ZOO[name]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    torch.manual_seed(seed)
    model = make()
    work = make_working_copy(model, dtype)
    master, working = dict(model.named_parameters()), dict(work.named_parameters())
    opt = torch.optim.AdamW(list(master.values()), lr=LR, weight_decay=WD, fused=True)
    scaler = None
    if dtype == torch.float16:
        scaler = torch.amp.GradScaler("cpu", **({} if init_scale is None else {"init_scale": init_scale}))
    out = {"losses": [], "skipped": [], "scales": [], "norms": []}
    for step in range(steps):
        args, kwargs, aux = batch(step, 0)
        args, kwargs = cast_inputs(args, kwargs, dtype)
        loss = loss_of(work(*args, **kwargs), aux)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        out["losses"].append(loss.detach().clone())
        if inf_at == step:
            next(iter(working.values())).grad.view(-1)[0] = float("inf")
        for n, p16 in working.items():
            master[n].grad = None if p16.grad is None else p16.grad.to(torch.float32, copy=True)
            p16.grad = None
        grads = [p.grad for p in master.values() if p.grad is not None]
        found_inf = not all(bool(torch.isfinite(g).all()) for g in grads)
        if max_norm is not None:
            if scaler is not None:
                scaler.unscale_(opt)
            out["norms"].append(torch.nn.utils.clip_grad_norm_(list(master.values()), max_norm))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            out["skipped"].append(found_inf)
            out["scales"].append(scaler.get_scale())
        else:
            opt.step()
        with torch.no_grad():
            for n, p16 in working.items():
                p16.copy_(master[n])
        opt.zero_grad()
    out["master"] = {k: v.detach().clone() for k, v in master.items()}
    out["state"] = {k: (opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()) for k, p in master.items() if p in opt.state}
    return out


def compiled(name: str, precision: str, steps: int, policy, *, seed: int = 0, max_norm: float | None = None,
             init_scale: float | None = None, inf_at: int | None = None, memory: str = "256MiB", **kw) -> dict:  # fmt: skip
    """shfx with the same seed, data and hyperparameters, seeded once."""
    make, batch = ZOO[name]
    torch.manual_seed(seed)
    model = make()
    if init_scale is not None:
        kw["scaler"] = shfx.LossScaler(init_scale=init_scale)
    cm = shfx.compile(
        model, device=shfx.EmulatedDevice(memory=memory, h2d=None, d2h=None), policy=policy, precision=precision,
        optimizer=shfx.optim.AdamW(lr=LR, weight_decay=WD), max_grad_norm=max_norm, **kw,
    )  # fmt: skip
    out = {"losses": [], "skipped": [], "scales": [], "norms": [], "cm": cm, "model": model}
    for step in range(steps):
        args, kwargs, aux = batch(step, 0)
        loss = loss_of(cm(*args, **kwargs), aux)
        if inf_at == step:
            _poison_next_backward(cm)
        loss.backward()
        out["losses"].append(loss.detach().clone())
        cm.step()
        out["skipped"].append(cm.last_step_skipped)
        out["scales"].append(cm.scaler.scale if cm.scaler is not None else None)
        if max_norm is not None:
            cm.sync()
            out["norms"].append(cm.last_grad_norm.clone())
        cm.zero_grad()
    cm.sync()
    out["master"] = {k: v.detach().clone() for k, v in model.named_parameters()}
    return out


def _poison_next_backward(cm) -> None:
    """Write inf into element 0 of the first parameter's gradient (the head's, the last backward)."""
    router = cm.engine.gradients
    orig = router.write

    def write(ctx, stage, slot, views, keys, grads, grads_to):
        if stage.index == 0:
            grads = list(grads)
            grads[0] = grads[0].clone()
            grads[0].view(-1)[0] = float("inf")
            router.write = orig
        return orig(ctx, stage, slot, views, keys, grads, grads_to)

    router.write = write


def _assert_same(got: dict, ref: dict) -> None:
    assert len(got["losses"]) == len(ref["losses"])
    for i, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert torch.equal(a, b), (i, got["losses"], ref["losses"])
    assert got["skipped"] == ref["skipped"] or not ref["skipped"]
    assert got["scales"] == ref["scales"] or not ref["scales"]
    for i, (a, b) in enumerate(zip(got["norms"], ref["norms"])):
        assert torch.equal(a, b), (i, got["norms"], ref["norms"])
    assert got["master"].keys() == ref["master"].keys()
    for k, v in ref["master"].items():
        assert got["master"][k].dtype == torch.float32
        assert torch.equal(got["master"][k], v), k


def _run(name, precision, policy, steps=4, **kw):
    ref = eager(name, precision, steps, **kw)
    got = compiled(name, precision, steps, POLICIES[policy](), **kw)
    try:
        _assert_same(got, ref)
    finally:
        got["cm"].close()
    got["ref"] = ref
    return got


FAST = [("l2l", "bf16")]  # (the fp16 overflow test below trains k1, the bf16 clipping one resident)
GRID = [(p, q) for p in POLICIES for q in ("bf16", "fp16") if (p, q) not in FAST]


@pytest.mark.parametrize("policy,precision", FAST)
def test_device_updates_train_like_the_eager_recipe(policy, precision):
    # (fp16: GradScaler's default 2**16 overflows the first step, skipped on both sides)
    _run("gpt_tied", precision, policy, steps=3)


@pytest.mark.slow
@pytest.mark.parametrize("policy,precision", GRID)
def test_device_updates_train_like_the_eager_recipe_everywhere(policy, precision):
    _run("gpt_tied", precision, policy)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_dropout", "bn_net", "hf_style"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_other_models_with_device_updates(name, policy):
    """Dropout drawn from the one seeded stream, BatchNorm's fp32 affine part beside the 16-bit
    one in a group (widened and rebuilt part by part), keyword inputs."""
    _run(name, "bf16", policy, steps=3)


@pytest.mark.parametrize("policy", [pytest.param(p, marks=[] if p == "k1" else [pytest.mark.slow]) for p in POLICIES])
def test_fp16_overflow_skips_the_step_on_every_side(policy):
    """An inf in the head's gradient at step 2 (its backward is the step's last): the updates of
    the other groups, on the device and on the host, already ran and are rolled back; the step is
    skipped and the scale backed off once, as GradScaler does."""
    got = _run("gpt_tied", "fp16", policy, steps=4, init_scale=1024.0, inf_at=2)
    assert got["skipped"] == [False, False, True, False]
    assert got["scales"][2] == got["scales"][1] / 2


@pytest.mark.parametrize("policy", ["resident", pytest.param("k1", marks=pytest.mark.slow)])
def test_bf16_clipping_with_device_updates_is_exact(policy):
    """Exact clipping over fp32 master gradients widened on the device (bf16): the norms, the
    coefficient and the weights are eager's clip_grad_norm_ + fused AdamW's, bitwise."""
    got = _run("gpt_tied", "bf16", policy, steps=3, max_norm=0.05)
    assert all(n > 0.05 for n in got["ref"]["norms"])  # (the clip bites)


def _accumulated(policy: str, precision: str, steps: int = 3, accum: int = 2, inf_at: int | None = None) -> dict:
    """shfx with ``grad_accum_steps=accum`` as :func:`mixed_reference.train_mixed_eager` trains
    (its seeds, data and loss; fp16 with ``init_scale=1024``); ``inf_at``: inf in the first
    parameter's gradient at the last micro-step of that step (the eager side's ``inject_inf``)."""
    from zoo import gpt, token_batch

    torch.manual_seed(0)
    model = gpt(layers=2, tie_weights=True)
    kw = {"scaler": shfx.LossScaler(init_scale=1024.0)} if precision == "fp16" else {}
    cm = shfx.compile(
        model, device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None), policy=POLICIES[policy](),
        precision=precision, optimizer=shfx.optim.AdamW(lr=LR, weight_decay=WD), grad_accum_steps=accum, **kw,
    )  # fmt: skip
    out: dict = {"loss_bits": [], "skipped": [], "scales": [], "cm": cm}
    for step in range(steps):
        for micro in range(accum):
            args, kwargs, aux = token_batch(step, micro)
            torch.manual_seed(10_000 + 100 * step + micro)
            loss = loss_of(cm(*args, **kwargs), aux) / accum
            if inf_at == step and micro == accum - 1:
                _poison_next_backward(cm)
            loss.backward()
            out["loss_bits"].append(bits_of(loss))
            if step == 0 and micro == 0:  # the device peak and host bytes of the first micro-step: the ledger's
                led = cm.variant.ledger(accum, rollback=cm.engine.journal.enabled)
                out["ledger"] = (cm.backend.peak_bytes, led.peak(), led.static("device"))
        cm.step()
        out["skipped"].append(cm.last_step_skipped)
        out["scales"].append(cm.scaler.scale if cm.scaler is not None else None)
        cm.zero_grad()
    cm.sync()
    out["master"] = {k: v.detach().clone() for k, v in model.named_parameters()}
    return out


ACCUM = [("k1", "fp16")]  # (a tied embedding: its head's borrowed 16-bit contribution summed before the widening)
ACCUM_GRID = [(p, q) for p in ("resident", "k1") for q in ("bf16", "fp16") if (p, q) not in ACCUM]


@pytest.mark.parametrize("policy,precision", ACCUM + [pytest.param(*c, marks=pytest.mark.slow) for c in ACCUM_GRID])
def test_gradient_accumulation_with_device_updates_sums_in_fp32(policy, precision):
    """grad_accum_steps=2 with groups updated on the device in 16 bits: each micro-step's 16-bit
    device gradient is widened into an fp32 accumulator on the device (copied at the first
    micro-step, added at the next: the recipe's ``master.grad += p16.grad.float()``), which the
    DU reads; losses and fp32 masters bitwise the eager recipe's. The accumulators are device
    memory the ledger counts (term ``gradients``, 4 B/param of each device group): the emulated
    device's peak is the ledger's, and the closed form's device terms are the ledger's too."""
    from mixed_reference import train_mixed_eager
    from zoo import gpt, token_batch

    make = lambda: gpt(layers=2, tie_weights=True)  # noqa: E731
    ref = train_mixed_eager(make, token_batch, precision, 3, grad_accum=2, lr=LR, weight_decay=WD,
                            scaler_kwargs={"init_scale": 1024.0} if precision == "fp16" else None)  # fmt: skip
    got = _accumulated(policy, precision)
    cm = got["cm"]
    try:
        assert got["loss_bits"] == ref["loss_bits"]
        assert got["skipped"] == ref["skipped"] and got["scales"] == ref["scales"]
        for k, v in ref["master"].items():
            assert torch.equal(got["master"][k], v), k
        peak, led_peak, static = got["ledger"]
        assert peak == led_peak
        dev = [grp for grp in cm.variant.graph.groups if grp.index in cm.variant.device_groups and grp.trainable_bytes]
        assert sorted(cm.engine.gradients.acc32) == [grp.index for grp in dev]
        assert static["gradients"] == sum(cm.variant.grad_buffer_sizes) + sum(grp.master_bytes for grp in dev)
    finally:
        cm.close()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["resident", "k1"])
def test_fp16_overflow_under_accumulation_with_device_updates(policy):
    """An inf in the last micro-step's gradient (the accumulator holds it): the step is skipped on
    every side, rolled back, the scale backed off once, as GradScaler does."""
    from mixed_reference import train_mixed_eager
    from zoo import gpt, token_batch

    make = lambda: gpt(layers=2, tie_weights=True)  # noqa: E731
    first = next(n for n, _ in make().named_parameters())
    ref = train_mixed_eager(make, token_batch, "fp16", 3, grad_accum=2, lr=LR, weight_decay=WD,
                            scaler_kwargs={"init_scale": 1024.0}, inject_inf={1: first})  # fmt: skip
    got = _accumulated(policy, "fp16", inf_at=1)
    try:
        assert got["loss_bits"] == ref["loss_bits"]
        assert got["skipped"] == ref["skipped"] == [False, True, False]
        assert got["scales"] == ref["scales"]
        for k, v in ref["master"].items():
            assert torch.equal(got["master"][k], v), k
    finally:
        got["cm"].close()


def test_the_closed_form_counts_the_fp32_accumulators():
    """The GPT closed form under accumulation in 16 bits (the device groups' fp32 accumulators
    among the device gradients) is the ledger of the real capture."""
    from dataclasses import replace

    from shfx.cost_model.planner import Target, memory_for_model, memory_model
    from shfx.models import GPT, GPTShape

    emu = Target("emulated", 1 << 40, emulated=True)
    fam = GPTShape(hidden=32, heads=2, seq=16, batch=2, vocab=64, layers=3)
    with torch.device("meta"):
        model = GPT(fam)
        idx = torch.zeros(fam.batch, fam.seq, dtype=torch.long)
    for policy, kw in (("resident", {}), ("stronghold", {"window": 2, "resident_first": 1})):
        one = memory_model(policy, replace(fam, precision="bf16"), emu, **kw)
        want = memory_model(policy, replace(fam, precision="bf16"), emu, grad_accum_steps=2, **kw)
        got = memory_for_model(policy, model, (idx, idx), emu, precision="bf16", grad_accum_steps=2, **kw)
        assert (got.device, got.host) == (want.device, want.host), policy
        masters = want.device["optimizer states"] // 3  # (fp32 master, m, v: one accumulator's bytes)
        assert want.device["gradients"] == one.device["gradients"] + masters > one.device["gradients"]


@pytest.mark.slow
def test_state_dict_and_checkpoint_resume_with_device_masters(tmp_path):
    """The model's parameters (``cm.state_dict()``, checkpoints) are the device's fp32 masters
    after a sync; a run saved after 2 steps and resumed in a new compiled model (whose device
    masters are read from the loaded host masters) ends as the 4-step run, bitwise."""
    ref = eager("gpt_tied", "bf16", 4)
    first = compiled("gpt_tied", "bf16", 2, shfx.Stronghold(window=2, resident_first=1))
    cm = first["cm"]
    sd = cm.state_dict()
    for k, v in first["master"].items():
        assert torch.equal(sd[k], v), k
    cm.save_checkpoint(str(tmp_path / "ck"))
    cm.close()
    make, batch = ZOO["gpt_tied"]
    model = make()
    cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None),
                      policy=shfx.Stronghold(window=2, resident_first=1), precision="bf16",
                      optimizer=shfx.optim.AdamW(lr=LR, weight_decay=WD))  # fmt: skip
    cm.load_checkpoint(str(tmp_path / "ck"))
    for step in (2, 3):
        args, kwargs, aux = batch(step, 0)
        loss = loss_of(cm(*args, **kwargs), aux)
        loss.backward()
        assert torch.equal(loss.detach(), ref["losses"][step])
        cm.step()
        cm.zero_grad()
    cm.sync()
    for k, v in ref["master"].items():
        assert torch.equal(dict(model.named_parameters())[k], v), k
    cm.close()


@pytest.mark.parametrize(
    "policy,precision", [("resident", "fp16"), pytest.param("l2l", "bf16", marks=pytest.mark.slow),
                         pytest.param("k1", "fp16", marks=pytest.mark.slow)],
)  # fmt: skip
def test_device_and_host_memory_are_the_ledger(policy, precision):
    """The device holds each device group's fp32 master beside m and v (ledger term ``optimizer
    states``): the emulated device's peak and the host's bytes are the ledger's (fp16: with the
    rollback copies of the 16-bit slot weights and the device masters)."""
    from zoo import gpt

    torch.manual_seed(0)
    kw = {"scaler": shfx.LossScaler(init_scale=1024.0)} if precision == "fp16" else {}
    cm = shfx.compile(gpt(layers=3, tie_weights=True), device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None),
                      policy=POLICIES[policy](), precision=precision, optimizer=shfx.optim.AdamW(lr=LR), **kw)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
    try:
        with cm.backend.recording():
            cm(x, y).backward()
            cm.step()
        led = cm.variant.ledger(rollback=cm.engine.journal.enabled)
        assert cm.backend.peak_bytes == led.peak()
        dev = led.static("device")
        dev_groups = [grp for grp in cm.variant.graph.groups if grp.index in cm.variant.device_groups]
        masters = sum(grp.master_bytes for grp in dev_groups)
        states = sum(2 * grp.state_bytes for grp in dev_groups)
        assert dev["optimizer states"] == masters + states
        cm.zero_grad()
        cm(x, y).backward()
        cm.step()
        assert cm.engine.host_bytes() == sum(led.static("host").values())
    finally:
        cm.close()


@pytest.mark.slow
def test_a_device_too_small_for_the_masters_is_refused_with_the_bytes_needed():
    from zoo import gpt

    torch.manual_seed(0)
    model = gpt(layers=3, tie_weights=True)
    probe = shfx.compile(copy.deepcopy(model), device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None),
                         policy="resident", precision="bf16", optimizer=shfx.optim.AdamW(lr=LR))  # fmt: skip
    x = torch.randint(0, 64, (2, 16))
    probe(x, x)
    need = sum(probe.variant.ledger().static("device").values())
    masters = sum(grp.master_bytes for grp in probe.variant.graph.groups if grp.trainable_bytes)
    probe.close()
    cm = shfx.compile(model, device=shfx.EmulatedDevice(memory=need - 1, h2d=None, d2h=None), policy="resident",
                      precision="bf16", optimizer=shfx.optim.AdamW(lr=LR))  # fmt: skip
    with pytest.raises(shfx.OutOfDeviceMemory) as e:
        cm(x, x)
    assert e.value.needed_bytes == need and need > masters
    cm.close()
