"""The host optimizers: AdamW (:class:`HostAdamW`), SGD (:class:`HostSGD`) and Adafactor
(:class:`HostAdafactor`) over a group's flat fp32 buffers, one fused call per (group, parameter
group of the bound :class:`shfx.optim.HostOptimizer`: :func:`_layout`), each parameter group
with its own hyperparameters from the snapshot the engine takes when it issues the update.
:func:`runner_for` picks the runner; each exposes per-group ``state`` objects whose
``tensors()`` the step journal saves, and the per-parameter state ``cm.optimizer.state`` shows.
The rest of this docstring is about AdamW.

One call updates a whole group with ``torch._fused_adamw_``, the kernel
``torch.optim.AdamW(fused=True)`` uses, over views of the group's flat master, gradient and
state buffers: one per parameter, or one per run of adjacent parameters where that is bitwise
the same (below). Updates of different groups run on the backend's ``cpu`` stream
(a thread pool) as soon as their gradients land.

NOTE: per-parameter views, not one flat tensor: the fused kernel's vector body and scalar
tail round differently (FMA), so an element's result depends on its position within its
tensor. Views make every element land where it would in ``torch.optim.AdamW(fused=True)``,
so results are bitwise equal to it (and within an ulp of the default for-loop AdamW).

Adjacent parameters are merged into one view where that cannot change a result: the kernel
splits a tensor into chunks of whole cache lines (:data:`_UNIT` = 16 fp32 elements), runs its
vector body over each chunk and the scalar path only over the last ``numel % vec`` elements of
the tensor (``vec`` = 4, 8 or 16 fp32 lanes, a divisor of 16). A parameter whose ``numel`` is a multiple
of 16 has no scalar tail, and if the next parameter starts right after it (no padding, which
:data:`shfx.passes.layout.ALIGN` = 64 bytes guarantees for such sizes) the next one keeps its
position modulo 16 inside the merged view: every element takes the same path, bitwise. Typical
transformer groups (hidden sizes multiple of 16) become a single view, so a group update is one
kernel call and one OpenMP parallel region instead of one per parameter: less per-call cost,
and far fewer fork/join barriers, which is what hurts when the cores are shared (compute
stream, other optimizer workers, other processes). ``tests/test_host_optim.py`` checks merged
against per-parameter views and against ``torch.optim.AdamW(fused=True)`` bitwise, so a torch
that chunks differently fails there.

Mixed precision: with a 16-bit working copy of the weights (bf16/fp16 image of the group, fp32
master), the copy is written in the same pass as the update (:func:`fused_adamw_with_copy`):
the views are cut into pieces of whole :data:`_UNIT` runs (a view's last piece keeps its tail),
so every element keeps its position modulo 16 inside its view and takes the same vector or
scalar path as in one call per view, and the kernel runs over about :data:`CHUNK` elements at a
time, each batch's fresh master cast into its working view while it is still in the cache:
no second pass over the master from DRAM. Results are bitwise those of
``torch.optim.AdamW(fused=True).step()`` followed by ``p16.copy_(p32)``.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from typing import Any

import torch

from .host_store import HostStore

__all__ = ["HostAdamW", "HostSGD", "HostAdafactor", "runner_for", "fused_adamw_with_copy", "CHUNK"]

# fp32 elements per cache line: the kernel's parallel chunks are whole multiples of it, and
# every vector width it uses (8 or 16 fp32 lanes) divides it
_UNIT = 16


# elements the update with a working copy runs the kernel over at a time (a batch of pieces of
# views) before casting them into the working copy: master, gradient, m and v of a batch (16 B
# per element, 16 MiB) stay in the last-level cache (32 MiB here) between the two. Measured
# with ``benchmarks/host_adam.py --only-copy`` on the 2-core VM (benchmarks/README.md): 128K
# loses to a separate cast pass at 2 threads (two OpenMP fork/joins per batch), 256K-4M are
# within the run-to-run noise of each other; 1M halves the fork/joins of 512K, which counts
# when other work shares the cores (each fork/join can then wait for a time slice).
CHUNK = 1 << 20


def _spans(
    offsets_numels: list[tuple[int, int]], merge: bool = True, boundaries: Collection[int] = ()
) -> list[tuple[int, int]]:
    """``(offset, numel)`` (in elements) of the views one update covers, in buffer order.

    With ``merge``, a parameter is appended to the previous view when that view ends exactly
    where the parameter starts and its length is a multiple of :data:`_UNIT`; results are then
    bitwise those of one view per parameter (see the module docstring). A parameter that
    starts at one of ``boundaries`` (element offsets where a new part of the trainable region
    begins, ``Group.part_starts``: the working dtype may change there) always starts a view."""
    out: list[tuple[int, int]] = []
    for off, n in sorted(offsets_numels):
        if n == 0:
            continue
        if (
            merge
            and out
            and off not in boundaries
            and out[-1][1] % _UNIT == 0
            and out[-1][0] + out[-1][1] == off
        ):
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return out


def _clip(spans: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """``(offset, numel)`` spans cut to the elements in ``[lo, hi)`` (a data-parallel shard,
    :func:`shfx.passes.sharding.shard_range`: its bounds are multiples of 16 elements from
    every parameter's start, so each piece keeps its elements' positions modulo 16 and the
    update stays bitwise the one over whole parameters)."""
    out = []
    for o, n in spans:
        a, b = max(o, lo), min(o + n, hi)
        if a < b:
            out.append((a, b - a))
    return out


def _kernel(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    hp: dict,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """One ``torch._fused_adamw_`` call (reads ``steps``, never increments them)."""
    torch._fused_adamw_(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
        lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"], weight_decay=hp["weight_decay"], eps=hp["eps"],
        amsgrad=hp["amsgrad"], maximize=hp["maximize"], grad_scale=grad_scale, found_inf=found_inf,
    )  # fmt: skip



def check_state_entries(entries: list, names: Sequence[str]) -> None:
    """Raise ``ValueError`` naming the first state ``names`` of torch-format per-parameter
    states ``[((g, off, n, shape), {name: tensor})]`` that is missing or not of its parameter's
    shape (the tensors may be meta placeholders: only shapes are read)."""
    for (_, off, n, shape), e in entries:
        for name in names:
            src = e.get(name)
            if src is None or tuple(src.shape) != tuple(shape):
                raise ValueError(
                    f"state {name!r} of a parameter of shape {tuple(shape)} is "
                    f"{'missing' if src is None else tuple(src.shape)} in the state dict"
                )


def copy_state_entries(entries: list, dst: dict[str, torch.Tensor | None], shard: tuple[int, int] | None = None) -> None:
    """Copy torch-format per-parameter states ``[((g, off, n, shape), {name: tensor})]`` into
    flat buffers ``dst`` (``{"exp_avg": m, "exp_avg_sq": v}``; a None buffer is skipped), each
    parameter's at its offset; a missing or misshapen state raises ``ValueError`` naming it
    (:func:`check_state_entries`, before anything is copied). ``shard``: the buffers hold only
    elements ``[lo, hi)`` of the group (data parallel): each parameter's part inside it is copied."""
    check_state_entries(entries, [name for name, buf in dst.items() if buf is not None])
    for (_, off, n, shape), e in entries:
        for name, buf in dst.items():
            if buf is None:
                continue
            src = e[name]
            if shard is None:
                buf[off : off + n].view(shape).copy_(src)
                continue
            lo, hi = shard
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                buf[a - lo : b - lo].copy_(src.reshape(-1)[a - off : b - off])

