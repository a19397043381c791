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
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from shfx.cost_model.trace import Event
from shfx.passes.actions import KINDS
from shfx.passes.capture import CAPTURE_GATE
from shfx.passes.meta import get_meta
from shfx.passes.partition import Stage
from shfx.passes.pipeline import Variant
from shfx.passes.program import ActionMeta, Program
from shfx.passes.units import format_bytes

from ..errors import ActionError, OutOfDeviceMemory, UsageError
from .backend import Backend, MemoryEvent
from .context import StepContext, fork_rng
from .delayed import DelayedUpdates
from .device_optim import DeviceAdamW
from .gradients import GradientRouter
from .host_optim import HostAdamW
from .host_store import GRAD_NONE, GRAD_VALID, HostStore
from .slots import SlotPool
from .streams import DependencyFailed, DoneToken, JoinToken, Token

__all__ = ["Engine", "StepContext", "MemoryEvent"]

# A forward longer than this recomputes with early stop (benchmarks/overhead.py on 2 CPU cores:
# early stop saved 3% on stages of ~8 ms and cost 23% on stages of ~0.5 ms).
_EARLY_STOP_MIN_S = 2e-3


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
    ):
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
        self.trace: list[Event] = []  # the last step's actions (shfx.cost_model.trace)
        self.tracing = True
        # "early-stop": forward records the graph (checkpoint), backward recomputes only what it
        # needs; "full": backward recomputes the whole stage; "auto": early stop for stages whose
        # forward takes more than _EARLY_STOP_MIN_S (its bookkeeping costs ~0.5 ms a stage on a CPU)
        self.recompute = "auto"
        self._forward_s: dict[int, float] = {}  # id(stage) -> last measured forward seconds
        self.param_keys_by_group: dict[int, list[str]] = {}
        self.device_optimizer = DeviceAdamW(backend) if optimizer is not None else None
        self.gradients = GradientRouter(self)
        self.dirty: set[int] = set()  # groups whose device weights are newer than the host's
        self.loaded: Variant | None = None  # the variant whose persistent stages are on the device
        self.current: Variant | None = None  # the variant of the last forward
        self.step_times: list[float] = []  # measured: first train forward of a step -> step() end
        self._step_t0: float | None = None
        self._profiling = False  # steps run inside profiling() are not the user's
        # the interpreter's dispatch table: one handler per kind of action
        self._handlers = {kind: getattr(self, f"_run_{info.name}") for kind, info in KINDS.items()}

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
        optimizer's states, the staging buffers and the buffers borrowed gradients wait in."""
        states = 0
        if self.optimizer is not None:
            states = sum(
                t.numel() * t.element_size()
                for st in self.optimizer.state.values()
                for t in (st.exp_avg, st.exp_avg_sq, st.max_exp_avg_sq)
                if t is not None
            )
        return self.store.host_bytes + states + self.store.staging_bytes + self.gradients.pending_host_bytes

    # ---- issuing -----------------------------------------------------------------------------
    def _timed(self, fn: Callable[[], None], meta: ActionMeta) -> Callable[[], None]:
        """The task of an action: its device reservations belong to it (a memory recording
        names it), and, when tracing, its start and end are traced (an OFFLOAD_GRAD's copy
        only: its event has no ``copy_end``, its ``end`` is when the slot's reads ended).

        NOTE: tracing the accumulation too would make an OFFLOAD_GRAD's ``end`` the end of the
        accumulation, as the simulator's; readers of ``trace`` (tests/test_runtime.py's
        residency check) take an OFFLOAD_GRAD's ``end`` as the last read of its slot."""
        label, backend = str(meta.action), self.backend
        if not self.tracing:

            def plain() -> None:
                with backend.during(label):
                    fn()

            return plain
        trace = self.trace

        def run() -> None:
            t0 = time.perf_counter()
            with backend.during(label):
                fn()
            trace.append(Event(label, meta.phase, meta.stream, t0, time.perf_counter(), meta.bytes))

        return run

    def _issue(
        self, ctx: StepContext, program: Program, nodes: Sequence[fx.Node], cold: bool, skip_updates: bool, serial: bool = False
    ) -> list[tuple[fx.Node, Token]]:
        """Issue ``nodes`` in order; with ``serial`` each waits for the previous one to finish
        (the profiler times actions in isolation that way)."""
        issued: list[tuple[fx.Node, Token]] = []
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

    def _run_cpu_step(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        return self._submit(m, self._update_task(m.stage), deps)

    def _run_device_step(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        return self._submit(m, self._device_step_task(ctx.variant, m.stage, m.slot), deps)

    def _run_offload_params(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        stage = ctx.variant.graph.stages[m.stage]
        return self._submit(m, lambda: self._offload_params(stage, m.slot), deps)

    def _run_prefetch(self, ctx: StepContext, m: ActionMeta, deps: list[Token], cold: bool) -> Token:
        stage = ctx.variant.graph.stages[m.stage]
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
        keep = ctx.grad and keep_graph
        if ctx.grad:
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
        elif ctx.grad and self._early_stop(stage):
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
            with torch.no_grad():
                outs = stage.gm(*params, *bufs, *ins)
            self._forward_s[id(stage)] = time.perf_counter() - t0
        for v, o in zip(stage.outputs, outs):
            ctx.put(v, o.detach())
        if not ctx.grad:
            for v in stage.inputs:
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
            if pairs and wrt:
                grads = torch.autograd.grad([o for o, _ in pairs], wrt, [x for _, x in pairs], allow_unused=True)
            else:
                grads = (None,) * len(wrt)
            for i, gr in zip(in_idx, grads[: len(in_idx)]):
                if gr is not None:
                    ctx.add_grad(stage.inputs[i], gr)
            self.gradients.write(ctx, stage, slot, views, [stage.params[i] for i in p_idx], grads[len(in_idx) :], grads_to)
        finally:
            ctx.saved.pop(s, None)
            ctx.drop_pre_buffers(s)
            for v in stage.outputs:
                ctx.drop_grad(v)
            for v in ctx.free_after_b.get(s, []):
                ctx.drop(v)

    def _device_step_task(self, variant: Variant, group: int, slot: int) -> Callable[[], None]:
        """DU: AdamW on the device for ``group``, in the slot of the stage owning it."""
        if self.device_optimizer is None:
            return lambda: None
        hp = self.optimizer.config.hyperparams()
        owner, base = self._group_base(variant, group)
        grp = self.store.groups[group]

        def run() -> None:
            if self.gradients.device_state.get(group, GRAD_NONE) != GRAD_VALID:
                return
            n = grp.trainable_bytes
            params = self.pool.region(slot, base, n).view(grp.dtypes.working)
            grads = self.gradients.device_grads(slot, base, n, grp.dtypes.device_grad)
            self.device_optimizer.update(grp, params, grads, hp)
            self.dirty.add(group)
            # persistent borrowers (tied weights) hold copies: refresh them (every contributor's
            # backward, the last reader of those copies this step, is done)
            for k, s in enumerate(variant.train.persistent):
                if s == owner:
                    continue
                for c in variant.graph.stages[s].slot.prefetch:
                    if c.group == group:
                        self.pool.region(k, c.slot_offset, c.nbytes).copy_(self.pool.region(slot, base + c.host_offset, c.nbytes))

        return run

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
        self.wait_delayed()
        self.delayed.clear()
        self.dirty.clear()
        self.loaded = None

    def _update_task(self, group: int, check: bool = True) -> Callable[[], None]:
        """The host update of ``group``; with ``check``, only if its gradient is valid when the
        task runs (a delayed update was checked when issued: zero_grad() may run before it)."""
        if self.optimizer is None:
            return lambda: None
        hp = self.optimizer.config.hyperparams()
        opt, store = self.optimizer, self.store

        def run() -> None:
            if not check or store.grad_state[group] == GRAD_VALID:
                opt.update(group, hp)

        return run

    # ---- waiting and errors ------------------------------------------------------------------
    def _wait(self, program: Program, issued: list[tuple[fx.Node, Token]]) -> None:
        for _, tok in issued:
            tok.wait()
        failed = [(n, t) for n, t in issued if t.error is not None]
        if not failed:
            return
        root = next(((n, t) for n, t in failed if not isinstance(t.error, DependencyFailed)), failed[0])
        node, tok = root
        err = tok.error
        action = str(get_meta(node).action)
        where = f"action {action} of program {program.name!r} failed"
        if isinstance(err, OutOfDeviceMemory):
            raise _oom_in(err, f"action {action} of program {program.name!r}") from err
        raise ActionError(f"{where}: {type(err).__name__}: {err}\n\n{program.format(mark=node)}", action) from err

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

    # ---- phases ----------------------------------------------------------------------------------
    def forward(
        self, variant: Variant, inputs: Sequence[torch.Tensor], grad: bool, *, serial: bool = False
    ) -> tuple[list[torch.Tensor], StepContext]:
        if self.pending_updates:
            accum = (
                f" (with grad_accum_steps={self.grad_accum_steps} the update starts in every "
                f"{self.grad_accum_steps}th backward)"
                if self.grad_accum_steps > 1
                else ""
            )
            raise UsageError(
                "the model was called while the optimizer update started by the last backward() is still "
                f"pending{accum}: call cm.step() after backward() and before the next forward (shfx starts the "
                "update during backward). To defer updates to step() instead, compile with overlap_update=False."
            )
        self._evict()
        with self.backend.during("setup"):
            self.ensure_pool(variant.slot_sizes, variant.grad_buffer_sizes)
            if self.device_optimizer is not None:  # the states are part of the steady state: allocate them now
                self.device_optimizer.ensure([self.store.groups[g] for g in sorted(variant.device_groups)])
            self._ensure_persistent(variant)
        if not serial:
            self.current = variant
        self.trace.clear()  # the trace covers the last forward and what follows it
        if grad and not serial and not self._profiling and self._step_t0 is None:
            self._step_t0 = time.perf_counter()
        ctx = StepContext(self, variant, grad)
        program = variant.train if grad else variant.eval
        nodes = program.phase_nodes("forward") if grad else program.nodes
        try:
            with self.backend.during("forward start"):
                for name, t in zip(variant.graph.inputs, inputs):
                    ctx.put(name, self.backend.to_device(t))
            issued = self._issue(ctx, program, nodes, cold=False, skip_updates=True, serial=serial)
            self._wait(program, issued)
        except BaseException:
            self._fail_cleanup(ctx)
            raise
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
        serialized unless ``serial=False`` (the profiler's timing runs)."""
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
            self.backward_calls += 1
        final = (
            not profile
            and self.overlap_update
            and self.optimizer is not None
            and self.backward_calls == self.grad_accum_steps
        )
        variant = ctx.variant
        cold = not ctx.hot or self.holder is not ctx
        if cold:
            self._evict()
            program = variant.cold
            nodes = program.nodes
        else:
            program = variant.train
            nodes = program.phase_nodes("backward")
        try:
            with self.backend.during("backward start"):
                for v, gr in zip(variant.graph.outputs, grad_outputs):
                    if gr is not None and variant.graph.values[v].differentiable:
                        ctx.add_grad(v, gr)
            issued = self._issue(ctx, program, nodes, cold=cold, skip_updates=not final, serial=serial)
            self._wait(program, [(n, t) for n, t in issued if not KINDS[get_meta(n).kind].update])
        except BaseException:
            self.pending_updates.clear()
            self._fail_cleanup(ctx)
            raise
        finally:
            if self.holder is ctx:
                self.holder = None
        in_grads = [ctx.grads.get(v) for v in variant.graph.inputs]
        with self.backend.during("end"):
            ctx.release_all()
        if not profile:
            self.expose_grads()
        return in_grads

    def expose_grads(self) -> None:
        """Point each trainable parameter's ``.grad`` at its slice of the host gradient buffer."""
        self.gradients.expose(self.param_keys_by_group)

    def step(self, program: Program | None = None) -> None:
        """Apply the optimizer: wait for updates started during backward, or run them now."""
        if self.optimizer is None:
            raise UsageError("step() needs an optimizer: pass optimizer=shfx.optim.AdamW(...) to shfx.compile")
        if self.delayed_update:
            self._delayed_step()
            return
        if not self.pending_updates:
            v = self.current
            dev = v.device_groups if v is not None else frozenset()
            groups = [
                i
                for i, g in enumerate(self.store.groups)
                if g.trainable_bytes and i not in dev and self.store.grad_state[i] == GRAD_VALID
            ]
            for gi in groups:
                tok = self.backend.cpu.submit(self._update_task(gi), [], f"U{gi}")
                self.pending_updates.append((f"U{gi}", tok))
            for gi in sorted(dev):
                if self.gradients.device_state.get(gi, GRAD_NONE) != GRAD_VALID:
                    continue
                owner = v.owner_of[gi]
                if self.loaded is not v or owner not in v.train.persistent:  # pragma: no cover - refused at compile
                    raise UsageError(f"group {gi} is updated on the device while its stage is resident; it is not now")
                slot = v.train.persistent.index(owner)
                tok = self.backend.compute.submit(self._device_step_task(v, gi, slot), [], f"DU{gi}")
                self.pending_updates.append((f"DU{gi}", tok))
        pending, self.pending_updates = self.pending_updates, []
        self.backward_calls = 0
        for _, tok in pending:
            tok.wait()
        if self._step_t0 is not None:
            self.step_times.append(time.perf_counter() - self._step_t0)
            self._step_t0 = None
        for label, tok in pending:
            err = tok.error
            if isinstance(err, OutOfDeviceMemory):
                raise _oom_in(err, f"the optimizer update {label}") from err
            if err is not None:
                where = "device" if label.startswith("DU") else "host"
                raise ActionError(f"{where} optimizer update {label} failed: {type(err).__name__}: {err}", label) from err

    def _delayed_step(self) -> None:
        """DPU: finish the previous step's updates, refresh the persistent slots with their
        weights, start this step's updates and return while they run."""
        self.finish_delayed(refresh=True)
        v = self.current
        dev = v.device_groups if v is not None else frozenset()
        groups = [
            gi
            for gi, g in enumerate(self.store.groups)
            if g.trainable_bytes and gi not in dev and self.store.grad_state[gi] == GRAD_VALID
        ]
        self.delayed.start(groups, lambda gi: self.backend.cpu.submit(self._update_task(gi, check=False), [], f"U{gi} (delayed)"))
        self.backward_calls = 0
        if self._step_t0 is not None:
            self.step_times.append(time.perf_counter() - self._step_t0)
            self._step_t0 = None

    def wait_delayed(self) -> None:
        """Wait for the delayed updates to reach the host weights (state_dict), leaving the
        device on the weights before them until the next step() refreshes it."""
        self.delayed.wait()

    def finish_delayed(self, refresh: bool = True) -> None:
        """Wait for the delayed updates; with ``refresh``, copy the updated weights into the
        persistent slots (otherwise they reload before the next step)."""
        try:
            if not self.delayed.finish():
                return
        except ActionError:
            self.loaded = None
            raise
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
            self.finish_delayed(refresh=False)
            self.sync_to_host()
        finally:
            if self.device_optimizer is not None:
                self.device_optimizer.close()
            self.gradients.close()
            if self.pool is not None:
                self.pool.close()
            self.loaded = None
            self.backend.close()

    def memory_summary(self) -> str:
        b = self.backend
        cap = "unlimited" if b.capacity_bytes is None else format_bytes(b.capacity_bytes)
        return f"device memory: {format_bytes(b.used_bytes)} in use, peak {format_bytes(b.peak_bytes)}, capacity {cap}"
