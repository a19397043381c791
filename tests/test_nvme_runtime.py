"""The NVMe tier's runtime (shfx.compile(offload=shfx.Offload(optimizer="nvme", ...))): AdamW's
states on an SSD store, a host window of them in RAM. Every run is compared bitwise
(torch.equal) with the same run keeping every state in host RAM: the update runs the same
kernel over the same per-parameter views, only the memory under the states differs."""

from __future__ import annotations

import os

import pytest
import torch
from zoo import ZOO, gpt, loss_of, token_batch

import shfx
from shfx.errors import ActionError, SSDSpaceError, UsageError
from shfx.runtime import ssd as ssd_mod


OPTIMIZERS = {
    "adamw": lambda: shfx.optim.AdamW(lr=1e-2, weight_decay=0.01),
    "sgd": lambda: shfx.optim.SGD(lr=1e-2, momentum=0.9, weight_decay=0.01),
    "nesterov": lambda: shfx.optim.SGD(lr=1e-2, momentum=0.9, nesterov=True),
    "adafactor": lambda: shfx.optim.Adafactor(lr=1e-2, weight_decay=0.01),
}


def train(make_model, make_batch, *, offload=None, steps=3, accum=1, window=2, policy="stronghold", keep=False, optimizer="adamw", **kw):
    """``steps`` optimizer steps; returns (losses, model state, optimizer state_dict, cm or None).
    ``optimizer``: a name in :data:`OPTIMIZERS`.

    NOTE: ``recompute="full"``, not ``"auto"``: auto picks early stop per stage from measured
    forward times, and the two recompute ways draw dropout masks differently, so a run whose
    timing differs (SSD I/O sharing the cores) could take the other way."""
    kw.setdefault("recompute", "full")
    torch.manual_seed(0)
    model = make_model()
    pol = shfx.Stronghold(window=window) if policy == "stronghold" else policy
    cm = shfx.compile(
        model, device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None), policy=pol,
        optimizer=OPTIMIZERS[optimizer](), grad_accum_steps=accum, offload=offload, **kw,
    )  # fmt: skip
    losses = []
    for step in range(steps):
        for micro in range(accum):
            args, kwargs, aux = make_batch(step, micro)
            torch.manual_seed(10_000 + 100 * step + micro)
            loss = loss_of(cm(*args, **kwargs), aux) / accum
            loss.backward()
            losses.append(loss.detach().clone())
        cm.step()
        cm.zero_grad()
    state = {k: v.clone() for k, v in cm.state_dict().items()}
    opt = cm.optimizer.state_dict()
    if not keep:
        cm.close()
        cm = None
    return losses, state, opt, cm


def assert_bitwise(a, b) -> None:
    la, sa, oa, _ = a
    lb, sb, ob, _ = b
    assert all(torch.equal(x, y) for x, y in zip(la, lb)), (la, lb)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert oa["state"].keys() == ob["state"].keys() and oa["state"]
    for i in oa["state"]:
        for f in oa["state"][i]:
            assert torch.equal(oa["state"][i][f], ob["state"][i][f]), (i, f)



def _resumed_third_step(cm, ckpt, ref) -> dict:
    """Load ``ckpt`` (saved after 2 steps) into ``cm`` and train step 2: the loss, weights and
    optimizer states equal ``ref``'s (train()'s 3 steps); returns the optimizer's state."""
    cm.load_checkpoint(ckpt)
    args, kwargs, aux = token_batch(2)
    torch.manual_seed(10_000 + 200)
    loss = loss_of(cm(*args, **kwargs), aux)
    loss.backward()
    cm.step()
    assert torch.equal(loss, ref[0][2])
    assert all(torch.equal(v, ref[1][k]) for k, v in cm.state_dict().items())
    opt = cm.optimizer.state_dict()["state"]
    assert all(torch.equal(opt[i][f], ref[2]["state"][i][f]) for i in opt for f in opt[i])
    return opt

