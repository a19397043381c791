"""Which capture serves a call: input signatures reduced to their structure or with their dynamic
sizes masked, the dimensions to capture dynamic, the dynamic capture whose ranges cover a call,
and the error for a capture that failed at a new size.

Pure functions of the signature, the input tensors and the captures kept so far
(:class:`shfx.api.CompiledModel` holds that cache and calls these)."""

from __future__ import annotations

from typing import Any

import torch

from shfx.passes.capture import CaptureError, DynamicDim, DynamicShapes, InputSignature
from shfx.passes.pipeline import Variant

from .config import _DYNAMIC_NAMES
from .errors import UsageError

__all__ = ["covering", "declared_dims", "dynamic_dims", "masked", "shape_change_error", "structure", "tensor_names"]


def declared_dims(dynamic: dict, tensors: list[torch.Tensor]) -> list[DynamicDim] | None:
    dims: dict[tuple[int, int], DynamicDim] = {}
    for name, rng in dynamic.items():
        if isinstance(name, str):
            d = _DYNAMIC_NAMES[name]
            for i, t in enumerate(tensors):
                if t.dim() > d:
                    dims[(i, d)] = DynamicDim(i, d, name, rng[0], rng[1])
        else:
            for d, (lo, hi) in rng.items():
                if name < len(tensors) and 0 <= d < tensors[name].dim():
                    dims[(name, d)] = DynamicDim(name, d, f"input{name}_dim{d}", lo, hi)
    for dd in dims.values():
        n = int(tensors[dd.input].shape[dd.dim])
        if not dd.lo <= n <= dd.hi:
            raise UsageError(
                f"dimension {dd.dim} of tensor input {dd.input} is {n}, outside the dynamic range {dd.name}="
                f"{(dd.lo, dd.hi)} declared with shfx.compile(dynamic=...); declare a range that holds it"
            )
    return list(dims.values()) or None


def tensor_names(args: tuple, kwargs: dict) -> list[str]:
    """Per tensor leaf of the call (``flatten_inputs`` order), where it was passed:
    ``args[0]``, ``kwargs['input_ids']``, ``args[1][0]``."""
    from torch.utils import _pytree as pytree

    leaves, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    names = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            head = "args" if getattr(path[0], "idx", 0) == 0 else "kwargs"
            names.append(head + pytree.keystr(path[1:]))
    return names


def shape_change_error(
    model_name: str, args: tuple, kwargs: dict, tensors: list[torch.Tensor], seen: set, e: CaptureError
) -> CaptureError | None:
    """The error for a capture that failed at a new size of a dimension earlier calls had
    another size (``seen``: their shapes, same structure): which input, which dimension,
    expected and got, instead of :func:`~shfx.passes.capture._capture_error`'s generic advice.
    None when ``e`` is not torch.export's failure of this call (a refusal) or nothing changed."""
    from shfx.passes.capture import _first_line, _user_frame

    cause = e.__cause__
    now = tuple(tuple(t.shape) for t in tensors)
    if cause is None or isinstance(cause, CaptureError) or not seen or now in seen:
        return None

    def changed(before: tuple) -> list[tuple[int, int, int, int]]:
        return [
            (i, d, a, b)
            for i, (old, new) in enumerate(zip(before, now))
            for d, (a, b) in enumerate(zip(old, new))
            if a != b
        ]

    before = min(sorted(seen), key=lambda shapes: len(changed(shapes)))
    diffs = changed(before)
    if not diffs:
        return None
    names = tensor_names(args, kwargs)
    lines = []
    for i, d, a, b in diffs:
        where = f"tensor input {i}" + (f" ({names[i]})" if i < len(names) else "")
        lines.append(
            f"{where}: dimension {d} is {b}, earlier calls had {a} (shape {list(now[i])}, captured with {list(before[i])})"
        )
    frame = _user_frame(cause)
    at = f"\n  at {frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}" if frame else ""
    dims = ", ".join(f"dimension {d} of tensor input {i} = {a}" for i, d, a, _ in diffs)
    return CaptureError(
        f"shfx could not capture {model_name} for a new input shape: {'; '.join(lines)}. The forward fails at the "
        f"new size: {_first_line(cause)}{at}\n"
        f"  what to change: a size the model's weights fix (a feature or hidden dimension, channels, a vocabulary) "
        f"must stay as it was: pass inputs with {dims}, as before (eager PyTorch fails at this size too). Sizes the "
        "model allows to vary (batch, sequence length) are captured again or covered by a dynamic capture "
        "(docs/usage.md, 'Variable shapes')."
    )


