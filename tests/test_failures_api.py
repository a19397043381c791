"""Failures a user can cause through the API are clean (issue 9): what PyTorch code does to the
model and its gradients between calls is honoured exactly as eager would (bitwise), or refused
with a UsageError that says what to do; dropped compiled models free their threads; bad device
specifications, a second backward and a clamped window say so."""

from __future__ import annotations

import copy
import gc
import threading
import time

import pytest
import torch
import torch.nn as nn

import shfx

LR, WD = 1e-2, 0.01


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.fc = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    """Four repeated blocks (four stages) and a head; returns the loss."""

    def __init__(self, h: int = 16, n: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList([Block(h) for _ in range(n)])
        self.head = nn.Linear(h, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).pow(2).mean()


def batch(step: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + micro))


def pair(**kw):
    """(cm, model, eager copy, eager fused AdamW), same initial weights."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    kw.setdefault("window", 2)
    cm = shfx.compile(
        model, device=shfx.EmulatedDevice(memory="64MiB", h2d=None, d2h=None),
        optimizer=shfx.optim.AdamW(lr=LR, weight_decay=WD), **kw,
    )  # fmt: skip
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    return cm, model, ref, opt


def assert_bitwise(model: nn.Module, ref: nn.Module) -> None:
    sd, rsd = model.state_dict(), ref.state_dict()
    assert sd.keys() == rsd.keys()
    for k in sd:
        torch.testing.assert_close(sd[k], rsd[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


# ---- 3: gradient edits between backward and step ---------------------------------------------------


def test_clipping_after_an_overlapped_backward_is_refused_at_step():
    """The updates started during backward and read the gradients: clipping after it cannot
    count, so step() says so (and what to do) instead of silently training other weights."""
    cm, model, _, _ = pair()
    cm(batch(0)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(shfx.UsageError, match=r"changed in place.*overlap_update=False.*max_grad_norm=.*clip_grad_norm_"):
        cm.step()
    # the step finished (nothing left running); training goes on
    cm.zero_grad()
    cm(batch(1)).backward()
    cm.step()
    cm.close()


@pytest.mark.parametrize("edit", ["rebind", "none"])
def test_rebinding_grad_after_an_overlapped_backward_is_refused_at_step(edit):
    cm, model, _, _ = pair()
    cm(batch(0)).backward()
    p = model.blocks[2].fc.weight
    p.grad = p.grad * 0.5 if edit == "rebind" else None
    with pytest.raises(shfx.UsageError, match=r"'blocks\.2\.fc\.weight' was (replaced|set to None)"):
        cm.step()
    cm.close()


def test_no_edit_after_an_overlapped_backward_steps_quietly():
    cm, model, ref, opt = pair()
    for step in range(3):
        cm(batch(step)).backward()
        _ = [p.grad.norm() for p in model.parameters()]  # reading is fine
        cm.step()
        cm.zero_grad()
        ref(batch(step)).backward()
        opt.step()
        opt.zero_grad()
    assert_bitwise(model, ref)
    cm.close()


@pytest.mark.parametrize("how", ["clip_grad_norm_", "rebind"])
def test_clipping_without_overlap_trains_like_eager(how):
    """With overlap_update=False the updates run in step(): gradients edited in place (clipping)
    or rebound to new tensors before it are what it applies, bitwise as torch.optim."""
    cm, model, ref, opt = pair(overlap_update=False)

    def clip(m: nn.Module) -> None:
        if how == "clip_grad_norm_":
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            assert norm > 0.05  # the clipping acts
        else:
            for p in m.parameters():
                p.grad = p.grad.clamp(-1e-3, 1e-3)

    for step in range(4):
        cm(batch(step)).backward()
        clip(model)
        cm.step()
        cm.zero_grad()
        ref(batch(step)).backward()
        clip(ref)
        opt.step()
        opt.zero_grad()
    assert_bitwise(model, ref)
    cm.close()


# ---- 8: a compiled model dropped without close() ----------------------------------------------------


def _shfx_threads() -> int:
    """shfx's own threads (its streams and host pools are named ``shfx-*``): other libraries'
    daemons (tqdm's monitor, started by torch.fx's interpreter when tqdm is installed) are not
    shfx's to free."""
    return sum(t.name.startswith("shfx-") for t in threading.enumerate())


