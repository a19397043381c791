"""Graph passes of shfx: capture, partition, schedule policies (one rewrite pass each),
lowering and verification of step programs.

Pure functions: graph in, graph out, metadata in ``node.meta["shfx"]``. This package never
imports the runtime.
"""

from .program import Action, ActionKind, ActionMeta, Program, ScheduleError, lower_actions
from .stages import StageSpec, chain

__all__ = [
    "Action",
    "ActionKind",
    "ActionMeta",
    "Program",
    "ScheduleError",
    "StageSpec",
    "chain",
    "lower_actions",
]
