"""shfx.amp.LossScaler against torch.amp.GradScaler."""

from __future__ import annotations

import pytest
import torch

from shfx import LossScaler

def bits_of(t: torch.Tensor) -> int:
    return int(t.reshape(()).view(torch.int32).item())


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


def test_docstring_examples():
    import doctest

    import shfx.amp

    result = doctest.testmod(shfx.amp, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS, report=False)
    assert result.failed == 0 and result.attempted > 0
