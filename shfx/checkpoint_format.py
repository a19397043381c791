"""The checkpoint format's pieces that :mod:`shfx.checkpoint` (one process, eager models) and
:mod:`shfx.dp_checkpoint` (data parallel) both use.

The state file's name and the format number, the optimizer state by parameter name, the
metadata saved beside the tensors (with the RNG states), the parts of the atomic switch (the
hidden directory beside the path, fsync, the leftovers' removal) and reading a checkpoint's
metadata and the model tensors it loads into. Both modules import this one and it imports
neither, so the imports run one way: :func:`shfx.checkpoint.save` and
:func:`shfx.checkpoint.load` hand over to :mod:`shfx.dp_checkpoint` under data parallel, and
:mod:`shfx.dp_checkpoint` writes and reads the same format through these helpers.
:mod:`shfx.checkpoint` keeps every name of this module importable from it as before
(``shfx.checkpoint.STATE_FILE``, ``shfx.checkpoint.rng_state``, ...).
"""

from __future__ import annotations

import copy
import os
import random
import shutil
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch

from .errors import UsageError

FORMAT = 1
STATE_FILE = "shfx_state.pt"
# tests only: kill this process (SIGKILL) at a named point of a save ("data": the shards are
# written but not DCP's metadata; "switch": the new directory is complete, the link not switched)
_KILL_ENV = "SHFX_CHECKPOINT_TEST_KILL_AT"


def _test_kill_point(where: str) -> None:
    if os.environ.get(_KILL_ENV) == where:
        os.kill(os.getpid(), signal.SIGKILL)


# ---- the optimizer state by parameter name (eager torch.optim and cm.optimizer alike) ---------------
# torch.optim options that choose an implementation, not the update: a load leaves the target's own
_IMPL = frozenset({"foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay"})


def _names(named_params: Any) -> dict[int, str]:
    return {id(p): n for n, p in named_params}


def _optimizer_state(
    named_params: Any, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict[str, Any]]]:
    """``({param name: {field: tensor}}, param_groups with parameter names)`` of a torch
    Optimizer over the parameters ``named_params`` (``model.named_parameters()``): its
    ``state[p]`` as it names the fields (AdamW's step/exp_avg/exp_avg_sq, SGD's
    momentum_buffer, Adafactor's step/row_var/col_var/variance, ...), and each group's
    hyperparameters. No copy of CPU tensors: for ``cm.optimizer`` they are views of the host
    store's flat buffers (device-updated stages' states are copied to the host)."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    groups: list[dict[str, Any]] = []
    if optimizer is None:
        return state, groups
    names, live = _names(named_params), optimizer.state
    for g in optimizer.param_groups:
        params = []
        for p in g["params"]:
            if id(p) not in names:
                raise UsageError(
                    f"the optimizer holds a tensor of shape {tuple(p.shape)} that is not a parameter of the model; pass "
                    "the model it optimizes"
                )
            params.append(names[id(p)])
            entry = {k: _as_tensor(k, v) for k, v in live.get(p, {}).items() if v is not None}
            if entry:
                state[names[id(p)]] = entry
        groups.append({**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": params})
    return state, groups


def _as_tensor(field: str, v: Any) -> torch.Tensor:
    if not torch.is_tensor(v):
        if not isinstance(v, (int, float)):
            raise UsageError(f"optimizer state {field!r} is a {type(v).__name__}; a checkpoint holds tensors and numbers")
        v = torch.tensor(float(v))
    if v.is_meta:  # (a streaming save's placeholder: kept as it is, a view of its group's meta buffer)
        return v
    t = v.detach().cpu()  # no copy on the CPU
    return t.reshape(()) if field == "step" and t.numel() == 1 else t


def _group_hyperparams(path: str, meta: dict[str, Any], named_params: Any, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The checkpoint's hyperparameters for each of ``optimizer``'s parameter groups (``{}``
    for a group none of whose parameters the checkpoint has), its groups mapped onto the
    optimizer's by parameter name; refused when one optimizer group mixes checkpoint groups
    with other hyperparameters, or the checkpoint lacks a hyperparameter the optimizer needs."""
    names = _names(named_params)
    group_of = {n: i for i, g in enumerate(meta["param_groups"]) for n in g["params"]}
    out: list[dict[str, Any]] = []
    for gi, group in enumerate(optimizer.param_groups):
        hps: dict[str, Any] = {}
        src: dict[int, str] = {}
        for p in group["params"]:
            n = names.get(id(p))
            if n in group_of and group_of[n] not in src:
                src[group_of[n]] = n
                h = {k: v for k, v in meta["param_groups"][group_of[n]].items() if k not in _IMPL and k != "params"}
                if hps and _norm(h) != _norm(hps):
                    raise UsageError(
                        f"param_groups[{gi}] of this optimizer holds {', '.join(repr(x) for x in src.values())}, which "
                        f"are in different groups of the checkpoint with other hyperparameters ({hps} and {h}); build "
                        "the optimizer with the checkpoint's groups (shfx.checkpoint.read_info(path)['param_groups'])"
                    )
                hps = h
        lacking = sorted(set(group) - set(hps) - _IMPL - {"params", "param_names", "initial_lr"}) if hps else []
        if lacking:
            raise UsageError(
                f"the checkpoint's optimizer has no {lacking} in its parameter groups ({sorted(hps)}), which "
                f"{type(optimizer).__name__} needs; load it into the kind of optimizer that saved it"
            )
        out.append(hps)
    return out


