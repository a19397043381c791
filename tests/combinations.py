"""The combination grid of issue 25: every pair of option values at least once (a covering
array), each case a configuration ``shfx.compile`` either trains exactly as its eager recipe
or refuses as a true conflict (a row of :data:`shfx.config.CONFLICTS`).

:func:`covering_array` builds the array greedily and deterministically: each new case starts
from the first pair still uncovered and fills the other options with the values that cover
the most new pairs, keeping the case a configuration the table accepts (:func:`verdict`); a
pair that no accepted case can hold is a *conflicting pair*, checked once as a refusal."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import shfx
from shfx.config import Config, check_supported
from shfx.errors import ConfigConflict, UsageError
from shfx.parallel import DataParallel

#: The options and their values (the first value of each is the plain one: fp32, one rank,
#: no tier, no clipping, ...).
FACTORS: dict[str, tuple] = {
    "policy": ("stronghold", "zero-offload", "zero-infinity", "resident", "l2l", "stronghold-k1", "zero-offload-delayed"),
    "optimizer": ("adamw", "sgd", "adafactor"),
    "precision": ("fp32", "bf16", "fp16"),
    "ranks": (1, 2),
    "nvme": (False, True),
    "clip": (None, 0.05),
    "guard": ("none", "rollback", "skip"),
    "accum": (1, 2),
    "overlap": (True, False),
}

LR, WD = 1e-2, 0.01


def policy_of(name: str) -> Any:
    return {
        "stronghold-k1": lambda: shfx.Stronghold(window=2, resident_first=1),
        "zero-offload-delayed": lambda: shfx.ZeroOffload(delayed_update=True),
        "stronghold": lambda: shfx.Stronghold(window=2),
    }.get(name, lambda: name)()


def optimizer_of(name: str) -> shfx.optim.HostOptimizer:
    return {
        "adamw": lambda: shfx.optim.AdamW(lr=LR, weight_decay=WD),
        "sgd": lambda: shfx.optim.SGD(lr=LR, momentum=0.9, weight_decay=WD, nesterov=True),
        "adafactor": lambda: shfx.optim.Adafactor(lr=LR, weight_decay=WD),
    }[name]()


def compile_kwargs(case: dict, ssd_path: str) -> dict:
    """``shfx.compile``'s options of ``case`` (not the model, device or data parallel)."""
    kw: dict = dict(
        policy=policy_of(case["policy"]), optimizer=optimizer_of(case["optimizer"]), precision=case["precision"],
        grad_accum_steps=case["accum"], overlap_update=case["overlap"], max_grad_norm=case["clip"],
    )  # fmt: skip
    if case["guard"] == "rollback":
        kw["rollback"] = True
    elif case["guard"] == "skip":
        kw["skip_nonfinite"] = True
    if case["nvme"]:
        kw["offload"] = shfx.Offload(optimizer="nvme", path=ssd_path, host_window=1)
    return kw


def verdict(case: dict) -> tuple[str, str]:
    """``("ok", "")``, ``("conflict", message)`` (a row of the conflict table) or
    ``("not yet", message)`` (``check_supported``: what a pass does not run yet), from the
    configuration alone (no model, no process group)."""
    try:
        c = Config.from_args(device="emulated", **compile_kwargs(case, "/nonexistent-shfx-path"))
    except ConfigConflict as e:
        return "conflict", str(e)
    except UsageError as e:
        return "not yet", str(e)
    if case["ranks"] > 1:
        try:
            check_supported(dataclasses.replace(c, data_parallel=DataParallel()))
        except ConfigConflict as e:
            return "conflict", str(e)
        except UsageError as e:
            return "not yet", str(e)
    return "ok", ""


def _pairs(case: dict) -> set[tuple]:
    names = list(FACTORS)
    return {(a, case[a], b, case[b]) for i, a in enumerate(names) for b in names[i + 1 :]}


def covering_array(factors: dict[str, tuple] = FACTORS, accept=lambda case: verdict(case)[0] != "conflict") -> tuple[list[dict], list[tuple]]:
    """``(cases, conflicting_pairs)``: cases (dicts of option -> value) covering every pair of
    values of two options that some accepted case can hold, and the pairs none can (each
    checked as a refusal). ``accept(case)`` says whether a complete case is accepted."""
    names = list(factors)
    plain = {n: factors[n][0] for n in names}
    todo = {(a, va, b, vb) for i, a in enumerate(names) for b in names[i + 1 :] for va in factors[a] for vb in factors[b]}
    order = {n: i for i, n in enumerate(names)}

    def key(p: tuple) -> tuple:
        a, va, b, vb = p
        return (order[a], factors[a].index(va), order[b], factors[b].index(vb))

    cases: list[dict] = []
    conflicting: list[tuple] = []
    while todo:
        a, va, b, vb = min(todo, key=key)
        case = plain | {a: va, b: vb}
        if not accept(case):
            # the pair with plain values elsewhere is refused: try other values of the rest
            fixed = False
            for n in names:
                if n in (a, b):
                    continue
                for v in factors[n]:
                    if accept(case | {n: v}):
                        case = case | {n: v}
                        fixed = True
                        break
                if fixed:
                    break
            if not fixed:
                conflicting.append((a, va, b, vb))
                todo.discard((a, va, b, vb))
                continue
        for n in names:
            if n in (a, b):
                continue
            best, gain = case[n], -1
            for v in factors[n]:
                trial = case | {n: v}
                g = len(_pairs(trial) & todo)
                if g > gain and accept(trial):
                    best, gain = v, g
            case[n] = best
        cases.append(case)
        todo -= _pairs(case)
    return cases, conflicting


def label(case: dict) -> str:
    return "-".join(f"{v}" if not isinstance(v, bool) else (k if v else f"no-{k}") for k, v in case.items())


if __name__ == "__main__":  # python tests/combinations.py: the array and each case's verdict
    cases, conflicting = covering_array()
    for c in cases:
        print(verdict(c)[0].ljust(8), c)
    print(len(cases), "cases;", len(conflicting), "conflicting pairs:", conflicting)
    total = list(itertools.product(*FACTORS.values()))
    print(len(total), "combinations in all")
