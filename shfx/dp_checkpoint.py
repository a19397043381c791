"""Checkpoints of data-parallel training: N ranks write one checkpoint that M ranks (1 included) load.

Under data parallel every rank holds the whole model (replicated weights) but, for each
parameter, only a contiguous range ``[lo, hi)`` of its FLATTENED optimizer state (the rank's
shard of the group's flat buffer, intersected with the parameter's span). This module writes
such a state in :mod:`shfx.checkpoint`'s format (``model.<name>``,
``optimizer.state.<param name>.<field>`` with each parameter's real shape, ``shfx_state.pt``):
a checkpoint written by N ranks has the same keys and shapes as one written by one process,
and :func:`shfx.checkpoint.load_into` (eager torch), a compiled model without data parallel,
or M ranks of data parallel load it.

How a range becomes DCP chunks: :func:`flat_range_boxes` cuts the row-major range ``[lo, hi)``
into the few rectangular boxes it is made of (at most ``2 * ndim - 1``, each contiguous in
memory), and each box is a local shard of a ``ShardedTensor`` whose tensor is a VIEW of the
rank's 1-D state reshaped to the box (no copy): DCP writes the shards it is given and, on
load, copies into the shards each rank asks for, reading whichever saved chunks overlap them
(resharding). The replicated weights are plain tensors on every rank; DCP's planner writes
each once.

NOTE: why ShardedTensor and not DTensor. A DTensor's local part is what a placement
(``Shard(dim)``, ``Replicate``) on a device mesh computes, an even split along one
dimension; a range of the flattened tensor that starts or ends inside a row is not one, and
its rank cannot hold several boxes. ``ShardedTensor`` takes any set of non-overlapping boxes
(``ShardMetadata``: offsets, sizes, placement ``rank:<global rank>/cpu``) and torch 2.13's
DCP planners read and write it (``planner_helpers._create_write_items`` /
``_create_chunk_list``); torch's own DCP optimizer code builds it the same way. Every rank
needs the global list of boxes: ``init_from_local_shards`` gathers it with one collective PER
TENSOR, so instead one ``all_gather_object`` of every rank's ``(key, shape, lo, hi)`` gives
each rank all the boxes and ``ShardedTensor._init_from_local_shards_and_global_metadata``
(the constructor DCP's ``optimizer.py`` uses) builds the tensors without further
communication; the same gathered list is checked first, so ranges that overlap or leave a
gap are refused with the key and ranks named.

The protocol of a compiled model under data parallel (the runtime implements it): a
compiled model ``cm`` whose ``cm._engine.dp`` is set has

- ``dp.state_pieces() -> {param name: {field: (global_shape, lo, hi, local_1d)}}``: the
  optimizer-state fields this rank holds a range of (AdamW's ``exp_avg``, ``exp_avg_sq``;
  SGD's ``momentum_buffer``), ``local_1d`` a 1-D view of the host store holding elements
  ``[lo, hi)`` of the flattened field (``lo == hi`` or a missing name: none); loading writes
  into these views; an optimizer the runtime replicates (Adafactor) has none: its
  states are whole on every rank, in ``cm.optimizer.state`` (saved once, as the weights);
- optionally ``dp.states_loaded()``: called after a load wrote into the pieces (SGD then
  counts its momentum buffers as past the first step);
- ``dp.group`` (the gloo ProcessGroup), ``dp.rank`` (this rank in it), ``dp.ranks`` (its size);
- ``dp.refresh_masters()``: called after a load has written the weights into the model's
  parameters (the whole image on every rank), so the runtime sets its master shards from them;
- optionally ``dp.master_pieces() -> {param name: (global_shape, lo, hi, local_1d)}``: mixed
  precision (bf16), where the model's trainable parameters are the 16-bit working copy and the
  fp32 master weights are sharded like the states: they are saved as ``model.<name>`` (fp32,
  boxes of the global tensor, as the states; every name the parameter has in the state dict,
  a tied one's too), so the checkpoint is a one-process bf16 checkpoint's (fp32 weights), and a
  load reads them into the shards, after which ``dp.refresh_masters()`` recasts the image;
- every other optimizer field (``step``: the same on every rank) is in ``cm.optimizer.state``
  as without data parallel, as views that a load writes into in place.

Saving with a process group is atomic as :func:`shfx.checkpoint.save` is: rank 0 makes the
new directory and tells the others its name, every rank writes its shards through DCP (an
error on any rank reaches every rank), rank 0 writes ``shfx_state.pt`` and switches the link,
and every rank returns only once the link is switched (or with rank 0's error). A rank that
fails or dies before the switch leaves the last good checkpoint. With ``async_save=True``
every rank snapshots its pieces first and the write, the state file and the switch run in a
background thread on a gloo group of their own (:func:`save`).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import checkpoint_format as _fmt
from .errors import UsageError

__all__ = ["flat_range_boxes", "sharded_state", "save", "load"]

Box = tuple[tuple[int, ...], tuple[int, ...], int]
# {param name: {field: (global_shape, lo, hi, local 1-D tensor)}}
Pieces = dict[str, dict[str, tuple[Sequence[int], int, int, torch.Tensor]]]


# ---- ranges of a flattened tensor as boxes ------------------------------------------------------------
def flat_range_boxes(shape: Sequence[int], lo: int, hi: int) -> list[Box]:
    """The flattened (row-major) range ``[lo, hi)`` of a tensor of ``shape`` as rectangular
    boxes ``(offsets, sizes, start)`` in order, ``start`` the position of the box's first
    element within ``[lo, hi)``. Each box is contiguous in memory (sizes ``(1, .., 1, n,
    full, .., full)``) and there are as few as the row-major decomposition allows: a partial
    leading row (cut again one dimension down), the whole rows, a partial trailing row;
    at most ``2 * len(shape) - 1``. An empty range has none.

    >>> flat_range_boxes((2, 3, 4), 4, 24)
    [((0, 1, 0), (1, 2, 4), 0), ((1, 0, 0), (1, 3, 4), 8)]
    >>> flat_range_boxes((3, 4), 2, 7)
    [((0, 2), (1, 2), 0), ((1, 0), (1, 3), 2)]
    """
    shape = tuple(int(d) for d in shape)
    numel = math.prod(shape)
    if not 0 <= lo <= hi <= numel:
        raise UsageError(f"the range [{lo}, {hi}) is not within a tensor of shape {shape} ({numel} elements); pass 0 <= lo <= hi <= numel")
    out: list[Box] = []
    _boxes(shape, lo, hi, (), lo, out)
    return out


def _boxes(shape: tuple[int, ...], lo: int, hi: int, prefix: tuple[int, ...], base: int, out: list[Box]) -> None:
    """Append the boxes of ``[lo, hi)`` (flat, within the sub-tensor ``shape`` at index
    ``prefix``); ``base`` is the flat position of the whole range's first element relative to
    this sub-tensor's first element."""
    if lo >= hi:
        return
    ones = (1,) * len(prefix)
    if not shape:  # a 0-d tensor (or one element of the last dimension's parent): [0, 1)
        out.append((prefix, ones, lo - base))
        return
    row = math.prod(shape[1:])  # elements per index of the first dimension
    first, last = lo // row, hi // row  # the rows [lo, hi) starts in, and ends before or in
    if len(shape) == 1 or (lo % row == 0 and hi % row == 0):  # whole rows (or a 1-d run)
        out.append((prefix + (first,) + (0,) * (len(shape) - 1), ones + (last - first,) + shape[1:], lo - base))
        return
    if lo % row:  # a partial leading row
        end = min(hi, (first + 1) * row)
        _boxes(shape[1:], lo - first * row, end - first * row, prefix + (first,), base - first * row, out)
        lo, first = end, first + 1
    if first < last:  # whole rows
        out.append((prefix + (first,) + (0,) * (len(shape) - 1), ones + (last - first,) + shape[1:], lo - base))
        lo = last * row
    if lo < hi:  # a partial trailing row
        _boxes(shape[1:], 0, hi - last * row, prefix + (last,), base - last * row, out)


