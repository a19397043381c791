"""Every combination a user asks for (issue 25): a covering array of precision x data parallel
(1, 2 ranks) x NVMe tier x clipping x rollback/skip x accumulation x optimizer x policy x
overlapped update (:mod:`combinations`), each case trained 3 steps against an eager recipe
built from the same options, with the same seed and data and no reseeding between steps:

- the torch optimizer (``AdamW(fused=True)``, ``SGD(nesterov, fused=True)``,
  ``Adafactor(foreach=True)``) on the fp32 parameters, or in 16 bits on the fp32 masters of a
  16-bit working copy (``master.grad = p16.grad.float()``, summed over the micro-steps,
  ``p16.copy_(master)`` after the step), ``torch.amp.GradScaler`` in fp16;
- ``clip_grad_norm_`` on those gradients (after ``scaler.unscale_``); a step whose loss is
  multiplied by inf (step 1, with ``skip_nonfinite`` or fp16) skipped as GradScaler skips;
- ZeRO-Offload's delayed update: step i's gradients applied after step i+1's backward;
- with 2 ranks: the same under DDP (``tests/test_data_parallel.py``'s ``_against_ddp``).

Bitwise: the losses and the final weights (fp32 masters in 16 bits), ``torch.equal``. The
default run trains a sample of the array (every fifth case); ``SHFX_SLOW=1`` trains all of it.
(Issue 25's array: 24 cases, 15 in one process and 9 on two ranks, all bitwise; 9 pairs no
accepted case can hold, each a row of the conflict table.)
A case the configuration refuses must be a true conflict (a row of ``shfx.config.CONFLICTS``),
never a "not yet" (``check_supported``)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from combinations import FACTORS, LR, WD, compile_kwargs, covering_array, label, verdict
from mixed_reference import cast_inputs, make_working_copy, working_dtype
from zoo import gpt, loss_of, token_batch

import shfx
from shfx.config import CONFLICTS
from shfx.errors import ConfigConflict

SLOW = os.environ.get("SHFX_SLOW") == "1"
CASES, CONFLICTING = covering_array()
ONE = [c for c in CASES if c["ranks"] == 1]
TWO = [c for c in CASES if c["ranks"] == 2]
# the default run: every fifth case of each (the two-rank ones in one spawn)
SAMPLE_ONE, SAMPLE_TWO = (ONE, TWO) if SLOW else (ONE[::5], TWO[::5])
STEPS = 3
POISON_STEP = 1  # the step whose loss is multiplied by inf (skip_nonfinite, fp16)


def _poisoned(case: dict) -> bool:
    return case["guard"] == "skip" or case["precision"] == "fp16"


def _torch_optimizer(name: str, params: list) -> torch.optim.Optimizer:
    return {
        "adamw": lambda: torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True),
        "sgd": lambda: torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=WD, nesterov=True, fused=True),
        "adafactor": lambda: torch.optim.Adafactor(params, lr=LR, weight_decay=WD, foreach=True),
    }[name]()


def _eager(case: dict, model: torch.nn.Module) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The eager recipe of ``case`` on ``model`` (the fp32 master): the losses, and the final
    fp32 weights."""
    dtype = working_dtype(case["precision"])
    mixed = dtype != torch.float32
    work = make_working_copy(model, dtype) if mixed else model
    master, working = dict(model.named_parameters()), dict(work.named_parameters())
    names = [n for n, p in master.items() if p.requires_grad]
    opt = _torch_optimizer(case["optimizer"], [master[n] for n in names])
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    delayed = case["policy"] == "zero-offload-delayed"
    accum = case["accum"]
    losses, prev = [], None

    def update(grads: list | None) -> None:
        for n, g in zip(names, grads or []):
            master[n].grad = g
        opt.step()
        if mixed:
            with torch.no_grad():
                for n in names:
                    working[n].copy_(master[n])
        opt.zero_grad()

    for step in range(STEPS):
        for micro in range(accum):
            args, kwargs, aux = token_batch(step, micro)
            args, kwargs = cast_inputs(args, kwargs, dtype)
            torch.manual_seed(10_000 + 100 * step + micro)
            loss = loss_of(work(*args, **kwargs), aux) / accum
            losses.append(loss.detach().clone())
            if _poisoned(case) and step == POISON_STEP and micro == accum - 1:
                loss = loss * float("inf")
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if mixed:
                for n in names:
                    p16 = working[n]
                    if p16.grad is not None:
                        g = p16.grad.float()
                        master[n].grad = g if master[n].grad is None else master[n].grad + g
                        p16.grad = None
        if delayed:  # step i's gradients applied after step i+1's backward
            cur = [master[n].grad.clone() if master[n].grad is not None else None for n in names]
            opt.zero_grad()
            if prev is not None:
                update(prev)
            prev = cur
            continue
        params = [master[n] for n in names]
        found = not all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)
        if scaler is not None:
            if case["clip"] is not None:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, case["clip"])
            scaler.step(opt)
            scaler.update()
            if mixed:
                with torch.no_grad():
                    for n in names:
                        working[n].copy_(master[n])
            opt.zero_grad()
            continue
        if case["clip"] is not None:
            torch.nn.utils.clip_grad_norm_(params, case["clip"])
        if found and case["guard"] == "skip":
            opt.zero_grad()
            continue
        update(None)
    if delayed:
        update(prev)  # the last step's update, which the compiled model's sync waits for
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _shfx(case: dict, model: torch.nn.Module, ssd_path: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], shfx.CompiledModel]:
    cm = shfx.compile(
        model, device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None), recompute="full",
        **compile_kwargs(case, ssd_path),
    )  # fmt: skip
    accum, losses = case["accum"], []
    for step in range(STEPS):
        for micro in range(accum):
            args, kwargs, aux = token_batch(step, micro)
            torch.manual_seed(10_000 + 100 * step + micro)
            loss = loss_of(cm(*args, **kwargs), aux) / accum
            losses.append(loss.detach().clone())
            if _poisoned(case) and step == POISON_STEP and micro == accum - 1:
                loss = loss * float("inf")
            loss.backward()
        cm.step()
        cm.zero_grad()
    cm.sync()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, cm