def structure(sig: InputSignature) -> InputSignature:
    """The signature with every tensor's shape reduced to its number of dimensions."""
    leaves = tuple(("T", len(x[1]), *x[2:]) if x[0] == "T" else x for x in sig.leaves)
    return InputSignature(sig.training, sig.tree, leaves)


def masked(sig: InputSignature, dyn: DynamicShapes) -> InputSignature:
    """The signature with the sizes of ``dyn``'s dynamic dimensions masked (None)."""
    dynamic = {(i, d) for i, d, _ in dyn.dims}
    leaves, i = [], 0
    for x in sig.leaves:
        if x[0] == "T":
            shape = tuple(None if (i, d) in dynamic else n for d, n in enumerate(x[1]))
            leaves.append(("T", shape, *x[2:]))
            i += 1
        else:
            leaves.append(x)
    return InputSignature(sig.training, sig.tree, tuple(leaves))



def covering(
    variants: dict[Any, Variant], sig: InputSignature, tensors: list[torch.Tensor], dynamic: str | bool | dict
) -> tuple[Any, Variant | None]:
    """A dynamic capture for this call's structure whose ranges hold its sizes; a declared
    range it falls outside of is an error (the device memory was sized for the range).
    ``variants``: the captures kept, least recently used first; ``dynamic``: the compile option."""
    outside = None
    for key, v in reversed(variants.items()):
        dyn = v.captured.dynamic if v.captured is not None else None
        if dyn is None or key[1] != masked(sig, dyn):
            continue
        why = dyn.mismatch(tensors)
        if why is None:
            return key, v
        outside = outside or why
    if outside is not None and isinstance(dynamic, dict):
        raise UsageError(
            f"{outside}: that is beyond the dynamic range declared with shfx.compile(dynamic={dynamic!r}), "
            "for which shfx captured the model once and sized the device memory (the largest shape in the "
            "range). Declare a range that holds this size (dynamic={'seq': (1, n)}, ...), or pad or split the "
            "input to fit the range."
        )
    return None, None


def dynamic_dims(
    variants: dict[Any, Variant],
    seen_shapes: dict[Any, set[tuple[tuple[int, ...], ...]]],
    sig: InputSignature,
    tensors: list[torch.Tensor],
    dynamic: str | bool | dict,
    dynamic_off: str | None,
) -> list[DynamicDim] | None:
    """Which dimensions to capture dynamic for this call: the declared ones, or (automatic
    mode) every dimension whose size differs from an earlier call of the same structure.
    ``seen_shapes``: the shapes of earlier calls, per :func:`structure`; ``dynamic``: the compile
    option; ``dynamic_off``: why dynamic capture was given up (None while it works)."""
    if dynamic_off is not None or dynamic is False or not tensors:
        return None
    if isinstance(dynamic, dict):
        return declared_dims(dynamic, tensors)
    seen = seen_shapes.get(structure(sig), set())
    if not seen:
        return None  # the first shape: captured as it is
    for key, v in variants.items():  # a dynamic capture of this family that cannot stretch to it
        dyn = v.captured.dynamic if v.captured is not None else None
        if dyn is not None and key[1] == masked(sig, dyn) and not dyn.could_grow(tensors):
            return None  # below its range or above the model's limit: this shape on its own
    dims = []
    for i, t in enumerate(tensors):
        for d, n in enumerate(t.shape):
            sizes = {shapes[i][d] for shapes in seen}
            if sizes != {n}:
                dims.append(DynamicDim(i, d, f"d{i}_{d}", auto=True, seen_max=max(sizes | {n})))
    return dims or None
