"""Checkpoint and resume (shfx.checkpoint, cm.save_checkpoint / cm.load_checkpoint).

The resume tests train 10 steps in this process, saving a checkpoint after step 5 on the way,
and a NEW process (this file run as a script) loads it and trains steps 5-9: its losses, final
weights and optimizer state must equal this run's bitwise. Saving does not change the state or
draw random numbers, so the run that saves is the uninterrupted 10-step reference. One child
process resumes every scenario (each subprocess pays ~3 s to import torch).

No step reseeds the RNG: dropout masks after the resume come from the generator state the
checkpoint restored (and the same resume with ``restore_rng=False`` is checked to differ).
"""

from __future__ import annotations

import copy
import doctest
import os
import subprocess
import sys
import threading

import pytest
import torch

import shfx
import shfx.checkpoint as ckpt
from shfx.errors import UsageError

from zoo import HFStyleLM, gpt_dropout, gpt_tied, hf_batch, loss_of, token_batch

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, SAVE_AT = 10, 5

# name -> (model, compile options, grad_accum_steps, with an LR scheduler)
SCENARIOS = {
    "dropout": (gpt_dropout, {"window": 2}, 1, False),
    # torch's LambdaLR on cm.optimizer itself; its state is saved and loaded through scheduler=
    "accum_scheduler": (gpt_dropout, {"window": 1}, 2, True),
    # the first stage and its optimizer stay on the device: its AdamW states are the device optimizer's
    "device_optimizer": (gpt_tied, {"policy": shfx.Stronghold(window=1, resident_first=1)}, 1, False),
}


def _compile(model, opts: dict, accum: int, **kw) -> shfx.CompiledModel:
    return shfx.compile(
        model, device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None),
        optimizer=shfx.optim.AdamW(lr=1e-2, weight_decay=0.01), grad_accum_steps=accum, **opts, **kw,
    )  # fmt: skip


def _scheduler(opt) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _train(cm, steps: range, accum: int, sched=None, make_batch=token_batch) -> list[float]:
    losses = []
    for step in steps:
        for micro in range(accum):
            args, kwargs, aux = make_batch(step, micro)
            loss = loss_of(cm(*args, **kwargs), aux) / accum
            loss.backward()
            losses.append(loss.item())
        cm.optimizer.step()
        cm.optimizer.zero_grad()
        if sched is not None:
            sched.step()
    return losses


