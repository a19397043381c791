"""What a failed, interrupted or skipped step leaves behind (docs/usage.md, "When something
fails"): a fault injected at the n-th action of each kind, for every policy; the post-state is
checked bitwise against eager PyTorch, then training goes on to eager's numbers."""

from __future__ import annotations

import copy
import re
import signal
import threading
import time

import pytest
import torch
from faults import KINDS, FaultInjector, InjectedFault, count_actions
from zoo import gpt, token_batch

import shfx
from shfx.errors import ActionError
from shfx.runtime import streams

LR, WD = 1e-2, 0.01

POLICIES = {
    "resident": shfx.Resident(),
    "l2l": shfx.L2L(),
    "zero-offload": shfx.ZeroOffload(),
    "zero-infinity": shfx.ZeroInfinity(),
    "stronghold": shfx.Stronghold(window=2),
    "stronghold-k1": shfx.Stronghold(window=2, resident_first=1),
}


class Pair:
    """A compiled model and its eager twin, stepped on the same batches."""

    def __init__(self, policy=shfx.Stronghold(window=2), **kw):
        torch.manual_seed(0)
        self.model = gpt(tie_weights=True)
        self.ref = copy.deepcopy(self.model)
        self.cm = shfx.compile(
            self.model,
            device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None),
            policy=policy,
            optimizer=shfx.optim.AdamW(lr=LR, weight_decay=WD),
            **kw,
        )
        self.opt = torch.optim.AdamW(self.ref.parameters(), lr=LR, weight_decay=WD, fused=True)
        self.n = 0

    def batch(self):
        (x, y), _, _ = token_batch(self.n)
        return x, y

    def shfx_step(self, scale: float = 1.0) -> None:
        (self.cm(*self.batch()) * scale).backward()
        self.cm.step()
        self.cm.zero_grad()

    def eager_step(self, apply: bool = True) -> None:
        if apply:
            self.ref(*self.batch()).backward()
            self.opt.step()
            self.opt.zero_grad()
        self.n += 1

    def step_both(self) -> None:
        self.shfx_step()
        self.eager_step()

    def assert_same(self) -> None:
        sd = self.cm.state_dict()
        for k, v in self.ref.state_dict().items():
            assert torch.equal(sd[k], v), f"{k} differs from eager by {(sd[k] - v).abs().max():.3g}"


def _cause(err: BaseException) -> BaseException:
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def _plan(counts: dict[str, int]) -> list[tuple[str, int]]:
    """The first and the last action of each kind (the middle ones fail like the first: the
    suite's time goes where the states differ)."""
    return [(k, n) for k in KINDS for n in sorted({1, counts[k]}) if 1 <= n <= counts[k]]


# resident and stronghold (k=0) with SHFX_SLOW=1: stronghold-k1 has both their kinds of stage (a
# device-updated resident one, streamed host-updated ones)
@pytest.mark.parametrize("name", [n if n not in ("resident", "stronghold") else pytest.param(n, marks=pytest.mark.slow) for n in POLICIES])
def test_a_fault_anywhere_leaves_the_state_before_the_step(name):
    p = Pair(POLICIES[name], rollback=True)
    p.step_both()  # captured; every optimizer state exists
    counts = count_actions(p.cm.backend, p.step_both)
    used, threads = p.cm.backend.used_bytes, threading.active_count()
    plan = _plan(counts)
    assert {k for k, _ in plan} >= {"F", "B"}
    for kind, n in plan:
        with FaultInjector(p.cm.backend, kind, n) as f:
            with pytest.raises(ActionError) as ei:
                p.shfx_step()
        assert f.fired, (kind, n)
        msg = str(ei.value)
        assert "InjectedFault: injected fault in " + f.fired in msg, msg  # the cause is named
        assert isinstance(_cause(ei.value), InjectedFault)
        assert ("forward was abandoned" in msg) or ("was not applied" in msg), msg
        assert p.cm.engine.pending_updates == []
        p.cm.zero_grad()
        p.assert_same()  # exactly the weights before the step (and below: the optimizer states)
        assert p.cm.backend.used_bytes == used, (kind, n)
        assert threading.active_count() == threads
        p.step_both()  # the same batch again: training goes on as eager
        p.assert_same()
    p.cm.close()


# zero-offload with SHFX_SLOW=1: its actions' failure paths are test_a_fault_anywhere_leaves_the_state_before_the_step's
@pytest.mark.parametrize("name", ["l2l", pytest.param("zero-offload", marks=pytest.mark.slow), "stronghold-k1"])
def test_an_interrupt_in_any_action_comes_out_as_keyboard_interrupt(name):
    p = Pair(POLICIES[name], rollback=True)
    p.step_both()
    counts = count_actions(p.cm.backend, p.step_both)
    used = p.cm.backend.used_bytes
    for kind, n in _plan(counts):
        with FaultInjector(p.cm.backend, kind, n, exc=KeyboardInterrupt) as f:
            with pytest.raises(KeyboardInterrupt) as ei:
                p.shfx_step()
        assert f.fired
        notes = " ".join(getattr(ei.value, "__notes__", []))
        assert ("forward was abandoned" in notes) or ("was not applied" in notes), notes
        p.cm.zero_grad()
        p.assert_same()
        assert p.cm.backend.used_bytes == used
        p.step_both()
        p.assert_same()
    p.cm.close()


