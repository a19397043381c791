"""Refusals of a variant the device cannot run, each saying what fits: a stage larger than the
device budget, a steady state (slots, gradient buffers, optimizer states on the device) over it,
and device updates of streamed stages that cannot be deferred.

Functions of a variant, the backend and the options they depend on; they raise before anything
is allocated for the variant (:class:`shfx.api.CompiledModel` calls them when it builds one)."""

from __future__ import annotations

import dataclasses
from typing import Any

from shfx.passes.meta import get_meta
from shfx.passes.partition import StageGraph
from shfx.passes.pipeline import Variant, build_programs, feature_options, with_policy
from shfx.passes.program import ActionKind, ScheduleError
from shfx.passes.units import format_bytes

from .errors import OutOfDeviceMemory, UsageError
from .runtime.backend import Backend

__all__ = ["capacity_bytes", "check_capacity", "check_deferrable", "check_host_budget", "check_one_stage"]


def capacity_bytes(backend: Backend) -> int | None:
    """The device budget the tuner plans for: the backend's capacity, else its total memory."""
    b = backend
    return b.capacity_bytes if b.capacity_bytes is not None else getattr(b, "total_bytes", None)


def check_deferrable(variant: Variant, grad_accum_steps: int, overlap_update: bool) -> None:
    """A group updated on the device while its stage is streamed must be updated during the
    backward that has it resident: no gradient accumulation, no deferred updates. (In 16-bit
    precision a group updated on the device accumulates its micro-steps in an fp32 accumulator
    on the device: :meth:`shfx.runtime.gradients.GradientRouter.ensure_accumulators`; under data
    parallel every device group does, summing its RS's all-reduced micro-step gradients.)"""
    train, graph = variant.train, variant.graph
    transient_du = [
        get_meta(n).stage
        for n in train.nodes
        if get_meta(n).kind == ActionKind.DEVICE_STEP
        and next(st.index for st in graph.stages if st.spec.update_group == get_meta(n).stage) not in train.persistent
    ]
    if transient_du and (grad_accum_steps > 1 or not overlap_update):
        raise UsageError(
            f"policy {train.name!r} updates groups {transient_du} on the device while their stage is resident "
            "during the backward, so it cannot defer updates: use grad_accum_steps=1 and overlap_update=True, "
            "or another policy"
        )


def check_one_stage(graph: StageGraph, backend: Backend) -> None:
    """Refuse a budget too small for the largest stage's slot, saying how to split."""
    cap = backend.capacity_bytes
    if cap is None:
        return
    largest = max(graph.stages, key=lambda s: s.slot.nbytes)
    if largest.slot.nbytes > cap:
        raise OutOfDeviceMemory(
            f"the device budget is too small for one stage: stage {largest.index} ({largest.name!r}) needs "
            f"{format_bytes(largest.slot.nbytes)} for its parameters and buffers, and the device has "
            f"{format_bytes(cap)} ({backend.describe()}). Split the model into smaller stages "
            "(blocks= naming smaller modules, or blocks=False with more num_stages) or use a device with more memory.",
            needed_bytes=largest.slot.nbytes,
            capacity_bytes=cap,
            what=f"slot for stage {largest.index}",
        )


def _check_activations(variant: Variant, backend: Backend, ledger: Any, grad_accum_steps: int) -> None:
    """Refuse a step whose checkpointed activations overflow the device when offloading them to
    the host (``Offload(activations="host")``, :mod:`shfx.passes.activations`) would fit, saying
    so, before anything of the step is allocated. (When it would not fit either, the step runs
    and its OutOfDeviceMemory names the action that overflowed, as without this check.)"""
    cap = backend.capacity_bytes
    peak = ledger.peak("device")
    if cap is None or peak <= cap or any(get_meta(n).kind == ActionKind.OFFLOAD_ACTIVATIONS for n in variant.train.nodes):
        return
    opts = feature_options(variant.train) | {"activations": "host"}
    try:
        train, ev, cold = build_programs(variant.graph.specs, variant.policy, verify=False, ranks=variant.train.ranks, **opts)
    except ScheduleError:  # (a user's policy function, say: no offloaded program to compare)
        return
    if train.count(ActionKind.OFFLOAD_ACTIVATIONS) == 0:
        return
    offloaded = dataclasses.replace(variant, train=train, eval=ev, cold=cold).ledger(grad_accum_steps)
    fits = offloaded.peak("device")
    if fits > cap:
        return
    acts = ledger.terms_at_peak()["activations (checkpoints)"]
    raise OutOfDeviceMemory(
        f"one training step needs {format_bytes(peak)} on the device, {format_bytes(acts)} of it checkpointed "
        f"activations, but the device has {format_bytes(cap)} ({backend.describe()}). With the activations offloaded "
        f"to host RAM between each stage's forward and backward the step needs {format_bytes(fits)} (and "
        f"{format_bytes(offloaded.static('host').get('offloaded activations', 0))} of pinned host buffers): compile "
        "with offload=shfx.Offload(activations='host'), or use a smaller batch or sequence.",
        needed_bytes=peak,
        capacity_bytes=cap,
        what="activations (checkpoints)",
    )


