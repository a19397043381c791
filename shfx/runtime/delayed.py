"""ZeRO-Offload's delayed parameter update (``shfx.ZeroOffload(delayed_update=True)``).

``step()`` starts the host update of every group and returns; the updates run during the next
forward and backward, which train on the weights before them. The next ``step()`` waits for
them and refreshes the persistent slots with the weights they wrote; a gradient copy of the next
step waits for the update that reads the same host gradient buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..errors import ActionError
from .streams import DependencyFailed, Token, root_cause

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
        """Wait for every update (and the actions started with them) to reach the host weights;
        then raise the first failure (they stay recorded: a later :meth:`finish` raises it
        too). Every update has finished when this raises: the caller may undo them."""
        for tok in [*self.running.values(), *self.others]:
            tok.wait()
        _raise_first(self.running, self.others)

    def finish(self) -> bool:
        """Wait for every update and the actions started with them, and forget them; returns
        whether any ran. Raises the first failure."""
        if not self.running and not self.others:
            return False
        pending, others = self.running, self.others
        self.running, self.others = {}, []
        for tok in [*pending.values(), *others]:
            tok.wait()
        _raise_first(pending, others)
        return bool(pending)

    def clear(self) -> None:
        self.running.clear()
        self.others.clear()


def _raise_first(running: dict[int, Token], others: list[Token]) -> None:
    """Raise the first failure that is not another's (an update after its failed SSD read)."""
    failed = [(f"U{g}", t) for g, t in running.items() if t.error is not None]
    failed += [(t.label or "?", t) for t in others if t.error is not None]
    if not failed:
        return
    label, tok = next(((lb, t) for lb, t in failed if not isinstance(t.error, DependencyFailed)), failed[0])
    raise _failed(label, tok)


def _failed(label: str, tok: Token) -> ActionError:
    err = root_cause(tok.error)
    what = {"SR": "SSD read of optimizer states", "SW": "SSD write of optimizer states", "SN": "rollback copy",
            "US": "unscale of the fp16 gradient"}.get(label[:2], "host optimizer update")  # fmt: skip
    e = ActionError(f"{what} {label} (delayed) failed: {type(err).__name__}: {err}", label)
    e.__cause__ = err
    return e
