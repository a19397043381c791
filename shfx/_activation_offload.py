"""``Offload(activations="auto")`` at the first call: the variant is built offloading every
eligible stage (``"host"``), then narrowed to the stages the cost model picks for the device
budget (:func:`shfx.cost_model.offload_choice.choose_activation_offload`), from the costs
profiled on the backend (the profiler's probe programs keep the offload, so they fit)."""

from __future__ import annotations

import dataclasses

import torch

from shfx.cost_model.offload_choice import choose_activation_offload
from shfx.passes.actions import AO
from shfx.passes.meta import get_meta
from shfx.passes.pipeline import Variant, build_programs, feature_options

from .runtime.engine import Engine

__all__ = ["narrow_activation_offload"]


def narrow_activation_offload(variant: Variant, engine: Engine, inputs: list[torch.Tensor], budget: int | None) -> Variant:
    """``variant`` (built with every eligible stage offloaded) with only the stages chosen for
    ``budget`` (device bytes; None: no budget, nothing offloaded)."""
    offloaded = sorted(get_meta(n).stage for n in variant.train.nodes if get_meta(n).kind == AO)
    if not offloaded:
        return variant
    plain = dataclasses.replace(variant, **_programs(variant, ()))
    costs = None
    if budget is not None and plain.ledger().peak() > budget:
        from shfx.profiler import profile_costs

        costs = profile_costs(engine, variant, inputs)
    chosen = choose_activation_offload(plain.train, costs, budget) if costs is not None else ()
    if list(chosen) == offloaded:
        return variant
    return dataclasses.replace(variant, **_programs(variant, chosen))


def _programs(variant: Variant, stages: tuple[int, ...]) -> dict:
    opts = feature_options(variant.train) | {"activations": tuple(stages) if stages else "device"}
    train, ev, cold = build_programs(variant.graph.specs, variant.policy, ranks=variant.train.ranks, **opts)
    return {"train": train, "eval": ev, "cold": cold}
