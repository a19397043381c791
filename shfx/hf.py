"""Hugging Face ``Trainer`` and ``accelerate`` with shfx.

:class:`Trainer` is ``transformers.Trainer`` for a model shfx trains: give it the model (or a
model already compiled by :func:`shfx.compile`) and the usual ``TrainingArguments``; it trains
as ``transformers.Trainer`` trains the eager model (same groups, optimizer, scheduler, clipping,
gradient accumulation, loss normalisation), bitwise on the CPU, with the host update overlapped
with the backward::

    from shfx.hf import Trainer
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                      shfx_options={"window": 2, "device": shfx.EmulatedDevice(memory="2GiB")})
    trainer.train()

What it changes in ``transformers.Trainer`` (each is a place where the eager loop assumes the
weights and gradients are in the model's parameters, which with shfx they are not while a step
runs):

- the model is compiled with the options the arguments imply: ``grad_accum_steps =
  gradient_accumulation_steps`` (the host updates start during the last micro-batch's
  backward), ``max_grad_norm`` (exact global-norm clipping that keeps the update overlapped:
  docs/usage.md, "Gradient clipping"), and the optimizer ``create_optimizer`` would build —
  ``optim="adamw_torch_fused"``/``"adamw_torch"`` (``shfx.optim.AdamW``) or ``"sgd"``
  (``shfx.optim.SGD``), with the Trainer's own weight-decay groups (no decay on biases and norms)
  and ``learning_rate``, ``adam_beta1/2``, ``adam_epsilon``, ``weight_decay``;
- the clip step asks the compiled model for the norm (``cm.clip_grad_norm_``) instead of
  editing ``p.grad`` under a running update;
- nothing is moved to ``args.device`` (shfx places the weights; inputs still go there);
- ``save_model`` and checkpoints write the current host weights (``save_pretrained`` for a
  ``PreTrainedModel``); the optimizer's state is torch's format (``cm.optimizer.state_dict()``).

``bf16=True``/``fp16=True`` in the arguments turn on ``torch.autocast`` and (fp16) a
``GradScaler`` in ``accelerate``, which is not how shfx trains in 16 bits: they are refused;
pass ``shfx_options={"precision": "bf16"}`` (fp32 masters on the host, a 16-bit working copy on
the device; docs/usage.md, "Mixed precision").

With ``accelerate`` alone no adapter is needed: ``accelerator.prepare(cm, cm.optimizer,
dataloader, scheduler)`` passes the compiled model through and wraps its optimizer; clip with
``shfx.compile(max_grad_norm=...)`` (or ``cm.clip_grad_norm_``), not with
``accelerator.clip_grad_norm_`` (docs/usage.md, "Hugging Face Trainer and accelerate").
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
from torch import nn

try:
    import transformers
except ImportError as e:  # pragma: no cover - transformers is optional
    raise ImportError(
        "shfx.hf needs Hugging Face transformers (and accelerate): pip install transformers accelerate"
    ) from e

from . import optim
from .api import CompiledModel
from .api import compile as shfx_compile
from .errors import UsageError

__all__ = ["Trainer", "optimizer_from_args"]

_ADAMW = ("adamw_torch", "adamw_torch_fused")


def optimizer_from_args(args: Any, model: nn.Module, decay_names: list[str] | None = None) -> optim.HostOptimizer:
    """The shfx optimizer ``transformers.Trainer.create_optimizer`` would build from ``args``
    for ``model``: two groups (weight decay on the Trainer's decay parameters, none on biases
    and norms; frozen parameters left out) and the arguments' hyperparameters.

    ``decay_names``: the parameter names that get weight decay (default: what
    ``transformers.Trainer.get_decay_parameter_names`` says for ``model``).
    """
    name = str(getattr(args.optim, "value", args.optim))
    if decay_names is None:
        decay_names = transformers.Trainer.get_decay_parameter_names(None, model)
    decay = set(decay_names)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if name in _ADAMW:
        return optim.AdamW(
            groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon
        )
    if name == "sgd":
        return optim.SGD(groups, lr=args.learning_rate)
    raise UsageError(
        f"TrainingArguments(optim={name!r}): shfx runs the optimizer on the host next to the master weights and has "
        f"{', '.join(_ADAMW)} (shfx.optim.AdamW) and 'sgd' (shfx.optim.SGD). Use one of them, or compile the model "
        "yourself with optimizer=shfx.optim.Adafactor(...) (or another shfx optimizer) and pass the compiled model."
    )


def _check_precision(args: Any) -> None:
    for flag in ("bf16", "fp16"):
        if getattr(args, flag, False):
            raise UsageError(
                f"TrainingArguments({flag}=True) turns on torch.autocast (and for fp16 accelerate's GradScaler), which "
                f"is not how shfx trains in 16 bits. Leave {flag}=False and pass shfx_options={{'precision': '{flag}'}} "
                "(or compile with precision=...): fp32 master weights on the host, a 16-bit copy on the device"
                + (", shfx's own loss scaling" if flag == "fp16" else "")
                + "."
            )


def _compiled_from(model: Any, args: Any, options: dict[str, Any]) -> CompiledModel:
    """``model`` compiled with what ``args`` imply, or ``model`` itself (already compiled)
    checked against ``args``."""
    clip = args.max_grad_norm if args.max_grad_norm is not None and args.max_grad_norm > 0 else None
    accum = args.gradient_accumulation_steps
    if isinstance(model, CompiledModel):
        if options:
            raise UsageError(
                f"shfx_options={sorted(options)} are compile options, but the model is already compiled: pass the "
                "uncompiled model with shfx_options, or compile it yourself with them"
            )
        cm = model
        config = cm.config
        if cm.optimizer is None:
            raise UsageError(
                "the compiled model has no optimizer (shfx.compile(optimizer=None)): compile it with "
                "optimizer=shfx.optim.AdamW(...), or pass the uncompiled model, and shfx.hf.Trainer builds the optimizer "
                "from the TrainingArguments as transformers.Trainer does"
            )
        if config.grad_accum_steps != accum:
            raise UsageError(
                f"TrainingArguments(gradient_accumulation_steps={accum}) but the model was compiled with "
                f"grad_accum_steps={config.grad_accum_steps} (backward() calls per step: the host updates start during "
                "the last one). Compile with the same number, or pass the uncompiled model."
            )
        if clip is not None and config.max_grad_norm is None and config.overlap_update:
            raise UsageError(
                f"TrainingArguments(max_grad_norm={args.max_grad_norm}) clips every step, but the model was compiled "
                "without max_grad_norm, so its updates start during backward, before the norm is known. Compile with "
                f"max_grad_norm={args.max_grad_norm} (exact clipping, update still overlapped), or set max_grad_norm=0 "
                "in the TrainingArguments for no clipping."
            )
        if clip is None and config.max_grad_norm is not None:
            raise UsageError(
                f"the model was compiled with max_grad_norm={config.max_grad_norm}, but TrainingArguments(max_grad_norm="
                f"{args.max_grad_norm}) asks for no clipping; make them agree"
            )
        return cm
    if not isinstance(model, nn.Module):
        raise TypeError(f"shfx.hf.Trainer takes an nn.Module or a shfx compiled model, got {type(model).__name__}")
    for k in ("grad_accum_steps", "max_grad_norm", "optimizer"):
        if k in options:
            raise UsageError(
                f"shfx_options[{k!r}] comes from the TrainingArguments (gradient_accumulation_steps, max_grad_norm, "
                "optim/learning_rate/...); set it there, or compile the model yourself and pass the compiled model"
            )
    opt = optimizer_from_args(args, model)
    return shfx_compile(model, optimizer=opt, grad_accum_steps=accum, max_grad_norm=clip, **options)


class _Model(nn.Module):
    """What ``transformers.Trainer`` and ``accelerate`` see as the model: an ``nn.Module`` with no
    parameters of its own around the compiled model (theirs live in shfx's host store), whose
    ``forward`` is the compiled model's call; ``to()`` moves nothing (shfx places the weights),
    ``train``/``eval``/``zero_grad``/``state_dict``/``load_state_dict`` go to the compiled model,
    ``parameters()``, ``config`` and ``loss_type`` (a Hugging Face model's) are the model's."""

    def __init__(self, cm: CompiledModel):
        super().__init__()
        self.__dict__["compiled"] = cm  # not a submodule: its parameters are not this module's
        module = cm.module
        if hasattr(module, "accepts_loss_kwargs"):
            self.accepts_loss_kwargs = bool(module.accepts_loss_kwargs)
        else:
            params = inspect.signature(module.forward).parameters.values()
            self.accepts_loss_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)

    @property
    def config(self) -> Any:
        return getattr(self.compiled.module, "config", None)

    @property
    def loss_type(self) -> Any:  # how the Trainer counts the tokens a causal LM's loss averages
        return getattr(self.compiled.module, "loss_type", None)

    def to(self, *args: Any, **kwargs: Any) -> _Model:
        return self

    def train(self, mode: bool = True) -> _Model:
        super().train(mode)
        self.compiled.train(mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.compiled.zero_grad(set_to_none)

    def parameters(self, recurse: bool = True) -> Any:
        return self.compiled.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled.named_parameters(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.compiled.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.compiled.load_state_dict(state_dict, strict=strict)


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` for shfx (see the module docstring).

    Args:
        model: an ``nn.Module`` (compiled here with ``shfx_options`` and what ``args``
            implies) or a model compiled by ``shfx.compile`` (checked against ``args``: the same
            ``gradient_accumulation_steps``, clipping compiled in when ``max_grad_norm > 0``).
        args: ``TrainingArguments`` (default: as ``transformers.Trainer``'s).
        shfx_options: ``shfx.compile`` keyword arguments (``window``, ``device``, ``policy``,
            ``precision``, ...), for an uncompiled model.
        **kwargs: the rest of ``transformers.Trainer``'s arguments. ``optimizers=(optimizer,
            scheduler)``: the optimizer, if given, must be the compiled model's
            (``cm.optimizer``); the scheduler may be any built on it.

    Attributes:
        compiled: the compiled model (``trainer.model`` is an ``nn.Module`` view of it).
    """

    def __init__(self, model: Any = None, args: Any = None, *, shfx_options: dict[str, Any] | None = None, **kwargs: Any):
        if model is None:
            raise UsageError("shfx.hf.Trainer needs a model (model_init is not supported: compile once, train once)")
        if args is None:
            args = transformers.TrainingArguments(output_dir="tmp_trainer")
        _check_precision(args)
        self.compiled = _compiled_from(model, args, dict(shfx_options or {}))
        optimizer, scheduler = kwargs.pop("optimizers", (None, None))
        if optimizer is not None and optimizer is not self.compiled.optimizer:
            raise UsageError(
                "optimizers=(optimizer, ...): shfx runs the optimizer bound to the compiled model on the host; pass "
                "(cm.optimizer, scheduler) or (None, scheduler), or compile the model with the optimizer you want"
            )
        if kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise UsageError("optimizer_cls_and_kwargs: compile the model with optimizer=shfx.optim.... instead")
        model = _Model(self.compiled)
        super().__init__(model=model, args=args, optimizers=(self.compiled.optimizer, scheduler), **kwargs)
        # what transformers reads off the model's class (the view's forward is *args, **kwargs)
        cls = self.compiled.module.__class__
        if args.label_names is None:
            self.label_names = transformers.utils.find_labels(cls)
        self.can_return_loss = transformers.utils.can_return_loss(cls)

    # ---- the places transformers.Trainer assumes an eager model ------------------------------
    def _move_model_to_device(self, model: Any, device: torch.device) -> None:
        """shfx places the weights itself (host store, device slots); nothing to move."""

    def _set_signature_columns_if_needed(self) -> None:
        if self._signature_columns is None:
            signature = inspect.signature(self.compiled.module.forward)
            self._signature_columns = list(signature.parameters.keys())
            self._signature_columns += list(set(["label", "label_ids"] + self.label_names))

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        self.optimizer = self.compiled.optimizer
        return self.optimizer

    def _clip_grad_norm(self, model: Any) -> torch.Tensor:
        return self.compiled.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        # without clipping the updates already ran during backward: the norm is not computed
        # (reading p.grad for it would cost a pass over every gradient)
        return grad_norm

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        module = self.compiled.module
        return module.floating_point_ops(inputs) if hasattr(module, "floating_point_ops") else 0

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        # save_pretrained leaves out one name of each tied pair (lm_head.weight): loading its
        # twin loaded it, since both names are one tensor in the host store
        tensors = self.compiled.module.state_dict(keep_vars=True)
        loaded = {id(tensors[k]) for k in tensors if k not in set(load_result.missing_keys)}
        missing = [k for k in load_result.missing_keys if id(tensors.get(k)) not in loaded]
        if missing:
            transformers.logging.get_logger(__name__).warning(f"missing keys in the checkpoint loaded: {missing}")
        if load_result.unexpected_keys:
            transformers.logging.get_logger(__name__).warning(
                f"unexpected keys in the checkpoint loaded: {load_result.unexpected_keys}"
            )

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        state_dict = self.compiled.state_dict() if state_dict is None else state_dict
        module = self.compiled.module
        if isinstance(module, transformers.PreTrainedModel):
            module.save_pretrained(output_dir, state_dict=state_dict)
        else:
            torch.save(state_dict, os.path.join(output_dir, "pytorch_model.bin"))
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
