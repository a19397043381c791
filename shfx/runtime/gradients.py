"""Gradient routing: where a stage's parameter gradients go after its backward, and how they
reach the host and accumulate there.

After a BACKWARD the gradients are in the stage's slot (over the parameters, which are not
needed there any more) or in the slot's device gradient buffer (the parameters stay: the stage
is persistent, or its group is updated on the device). An OFFLOAD_GRAD copies them to the host
(on the d2h stream) and adds them into the group's gradient buffer (on the host FIFO).
Gradients of a tensor several stages use (a tied embedding) are summed before they are added,
as eager autograd sums contributions before accumulating.

Data parallel: an OFFLOAD_GRAD never writes the host gradient. The owner's copy of its group
lands in a local buffer (padded for the collective, :meth:`DataParallelRuntime.local_grad_buffer
<shfx.runtime.data_parallel.DataParallelRuntime.local_grad_buffer>`), borrowed contributions are
summed into it as they are into the host gradient without data parallel, and the group's
complete local gradient waits there (``Accumulation.local``) for ``RS g``, which reduces it
across ranks into this rank's gradient shard. ``.grad`` is not exposed (the gradient is sharded).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from shfx.passes.partition import Stage
from shfx.passes.program import ActionMeta

from ..errors import UsageError
from .host_store import GRAD_NONE, GRAD_VALID
from .streams import Token

if TYPE_CHECKING:
    from .context import StepContext
    from .protocols import GradientEngine

__all__ = ["GradientRouter", "Accumulation", "accumulator_label"]

GRAD_BUFFERS = "gradients"  # the memory-ledger term of the device gradient buffers


def accumulator_label(g: int) -> str:
    """The allocation name of group ``g``'s fp32 gradient accumulator on the device."""
    return f"gradient accumulator (fp32) of group {g}"


class Accumulation:
    """Gradient accumulation of one backward, kept on the host FIFO: contributions to shared
    parameters waiting for their owner, and the groups whose owner has added its sum."""

    def __init__(self) -> None:
        self.flushed: set[int] = set()
        self.pending: dict[int, list] = {}
        self.pending_keys: set[tuple[int, int]] = set()
        # data parallel: group -> its complete local gradient (device dtype, padded), waiting for RS
        self.local: dict[int, torch.Tensor] = {}


