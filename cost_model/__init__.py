"""Cost model of shfx: per-stage costs, simulation of step programs, window tuning.

This package reads step programs (``passes``) and never imports the runtime.
"""

from .simulate import Event, SimulationError, Timeline, simulate

__all__ = ["Event", "SimulationError", "Timeline", "simulate"]
