"""The state of one forward call, kept until its backward, and the device memory it holds.

A :class:`StepContext` holds the boundary activations (device tensors), their gradients, the
RNG states of the stages, the pre-forward copies of mutated buffers, the saved autograd graphs
and the tokens of issued actions. Every device tensor it keeps is reserved on the backend under
its memory-ledger term (:mod:`shfx.passes.ledger`), with the same name the ledger gives it, so
``tests/test_ledger.py`` can check the runtime against the ledger action by action.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from shfx.passes.actions import AO, B
from shfx.passes.meta import get_meta
from shfx.passes.pipeline import Variant

from .backend import Backend
from .streams import Token

if TYPE_CHECKING:
    from .protocols import ContextEngine

__all__ = ["StepContext", "fork_rng"]

ACTIVATIONS = "activations (checkpoints)"
ACTIVATION_GRADS = "activation gradients"
PENDING = "pending tied gradient"


class StepContext:
    """State of one forward call, kept until its backward (see the module docstring)."""

    _ids = 0

    def __init__(self, engine: ContextEngine, variant: Variant, grad: bool):
        StepContext._ids += 1
        self.id = StepContext._ids
        self.engine = engine
        self.variant = variant
        self.grad = grad
        self.values: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.rng: dict[int, Any] = {}
        self.pre_buffers: dict[int, list[torch.Tensor]] = {}
        self.saved: dict[int, tuple] = {}
        self.checkpointed: dict[int, tuple] = {}  # stage -> (outputs, param/buffer/input leaves)
        # activation offload (AO/AF): value -> its host copy while it is off the device, and the
        # stash the host buffers go back to (shfx.runtime.activations)
        self.host_values: dict[str, torch.Tensor] = {}
        self.stash: Any = None
        self.act_window: Any = None  # (activations on the SSD: the window whose buffers it may hold)
        self.grad_src: dict[int, str] = {}  # stage -> where its backward wrote param grads ("slot"/"buffer")
        self.dev_pending: dict[str, torch.Tensor] = {}  # borrowed param -> its grad, for a device-updated owner
        self.no_grads: set[int] = set()
        self.env: dict[fx.Node, Token] = {}
        self.accumulation: Any = None  # the gradient router's state for this backward
        self.hot = False  # holds slots from its forward for the start of its backward
        self.backward_done = False
        # what this context holds on the device: ledger name -> (term, bytes)
        self._held: dict[str, tuple[str, int]] = {}
        # A forward whose backward never runs (the loss was dropped) frees its device
        # accounting when the context is garbage: the finalizer holds the byte record, not self.
        weakref.finalize(self, _release, engine.backend, self._held)
        g = variant.graph
        # forward refcounts (eval: free a value once every consumer's forward ran)
        self.fwd_left = {v: len(info.consumers) for v, info in g.values.items()}
        # the stages the train program runs a backward of (a frozen bottom runs none)
        self.backward_stages = frozenset(get_meta(n).stage for n in variant.train.nodes if get_meta(n).kind == B)
        # the stages whose activations the train program offloads: their forward keeps nothing
        # but its inputs (no graph, no checkpoint), so the device copy is really freed
        self.offloaded = frozenset(get_meta(n).stage for n in variant.train.nodes if get_meta(n).kind == AO)
        # backward: a value is last needed by the backward of its earliest consumer that runs one
        # (freed in the ledger's order: the stages' outputs, stage by stage, then the model's
        # inputs); a value no backward reads is freed once its last consumer's forward ran
        self.free_after_b: dict[int, list[str]] = {}
        self.forward_only: set[str] = set()
        for v in [v for st in g.stages for v in st.outputs] + list(g.inputs):
            info = g.values[v]
            if info.consumers and v not in g.outputs:
                readers = [c for c in info.consumers if c in self.backward_stages]
                if readers:
                    self.free_after_b.setdefault(min(readers), []).append(v)
                else:
                    self.forward_only.add(v)

    # ---- device memory, under the ledger's terms and names ------------------------------------
    def _hold(self, name: str, term: str, nbytes: int, detail: str = "") -> None:
        old = self._held.pop(name, None)
        if old is not None and old[1]:
            self.engine.backend.unreserve(old[1], name, old[0])
        self.engine.backend.reserve(nbytes, name + detail, term=term, key=name)
        self._held[name] = (term, nbytes)

    def _let_go(self, name: str) -> None:
        got = self._held.pop(name, None)
        if got is not None and got[1]:
            self.engine.backend.unreserve(got[1], name, got[0])

    def put(self, name: str, t: torch.Tensor) -> None:
        """Keep boundary value ``name`` on the device."""
        self._hold(f"activation {name!r}", ACTIVATIONS, t.numel() * t.element_size(), f" ({list(t.shape)})")
        self.values[name] = t

    def drop(self, name: str) -> None:
        self.values.pop(name, None)
        self._let_go(f"activation {name!r}")


    def add_grad(self, name: str, g: torch.Tensor) -> None:
        """Add a gradient contribution for ``name`` (the first one is reserved)."""
        cur = self.grads.get(name)
        if cur is None:
            self._hold(f"gradient of {name!r}", ACTIVATION_GRADS, g.numel() * g.element_size())
            self.grads[name] = g
        else:
            self.grads[name] = cur + g

    def replace_grad(self, name: str, g: torch.Tensor) -> None:
        """Replace the gradient held for ``name`` by ``g``, a sum that already includes it
        (same shape and dtype: the reservation stands)."""
        if name not in self.grads:
            raise KeyError(f"replace_grad: no gradient of {name!r} is held; add it with add_grad")
        self.grads[name] = g

    def drop_grad(self, name: str) -> None:
        self.grads.pop(name, None)
        self._let_go(f"gradient of {name!r}")

    def keep_pre_buffers(self, stage: int, tensors: list[torch.Tensor]) -> None:
        """Copies of the buffers stage ``stage``'s forward mutates, for its recompute."""
        self.pre_buffers[stage] = tensors
        self._hold(f"pre-forward buffers of stage {stage}", ACTIVATIONS, sum(t.numel() * t.element_size() for t in tensors))

    def drop_pre_buffers(self, stage: int) -> None:
        self.pre_buffers.pop(stage, None)
        self._let_go(f"pre-forward buffers of stage {stage}")

    def keep_pending(self, key: str, grad: torch.Tensor) -> None:
        """A borrowed tensor's gradient waiting on the device for its owner's backward."""
        self.dev_pending[key] = grad
        self._hold(f"pending gradient of {key!r}", PENDING, grad.numel() * grad.element_size())

    def take_pending(self, key: str) -> torch.Tensor | None:
        pend = self.dev_pending.pop(key, None)
        if pend is not None:
            self._let_go(f"pending gradient of {key!r}")
        return pend

    def release_all(self) -> None:
        """Free every device tensor this context still holds."""
        self.values.clear()
        self.grads.clear()
        self.pre_buffers.clear()
        self.saved.clear()
        self.checkpointed.clear()
        self.dev_pending.clear()
        if self.host_values and self.stash is not None:  # (offloaded values no backward fetched)
            self.stash.give_back(list(self.host_values.values()))
        self.host_values.clear()
        if self.act_window is not None:  # (window buffers an AO or AR filled and nothing emptied)
            self.act_window.release(self)
        _release(self.engine.backend, self._held)


def _release(backend: Backend, held: dict[str, tuple[str, int]]) -> None:
    for name, (term, n) in list(held.items()):
        if n:
            backend.unreserve(n, name, term)
    held.clear()


@contextlib.contextmanager
def fork_rng(backend: Backend, state: Any) -> Iterator[None]:
    """Run with the backend's generator set to ``state`` (a stage's forward RNG state), then
    restore it: a recompute replays the forward's dropout masks and leaves the RNG as it was."""
    if state is None:
        yield
        return
    cur = backend.get_rng_state()
    backend.set_rng_state(state)
    try:
        yield
    finally:
        backend.set_rng_state(cur)
