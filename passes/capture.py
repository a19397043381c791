"""Capture a model with torch.export (training IR) into one FX graph.

The model runs inside a thin wrapper that takes only the tensor leaves of ``(args, kwargs)``
and returns only the tensor leaves of the output; non-tensor inputs are baked in (a new value
re-captures) and the output's structure (dicts, dataclasses, Hugging Face ``ModelOutput``,
``None`` fields) is recorded on the Python side and rebuilt around the tensors at run time.

The graph executed is the training IR (``torch.export.export(..., strict=False)``): it keeps
``torch.no_grad()`` regions (as ``wrap_with_set_grad_enabled``) and the model's in-place
buffer updates. A functionalized copy (``run_decompositions({})``) is made once for analysis
only: it names the buffers the forward mutates (BatchNorm statistics) and any inputs or
parameters mutated in place. A tensor assigned to a registered buffer in forward
(``self.last = x.mean()``) is traced as a copy into the buffer, so it is one of them.

Captures run one at a time and never while a stage runs in another thread (``CAPTURE_GATE``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from .attention import pin_attention_grad_mode, restore_causal_attention_in_export
from .capture_errors import CaptureError, _is_user_file
from .exact import refuse_hooks, refuse_recorded, watch

__all__ = [
    "CaptureError",
    "Captured",
    "Placeholder",
    "OutputStructure",
    "capture_model",
    "flatten_inputs",
    "InputSignature",
    "check_real_inputs",
    "CAPTURE_GATE",
    "DynamicDim",
    "DynamicShapes",
    "capture_model_dynamic",
]

_WRAPPED = "m"  # attribute name of the user's model inside the capture wrapper


class _CaptureGate:
    """Captures run alone: one at a time, and while no stage runs in another thread.

    NOTE: torch.export sets process-wide state while it traces, not per thread: the
    ``torch.compiler.is_exporting()`` flag, the annotations of ``torch.fx.traceback``, global
    module hooks, patched ``__getattribute__``. Two exports at once corrupt each other and leave
    every later capture in the process failing; a stage that runs in another thread meanwhile
    (``torch.utils.checkpoint`` reads the flag) fails or changes the export's state. So a capture
    waits for the stages under way to finish, and holds back new ones until it is done; stages
    run side by side as before when no capture is under way. Code outside shfx (an eager model
    in another thread) is not held back.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._owner: int | None = None  # the thread capturing
        self._depth = 0
        self._waiting = 0  # captures waiting for the stages under way
        self._running = 0
        self._section = _StageSection(self)

    @contextlib.contextmanager
    def capture(self):
        """Hold the gate for a capture (re-entrant in the capturing thread)."""
        me = threading.get_ident()
        with self._cond:
            if self._owner != me:
                self._waiting += 1
                try:
                    self._cond.wait_for(lambda: self._owner is None and self._running == 0)
                finally:
                    self._waiting -= 1
                self._owner = me
            self._depth += 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if self._depth == 0:
                    self._owner = None
                    self._cond.notify_all()

    def stage(self) -> _StageSection:
        """Run a stage's computation (``with CAPTURE_GATE.stage():``): waits while a capture is
        under way or waiting (not in the capturing thread itself). It must not wait for other
        stages inside."""
        return self._section

    def _enter_stage(self) -> None:
        with self._cond:
            if self._owner is not None or self._waiting:
                me = threading.get_ident()
                if self._owner != me:
                    self._cond.wait_for(lambda: self._owner is None and self._waiting == 0)
            self._running += 1

    def _exit_stage(self) -> None:
        with self._cond:
            self._running -= 1
            if self._running == 0 and self._waiting:
                self._cond.notify_all()


class _StageSection:
    """``with``: a stage's computation (a class, not a generator: it runs around every stage)."""

    __slots__ = ("_gate",)

    def __init__(self, gate: _CaptureGate):
        self._gate = gate

    def __enter__(self) -> None:
        self._gate._enter_stage()

    def __exit__(self, *exc: object) -> None:
        self._gate._exit_stage()


CAPTURE_GATE = _CaptureGate()


def _import_export() -> None:
    """Import what ``torch.export.export`` imports on its first call, and repair what an
    interrupted import left behind (before every capture: it costs a millisecond).

    NOTE: the first export imports torch._dynamo (a second or two). A KeyboardInterrupt (or any
    exception) during that import drops the modules being imported from ``sys.modules`` but
    keeps the submodules already imported, and when the parent is imported again they are not
    bound to it: every later export then fails with "module 'torch._dynamo' has no attribute
    'exc'". After importing, each torch submodule in ``sys.modules`` is bound to its parent, as
    an uninterrupted import leaves it.
    """
    import torch.export._trace  # noqa: F401 - imports torch._dynamo

    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch."):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = sys.modules.get(parent_name)
        if parent is not None and child not in vars(parent):
            setattr(parent, child, module)


