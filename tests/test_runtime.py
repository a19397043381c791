"""The runtime on the emulated device: residency, bytes moved, the cold backward, and
failures that surface in the caller with the action named (never a hang)."""

from __future__ import annotations

import copy

import pytest
import torch
from equivalence import assert_same_state
from zoo import BNNet, gpt_tied, token_batch, vector_batch

from faults import run_with_deadline

import shfx
from shfx.passes.meta import get_meta
from shfx.passes.program import ActionKind
from shfx.runtime.engine import Engine
from shfx.runtime.host_optim import HostAdamW


def compiled(window=2, memory="64MiB", model=None, **kw):
    torch.manual_seed(0)
    model = model or gpt_tied()
    cm = shfx.compile(model, device=shfx.EmulatedDevice(memory=memory, h2d="2GB/s", d2h="2GB/s"), window=window, optimizer=shfx.optim.AdamW(lr=1e-2), **kw)
    return cm, model


def one_step(cm, step=0):
    (x, y), _, _ = token_batch(step)
    loss = cm(x, y)
    loss.backward()
    cm.step()
    cm.zero_grad()
    return loss


def residency_intervals(cm):
    """(start, end, slot) per residency, from the measured trace: from PF start to the end of
    the last action reading the slot."""
    prog = cm.program
    ev = {(e.action, e.phase): e for e in cm.engine.trace}
    out, open_ = [], {}
    for n in prog.nodes:
        m = get_meta(n)
        key = (str(m.action), m.phase)
        if m.kind == ActionKind.PREFETCH:
            open_[m.stage] = [ev[key].start, ev[key].end, m.slot]
        elif m.kind in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.OFFLOAD_GRAD, ActionKind.OFFLOAD_BUFFERS):
            open_[m.stage][1] = max(open_[m.stage][1], ev[key].end)
        elif m.kind == ActionKind.RELEASE:
            out.append(tuple(open_.pop(m.stage)))
    return out


def max_overlap(intervals):
    points = sorted([(s, 1) for s, _, _ in intervals] + [(e, -1) for _, e, _ in intervals], key=lambda p: (p[0], p[1]))
    cur = best = 0
    for _, d in points:
        cur += d
        best = max(best, cur)
    return best


@pytest.mark.parametrize("window", [1, 2, 3])
def test_at_most_window_stages_resident(window):
    cm, _ = compiled(window)
    one_step(cm)
    one_step(cm, 1)
    n = len(cm.stages.stages)
    iv = residency_intervals(cm)
    assert len(iv) == 2 * n - min(window, n)  # one residency per PF
    assert max_overlap(iv) <= window
    if window < n:
        assert max_overlap(iv) == window, "the schedule should use its whole window"
    # device memory never went past the slots plus activations
    assert cm.backend.peak_bytes <= cm.backend.capacity_bytes
    cm.close()


@pytest.mark.parametrize("window", [1, 2, 5])
def test_bytes_moved_equal_what_the_program_says(window):
    cm, _ = compiled(window)
    one_step(cm)  # capture, warm up
    b = cm.backend
    h0, d0 = b.bytes_h2d, b.bytes_d2h
    one_step(cm, 1)
    moved = {"h2d": b.bytes_h2d - h0, "d2h": b.bytes_d2h - d0}
    assert moved == cm.program.bytes_moved()
    specs = cm.stages.specs
    n, w = len(specs), min(window, len(specs))
    streamed = specs[: n - w]
    assert moved["h2d"] == sum(s.prefetch_bytes for s in specs) + sum(s.prefetch_bytes for s in streamed)
    assert moved["d2h"] == sum(s.grad_bytes + s.buffer_out_bytes for s in specs)
    # no parameter ever goes back to the host: d2h carries grads (and mutated buffers) only
    assert cm.program.count(ActionKind.OFFLOAD_GRAD) == sum(1 for s in specs if s.has_grads)
    cm.close()


def test_device_memory_returns_to_slots_after_step():
    cm, _ = compiled(2)
    one_step(cm)
    slots = cm.engine.pool.num_slots * cm.engine.pool.slot_bytes
    assert cm.backend.used_bytes == slots
    assert cm.backend.peak_bytes > slots  # activations were on the device during the step
    cm.close()


def test_cold_backward_after_second_forward():
    """Two forwards, then one backward through both losses: the first forward's resident
    stages were evicted by the second, so its backward prefetches them again."""
    torch.manual_seed(0)
    model = gpt_tied()
    ref = copy.deepcopy(model)
    cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="64MiB"), window=2, optimizer=shfx.optim.AdamW(lr=1e-2), grad_accum_steps=2)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    (x1, y1), _, _ = token_batch(0)
    (x2, y2), _, _ = token_batch(1)
    (cm(x1, y1) + cm(x2, y2)).backward()
    cm.step()
    (ref(x1, y1) + ref(x2, y2)).backward()
    opt.step()
    assert_same_state(model, ref)
    cm.close()