def nvme(tmp_path, host_window=1, **kw) -> shfx.Offload:
    return shfx.Offload(optimizer="nvme", path=str(tmp_path / "ssd"), host_window=host_window, **kw)


@pytest.mark.parametrize("host_window", [1, 2])
def test_same_bits_as_the_host_ram_run(tmp_path, host_window):
    ref = train(gpt, token_batch)
    got = train(gpt, token_batch, offload=nvme(tmp_path, host_window), keep=True)
    cm = got[3]
    assert cm.variant.train.ssd_groups and cm.variant.train.host_window == host_window
    assert cm._engine.ssd.host_window == host_window
    cm.close()
    assert_bitwise(got, ref)


def test_accumulation_and_zero_infinity(tmp_path):
    ref = train(gpt, token_batch, accum=2, policy=shfx.ZeroInfinity())
    got = train(gpt, token_batch, accum=2, policy=shfx.ZeroInfinity(), offload=nvme(tmp_path, 2))
    assert_bitwise(got, ref)


@pytest.mark.parametrize("how", ["overlap_update=False", "max_grad_norm"])
def test_updates_the_engine_runs_itself(tmp_path, how):
    # without overlap step() runs the updates; with clipping they run during the next forward:
    # both from the program, with the SSD reads and write-backs its passes placed around them
    kw = {"overlap_update": False} if how == "overlap_update=False" else {"max_grad_norm": 0.5}
    ref = train(gpt, token_batch, **kw)
    got = train(gpt, token_batch, offload=nvme(tmp_path, 1), **kw)
    assert_bitwise(got, ref)


def test_bf16_mixed_precision(tmp_path):
    ref = train(gpt, token_batch, precision="bf16")
    got = train(gpt, token_batch, precision="bf16", offload=nvme(tmp_path, 2))
    assert_bitwise(got, ref)


def _fp16_with_an_overflow(offload, optimizer="adamw", policy=None):
    """fp16, overlapped update (rollback on: its default), 4 steps; the second one's first-stage
    gradient overflows after the later stages' updates ran (they are undone). Returns train()'s
    tuple and the groups each rollback restored."""
    from faults import FaultInjector

    torch.manual_seed(0)
    cm = shfx.compile(
        gpt(), device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None), policy=policy or shfx.Stronghold(window=2),
        optimizer=OPTIMIZERS[optimizer](), precision="fp16", scaler=shfx.LossScaler(init_scale=256.0),
        recompute="full", offload=offload,
    )  # fmt: skip
    restored = []

    def overflow(event):
        cm._engine.store.grad(0).data[0] = float("inf")

    losses = []
    for step in range(4):
        args, kwargs, aux = token_batch(step)
        torch.manual_seed(10_000 + 100 * step)
        loss = loss_of(cm(*args, **kwargs), aux)
        if step == 1:
            rollback = cm._engine.journal.rollback  # (the engine starts at the first call)
            cm._engine.journal.rollback = lambda region: restored.append(rollback(region)) or restored[-1]
            with FaultInjector(cm.backend, "US0", 1, action=overflow):
                loss.backward()
                cm.step()
        else:
            loss.backward()
            cm.step()
        cm.zero_grad()
        losses.append(loss.detach().clone())
    out = losses, {k: v.clone() for k, v in cm.state_dict().items()}, cm.optimizer.state_dict(), cm
    return out, restored


def test_fp16_overlapped_rolls_back_with_the_states_on_the_ssd(tmp_path):
    # issue 25: fp16 with the overlapped update runs with the tier (rollback, its default, keeps
    # the undo of the states on the SSD: their previous version until the step commits); an
    # overflow after later groups were updated undoes them; the same bits as in RAM
    ref, ref_restored = _fp16_with_an_overflow(None)
    got, restored = _fp16_with_an_overflow(nvme(tmp_path, 2))
    cm = got[3]
    assert cm.config.rollback and cm._engine.ssd.versioned and cm.skipped_steps == ref[3].skipped_steps == 1
    assert restored == ref_restored and restored[0] and 0 not in restored[0], restored  # later groups undone
    assert cm._engine.journal.host_bytes < ref[3]._engine.journal.host_bytes / 2  # master and step only
    for c in (cm, ref[3]):
        c.close()
    assert_bitwise(got, ref)


