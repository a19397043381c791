"""Step traces: one event type for the simulator's timeline and the runtime's measured trace.

An :class:`Event` is one action of a step program: what it is (``action``, ``phase``,
``stream``), when it ran (``start``, ``end``) and, for an OFFLOAD_GRAD, when its two parts ran
(the copy on ``d2h`` until ``copy_end``, the accumulation on the ``host`` FIFO from
``host_start`` to ``end``). :func:`shfx.cost_model.simulate.simulate` puts one per node on its
:class:`~shfx.cost_model.simulate.Timeline` (seconds from the step start, ``node`` and ``deps``
filled in); the runtime's interpreter appends one per executed action to ``engine.trace``
(host ``time.perf_counter()`` seconds, in completion order, ``node`` None and ``deps`` empty:
it does not know them when it records). The runtime traces an OFFLOAD_GRAD's copy only: its
event has no ``copy_end`` and ends when the copy ends (its ``reads_end``, what a RELEASE waits
for); the accumulation on the host FIFO is not traced.
"""

from __future__ import annotations

from dataclasses import dataclass

from shfx.passes.program import ActionKind

__all__ = ["Event"]


@dataclass(frozen=True)
class Event:
    """One action of a step, simulated or measured.

    Attributes:
        action: the action string, e.g. ``"PF3"``.
        phase: ``"forward"`` or ``"backward"``.
        stream: ``"compute"``, ``"h2d"``, ``"d2h"``, ``"cpu"`` or ``"none"`` (an OFFLOAD_GRAD
            is on ``"d2h"``; its accumulation part runs on the ``"host"`` FIFO).
        start: when the action started: seconds from the start of the step (simulated, or a
            view of a measured step), or host ``perf_counter`` seconds (the runtime's trace).
        end: when the action is done (for OG: its accumulation on the host FIFO ended).
        bytes: bytes the action moves over the link.
        copy_end: OG only: the end of its d2h copy (when a RELEASE stops waiting for it).
            None for a measured OG whose accumulation was not traced: ``end`` is the copy's.
        host_start: OG only: when its accumulation started on the host FIFO.
        worker: CPU_STEP only: the host optimizer worker that ran it (None when not known).
        node: the FX node's name (unique in the program); None in the runtime's trace.
        deps: the node names it waited for; empty in the runtime's trace.
    """

    action: str
    phase: str
    stream: str
    start: float
    end: float
    bytes: int = 0
    copy_end: float | None = None
    host_start: float | None = None
    worker: int | None = None
    node: str | None = None
    deps: tuple[str, ...] = ()

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def reads_end(self) -> float:
        """When the action stopped reading its slot (what a RELEASE waits for)."""
        return self.copy_end if self.copy_end is not None else self.end

    @property
    def kind(self) -> ActionKind:
        return ActionKind(self.action.rstrip("0123456789"))
