"""Starting the runtime of a compiled model once its host store is laid out: the engine, with
the optimizer bound to the store (:func:`start_engine`), and the NVMe tier's SSD store and host
window, made by the first variant that needs them (:func:`ensure_ssd`).

Functions of the store, the backend, the options and the variant
(:class:`shfx.api.CompiledModel` calls them when it builds a variant)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from shfx.passes.capture import Captured
from shfx.passes.partition import StageGraph
from shfx.passes.pipeline import Variant

from .config import Config
from .errors import UsageError
from .offload import Offload
from .runtime.backend import Backend
from .runtime.data_parallel import DataParallelRuntime
from .runtime.engine import Engine
from .runtime.host_store import HostStore

__all__ = ["ensure_ssd", "start_engine", "param_tier_store"]


def param_tier_store(offload: Offload, variant: Variant, accumulate: bool = False, optimizer: Any = None) -> tuple[Any, Any]:
    """The parameter tier (``Offload(params="nvme")``): the SSD store, made before the host
    store (which writes each paged group's image and master into it as it lays the group
    out), and that write, ``spill(g, image, master)``. Extents: the states of ``optimizer``
    (:meth:`shfx.optim.HostOptimizer.ssd_extents`; None: AdamW's ``m`` and ``v``) of every group of
    the NVMe tier, and each paged group's ``image`` (all its tensors, as a PREFETCH
    sends them), ``master`` (mixed precision: the fp32 trainable region) and, with ``accumulate``
    (``grad_accum_steps > 1``), ``grad``: the gradient summed over the micro-steps before the last."""
    from .runtime.ssd import SSDStore, group_extents

    prog = variant.train
    groups = variant.graph.groups
    # (the host optimizer's states: AdamW's m and v, SGD's momentum, Adafactor's factors)
    states = optimizer.ssd_extents if optimizer is not None else ("m", "v")
    extents = group_extents([groups[g] for g in sorted(prog.ssd_groups)], states=states)
    for g in sorted(prog.ssd_images):
        extents[("image", g)] = groups[g].nbytes
        if groups[g].separate_master:
            extents[("master", g)] = groups[g].master_bytes
        if accumulate:  # (grad_accum_steps > 1: the gradient waits on the SSD between micro-steps)
            extents[("grad", g)] = groups[g].grad_bytes
    ssd = SSDStore.from_offload(offload, extents)

    def spill(g: int, image: Any, master: Any) -> None:
        reqs = [ssd.write_from(("image", g), image)]
        if master is not None:
            reqs.append(ssd.write_from(("master", g), master))
        for r in reqs:
            r.wait()

    return ssd, spill


def start_engine(
    backend: Backend,
    store: HostStore,
    optimizer: Any,
    config: Config,
    dp: DataParallelRuntime | None,
    module: nn.Module,
    captured: Captured,
    graph: StageGraph,
) -> Engine:
    """The engine of the first capture: ``optimizer`` (a :class:`shfx.optim.HostOptimizer` or
    None) bound to the host store, data parallel's runtime given the store and the bound
    optimizer, the trainable parameters listed per group and in ``module.parameters()``'s order."""
    opt = optimizer.bind(store, captured.params) if optimizer is not None else None
    if dp is not None:
        dp.store, dp.optimizer = store, opt
    by_group: dict[int, list] = {}
    for key in sorted(graph.owner, key=lambda k: graph.owner[k]):
        if key in captured.trainable:
            by_group.setdefault(graph.owner[key], []).append((key, captured.params[key]))
    # gradient clipping reads the norms in the order of model.parameters(), as torch does
    where = {id(t): (g, key) for g, keys in by_group.items() for key, t in keys}
    c = config
    return Engine(
        backend, store, opt, grad_accum_steps=c.grad_accum_steps, overlap_update=c.overlap_update,
        delayed_update=c.delayed_update, rollback=c.rollback, skip_nonfinite=c.skip_nonfinite, scaler=c.scaler,
        max_grad_norm=c.max_grad_norm, norm_type=c.norm_type, recompute=c.recompute, dp=dp,
        param_keys_by_group=by_group, clip_order=[where[id(p)] for p in module.parameters() if id(p) in where],
        activations_on=c.offload if c.offload is not None and c.offload.activations == "nvme" else None,
    )  # fmt: skip


def ensure_ssd(engine: Engine, store: HostStore, offload: Offload | None, variant: Variant, ssd_store: Any = None) -> None:
    """The NVMe tier: the first variant with SSD transfers makes the SSD store (its extents
    from the host store's groups, the disk space checked by the store before anything is
    allocated) and the engine's host window; a later one grows the window if it needs more.
    Activations on the SSD (``Offload(activations="nvme")``): the variant's activation window
    buffers and SSD store (its space checked here, before its first step)."""
    prog = variant.train
    if prog.activation_window and engine.activation_window is not None:
        engine.activation_window.prepare(prog)
    if not prog.ssd_groups:
        return
    eng = engine
    if eng.ssd is None:
        from .runtime.ssd import SSDStore
        from .runtime.ssd_window import SSDWindow

        groups = sorted(g for g, grp in enumerate(store.groups) if grp.trainable_bytes and g not in variant.device_groups)
        # (rollback: two versions of each state, the step's write-back beside the committed one)
        versions = 2 if eng.journal.enabled else 1
        if ssd_store is not None:  # (the parameter tier's: made before the host store, images written)
            ssd = ssd_store
        else:
            extents = SSDWindow.extents(store, groups, versions=versions, optimizer=eng.optimizer)  # (data parallel: this rank's shards)
            ssd = SSDStore.from_offload(offload, extents)
        try:
            eng.attach_ssd(SSDWindow(store, eng.optimizer, groups, prog.host_window, ssd, versioned=versions == 2,
                                     image_window=prog.image_window))  # fmt: skip
        except BaseException:
            ssd.close()
            raise
        return
    missing = sorted(prog.ssd_groups - eng.ssd.groups)
    if missing:
        raise UsageError(
            f"program {prog.name!r} keeps groups {missing} on the SSD, which the SSD store made for the first "
            f"capture does not hold (it holds {sorted(eng.ssd.groups)}); keep the same policy for every input shape"
        )
    if prog.ssd_images - eng.ssd.paged:
        raise UsageError(
            f"program {prog.name!r} keeps the images of groups {sorted(prog.ssd_images - eng.ssd.paged)} on the SSD, which "
            "the first capture's store keeps in host RAM; keep the same policy for every input shape"
        )
    eng.ssd.ensure(prog.host_window)
    eng.ssd.ensure_images(prog.image_window)
