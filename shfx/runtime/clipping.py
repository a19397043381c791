"""Exact global-norm gradient clipping: the step-phase actions ``GN g``, ``NR0`` and ``CK0``
(docs/usage.md, "Gradient clipping"; docs/design.md, "The whole step").

``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)`` computes each parameter's norm
(``torch._foreach_norm``), then the norm of those, then scales every gradient by
``min(max_norm / (total + 1e-6), 1)``. shfx computes the same numbers from the host gradients:

- ``GN g`` (during the backward, as soon as group ``g``'s gradient is on the host): the norm of
  each of its parameters' gradients, over views of the flat host gradient (the same kernel over
  the same values: the same bits). A group updated on the device (``Resident``,
  ``Stronghold(resident_first=k)``) is normed on the compute stream right after its last
  backward, over views of its gradient in its persistent owner's gradient buffer, where the
  gradient waits for its ``DU g`` after the gate (scaled by the coefficient there first). Under data parallel a rank holds a shard of the group: the
  parameters wholly inside it are normed here, the ones split between ranks by ``NR0``.
- ``NR0`` (data parallel, the reduce queue, after every ``RS``): the pieces of every split
  parameter are all-gathered so each rank norms it whole (the same bits as eager's norm of the
  whole gradient), then one SUM all-reduce of the per-parameter norm vector, to which each
  parameter's norm is contributed by exactly one rank (``x + 0 = x``: exact). With a replicated
  optimizer (Adafactor) every rank holds every gradient whole, all-reduced, and norms every
  parameter: rank 0 alone contributes them (N contributions would count each norm N times); so
  it does for a group updated on the device, replicated whatever the optimizer (its ``RS g``
  all-reduced its device gradient before its ``GN g``).
- ``CK0`` (the step's gate): the total norm over every parameter in the model's order and the
  clip coefficient; ``step()`` reads it, skips or fails a non-finite step, then starts the
  clipped updates (each scales its group's gradient by the coefficient first).

Under data parallel, ``NR0`` is in the step phase of every program whose updates wait for the
gate, clipped or not. A step without norms to reduce (updates in ``step()``, not clipped; or
clipped by ``cm.clip_grad_norm_()``, whose call reduced them already) agrees the finite check
instead: each rank puts its first non-finite gradient (0: none, else group + 1) in its slot of
a vector of N integers, one MAX all-reduce, and every rank reads the same verdict, so all skip
(``skip_nonfinite``) or fail the step alike. ``cm.clip_grad_norm_()`` under data parallel
issues the program's ``NR0`` and ``CK0`` when it is called (``requested``): every rank gets the
same total, which ``step()`` then clips by.
"""

from __future__ import annotations

from typing import Any

import torch

from .host_store import GRAD_VALID

__all__ = ["Clipping"]


