"""What one engine holds where: the slot pool, the persistent stages and the host memory count.

:class:`Residency` is the device-residency side of :class:`~shfx.runtime.engine.Engine`: it
sizes the slot pool (:meth:`Residency.ensure_pool`), gives up the stages a pending forward keeps
resident (:meth:`Residency.evict`), loads a variant's persistent stages
(:meth:`Residency.ensure_persistent`) and copies the weights updated on the device back to the
host store (:meth:`Residency.sync_to_host`), swaps a retuned variant in between steps
(:meth:`Residency.replace_variant`), forgets the device weights when the host's change
(:meth:`Residency.invalidate_device_weights`), and counts the host memory the runtime holds
(:meth:`Residency.host_bytes`). The state stays the engine's (``pool``, ``loaded``, ``dirty``,
``holder``): the interpreter and the step read it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shfx.passes.pipeline import Variant

from ..errors import UsageError
from .slots import SlotPool

__all__ = ["Residency"]


class Residency:
    """The slot pool, the persistent stages and the host memory count of one engine.

    What it uses of the engine (:class:`~shfx.runtime.engine.Engine`): ``backend``, ``store``,
    ``pool`` (made here), ``loaded``, ``dirty``, ``holder``, ``current``, ``pending_updates``,
    ``optimizer``, ``device_optimizer``, ``gradients``, ``journal``, ``ssd``, ``dp``, ``delayed``,
    ``handlers`` (its ``prefetch`` and ``offload_params`` tasks), ``steps`` (``finish_delayed``),
    and its methods ``await_deferred`` and ``wait_delayed``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def ensure_pool(self, sizes: list[int], grad_sizes: Sequence[int] = ()) -> None:
        """Make slot ``k`` hold at least ``sizes[k]`` bytes, and its gradient buffer
        ``grad_sizes[k]`` (for backwards that write gradients beside the parameters)."""
        eng = self.engine
        if eng.pool is None:
            eng.pool = SlotPool(eng.backend, sizes)
        elif len(sizes) > eng.pool.num_slots or any(n > m for n, m in zip(sizes, eng.pool.sizes)):
            self.evict()
            if eng.loaded is not None and eng.loaded.train.persistent:
                self.sync_to_host()
                eng.loaded = None  # persistent stages reload into the new slots
            eng.pool.resize(sizes)
        eng.gradients.ensure_buffers(grad_sizes)

    def evict(self) -> None:
        """The resident stages of a pending forward are given up: its backward will prefetch
        them again (the cold variant) and recompute instead of using kept graphs."""
        eng = self.engine
        if eng.holder is not None:
            h = eng.holder
            h.hot = False
            for k in list(h.saved):
                h.saved.pop(k)
            eng.holder = None

    def sync_to_host(self) -> None:
        """Copy the weights updated on the device (persistent stages) back to the host store;
        in mixed precision also the fp32 masters the device updated (every device group, a
        streamed L2L stage's too), into the host masters the model's parameters are."""
        eng = self.engine
        v = eng.loaded
        dev = eng.device_optimizer
        toks = []
        if dev is not None and dev.dirty:
            toks.append(eng.backend.d2h.submit(dev.sync_masters))
        for g in sorted(eng.dirty) if v is not None else ():
            st = v.graph.stages[v.owner_of[g]]
            slot = v.train.persistent.index(st.index)
            toks.append(eng.backend.d2h.submit(lambda st=st, slot=slot: eng.handlers.offload_params(st, slot)))
        for t in toks:
            t.wait()
        errors = [t.error for t in toks if t.error is not None]
        if errors:
            raise errors[0]

    def ensure_persistent(self, variant: Variant) -> None:
        """Load the variant's persistent stages into their slots (once; again after another
        variant or new weights took them)."""
        eng = self.engine
        if eng.loaded is variant:
            return
        eng.await_deferred()
        eng.steps.finish_delayed(refresh=False)  # the host weights must be final before loading them
        self.sync_to_host()
        eng.loaded = None
        toks = [
            eng.backend.h2d.submit(lambda st=variant.graph.stages[s], k=k: eng.handlers.prefetch(st, k))
            for k, s in enumerate(variant.train.persistent)
        ]
        for t in toks:
            t.wait()
        errors = [t.error for t in toks if t.error is not None]
        if errors:
            raise errors[0]
        eng.loaded = variant

    def replace_variant(self, old: Variant, new: Variant) -> None:
        """``new`` takes ``old``'s place between steps (a retune rebuilt its programs): weights
        updated on the device go back to the host and the persistent stages reload at the next
        forward, the optimizer states of groups that change sides (host <-> device) move with
        them, and the slot pool takes ``new``'s sizes (another signature's grow it back)."""
        eng = self.engine
        if eng.pending_updates or eng.holder is not None:
            raise UsageError("the programs can only change between steps; finish the step (backward, cm.step()) first")
        eng.await_deferred()
        eng.steps.finish_delayed(refresh=False)
        self.sync_to_host()
        eng.loaded = None
        if eng.current is old:
            eng.current = new
        if eng.optimizer is not None and eng.device_optimizer is not None:
            for g in sorted(old.device_groups - new.device_groups):
                st = eng.device_optimizer.take(g)
                if st is not None:
                    eng.optimizer.put(g, *st)
            for g in sorted(new.device_groups - old.device_groups):
                st = eng.optimizer.take(g)
                if st is not None:
                    eng.device_optimizer.put(eng.store.groups[g], *st)
        for g in old.device_groups ^ new.device_groups:
            eng.gradients.device_state.pop(g, None)
        if eng.pool is not None:
            eng.pool.set_sizes(list(new.slot_sizes))

    def invalidate_device_weights(self) -> None:
        """The host weights changed (load_state_dict): persistent stages reload before the next step."""
        eng = self.engine
        eng.await_deferred()
        eng.wait_delayed()
        eng.delayed.clear()
        eng.dirty.clear()
        if eng.device_optimizer is not None:  # (mixed precision: the device masters are read again)
            eng.device_optimizer.invalidate_masters()
        eng.loaded = None

    def host_bytes(self) -> int:
        """Host memory the runtime holds: the host store (weights, gradients), the host
        optimizer's states, the staging buffers, the buffers borrowed gradients wait in, the host
        buffers of offloaded activations (or their window, on the way to the SSD) and, under data parallel, the local-gradient and
        collective buffers."""
        eng = self.engine
        states = 0
        if eng.optimizer is not None:
            states = sum(
                t.numel() * t.element_size()
                for g, st in list(eng.optimizer.state.items())
                if eng.ssd is None or g not in eng.ssd.groups  # (staged: views of the window's buffers)
                for t in st.tensors()
                if t.dim()  # not the 0-dim step counters (the memory ledger does not count them)
            )
        if eng.ssd is not None:
            states += eng.ssd.host_bytes
        return (
            eng.store.host_bytes + states + eng.store.staging_bytes + eng.gradients.pending_host_bytes
            + eng.journal.host_bytes + (eng.dp.buffer_bytes if eng.dp is not None else 0)
            + eng.activation_stash.allocated_bytes
            + (eng.activation_window.host_bytes if eng.activation_window is not None else 0)
        )  # fmt: skip
