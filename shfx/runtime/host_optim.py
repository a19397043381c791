"""The host optimizer: AdamW over a group's flat fp32 buffers.

One call updates a whole group with ``torch._fused_adamw_``, the kernel
``torch.optim.AdamW(fused=True)`` uses, over views of the group's flat master, gradient and
state buffers: one per parameter, or one per run of adjacent parameters where that is bitwise
the same (below). Updates of different groups run on the backend's ``cpu`` stream
(a thread pool) as soon as their gradients land.

NOTE: per-parameter views, not one flat tensor: the fused kernel's vector body and scalar
tail round differently (FMA), so an element's result depends on its position within its
tensor. Views make every element land where it would in ``torch.optim.AdamW(fused=True)``,
so results are bitwise equal to it (and within an ulp of the default for-loop AdamW).

Adjacent parameters are merged into one view where that cannot change a result: the kernel
splits a tensor into chunks of whole cache lines (:data:`_UNIT` = 16 fp32 elements), runs its
vector body over each chunk and the scalar path only over the last ``numel % vec`` elements of
the tensor (``vec`` = 4, 8 or 16 fp32 lanes, a divisor of 16). A parameter whose ``numel`` is a multiple
of 16 has no scalar tail, and if the next parameter starts right after it (no padding, which
:data:`shfx.passes.layout.ALIGN` = 64 bytes guarantees for such sizes) the next one keeps its
position modulo 16 inside the merged view: every element takes the same path, bitwise. Typical
transformer groups (hidden sizes multiple of 16) become a single view, so a group update is one
kernel call and one OpenMP parallel region instead of one per parameter: less per-call cost,
and far fewer fork/join barriers, which is what hurts when the cores are shared (compute
stream, other optimizer workers, other processes). ``tests/test_host_optim.py`` checks merged
against per-parameter views and against ``torch.optim.AdamW(fused=True)`` bitwise, so a torch
that chunks differently fails there.
"""

from __future__ import annotations

import threading

import torch

from ..optim import AdamW
from .host_store import HostStore

__all__ = ["HostAdamW"]

# fp32 elements per cache line: the kernel's parallel chunks are whole multiples of it, and
# every vector width it uses (8 or 16 fp32 lanes) divides it
_UNIT = 16


def _spans(offsets_numels: list[tuple[int, int]], merge: bool = True) -> list[tuple[int, int]]:
    """``(offset, numel)`` (in elements) of the views one update covers, in buffer order.

    With ``merge``, a parameter is appended to the previous view when that view ends exactly
    where the parameter starts and its length is a multiple of :data:`_UNIT`; results are then
    bitwise those of one view per parameter (see the module docstring)."""
    out: list[tuple[int, int]] = []
    for off, n in sorted(offsets_numels):
        if n == 0:
            continue
        if merge and out and out[-1][1] % _UNIT == 0 and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return out


class _State:
    """Flat fp32 states of one group, and the views (per parameter, or merged runs of
    parameters, see :func:`_spans`) of every flat buffer an update covers."""

    __slots__ = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "views")

    def __init__(self, store: HostStore, g: int, amsgrad: bool, merge: bool = True):
        grp = store.groups[g]
        n, dt = grp.trainable_numel, grp.dtypes.state
        self.step = torch.zeros((), dtype=torch.float32)
        self.exp_avg = torch.zeros(n, dtype=dt)
        self.exp_avg_sq = torch.zeros(n, dtype=dt)
        self.max_exp_avg_sq = torch.zeros(n, dtype=dt) if amsgrad else None
        spans = _spans(grp.trainable_spans(), merge)
        bufs = [store.master(g), store.grad(g), self.exp_avg, self.exp_avg_sq]
        if amsgrad:
            bufs.append(self.max_exp_avg_sq)
        self.views = [[b[o : o + k] for o, k in spans] for b in bufs]


class HostAdamW:
    """AdamW states for every group of a host store; ``update(g, hp)`` steps group ``g``.

    ``merge_views=False`` keeps one view per parameter (no merging of adjacent ones; same
    results, more kernel calls: for tests and benchmarks)."""

    def __init__(self, config: AdamW, store: HostStore, merge_views: bool = True):
        self.config = config
        self.store = store
        self.merge_views = merge_views
        self.state: dict[int, _State] = {}
        self._lock = threading.Lock()

    def _state(self, g: int, amsgrad: bool) -> _State:
        with self._lock:
            st = self.state.get(g)
            if st is None:
                st = _State(self.store, g, amsgrad, self.merge_views)
                self.state[g] = st
            elif amsgrad and st.max_exp_avg_sq is None:
                raise ValueError("amsgrad was switched on after the first step; set it when creating the optimizer")
            return st

    def take(self, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Group ``g``'s ``(step, exp_avg, exp_avg_sq)``, dropped here (the group is updated on
        the device from now on); None when it has none."""
        with self._lock:
            st = self.state.get(g)
            if st is None:
                return None
            if st.max_exp_avg_sq is not None:
                raise NotImplementedError("amsgrad is not supported by the device-side optimizer")
            del self.state[g]
        return st.step, st.exp_avg, st.exp_avg_sq

    def put(self, g: int, step: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Take over group ``g``'s states (it is updated on the host from now on)."""
        st = self._state(g, amsgrad=False)
        st.step.copy_(step)
        st.exp_avg.copy_(exp_avg)
        st.exp_avg_sq.copy_(exp_avg_sq)

    def update(self, g: int, hp: dict) -> None:
        if self.store.master(g).numel() == 0:
            return
        st = self._state(g, hp["amsgrad"])
        st.step += 1
        params, grads, avgs, sqs = st.views[:4]
        if not params:
            return
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

    def time_update(self, g: int, hp: dict, repeats: int = 3) -> float:
        """Median seconds of one update of group ``g``, run on scratch buffers laid out like the
        group's (the same views and kernel calls as :meth:`update`), leaving the state untouched."""
        import statistics

        scratch = self.scratch(g)
        self.time_update_on(g, hp, scratch)  # warm-up
        return statistics.median(self.time_update_on(g, hp, scratch) for _ in range(repeats))

    def scratch(self, g: int) -> list[torch.Tensor]:
        """Scratch master, gradient and two state buffers for timing group ``g``'s update (any
        group of the same dtypes and at most its size can be timed on them)."""
        grp = self.store.groups[g]
        n, dt = grp.trainable_numel, grp.dtypes
        return [
            (torch.randn(n) * 1e-3).to(dt.master), (torch.randn(n) * 1e-3).to(dt.grad),
            torch.zeros(n, dtype=dt.state), torch.zeros(n, dtype=dt.state),
        ]  # fmt: skip

    def time_update_on(self, g: int, hp: dict, scratch: list[torch.Tensor]) -> float:
        """Seconds of one update of group ``g`` (its views and kernel call, as in :meth:`update`)
        on ``scratch`` (from :meth:`scratch` of a group at least as large, same dtypes)."""
        import time

        grp = self.store.groups[g]
        spans = _spans(grp.trainable_spans(), self.merge_views)
        if not spans:
            return 0.0
        views = [[b[o : o + k] for o, k in spans] for b in scratch]
        step = torch.zeros(())
        t0 = time.perf_counter()
        step += 1
        torch._fused_adamw_(
            *views, [], [step] * len(spans), lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"],
            weight_decay=hp["weight_decay"], eps=hp["eps"], amsgrad=False, maximize=hp["maximize"],
        )  # fmt: skip
        return time.perf_counter() - t0

    def steps(self, g: int) -> int:
        st = self.state.get(g)
        return 0 if st is None else int(st.step.item())
