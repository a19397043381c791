"""The interpreter: runs step programs on a backend.

The engine issues actions and owns the device side (slot pool, persistent stages, device
optimizer); the state of one forward call is a :class:`~shfx.runtime.context.StepContext`,
gradients are routed and accumulated by :class:`~shfx.runtime.gradients.GradientRouter`, and
ZeRO-Offload's delayed update is :class:`~shfx.runtime.delayed.DelayedUpdates`. The other parts
live in their own modules, each a class holding the engine and using a listed set of its
attributes: the slot pool, the persistent stages and the host memory count
(:class:`~shfx.runtime.residency.Residency`), the handler of each kind of action and the tasks
they submit (:class:`~shfx.runtime.handlers.ActionHandlers`), ``step()`` with its clipped,
delayed and skipped variants (:class:`~shfx.runtime.stepping.StepRunner`), and the undoing and
wording of a failed or interrupted step (:class:`~shfx.runtime.failures.StepFailures`).

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
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from shfx.passes.actions import KINDS, PR, PW, SR, SW, U
from shfx.passes.attention import training_forward
from shfx.passes.meta import get_meta
from shfx.passes.partition import Stage
from shfx.passes.pipeline import Variant
from shfx.passes.program import ActionMeta, Program
from shfx.passes.units import format_bytes

from ..errors import NonFiniteGradient, UsageError
from .activations import ActivationStash, ActivationWindow
from .backend import Backend, MemoryEvent
from .clipping import Clipping
from .context import StepContext, fork_rng
from .data_parallel import DataParallelRuntime
from .delayed import DelayedUpdates
from .device_optim import DeviceAdamW, device_runner_for
from .failures import StepFailures, with_note
from .gradients import GradientRouter
from .handlers import ActionHandlers
from .host_optim import HostAdamW
from .host_store import HostStore
from .journal import StepJournal
from .residency import Residency
from .slots import SlotPool
from .ssd_window import SSDWindow
from .stepping import StepRunner
from .streams import DeviceToken, DoneToken, JoinToken, Token, root_cause
from .tracing import StepTrace

__all__ = ["Engine", "StepContext", "MemoryEvent"]

# A forward longer than this recomputes with early stop (benchmarks/overhead.py on 2 CPU cores:
# early stop saved 3% on stages of ~8 ms and cost 23% on stages of ~0.5 ms).
_EARLY_STOP_MIN_S = 2e-3


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
        activations_on: Any = None,
    ):
        """Everything comes from ``shfx.compile``'s :class:`~shfx.config.Config` (the compiled
        model passes its fields) and the host store: ``param_keys_by_group`` is group -> its
        trainable ``(key, tensor)`` pairs, ``clip_order`` every trainable parameter's ``(group,
        key)`` in the model's order (gradient clipping stacks the norms in it, as torch does),
        ``activations_on`` the ``Offload`` spec when activations go to the SSD (its path and rates)."""
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
        self.device_optimizer: DeviceAdamW | None = device_runner_for(backend, optimizer.config, store) if optimizer is not None else None
        # what the updates of the current step changed, to undo a step that fails or is skipped
        self.journal = StepJournal(store, optimizer, self.device_optimizer, enabled=rollback)
        # the NVMe tier's host window (shfx.runtime.ssd_window): attach_ssd() at the first program
        # with SSD transfers (shfx.compile(offload=...))
        self.ssd: SSDWindow | None = None
        # activation offload's host buffers (shfx.runtime.activations; Offload(activations=...))
        self.activation_stash = ActivationStash(backend)
        # Offload(activations="nvme"): the window of host buffers and the SSD store they go through
        self.activation_window: ActivationWindow | None = ActivationWindow(backend, activations_on) if activations_on is not None else None
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
        self.clip_order = list(clip_order)  # (group, key) of each trainable parameter, in model order
        # the parts, each holding this engine: the slot pool and persistent stages
        # (shfx.runtime.residency), one handler per kind of action and the tasks they run
        # (shfx.runtime.handlers), a failed step's undoing and errors (shfx.runtime.failures), and
        # step() itself (shfx.runtime.stepping)
        self.residency = Residency(self)
        self.handlers = ActionHandlers(self)
        self.failures = StepFailures(self)
        self.steps = StepRunner(self, self.handlers, self.failures)
        self._handlers = self.handlers.table  # the interpreter's dispatch table

    # ---- setup -----------------------------------------------------------------------------
    def ensure_pool(self, sizes: list[int], grad_sizes: Sequence[int] = ()) -> None:
        """Make slot ``k`` hold at least ``sizes[k]`` bytes, and its gradient buffer
        ``grad_sizes[k]`` (:meth:`Residency.ensure_pool <shfx.runtime.residency.Residency.ensure_pool>`)."""
        self.residency.ensure_pool(sizes, grad_sizes)

    def attach_ssd(self, window: SSDWindow) -> None:
        """Run the NVMe tier through ``window`` (made by the compiled model at the first program
        with SSD transfers: the tier's groups are known from it)."""
        self.ssd = window
        self.journal.ssd = window  # (rollback: its groups' states are undone by the window's versions)

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
        """Host memory the runtime holds (:meth:`Residency.host_bytes
        <shfx.runtime.residency.Residency.host_bytes>`)."""
        return self.residency.host_bytes()

    # ---- issuing -----------------------------------------------------------------------------
    def issue(
        self,
        ctx: StepContext,
        program: Program,
        nodes: Sequence[fx.Node],
        cold: bool,
        skip_updates: bool,
        serial: bool = False,
        into: list[tuple[fx.Node, Token]] | None = None,
        unupdated: str | None = None,
    ) -> list[tuple[fx.Node, Token]]:
        """Issue ``nodes`` in order, appending ``(node, token)`` to ``into`` as they are issued
        (so an interrupt part-way leaves the caller every token to wait for); with ``serial``
        each waits for the previous one to finish (the profiler times actions in isolation).
        ``unupdated``: a backward without updates (``skip_updates``) whose parameter-tier
        actions still run without their update: ``"profile"`` (the profiler's timing steps) or
        ``"accumulate"`` (a micro-step before the last: the gradient goes to the SSD)."""
        issued: list[tuple[fx.Node, Token]] = [] if into is None else into
        paged = self.ssd.paged if self.ssd is not None and skip_updates and unupdated else frozenset()
        for node in nodes:
            meta = get_meta(node)
            # NOTE: the parameter tier without its updates: a paged group's SR still gives its
            # gradient a window buffer (with the gradient accumulated so far), its SW frees it
            # (writing the gradient when accumulating), an image read only the update needed is
            # not made and its PW is dropped (ActionHandlers.run_tier_unupdated); every other
            # update is skipped
            tier = meta.stage in paged and meta.kind in (SR, PW, SW)
            if meta.stage in paged and meta.kind == PR and all(KINDS[get_meta(u).kind].update for u in node.users):
                continue  # (an image read for the update alone)
            if KINDS[meta.kind].update and skip_updates and not tier:
                continue
            deps = [ctx.env[d] for d in program.deps(node) if d in ctx.env]
            if tier and meta.kind != SR:  # (what the skipped update waited for: the gradient's copy, the prefetches)
                upd = next((u for u in program.deps(node) if get_meta(u).kind == U), None)
                deps += [ctx.env[d] for d in (program.deps(upd) if upd is not None else ()) if d in ctx.env]
            try:
                tok = (
                    self.handlers.run_tier_unupdated(ctx, meta, deps, accumulate=unupdated == "accumulate")
                    if tier else self._issue_action(ctx, meta, deps, cold)
                )  # fmt: skip
            except BaseException as e:  # synchronous failure (CUDA issue path, bad state)
                tok = DoneToken(str(meta.action), e)
            tok.label = str(meta.action)
            ctx.env[node] = tok
            issued.append((node, tok))
            if KINDS[meta.kind].update and not tier:
                self.pending_updates.append((str(meta.action), tok))
            if serial:
                tok.wait()
        return issued

    def _issue_action(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        return self._handlers[m.kind](ctx, m, deps, cold)

    # ---- a stage's forward and backward (the F and B actions' tasks) --------------------------
    def _forward(self, ctx: StepContext, stage: Stage, slot: int, keep_graph: bool) -> None:
        g = ctx.variant.graph
        views = self.pool.views(slot, stage, g)
        params = [views[k] for k in stage.params]
        bufs = [views[k] for k in stage.buffers]
        ins = [ctx.values[v] for v in stage.inputs]
        # NOTE: a stage the program runs no backward of (frozen, and no gradient flows through
        # it: the bottom of a fine-tuned model) runs as in inference, keeping nothing for one
        grad = ctx.grad and stage.index in ctx.backward_stages
        # NOTE: a stage whose activations are offloaded (AO) runs the plain recompute path below:
        # its graph (keep_graph) or checkpoint (early stop: torch.utils.checkpoint holds its
        # inputs) would keep the device copy of the inputs alive after the AO freed them
        offloaded = stage.index in ctx.offloaded
        keep = grad and keep_graph and not offloaded
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
        elif grad and not offloaded and self._early_stop(stage):
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

    # ---- device residency (shfx.runtime.residency) ---------------------------------------------
    def sync_to_host(self) -> None:
        """Copy the weights updated on the device back to the host store (:meth:`Residency.sync_to_host
        <shfx.runtime.residency.Residency.sync_to_host>`)."""
        self.residency.sync_to_host()

    def replace_variant(self, old: Variant, new: Variant) -> None:
        """``new`` takes ``old``'s place between steps (:meth:`Residency.replace_variant
        <shfx.runtime.residency.Residency.replace_variant>`)."""
        self.residency.replace_variant(old, new)

    def invalidate_device_weights(self) -> None:
        """The host weights changed (load_state_dict): persistent stages reload before the next step."""
        self.residency.invalidate_device_weights()

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
        self.residency.evict()
        if not grad:  # an inference forward reads every weight: the clipped updates first
            self.await_deferred()
        with self.backend.during("setup"):
            self.residency.ensure_pool(variant.slot_sizes, variant.grad_buffer_sizes)
            if self.dp is not None:  # (its device groups are replicated: no host states, no local-gradient buffer)
                self.dp.device_groups = frozenset(variant.device_groups)
            if self.device_optimizer is not None:  # the states are part of the steady state: allocate them now
                self.device_optimizer.ensure([self.store.groups[g] for g in sorted(variant.device_groups)], self.optimizer)
            if self.grad_accum_steps > 1:  # mixed precision (or data parallel): the device groups' fp32 gradient accumulators
                self.gradients.ensure_accumulators([self.store.groups[g] for g in sorted(variant.device_groups)], replicated=self.dp is not None)
            if self.dp is not None and grad and self.device_optimizer is not None:
                # data parallel in mixed precision: device masters from the ranks' fp32 master shards
                self.device_optimizer.gather_masters(self.dp)
            self.residency.ensure_persistent(variant)
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
            with self.failures.deferred_interrupt(abandon=True):
                with self.backend.during("forward start"):
                    for name, t in zip(variant.graph.inputs, inputs):
                        ctx.put(name, self.backend.to_device(t))
                self.issue(ctx, program, nodes, cold=False, skip_updates=True, serial=serial, into=issued)
                for _, tok in issued:
                    _settle(tok)
            failure = KeyboardInterrupt() if self.failures.interrupted else self.failures.failure(program, issued)
        except BaseException as e:  # an interrupt while waiting, or a failure issuing
            self.failures.quiesce([t for _, t in issued])
            failure = e if isinstance(e, (KeyboardInterrupt, SystemExit)) else (self.failures.failure(program, issued) or e)
        if failure is not None:
            self._step_t0 = None if self.backward_calls == 0 else self._step_t0
            self.failures.fail_cleanup(ctx)
            if any(t.error is not None for t in self.deferred.running.values()):
                self.await_deferred()  # a clipped update the prefetches waited for failed: say so, roll back
            raise with_note(failure, "The forward was abandoned; no weight was changed (as in eager PyTorch, "
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
            self.residency.evict()
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
            with self.failures.deferred_interrupt(abandon=not finish):
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
                # (the parameter tier: a micro-step before the last sends its gradients to the SSD)
                unupdated = "profile" if profile else "accumulate" if not final and self.grad_accum_steps > 1 else None
                self.issue(ctx, program, nodes, cold=cold, skip_updates=not final, serial=serial, into=issued, unupdated=unupdated)
                # (without updates, the parameter tier's SR/PW/SW are this backward's own: waited for here)
                compute = [(n, t) for n, t in issued if unupdated or not KINDS[get_meta(n).kind].update]
                for _, tok in compute:
                    _settle(tok)
            failure = self.failures.failure(program, [(n, t) for n, t in compute if not _skipped_refresh(n, t)])
            if self.failures.interrupted:
                failure = KeyboardInterrupt() if failure is None or not finish else failure
        except BaseException as e:  # an interrupt while waiting (not deferred), or a failure issuing
            failure = e
        finally:
            if self.holder is ctx:
                self.holder = None
        if isinstance(failure, KeyboardInterrupt) and finish:
            # updates are running and cannot be undone: finish the step, then raise
            raise self.failures.finish_interrupted(ctx, program, issued, failure)
        if failure is not None:
            raise self.failures.abandon_backward(ctx, program, issued, failure)
        in_grads = [ctx.grads.get(v) for v in variant.graph.inputs]
        with self.backend.during("end"):
            ctx.release_all()
        if not profile:
            self.expose_grads()
        return in_grads

    def expose_grads(self) -> None:
        """Point each trainable parameter's ``.grad`` at its slice of the host gradient buffer."""
        self.gradients.expose(self.param_keys_by_group)

    # ---- the step (shfx.runtime.stepping) -----------------------------------------------------
    def step(self, program: Program | None = None) -> bool:
        """Apply the optimizer: wait for updates started during backward, or run them now
        (:meth:`StepRunner.step <shfx.runtime.stepping.StepRunner.step>`). Returns False when
        the step was skipped for a non-finite gradient."""
        return self.steps.step(program)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.steps.zero_grad(set_to_none)

    def await_deferred(self) -> None:
        """Wait for the clipped updates the last ``step()`` started (see :class:`StepRunner`)."""
        self.steps.await_deferred()

    def wait_delayed(self) -> None:
        """Wait for the delayed updates to reach the host weights (``state_dict``)."""
        self.steps.wait_delayed()

    def end_step_clock(self) -> None:
        """The step ended (applied or skipped): its time goes to ``step_times``."""
        if self._step_t0 is not None:
            t1 = time.perf_counter()
            self.step_times.append(t1 - self._step_t0)
            # (time.perf_counter(): the clock of the step's trace)
            self.last_step_window = (self._step_t0, t1)
            self._step_t0 = None

    def drop_step_clock(self) -> None:
        """The step failed or was dropped: it is not timed."""
        self._step_t0 = None

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

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``cm.clip_grad_norm_`` (:meth:`StepRunner.clip_grad_norm`)."""
        return self.steps.clip_grad_norm(max_norm, norm_type)

    def close(self) -> None:
        """Copy device-updated weights back to the host, then free the device."""
        self.residency.evict()
        try:
            self.await_deferred()
            self.steps.finish_delayed(refresh=False)
            self.residency.sync_to_host()
        finally:
            if self.device_optimizer is not None:
                self.device_optimizer.close()
            self.gradients.close()
            if self.pool is not None:
                self.pool.close()
            self.loaded = None
            try:
                if self.activation_window is not None:
                    self.activation_window.close()
                if self.ssd is not None:
                    self.ssd.close()
            finally:
                self.backend.close()

    def memory_summary(self) -> str:
        b = self.backend
        cap = "unlimited" if b.capacity_bytes is None else format_bytes(b.capacity_bytes)
        return f"device memory: {format_bytes(b.used_bytes)} in use, peak {format_bytes(b.peak_bytes)}, capacity {cap}"



def _skipped_refresh(node: fx.Node, tok: Token) -> bool:
    """The refresh of a persistent stage (ZeRO-Offload's ``PF`` in the backward) that did not
    run because its update found a non-finite gradient: ``step()`` judges that (a skip under
    fp16 or ``skip_nonfinite``, undone there with the slots reloaded), not the backward (it
    failed the backward, issue 25)."""
    m = get_meta(node)
    return m.kind.value == "PF" and bool(m.refresh) and tok.error is not None and isinstance(root_cause(tok.error), NonFiniteGradient)
