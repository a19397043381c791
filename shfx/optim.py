"""Optimizers shfx runs on the host, next to the master weights.

``shfx.optim.AdamW(...)`` is a configuration with ``torch.optim.AdamW``'s arguments and
defaults; ``shfx.compile(optimizer=...)`` binds it to the model's host store, where updates run
on flat per-group buffers, each starting as soon as that group's gradients are on the host.
Results match ``torch.optim.AdamW`` (it uses the same fused kernel on the flat buffers).

Change the learning rate between steps with ``cm.optimizer.lr = ...`` (or ``param_groups[0]["lr"]``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AdamW"]


@dataclass
class AdamW:
    """AdamW on the host (decoupled weight decay), as ``torch.optim.AdamW``.

    >>> opt = AdamW(lr=3e-4, weight_decay=0.1)
    >>> opt.betas
    (0.9, 0.999)
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    amsgrad: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        self.validate()

    def validate(self) -> None:
        if not 0.0 <= float(self.lr):
            raise ValueError(f"AdamW lr must be >= 0, got {self.lr}")
        if not 0.0 <= float(self.eps):
            raise ValueError(f"AdamW eps must be >= 0, got {self.eps}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"AdamW betas must be two numbers in [0, 1), got {self.betas}")
        if not 0.0 <= float(self.weight_decay):
            raise ValueError(f"AdamW weight_decay must be >= 0, got {self.weight_decay}")

    def hyperparams(self) -> dict:
        """A snapshot of the hyperparameters (taken when an update is issued)."""
        self.validate()
        return {
            "lr": float(self.lr),
            "beta1": float(self.betas[0]),
            "beta2": float(self.betas[1]),
            "eps": float(self.eps),
            "weight_decay": float(self.weight_decay),
            "amsgrad": bool(self.amsgrad),
            "maximize": bool(self.maximize),
        }

    @property
    def param_groups(self) -> list[dict]:
        """A torch-style view for code that sets ``param_groups[0]["lr"]``."""
        return [_GroupView(self)]


class _GroupView(dict):
    def __init__(self, opt: AdamW):
        super().__init__(lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
        self._opt = opt

    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        if not hasattr(self._opt, k):
            raise KeyError(f"AdamW has no hyperparameter {k!r}")
        setattr(self._opt, k, v)