def _snapshot(cm, opt=None) -> dict:
    """Weights, optimizer state (by parameter name, copied) and param_groups (with names, less
    the options that pick an implementation) of a compiled model, or of an eager model ``cm``
    and its optimizer ``opt``."""
    model, opt = (cm.module, cm.optimizer) if opt is None else (cm, opt)
    state, groups = ckpt._optimizer_state(model.named_parameters(), opt)
    return {
        "weights": {k: v.detach().clone() for k, v in cm.state_dict().items()},
        "optim": {n: {k: v.clone() for k, v in e.items()} for n, e in state.items()},
        "hyper": [{k: v for k, v in g.items() if k not in ckpt._IMPL} for g in groups],
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["weights"].keys() == b["weights"].keys()
    for k in a["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), f"weight {k} differs"
    assert a["optim"].keys() == b["optim"].keys() and a["optim"]
    for n in a["optim"]:
        assert a["optim"][n].keys() == b["optim"][n].keys()
        for f in a["optim"][n]:
            assert torch.equal(a["optim"][n][f], b["optim"][n][f]), f"optimizer state {f} of {n} differs"
    assert a["hyper"] == b["hyper"]


# ---- the child process ----------------------------------------------------------------------------
def _resume(name: str, path: str) -> dict:
    make, opts, accum, with_sched = SCENARIOS[name]
    torch.manual_seed(123)  # other initial weights and RNG than the saving run: the checkpoint must set both
    cm = _compile(make(), opts, accum)
    sched = _scheduler(cm.optimizer) if with_sched else None
    extra = cm.load_checkpoint(path, scheduler=sched)  # before the first call: a fresh process
    losses = _train(cm, range(extra["next_step"], STEPS), accum, sched)
    out = {"losses": losses, "extra": extra, **_snapshot(cm)}
    # again, into the model that has run since (its host store and states exist): the same run
    sched = _scheduler(cm.optimizer) if with_sched else None
    cm.load_checkpoint(path, scheduler=sched)
    out["again"] = _train(cm, range(SAVE_AT, STEPS), accum, sched)
    if name == "dropout":  # and without restoring the RNG: other dropout masks, other losses
        cm.load_checkpoint(path, restore_rng=False)
        out["no_rng"] = _train(cm, range(SAVE_AT, STEPS), accum)
    cm.close()
    return out


def _kill_mid_save(path: str, expected: str) -> None:
    """Save a good checkpoint, record what it holds, train on, then save again with
    SHFX_CHECKPOINT_TEST_KILL_AT=data set: the process is SIGKILLed with the new shards written
    and DCP's metadata not."""
    torch.manual_seed(0)
    cm = _compile(gpt_tied(), {"window": 2}, 1)
    _train(cm, range(2), 1)
    cm.save_checkpoint(path, extra={"next_step": 2})
    torch.save(_snapshot(cm), expected)
    _train(cm, range(2, 3), 1)
    os.environ[ckpt._KILL_ENV] = "data"
    cm.save_checkpoint(path, extra={"next_step": 3})
    raise AssertionError("the save was not killed")


def _main(argv: list[str]) -> None:
    sys.path.insert(0, HERE)
    if argv[0] == "resume":
        out, paths = argv[1], dict(a.split("=", 1) for a in argv[2:])
        torch.save({name: _resume(name, p) for name, p in paths.items()}, out)
    elif argv[0] == "kill":
        _kill_mid_save(argv[1], argv[2])


def _run_child(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=600)


# ---- resume in a new process ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Per scenario: (this process's 10-step run, the child's resumed run)."""
    root = tmp_path_factory.mktemp("resume")
    full, paths = {}, {}
    for name, (make, opts, accum, with_sched) in SCENARIOS.items():
        torch.manual_seed(0)
        model = make()
        cm = _compile(model, opts, accum)
        sched = _scheduler(cm.optimizer) if with_sched else None
        torch.manual_seed(1)
        losses = _train(cm, range(SAVE_AT), accum, sched)
        paths[name] = str(root / name)
        cm.save_checkpoint(paths[name], extra={"next_step": SAVE_AT}, scheduler=sched)
        losses += _train(cm, range(SAVE_AT, STEPS), accum, sched)
        full[name] = {"losses": losses, **_snapshot(cm)}
        cm.close()
    out = str(root / "resumed.pt")
    r = _run_child("resume", out, *(f"{n}={p}" for n, p in paths.items()))
    assert r.returncode == 0, r.stderr[-4000:]
    child = torch.load(out, weights_only=False)
    return {name: (full[name], child[name]) for name in SCENARIOS}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_resume_in_a_new_process_is_bitwise(resumed, name):
    full, res = resumed[name]
    accum = SCENARIOS[name][2]
    assert res["extra"] == {"next_step": SAVE_AT}
    assert res["losses"] == full["losses"][SAVE_AT * accum :]
    assert res["again"] == full["losses"][SAVE_AT * accum :]  # loaded again into the running model
    _assert_same(res, full)


def test_resume_restores_the_rng(resumed):
    full, res = resumed["dropout"]
    assert res["no_rng"] != full["losses"][SAVE_AT:]  # other dropout masks: the RNG state matters


def test_scheduler_state_and_lr_are_resumed(resumed):
    full, res = resumed["accum_scheduler"]
    assert res["hyper"][0]["lr"] == full["hyper"][0]["lr"] == pytest.approx(1e-2 / (1 + STEPS))


# ---- atomicity ---------------------------------------------------------------------------------------
def test_killed_save_leaves_the_last_checkpoint(tmp_path):
    path, expected = str(tmp_path / "ckpt"), str(tmp_path / "expected.pt")
    r = _run_child("kill", path, expected)
    assert r.returncode == -9, f"expected SIGKILL, got {r.returncode}: {r.stderr[-3000:]}"
    leftovers = [e for e in os.listdir(tmp_path) if e.startswith(".ckpt.shfx-") and e != os.readlink(path)]
    assert leftovers, "the killed save left nothing behind: it was not killed in the middle"
    want = torch.load(expected, weights_only=False)
    # into a compiled model (before its first call) ...
    torch.manual_seed(5)
    cm = _compile(gpt_tied(), {"window": 2}, 1)
    assert cm.load_checkpoint(path) == {"next_step": 2}
    args, _, _ = token_batch(0)
    with torch.no_grad():
        cm(*args)  # the first call lays out the host store and takes the optimizer state
    _assert_same(_snapshot(cm), want)
    # ... and the next save to the path removes the killed one's leftovers
    cm.save_checkpoint(path)
    assert [e for e in os.listdir(tmp_path) if e.startswith(".ckpt.shfx-")] == [os.readlink(path)]
    cm.close()


def test_failed_save_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """A save that fails after writing its data (disk full, say) leaves the last checkpoint and
    nothing else."""
    path = str(tmp_path / "ckpt")
    cm = _compile(gpt_tied(), {"window": 2}, 1)
    _train(cm, range(2), 1)
    cm.save_checkpoint(path, extra={"n": 1})
    want = _snapshot(cm)
    _train(cm, range(2, 3), 1)

    def fail(where: str) -> None:
        if where == "switch":
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "_test_kill_point", fail)
    with pytest.raises(OSError, match="No space"):
        cm.save_checkpoint(path, extra={"n": 2})
    assert [e for e in os.listdir(tmp_path) if e.startswith(".ckpt.shfx-")] == [os.readlink(path)]
    assert cm.load_checkpoint(path) == {"n": 1}
    _assert_same(_snapshot(cm), want)
    cm.close()


# ---- asynchronous save ------------------------------------------------------------------------------
def _read_all(path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    md, meta = ckpt._read_meta(path)
    flat = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items()}
    nested: dict = {"model": {}, "optimizer": {"state": {}}}
    for k, t in flat.items():
        if k.startswith("model."):
            nested["model"][k[6:]] = t
        else:
            name, _, f = k[len("optimizer.state.") :].rpartition(".")
            nested["optimizer"]["state"].setdefault(name, {})[f] = t
    dcp.load(nested, storage_reader=ckpt._reader(path), no_dist=True)
    return {"tensors": flat, "meta": meta}


def test_async_save_equals_a_synchronous_save(tmp_path, monkeypatch):
    cm = _compile(gpt_dropout(), {"window": 2}, 1)
    _train(cm, range(3), 1)
    cm.save_checkpoint(str(tmp_path / "sync"), extra={"n": 3})
    # hold the writer until the next step has changed the weights and optimizer states, so the
    # async save can only be right if it wrote the snapshot taken when it was called
    go = threading.Event()
    write = ckpt._write_checkpoint

    def held(*a, **kw):
        assert go.wait(120)
        write(*a, **kw)

    monkeypatch.setattr(ckpt, "_write_checkpoint", held)
    cm.save_checkpoint(str(tmp_path / "async"), extra={"n": 3}, async_save=True)
    _train(cm, range(3, 4), 1)
    go.set()
    cm.wait_checkpoint()
    a, s = _read_all(str(tmp_path / "async")), _read_all(str(tmp_path / "sync"))
    assert a["tensors"].keys() == s["tensors"].keys()
    for k in a["tensors"]:
        assert torch.equal(a["tensors"][k], s["tensors"][k]), k
    assert torch.equal(a["meta"]["rng"]["torch"], s["meta"]["rng"]["torch"])
    assert {k: v for k, v in a["meta"].items() if k != "rng"} == {k: v for k, v in s["meta"].items() if k != "rng"}
    cm.close()


# ---- eager interop ----------------------------------------------------------------------------------
def _eager_train(model, opt, steps: range, sched=None) -> list[float]:
    losses = []
    for step in steps:
        args, kwargs, aux = token_batch(step)
        loss = loss_of(model(*args, **kwargs), aux)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return losses


def test_eager_round_trip(tmp_path):
    """eager -> shfx -> eager: each side resumes the other's training exactly."""
    torch.manual_seed(0)
    model = gpt_dropout()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    torch.manual_seed(1)
    _eager_train(model, opt, range(3))
    ckpt.save_from(model, opt, str(tmp_path / "eager"), extra={"next_step": 3})
    info = ckpt.read_info(str(tmp_path / "eager"))
    assert (info["steps"], info["source"], info["extra"]) == (3, "eager", {"next_step": 3})
    assert info["tensors"]["optimizer.state.transformer.wte.weight.exp_avg"] == ((64, 32), torch.float32)
    ref_losses = _eager_train(model, opt, range(3, 6))

    torch.manual_seed(9)
    cm = _compile(gpt_dropout(), {"window": 2}, 1)
    _train(cm, range(1), 1)  # a model that already trained: the load replaces its state
    assert cm.load_checkpoint(str(tmp_path / "eager")) == {"next_step": 3}
    assert _train(cm, range(3, 6), 1) == ref_losses
    ours = _snapshot(cm)
    _assert_same(ours, _snapshot(model, opt))

    cm.save_checkpoint(str(tmp_path / "shfx"), extra={"next_step": 6})
    ref_losses = _train(cm, range(6, 8), 1)
    torch.manual_seed(3)
    model2 = gpt_dropout()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5, fused=True)  # hyperparameters come from the checkpoint
    assert ckpt.load_into(model2, opt2, str(tmp_path / "shfx")) == {"next_step": 6}
    assert opt2.param_groups[0]["lr"] == 1e-2
    assert _eager_train(model2, opt2, range(6, 8)) == ref_losses
    _assert_same(_snapshot(cm), _snapshot(model2, opt2))
    cm.close()


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def test_eager_amsgrad_and_partial_state(tmp_path):
    """amsgrad's max_exp_avg_sq comes along; a checkpoint whose optimizer stepped only part of
    a stage shfx updates as one is refused, and changes nothing."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True, fused=True)
    batches = [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(4)]

    def step(m, o, x, y):
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.item()

    for x, y in batches[:2]:
        step(model, opt, x, y)
    ckpt.save_from(model, opt, str(tmp_path / "ams"))
    cm = shfx.compile(_mlp(), device=shfx.EmulatedDevice(memory="1MiB", h2d=None, d2h=None), blocks=False, num_stages=2,
                      optimizer=shfx.optim.AdamW(amsgrad=True))  # fmt: skip
    cm.load_checkpoint(str(tmp_path / "ams"))
    assert [step(cm, cm, x, y) for x, y in batches[2:]] == [step(model, opt, x, y) for x, y in batches[2:]]
    _assert_same(_snapshot(cm), _snapshot(model, opt))

    before = _snapshot(cm)
    partial = _mlp()
    # the first stage whole, the second's weight but not the bias shfx updates with it: the
    # optimizer loads stage by stage, so stage 0 is loaded when stage 1 is refused
    popt = torch.optim.AdamW([partial[0].weight, partial[0].bias, partial[2].weight], lr=1e-2, amsgrad=True)
    partial(batches[0][0]).sum().backward()
    popt.step()
    ckpt.save_from(partial, popt, str(tmp_path / "partial"))
    with pytest.raises(UsageError, match=r"state for 1 of the 2 trainable parameters of stage 1"):
        cm.load_checkpoint(str(tmp_path / "partial"))
    _assert_same(_snapshot(cm), before)  # the refused load changed nothing
    cm.close()


# ---- every optimizer, parameter groups, schedulers on cm.optimizer ----------------------------------
def _groups(model: torch.nn.Module, names: bool = False) -> list[dict]:
    """No weight decay on 1-d parameters, 3x the lr for the last two parameters (three groups)."""
    named = list(model.named_parameters())
    last = {n for n, _ in named[-2:]}
    pick = (lambda n, p: n) if names else (lambda n, p: p)
    return [
        {"params": [pick(n, p) for n, p in named if p.ndim > 1 and n not in last]},
        {"params": [pick(n, p) for n, p in named if p.ndim < 2 and n not in last], "weight_decay": 0.0},
        {"params": [pick(n, p) for n, p in named if n in last], "lr": 3e-2, "weight_decay": 0.05},
    ]


# name -> (shfx optimizer over groups, torch's over groups: the kernel shfx runs)
OPTIMIZERS = {
    "adamw": (lambda g: shfx.optim.AdamW(g, lr=1e-2, weight_decay=0.01),
              lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.01, fused=True)),
    "sgd": (lambda g: shfx.optim.SGD(g, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
            lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01, fused=True)),
    "adafactor": (lambda g: shfx.optim.Adafactor(g, lr=1e-2, weight_decay=0.01),
                  lambda g: torch.optim.Adafactor(g, lr=1e-2, weight_decay=0.01, foreach=True)),
}  # fmt: skip
SCHEDULERS = {
    None: lambda opt: None,
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    "warmup_cosine": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3),
         torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - 3)],
        milestones=[3],
    ),
}  # fmt: skip


def _compile_with(kind: str, seed: int) -> shfx.CompiledModel:
    torch.manual_seed(seed)
    model = gpt_tied()
    return shfx.compile(model, device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None), window=2,
                        optimizer=OPTIMIZERS[kind][0](_groups(model, names=True)))  # fmt: skip


@pytest.mark.parametrize(
    "kind,sched",
    [
        ("adamw", "warmup_cosine"),
        pytest.param("sgd", "lambda", marks=pytest.mark.slow),
        pytest.param("adafactor", None, marks=pytest.mark.slow),
    ],
)
def test_every_optimizer_with_groups_and_scheduler_resumes_bitwise(tmp_path, kind, sched):
    """Three parameter groups (other lr and weight_decay each), the scheduler built on
    cm.optimizer itself: 10 steps equal 5 + save + load + 5, in a new compiled model (loaded
    before its first call) and again in the one that ran on, and both equal eager PyTorch."""
    path = str(tmp_path / kind)
    cm = _compile_with(kind, 0)
    ref = copy.deepcopy(cm.module)  # the same initial weights
    s = SCHEDULERS[sched](cm.optimizer)
    losses = _train(cm, range(SAVE_AT), 1, s)
    cm.save_checkpoint(path, extra={"next_step": SAVE_AT}, scheduler=s)
    lrs = s.get_last_lr() if s is not None else [1e-2, 1e-2, 3e-2]
    losses += _train(cm, range(SAVE_AT, STEPS), 1, s)
    full = _snapshot(cm)
    groups = ckpt.read_info(path)["param_groups"]
    assert [g["params"] for g in groups] == [g["params"] for g in _groups(cm.module, names=True)]
    assert [g["lr"] for g in groups] == lrs and [g["weight_decay"] for g in groups] == [0.01, 0.0, 0.05]
    field = {"adamw": "exp_avg", "sgd": "momentum_buffer", "adafactor": "row_var"}[kind]
    assert f"optimizer.state.transformer.wte.weight.{field}" in ckpt.read_info(path)["tensors"]

    opt = OPTIMIZERS[kind][1](_groups(ref))
    assert _eager_train(ref, opt, range(STEPS), SCHEDULERS[sched](opt)) == losses
    _assert_same(full, _snapshot(ref, opt))

    other = _compile_with(kind, 123)
    s2 = SCHEDULERS[sched](other.optimizer)
    assert other.load_checkpoint(path, scheduler=s2) == {"next_step": SAVE_AT}
    assert _train(other, range(SAVE_AT, STEPS), 1, s2) == losses[SAVE_AT:]
    _assert_same(_snapshot(other), full)
    s2 = SCHEDULERS[sched](other.optimizer)
    other.load_checkpoint(path, scheduler=s2)  # into the model that ran on: the same steps again
    assert _train(other, range(SAVE_AT, STEPS), 1, s2) == losses[SAVE_AT:]
    _assert_same(_snapshot(other), full)
    cm.close()
    other.close()


def test_eager_param_groups_round_trip(tmp_path):
    """eager torch.optim.AdamW(groups, fused=True) -> cm with the same groups -> eager: each side
    resumes the other's training exactly, each group with its own hyperparameters."""
    torch.manual_seed(0)
    model = gpt_tied()
    opt = torch.optim.AdamW(_groups(model), lr=1e-2, weight_decay=0.01, fused=True)
    _eager_train(model, opt, range(3))
    ckpt.save_from(model, opt, str(tmp_path / "eager"))
    ref_losses = _eager_train(model, opt, range(3, 6))

    cm = _compile_with("adamw", 9)
    cm.optimizer.lr = 0.5  # every group: the checkpoint's hyperparameters replace these
    cm.load_checkpoint(str(tmp_path / "eager"))
    assert [g["lr"] for g in cm.optimizer.param_groups] == [1e-2, 1e-2, 3e-2]
    assert [g["weight_decay"] for g in cm.optimizer.param_groups] == [0.01, 0.0, 0.05]
    assert _train(cm, range(3, 6), 1) == ref_losses
    _assert_same(_snapshot(cm), _snapshot(model, opt))

    cm.save_checkpoint(str(tmp_path / "shfx"))
    ref_losses = _train(cm, range(6, 8), 1)
    torch.manual_seed(3)
    model2 = gpt_tied()
    opt2 = torch.optim.AdamW(_groups(model2), lr=0.5, fused=True)
    ckpt.load_into(model2, opt2, str(tmp_path / "shfx"))
    assert [g["lr"] for g in opt2.param_groups] == [1e-2, 1e-2, 3e-2]
    assert _eager_train(model2, opt2, range(6, 8)) == ref_losses
    _assert_same(_snapshot(cm), _snapshot(model2, opt2))
    cm.close()


