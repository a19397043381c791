"""Errors shfx raises for things a user can cause. Each message says what was needed, what
was available, and what to change."""

from __future__ import annotations

from shfx.passes.capture import CaptureError
from shfx.passes.partition import PartitionError
from shfx.passes.program import ScheduleError
from shfx.passes.verify import VerificationError

__all__ = [
    "ShfxError",
    "CaptureError",
    "PartitionError",
    "ScheduleError",
    "VerificationError",
    "OutOfDeviceMemory",
    "ActionError",
    "UsageError",
    "ConfigConflict",
    "NonFiniteGradient",
    "SSDSpaceError",
    "SSDIOError",
]


class ShfxError(RuntimeError):
    """Base class of shfx's own runtime errors."""


class OutOfDeviceMemory(ShfxError, MemoryError):
    """The device budget is too small for what the schedule needs.

    Attributes: ``needed_bytes`` (the allocation that failed), ``used_bytes`` and
    ``capacity_bytes`` at the time, ``what`` (what was being allocated).
    """

    def __init__(self, message: str, *, needed_bytes: int = 0, used_bytes: int = 0, capacity_bytes: int = 0, what: str = ""):
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.used_bytes = used_bytes
        self.capacity_bytes = capacity_bytes
        self.what = what


class ActionError(ShfxError):
    """An action of the step program failed; the message names it and shows the program
    with the failing step marked. ``.action`` is its string form, ``.__cause__`` the error."""

    def __init__(self, message: str, action: str = ""):
        super().__init__(message)
        self.action = action


class UsageError(ShfxError):
    """The compiled model was used in an order shfx cannot honour (e.g. a forward while the
    previous step's update is still pending)."""


class ConfigConflict(UsageError, ValueError):
    """Two of ``shfx.compile``'s options that cannot hold together (a row of
    :data:`shfx.config.CONFLICTS`); the message gives its reason and fix, ``.conflict`` is the
    row. A ``ValueError`` too, as the argument errors these checks once were."""

    def __init__(self, message: str, conflict: object = None):
        super().__init__(message)
        self.conflict = conflict


class NonFiniteGradient(ShfxError):
    """A group's gradient holds inf or NaN (raised inside its update with
    ``skip_nonfinite=True``; the step is then skipped, not applied anywhere). ``.group`` is the
    parameter group."""

    def __init__(self, message: str, group: int = -1):
        super().__init__(message)
        self.group = group


class SSDSpaceError(ShfxError, OSError):
    """The SSD store's disk has too little free space (checked before anything is allocated,
    and again when the preallocation itself fails). ``path``, ``needed_bytes`` and
    ``available_bytes`` say where and how much."""

    def __init__(self, message: str, *, path: str = "", needed_bytes: int = 0, available_bytes: int = 0):
        super().__init__(message)
        self.path = path
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


class SSDIOError(ShfxError):
    """A read or write of the SSD store failed; raised by the request's ``wait()``. ``key`` is
    the extent's key, ``offset`` the file offset of the failed chunk, ``path`` the file; the
    operating system's error is ``__cause__``."""

    def __init__(self, message: str, *, key: object = None, offset: int = -1, path: str = ""):
        super().__init__(message)
        self.key = key
        self.offset = offset
        self.path = path
