"""shfx.amp.LossScaler against torch.amp.GradScaler, and the eager mixed-precision reference
(tests/mixed_reference.py) against what it claims to be."""

from __future__ import annotations

import functools

import pytest
import torch

from mixed_reference import bits_of, make_working_copy, train_mixed_eager
from shfx import LossScaler
from zoo import LOSS_IN_FP32, ZOO, BNNet, HFStyleLM, gpt_tied, hf_batch, token_batch, vector_batch

# -- LossScaler == GradScaler ------------------------------------------------------------------


def _drive_gradscaler(pattern: list[bool], *, loss_weight: float = 1.0, **kw) -> list[tuple[int, int]]:
    """Train a tiny fp32 model with fused AdamW under ``torch.amp.GradScaler("cpu", **kw)``,
    writing inf into a gradient at the steps where ``pattern`` is True; returns (scale bits,
    growth tracker) after each update."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", **kw)
    seen = []
    for step, overflow in enumerate(pattern):
        opt.zero_grad()
        x = torch.randn(5, 4)
        loss = model(x).square().mean() * loss_weight
        scaler.scale(loss).backward()
        if overflow:
            model.weight.grad[1, 2] = float("inf")
        scaler.step(opt)
        scaler.update()
        sd = scaler.state_dict()
        seen.append((bits_of(torch.tensor(sd["scale"], dtype=torch.float32)), sd["_growth_tracker"]))
    return seen


def _drive_loss_scaler(pattern: list[bool], **kw) -> list[tuple[int, int]]:
    s = LossScaler(**kw)
    seen = []
    for overflow in pattern:
        s.update(found_inf=overflow)
        seen.append((bits_of(s.scale_tensor()), s.growth_tracker))
    return seen


PATTERNS = {
    "clean": [False] * 9,
    "first_overflows": [True, True, False, False, False, False, False, False],
    "mixed": [False, True, False, False, True, True, False, False, False, False, True, False],
    "every_other": [True, False] * 6,
}
SETTINGS = {
    "default": {},
    "fast_growth": dict(init_scale=1024.0, growth_interval=2),
    "odd_factors": dict(init_scale=3.0e4, growth_factor=3.0, backoff_factor=0.3, growth_interval=3),
}


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_scale_sequence_matches_gradscaler(pattern, settings):
    kw = SETTINGS[settings]
    assert _drive_loss_scaler(PATTERNS[pattern], **kw) == _drive_gradscaler(PATTERNS[pattern], **kw)


def test_no_growth_past_fp32_max_as_gradscaler():
    kw = dict(init_scale=2.0**126, growth_interval=1)
    pattern = [False, False, False, True, False]
    ours = _drive_loss_scaler(pattern, **kw)
    assert ours == _drive_gradscaler(pattern, loss_weight=1e-30, **kw)
    assert [t for t, _ in ours][1] == bits_of(torch.tensor(2.0**127))  # grew once, then held


def test_scale_tensor_is_one_fp32_tensor_updated_in_place():
    s = LossScaler(init_scale=8.0, growth_interval=1)
    t = s.scale_tensor()
    assert t.dtype == torch.float32 and t.dim() == 0 and t.item() == 8.0
    s.update(False)
    s.update(torch.tensor(1.0))  # a found_inf tensor, as GradScaler collects it
    assert s.scale_tensor() is t and t.item() == 8.0 and s.scale == 8.0 and s.growth_tracker == 0


def test_state_dict_moves_between_loss_scaler_and_gradscaler():
    kw = dict(init_scale=512.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=3)
    ours = LossScaler(**kw)
    for overflow in [False, True, False, False]:
        ours.update(overflow)
    sd = ours.state_dict()
    assert list(sd) == list(torch.amp.GradScaler("cpu").state_dict())
    assert sd == {"scale": 128.0, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 3, "_growth_tracker": 2}

    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(sd)
    assert theirs.state_dict() == sd
    back = LossScaler()
    back.load_state_dict(theirs.state_dict())
    assert back.state_dict() == sd and repr(back) == repr(ours)
    # one more clean step grows both (tracker 2 -> 3 == growth_interval)
    back.update(False)
    assert back.scale == 384.0 and back.growth_tracker == 0


def test_disabled_is_a_no_op_like_gradscaler():
    s = LossScaler(enabled=False)
    s.update(True)
    assert s.scale == 1.0 and s.scale_tensor().item() == 1.0
    assert s.state_dict() == torch.amp.GradScaler("cpu", enabled=False).state_dict() == {}
    s.load_state_dict({})  # no-op, as GradScaler's
    assert repr(s) == "LossScaler(enabled=False)"


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(growth_factor=1.0), "growth_factor must be a finite number > 1.0"),
        (dict(growth_factor=float("inf")), "growth_factor"),
        (dict(backoff_factor=1.0), "backoff_factor must lie strictly between 0 and 1"),
        (dict(backoff_factor=0.0), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval must be an int >= 1"),
        (dict(growth_interval=2.5), "growth_interval"),
        (dict(growth_interval=True), "growth_interval"),
        (dict(init_scale=0.0), "init_scale must be a finite number > 0"),
        (dict(init_scale=-1.0), "init_scale"),
        (dict(init_scale=float("inf")), "init_scale"),
        (dict(init_scale=float("nan")), "init_scale"),
        (dict(init_scale="65536"), "init_scale must be a number"),
    ],
)
def test_bad_settings_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        LossScaler(**kw)


def test_bad_state_dicts_are_refused():
    s = LossScaler()
    with pytest.raises(RuntimeError, match="empty"):
        s.load_state_dict({})
    with pytest.raises(KeyError, match="_growth_tracker"):
        s.load_state_dict({"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 10})
    good = LossScaler().state_dict()
    with pytest.raises(ValueError, match="backoff_factor"):
        s.load_state_dict({**good, "backoff_factor": 2.0})
    with pytest.raises(ValueError, match="_growth_tracker"):
        s.load_state_dict({**good, "_growth_tracker": -1})
    assert s.state_dict() == good  # nothing half-loaded
    s.load_state_dict({**good, "scale": 0.0})  # enough back-offs underflow a GradScaler's scale to 0
    assert s.scale == 0.0


# -- the eager mixed-precision reference --------------------------------------------------------


def _train_fp32_eager(make_model, make_batch, steps, *, grad_accum=1, lr=1e-2, weight_decay=0.01, seed=0):
    """Plain fp32 training as tests/equivalence.py's eager side does it."""
    from zoo import loss_of

    torch.manual_seed(seed)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)
    losses = []
    for step in range(steps):
        for micro in range(grad_accum):
            args, kwargs, aux = make_batch(step, micro)
            torch.manual_seed(10_000 + 100 * step + micro)
            loss = loss_of(model(*args, **kwargs), aux) / grad_accum
            loss.backward()
            losses.append(bits_of(loss))
        opt.step()
        opt.zero_grad()
    return losses, model, opt