def _window_matches_the_ledger(cm) -> None:
    """The tier's bytes: each step's SSD reads and writes are the program's, the window's host
    bytes (buffers and step counters) and the SSD's extents the ledger's, with this optimizer's
    states (``cm.optimizer.host_states``)."""
    store, win = cm._engine.ssd.ssd, cm._engine.ssd
    moved = cm.variant.train.bytes_moved()
    r0, w0 = store.bytes_read, store.bytes_written
    args, kwargs, aux = token_batch(0)
    loss_of(cm(*args, **kwargs), aux).backward()
    cm.step()
    cm.zero_grad()
    assert moved["ssd_read"] > 0 and (store.bytes_read - r0, store.bytes_written - w0) == (moved["ssd_read"], moved["ssd_write"])
    led = cm.variant.ledger(rollback=cm.config.rollback, optimizer=cm.optimizer.host_states(cm.variant.graph.groups))
    assert led.static("host")["SSD host window"] == win.host_bytes
    assert led.static("ssd")["optimizer states (m, v)"] == sum(e.nbytes for e in store.extents.values())
    # (without the optimizer the ledger sizes the buffers by the program's specs, and counts one step per group)
    default = cm.variant.ledger(rollback=cm.config.rollback).static("host")["SSD host window"]
    assert win.host_bytes - default == 4 * sum(win.steps[g].numel() - 1 for g in win.groups)


@pytest.mark.parametrize(
    "optimizer, policy",
    [("nesterov", shfx.ZeroOffload()), ("adafactor", shfx.Stronghold(window=2))],
    ids=["sgd-nesterov-zero-offload", "adafactor-stronghold"],
)
def test_sgd_adafactor_and_zero_offload(tmp_path, optimizer, policy):
    # issue 25: the tier holds each optimizer's states (SGD's momentum buffer, Adafactor's factored
    # second moments and full ones for vectors, its per-parameter steps in RAM) and runs with every
    # policy updating on the host; the same bits as the run with every state in RAM, and the
    # tier's bytes are the program's and the ledger's
    ref = train(gpt, token_batch, optimizer=optimizer, policy=policy)
    got = train(gpt, token_batch, optimizer=optimizer, policy=policy, offload=nvme(tmp_path, 1), keep=True)
    cm = got[3]
    names = {k[0] for k in cm._engine.ssd.ssd.extents}
    assert names == ({"momentum"} if optimizer == "nesterov" else {"factors"}), names
    _window_matches_the_ledger(cm)
    cm.close()
    assert_bitwise(got, ref)


def test_adafactor_fp16_rolls_back(tmp_path):
    # rollback with the tier and another optimizer: fp16's overflow undoes the later groups'
    # updates (versioned extents of Adafactor's factors, its per-parameter steps from the journal)
    ref, ref_restored = _fp16_with_an_overflow(None, "adafactor")
    got, restored = _fp16_with_an_overflow(nvme(tmp_path, 2), "adafactor")
    cm = got[3]
    assert cm._engine.ssd.versioned and cm.skipped_steps == ref[3].skipped_steps == 1
    assert restored == ref_restored and restored[0], restored
    for c in (cm, ref[3]):
        c.close()
    assert_bitwise(got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "nesterov", "adafactor"])