class Clipping:
    """The clipping state of one engine: the norms of the step's gradients and the gate's result.

    Attributes:
        clip: ``(max_norm, norm_type)`` from ``shfx.compile(max_grad_norm=...)``, or None.
        clip_order: ``(group, key)`` of every trainable parameter in the model's order (the
            order ``clip_grad_norm_`` stacks the norms in).
        grad_norms: group -> ``(norm_type, {key: norm})`` of this step's gradients.
        clipped: ``cm.clip_grad_norm_()``'s ``(max_norm, total)`` this step, or None.
        gate: ``CK0``'s ``(max_norm, total)`` this step, or None.
        last_grad_norm: the total norm the last clipped ``step()`` used.
        requested: under data parallel, ``cm.clip_grad_norm_()``'s ``(max_norm, norm_type)``
            while the gate it issues reduces the norms and computes the total, or None.
        nonfinite: the finite check ``NR0`` agreed across ranks (a step whose norms it does not
            reduce): ``(rank, group)`` of each rank's first non-finite gradient, empty when every
            one is finite; None before it ran.
        outcome: the verdict ``NR0`` of an overlapped step with rollback under data parallel
            (:meth:`agree_outcome`), or None.
    """

    def __init__(self, engine: Any, max_grad_norm: float | None, norm_type: float) -> None:
        self._engine = engine  # reads: store, dp, scaler, unscaled, param_keys_by_group
        self.clip: tuple[float, float] | None = None if max_grad_norm is None else (float(max_grad_norm), float(norm_type))
        self.clip_order: list[tuple[int, str]] = []
        self.grad_norms: dict[int, tuple[float, dict[str, torch.Tensor]]] = {}
        self.clipped: tuple[float, torch.Tensor] | None = None
        self.gate: tuple[float, torch.Tensor] | None = None
        self.last_grad_norm: torch.Tensor | None = None
        self.requested: tuple[float, float] | None = None
        self.nonfinite: list[tuple[int, int]] | None = None
        self.outcome: dict[str, list] | None = None  # the overlapped step's verdict NR0 (agree_outcome)

    @property
    def norm_type(self) -> float:
        if self.requested is not None:
            return self.requested[1]
        return self.clip[1] if self.clip is not None else 2.0

    def reduces_norms(self) -> bool:
        """Whether this step's ``NR0`` reduces gradient norms (the compiled ``max_grad_norm``'s,
        or ``cm.clip_grad_norm_()``'s being computed); otherwise it agrees the finite check."""
        return self.requested is not None or (self.clip is not None and self.clipped is None)

    # ---- GN g --------------------------------------------------------------------------------
    def _unscale(self, group: int) -> None:
        """fp16: the host gradient unscaled once (as ``GradScaler.unscale_`` before clipping)."""
        eng = self._engine
        if eng.scaler is not None and group not in eng.unscaled:
            eng.store.grad(group).data.div_(eng.scaler.scale_tensor())
            eng.unscaled.add(group)

    def group_norms(self, group: int, norm_type: float) -> dict[str, torch.Tensor]:
        """The norm of each trainable parameter's host gradient in ``group`` that this process
        holds whole (all of them without data parallel); empty when the group holds none.

        NOTE: ``torch._foreach_norm`` over per-parameter views of the flat host gradient, as
        ``torch.nn.utils.clip_grad_norm_`` computes each parameter's norm: the same bits."""
        eng = self._engine
        store = eng.store
        v = eng.current
        if v is not None and group in v.device_groups:
            return self._device_norms(v, group, norm_type)
        if store.grad_state[group] != GRAD_VALID:
            return {}
        self._unscale(group)
        if store.sharded:
            keys, views = [], []
            grad = store.grad(group)
            lo, hi = store.shard_of(group)
            for info, o, n in _trainable(store.groups[group]):
                if lo <= o and o + n <= hi:
                    keys.append(info.key)
                    views.append(grad[o - lo : o - lo + n].view(tuple(info.shape)))
        else:
            keys = [k for k, _ in eng.param_keys_by_group.get(group, [])]
            views = [store.param_grad_view(k, group) for k in keys]
        return dict(zip(keys, torch._foreach_norm(views, norm_type))) if views else {}

    def _device_norms(self, v: Any, group: int, norm_type: float) -> dict[str, torch.Tensor]:
        """The norms of a group updated on the device (``GN g`` on the compute stream): over
        per-parameter views of its gradient in its persistent owner's gradient buffer, where it
        waits for the ``DU g`` after the gate (the same kernel over the same fp32 values as
        eager's: the same bits); empty when the group holds no gradient this step."""
        eng = self._engine
        if eng.gradients.device_state.get(group) != GRAD_VALID:
            return {}
        owner, base = eng.handlers.group_base(v, group)
        if owner not in v.train.persistent:  # (the lowering refuses it: the gradient left with the slot)
            raise RuntimeError(f"group {group} is updated on the device by streamed stage {owner}: its gradient is gone")
        grp = eng.store.groups[group]
        # (mixed precision: the 16-bit gradient widened to fp32, as the recipe's master.grad, and
        # unscaled in fp16, as GradScaler.unscale_ before clip_grad_norm_)
        scale = eng.scaler.scale_tensor() if eng.scaler is not None and grp.dtypes.mixed else None
        flat = eng.handlers.device_grad32(v, group, v.train.persistent.index(owner), scale)
        keys, views = [], []
        for info, o, n in _trainable(grp):
            keys.append(info.key)
            views.append(flat[o : o + n].view(tuple(info.shape)))
        return dict(zip(keys, torch._foreach_norm(views, norm_type))) if views else {}

    def record(self, group: int, norm_type: float | None = None) -> None:
        """``GN g``: the norms of group ``g``'s gradients, kept for the gate."""
        p = self.norm_type if norm_type is None else norm_type
        self.grad_norms[group] = (p, self.group_norms(group, p))

    # ---- NR0 ---------------------------------------------------------------------------------
    def reduce_across_ranks(self, norm_type: float | None = None) -> None:
        """``NR0``: every parameter's norm on every rank. The parameters split between ranks'
        shards are gathered whole and normed here; then one SUM all-reduce of the vector of
        per-parameter norms in ``clip_order``, each contributed by one rank."""
        eng = self._engine
        dp, store = eng.dp, eng.store
        p = self.norm_type if norm_type is None else norm_type
        valid = self._valid_groups()
        for gi in sorted(valid):  # norms not recorded yet (no GN ran: updates in step()) are computed now
            have = self.grad_norms.get(gi)
            if store.groups[gi].trainable_numel and (have is None or have[0] != p):
                self.record(gi, p)
        split = self._split_norms(dp, store, p)
        index = {gk: i for i, gk in enumerate(self.clip_order)}
        vec = torch.zeros(len(self.clip_order), dtype=torch.float32)
        # (replicated: every rank normed the same whole gradients, and so it does for a group
        # updated on the device, whose gradient every rank holds all-reduced; rank 0's count once)
        dev = self._device_groups()
        for g, (_, norms) in self.grad_norms.items():
            if dp.rank != 0 and (dp.replicated or g in dev):
                continue
            for k, v in norms.items():
                if (g, k) in index:
                    vec[index[(g, k)]] = v
        if dp.rank == 0:  # (every rank normed them: one contributes)
            for gk, v in split.items():
                if gk in index:
                    vec[index[gk]] = v
        dp.all_reduce_sum(vec, "the gradient norms' reduction NR0")
        out: dict[int, dict[str, torch.Tensor]] = {}
        for (g, k), i in index.items():
            if g in valid:
                out.setdefault(g, {})[k] = vec[i]
        self.grad_norms = {g: (p, norms) for g, norms in out.items()}

    def _device_groups(self) -> frozenset[int]:
        v = self._engine.current
        return v.device_groups if v is not None else frozenset()

    def _valid_groups(self) -> set[int]:
        """The groups holding a gradient this step: on the host (this rank's shard), or on the
        device for a group updated there."""
        eng = self._engine
        dev = self._device_groups()
        state = eng.gradients.device_state
        return {
            gi for gi in range(len(eng.store.groups))
            if (state.get(gi) == GRAD_VALID if gi in dev else eng.store.grad_state[gi] == GRAD_VALID)
        }  # fmt: skip

    def agree_finite(self, dp: Any, first_bad: int | None) -> None:
        """``NR0`` of a step whose norms it does not reduce: this rank's finite check
        (``first_bad``: its first group whose gradient shard holds inf or NaN, or None) and every
        other rank's, by one MAX all-reduce of a vector with one slot per rank; ``nonfinite``
        then holds the same verdict on every rank."""
        flags = torch.zeros(dp.ranks, dtype=torch.int64)
        flags[dp.rank] = 0 if first_bad is None else first_bad + 1
        dp.all_reduce_max(flags, "the finite checks' reduction NR0")
        self.nonfinite = [(r, int(f) - 1) for r, f in enumerate(flags.tolist()) if f]

    def agree_outcome(self, dp: Any, tokens: Any) -> None:
        """``NR0`` ending an overlapped step with rollback (the rollback pass's verdict under data
        parallel): this rank's outcome of the step's updates, copies, unscales and all-gathers
        (``tokens``, in program order, all finished: ``NR0`` waits for them whether they failed
        or not) and every other rank's, by one MAX all-reduce of a vector of 3N integers: per
        rank its first group whose gradient shard is non-finite (a ``NonFiniteGradient``: an
        inf or NaN, an fp16 overflow; 0: none, else group + 1), its first group whose update
        failed otherwise (likewise), and whether one of its all-gathers failed (the gather group
        is then broken: the step cannot be undone collectively). ``outcome`` then holds the same
        ``{"nonfinite": [(rank, group)], "failed": [(rank, group)], "lost": [rank]}`` on every rank."""
        from ..errors import NonFiniteGradient
        from .streams import root_cause

        bad = failed = None
        lost = False
        for t in tokens:
            if t.error is None:
                continue
            err = root_cause(t.error)
            label = t.label or ""
            if label.startswith("AG"):
                lost = True
            elif isinstance(err, NonFiniteGradient):
                bad = err.group if bad is None else bad
            elif failed is None:
                digits = "".join(ch for ch in label if ch.isdigit())
                failed = int(digits) if digits else 0
        n, r = dp.ranks, dp.rank
        flags = torch.zeros(3 * n, dtype=torch.int64)
        flags[r] = 0 if bad is None else bad + 1
        flags[n + r] = 0 if failed is None else failed + 1
        flags[2 * n + r] = int(lost)
        dp.all_reduce_max(flags, "the step's verdict NR0 (every rank's outcome of its updates)")
        f = flags.tolist()
        self.outcome = {
            "nonfinite": [(i, f[i] - 1) for i in range(n) if f[i]],
            "failed": [(i, f[n + i] - 1) for i in range(n) if f[n + i]],
            "lost": [i for i in range(n) if f[2 * n + i]],
        }

    def _split_norms(self, dp: Any, store: Any, p: float) -> dict[tuple[int, str], torch.Tensor]:
        """The norm of every parameter split between ranks' shards, whole: each rank sends its
        pieces of them (zero-padded to the longest rank's), all-gathered."""
        split: list[tuple[int, Any, int, int]] = []  # (group, info, offset, numel)
        dev = self._device_groups()  # (whole on every rank: normed by GN)
        for grp in store.groups:
            if not grp.trainable_numel or grp.index in dev or store.grad_state[grp.index] != GRAD_VALID:
                continue
            bounds = [dp.shard(grp, r) for r in range(dp.ranks)]
            for info, o, n in _trainable(grp):
                if not any(lo <= o and o + n <= hi for lo, hi in bounds):
                    split.append((grp.index, info, o, n))
        if not split:
            return {}

        def pieces(r: int) -> list[tuple[int, int, int, int]]:  # (split index, group, a, b) rank r holds
            out = []
            for i, (g, _, o, n) in enumerate(split):
                lo, hi = dp.shard(store.groups[g], r)
                a, b = max(o, lo), min(o + n, hi)
                if a < b:
                    out.append((i, g, a, b))
            return out

        per_rank = [pieces(r) for r in range(dp.ranks)]
        length = max(sum(b - a for _, _, a, b in pr) for pr in per_rank)
        send = torch.zeros(length, dtype=torch.float32)
        pos = 0
        for _, g, a, b in per_rank[dp.rank]:
            lo, _ = store.shard_of(g)
            send[pos : pos + b - a] = store.grad(g)[a - lo : b - lo]
            pos += b - a
        out = dp.all_gather_flat(send, "the split parameters' gradients for NR0")
        whole = [torch.empty(n, dtype=torch.float32) for _, _, _, n in split]
        for r, pr in enumerate(per_rank):
            pos = r * length
            for i, _, a, b in pr:
                o = split[i][2]
                whole[i][a - o : b - o] = out[pos : pos + b - a]
                pos += b - a
        views = [w.view(tuple(info.shape)) for w, (_, info, _, _) in zip(whole, split)]
        norms = torch._foreach_norm(views, p)
        return {(g, info.key): v for (g, info, _, _), v in zip(split, norms)}

    # ---- CK0 ---------------------------------------------------------------------------------
    def total(self, groups: list[int], norm_type: float) -> torch.Tensor:
        """The norm of every gradient of the step, as ``torch.nn.utils.clip_grad_norm_`` computes
        it over the model's parameters (per-parameter norms in the model's parameter order, then
        the norm of those); norms not recorded yet (another ``norm_type``) are computed now."""
        for gi in groups:
            have = self.grad_norms.get(gi)
            if have is None or have[0] != norm_type:
                self.record(gi, norm_type)
        # (the norms of device-updated groups were computed on the device: ``.cpu()`` is the
        # tensor itself on the emulated device)
        norms = [self.grad_norms[g][1][k].cpu() for g, k in self.clip_order if k in self.grad_norms.get(g, (0, {}))[1]]
        if not norms:
            return torch.tensor(0.0)
        return torch.linalg.vector_norm(torch.stack(norms), norm_type)

    def check(self, groups: list[int]) -> None:
        """``CK0``: the step's ``(max_norm, total)``: ``cm.clip_grad_norm_()``'s when it was
        called this step, else the compiled ``max_grad_norm``'s."""
        if self.clipped is not None:
            self.gate = self.clipped
        elif self.requested is not None:  # cm.clip_grad_norm_() under data parallel: its total, now
            self.gate = (self.requested[0], self.total(groups, self.requested[1]))
        else:
            assert self.clip is not None, "CK0 runs in a program compiled with max_grad_norm"
            self.gate = (self.clip[0], self.total(groups, self.clip[1]))

    @staticmethod
    def coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
        """``clip_grad_norm_``'s scale: ``min(max_norm / (total + 1e-6), 1)``."""
        return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def _trainable(grp: Any) -> list[tuple[Any, int, int]]:
    """``(info, offset, numel)`` of each trainable parameter of a group, in its layout."""
    infos = [i for i in grp.infos if i.kind == "param" and i.trainable]
    return [(info, o, n) for info, (o, n) in zip(infos, grp.trainable_spans())]