def test_no_grad_forward_between_forward_and_backward():
    torch.manual_seed(0)
    model = gpt_tied()
    ref = copy.deepcopy(model)
    cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="64MiB"), window=2, optimizer=shfx.optim.AdamW(lr=1e-2))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    (x, y), _, _ = token_batch(0)
    loss = cm(x, y)
    with torch.no_grad():
        cm(x, y)  # evicts the stages kept for the backward
    loss.backward()
    cm.step()
    ref(x, y).backward()
    opt.step()
    assert_same_state(model, ref)
    cm.close()


def test_buffers_updated_once_per_forward():
    torch.manual_seed(0)
    model = BNNet()
    ref = copy.deepcopy(model)
    cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="64MiB"), window=1)  # no optimizer: buffers only
    args, _, _ = vector_batch(0)
    cm(*args).backward()
    ref(*args).backward()
    assert int(model.blocks[0].bn.num_batches_tracked) == 1
    assert_same_state(model, ref)
    assert any(get_meta(n).kind == ActionKind.OFFLOAD_BUFFERS for n in cm.program.nodes)
    cm.close()


# ---- failures ---------------------------------------------------------------------------------


def test_exception_in_compute_stream_names_the_action(monkeypatch):
    cm, model = compiled(2)
    one_step(cm)
    real = Engine._forward

    def boom(self, ctx, stage, slot, keep):
        if stage.index == 2:
            raise RuntimeError("injected failure")
        return real(self, ctx, stage, slot, keep)

    monkeypatch.setattr(Engine, "_forward", boom)
    with pytest.raises(shfx.ActionError, match="action F2 of program 'stronghold") as e:
        run_with_deadline(lambda: one_step(cm, 1))
    assert "->" in str(e.value) and "injected failure" in str(e.value)
    assert e.value.action == "F2"
    assert isinstance(e.value.__cause__, RuntimeError)
    # nothing lost: after the failure the model trains on, and matches a fresh run
    monkeypatch.setattr(Engine, "_forward", real)
    assert cm.engine.holder is None
    one_step(cm, 2)
    cm.close()


def test_exception_in_copy_stream_names_the_action(monkeypatch):
    cm, _ = compiled(2)
    one_step(cm)
    calls = {"n": 0}
    real = type(cm.backend).h2d_copy

    def flaky(self, dst, src):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("link down")
        return real(self, dst, src)

    monkeypatch.setattr(type(cm.backend), "h2d_copy", flaky)
    with pytest.raises(shfx.ActionError, match=r"action PF\d of program") as e:
        run_with_deadline(lambda: one_step(cm, 1))
    assert "link down" in str(e.value)
    cm.close()


def test_exception_in_backward_names_the_action(monkeypatch):
    cm, _ = compiled(2)
    real = Engine._backward

    def boom(self, ctx, stage, *args):
        if stage.index == 1:
            raise ValueError("bad grad")
        return real(self, ctx, stage, *args)

    monkeypatch.setattr(Engine, "_backward", boom)
    with pytest.raises(shfx.ActionError, match="action B1") as e:
        run_with_deadline(lambda: one_step(cm))
    assert isinstance(e.value.__cause__, ValueError)
    cm.close()


def test_exception_in_host_update_surfaces_in_step(monkeypatch):
    cm, _ = compiled(2)

    def boom(self, g, hp):
        raise RuntimeError("optimizer broke")

    monkeypatch.setattr(HostAdamW, "update", boom)
    (x, y), _, _ = token_batch(0)
    cm(x, y).backward()
    with pytest.raises(shfx.ActionError, match=r"host optimizer update U\d failed.*optimizer broke"):
        run_with_deadline(cm.step)
    cm.close()


def test_budget_too_small_for_one_stage():
    torch.manual_seed(0)
    cm = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(memory="8KiB"), window=1)
    (x, y), _, _ = token_batch(0)
    with pytest.raises(shfx.OutOfDeviceMemory) as e:
        cm(x, y)
    msg = str(e.value)
    assert "too small for one stage" in msg and "the device has 8.0 KiB" in msg and "needs" in msg
    assert e.value.needed_bytes > e.value.capacity_bytes == 8 * 1024
    cm.close()


def test_window_too_large_for_budget():
    torch.manual_seed(0)
    probe = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(memory="64MiB"), window=1)
    (x, y), _, _ = token_batch(0)
    probe(x, y)
    slot = probe.stages.slot_bytes
    probe.close()
    cm = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(memory=int(slot * 2.5)), window=3)
    with pytest.raises(shfx.OutOfDeviceMemory, match=r"window=3 needs 3 slots .* Use window <= 2"):
        cm(x, y)
    cm.close()


def test_activations_out_of_memory_names_the_action():
    torch.manual_seed(0)
    probe = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(memory="64MiB"), window=1)
    (x, y), _, _ = token_batch(0)
    probe(x, y)
    slot = probe.stages.slot_bytes
    probe.close()
    cm = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(memory=slot + 2048), window=1)
    with pytest.raises(shfx.OutOfDeviceMemory, match=r"activation .* in action F\d of program") as e:
        run_with_deadline(lambda: cm(x, y))
    assert "free" in str(e.value)
    assert cm.backend.used_bytes == slot  # everything the failed step held was freed
    cm.close()


