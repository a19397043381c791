"""The interpreter: runs step programs on a backend.

The engine issues actions and owns the device side (slot pool, persistent stages, device
optimizer); the state of one forward call is a :class:`~shfx.runtime.context.StepContext`,
gradients are routed and accumulated by :class:`~shfx.runtime.gradients.GradientRouter`, and
ZeRO-Offload's delayed update is :class:`~shfx.runtime.delayed.DelayedUpdates`.

``Engine.forward`` issues a program's forward phase, ``Engine.backward`` its backward phase,
``Engine.step`` waits for (or issues) the host updates. Issuing a node means submitting its
action to its stream with the tokens of the nodes it depends on; the interpreter itself never
waits between nodes, only at the end of a phase. A failure anywhere surfaces in the caller as
:class:`shfx.errors.ActionError` naming the action, with the program printed and the failing
step marked; every other task of the phase has finished by then (no hang, nothing left
running against the host store).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from shfx.passes.actions import KINDS, ActionKind
from shfx.passes.attention import training_forward
from shfx.passes.capture import CAPTURE_GATE
from shfx.passes.meta import get_meta
from shfx.passes.partition import Stage
from shfx.passes.pipeline import Variant
from shfx.passes.program import ActionMeta, Program, ScheduleError
from shfx.passes.units import format_bytes

from ..errors import ActionError, NonFiniteGradient, OutOfDeviceMemory, UsageError
from .backend import Backend, MemoryEvent
from .clipping import Clipping
from .context import StepContext, fork_rng
from .data_parallel import DataParallelRuntime
from .delayed import DelayedUpdates
from .device_optim import DeviceAdamW
from .gradients import GradientRouter
from .host_optim import HostAdamW
from .host_store import GRAD_NONE, GRAD_VALID, HostStore
from .journal import StepJournal
from .slots import SlotPool
from .ssd_window import SSDWindow
from .streams import Cancelled, DependencyFailed, DeviceToken, DoneToken, JoinToken, Token, root_cause
from .tracing import StepTrace

__all__ = ["Engine", "StepContext", "MemoryEvent"]

# A forward longer than this recomputes with early stop (benchmarks/overhead.py on 2 CPU cores:
# early stop saved 3% on stages of ~8 ms and cost 23% on stages of ~0.5 ms).
_EARLY_STOP_MIN_S = 2e-3


def _check_finite(grad: torch.Tensor, group: int, where: str) -> None:
    """Raise :class:`NonFiniteGradient` when ``grad`` holds inf or NaN (a sum is inf or NaN
    then, and reads the buffer once without allocating a mask). ``where``: whose gradient, in
    words."""
    total = float(grad.sum(dtype=torch.float32)) if grad.numel() else 0.0
    if total != total or total in (float("inf"), float("-inf")):
        raise NonFiniteGradient(f"the gradient of {where} holds inf or NaN", group)


def _settle(tok: Token) -> None:
    """Wait at the end of a forward or backward phase until ``tok``'s outcome is known, without a
    host synchronization on the device's compute and prefetch work: those are only waited for
    until launched (their errors are known then; the caller's stream is the compute stream, so
    what the user does next is ordered after them on the device). Copies to the host and host
    work are waited for: the host reads what they write (``.grad``, buffers in the host store). A
    RELEASE only orders later device work: launched is enough."""
    if isinstance(tok, DeviceToken) and tok.stream.name in ("compute", "h2d"):
        tok.wait_launched()
    elif isinstance(tok, JoinToken):  # a RELEASE: what waits for it is device work, ordered by the stream
        tok.wait_launched()
    else:
        tok.wait()


def _state_note(phase: str, restored: list[int], applied: list[int], gradients: str) -> str:
    """What a failed or interrupted step left behind, and how to go on."""
    if applied:
        return (
            f"The {phase} failed after the updates of parameter groups {applied} had run, and rollback is off "
            "(shfx.compile(rollback=False)): those groups are updated and the others are not, so the training "
            "state is inconsistent. Reload the last checkpoint (model and optimizer state) to go on exactly; "
            + ("calling cm.step() again applies only the updates that did not run." if gradients == "kept" else "")
        ).rstrip("; ")
    state = (
        f"The step was not applied: the updates that had run (parameter groups {restored}) were rolled back, "
        if restored
        else "The step was not applied: no update had run, "
    ) + "so the weights and optimizer states are exactly as before it"
    if gradients == "kept":
        return state + "; the gradients are kept: call cm.step() again to apply the step, or cm.zero_grad() to drop it."
    return state + ", and the gradients of this step were cleared (as by zero_grad()): run the step again from its first forward."


def _with_note(err: BaseException, note: str) -> BaseException:
    """``err`` with ``note`` added: to the message of shfx's errors, as a note (shown under the
    traceback) on others, such as ``KeyboardInterrupt``, which keep their type."""
    if isinstance(err, OutOfDeviceMemory):
        e = OutOfDeviceMemory(
            f"{err}\n\n{note}", needed_bytes=err.needed_bytes, used_bytes=err.used_bytes,
            capacity_bytes=err.capacity_bytes, what=err.what,
        )  # fmt: skip
        e.__cause__ = err.__cause__
        return e
    if isinstance(err, ActionError):
        msg = str(err)
        head, sep, program = msg.partition("\n\n")
        e = ActionError(f"{head}\n\n{note}{sep}{program}", err.action)
        e.__cause__ = err.__cause__
        return e
    err.add_note(note)
    return err


def _ordinal(n: int) -> str:
    """1 -> '1st', 2 -> '2nd', 11 -> '11th', 23 -> '23rd'."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _own_version(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a tensor with an autograd version counter of its own.

    NOTE: a stage's parameters and buffers are views of one slot tensor and share its version
    counter. A buffer updated in place during the forward (BatchNorm's ``num_batches_tracked``)
    then counts as a change to every parameter and buffer the forward saved before it (a
    weight, another BatchNorm's running statistics), and the backward of a stage that kept its
    graph refuses them ("modified by an inplace operation"). The slot is not rewritten while
    the graph lives (the program's edges see to it), so each tensor gets a counter of its own:
    autograd still sees a change to the tensor itself."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def _oom_in(err: OutOfDeviceMemory, where: str) -> OutOfDeviceMemory:
    """The same out-of-memory error, saying where in the step it happened."""
    return OutOfDeviceMemory(
        f"{err} This happened in {where}.",
        needed_bytes=err.needed_bytes,
        used_bytes=err.used_bytes,
        capacity_bytes=err.capacity_bytes,
        what=err.what,
    )


class StepPhase:
    """What the actions ``step()`` issues see of their step (the step and next-forward phases):
    the variant, and each issued node's token (their dependencies on the backward's actions
    are done: those are left out)."""

    def __init__(self, variant: Variant) -> None:
        self.variant = variant
        self.env: dict[fx.Node, Token] = {}
        self.accumulation = None


class Engine:
    """Runs the programs of a compiled model on one backend, host store and slot pool."""

    def __init__(
        self,
        backend: Backend,
        store: HostStore,
        optimizer: HostAdamW | None,
        *,
        grad_accum_steps: int = 1,
        overlap_update: bool = True,
        delayed_update: bool = False,
        rollback: bool = True,
        skip_nonfinite: bool = False,
        scaler: Any = None,
        max_grad_norm: float | None = None,
        norm_type: float = 2.0,
        recompute: str = "auto",
        dp: DataParallelRuntime | None = None,
        param_keys_by_group: dict[int, list] | None = None,
        clip_order: Sequence[tuple[int, str]] = (),
    ):
        """Everything comes from ``shfx.compile``'s :class:`~shfx.config.Config` (the compiled
        model passes its fields) and the host store: ``param_keys_by_group`` is group -> its
        trainable ``(key, tensor)`` pairs, ``clip_order`` every trainable parameter's ``(group,
        key)`` in the model's order (gradient clipping stacks the norms in it, as torch does)."""
        self.backend = backend
        self.store = store
        self.optimizer = optimizer
        self.pool: SlotPool | None = None
        self.grad_accum_steps = grad_accum_steps
        self.overlap_update = overlap_update
        # ZeRO-Offload's delayed parameter update (shfx.runtime.delayed)
        self.delayed_update = delayed_update
        self.delayed = DelayedUpdates()
        self.holder: StepContext | None = None  # context whose stages are resident
        self.backward_calls = 0
        self.pending_updates: list[tuple[str, Token]] = []
        self.trace = StepTrace(backend)  # the last step's actions (shfx.cost_model.trace.Event), device-timed
        self.tracing = True
        # "early-stop": forward records the graph (checkpoint), backward recomputes only what it
        # needs; "full": backward recomputes the whole stage; "auto": early stop for stages whose
        # forward takes more than _EARLY_STOP_MIN_S (its bookkeeping costs ~0.5 ms a stage on a CPU)
        self.recompute = recompute
        self._forward_s: dict[int, float] = {}  # id(stage) -> last measured forward seconds
        self.param_keys_by_group: dict[int, list] = dict(param_keys_by_group or {})
        self.device_optimizer = DeviceAdamW(backend, optimizer.config) if optimizer is not None else None
        # what the updates of the current step changed, to undo a step that fails or is skipped
        self.journal = StepJournal(store, optimizer, self.device_optimizer, enabled=rollback)
        # the NVMe tier's host window (shfx.runtime.ssd_window): attach_ssd() at the first program
        # with SSD transfers (shfx.compile(offload=...))
        self.ssd: SSDWindow | None = None
        # data parallel (shfx.runtime.data_parallel; shfx.compile(data_parallel=...)), or None
        self.dp: DataParallelRuntime | None = dp
        self.skip_nonfinite = skip_nonfinite
        # every update checks its gradient first (a sum over it): inf or NaN skips the step
        # (skip_nonfinite, fp16) or fails it with an error naming the stage
        self.check_finite = True
        self.unscaled: set[int] = set()  # fp16: groups whose host gradient is unscaled this step
        # fp16: the loss scaler (shfx.amp.LossScaler); backward seeds the loss gradient with its
        # scale, the host update unscales, an overflow skips the step and backs the scale off
        self.scaler = scaler
        self.prescaled = False  # the next backward's loss gradient was scaled by cm.scale_loss
        self.skipped_steps = 0  # steps skipped for a non-finite gradient
        # device-updated groups' non-finite flags (device tensors, 1.0: inf or NaN; the update was
        # a no-op), read by step() at once
        self.nonfinite_flags: dict[int, torch.Tensor] = {}
        self.last_step_skipped = False
        # set while a failed or interrupted step is abandoned: tasks not started yet are skipped
        self.cancel = threading.Event()
        self.interrupted = False  # Ctrl-C came while a phase ran (see _deferred_interrupt)
        self.gradients = GradientRouter(self)
        # exact global-norm gradient clipping (docs/usage.md, "Gradient clipping"): the GN, NR and
        # CK actions' state (shfx.runtime.clipping)
        self.clipping = Clipping(self, max_grad_norm, norm_type)
        self.clip_coef: torch.Tensor | None = None  # the gate's clip coefficient, read by the clipped updates
        # False while step() issues updates whose gradients it checked first (they skip their own check)
        self.step_checked: bool | None = None
        # the clipped updates step() started: they run during the next forward, whose prefetch
        # of a stage waits for the updates of the groups it reads
        self.deferred = DelayedUpdates()
        self.dirty: set[int] = set()  # groups whose device weights are newer than the host's
        self.loaded: Variant | None = None  # the variant whose persistent stages are on the device
        self.current: Variant | None = None  # the variant of the last forward
        self.step_times: list[float] = []  # measured: first train forward of a step -> step() end
        self.last_step_window: tuple[float, float] | None = None  # (start, end) of the last one
        self._step_t0: float | None = None
        self._profiling = False  # steps run inside profiling() are not the user's
        # the interpreter's dispatch table: one handler per kind of action
        self._handlers = {kind: getattr(self, f"_run_{info.name}") for kind, info in KINDS.items()}
        self.clip_order = list(clip_order)  # (group, key) of each trainable parameter, in model order

    # ---- setup -----------------------------------------------------------------------------
    def ensure_pool(self, sizes: list[int], grad_sizes: Sequence[int] = ()) -> None:
        """Make slot ``k`` hold at least ``sizes[k]`` bytes, and its gradient buffer
        ``grad_sizes[k]`` (for backwards that write gradients beside the parameters)."""
        if self.pool is None:
            self.pool = SlotPool(self.backend, sizes)
        elif len(sizes) > self.pool.num_slots or any(n > m for n, m in zip(sizes, self.pool.sizes)):
            self._evict()
            if self.loaded is not None and self.loaded.train.persistent:
                self.sync_to_host()
                self.loaded = None  # persistent stages reload into the new slots
            self.pool.resize(sizes)
        self.gradients.ensure_buffers(grad_sizes)

    def attach_ssd(self, window: SSDWindow) -> None:
        """Run the NVMe tier through ``window`` (made by the compiled model at the first program
        with SSD transfers: the tier's groups are known from it)."""
        self.ssd = window

    def mark_prescaled(self) -> None:
        """The loss gradient of the backward running now is scaled already (``cm.scale_loss``)."""
        self.prescaled = True

    @contextlib.contextmanager
    def profiling(self) -> Iterator[None]:
        """Steps run inside are the profiler's, not the user's: they start no step clock (so
        ``step_times`` and the report's measured steps stay the user's), and the slot pool is
        given back to its sizes on exit (profiling may borrow device memory)."""
        sizes = list(self.pool.sizes) if self.pool is not None else []
        self._profiling, prev = True, self._profiling
        try:
            yield
        finally:
            self._profiling = prev
            if self.pool is not None:
                self.pool.set_sizes(sizes)

    def record_memory(self) -> contextlib.AbstractContextManager[list[MemoryEvent]]:
        """Record every device reservation and release in the block, each with its
        memory-ledger term and the event of the step it happened in (``"setup"``, ``"forward
        start"``, an action such as ``"F3"``, ``"backward start"``, ``"end"``)::

            with cm.engine.record_memory() as log:
                cm(x, y).backward()
        """
        return self.backend.recording()

    def host_bytes(self) -> int:
        """Host memory the runtime holds: the host store (weights, gradients), the host
        optimizer's states, the staging buffers, the buffers borrowed gradients wait in and, under
        data parallel, the local-gradient and collective buffers."""
        states = 0
        if self.optimizer is not None:
            states = sum(
                t.numel() * t.element_size()
                for g, st in list(self.optimizer.state.items())
                if self.ssd is None or g not in self.ssd.groups  # (staged: views of the window's buffers)
                for t in st.tensors()
                if t.dim()  # not the 0-dim step counters (the memory ledger does not count them)
            )
        if self.ssd is not None:
            states += self.ssd.host_bytes
        return (
            self.store.host_bytes + states + self.store.staging_bytes + self.gradients.pending_host_bytes
            + self.journal.host_bytes + (self.dp.buffer_bytes if self.dp is not None else 0)
        )  # fmt: skip

    # ---- issuing -----------------------------------------------------------------------------
    def _timed(self, fn: Callable[[], None], meta: ActionMeta) -> Callable[[], None]:
        """The task of an action: its device reservations belong to it (a memory recording
        names it), and, when tracing, its start and end are traced (an OFFLOAD_GRAD's copy
        only: its event has no ``copy_end``, its ``end`` is when the slot's reads ended).

        NOTE: tracing the accumulation too would make an OFFLOAD_GRAD's ``end`` the end of the
        accumulation, as the simulator's; readers of ``trace`` (tests/test_runtime.py's
        residency check) take an OFFLOAD_GRAD's ``end`` as the last read of its slot."""
        label, backend, cancel = str(meta.action), self.backend, self.cancel
        if not self.tracing:
            return self._task(label, fn)
        trace = self.trace

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

    def _task(self, label: str, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn`` as a task named ``label`` (an action not traced, an update started by step()):
        skipped while a step is abandoned, its reservations named ``label``."""
        backend, cancel = self.backend, self.cancel

        def run() -> None:
            if cancel.is_set():
                raise Cancelled(f"{label} was not run: the step is being abandoned")
            with backend.during(label):
                fn()

        return run

    def _issue(
        self,
        ctx: StepContext,
        program: Program,
        nodes: Sequence[fx.Node],
        cold: bool,
        skip_updates: bool,
        serial: bool = False,
        into: list[tuple[fx.Node, Token]] | None = None,
    ) -> list[tuple[fx.Node, Token]]:
        """Issue ``nodes`` in order, appending ``(node, token)`` to ``into`` as they are issued
        (so an interrupt part-way leaves the caller every token to wait for); with ``serial``
        each waits for the previous one to finish (the profiler times actions in isolation)."""
        issued: list[tuple[fx.Node, Token]] = [] if into is None else into
        for node in nodes:
            meta = get_meta(node)
            if KINDS[meta.kind].update and skip_updates:
                continue
            deps = [ctx.env[d] for d in program.deps(node) if d in ctx.env]
            try:
                tok = self._issue_action(ctx, meta, deps, cold)
            except BaseException as e:  # synchronous failure (CUDA issue path, bad state)
                tok = DoneToken(str(meta.action), e)
            tok.label = str(meta.action)
            ctx.env[node] = tok
            issued.append((node, tok))
            if KINDS[meta.kind].update:
                self.pending_updates.append((str(meta.action), tok))
            if serial:
                tok.wait()
        return issued

    def _issue_action(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        return self._handlers[m.kind](ctx, m, deps, cold)

    def _submit(self, m: ActionMeta, fn: Callable[[], None], deps: list[Token]) -> Token:
        """Run ``fn`` on the action's stream (:data:`shfx.passes.actions.KINDS`) after ``deps``."""
        stream = getattr(self.backend, KINDS[m.kind].stream)
        return stream.submit(self._timed(fn, m), deps, str(m.action))

    # ---- one handler per action kind (``_run_<KINDS[kind].name>``) ------------------------------
    def _run_release(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        return JoinToken([d.reads_done for d in deps], str(m.action))

    def _ssd_window(self, m: ActionMeta) -> SSDWindow:
        if self.ssd is None:
            raise ScheduleError(
                f"{m.action}: the program reads and writes optimizer states on the SSD, but this model has no SSD store; "
                "compile with offload=shfx.Offload(optimizer='nvme', path=...)"
            )
        return self.ssd

    def _run_ssd_read(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """SR g: the group's states into host-window buffer ``m.buffer``, on the window's read
        stream; the token completes when the reads did (:meth:`SSDWindow.read`)."""
        w = self._ssd_window(m)
        return w.read_stream.submit(self._timed(lambda: w.read(m.stage, m.buffer), m), deps, str(m.action))

    def _run_ssd_write(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """SW g: the group's states back to the SSD; its buffer is free when the token completes."""
        w = self._ssd_window(m)
        return w.write_stream.submit(self._timed(lambda: w.write(m.stage), m), deps, str(m.action))

    def _data_parallel(self, m: ActionMeta) -> DataParallelRuntime:
        if self.dp is None:
            raise ScheduleError(
                f"{m.action}: the program is data parallel, but this model was compiled without it; compile with "
                "shfx.compile(..., data_parallel=True) under torch.distributed"
            )
        return self.dp

    def _run_reduce_grads(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """RS g (queue ``reduce``, every backward): the group's local gradient, complete once the
        OGs it waits for ran, reduce-scattered into this rank's gradient shard (copied at the
        first micro-step, added at later ones)."""
        dp, store, g = self._data_parallel(m), self.store, m.stage

        def run() -> None:
            acc = ctx.accumulation
            local = acc.local.pop(g, None) if acc is not None else None
            dp.reduce_grads(str(m.action), g, local, first=store.grad_state[g] == GRAD_NONE)
            store.grad_state[g] = GRAD_VALID

        return self._submit(m, run, deps)

    def _run_gather_params(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """AG g (queue ``gather``, after U g): the updated shards of the group's working copy
        from every rank into the host image."""
        dp = self._data_parallel(m)
        return self._submit(m, lambda: dp.gather_params(str(m.action), m.stage), deps)

    def _run_cpu_step(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        if self.clip_coef is None or m.phase not in ("step", "next-forward"):
            return self._submit(m, self._update_task(m.stage, finite=self.step_checked), deps)
        # after the gate: scale the gradient by the clip coefficient, then update
        g, coef, update = m.stage, self.clip_coef, self._update_task(m.stage, check=False, finite=False)
        store = self.store

        def run() -> None:
            store.grad(g).data.mul_(coef)  # as clip_grad_norm_'s _foreach_mul_ (through .data: no user edit)
            update()

        return self._submit(m, run, deps)

    def _run_grad_norm(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        return self._submit(m, lambda: self.clipping.record(m.stage), deps)

    def _run_norm_reduce(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """NR0 (data parallel, the reduce queue): every parameter's norm on every rank."""
        self._data_parallel(m)
        return self._submit(m, self.clipping.reduce_across_ranks, deps)

    def _run_check(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        """CK0, the step's gate: the total norm and the clip coefficient, read by step()."""
        return self._submit(m, lambda: self.clipping.check(self._clip_groups()), deps)

    def _run_device_step(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        return self._submit(m, self._device_step_task(ctx.variant, m.stage, m.slot, finite=self.step_checked), deps)

    def _run_offload_params(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        stage = ctx.variant.graph.stages[m.stage]
        return self._submit(m, lambda: self._offload_params(stage, m.slot), deps)

    def _run_prefetch(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        stage = ctx.variant.graph.stages[m.stage]
        if self.deferred:  # the clipped updates step() started: the weights this copies must be final
            deps = deps + self.deferred.deps_for({c.group for c in stage.slot.prefetch})
        return self._submit(m, lambda: self._prefetch(stage, m.slot, ctx.variant), deps)

    def _run_forward(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        stage = ctx.variant.graph.stages[m.stage]

        def run() -> None:
            with CAPTURE_GATE.stage():
                self._forward(ctx, stage, m.slot, m.keep_graph)

        return self._submit(m, run, deps)

    def _run_offload_buffers(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        stage = ctx.variant.graph.stages[m.stage]
        return self._submit(m, lambda: self._offload_buffers(stage, m.slot), deps)

    def _run_backward(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        stage = ctx.variant.graph.stages[m.stage]
        grads_to = m.grads_to or "slot"

        def run() -> None:
            with CAPTURE_GATE.stage():
                self._backward(ctx, stage, m.slot, cold, grads_to)

        return self._submit(m, run, deps)

    def _run_offload_grad(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        stage = ctx.variant.graph.stages[m.stage]
        if self.delayed:  # the previous step's update still reads these host gradients
            deps = deps + self.delayed.deps_for(stage.spec.grad_groups)
        return self.gradients.offload(ctx, stage, m, deps, self._timed)

    # ---- actions ----------------------------------------------------------------------------
    def _prefetch(self, stage: Stage, slot: int, variant: Variant | None = None) -> None:
        """Copy the stage's parameters and buffers into ``slot``: from the host, or, for copies of
        a group updated on the device in a persistent owner's slot, from there (the host is stale)."""
        for c in stage.slot.prefetch:
            dst = self.pool.region(slot, c.slot_offset, c.nbytes)
            src = self._device_copy_source(variant, stage.index, c) if variant is not None else None
            if src is not None:
                dst.copy_(src)
            else:
                self.backend.h2d_copy(dst, self.store.group_bytes(c.group)[c.host_offset : c.host_offset + c.nbytes])

    def _group_base(self, variant: Variant, group: int) -> tuple[int, int]:
        """(owner stage, offset of the group's first byte in the owner's slot): a group is laid
        out in its owner's slot as on the host."""
        owner = variant.graph.stages[variant.owner_of[group]]
        grp = self.store.groups[group]
        first = grp.infos[0].key
        return owner.index, owner.slot.offsets[first] - grp.offsets[first]

    def _device_copy_source(self, variant: Variant, stage: int, c: Any) -> torch.Tensor | None:
        """Where a borrowed copy's current values are on the device, if the host's are stale."""
        if c.group not in variant.device_groups:
            return None
        owner, base = self._group_base(variant, c.group)
        if owner == stage or owner not in variant.train.persistent:
            return None  # the owner itself, or a transient owner that copies its update back (OP)
        return self.pool.region(variant.train.persistent.index(owner), base + c.host_offset, c.nbytes)

    def _offload_buffers(self, stage: Stage, slot: int) -> None:
        for c in stage.slot.buffers_out:
            dst = self.store.group_bytes(c.group)[c.host_offset : c.host_offset + c.nbytes]
            self.backend.d2h_copy(dst, self.pool.region(slot, c.slot_offset, c.nbytes))

    def _forward(self, ctx: StepContext, stage: Stage, slot: int, keep_graph: bool) -> None:
        g = ctx.variant.graph
        views = self.pool.views(slot, stage, g)
        params = [views[k] for k in stage.params]
        bufs = [views[k] for k in stage.buffers]
        ins = [ctx.values[v] for v in stage.inputs]
        # NOTE: a stage the program runs no backward of (frozen, and no gradient flows through
        # it: the bottom of a fine-tuned model) runs as in inference, keeping nothing for one
        grad = ctx.grad and stage.index in ctx.backward_stages
        keep = grad and keep_graph
        if grad:
            ctx.rng[stage.index] = self.backend.get_rng_state()
            if stage.mutated_buffers and not keep:
                ctx.keep_pre_buffers(stage.index, [views[k].clone() for k in stage.mutated_buffers])
        if keep:
            trainable = set(stage.trainable)
            with torch.enable_grad():
                pleaves = [_own_version(p).requires_grad_(k in trainable) for k, p in zip(stage.params, params)]
                ileaves = [
                    x.detach().requires_grad_(True) if g.values[v].differentiable else x for v, x in zip(stage.inputs, ins)
                ]
                outs = stage.gm(*pleaves, *[_own_version(b) for b in bufs], *ileaves)
            ctx.saved[stage.index] = (outs, pleaves, ileaves)
        elif grad and self._early_stop(stage):
            # NOTE: the forward records its autograd graph without keeping activations
            # (non-reentrant torch.utils.checkpoint); the backward recomputes only until every
            # tensor it needs exists (a block's last matmul is not redone). Parameters and
            # buffers reach the stage through a holder, not as checkpoint inputs: the backward
            # points the holder at the slot the stage is in then (the forward's slot has been
            # reused), and checkpoint's version checks see only the activation inputs (what
            # the stage's ops save goes through checkpoint's hooks, not the slot).
            trainable = set(stage.trainable)
            holder = {
                "params": [p.detach().requires_grad_(k in trainable) for k, p in zip(stage.params, params)],
                "buffers": list(bufs),
            }
            pleaves = holder["params"]

            def run(*inputs: torch.Tensor, holder=holder, gm=stage.gm):
                return gm(*holder["params"], *holder["buffers"], *inputs)

            ileaves = [
                x.detach().requires_grad_(True) if g.values[v].differentiable else x for v, x in zip(stage.inputs, ins)
            ]
            with torch.enable_grad():
                outs = torch.utils.checkpoint.checkpoint(
                    run, *ileaves, use_reentrant=False, preserve_rng_state=True, determinism_check="none"
                )
            ctx.checkpointed[stage.index] = (outs, pleaves, ileaves, holder)
        else:
            t0 = time.perf_counter()
            if grad:
                # a training forward without autograd (recomputed in the backward): run as eager's
                # training forward would, where an op's kernel depends on it: the parameters
                # flagged requires_grad (matmul's folding reads it), attention under autograd
                # (passes/attention.py sdpa_as_trained)
                trainable = set(stage.trainable)
                params = [p.detach().requires_grad_(k in trainable) for k, p in zip(stage.params, params)]
            with torch.no_grad(), (training_forward() if grad else contextlib.nullcontext()):
                outs = stage.gm(*params, *bufs, *ins)
            self._forward_s[id(stage)] = time.perf_counter() - t0
        for v, o in zip(stage.outputs, outs):
            ctx.put(v, o.detach())
        for v in stage.inputs:
            if not ctx.grad or v in ctx.forward_only:
                ctx.fwd_left[v] -= 1
                if ctx.fwd_left[v] == 0 and v not in g.outputs:
                    ctx.drop(v)

    def _early_stop(self, stage: Stage) -> bool:
        if self.recompute != "auto":
            return self.recompute == "early-stop"
        if self.backend.name != "emulated":
            return True  # stage times on a GPU dwarf the bookkeeping, which overlaps the kernels
        return self._forward_s.get(id(stage), 0.0) > _EARLY_STOP_MIN_S

    def _backward(self, ctx: StepContext, stage: Stage, slot: int, cold: bool, grads_to: str = "slot") -> None:
        g = ctx.variant.graph
        s = stage.index
        gouts = [ctx.grads.get(v) for v in stage.outputs]
        try:
            if all(x is None for x in gouts):
                ctx.no_grads.add(s)
                return
            saved = None if cold else ctx.saved.pop(s, None)
            views = self.pool.views(slot, stage, g)
            ckpt = ctx.checkpointed.pop(s, None)
            if saved is not None:
                outs, pleaves, ileaves = saved
            elif ckpt is not None:
                outs, pleaves, ileaves, holder = ckpt
                trainable = set(stage.trainable)
                pre = dict(zip(stage.mutated_buffers, ctx.pre_buffers.get(s, [])))
                # the recompute reads the slot the stage is in now, and pre-forward buffer values
                holder["params"] = [views[k].detach().requires_grad_(k in trainable) for k in stage.params]
                holder["buffers"] = [pre.get(k, views[k]) for k in stage.buffers]
            else:
                trainable = set(stage.trainable)
                pre = dict(zip(stage.mutated_buffers, ctx.pre_buffers.get(s, [])))
                bufs = [pre.get(k, views[k]) for k in stage.buffers]
                with torch.enable_grad(), fork_rng(self.backend, ctx.rng.get(s)):
                    pleaves = [views[k].detach().requires_grad_(k in trainable) for k in stage.params]
                    ileaves = [
                        ctx.values[v].detach().requires_grad_(True) if g.values[v].differentiable else ctx.values[v]
                        for v in stage.inputs
                    ]
                    outs = stage.gm(*pleaves, *bufs, *ileaves)
            pairs = [(o, x) for o, x in zip(outs, gouts) if x is not None and isinstance(o, torch.Tensor) and o.requires_grad]
            in_idx = [i for i, x in enumerate(ileaves) if isinstance(x, torch.Tensor) and x.requires_grad]
            p_idx = [i for i, p in enumerate(pleaves) if p.requires_grad]
            wrt = [ileaves[i] for i in in_idx] + [pleaves[i] for i in p_idx]
            # NOTE: an input that later stages also read (the encoder output every decoder block
            # cross-attends to) already has their gradient. Eager autograd adds each use's
            # contribution to one running sum, later uses first: ((g_late + g_a) + g_b). Adding
            # this stage's own sum afterwards, g_late + (g_a + g_b), rounds differently; so the
            # running sum enters this stage's autograd as the gradient of an alias of the input
            # made last (the highest sequence number runs first) and arrives before the stage's
            # own contributions.
            seeded = [i for i in in_idx if stage.inputs[i] in ctx.grads] if pairs else []
            if seeded:
                with torch.enable_grad():
                    pairs += [(ileaves[i].view_as(ileaves[i]), ctx.grads[stage.inputs[i]]) for i in seeded]
            if pairs and wrt:
                grads = torch.autograd.grad([o for o, _ in pairs], wrt, [x for _, x in pairs], allow_unused=True)
            else:
                grads = (None,) * len(wrt)
            for i, gr in zip(in_idx, grads[: len(in_idx)]):
                if gr is not None:
                    if i in seeded:
                        ctx.replace_grad(stage.inputs[i], gr)
                    else:
                        ctx.add_grad(stage.inputs[i], gr)
            self.gradients.write(ctx, stage, slot, views, [stage.params[i] for i in p_idx], grads[len(in_idx) :], grads_to)
        finally:
            ctx.saved.pop(s, None)
            ctx.drop_pre_buffers(s)
            for v in stage.outputs:
                ctx.drop_grad(v)
            for v in ctx.free_after_b.get(s, []):
                ctx.drop(v)

    def _device_step_task(self, variant: Variant, group: int, slot: int, finite: bool | None = None) -> Callable[[], None]:
        """DU: AdamW on the device for ``group``, in the slot of the stage owning it."""
        if self.device_optimizer is None:
            return lambda: None
        hp = self.optimizer.config.hyperparams()
        owner, base = self._group_base(variant, group)
        grp = self.store.groups[group]

        persistent = owner in variant.train.persistent
        finite = self.check_finite if finite is None else finite

        def run() -> None:
            if self.gradients.device_state.get(group, GRAD_NONE) != GRAD_VALID:
                return
            n = grp.trainable_bytes
            params = self.pool.region(slot, base, n).view(grp.dtypes.working)
            grads = self.gradients.device_grads(slot, base, n, grp.dtypes.device_grad)
            flag = None
            if finite:
                # NOTE: the check stays on the device (a host read here would synchronize the
                # issuing thread with the GPU once per group): a non-finite gradient makes the
                # update a no-op there, and step() reads every group's flag at once
                flag = torch.isfinite(grads.sum(dtype=torch.float32)).logical_not().to(torch.float32)
                self.nonfinite_flags[group] = flag
            self.journal.before_device_update(group, params, (slot, base) if persistent else None)
            self.device_optimizer.update(grp, params, grads, hp, found_inf=flag)
            self.journal.done("device", group)
            self.dirty.add(group)
            self._refresh_borrowers(variant, group)

        return run

    def _refresh_borrowers(self, variant: Variant, group: int) -> None:
        """Persistent borrowers (tied weights) of a device-updated group hold copies: refresh
        them from the owner's slot (every contributor's backward, the last reader of those
        copies this step, is done)."""
        owner, base = self._group_base(variant, group)
        if owner not in variant.train.persistent:
            return
        slot = variant.train.persistent.index(owner)
        for k, s in enumerate(variant.train.persistent):
            if s == owner:
                continue
            for c in variant.graph.stages[s].slot.prefetch:
                if c.group == group:
                    self.pool.region(k, c.slot_offset, c.nbytes).copy_(self.pool.region(slot, base + c.host_offset, c.nbytes))

    def _offload_params(self, stage: Stage, slot: int) -> None:
        """OP: the stage's updated parameters (its own group's trainable region) back to the host."""
        g = stage.spec.update_group
        grp = self.store.groups[g]
        base = stage.slot.offsets[grp.infos[0].key] - grp.offsets[grp.infos[0].key]
        self.backend.d2h_copy(self.store.group_bytes(g)[: grp.trainable_bytes], self.pool.region(slot, base, grp.trainable_bytes))
        self.dirty.discard(g)

    def sync_to_host(self) -> None:
        """Copy the weights updated on the device (persistent stages) back to the host store."""
        v = self.loaded
        if v is None or not self.dirty:
            return
        toks = []
        for g in sorted(self.dirty):
            st = v.graph.stages[v.owner_of[g]]
            slot = v.train.persistent.index(st.index)
            toks.append(self.backend.d2h.submit(lambda st=st, slot=slot: self._offload_params(st, slot)))
        for t in toks:
            t.wait()
        errors = [t.error for t in toks if t.error is not None]
        if errors:
            raise errors[0]

    def _ensure_persistent(self, variant: Variant) -> None:
        """Load the variant's persistent stages into their slots (once; again after another
        variant or new weights took them)."""
        if self.loaded is variant:
            return
        self.await_deferred()
        self.finish_delayed(refresh=False)  # the host weights must be final before loading them
        self.sync_to_host()
        self.loaded = None
        toks = [
            self.backend.h2d.submit(lambda st=variant.graph.stages[s], k=k: self._prefetch(st, k))
            for k, s in enumerate(variant.train.persistent)
        ]
        for t in toks:
            t.wait()
        errors = [t.error for t in toks if t.error is not None]
        if errors:
            raise errors[0]
        self.loaded = variant

    def replace_variant(self, old: Variant, new: Variant) -> None:
        """``new`` takes ``old``'s place between steps (a retune rebuilt its programs): weights
        updated on the device go back to the host and the persistent stages reload at the next
        forward, the optimizer states of groups that change sides (host <-> device) move with
        them, and the slot pool takes ``new``'s sizes (another signature's grow it back)."""
        if self.pending_updates or self.holder is not None:
            raise UsageError("the programs can only change between steps; finish the step (backward, cm.step()) first")
        self.await_deferred()
        self.finish_delayed(refresh=False)
        self.sync_to_host()
        self.loaded = None
        if self.current is old:
            self.current = new
        if self.optimizer is not None and self.device_optimizer is not None:
            for g in sorted(old.device_groups - new.device_groups):
                st = self.device_optimizer.take(g)
                if st is not None:
                    self.optimizer.put(g, *st)
            for g in sorted(new.device_groups - old.device_groups):
                st = self.optimizer.take(g)
                if st is not None:
                    self.device_optimizer.put(self.store.groups[g], *st)
        for g in old.device_groups ^ new.device_groups:
            self.gradients.device_state.pop(g, None)
        if self.pool is not None:
            self.pool.set_sizes(list(new.slot_sizes))

    def invalidate_device_weights(self) -> None:
        """The host weights changed (load_state_dict): persistent stages reload before the next step."""
        self.await_deferred()
        self.wait_delayed()
        self.delayed.clear()
        self.dirty.clear()
        self.loaded = None

    def _update_task(self, group: int, check: bool = True, finite: bool | None = None) -> Callable[[], None]:
        """The host update of ``group``; with ``check``, only if its gradient is valid when the
        task runs (a delayed update was checked when issued: zero_grad() may run before it)."""
        if self.optimizer is None:
            return lambda: None
        hp = self.optimizer.config.hyperparams()
        opt, store, journal = self.optimizer, self.store, self.journal
        finite = self.check_finite if finite is None else finite
        scaler, unscaled, whose = self.scaler, self.unscaled, self._whose(group, "host")

        ssd = self.ssd if self.ssd is not None and group in self.ssd.groups else None

        def run() -> None:
            if not check or store.grad_state[group] == GRAD_VALID:
                if ssd is not None and not ssd.is_staged(group):
                    # an update outside the program's SR/SW (step() without overlap, clipping's
                    # deferred updates): read, update and write back here
                    with ssd.staged(group):
                        body()
                else:
                    body()

        def body() -> None:
            if finite:
                _check_finite(store.grad(group), group, whose)
            journal.before_host_update(group)
            if scaler is not None and group not in unscaled:
                # as the fused kernel's grad_scale divides (bitwise alike); through .data, so
                # the exposed .grad views' version counters see no user edit
                store.grad(group).data.div_(scaler.scale_tensor())
                unscaled.add(group)
            opt.update(group, hp)  # (mixed precision: also writes the 16-bit working copy, same pass)
            journal.done("host", group)

        return run

    # ---- waiting and errors ------------------------------------------------------------------
    def _failure(self, program: Program, issued: list[tuple[fx.Node, Token]]) -> BaseException | None:
        """The error to raise for a phase whose tasks have all finished, or None: the root
        cause (the first failure that is neither a skip nor a cancellation) wrapped in an
        :class:`ActionError` naming the action and showing the program, an
        :class:`OutOfDeviceMemory` saying where, or a ``KeyboardInterrupt`` as it is."""
        failed = [(n, t) for n, t in issued if t.error is not None]
        if not failed:
            return None
        causes = [(n, root_cause(t.error)) for n, t in failed]
        node, err = next(
            ((n, e) for n, e in causes if not isinstance(e, (DependencyFailed, Cancelled))), causes[0]
        )  # fmt: skip
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            return err
        action = str(get_meta(node).action)
        if isinstance(err, OutOfDeviceMemory):
            e = _oom_in(err, f"action {action} of program {program.name!r}")
        else:
            e = ActionError(
                f"action {action} of program {program.name!r} failed: {type(err).__name__}: {err}\n\n"
                f"{program.format(mark=node)}",
                action,
            )
        e.__cause__ = err
        return e

    @contextlib.contextmanager
    def _deferred_interrupt(self, abandon: bool) -> Iterator[None]:
        """Ctrl-C while a phase runs sets ``interrupted`` instead of raising in whatever the
        main thread runs then (an action running inline, a wait): the phase then ends cleanly
        and raises ``KeyboardInterrupt`` itself. With ``abandon`` the tasks not started yet are
        skipped at once; without, the phase runs to its end (its updates cannot be undone). A
        second Ctrl-C raises at once. Only where Python's default SIGINT handler is installed,
        in the main thread (a user's own handler is left alone)."""
        self.interrupted = False
        if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            if self.interrupted:
                raise KeyboardInterrupt
            self.interrupted = True
            if abandon:
                self.cancel.set()

        prev = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, prev)
            self.cancel.clear()

    def _quiesce(self, tokens: Sequence[Token]) -> None:
        """Abandon a step: tasks not started yet are skipped (:class:`Cancelled`), and every
        task of ``tokens`` has finished when this returns (nothing left running against the
        slots or the host store)."""
        self.cancel.set()
        try:
            for t in tokens:
                t.wait()
        finally:
            self.cancel.clear()

    def _evict(self) -> None:
        """The resident stages of a pending forward are given up: its backward will prefetch
        them again (the cold variant) and recompute instead of using kept graphs."""
        if self.holder is not None:
            h = self.holder
            h.hot = False
            for k in list(h.saved):
                h.saved.pop(k)
            self.holder = None

    def _fail_cleanup(self, ctx: StepContext) -> None:
        if self.holder is ctx:
            self.holder = None
        ctx.release_all()
        if self.dp is not None:  # (after the quiesce: the local gradients whose RS never ran)
            if ctx.accumulation is not None:
                ctx.accumulation.local.clear()
            self.dp.reclaim()

    def _undo_step(self) -> tuple[list[int], list[int]]:
        """Roll back the current step's updates (the journal's copies) when rollback is on;
        returns (groups restored, groups updated and left applied)."""
        if self.ssd is not None:
            self.ssd.reset()  # a group read for an update that did not finish goes back to the SSD
        if self.journal.enabled:
            restored = self.journal.rollback(self.pool.region if self.pool is not None else None)
            if restored:
                # the persistent slots may hold updated weights (a refresh after the host update,
                # a tied copy of a device-updated group): write the device-updated groups (restored
                # in their slots) back to the host, and reload every persistent stage from there
                self.sync_to_host()
                self.loaded = None
            return restored, []
        return [], self.journal.updated_groups()

    def _clear_grads(self) -> None:
        """Drop every gradient (as ``zero_grad()``): a failed backward's are incomplete."""
        for g in range(len(self.store.groups)):
            self.store.grad_state[g] = GRAD_NONE
        for keys in self.param_keys_by_group.values():
            for _, p in keys:
                p.grad = None
        self.gradients.reset_device()
        self.backward_calls = 0

    def _abandon_backward(self, ctx: StepContext, program: Program, issued: list[tuple[fx.Node, Token]], err: BaseException) -> BaseException:
        """A backward failed or was interrupted: wait for what runs, undo the updates it started,
        drop its gradients, free its context; returns the error to raise, saying so."""
        tokens = [t for _, t in issued] + [t for _, t in self.pending_updates]
        self._quiesce(tokens)
        self.pending_updates.clear()
        failure = self._failure(program, issued)
        if isinstance(err, (KeyboardInterrupt, SystemExit)) or failure is None:
            failure = err
        restored, applied = self._undo_step()
        self._clear_grads()
        self._step_t0 = None
        self._fail_cleanup(ctx)
        return _with_note(failure, _state_note("backward", restored, applied, gradients="cleared"))

    def _finish_interrupted(
        self, ctx: StepContext, program: Program, issued: list[tuple[fx.Node, Token]], interrupt: BaseException
    ) -> BaseException:
        """Ctrl-C came during a backward whose updates had started, without rollback: finish the
        backward and its updates (the step is then applied, as by ``step()``) and return the
        interrupt to raise, saying so. A failure meanwhile abandons the step as usual."""
        try:
            for _, t in issued:
                t.wait()
        except BaseException as e:  # a second interrupt: stop now
            return self._abandon_backward(ctx, program, issued, e)
        failure = self._failure(program, issued)
        if failure is not None:
            return self._abandon_backward(ctx, program, issued, failure)
        with self.backend.during("end"):
            ctx.release_all()
        self.expose_grads()
        self.pending_updates.clear()
        self.journal.commit()
        self.backward_calls = 0
        self._end_step_clock()
        return _with_note(
            interrupt,
            "The interrupt came during backward() after its optimizer updates had started (they cannot be undone "
            "with rollback off), so shfx finished the backward and the updates first: the step is applied, as by "
            "cm.step(), and the state is consistent. Call cm.zero_grad() and go on with the next batch.",
        )

    # ---- phases ----------------------------------------------------------------------------------
    def forward(
        self, variant: Variant, inputs: Sequence[torch.Tensor], grad: bool, *, serial: bool = False
    ) -> tuple[list[torch.Tensor], StepContext]:
        if self.pending_updates:
            accum = (
                f" (with grad_accum_steps={self.grad_accum_steps} the update starts in every "
                f"{_ordinal(self.grad_accum_steps)} backward)"
                if self.grad_accum_steps > 1
                else ""
            )
            raise UsageError(
                "the model was called while the optimizer update started by the last backward() is still "
                f"pending{accum}: call cm.step() after backward() and before the next forward (shfx starts the "
                "update during backward). To defer updates to step() instead, compile with overlap_update=False."
            )
        self._evict()
        if not grad:  # an inference forward reads every weight: the clipped updates first
            self.await_deferred()
        with self.backend.during("setup"):
            self.ensure_pool(variant.slot_sizes, variant.grad_buffer_sizes)
            if self.device_optimizer is not None:  # the states are part of the steady state: allocate them now
                self.device_optimizer.ensure([self.store.groups[g] for g in sorted(variant.device_groups)], self.optimizer)
            self._ensure_persistent(variant)
        if not serial:
            self.current = variant
        self.trace.clear()  # the trace covers the last forward and what follows it
        if grad and not serial and not self._profiling and self._step_t0 is None:
            self._step_t0 = time.perf_counter()
        ctx = StepContext(self, variant, grad)
        program = variant.train if grad else variant.eval
        nodes = program.phase_nodes("forward") if grad else program.nodes
        issued: list[tuple[fx.Node, Token]] = []
        try:
            with self._deferred_interrupt(abandon=True):
                with self.backend.during("forward start"):
                    for name, t in zip(variant.graph.inputs, inputs):
                        ctx.put(name, self.backend.to_device(t))
                self._issue(ctx, program, nodes, cold=False, skip_updates=True, serial=serial, into=issued)
                for _, tok in issued:
                    _settle(tok)
            failure = KeyboardInterrupt() if self.interrupted else self._failure(program, issued)
        except BaseException as e:  # an interrupt while waiting, or a failure issuing
            self._quiesce([t for _, t in issued])
            failure = e if isinstance(e, (KeyboardInterrupt, SystemExit)) else (self._failure(program, issued) or e)
        if failure is not None:
            self._step_t0 = None if self.backward_calls == 0 else self._step_t0
            self._fail_cleanup(ctx)
            if any(t.error is not None for t in self.deferred.running.values()):
                self.await_deferred()  # a clipped update the prefetches waited for failed: say so, roll back
            raise _with_note(failure, "The forward was abandoned; no weight was changed (as in eager PyTorch, "
                             "buffers a forward updates, such as running statistics, keep the updates of the stages "
                             "that ran). Call the model again.")
        outs = [ctx.values[v] for v in variant.graph.outputs]
        if grad:
            ctx.hot = True
            self.holder = ctx
        else:
            with self.backend.during("end"):
                ctx.release_all()
        return outs, ctx

    def backward(
        self,
        ctx: StepContext,
        grad_outputs: Sequence[torch.Tensor | None],
        *,
        profile: bool = False,
        serial: bool | None = None,
    ) -> list[torch.Tensor | None]:
        """Run ``ctx``'s backward phase. ``profile``: no updates, not counted as a micro-step,
        serialized unless ``serial=False`` (the profiler's timing runs).

        A failure or an interrupt abandons the step: what runs is waited for, the updates the
        backward started are rolled back (``rollback=True``), the gradients are cleared (as
        ``zero_grad()``), and the error says so; a ``KeyboardInterrupt`` comes out as one."""
        serial = profile if serial is None else serial
        if ctx.backward_done:
            raise UsageError("backward() ran twice through the same shfx forward; run the model again instead")
        if not profile and self.backward_calls >= self.grad_accum_steps and self.pending_updates:
            raise UsageError(
                f"backward() was called {self.backward_calls + 1} times since the last cm.step(), but the model was "
                f"compiled with grad_accum_steps={self.grad_accum_steps}: the host update of those steps has already "
                "started. Call cm.step() after every grad_accum_steps backward() calls, or raise grad_accum_steps."
            )
        ctx.backward_done = True
        if not profile:
            # the clipped updates of the last step() read the host gradients this backward writes
            # (its forward's prefetches waited for them already: nothing is left to wait for)
            self.await_deferred()
        self.unscaled.clear()  # new (scaled) gradients arrive
        self.nonfinite_flags.clear()
        if not profile:
            self.backward_calls += 1
        final = (
            not profile
            and self.overlap_update
            and self.optimizer is not None
            and self.backward_calls == self.grad_accum_steps
        )
        if final and not self.delayed:  # (delayed updates of the last step() may still be journaled)
            self.journal.commit()  # a new step (what an earlier failed step left applied is the user's)
            self.last_step_skipped = False
        variant = ctx.variant
        cold = not ctx.hot or self.holder is not ctx
        if cold:
            self._evict()
            program = variant.cold
            # (its step and next-forward phases are step()'s)
            nodes = [n for n in program.nodes if get_meta(n).phase in ("forward", "backward")]
        else:
            program = variant.train
            nodes = program.phase_nodes("backward")
        issued: list[tuple[fx.Node, Token]] = []
        failure: BaseException | None = None
        # an interrupt abandons the step, unless updates run that cannot be undone: then the
        # step is finished first
        finish = final and not self.journal.enabled
        try:
            with self._deferred_interrupt(abandon=not finish):
                with self.backend.during("backward start"):
                    scale = None
                    if self.scaler is not None and not profile and not self.prescaled:
                        scale = self.scaler.scale_tensor()
                    self.prescaled = False
                    for v, gr in zip(variant.graph.outputs, grad_outputs):
                        if gr is not None and variant.graph.values[v].differentiable:
                            if scale is not None:  # as autograd's gradient of (loss * scale), fp32 scale
                                gr = (gr.to(torch.float32) * scale).to(gr.dtype)
                            ctx.add_grad(v, gr)
                self._issue(ctx, program, nodes, cold=cold, skip_updates=not final, serial=serial, into=issued)
                compute = [(n, t) for n, t in issued if not KINDS[get_meta(n).kind].update]
                for _, tok in compute:
                    _settle(tok)
            failure = self._failure(program, compute)
            if self.interrupted:
                failure = KeyboardInterrupt() if failure is None or not finish else failure
        except BaseException as e:  # an interrupt while waiting (not deferred), or a failure issuing
            failure = e
        finally:
            if self.holder is ctx:
                self.holder = None
        if isinstance(failure, KeyboardInterrupt) and finish:
            # updates are running and cannot be undone: finish the step, then raise
            raise self._finish_interrupted(ctx, program, issued, failure)
        if failure is not None:
            raise self._abandon_backward(ctx, program, issued, failure)
        in_grads = [ctx.grads.get(v) for v in variant.graph.inputs]
        with self.backend.during("end"):
            ctx.release_all()
        if not profile:
            self.expose_grads()
        return in_grads

    def expose_grads(self) -> None:
        """Point each trainable parameter's ``.grad`` at its slice of the host gradient buffer."""
        self.gradients.expose(self.param_keys_by_group)

    def step(self, program: Program | None = None) -> bool:
        """Apply the optimizer: wait for updates started during backward, or run them now.

        Returns False when the step was skipped (``skip_nonfinite`` and a gradient holds inf or
        NaN): no group is updated, the gradients stay. A failed or interrupted step is rolled
        back (``rollback=True``) and the gradients stay, so calling ``step()`` again applies
        it; with ``rollback=False`` the error says which groups were updated, and calling
        ``step()`` again applies only the others."""
        if self.optimizer is None:
            raise UsageError("step() needs an optimizer: pass optimizer=shfx.optim.AdamW(...) to shfx.compile")
        if self.delayed_update:
            self._delayed_step()
            return True
        v = self.current
        if v is not None and v.train.updates_in_step:
            skipped = self._issue_step_phase(v)
            return skipped if skipped is not None else self._finish_step()
        if self.clip is not None or self.clipping.clipped is not None:
            return self._clipped_step()
        if not self.pending_updates:
            self.last_step_skipped = False
            done = self.journal.applied  # a retried step: the updates that ran before it failed
            v = self.current
            dev = v.device_groups if v is not None else frozenset()
            groups = [
                i
                for i, g in enumerate(self.store.groups)
                if g.trainable_bytes and i not in dev and self.store.grad_state[i] == GRAD_VALID and ("host", i) not in done
            ]
            dev_groups = []
            for gi in sorted(dev):
                if self.gradients.device_state.get(gi, GRAD_NONE) != GRAD_VALID or ("device", gi) in done:
                    continue
                owner = v.owner_of[gi]
                if self.loaded is not v or owner not in v.train.persistent:
                    raise UsageError(
                        f"group {gi} is updated on the device while its stage is resident, and it is not now: "
                        "its gradient is gone with the slot. Run the step again from the forward."
                    )
                dev_groups.append((gi, v.train.persistent.index(owner)))
            bad = self._first_nonfinite(v, groups, dev_groups) if self.check_finite else None
            if bad is not None:
                if self.skip_nonfinite:
                    return self._skip_step()  # every gradient is known: nothing has run
                raise self._nonfinite_error(bad, [], [])
            for gi in groups:
                tok = self.backend.cpu.submit(self._task(f"U{gi}", self._update_task(gi, finite=False)), [], f"U{gi}")
                self.pending_updates.append((f"U{gi}", tok))
                if self.dp is not None:  # the program's AG after each U: the updated shards to every rank
                    ag = self.backend.gather.submit(
                        self._task(f"AG{gi}", lambda gi=gi: self.dp.gather_params(f"AG{gi}", gi)), [tok], f"AG{gi}"
                    )  # fmt: skip
                    self.pending_updates.append((f"AG{gi}", ag))
            for gi, slot in dev_groups:
                task = self._device_step_task(v, gi, slot, finite=False)
                tok = self.backend.compute.submit(self._task(f"DU{gi}", task), [], f"DU{gi}")
                self.pending_updates.append((f"DU{gi}", tok))
        return self._finish_step()

    def _issue_step_phase(self, v: Variant) -> bool | None:
        """Issue the step phase of a program whose updates run in ``step()`` (``overlap_update=
        False``: :data:`~shfx.passes.features.UPDATES_IN_STEP`): the gate ``CK0`` (waited for:
        with clipping the total norm and coefficient), or the finite check of every gradient, then
        the updates of the groups holding a gradient and not applied yet (a retried step), their SSD
        transfers and all-gathers, and the refresh of the persistent stages. Their tokens go to
        ``pending_updates`` for :meth:`_finish_step`; returns False for a skipped step, None
        otherwise."""
        program = v.train
        clipping = self.clip is not None or self.clipping.clipped is not None
        if clipping:
            self._wait_norms()
        self.pending_updates.clear()
        self.last_step_skipped = False
        done = self.journal.applied  # a retried step: the updates that ran before it failed
        dev = v.device_groups
        host = {gi for gi, g in enumerate(self.store.groups) if g.trainable_bytes and gi not in dev
                and self.store.grad_state[gi] == GRAD_VALID and ("host", gi) not in done}  # fmt: skip
        device = {gi for gi in dev if self.gradients.device_state.get(gi, GRAD_NONE) == GRAD_VALID and ("device", gi) not in done}
        for gi in sorted(device):
            if self.loaded is not v or v.owner_of[gi] not in program.persistent:
                raise UsageError(
                    f"group {gi} is updated on the device while its stage is resident, and it is not now: "
                    "its gradient is gone with the slot. Run the step again from the forward."
                )
        phase = StepPhase(v)
        nodes = program.phase_nodes("step")
        gate = [n for n in nodes if get_meta(n).kind in (ActionKind.NORM_REDUCE, ActionKind.CHECK)]
        if clipping:
            issued = self._issue(phase, program, gate, cold=False, skip_updates=False)
            self.pending_updates.clear()
            for _, tok in issued:
                tok.wait()
            self._raise_gate_failure(issued)
            max_norm, total = self.clipping.gate
            self.clipping.gate = None
            skipped = self._begin_clipped(total)
            if skipped is not None:
                return skipped
            self.clip_coef = Clipping.coefficient(max_norm, total)
        elif self.check_finite:
            dev_slots = [(gi, program.persistent.index(v.owner_of[gi])) for gi in sorted(device)]
            bad = self._first_nonfinite(v, sorted(host), dev_slots)
            if bad is not None:
                if self.skip_nonfinite:
                    return self._skip_step()  # every gradient is known: nothing has run
                raise self._nonfinite_error(bad, [], [])
        wanted = []
        for n in nodes:
            m = get_meta(n)
            if m.kind in (ActionKind.NORM_REDUCE, ActionKind.CHECK):
                continue
            if m.kind == ActionKind.DEVICE_STEP and m.stage not in device:
                continue
            if m.kind in (ActionKind.CPU_STEP, ActionKind.SSD_READ, ActionKind.SSD_WRITE, ActionKind.GATHER_PARAMS) and m.stage not in host:
                continue
            wanted.append(n)
        self.step_checked = False
        try:
            issued = self._issue(phase, program, wanted, cold=False, skip_updates=False)
        finally:
            self.step_checked = None
            self.clip_coef = None
        self.pending_updates = [(str(get_meta(n).action), tok) for n, tok in issued]
        return None

    def _raise_gate_failure(self, issued: list[tuple[fx.Node, Token]]) -> None:
        """A failed ``NR0``/``CK0``: nothing was applied, the gradients stay; raise naming it."""
        failed = [(str(get_meta(n).action), tok) for n, tok in issued if tok.error is not None]
        if not failed:
            return
        label, tok = failed[0]
        err = root_cause(tok.error)
        self.clipping.grad_norms.clear()
        self._step_t0 = None
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise err
        what = "gradient norms' reduction across ranks" if label.startswith("NR") else "gate (total gradient norm)"
        e = ActionError(f"the step's {what} {label} failed: {type(err).__name__}: {err}", label)
        raise _with_note(e, _state_note("step", [], [], gradients="kept")) from err

    def _finish_step(self) -> bool:
        """Wait for the step's updates (``pending_updates``), then commit, or undo and raise."""
        pending, self.pending_updates = self.pending_updates, []
        interrupt: BaseException | None = None
        try:
            with self._deferred_interrupt(abandon=self.journal.enabled):
                for _, tok in pending:
                    tok.wait()
            if self.interrupted:
                raise KeyboardInterrupt
        except BaseException as e:  # an interrupt while waiting
            if self.journal.enabled:  # skip what has not started, then undo the rest (below)
                self._quiesce([t for _, t in pending])
            else:  # the updates cannot be undone: let them all finish, then raise
                for _, tok in pending:
                    tok.wait()
                if all(tok.error is None for _, tok in pending):
                    self.journal.commit()
                    self.backward_calls = 0
                    self._end_step_clock()
                    raise _with_note(e, "The interrupt came during cm.step(); shfx finished its updates first: the "
                                     "step is applied and the state is consistent.") from None
            interrupt = e
        causes = [(label, root_cause(tok.error)) for label, tok in pending if tok.error is not None]
        causes += self._device_nonfinite()
        nonfinite = [(label, e) for label, e in causes if isinstance(e, NonFiniteGradient)]
        real = [(label, e) for label, e in causes if not isinstance(e, (NonFiniteGradient, Cancelled, DependencyFailed))]
        if interrupt is None:
            interrupt = next((e for _, e in real if isinstance(e, (KeyboardInterrupt, SystemExit))), None)
        if interrupt is not None or real:
            restored, applied = self._undo_step()
            retry = self._gradients_survive()
            if not retry:
                self._clear_grads()
            self._step_t0 = None
            note = _state_note("step", restored, applied, gradients="kept" if retry else "cleared")
            if interrupt is not None:
                raise _with_note(interrupt, note)
            label, err = real[0]
            if isinstance(err, OutOfDeviceMemory):
                e = _oom_in(err, f"the optimizer update {label}")
            else:
                what = {
                    "DU": "device optimizer update", "SR": "SSD read of optimizer states",
                    "SW": "SSD write of optimizer states", "AG": "data-parallel all-gather of the updated weights",
                    "PF": "refresh of a persistent stage's weights",
                }  # fmt: skip
                e = ActionError(f"{what.get(label[:2], 'host optimizer update')} {label} failed: {type(err).__name__}: {err}", label)
            raise _with_note(e, note) from err
        if nonfinite:
            if not self.skip_nonfinite:
                restored, applied = self._undo_step()
                raise self._nonfinite_error(nonfinite[0][1], restored, applied)
            if self.journal.enabled:
                self._undo_step()
            elif self.journal.applied:  # pragma: no cover - refused at compile (skip_nonfinite needs rollback)
                raise AssertionError("a non-finite step was partly applied without rollback")
            return self._skip_step()
        self.journal.commit()
        self.backward_calls = 0
        self._end_step_clock()
        if self.scaler is not None:
            self.scaler.update(False)
        return True

    # ---- exact global-norm gradient clipping (shfx.runtime.clipping) --------------------------
    @property
    def clip(self) -> tuple[float, float] | None:
        return self.clipping.clip

    @property
    def clip_order(self) -> list[tuple[int, str]]:
        return self.clipping.clip_order

    @clip_order.setter
    def clip_order(self, order: list[tuple[int, str]]) -> None:
        self.clipping.clip_order = order

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        return self.clipping.last_grad_norm

    def _clip_groups(self) -> list[int]:
        """The host groups a clipped step reads and updates (their gradient is valid), in
        forward order (the order of the stages owning them)."""
        v = self.current
        dev = v.device_groups if v is not None else frozenset()
        if dev:
            raise UsageError(
                f"gradient clipping needs every gradient on the host, but {v.train.name!r} updates groups "
                f"{sorted(dev)} on the device; use Stronghold(resident_first=0), ZeroOffload or ZeroInfinity"
            )
        groups = [gi for gi, g in enumerate(self.store.groups) if g.trainable_bytes and self.store.grad_state[gi] == GRAD_VALID]
        if v is not None:
            groups.sort(key=lambda gi: v.owner_of.get(gi, gi))
        return groups

    def _wait_norms(self) -> None:
        """Wait for the GRAD_NORMs the backward started; a failure drops the step's gradients."""
        for _, tok in self.pending_updates:
            tok.wait()
        failed = [(label, tok) for label, tok in self.pending_updates if tok.error is not None]
        if failed:
            self.pending_updates.clear()
            self.clipping.grad_norms.clear()
            label, tok = failed[0]
            err = root_cause(tok.error)
            self._clear_grads()
            self._step_t0 = None
            e = ActionError(f"gradient norm {label} failed: {type(err).__name__}: {err}", label)
            raise _with_note(e, _state_note("step", [], [], gradients="cleared")) from err

    def total_grad_norm(self, norm_type: float) -> torch.Tensor:
        """The norm of every host gradient of the step, as ``torch.nn.utils.clip_grad_norm_``
        computes it over the model's parameters: waits for the GRAD_NORMs the backward started
        and computes the others now."""
        self._wait_norms()
        return self.clipping.total(self._clip_groups(), norm_type)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``cm.clip_grad_norm_``: the total norm of the step's gradients; ``step()`` scales them by
        ``min(max_norm / (total + 1e-6), 1)`` before its updates (as eager's clip, then step)."""
        if self.optimizer is None:
            raise UsageError("clip_grad_norm_() needs an optimizer: pass optimizer=shfx.optim.AdamW(...) to shfx.compile")
        total = self.total_grad_norm(float(norm_type))
        self.clipping.clipped = (float(max_norm), total)
        return total

    def _begin_clipped(self, total: torch.Tensor) -> bool | None:
        """The common start of a clipped step once its total norm is known: the step's records
        reset; a non-finite total skips the step (``skip_nonfinite``: returns False) or fails it."""
        clipping = self.clipping
        self.pending_updates.clear()
        clipping.clipped = None
        clipping.grad_norms.clear()
        clipping.last_grad_norm = total
        self.last_step_skipped = False
        if not bool(torch.isfinite(total)):
            if self.skip_nonfinite:
                return self._skip_step()
            if self.check_finite:
                groups = self._clip_groups()
                err = NonFiniteGradient(f"the total gradient norm is {float(total)}", groups[0] if groups else -1)
                raise self._nonfinite_error(err, [], [])
        return None

    def _gated_step(self, v: Variant) -> bool:
        """step() of a program with a step phase (exact clipping, updates overlapped): the
        program's step phase (``NR0``, the gate ``CK0``) is issued and waited for; then its
        next-forward phase (every clipped ``U``, with their ``SR``/``SW``/``AG``) is started and
        step() returns: the next forward's prefetches wait for the updates of the groups they
        read (``self.deferred``), and anything reading the weights first waits for them all."""
        self.await_deferred()
        self._wait_norms()
        self.pending_updates.clear()
        program = v.train
        phase = StepPhase(v)
        issued = self._issue(phase, program, program.phase_nodes("step"), cold=False, skip_updates=False)
        self.pending_updates.clear()
        for _, tok in issued:
            tok.wait()
        self._raise_gate_failure(issued)
        max_norm, total = self.clipping.gate
        self.clipping.gate = None
        skipped = self._begin_clipped(total)
        if skipped is not None:
            return skipped
        self.clip_coef = Clipping.coefficient(max_norm, total)
        self.backward_calls = 0
        if self.scaler is not None:
            self.scaler.update(False)
        tail = self._issue(phase, program, program.phase_nodes("next-forward"), cold=False, skip_updates=False)
        self.pending_updates.clear()
        for n, tok in tail:
            m = get_meta(n)
            if m.kind in (ActionKind.CPU_STEP, ActionKind.GATHER_PARAMS):  # what a prefetch of the group waits for
                self.deferred.running[m.stage] = tok
            else:
                self.deferred.others.append(tok)
        self._end_step_clock()
        return True

    def _clipped_step(self) -> bool:
        """step() with clipping when the updates are not overlapped (``overlap_update=False``,
        or a program without a step phase): the total norm (from the GRAD_NORMs of the backward,
        or computed now), then each group's update scales its gradient by the clip coefficient
        and applies AdamW, in forward order; step() waits for them."""
        v = self.current
        if self.overlap_update and v is not None and v.train.phase_nodes("step"):
            return self._gated_step(v)
        self.await_deferred()
        clipping = self.clipping
        if clipping.clipped is not None:
            max_norm, total = clipping.clipped
        else:
            assert clipping.clip is not None
            max_norm, total = clipping.clip[0], self.total_grad_norm(clipping.clip[1])
        skipped = self._begin_clipped(total)
        if skipped is not None:
            return skipped
        groups = self._clip_groups()
        coef = Clipping.coefficient(max_norm, total)
        store = self.store

        def task(gi: int) -> Callable[[], None]:
            update = self._update_task(gi, check=False, finite=False)

            def run() -> None:
                store.grad(gi).data.mul_(coef)  # as clip_grad_norm_'s _foreach_mul_ (through .data: no user edit)
                update()

            return self._task(f"U{gi}", run)

        self.backward_calls = 0
        if self.scaler is not None:
            self.scaler.update(False)
        self.deferred.start(groups, lambda gi: self.backend.cpu.submit(task(gi), [], f"U{gi}"))
        self.await_deferred()
        self._end_step_clock()
        return True

    def await_deferred(self) -> None:
        """Wait for the clipped updates the last ``step()`` started (anything reading the weights
        between steps: ``state_dict``, ``sync``, an inference forward, ``close``, the next
        backward). A failed one rolls the step back (``rollback=True``) and drops the gradients
        (they were scaled), and raises saying so."""
        if not self.deferred:
            return
        pending = [(f"U{g}", tok) for g, tok in self.deferred.running.items()]
        pending += [(tok.label or "?", tok) for tok in self.deferred.others]
        self.deferred.clear()
        for _, tok in pending:
            tok.wait()
        failed = [(label, tok) for label, tok in pending if tok.error is not None]
        if not failed:
            self.journal.commit()
            return
        # the first failure that is not another's (an all-gather after a failed update)
        label, tok = next(((lb, t) for lb, t in failed if not isinstance(t.error, DependencyFailed)), failed[0])
        err = root_cause(tok.error)
        restored, applied = self._undo_step()
        self._clear_grads()
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise err
        label = tok.label or label
        what = {"SR": "SSD read of optimizer states", "SW": "SSD write of optimizer states",
                "AG": "data-parallel all-gather of the updated weights"}.get(label[:2], "host optimizer update")  # fmt: skip
        e = ActionError(f"{what} {label} (clipped, started by step()) failed: {type(err).__name__}: {err}", label)
        raise _with_note(e, _state_note("step", restored, applied, gradients="cleared")) from err

    def _first_nonfinite(
        self, v: Variant | None, groups: list[int], dev_groups: list[tuple[int, int]]
    ) -> NonFiniteGradient | None:
        """The error of the first gradient a step() would apply that holds inf or NaN, or None
        (checked before any update)."""
        try:
            for gi in groups:
                _check_finite(self.store.grad(gi), gi, self._whose(gi, "host"))
            for gi, slot in dev_groups:
                _, base = self._group_base(v, gi)
                grp = self.store.groups[gi]
                dgrad = self.gradients.device_grads(slot, base, grp.trainable_bytes, grp.dtypes.device_grad)
                _check_finite(dgrad, gi, self._whose(gi, "device"))
        except NonFiniteGradient as e:
            return e
        return None

    def _device_nonfinite(self) -> list[tuple[str, NonFiniteGradient]]:
        """The device-updated groups whose gradient held inf or NaN this step (their update was
        a no-op on the device, so it is not counted as applied): one host read for all flags."""
        flags, self.nonfinite_flags = self.nonfinite_flags, {}
        if not flags:
            return []
        groups = sorted(flags)
        bad = torch.stack([flags[g] for g in groups]).cpu().tolist()
        out = []
        for g, b in zip(groups, bad):
            if b:
                self.journal.applied.discard(("device", g))
                out.append((f"DU{g}", NonFiniteGradient(f"the gradient of {self._whose(g, 'device')} holds inf or NaN", g)))
        return out

    def _whose(self, group: int, where: str) -> str:
        """``group``'s gradient, in words: the stage owning it (``"stage 'blocks.2' (parameter
        group 3, on the host)"``)."""
        v = self.current
        name = ""
        if v is not None and group in v.owner_of:
            name = f"stage {v.graph.stages[v.owner_of[group]].name!r} "
        return f"{name}(parameter group {group}, on the {where})"

    def _nonfinite_error(self, err: NonFiniteGradient, restored: list[int], applied: list[int]) -> NonFiniteGradient:
        """The error of a step whose gradient holds inf or NaN (``skip_nonfinite`` off): the step
        is dropped, the gradients stay for inspection."""
        self.journal.commit()
        self.backward_calls = 0
        self._step_t0 = None
        if applied:
            state = (
                f"The updates of parameter groups {applied} had already run during backward (rollback is off: "
                "shfx.compile(rollback=True) makes a step all-or-nothing), so those groups are updated and the others "
                "are not; reload the last checkpoint to go on exactly."
            )
        else:
            state = "The step was not applied: " + (
                f"the updates that had run (parameter groups {restored}) were rolled back, so " if restored else ""
            ) + "the weights and optimizer states are exactly as before it."
        msg = (
            f"{err} after backward(): {state} The gradients are kept for inspection (.grad); call cm.zero_grad() "
            "and go on with the next batch, or lower the learning rate. To skip such steps instead of raising, "
            "compile with skip_nonfinite=True (or precision='fp16', which skips overflowing steps)."
        )
        return NonFiniteGradient(msg, err.group)

    def _skip_step(self) -> bool:
        """The step is not applied (a non-finite gradient); the gradients stay for the user."""
        self.journal.commit()
        self.skipped_steps += 1
        self.last_step_skipped = True
        if self.scaler is not None:  # an overflow: back the scale off
            self.scaler.update(True)
        self.backward_calls = 0
        self._end_step_clock()
        return False

    def _end_step_clock(self) -> None:
        if self._step_t0 is not None:
            t1 = time.perf_counter()
            self.step_times.append(t1 - self._step_t0)
            # (time.perf_counter(): the clock of the step's trace)
            self.last_step_window = (self._step_t0, t1)
            self._step_t0 = None

    def _gradients_survive(self) -> bool:
        """Whether the step's gradients are all still where step() reads them: not when a group
        updated on the device lost its gradient with a transient slot."""
        v = self.current
        if v is None:
            return True
        return all(v.owner_of[g] in v.train.persistent for g in v.device_groups)

    def _delayed_step(self) -> None:
        """DPU: finish the previous step's updates, refresh the persistent slots with their
        weights, start this step's updates and return while they run."""
        self.finish_delayed(refresh=True)
        self.journal.commit()
        v = self.current
        dev = v.device_groups if v is not None else frozenset()
        groups = [
            gi
            for gi, g in enumerate(self.store.groups)
            if g.trainable_bytes and gi not in dev and self.store.grad_state[gi] == GRAD_VALID
        ]
        self.delayed.start(
            groups, lambda gi: self.backend.cpu.submit(self._task(f"U{gi}", self._update_task(gi, check=False)), [], f"U{gi} (delayed)")
        )  # fmt: skip
        self.backward_calls = 0
        self._end_step_clock()

    def wait_delayed(self) -> None:
        """Wait for the delayed updates to reach the host weights (state_dict), leaving the
        device on the weights before them until the next step() refreshes it."""
        try:
            self.delayed.wait()
        except ActionError as e:
            self.delayed.clear()
            self.loaded = None
            restored, applied = self._undo_step()
            raise _with_note(e, _state_note("delayed update", restored, applied, gradients="kept")) from e.__cause__

    def finish_delayed(self, refresh: bool = True) -> None:
        """Wait for the delayed updates; with ``refresh``, copy the updated weights into the
        persistent slots (otherwise they reload before the next step)."""
        try:
            if not self.delayed.finish():
                return
        except ActionError as e:
            self.loaded = None
            restored, applied = self._undo_step()
            raise _with_note(e, _state_note("delayed update", restored, applied, gradients="kept")) from e.__cause__
        v = self.loaded
        if v is None:
            return
        if not refresh:
            self.loaded = None
            return
        toks = [self.backend.h2d.submit(lambda st=v.graph.stages[s], k=k: self._prefetch(st, k)) for k, s in enumerate(v.train.persistent)]
        for t in toks:
            t.wait()
        errors = [t.error for t in toks if t.error is not None]
        if errors:
            self.loaded = None
            raise errors[0]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.pending_updates:
            raise UsageError(
                "zero_grad() was called between backward() and step() while the update started by backward() is "
                "pending; call cm.step() first (or compile with overlap_update=False)"
            )
        if not set_to_none:
            self.await_deferred()  # zeroing the host gradients: the clipped updates read them
        self.clipping.clipped = None
        self.clipping.grad_norms.clear()
        if not self.delayed and not self.deferred:
            self.journal.commit()  # a failed step's records: the user drops that step
        st = self.store
        if not set_to_none:
            self.finish_delayed()  # zeroing the host gradients: the delayed updates read them
        for g in range(len(st.groups)):
            if set_to_none:
                st.grad_state[g] = GRAD_NONE
            elif st.grad_state[g] == GRAD_VALID or st.groups[g].trainable_bytes:
                st.grad(g).zero_()
                st.grad_state[g] = GRAD_VALID
        for g, keys in self.param_keys_by_group.items():
            for _, p in keys:
                if set_to_none:
                    p.grad = None
        self.gradients.reset_device()
        if not set_to_none:
            self.expose_grads()

    def close(self) -> None:
        """Copy device-updated weights back to the host, then free the device."""
        self._evict()
        try:
            self.await_deferred()
            self.finish_delayed(refresh=False)
            self.sync_to_host()
        finally:
            if self.device_optimizer is not None:
                self.device_optimizer.close()
            self.gradients.close()
            if self.pool is not None:
                self.pool.close()
            self.loaded = None
            try:
                if self.ssd is not None:
                    self.ssd.close()
            finally:
                self.backend.close()

    def memory_summary(self) -> str:
        b = self.backend
        cap = "unlimited" if b.capacity_bytes is None else format_bytes(b.capacity_bytes)
        return f"device memory: {format_bytes(b.used_bytes)} in use, peak {format_bytes(b.peak_bytes)}, capacity {cap}"
