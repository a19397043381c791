"""The examples in the docstrings of shfx.passes, shfx.cost_model, shfx.api (compile, retune),
shfx.config and shfx.profiler run and give what they say (the golden action strings of every policy among
them)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import shfx.cost_model
import shfx.passes

MODULES = sorted(
    m.name for pkg in (shfx.passes, shfx.cost_model) for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")
) + ["shfx.api", "shfx.config", "shfx.profiler"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(name)
    result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS, report=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples of {name} failed (run doctest on it)"