@dataclass(frozen=True)
class Placeholder:
    """One input of the captured graph.

    ``kind`` is ``"param"``, ``"buffer"``, ``"constant"`` or ``"input"``; ``key`` is the
    canonical name (the model's own parameter/buffer name; a tied parameter has one key) or,
    for user inputs, ``"input:<i>"`` with ``index`` the position among tensor inputs.
    """

    name: str  # the graph placeholder's name
    kind: str
    key: str
    index: int = -1


@dataclass(frozen=True)
class InputSignature:
    """What a capture is specialised to: the training flag, the input tree structure, and
    per leaf either (shape, dtype, requires_grad) for tensors or the value itself."""

    training: bool
    tree: str
    leaves: tuple

    def describe(self) -> str:
        parts = []
        for leaf in self.leaves:
            if leaf[0] == "T":
                parts.append(f"tensor{list(leaf[1])}:{str(leaf[2]).replace('torch.', '')}" + ("(grad)" if leaf[3] else ""))
            else:
                parts.append(repr(leaf[1]))
        return f"{'train' if self.training else 'eval'}({', '.join(parts)})"


def flatten_inputs(args: tuple, kwargs: dict, training: bool) -> tuple[list[torch.Tensor], InputSignature, Callable]:
    """Split ``(args, kwargs)`` into tensor leaves, a hashable signature and a rebuild function."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    tensors: list[torch.Tensor] = []
    sig: list[tuple] = []
    positions: list[int] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            positions.append(i)
            sig.append(("T", tuple(leaf.shape), leaf.dtype, bool(leaf.requires_grad)))
        else:
            try:
                hash(leaf)
                sig.append(("C", leaf))
            except TypeError:
                sig.append(("C", repr(leaf)))

    def rebuild(new_tensors: list[torch.Tensor]) -> tuple[tuple, dict]:
        out = list(leaves)
        for pos, t in zip(positions, new_tensors):
            out[pos] = t
        a, k = pytree.tree_unflatten(out, spec)
        return a, k

    return tensors, InputSignature(bool(training), str(spec), tuple(sig)), rebuild


# ---- output structure ----------------------------------------------------------------------


class OutputStructure:
    """Records the structure of a model's output and rebuilds it around new tensors.

    Handles tensors, tuples, lists, namedtuples, dicts (incl. OrderedDict and Hugging Face
    ``ModelOutput``), dataclasses and constant leaves (None, ints, strings).
    """

    def __init__(self, obj: Any):
        self.tensors: list[torch.Tensor] = []
        self.spec = self._flatten(obj)

    def _flatten(self, obj: Any) -> tuple:
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
            return ("T", len(self.tensors) - 1)
        if isinstance(obj, dict):
            keys = list(obj.keys())
            return ("dict", type(obj), keys, [self._flatten(obj[k]) for k in keys])
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            names = [f.name for f in dataclasses.fields(obj)]
            return ("dc", type(obj), names, [self._flatten(getattr(obj, n)) for n in names])
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return ("nt", type(obj), [self._flatten(v) for v in obj])
        if isinstance(obj, (tuple, list)):
            return ("seq", type(obj), [self._flatten(v) for v in obj])
        return ("C", obj)

    def rebuild(self, tensors: list[torch.Tensor]) -> Any:
        return self._build(self.spec, tensors)

    def _build(self, spec: tuple, t: list[torch.Tensor]) -> Any:
        kind = spec[0]
        if kind == "T":
            return t[spec[1]]
        if kind == "C":
            return spec[1]
        if kind == "seq":
            return spec[1](self._build(s, t) for s in spec[2])
        if kind == "nt":
            return spec[1](*(self._build(s, t) for s in spec[2]))
        if kind == "dict":
            cls, keys, subs = spec[1], spec[2], spec[3]
            values = {k: self._build(s, t) for k, s in zip(keys, subs)}
            if cls is dict:
                return values
            try:
                return cls(**values) if dataclasses.is_dataclass(cls) else cls(values)
            except TypeError:
                return cls(values)
        if kind == "dc":
            cls, names, subs = spec[1], spec[2], spec[3]
            values = {n: self._build(s, t) for n, s in zip(names, subs)}
            init = {f.name for f in dataclasses.fields(cls) if f.init}
            obj = cls(**{k: v for k, v in values.items() if k in init})
            for k, v in values.items():
                if k not in init:
                    object.__setattr__(obj, k, v)
            return obj
        raise AssertionError(f"unknown output spec {kind}")


class _CaptureWrapper(nn.Module):
    def __init__(self, model: nn.Module, rebuild: Callable):
        super().__init__()
        setattr(self, _WRAPPED, model)
        self._rebuild = rebuild
        # NOTE: recorded through a closure, not a module attribute: export may trace a copy
        # of the module and restores attributes assigned during tracing; a function is shared
        # by reference even when the module is copied.
        seen: list[OutputStructure] = []
        self._record = seen.append
        self._seen_ref = lambda: seen
        refused: list[str] = []  # buffer assignments that cannot become in-place copies
        self._refuse = refused.append
        self._refused_ref = lambda: refused

    @property
    def structure(self) -> OutputStructure | None:
        seen = self._seen_ref()
        return seen[-1] if seen else None

    @property
    def refused(self) -> list[str]:
        return self._refused_ref()

    def forward(self, *tensors: torch.Tensor):
        args, kwargs = self._rebuild(list(tensors))
        model = getattr(self, _WRAPPED)
        with _assignments_as_copies(model, self._refuse):
            out = model(*args, **kwargs)
        st = OutputStructure(out)
        self._record(st)
        return tuple(st.tensors)


@contextlib.contextmanager
def _assignments_as_copies(model: nn.Module, refuse: Callable[[str], None]):
    """While the model's forward is traced, ``self.buf = t`` on a registered buffer of
    ``model`` becomes ``self.buf.copy_(t)``: the graph then updates the buffer in place, like
    BatchNorm's statistics, and the host store keeps the value (eager PyTorch rebinds the
    attribute to ``t``; the values are the same). An assignment that changes the buffer's
    shape or dtype, or gives a tensor to a buffer registered as None, cannot be a copy: it is
    recorded with ``refuse`` (one line naming the buffer) and left to happen as it would."""
    names = {id(m): name for name, m in model.named_modules()}

    def hook(module: nn.Module, name: str, value: Any) -> Any:
        if id(module) not in names or name not in module._buffers or not isinstance(value, torch.Tensor):
            return None  # another model, a new buffer being registered, or None
        old = module._buffers[name]
        if old is value:
            return None
        key = f"{names[id(module)]}.{name}" if names[id(module)] else name
        if old is None:
            refuse(f"{key!r} (registered as None) is assigned a tensor of shape {list(value.shape)} {value.dtype}")
            return None
        if old.shape != value.shape or old.dtype != value.dtype:
            refuse(
                f"{key!r} (shape {list(old.shape)} {old.dtype}) is assigned a tensor of shape "
                f"{list(value.shape)} {value.dtype}"
            )
            return None
        old.copy_(value)
        return old

    handle = nn.modules.module.register_module_buffer_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()


# ---- the captured program -------------------------------------------------------------------


@dataclass
class Captured:
    """A model captured as one FX graph (training IR) plus what the passes need to know.

    Attributes:
        gm: the graph module; placeholders in ``placeholders`` order.
        placeholders: one per graph placeholder.
        outputs: the graph's output nodes (tensors only; structure in ``structure``).
        structure: rebuilds the model's output object around the output tensors.
        params / buffers / constants: canonical key -> the tensor (the model's own objects).
        trainable: canonical keys of parameters with ``requires_grad``.
        mutated_buffers: canonical keys of buffers the forward updates in place.
        signature: what this capture is specialised to.
    """

    gm: fx.GraphModule
    placeholders: list[Placeholder]
    outputs: list[fx.Node]
    structure: OutputStructure
    params: dict[str, nn.Parameter]
    buffers: dict[str, torch.Tensor]
    constants: dict[str, torch.Tensor]
    trainable: frozenset[str]
    mutated_buffers: frozenset[str]
    signature: InputSignature
    module_prefix: str = _WRAPPED + "."
    model_name: str = ""
    persistent: dict[str, bool] = field(default_factory=dict)
    # mixed precision: parameter key -> the dtype the graph was traced with (and the device
    # holds), for parameters cast from the model's dtype
    device_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    working_dtype: torch.dtype | None = None
    # a capture with dynamic dimensions (:func:`capture_model_dynamic`): which input sizes it
    # covers; None for a capture specialised to the example's shapes
    dynamic: DynamicShapes | None = None

    def placeholder_of(self, name: str) -> Placeholder:
        for p in self.placeholders:
            if p.name == name:
                return p
        raise KeyError(name)


def _strip(name: str) -> str:
    pre = _WRAPPED + "."
    return name[len(pre) :] if name.startswith(pre) else name


FP32_NORMS = tuple(t for t in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if t is not None)
"""The layers whose parameters ``fp32_norms=True`` keeps in fp32: torch's own, whose kernels take a
16-bit input with fp32 weights and return the input's dtype (a model's own norm class, which
multiplies by its weight in Python, would change the dtype downstream, so it is left 16-bit)."""


def cast_for_device(model: nn.Module, working_dtype: torch.dtype, fp32_norms: bool = False) -> dict[str, nn.Parameter]:
    """The parameters a mixed-precision device holds in ``working_dtype``: every floating-point
    parameter of another dtype, except the affine parameters of BatchNorm layers, which stay in
    full precision beside their full-precision running statistics (as apex's
    ``keep_batchnorm_fp32``; the CPU's batch norm refuses a 16-bit weight with fp32 statistics),
    and with ``fp32_norms`` those of :data:`FP32_NORMS` (LayerNorm, RMSNorm): a gain near 1 in
    bf16 moves in steps of 2**-7, coarser than the updates it receives."""
    keep: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) or (fp32_norms and isinstance(mod, FP32_NORMS)):
            keep.update(id(p) for p in mod.parameters(recurse=False))
    return {
        n: p
        for n, p in model.named_parameters()
        if p.is_floating_point() and p.dtype != working_dtype and id(p) not in keep
    }


def cast_inputs(tensors: Sequence[torch.Tensor], working_dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Floating-point inputs in the working dtype (mixed precision), others as they are."""
    if working_dtype is None:
        return list(tensors)
    return [t.to(working_dtype) if t.is_floating_point() and t.dtype != working_dtype else t for t in tensors]


@contextlib.contextmanager
def _params_cast(params: dict[str, nn.Parameter], working_dtype: torch.dtype | None):
    """The parameters hold casts to ``working_dtype`` inside the block (the trace sees the
    16-bit model copy), their own data again after it."""
    saved = {n: p.data for n, p in params.items()}
    try:
        for p in params.values():
            p.data = p.data.to(working_dtype)
        yield
    finally:
        for n, p in params.items():
            p.data = saved[n]


def capture_model(
    model: nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    working_dtype: torch.dtype | None = None,
    *,
    fp32_norms: bool = False,
    dynamic_shapes: Any = None,
    _exported: list | None = None,
) -> Captured:
    """Capture ``model(*args, **kwargs)`` with torch.export (training IR, non-strict).

    Inputs are moved to the CPU for tracing (the parameters live on the host); the graph is
    retargeted later if the compute device differs. Raises :class:`CaptureError` with the
    construct, the model's source line, and a suggested fix when export fails.

    ``working_dtype`` (mixed precision): trace the model's 16-bit copy, as eager PyTorch runs a
    ``to(dtype)`` copy of it (:func:`cast_for_device` says which parameters; floating-point
    inputs are cast too), so every dtype the model's code derives from its parameters is the
    16-bit one. ``fp32_norms``: keep LayerNorm/RMSNorm parameters in fp32 (:func:`cast_for_device`).

    ``dynamic_shapes`` is passed to ``torch.export.export`` (one entry per tensor input); use
    :func:`capture_model_dynamic`, which also sizes the graph's values and checks the ranges.
    """
    kwargs = dict(kwargs or {})
    tensors, signature, rebuild = flatten_inputs(args, kwargs, model.training)
    cast = cast_for_device(model, working_dtype, fp32_norms) if working_dtype is not None else {}
    # the parameters live on the host (CPU); a model built on the meta device (for planning
    # models too large to allocate) is traced on meta inputs
    on_meta = any(p.is_meta for p in model.parameters())
    if not on_meta:
        check_real_inputs(tensors, type(model).__name__)
    example = tuple(
        (torch.empty_like(t, device="meta") if on_meta else t.detach().to("cpu")).requires_grad_(t.requires_grad)
        for t in cast_inputs(tensors, working_dtype)
    )
    if not on_meta:  # (a meta model is planned, never trained)
        refuse_hooks(model)  # backward hooks shfx would never call: refused before anything is traced
    wrapper = _CaptureWrapper(model, rebuild)
    wrapper.train(model.training)
    recorded: list = []
    with CAPTURE_GATE.capture():
        _import_export()
        try:
            with warnings.catch_warnings():
                # torch.export's own pytree internals warn about a deprecated LeafSpec check
                warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
                # NOTE: traced with grad enabled whatever the caller's mode: one capture serves
                # both training and torch.no_grad() calls (the signature has no grad mode), and
                # under no_grad the export drops the model's own no_grad regions (a first call
                # under no_grad then trained gradients through them)
                with _params_cast(cast, working_dtype), torch.enable_grad(), watch(model) as recorded:
                    ep = torch.export.export(wrapper, example, strict=False, dynamic_shapes=dynamic_shapes)
        except Exception as e:  # noqa: BLE001 - re-raised with context
            _refuse_assignments(model, wrapper.refused)
            if _raised_by_model(e):
                raise  # the model's own error, as eager PyTorch raises it
            if not on_meta:
                refuse_recorded(model, recorded)
            raise _capture_error(model, e) from e
        finally:
            wrapper.train(model.training)
        _refuse_assignments(model, wrapper.refused)
        if not on_meta:
            refuse_recorded(model, recorded)  # custom autograd.Functions, hooks in forward, reentrant checkpoints
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
                # NOTE: the functional retrace reads the parameters again: in mixed precision it
                # must see the 16-bit copy the export traced (without the cast, a frozen
                # parameter is retraced from its fp32 data: a frozen embedding fed fp32 into the
                # 16-bit graph and failed its dtype checks; trainable ones did not show this)
                with _params_cast(cast, working_dtype):
                    analysis = ep.run_decompositions({}).graph_signature
            mutated_targets = set(analysis.buffers_to_mutate.values())
            mutated_inputs = dict(getattr(analysis, "user_inputs_to_mutate", {}) or {})
            mutated_params = dict(getattr(analysis, "parameters_to_mutate", {}) or {})
        except Exception as e:  # noqa: BLE001
            raise CaptureError(
                f"shfx captured {type(model).__name__} but could not analyse which buffers its forward "
                f"mutates (functionalization failed: {_first_line(e)}). Please report this model."
            ) from e
    if mutated_params:
        names = ", ".join(sorted(_strip(t) for t in mutated_params.values()))
        raise CaptureError(
            f"{type(model).__name__}'s forward modifies parameters in place ({names}). shfx keeps "
            "parameters on the host and updates them only in the optimizer step; move the in-place "
            "change out of forward (e.g. into a hook after cm.step())."
        )
    if mutated_inputs:
        raise CaptureError(
            f"{type(model).__name__}'s forward modifies its input tensors in place "
            f"({', '.join(sorted(mutated_inputs.values()))}). shfx recomputes stages from their inputs, "
            "so inputs must not change; clone the input inside forward (x = x.clone()) before changing it."
        )

    gm = ep.graph_module
    _drop_metadata_asserts(gm)
    restore_causal_attention_in_export(ep)  # passes/attention.py: the SDPA call eager would make
    if _exported is not None:
        _exported.append(ep)
    canon_param = {id(p): n for n, p in model.named_parameters()}
    canon_buffer = {id(b): n for n, b in model.named_buffers()}
    persistent = {}
    for mname, mod in model.named_modules():
        for bname in mod._buffers:
            persistent[f"{mname}.{bname}" if mname else bname] = bname not in mod._non_persistent_buffers_set
    params: dict[str, nn.Parameter] = {}
    buffers: dict[str, torch.Tensor] = {}
    constants: dict[str, torch.Tensor] = {}
    placeholders: list[Placeholder] = []
    mutated: set[str] = set()
    n_inputs = 0
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    specs = ep.graph_signature.input_specs
    if len(phs) != len(specs):  # pragma: no cover - export invariant
        raise CaptureError("torch.export returned a graph whose placeholders do not match its signature")
    for node, spec in zip(phs, specs):
        kind = spec.kind.name
        if kind == "PARAMETER":
            obj = wrapper.get_parameter(spec.target)
            key = canon_param.get(id(obj), _strip(spec.target))
            params[key] = obj
            placeholders.append(Placeholder(node.name, "param", key))
        elif kind == "BUFFER":
            obj = wrapper.get_buffer(spec.target)
            key = canon_buffer.get(id(obj), _strip(spec.target))
            buffers[key] = obj
            if spec.target in mutated_targets:
                mutated.add(key)
            placeholders.append(Placeholder(node.name, "buffer", key))
        elif kind == "CONSTANT_TENSOR":
            key = f"<constant>{_strip(spec.target)}"
            constants[key] = ep.constants[spec.target]
            placeholders.append(Placeholder(node.name, "constant", key))
        elif kind == "USER_INPUT":
            placeholders.append(Placeholder(node.name, "input", f"input:{n_inputs}", n_inputs))
            n_inputs += 1
        else:
            raise CaptureError(
                f"{type(model).__name__} captured with an input of kind {kind} ({spec.target}); shfx "
                "supports parameters, buffers, tensor constants and tensor inputs"
            )
    # attention in a checkpointed forward (no autograd) runs as in eager's training forward
    pin_attention_grad_mode(gm, {p.name for p in placeholders if p.kind == "param" and params[p.key].requires_grad})
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = list(out_node.args[0])
    for o in outputs:
        if not isinstance(o, fx.Node):  # pragma: no cover - wrapper returns tensors only
            raise CaptureError(f"{type(model).__name__} returned a non-tensor where a tensor was expected: {o!r}")
    structure = wrapper.structure
    assert structure is not None
    return Captured(
        gm=gm,
        placeholders=placeholders,
        outputs=outputs,
        structure=structure,
        params=params,
        buffers=buffers,
        constants=constants,
        trainable=frozenset(k for k, p in params.items() if p.requires_grad),
        mutated_buffers=frozenset(mutated),
        signature=signature,
        model_name=type(model).__name__,
        persistent=persistent,
        device_dtypes={canon_param.get(id(p), n): working_dtype for n, p in cast.items()},
        working_dtype=working_dtype,
    )


def _drop_metadata_asserts(gm: fx.GraphModule) -> None:
    """Remove torch.export's ``_assert_tensor_metadata`` checks (emitted for ``x.float()``,
    ``x.to(dtype)``): they pin the device and dtype of the capture's example tensors, which shfx
    changes on purpose (captured on meta or the CPU, run on the device; retargeted dtypes). The
    graph's own dtypes and devices are what the stages compute with, so the check adds nothing."""
    target = torch.ops.aten._assert_tensor_metadata.default
    asserts = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target and not n.users]
    for node in asserts:
        gm.graph.erase_node(node)
    if asserts:
        gm.recompile()


