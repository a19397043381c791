"""Mixed precision (``shfx.compile(precision="bf16" | "fp16")``): training equal to the bit to
the eager recipe of ``tests/mixed_reference.py`` (a 16-bit model copy, fp32 master weights and
``torch.optim.AdamW(fused=True)`` on them, fp16 with ``torch.amp.GradScaler``), the bytes on the
link halved, the ledger's memory, overflow skipping and non-finite gradients.

The fast subset runs by default; the whole matrix (every zoo model, windows 1, 2 and all, both
precisions) with ``SHFX_SLOW=1``.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import shfx
from mixed_reference import train_mixed_eager
from mixed_shfx import train_mixed_shfx
from zoo import ZOO, gpt

ALL = 99  # a window larger than any zoo model's stages: all of them
STEPS = 5


@functools.lru_cache(maxsize=None)
def _reference(name: str, precision: str, steps: int = STEPS, **kw):
    make, batch = ZOO[name]
    return train_mixed_eager(make, batch, precision, steps, **dict(kw))


def _assert_equal_to_reference(name: str, precision: str, window: int, **kw) -> dict:
    make, batch = ZOO[name]
    ref = _reference(name, precision, **kw)
    # a loss computed outside the model is scaled there, as GradScaler.scale(loss) is
    got = train_mixed_shfx(make, batch, precision, STEPS, window=window, scale_outside=name == "skip_cnn", **kw)
    try:
        assert got["loss_bits"] == ref["loss_bits"], (got["losses"], ref["losses"])
        assert got["skipped"] == ref["skipped"]
        assert got["scales"] == ref["scales"]
        assert got["master"].keys() == ref["master"].keys()
        for k, v in ref["master"].items():
            assert got["master"][k].dtype == torch.float32
            assert torch.equal(got["master"][k], v), k
        # the working copy the device trains on is the master's cast
        opt = got["cm"].engine.optimizer
        assert opt is not None
        return {"device_dtypes": dict(got["cm"].variant.captured.device_dtypes), "losses": got["losses"]}
    finally:
        got["cm"].close()


FAST = [
    ("gpt_tied", "bf16", 1), ("gpt_mask", "bf16", 2), ("gpt_dropout", "bf16", 2),
    ("skip_cnn", "bf16", 2), ("hf_style", "bf16", 2), ("gpt_tied", "fp16", 2), ("bn_net", "fp16", 1),
]  # fmt: skip  (the MATRIX below, SHFX_SLOW=1, has every model x precision x window)
MATRIX = [(n, p, w) for n in ZOO for p in ("bf16", "fp16") for w in (1, 2, ALL)]


@pytest.mark.parametrize("name,precision,window", FAST, ids=[f"{n}-{p}-W{w}" for n, p, w in FAST])
def test_trains_like_the_eager_recipe(name, precision, window):
    _assert_equal_to_reference(name, precision, window)


@pytest.mark.slow
@pytest.mark.parametrize("name,precision,window", MATRIX, ids=[f"{n}-{p}-W{w}" for n, p, w in MATRIX])
def test_trains_like_the_eager_recipe_everywhere(name, precision, window):
    _assert_equal_to_reference(name, precision, window)


NORMS = [("gpt_tied", "bf16", 2), ("hf_style", "bf16", 1), ("gpt_mask", "fp16", ALL)]


@pytest.mark.parametrize("name,precision,window", NORMS, ids=[f"{n}-{p}-W{w}" for n, p, w in NORMS])
def test_fp32_norms_train_like_the_eager_recipe(name, precision, window):
    """``fp32_norms=True``: LayerNorm parameters stay fp32 in the working copy (16-bit input,
    fp32 gain and bias, 16-bit output: torch's kernel), bitwise as the eager recipe that keeps them."""
    got = _assert_equal_to_reference(name, precision, window, fp32_norms=True)
    norms = [n for n, m in ZOO[name][0]().named_modules() if isinstance(m, torch.nn.LayerNorm)]
    assert norms
    kept = [n for n in norms if f"{n}.weight" not in got["device_dtypes"]]
    assert kept == norms, "every LayerNorm weight stays fp32 on the device"
    assert any(d != torch.float32 for d in got["device_dtypes"].values())
    # and it is another recipe: the master weights differ from the all-16-bit copy's
    kept_ref, all16 = _reference(name, precision, fp32_norms=True)["master"], _reference(name, precision)["master"]
    assert any(not torch.equal(v, all16[k]) for k, v in kept_ref.items())


def test_fp32_norms_needs_a_16_bit_precision():
    with pytest.raises(ValueError, match="fp32_norms=True.*precision='bf16'"):
        shfx.compile(gpt(), fp32_norms=True)


def _compile(model, precision, **kw):
    kw.setdefault("device", shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None))
    kw.setdefault("optimizer", shfx.optim.AdamW(lr=1e-2))
    return shfx.compile(model, precision=precision, **kw)