def _threads_settle(baseline: int, timeout_s: float = 5.0) -> int:
    deadline = time.monotonic() + timeout_s
    while _shfx_threads() > baseline and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    return _shfx_threads()


def test_dropped_compiled_models_free_their_threads():
    gc.collect()
    baseline = _shfx_threads()
    for i in range(10):
        cm, model, _, _ = pair()
        cm(batch(i)).backward()
        cm.step()
        cm.zero_grad()
        del cm, model
    gc.collect()
    assert _threads_settle(baseline) == baseline


def test_already_compiled_while_alive_and_free_once_dropped():
    torch.manual_seed(0)
    model = Net()
    cm = shfx.compile(model, device=shfx.EmulatedDevice(), optimizer=shfx.optim.AdamW())
    cm(batch(0)).backward()
    cm.step()
    with pytest.raises(shfx.UsageError, match="already compiled"):
        shfx.compile(model, device=shfx.EmulatedDevice())
    del cm
    gc.collect()
    cm2 = shfx.compile(model, device=shfx.EmulatedDevice(), optimizer=shfx.optim.AdamW())  # released
    cm2(batch(1)).backward()
    cm2.step()
    cm2.close()
    cm3 = shfx.compile(model, device=shfx.EmulatedDevice())  # and after close()
    cm3.close()


# ---- 9: the model changed after the first call ---------------------------------------------------------


@pytest.mark.parametrize("to", [False, True])
def test_requires_grad_changed_after_the_first_call_is_refused(to):
    torch.manual_seed(0)
    model = Net()
    p = model.blocks[1].fc.weight
    p.requires_grad_(not to)
    cm = shfx.compile(model, device=shfx.EmulatedDevice(), window=2, optimizer=shfx.optim.AdamW())
    cm(batch(0)).backward()
    cm.step()
    cm.zero_grad()
    p.requires_grad_(to)
    with pytest.raises(shfx.UsageError, match=rf"'blocks\.1\.fc\.weight' has requires_grad={to}.*first call"):
        cm(batch(1))
    with torch.no_grad():
        cm(batch(1))  # without grad, requires_grad does not matter
    p.requires_grad_(not to)  # set back: training goes on
    cm(batch(1)).backward()
    cm.step()
    cm.close()


def test_replaced_parameter_is_refused():
    cm, model, _, _ = pair()
    cm(batch(0)).backward()
    cm.step()
    cm.zero_grad()
    model.head.weight = nn.Parameter(torch.zeros_like(model.head.weight))
    with pytest.raises(shfx.UsageError, match=r"'head\.weight' was replaced by another object"):
        cm(batch(1))
    cm.close()


@pytest.mark.parametrize("policy", [shfx.Stronghold(window=2), shfx.Stronghold(window=2, resident_first=1), shfx.Resident()])
def test_data_rebound_between_steps_trains_like_eager(policy):
    """``p.data = t`` detaches the parameter from the host store; the next call copies t in and
    binds p again (the device copies of persistent stages reload): the new values train."""
    cm, model, ref, opt = pair(policy=policy, window=None)
    g = torch.Generator().manual_seed(7)
    for step in range(4):
        if step == 2:
            for name in ("blocks.0.fc.weight", "head.bias"):
                new = torch.randn(model.get_parameter(name).shape, generator=g)
                model.get_parameter(name).data = new.clone()
                ref.get_parameter(name).data = new.clone()
        cm(batch(step)).backward()
        cm.step()
        cm.zero_grad()
        ref(batch(step)).backward()
        opt.step()
        opt.zero_grad()
    cm.sync()
    assert_bitwise(model, ref)
    cm.close()