@pytest.mark.parametrize(
    "policy", ["stronghold", "zero-offload", "delayed", "zero-infinity", "function"],
)
def test_optimizers_and_policies_grid(tmp_path, optimizer, policy):
    # every host-updating policy (ZeroOffload's delayed update, a function policy's program) with
    # each optimizer, and gradient accumulation, overlap_update=False and exact clipping for SGD
    from shfx.passes.policies import schedule_window

    pol = {"stronghold": shfx.Stronghold(window=2), "zero-offload": shfx.ZeroOffload(),
           "delayed": shfx.ZeroOffload(delayed_update=True), "zero-infinity": shfx.ZeroInfinity(),
           "function": lambda specs, w: schedule_window(specs, w)}[policy]  # fmt: skip
    ref = train(gpt, token_batch, optimizer=optimizer, policy=pol)
    got = train(gpt, token_batch, optimizer=optimizer, policy=pol, offload=nvme(tmp_path, 2), keep=True)
    assert got[3].variant.train.ssd_groups and "nvme H=2" in got[3].variant.train.name
    got[3].close()
    assert_bitwise(got, ref)
    if optimizer == "sgd" and policy == "stronghold":
        for kw in (dict(accum=2), dict(overlap_update=False), dict(max_grad_norm=0.5), dict(precision="bf16")):
            assert_bitwise(train(gpt, token_batch, optimizer=optimizer, offload=nvme(tmp_path, 1), **kw),
                           train(gpt, token_batch, optimizer=optimizer, **kw))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adafactor"])
def test_rollback_and_checkpoints_of_the_other_optimizers(tmp_path, optimizer):
    # fp16's rollback (SGD's momentum; Adafactor's: the default suite); a checkpoint of an NVMe run
    # loaded into another NVMe run (written to the SSD before the first call) resumes bitwise as
    # the RAM run
    if optimizer == "sgd":
        ref, ref_restored = _fp16_with_an_overflow(None, optimizer)
        got, restored = _fp16_with_an_overflow(nvme(tmp_path, 1), optimizer)
        assert restored == ref_restored and restored[0], restored
        for c in (got[3], ref[3]):
            c.close()
        assert_bitwise(got, ref)
    *_, cm = train(gpt, token_batch, optimizer=optimizer, offload=nvme(tmp_path, 1), steps=2, keep=True)
    ckpt = str(tmp_path / "ckpt")
    cm.save_checkpoint(ckpt)
    cm.close()
    ref = train(gpt, token_batch, optimizer=optimizer, steps=3)
    torch.manual_seed(0)
    cm2 = shfx.compile(gpt(), device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None), policy=shfx.Stronghold(window=2),
                       optimizer=OPTIMIZERS[optimizer](), offload=nvme(tmp_path / "b", 2), recompute="full")  # fmt: skip
    opt = _resumed_third_step(cm2, ckpt, ref)
    assert opt
    cm2.load_checkpoint(ckpt)  # into the running model: written to the SSD
    assert all(int(e["step"]) == 2 for e in cm2.optimizer.state_dict()["state"].values() if "step" in e)
    cm2.close()


def test_a_skip_undoes_the_updates_whose_states_are_on_the_ssd(tmp_path):
    # skip_nonfinite with the overlapped update: the first stage's gradient is the last known, the
    # later groups' updates ran (their states written back to the SSD's other version) and are
    # undone; eager skips the step too, and the next step matches it (states included)
    from test_failures_engine import Pair, _poison_host_grad

    from faults import FaultInjector

    p = Pair(shfx.Stronghold(window=2), skip_nonfinite=True, offload=nvme(tmp_path, 1))
    p.step_both()
    with FaultInjector(p.cm.backend, "U0", 1, action=_poison_host_grad(p, 0)) as f:
        p.shfx_step()
    assert f.fired == "U0" and p.cm.last_step_skipped
    p.eager_step(apply=False)
    p.assert_same()
    for _ in range(2):
        p.step_both()
        p.assert_same()
    p.cm.close()


