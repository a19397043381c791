"""shfx installs one top-level package: passes/ and cost_model/ are shfx.passes and shfx.cost_model."""

from __future__ import annotations

import subprocess
import sys


def test_no_generic_top_level_packages():
    """Importing everything shfx ships loads no top-level ``passes`` or ``cost_model`` (they
    would be second copies of the same modules, with their own classes)."""
    code = (
        "import sys, pkgutil, importlib, shfx, shfx.passes, shfx.cost_model\n"
        "for pkg in (shfx, shfx.passes, shfx.cost_model):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('passes', 'cost_model'))\n"
        "print(bad)\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