def _norm(h: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in h.items()}


# ---- RNG -------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """The RNG states a step draws from: torch's CPU generator (dropout on the CPU and the
    emulated device), every CUDA generator (dropout on a GPU), and Python's ``random``.

    NOTE: shfx's recompute keeps a stage's forward RNG state only within a step (the
    ``StepContext``), and restores the generator after replaying it, so between steps these
    generators are all the RNG state there is."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    if "python" in state:
        random.setstate(_as_tuple(state["python"]))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise UsageError(
                f"the checkpoint has the RNG states of {len(cuda)} CUDA devices, this process sees "
                f"{torch.cuda.device_count()}; load with restore_rng=False (dropout masks then differ from the run saved)"
            )
        torch.cuda.set_rng_state_all(cuda)


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---- writing ---------------------------------------------------------------------------------------
def _writer(path: str, **options: Any):
    """DCP's ``FileSystemWriter`` into ``path`` (its files fsynced; ``options``: its other
    arguments), stopping at the tests' kill point between the shards and the metadata."""
    from torch.distributed.checkpoint import FileSystemWriter

    class _Writer(FileSystemWriter):
        def write_data(self, plan, planner):  # the shards, before DCP's metadata (finish)
            fut = super().write_data(plan, planner)
            fut.wait()
            _test_kill_point("data")
            return fut

    return _Writer(path, sync_files=True, **options)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prefix(path: str) -> tuple[str, str]:
    parent, name = os.path.split(os.path.abspath(path))
    return parent, f".{name}.shfx-"


def _check_target(path: str) -> None:
    if os.path.islink(path):
        parent, prefix = _prefix(path)
        if not os.readlink(path).startswith(prefix):
            raise UsageError(
                f"{path!r} is a symbolic link to {os.readlink(path)!r}, not a checkpoint shfx wrote (shfx makes "
                f"the path a link to a hidden {prefix}* directory beside it); save to another path or remove the link"
            )
        return
    if os.path.isdir(path):
        if os.listdir(path):
            raise UsageError(
                f"{path!r} is a directory that is not empty and was not written by shfx.checkpoint (a checkpoint "
                "path is a link shfx switches atomically); save to a new path, or remove the directory first"
            )
        os.rmdir(path)
    elif os.path.exists(path):
        raise UsageError(f"{path!r} exists and is not a directory; save the checkpoint to another path")


def _remove_leftovers(parent: str, prefix: str, real: str) -> None:
    """Remove every ``prefix*`` entry of ``parent`` but the checkpoint directory ``real`` (the
    previous checkpoints and leftovers of saves that failed or were killed)."""
    for entry in os.listdir(parent):
        full = os.path.join(parent, entry)
        if entry.startswith(prefix) and entry != os.path.basename(real):
            if os.path.islink(full) or not os.path.isdir(full):
                os.unlink(full)
            else:
                shutil.rmtree(full, ignore_errors=True)