def check_capacity(variant: Variant, backend: Backend, grad_accum_steps: int) -> None:
    """Refuse a variant whose steady state (the memory ledger's setup: slots, gradient
    buffers, optimizer states on the device) does not fit the budget, saying what fits.
    (Activations come on top; a step that overflows with them raises OutOfDeviceMemory
    naming the action.)"""
    cap = backend.capacity_bytes
    if cap is None:
        return
    ledger = variant.ledger(grad_accum_steps)
    static = ledger.static("device")
    need = sum(static.values())
    dyn = variant.captured.dynamic if variant.captured is not None else None
    if need <= cap and dyn is not None and ledger.peak("device") > cap:
        # a dynamic capture: the ledger's activations are those of the largest shape covered
        peak = ledger.peak("device")
        raise OutOfDeviceMemory(
            f"one training step at the largest shape of the dynamic range ({dyn.describe()}) needs "
            f"{format_bytes(peak)} on the device ({format_bytes(need)} of slots, gradient buffers and optimizer "
            f"states, the rest activations), but the device has {format_bytes(cap)} ({backend.describe()}). "
            "Declare a smaller range (shfx.compile(dynamic={'seq': (1, n)}, ...)), a smaller window, or use a "
            "device with more memory.",
            needed_bytes=peak,
            capacity_bytes=cap,
            what=f"a step at {dyn.describe()}",
        )
    if need <= cap:
        _check_activations(variant, backend, ledger, grad_accum_steps)
        return
    policy, sizes = variant.policy, variant.slot_sizes
    extra = need - static.get("parameters (slots)", 0)

    def static_at(window: int) -> int:
        return sum(with_policy(variant, policy.replace(window=window), verify=False).ledger().static("device").values())

    w = variant.train.num_slots - len(variant.train.persistent)
    fit = next((v for v in range(w - 1, 0, -1) if static_at(v) <= cap), None) if policy.windowed else None
    what = f"{len(sizes)} slots of {', '.join(format_bytes(n) for n in sizes)}"
    if extra:
        what += (
            f", plus {format_bytes(static.get('gradients', 0))} of gradient buffers and "
            f"{format_bytes(static.get('optimizer states', 0))} of optimizer states on the device"
        )
    hint = f"Use window <= {fit}, or smaller stages." if fit else "Use a policy that keeps less on the device, smaller stages, or a device with more memory."
    name = variant.train.name
    raise OutOfDeviceMemory(
        f"{'window=' + str(w) if name.startswith('stronghold') else 'policy ' + repr(name)} needs {what} = "
        f"{format_bytes(need)}, but the device has {format_bytes(cap)} "
        f"({backend.describe()}). {hint}",
        needed_bytes=need,
        capacity_bytes=cap,
        what=f"{len(sizes)} slots",
    )


def check_host_budget(variant: Variant, budget: int | None, grad_accum_steps: int) -> int:
    """``Offload(host_budget=...)``: the host memory the ledger counts for ``variant`` (its static
    host terms: the host store, the SSD windows, staging, offloaded activations) must fit the
    declared budget; refused before the host store is laid out, naming the largest terms and
    what shrinks them. Returns the ledger's host bytes."""
    host = variant.ledger(grad_accum_steps).static("host")
    total = sum(host.values())
    if budget is not None and total > budget:
        top = sorted(host.items(), key=lambda kv: -kv[1])[:4]
        terms = ", ".join(f"{k} {format_bytes(v)}" for k, v in top if v)
        paged = bool(variant.train.ssd_images)
        fix = (
            "a smaller Offload(host_window=...) or image_window=..., a smaller window, or a larger host_budget"
            if paged else "Offload(params='nvme', gradients='nvme', optimizer='nvme', ...) (the parameter tier), or a larger host_budget"
        )
        raise UsageError(
            f"the host memory this model needs is {format_bytes(total)} ({total} bytes: {terms}), over "
            f"Offload(host_budget={format_bytes(budget)}); use {fix}"
        )
    return total
