"""Fault injection: make the n-th action of a kind fail, to check what a failed step leaves.

:class:`FaultInjector` wraps a backend's ``during`` (every action task enters it with its
label, ``"PF3"``, ``"B0"``, ``"OG2"``, ``"U1"``, ``"DU0"``, before doing anything) and raises
the given exception at the ``n``-th action of ``kind`` (or calls ``action(event)`` instead,
to corrupt a value or sleep there); with ``n=None`` it only counts.
"""

from __future__ import annotations

import re
import threading

KINDS = ("PF", "F", "B", "OG", "U", "DU")


class InjectedFault(RuntimeError):
    """The exception a fault raises by default."""


class FaultInjector:
    def __init__(self, backend, kind: str, n: int | None, exc: type[BaseException] = InjectedFault, action=None):
        self.backend = backend
        self.action = action
        self.kind = kind
        self.n = n
        self.exc = exc
        self.count = 0
        self.fired: str | None = None
        # a kind ("U"), or one action ("U0")
        self._pattern = re.compile(rf"{kind}$" if kind[-1:].isdigit() else rf"{kind}\d+$")
        self._lock = threading.Lock()

    def __enter__(self) -> FaultInjector:
        orig = self.backend.during

        def during(event: str):
            if self._pattern.match(event):
                with self._lock:
                    self.count += 1
                    hit = self.count == self.n
                if hit:
                    self.fired = event
                    if self.action is not None:
                        self.action(event)
                    else:
                        raise self.exc(f"injected fault in {event}")
            return orig(event)

        self.backend.during = during
        return self

    def __exit__(self, *exc) -> None:
        del self.backend.during  # the class's method again


def count_actions(backend, run) -> dict[str, int]:
    """How many actions of each kind ``run()`` issues."""
    counts = dict.fromkeys(KINDS, 0)
    orig = backend.during
    lock = threading.Lock()

    def during(event: str):
        m = re.match(r"([A-Z]+)\d+$", event)
        if m and m.group(1) in counts:
            with lock:
                counts[m.group(1)] += 1
        return orig(event)

    backend.during = during
    try:
        run()
    finally:
        del backend.during
    return counts


def run_with_deadline(fn, seconds: float = 60, why: str = ""):
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it does not return."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"hung for {seconds}s" + (f": {why}" if why else "")
    if "error" in result:
        raise result["error"]
    return result.get("value")


def fail_nth_ssd_read(monkeypatch, n: int = 2) -> list[int]:
    """Make the ``n``-th read of any SSD store fail with an I/O error (``OSError(EIO)``), as a
    disk would; the offsets read so far are returned (``monkeypatch.undo()`` heals it)."""
    from shfx.runtime import ssd as ssd_mod

    real, calls = ssd_mod._read_full, []

    def broken(fd, buf, offset):
        calls.append(offset)
        if len(calls) == n:
            raise OSError(5, "Input/output error")
        return real(fd, buf, offset)

    monkeypatch.setattr(ssd_mod, "_read_full", broken)
    return calls
