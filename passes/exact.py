"""What shfx refuses at capture so that training is never silently different from eager.

shfx trains the graph torch.export captured: it differentiates the captured ATen operations
with autograd, stage by stage. Three kinds of model code change eager's gradients in ways that
graph cannot show, and would train with eager's loss but other gradients:

- a custom ``torch.autograd.Function``: non-strict torch.export inlines its ``forward`` and
  leaves no trace of it in the graph (no node, no metadata), so its ``backward`` is never run;
  shfx would use the derivative of the forward's operations instead (gradient reversal, a
  straight-through estimator, Hugging Face Bloom's hand-written ``GeLUFunction`` backward);
- backward hooks (on modules, global module hooks, on parameters, on tensors inside forward,
  post-accumulate-grad hooks): shfx never calls them;
- reentrant activation checkpointing (``torch.utils.checkpoint.checkpoint(...,
  use_reentrant=True)``): torch.export traces its ``CheckpointFunction`` as a ``no_grad`` region,
  so nothing before it gets a gradient (non-reentrant checkpointing is captured as the plain
  operations and trains exactly).

:func:`refuse_hooks` scans the model's hook dictionaries (every submodule, the global ones in
``torch.nn.modules.module``, every trainable parameter) before the export; :func:`watch`
records, while the export traces the forward, each ``autograd.Function.apply`` that builds a
graph (grad enabled and a tensor argument that requires grad: a Function under ``no_grad`` or on
constants has no backward to miss) and each ``Tensor.register_hook`` /
``register_post_accumulate_grad_hook``, with the module that called it (the innermost
``forward`` whose ``self`` is one of the model's modules) and the model's source line;
:func:`refuse_recorded` raises after the export. Once per capture; nothing on the step's path.
"""

from __future__ import annotations

import contextlib
import linecache
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from .capture_errors import CaptureError, _is_user_file

__all__ = ["Recorded", "refuse_hooks", "refuse_recorded", "scan_hooks", "watch"]

_MAX_LISTED = 6  # findings listed in one message; the rest are counted


# ---- hooks registered before the call ------------------------------------------------------


def _describe_fn(fn: Any) -> str:
    """``name (file:line)`` of a hook function, as far as it can be known."""
    inner = getattr(fn, "func", fn)  # functools.partial
    name = getattr(inner, "__qualname__", None) or getattr(inner, "__name__", None) or type(inner).__name__
    code = getattr(inner, "__code__", None)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def _hooks(d: Any) -> list[Any]:
    return list(d.values()) if d else []


def _module_label(path: str) -> str:
    return f"module {path!r}" if path else "the model itself"


def scan_hooks(model: nn.Module) -> list[tuple[str, str]]:
    """The backward hooks eager autograd would call for ``model``: ``(kind, description)``
    per hook, kind one of ``"module"``, ``"global"``, ``"param"``, ``"post-accumulate"``."""
    from torch.nn.modules import module as torch_module

    found: list[tuple[str, str]] = []
    for path, mod in model.named_modules():
        full = mod._is_full_backward_hook
        for fn in _hooks(mod._backward_hooks):
            how = "register_full_backward_hook" if full is not False else "register_backward_hook"
            found.append(("module", f"{_module_label(path)} ({type(mod).__name__}) has a backward hook ({how}: {_describe_fn(fn)})"))
        for fn in _hooks(mod._backward_pre_hooks):
            found.append(
                ("module", f"{_module_label(path)} ({type(mod).__name__}) has a backward pre-hook "
                 f"(register_full_backward_pre_hook: {_describe_fn(fn)})")
            )
    for fn in _hooks(torch_module._global_backward_hooks):
        how = "register_module_full_backward_hook" if torch_module._global_is_full_backward_hook is not False else "register_module_backward_hook"
        found.append(("global", f"a global module backward hook (torch.nn.modules.module.{how}: {_describe_fn(fn)})"))
    for fn in _hooks(torch_module._global_backward_pre_hooks):
        found.append(
            ("global", f"a global module backward pre-hook (torch.nn.modules.module.register_module_full_backward_pre_hook: "
             f"{_describe_fn(fn)})")
        )
    for name, p in model.named_parameters():
        if not p.requires_grad:  # eager never calls them: no gradient
            continue
        for fn in _hooks(getattr(p, "_backward_hooks", None)):
            found.append(("param", f"parameter {name!r} has a gradient hook (register_hook: {_describe_fn(fn)})"))
        for fn in _hooks(getattr(p, "_post_accumulate_grad_hooks", None)):
            found.append(
                ("post-accumulate", f"parameter {name!r} has a post-accumulate-grad hook "
                 f"(register_post_accumulate_grad_hook: {_describe_fn(fn)})")
            )
    return found


