"""Tuning a variant's window on the backend: profile its costs, simulate every choice, choose
one (:func:`tune_variant`); the SSD's speed the simulator needs for the NVMe tier
(:func:`measure_ssd_rates`); and the fixed window asked for that is larger than the stages a
variant streams (:func:`clamped_window`, :func:`warn_unused_window`).

Functions of the variant, the engine and backend that run it, and the options they read
(:class:`shfx.api.CompiledModel` calls them at the first call, ``report()`` and ``retune()``)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch

from shfx.passes.pipeline import Variant, candidate_passes
from shfx.passes.policies import Policy
from shfx.passes.units import format_bytes

from shfx.cost_model.report import WindowReport
from shfx.cost_model.tune import NoWindowFits, TuneResult, tune_window

from ._capacity import capacity_bytes
from .errors import OutOfDeviceMemory, UsageError
from .offload import Offload
from .runtime.backend import Backend
from .runtime.data_parallel import DataParallelRuntime
from .runtime.engine import Engine

__all__ = ["clamped_window", "host_terms_of", "measure_ssd_rates", "tune_variant", "warn_unused_window"]


def clamped_window(variant: Variant) -> int | None:
    """The fixed window the user asked for when it is larger than the stages ``variant``
    streams (the policy then keeps all of them on the device), else None."""
    asked = getattr(variant.policy, "window", None) if variant.policy.windowed else None
    if not isinstance(asked, int) or isinstance(asked, bool):
        return None
    return asked if asked > variant.train.num_slots - len(variant.train.persistent) else None


def warn_unused_window(variant: Variant, stacklevel: int) -> None:
    """Warn (at the caller ``stacklevel`` frames up) when the fixed window asked for is larger
    than the stages ``variant`` streams: which window the policy runs instead."""
    asked = clamped_window(variant)
    if asked is None:
        return
    n, k = len(variant.graph.stages), len(variant.train.persistent)

    def stages(m: int) -> str:
        return f"{m} stage" + ("s" if m != 1 else "")

    if k == n:
        what = f"window={asked} is unused: every stage ({n}) is kept on the device (resident_first={k})"
    else:
        streamed = f"{stages(n - k)} to stream ({stages(n)}, {k} kept on the device)" if k else stages(n)
        what = (
            f"window={asked} is more than the {streamed}: shfx keeps all of them on the device "
            f"(window {n - k}). Pass window={n - k} to say so, or a smaller window to stream"
        )
    warnings.warn(what + ".", stacklevel=stacklevel + 1)


def measure_ssd_rates(offload: Offload) -> tuple[float, float]:
    """The SSD's read and write bytes/s, measured on ``offload.path`` (32 MiB written and read
    through an SSDStore)."""
    import time

    from .runtime.ssd import SSDStore

    off = offload
    n = 32 << 20
    buf = torch.zeros(n // 4)
    with SSDStore(off.path, {"probe": n}, read_bps=off.read_bps, write_bps=off.write_bps) as probe:
        t0 = time.perf_counter()
        probe.write_from("probe", buf).wait()
        t1 = time.perf_counter()
        probe.read_into("probe", buf).wait()
        t2 = time.perf_counter()
    # NOTE: a read right after the write may come from the page cache (buffered I/O): an
    # optimistic figure; give nvme_read/nvme_write to tune for a known speed
    return n / max(t2 - t1, 1e-9), n / max(t1 - t0, 1e-9)


def tune_variant(
    engine: Engine,
    backend: Backend,
    variant: Variant,
    tensors: list[torch.Tensor],
    policy: Policy,
    how: str,
    *,
    tolerance: float,
    rollback: bool,
    ssd_rates: Callable[[], tuple[float, float]],
    refresh: bool = False,
    host_budget: int | None = None,
    image_window: int | str | None = None,
    grad_accum_steps: int = 1,
) -> WindowReport:
    """Profile ``variant``'s costs on the backend (``refresh``: again, replacing the cached
    profile), simulate every window of ``policy`` (its ``"auto"`` fields; all windows for a
    fixed one, ``how="fixed"``), choose one. ``tolerance`` and ``rollback`` are the compile
    options; ``ssd_rates()`` gives the SSD's read and write bytes/s (asked only for an NVMe policy).
    ``host_budget``: ``Offload(host_budget=...)``, the bound of the host windows' choice (the
    ledger's host terms of each candidate, :func:`host_terms_of`); ``image_window``: the
    parameter tier's (``"auto"``: chosen with the host window; for ``how="fixed"`` the variant's).

    Every tuning (the first call's with ``"auto"`` fields, ``report()``'s, ``retune()``'s)
    runs under forked random streams (:func:`shfx.profiler.forked_rng`): the profile's
    dropout leaves the user's generators where they were, so ``"auto"`` trains exactly as
    the fixed choice would."""
    from .profiler import forked_rng, profile_costs

    graph = variant.graph
    # data parallel: the choice is every rank's (the same program on each), so rank 0 takes it
    # and every rank gets it (:func:`_agreed`); a fixed window's report is this rank's own
    dp = engine.dp if how == "auto" else None
    capacity = capacity_bytes(backend)
    failed: OutOfDeviceMemory | None = None
    with forked_rng(backend):
        try:
            # (under data parallel the profile runs no collective: shfx.profiler's probes are
            # one-rank programs, so each rank profiles on its own, however many rounds it takes)
            costs = profile_costs(engine, variant, tensors, refresh=refresh)
        except OutOfDeviceMemory as e:
            if dp is None:
                raise _profile_out_of_memory(e, policy, how) from e
            failed = _profile_out_of_memory(e, policy, how)
            failed.__cause__ = e
        # (an NVMe policy's SSD reads and writes, or activations on the SSD: Offload(activations="nvme"))
        on_ssd = getattr(policy, "nvme", False) or variant.train.activation_window
        read_bps, write_bps = ssd_rates() if on_ssd and failed is None else (None, None)
    if dp is not None:
        capacity = _agreed_capacity(dp, capacity, failed)
    if read_bps is not None:  # the simulator needs the SSD's speed to choose the host window
        costs = dataclasses.replace(costs, links=dataclasses.replace(costs.links, ssd_read_bps=read_bps, ssd_write_bps=write_bps))
    if how == "fixed" and policy.windowed:
        policy = policy.replace(window="auto")

    tier = bool(variant.train.ssd_images)
    if how == "fixed" or not tier:
        image_window = variant.train.image_window if tier else None

    def choose() -> TuneResult:
        try:
            return tune_window(
                graph.specs, costs, capacity_bytes=capacity,
                tolerance=tolerance, policy=policy, rollback=rollback, features=candidate_passes(variant.train),
                host_capacity_bytes=host_budget, host_terms=host_terms_of(variant, grad_accum_steps),
                param_tier=tier, image_window=image_window, masters=tier and variant.train.ssd_masters,
            )  # fmt: skip
        except NoWindowFits as e:
            if e.what == "host":
                raise UsageError(
                    f"{e}. Declared: Offload(host_budget={format_bytes(host_budget or 0)}); use a larger host_budget, "
                    "more stages (smaller groups, smaller window buffers), or the parameter tier "
                    "(Offload(params='nvme', gradients='nvme', optimizer='nvme')) if the masters are in host RAM"
                ) from e
            raise OutOfDeviceMemory(
                f"{e}. Device: {backend.describe()}. Use a smaller batch or sequence, more stages "
                "(smaller blocks), or a device with more memory.",
                needed_bytes=min(r.peak_device_bytes for r in e.rows),
                capacity_bytes=capacity or 0,
                what="window 1",
            ) from e

    profile = getattr(costs, "extra", {}).get("profile")
    if dp is None:
        tune = choose()
    else:  # (the profile's summary in the report is rank 0's, as the tune it chose from)
        tune, profile = _agreed(dp, choose, profile)
    window = tune.window if how == "auto" else variant.train.num_slots - len(variant.train.persistent)
    steps = engine.step_times
    asked = clamped_window(variant) if how == "fixed" else None
    return WindowReport(
        tune, window, backend.describe(), how, steps, first_step=len(steps) if refresh else 0,
        profile=profile, window_asked=asked, pinned=_pinned_line(backend),
    )  # fmt: skip


def host_terms_of(variant: Variant, grad_accum_steps: int = 1) -> Callable[[Any], dict[str, int]]:
    """The host terms of a candidate train program over ``variant``'s stages: the ledger's static
    host terms with the groups' real masters and working copies (whose sum
    :func:`shfx._capacity.check_host_budget` compares with ``Offload(host_budget=...)``)."""
    from shfx.passes.ledger import replay

    groups = variant.graph.groups

    def host_terms(program: Any) -> dict[str, int]:
        led = replay(program, group_bytes=[g.host_master_bytes for g in groups], working_bytes=[g.working_bytes for g in groups],
                     grad_accum_steps=grad_accum_steps, rollback=variant.journaled)  # fmt: skip
        return led.static("host")

    return host_terms


def _pinned_line(backend: Backend) -> str:
    """The pinned pool's plan in words for the report ("" when it pins nothing)."""
    plan = getattr(backend.pinned, "plan", None)
    return plan.describe() if plan is not None else ""