def _tokens(step: int = 0):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_prefetches_half_the_bytes_and_casts_gradients_on_the_device(tied):
    """Parameters cross the link in 16 bits: exactly half of fp32's prefetch bytes (every tensor
    of this GPT is a multiple of 32 elements, so no alignment padding differs). Gradients are
    cast to fp32 on the device and copied straight into the host gradient
    (``passes.layout.device_cast_groups``): an untied model sends fp32's gradient bytes and
    needs no host staging buffer; with a tied embedding the owner's gradient and the tail's
    borrowed share stay 16-bit (autograd sums them in bf16), so fewer bytes than fp32 but more
    than half. Counted by the backend and equal to the program's."""
    moved, staging = {}, {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        cm = _compile(gpt(layers=3, tie_weights=tied), precision, window=2)
        x, y = _tokens()
        cm(x, y).backward()  # the first call captures and sets up
        cm.step()
        cm.zero_grad()
        b = cm.backend
        h2d0, d2h0 = b.bytes_h2d, b.bytes_d2h
        cm(x, y).backward()
        cm.step()
        cm.zero_grad()
        moved[precision] = (b.bytes_h2d - h2d0, b.bytes_d2h - d2h0)
        prog = cm.program.bytes_moved()
        assert moved[precision] == (prog["h2d"], prog["d2h"]), precision
        staging[precision] = cm.engine.store.staging_bytes
        cm.close()
    assert moved["bf16"][0] * 2 == moved["fp32"][0]
    assert moved["bf16"][1] > 0
    if tied:
        assert moved["fp32"][1] // 2 < moved["bf16"][1] < moved["fp32"][1]
        assert staging["bf16"] > 0
    else:
        assert moved["bf16"][1] == moved["fp32"][1]
        assert staging["bf16"] == 0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_device_and_host_memory_are_the_ledger(precision):
    torch.manual_seed(0)
    kw = {"scaler": shfx.LossScaler(init_scale=1024.0)} if precision == "fp16" else {}  # (2**16 skips step 1)
    cm = _compile(gpt(layers=3, tie_weights=True), precision, window=2, **kw)
    x, y = _tokens()
    try:
        with cm.backend.recording():
            cm(x, y).backward()
            cm.step()
        led = cm.variant.ledger(rollback=cm.engine.journal.enabled)
        assert cm.backend.peak_bytes == led.peak()
        cm.zero_grad()
        cm(x, y).backward()  # (the rollback copies of the states exist from the second step on)
        cm.step()
        assert cm.engine.host_bytes() == sum(led.static("host").values())
        host = led.static("host")
        groups = cm.variant.graph.groups
        assert host["working copy (16-bit)"] == sum(g.param_end for g in groups)
        assert host["working copy (16-bit)"] * 2 <= host["master parameters (fp32)"] + 64 * len(groups) * 8
        assert (precision == "fp16") == bool(host.get("rollback copies"))  # fp16 rolls back overflowing steps
    finally:
        cm.close()


def test_the_model_keeps_fp32_master_weights():
    torch.manual_seed(0)
    model = gpt(layers=2)
    cm = _compile(model, "bf16")
    x, y = _tokens()
    loss = cm(x, y)
    assert loss.dtype == torch.float32  # the GPT computes its loss on logits.float()
    loss.backward()
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, n
    cm.step()
    sd = model.state_dict()
    assert all(v.dtype == torch.float32 for v in sd.values())
    cm.close()


def _poison_stage0(cm, steps: set[int], counter: list[int], wait_for_updates: bool = True):
    """Make the backward of stage 0 (the last one to run) write inf into its first parameter's
    gradient at the given step, after the updates of the other stages have started."""
    router = cm.engine.gradients
    orig = router.write

    def write(ctx, stage, slot, views, keys, grads, grads_to):
        if stage.index == 0 and counter[0] in steps:
            if wait_for_updates:
                for _, tok in list(cm.engine.pending_updates):
                    tok.wait()  # the updates of the later stages have run
            grads = list(grads)
            grads[0] = grads[0].clone()
            grads[0].view(-1)[0] = float("inf")
        if stage.index == 0:
            counter[0] += 1
        return orig(ctx, stage, slot, views, keys, grads, grads_to)

    router.write = write
    return keys_of_stage0(cm)


def keys_of_stage0(cm):
    st = cm.variant.graph.stages[0]
    return [k for k in st.params if k in st.trainable]


def test_fp16_overflow_in_a_late_stage_is_skipped_and_training_goes_on_as_eager():
    """An inf in the gradient of stage 0, whose backward runs last, after the host updates of
    the other stages have run: the step is skipped (those updates rolled back), masters and m, v
    bitwise as before it, the scale backs off, and the next steps equal the eager recipe's
    with the same overflow."""
    make, batch = ZOO["gpt_tied"]
    torch.manual_seed(0)
    model = make()
    cm = _compile(model, "fp16", window=2, scaler=shfx.LossScaler(init_scale=1024.0))
    counter = [0]
    losses = []
    before = None
    for step in range(4):
        args, _, _ = batch(step)
        torch.manual_seed(10_000 + 100 * step)
        loss = cm(*args)
        if step == 0:  # (the first call captured the model)
            first = _poison_stage0(cm, {1}, counter)[0]
        if step == 1:
            before = {k: v.detach().clone() for k, v in model.named_parameters()}
            states = {g: (st.exp_avg.clone(), st.exp_avg_sq.clone(), st.step.clone()) for g, st in cm.engine.optimizer.state.items()}
        loss.backward()
        if step == 1:
            assert cm.engine.journal.applied, "no update had run before the overflow"
        cm.step()
        losses.append(loss.item())
        if step == 1:
            assert cm.last_step_skipped
            assert cm.scaler.scale == 512.0
            for k, v in model.named_parameters():
                assert torch.equal(v, before[k]), k
            for g, (m, v, s) in states.items():
                st = cm.engine.optimizer.state[g]
                assert torch.equal(st.exp_avg, m) and torch.equal(st.exp_avg_sq, v) and torch.equal(st.step, s)
        else:
            assert not cm.last_step_skipped
        cm.zero_grad()
    ref = train_mixed_eager(make, batch, "fp16", 4, scaler_kwargs={"init_scale": 1024.0}, inject_inf={1: first})
    assert ref["skipped"] == [False, True, False, False]
    assert losses == ref["losses"]
    for k, v in ref["master"].items():
        assert torch.equal(dict(model.named_parameters())[k], v), k
    assert cm.scaler.scale == ref["scales"][-1]
    cm.close()


def test_fp16_overflow_with_zero_offload_skips_as_eager():
    """ZeRO-Offload keeps every stage persistent and refreshes it after its update, in the
    backward: an overflow in stage 0 fails its update, and with it the refresh waiting for that
    update, which is not the backward's failure (it failed the backward, issue 25): step()
    skips the step, the scale backs off, and training equals the eager recipe's."""
    make, batch = ZOO["gpt_tied"]
    torch.manual_seed(0)
    model = make()
    cm = _compile(model, "fp16", policy="zero-offload", scaler=shfx.LossScaler(init_scale=1024.0))
    counter, losses = [0], []
    for step in range(3):
        args, _, _ = batch(step)
        torch.manual_seed(10_000 + 100 * step)
        loss = cm(*args)
        if step == 0:
            first = _poison_stage0(cm, {1}, counter)[0]
        loss.backward()
        cm.step()
        losses.append(loss.item())
        assert cm.last_step_skipped == (step == 1)
        cm.zero_grad()
    ref = train_mixed_eager(make, batch, "fp16", 3, scaler_kwargs={"init_scale": 1024.0}, inject_inf={1: first})
    assert ref["skipped"] == [False, True, False] and losses == ref["losses"]
    for k, v in ref["master"].items():
        assert torch.equal(dict(model.named_parameters())[k], v), k
    cm.close()


@pytest.mark.parametrize("rollback,overlap", [(True, True), (None, False)], ids=["rollback", "no-overlap"])
def test_bf16_nonfinite_gradient_names_the_stage_and_changes_nothing(rollback, overlap):
    torch.manual_seed(0)
    model = gpt(layers=3)
    cm = _compile(model, "bf16", window=2, rollback=rollback, overlap_update=overlap)
    x, y = _tokens()
    cm(x, y).backward()
    cm.step()
    cm.zero_grad()
    counter = [0]
    _poison_stage0(cm, {0}, counter, wait_for_updates=overlap)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    states = {g: st.exp_avg.clone() for g, st in cm.engine.optimizer.state.items()}
    cm(x, y).backward()
    with pytest.raises(shfx.errors.NonFiniteGradient, match=r"stage '.*' \(parameter group 0, on the host\) holds inf or NaN"):
        cm.step()
    for k, v in model.named_parameters():
        assert torch.equal(v, before[k]), k
    for g, m in states.items():
        assert torch.equal(cm.engine.optimizer.state[g].exp_avg, m)
    cm.zero_grad()  # and training goes on
    loss = cm(x, y)
    loss.backward()
    cm.step()
    assert math.isfinite(loss.item())
    cm.close()


def test_autocast_is_refused_pointing_to_precision():
    cm = _compile(gpt(layers=2), "fp32")
    x, y = _tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(NotImplementedError, match="precision='bf16'"):
        cm(x, y)
    cm.close()


def test_precision_arguments_are_checked():
    with pytest.raises(ValueError, match="precision must be"):
        _compile(gpt(layers=2), "int8")
    with pytest.raises(ValueError, match="loss scaler is for precision='fp16'"):
        _compile(gpt(layers=2), "bf16", scaler=shfx.LossScaler())
    with pytest.raises(ValueError, match="rollback=True"):
        _compile(gpt(layers=2), "fp16", rollback=False)
    # (policies updating on the device run in 16-bit: tests/test_mixed_device.py)


@pytest.mark.parametrize("tied", [False, True])
def test_gradient_accumulation_in_bf16_is_the_recipe(tied):
    """Gradient accumulation with gradients cast on the device: the second micro-step's fp32
    copy is added on the host (``add32``), bitwise ``grad += g16`` of the recipe; with a tied
    embedding its 16-bit path beside it. Losses and masters bitwise, 3 steps of 2 micro-steps."""
    make = lambda: gpt(layers=2, tie_weights=tied)  # noqa: E731
    from zoo import token_batch

    ref = train_mixed_eager(make, token_batch, "bf16", 3, grad_accum=2)
    got = train_mixed_shfx(make, token_batch, "bf16", 3, window=2, grad_accum=2)
    try:
        assert got["loss_bits"] == ref["loss_bits"], (got["losses"], ref["losses"])
        for k, v in ref["master"].items():
            assert torch.equal(got["master"][k], v), k
        assert bool(got["cm"].engine.store.staging_bytes)  # the accumulation went through staging
    finally:
        got["cm"].close()