class _Batch:
    """One kernel call over pieces of views, then the cast of their masters into the working
    pieces (``dst``/``src``: the pieces that have a working copy)."""

    __slots__ = ("lists", "dst", "src")

    def __init__(self, n_lists: int):
        self.lists: list[list[torch.Tensor]] = [[] for _ in range(n_lists)]
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []


def _plan(
    bufs: list[list[torch.Tensor]],
    steps: list[torch.Tensor],
    working: Sequence[torch.Tensor | None],
    chunk: int,
) -> list[_Batch]:
    """Batches of pieces for :func:`_run`. ``bufs``: the per-view lists the kernel takes
    (params, grads, exp_avgs, exp_avg_sqs[, max_exp_avg_sqs]), ``steps`` one per view.

    Views with a working copy are cut into pieces of a multiple of :data:`_UNIT` elements (a
    view's last piece takes the rest: its tail stays its tail), gathered into batches of at
    most ``chunk`` elements. Views without one (None) go whole into one batch of their own."""
    if chunk < _UNIT:
        raise ValueError(f"chunk must be at least {_UNIT} elements, got {chunk}")
    k = len(bufs)
    batches: list[_Batch] = []
    plain = _Batch(k + 1)
    cur, fill = _Batch(k + 1), 0

    def flush() -> None:
        nonlocal cur, fill
        if cur.lists[0]:
            batches.append(cur)
        cur, fill = _Batch(k + 1), 0

    for i, w in enumerate(working):
        n = bufs[0][i].numel()
        if n == 0:
            continue
        if w is None:
            for j in range(k):
                plain.lists[j].append(bufs[j][i])
            plain.lists[k].append(steps[i])
            continue
        o = 0
        while o < n:
            take = n - o
            room = chunk - fill
            if take > room:
                take = room // _UNIT * _UNIT
                if take == 0:
                    flush()
                    continue
            for j in range(k):
                cur.lists[j].append(bufs[j][i][o : o + take])
            cur.lists[k].append(steps[i])
            cur.src.append(cur.lists[0][-1])
            cur.dst.append(w[o : o + take])
            o += take
            fill += take
            if chunk - fill < _UNIT:
                flush()
    flush()
    if plain.lists[0]:
        batches.insert(0, plain)
    return batches


def _run(
    batches: list[_Batch], hp: dict, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None
) -> None:
    amsgrad = hp["amsgrad"]
    for b in batches:
        ls = b.lists
        _kernel(ls[0], ls[1], ls[2], ls[3], ls[4] if amsgrad else [], ls[-1], hp, grad_scale, found_inf)
        if len(b.dst) == 1:
            b.dst[0].copy_(b.src[0])
        elif b.dst:
            torch._foreach_copy_(b.dst, b.src)


def fused_adamw_with_copy(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    hp: dict,
    working: Sequence[torch.Tensor | None] | None = None,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    chunk: int = CHUNK,
    *,
    max_exp_avg_sqs: list[torch.Tensor] | None = None,
) -> None:
    """AdamW (``torch._fused_adamw_``, as ``torch.optim.AdamW(fused=True)``) over 1-D fp32
    views, and with ``working`` the refresh of a working copy of the weights in the same pass.

    ``steps``: each view's 0-dim fp32 step tensor (one tensor repeated is fine), which the
    caller increments once per update before this call; it is only read here, however many
    kernel calls the update takes. ``hp``: :meth:`shfx.optim.AdamW.hyperparams`;
    ``max_exp_avg_sqs`` is needed with ``hp["amsgrad"]``. ``grad_scale`` / ``found_inf``:
    0-dim fp32 tensors passed to the kernel as ``torch.amp.GradScaler`` does for fused
    optimizers (it divides the gradients by ``grad_scale`` in place and changes nothing when
    ``found_inf`` is 1; undoing the step increment then is the caller's job).

    ``working``: per view, a 1-D view of the same length (bf16, fp16, or fp32: a plain copy),
    or None for a view without one. Each ends up equal to ``params[i].to(working[i].dtype)``
    after the update (bitwise what ``p16.copy_(p32)`` after ``torch.optim.AdamW(fused=True)
    .step()`` gives; also when ``found_inf`` skips the update). The kernel runs over batches
    of about ``chunk`` elements and each batch's master is cast while it is in the cache
    (see the module docstring). Without ``working`` (or all None): one kernel call."""
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(steps) == n):
        raise ValueError("params, grads, exp_avgs, exp_avg_sqs and steps must have the same length")
    bufs = [list(params), list(grads), list(exp_avgs), list(exp_avg_sqs)]
    if hp["amsgrad"]:
        if max_exp_avg_sqs is None or len(max_exp_avg_sqs) != n:
            raise ValueError("amsgrad needs max_exp_avg_sqs, one per param")
        bufs.append(list(max_exp_avg_sqs))
    if working is None or all(w is None for w in working):
        _kernel(*bufs[:4], bufs[4] if hp["amsgrad"] else [], list(steps), hp, grad_scale, found_inf)
        return
    if len(working) != n:
        raise ValueError(f"working has {len(working)} views for {n} params")
    for p, w in zip(params, working):
        if w is not None and (w.dim() != 1 or p.dim() != 1 or w.numel() != p.numel()):
            raise ValueError(f"working view of shape {tuple(w.shape)} for a param view of shape {tuple(p.shape)}")
    _run(_plan(bufs, list(steps), working, chunk), hp, grad_scale, found_inf)


def _boundaries(grp) -> frozenset[int]:
    """Element offsets where a new part of the group's trainable region begins (the working
    dtype may change there): never merged across."""
    return frozenset(getattr(grp, "part_starts", ()))


def _layout(config, grp) -> list[tuple[int, list[tuple[int, int]]]]:
    """``[(param group index, [(element offset, numel)])]`` of group ``grp``'s trainable
    parameters: the bound optimizer's parameter groups, or one group over all of them."""
    lay = config.layout(grp.index) if hasattr(config, "layout") else None
    return [(0, grp.trainable_spans())] if lay is None else lay


def _hp_of(hp: dict | Sequence[dict], k: int) -> dict:
    """Parameter group ``k``'s hyperparameters from a snapshot (one dict: every group)."""
    return hp if isinstance(hp, dict) else hp[k]