def _agreed_capacity(dp: DataParallelRuntime, capacity: int | None, failed: OutOfDeviceMemory | None) -> int | None:
    """Data parallel, after every rank profiled on its own: every rank's outcome and device
    budget, exchanged (one all-gather on the control group). A rank whose profile failed raises
    its error, the others one naming it (no rank waits for a decision that will not come); else
    the smallest budget, so that rank 0's choice fits every rank's device."""
    outcomes = dp.gather_objects((None if failed is None else str(failed), capacity), "the tuner's exchange of profiles")
    if failed is not None:
        raise failed
    bad = [(r, err) for r, (err, _) in enumerate(outcomes) if err is not None]
    if bad:
        r, err = bad[0]
        raise OutOfDeviceMemory(
            f"data parallel: the profile for the tuner failed on rank {r} of {dp.ranks} (every rank profiles, rank 0 "
            f"chooses for all), so no rank trains with its choice. Rank {r}: {err}"
        )
    budgets = [c for _, c in outcomes if c is not None]
    return min(budgets) if budgets else None


def _agreed(dp: DataParallelRuntime, choose: Callable[[], TuneResult], profile: Any) -> tuple[TuneResult, Any]:
    """Data parallel: rank 0's ``choose()`` (its tune over its own profile) and its profile's
    summary, broadcast to every rank (one broadcast on the control group), so every rank builds
    the same program. Rank 0's failure (no window fits) is raised on every rank."""
    result: Any = None
    if dp.rank == 0:
        try:
            result = (choose(), profile)
        except OutOfDeviceMemory as e:
            dp.broadcast_object(e, "the tuner's choice")
            raise
    result = dp.broadcast_object(result, "the tuner's choice")
    if isinstance(result, BaseException):
        raise result
    return result