class GradientRouter:
    """The gradient side of an :class:`~shfx.runtime.engine.Engine`: device gradient buffers,
    the state of gradients kept on the device, the pending sums of shared parameters on the
    host, and the OFFLOAD_GRAD tasks."""

    def __init__(self, engine: GradientEngine):
        self.engine = engine
        self.store = engine.store
        self.backend = engine.backend
        self.buffers: list[torch.Tensor | None] = []  # per slot, for backwards that keep params
        self.device_state: dict[int, int] = {}  # group -> GRAD_NONE/GRAD_VALID of its device gradient
        # mixed precision under grad_accum_steps > 1: group -> the fp32 sum of its micro-steps'
        # 16-bit device gradients (the recipe's master.grad += p16.grad.float()), on the device
        self.acc32: dict[int, torch.Tensor] = {}
        # data parallel (the device groups replicated): each micro-step's device gradient is
        # all-reduced by its RS, which sums the reduced gradients into ``acc32`` (fp32 groups
        # too); the backward only writes the micro-step's local gradient into the buffer
        self.summed_by_reduce = False
        self._pending_bufs: dict[tuple[int, int, int], torch.Tensor] = {}
        self._views: dict[str, torch.Tensor] = {}  # parameter -> its slice of the host gradient buffer
        # after an overlapped backward: (parameter, its .grad, that .grad's version) as exposed
        self._exposed: list[tuple[str, torch.Tensor, torch.Tensor | None, int]] | None = None
        self._stepped = False  # a step() ran since the last backward (see take_user_grads)

    # ---- device gradient buffers ------------------------------------------------------------------
    def ensure_buffers(self, sizes: Sequence[int]) -> None:
        """Make slot ``k``'s gradient buffer hold at least ``sizes[k]`` bytes."""
        while len(self.buffers) < len(sizes):
            self.buffers.append(None)
        for k, n in enumerate(sizes):
            cur = self.buffers[k]
            if n and (cur is None or cur.numel() < n):
                if cur is not None:
                    self.backend.free_device(cur, f"gradient buffer of slot {k}", GRAD_BUFFERS)
                self.buffers[k] = self.backend.alloc_device(n, f"gradient buffer of slot {k}", GRAD_BUFFERS)

    def buffer(self, slot: int) -> torch.Tensor:
        buf = self.buffers[slot] if slot < len(self.buffers) else None
        if buf is None:  # pragma: no cover - ensure_buffers allocates them
            raise AssertionError(f"slot {slot} has no gradient buffer")
        return buf

    def ensure_accumulators(self, groups: Sequence[Any], replicated: bool = False) -> None:
        """Mixed precision with ``grad_accum_steps > 1``: an fp32 accumulator on the device for
        each of ``groups`` (updated on the device, 16-bit gradients), laid out like its master
        (``master_bytes``, ledger term ``gradients``); allocated once, as the steady state.

        ``replicated`` (data parallel: the groups' RS all-reduces every micro-step's gradient):
        fp32 groups get one too, and the sum of the reduced micro-step gradients is the RS's
        (:meth:`~shfx.runtime.data_parallel.DataParallelRuntime.accumulate_device_grads`), the
        gradient buffer keeping each micro-step's local gradient apart from it."""
        self.summed_by_reduce = replicated
        for grp in groups:
            if (grp.dtypes.mixed or replicated) and grp.trainable_bytes and grp.index not in self.acc32:
                buf = self.backend.alloc_device(grp.master_bytes, accumulator_label(grp.index), GRAD_BUFFERS)
                self.acc32[grp.index] = buf.view(grp.dtypes.master)

    def close(self) -> None:
        for k, buf in enumerate(self.buffers):
            if buf is not None:
                self.backend.free_device(buf, f"gradient buffer of slot {k}", GRAD_BUFFERS)
        self.buffers = []
        for g, acc in self.acc32.items():
            self.backend.free_device(acc.view(torch.uint8), accumulator_label(g), GRAD_BUFFERS)
        self.acc32 = {}

    # ---- after a backward -------------------------------------------------------------------------
    def write(
        self, ctx: StepContext, stage: Stage, slot: int, views: dict, keys: list[str], grads: Sequence, grads_to: str
    ) -> None:
        """Put a stage's parameter gradients where the rest of the program reads them.

        ``"slot"``: over the parameters in the slot (they are not needed there any more); the OG
        copies them to the host. ``"buffer"``: into the slot's device gradient buffer (the
        parameters stay: the stage is persistent or updated on the device). Gradients of groups
        updated on the device accumulate there across backward calls; a borrowed parameter whose
        owner is updated on the device waits in the context (``keep_pending``) and is added to
        the owner's contribution first (``G += own + borrowed``, as on the host).

        Mixed precision under accumulation (the group has an fp32 accumulator, ``acc32``): the
        16-bit buffer holds each micro-step's gradient alone (the recipe's ``p16.grad``, its
        borrowed contributions summed in 16 bits as autograd sums them), widened exactly into
        the accumulator after the owner's backward: copied at the first micro-step, added at
        the next ones (``master.grad += p16.grad.float()``). Under data parallel
        (``summed_by_reduce``) the buffer holds each micro-step's local gradient alone, in fp32
        too, and the group's RS sums the reduced ones into the accumulator."""
        v = ctx.variant
        dev = v.device_groups
        owner = v.graph.owner
        own_group = stage.spec.update_group
        ctx.grad_src[stage.index] = grads_to
        first = self.device_state.get(own_group, GRAD_NONE) == GRAD_NONE
        acc32 = self.acc32.get(own_group) if own_group in dev and grads_to == "buffer" else None
        gbuf = self.buffer(slot) if grads_to == "buffer" else None
        with torch.no_grad():
            for key, gr in zip(keys, grads):
                grp = owner[key]
                if grp in dev and grp != own_group:  # borrowed; its owner updates it on the device
                    if gr is not None:
                        prev = ctx.dev_pending.get(key)
                        if prev is None:
                            ctx.keep_pending(key, gr)  # device memory until the owner's backward
                        else:
                            ctx.dev_pending[key] = prev + gr
                    continue
                pend = ctx.take_pending(key)
                if pend is not None:
                    gr = pend if gr is None else gr + pend
                if gbuf is None:
                    dst = views[key]
                else:
                    info = v.graph.tensors[key]
                    off = stage.slot.offsets[key]
                    dst = gbuf[off : off + info.nbytes].view(info.dtype).view(info.shape)
                if grp in dev and not first and acc32 is None:
                    if gr is not None:
                        dst.add_(gr)
                elif gr is None:
                    dst.zero_()
                else:
                    dst.copy_(gr)
            if acc32 is not None and not self.summed_by_reduce:
                self._accumulate32(stage, gbuf, own_group, acc32, first)
        if own_group in dev:
            self.device_state[own_group] = GRAD_VALID

    def _accumulate32(self, stage: Stage, gbuf: torch.Tensor, g: int, acc: torch.Tensor, first: bool) -> None:
        """Group ``g``'s micro-step gradient (16-bit, in ``gbuf``) widened into its fp32
        accumulator, part by part (a BatchNorm part is fp32 already): ``acc = g16.float()`` at
        the first micro-step, ``acc += g16`` after (the 16-bit value widens exactly, then one fp32
        addition: the recipe's ``master.grad += p16.grad.float()``)."""
        grp = self.store.groups[g]
        key = grp.infos[0].key
        base = stage.slot.offsets[key] - grp.offsets[key]
        for p in grp.parts:
            src = gbuf[base + p.offset : base + p.offset + p.nbytes].view(p.dtype)
            dst = acc[p.elem : p.elem + p.numel]
            if first:
                dst.copy_(src)
            else:
                dst.add_(src)

    def device_grad32(self, g: int) -> torch.Tensor | None:
        """Group ``g``'s accumulated fp32 gradient (mixed precision under accumulation), or
        None: its device gradient is the 16-bit buffer's."""
        return self.acc32.get(g)

    def device_grads(self, slot: int, base: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A group's gradient in slot ``slot``'s gradient buffer (a device update reads it)."""
        return self.buffer(slot)[base : base + nbytes].view(dtype)

    def reset_device(self) -> None:
        """The next backward copies into the device gradients instead of adding (``0 + g == g``
        exactly, so zero_grad(set_to_none=False) needs no zeroing there)."""
        for g in list(self.device_state):
            self.device_state[g] = GRAD_NONE

    # ---- OFFLOAD_GRAD ---------------------------------------------------------------------------
    def offload(self, ctx: StepContext, stage: Stage, m: ActionMeta, deps: list[Token], timed: Callable) -> Token:
        """OG: copy the stage's param grads device -> host and accumulate them.

        Two tasks: the copy on the d2h stream (its token frees the slot), and the accumulation
        on the host stream (its token is what updates wait for). A group's whole trainable
        region goes straight into the gradient buffer when it holds no gradient yet, else
        through a staging buffer that is then added. Both tasks are methods of one
        :class:`_GradOffload`, which holds what they share.

        NOTE: a parameter shared by several stages (a tied embedding) gets one contribution
        per stage. As eager autograd does, they are summed first (into a persistent pending
        buffer, in backward order) and the sum is added to the accumulated gradient when the
        owning stage's gradients arrive: ``G += (own + others)``, not ``(G + other) + own``,
        which rounds differently under gradient accumulation.
        """
        if ctx.accumulation is None:
            ctx.accumulation = Accumulation()
        og = _GradOffload(self, ctx, stage, m.slot, ctx.accumulation)
        backend = self.backend
        t_copy = backend.d2h.submit(timed(og.copy_out, m), deps, str(m.action))
        t_acc = backend.host.submit(og.accumulate, [t_copy], str(m.action))
        t_acc.reads = t_copy
        return t_acc

    def _target(self, acc: Accumulation, g: int, c: Any) -> torch.Tensor:
        """Where a borrowed contribution is added once its owner's sum is in (or the owner has
        none): group ``g``'s host gradient over the copy's range, or under data parallel its
        local gradient (zeros first when the owner sent none)."""
        dp = self.engine.dp
        if dp is None:
            return self._grad_slice(g, c, zero_if_none=True)
        local = acc.local.get(g)
        if local is None:
            grp = self.store.groups[g]
            local = acc.local[g] = dp.local_grad_buffer(g).view(grp.dtypes.device_grad).zero_()
        ((_, elem, n, _),) = self.store.groups[g].elements(c.host_offset, c.nbytes)
        return local[elem : elem + n]

    def _grad_slice(self, g: int, c: Any, zero_if_none: bool) -> torch.Tensor:
        """Group ``g``'s host gradient over a copy's range (zeroing the group first if it holds
        no gradient yet)."""
        st = self.store
        if st.grad_state[g] == GRAD_NONE:
            if not zero_if_none:  # pragma: no cover - a direct copy sets the state first
                raise AssertionError(f"group {g} has no gradient to add to")
            st.grad(g).zero_()
            st.grad_state[g] = GRAD_VALID
        ((_, elem, n, _),) = st.groups[g].elements(c.host_offset, c.nbytes)
        return st.grad(g)[elem : elem + n]

    def _dtype(self, c: Any) -> torch.dtype:
        """The device dtype of a gradient copy (the part of its group's trainable region it is in)."""
        return self.store.groups[c.group].part_at(c.host_offset).dtype

    def _pending(self, c: Any) -> torch.Tensor:
        key = (c.group, c.host_offset, c.nbytes)
        t = self._pending_bufs.get(key)
        if t is None:
            dt = self._dtype(c)  # summed as autograd sums them: in the device dtype
            t = torch.empty(c.nbytes // dt.itemsize, dtype=dt)
            self._pending_bufs[key] = t
        return t

    @property
    def pending_host_bytes(self) -> int:
        """Host bytes of the buffers borrowed gradients wait in."""
        return sum(t.numel() * t.element_size() for t in self._pending_bufs.values())

    # ---- what PyTorch code sees, and what it did ------------------------------------------------
    def expose(self, param_keys_by_group: dict[int, list]) -> None:
        """Point each trainable parameter's ``.grad`` at its slice of the host gradient buffer.

        When updates are already running (the overlapped update started during backward) it
        also records each ``.grad`` and its version counter, after shfx's own writes: an edit
        from now on comes too late for this step (:meth:`edited_since_expose`).

        Data parallel: nothing is exposed (each rank holds a shard of the gradient)."""
        st = self.store
        if st.sharded:
            self._exposed = None
            return
        for g, keys in param_keys_by_group.items():
            if st.grad_state[g] == GRAD_VALID and g not in st.paged:  # (the parameter tier's gradients pass through its window)
                for k, p in keys:
                    v = self._view(k, g)
                    if p.grad is not v:
                        p.grad = v
        if self.engine.pending_updates:
            self._exposed = [
                (k, p, p.grad, -1 if p.grad is None else p.grad._version)
                for keys in param_keys_by_group.values()
                for k, p in keys
            ]
        else:
            self._exposed = None

    def _view(self, key: str, group: int) -> torch.Tensor:
        """``key``'s slice of its group's host gradient buffer, the one tensor its ``.grad`` is
        (so that ``p.grad is view`` says whether PyTorch code rebound it)."""
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = self.store.param_grad_view(key, group)
        return v

    def edited_since_expose(self) -> str | None:
        """After an overlapped backward (updates started during it): how PyTorch code changed a
        ``.grad`` since (in place: its version counter moved; or rebound it), in words; None
        when nothing changed or there was no overlapped backward. Forgets the record.

        NOTE: the gradient views of one group share their buffer's version counter, so an
        in-place edit of one parameter's gradient shows on every parameter of its group."""
        exposed, self._exposed = self._exposed, None
        for key, p, grad, version in exposed or ():
            now = p.grad
            if now is not grad:
                how = "set to None" if now is None else "replaced by another tensor"
                return f"the .grad of parameter {key!r} was {how}"
            if grad is not None and grad._version != version:
                return (
                    f"the .grad of parameter {key!r} (or of another parameter of its stage: they share one "
                    "buffer) was changed in place"
                )
        return None

    def note_step(self) -> None:
        """A step applied the gradients (:meth:`take_user_grads` then reads an all-None ``.grad``
        as zeroed for the groups updated on the device)."""
        self._stepped = True

    def take_user_grads(self, param_keys_by_group: dict[int, list], *, before_step: bool = False) -> None:
        """Make the host gradients what PyTorch code left in ``.grad`` since :meth:`expose`,
        as eager autograd and ``torch.optim`` would read them: a ``.grad`` set to None starts
        from zero at the next backward (the parameter's slice is zeroed; the group holds no
        gradient when all of its parameters were set to None), one rebound to another tensor
        has its values copied into the slice (and points at the slice again). In-place edits
        need nothing: ``.grad`` is the slice. ``before_step``: a step is about to read them;
        some but not all of a group's parameters without a gradient is refused (shfx updates a
        group whole, where ``torch.optim`` would skip just those parameters).

        Groups updated on the device keep their gradients there and never expose them: at the
        first backward after a step, when every parameter's ``.grad`` is None (``model.zero_grad()``),
        they start from zero too; otherwise they accumulate, as the exposed ones then do.

        The common cases cost one identity check per parameter.

        Data parallel: ``.grad`` is never exposed, so there is nothing to take; the gradients
        are dropped by ``cm.zero_grad()`` only."""
        st, views = self.store, self._views
        if st.sharded:
            return
        cur = self.engine.current
        dev = cur.device_groups if cur is not None else frozenset()
        if self._stepped and not before_step:
            self._stepped = False
            if GRAD_VALID in self.device_state.values() and all(
                p.grad is None for keys in param_keys_by_group.values() for _, p in keys
            ):
                self.reset_device()
        for g, keys in param_keys_by_group.items():
            if g in dev:
                continue  # updated on the device: its gradients are never exposed
            valid = st.grad_state[g] == GRAD_VALID
            changed = [(k, p, p.grad) for k, p in keys if (p.grad is not views.get(k) if valid else p.grad is not None)]
            if not changed:
                continue
            none = [k for k, p in keys if p.grad is None]
            if len(none) == len(keys):  # all set to None (model.zero_grad())
                st.grad_state[g] = GRAD_NONE
                continue
            if before_step and none:
                have = [k for k, p in keys if p.grad is not None]
                raise UsageError(
                    f"step() updates a stage's parameters together, but {', '.join(map(repr, none[:3]))}"
                    f"{' ...' if len(none) > 3 else ''} of a stage {'has' if len(none) == 1 else 'have'} .grad None "
                    f"while {', '.join(map(repr, have[:3]))}{' ...' if len(have) > 3 else ''} of the same stage "
                    "have a gradient (torch.optim would skip just the former). Set every .grad to None "
                    "(model.zero_grad()) or none, or zero a gradient in place (p.grad.zero_()) to update with a "
                    "zero gradient. Nothing was updated."
                )
            self.engine.wait_delayed()  # a delayed update (ZeRO-Offload's) may still read the buffer
            with torch.no_grad():
                if not valid:
                    st.grad(g).zero_()
                    st.grad_state[g] = GRAD_VALID
                for k, p, gr in changed:
                    v = self._view(k, g)
                    if gr is None:
                        v.zero_()
                        continue
                    if gr.shape != v.shape:
                        raise UsageError(
                            f"the .grad of parameter {k!r} was set to a tensor of shape {tuple(gr.shape)}, but the "
                            f"parameter has shape {tuple(v.shape)}: assign a gradient of the parameter's shape"
                        )
                    v.copy_(gr)
                    p.grad = v


class _GradOffload:
    """One OFFLOAD_GRAD's two tasks and the state they share.

    :meth:`copy_out` (d2h stream) copies the stage's gradients off the device and plans, per
    copy, how it is accumulated; :meth:`accumulate` (host stream, after the copy) carries the
    plan out in order and releases the OG's staging buffers. The plan's kinds:

    - ``"direct"``: copied straight into the host gradient (cast on the device if need be);
      the borrowed sums waiting for the group are added to it.
    - ``"add32"``: cast to fp32 on the device into staging; added to the host gradient.
    - ``"dp"``: the owner's whole group into its data-parallel local buffer, kept for ``RS g``.
    - ``"add"``: the owner's whole group into staging; the borrowed sums are added to it in
      the device dtype, then it goes into the host gradient.
    - ``"shared"``: any other copy (a borrowed contribution) into staging; summed into its
      pending buffer, or added directly once the owner's sum is in.
    """

    def __init__(self, router: GradientRouter, ctx: StepContext, stage: Stage, slot: int, acc: Accumulation):
        self.router = router
        self.store, self.backend = router.store, router.backend
        self.ctx, self.stage, self.slot, self.acc = ctx, stage, slot, acc
        self.dev = ctx.variant.device_groups
        self.pool = router.engine.pool
        self.dp = router.engine.dp
        # mixed precision, one process: groups whose 16-bit gradient is cast to fp32 on the
        # device and copied into the host gradient (passes.layout.device_cast_groups)
        self.cast = {g for g, _ in stage.spec.grad_wire_bytes} if self.dp is None else set()
        self.plan: list[tuple[str, Any, torch.Tensor | None]] = []  # (kind, copy, staging)
        self.held: list[torch.Tensor] = []  # the OG's staging buffers, released after accumulate

    # ---- the d2h task ---------------------------------------------------------------------------
    def copy_out(self) -> None:
        """Copy each of the stage's gradients off the device (from its slot, or from the slot's
        gradient buffer) and plan its accumulation. Groups updated on the device are skipped:
        their gradient stays there. Nothing to do when the stage's backward made no gradients."""
        ctx, stage, slot = self.ctx, self.stage, self.slot
        if stage.index in ctx.no_grads:
            return
        from_buffer = ctx.grad_src.get(stage.index) == "buffer"
        regions: dict[int, torch.Tensor] = {}
        for c in stage.slot.grads:
            if c.group in self.dev:
                continue  # updated on the device: the gradient stays there
            if from_buffer:
                src = self.router.buffer(slot)[c.slot_offset : c.slot_offset + c.nbytes]
            else:
                src = self.pool.region(slot, c.slot_offset, c.nbytes)
            if c.group in self.cast:
                self._copy_cast(c, src, regions)
            else:
                self._copy_bytes(c, src, regions)

    def _copy_cast(self, c: Any, src: torch.Tensor, regions: dict[int, torch.Tensor]) -> None:
        """A gradient cast to fp32 on the device: straight into the host gradient when the group
        holds none yet (``"direct"``), else into the group's staging region (``"add32"``)."""
        store = self.store
        if store.grad_state[c.group] == GRAD_NONE:
            self._cast_into(store.grad(c.group), src, c.group, c.nbytes)
            store.grad_state[c.group] = GRAD_VALID
            self.plan.append(("direct", c, None))
        else:  # accumulating: fp32 into a staging buffer, added on the host
            buf = self._staging(regions, c.group)
            self._cast_into(buf.view(store.groups[c.group].dtypes.grad), src, c.group, c.nbytes)
            self.plan.append(("add32", c, buf))

    def _copy_bytes(self, c: Any, src: torch.Tensor, regions: dict[int, torch.Tensor]) -> None:
        """A gradient copied as it is on the device: the owner's copy of its whole group into the
        data-parallel local buffer (``"dp"``), or straight into the host gradient when the group
        holds none yet and is not mixed (``"direct"``); anything else into the group's staging
        region at the copy's offset (``"add"`` for the owner's whole group, else ``"shared"``),
        where borrowers' copies wait in pending."""
        store, backend, dp = self.store, self.backend, self.dp
        full = (
            c.group == self.stage.spec.update_group
            and c.host_offset == 0
            and c.nbytes == store.groups[c.group].trainable_bytes
        )
        if full and dp is not None:  # the local gradient waits for RS in a buffer of its own
            buf = dp.local_grad_buffer(c.group)
            backend.d2h_copy(buf[: c.nbytes], src)
            self.plan.append(("dp", c, buf))
        elif full and store.grad_state[c.group] == GRAD_NONE and not store.groups[c.group].dtypes.mixed:
            backend.d2h_copy(store.grad_bytes(c.group)[: c.nbytes], src)
            store.grad_state[c.group] = GRAD_VALID
            self.plan.append(("direct", c, None))
        else:
            # at the copy's offset in the group: the staged copies of one group never overlap
            buf = self._staging(regions, c.group)[c.host_offset : c.host_offset + c.nbytes]
            backend.d2h_copy(buf, src)
            self.plan.append(("add" if full else "shared", c, buf))

    def _cast_into(self, dst: torch.Tensor, src: torch.Tensor, g: int, nbytes: int) -> None:
        """The group's device gradient (bytes ``src``) into ``dst`` (its fp32 elements), part by
        part (a part's device dtype may be fp32 already: a BatchNorm weight)."""
        for part, elem, n, off in self.store.groups[g].elements(0, nbytes):
            self.backend.d2h_copy_cast(dst[elem : elem + n], src[off : off + n * part.dtype.itemsize].view(part.dtype))

    def _staging(self, regions: dict[int, torch.Tensor], g: int) -> torch.Tensor:
        """Group ``g``'s staging region for this OG: one buffer per group, its copies placed at
        their offsets in the group (a stage may send many tensors of one group: ALBERT's
        shared layer, one copy per tensor; a buffer per copy would wait forever for the
        pool's two). A second group's buffer never waits for the pool (this OG would wait
        for itself): it is allocated past the pool's size if need be."""
        buf = regions.get(g)
        if buf is None:
            buf = regions[g] = self.store.acquire_staging(self.store.groups[g].grad_bytes, wait=not self.held)
            self.held.append(buf)
        return buf

    # ---- the host task --------------------------------------------------------------------------
    def accumulate(self) -> None:
        """Carry out the plan in order (one ``_add_<kind>`` per copy), then add the borrowed sums
        of an owner that sent no gradients of its own; always release the staging buffers."""
        try:
            for kind, c, buf in self.plan:
                self._ADD[kind](self, c, buf)
            self._flush_owner()
        finally:
            for buf in self.held:
                self.store.release_staging(buf)
            self.held.clear()
            self.plan.clear()
            if self.dp is not None and self.ctx.variant.train.ranks == 1:
                # a one-rank program under data parallel (the profiler's probes): no RS reduces
                # the local gradients, which are dropped, their buffers given back at once
                for g in list(self.acc.local):
                    self.dp.release_local(self.acc.local.pop(g))

    def _add_shared(self, c: Any, buf: torch.Tensor) -> None:
        """A borrowed contribution: added directly when its owner's sum is in already, else
        summed into its pending buffer (copied in when it is the first)."""
        router, acc, g = self.router, self.acc, c.group
        src = buf[: c.nbytes].view(router._dtype(c))
        if g in acc.flushed:  # the owner's sum is in already: add directly
            router._target(acc, g, c).add_(src)
        else:
            pend = router._pending(c)
            if (g, c.host_offset) in acc.pending_keys:
                pend.add_(src)
            else:
                pend.copy_(src)
                acc.pending_keys.add((g, c.host_offset))
                acc.pending.setdefault(g, []).append(c)

    def _add_dp(self, c: Any, buf: torch.Tensor) -> None:
        """Own + borrowed, in the device dtype, in the local buffer kept for ``RS g``."""
        g = c.group
        self._sum_pending_into(g, buf)
        self.acc.local[g] = buf.view(self.store.groups[g].dtypes.device_grad)
        self.acc.flushed.add(g)

    def _add_staged(self, c: Any, buf: torch.Tensor) -> None:
        """The sum of the stage's own gradient and the borrowed ones, in the device dtype (as
        autograd sums a tied weight's contributions), then into the host gradient (cast to its
        dtype in mixed precision): copied when the group holds none yet, else added."""
        store, g = self.store, c.group
        self._sum_pending_into(g, buf)
        grp = store.groups[g]
        first = store.grad_state[g] == GRAD_NONE
        grad = store.grad(g)
        for part, elem, n, off in grp.elements(0, c.nbytes):
            stg = buf[off : off + n * part.dtype.itemsize].view(part.dtype)
            if first:
                grad[elem : elem + n].copy_(stg)
            else:
                grad[elem : elem + n].add_(stg)
        store.grad_state[g] = GRAD_VALID
        self.acc.flushed.add(g)

    def _add_32(self, c: Any, buf: torch.Tensor) -> None:
        """Cast on the device: fp32 + fp32 into the host gradient, as ``grad += g16`` widens g16."""
        grad = self.store.grad(c.group)
        grad.add_(buf.view(grad.dtype)[: grad.numel()])
        self.acc.flushed.add(c.group)

    def _add_direct(self, c: Any, buf: torch.Tensor | None) -> None:
        """The group's gradient was copied in whole: the borrowed sums waiting for it are added."""
        g = c.group
        for pc in self.acc.pending.pop(g, []):
            self.router._grad_slice(g, pc, zero_if_none=False).add_(self.router._pending(pc))
        self.acc.flushed.add(g)

    _ADD: dict[str, Callable[[_GradOffload, Any, Any], None]] = {
        "shared": _add_shared,
        "dp": _add_dp,
        "add": _add_staged,
        "add32": _add_32,
        "direct": _add_direct,
    }

    def _sum_pending_into(self, g: int, buf: torch.Tensor) -> None:
        """Add the borrowed sums waiting for group ``g`` into the owner's staged copy ``buf``, each
        at its offset in the group, in the device dtype (forgetting them)."""
        router = self.router
        for pc in self.acc.pending.pop(g, []):
            buf[pc.host_offset : pc.host_offset + pc.nbytes].view(router._dtype(pc)).add_(router._pending(pc))

    def _flush_owner(self) -> None:
        """When the stage owns a group whose sum is not in yet (it sent no whole copy of it), the
        borrowed sums waiting for that group go to their target now."""
        acc, own = self.acc, self.stage.spec.update_group
        if own is not None and own not in acc.flushed:  # owner without gradients of its own
            for pc in acc.pending.pop(own, []):
                self.router._target(acc, own, pc).add_(self.router._pending(pc))
            acc.flushed.add(own)
