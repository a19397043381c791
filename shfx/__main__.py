"""``python -m shfx <command>``: the same as the ``shfx`` console script.

>>> import subprocess, sys
>>> subprocess.run([sys.executable, "-m", "shfx", "--help"], capture_output=True).returncode  # doctest: +SKIP
0
"""

from __future__ import annotations

import sys

from .cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