_WHY_HOOKS = (
    "shfx computes the gradients stage by stage from the captured graph and never calls backward hooks, "
    "so training would silently differ from eager PyTorch"
)

_FIX_HOOKS = {
    "module": (
        "a module backward hook sees activation gradients (grad_input, grad_output), which shfx does not expose: "
        "remove the hook (handle.remove()) before the first call of the compiled model, or run this model eagerly"
    ),
    "global": (
        "remove the global hook (handle.remove()) before calling the compiled model, or run this model eagerly"
    ),
    "param": (
        "remove the hook (handle.remove()); to change a parameter's gradient as the hook did, compile with "
        "overlap_update=False and edit p.grad between loss.backward() and cm.step() (the same as the hook when a "
        "step has one backward; with overlap_update=True, the default, the update has already read the gradient); "
        "for gradient clipping compile with max_grad_norm=...; to only read a gradient, read p.grad after "
        "loss.backward(); or run this model eagerly"
    ),
    "post-accumulate": (
        "remove the hook (handle.remove()): shfx already updates each stage's parameters as soon as their "
        "gradients are complete on the host, during backward (overlap_update=True, with the optimizer given to "
        "shfx.compile), which is what per-parameter optimizer hooks are for; to run other code on a complete "
        "gradient, run it on p.grad after loss.backward(); or run this model eagerly"
    ),
}


def refuse_hooks(model: nn.Module) -> None:
    """Raise :class:`CaptureError` naming each backward hook of ``model`` (see :func:`scan_hooks`)."""
    found = scan_hooks(model)
    if not found:
        return
    kinds = list(dict.fromkeys(k for k, _ in found))
    listed = "; ".join(d for _, d in found[:_MAX_LISTED])
    more = f"; and {len(found) - _MAX_LISTED} more" if len(found) > _MAX_LISTED else ""
    fixes = "\n".join(f"  what to change ({k} hooks): {_FIX_HOOKS[k]}." for k in kinds)
    raise CaptureError(
        f"shfx refuses {type(model).__name__}: {listed}{more}. {_WHY_HOOKS}.\n{fixes}"
    )


# ---- what the forward does while it is traced --------------------------------------------------


@dataclass(frozen=True)
class Recorded:
    """One construct met while the export traced the forward.

    ``kind``: ``"function"`` (a custom autograd.Function that builds a graph), ``"checkpoint"``
    (reentrant activation checkpointing), ``"module-hook"`` (torch's BackwardHookFunction: a
    module backward hook registered during forward), ``"tensor-hook"``, ``"post-accumulate"``;
    ``what``: the Function's qualified class name or the hook's description; ``module``: the
    model's module path that called it (None: not inside one of its modules), ``module_type``
    its class name; ``line``: the model's source line, as ``file:line in function: code``."""

    kind: str
    what: str
    module: str | None
    line: str | None
    module_type: str = ""


def _locate(frame: Any, names: dict[int, str]) -> tuple[str | None, str, str | None]:
    """The innermost module of the model whose code is on the stack from ``frame`` up (its
    path and class name), and the innermost source line outside torch and shfx."""
    path = line = None
    kind = ""
    f = frame
    while f is not None and (path is None or line is None):
        code = f.f_code
        if line is None and _is_user_file(code.co_filename):
            text = linecache.getline(code.co_filename, f.f_lineno).strip()
            line = f"{code.co_filename}:{f.f_lineno} in {code.co_name}: {text}"
        if path is None:
            try:
                owner = f.f_locals.get("self")
            except Exception:  # noqa: BLE001 - a frame whose locals cannot be read
                owner = None
            if owner is not None and id(owner) in names:
                path, kind = names[id(owner)], type(owner).__name__
        f = f.f_back
    return path, kind, line


