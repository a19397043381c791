"""Dynamic loss scaling for fp16 training: :class:`LossScaler`, shfx's equivalent of
``torch.amp.GradScaler``.

How shfx uses it (``shfx.compile(model, precision="fp16")``; see the mixed-precision design
note): the model runs as a 16-bit working copy on the device and the host keeps fp32 master
weights, fp32 gradients and the AdamW state. With fp16, small gradients underflow, so

- backward seeds the loss gradient with the current scale (as ``(loss * scale).backward()``
  with the 0-dim fp32 tensor :meth:`LossScaler.scale_tensor`, exactly what
  ``GradScaler.scale`` does), so every gradient arrives scaled;
- the host casts each 16-bit gradient to fp32 and its fused AdamW (``torch._fused_adamw_``)
  receives ``grad_scale`` (this scale) and ``found_inf``, as ``GradScaler.step`` passes them
  to a fused optimizer: the kernel unscales inside and does nothing where ``found_inf`` is set;
- an inf or NaN in any gradient skips the whole step: no parameter, ``m``, ``v`` or step count
  changes anywhere. Updates a policy already ran during backward (before the overflow was
  known) are rolled back from the step journal;
- at the end of the step :meth:`LossScaler.update` backs the scale off after an overflow, or
  grows it after ``growth_interval`` consecutive clean steps, through the same
  ``torch._amp_update_scale_`` op as ``GradScaler.update``, so the scale sequence, the
  growth tracker and the :meth:`~LossScaler.state_dict` are GradScaler's, bit for bit (a
  checkpoint moves between the two).

bf16 and fp32 need no scaling; a compiled model then has no scaler.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["LossScaler"]

_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _check_settings(scale: Any, growth_factor: Any, backoff_factor: Any, growth_interval: Any, *, loaded: bool = False) -> None:
    """Raise ValueError naming the first bad setting and the rule it breaks. A loaded scale may
    be 0.0 (enough back-offs underflow fp32 to zero, and GradScaler saves that as it is)."""
    scale_name = "scale" if loaded else "init_scale"
    for name, value in ((scale_name, scale), ("growth_factor", growth_factor), ("backoff_factor", backoff_factor)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"LossScaler: {name} must be a number, got {value!r}")
    if not (math.isfinite(scale) and (scale >= 0 if loaded else scale > 0)):
        raise ValueError(f"LossScaler: {scale_name} must be a finite number {'>=' if loaded else '>'} 0, got {scale!r}")
    if not (math.isfinite(growth_factor) and growth_factor > 1.0):
        raise ValueError(f"LossScaler: growth_factor must be a finite number > 1.0, got {growth_factor!r}")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"LossScaler: backoff_factor must lie strictly between 0 and 1, got {backoff_factor!r}")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
        raise ValueError(f"LossScaler: growth_interval must be an int >= 1, got {growth_interval!r}")


class LossScaler:
    """Dynamic loss scale for fp16 training, equivalent to ``torch.amp.GradScaler``.

    ``update(found_inf)`` after every optimizer step: an overflow multiplies the scale by
    ``backoff_factor`` and resets the growth tracker; ``growth_interval`` consecutive clean
    steps multiply it by ``growth_factor`` (if the result is finite). The scale lives in one
    0-dim fp32 tensor on the host (:meth:`scale_tensor`), updated in place.

    >>> s = LossScaler(init_scale=1024.0, growth_interval=2)
    >>> s
    LossScaler(scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2, growth_tracker=0)
    >>> s.update(found_inf=True); s.scale, s.growth_tracker
    (512.0, 0)
    >>> s.update(found_inf=False); s.update(found_inf=False); s.scale, s.growth_tracker
    (1024.0, 0)
    >>> s.state_dict()
    {'scale': 1024.0, 'growth_factor': 2.0, 'backoff_factor': 0.5, 'growth_interval': 2, '_growth_tracker': 0}
    >>> LossScaler(backoff_factor=1.5)
    Traceback (most recent call last):
    ...
    ValueError: LossScaler: backoff_factor must lie strictly between 0 and 1, got 1.5

    ``enabled=False`` makes it a no-op (scale 1.0, ``update`` does nothing, an empty
    ``state_dict``), as a disabled GradScaler.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        _check_settings(init_scale, growth_factor, backoff_factor, growth_interval)
        self._enabled = bool(enabled)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        # The three tensors _amp_update_scale_ works on, allocated once and updated in place.
        self._scale = torch.full((), float(init_scale) if self._enabled else 1.0, dtype=torch.float32)
        self._growth_tracker = torch.zeros((), dtype=torch.int32)
        self._found_inf = torch.zeros((), dtype=torch.float32)

    # -- reading -------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled)."""
        return float(self._scale.item())

    def scale_tensor(self) -> torch.Tensor:
        """The current scale as a 0-dim fp32 tensor on the host, the one tensor the scaler
        updates in place (the same object every call; do not write to it)."""
        return self._scale

    @property
    def growth_tracker(self) -> int:
        """Consecutive clean steps since the last overflow or growth."""
        return int(self._growth_tracker.item())

    @property
    def growth_factor(self) -> float:
        return self._growth_factor

    @property
    def backoff_factor(self) -> float:
        return self._backoff_factor

    @property
    def growth_interval(self) -> int:
        return self._growth_interval

    # -- stepping ------------------------------------------------------------------------------

    def update(self, found_inf: bool | torch.Tensor) -> None:
        """Back off (``found_inf``: the step saw an inf/NaN gradient and was skipped) or count
        a clean step and grow after ``growth_interval`` of them, exactly as
        ``GradScaler.update``. ``found_inf`` is a bool or a 0-dim float tensor (nonzero: overflow)."""
        if not self._enabled:
            return
        if isinstance(found_inf, torch.Tensor):
            if found_inf.numel() != 1:
                raise ValueError(
                    f"LossScaler.update: found_inf must be a bool or a one-element tensor, got shape {tuple(found_inf.shape)}"
                )
            self._found_inf.copy_(found_inf.reshape(()))
        else:
            self._found_inf.fill_(1.0 if found_inf else 0.0)
        torch._amp_update_scale_(
            self._scale,
            self._growth_tracker,
            self._found_inf,
            self._growth_factor,
            self._backoff_factor,
            self._growth_interval,
        )

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``torch.amp.GradScaler.state_dict()``'s keys and value types (an empty dict when
        disabled), so a checkpoint loads into either."""
        if not self._enabled:
            return {}
        return {
            "scale": self.scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self.growth_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` or ``GradScaler.state_dict()`` (a no-op when
        disabled)."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "LossScaler.load_state_dict: the state dict is empty, possibly because it was saved "
                "from a disabled LossScaler or GradScaler"
            )
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise KeyError(f"LossScaler.load_state_dict: missing keys {missing} (expected {list(_STATE_KEYS)})")
        tracker = state_dict["_growth_tracker"]
        _check_settings(
            state_dict["scale"], state_dict["growth_factor"], state_dict["backoff_factor"], state_dict["growth_interval"], loaded=True
        )
        if isinstance(tracker, bool) or not isinstance(tracker, int) or tracker < 0:
            raise ValueError(f"LossScaler.load_state_dict: _growth_tracker must be an int >= 0, got {tracker!r}")
        self._scale.fill_(float(state_dict["scale"]))
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker.fill_(tracker)

    def __repr__(self) -> str:
        if not self._enabled:
            return "LossScaler(enabled=False)"
        return (
            f"LossScaler(scale={self.scale}, growth_factor={self._growth_factor}, backoff_factor={self._backoff_factor}, "
            f"growth_interval={self._growth_interval}, growth_tracker={self.growth_tracker})"
        )