# ---- usage errors -----------------------------------------------------------------------------


def test_forward_while_update_pending_is_an_error():
    cm, _ = compiled(2)
    (x, y), _, _ = token_batch(0)
    cm(x, y).backward()
    with pytest.raises(shfx.UsageError, match="call cm.step"):
        cm(x, y)
    cm.step()
    cm(x, y)  # fine after step
    cm.close()


def test_too_many_backward_calls_is_an_error():
    cm, _ = compiled(2, grad_accum_steps=2)
    (x, y), _, _ = token_batch(0)
    losses = [cm(x, y) for _ in range(3)]
    losses[0].backward()
    losses[1].backward()  # the second starts the update
    with pytest.raises(shfx.UsageError, match="called 3 times since the last cm.step.*grad_accum_steps=2"):
        losses[2].backward()
    cm.step()
    with pytest.raises(shfx.UsageError, match="grad_accum_steps=2 the update starts"):
        cm(x, y).backward()
        cm(x, y).backward()
        cm(x, y)
    cm.step()
    cm.close()


def test_step_runs_updates_when_fewer_backward_than_accumulation():
    """Like the end of an epoch: step() after 1 of 3 accumulation steps updates with what is there."""
    torch.manual_seed(0)
    model = gpt_tied()
    ref = copy.deepcopy(model)
    cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="64MiB"), window=2, optimizer=shfx.optim.AdamW(lr=1e-2), grad_accum_steps=3)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    (x, y), _, _ = token_batch(0)
    cm(x, y).backward()
    assert not cm.engine.pending_updates
    cm.step()
    ref(x, y).backward()
    opt.step()
    assert_same_state(model, ref)
    cm.close()


def test_compile_errors():
    with pytest.raises(ValueError, match="window must be"):
        shfx.compile(gpt_tied(), window=0)
    with pytest.raises(ValueError, match="window must be"):
        shfx.compile(gpt_tied(), window=2.5)
    with pytest.raises(ValueError, match="grad_accum_steps"):
        shfx.compile(gpt_tied(), grad_accum_steps=0)
    with pytest.raises(TypeError, match="shfx.optim.AdamW"):
        m = gpt_tied()
        shfx.compile(m, optimizer=torch.optim.AdamW(m.parameters()))
    with pytest.raises(ValueError, match="on the CPU"):
        shfx.compile(gpt_tied().to("meta"))
    with pytest.raises(ValueError, match="not supported"):
        shfx.compile(gpt_tied(), device="mps")
    m = gpt_tied()
    cm = shfx.compile(m, device=shfx.EmulatedDevice())
    with pytest.raises(shfx.UsageError, match="already compiled"):
        shfx.compile(m)
    cm.close()
    shfx.compile(m, device=shfx.EmulatedDevice()).close()  # after close it may be compiled again


def test_step_without_optimizer_is_an_error():
    torch.manual_seed(0)
    cm = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice())
    (x, y), _, _ = token_batch(0)
    cm(x, y).backward()
    with pytest.raises(shfx.UsageError, match="needs an optimizer"):
        cm.step()
    cm.close()


def test_state_dict_round_trip():
    cm, model = compiled(2)
    one_step(cm)
    sd = {k: v.clone() for k, v in cm.state_dict().items()}
    fresh = gpt_tied()
    fresh.load_state_dict(sd)
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, sd[k])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    cm.load_state_dict(sd)  # writes into the host store
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, sd[k])
    cm.close()


def test_learning_rate_change_between_steps():
    torch.manual_seed(0)
    model = gpt_tied()
    ref = copy.deepcopy(model)
    cm = shfx.compile(model, device=shfx.EmulatedDevice(), window=2, optimizer=shfx.optim.AdamW(lr=1e-2))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for step, lr in enumerate([1e-2, 5e-3, 1e-3]):
        cm.optimizer.param_groups[0]["lr"] = lr
        opt.param_groups[0]["lr"] = lr
        one_step(cm, step)
        (x, y), _, _ = token_batch(step)
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
    assert cm.optimizer.lr == 1e-3
    assert_same_state(model, ref)
    cm.close()


def test_abandoned_forward_frees_its_device_memory():
    """A forward under grad mode whose loss is dropped (no backward) must not leak the
    activations it accounted for."""
    import gc

    cm, _ = compiled(2)
    one_step(cm)
    slots = cm.engine.pool.num_slots * cm.engine.pool.slot_bytes
    (x, y), _, _ = token_batch(0)
    for _ in range(5):
        loss = cm(x, y)
        del loss
        gc.collect()
    cm(x, y).backward()  # the next forward evicted the last abandoned one; training goes on
    cm.step()
    gc.collect()
    assert cm.backend.used_bytes == slots
    with torch.no_grad():
        for _ in range(3):
            cm(x, y)
    assert len(cm.engine.trace) <= 4 * len(cm.program.nodes)  # the trace does not grow without bound
    cm.close()
