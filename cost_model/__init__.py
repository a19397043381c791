"""Cost model of shfx: per-stage costs, simulation of step programs, window tuning.

This package reads step programs (``passes``) and never imports the runtime.
"""
