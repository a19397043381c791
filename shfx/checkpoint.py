"""Checkpoint and resume: the whole training state, saved atomically with torch.distributed.checkpoint.

A checkpoint is a directory written by ``torch.distributed.checkpoint`` (DCP, the format FSDP
and torchtitan use) plus one small file beside its shards::

    model.<name>                              every tensor of model.state_dict() (fp32 masters)
    optimizer.state.<param name>.<field>      optimizer.state[p] as torch names it (AdamW's step,
                                              exp_avg, exp_avg_sq; SGD's momentum_buffer; ...)
    shfx_state.pt                             every parameter group's hyperparameters with its
                                              parameters' names, the step count, LR scheduler,
                                              loss scaler, RNG states, extra

The tensor part has the layout of ``torch.distributed.checkpoint.state_dict.get_state_dict``
(``{"model": ..., "optimizer": {"state": {fqn: {...}}}}``), so ``dcp.load`` reads it into
any model with the same names, on any number of ranks. Eager models and compiled ones take
one path: ``model.state_dict()`` and a torch Optimizer's ``state`` / ``param_groups`` (for a
compiled model ``cm.optimizer``, whose states are views of the host store: DCP copies one
tensor at a time while it writes), read back through ``optimizer.load_state_dict``.

Saving is atomic: the checkpoint is written into a new directory beside ``path`` (its files
and the directory fsynced), then ``path`` - a symbolic link to that directory - is switched to
it with ``os.replace`` (atomic on POSIX) and the parent directory fsynced. A save that fails or
is killed half way leaves the last good checkpoint as it was (its leftovers, hidden
``.<name>.shfx-*`` directories, are removed by the next save to the same path).

Under data parallel (``cm._engine.dp`` set) :func:`save` and :func:`load` hand over to
:mod:`shfx.dp_checkpoint`: every rank calls them, each writes and reads its own ranges of the
optimizer states, and the checkpoint is the same format, loadable with any number of ranks. The
format's pieces both modules use (the state file, the metadata, the atomic switch's parts,
reading) are in :mod:`shfx.checkpoint_format`, which imports neither.

>>> import tempfile, torch, shfx
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
>>> opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
>>> model(torch.randn(2, 4)).sum().backward(); opt.step()
>>> d = tempfile.mkdtemp() + "/ckpt"
>>> save_from(model, opt, d, extra={"batch": 7})
>>> load_into(model, opt, d)
{'batch': 7}
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .checkpoint_format import (  # noqa: F401 - each name stays importable from here (shfx.checkpoint.STATE_FILE, ...)
    AsyncSave,
    FORMAT,
    STATE_FILE,
    _IMPL,
    _KILL_ENV,
    _as_tensor,
    _as_tuple,
    _check_common,
    _check_target,
    _fsync_dir,
    _group_hyperparams,
    _load_common,
    _meta,
    _model_targets,
    _names,
    _norm,
    _optimizer_state,
    _prefix,
    _read_meta,
    _reader,
    _remove_leftovers,
    _test_kill_point,
    _writer,
    rng_state,
    set_rng_state,
)
from ._checkpoint_stream import GroupReads, StreamingSavePlanner
from ._checkpoint_stream import writer as stream_writer
from .errors import UsageError

__all__ = ["save", "load", "save_from", "load_into", "read_info", "AsyncSave", "STATE_FILE", "FORMAT"]


# ---- the optimizer state by parameter name (eager torch.optim and cm.optimizer alike) ---------------
def _load_optimizer(
    path: str, md: dict[str, Any], meta: dict[str, Any], named_params: Any, optimizer: torch.optim.Optimizer
) -> None:
    """Load a checkpoint's optimizer state and hyperparameters into ``optimizer`` (eager, or
    ``cm.optimizer`` before or after its first call) through ``optimizer.load_state_dict``, the
    checkpoint's names mapped onto the optimizer's parameters and groups. A load that is
    refused changes nothing."""
    named_params = list(named_params)
    saved = _load_optim_tensors(path, md)
    names = _names(named_params)
    hps_by_group = _group_hyperparams(path, meta, named_params, optimizer)
    sd = optimizer.state_dict()
    held: set[str] = set()
    state: dict[int, dict[str, torch.Tensor]] = {}
    for group, sdg, hps in zip(optimizer.param_groups, sd["param_groups"], hps_by_group):
        for p, index in zip(group["params"], sdg["params"]):
            n = names.get(id(p))
            held.add(n)
            if n in saved:
                state[index] = saved[n]
        sdg.update({k: tuple(v) if isinstance(v, list) else v for k, v in hps.items()})
    unknown = sorted(set(saved) - held)
    if unknown:
        raise UsageError(
            f"the checkpoint has optimizer state for {unknown[0]!r} ({len(unknown)} such), which this optimizer does not "
            "update; load a checkpoint of this model (same parameter names and requires_grad)"
        )
    sd["state"] = state
    try:
        optimizer.load_state_dict(sd)  # torch's and shfx's optimizers change nothing when they refuse
    except (ValueError, KeyError, RuntimeError) as e:
        raise UsageError(
            f"the checkpoint's optimizer state does not fit this {type(optimizer).__name__}: {e}. Load a checkpoint "
            "saved from this model with the same kind of optimizer"
        ) from e


# ---- writing ---------------------------------------------------------------------------------------
def _no_dist() -> bool:
    """Whether DCP runs in this process alone (no process group)."""
    import torch.distributed as dist

    single = not (dist.is_available() and dist.is_initialized())
    if single:
        # NOTE: DCP warns on every single-process save and load that it "assumes the intent is
        # to save in a single process", which is this module's normal case; catch_warnings
        # would not do (it is not thread-safe, and asynchronous saves run in a thread), so that
        # one message is filtered, once.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    return single


def _atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Write a checkpoint with ``write(directory)`` into a new directory beside ``path``, then
    switch ``path`` (a link) to it atomically; the previous one is removed only after that."""
    path = os.path.abspath(path)
    parent, prefix = _prefix(path)
    os.makedirs(parent, exist_ok=True)
    _check_target(path)
    token = f"{time.time_ns():x}-{os.getpid()}-{threading.get_ident():x}"
    real = os.path.join(parent, prefix + token)
    os.mkdir(real)
    try:
        write(real)
        _fsync_dir(real)
        _test_kill_point("switch")
        link = os.path.join(parent, prefix + "link-" + token)
        os.symlink(os.path.basename(real), link)
        os.replace(link, path)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(real, ignore_errors=True)
        raise
    # the previous checkpoint, and leftovers of saves that were killed: no longer reachable
    _remove_leftovers(parent, prefix, real)


