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
from ._checkpoint_stream import CheckpointReader, GroupReads, StreamingSavePlanner
from ._checkpoint_stream import writer as stream_writer
from .errors import ShfxError, UsageError
from .optim import HostOptimizer

__all__ = ["save", "load", "save_from", "load_into", "read_info", "AsyncSave", "STATE_FILE", "FORMAT"]


# ---- the optimizer state by parameter name (eager torch.optim and cm.optimizer alike) ---------------
_OPT = "optimizer.state."


def _optim_placeholders(reader: CheckpointReader) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's ``optimizer.state.*`` as ``{param name: {field: tensor}}``: meta tensors
    of their shapes and dtypes (nothing read), but each ``step`` read (a few bytes: the checks
    need its value)."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    steps: dict[str, torch.Tensor] = {}
    for k, m in reader.metadata.items():
        if not k.startswith(_OPT):
            continue
        name, _, field = k[len(_OPT) :].rpartition(".")
        shape, dtype = tuple(m.size), m.properties.dtype
        t = torch.empty(shape, dtype=dtype, device="cpu" if field == "step" else "meta")
        if field == "step":
            steps[k] = t
        state.setdefault(name, {})[field] = t
    reader.read(steps)
    return state


def _torch_format(
    path: str, meta: dict[str, Any], named_params: list, optimizer: torch.optim.Optimizer, saved: dict[str, dict], hyperparams: bool
) -> tuple[dict[str, Any], dict[int, str]]:
    """``(torch's state-dict format of the checkpoint's optimizer state for optimizer, each
    parameter index's name)``: the checkpoint's names mapped onto the optimizer's parameters
    (indices numbered across its groups in order, as ``optimizer.state_dict()`` numbers them,
    without reading its state) and each group given the hyperparameters of the checkpoint's
    group its parameters were in (``hyperparams=False``: its own). Refused: state for a
    parameter the optimizer does not update, groups that mix the checkpoint's."""
    names = _names(named_params)
    hps_by_group = _group_hyperparams(path, meta, named_params, optimizer)
    index: dict[int, int] = {}
    name_of: dict[int, str] = {}
    held: set[str] = set()
    state: dict[int, dict[str, torch.Tensor]] = {}
    groups = []
    for group, hps in zip(optimizer.param_groups, hps_by_group):
        packed = {k: v for k, v in group.items() if k != "params"}
        if hyperparams:
            packed.update({k: tuple(v) if isinstance(v, list) else v for k, v in hps.items()})
        packed["params"] = []
        for p in group["params"]:
            i = index.setdefault(id(p), len(index))
            packed["params"].append(i)
            n = names.get(id(p))
            held.add(n)
            name_of[i] = n
            if n in saved:
                state[i] = saved[n]
        groups.append(packed)
    unknown = sorted(set(saved) - held)
    if unknown:
        raise UsageError(
            f"the checkpoint has optimizer state for {unknown[0]!r} ({len(unknown)} such), which this optimizer does not "
            "update; load a checkpoint of this model (same parameter names and requires_grad)"
        )
    return {"state": state, "param_groups": groups}, name_of


def _load_optimizer(
    reader: CheckpointReader, meta: dict[str, Any], named_params: Any, optimizer: torch.optim.Optimizer, *,
    states: bool = True, hyperparams: bool = True,
) -> None:  # fmt: skip
    """Load a checkpoint's optimizer state and hyperparameters into ``optimizer`` (eager, or
    ``cm.optimizer`` before or after its first call) through ``optimizer.load_state_dict``, the
    checkpoint's names mapped onto the optimizer's parameters and groups. A load that is
    refused changes nothing. ``cm.optimizer`` checks the checkpoint's shapes (placeholders)
    first and reads the state one stage at a time while it writes it (its ``read=``); a torch
    Optimizer gets it all at once. ``states=False``: the hyperparameters only (the states are
    loaded at the first call, :func:`apply_pending`); ``hyperparams=False``: the states only."""
    named_params = list(named_params)
    saved = _optim_placeholders(reader)
    sd, name_of = _torch_format(reader.path, meta, named_params, optimizer, saved, hyperparams)
    failed: list[BaseException] = []

    def read(indices: list[int]) -> dict[int, dict[str, torch.Tensor]]:
        wanted = {(i, f): torch.empty(t.shape, dtype=t.dtype) for i in indices for f, t in sd["state"][i].items() if t.is_meta}
        try:
            reader.read({f"{_OPT}{name_of[i]}.{f}": t for (i, f), t in wanted.items()})
        except BaseException as e:
            failed.append(e)
            raise
        return {i: {f: wanted.get((i, f), t) for f, t in sd["state"][i].items()} for i in indices}

    if not states:
        sd["state"] = {}
    try:
        if isinstance(optimizer, HostOptimizer):
            optimizer.load_state_dict(sd, read=read)  # (checks every stage, then reads and writes one at a time)
        else:
            sd["state"] = read(sorted(sd["state"]))
            optimizer.load_state_dict(sd)  # torch's optimizers change nothing when they refuse
    except ShfxError:
        raise
    except (ValueError, KeyError, RuntimeError) as e:
        if failed:  # (the checkpoint's files could not be read: not a refusal)
            raise
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


