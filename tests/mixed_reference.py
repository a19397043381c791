"""The eager reference of shfx's mixed-precision training recipe (the design note on mixed
precision, issue 10): what ``shfx.compile(model, precision=...)`` must reproduce bit for bit.

The recipe, in plain PyTorch:

- ``torch.manual_seed(seed)``; ``model = make_model()`` is the fp32 *master* (the user's
  model); ``work = copy.deepcopy(model)`` is the *16-bit working copy*: every floating-point
  parameter cast to the working dtype except the affine parameters of BatchNorm layers (fp32,
  like apex's keep_batchnorm_fp32); buffers keep their dtype (and evolve in the working copy).
- ``torch.optim.AdamW(master params, fused=True)``; fp16 adds ``torch.amp.GradScaler("cpu")``.
- Per micro-batch: ``torch.manual_seed(10_000 + 100 * step + micro)`` (the dropout seed of
  ``equivalence.run_pair``), forward ``work`` on the batch with floating-point tensors cast to
  the working dtype (integer tensors untouched), ``loss = zoo.loss_of(out, aux) / grad_accum``
  (in the dtype the model computes), backward of ``scaler.scale(loss)`` (= ``loss * scale``
  with the 0-dim fp32 scale) for fp16 or of ``loss``; then ``master.grad = p16.grad.float()``
  on the first micro-batch, ``master.grad += p16.grad.float()`` on the next ones (fp32
  accumulation), ``p16.grad = None``.
- The step: fp16 ``scaler.step(opt); scaler.update()`` (the fused AdamW gets ``grad_scale``
  and ``found_inf``: an inf/NaN anywhere leaves params, m, v and step counts unchanged and
  backs the scale off); bf16/fp32 ``opt.step()``. Then ``p16.copy_(master)`` for every
  parameter and ``opt.zero_grad()``.

With ``precision="fp32"`` the recipe is plain fp32 training (bitwise; ``test_amp`` checks it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

__all__ = ["WORKING_DTYPES", "working_dtype", "make_working_copy", "cast_inputs", "bits_of", "train_mixed_eager"]

WORKING_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def working_dtype(precision: str | torch.dtype) -> torch.dtype:
    """The working dtype of a precision name (as shfx.compile accepts them) or dtype."""
    if isinstance(precision, torch.dtype):
        if precision not in WORKING_DTYPES.values():
            raise ValueError(f"unsupported working dtype {precision}")
        return precision
    try:
        return WORKING_DTYPES[precision]
    except KeyError:
        raise ValueError(f"precision must be one of {sorted(WORKING_DTYPES)}, got {precision!r}") from None


def make_working_copy(model: torch.nn.Module, dtype: torch.dtype, fp32_norms: bool = False) -> torch.nn.Module:
    """A deep copy of ``model`` with its floating-point parameters in ``dtype``, except
    BatchNorm affine parameters (fp32) and, with ``fp32_norms``, torch's LayerNorm and RMSNorm
    parameters; buffers as they are. Tied parameters stay tied."""
    work = copy.deepcopy(model)
    kept = (torch.nn.modules.batchnorm._BatchNorm,) + ((torch.nn.LayerNorm, torch.nn.RMSNorm) if fp32_norms else ())
    keep_fp32 = {id(p) for mod in work.modules() if isinstance(mod, kept) for p in mod.parameters(recurse=False)}
    for p in work.parameters():  # unique parameters: a tied one is cast once
        if p.is_floating_point() and id(p) not in keep_fp32:
            p.data = p.data.to(dtype)
    return work


def cast_inputs(args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """Floating-point tensors among the model's top-level arguments cast to ``dtype``."""

    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def bits_of(t: torch.Tensor) -> int:
    """The exact bit pattern of a one-element floating-point tensor, as an int."""
    as_int = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}
    return int(t.detach().reshape(()).view(as_int[t.dtype]).item())


