"""What the step context and the gradient router use of the engine, as typing protocols.

:class:`~shfx.runtime.engine.Engine` makes a :class:`~shfx.runtime.context.StepContext` for
each forward call and one :class:`~shfx.runtime.gradients.GradientRouter`, and each keeps the
engine it was made by. They are annotated with these protocols rather than with ``Engine``, so
neither module imports the engine module (the engine imports both: the imports run one way).
Type hints only: nothing here runs, and ``Engine`` fits both as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from shfx.passes.pipeline import Variant

    from .backend import Backend
    from .data_parallel import DataParallelRuntime
    from .host_store import HostStore
    from .slots import SlotPool
    from .streams import Token

__all__ = ["ContextEngine", "GradientEngine"]


class ContextEngine(Protocol):
    """What a :class:`~shfx.runtime.context.StepContext` uses of its engine: the backend it
    reserves (and frees) its device tensors on."""

    backend: Backend


class GradientEngine(Protocol):
    """What the :class:`~shfx.runtime.gradients.GradientRouter` uses of its engine."""

    backend: Backend
    store: HostStore
    pool: SlotPool | None  # the slot pool (None until the first program is laid out)
    dp: DataParallelRuntime | None  # data parallel's runtime, None in one process
    pending_updates: list[tuple[str, Token]]  # the host updates issued and not yet waited for
    current: Variant | None  # the variant of the last forward

    def wait_delayed(self) -> None:
        """Wait for the delayed updates (ZeRO-Offload's) to reach the host weights."""
        ...