def _interrupt_main_while(p: Pair, kind: str, n: int, where) -> BaseException:
    """Ctrl-C in the main thread while it waits, once the n-th action of ``kind`` has started
    (and is still running).

    Deterministic: the SIGINT handler in force (the engine's, which records the interrupt, or
    Python's, which raises KeyboardInterrupt) runs in the main thread's next wait on a token
    after the action started, as a real Ctrl-C does in a blocked wait (a timer racing the main
    thread's progress landed it anywhere on a loaded machine: 5 of 5 failed in one full run).
    The action runs until then, and a little longer, so the engine meets it still running."""
    armed, delivered = threading.Event(), threading.Event()
    originals = {cls: cls.__dict__["wait"] for cls in (streams.Token, streams.JoinToken, streams.DeviceToken)}

    def patched(orig):
        def wait(self, *a, **kw):
            if armed.is_set() and not delivered.is_set() and threading.current_thread() is threading.main_thread():
                delivered.set()
                handler = signal.getsignal(signal.SIGINT)
                if callable(handler):
                    handler(signal.SIGINT, None)
                else:  # pragma: no cover - SIG_IGN / SIG_DFL: what Python does without a handler
                    raise KeyboardInterrupt
            return orig(self, *a, **kw)

        return wait

    def slow(event):
        armed.set()
        assert delivered.wait(30), "the main thread never waited while the action ran"
        time.sleep(0.05)

    for cls, orig in originals.items():
        setattr(cls, "wait", patched(orig))
    try:
        with FaultInjector(p.cm.backend, kind, n, action=slow):
            with pytest.raises(KeyboardInterrupt) as ei:
                where()
    finally:
        for cls, orig in originals.items():
            setattr(cls, "wait", orig)
    assert delivered.is_set()
    return ei.value


@pytest.mark.parametrize("rollback", [True, False])
def test_ctrl_c_during_backward_leaves_a_consistent_state(rollback):
    """Rollback on: the step is undone. Off: the updates already running cannot be undone, so
    the backward and its updates are finished first and the step is applied."""
    p = Pair(shfx.Stronghold(window=2), rollback=rollback)
    p.step_both()
    loss = p.cm(*p.batch())
    err = _interrupt_main_while(p, "OG", 2, loss.backward)  # OG runs on the d2h thread
    notes = " ".join(err.__notes__)
    eng = p.cm.engine
    assert eng.pending_updates == [] and eng.holder is None
    p.cm.zero_grad()
    if rollback:
        assert "was not applied" in notes
        p.assert_same()
        p.step_both()
    else:
        assert "the step is applied" in notes
        p.eager_step()
    p.assert_same()
    p.step_both()
    p.assert_same()


def test_ctrl_c_during_a_backward_without_updates_drops_it():
    p = Pair(shfx.Stronghold(window=2), overlap_update=False)
    p.step_both()
    loss = p.cm(*p.batch())
    err = _interrupt_main_while(p, "OG", 2, loss.backward)
    assert "no update had run" in " ".join(err.__notes__)
    p.cm.zero_grad()
    p.assert_same()
    p.step_both()
    p.assert_same()


@pytest.mark.parametrize("rollback", [True, False])
def test_ctrl_c_during_step_leaves_a_consistent_state(rollback):
    p = Pair(shfx.Stronghold(window=2), overlap_update=False, rollback=rollback)
    p.step_both()
    p.cm(*p.batch()).backward()
    err = _interrupt_main_while(p, "U", 2, p.cm.step)
    notes = " ".join(err.__notes__)
    if rollback:
        assert "call cm.step() again" in notes
        p.cm.step()  # the whole step, once
    else:
        assert "the step is applied" in notes
    p.cm.zero_grad()
    p.eager_step()
    p.assert_same()


@pytest.mark.parametrize("rollback", [True, False])
def test_retrying_a_failed_step_applies_each_update_once(rollback):
    p = Pair(shfx.Stronghold(window=2), rollback=rollback)
    p.step_both()
    with FaultInjector(p.cm.backend, "U", 2):  # updates start during backward
        p.cm(*p.batch()).backward()
        with pytest.raises(ActionError, match="optimizer update U") as ei:
            p.cm.step()
    msg = str(ei.value)
    if rollback:
        assert "were rolled back" in msg and "call cm.step() again" in msg
    else:
        assert "training state is inconsistent" in msg and "applies only the updates that did not run" in msg
    p.cm.step()
    p.cm.zero_grad()
    p.eager_step()
    p.assert_same()