def _single_process(case: dict, ssd_path: str) -> list[str]:
    """Train ``case`` with shfx and eagerly; the mismatches (empty: bitwise)."""
    torch.manual_seed(0)
    model = gpt()
    ref = copy.deepcopy(model)
    losses, weights, cm = _shfx(case, model, ssd_path)
    try:
        if _poisoned(case) and case["guard"] != "none" or case["precision"] == "fp16":
            assert cm.skipped_steps == 1, f"{label(case)}: {cm.skipped_steps} steps skipped, not the poisoned one"
    finally:
        cm.close()
    ref_losses, ref_weights = _eager(case, ref)
    bad = [f"loss {i}: {a.item()!r} != {b.item()!r}" for i, (a, b) in enumerate(zip(losses, ref_losses)) if not torch.equal(a, b)]
    bad += [f"{n}: max |diff| {(weights[n] - w).abs().max().item():.3g}" for n, w in ref_weights.items() if not torch.equal(weights[n], w)]
    return bad


@pytest.mark.parametrize("case", SAMPLE_ONE, ids=label)
def test_a_case_trains_like_its_eager_recipe(case, tmp_path):
    kind, why = verdict(case)
    assert kind == "ok", why
    bad = _single_process(case, str(tmp_path))
    assert not bad, f"{label(case)} differs from its eager recipe: " + "; ".join(bad[:6])


def _ddp_config(case: dict) -> dict:
    """``case`` as a configuration of ``tests/test_data_parallel.py``'s ``_against_ddp`` (eager
    DDP with the same recipe): the GPT, or with a poisoned step the MLP whose rank-0 targets
    are inf at that step (its loss, and so every rank's reduced gradient, non-finite)."""
    import tempfile

    kw = compile_kwargs(case, tempfile.gettempdir())  # (each rank's SSD file is its own)
    del kw["optimizer"], kw["grad_accum_steps"]
    cfg = dict(name="gpt_mask", window=None, accum=case["accum"], optimizer=case["optimizer"], **kw)
    if _poisoned(case):
        cfg.update(name="mlp", poison=(POISON_STEP, 0, "batch"))
    return cfg


def test_two_rank_cases_train_like_ddp(tmp_path):
    from test_data_parallel import _check_ddp_results, _spawn

    for case in SAMPLE_TWO:
        kind, why = verdict(case)
        assert kind == "ok", f"{label(case)}: {why}"
    configs = [_ddp_config(c) for c in SAMPLE_TWO]
    results = _spawn(tmp_path, 2, "ddp", timeout_s=600, configs=configs)
    _check_ddp_results(results, configs, 2)


def test_the_array_covers_every_pair_and_refuses_only_true_conflicts():
    """Every pair of values of two options is in an accepted case, or no accepted case can hold
    it (a conflicting pair: refused by a row of the conflict table, with its reason and fix)."""
    names = list(FACTORS)
    covered = set()
    for c in CASES:
        covered |= {(a, c[a], b, c[b]) for i, a in enumerate(names) for b in names[i + 1 :]}
    every = {(a, va, b, vb) for i, a in enumerate(names) for b in names[i + 1 :] for va in FACTORS[a] for vb in FACTORS[b]}
    assert every == covered | set(CONFLICTING)
    not_yet = [(label(c), verdict(c)[1]) for c in CASES if verdict(c)[0] == "not yet"]
    assert not not_yet, f"{len(not_yet)} of {len(CASES)} cases are not run yet: {not_yet[:3]}"
    plain = {n: v[0] for n, v in FACTORS.items()}
    rows = {row.name for row in CONFLICTS}
    for a, va, b, vb in CONFLICTING:
        kind, why = verdict(plain | {a: va, b: vb})
        assert kind == "conflict", (a, va, b, vb, why)
        with pytest.raises(ConfigConflict) as e:
            from shfx.config import Config

            Config.from_args(device="emulated", **compile_kwargs(plain | {a: va, b: vb}, "/nonexistent"))
        assert e.value.conflict.name in rows