def _builds_graph(args: tuple, kwargs: dict) -> bool:
    """Whether autograd records this call: grad enabled and some tensor argument requires grad."""
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in pytree.tree_leaves((args, kwargs)))


@contextlib.contextmanager
def watch(model: nn.Module) -> Iterator[list[Recorded]]:
    """While the export traces ``model`` (in this thread): record every custom
    ``autograd.Function`` that builds a graph, and every ``Tensor.register_hook`` /
    ``register_post_accumulate_grad_hook`` call. The calls themselves run unchanged.

    NOTE: non-strict torch.export runs the model's Python code on fake tensors and inlines a
    Function's ``forward``; its graph keeps no evidence of the Function (no higher-order op, no
    ``nn_module_stack`` or ``source_fn_stack`` entry), and a hook on a traced tensor is dropped
    silently. So the evidence is taken from the calls themselves, wrapped for the export's
    duration: the two Tensor methods, and ``apply`` one class below ``Function``
    (``_SingleLevelFunction``, where ``Function.apply``'s ``super().apply(...)`` goes on its way to
    ``torch._C._FunctionBase.apply``): wrapping ``Function.apply`` itself would miss a model that
    keeps the bound method (``grad_reverse = GradReverse.apply`` at import). Captures run alone
    (``CAPTURE_GATE``); calls from other threads pass through unrecorded."""
    from torch.autograd.function import _SingleLevelFunction

    names = {id(m): path for path, m in model.named_modules()}
    recorded: list[Recorded] = []
    me = threading.get_ident()
    apply_before = _SingleLevelFunction.__dict__.get("apply")  # (None: inherited, as torch has it)
    hook_orig = torch.Tensor.register_hook
    post_orig = torch.Tensor.register_post_accumulate_grad_hook

    def record(kind: str, what: str) -> None:
        path, module_type, line = _locate(sys._getframe(2), names)
        recorded.append(Recorded(kind, what, path, line, module_type))

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == me and _builds_graph(args, kwargs):
            qual = f"{cls.__module__}.{cls.__qualname__}"
            if cls.__module__ == "torch._library.autograd":
                # the autograd of a torch.library custom op (register_autograd): the op stays one
                # node of the captured graph, and shfx's backward runs its registered backward, as
                # eager does (Mixtral's grouped_mm_fallback: bitwise, benchmarks/hf_zoo.py)
                pass
            elif qual == "torch.utils.checkpoint._NoopSaveInputs":
                pass  # non-reentrant checkpointing's own bookkeeping (torch 2.11 applies it under export): exact
            elif qual == "torch.utils.checkpoint.CheckpointFunction":
                record("checkpoint", qual)
            elif qual == "torch.utils.hooks.BackwardHookFunction":
                record("module-hook", qual)
            else:
                record("function", qual)
        return super(_SingleLevelFunction, cls).apply(*args, **kwargs)  # torch._C._FunctionBase.apply

    def register_hook(self: torch.Tensor, hook: Any) -> Any:
        if threading.get_ident() == me and self.requires_grad:  # (else torch refuses it, as in eager)
            record("tensor-hook", f"tensor.register_hook({_describe_fn(hook)})")
        return hook_orig(self, hook)

    def register_post_accumulate_grad_hook(self: torch.Tensor, hook: Any) -> Any:
        if threading.get_ident() == me:
            record("post-accumulate", f"tensor.register_post_accumulate_grad_hook({_describe_fn(hook)})")
        return post_orig(self, hook)

    _SingleLevelFunction.apply = classmethod(apply)
    torch.Tensor.register_hook = register_hook
    torch.Tensor.register_post_accumulate_grad_hook = register_post_accumulate_grad_hook
    try:
        yield recorded
    finally:
        if apply_before is None:
            del _SingleLevelFunction.apply
        else:
            _SingleLevelFunction.apply = apply_before
        torch.Tensor.register_hook = hook_orig
        torch.Tensor.register_post_accumulate_grad_hook = post_orig