# ---- pieces as ShardedTensors -------------------------------------------------------------------------
def _flat_pieces(pieces: Pieces) -> dict[tuple[str, str], tuple[tuple[int, ...], int, int, torch.Tensor]]:
    out = {}
    for name, fields in pieces.items():
        for field, (shape, lo, hi, local) in fields.items():
            shape = tuple(int(d) for d in shape)
            lo, hi = int(lo), int(hi)
            if local.dim() != 1 or local.numel() != hi - lo or not local.is_contiguous() or local.device.type != "cpu":
                raise UsageError(
                    f"the data-parallel state piece {name}.{field} must be a contiguous 1-D CPU tensor of hi - lo = "
                    f"{hi - lo} elements (range [{lo}, {hi}) of shape {shape}), got shape {tuple(local.shape)} on "
                    f"{local.device}; the runtime's state_pieces() must return views of its host shard"
                )
            if not 0 <= lo <= hi <= math.prod(shape):
                raise UsageError(f"the data-parallel state piece {name}.{field} has range [{lo}, {hi}), outside shape {shape}")
            out[(name, field)] = (shape, lo, hi, local)
    return out


def sharded_state(pieces: Pieces, group: Any, error: str | None = None) -> dict[str, dict[str, Any]]:
    """``{param name: {field: ShardedTensor}}`` of every rank's ``pieces`` (a collective on
    ``group``: every rank calls it): each tensor has the field's global shape, and this rank's
    local shards are views of its 1-D pieces cut into :func:`flat_range_boxes`. The keys are
    the union over the ranks (a rank without a piece of a key has no local shard of it); the
    ranges of every key must tile it exactly (checked, naming the ranks). ``error``: this
    rank's reason to refuse (a check that failed before), raised on every rank."""
    import torch.distributed as dist
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    # NOTE: torch warns (FutureWarning) on every use of a ShardedTensor, DCP's own included, that
    # it is deprecated for DTensor, which cannot express these ranges (module docstring): that one
    # message is filtered, once, as shfx.checkpoint filters DCP's single-process notice
    warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating ShardedTensor", category=FutureWarning)
    mine: dict = {}
    if error is None:
        try:
            mine = _flat_pieces(pieces)
        except UsageError as e:
            error = str(e)
    ranks = dist.get_process_group_ranks(group)  # group rank -> global rank (ShardMetadata's placement)
    desc = {k: (shape, lo, hi, local.dtype) for k, (shape, lo, hi, local) in mine.items()}
    gathered: list[Any] = [None] * len(ranks)
    # NOTE: a rank's own error travels with its pieces, so every rank raises instead of the
    # others waiting in this collective for a rank that has given up
    dist.all_gather_object(gathered, (error, desc), group=group)
    failed = [(r, e) for r, (e, _) in enumerate(gathered) if e is not None]
    if failed:
        r, e = failed[0]
        raise UsageError(e if r == dist.get_rank(group) else f"rank {r} refused the checkpoint: {e}")
    everyone = [d for _, d in gathered]
    me = dist.get_rank()
    out: dict[str, dict[str, Any]] = {}
    for key in sorted(set().union(*everyone)):
        held = sorted((d[key][1], d[key][2], r, d[key][0], d[key][3]) for r, d in enumerate(everyone) if key in d)
        shape, dtype = held[0][3], held[0][4]
        _check_tiling(key, shape, dtype, held)
        shards_md, local_shards = [], []
        for lo, hi, r, _, _ in held:
            for offsets, sizes, start in flat_range_boxes(shape, lo, hi):
                md = ShardMetadata(shard_offsets=list(offsets), shard_sizes=list(sizes), placement=f"rank:{ranks[r]}/cpu")
                shards_md.append(md)
                if ranks[r] == me:
                    n = math.prod(sizes)
                    local_shards.append(Shard(mine[key][3][start : start + n].view(sizes), md))
        props = TensorProperties(
            dtype=dtype, layout=torch.strided, requires_grad=False, memory_format=torch.contiguous_format, pin_memory=False
        )
        st_md = ShardedTensorMetadata(shards_metadata=shards_md, size=torch.Size(shape), tensor_properties=props)
        out.setdefault(key[0], {})[key[1]] = ShardedTensor._init_from_local_shards_and_global_metadata(
            local_shards, st_md, process_group=group
        )
    return out


