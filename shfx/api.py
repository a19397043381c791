"""``shfx.compile`` and the compiled model it returns."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from shfx.passes.capture import CaptureError, Captured, DynamicDim, cast_inputs, check_real_inputs, flatten_inputs
from shfx.passes.actions import KINDS
from shfx.passes.meta import get_meta
from shfx.passes.partition import StageGraph
from shfx.passes.pinned import plan_for_groups
from shfx.passes.pipeline import Variant, build_programs, compile_variant, probe_policy, with_policy
from shfx.passes.policies import Policy, Stronghold, least_image_window
from shfx.passes.program import ActionKind, Program

from shfx.cost_model.report import WindowReport

from ._capacity import check_capacity, check_deferrable, check_host_budget, check_one_stage
from ._capture_cache import covering, dynamic_dims, masked, shape_change_error, structure
from ._model_binding import Bound, bind_record, check_model
from ._runtime_setup import ensure_ssd, param_tier_store, start_engine
from ._state_methods import StateMethods
from ._tuning import measure_ssd_rates, tune_variant, warn_unused_window
from ._activation_offload import narrow_activation_offload
from .config import Config
# data parallel's refusals live in shfx.config (check_supported); the name stays importable here
from .config import _check_data_parallel as _check_data_parallel  # noqa: F401
from .devices import CudaDevice, EmulatedDevice
from .errors import OutOfDeviceMemory, UsageError
from .runtime.data_parallel import DataParallelRuntime
from .runtime.backend import Backend
from .runtime.engine import Engine, StepContext
from .runtime.host_store import HostStore

__all__ = ["compile", "CompiledModel"]

# options that belong to one policy: shfx.compile takes them on the policy object
_POLICY_OPTIONS = {
    "resident_first": "policy=shfx.Stronghold(window=2, resident_first=1)",
    "delayed_update": "policy=shfx.ZeroOffload(delayed_update=True)",
    "lookahead": "policy=shfx.ZeroInfinity(lookahead=2)",
}

# model -> its live compiled model. NOTE: the value is a weak reference: the compiled model holds
# its model, so a strong value would keep both (and the backend's worker threads) alive forever.
_COMPILED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[CompiledModel]] = weakref.WeakKeyDictionary()


def _refuse_policy_options(kwargs: dict[str, Any]) -> None:
    """Refuse an option :data:`_POLICY_OPTIONS` moved onto its policy, saying how to pass it now."""
    moved = [k for k in kwargs if k in _POLICY_OPTIONS]
    if moved:
        k = moved[0]
        raise TypeError(
            f"shfx.compile({k}=...) is an option of the policy now: pass {_POLICY_OPTIONS[k]} "
            "(policy-specific options live on the policy object)"
        )


def _compiled_of(model: nn.Module) -> CompiledModel | None:
    ref = _COMPILED.get(model)
    return ref() if ref is not None else None


# every device type torch.autocast knows (and the out-of-tree backend's name, added at run time)
_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "mtia", "maia")


def _autocast_device_types() -> list[str]:
    """The device types torch.autocast is enabled for in this thread."""
    types = list(_AUTOCAST_DEVICE_TYPES)
    backend = getattr(torch._C, "_get_privateuse1_backend_name", lambda: "privateuseone")()
    if backend not in types:
        types.append(backend)
    enabled = []
    for t in types:
        try:
            if torch.is_autocast_enabled(t):
                enabled.append(t)
        except (RuntimeError, TypeError, ValueError):  # a device type this build of torch does not know
            continue
    if not enabled and torch.is_autocast_enabled():  # the CUDA check of older torch
        enabled.append("cuda")
    return enabled


def _make_backend(device: EmulatedDevice | CudaDevice, optimizer_workers: int) -> Backend:
    """The backend of a device spec (:attr:`shfx.config.Config.device`)."""
    if isinstance(device, EmulatedDevice):
        from .runtime.emulated import EmulatedBackend

        return EmulatedBackend(device, optimizer_workers)
    from .runtime.cuda import CudaBackend

    return CudaBackend(device, optimizer_workers)



class _OffloadFunction(torch.autograd.Function):
    """Runs the forward program in forward and the backward program in backward, so
    ``loss.backward()`` drives the offloaded backward, whatever the loss is computed from."""

    @staticmethod
    def forward(ctx, cm: CompiledModel, variant: Variant, dummy: torch.Tensor, *inputs: torch.Tensor):  # type: ignore[override]
        outs, sctx = cm._engine.forward(variant, list(inputs), grad=True)
        ctx.sctx = sctx
        ctx.engine = cm._engine
        ctx.n_inputs = len(inputs)
        ctx.set_materialize_grads(False)
        values = variant.graph.values
        outs = list(outs)
        seen: set[int] = set()
        for i, (o, v) in enumerate(zip(outs, variant.graph.outputs)):
            if id(o) in seen or any(o is x for x in inputs):
                outs[i] = o.clone()  # autograd needs distinct outputs
            seen.add(id(outs[i]))
        nondiff = [o for o, v in zip(outs, variant.graph.outputs) if not values[v].differentiable]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        sctx: StepContext | None = ctx.sctx
        if sctx is None:
            raise UsageError(
                "backward() ran a second time through the same shfx forward (loss.backward(retain_graph=True) "
                "then backward() again, or two losses computed from the same model output); shfx runs one "
                "backward per forward, and frees the forward's state in it. Add the losses and call backward() "
                "once ((loss1 + loss2).backward()), or call the model again for another backward."
            )
        ctx.sctx = None
        eng: Engine = ctx.engine
        eng.await_deferred()  # the clipped updates of the last step() read the gradients (done by now)
        if not eng.pending_updates:  # (else the backward is refused: the update reads the gradients)
            eng.gradients.take_user_grads(eng.param_keys_by_group)  # model.zero_grad(), p.grad = ...
        in_grads = eng.backward(sctx, list(grads))
        return (None, None, None, *in_grads)


class _Prescaled(torch.autograd.Function):
    """Identity, whose backward tells the engine that the gradients reaching the model's outputs
    in this backward pass are already scaled (:meth:`CompiledModel.scale_loss`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, engine: Engine):  # type: ignore[override]
        ctx.engine = engine
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.engine.mark_prescaled()
        return grad, None