def check_real_inputs(tensors: Sequence[torch.Tensor], model_name: str) -> None:
    """Refuse inputs that hold no data (the meta device): shfx runs the model on real tensors."""
    for i, t in enumerate(tensors):
        if t.is_meta:
            raise CaptureError(
                f"{model_name} was called with tensor input {i} (shape {list(t.shape)}) on the meta device, which "
                "holds no data; shfx trains on real tensors. Pass inputs on the CPU or on the compute device "
                "(a meta model and meta inputs are for planning: shfx.cost_model.planner)."
            )


def _refuse_assignments(model: nn.Module, refused: Sequence[str]) -> None:
    if refused:
        raise CaptureError(
            f"{type(model).__name__}'s forward assigns a new tensor to a registered buffer: "
            f"{'; '.join(dict.fromkeys(refused))}. shfx keeps buffers in its host store and updates them in place, "
            "so an assignment must keep the buffer's shape and dtype. Register the buffer with the shape and dtype "
            "it will hold, or convert the value (self.buf = value.reshape(shape).to(dtype))."
        )


# ---- error messages ---------------------------------------------------------------------------

_HINTS: list[tuple[tuple[str, ...], str]] = [
    (
        ("past_key_values", "DynamicCache", "Cache", "use_cache"),
        "the model builds a key/value cache during forward; pass use_cache=False (e.g. "
        "model.config.use_cache = False) for training",
    ),
    (
        (
            "data-dependent",
            "data dependent",
            "GuardOnDataDependentSymNode",
            "Could not guard on data-dependent",
            "Could not extract specialized integer",
            ".item()",
            "nonzero",
        ),
        "control flow or a shape depends on tensor values (e.g. `if x.sum() > 0:`, `x.item()`, "
        "`torch.nonzero`); compute it outside the model and pass it in, or use torch.cond",
    ),
    (
        ("Unsupported", "graph break", "not supported"),
        "the construct is not supported by torch.export; rewrite it with tensor operations, or move "
        "it outside the model's forward",
    ),
]


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0] if s else ''}"