def _assert_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name, accum", [("gpt_dropout", 1), ("bn_net", 2), ("skip_cnn", 1)])
def test_fp32_recipe_is_plain_fp32_training_bitwise(name, accum):
    make_model, make_batch = ZOO[name]
    r = train_mixed_eager(make_model, make_batch, "fp32", 3, grad_accum=accum)
    losses, model, opt = _train_fp32_eager(make_model, make_batch, 3, grad_accum=accum)
    assert r["loss_bits"] == losses and r["loss_dtype"] == torch.float32
    assert r["skipped"] == [False] * 3 and r["scales"] == [None] * 3
    _assert_equal(r["master"], {k: v.detach() for k, v in model.named_parameters()})
    _assert_equal(r["working"], r["master"])
    _assert_equal(r["buffers"], dict(model.named_buffers()))
    _assert_equal(r["exp_avg"], {n: opt.state[p]["exp_avg"] for n, p in model.named_parameters()})
    _assert_equal(r["exp_avg_sq"], {n: opt.state[p]["exp_avg_sq"] for n, p in model.named_parameters()})


def _assert_working_is_cast_master(r, dtype):
    work = r["working_model"]
    bn = {id(p) for m in work.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for p in m.parameters()}
    for n, p in work.named_parameters():
        want = torch.float32 if id(p) in bn else dtype
        assert p.dtype == want, n
        assert torch.equal(r["working"][n], r["master"][n].to(want)), n
    for n, b in work.named_buffers():  # buffers keep their dtype
        assert b.dtype == dict(r["model"].named_buffers())[n].dtype, n


@functools.cache
def _fp32_gpt_tied() -> dict:
    """The fp32 run the 16-bit runs are compared with (computed once; read-only)."""
    return train_mixed_eager(gpt_tied, token_batch, "fp32", 3)


def _assert_near(master: dict, fp32_master: dict, *, mean: float, steps: int = 3, lr: float = 1e-2):
    """Masters after ``steps`` AdamW steps from the same start: each element within Adam's
    reach (about ``lr`` a step each way: a near-zero gradient can flip an element's sign),
    and close on average."""
    diff = torch.cat([(master[k] - fp32_master[k]).abs().flatten() for k in master])
    assert diff.max() <= 2 * steps * lr * 1.01 and diff.mean() <= mean, (diff.max(), diff.mean())