_NO_GENERATE = (
    "CompiledModel has no generate(): shfx compiles the training step (forward, backward, the optimizer "
    "update), not generation. To generate with the trained weights: call cm.sync() after cm.step() (it waits for "
    "the updates and copies weights a policy updated on the device back into the model's own tensors, which "
    "are views of shfx's host store), then call {model}'s own generate() eagerly on the CPU where those tensors "
    "live (without cm.sync() it may read weights a few updates old); or load them into a separate copy of the "
    "model on your accelerator: gen.load_state_dict(cm.state_dict()); gen.generate(...); or decode step by step "
    "with the compiled model under torch.no_grad(): logits = cm(ids).logits; ids = torch.cat([ids, "
    "logits[:, -1:].argmax(-1)], 1) (one dynamic capture covers the growing length: docs/usage.md, "
    "'Variable shapes')"
)


class CompiledModel(StateMethods):
    """A model compiled by :func:`shfx.compile`: call it like the model, then
    ``loss.backward()``, ``cm.step()``, ``cm.zero_grad()``.

    Attributes:
        module: the original model; its parameters and buffers now live in shfx's host store
            (``module.state_dict()`` reads the current weights).
        optimizer: the optimizer, a ``torch.optim.Optimizer`` bound to the model (``param_groups``,
            ``state``, ``state_dict()``; schedulers work on it; ``cm.optimizer.lr = x`` sets every group).
    """

    # NOTE: the state methods (state_dict, load_state_dict, save_checkpoint, wait_checkpoint,
    # load_checkpoint, sync, _settle) are StateMethods' (shfx._state_methods)

    def __init__(self, model: nn.Module, **options: Any):
        if not isinstance(model, nn.Module):
            raise TypeError(f"shfx.compile takes an nn.Module, got {type(model).__name__}")
        if _compiled_of(model) is not None:
            raise UsageError(
                f"this {type(model).__name__} is already compiled by shfx; use that compiled model, or call its "
                ".close() first (its parameters live in that model's host store)"
            )
        bad = [(n, p.device) for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.device.type != "cpu"]
        if bad:
            n, d = bad[0]
            raise ValueError(
                f"shfx.compile expects the model on the CPU (its weights live in host memory and stream to the "
                f"device); {n!r} is on {d}. Build the model on the CPU or call model.cpu() first."
            )
        # every option checked and normalised, its conflicts refused, the policy final: once
        self._config = config = Config.from_args(**options)
        self._dp: DataParallelRuntime | None = None
        if config.data_parallel is not None:
            self._dp = DataParallelRuntime(
                config.data_parallel.process_group, config.data_parallel.timeout_s,
                replicated=getattr(config.optimizer, "data_parallel", None) == "replicated",
            )  # fmt: skip
            if self._dp.ranks == 1:  # one rank: nothing to reduce or shard, the single-process runtime
                self._dp = None
        self._backend = _make_backend(config.device, config.optimizer_workers)
        if self._dp is not None:
            self._backend.add_collective_streams()
        # every pinned buffer comes from the backend's pool, within this budget (docs/usage.md, "Pinned memory")
        self._backend.pinned.budget_bytes = config.pinned if config.pin_memory else 0  # (pin_memory=False: nothing, whoever asks)
        # dropped without close() (or failing below): stop the worker threads and free the device
        # when the compiled model is garbage (the finalizer holds the backend, not self)
        self._finalizer = weakref.finalize(self, self._backend.close)
        self._options = config.pipeline_options(ranks=self._dp.ranks if self._dp is not None else 1)
        self.module = model
        self.optimizer = config.optimizer
        if self.optimizer is not None:
            self.optimizer.attach(self, model)  # its param_groups now hold the model's parameters
        self._engine: Engine | None = None
        self._store: HostStore | None = None
        self._param_ssd: Any = None  # the parameter tier's SSD store, from the host store's layout to the window
        self._paged_hook: Any = None  # the parameter tier's state_dict hook on the model
        self._pinned_windows: tuple[int, int] | None = None  # the (image, gradient) windows the pinned plan has
        # per model tensor in the host store: (key, tensor, its data_ptr, owning module and name
        # and requires_grad for a parameter): what __call__ checks the model against
        self._bound: list[Bound] = []
        # captures, least recently used first: keyed by the input signature, or for a dynamic
        # capture by ("dynamic", its signature with the dynamic sizes masked, its number)
        self._variants: OrderedDict[Any, Variant] = OrderedDict()
        self._cache_stats = {"captures": 0, "dynamic_captures": 0, "hits": 0, "evictions": 0}
        self._seen_shapes: dict[Any, set[tuple[tuple[int, ...], ...]]] = {}  # automatic mode: shapes per structure
        self._dynamic_off: str | None = None  # why dynamic capture failed (then per-shape captures)
        self._reports: dict[Any, WindowReport] = {}  # per input signature (the tuner's, or profiled for a fixed window)
        self._last: Variant | None = None
        self._last_tensors: list[torch.Tensor] | None = None
        self._dummy = torch.empty(0, requires_grad=True)
        self._pending_checkpoint: dict[str, Any] | None = None  # loaded before the first call (shfx.checkpoint)
        self._checkpoint_save: Any = None  # the asynchronous save in flight (shfx.checkpoint.AsyncSave)
        self._checkpoint_staging: dict[str, torch.Tensor] = {}  # its host copy, reused by the next one
        _COMPILED[model] = weakref.ref(self)

    @property
    def config(self) -> Config:
        """The compile options, validated and normalised once (:class:`shfx.config.Config`,
        frozen): what this compiled model runs with."""
        return self._config

    @property
    def policy(self) -> Policy:
        """The policy as given (``"auto"`` fields left to the tuner); each input signature's
        variant holds the one chosen for it (``cm.variant.policy``)."""
        return self._config.policy

    @property
    def window(self) -> int | str | None:
        """The window asked for (``"auto"``: the tuner's), None for a policy without one."""
        return self._config.window

    # the options read most (cm.config has them all)
    precision = property(lambda self: self._config.precision, doc="``'fp32'``, ``'bf16'`` or ``'fp16'``.")
    scaler = property(lambda self: self._config.scaler, doc="fp16's loss scaler (:class:`shfx.LossScaler`), else None.")
    offload = property(lambda self: self._config.offload, doc="The :class:`shfx.Offload` spec, or None.")
    recompute = property(lambda self: self._config.recompute, doc="How a stage's backward recomputes its forward.")
    tune_tolerance = property(lambda self: self._config.tune_tolerance, doc="The tuner's tolerance.")
    pin_memory = property(lambda self: self._config.pin_memory, doc="Whether the host buffers that cross the link are pinned (within ``pinned``).")
    max_captures = property(lambda self: self._config.max_captures, doc="How many captures are kept.")

    # ---- compilation -------------------------------------------------------------------------
    def _variant(self, args: tuple, kwargs: dict) -> tuple[Variant, list[torch.Tensor]]:
        """The variant for this call: the capture of its exact signature, or a dynamic capture
        whose ranges cover it (a hit), else a new capture (LRU-bounded by ``max_captures``)."""
        tensors, sig, _ = flatten_inputs(args, kwargs, self.module.training)
        check_real_inputs(tensors, type(self.module).__name__)
        key, v = sig, self._variants.get(sig)
        if v is None:
            key, v = covering(self._variants, sig, tensors, self._config.dynamic)
        if v is not None:
            self._cache_stats["hits"] += 1
            self._variants.move_to_end(key)
        else:
            dims = dynamic_dims(self._variants, self._seen_shapes, sig, tensors, self._config.dynamic, self._dynamic_off)
            try:
                v = self._build(args, kwargs, tensors, dims)
            except CaptureError as e:
                seen = self._seen_shapes.get(structure(sig), set())
                shape_error = shape_change_error(type(self.module).__name__, args, kwargs, tensors, seen, e)
                if shape_error is not None:
                    raise shape_error from e.__cause__
                raise
            dyn = v.captured.dynamic
            if dyn is not None and dyn.mismatch(tensors) is not None:  # torch.export narrowed the range
                self._cache_stats["captures"] += 1
                self._cache_stats["dynamic_captures"] += 1
                self._variants[("dynamic", masked(sig, dyn), self._cache_stats["captures"])] = v
                v = self._build(args, kwargs, tensors, None)
                dyn = None
            self._cache_stats["captures"] += 1
            if dyn is not None:
                self._cache_stats["dynamic_captures"] += 1
                key = ("dynamic", masked(sig, dyn), self._cache_stats["captures"])
            else:
                key = sig
            self._variants[key] = v
        seen = self._seen_shapes.setdefault(structure(sig), set())
        if len(seen) < 64:  # enough to tell which dimensions vary
            seen.add(tuple(tuple(t.shape) for t in tensors))
        self._last = v
        self._last_tensors = tensors
        self._evict()
        return v, tensors

    def _evict(self) -> None:
        """Drop the least recently used captures beyond ``max_captures`` (never one a step is
        using); their graphs and programs are freed with them."""
        eng = self._engine
        busy = {id(self._last)}
        if eng is not None:
            busy |= {id(eng.loaded), id(eng.current)}
        while len(self._variants) > self.max_captures:
            key = next((k for k, v in self._variants.items() if id(v) not in busy), None)
            if key is None:
                return
            v = self._variants.pop(key)
            if v.signature is not None and not any(x.signature == v.signature for x in self._variants.values()):
                self._reports.pop(v.signature, None)
            self._cache_stats["evictions"] += 1

    def _build(
        self, args: tuple, kwargs: dict, tensors: list[torch.Tensor], dims: list[DynamicDim] | None = None
    ) -> Variant:
        groups = self._store.groups if self._store is not None else None

        def choose(captured: Captured, graph: StageGraph, policy: Policy) -> Policy | tuple[Policy, dict]:
            opts = self._options
            probe = probe_policy(policy, opts.param_tier)
            # (with activation offload the probe offloads too: it must fit where the training does;
            # with the parameter tier its groups' images are on the SSD as in training, with the
            # fewest buffers: the host store is laid out for it, paged, before the profile)
            least = least_image_window(probe.program(graph.specs)) if opts.param_tier else None
            pv = Variant(captured.signature, captured, graph, probe, *build_programs(
                graph.specs, probe, activations=opts.activations, activation_window=opts.activation_window,
                param_tier=opts.param_tier, image_window=least or None,
                masters=opts.param_tier and captured.working_dtype is not None,
            ))  # fmt: skip
            tier = pv if pv.train.ssd_images else None
            if tier is not None and self._store is None:  # (the least any choice holds; the choice is bounded below)
                check_host_budget(pv, self.offload.host_budget_bytes, self._config.grad_accum_steps)
            self._ensure_store(captured, graph, tier)
            if tier is not None:  # (the probe's windows: the SSD store and its window before the profile)
                ensure_ssd(self._engine, self._store, self.offload, pv, self._param_ssd)
                self._param_ssd = None
            self._check_one_stage(graph)
            report = self._tune(pv, tensors, policy, how="auto")
            self._reports[captured.signature] = report
            if opts.image_window == "auto" and report.tune.image_window is not None:
                return report.tune.policy, {"image_window": report.tune.image_window}
            return report.tune.policy

        dynamic_failed: tuple[list[DynamicDim], Exception] | None = None
        if dims:
            try:
                variant = compile_variant(self.module, args, kwargs, self._options, groups=groups, choose=choose, dynamic=dims)
            except (KeyboardInterrupt, OutOfDeviceMemory):
                raise
            except Exception as e:  # noqa: BLE001 - per-shape captures from now on, said once
                dynamic_failed = (dims, e)
                dims = None
        if not dims:
            # NOTE: when this shape cannot be captured at all (a feature size changed), the
            # dynamic failure says nothing about dynamic capture: no warning, dynamic stays on
            variant = compile_variant(self.module, args, kwargs, self._options, groups=groups, choose=choose)
        if dynamic_failed is not None:
            failed_dims, e = dynamic_failed
            self._dynamic_off = f"{type(e).__name__}: {e}"
            warnings.warn(
                f"shfx could not capture {type(self.module).__name__} with dynamic dimensions "
                f"({', '.join(sorted({d.name for d in failed_dims}))}), so every new input shape is captured again "
                f"(compile with dynamic=False to silence this). Why: {e}",
                stacklevel=4,
            )
        warn_unused_window(variant, stacklevel=4)
        if self.offload is not None:  # (before anything is laid out, or the windows grow to the tuner's choice)
            check_host_budget(variant, self.offload.host_budget_bytes, self._config.grad_accum_steps)
        self._ensure_store(variant.captured, variant.graph, variant)
        if self.pin_memory and variant.train.ssd_images:
            self._plan_pinned(variant.graph, variant.train)
        if self.offload is not None and self.offload.activations == "auto":  # (the stages chosen from the costs)
            variant = narrow_activation_offload(variant, self._engine, tensors, self._backend.capacity_bytes)
        self._store.ensure_staging(variant.staging_buffers(self._config.grad_accum_steps))
        ensure_ssd(self._engine, self._store, self.offload, variant, self._param_ssd)
        self._param_ssd = None  # (the window owns it now)
        if self._store.paged_keys and self._paged_hook is None:  # (the parameter tier: model.state_dict() reads the SSD)
            self._paged_hook = self.module._register_state_dict_hook(self._paged_values_hook)
        if variant.signature not in self._reports:
            self._check_one_stage(variant.graph)
            self._check_capacity(variant)
        self._check_deferrable(variant)
        return variant

    def _ensure_store(self, captured: Captured, graph: StageGraph, variant: Variant | None = None) -> None:
        """The first capture lays out the host store and starts the engine; a later one copies
        its tensor constants in (their values may differ). With the parameter tier
        (``variant.train.ssd_images``) the SSD store comes first: the host store writes each
        paged group into it as it lays the group out."""
        if self._store is None:
            model_tensors = {**captured.params, **captured.buffers, **captured.constants}
            paged, spill = frozenset(), None
            if variant is not None and variant.train.ssd_images:
                self._param_ssd, spill = param_tier_store(
                    self.offload, variant, accumulate=self._config.grad_accum_steps > 1, optimizer=self.optimizer,
                )  # fmt: skip
                paged = variant.train.ssd_images
            if self.pin_memory:  # the pinned pool's plan (refused here, before training, when the budget is too small)
                self._plan_pinned(graph, variant.train if paged else None)
            self._store = HostStore(
                self._backend, graph.groups, model_tensors, pin=self.pin_memory, dp=self._dp, paged=paged, spill=spill,
            )  # (data parallel: broadcasts rank 0's weights, collectively)
            self._engine = start_engine(self._backend, self._store, self.optimizer, self._config, self._dp, self.module, captured, graph)
            self._bound = bind_record(self.module, captured)
        elif captured.constants:
            for k, t in captured.constants.items():  # constants of this capture (values may differ)
                if k in self._store.paged_keys:
                    raise UsageError(
                        f"this input shape's capture has its own value of the constant {k!r}, which the parameter tier keeps "
                        "on the SSD with its stage's image (Offload(params='nvme')): writing it there is not built; use one "
                        "input shape (or dynamic=...), or params='host'"
                    )
                if k in self._store.tensors:
                    self._store.tensors[k].copy_(t)

    def _plan_pinned(self, graph: StageGraph, tier: Program | None) -> None:
        """The pinned pool's plan for the host store of ``graph`` (``tier``: a program with the
        parameter tier, whose window buffers take the paged groups' places); planned again when a
        later program's windows are larger (the tuner's choice after the probe's least windows)."""
        windows = (tier.image_window, tier.host_window) if tier is not None else (0, 0)
        planned = self._pinned_windows
        if planned is not None:
            if windows[0] <= planned[0] and windows[1] <= planned[1]:
                return
            windows = (max(windows[0], planned[0]), max(windows[1], planned[1]))
        self._pinned_windows = windows
        self._backend.pinned.set_plan(plan_for_groups(
            graph.groups, self._config.pinned, data_parallel=self._dp is not None, paged=tier.ssd_images if tier is not None else (),
            image_window=windows[0], gradient_window=windows[1],
        ))  # fmt: skip

    def _ssd_rates(self) -> tuple[float, float]:
        """The SSD's read and write bytes/s for the tuner: the emulated rates of the Offload spec,
        else measured once on its path (:func:`shfx._tuning.measure_ssd_rates`)."""
        off = self.offload
        if off.read_bps is not None and off.write_bps is not None:
            return off.read_bps, off.write_bps
        if getattr(self, "_ssd_measured", None) is None:
            self._ssd_measured = measure_ssd_rates(off)
        return self._ssd_measured

    # the refusals of a variant the device cannot run (shfx._capacity) and its tuning (shfx._tuning)
    def _check_one_stage(self, graph: StageGraph) -> None:
        check_one_stage(graph, self._backend)

    def _check_capacity(self, variant: Variant) -> None:
        check_capacity(variant, self._backend, self._config.grad_accum_steps)

    def _check_deferrable(self, variant: Variant) -> None:
        check_deferrable(variant, self._config.grad_accum_steps, self._config.overlap_update)

    def _tune(
        self, variant: Variant, tensors: list[torch.Tensor], policy: Policy, how: str, refresh: bool = False
    ) -> WindowReport:
        # (mixed precision: the profile's steps take the inputs as a call gives them, cast to the
        # 16-bit dtype; ``tensors`` are the call's own, kept for report() and retune())
        tensors = cast_inputs(tensors, variant.captured.working_dtype)
        off = self.offload
        return tune_variant(
            self._engine, self._backend, variant, tensors, policy, how, tolerance=self.tune_tolerance,
            rollback=self._config.rollback, ssd_rates=self._ssd_rates, refresh=refresh,
            host_budget=off.host_budget_bytes if off is not None else None, image_window=self._options.image_window,
            grad_accum_steps=self._config.grad_accum_steps,
        )  # fmt: skip

    # ---- running ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        autocast = _autocast_device_types()
        if autocast:
            raise NotImplementedError(
                f"torch.autocast is enabled for {', '.join(repr(t) for t in autocast)} around this call; shfx does "
                "not run under autocast (its stages are captured once, and autocast's per-op casts of fp32 weights "
                "would not match eager autocast). For mixed precision compile with shfx.compile(model, "
                "precision='bf16') or precision='fp16' (16-bit weights and gradients on the device, fp32 master "
                "weights on the host) and call the compiled model outside torch.autocast."
            )
        if self._engine is not None and not self._engine.pending_updates:  # (else engine.forward refuses)
            check_model(self._bound, self._store, self._engine)
        variant, tensors = self._variant(args, kwargs)
        assert self._engine is not None
        if self._pending_checkpoint is not None:  # a checkpoint loaded before the host store existed
            from .checkpoint import apply_pending

            apply_pending(self, variant)
        tensors = cast_inputs(tensors, variant.captured.working_dtype)  # mixed precision: as the 16-bit copy takes them
        if torch.is_grad_enabled():
            outs = _OffloadFunction.apply(self, variant, self._dummy, *tensors)
        else:
            outs, _ = self._engine.forward(variant, tensors, grad=False)
        return variant.captured.structure.rebuild(list(outs))

    forward = __call__

    def __getattr__(self, name: str) -> Any:
        # (only for names CompiledModel does not have: a clear answer for generate())
        if name == "generate":
            raise AttributeError(_NO_GENERATE.format(model=type(self.__dict__.get("module")).__name__))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def step(self) -> None:
        """Apply the optimizer to every group (waits for updates started during backward).

        Gradients are read as PyTorch code left them (``p.grad`` edited in place, rebound, or
        set to None for every parameter of a stage), as ``torch.optim`` reads them, except after
        a backward that started the updates (``overlap_update=True``, the default): they have
        already read the gradients, so an edit since raises :class:`UsageError` here (after the
        step has been applied with the gradients the backward computed).

        A failed update leaves the others applied and the gradients kept: calling ``step()``
        again applies the step exactly once (with ``rollback=True`` the step is undone first).
        With ``skip_nonfinite=True`` a step whose gradients hold inf or NaN is skipped
        (``cm.last_step_skipped``, ``cm.skipped_steps``); see "When something fails" in
        docs/usage.md.

        ``cm.optimizer.step()`` is the same call (this calls it, so a learning-rate scheduler's
        and the optimizer's step hooks see it)."""
        if self.optimizer is not None:
            self.optimizer.step()
        else:
            self._apply_step()

    def _apply_step(self) -> None:
        """:meth:`step`'s work (``HostOptimizer.step`` calls it)."""
        self._require_engine("step")
        eng = self._engine
        grads = eng.gradients
        edited = grads.edited_since_expose()
        if edited is None and not eng.pending_updates:
            grads.take_user_grads(eng.param_keys_by_group, before_step=True)
        try:
            eng.step()
        finally:
            grads.note_step()
        if edited is not None:
            raise UsageError(
                f"{edited} after backward(), but the optimizer update had already started during backward() "
                "(overlap_update=True, the default) and read the gradients as backward computed them: this step "
                "was applied without your edit (an edit racing with a running update may have been seen in part). "
                "To edit gradients before the update (gradient clipping, scaling), compile with "
                "overlap_update=False; for gradient clipping, compile with max_grad_norm=... (exact, and the update stays "
                "overlapped) and/or call cm.clip_grad_norm_(). "
                "Reload the last checkpoint if this step must not count."
            )

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of this step by their global norm, as
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)`` called
        between ``backward()`` and ``step()``: returns the total norm (a 0-dim fp32 tensor, of the
        unscaled gradients in fp16), and ``step()`` scales every gradient by
        ``min(max_norm / (total + 1e-6), 1)`` before its update (bitwise like eager clip then
        ``torch.optim.AdamW(fused=True)`` on the CPU). ``p.grad`` keeps the unclipped values
        until ``step()``.

        With ``overlap_update=True`` (the default) the updates start during ``backward()``, before
        every gradient is known, so this needs ``shfx.compile(max_grad_norm=...)`` (the schedule
        that computes the norms during backward and runs the updates in the next forward; this
        call then overrides ``max_norm`` for the step) or ``overlap_update=False``.

        Under data parallel every rank calls it (as a collective): the program's step gate
        (``NR0``: the per-parameter norms of the shards summed across ranks; ``CK0``: the total)
        runs at the call, so every rank returns the same total, torch's ``clip_grad_norm_`` on
        the DDP-reduced gradients (docs/usage.md, "Data parallel").

        >>> import torch, shfx
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="1MiB"), optimizer=shfx.optim.AdamW(lr=1e-3),
        ...                   blocks=False, num_stages=4, max_grad_norm=1.0)
        >>> cm(torch.randn(2, 8)).sum().backward()
        >>> total = cm.clip_grad_norm_(0.5); cm.step(); cm.zero_grad()
        >>> total.dtype, total.dim()
        (torch.float32, 0)
        """
        self._require_engine("clip_grad_norm_")
        eng = self._engine
        v = self._last
        if v is not None and eng.overlap_update and eng.pending_updates and any(
            get_meta(n).kind != ActionKind.GRAD_NORM and KINDS[get_meta(n).kind].update and get_meta(n).phase == "backward"
            for n in v.train.nodes
        ):
            raise UsageError(
                f"clip_grad_norm_() after backward(), but {v.train.name!r} started the optimizer updates during "
                "backward(), before every gradient was known. Compile with max_grad_norm=... (exact clipping that keeps "
                "the update overlapped: norms during backward, updates in the next forward), or overlap_update=False."
            )
        return eng.clip_grad_norm(max_norm, norm_type)

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """The total gradient norm the last clipped ``step()`` used (None before one)."""
        return None if self._engine is None else self._engine.last_grad_norm

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (fp16; other precisions: ``loss`` itself), for a loss
        computed outside the model: ``cm.scale_loss(loss).backward()``, as
        ``torch.amp.GradScaler.scale(loss).backward()``, so the loss's own backward runs scaled
        too. ``loss.backward()`` alone also trains (the backward scales the gradients reaching
        the model's outputs), but the gradient of the loss computed outside is then unscaled in
        16-bit, where small values lose precision or flush to zero."""
        if self.scaler is None:
            return loss
        self._require_engine("scale_loss")
        return _Prescaled.apply(loss * self.scaler.scale_tensor(), self._engine)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because a gradient was not finite (``skip_nonfinite=True``)."""
        return self._engine.skipped_steps if self._engine is not None else 0

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last ``step()`` was skipped for a non-finite gradient."""
        return self._engine.last_step_skipped if self._engine is not None else False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients, like ``torch.optim.Optimizer.zero_grad``."""
        if self._engine is None:
            for p in self.module.parameters():
                p.grad = None
            return
        self._engine.zero_grad(set_to_none)

    def _require_engine(self, what: str) -> None:
        if self._engine is None:
            raise UsageError(f"{what}() before the first forward: call the model first (shfx captures it on the first call)")

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any):
        return self.module.named_parameters(*args, **kwargs)

    def train(self, mode: bool = True) -> CompiledModel:
        self.module.train(mode)
        return self

    def eval(self) -> CompiledModel:
        return self.train(False)

    @property
    def training(self) -> bool:
        return self.module.training

    def to(self, *args: Any, **kwargs: Any) -> CompiledModel:
        """Refused: shfx keeps the weights in its host store and streams them to its device.

        Training loops that move the model themselves: Hugging Face's ``Trainer`` has
        ``shfx.hf.Trainer``; ``accelerate`` passes the compiled model through ``prepare``
        unchanged (docs/usage.md, "Hugging Face Trainer and accelerate")."""
        raise UsageError(
            f"{type(self).__name__}.to{args!r}: the compiled model cannot be moved; shfx keeps its weights in host memory "
            f"and streams them to its device ({self._backend.device}); give inputs on the device the model was called "
            "with. For Hugging Face's Trainer use shfx.hf.Trainer(model=..., args=...), which leaves placement to shfx "
            "and clips without breaking the overlapped update; accelerate's prepare() passes the compiled model through."
        )

    # ---- introspection ------------------------------------------------------------------------
    @property
    def program(self) -> Program:
        """The step program of the most recent input signature (``print(cm.program)``)."""
        if self._last is None:
            raise UsageError("no program yet: shfx captures the model on its first call; call it once first")
        return self._last.train

    def report(self) -> WindowReport:
        """The window report of the last input signature: per window the predicted step time,
        device memory and bottleneck, the choice and why, and measured vs predicted.

        With ``window="auto"`` it is the tuner's report; with a fixed window the costs are
        profiled now (once per signature) to predict every window for comparison. When the
        measured steps keep missing the prediction it says so (``report.drift``);
        :meth:`retune` then profiles and tunes again.

        Under data parallel it runs no collective (any rank may call it, alone): with
        ``window="auto"`` it is the tuning every rank agreed on (rank 0's profile and choice,
        this rank's measured steps); with a fixed window this rank's own profile."""
        v = self.variant
        rep = self._reports.get(v.signature)
        if rep is None:
            self._settle()
            rep = self._tune(v, self._last_tensors or [], v.policy, how="fixed")
            self._reports[v.signature] = rep
        return rep

    def retune(self) -> WindowReport:
        """Profile the costs again and re-run the tuner, for the last input signature.

        The costs are measured again on the device (not taken from the process's cache, which
        the new profile replaces) and the tuner runs again over the policy's ``"auto"`` fields;
        if its choice (the window, STRONGHOLD's ``resident_first``) changes, that signature's
        programs are rebuilt and the next step runs them: weights and optimizer states carry
        over, so training goes on exactly as before. With a fixed window only the report's
        predictions are refreshed. For when ``cm.report()`` says the measured steps keep
        missing the prediction (a profile taken while the machine was busy, say).

        Under data parallel with ``"auto"`` fields it is collective: **every rank calls it**, at
        the same point between steps (each rank profiles on its own, rank 0 chooses, every rank
        gets that choice and rebuilds alike); a rank that does not call it leaves the others
        waiting until ``DataParallel(timeout_s=...)``, then failing with ``RankLost``. With a
        fixed window it only refreshes this rank's report (no collective).

        Call it between steps: after ``cm.step()`` and before the next forward.

        Returns:
            the new :class:`~shfx.cost_model.report.WindowReport` (``cm.report()`` returns it
            from now on); its measured steps start with the next step.

        Raises:
            UsageError: before the first call, between a forward and its ``cm.step()``, or for
                a policy without a window.

        >>> import torch, shfx
        >>> cm = shfx.compile(torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]), window="auto",
        ...                   device=shfx.EmulatedDevice(memory="1MiB"), optimizer=shfx.optim.AdamW(),
        ...                   blocks=False, num_stages=4)
        >>> cm(torch.randn(2, 8)).sum().backward(); cm.step(); cm.zero_grad()
        >>> rep = cm.retune()
        >>> rep is cm.report() and rep.window == cm.program.num_slots
        True
        """
        self._require_engine("retune")
        eng = self._engine
        v = self.variant
        if eng.holder is not None or eng.pending_updates or (eng.backward_calls and self.optimizer is not None):
            raise UsageError(
                "cm.retune() runs between steps, but a step is under way (a forward waiting for its backward, or a "
                "backward whose optimizer update is pending): finish it with loss.backward() and cm.step() first"
            )
        policy = self._config.policy
        if not policy.windowed:
            raise UsageError(
                f"cm.retune() tunes a window, and policy {policy.name!r} has none; use a windowed policy "
                "(shfx.Stronghold(window='auto'), say) to have shfx choose and re-choose it"
            )
        self._settle()
        how = "auto" if policy.auto else "fixed"
        tensors = self._last_tensors or []
        report = self._tune(v, tensors, policy if how == "auto" else v.policy, how, refresh=True)
        # (the parameter tier with image_window="auto": its image buffers are the tuner's too)
        iw = report.tune.image_window if self._options.image_window == "auto" and v.train.ssd_images else v.train.image_window
        if how == "auto" and (report.tune.policy != v.policy or iw != v.train.image_window):
            verify = self._config.verify or self._config.verify_each_pass
            new = with_policy(v, report.tune.policy, verify=verify, **({"image_window": iw} if v.train.ssd_images else {}))
            new = dataclasses.replace(new, passes=v.passes)
            moved = sorted(set(new.device_groups) ^ set(v.device_groups))
            if eng.dp is not None and moved:
                # NOTE: every rank has rank 0's choice, so every rank refuses alike. Moving a group
                # between the device (whole states, replicated) and the host (this rank's shard of
                # them) would need its states gathered or sliced across ranks: not built
                raise UsageError(
                    f"cm.retune() under data parallel chose {report.tune.policy!r}, which moves groups {moved} between "
                    f"the device and the host (the current policy is {v.policy!r}); moving their optimizer states "
                    "between the device (whole on every rank) and the host (sharded) is not built yet. Compile with a "
                    "fixed resident_first (window='auto' may stay) to retune under data parallel"
                )
            self._check_capacity(new)
            self._check_deferrable(new)
            if new.train.ssd_groups:  # (the NVMe tier: the new windows within the host budget, then allocated)
                if self.offload.host_budget_bytes is not None:
                    check_host_budget(new, self.offload.host_budget_bytes, self._config.grad_accum_steps)
                if self.pin_memory and new.train.ssd_images:
                    self._plan_pinned(new.graph, new.train)
                ensure_ssd(eng, self._store, self.offload, new, None)
            eng.replace_variant(v, new)
            for sig, x in self._variants.items():
                if x is v:
                    self._variants[sig] = new
            if self._last is v:
                self._last = new
        self._reports[v.signature] = report
        return report

    @property
    def variant(self) -> Variant:
        if self._last is None:
            raise UsageError("nothing compiled yet: call the model once first")
        return self._last

    @property
    def stages(self):
        """The partitioned model (stages, boundary values, host layout) of the last signature."""
        return self.variant.graph

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def engine(self) -> Engine:
        self._require_engine("engine")
        return self._engine

    def stats(self) -> dict[str, Any]:
        """Counters since compile: bytes moved each way, device memory peak, resident window, and
        the capture cache: ``captures`` (how many times the model was captured, dynamic ones
        counted in ``dynamic_captures``), ``cache_hits`` (calls that reused a capture),
        ``evictions`` (captures dropped beyond ``max_captures``), ``cached_captures``,
        ``dynamic_ranges`` (the ranges each dynamic capture covers) and ``dynamic_off`` (why
        dynamic capture was given up, None while it works)."""
        b = self._backend
        return {
            "device": b.describe(),
            "bytes_h2d": b.bytes_h2d,
            "bytes_d2h": b.bytes_d2h,
            "copies_h2d": b.copies_h2d,
            "copies_d2h": b.copies_d2h,
            "device_bytes_in_use": b.used_bytes,
            "device_bytes_peak": b.peak_bytes,
            "device_capacity": b.capacity_bytes,
            "window": self._last.train.num_slots if self._last else None,
            "stages": len(self._last.graph.stages) if self._last else None,
            "host_bytes": self._store.host_bytes if self._store else 0,
            # the pinned pool (docs/usage.md, "Pinned memory"): measured, and as the ledger plans it
            "pinned_bytes": b.pinned_bytes,
            "pinned_planned_bytes": self._pinned_planned_bytes(),
            "pinned_budget": b.pinned.budget_bytes,
            "unpinned_bytes": b.pinned.unpinned_bytes,
            # the capture cache (docs/usage.md, "Variable shapes")
            "captures": self._cache_stats["captures"],
            "dynamic_captures": self._cache_stats["dynamic_captures"],
            "cache_hits": self._cache_stats["hits"],
            "evictions": self._cache_stats["evictions"],
            "cached_captures": len(self._variants),
            "dynamic_ranges": [
                v.captured.dynamic.describe() for v in self._variants.values() if v.captured is not None and v.captured.dynamic
            ],
            "dynamic_off": self._dynamic_off,
        }

    def _pinned_planned_bytes(self) -> int | None:
        """The pinned bytes the memory ledger plans for the last signature's program (its
        ``"pinned"`` tier: ``cm.variant.ledger(pinned=cm.backend.pinned.plan)``); None before the
        first call or with ``pin_memory=False``."""
        plan = self._backend.pinned.plan
        if plan is None or self._last is None:
            return None
        return self._last.ledger(self._config.grad_accum_steps, pinned=plan).peak("pinned")

    def close(self) -> None:
        """Stop the worker threads and free device memory; the model keeps its (host) weights.
        Waits for an asynchronous checkpoint save first."""
        try:
            self.wait_checkpoint()
            if self._engine is not None:
                self._engine.close()
            else:
                self._backend.close()
        finally:
            self._finalizer.detach()
            if _compiled_of(self.module) is self:
                _COMPILED.pop(self.module, None)

    def __repr__(self) -> str:
        n = len(self._variants)
        return f"CompiledModel({type(self.module).__name__}, device={self._backend.describe()}, policy={self.policy!r}, captures={n})"


# NOTE: doctest.testmod(shfx.api) collects the examples of what CompiledModel defines itself;
# save_checkpoint's belongs to StateMethods, so it is named here to run with them
__test__ = {"CompiledModel.save_checkpoint": StateMethods.save_checkpoint}

# NOTE: the options have one signature, Config.from_args's (their defaults in one place);
# CompiledModel(model, **options) shows it (inspect.signature, help(), an IDE)
CompiledModel.__init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
     inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="nn.Module"),
     *inspect.signature(Config.from_args).parameters.values()],
    return_annotation=None,
)  # fmt: skip


def compile(model: nn.Module, **kwargs: Any) -> CompiledModel:  # noqa: A001 - mirrors torch.compile
    """Compile ``model`` for training with only a window of stages on the device.

    The options are checked and normalised once into ``cm.config`` (:class:`shfx.config.Config`);
    combinations that conflict are refused by one table, :data:`shfx.config.CONFLICTS`, with
    their reason and fix (:class:`shfx.errors.ConfigConflict`; docs/usage.md, "Options: one
    configuration").

    Args:
        model: any ``nn.Module`` on the CPU that ``torch.export`` can capture.
        device: ``"cuda"``, ``shfx.CudaDevice(...)``, or ``shfx.EmulatedDevice(memory=..., h2d=..., d2h=...)``;
            default CUDA when available, else an emulated device.
        policy: the schedule, a policy object or its name (the name means its defaults):
            ``shfx.Stronghold(window=2, resident_first=0)`` (``"stronghold"``, the default: a
            window of stages on the device, STRONGHOLD's first k stages optionally kept there with
            their optimizer), ``shfx.Resident()`` (``"resident"``: Megatron-like, everything and the
            optimizer on the device), ``shfx.L2L()``, ``shfx.ZeroOffload(delayed_update=False)``,
            ``shfx.ZeroInfinity(lookahead=1)`` (see ``shfx.passes.policies``), or a function
            ``(stage_specs, window) -> shfx.passes.Program`` (e.g. built with
            ``shfx.passes.lower_actions``). A field set to ``"auto"`` (``Stronghold(window="auto",
            resident_first="auto")``) is chosen by the tuner at the first call: it profiles the
            costs on the device, simulates every choice and takes the smallest within
            ``tune_tolerance`` of the fastest that fits (``cm.report()`` explains it, and says
            when the measured steps keep missing the prediction; ``cm.retune()`` then profiles
            and tunes again).
        window: shorthand for the policy's window (int >= 1; larger than the number of stages
            means all, with a warning at the first call and a line in ``cm.report()``; or
            ``"auto"``), for a policy given by name or as a function; default the policy's own
            (2). A policy without a window (``"resident"``, ...) refuses one.
        optimizer: ``shfx.optim.AdamW(...)``, ``SGD(...)`` or ``Adafactor(...)`` (torch-style parameter groups
            allowed), run on the host; None for no optimizer. ``cm.optimizer`` is it, bound to the model.
        blocks: module path of the repeated blocks, or several (``["encoder.block",
            "decoder.block"]``; paths or the container modules), default: every list of repeated
            blocks, auto-detected; or False to split by parameter bytes into ``num_stages``
            stages. A wrong path lists the model's lists of repeated blocks (docs/usage.md,
            "Encoder-decoder models and several block lists").
        grad_accum_steps: backward() calls per step(); the host update starts during the last one.
        overlap_update: start host updates during backward (default) or only in step().
        max_grad_norm: clip the gradients by their global norm before every update, exactly as
            ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm, norm_type)``
            (None: no clipping). With ``overlap_update`` it turns on the policy's
            ``deferred_update`` schedule: each group's gradient norm is computed as it lands on
            the host, and the updates run in forward order during the next forward (docs/usage.md,
            "Gradient clipping"). ``cm.clip_grad_norm_`` is the torch-style call.
        norm_type: the p of the p-norm (2.0; ``float("inf")`` for the max norm).
        offload: ``shfx.Offload(optimizer="nvme", path=..., host_window=..., nvme_read=...,
            nvme_write=...)``: the NVMe tier (docs/usage.md, "NVMe tier"): AdamW's ``m`` and ``v``
            live in a scratch file under ``path``, ``host_window`` groups' of them in host RAM at a
            time. It sets the policy's fields (``nvme=True``, and ``host_window`` unless
            ``"auto"``, which leaves the policy's own, default ``"auto"``: the tuner's); the
            policy must be Stronghold or ZeroInfinity, the optimizer AdamW, and rollback off.
        data_parallel: ``True`` or ``shfx.DataParallel(process_group=None, timeout_s=600)``:
            train over the ranks of a ``torch.distributed`` process group (initialised by you, as
            for DDP), each with its own batch and device (``cuda:<LOCAL_RANK>``, or its emulated
            device), gradients reduce-scattered during backward and the host AdamW sharded
            across the ranks (docs/usage.md, "Data parallel": what is sharded, what is refused).
        pin_memory: pin the host buffers that cross the link (False: pin nothing).
        pinned: the pinned-memory budget: bytes (int) or a size (``"8GiB"``); None or ``"auto"``
            (default): a quarter of the physical RAM. Every pinned buffer comes from one pool of
            at most this size: the images a PREFETCH sends first, then the gradient buffers an
            OFFLOAD_GRAD lands in, then the staging buffers; what does not fit stays ordinary
            memory, copied through four pinned bounce buffers. A budget below those is refused
            at the first call with the bytes needed (docs/usage.md, "Pinned memory").
        optimizer_workers: host threads running updates of different stages in parallel.
        verify: check every step program's invariants before running it; ``verify_each_pass``:
            after every pass of the compile pipeline (``shfx.passes.pipeline``).
        tune_tolerance: with ``"auto"``, how much slower (fraction) than the best choice a
            smaller one may be predicted to be.
        rollback: make every step all-or-nothing: a step that fails, is interrupted or is skipped
            after some updates ran during backward is undone exactly, at the cost of a copy of each
            group's weights and optimizer states before its update (host memory: 12 more bytes per
            fp32 parameter; time: ``benchmarks/rollback.py``). Default (None): on only where
            ``skip_nonfinite`` needs it. Off, a backward that fails after some updates ran says
            which groups it updated (reload a checkpoint to go on exactly); every other failure
            still leaves a consistent state (docs/usage.md, "When something fails").
        skip_nonfinite: check each group's gradient before its update; if any holds inf or NaN
            the step is skipped everywhere (``cm.last_step_skipped``), as a loss-scaling
            optimizer skips an overflowing step. Under data parallel (with
            ``overlap_update=False``) every rank's check is agreed first: all ranks skip alike.
        precision: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"``: mixed precision, fp32 master
            weights and optimizer states on the host, a 16-bit working copy of the parameters and
            16-bit gradients on the device (docs/usage.md, "Mixed precision").
        fp32_norms: in mixed precision, keep the parameters of LayerNorm/RMSNorm layers in fp32 in
            the working copy (as BatchNorm's always are): a norm's gain near 1 moves in bf16 steps
            of 2**-7, coarser than its updates, which slows early training (docs/usage.md).
        scaler: fp16's loss scaler (``shfx.LossScaler(...)``; default GradScaler's settings).
        recompute: how a stage's backward recomputes its forward: ``"early-stop"`` (the forward
            records its graph and the backward recomputes only what it needs, like
            ``torch.utils.checkpoint``), ``"full"`` (recompute the whole stage), ``"auto"``
            (early stop on CUDA, and on the emulated device for stages whose forward takes > 2 ms).
        dynamic: how input shapes map to captures (docs/usage.md, "Variable shapes").
            ``"auto"`` (default): the first shape is captured as it is; when a later call of
            the same structure differs in some dimensions, the model is captured once more with
            those dimensions dynamic (torch.export ``Dim.AUTO``: the range the model allows, an
            unbounded end capped at the largest size seen), as torch.compile's automatic dynamic
            shapes. A dict declares ranges from the first call: ``{"batch": (1, 64), "seq":
            (1, 1024)}`` (dimension 0 / 1 of every tensor input that has it) or ``{0: {1: (1,
            1024)}}`` (by tensor input position); one capture serves the range, the memory
            ledger and capacity check count its largest shape, and a call outside it raises
            :class:`UsageError`. ``False``: one capture per input shape. A model torch.export
            cannot capture dynamically is captured per shape, with one warning saying why.
        max_captures: how many captures to keep (least recently used dropped first, with
            their graphs and programs; ``cm.stats()`` counts captures, hits and evictions).

    Returns:
        a :class:`CompiledModel`.

    >>> import torch, shfx
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    >>> cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="1MiB"), policy=shfx.Stronghold(window=2),
    ...                   optimizer=shfx.optim.AdamW(lr=1e-3), blocks=False, num_stages=4)
    >>> loss = cm(torch.randn(2, 8)).sum(); loss.backward(); cm.step(); cm.zero_grad()
    >>> cm.program.actions()[:4]
    ['PF0', 'PF1', 'F0', 'R0']
    """
    _refuse_policy_options(kwargs)
    return CompiledModel(model, **kwargs)