def _meta(steps: int, param_groups, scheduler, scaler, extra, skipped_steps: int = 0, source: str = "shfx") -> dict:
    return {
        "format": FORMAT,
        "source": source,
        "steps": int(steps),
        "skipped_steps": int(skipped_steps),
        "param_groups": copy.deepcopy(param_groups),
        "scheduler": copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
        "scaler": copy.deepcopy(scaler.state_dict()) if scaler is not None else None,
        "rng": rng_state(),
        "extra": copy.deepcopy(extra),
    }


# ---- reading ---------------------------------------------------------------------------------------
def _read_meta(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(DCP's tensor metadata by flattened key, the shfx state file)``; clear errors for a
    path that is not a checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path!r} (save one with cm.save_checkpoint or shfx.checkpoint.save_from)")
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise UsageError(f"{path!r} is not a torch.distributed.checkpoint directory (no .metadata file); pass a checkpoint's path")
    md = FileSystemReader(path).read_metadata().state_dict_metadata
    sf = os.path.join(path, STATE_FILE)
    if not os.path.exists(sf):
        raise UsageError(
            f"{path!r} is a torch.distributed.checkpoint without shfx's {STATE_FILE}; load its tensors with "
            "torch.distributed.checkpoint.load, or save it with shfx.checkpoint.save_from"
        )
    try:
        meta = torch.load(sf, weights_only=True)
    except Exception as e:
        raise UsageError(
            f"cannot read {sf}: {e}. The extra= dict of a checkpoint must hold plain data (dicts, lists, numbers, strings, "
            "tensors)"
        ) from e
    if meta.get("format") != FORMAT:
        raise UsageError(f"{path!r} has checkpoint format {meta.get('format')!r}; this shfx reads format {FORMAT}")
    return md, meta


def _model_targets(path: str, md: dict[str, Any], model_sd: dict[str, torch.Tensor], strict: bool) -> dict[str, torch.Tensor]:
    """The tensors of ``model_sd`` that ``model.*`` of the checkpoint loads into (checked)."""
    saved = {k[len("model.") :] for k in md if k.startswith("model.")}
    missing = sorted(set(model_sd) - saved)
    unexpected = sorted(saved - set(model_sd))
    if strict and (missing or unexpected):
        raise UsageError(
            f"the checkpoint at {path!r} does not match the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}; load a checkpoint of this model, or "
            "pass strict=False to load the names both have"
        )
    targets = {}
    for k, t in model_sd.items():
        if k not in saved:
            continue
        m = md["model." + k]
        if tuple(m.size) != tuple(t.shape):
            raise UsageError(f"{k!r} has shape {tuple(m.size)} in the checkpoint and {tuple(t.shape)} in the model; load a checkpoint of this model")
        targets[k] = t
    return targets


def _reader(path: str):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path)


def _check_common(meta: dict[str, Any], path: str, scheduler: Any) -> None:
    """What :func:`_load_common` would refuse, checked before anything loads."""
    if scheduler is not None and meta["scheduler"] is None:
        raise UsageError(f"scheduler= was given, but the checkpoint at {path!r} was saved without one; load without it")


def _load_common(meta: dict[str, Any], path: str, scheduler: Any, scaler: Any, restore_rng: bool) -> None:
    """The scheduler, the loss scaler (when the checkpoint has one: a checkpoint saved in
    another precision leaves the scaler as it is) and the RNG states."""
    _check_common(meta, path, scheduler)
    if scheduler is not None:
        scheduler.load_state_dict(meta["scheduler"])
    if scaler is not None and meta["scaler"]:
        scaler.load_state_dict(meta["scaler"])
    if restore_rng:
        set_rng_state(meta["rng"])


class AsyncSave:
    """A save running in a background thread (``cm.save_checkpoint(..., async_save=True)``):
    ``job`` (the atomic write of a staged checkpoint: :mod:`shfx.checkpoint`; every rank's
    pieces under data parallel: :mod:`shfx.dp_checkpoint`) runs there; :meth:`wait` joins it
    and re-raises what it raised."""

    def __init__(self, path: str, *, job: Callable[[], None]):
        self.path = path
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(job,), name="shfx-checkpoint", daemon=True)
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # re-raised by wait()
            self.error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self.error is not None:
            e, self.error = self.error, None
            raise RuntimeError(f"the asynchronous checkpoint save to {self.path!r} failed: {e}") from e