def test_a_failing_ssd_write_rolls_the_step_back(tmp_path, monkeypatch):
    # rollback=True with the tier: a write-back that fails undoes the step (the groups written
    # before it keep their previous version, the masters and steps come from the journal), the
    # gradients stay, and retrying step() applies the step as if nothing had failed
    ref = train(gpt, token_batch, steps=2)
    *_, cm = train(gpt, token_batch, offload=nvme(tmp_path, 1), rollback=True, steps=1, keep=True)
    real, calls = ssd_mod._write_full, []

    def broken(fd, buf, offset):
        calls.append(offset)
        if len(calls) == 3:  # the second group's write: the first group's is on the SSD already
            raise OSError(5, "Input/output error")
        return real(fd, buf, offset)

    monkeypatch.setattr(ssd_mod, "_write_full", broken)
    args, kwargs, aux = token_batch(1)
    torch.manual_seed(10_000 + 100)
    loss_of(cm(*args, **kwargs), aux).backward()
    with pytest.raises(ActionError, match=r"SSD write of optimizer states SW\d+ failed") as e:
        cm.step()
    assert "rolled back" in str(e.value) and "the gradients are kept" in str(e.value), str(e.value)
    monkeypatch.undo()
    cm.step()
    assert all(torch.equal(v, ref[1][k]) for k, v in cm.state_dict().items())
    opt = cm.optimizer.state_dict()["state"]
    assert all(torch.equal(opt[i][f], ref[2]["state"][i][f]) for i in opt for f in opt[i])
    # the ledger: the journal's copies are masters and steps; the SSD holds two versions of m and v
    led = cm.variant.ledger(rollback=True)
    assert led.static("host")["rollback copies"] == cm._engine.journal.host_bytes > 0
    assert led.static("ssd")["optimizer states (m, v)"] == sum(e.nbytes for e in cm._engine.ssd.ssd.extents.values())
    cm.close()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:window=64 is more than")
@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("window", [1, 2, "all"])
@pytest.mark.parametrize("host_window", [1, 2])
def test_zoo_grid(tmp_path, name, window, host_window):
    make_model, make_batch = ZOO[name]
    w = 64 if window == "all" else window
    ref = train(make_model, make_batch, window=w)
    got = train(make_model, make_batch, window=w, offload=nvme(tmp_path, host_window))
    assert_bitwise(got, ref)


def test_bytes_per_step_are_the_programs(tmp_path):
    *_, cm = train(gpt, token_batch, offload=nvme(tmp_path, 2), steps=1, keep=True)
    store = cm._engine.ssd.ssd
    moved = cm.variant.train.bytes_moved()
    assert moved["ssd_read"] > 0 and moved["ssd_read"] == moved["ssd_write"]
    for step in range(1, 3):
        r0, w0 = store.bytes_read, store.bytes_written
        args, kwargs, aux = token_batch(step)
        loss_of(cm(*args, **kwargs), aux).backward()
        cm.step()
        cm.zero_grad()
        assert (store.bytes_read - r0, store.bytes_written - w0) == (moved["ssd_read"], moved["ssd_write"])
    # the states in RAM: the window's buffers (for the largest group), not every group's
    groups = [cm._store.groups[g] for g in cm._engine.ssd.groups]
    assert len(groups) > 2
    assert cm._engine.ssd.host_bytes == 2 * 2 * max(g.state_bytes for g in groups) + 4 * len(groups)
    assert not cm.optimizer.runner.state  # nothing staged between steps
    cm.close()


def test_an_emulated_ssd_at_a_finite_rate(tmp_path):
    off = nvme(tmp_path, 1, nvme_read="200MB/s", nvme_write="100MB/s")
    *rest, cm = train(gpt, token_batch, offload=off, keep=True)
    store = cm._engine.ssd.ssd
    assert (store.read_bps, store.write_bps) == (200e6, 100e6)
    cm.close()
    assert_bitwise((*rest, None), train(gpt, token_batch))


def test_the_scratch_file_goes_with_close(tmp_path):
    *_, cm = train(gpt, token_batch, offload=nvme(tmp_path, 1), steps=1, keep=True)
    path = cm._engine.ssd.ssd.file_path
    assert os.path.exists(path) and os.path.dirname(path) == str(tmp_path / "ssd")
    cm.close()
    assert not os.path.exists(path) and os.listdir(tmp_path / "ssd") == []


