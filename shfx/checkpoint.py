"""Checkpoint and resume: the whole training state, saved atomically with torch.distributed.checkpoint.

A checkpoint is a directory written by ``torch.distributed.checkpoint`` (DCP, the format FSDP
and torchtitan use) plus one small file beside its shards::

    model.<name>                              every tensor of model.state_dict() (fp32 masters)
    optimizer.state.<param name>.<field>      AdamW's step, exp_avg, exp_avg_sq (max_exp_avg_sq)
    shfx_state.pt                             optimizer hyperparameters (param_groups), the step
                                              count, LR scheduler, loss scaler, RNG states, extra

The tensor part has the layout of ``torch.distributed.checkpoint.state_dict.get_state_dict``
(``{"model": ..., "optimizer": {"state": {fqn: {...}}}}``), so ``dcp.load`` reads it into
any model with the same names, on any number of ranks. Weights are written straight from the
host store's tensors (views: DCP copies one tensor at a time while it writes), and read back
into them in place.

Saving is atomic: the checkpoint is written into a new directory beside ``path`` (its files
and the directory fsynced), then ``path`` - a symbolic link to that directory - is switched to
it with ``os.replace`` (atomic on POSIX) and the parent directory fsynced. A save that fails or
is killed half way leaves the last good checkpoint as it was (its leftovers, hidden
``.<name>.shfx-*`` directories, are removed by the next save to the same path).

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

import copy
import os
import random
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .errors import UsageError

__all__ = ["save", "load", "save_from", "load_into", "read_info", "AsyncSave", "STATE_FILE", "FORMAT"]

FORMAT = 1
STATE_FILE = "shfx_state.pt"
_ADAM_FIELDS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
# tests only: kill this process (SIGKILL) at a named point of a save ("data": the shards are
# written but not DCP's metadata; "switch": the new directory is complete, the link not switched)
_KILL_ENV = "SHFX_CHECKPOINT_TEST_KILL_AT"


def _test_kill_point(where: str) -> None:
    if os.environ.get(_KILL_ENV) == where:
        os.kill(os.getpid(), signal.SIGKILL)


# ---- the optimizer state of a compiled model, by parameter name -----------------------------------
# NOTE: the only place that knows how shfx keeps AdamW states (flat per-group buffers on the
# host, HostAdamW.state; on the device for groups a policy updates there, DeviceAdamW.state).
# When cm.optimizer becomes a torch Optimizer these two functions become its state_dict() and
# load_state_dict() with parameter names for keys.


def _param_spans(grp) -> list[tuple[str, int, tuple[int, ...]]]:
    """``(name, element offset, shape)`` of each trainable parameter of host group ``grp``."""
    out = []
    for info in grp.infos:
        if info.kind == "param" and info.trainable:
            p = grp.part_at(grp.offsets[info.key])
            out.append((info.key, p.elem + (grp.offsets[info.key] - p.offset) // p.dtype.itemsize, info.shape))
    return out


def _group_states(cm) -> dict[int, tuple[str, Any]]:
    """Group index -> ("host" | "device", its state object) for every group that has one."""
    eng = cm._engine
    out: dict[int, tuple[str, Any]] = {}
    if eng is None or eng.optimizer is None:
        return out
    for g, st in eng.optimizer.state.items():
        out[g] = ("host", st)
    if eng.device_optimizer is not None:
        for g, st in eng.device_optimizer.state.items():
            out[g] = ("device", st)
    return out


def _hyperparams(opt) -> dict[str, Any]:
    return {k: getattr(opt, k) for k in _HYPER}


def _optimizer_state(cm) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict[str, Any]]]:
    """The compiled model's optimizer state as ``({param name: {"step", "exp_avg", "exp_avg_sq"
    [, "max_exp_avg_sq"]}}, param_groups)``, torch's AdamW state keyed by the model's names.
    Host states are views of the flat buffers (no copy); device states are copied to the host.
    A parameter whose group never stepped has no entry (as in torch)."""
    if cm.optimizer is None:
        return {}, []
    state: dict[str, dict[str, torch.Tensor]] = {}
    store = cm._store
    states = _group_states(cm)
    for grp in store.groups if store is not None else []:
        spans = _param_spans(grp)
        if grp.index not in states:
            continue
        where, st = states[grp.index]
        flat = {"step": st.step}
        if where == "host":
            flat.update(exp_avg=st.exp_avg, exp_avg_sq=st.exp_avg_sq)
            if st.max_exp_avg_sq is not None:
                flat["max_exp_avg_sq"] = st.max_exp_avg_sq
        else:
            flat.update(exp_avg=st.m, exp_avg_sq=st.v)
        for name, off, shape in spans:
            n = _numel(shape)
            entry = {"step": flat["step"].detach().cpu().reshape(())}
            for k, t in flat.items():
                if k != "step":
                    entry[k] = t[off : off + n].view(shape).cpu()
            state[name] = entry
    names = [n for n, p in cm.module.named_parameters() if p.requires_grad]  # the model's order, as torch's
    return state, [{**_hyperparams(cm.optimizer), "params": names}]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _load_optimizer_state(
    cm, state: dict[str, dict[str, torch.Tensor]], param_groups: list[dict[str, Any]], device_groups=None
) -> None:
    """Put ``state`` (as :func:`_optimizer_state` returns it) into the compiled model's optimizer
    (:func:`_prepare_optimizer_state`, then apply)."""
    _prepare_optimizer_state(cm, state, param_groups, device_groups)()


def _prepare_optimizer_state(
    cm, state: dict[str, dict[str, torch.Tensor]], param_groups: list[dict[str, Any]], device_groups=None
) -> Callable[[], None]:
    """Check ``state`` (as :func:`_optimizer_state` returns it) and ``param_groups`` against the
    compiled model and return the function that puts them into its optimizer: each group's
    states are replaced (a group none of whose parameters has state starts fresh) and the
    hyperparameters set. Changes nothing itself (a load that is refused leaves the model as it
    was). Needs the host store (after the first call). ``device_groups``: the groups updated on
    the device (default: those of the last forward's variant)."""
    eng, store = cm._engine, cm._store
    if device_groups is None:
        device_groups = eng.current.device_groups if eng.current is not None else frozenset()
    trainable = {n for grp in store.groups for n, _, _ in _param_spans(grp)}
    unknown = sorted(set(state) - trainable)
    if unknown:
        raise UsageError(
            f"the checkpoint has optimizer state for {unknown[0]!r} ({len(unknown)} such), which is not a trainable "
            "parameter of this compiled model; load a checkpoint of this model (same parameter names and requires_grad)"
        )
    plan = [(grp, _group_flat(grp, state)) for grp in store.groups if _param_spans(grp)]
    hps = _checked_hyperparams(param_groups)
    amsgrad = any(flat is not None and "max_exp_avg_sq" in flat[1] for _, flat in plan)
    if any(flat is not None for _, flat in plan) and bool(hps.get("amsgrad", cm.optimizer.amsgrad)) != amsgrad:
        raise UsageError(
            f"the checkpoint's hyperparameters say amsgrad={hps.get('amsgrad')}, but its states "
            f"{'have' if amsgrad else 'have no'} max_exp_avg_sq; save it again from an optimizer whose states match"
        )
    if amsgrad and any(grp.index in device_groups for grp, flat in plan if flat is not None):
        raise NotImplementedError("amsgrad is not supported by the device-side optimizer")

    def apply() -> None:
        for k, v in hps.items():
            setattr(cm.optimizer, k, v)
        states = _group_states(cm)
        for grp, flat in plan:
            g = grp.index
            if g in states:  # the group's current states go, wherever they are
                (eng.device_optimizer if states[g][0] == "device" else eng.optimizer).take(g)
            if flat is None:  # no state saved for this group: it starts fresh, as it would in torch
                continue
            step, f = flat
            if g in device_groups:
                eng.device_optimizer.put(grp, step, f["exp_avg"], f["exp_avg_sq"])
                continue
            if amsgrad:  # NOTE: HostAdamW.put makes states without amsgrad's buffer; this makes them with it
                eng.optimizer._state(g, amsgrad=True)
            eng.optimizer.put(g, step, f["exp_avg"], f["exp_avg_sq"])
            if amsgrad:
                eng.optimizer.state[g].max_exp_avg_sq.copy_(f["max_exp_avg_sq"])

    return apply


def _group_flat(grp, state: dict[str, dict[str, torch.Tensor]]) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """Host group ``grp``'s ``(step, {field: flat buffer})`` from per-parameter ``state``, laid
    out like its trainable region; None when none of its parameters has state."""
    spans = _param_spans(grp)
    have = [n for n, _, _ in spans if n in state]
    if not have:
        return None
    if len(have) != len(spans):
        missing = [n for n, _, _ in spans if n not in state]
        raise UsageError(
            f"the checkpoint has optimizer state for {have[0]!r} but not for {missing[0]!r}, which shfx updates "
            f"together (host group {grp.index}: {', '.join(n for n, _, _ in spans)}); a checkpoint from shfx or "
            "from an eager optimizer that stepped every parameter has both. Save it again after a step that "
            "reached every parameter, or load the weights alone (cm.load_state_dict)."
        )
    steps = {float(state[n]["step"]) for n in have}
    if len(steps) != 1:
        raise UsageError(
            f"the checkpoint's parameters {', '.join(have)} have different AdamW step counts ({sorted(steps)}), "
            f"but shfx keeps one per group (host group {grp.index}); a checkpoint from an optimizer that stepped "
            "them all alike loads"
        )
    fields = [f for f in _ADAM_FIELDS[1:] if f in state[have[0]]]
    flat = {f: torch.zeros(grp.trainable_numel, dtype=grp.dtypes.state) for f in fields}
    for name, off, shape in spans:
        for f in dict.fromkeys(_ADAM_FIELDS[1:3] + tuple(fields)):
            src = state[name].get(f)
            if src is None or tuple(src.shape) != tuple(shape):
                got = "nothing" if src is None else f"shape {tuple(src.shape)}"
                raise UsageError(
                    f"optimizer state {f!r} of {name!r} in the checkpoint is {got}; the model's parameter has shape "
                    f"{tuple(shape)}. Load a checkpoint of this model."
                )
            flat[f][off : off + _numel(shape)].copy_(src.reshape(-1))
    return torch.tensor(steps.pop(), dtype=torch.float32), flat


def _checked_hyperparams(param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """The one set of AdamW hyperparameters of ``param_groups`` (checked: shfx's AdamW has one)."""
    if not param_groups:
        return {}
    hps = [{k: g[k] for k in _HYPER if k in g} for g in param_groups]
    if any(_norm(h) != _norm(hps[0]) for h in hps[1:]):
        raise UsageError(
            f"the checkpoint's optimizer has {len(hps)} parameter groups with different hyperparameters ({hps}); "
            "shfx.optim.AdamW has one set. Save from an optimizer with one set of hyperparameters."
        )
    out = {k: tuple(v) if k == "betas" else v for k, v in hps[0].items()}
    from .optim import AdamW

    AdamW(**out)  # validates them
    return out


def _set_hyperparams(opt, param_groups: list[dict[str, Any]]) -> None:
    for k, v in _checked_hyperparams(param_groups).items():
        setattr(opt, k, v)


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


def _writer(path: str):
    from torch.distributed.checkpoint import FileSystemWriter

    class _Writer(FileSystemWriter):
        def write_data(self, plan, planner):  # the shards, before DCP's metadata (finish)
            fut = super().write_data(plan, planner)
            fut.wait()
            _test_kill_point("data")
            return fut

    return _Writer(path, sync_files=True)


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
    for entry in os.listdir(parent):
        full = os.path.join(parent, entry)
        if entry.startswith(prefix) and entry != os.path.basename(real):
            if os.path.islink(full) or not os.path.isdir(full):
                os.unlink(full)
            else:
                shutil.rmtree(full, ignore_errors=True)


def _write_checkpoint(directory: str, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, storage_writer=_writer(directory), no_dist=_no_dist())
    with open(os.path.join(directory, STATE_FILE), "wb") as f:
        torch.save(meta, f)
        f.flush()
        os.fsync(f.fileno())


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


def _cm_state(cm) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors for DCP, param_groups and steps)`` of a compiled model: views of the host store."""
    model = cm.state_dict()  # settles the step, copies device-updated weights back to the host
    state, groups = _optimizer_state(cm)
    steps = max((int(e["step"]) for e in state.values()), default=0)
    tensors: dict[str, Any] = {"model": model}
    if state:
        tensors["optimizer"] = {"state": state}
    return tensors, {"param_groups": groups, "steps": steps}


class AsyncSave:
    """A save running in a background thread (``cm.save_checkpoint(..., async_save=True)``):
    :meth:`wait` joins it and re-raises what it raised."""

    def __init__(self, path: str, tensors: dict[str, Any], meta: dict[str, Any]):
        self.path = path
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(tensors, meta), name="shfx-checkpoint", daemon=True)
        self._thread.start()

    def _run(self, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
        try:
            _atomic_write(self.path, lambda d: _write_checkpoint(d, tensors, meta))
        except BaseException as e:  # re-raised by wait()
            self.error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self.error is not None:
            e, self.error = self.error, None
            raise RuntimeError(f"the asynchronous checkpoint save to {self.path!r} failed: {e}") from e


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
    """Save a compiled model's training state to ``path`` (see :meth:`CompiledModel.save_checkpoint`)."""
    if pending := getattr(cm, "_pending_checkpoint", None):
        raise UsageError(
            "a checkpoint was loaded before the first call and its optimizer state is applied at that call; call "
            f"the model once (a training step) before saving again ({pending['path']!r} is still the checkpoint)"
        )
    tensors, info = _cm_state(cm)
    meta = _meta(info["steps"], info["param_groups"], scheduler, cm.scaler, extra, cm.skipped_steps)
    if not async_save:
        _atomic_write(path, lambda d: _write_checkpoint(d, tensors, meta))
        return None
    return AsyncSave(os.path.abspath(path), _stage(tensors, cm._checkpoint_staging), meta)


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


def read_info(path: str) -> dict[str, Any]:
    """What a checkpoint holds besides its tensors: ``steps`` (optimizer steps taken),
    ``skipped_steps`` (fp16), ``param_groups`` (hyperparameters and parameter names),
    ``source`` (``"shfx"`` or ``"eager"``), ``extra``, and ``tensors`` (each tensor's flattened
    DCP key with its shape and dtype)."""
    md, meta = _read_meta(os.path.abspath(path))
    keys = ("steps", "skipped_steps", "param_groups", "source", "extra")
    tensors = {k: (tuple(m.size), m.properties.dtype) for k, m in md.items() if hasattr(m, "size")}
    return {**{k: meta[k] for k in keys}, "tensors": tensors}


def _load_model(path: str, md: dict[str, Any], model_sd: dict[str, torch.Tensor], strict: bool) -> None:
    """Load ``model.*`` into the tensors of ``model_sd`` in place."""
    import torch.distributed.checkpoint as dcp

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
    if targets:
        dcp.load({"model": targets}, storage_reader=_reader(path), no_dist=_no_dist())


def _reader(path: str):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path)