class _State:
    """Flat fp32 states of one group, and the views (per parameter, or merged runs of
    parameters of one parameter group, see :func:`_spans`) of every flat buffer an update
    covers, per parameter group (``pgs``: ``(index, views, batches)``); with a working copy
    (``store.working_view``), its views and each parameter group's batches (:func:`_plan`)."""

    __slots__ = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "views", "working", "pgs")

    def __init__(
        self, store: HostStore, g: int, amsgrad: bool, merge: bool = True, chunk: int = CHUNK, layout=None,
        *, step: torch.Tensor | None = None, exp_avg: torch.Tensor | None = None, exp_avg_sq: torch.Tensor | None = None,
        bare: bool = False,
    ):  # fmt: skip
        # step / exp_avg / exp_avg_sq: the NVMe tier's host-window buffers (views of a staging
        # buffer, shfx.runtime.ssd_window) instead of buffers of the state's own
        grp = store.groups[g]
        # data parallel: the buffers hold the rank's shard [lo, hi) of the trainable region;
        # spans (group element offsets) are clipped to it, and views index the shard buffers
        lo, hi = store.shard_of(g) if hasattr(store, "shard_of") else (0, grp.trainable_numel)
        n, dt = hi - lo, grp.dtypes.state
        self.step = torch.zeros((), dtype=torch.float32) if step is None else step
        self.exp_avg = torch.zeros(n, dtype=dt) if exp_avg is None else exp_avg
        self.exp_avg_sq = torch.zeros(n, dtype=dt) if exp_avg_sq is None else exp_avg_sq
        self.max_exp_avg_sq = torch.zeros(n, dtype=dt) if amsgrad else None
        self.views: list[list[torch.Tensor]] = []
        self.working = None
        self.pgs: list[tuple[int, list[list[torch.Tensor]], list | None]] = []
        if bare:  # (the parameter tier's copies of a paged group's states: read, loaded, never updated)
            return
        bufs = [store.master(g), store.grad(g), self.exp_avg, self.exp_avg_sq]
        if amsgrad:
            bufs.append(self.max_exp_avg_sq)
        working_view = getattr(store, "working_view", None)
        self.views = [[] for _ in bufs]
        for k, pspans in layout if layout is not None else [(0, grp.trainable_spans())]:
            if (lo, hi) != (0, grp.trainable_numel):
                pspans = _clip(pspans, lo, hi)
            spans = _spans(pspans, merge, _boundaries(grp))
            if not spans:
                continue
            views = [[b[o - lo : o - lo + m] for o, m in spans] for b in bufs]
            for all_v, v in zip(self.views, views):
                all_v.extend(v)
            # the group's working image over each view, None per view without one (fp32
            # training: a store without working_view, or one returning None)
            work = [working_view(g, o, m) for o, m in spans] if working_view is not None else []
            batches = None
            if any(w is not None for w in work):
                self.working = (self.working or []) + work
                batches = _plan(views, [self.step] * len(spans), work, chunk)
            self.pgs.append((k, views, batches))

    def tensors(self) -> list[torch.Tensor]:
        """What an update overwrites (the step first): what the step journal saves."""
        out = [self.step, self.exp_avg, self.exp_avg_sq]
        return out + ([self.max_exp_avg_sq] if self.max_exp_avg_sq is not None else [])