def test_mismatched_groups_or_optimizer_are_refused_and_change_nothing(tmp_path):
    cm = _compile_with("adamw", 0)
    _train(cm, range(2), 1)
    cm.save_checkpoint(str(tmp_path / "groups"))
    torch.manual_seed(0)
    model = gpt_tied()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _eager_train(model, sgd, range(1))
    ckpt.save_from(model, sgd, str(tmp_path / "sgd"))

    one = shfx.compile(gpt_tied(), device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None), window=2,
                       optimizer=shfx.optim.AdamW(lr=1e-3))  # fmt: skip
    _train(one, range(1), 1)
    before = _snapshot(one)
    with pytest.raises(UsageError, match="in different groups of the checkpoint"):
        one.load_checkpoint(str(tmp_path / "groups"))
    _assert_same(_snapshot(one), before)
    with pytest.raises(UsageError, match=r"has no \['amsgrad', 'betas', 'eps'\].*kind of optimizer that saved it"):
        one.load_checkpoint(str(tmp_path / "sgd"))
    _assert_same(_snapshot(one), before)
    cm.close()
    one.close()


def test_save_holds_views_of_the_host_store(tmp_path):
    """The synchronous save writes cm.optimizer.state's own tensors (views of the flat
    buffers) and the model's: no second copy of the training state."""
    cm = _compile_with("adamw", 0)
    _train(cm, range(1), 1)
    tensors, _ = ckpt._state(cm.state_dict(), cm.module.named_parameters(), cm.optimizer)
    live = cm.optimizer.state
    for n, p in cm.module.named_parameters():
        for f, t in tensors["optimizer"]["state"][n].items():
            if f != "step":
                assert t.data_ptr() == live[p][f].data_ptr(), (n, f)
    for k, t in cm.state_dict().items():
        assert tensors["model"][k].data_ptr() == t.data_ptr(), k
    cm.close()