def _load_optim_tensors(path: str, md: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """The ``optimizer.state.*`` tensors of a checkpoint, as ``{param name: {field: tensor}}``."""
    import torch.distributed.checkpoint as dcp

    pre = "optimizer.state."
    state: dict[str, dict[str, torch.Tensor]] = {}
    for k, m in md.items():
        if not k.startswith(pre):
            continue
        name, _, field = k[len(pre) :].rpartition(".")
        if field not in _ADAM_FIELDS:
            raise UsageError(f"the checkpoint's optimizer state has a field {field!r} ({k}); shfx reads AdamW's {_ADAM_FIELDS}")
        state.setdefault(name, {})[field] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    if state:
        dcp.load({"optimizer": {"state": state}}, storage_reader=_reader(path), no_dist=_no_dist())
    return state


def load(cm, path: str, *, scheduler: Any = None, strict: bool = True, restore_rng: bool = True) -> Any:
    """Load what :func:`save` wrote into a compiled model (see :meth:`CompiledModel.load_checkpoint`)."""
    path = os.path.abspath(path)
    md, meta = _read_meta(path)
    cm._settle()
    _check_common(meta, path, scheduler)
    apply_optimizer = None
    if cm.optimizer is not None:  # checked before anything loads: a refused load changes nothing
        state = _load_optim_tensors(path, md)
        if cm._engine is not None:
            apply_optimizer = _prepare_optimizer_state(cm, state, meta["param_groups"])
        else:
            _checked_hyperparams(meta["param_groups"])
    _load_model(path, md, cm.module.state_dict(), strict)  # in place: the model's tensors are the host store
    if cm._engine is not None:
        cm._store.refresh_working()  # mixed precision: the 16-bit image from the loaded masters
        cm._engine.invalidate_device_weights()
    if apply_optimizer is not None:
        apply_optimizer()
        cm._engine.skipped_steps = meta["skipped_steps"]
    elif cm.optimizer is not None:  # the host store does not exist yet: the states go in at the first call
        _set_hyperparams(cm.optimizer, meta["param_groups"])
        cm._pending_checkpoint = {"path": path, "state": state, "param_groups": meta["param_groups"],
                                  "skipped_steps": meta["skipped_steps"]}  # fmt: skip
    _load_common(meta, path, scheduler, cm.scaler, restore_rng)
    return meta["extra"]


def apply_pending(cm, variant) -> None:
    """At the first call after :func:`load` ran before it: the optimizer state, now that the
    host store exists (``variant``: the one that call runs, whose groups updated on the device
    get their states there)."""
    pending = cm._pending_checkpoint
    cm._pending_checkpoint = None
    _load_optimizer_state(cm, pending["state"], pending["param_groups"], variant.device_groups)
    cm._engine.skipped_steps = pending["skipped_steps"]


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


# ---- eager PyTorch ----------------------------------------------------------------------------------
def _names_by_param(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def save_from(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path: str,
    *,
    extra: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
) -> None:
    """Save an eager model and its ``torch.optim.AdamW`` in shfx's checkpoint format (atomically),
    for :meth:`CompiledModel.load_checkpoint` or :func:`load_into`. ``scaler``: a
    ``torch.amp.GradScaler`` (its state dict is the loss scaler's)."""
    names = _names_by_param(model)
    state: dict[str, dict[str, torch.Tensor]] = {}
    groups: list[dict[str, Any]] = []
    if optimizer is not None:
        for g in optimizer.param_groups:
            params = []
            for p in g["params"]:
                if id(p) not in names:
                    raise UsageError("the optimizer holds a tensor that is not a parameter of the model; pass the model it optimizes")
                params.append(names[id(p)])
                st = optimizer.state.get(p)
                if st:
                    unknown = set(st) - set(_ADAM_FIELDS)
                    if unknown:
                        raise UsageError(f"optimizer state {sorted(unknown)} of {names[id(p)]!r}: shfx checkpoints hold AdamW's {_ADAM_FIELDS}")
                    state[names[id(p)]] = {k: (v if torch.is_tensor(v) else torch.tensor(float(v))).detach().cpu() for k, v in st.items()}
            groups.append({**{k: g[k] for k in _HYPER if k in g}, "params": params})
    tensors: dict[str, Any] = {"model": {k: v.detach().cpu() for k, v in model.state_dict().items()}}
    if state:
        tensors["optimizer"] = {"state": state}
    steps = max((int(e["step"]) for e in state.values()), default=0)
    meta = _meta(steps, groups, scheduler, scaler, extra, source="eager")
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
    """Load a checkpoint (from shfx or :func:`save_from`) into an eager model and its
    ``torch.optim.AdamW``: weights, optimizer state and hyperparameters, ``scheduler``,
    ``scaler`` (``torch.amp.GradScaler``), the RNG states. Returns the ``extra`` saved."""
    path = os.path.abspath(path)
    md, meta = _read_meta(path)
    _check_common(meta, path, scheduler)
    with torch.no_grad():
        _load_model(path, md, model.state_dict(), strict)
    if optimizer is not None:
        state = _load_optim_tensors(path, md)
        names = _names_by_param(model)
        hps = {n: {k: g[k] for k in _HYPER if k in g} for g in meta["param_groups"] for n in g["params"]}
        sd = optimizer.state_dict()
        by_index: dict[int, dict[str, torch.Tensor]] = {}
        for group, sd_group in zip(optimizer.param_groups, sd["param_groups"]):
            for p, index in zip(group["params"], sd_group["params"]):
                n = names.get(id(p))
                if n in state:
                    by_index[index] = state[n]
                if n in hps:
                    sd_group.update({k: tuple(v) if k == "betas" else v for k, v in hps[n].items()})
        unknown = sorted(set(state) - {names.get(id(p)) for g in optimizer.param_groups for p in g["params"]})
        if unknown:
            raise UsageError(f"the checkpoint has optimizer state for {unknown[0]!r}, which this optimizer does not hold")
        sd["state"] = by_index
        optimizer.load_state_dict(sd)
    _load_common(meta, path, scheduler, scaler, restore_rng)
    return meta["extra"]