def train_mixed_eager(
    make_model: Callable[[], torch.nn.Module],
    make_batch: Callable,
    precision: str | torch.dtype,
    steps: int,
    *,
    lr: float = 1e-2,
    weight_decay: float = 0.01,
    grad_accum: int = 1,
    seed: int = 0,
    scaler_kwargs: dict | None = None,
    inject_inf: dict[int, str] | None = None,
    loss_fn: Callable | None = None,
    fp32_norms: bool = False,
) -> dict:
    """Train ``steps`` optimizer steps with the recipe of the module docstring.

    ``fp32_norms``: the working copy keeps LayerNorm/RMSNorm parameters in fp32
    (:func:`make_working_copy`), as ``shfx.compile(fp32_norms=True)``.

    ``make_batch(step, micro) -> (args, kwargs, aux)`` as in ``tests/zoo.py``; ``loss_fn(out,
    aux)`` defaults to ``zoo.loss_of``. ``scaler_kwargs`` go to ``torch.amp.GradScaler("cpu",
    ...)`` (fp16 only). ``inject_inf={step: param_name}`` writes ``inf`` into element 0 of that
    parameter's 16-bit gradient after the step's last backward (fp16: the step is skipped;
    bf16/fp32 have no skipping, the inf reaches AdamW).

    Returns a dict:

    - ``"losses"``: ``list[float]``, one per micro-batch (``steps * grad_accum``, in order),
      the loss divided by ``grad_accum`` that was (scaled and) backpropagated;
      ``"loss_bits"``: ``list[int]``, their exact bits (:func:`bits_of`); ``"loss_dtype"``;
    - ``"skipped"``: ``list[bool]`` per step (an inf/NaN gradient; only ever True in fp16);
    - ``"scales"``: ``list[float | None]`` per step, the scale after ``scaler.update()``
      (None unless fp16); ``"growth_trackers"``: ``list[int | None]`` likewise;
    - at the end: ``"master"`` ``{name: fp32 tensor}`` (the master model's
      ``named_parameters()``), ``"exp_avg"``, ``"exp_avg_sq"`` ``{name: fp32 tensor}`` and
      ``"step"`` ``{name: float}`` (parameters the optimizer has state for), ``"working"``
      ``{name: tensor}`` (the working copy's parameters, 16-bit except BatchNorm affine),
      ``"buffers"`` ``{name: tensor}`` (the working copy's buffers, e.g. running stats);
      all clones;
    - ``"model"`` (the fp32 master model), ``"working_model"``, ``"optimizer"``, ``"scaler"``
      (``GradScaler`` or None), to look at anything else.
    """
    if loss_fn is None:
        from zoo import loss_of as loss_fn
    dtype = working_dtype(precision)
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    inject_inf = dict(inject_inf or {})

    torch.manual_seed(seed)
    model = make_model()
    work = make_working_copy(model, dtype, fp32_norms)
    master = dict(model.named_parameters())
    working = dict(work.named_parameters())
    assert master.keys() == working.keys()
    for step, name in inject_inf.items():
        if name not in working:
            raise KeyError(f"inject_inf[{step}]: no parameter {name!r} (have {sorted(working)})")
    trainable = [n for n, p in master.items() if p.requires_grad]
    opt = torch.optim.AdamW([master[n] for n in trainable], lr=lr, weight_decay=weight_decay, fused=True)
    scaler = torch.amp.GradScaler("cpu", **(scaler_kwargs or {})) if dtype == torch.float16 else None

    out: dict = {"losses": [], "loss_bits": [], "loss_dtype": None, "skipped": [], "scales": [], "growth_trackers": []}
    for step in range(steps):
        opt.zero_grad()
        for micro in range(grad_accum):
            args, kwargs, aux = make_batch(step, micro)
            args, kwargs = cast_inputs(args, kwargs, dtype)
            torch.manual_seed(10_000 + 100 * step + micro)
            loss = loss_fn(work(*args, **kwargs), aux) / grad_accum
            (scaler.scale(loss) if scaler is not None else loss).backward()
            out["losses"].append(loss.item())
            out["loss_bits"].append(bits_of(loss))
            out["loss_dtype"] = loss.dtype
            if micro == grad_accum - 1 and step in inject_inf:
                g = working[inject_inf[step]].grad
                if g is None:
                    raise ValueError(f"inject_inf[{step}]: {inject_inf[step]} got no gradient")
                g.view(-1)[0] = float("inf")
            for n in trainable:
                p16 = working[n]
                if p16.grad is None:
                    continue
                if master[n].grad is None:
                    # .float() of an fp32 grad (fp32 precision, BatchNorm) is the grad itself
                    master[n].grad = p16.grad.to(torch.float32, copy=True)
                else:
                    master[n].grad += p16.grad.float()
                p16.grad = None

        grads = [master[n].grad for n in trainable if master[n].grad is not None]
        found_inf = not all(bool(torch.isfinite(g).all()) for g in grads)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            out["skipped"].append(found_inf)
            out["scales"].append(scaler.get_scale())
            out["growth_trackers"].append(scaler.state_dict()["_growth_tracker"])
        else:
            opt.step()
            out["skipped"].append(False)
            out["scales"].append(None)
            out["growth_trackers"].append(None)
        with torch.no_grad():
            for n, p16 in working.items():
                p16.copy_(master[n])
    opt.zero_grad()

    def clones(d):
        return {k: v.detach().clone() for k, v in d.items()}

    out["master"] = clones(master)
    out["working"] = clones(working)
    out["buffers"] = clones(dict(work.named_buffers()))
    state = {n: opt.state[master[n]] for n in trainable if master[n] in opt.state}
    out["exp_avg"] = {n: s["exp_avg"].clone() for n, s in state.items()}
    out["exp_avg_sq"] = {n: s["exp_avg_sq"].clone() for n, s in state.items()}
    out["step"] = {n: float(s["step"]) for n, s in state.items()}
    out.update(model=model, working_model=work, optimizer=opt, scaler=scaler)
    return out