def _write_checkpoint(directory: str, tensors: dict[str, Any], meta: dict[str, Any], reads: GroupReads | None = None) -> None:
    """DCP's directory of ``tensors`` and the state file. Through the streaming planner: each
    tensor is written from a copy freed once written (never the whole state twice in RAM), and
    the placeholders ``reads`` names are read one group at a time (:mod:`shfx._checkpoint_stream`)."""
    import torch.distributed.checkpoint as dcp

    planner = StreamingSavePlanner(reads)
    try:
        dcp.save(tensors, storage_writer=stream_writer(directory), planner=planner, no_dist=_no_dist())
    finally:
        planner.release()
    with open(os.path.join(directory, STATE_FILE), "wb") as f:
        torch.save(meta, f)
        f.flush()
        os.fsync(f.fileno())


def _state(model_sd: dict[str, torch.Tensor], named_params: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors for DCP, param_groups and steps)`` of a model's state dict and its torch
    Optimizer over ``named_params``: the one save path of eager models and compiled ones (whose
    tensors are views of the host store; placeholders, meta tensors, are kept as they are)."""
    state, groups = _optimizer_state(named_params, optimizer)
    steps = max((int(e["step"]) for e in state.values() if "step" in e), default=0)
    tensors: dict[str, Any] = {"model": {k: v if v.is_meta else v.detach().cpu() for k, v in model_sd.items()}}
    if state:
        tensors["optimizer"] = {"state": state}
    return tensors, {"param_groups": groups, "steps": steps}


def _streamed_state(cm) -> tuple[dict[str, Any], dict[str, Any], GroupReads | None]:
    """:func:`_state` of a compiled model, with what lives on the SSD (the parameter tier's
    images and fp32 masters, the NVMe tier's optimizer states) as placeholders, and the
    :class:`GroupReads` that reads them one group at a time: the model's values of a paged group
    from one read of its image and master (``SSDWindow.paged_group``), a group's optimizer
    states from one read of its flat state buffers (``SSDWindow.read_state``), each placeholder
    a view of its group's meta buffer (``SSDWindow.placeholders``) mapped onto the read one."""
    model_sd = cm._state_dict_for_save()  # settles the step, copies device-updated weights back to the host
    ssd = cm._engine.ssd if cm._engine is not None else None
    if ssd is None:
        return (*_state(model_sd, cm.module.named_parameters(), cm.optimizer), None)
    with ssd.placeholders() as described:
        tensors, info = _state(model_sd, cm.module.named_parameters(), cm.optimizer)
    paged = ssd.store.paged_keys
    group_of: dict[str, tuple[str, int]] = {f"model.{k}": ("model", paged[k]) for k in tensors["model"] if k in paged}
    buffer_of = {id(b): (g, i) for g, bufs in described.items() for i, b in enumerate(bufs)}
    views: dict[str, tuple[int, tuple[int, ...], tuple[int, ...], int]] = {}
    for name, fields in tensors.get("optimizer", {}).get("state", {}).items():
        for field, t in fields.items():
            if not t.is_meta:
                continue
            base = t._base if t._base is not None else t
            if id(base) not in buffer_of:
                raise RuntimeError(
                    f"the optimizer state {field!r} of {name!r} is not a view of its group's flat state buffers: "
                    f"{type(cm.optimizer).__name__}'s states cannot be saved from the SSD one group at a time"
                )
            g, i = buffer_of[id(base)]
            key = f"optimizer.state.{name}.{field}"
            group_of[key] = ("optimizer", g)
            views[key] = (i, tuple(t.shape), t.stride(), t.storage_offset())

    def read(group: tuple[str, int]) -> dict[str, torch.Tensor]:
        section, g = group
        if section == "model":
            return {f"model.{k}": v for k, v in ssd.paged_group(g).items()}
        bufs = ssd.read_state(g)
        return {key: bufs[i].as_strided(*where) for key, (i, *where) in views.items() if group_of[key] == group}

    return tensors, info, GroupReads(group_of, read)


def _stage(tensors: Any, staging: dict[str, torch.Tensor], prefix: str = "") -> Any:
    """A copy of the nested tensor dict ``tensors`` in host buffers kept in ``staging`` (reused
    by the next asynchronous save when the shapes match)."""
    if isinstance(tensors, dict):
        return {k: _stage(v, staging, f"{prefix}{k}.") for k, v in tensors.items()}
    key = prefix[:-1]
    buf = staging.get(key)
    if buf is None or buf.shape != tensors.shape or buf.dtype != tensors.dtype:
        buf = staging[key] = torch.empty(tensors.shape, dtype=tensors.dtype)
    return buf.copy_(tensors.detach())


def save(
    cm, path: str, *, extra: Any = None, scheduler: Any = None, async_save: bool = False
) -> AsyncSave | None:
    """Save a compiled model's training state to ``path`` (see :meth:`CompiledModel.save_checkpoint`).
    Under data parallel (``cm._engine.dp`` set) every rank calls it: :func:`shfx.dp_checkpoint.save`."""
    if getattr(getattr(cm, "_engine", None), "dp", None) is not None:
        from . import dp_checkpoint

        return dp_checkpoint.save(cm, path, extra=extra, scheduler=scheduler, async_save=async_save)
    if pending := getattr(cm, "_pending_checkpoint", None):
        raise UsageError(
            "a checkpoint was loaded before the first call and its optimizer state is applied at that call; call "
            f"the model once (a training step) before saving again ({pending['path']!r} is still the checkpoint)"
        )
    if not async_save:  # what lives on the SSD is read one group at a time while it is written
        tensors, info, reads = _streamed_state(cm)
        meta = _meta(info["steps"], info["param_groups"], scheduler, cm.scaler, extra, cm.skipped_steps)
        _atomic_write(path, lambda d: _write_checkpoint(d, tensors, meta, reads))
        return None
    ssd = cm._engine.ssd if cm._engine is not None else None
    if ssd is not None and ssd.paged:
        raise UsageError(
            "async_save=True with the parameter tier (Offload(params='nvme')) is not built: the weights and optimizer "
            "states live on the SSD, which the next steps rewrite while a background save would read them, and staging "
            "them in RAM would hold the whole model there; call cm.save_checkpoint(path) (async_save=False: it reads "
            "the SSD one group at a time while it writes)"
        )
    model_sd = cm.state_dict()  # settles the step, copies device-updated weights back to the host
    tensors, info = _state(model_sd, cm.module.named_parameters(), cm.optimizer)
    meta = _meta(info["steps"], info["param_groups"], scheduler, cm.scaler, extra, cm.skipped_steps)
    tensors, path = _stage(tensors, cm._checkpoint_staging), os.path.abspath(path)
    return AsyncSave(path, job=lambda: _atomic_write(path, lambda d: _write_checkpoint(d, tensors, meta)))


# ---- reading ---------------------------------------------------------------------------------------
def read_info(path: str) -> dict[str, Any]:
    """What a checkpoint holds besides its tensors: ``steps`` (optimizer steps taken),
    ``skipped_steps`` (fp16), ``param_groups`` (hyperparameters and parameter names),
    ``source`` (``"shfx"`` or ``"eager"``), ``extra``, and ``tensors`` (each tensor's flattened
    DCP key with its shape and dtype)."""
    md, meta = _read_meta(os.path.abspath(path))
    keys = ("steps", "skipped_steps", "param_groups", "source", "extra")
    tensors = {k: (tuple(m.size), m.properties.dtype) for k, m in md.items() if hasattr(m, "size")}
    return {**{k: meta[k] for k in keys}, "tensors": tensors}


def _load_model(path: str, targets: dict[str, torch.Tensor]) -> None:
    """Load ``model.*`` into ``targets`` (from :func:`_model_targets`) in place."""
    import torch.distributed.checkpoint as dcp

    if targets:
        with torch.no_grad():
            dcp.load({"model": targets}, storage_reader=_reader(path), no_dist=_no_dist())


def _load_optim_tensors(path: str, md: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """The ``optimizer.state.*`` tensors of a checkpoint, as ``{param name: {field: tensor}}``."""
    import torch.distributed.checkpoint as dcp

    pre = "optimizer.state."
    state: dict[str, dict[str, torch.Tensor]] = {}
    for k, m in md.items():
        if not k.startswith(pre):
            continue
        name, _, field = k[len(pre) :].rpartition(".")
        state.setdefault(name, {})[field] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    if state:
        dcp.load({"optimizer": {"state": state}}, storage_reader=_reader(path), no_dist=_no_dist())
    return state


def load(cm, path: str, *, scheduler: Any = None, strict: bool = True, restore_rng: bool = True) -> Any:
    """Load what :func:`save` wrote into a compiled model (see :meth:`CompiledModel.load_checkpoint`).
    Under data parallel (``cm._engine.dp`` set) every rank calls it: :func:`shfx.dp_checkpoint.load`."""
    if getattr(getattr(cm, "_engine", None), "dp", None) is not None:
        from . import dp_checkpoint

        return dp_checkpoint.load(cm, path, scheduler=scheduler, strict=strict, restore_rng=restore_rng)
    path = os.path.abspath(path)
    md, meta = _read_meta(path)
    cm._settle()
    _check_common(meta, path, scheduler)
    targets = _model_targets(path, md, cm._load_targets(), strict)  # the model's tensors are the host store's
    if cm.optimizer is not None:  # before the first call its load_state_dict keeps the state for it
        _load_optimizer(path, md, meta, cm.module.named_parameters(), cm.optimizer)
    _load_model(path, targets)
    if cm._engine is not None:
        if cm._store.paged_keys:  # (the parameter tier: the model's state_dict gave copies; to the SSD)
            cm._engine.ssd.write_paged({k: t for k, t in targets.items() if k in cm._store.paged_keys})
        cm._store.refresh_working()  # mixed precision: the 16-bit image from the loaded masters
        cm._engine.invalidate_device_weights()
        cm._engine.skipped_steps = meta["skipped_steps"]
    else:  # the engine exists at the first call
        cm._pending_checkpoint = {"path": path, "skipped_steps": meta["skipped_steps"]}
    _load_common(meta, path, scheduler, cm.scaler, restore_rng)
    return meta["extra"]


def apply_pending(cm, variant) -> None:
    """At the first call after :func:`load` ran before it: what the engine keeps (the optimizer
    state is the optimizer's own, loaded at that call by ``cm.optimizer``)."""
    pending, cm._pending_checkpoint = cm._pending_checkpoint, None
    cm._engine.skipped_steps = pending["skipped_steps"]


# ---- eager PyTorch ----------------------------------------------------------------------------------
def save_from(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path: str,
    *,
    extra: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
) -> None:
    """Save an eager model and its torch Optimizer (any: AdamW, SGD, Adafactor, ..., with
    parameter groups) in shfx's checkpoint format (atomically), for
    :meth:`CompiledModel.load_checkpoint` or :func:`load_into`. ``scaler``: a
    ``torch.amp.GradScaler`` (its state dict is the loss scaler's)."""
    tensors, info = _state(model.state_dict(), model.named_parameters(), optimizer)
    meta = _meta(info["steps"], info["param_groups"], scheduler, scaler, extra, source="eager")
    _atomic_write(path, lambda d: _write_checkpoint(d, tensors, meta))


def load_into(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path: str,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    strict: bool = True,
    restore_rng: bool = True,
) -> Any:
    """Load a checkpoint (from shfx or :func:`save_from`) into an eager model and its torch
    Optimizer: weights, optimizer state and each group's hyperparameters, ``scheduler``,
    ``scaler`` (``torch.amp.GradScaler``), the RNG states. Returns the ``extra`` saved."""
    path = os.path.abspath(path)
    md, meta = _read_meta(path)
    _check_common(meta, path, scheduler)
    targets = _model_targets(path, md, model.state_dict(), strict)
    if optimizer is not None:
        _load_optimizer(path, md, meta, model.named_parameters(), optimizer)
    _load_model(path, targets)
    _load_common(meta, path, scheduler, scaler, restore_rng)
    return meta["extra"]