def test_a_full_disk_is_refused_before_training(tmp_path, monkeypatch):
    real = ssd_mod.shutil.disk_usage
    monkeypatch.setattr(ssd_mod.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    torch.manual_seed(0)
    model = gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="256MiB"), optimizer=shfx.optim.AdamW(), offload=nvme(tmp_path))
    args, kwargs, _ = token_batch(0)
    with pytest.raises(SSDSpaceError, match=r"needs \d+ bytes .* has 1000 bytes .* free") as e:
        cm(*args, **kwargs)
    assert e.value.path == str(tmp_path / "ssd") and e.value.available_bytes == 1000
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    cm.close()


def test_a_failing_ssd_read_names_its_action(tmp_path, monkeypatch):
    # the SSD reads run with the updates (issued by the backward, waited for by step()): a failed
    # read fails step() with an ActionError naming it; nothing hangs, every buffer is free again,
    # and (no update ran: each waits for its group's read) retrying step() applies the step
    ref = train(gpt, token_batch, steps=2)
    *_, cm = train(gpt, token_batch, offload=nvme(tmp_path, 1), steps=1, keep=True)

    def broken(fd, buf, offset):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ssd_mod, "_read_full", broken)
    args, kwargs, aux = token_batch(1)
    torch.manual_seed(10_000 + 100)
    loss_of(cm(*args, **kwargs), aux).backward()
    with pytest.raises(ActionError, match=r"SSD read of optimizer states SR\d+ failed: SSDIOError: SSD read of \('[mv]', \d+\) failed") as e:
        cm.step()
    assert e.value.action.startswith("SR") and "the gradients are kept" in str(e.value)
    assert not cm._engine.ssd.where
    monkeypatch.undo()
    cm.step()
    assert all(torch.equal(v, ref[1][k]) for k, v in cm.state_dict().items())
    cm.close()


def test_state_dict_and_checkpoint_read_the_ssd(tmp_path):
    # a checkpoint of an NVMe run after 2 steps, loaded into a new NVMe run: 1 more step there is
    # bitwise the host-RAM run's 3 steps
    *_, cm = train(gpt, token_batch, offload=nvme(tmp_path, 1), steps=2, keep=True)
    ckpt = str(tmp_path / "ckpt")
    cm.save_checkpoint(ckpt)
    cm.close()
    ref = train(gpt, token_batch, steps=3)
    torch.manual_seed(0)
    model = gpt()
    cm2 = shfx.compile(model, device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None), policy=shfx.Stronghold(window=2),
                       optimizer=shfx.optim.AdamW(lr=1e-2, weight_decay=0.01), offload=nvme(tmp_path / "b", 1))  # fmt: skip
    _resumed_third_step(cm2, ckpt, ref)
    # and loading into a running NVMe model writes the SSD
    cm2.load_checkpoint(ckpt)
    assert int(cm2.optimizer.state_dict()["state"][0]["step"]) == 2
    cm2.close()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(offload="params", policy=shfx.Stronghold(resident_first="auto")), r"params='nvme'\) \(the parameter tier\) is not run yet with: resident_first='auto'"),
        (dict(optimizer="sgd"), "SGD without momentum keeps no optimizer state"),
        (dict(policy=shfx.Resident()), "updates every group on the device"),
        (dict(policy=shfx.Stronghold(nvme=True, host_window=2)), "give it in one place"),
        (dict(optimizer=None), "there is no optimizer"),
    ],
)
def test_refusals(tmp_path, kw, match):
    opt = {"sgd": shfx.optim.SGD(lr=0.1), None: None}.get(kw.pop("optimizer", "adamw"), shfx.optim.AdamW())
    off = kw.pop("offload", None)
    off = shfx.Offload(optimizer="nvme", params="nvme", gradients="nvme", path=str(tmp_path)) if off == "params" else nvme(tmp_path, 1)
    with pytest.raises(UsageError, match=match):
        shfx.compile(gpt(), optimizer=opt, offload=off, **kw)