def _loads_states_at_first_call(cm) -> bool:
    """Whether a load before the first call leaves ``cm.optimizer``'s states to that call: a
    shfx optimizer in one process, whose states can then be read one stage at a time into the
    host store or the SSD (the NVMe and parameter tiers) once they are laid out, instead of
    being held in RAM until then. (Data parallel keeps them until then: each rank keeps its
    shard of them.)"""
    return cm._engine is None and isinstance(cm.optimizer, HostOptimizer) and getattr(cm, "_dp", None) is None


def load(cm, path: str, *, scheduler: Any = None, strict: bool = True, restore_rng: bool = True) -> Any:
    """Load what :func:`save` wrote into a compiled model (see :meth:`CompiledModel.load_checkpoint`).
    Under data parallel (``cm._engine.dp`` set) every rank calls it: :func:`shfx.dp_checkpoint.load`.

    Everything a load can refuse is checked against the checkpoint's metadata before anything
    is written; then the weights the host store holds are read into it in place, and what lives
    on the SSD (the parameter tier's weights, the NVMe tier's optimizer states) one group at a
    time, each group read into the SSD window's buffers and written to the SSD before the next.
    Before the first call the weights go into the model's own tensors and the optimizer states
    wait for that call (:func:`apply_pending`), which reads them the same way."""
    if getattr(getattr(cm, "_engine", None), "dp", None) is not None:
        from . import dp_checkpoint

        return dp_checkpoint.load(cm, path, scheduler=scheduler, strict=strict, restore_rng=restore_rng)
    path = os.path.abspath(path)
    md, meta = _read_meta(path)
    cm._settle()
    _check_common(meta, path, scheduler)
    reader = CheckpointReader(os.path.realpath(path), _no_dist())  # (the directory the link names now)
    targets = _model_targets(path, md, cm._load_targets(), strict)  # (the tier's paged weights: placeholders)
    defer = _loads_states_at_first_call(cm)
    if cm.optimizer is not None:
        _load_optimizer(reader, meta, cm.module.named_parameters(), cm.optimizer, states=not defer)
    paged = cm._store.paged_keys if cm._store is not None else {}
    reader.read({f"model.{k}": t for k, t in targets.items() if k not in paged})  # in place
    if cm._engine is not None:
        if any(k in paged for k in targets):  # (the parameter tier: one group at a time, into the window, to the SSD)
            cm._engine.ssd.load_paged(
                [k for k in targets if k in paged], lambda views: reader.read({f"model.{k}": v for k, v in views.items()})
            )
        cm._store.refresh_working()  # mixed precision: the 16-bit image from the loaded masters
        cm._engine.invalidate_device_weights()
        cm._engine.skipped_steps = meta["skipped_steps"]
        cm._pending_checkpoint = None  # (one refused at the first call: this load replaces it)
    else:  # the engine exists at the first call
        cm._pending_checkpoint = {
            "path": reader.path, "skipped_steps": meta["skipped_steps"], "states": defer and cm.optimizer is not None
        }  # fmt: skip
    _load_common(meta, path, scheduler, cm.scaler, restore_rng)
    return meta["extra"]


def apply_pending(cm, variant) -> None:
    """At the first call after :func:`load` ran before it, once the host store and the SSD
    window are laid out: the optimizer states, read one stage at a time (the hyperparameters
    were loaded then), and what the engine keeps. A refused state (what only the store's
    layout can tell: a stage's parameters with and without state, or with different steps) is
    raised here, and at every call until another checkpoint is loaded, with nothing written."""
    pending = cm._pending_checkpoint
    if pending["states"]:
        path = pending["path"]
        _, meta = _read_meta(path)
        try:
            _load_optimizer(CheckpointReader(path, _no_dist()), meta, cm.module.named_parameters(), cm.optimizer, hyperparams=False)
        except UsageError as e:
            raise UsageError(
                f"the optimizer state of the checkpoint loaded before the first call ({path!r}) is refused: {e}; load "
                "another checkpoint (cm.load_checkpoint) before calling the model"
            ) from e
    cm._engine.skipped_steps = pending["skipped_steps"]
    cm._pending_checkpoint = None


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
    reader = CheckpointReader(path, _no_dist())
    if optimizer is not None:
        _load_optimizer(reader, meta, model.named_parameters(), optimizer)
    reader.read({f"model.{k}": t for k, t in targets.items()})  # in place
    _load_common(meta, path, scheduler, scaler, restore_rng)
    return meta["extra"]
