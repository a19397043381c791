"""What :mod:`shfx.passes.capture` and :mod:`shfx.passes.exact` both need: the error a capture
raises and the test for the model's own source files.

Both import this module, neither the other's at import time: capture calls exact's refusals,
exact raises the capture's error. :class:`CaptureError` is public as
``shfx.passes.capture.CaptureError`` (and ``shfx.CaptureError``).
"""

from __future__ import annotations

import os

import torch

__all__ = ["CaptureError"]


class CaptureError(RuntimeError):
    """The model could not be captured as one graph; the message names the construct and a fix."""


# NOTE: its public home, as before it moved here: what reprs, tracebacks and pickles name
CaptureError.__module__ = "shfx.passes.capture"


def _is_user_file(filename: str) -> bool:
    """True for the model's code: neither torch's, nor shfx's, nor generated code."""
    return not (
        filename.startswith(os.path.dirname(torch.__file__))
        or filename.startswith(os.path.dirname(__file__))  # passes/, as capture.py's own folder
        or "site-packages/torch" in filename
        or filename.startswith("<")
    )