def test_the_tuner_chooses_the_host_window(tmp_path):
    # host_window="auto" (the Offload default): the tuner simulates each host window with the
    # emulated SSD's rates and cm.report() says which it chose and why (a real disk's speed is
    # measured once on the path instead)
    torch.manual_seed(0)
    cm = shfx.compile(gpt(), device=shfx.EmulatedDevice(memory="256MiB"), optimizer=shfx.optim.AdamW(), policy=shfx.Stronghold(window="auto"),
                      offload=shfx.Offload(optimizer="nvme", path=str(tmp_path), nvme_read="20MB/s", nvme_write="20MB/s"))  # fmt: skip
    args, kwargs, aux = token_batch(0)
    loss_of(cm(*args, **kwargs), aux).backward()
    cm.step()
    h = cm.variant.train.host_window
    assert 1 <= h <= len(cm.variant.train.ssd_groups) and cm._engine.ssd.host_window == h
    assert f"Host window {h} (of {len(cm.variant.train.ssd_groups)} groups on the SSD)" in str(cm.report())
    cm.close()


def _tight_run(tmp_path, memory, offload=None):
    """Two steps of a window-1 Stronghold on an emulated device of ``memory`` bytes; the cm."""
    torch.manual_seed(0)
    cm = shfx.compile(gpt(), device=shfx.EmulatedDevice(memory=memory), policy=shfx.Stronghold(window=1),
                      optimizer=shfx.optim.AdamW(lr=1e-2), offload=offload, recompute="full")  # fmt: skip
    for step in range(2):
        args, kwargs, aux = token_batch(step)
        loss_of(cm(*args, **kwargs), aux).backward()
        cm.step()
        cm.zero_grad()
    return cm


def _training_peak_bytes(tmp_path) -> int:
    """The device bytes the window-1 training holds at its peak (no profile runs for it); the
    profiler's cache cleared, so the run on a device of that size profiles again."""
    import shfx.profiler as profiler

    cm = _tight_run(tmp_path, "256MiB")
    need = cm._backend.peak_bytes
    cm.close()
    profiler.clear_cache()
    return need


def test_the_host_window_probe_fits_where_the_training_fits(tmp_path):
    # issue 25: with host_window="auto" (the Offload default) the tuner profiles the device even
    # for a fixed window; its probe allocated a link-copy buffer of 8 slots (and, emulated, ran
    # window 2, and timed the device optimizer on 16k-element scratch copies) and ran out of
    # memory on a device where the window-1 training itself runs
    need = _training_peak_bytes(tmp_path)
    _tight_run(tmp_path, need).close()  # the training fits exactly
    cm = _tight_run(tmp_path, need, offload=shfx.Offload(optimizer="nvme", path=str(tmp_path / "ssd")))
    assert cm.variant.train.host_window >= 1 and "host_window" not in cm.variant.policy.auto
    assert cm._backend.peak_bytes <= need
    cm.close()


def test_a_profile_out_of_memory_names_the_host_window_probe(tmp_path, monkeypatch):
    import shfx.profiler as profiler

    need = _training_peak_bytes(tmp_path)
    # the link probe's smallest copies larger than the device has free: it cannot fit
    monkeypatch.setattr(profiler._LinkProbe, "MIN_SMALL_BYTES", need)
    with pytest.raises(shfx.OutOfDeviceMemory, match=r'profiling the device to choose host_window="auto"') as e:
        _tight_run(tmp_path, need, offload=shfx.Offload(optimizer="nvme", path=str(tmp_path / "ssd")))
    msg = str(e.value)
    assert "host_window=<int> in shfx.Offload" in msg and "smaller window" not in msg, msg
    assert e.value.what.startswith("profiling buffer (the tuner's link probe)")
