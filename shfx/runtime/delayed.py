"""ZeRO-Offload's delayed parameter update (``shfx.ZeroOffload(delayed_update=True)``).

``step()`` starts the host update of every group and returns; the updates run during the next
forward and backward, which train on the weights before them. The next ``step()`` waits for
them and refreshes the persistent slots with the weights they wrote; a gradient copy of the next
step waits for the update that reads the same host gradient buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..errors import ActionError
from .streams import Token

__all__ = ["DelayedUpdates"]


class DelayedUpdates:
    """The host updates of the last ``step()``, still running: group -> its token (what a
    prefetch of the group waits for: its update, or under data parallel the all-gather after
    it); ``others``: the other actions started with them (SSD reads and write-backs), waited
    for with them."""

    def __init__(self) -> None:
        self.running: dict[int, Token] = {}
        self.others: list[Token] = []

    def __bool__(self) -> bool:
        return bool(self.running) or bool(self.others)

    def start(self, groups: Iterable[int], submit: Callable[[int], Token]) -> None:
        """Start the update of each group (``submit(group)`` issues it)."""
        for g in groups:
            self.running[g] = submit(g)

    def deps_for(self, groups: Iterable[int]) -> list[Token]:
        """The updates a gradient copy into ``groups`` must wait for (they read the buffer)."""
        return [t for g, t in self.running.items() if g in set(groups)]

    def wait(self) -> None:
        """Wait for every update to reach the host weights; then raise the first failure (they
        stay recorded: a later :meth:`finish` raises it too). Every update has finished when
        this raises: the caller may undo them."""
        for tok in self.running.values():
            tok.wait()
        for g, tok in self.running.items():
            if tok.error is not None:
                raise _failed(g, tok)

    def finish(self) -> bool:
        """Wait for every update and forget them; returns whether any ran. Raises the first
        failure."""
        if not self.running:
            return False
        pending, self.running = self.running, {}
        for tok in pending.values():
            tok.wait()
        for g, tok in pending.items():
            if tok.error is not None:
                raise _failed(g, tok)
        return True

    def clear(self) -> None:
        self.running.clear()
        self.others.clear()


def _failed(group: int, tok: Token) -> ActionError:
    err = tok.error
    e = ActionError(f"host optimizer update U{group} (delayed) failed: {type(err).__name__}: {err}", f"U{group}")
    e.__cause__ = err
    return e