# ---- fp16: the loss scaler ----------------------------------------------------------------------------
def test_fp16_scaler_state_round_trip(tmp_path):
    """HFStyleLM's first fp16 step overflows at the default scale (skipped, the scale backs
    off), later steps grow it: the scaler's state, the skip count, the fp32 masters and the
    16-bit working copy made from them all come back."""

    def make(seed):
        torch.manual_seed(seed)
        return _compile(HFStyleLM(), {"window": 2}, 1, precision="fp16", scaler=shfx.LossScaler(growth_interval=2))

    cm = make(0)
    torch.manual_seed(1)
    _train(cm, range(4), 1, make_batch=hf_batch)
    assert cm.skipped_steps >= 1
    cm.save_checkpoint(str(tmp_path / "c"))
    saved_scaler, saved_skips = cm.scaler.state_dict(), cm.skipped_steps
    ref = _train(cm, range(4, 7), 1, make_batch=hf_batch)

    other = make(7)
    _train(other, range(1), 1, make_batch=hf_batch)  # loads into a running model: its 16-bit copy is refreshed
    other.load_checkpoint(str(tmp_path / "c"))
    assert other.scaler.state_dict() == saved_scaler and other.skipped_steps == saved_skips
    assert _train(other, range(4, 7), 1, make_batch=hf_batch) == ref
    assert other.scaler.state_dict() == cm.scaler.state_dict()
    _assert_same(_snapshot(other), _snapshot(cm))
    cm.close()
    other.close()