def _user_frame(e: BaseException) -> traceback.FrameSummary | None:
    frames = traceback.extract_tb(e.__traceback__)
    cur: BaseException | None = e
    while cur is not None:  # follow the chain: the user's frame is often in the cause
        frames += traceback.extract_tb(cur.__traceback__)
        cur = cur.__cause__ or cur.__context__
    user = [f for f in frames if _is_user_file(f.filename)]
    return user[-1] if user else None


# errors a model raises itself to say it was called wrongly; torch's own (and the
# data-dependent guards of tracing) are RuntimeErrors and raised in torch's code
_MODEL_ERRORS = (TypeError, ValueError, AssertionError, KeyError, IndexError)


def _raised_by_model(e: BaseException) -> bool:
    """True when ``e`` is the model's own error (``raise ValueError(...)`` in its forward):
    a TypeError, ValueError, ... raised in the model's code, not in torch's. Eager PyTorch
    raises the same, so it is no limitation of the capture."""
    if not isinstance(e, _MODEL_ERRORS) or isinstance(e, RuntimeError):
        return False
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and _is_user_file(frames[-1].filename)


def _capture_error(model: nn.Module, e: BaseException) -> CaptureError:
    text = f"{type(e).__name__}: {e}"
    hint = None
    for needles, h in _HINTS:
        if any(n in text for n in needles):
            hint = h
            break
    frame = _user_frame(e)
    where = (
        f"\n  at {frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}" if frame else ""
    )
    hint = hint or "check that forward runs with plain tensor operations and no Python-side state changes"
    return CaptureError(
        f"shfx could not capture {type(model).__name__} with torch.export: {_first_line(e)}{where}\n"
        f"  what to change: {hint}.\n"
        "  (shfx needs the whole forward as one graph; see the torch.export error above for details)"
    )