def _check_tiling(key: tuple[str, str], shape: tuple[int, ...], dtype: torch.dtype, held: list) -> None:
    name = f"{key[0]}.{key[1]}"
    for _, _, r, s, d in held:
        if s != shape or d != dtype:
            raise UsageError(
                f"rank {held[0][2]} holds {name} as {shape} {dtype}, rank {r} as {s} {d}; every rank must describe a "
                "field with its global shape and dtype"
            )
    at = 0
    for lo, hi, r, _, _ in held:
        if lo == hi:
            continue
        if lo != at:
            what = "overlaps" if lo < at else "leaves a gap before"
            raise UsageError(
                f"the ranks' ranges of {name} (shape {shape}) do not tile it: rank {r}'s [{lo}, {hi}) {what} element {at} "
                f"(ranges by rank: {[(x[2], x[0], x[1]) for x in held]}); each element must be held by exactly one rank"
            )
        at = hi
    if at != math.prod(shape):
        raise UsageError(
            f"the ranks' ranges of {name} (shape {shape}) end at element {at} of {math.prod(shape)} (ranges by rank: "
            f"{[(x[2], x[0], x[1]) for x in held]}); each element must be held by exactly one rank"
        )


# ---- the fp32 masters of mixed precision -------------------------------------------------------------
MASTER = "<fp32 master>"
"""The field the fp32 master weights' pieces travel under through :func:`sharded_state` (saved
as ``model.<name>``, never as an optimizer field)."""


