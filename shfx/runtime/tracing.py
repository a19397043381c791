"""The runtime's trace of a step: one :class:`shfx.cost_model.trace.Event` per executed action.

An action's start and end are *stamps* (:meth:`shfx.runtime.backend.Backend.stamp`): host clock
readings for host work, and for work a device stream queues (CUDA, the emulated device's
CUDA-like copies) records the device takes when it gets there, so a stage's time is the time
the device spent on it, not the time its launch took. Stamps are turned into host
``perf_counter`` seconds when the trace is read (which waits for the device to reach them):
recording costs no host synchronization.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from shfx.cost_model.trace import Event

__all__ = ["StepTrace"]


class StepTrace:
    """A list of :class:`Event` whose times resolve when read (see the module docstring)."""

    def __init__(self, backend: Any):
        self._backend = backend
        self._events: list[Any] = []  # Event, or (label, phase, stream, start stamp, end stamp, bytes)
        self._lock = threading.Lock()

    def record(self, label: str, phase: str, stream: str, start: Any, end: Any, nbytes: int) -> None:
        with self._lock:
            self._events.append((label, phase, stream, start, end, nbytes))

    def append(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)

    def clear(self) -> None:
        with self._lock:
            self._events.clear()

    def _resolved(self) -> list[Event]:
        with self._lock:
            raw = list(enumerate(self._events))
        pending = [(i, e) for i, e in raw if not isinstance(e, Event)]
        if pending:
            stamps = [s for _, e in pending for s in (e[3], e[4])]
            times = self._backend.stamp_times(stamps)
            with self._lock:
                for k, (i, e) in enumerate(pending):
                    if i < len(self._events) and self._events[i] is e:
                        self._events[i] = Event(e[0], e[1], e[2], times[2 * k], times[2 * k + 1], e[5])
                return list(self._events)
        return [e for _, e in raw]

    def __iter__(self) -> Iterator[Event]:
        return iter(self._resolved())

    def __len__(self) -> int:
        return len(self._events)

    def __bool__(self) -> bool:
        return bool(self._events)

    def __getitem__(self, i: Any) -> Any:
        return self._resolved()[i]

    def __setitem__(self, i: Any, value: Any) -> None:
        events = self._resolved()
        events[i] = value
        with self._lock:
            self._events = list(events)

    def __repr__(self) -> str:
        return f"StepTrace({self._resolved()!r})"

