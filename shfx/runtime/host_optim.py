"""The host optimizer: AdamW over a group's flat fp32 buffers.

One call updates a whole group (all of a stage's trainable parameters, padding included:
padding has zero params and grads and stays zero) with ``torch._fused_adamw_``, the kernel
``torch.optim.AdamW(fused=True)`` uses, so results match torch's AdamW. Updates of different
groups run on the backend's ``cpu`` stream (a thread pool) as soon as their gradients land.
"""

from __future__ import annotations

import threading

import torch

from ..optim import AdamW
from .host_store import HostStore

__all__ = ["HostAdamW"]


class _State:
    __slots__ = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def __init__(self, n: int, amsgrad: bool):
        self.step = torch.zeros((), dtype=torch.float32)
        self.exp_avg = torch.zeros(n, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(n, dtype=torch.float32)
        self.max_exp_avg_sq = torch.zeros(n, dtype=torch.float32) if amsgrad else None


class HostAdamW:
    """AdamW states for every group of a host store; ``update(g, hp)`` steps group ``g``."""

    def __init__(self, config: AdamW, store: HostStore):
        self.config = config
        self.store = store
        self.state: dict[int, _State] = {}
        self._lock = threading.Lock()

    def _state(self, g: int, amsgrad: bool) -> _State:
        with self._lock:
            st = self.state.get(g)
            if st is None:
                st = _State(self.store.master(g).numel(), amsgrad)
                self.state[g] = st
            return st

    def update(self, g: int, hp: dict) -> None:
        p = self.store.master(g)
        if p.numel() == 0:
            return
        grad = self.store.grad(g)
        st = self._state(g, hp["amsgrad"])
        st.step += 1
        torch._fused_adamw_(
            [p],
            [grad],
            [st.exp_avg],
            [st.exp_avg_sq],
            [st.max_exp_avg_sq] if hp["amsgrad"] else [],
            [st.step],
            lr=hp["lr"],
            beta1=hp["beta1"],
            beta2=hp["beta2"],
            weight_decay=hp["weight_decay"],
            eps=hp["eps"],
            amsgrad=hp["amsgrad"],
            maximize=hp["maximize"],
        )

    def steps(self, g: int) -> int:
        st = self.state.get(g)
        return 0 if st is None else int(st.step.item())