def _with_masters(dp: Any, pieces: Pieces) -> Pieces:
    """``pieces`` plus, where the runtime shards the fp32 masters (``dp.master_pieces()``, bf16),
    each parameter's master range under :data:`MASTER`."""
    get = getattr(dp, "master_pieces", None)
    masters = get() if get is not None else {}
    if not masters:
        return pieces
    out = {k: dict(v) for k, v in pieces.items()}
    for name, piece in masters.items():
        out.setdefault(name, {})[MASTER] = piece
    return out


def _master_targets(cm: Any, sharded: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Take the :data:`MASTER` fields out of ``sharded`` (in place) and return them by every
    state-dict name of their parameter (a tied parameter has several): what ``model.<name>``
    is saved from and loaded into."""
    by_key = {}
    for name in list(sharded):
        st = sharded[name].pop(MASTER, None)
        if st is not None:
            by_key[name] = st
        if not sharded[name]:
            del sharded[name]
    if not by_key:
        return {}
    store = cm._store
    at = {store.tensors[k].data_ptr(): k for k in by_key}
    out = {}
    for n, p in cm.module.named_parameters(remove_duplicate=False):
        k = at.get(p.data_ptr()) if p.numel() else None
        if k is not None:
            out[n] = by_key[k]
    return out


# ---- atomic save with a process group ------------------------------------------------------------------
def _root(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_process_group_ranks(group)[0]


def _checkpoint_group(dp: Any) -> Any:
    """A gloo group over ``dp.group``'s ranks for the saves that run in a background thread
    (``async_save=True``), made at the first one (every rank calls the save: collective) and
    kept on ``dp``: a save's collectives then never interleave with the user's on ``dp.group``
    (their own DDP, a barrier) or the runtime's on its queues' groups while training goes on."""
    group = getattr(dp, "_checkpoint_group", None)
    if group is None:
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=float(getattr(dp, "timeout_s", 600.0)))
        members = dist.get_process_group_ranks(dp.group)
        group = dist.new_group(members, backend="gloo", timeout=timeout, use_local_synchronization=True)
        dp._checkpoint_group = group
    return group


def _snapshot(obj: Any, staging: dict[str, torch.Tensor], key: str) -> Any:
    """A copy of ``obj`` (a tensor, or nested dicts of tensors and other values) whose tensors
    are host buffers kept in ``staging`` under ``key`` (reused by the next asynchronous save
    when the shape and dtype match); other values as they are."""
    if isinstance(obj, dict):
        return {k: _snapshot(v, staging, f"{key}.{k}") for k, v in obj.items()}
    if not torch.is_tensor(obj):
        return obj
    buf = staging.get(key)
    if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
        buf = staging[key] = torch.empty(obj.shape, dtype=obj.dtype)
    return buf.copy_(obj.detach())


def _atomic_write_group(path: str, write: Callable[[str], None], finish: Callable[[str], None], group: Any, rank: int) -> None:
    """:func:`shfx.checkpoint._atomic_write` across the ranks of ``group``: rank 0 makes the new
    directory, every rank runs ``write(directory)`` (collective: DCP), rank 0 runs
    ``finish(directory)`` and switches the link; every rank returns after the switch or raises."""
    import torch.distributed as dist

    path = os.path.abspath(path)
    parent, prefix = _fmt._prefix(path)
    box: list[Any] = [None]
    error: BaseException | None = None
    if rank == 0:
        try:
            os.makedirs(parent, exist_ok=True)
            _fmt._check_target(path)
            token = f"{time.time_ns():x}-{os.getpid()}-{threading.get_ident():x}"
            real = os.path.join(parent, prefix + token)
            os.mkdir(real)
            box[0] = ("ok", real)
        except BaseException as e:
            error, box[0] = e, ("error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=_root(group), group=group)
    if error is not None:
        raise error
    status, real = box[0]
    if status != "ok":
        raise RuntimeError(f"rank 0 could not start the checkpoint at {path!r}: {real}")
    try:
        write(real)  # DCP: an exception on one rank is raised on every rank
    except BaseException:
        if rank == 0:
            shutil.rmtree(real, ignore_errors=True)
        raise
    if rank == 0:
        try:
            finish(real)
            _fmt._fsync_dir(real)
            _fmt._test_kill_point("switch")
            link = os.path.join(parent, prefix + "link-" + os.path.basename(real)[len(prefix) :])
            os.symlink(os.path.basename(real), link)
            os.replace(link, path)
            _fmt._fsync_dir(parent)
            box[0] = ("ok", "")
        except BaseException as e:
            shutil.rmtree(real, ignore_errors=True)
            error, box[0] = e, ("error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=_root(group), group=group)
    if error is not None:
        raise error
    if box[0][0] != "ok":
        raise RuntimeError(f"rank 0 could not finish the checkpoint at {path!r}: {box[0][1]}; the last checkpoint there is kept")
    if rank == 0:  # the previous checkpoint, and leftovers of saves that failed: no longer reachable
        _fmt._remove_leftovers(parent, prefix, real)


# ---- save and load of a compiled model under data parallel ---------------------------------------------
@contextlib.contextmanager
def _failures_named(what: str, after: str):
    """Re-raise DCP's ``CheckpointException`` (a BaseException, raised on every rank when one
    rank's part failed) as a RuntimeError naming the ranks and their errors."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        causes = "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, (x, _) in sorted(e.failures.items()))
        raise RuntimeError(f"{what} failed on rank(s) {sorted(e.failures)} ({causes}); {after}") from e


def _rng_by_rank(group: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, _fmt.rng_state(), group=group)
    return out


def save(cm, path: str, *, extra: Any = None, scheduler: Any = None, async_save: bool = False) -> Any:
    """:func:`shfx.checkpoint.save` of a compiled model under data parallel (every rank calls
    it): the weights (replicated: written once), each rank's ranges of the optimizer states as
    boxes of their global tensors, the other optimizer fields (``step``) and ``shfx_state.pt``
    (rank 0's RNG states as ``rng``, every rank's as ``rng_by_rank``).

    ``async_save=True``: every rank first takes a snapshot of what it writes (its pieces, the
    weights it offers, ``step``; copied into host buffers kept in ``cm._checkpoint_staging`` for
    the next asynchronous save) and agrees the pieces' layout with the others (the collective
    of :func:`sharded_state`, on ``dp.group``, in the caller's thread as a synchronous save
    does); then DCP's write and the atomic switch run in a background thread on a gloo group of
    their own (:func:`_checkpoint_group`), and training goes on. Returns the
    :class:`shfx.checkpoint.AsyncSave` (``cm.wait_checkpoint()``, the next save or load and
    ``cm.close()`` wait for it, and raise its error on the rank it reached: every rank, for a
    failure DCP or rank 0 reports)."""
    import torch.distributed.checkpoint as dcp

    dp = cm._engine.dp
    error, pieces = None, {}
    try:
        model_sd = cm.state_dict()  # settles the step
        pieces = _with_masters(dp, dp.state_pieces())
        state, groups = _fmt._optimizer_state(cm.module.named_parameters(), cm.optimizer)
    except UsageError as e:
        error = str(e)
    staging = cm._checkpoint_staging if async_save else {}
    if async_save and error is None:  # the pieces' snapshot: the ShardedTensors' shards are views of it
        pieces = {n: {f: (shape, lo, hi, _snapshot(t, staging, f"piece.{n}.{f}")) for f, (shape, lo, hi, t) in fs.items()}
                  for n, fs in pieces.items()}  # fmt: skip
    sharded = sharded_state(pieces, dp.group, error)
    masters = _master_targets(cm, sharded)
    if async_save:  # (bf16: the weights a master replaces are not copied)
        state = _snapshot(state, staging, "optimizer.state")
        model_sd = {k: v if k in masters else _snapshot(v, staging, f"model.{k}") for k, v in model_sd.items()}
    for name, fields in sharded.items():  # the ranges replace what cm.optimizer.state may show of them
        state.setdefault(name, {}).update(fields)
    steps = max((int(e["step"]) for e in state.values() if "step" in e and torch.is_tensor(e["step"]) and e["step"].dim() == 0), default=0)
    # (bf16: the sharded fp32 masters, not the 16-bit working copy the model's parameters are)
    tensors: dict[str, Any] = {"model": {k: masters.get(k, v.detach().cpu()) for k, v in model_sd.items()}}
    if state:
        tensors["optimizer"] = {"state": state}
    meta = _fmt._meta(steps, groups, scheduler, cm.scaler, extra, cm.skipped_steps)
    meta["ranks"] = int(dp.ranks)
    meta["rng_by_rank"] = _rng_by_rank(dp.group)
    group = _checkpoint_group(dp) if async_save else dp.group

    def write(d: str) -> None:
        with _failures_named(f"writing the checkpoint {os.path.abspath(path)!r}", "the last checkpoint there is kept"):
            dcp.save(tensors, storage_writer=_fmt._writer(d), process_group=group)

    def finish(d: str) -> None:
        with open(os.path.join(d, _fmt.STATE_FILE), "wb") as f:
            torch.save(meta, f)
            f.flush()
            os.fsync(f.fileno())

    if async_save:
        return _fmt.AsyncSave(os.path.abspath(path), job=lambda: _atomic_write_group(path, write, finish, group, int(dp.rank)))
    _atomic_write_group(path, write, finish, group, int(dp.rank))
    return None


def load(cm, path: str, *, scheduler: Any = None, strict: bool = True, restore_rng: bool = True) -> Any:
    """:func:`shfx.checkpoint.load` into a compiled model under data parallel (every rank calls
    it; the checkpoint may come from any number of ranks, or one process): the weights whole
    on every rank, this rank's ranges of the optimizer states read in place into
    ``dp.state_pieces()``, the other fields (``step``) in place into ``cm.optimizer.state``,
    the hyperparameters into ``cm.optimizer.param_groups``. Every check runs before anything
    is written (the ranges' tiling is checked by every rank alike)."""
    import torch.distributed.checkpoint as dcp

    dp = cm._engine.dp
    path = os.path.abspath(path)
    error, pieces = None, {}
    try:
        md, meta = _fmt._read_meta(path)
        cm._settle()
        _fmt._check_common(meta, path, scheduler)
        targets = _fmt._model_targets(path, md, cm.module.state_dict(), strict)
        # (a load after the first call but before the first step: the states are made, zeros at
        # step 0, for the checkpoint's to be read into, when it has any)
        # (md: DCP's metadata by flattened key, _fmt._read_meta's)
        has_state = any(k.startswith("optimizer.state.") for k in md)
        pieces = _with_masters(dp, dp.state_pieces(create=True) if has_state else dp.state_pieces())
    except (UsageError, FileNotFoundError) as e:
        error = str(e)
    sharded = sharded_state(pieces, dp.group, error)
    for name, t in _master_targets(cm, sharded).items():  # bf16: the fp32 weights into the master shards
        if name in targets:
            targets[name] = t
    named = dict(cm.module.named_parameters())
    pre = "optimizer.state."
    saved: dict[str, dict[str, Any]] = {}
    for k, m in md.items():
        if k.startswith(pre):
            name, _, field = k[len(pre) :].rpartition(".")
            saved.setdefault(name, {})[field] = m
    unknown = sorted(set(saved) - set(named))
    if unknown:
        raise UsageError(
            f"the checkpoint has optimizer state for {unknown[0]!r} ({len(unknown)} such), which is not a parameter of "
            "this model; load a checkpoint of this model"
        )
    live = cm.optimizer.state if cm.optimizer is not None else {}
    scalars: dict[str, dict[str, torch.Tensor]] = {}  # fields outside the pieces: read whole, copied in place
    for name, fields in sorted(saved.items()):
        for field, m in fields.items():
            if field in sharded.get(name, {}):
                st = sharded[name][field]
                here = st.metadata()
                if tuple(m.size) != tuple(here.size) or m.properties.dtype != here.tensor_properties.dtype:
                    raise UsageError(
                        f"optimizer state {name}.{field} is {tuple(m.size)} {m.properties.dtype} in the checkpoint and "
                        f"{tuple(here.size)} {here.tensor_properties.dtype} here; load a checkpoint of this model and optimizer"
                    )
                continue
            held = live.get(named[name], {}).get(field)
            if held is None:
                raise UsageError(
                    f"the checkpoint has optimizer state {name}.{field}, which this data-parallel model holds neither in "
                    "its shards (dp.state_pieces()) nor in cm.optimizer.state: either the checkpoint comes from another "
                    "optimizer configuration (amsgrad's max_exp_avg_sq, say; load it into the same one), or no step "
                    "has run since the first call (load the checkpoint before the first call, right after "
                    "shfx.compile, or after a step)"
                )
            if tuple(m.size) != tuple(held.shape):
                raise UsageError(f"optimizer state {name}.{field} is {tuple(m.size)} in the checkpoint and {tuple(held.shape)} here")
            scalars.setdefault(name, {})[field] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    missing = sorted(f"{n}.{f}" for n, fs in sharded.items() for f in fs if f not in saved.get(n, {}))
    if missing:
        raise UsageError(
            f"the checkpoint at {path!r} has no optimizer state {missing[0]} ({len(missing)} such) that this "
            "data-parallel model holds; load a checkpoint saved after the optimizer's first step, with the same optimizer"
        )
    hps = _fmt._group_hyperparams(path, meta, cm.module.named_parameters(), cm.optimizer) if cm.optimizer is not None else []
    # every check is done: read
    want: dict[str, Any] = {k: v for k, v in sharded.items()}
    for name, fields in scalars.items():
        want.setdefault(name, {}).update(fields)
    if want:
        with _failures_named(f"reading the optimizer state of {path!r}", "the model's weights are unchanged"):
            dcp.load({"optimizer": {"state": want}}, storage_reader=_fmt._reader(path), process_group=dp.group)
        getattr(dp, "states_loaded", lambda: None)()
    with torch.no_grad():
        for name, fields in scalars.items():
            for field, t in fields.items():
                live_t = live[named[name]][field]
                live_t.copy_(t.to(live_t.dtype))
    if targets:
        with torch.no_grad():
            with _failures_named(f"reading the weights of {path!r}", "the optimizer state is loaded"):
                dcp.load({"model": targets}, storage_reader=_fmt._reader(path), process_group=dp.group)
    for g, h in zip(cm.optimizer.param_groups if cm.optimizer is not None else [], hps):
        g.update({k: tuple(v) if isinstance(v, list) else v for k, v in h.items()})
    dp.refresh_masters()
    cm._engine.invalidate_device_weights()
    cm._engine.skipped_steps = meta["skipped_steps"]
    rng = meta.get("rng_by_rank")
    if restore_rng and rng is not None and len(rng) == int(dp.ranks):
        meta = {**meta, "rng": rng[int(dp.rank)]}
    _fmt._load_common(meta, path, scheduler, cm.scaler, restore_rng)
    return meta["extra"]