@pytest.mark.parametrize("name", ["stronghold", "resident"])
def test_without_rollback_a_failure_says_truly_what_it_left(name):
    """Rollback off (the default): a failure before any update ran leaves the state before
    the step; one after some ran says which groups are updated and that the state is
    inconsistent. Both say so, and the first goes on exactly."""
    p = Pair(POLICIES[name])
    p.step_both()
    counts = count_actions(p.cm.backend, p.step_both)
    inconsistent = 0
    for kind, n in _plan(counts):
        with FaultInjector(p.cm.backend, kind, n):
            with pytest.raises(ActionError) as ei:
                p.shfx_step()
        msg = str(ei.value)
        p.cm.zero_grad()
        if "training state is inconsistent" in msg:
            assert re.search(r"updates of parameter groups \[\d.*\] had run", msg), msg
            inconsistent += 1
            break  # the model has left eager's path
        assert ("forward was abandoned" in msg) or ("no update had run" in msg) or ("call cm.step() again" in msg), msg
        p.assert_same()
        p.step_both()
        p.assert_same()
    if name == "stronghold":
        assert inconsistent  # a backward fault after the last stages' updates
    p.cm.close()


def test_the_cause_of_a_failed_gradient_copy_is_kept():
    p = Pair(shfx.Stronghold(window=2))
    p.step_both()
    with FaultInjector(p.cm.backend, "OG", 1):
        with pytest.raises(ActionError) as ei:
            p.shfx_step()
    assert "action OG" in str(ei.value) and "InjectedFault: injected fault in OG" in str(ei.value)
    assert isinstance(ei.value.__cause__, InjectedFault)
    p.cm.close()


def _poison_host_grad(p: Pair, group: int):
    def poison(event):
        # through .data: a gradient that arrives non-finite, not an edit by the user (an in-place
        # write to the exposed buffer after backward is one, and step() would refuse it)
        p.cm.engine.store.grad(group).data[0] = float("nan")

    return poison


@pytest.mark.parametrize("overlap", [True, False])
def test_skip_nonfinite_skips_the_whole_step(overlap):
    p = Pair(shfx.Stronghold(window=2), skip_nonfinite=True, overlap_update=overlap)
    p.step_both()
    if overlap:  # the first stage's gradient is the last one known: the others' updates ran, and are undone
        with FaultInjector(p.cm.backend, "U0", 1, action=_poison_host_grad(p, 0)) as f:
            p.shfx_step()
        assert f.fired == "U0"
    else:  # step() checks every gradient before it starts an update
        p.cm(*p.batch()).backward()
        _poison_host_grad(p, 0)("")
        p.cm.step()
        p.cm.zero_grad()
    assert p.cm.last_step_skipped and p.cm.skipped_steps == 1
    p.eager_step(apply=False)  # the step is skipped: eager keeps its weights too
    p.assert_same()
    p.step_both()
    assert not p.cm.last_step_skipped
    p.assert_same()
    p.cm.close()


def test_skip_nonfinite_on_device_updates():
    p = Pair(shfx.Resident(), skip_nonfinite=True)
    p.step_both()
    p.shfx_step(scale=float("inf"))
    assert p.cm.last_step_skipped
    p.eager_step(apply=False)
    p.assert_same()
    p.step_both()
    p.assert_same()
    p.cm.close()


def test_skip_nonfinite_needs_rollback_with_overlap():
    with pytest.raises(ValueError, match="needs rollback=True"):
        Pair(skip_nonfinite=True, rollback=False)
    with pytest.raises(ValueError, match="delayed_update"):
        Pair(shfx.ZeroOffload(delayed_update=True), skip_nonfinite=True)


def test_a_failed_forward_leaves_nothing_running():
    p = Pair(shfx.Stronghold(window=2))
    p.step_both()
    used = p.cm.backend.used_bytes
    with FaultInjector(p.cm.backend, "PF", 2):
        with pytest.raises(ActionError, match="forward was abandoned"):
            p.cm(*p.batch())
    assert p.cm.engine.holder is None and p.cm.backend.used_bytes == used
    p.step_both()
    p.assert_same()
    p.cm.close()


def test_a_failed_delayed_update_is_rolled_back():
    """ZeRO-Offload's delayed update runs after step() returned: its failure surfaces at the
    next call that needs the weights, and with rollback the step's updates are undone."""
    p = Pair(shfx.ZeroOffload(delayed_update=True), rollback=True)
    p.shfx_step()
    p.cm(*p.batch()).backward()
    before = {k: v.clone() for k, v in p.cm.state_dict().items()}  # waits for the last step's updates
    with FaultInjector(p.cm.backend, "U", 2):
        p.cm.step()  # starts this step's updates and returns
        with pytest.raises(ActionError, match=r"U\d \(delayed\) failed: InjectedFault") as ei:
            p.cm.state_dict()
    assert "were rolled back" in str(ei.value)
    for k, v in p.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    p.cm.zero_grad()
    p.shfx_step()  # training goes on
    p.cm.close()
