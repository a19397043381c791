"""The shape of a GPT and of the batches it trains on: one type for the model
(:class:`shfx.models.GPT`), the capacity planner, ``shfx compare``, ``shfx tune`` and the
paper's experiments.

>>> s = GPTShape(layers=48, hidden=2048, heads=16, seq=1024, batch=4, vocab=50304)  # STRONGHOLD's setup
>>> s.num_params()
2522320896
>>> s.with_layers(2).layers
2
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["GPTShape", "PRECISIONS", "PRECISION_NAMES", "normalize_precision", "short_precision"]

PRECISIONS = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Compute dtype of the parameters on the device -> bytes per element. ``bfloat16``/``float16``
model mixed precision (16-bit working copy and gradients on the device, fp32 master weights,
gradients and AdamW states on the host)."""

_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
PRECISION_NAMES = tuple(_SHORT.values()) + tuple(_SHORT)
"""Every name a precision is accepted by: ``fp32 bf16 fp16`` (what ``shfx.compile(precision=)``
takes) and the long names ``float32 bfloat16 float16`` (the keys of :data:`PRECISIONS`)."""


def normalize_precision(precision: str) -> str:
    """The long name (a key of :data:`PRECISIONS`) of any accepted precision name, in one
    direction everywhere: the planner, the cost models and :class:`GPTShape` use the long
    names; :func:`short_precision` gives what ``shfx.compile(precision=)`` takes.

    >>> normalize_precision("bf16"), normalize_precision("float16")
    ('bfloat16', 'float16')
    """
    if isinstance(precision, str):
        key = precision.strip().lower()
        for long, short in _SHORT.items():
            if key in (long, short):
                return long
    raise ValueError(f"precision must be one of {', '.join(PRECISION_NAMES)}, got {precision!r}")


def short_precision(precision: str) -> str:
    """``"bfloat16"`` (or ``"bf16"``) -> ``"bf16"``: the name ``shfx.compile(precision=)`` takes.

    >>> short_precision("float32")
    'fp32'
    """
    return _SHORT[normalize_precision(precision)]


def _positive_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


@dataclass(frozen=True)
class GPTShape:
    """A GPT (``shfx.models.GPT``: ``layers`` blocks in ``transformer.h``, token and position
    embeddings, a final LayerNorm and a head tied to the token embedding) and its micro-batch.

    Attributes:
        layers, hidden, heads: transformer blocks, model width, attention heads.
        seq: tokens per sequence (the model's ``block_size``: its position embedding's length).
        vocab: vocabulary size.
        batch: sequences per micro-batch.
        dropout, bias, tie_weights, mask_buffer: the model's options (``mask_buffer``: an
            explicit causal-mask buffer instead of ``is_causal``, as older GPT code does).
        precision: compute dtype of the parameters on the device: ``"float32"``, or
            ``"bfloat16"``/``"float16"`` (mixed precision: 16-bit parameters, gradients and
            activations on the device, fp32 master weights, gradients and AdamW states on the
            host, as ``shfx.compile(precision=...)`` trains). The short names ``fp32``, ``bf16``,
            ``fp16`` are accepted and stored as the long ones (:func:`normalize_precision`).
        checkpointing: keep only stage-boundary activations (what shfx does); ``False`` keeps
            every layer's activations (Korthikanti et al.'s ``s b h (34 + 5 a s / h)``).
        loss_in_model: the model is called as ``model(idx, targets)`` and returns the scalar
            loss; ``False``: it returns the logits ``[b, s, V]`` and the loss is computed outside.
    """

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    seq: int = 128
    vocab: int = 256
    batch: int = 1
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    mask_buffer: bool = False
    precision: str = "float32"
    checkpointing: bool = True
    loss_in_model: bool = True

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab", "batch"):
            _positive_int(f"GPTShape.{name}", getattr(self, name))
        if self.hidden % self.heads:
            raise ValueError(f"GPTShape.hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        try:
            object.__setattr__(self, "precision", normalize_precision(self.precision))
        except ValueError:
            raise ValueError(
                f"GPTShape.precision must be one of {', '.join(PRECISION_NAMES)}, got {self.precision!r}"
            ) from None
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"GPTShape.dropout must be in [0, 1), got {self.dropout!r}")

    def with_layers(self, n: int) -> GPTShape:
        return replace(self, layers=n)

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter element on the device."""
        return PRECISIONS[self.precision]

    @property
    def mixed(self) -> bool:
        """16-bit on the device, fp32 master on the host."""
        return self.precision != "float32"

    @property
    def rollback_default(self) -> bool:
        """Whether ``shfx.compile`` keeps the step journal's rollback copies by default at this
        precision: on for fp16 (an overflow found by the loss scaler undoes the updates that
        already ran during the backward), off otherwise."""
        return self.precision == "float16"

    @property
    def params_per_layer(self) -> int:
        """``12 h^2 + 13 h`` with biases (REFERENCE.md), ``12 h^2 + 4 h`` without."""
        h = self.hidden
        return 12 * h * h + (13 * h if self.bias else 4 * h)

    def num_params(self) -> int:
        """``l (12h^2 + 13h) + (V + s) h + 2h`` with the embedding tied to the head (REFERENCE.md)."""
        h = self.hidden
        head = 0 if self.tie_weights else self.vocab * h
        final_ln = 2 * h if self.bias else h
        return self.layers * self.params_per_layer + (self.vocab + self.seq) * h + head + final_ln

    def describe(self) -> str:
        how = "activation checkpointing" if self.checkpointing else "no checkpointing"
        return (
            f"GPT hidden {self.hidden}, {self.heads} heads, seq {self.seq}, batch {self.batch}, vocab {self.vocab}, "
            f"{self.precision}, {how}"
        )