def _profile_out_of_memory(err: OutOfDeviceMemory, policy: Policy, how: str) -> OutOfDeviceMemory:
    """``err``, raised while profiling for the tuner, as a message that says so and names how to
    train without the profile: fix the fields the tuner was choosing (``how="auto"``), or, for
    ``report()``/``retune()`` (``how="fixed"``), do without them.

    NOTE: the profile sizes its own buffers to the free device memory (shfx.profiler), so this is
    rare; but the generic advice of the allocation's message (a smaller window, more memory)
    sent users of ``Offload(optimizer="nvme")``, whose ``host_window="auto"`` turns the tuner on
    even for a fixed window, away from the one option that skips the profile (issue 25)."""
    auto = policy.auto if how == "auto" else ()
    fixes = []
    if "host_window" in auto:
        fixes.append("host_window=<int> in shfx.Offload(optimizer=..., host_window=...) (1: one group's "
                     "optimizer states in host RAM at a time)")  # fmt: skip
    if "window" in auto:
        fixes.append("a fixed window (window=1 streams one stage at a time, the least device memory)")
    if "resident_first" in auto:
        fixes.append("resident_first=0")
    if auto:
        chose = ", ".join(f'{f}="auto"' for f in auto)
        what = f"to choose {chose}"
        todo = "Skip the profile by fixing what it chooses: pass " + "; and ".join(fixes) + "."
    else:
        what = "for cm.report() or cm.retune()"
        todo = "Train without cm.report()/cm.retune() on a device this full."
    detail = (
        f"allocating {format_bytes(err.needed_bytes)} for {err.what}: {format_bytes(err.used_bytes)} of "
        f"{format_bytes(err.capacity_bytes)} in use"
    )
    return OutOfDeviceMemory(
        f"out of device memory while profiling the device {what} (the tuner times a window-1 step, "
        f"the host-device copies and the optimizer before choosing): {detail}. {todo} The training "
        "itself may need less device memory than its profile; if it does not fit either, its own "
        "message says which window fits.",
        needed_bytes=err.needed_bytes, used_bytes=err.used_bytes, capacity_bytes=err.capacity_bytes, what=err.what,
    )  # fmt: skip