def test_data_rebound_to_another_shape_is_refused():
    cm, model, _, _ = pair()
    cm(batch(0)).backward()
    cm.step()
    cm.zero_grad()
    model.head.bias.data = torch.zeros(3)
    with pytest.raises(shfx.UsageError, match=r"'head\.bias' was given new data .*shape \(3,\).*holds it as shape \(1,\)"):
        cm(batch(1))
    cm.close()


# ---- 10: zeroing gradients through the original model ----------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize(
    "how", ["model.zero_grad()", "set_to_none=False", "optimizer-style", "between forward and backward"]
)
def test_zeroing_through_the_model_trains_like_eager(how, overlap):
    """Hugging Face's Trainer zeroes with model.zero_grad(); torch.optim's zero_grad sets each
    p.grad to None (or zeroes it in place): either acts as cm.zero_grad() would."""
    cm, model, ref, opt = pair(overlap_update=overlap)

    def zero(m: nn.Module) -> None:
        if how in ("model.zero_grad()", "between forward and backward"):
            m.zero_grad()
        elif how == "set_to_none=False":
            m.zero_grad(set_to_none=False)
        else:
            for p in m.parameters():
                p.grad = None

    for step in range(4):
        for call, m, stepper in ((cm, model, cm), (ref, ref, opt)):
            loss = call(batch(step))
            if how == "between forward and backward":
                zero(m)
            loss.backward()
            stepper.step()
            if how != "between forward and backward":
                zero(m)
    assert_bitwise(model, ref)
    cm.close()


def test_one_grad_set_to_none_between_accumulated_backwards_trains_like_eager():
    """Per parameter: a .grad set to None between two backward() calls of one step starts that
    parameter's gradient from zero, the rest of its stage keeps accumulating."""
    cm, model, ref, opt = pair(grad_accum_steps=2)
    for step in range(3):
        for call, m in ((cm, model), (ref, ref)):
            call(batch(step, 0)).backward()
            m.blocks[1].fc.bias.grad = None
            call(batch(step, 1)).backward()
        cm.step()
        opt.step()
        model.zero_grad()
        opt.zero_grad()
    assert_bitwise(model, ref)
    cm.close()


def test_some_grads_of_a_stage_none_at_step_is_refused():
    cm, model, _, _ = pair(overlap_update=False)
    cm(batch(0)).backward()
    model.blocks[1].fc.bias.grad = None
    with pytest.raises(shfx.UsageError, match=r"'blocks\.1\.fc\.bias' of a stage has \.grad None.*Nothing was updated"):
        cm.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.blocks[1].fc.weight.grad = None  # the whole stage: skipped, as torch.optim skips it
    cm.step()
    after = model.state_dict()
    assert torch.equal(before["blocks.1.fc.weight"], after["blocks.1.fc.weight"])
    assert not torch.equal(before["blocks.0.fc.weight"], after["blocks.0.fc.weight"])
    cm.close()


# ---- 14: smaller ------------------------------------------------------------------------------------------


def test_second_backward_through_one_forward_is_a_usage_error():
    cm, _, _, _ = pair()
    loss = cm(batch(0))
    loss.backward(retain_graph=True)
    with pytest.raises(shfx.UsageError, match=r"backward\(\) ran a second time.*\(loss1 \+ loss2\)\.backward\(\)"):
        loss.backward()
    cm.step()
    cm.zero_grad()
    out = cm(batch(1))
    a, b = out * 2, out * 3
    a.backward()
    with pytest.raises(shfx.UsageError, match="second time"):
        b.backward()
    cm.step()
    cm.close()


@pytest.mark.parametrize("memory", ["-1GiB", -1, 0, "0", "0.1B", float("nan"), float("inf"), "1e400", "1e400GiB"])
def test_device_memory_must_be_a_positive_finite_size(memory):
    with pytest.raises(ValueError, match=r"EmulatedDevice memory must be (> 0|a finite number)"):
        shfx.EmulatedDevice(memory=memory)
    with pytest.raises(ValueError, match=r"CudaDevice memory must be (> 0|a finite number)"):
        shfx.CudaDevice(memory=memory)


