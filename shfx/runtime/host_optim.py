"""The host optimizer: AdamW over a group's flat fp32 buffers.

One call updates a whole group with ``torch._fused_adamw_``, the kernel
``torch.optim.AdamW(fused=True)`` uses, over per-parameter views of the group's flat master,
gradient and state buffers. Updates of different groups run on the backend's ``cpu`` stream
(a thread pool) as soon as their gradients land.

NOTE: per-parameter views, not one flat tensor: the fused kernel's vector body and scalar
tail round differently (FMA), so an element's result depends on its position within its
tensor. Views make every element land where it would in ``torch.optim.AdamW(fused=True)``,
so results are bitwise equal to it (and within an ulp of the default for-loop AdamW).
"""

from __future__ import annotations

import threading

import torch

from ..optim import AdamW
from .host_store import HostStore

__all__ = ["HostAdamW"]


class _State:
    """Flat fp32 states of one group, and per-parameter views of every flat buffer."""

    __slots__ = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "views")

    def __init__(self, store: HostStore, g: int, amsgrad: bool):
        n = store.master(g).numel()
        self.step = torch.zeros((), dtype=torch.float32)
        self.exp_avg = torch.zeros(n, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(n, dtype=torch.float32)
        self.max_exp_avg_sq = torch.zeros(n, dtype=torch.float32) if amsgrad else None
        grp = store.groups[g]
        spans = [(grp.offsets[i.key] // 4, i.numel) for i in grp.infos if i.kind == "param" and i.trainable]
        bufs = [store.master(g), store.grad(g), self.exp_avg, self.exp_avg_sq]
        if amsgrad:
            bufs.append(self.max_exp_avg_sq)
        self.views = [[b[o : o + k] for o, k in spans] for b in bufs]


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
                st = _State(self.store, g, amsgrad)
                self.state[g] = st
            elif amsgrad and st.max_exp_avg_sq is None:
                raise ValueError("amsgrad was switched on after the first step; set it when creating the optimizer")
            return st

    def update(self, g: int, hp: dict) -> None:
        if self.store.master(g).numel() == 0:
            return
        st = self._state(g, hp["amsgrad"])
        st.step += 1
        params, grads, avgs, sqs = st.views[:4]
        torch._fused_adamw_(
            params,
            grads,
            avgs,
            sqs,
            st.views[4] if hp["amsgrad"] else [],
            [st.step] * len(params),
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