# ---- errors -------------------------------------------------------------------------------------------
def test_errors_say_what_to_do(tmp_path):
    cm = _compile(gpt_tied(), {"window": 2}, 1)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        cm.load_checkpoint(str(tmp_path / "missing"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(UsageError, match="not empty and was not written by shfx"):
        cm.save_checkpoint(str(tmp_path / "full"))
    other = torch.nn.Sequential(torch.nn.Linear(4, 4))
    ckpt.save_from(other, None, str(tmp_path / "other"))
    with pytest.raises(UsageError, match="does not match the model: missing"):
        cm.load_checkpoint(str(tmp_path / "other"))
    with pytest.raises(UsageError, match="saved without one"):
        cm.load_checkpoint(str(tmp_path / "other"), scheduler=_scheduler(cm.optimizer))
    args, _, _ = token_batch(0)
    cm(*args).backward()
    with pytest.raises(UsageError, match="call cm.step"):
        cm.save_checkpoint(str(tmp_path / "mid"))
    cm.step()
    cm.close()


def test_module_docstring_example():
    result = doctest.testmod(ckpt, optionflags=doctest.NORMALIZE_WHITESPACE, report=False)
    assert result.attempted and result.failed == 0


if __name__ == "__main__":
    _main(sys.argv[1:])