_WHY = {
    "function": (
        "non-strict torch.export inlines a Function's forward and keeps no trace of the Function, so shfx "
        "differentiates the forward's operations and never runs its backward(); eager runs backward(), so the "
        "gradients differ wherever backward is not that derivative to the bit (gradient reversal, straight-through "
        "estimators, a hand-written derivative), and training would silently differ from eager PyTorch"
    ),
    "checkpoint": (
        "torch.export traces reentrant checkpointing (CheckpointFunction) as a no_grad region, so nothing before "
        "it would get a gradient (the loss would have no grad_fn)"
    ),
    "module-hook": (
        "a module backward hook was registered during forward; shfx never calls backward hooks, so training "
        "would silently differ from eager PyTorch"
    ),
    "tensor-hook": (
        "torch.export drops a hook registered on a tensor inside forward and shfx never calls it, so training "
        "would silently differ from eager PyTorch"
    ),
    "post-accumulate": (
        "shfx never calls post-accumulate-grad hooks, so training would silently differ from eager PyTorch"
    ),
}

_FIX = {
    "function": (
        "replace the custom autograd.Function with plain tensor operations whose derivative is the backward you "
        "want (gradient scaled by s, s=-1 reverses it: y = x.detach() + s * (x - x.detach()); straight-through "
        "rounding: y = x + (torch.round(x) - x).detach()), or run this model eagerly"
    ),
    "checkpoint": (
        "use non-reentrant checkpointing, which shfx captures exactly: torch.utils.checkpoint.checkpoint(..., "
        "use_reentrant=False) (Hugging Face: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
        "{'use_reentrant': False}), or activation_checkpointing_kwargs= of activation_checkpointing_enable in "
        "recent versions), or drop the checkpointing"
    ),
    "module-hook": _FIX_HOOKS["module"],
    "tensor-hook": (
        "express the gradient change with plain tensor operations in forward (gradient scaled by s: "
        "x = x.detach() + s * (x - x.detach())), or remove the hook, or run this model eagerly"
    ),
    "post-accumulate": _FIX_HOOKS["post-accumulate"],
}

_TITLE = {
    "function": "calls the custom autograd.Function",
    "checkpoint": "uses reentrant activation checkpointing (torch.utils.checkpoint.checkpoint(..., use_reentrant=True))",
    "module-hook": "runs a module backward hook registered during forward",
    "tensor-hook": "registers a gradient hook in forward:",
    "post-accumulate": "registers a post-accumulate-grad hook in forward:",
}


def refuse_recorded(model: nn.Module, recorded: list[Recorded]) -> None:
    """Raise :class:`CaptureError` for what :func:`watch` recorded: each distinct construct
    once, with the modules and source lines where it was met; reentrant checkpointing first
    (the Functions inside it are not recorded: they run under no_grad)."""
    if not recorded:
        return
    order = ["checkpoint", "function", "module-hook", "tensor-hook", "post-accumulate"]
    groups: dict[tuple[str, str], list[Recorded]] = {}
    for r in sorted(recorded, key=lambda r: order.index(r.kind)):
        groups.setdefault((r.kind, r.what if r.kind != "checkpoint" else ""), []).append(r)
    parts = []
    for (kind, what), rs in list(groups.items())[:_MAX_LISTED]:
        mods = list(dict.fromkeys(r.module for r in rs if r.module is not None))
        lines = list(dict.fromkeys(r.line for r in rs if r.line is not None))
        where = ""
        if mods:
            shown = ", ".join(repr(m) if m else "the model itself" for m in mods[:4])
            types = ", ".join(dict.fromkeys(r.module_type for r in rs if r.module is not None and r.module_type))
            where = f" in module{'s' if len(mods) > 1 else ''} {shown}" + (f" and {len(mods) - 4} more" if len(mods) > 4 else "")
            where += f" ({types})" if types else ""
        at = f"\n    at {lines[0]}" if lines else ""
        name = what.rsplit(".", 1)[-1] if kind == "function" else what
        title = f"{_TITLE[kind]} {name}" if kind in ("function", "tensor-hook", "post-accumulate") else _TITLE[kind]
        if kind == "function":
            title += f" ({what}.apply)"
        parts.append(f"  {title}{where}{at}\n  why: {_WHY[kind]}.\n  what to change: {_FIX[kind]}.")
    more = f"\n  (and {len(groups) - _MAX_LISTED} more)" if len(groups) > _MAX_LISTED else ""
    raise CaptureError(
        f"shfx refuses {type(model).__name__}: its forward would train with different gradients than eager "
        "PyTorch.\n" + "\n".join(parts) + more
    )