class HostAdamW:
    """AdamW states for every group of a host store; ``update(g, hp)`` steps group ``g``, and
    refreshes the group's working copy where the store keeps one (``store.working_view``).

    ``merge_views=False`` keeps one view per parameter (no merging of adjacent ones; same
    results, more kernel calls: for tests and benchmarks). ``chunk``: elements per kernel call
    of an update with a working copy (:data:`CHUNK`; see :func:`fused_adamw_with_copy`)."""

    def __init__(self, config: Any, store: HostStore, merge_views: bool = True, chunk: int = CHUNK):
        if chunk < _UNIT:
            raise ValueError(f"chunk must be at least {_UNIT} elements, got {chunk}")
        self.config = config
        self.store = store
        self.merge_views = merge_views
        self.chunk = chunk
        self.state: dict[int, _State] = {}
        self._lock = threading.Lock()
        # the NVMe tier (shfx.runtime.ssd_window.SSDWindow): the states of its groups are in
        # ``state`` only while a host-window buffer holds them (between their SSD read and write)
        self.ssd: Any = None

    def _state(self, g: int, amsgrad: bool) -> _State:
        with self._lock:
            st = self.state.get(g)
            if st is None:
                _on_ssd_refusal(self, g)
                # (a paged group of the parameter tier: a loaded state waiting for the SSD window,
                # without the update's views of a master and gradient that are not on the host)
                bare = g in getattr(self.store, "paged", ())
                st = _State(self.store, g, amsgrad, self.merge_views, self.chunk, _layout(self.config, self.store.groups[g]), bare=bare)
                self.state[g] = st
            elif amsgrad and st.max_exp_avg_sq is None:
                raise ValueError("amsgrad was switched on after the first step; set it when creating the optimizer")
            return st

    def ensure(self, g: int, amsgrad: bool = False) -> _State:
        """Group ``g``'s state, created (zeros, step 0) if it has none yet: for a load to write
        into before the first update (data parallel's checkpoint pieces)."""
        return self._state(g, amsgrad)

    def shard_states(self, g: int, off: int, st: Any = None) -> dict[str, torch.Tensor]:
        """Data parallel's checkpoint pieces: the per-element state buffers (this rank's shard
        of group ``g``) of the parameter at element ``off``, by torch's field names. ``st``: a
        state of the group other than its live one (the NVMe tier's copies read from the SSD)."""
        st = self.state[g] if st is None else st
        return {"exp_avg": st.exp_avg, "exp_avg_sq": st.exp_avg_sq}

    def take(self, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Group ``g``'s ``(step, exp_avg, exp_avg_sq)``, dropped here (the group is updated on
        the device from now on); None when it has none."""
        if self.ssd is not None and g in self.ssd.groups:
            raise NotImplementedError(f"group {g}'s optimizer state is on the SSD: it cannot move to the device-side optimizer")
        with self._lock:
            st = self.state.get(g)
            if st is None:
                return None
            if st.max_exp_avg_sq is not None:
                raise NotImplementedError("amsgrad is not supported by the device-side optimizer")
            del self.state[g]
        return st.step, st.exp_avg, st.exp_avg_sq

    def put(self, g: int, step: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Take over group ``g``'s states (it is updated on the host from now on)."""
        if self.ssd is not None and g in self.ssd.groups:
            raise NotImplementedError(f"group {g}'s optimizer state is on the SSD: it cannot take a device-side state")
        st = self._state(g, amsgrad=False)
        st.step.copy_(step)
        st.exp_avg.copy_(exp_avg)
        st.exp_avg_sq.copy_(exp_avg_sq)

    def update(
        self, g: int, hp: dict, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None
    ) -> None:
        """One AdamW step of group ``g`` (and the refresh of its working copy, if any).

        ``grad_scale`` / ``found_inf`` (0-dim fp32): as ``torch.amp.GradScaler`` passes them to
        ``torch.optim.AdamW(fused=True)``: the gradients are divided by ``grad_scale`` in place;
        with ``found_inf`` 1 nothing changes (the step count included; the working copy is
        still rewritten from the unchanged master)."""
        if self.store.master(g).numel() == 0 and not getattr(self.store, "sharded", False):
            return  # (data parallel: an empty shard still counts the step, as the other ranks do)
        first = _hp_of(hp, 0)
        st = self._state(g, first["amsgrad"])
        st.step += 1
        for k, views, batches in st.pgs:
            h = _hp_of(hp, k)
            if h["amsgrad"] != first["amsgrad"]:
                raise ValueError("amsgrad must be the same in every parameter group")
            if batches is None:  # no working copy: one kernel call over the group's views
                _kernel(*views[:4], views[4] if h["amsgrad"] else [], [st.step] * len(views[0]), h, grad_scale, found_inf)
            else:
                _run(batches, h, grad_scale, found_inf)
        if found_inf is not None:
            st.step -= found_inf  # as torch.optim.AdamW(fused=True) does: a skipped step is not counted

    # ---- per-parameter state (shfx.optim.HostOptimizer.state / state_dict / load_state_dict) ----
    def param_state(self, g: int, off: int, n: int, shape: tuple[int, ...], dev: Any = None) -> dict:
        """The torch-named state of the parameter at elements ``[off, off + n)`` of group ``g``,
        as views (of the device state ``dev`` for a group updated on the device); {} before its
        first update."""
        st = self.state.get(g)
        if st is None and dev is None and self.ssd is not None and g in self.ssd.groups:
            # NOTE: copies read from the SSD (one group at a time), not views of a live buffer
            st = self.ssd.snapshot(g)
        if dev is not None:
            if int(dev.step.item()) == 0:
                return {}
            return {"step": dev.step, "exp_avg": dev.m[off : off + n].view(shape), "exp_avg_sq": dev.v[off : off + n].view(shape)}
        if st is None:
            return {}
        if getattr(self.store, "sharded", False):
            # data parallel: each rank holds a range of the states (shfx.runtime.data_parallel's
            # state_pieces, what checkpoints save); the step is every rank's
            return {"step": st.step}
        out = {
            "step": st.step,
            "exp_avg": st.exp_avg[off : off + n].view(shape),
            "exp_avg_sq": st.exp_avg_sq[off : off + n].view(shape),
        }
        if st.max_exp_avg_sq is not None:
            out["max_exp_avg_sq"] = st.max_exp_avg_sq[off : off + n].view(shape)
        return out

    def check_group(self, g: int, entries: list[tuple[tuple, dict]], dev: Any = None) -> None:
        """Raise what :meth:`load_group` would refuse for these entries, changing nothing (their
        tensors may be meta placeholders of the shapes to load; the steps are read): a load
        checks every group first, so a refused one changes nothing."""
        if not entries:
            return
        steps = {float(e["step"]) for _, e in entries}
        if len(steps) != 1:
            raise ValueError(f"the parameters of stage {g} have different steps {sorted(steps)}; shfx keeps one per stage")
        amsgrad = any("max_exp_avg_sq" in e for _, e in entries)
        if amsgrad and dev is not None:
            raise NotImplementedError("amsgrad is not supported by the device-side optimizer")
        if amsgrad and self.ssd is not None and g in self.ssd.groups:
            raise NotImplementedError("amsgrad is not supported with the NVMe tier (its third state is not on the SSD)")
        check_state_entries(entries, ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else []))

    def load_group(self, g: int, entries: list[tuple[tuple, dict]], dev: Any = None) -> None:
        """Set group ``g``'s state from torch-format entries ``[((g, off, n, shape), state)]``
        covering all its trainable parameters, or drop it (``entries`` empty: fresh state)."""
        if self.ssd is not None and g in self.ssd.groups and dev is None:
            self.ssd.load_group(g, entries)
            return
        if not entries:
            with self._lock:
                self.state.pop(g, None)
            if dev is not None:
                for t in (dev.step, dev.m, dev.v):
                    t.zero_()
            return
        steps = {float(e["step"]) for _, e in entries}
        if len(steps) != 1:
            raise ValueError(f"the parameters of stage {g} have different steps {sorted(steps)}; shfx keeps one per stage")
        amsgrad = any("max_exp_avg_sq" in e for _, e in entries)
        if dev is None:
            with self._lock:
                self.state.pop(g, None)
            st = self._state(g, amsgrad)
            dst = {"exp_avg": st.exp_avg, "exp_avg_sq": st.exp_avg_sq, "max_exp_avg_sq": st.max_exp_avg_sq}
            step = st.step
        else:
            if amsgrad:
                raise NotImplementedError("amsgrad is not supported by the device-side optimizer")
            dst = {"exp_avg": dev.m, "exp_avg_sq": dev.v}
            step = dev.step
        step.fill_(steps.pop())
        if getattr(self.store, "sharded", False):
            # data parallel: whole per-parameter states (a checkpoint loaded before the first
            # call), of which this rank keeps its shard's range
            copy_state_entries(entries, dst, shard=self.store.shard_of(g))
            return
        copy_state_entries(entries, dst)

    def time_update(self, g: int, hp: dict, repeats: int = 3) -> float:
        """Median seconds of one update of group ``g``, run on scratch buffers laid out like the
        group's (the same views and kernel calls as :meth:`update`), leaving the state untouched."""
        import statistics

        scratch = self.scratch(g)
        self.time_update_on(g, hp, scratch)  # warm-up
        return statistics.median(self.time_update_on(g, hp, scratch) for _ in range(repeats))

    def scratch(self, g: int) -> list[torch.Tensor]:
        """Scratch master, gradient and two state buffers for timing group ``g``'s update (any
        group of the same dtypes and at most its size can be timed on them), and a working
        copy buffer when the group's working dtype is not the master's."""
        grp = self.store.groups[g]
        n, dt = grp.trainable_numel, grp.dtypes
        out = [
            (torch.randn(n) * 1e-3).to(dt.master), (torch.randn(n) * 1e-3).to(dt.grad),
            torch.zeros(n, dtype=dt.state), torch.zeros(n, dtype=dt.state),
        ]  # fmt: skip
        if dt.working != dt.master:
            out.append(torch.zeros(n, dtype=dt.working))
        return out

    def time_update_on(self, g: int, hp: dict, scratch: list[torch.Tensor]) -> float:
        """Seconds of one update of group ``g`` (its views and kernel calls, as in :meth:`update`,
        with the working copy's refresh when the group's working dtype is not the master's and
        ``scratch`` has a working buffer) on ``scratch`` (from :meth:`scratch` of a group at
        least as large, same dtypes)."""
        import time

        grp = self.store.groups[g]
        spans = _spans(grp.trainable_spans(), self.merge_views, _boundaries(grp))
        if not spans:
            return 0.0
        views = [[b[o : o + k] for o, k in spans] for b in scratch[:4]]
        step = torch.zeros(())
        steps = [step] * len(spans)
        hp = {**_hp_of(hp, 0), "amsgrad": False}
        with_copy = grp.dtypes.working != grp.dtypes.master and len(scratch) > 4
        batches = _plan(views, steps, [scratch[4][o : o + k] for o, k in spans], self.chunk) if with_copy else None
        t0 = time.perf_counter()
        step += 1
        if batches is None:
            _kernel(*views, [], steps, hp, None, None)
        else:
            _run(batches, hp)
        return time.perf_counter() - t0

    def steps(self, g: int) -> int:
        if self.ssd is not None and g in self.ssd.groups:
            return self.ssd.step_count(g)
        st = self.state.get(g)
        return 0 if st is None else int(st.step.item())

    # ---- the NVMe tier (shfx.runtime.ssd_window.SSDWindow: its protocol, one per runner) ----------
    def ssd_states(self, g: int) -> list[tuple[str, int]]:
        """``(name, numel)`` of the flat state buffers of group ``g`` the NVMe tier keeps on the
        SSD, in the state dtype: ``m`` and ``v`` (this rank's shard under data parallel)."""
        lo, hi = _bounds(self.store, g)
        return [("m", hi - lo), ("v", hi - lo)]

    def ssd_steps(self, g: int) -> torch.Tensor:
        """A fresh step counter of group ``g`` (the tier keeps it in RAM): one 0-dim fp32."""
        return torch.zeros((), dtype=torch.float32)

    def ssd_state(self, g: int, bufs: Sequence[torch.Tensor], steps: torch.Tensor, bare: bool = False) -> _State:
        """Group ``g``'s state over ``bufs`` (:meth:`ssd_states`' buffers: a host-window
        buffer's views, or copies) and ``steps``: the same views and kernel calls as a state of
        its own, so an update there is bitwise the same. ``bare``: without the update's views
        (the parameter tier's copies of a paged group's states, whose master and gradient are
        not on the host)."""
        m, v = bufs
        return _State(self.store, g, False, self.merge_views, self.chunk, _layout(self.config, self.store.groups[g]),
                      step=steps, exp_avg=m, exp_avg_sq=v, bare=bare)  # fmt: skip

    def ssd_buffers(self, st: _State) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The flat buffers (:meth:`ssd_states`' order) and steps of a state."""
        if st.max_exp_avg_sq is not None:
            raise NotImplementedError("amsgrad is not supported with the NVMe tier (its third state is not on the SSD)")
        return [st.exp_avg, st.exp_avg_sq], st.step

    def ssd_load(self, g: int, st: _State, entries: list) -> None:
        """Write torch-format entries (all of group ``g``'s parameters) into ``st``."""
        if any("max_exp_avg_sq" in e for _, e in entries):
            raise NotImplementedError("amsgrad is not supported with the NVMe tier (its third state is not on the SSD)")
        steps = {float(e["step"]) for _, e in entries}
        if len(steps) != 1:
            raise ValueError(f"the parameters of stage {g} have different steps {sorted(steps)}; shfx keeps one per stage")
        st.step.fill_(steps.pop())
        shard = self.store.shard_of(g) if getattr(self.store, "sharded", False) else None
        copy_state_entries(entries, {"exp_avg": st.exp_avg, "exp_avg_sq": st.exp_avg_sq}, shard=shard)


def _bounds(store: Any, g: int) -> tuple[int, int]:
    """``[lo, hi)``: the elements of group ``g``'s trainable region a state holds (data
    parallel: this rank's shard)."""
    return store.shard_of(g) if hasattr(store, "shard_of") else (0, store.groups[g].trainable_numel)


def _on_ssd_refusal(runner: Any, g: int) -> None:
    """Raise when group ``g``'s state lives on the SSD and is not staged (an update outside its
    ``SR g`` .. ``SW g``: a program error, never read inline)."""
    if runner.ssd is not None and g in runner.ssd.groups:
        raise RuntimeError(
            f"group {g}'s optimizer state lives on the SSD and is not in a host-window buffer: its update must "
            f"come between its SSD read (SR{g}) and write (SW{g})"
        )


# ---- the other optimizers ------------------------------------------------------------------------
# NOTE: one view per parameter (no merging): the merging argument above is about
# torch._fused_adamw_'s chunking; SGD's kernel and Adafactor's foreach ops were not checked for
# it, and per-parameter views are bitwise what torch runs by construction.


def _master_grad(store: HostStore, g: int, bare: bool) -> list[torch.Tensor]:
    """Group ``g``'s flat master and gradient, or (``bare``: a state never updated, whose group's
    master and gradient are not on the host: the parameter tier's) meta tensors of their sizes,
    so a state's views have their shapes and nothing else."""
    if not bare:
        return [store.master(g), store.grad(g)]
    grp = store.groups[g]
    return [torch.empty(grp.trainable_numel, dtype=d, device="meta") for d in (grp.dtypes.master, grp.dtypes.grad)]


def _param_views(store: HostStore, g: int, layout, bufs: list[torch.Tensor], shaped: bool = False):
    """Per parameter group ``(index, [views of each of bufs], shapes, spans)``."""
    grp = store.groups[g]
    shapes = {}
    keys = [i for i in grp.infos if i.kind == "param" and i.trainable]
    for info, (o, n) in zip(keys, grp.trainable_spans()):
        shapes[o] = info.shape
    out = []
    for k, spans in layout:
        spans = [(o, n) for o, n in spans if n]
        if not spans:
            continue
        views = [[b[o : o + n].view(shapes[o]) if shaped else b[o : o + n] for o, n in spans] for b in bufs]
        out.append((k, views, [shapes[o] for o, _ in spans], spans))
    return out


class _HostRunner:
    """What the engine, the journal and :class:`shfx.optim.HostOptimizer` need of a host
    optimizer other than AdamW: per-group ``state`` (objects with ``tensors()``), ``update``,
    per-parameter state, timing for the profiler, and ``take``/``put`` to move a group's
    states to and from the device runner (:mod:`shfx.runtime.device_optim`)."""

    def __init__(self, config: Any, store: HostStore):
        self.config = config
        self.store = store
        self.state: dict[int, Any] = {}
        self._lock = threading.Lock()
        # the NVMe tier (shfx.runtime.ssd_window.SSDWindow), as for HostAdamW: the states of its
        # groups are in ``state`` only while a host-window buffer holds them
        self.ssd: Any = None

    def _working(self, g: int, spans: list[tuple[int, int]]) -> list[torch.Tensor] | None:
        wv = getattr(self.store, "working_view", None)
        work = [wv(g, o, n) for o, n in spans] if wv is not None else []
        return work if work and all(w is not None for w in work) else None

    def take(self, g: int) -> tuple[torch.Tensor, ...] | None:
        """Group ``g``'s states (:meth:`_export`'s tuple, what the device runner's ``put``
        takes), dropped here (the group is updated on the device from now on); None when it
        has none."""
        if self.ssd is not None and g in self.ssd.groups:
            raise NotImplementedError(f"group {g}'s optimizer state is on the SSD: it cannot move to the device-side optimizer")
        with self._lock:
            st = self.state.pop(g, None)
        return None if st is None else self._export(st)

    def put(self, g: int, *states: torch.Tensor) -> None:
        """Take over group ``g``'s states from the device runner (its ``take``'s tuple): it is
        updated on the host from now on."""
        if self.ssd is not None and g in self.ssd.groups:
            raise NotImplementedError(f"group {g}'s optimizer state is on the SSD: it cannot take a device-side state")
        self._import(self._state(g), states)

    def _export(self, st: Any) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError(f"{type(self.config).__name__} runs on the host only")

    def _import(self, st: Any, states: tuple[torch.Tensor, ...]) -> None:
        raise NotImplementedError(f"{type(self.config).__name__} runs on the host only")

    def steps(self, g: int) -> int:
        if self.ssd is not None and g in self.ssd.groups:
            return self.ssd.step_count(g)
        st = self.state.get(g)
        return 0 if st is None else int(st.step.item())

    def ssd_steps(self, g: int) -> torch.Tensor:
        """A fresh step counter of group ``g`` for the NVMe tier (one 0-dim fp32)."""
        return torch.zeros((), dtype=torch.float32)

    def scratch(self, g: int) -> list[torch.Tensor]:
        grp = self.store.groups[g]
        n, dt = grp.trainable_numel, grp.dtypes
        return [(torch.randn(n) * 1e-3).to(dt.master), (torch.randn(n) * 1e-3).to(dt.grad), torch.zeros(n), torch.zeros(n)]

    def time_update(self, g: int, hp: Any, repeats: int = 3) -> float:
        import statistics

        scratch = self.scratch(g)
        self.time_update_on(g, hp, scratch)
        return statistics.median(self.time_update_on(g, hp, scratch) for _ in range(repeats))

    def time_update_on(self, g: int, hp: Any, scratch: list[torch.Tensor]) -> float:
        """Seconds of one update of group ``g``'s layout on ``scratch`` (state untouched)."""
        import time

        grp = self.store.groups[g]
        spans = [s for s in grp.trainable_spans() if s[1]]
        if not spans:
            return 0.0
        t0 = time.perf_counter()
        self._time_kernel(g, _hp_of(hp, 0), scratch, spans)
        return time.perf_counter() - t0


class _SGDState:
    __slots__ = ("step", "momentum_buffer", "pgs")

    def __init__(
        self, store: HostStore, g: int, layout, *, step: torch.Tensor | None = None, momentum_buffer: torch.Tensor | None = None,
        bare: bool = False,
    ) -> None:  # fmt: skip
        # step / momentum_buffer: the NVMe tier's (a host-window buffer's views, or copies);
        # bare: the parameter tier's copies of a paged group's states (read, loaded, never updated)
        grp = store.groups[g]
        # updates so far (torch's first-step test)
        self.step = torch.zeros((), dtype=torch.float32) if step is None else step
        # data parallel: the buffers hold the rank's shard [lo, hi) (momentum is elementwise, and
        # the shard's bounds keep every element's position modulo 16 in its parameter: bitwise
        # the update over whole parameters, as for AdamW); spans stay group element offsets
        lo, hi = _bounds(store, g)
        self.momentum_buffer = torch.zeros(hi - lo, dtype=grp.dtypes.state) if momentum_buffer is None else momentum_buffer
        bufs = [*_master_grad(store, g, bare), self.momentum_buffer]
        self.pgs = []
        for k, spans in layout:
            spans = _clip(spans, lo, hi)
            if spans:
                views = [[b[o - lo : o - lo + n] for o, n in spans] for b in bufs]
                self.pgs.append((k, views, None, spans))

    def tensors(self) -> list[torch.Tensor]:
        return [self.step, self.momentum_buffer]


class HostSGD(_HostRunner):
    """``torch._fused_sgd_`` (``torch.optim.SGD(fused=True)``) per (group, parameter group)
    over per-parameter views of the flat master, gradient and momentum buffers; with a 16-bit
    working copy, a cast of the group's views after the update."""

    def _state(self, g: int) -> _SGDState:
        with self._lock:
            st = self.state.get(g)
            if st is None:
                _on_ssd_refusal(self, g)
                st = self.state[g] = _SGDState(self.store, g, _layout(self.config, self.store.groups[g]))
            return st

    def update(self, g: int, hp: Any, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
        if self.store.master(g).numel() == 0:
            return
        st = self._state(g)
        st.step += 1
        first = int(st.step.item()) == 1
        for k, (params, grads, bufs), _, spans in st.pgs:
            h = _hp_of(hp, k)
            torch._fused_sgd_(
                params, grads, bufs if h["momentum"] != 0 else [],
                weight_decay=h["weight_decay"], momentum=h["momentum"], lr=h["lr"], dampening=h["dampening"],
                nesterov=h["nesterov"], maximize=h["maximize"], is_first_step=first,
                grad_scale=grad_scale, found_inf=found_inf,
            )  # fmt: skip
            work = self._working(g, spans)
            if work is not None:
                torch._foreach_copy_(work, params)
        if found_inf is not None:
            st.step -= found_inf

    def _time_kernel(self, g: int, h: dict, scratch: list[torch.Tensor], spans) -> None:
        views = [[b[o : o + n] for o, n in spans] for b in scratch[:3]]
        torch._fused_sgd_(
            *views[:2], views[2] if h["momentum"] != 0 else [], weight_decay=h["weight_decay"], momentum=h["momentum"],
            lr=h["lr"], dampening=h["dampening"], nesterov=h["nesterov"], maximize=h["maximize"], is_first_step=False,
        )  # fmt: skip

    def _export(self, st: _SGDState) -> tuple[torch.Tensor, ...]:
        return st.step, st.momentum_buffer  # (shfx.runtime.device_optim.DeviceSGD's order)

    def _import(self, st: _SGDState, states: tuple[torch.Tensor, ...]) -> None:
        step, buf = states
        st.step.copy_(step)
        st.momentum_buffer.copy_(buf)

    def ensure(self, g: int) -> _SGDState:
        """Group ``g``'s state, created (zeros, step 0) if it has none yet (data parallel's
        checkpoint pieces, for a load to write into; :meth:`loaded` after it)."""
        return self._state(g)

    def loaded(self, g: int) -> None:
        """A load wrote group ``g``'s momentum buffers: past the first step (torch uses a
        loaded buffer at its next step), as :meth:`load_group` marks it (the NVMe tier: the
        copies the load wrote into, :meth:`shfx.runtime.ssd_window.SSDWindow.loadable`)."""
        st = self.state.get(g)
        if st is None and self.ssd is not None and g in self.ssd.groups:
            st = self.ssd.loading(g)
        if st is not None:
            st.step.clamp_(min=1.0)

    def shard_states(self, g: int, off: int, st: Any = None) -> dict[str, torch.Tensor]:
        """Data parallel's checkpoint pieces: this rank's shard of group ``g``'s momentum buffer
        for the parameter at element ``off`` (of ``st``, when given: the NVMe tier's copies);
        none where its parameter group has no momentum (torch keeps no state then)."""
        st = self.state[g] if st is None else st
        return {"momentum_buffer": st.momentum_buffer} if self._momentum(g, off) else {}

    def _momentum(self, g: int, off: int) -> bool:
        lay = _layout(self.config, self.store.groups[g])
        for k, spans in lay:
            if any(o == off for o, _ in spans):
                return _hp_of(self.config.hyperparams(), k)["momentum"] != 0
        return False

    def param_state(self, g: int, off: int, n: int, shape: tuple[int, ...], dev: Any = None) -> dict:
        """As :meth:`HostAdamW.param_state` (``dev``: the group's device state, a group updated
        on the device: views of its momentum buffer there)."""
        st = self.state.get(g) if dev is None else dev
        if st is None and self.ssd is not None and g in self.ssd.groups:
            st = self.ssd.snapshot(g)  # NOTE: copies read from the SSD, not views of a live buffer
        if dev is not None:
            if int(dev.step.item()) == 0 or not self._momentum(g, off):
                return {}
            return {"momentum_buffer": dev.momentum_buffer[off : off + n].view(shape)}
        if st is None or int(st.step.item()) == 0 or not self._momentum(g, off):
            return {}  # torch.optim.SGD keeps no state without momentum
        if getattr(self.store, "sharded", False):
            return {}  # data parallel: ranges per rank (DataParallelRuntime.state_pieces, what checkpoints save)
        return {"momentum_buffer": st.momentum_buffer[off : off + n].view(shape)}

    def check_group(self, g: int, entries: list, dev: Any = None) -> None:
        """As :meth:`HostAdamW.check_group`: a momentum buffer of another shape is refused."""
        check_state_entries([(w, e) for w, e in entries if e.get("momentum_buffer") is not None], ["momentum_buffer"])

    def load_group(self, g: int, entries: list, dev: Any = None) -> None:
        if dev is not None:  # a group updated on the device: into its device state
            entries = [(w, e) for w, e in entries if e.get("momentum_buffer") is not None]
            for t in dev.tensors():
                t.zero_()
            if entries:
                dev.step.fill_(1.0)  # past the first step: the momentum buffers exist
                copy_state_entries(entries, {"momentum_buffer": dev.momentum_buffer})
            dev.restored()
            return
        if self.ssd is not None and g in self.ssd.groups:
            self.ssd.load_group(g, entries)
            return
        with self._lock:
            self.state.pop(g, None)
        entries = [(w, e) for w, e in entries if e.get("momentum_buffer") is not None]
        if not entries:
            return
        self.ssd_load(g, self._state(g), entries)

    # ---- the NVMe tier (HostAdamW's protocol) ---------------------------------------------------
    def ssd_states(self, g: int) -> list[tuple[str, int]]:
        """The momentum buffer (this rank's shard under data parallel)."""
        lo, hi = _bounds(self.store, g)
        return [("momentum", hi - lo)]

    def ssd_state(self, g: int, bufs: Sequence[torch.Tensor], steps: torch.Tensor, bare: bool = False) -> _SGDState:
        return _SGDState(self.store, g, _layout(self.config, self.store.groups[g]), step=steps, momentum_buffer=bufs[0], bare=bare)

    def ssd_buffers(self, st: _SGDState) -> tuple[list[torch.Tensor], torch.Tensor]:
        return [st.momentum_buffer], st.step

    def ssd_load(self, g: int, st: _SGDState, entries: list) -> None:
        entries = [(w, e) for w, e in entries if e.get("momentum_buffer") is not None]
        if not entries:  # (no momentum state: fresh, zeros and step 0)
            return
        st.step.fill_(1.0)  # past the first step: the momentum buffers exist
        # (data parallel: whole states, of which this rank keeps its shard's range)
        shard = self.store.shard_of(g) if getattr(self.store, "sharded", False) else None
        copy_state_entries(entries, {"momentum_buffer": st.momentum_buffer}, shard=shard)


class _AdafactorState:
    __slots__ = ("steps", "factors", "pgs", "index", "flat_steps")

    def __init__(
        self, store: HostStore, g: int, layout, *, factors: torch.Tensor | None = None, steps: torch.Tensor | None = None,
        bare: bool = False,
    ) -> None:  # fmt: skip
        # factors / steps: the NVMe tier's (a host-window buffer's views, or copies; ``steps`` one
        # element per parameter, in this order: each parameter's step is a 0-dim view of it);
        # bare: the parameter tier's copies of a paged group's states (read, loaded, never updated)
        grp = store.groups[g]
        pgs = _param_views(store, g, layout, _master_grad(store, g, bare), shaped=True)
        size = 0
        for _, _, shapes, _ in pgs:
            for sh in shapes:
                size += _factored_numel(sh)
        self.factors = torch.zeros(size, dtype=grp.dtypes.state) if factors is None else factors
        self.flat_steps = steps
        self.steps: list[torch.Tensor] = []
        self.index: dict[int, int] = {}  # element offset of a parameter -> its position in steps
        self.pgs = []
        pos = 0
        for k, (params, grads), shapes, spans in pgs:
            rows, cols, variances, steps = [], [], [], []
            for sh, (o, _) in zip(shapes, spans):
                r, c, v, pos = _factor_views(self.factors, pos, sh)
                rows.append(r)
                cols.append(c)
                variances.append(v)
                self.index[o] = len(self.steps)
                self.steps.append(torch.zeros((), dtype=torch.float32) if self.flat_steps is None else self.flat_steps[len(self.steps)])
                steps.append(self.steps[-1])
            self.pgs.append((k, params, grads, rows, cols, variances, steps, spans))

    @property
    def step(self) -> torch.Tensor:
        return self.steps[0] if self.steps else torch.zeros(())

    def tensors(self) -> list[torch.Tensor]:
        return [*self.steps, self.factors]


def _factored_numel(shape: tuple[int, ...]) -> int:
    """Elements of Adafactor's second-moment state of a parameter of ``shape``."""
    if len(shape) < 2:
        return max(1, int(torch.Size(shape).numel()))
    lead = int(torch.Size(shape[:-2]).numel())
    return lead * shape[-2] + lead * shape[-1]


def _factor_views(buf: torch.Tensor, pos: int, shape: tuple[int, ...]):
    """``(row_var, col_var, variance, next position)`` views of ``buf`` for one parameter, in
    torch.optim.Adafactor's shapes (None where it keeps none)."""
    if len(shape) < 2:
        n = int(torch.Size(shape).numel())
        return None, None, buf[pos : pos + n].view(shape), pos + max(1, n)
    lead = int(torch.Size(shape[:-2]).numel())
    r_shape = (*shape[:-1], 1)
    c_shape = (*shape[:-2], 1, shape[-1])
    nr, nc = lead * shape[-2], lead * shape[-1]
    r = buf[pos : pos + nr].view(r_shape)
    c = buf[pos + nr : pos + nr + nc].view(c_shape)
    return r, c, None, pos + nr + nc


class HostAdafactor(_HostRunner):
    """``torch.optim.Adafactor(foreach=True)``'s update function per (group, parameter group)
    over views (in each parameter's shape) of the flat master and gradient, and of one flat
    buffer of the factored second moments; per-parameter steps, as torch keeps them.

    NOTE: torch's foreach Adafactor itself loops over parameters in Python (a norm and an
    ``.item()`` each); shfx calls it once per parameter group and adds no loop of its own."""

    def _state(self, g: int) -> _AdafactorState:
        with self._lock:
            st = self.state.get(g)
            if st is None:
                _on_ssd_refusal(self, g)
                st = self.state[g] = _AdafactorState(self.store, g, _layout(self.config, self.store.groups[g]))
            return st

    def update(self, g: int, hp: Any, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
        from torch.optim._adafactor import adafactor

        if grad_scale is not None or found_inf is not None:
            raise NotImplementedError("Adafactor takes unscaled gradients (the engine unscales them first)")
        if self.store.master(g).numel() == 0:
            return
        st = self._state(g)
        for k, params, grads, rows, cols, variances, steps, spans in st.pgs:
            h = _hp_of(hp, k)
            adafactor(
                params, grads, rows, cols, variances, steps, foreach=True, d=h["d"], lr=h["lr"],
                beta2_decay=h["beta2_decay"], weight_decay=h["weight_decay"], eps1=h["eps1"], eps2=h["eps2"],
                maximize=h["maximize"],
            )  # fmt: skip
            work = self._working(g, spans)
            if work is not None:
                torch._foreach_copy_(work, [p.view(-1) for p in params])

    def _time_kernel(self, g: int, h: dict, scratch: list[torch.Tensor], spans) -> None:
        from torch.optim._adafactor import adafactor

        p = [scratch[0][o : o + n] for o, n in spans]
        gr = [scratch[1][o : o + n] for o, n in spans]
        v = [scratch[2][o : o + n] for o, n in spans]
        steps = [torch.ones(()) for _ in spans]
        adafactor(p, gr, [None] * len(p), [None] * len(p), v, steps, foreach=True, d=h["d"], lr=h["lr"],
                  beta2_decay=h["beta2_decay"], weight_decay=h["weight_decay"], eps1=h["eps1"], eps2=h["eps2"],
                  maximize=h["maximize"])  # fmt: skip

    def steps(self, g: int) -> int:
        if self.ssd is not None and g in self.ssd.groups:
            return self.ssd.step_count(g)
        st = self.state.get(g)
        return 0 if st is None or not st.steps else int(st.steps[0].item())

    def _export(self, st: _AdafactorState) -> tuple[torch.Tensor, ...]:
        # (shfx.runtime.device_optim.DeviceAdafactor's order: the steps as one 1-D tensor, the factors)
        return (torch.stack(st.steps) if st.steps else torch.zeros(0)), st.factors

    def _import(self, st: _AdafactorState, states: tuple[torch.Tensor, ...]) -> None:
        steps, factors = states
        for i, s in enumerate(st.steps):
            s.copy_(steps[i])
        st.factors.copy_(factors)

    def _views_at(self, st: _AdafactorState, off: int):
        i = st.index[off]
        for _, params, _, rows, cols, variances, steps, spans in st.pgs:
            for j, (o, _) in enumerate(spans):
                if o == off:
                    return steps[j], rows[j], cols[j], variances[j]
        raise KeyError(off)

    def param_state(self, g: int, off: int, n: int, shape: tuple[int, ...], dev: Any = None) -> dict:
        """As :meth:`HostAdamW.param_state` (``dev``: the group's device state, a group updated
        on the device: views of its factored states there, its steps)."""
        st = self.state.get(g) if dev is None else dev
        if st is None and self.ssd is not None and g in self.ssd.groups:
            st = self.ssd.snapshot(g)  # NOTE: copies read from the SSD, not views of a live buffer
        if st is None or off not in st.index:
            return {}
        step, r, c, v = dev.views_at(off) if dev is not None else self._views_at(st, off)
        if int(step.item()) == 0:
            return {}
        return {"step": step, "row_var": r, "col_var": c} if v is None else {"step": step, "variance": v}

    def check_group(self, g: int, entries: list, dev: Any = None) -> None:
        """As :meth:`HostAdamW.check_group`: the entries against the views of a state over meta
        buffers (the group's factored layout, nothing allocated)."""
        if not entries:
            return
        size, nparams = self._counts(g)
        factors = torch.empty(size, dtype=self.store.groups[g].dtypes.state, device="meta")
        st = self.ssd_state(g, [factors], torch.zeros(nparams), bare=True)
        _load_factored(entries, lambda off: self._views_at(st, off), write=False)

    def load_group(self, g: int, entries: list, dev: Any = None) -> None:
        if dev is not None:  # a group updated on the device: into its device state
            for t in dev.tensors():
                t.zero_()
            _load_factored(entries, dev.views_at)
            dev.restored()
            return
        if self.ssd is not None and g in self.ssd.groups:
            self.ssd.load_group(g, entries)
            return
        with self._lock:
            self.state.pop(g, None)
        if not entries:
            return
        self.ssd_load(g, self._state(g), entries)

    # ---- the NVMe tier (HostAdamW's protocol) ---------------------------------------------------
    # NOTE: Adafactor's states are small (a row and a column vector per matrix, a full second
    # moment per vector), but the tier holds them too: every state of a group on the SSD
    def _counts(self, g: int) -> tuple[int, int]:
        """Elements of group ``g``'s factored states, and its parameters (step counters)."""
        lay = _layout(self.config, self.store.groups[g])
        size = nparams = 0
        for _, _, shapes, _ in _param_views(self.store, g, lay, [], shaped=True):
            size += sum(_factored_numel(sh) for sh in shapes)
            nparams += len(shapes)
        return size, nparams

    def ssd_states(self, g: int) -> list[tuple[str, int]]:
        """The factored second moments of every parameter of the group, as one flat buffer
        (replicated under data parallel: whole on every rank)."""
        return [("factors", self._counts(g)[0])]

    def ssd_steps(self, g: int) -> torch.Tensor:
        """The group's step counters: one per parameter, as torch keeps them."""
        return torch.zeros(self._counts(g)[1], dtype=torch.float32)

    def ssd_state(self, g: int, bufs: Sequence[torch.Tensor], steps: torch.Tensor, bare: bool = False) -> _AdafactorState:
        return _AdafactorState(self.store, g, _layout(self.config, self.store.groups[g]), factors=bufs[0], steps=steps, bare=bare)

    def ssd_buffers(self, st: _AdafactorState) -> tuple[list[torch.Tensor], torch.Tensor]:
        steps = st.flat_steps if st.flat_steps is not None else torch.stack(st.steps) if st.steps else torch.zeros(0)
        return [st.factors], steps

    def ssd_load(self, g: int, st: _AdafactorState, entries: list) -> None:
        _load_factored(entries, lambda off: self._views_at(st, off))


def _load_factored(entries: list, views_at, write: bool = True) -> None:
    """Write torch-format Adafactor entries into the states ``views_at(offset)`` gives
    (``(step, row_var, col_var, variance)`` of the parameter there), every entry checked before
    anything is written (``write=False``: only checked)."""
    pairs = []
    for (_, off, n, shape), e in entries:
        step, r, c, v = views_at(off)
        pairs.append((step, e["step"]))
        for name, dst in (("row_var", r), ("col_var", c), ("variance", v)):
            if dst is None:
                continue
            src = e.get(name)
            if src is None or tuple(src.shape) != tuple(dst.shape):
                raise ValueError(
                    f"Adafactor state {name!r} of a parameter of shape {tuple(shape)} is "
                    f"{'missing' if src is None else tuple(src.shape)} in the state dict"
                )
            pairs.append((dst, src))
    if write:
        for dst, src in pairs:
            dst.copy_(src)


#: the runners by the name a :class:`shfx.optim.HostOptimizer` class gives as its ``host_runner``
_RUNNERS: dict[str, type] = {"adamw": HostAdamW, "sgd": HostSGD, "adafactor": HostAdafactor}


def runner_for(config: Any, store: HostStore) -> Any:
    """The host runner of optimizer ``config`` (a :class:`shfx.optim.HostOptimizer`) over ``store``:
    the one its class names (``host_runner``; this module never imports :mod:`shfx.optim`)."""
    runner = _RUNNERS.get(getattr(config, "host_runner", None))
    if runner is None:
        raise TypeError(f"no host runner for {type(config).__name__}")
    return runner(config, store)
