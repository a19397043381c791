"""The interpreter's handlers: one per kind of action, and the task bodies they submit.

:class:`ActionHandlers` maps each :data:`shfx.passes.actions.KINDS` entry to its handler
``run_<KindInfo.name>(ctx, meta, deps, cold) -> Token``, which submits the action's task to its
stream after ``deps``. The task bodies of the transfers (``prefetch``, ``offload_params``) and of
the step-time updates (``update_task``: U on the host, ``device_step_task``: DU on the device)
live here too: ``step()`` (:mod:`shfx.runtime.stepping`) issues the same tasks when it runs the
updates itself. A stage's forward and backward stay the engine's (``Engine._forward`` and
``Engine._backward``): the handlers call them through the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shfx.passes.actions import KINDS, PW, SR
from shfx.passes.capture import CAPTURE_GATE
from shfx.passes.partition import Stage
from shfx.passes.pipeline import Variant
from shfx.passes.program import ActionMeta, ScheduleError

from ..errors import NonFiniteGradient, UsageError
from .context import StepContext
from .data_parallel import DataParallelRuntime
from .device_optim import widen
from .host_store import GRAD_NONE, GRAD_VALID
from .ssd_window import SSDWindow
from .streams import Cancelled, JoinToken, Settled, Token

__all__ = ["ActionHandlers", "require_finite"]


def device_nonfinite(grad: torch.Tensor) -> torch.Tensor:
    """A device flag (0-dim fp32, 1.0: ``grad`` holds inf or NaN), computed where ``grad`` is
    without the host reading it."""
    return torch.isfinite(grad.sum(dtype=torch.float32)).logical_not().to(torch.float32)


def require_finite(grad: torch.Tensor, group: int, where: str) -> None:
    """Raise :class:`NonFiniteGradient` when ``grad`` holds inf or NaN (a sum is inf or NaN
    then, and reads the buffer once without allocating a mask). ``where``: whose gradient, in
    words."""
    total = float(grad.sum(dtype=torch.float32)) if grad.numel() else 0.0
    if total != total or total in (float("inf"), float("-inf")):
        raise NonFiniteGradient(f"the gradient of {where} holds inf or NaN", group)


class ActionHandlers:
    """The handlers of one engine's actions (``table``: kind -> handler) and their tasks.

    What it uses of the engine (:class:`~shfx.runtime.engine.Engine`): ``backend``, ``store``,
    ``pool``, ``ssd``, ``dp``, ``optimizer``, ``device_optimizer``, ``journal``, ``gradients``,
    ``clipping``, ``current``, ``deferred``, ``delayed``, ``cancel``, ``tracing``, ``trace``, the
    step's update flags (``check_finite``, ``step_checked``, ``clip_coef``, ``scaler``,
    ``unscaled``, ``nonfinite_flags``, ``dirty``), and its stage compute ``_forward`` and
    ``_backward`` (looked up on the engine each time: tests replace them)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        # the interpreter's dispatch table: one handler per kind of action
        self.table: dict[Any, Callable[[StepContext, ActionMeta, list[Token], bool], Token]] = {
            kind: getattr(self, f"run_{info.name}") for kind, info in KINDS.items()
        }

    # ---- submitting an action's task to its stream -----------------------------------------------
    def _timed(self, fn: Callable[[], None], meta: ActionMeta) -> Callable[[], None]:
        """The task of an action: its device reservations belong to it (a memory recording
        names it), and, when tracing, its start and end are traced (an OFFLOAD_GRAD's copy
        only: its event has no ``copy_end``, its ``end`` is when the slot's reads ended).

        NOTE: tracing the accumulation too would make an OFFLOAD_GRAD's ``end`` the end of the
        accumulation, as the simulator's; readers of ``trace`` (tests/test_runtime.py's
        residency check) take an OFFLOAD_GRAD's ``end`` as the last read of its slot."""
        eng = self.engine
        label, backend, cancel = str(meta.action), eng.backend, eng.cancel
        if not eng.tracing:
            return self.task(label, fn)
        trace = eng.trace

        def run() -> None:
            if cancel.is_set():
                raise Cancelled(f"{label} was not run: the step is being abandoned")
            # NOTE: stamps, not host clock readings: on a device stream that queues its work
            # (CUDA) they are events the device records when it gets there (shfx.runtime.tracing)
            t0 = backend.stamp()
            with backend.during(label):
                fn()
            trace.record(label, meta.phase, meta.stream, t0, backend.stamp(), meta.bytes)

        return run

    def task(self, label: str, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn`` as a task named ``label`` (an action not traced, an update started by step()):
        skipped while a step is abandoned, its reservations named ``label``."""
        eng = self.engine
        backend, cancel = eng.backend, eng.cancel

        def run() -> None:
            if cancel.is_set():
                raise Cancelled(f"{label} was not run: the step is being abandoned")
            with backend.during(label):
                fn()

        return run

    def _submit(self, m: ActionMeta, fn: Callable[[], None], deps: list[Token]) -> Token:
        """Run ``fn`` on the action's stream (:data:`shfx.passes.actions.KINDS`) after ``deps``."""
        eng = self.engine
        stream = getattr(eng.backend, m.stream)  # (a GN of a device-updated group: the compute stream)
        return stream.submit(self._timed(fn, m), deps, str(m.action))

    # ---- one handler per action kind (run_<KINDS[kind].name>) ------------------------------------
    def run_release(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        return JoinToken([d.reads_done for d in deps], str(m.action))

    def _ssd_window(self, m: ActionMeta) -> SSDWindow:
        eng = self.engine
        if eng.ssd is None:
            raise ScheduleError(
                f"{m.action}: the program reads and writes optimizer states on the SSD, but this model has no SSD store; "
                "compile with offload=shfx.Offload(optimizer='nvme', path=...)"
            )
        return eng.ssd

    def run_ssd_read(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """SR g: the group's states into host-window buffer ``m.buffer``, on the window's read
        stream; the token completes when the reads did (:meth:`SSDWindow.read`)."""
        w = self._ssd_window(m)
        return w.read_stream.submit(self._timed(lambda: w.read(m.stage, m.buffer), m), deps, str(m.action))

    def run_ssd_write(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """SW g: the group's states back to the SSD; its buffer is free when the token completes."""
        w = self._ssd_window(m)
        return w.write_stream.submit(self._timed(lambda: w.write(m.stage), m), deps, str(m.action))

    def _images(self, m: ActionMeta) -> Any:
        eng = self.engine
        if eng.ssd is None or eng.ssd.images is None:
            raise ScheduleError(
                f"{m.action}: the program reads and writes parameter images on the SSD, but this model keeps them in host "
                "RAM; compile with offload=shfx.Offload(params='nvme', gradients='nvme', optimizer='nvme', path=...)"
            )
        return eng.ssd

    def run_param_read(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """PR g: the group's image into image buffer ``m.buffer``, on the SSD read stream (the
        prefetches and the update of the group wait for it)."""
        w = self._images(m)
        return w.read_stream.submit(self._timed(lambda: w.read_image(m.stage, m.buffer), m), deps, str(m.action))

    def run_param_drop(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """PD g: the image buffer is free once the prefetches reading it are done (no bytes)."""
        w = self._images(m)
        return w.write_stream.submit(self._timed(lambda: w.drop_image(m.stage), m), [d.reads_done for d in deps], str(m.action))

    def run_param_write(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """PW g: the updated image back to the SSD; its buffer is free when the token completes."""
        w = self._images(m)
        return w.write_stream.submit(self._timed(lambda: w.write_image(m.stage), m), deps, str(m.action))

    def run_tier_unupdated(self, ctx: StepContext, m: ActionMeta, deps: list[Token], accumulate: bool = False) -> Token:
        """A paged group's ``SR``/``PW``/``SW`` in a backward without its update (the profiler's
        timing steps; with ``accumulate``, a micro-step before the last): ``SR`` gives the
        group's gradient a window buffer (holding the gradient accumulated so far), ``PW`` frees
        the image buffer unwritten (nothing changed it), ``SW`` frees the window buffer, writing
        the gradient to the SSD when accumulating (:class:`~shfx.runtime.ssd_window.SSDWindow`'s
        ``stage_gradient``, ``write_gradient``)."""
        w = self._images(m)
        g = m.stage
        if m.kind == SR:
            return w.read_stream.submit(self._timed(lambda: w.stage_gradient(g, m.buffer, accumulate), m), deps, str(m.action))
        if m.kind == PW:  # (an image read for a prefetch too; one read for the update alone was not made)
            fn = lambda: w.drop_image(g) if g in w.image_at else None  # noqa: E731
        else:
            fn = (lambda: w.write_gradient(g)) if accumulate else (lambda: w.release(g))
        return w.write_stream.submit(self._timed(fn, m), deps, str(m.action))

    def _data_parallel(self, m: ActionMeta) -> DataParallelRuntime:
        eng = self.engine
        if eng.dp is None:
            raise ScheduleError(
                f"{m.action}: the program is data parallel, but this model was compiled without it; compile with "
                "shfx.compile(..., data_parallel=True) under torch.distributed"
            )
        return eng.dp

    def run_reduce_grads(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """RS g (queue ``reduce``, every backward): the group's local gradient, complete once the
        OGs it waits for ran, reduce-scattered into this rank's gradient shard (copied at the
        first micro-step, added at later ones)."""
        eng = self.engine
        dp, store, g = self._data_parallel(m), eng.store, m.stage
        if g in ctx.variant.device_groups:
            return self._reduce_device_grads(ctx, m, deps)
        if eng.delayed:  # the previous step's delayed update still reads the gradient shard this writes
            deps = deps + eng.delayed.deps_for([g])

        def run() -> None:
            acc = ctx.accumulation
            local = acc.local.pop(g, None) if acc is not None else None
            dp.reduce_grads(str(m.action), g, local, first=store.grad_state[g] == GRAD_NONE)
            store.grad_state[g] = GRAD_VALID

        return self._submit(m, run, deps)

    def _reduce_device_grads(self, ctx: StepContext, m: ActionMeta, deps: list[Token]) -> Token:
        """RS g of a group updated on the device (replicated): its gradient in its owner's
        gradient buffer (slot ``m.slot``) all-reduced, ``* 1/N`` and SUM, in every backward.
        Under ``grad_accum_steps`` the buffer holds this micro-step's local gradient alone, and
        the reduced one is copied (first micro-step) or added into the group's fp32 accumulator
        on the device, which GN, US and DU read (DDP's recipe: each micro-step reduced, the
        reduced gradients summed; in 16 bits in the device dtype)."""
        eng = self.engine
        dp, g = self._data_parallel(m), m.stage
        owner, base = self.group_base(ctx.variant, g)
        grp = eng.store.groups[g]
        first = eng.backward_calls <= 1  # (counted before this backward's actions are issued)
        acc = eng.gradients.acc32.get(g) if eng.grad_accum_steps > 1 else None

        def run() -> None:
            grads = eng.gradients.device_grads(m.slot, base, grp.trainable_bytes, grp.dtypes.device_grad)
            if eng.gradients.device_state.get(g, GRAD_NONE) != GRAD_VALID:  # (no gradient this step: zeros, as DDP's)
                grads.zero_()
                eng.gradients.device_state[g] = GRAD_VALID
            dp.all_reduce_device_grads(str(m.action), grads)
            if acc is not None:
                raw = eng.gradients.device_grads(m.slot, base, grp.trainable_bytes, torch.uint8)
                dp.accumulate_device_grads(grp, raw, acc, first)

        return self._submit(m, run, deps)

    def run_gather_params(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """AG g (queue ``gather``, after U g): the updated shards of the group's working copy
        from every rank into the host image."""
        dp = self._data_parallel(m)
        if m.phase == "backward" and self.engine.journal.enabled:
            # rollback, the update during the backward: the step's verdict NR0 decides after every
            # rank's all-gathers, so this one runs even when this rank's update failed (every rank
            # reaches it; a failed update sends its shard unchanged, and an undone step rebuilds it)
            deps = [Settled(d) for d in deps]
        return self._submit(m, lambda: dp.gather_params(str(m.action), m.stage), deps)

    def run_cpu_step(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        eng = self.engine
        if m.phase == "delayed":  # ZeRO-Offload's delayed update: zero_grad() may run before it (checked when issued)
            return self._submit(m, self.update_task(m.stage, check=False, finite=eng.step_checked), deps)
        if eng.clip_coef is None or m.phase not in ("step", "next-forward"):
            return self._submit(m, self.update_task(m.stage, finite=eng.step_checked), deps)
        # after the gate: scale the gradient by the clip coefficient, then update
        g, coef, update = m.stage, eng.clip_coef, self.update_task(m.stage, check=False, finite=False)
        store = eng.store

        def run() -> None:
            store.grad(g).data.mul_(coef)  # as clip_grad_norm_'s _foreach_mul_ (through .data: no user edit)
            update()

        return self._submit(m, run, deps)

    def run_grad_norm(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        eng = self.engine
        return self._submit(m, lambda: eng.clipping.record(m.stage), deps)

    def run_snapshot(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """SN g (rollback): the journal's copy of the group's master and states before ``U g``
        (only when the update will run: its gradient is there)."""
        eng, g = self.engine, m.stage
        delayed = m.phase == "delayed"

        def run() -> None:
            if delayed or eng.store.grad_state[g] == GRAD_VALID:
                eng.journal.snapshot_host(g)

        return self._submit(m, run, deps)

    def run_unscale(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """US g (fp16, the loss-scaling pass): the group's scaled host gradient checked finite
        (where its update would check it: not behind a gate that checks the total norm, nor
        after step()'s check of every gradient), then divided by the loss scale once, as the
        fused kernel's ``grad_scale`` divides (bitwise alike); through ``.data``, so the exposed
        ``.grad`` views' version counters see no user edit. ``unscaled`` then holds the group:
        its norm and update neither check nor divide again."""
        eng, g = self.engine, m.stage
        delayed = m.phase == "delayed"  # (zero_grad() may run before it: checked when issued)
        check = eng.check_finite and eng.clipping.clip is None and eng.step_checked is None
        if g in ctx.variant.device_groups:
            return self._unscale_device(ctx, m, deps, check)
        whose = self.whose(g, "host")

        def run() -> None:
            if not delayed and eng.store.grad_state[g] != GRAD_VALID:
                return
            grad = eng.store.grad(g)
            if check and g not in eng.unscaled:
                require_finite(grad, g, whose)
            if eng.scaler is not None and g not in eng.unscaled:
                grad.data.div_(eng.scaler.scale_tensor())
            eng.unscaled.add(g)

        return self._submit(m, run, deps)

    def _unscale_device(self, ctx: StepContext, m: ActionMeta, deps: list[Token], check: bool) -> Token:
        """US g of a group updated on the device (fp16), on the compute stream: its scaled
        gradient (widened to fp32, as the recipe's ``master.grad``) checked finite into a device
        flag, which its ``DU`` passes to AdamW as ``found_inf`` and ``step()`` reads with every
        other verdict (one skip decision, the scale backed off once). The 16-bit buffer cannot
        hold the unscaled gradient: ``GN g`` and ``DU g`` divide the fp32 gradient they make."""
        eng, g = self.engine, m.stage

        def run() -> None:
            if eng.gradients.device_state.get(g, GRAD_NONE) != GRAD_VALID:
                return
            if check and g not in eng.unscaled:
                eng.nonfinite_flags[g] = device_nonfinite(self.device_grad32(ctx.variant, g, m.slot))
            eng.unscaled.add(g)

        return self._submit(m, run, deps)

    def device_grad32(self, variant: Variant, g: int, slot: int, scale: torch.Tensor | None = None) -> torch.Tensor:
        """Device group ``g``'s gradient in slot ``slot``'s gradient buffer (its owner's), in
        fp32: mixed precision widens it (a new tensor, divided by ``scale`` when given), or
        under accumulation copies its fp32 accumulator (the micro-steps' widened sum); in fp32
        it is the buffer's view itself."""
        eng = self.engine
        _, base = self.group_base(variant, g)
        grp = eng.store.groups[g]
        acc = eng.gradients.device_grad32(g)
        if acc is not None and not grp.dtypes.mixed:  # (data parallel, fp32: the reduced micro-steps' sum itself)
            return acc
        if acc is not None:
            out = acc.clone()
            return out.div_(scale.to(out.device)) if scale is not None else out
        if grp.dtypes.mixed:
            return widen(grp, eng.gradients.device_grads(slot, base, grp.trainable_bytes, torch.uint8), scale)
        return eng.gradients.device_grads(slot, base, grp.trainable_bytes, grp.dtypes.device_grad)

    def run_norm_reduce(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """NR0 (data parallel, the reduce queue, after every RS): with norms to reduce (clipping),
        every parameter's norm on every rank; otherwise every rank's finite check, agreed (so all
        ranks skip or apply the step alike)."""
        eng = self.engine
        dp = self._data_parallel(m)
        if m.phase == "backward":  # the overlapped step's verdict (rollback): every rank's outcome of its updates
            return self._submit(m, lambda: eng.clipping.agree_outcome(dp, deps), [Settled(d) for d in deps])
        if eng.clipping.reduces_norms():
            return self._submit(m, eng.clipping.reduce_across_ranks, deps)
        return self._submit(m, lambda: eng.clipping.agree_finite(dp, self.first_nonfinite_host()), deps)

    def first_nonfinite_host(self) -> int | None:
        """The first group (forward order) whose gradient holds inf or NaN, or None: this rank's
        shard of a host group's, a device group's whole (all-reduced) gradient."""
        eng = self.engine
        v = eng.current
        for gi in self.clip_groups():
            if v is not None and gi in v.device_groups:
                owner, _ = self.group_base(v, gi)
                grad = self.device_grad32(v, gi, v.train.persistent.index(owner))
            else:
                grad = eng.store.grad(gi)
            try:
                require_finite(grad, gi, "")
            except NonFiniteGradient:
                return gi
        return None

    def run_check(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """CK0, the step's gate: the total norm and the clip coefficient, read by step()."""
        eng = self.engine
        return self._submit(m, lambda: eng.clipping.check(self.clip_groups()), deps)

    def run_device_step(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        eng = self.engine
        if eng.clip_coef is None or m.phase not in ("step", "next-forward"):
            return self._submit(m, self.device_step_task(ctx.variant, m.stage, m.slot, finite=eng.step_checked), deps)
        # after the gate (which checked the total norm): the gradient scaled by the clip
        # coefficient in the slot's gradient buffer, as clip_grad_norm_'s _foreach_mul_, then AdamW
        return self._submit(m, self.device_step_task(ctx.variant, m.stage, m.slot, finite=False, coef=eng.clip_coef), deps)

    def run_offload_params(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        stage = ctx.variant.graph.stages[m.stage]
        return self._submit(m, lambda: self.offload_params(stage, m.slot), deps)

    def run_prefetch(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        eng = self.engine
        stage = ctx.variant.graph.stages[m.stage]
        if eng.deferred:  # the clipped updates step() started: the weights this copies must be final
            deps = deps + eng.deferred.deps_for({c.group for c in stage.slot.prefetch})
        return self._submit(m, lambda: self.prefetch(stage, m.slot, ctx.variant), deps)

    def run_forward(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        eng = self.engine
        stage = ctx.variant.graph.stages[m.stage]
        if eng.deferred and ctx.variant.device_groups:  # a persistent slot the clipped DU step() started updates in place
            deps = deps + eng.deferred.deps_for(set(stage.spec.grad_groups) & ctx.variant.device_groups)

        frees = eng.activation_stash.frees_at(ctx.variant.train, m.stage) if ctx.offloaded and ctx.grad else ()

        def run() -> None:
            if frees:  # (activation offload: the device copies of the AOs this forward waited for)
                eng.activation_stash.free_device_copies(ctx, frees)
            with CAPTURE_GATE.stage():
                eng._forward(ctx, stage, m.slot, m.keep_graph)

        return self._submit(m, run, deps)

    def run_offload_buffers(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        stage = ctx.variant.graph.stages[m.stage]
        return self._submit(m, lambda: self._offload_buffers(stage, m.slot), deps)

    def run_backward(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        eng = self.engine
        stage = ctx.variant.graph.stages[m.stage]
        grads_to = m.grads_to or "slot"

        def run() -> None:
            with CAPTURE_GATE.stage():
                eng._backward(ctx, stage, m.slot, cold, grads_to)

        return self._submit(m, run, deps)

    def run_offload_grad(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        eng = self.engine
        stage = ctx.variant.graph.stages[m.stage]
        if eng.delayed:  # the previous step's update still reads these host gradients
            deps = deps + eng.delayed.deps_for(stage.spec.grad_groups)
        return eng.gradients.offload(ctx, stage, m, deps, self._timed)

    def run_offload_activations(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """AO g (d2h): the stage's offloaded boundary values copied to host buffers, their device
        copies freed (:class:`~shfx.runtime.activations.ActivationStash`), or, with activations
        on the SSD, to window buffer ``m.buffer`` (:class:`~shfx.runtime.activations.ActivationWindow`)."""
        if m.buffer is not None:
            w, train = self._activation_window(ctx, m)
            return self._submit(m, lambda: w.offload(ctx, train, m.stage, m.buffer), deps)
        stash = self.engine.activation_stash
        ctx.stash = stash
        names = stash.names(ctx.variant.train, m.stage)
        return self._submit(m, lambda: stash.offload(ctx, names), deps)

    def run_fetch_activations(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """AF g (h2d): the values AO g offloaded (or AR g read back), on the device for B g."""
        eng = self.engine
        # (CUDA: the stream the step's compute runs on, the issuing thread's; the fetched tensors cross to it)
        compute = eng.backend.compute.current() if eng.backend.name == "cuda" else None
        if m.buffer is not None:
            w, train = self._activation_window(ctx, m)
            return self._submit(m, lambda: w.fetch(ctx, train, m.stage, m.buffer, compute), deps)
        stash = eng.activation_stash
        names = stash.names(ctx.variant.train, m.stage)
        return self._submit(m, lambda: stash.fetch(ctx, names, compute), deps)

    def _activation_window(self, ctx: StepContext, m: ActionMeta) -> tuple[Any, Any]:
        """The engine's activation window, ready for ``ctx``'s train program (its buffers and SSD
        store: made at its first use, :meth:`ActivationWindow.prepare`), and that program."""
        w = self.engine.activation_window
        if w is None:
            raise ScheduleError(
                f"{m.action}: the program sends activations to the SSD, but this model was compiled without a place for them; "
                "compile with offload=shfx.Offload(activations='nvme', path=...)"
            )
        train = ctx.variant.train
        w.prepare(train)
        ctx.act_window = w
        return w, train

    def _activation_streams(self) -> tuple[Any, Any]:
        """The SSD queues: the NVMe tier's when it exists (its transfers and the activations' run
        in issue order, one queue per direction), else the activation window's own."""
        eng = self.engine
        if eng.ssd is not None:
            return eng.ssd.read_stream, eng.ssd.write_stream
        return eng.activation_window.streams()

    def run_write_activations(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """AW g (ssd_write): window buffer ``m.buffer`` to the stage's extents on the SSD; the
        buffer is free when the token completes."""
        w, train = self._activation_window(ctx, m)
        stream = self._activation_streams()[1]
        return stream.submit(self._timed(lambda: w.write(ctx, train, m.stage, m.buffer), m), deps, str(m.action))

    def run_read_activations(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """AR g (ssd_read): the stage's extents into window buffer ``m.buffer``, for AF g."""
        w, train = self._activation_window(ctx, m)
        stream = self._activation_streams()[0]
        return stream.submit(self._timed(lambda: w.read(ctx, train, m.stage, m.buffer), m), deps, str(m.action))

    # ---- the transfers' tasks --------------------------------------------------------------------
    def prefetch(self, stage: Stage, slot: int, variant: Variant | None = None) -> None:
        """Copy the stage's parameters and buffers into ``slot``: from the host, or, for copies of
        a group updated on the device in a persistent owner's slot, from there (the host is stale)."""
        eng = self.engine
        for c in stage.slot.prefetch:
            dst = eng.pool.region(slot, c.slot_offset, c.nbytes)
            src = self._device_copy_source(variant, stage.index, c) if variant is not None else None
            if src is not None:
                dst.copy_(src)
            else:
                eng.backend.h2d_copy(dst, eng.store.group_bytes(c.group)[c.host_offset : c.host_offset + c.nbytes])

    def group_base(self, variant: Variant, group: int) -> tuple[int, int]:
        """(owner stage, offset of the group's first byte in the owner's slot): a group is laid
        out in its owner's slot as on the host."""
        eng = self.engine
        owner = variant.graph.stages[variant.owner_of[group]]
        grp = eng.store.groups[group]
        first = grp.infos[0].key
        return owner.index, owner.slot.offsets[first] - grp.offsets[first]

    def _device_copy_source(self, variant: Variant, stage: int, c: Any) -> torch.Tensor | None:
        """Where a borrowed copy's current values are on the device, if the host's are stale."""
        eng = self.engine
        if c.group not in variant.device_groups:
            return None
        owner, base = self.group_base(variant, c.group)
        if owner == stage or owner not in variant.train.persistent:
            return None  # the owner itself, or a transient owner that copies its update back (OP)
        return eng.pool.region(variant.train.persistent.index(owner), base + c.host_offset, c.nbytes)

    def _offload_buffers(self, stage: Stage, slot: int) -> None:
        eng = self.engine
        for c in stage.slot.buffers_out:
            dst = eng.store.group_bytes(c.group)[c.host_offset : c.host_offset + c.nbytes]
            eng.backend.d2h_copy(dst, eng.pool.region(slot, c.slot_offset, c.nbytes))

    # ---- the updates' tasks (DU on the device, U on the host) and what they read -----------------
    def device_step_task(
        self, variant: Variant, group: int, slot: int, finite: bool | None = None, coef: torch.Tensor | None = None
    ) -> Callable[[], None]:
        """DU: AdamW on the device for ``group``, in the slot of the stage owning it; with ``coef``
        (exact clipping, after the gate) the gradient is multiplied by it first."""
        eng = self.engine
        if eng.device_optimizer is None:
            return lambda: None
        hp = eng.optimizer.config.hyperparams()
        owner, base = self.group_base(variant, group)
        grp = eng.store.groups[group]

        persistent = owner in variant.train.persistent
        finite = eng.check_finite if finite is None else finite

        mixed = grp.dtypes.mixed
        scaler = eng.scaler

        def run() -> None:
            if eng.gradients.device_state.get(group, GRAD_NONE) != GRAD_VALID:
                return
            n = grp.trainable_bytes
            wide = None
            if mixed:
                # the eager recipe: master.grad = p16.grad.float(), unscaled (fp16) and clipped in
                # fp32; AdamW on the device's fp32 master; then p16.copy_(master) (DeviceAdamW)
                params = eng.pool.region(slot, base, n)
                grads = eng.gradients.device_grads(slot, base, n, torch.uint8)
                wide = self.device_grad32(variant, group, slot)  # (accumulating: the fp32 sum's copy)
                checked = wide
            else:
                params = eng.pool.region(slot, base, n).view(grp.dtypes.working)
                grads = self.device_grad32(variant, group, slot)  # (data parallel accumulating: the reduced sum)
                if coef is not None:
                    grads.mul_(coef.to(grads.device))
                checked = grads
            flag = eng.nonfinite_flags.get(group) if mixed and group in eng.unscaled else None  # (its US checked it)
            if finite and flag is None:
                # NOTE: the check stays on the device (a host read here would synchronize the
                # issuing thread with the GPU once per group): a non-finite gradient makes the
                # update a no-op there, and step() reads every group's flag at once
                flag = device_nonfinite(checked)
                eng.nonfinite_flags[group] = flag
            if wide is not None:
                if scaler is not None:
                    wide.div_(scaler.scale_tensor().to(wide.device))
                if coef is not None:
                    wide.mul_(coef.to(wide.device))
            eng.journal.before_device_update(group, params, (slot, base) if persistent else None)
            eng.device_optimizer.update(grp, params, grads, hp, found_inf=flag, wide=wide)
            eng.journal.done("device", group)
            eng.dirty.add(group)
            self._refresh_borrowers(variant, group)

        return run

    def _refresh_borrowers(self, variant: Variant, group: int) -> None:
        """Persistent borrowers (tied weights) of a device-updated group hold copies: refresh
        them from the owner's slot (every contributor's backward, the last reader of those
        copies this step, is done)."""
        eng = self.engine
        owner, base = self.group_base(variant, group)
        if owner not in variant.train.persistent:
            return
        slot = variant.train.persistent.index(owner)
        for k, s in enumerate(variant.train.persistent):
            if s == owner:
                continue
            for c in variant.graph.stages[s].slot.prefetch:
                if c.group == group:
                    eng.pool.region(k, c.slot_offset, c.nbytes).copy_(eng.pool.region(slot, base + c.host_offset, c.nbytes))

    def offload_params(self, stage: Stage, slot: int) -> None:
        """OP: the stage's updated parameters (its own group's trainable region) back to the host."""
        eng = self.engine
        g = stage.spec.update_group
        grp = eng.store.groups[g]
        base = stage.slot.offsets[grp.infos[0].key] - grp.offsets[grp.infos[0].key]
        eng.backend.d2h_copy(eng.store.group_bytes(g)[: grp.trainable_bytes], eng.pool.region(slot, base, grp.trainable_bytes))
        eng.dirty.discard(g)

    def update_task(self, group: int, check: bool = True, finite: bool | None = None) -> Callable[[], None]:
        """The host update of ``group``; with ``check``, only if its gradient is valid when the
        task runs (a delayed update was checked when issued: zero_grad() may run before it)."""
        eng = self.engine
        if eng.optimizer is None:
            return lambda: None
        hp = eng.optimizer.config.hyperparams()
        opt, store, journal = eng.optimizer, eng.store, eng.journal
        finite = eng.check_finite if finite is None else finite
        scaler, unscaled, whose = eng.scaler, eng.unscaled, self.whose(group, "host")

        ssd = eng.ssd if eng.ssd is not None and group in eng.ssd.groups else None

        def run() -> None:
            if not check or store.grad_state[group] == GRAD_VALID:
                if ssd is not None and not ssd.is_staged(group):
                    # every update is the program's, after its SSD_READ (each pass places them)
                    raise ScheduleError(
                        f"U{group} updates group {group}, whose optimizer state is on the SSD, but no SR{group} read it "
                        "into the host window first: the program misses the NVMe tier's transfers"
                    )
                body()

        def body() -> None:
            if finite and group not in unscaled:  # (a US action checked it already: fp16's loss-scaling pass)
                require_finite(store.grad(group), group, whose)
            journal.before_host_update(group)
            if scaler is not None and group not in unscaled:
                # as the fused kernel's grad_scale divides (bitwise alike); through .data, so
                # the exposed .grad views' version counters see no user edit
                store.grad(group).data.div_(scaler.scale_tensor())
                unscaled.add(group)
            if ssd is not None and group in ssd.paged:  # (the parameter tier: its state over this step's buffers)
                ssd.stage_paged(group)
            opt.update(group, hp)  # (mixed precision: also writes the 16-bit working copy, same pass)
            journal.done("host", group)

        return run

    def whose(self, group: int, where: str) -> str:
        """``group``'s gradient, in words: the stage owning it (``"stage 'blocks.2' (parameter
        group 3, on the host)"``)."""
        eng = self.engine
        v = eng.current
        name = ""
        if v is not None and group in v.owner_of:
            name = f"stage {v.graph.stages[v.owner_of[group]].name!r} "
        return f"{name}(parameter group {group}, on the {where})"

    def clip_groups(self) -> list[int]:
        """The groups a clipped step reads and updates (their gradient is valid: on the host, or
        on the device for a group updated there), in forward order (the order of the stages
        owning them)."""
        eng = self.engine
        v = eng.current
        dev = v.device_groups if v is not None else frozenset()
        if dev and any(v.owner_of[g] not in v.train.persistent for g in dev):
            raise UsageError(
                f"gradient clipping needs every gradient until the step's gate, but {v.train.name!r} updates groups "
                f"{sorted(dev)} on the device during the backward, in streamed stages whose gradients leave with the "
                "slot; use policy='resident', Stronghold(resident_first=...) or a policy updating on the host"
            )
        valid = eng.gradients.device_state
        groups = [
            gi for gi, g in enumerate(eng.store.groups)
            if g.trainable_bytes and (valid.get(gi) == GRAD_VALID if gi in dev else eng.store.grad_state[gi] == GRAD_VALID)
        ]  # fmt: skip
        if v is not None:
            groups.sort(key=lambda gi: v.owner_of.get(gi, gi))
        return groups