def test_bf16_recipe_runs_in_bf16():
    fp32 = _fp32_gpt_tied()
    r = train_mixed_eager(gpt_tied, token_batch, "bf16", 3)
    assert r["loss_dtype"] == torch.float32 and r["skipped"] == [False] * 3  # the GPT's loss: on logits.float()
    _assert_working_is_cast_master(r, torch.bfloat16)
    assert all(v.dtype == torch.float32 for v in r["master"].values())
    assert any(not torch.equal(r["master"][k], fp32["master"][k]) for k in r["master"])
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(fp32["losses"]), rtol=2e-2, atol=0)
    _assert_near(r["master"], fp32["master"], mean=2e-3)


def test_fp16_default_scale_overflows_the_first_step():
    """With init_scale 2**16 the gradient of a 16-bit loss is itself inf in fp16 (65536 > 65504):
    step 0 is skipped, the scale backs off to 2**15, and the next steps train (the Hugging
    Face-style model computes its loss on 16-bit logits; the GPT's fp32 loss would not overflow)."""
    init = train_mixed_eager(HFStyleLM, hf_batch, "fp16", 0)
    r = train_mixed_eager(HFStyleLM, hf_batch, "fp16", 3)
    assert r["skipped"] == [True, False, False]
    assert r["scales"] == [2.0**15] * 3 and r["growth_trackers"] == [0, 1, 2]
    s = LossScaler()
    for overflow, scale, tracker in zip(r["skipped"], r["scales"], r["growth_trackers"]):
        s.update(overflow)
        assert (s.scale, s.growth_tracker) == (scale, tracker)
    one = train_mixed_eager(HFStyleLM, hf_batch, "fp16", 1)
    _assert_equal(one["master"], init["master"])  # the skipped step changed nothing
    assert all(v == 0.0 for v in one["step"].values())
    assert all(not v.any() for v in [*one["exp_avg"].values(), *one["exp_avg_sq"].values()])
    assert any(not torch.equal(r["master"][k], init["master"][k]) for k in r["master"])
    _assert_working_is_cast_master(r, torch.float16)


def test_fp16_with_a_safe_scale_trains_like_fp32():
    fp32 = _fp32_gpt_tied()
    r = train_mixed_eager(gpt_tied, token_batch, "fp16", 3, scaler_kwargs=dict(init_scale=1024.0))
    assert r["loss_dtype"] == torch.float32 and r["skipped"] == [False] * 3
    assert r["scales"] == [1024.0] * 3 and r["growth_trackers"] == [1, 2, 3]
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(fp32["losses"]), rtol=5e-3, atol=0)
    _assert_near(r["master"], fp32["master"], mean=5e-4)


def test_injected_inf_skips_the_step_and_backs_off():
    kw = dict(scaler_kwargs=dict(init_scale=1024.0, growth_interval=3), grad_accum=2)
    before = train_mixed_eager(BNNet, vector_batch, "fp16", 1, **kw)
    r = train_mixed_eager(BNNet, vector_batch, "fp16", 2, inject_inf={1: "blocks.1.fc.bias"}, **kw)
    assert r["skipped"] == [False, True] and r["scales"] == [1024.0, 512.0] and r["growth_trackers"] == [1, 0]
    for key in ("master", "exp_avg", "exp_avg_sq", "working"):
        _assert_equal(r[key], before[key])
    assert r["step"] == before["step"] == {n: 1.0 for n in r["master"]}
    # the forward of the skipped step still ran: BatchNorm's running stats moved
    assert not torch.equal(r["buffers"]["blocks.0.bn.running_mean"], before["buffers"]["blocks.0.bn.running_mean"])


def test_working_copy_keeps_batchnorm_fp32_and_ties():
    torch.manual_seed(0)
    work = make_working_copy(BNNet(), torch.float16)
    assert work.blocks[0].bn.weight.dtype == torch.float32 and work.blocks[0].fc.weight.dtype == torch.float16
    assert work.blocks[0].bn.running_var.dtype == torch.float32 and work.blocks[0].bn.num_batches_tracked.dtype == torch.int64
    tied = make_working_copy(gpt_tied(), torch.bfloat16)
    assert tied.lm_head.weight is tied.transformer.wte.weight and tied.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ZOO)
def test_every_zoo_model_trains_in_16_bit(name, precision):
    make_model, make_batch = ZOO[name]
    r = train_mixed_eager(make_model, make_batch, precision, 3)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    loss16 = name not in LOSS_IN_FP32
    assert r["loss_dtype"] == (dtype if loss16 else torch.float32) and all(torch.isfinite(torch.tensor(r["losses"])))
    # a 16-bit loss's gradient at the default scale (2**16) is inf in fp16: the first step skips
    assert r["skipped"] == ([True, False, False] if precision == "fp16" and loss16 else [False] * 3)
    assert all(torch.isfinite(v).all() for v in r["master"].values())
    _assert_working_is_cast_master(r, dtype)


def test_docstring_examples():
    import doctest

    import shfx.amp

    result = doctest.testmod(shfx.amp, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS, report=False)
    assert result.failed == 0 and result.attempted > 0