# ---- dynamic dimensions -----------------------------------------------------------------------


class DynamicCaptureError(CaptureError):
    """torch.export could not keep a dimension dynamic (the model specialises it, or guards on
    it in a way the declared range does not satisfy); the message is torch.export's reason."""


@dataclass(frozen=True)
class DynamicDim:
    """One dimension of one tensor input to capture as dynamic.

    ``input`` is the position among the call's tensor leaves (``flatten_inputs`` order), ``dim``
    the dimension, ``name`` the range's name (dimensions with one name are one symbol when
    ``hi`` is declared: torch.export then checks they are equal). ``lo``/``hi``: the declared
    range (inclusive); ``hi=None``: as far as the model allows (``auto``: torch.export's
    ``Dim.AUTO``), else up to ``seen_max``."""

    input: int
    dim: int
    name: str
    lo: int = 1
    hi: int | None = None
    auto: bool = False
    seen_max: int = 1


@dataclass(frozen=True)
class DynamicShapes:
    """What one dynamic capture covers.

    Attributes:
        dims: ``(input, dim, symbol)`` for each dynamic dimension.
        ranges: symbol -> ``(lo, hi)``, inclusive: the sizes this capture runs (torch.export's
            range intersected with the declared one; an unbounded end is the declared maximum
            or, for an undeclared dimension, the largest size seen when it was captured).
        shapes: per tensor input, its shape with None at the dynamic dimensions.
        sized_for: symbol -> the size the graph's byte counts were computed at (``hi``): the
            memory ledger, the capacity check and the simulator see the largest shape covered.
    """

    dims: tuple[tuple[int, int, str], ...]
    ranges: dict[str, tuple[int, int]] = field(hash=False)
    shapes: tuple[tuple[int | None, ...], ...]
    sized_for: dict[str, int] = field(hash=False)
    capped: frozenset[str] = frozenset()  # symbols whose upper end is the largest size seen, not a limit

    def could_grow(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether a capture with a larger range could cover ``tensors`` where this one does
        not: every dynamic size outside its range is above an end that only the largest size
        seen set (below the range, or above a limit torch.export derived, it could not)."""
        for i, d, sym in self.dims:
            n = int(tensors[i].shape[d])
            lo, hi = self.ranges[sym]
            if n < lo or (n > hi and sym not in self.capped):
                return False
        return True

    def mismatch(self, tensors: Sequence[torch.Tensor]) -> str | None:
        """None when ``tensors`` (the call's tensor leaves) are covered, else why not."""
        if len(tensors) != len(self.shapes):
            return f"{len(tensors)} tensor inputs, captured with {len(self.shapes)}"
        for i, (t, shape) in enumerate(zip(tensors, self.shapes)):
            if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
                return f"tensor input {i} has shape {list(t.shape)}, captured for {[s if s is not None else '*' for s in shape]}"
        seen: dict[str, int] = {}
        for i, d, sym in self.dims:
            n = int(tensors[i].shape[d])
            lo, hi = self.ranges[sym]
            if not lo <= n <= hi:
                return f"dimension {d} of tensor input {i} is {n}, outside the captured range [{lo}, {hi}]"
            if seen.setdefault(sym, n) != n:
                return f"dimension {d} of tensor input {i} is {n}, but another dimension of the same symbol is {seen[sym]}"
        return None

    def describe(self) -> str:
        names = dict.fromkeys(sym for _, _, sym in self.dims)
        return ", ".join(f"{sym} in [{self.ranges[sym][0]}, {self.ranges[sym][1]}]" for sym in names)


def capture_model_dynamic(
    model: nn.Module,
    args: tuple,
    kwargs: dict | None,
    dims: Sequence[DynamicDim],
    working_dtype: torch.dtype | None = None,
    fp32_norms: bool = False,
) -> Captured:
    """Capture ``model(*args, **kwargs)`` with the dimensions ``dims`` dynamic: one graph that
    runs every size in their ranges (torch.export ``dynamic_shapes``, non-strict).

    The graph's symbolic sizes (``sym_size`` nodes and arithmetic on them) are recomputed next
    to each operation that uses them, so no symbolic integer crosses a stage boundary; every
    tensor's ``meta["val"]`` is replaced by a meta tensor of its size at the top of the ranges
    (``DynamicShapes.sized_for``), so stage specs, the memory ledger and the capacity check count
    the largest shape covered. Raises :class:`DynamicCaptureError` with torch.export's reason
    when a dimension cannot stay dynamic (the model specialises it, a guard the declared range
    does not satisfy); the caller then captures per shape.
    """
    from torch.export import Dim

    kwargs = dict(kwargs or {})
    tensors, _, _ = flatten_inputs(args, kwargs, model.training)
    named: dict[str, Any] = {}
    specs: list[dict[int, Any] | None] = [None] * len(tensors)
    for dd in dims:
        if not 0 <= dd.input < len(tensors) or not 0 <= dd.dim < tensors[dd.input].dim():
            raise ValueError(f"dynamic dimension {dd.dim} of tensor input {dd.input}: the call has no such dimension")
        if dd.auto:
            spec = Dim.AUTO
        else:
            if dd.name not in named:
                named[dd.name] = Dim(dd.name, min=dd.lo, max=dd.hi) if dd.hi is not None else Dim(dd.name, min=dd.lo)
            spec = named[dd.name]
        specs[dd.input] = {**(specs[dd.input] or {}), dd.dim: spec}
    exported: list = []
    try:
        captured = capture_model(
            model, args, kwargs, working_dtype, fp32_norms=fp32_norms, dynamic_shapes=(tuple(specs),), _exported=exported
        )
    except CaptureError as e:
        cause = e.__cause__ or e
        raise DynamicCaptureError(f"torch.export could not capture it with dynamic dimensions: {_export_reason(cause)}") from e
    ep = exported[0]
    user_vals = [n.meta["val"] for n in ep.graph_module.graph.nodes if n.op == "placeholder"][-len(tensors) :] if tensors else []
    ranges: dict[str, tuple[int, int]] = {}
    symbol_of: dict[Any, str] = {}
    out_dims: list[tuple[int, int, str]] = []
    capped: set[str] = set()
    for dd in dims:
        size = user_vals[dd.input].shape[dd.dim]
        if not isinstance(size, torch.SymInt) or not getattr(size.node.expr, "is_Symbol", False):
            raise DynamicCaptureError(
                f"torch.export specialised dimension {dd.dim} of tensor input {dd.input} ({dd.name}) to {size}: "
                "the model's code depends on its exact value"
            )
        expr = size.node.expr
        sym = symbol_of.setdefault(expr, dd.name if dd.name not in ranges else f"{dd.name}@{dd.input}.{dd.dim}")
        vr = ep.range_constraints.get(expr)
        lo = max(dd.lo, int(vr.lower)) if vr is not None else dd.lo
        hi_candidates = [] if vr is None else [h for h in [_finite_int(vr.upper)] if h is not None]
        if dd.hi is not None:
            hi_candidates.append(dd.hi)
        hi = min(hi_candidates) if hi_candidates else max(dd.seen_max, int(tensors[dd.input].shape[dd.dim]))
        if not hi_candidates:
            capped.add(sym)
        if sym in ranges:
            lo, hi = max(lo, ranges[sym][0]), min(hi, ranges[sym][1])
        ranges[sym] = (lo, hi)
        out_dims.append((dd.input, dd.dim, sym))
    dyn = {(i, d) for i, d, _ in out_dims}
    shapes = tuple(
        tuple(None if (i, d) in dyn else int(n) for d, n in enumerate(t.shape)) for i, t in enumerate(tensors)
    )
    sized_for = {sym: hi for sym, (_, hi) in ranges.items()}
    by_expr = {expr: sized_for[sym] for expr, sym in symbol_of.items()}
    _localize_symbolic(captured.gm)
    _size_values(captured.gm, by_expr)
    captured.dynamic = DynamicShapes(tuple(out_dims), ranges, shapes, sized_for, frozenset(capped))
    return captured


def _finite_int(x: Any) -> int | None:
    """A range end as an int, None when unbounded (sympy's oo, torch's int_oo, a sentinel)."""
    try:
        v = int(x)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None
    return v if abs(v) < 1 << 62 else None


def _export_reason(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    keep = [ln for ln in lines if not ln.startswith("For more information") and "draft_export" not in ln][:4]
    return f"{type(e).__name__}: " + " ".join(keep)


def _is_symbolic(v: Any) -> bool:
    return isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _localize_symbolic(gm: fx.GraphModule) -> None:
    """Recompute every symbolic integer next to each operation that reads it.

    torch.export computes ``sym_size(x, 1)`` once, at the top of the graph, and every block's
    ``view`` reads it; a stage must not receive a symbolic integer from another stage (only
    tensors cross boundaries). So each operation gets its own copy of the symbolic expressions
    it reads, inserted just before it with its module path (the copy joins its stage); a
    ``sym_size`` leaf reads the size from one of the operation's own tensor arguments when one
    has that size (else from the original tensor: a user input any stage may read)."""
    g = gm.graph
    sym_nodes = {n for n in g.nodes if n.op == "call_function" and _is_symbolic(n.meta.get("val"))}
    if not sym_nodes:
        return
    sym_size = torch.ops.aten.sym_size.int
    for n in list(g.nodes):
        if n in sym_nodes or n.op in ("placeholder", "output", "get_attr"):
            continue
        reads = [a for a in n.all_input_nodes if a in sym_nodes]
        if not reads:
            continue
        own_tensors = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        copies: dict[fx.Node, fx.Node] = {}

        def copy(s: fx.Node, n: fx.Node = n, own_tensors: list = own_tensors, copies: dict = copies) -> fx.Node:
            if s in copies:
                return copies[s]
            if s.target is sym_size and isinstance(s.args[0], fx.Node):
                src, d = s.args[0], s.args[1]
                expr = s.meta["val"].node.expr
                for a in own_tensors:
                    hit = [j for j, sz in enumerate(a.meta["val"].shape) if isinstance(sz, torch.SymInt) and sz.node.expr == expr]
                    if hit:
                        src, d = a, hit[0]
                        break
                args, kwargs = (src, d), {}
            else:
                args = fx.map_arg(s.args, lambda a: copy(a) if a in sym_nodes else a)
                kwargs = fx.map_arg(s.kwargs, lambda a: copy(a) if a in sym_nodes else a)
            with g.inserting_before(n):
                c = g.call_function(s.target, args, kwargs)
            c.meta = dict(s.meta)
            for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
                if key in n.meta:
                    c.meta[key] = n.meta[key]
            copies[s] = c
            return c

        n.args = fx.map_arg(n.args, lambda a: copy(a) if a in sym_nodes else a)
        n.kwargs = fx.map_arg(n.kwargs, lambda a: copy(a) if a in sym_nodes else a)
    for s in reversed([m for m in g.nodes if m in sym_nodes]):
        if not s.users:
            g.erase_node(s)
    g.lint()
    gm.recompile()


def _size_values(gm: fx.GraphModule, sizes: dict[Any, int]) -> None:
    """Replace each tensor's symbolic ``meta["val"]`` by a meta tensor of its size with the
    symbols at ``sizes`` (other symbols at their example value)."""
    import sympy

    def concrete(n: Any) -> int:
        if not isinstance(n, torch.SymInt):
            return int(n)
        node = n.node
        expr = node.expr
        env = node.shape_env
        sub = {s: sympy.Integer(sizes[s]) if s in sizes else sympy.Integer(int(env.var_to_val.get(s, 1))) for s in expr.free_symbols}
        return int(expr.xreplace(sub))

    def sized(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if not any(isinstance(s, torch.SymInt) for s in v.shape):
                return v
            return torch.empty([concrete(s) for s in v.shape], dtype=v.dtype, device="meta")
        if isinstance(v, (tuple, list)):
            return type(v)(sized(x) for x in v)
        return v

    for n in gm.graph.nodes:
        if "val" in n.meta:
            n.meta["val"] = sized(n.meta["val"])