@pytest.mark.parametrize("bw", ["-1GB/s", -1.0, 0, "0GB/s", float("nan"), "1e400GB/s"])
def test_bandwidth_must_be_a_positive_finite_rate(bw):
    with pytest.raises(ValueError, match=r"EmulatedDevice h2d bandwidth must be (> 0|a finite number)"):
        shfx.EmulatedDevice(h2d=bw)
    with pytest.raises(ValueError, match=r"EmulatedDevice d2h bandwidth must be (> 0|a finite number)"):
        shfx.EmulatedDevice(d2h=bw)


def test_device_specs_still_accepted():
    d = shfx.EmulatedDevice(memory="1.5KiB", h2d=float("inf"), d2h="inf")
    assert d.memory_bytes == 1536 and d.h2d_bps is None and d.d2h_bps is None
    assert shfx.EmulatedDevice(memory=1, h2d="800MiB/s").h2d_bps == 800 * 2**20
    with pytest.raises(ValueError, match=r"duplex must be in \(0, 1\]: a number"):
        shfx.EmulatedDevice(duplex="half")


def test_window_larger_than_the_stages_is_said():
    cm, _, _, _ = pair(window=100)
    with pytest.warns(UserWarning, match=r"window=100 is more than the 5 stages.*window 5"):
        cm(batch(0)).backward()
    cm.step()
    assert cm.program.num_slots == 5  # all stages, as documented
    text = str(cm.report())
    assert "window=100 was set by the user, more than the 5 stages there are to stream" in text
    assert cm.report().to_dict()["window_asked"] == 100
    cm.close()


def test_window_equal_to_the_stages_is_quiet(recwarn):
    cm, _, _, _ = pair(window=5)
    cm(batch(0)).backward()
    cm.step()
    assert not [w for w in recwarn if "window=" in str(w.message)]
    cm.close()


def test_accumulation_message_ordinals():
    from shfx.runtime.engine import _ordinal

    assert [_ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 101, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "101st", "111th",
    ]  # fmt: skip
    cm, _, _, _ = pair(grad_accum_steps=2)
    cm(batch(0, 0)).backward()
    cm(batch(0, 1)).backward()
    with pytest.raises(shfx.UsageError, match="every 2nd backward"):
        cm(batch(1))
    cm.step()
    cm.close()


@pytest.mark.parametrize("policy", [shfx.Resident(), shfx.Stronghold(window=2, resident_first=1)])
def test_model_zero_grad_with_groups_updated_on_the_device_trains_like_eager(policy):
    """Groups updated on the device keep their gradients there (their .grad is never exposed):
    model.zero_grad() after a step (every .grad None) starts them from zero too."""
    cm, model, ref, opt = pair(policy=policy, window=None)
    for step in range(4):
        cm(batch(step)).backward()
        cm.step()
        model.zero_grad()
        ref(batch(step)).backward()
        opt.step()
        ref.zero_grad()
    cm.sync()
    assert_bitwise(model, ref)
    cm.close()


def test_model_zero_grad_with_the_delayed_update_is_cm_zero_grad():
    """ZeRO-Offload's delayed update reads the gradients after step() returns: model.zero_grad()
    trains exactly as cm.zero_grad() does there (that policy is checked against eager in
    tests/test_policies.py)."""
    states = []
    for zero in ("cm", "model"):
        cm, model, _, _ = pair(policy=shfx.ZeroOffload(delayed_update=True), window=None)
        for step in range(4):
            cm(batch(step)).backward()
            cm.step()
            cm.zero_grad() if zero == "cm" else model.zero_grad()
        states.append({k: v.clone() for k, v in cm.state_dict().items()})
        cm.close()
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k
