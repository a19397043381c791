from __future__ import annotations

import gc
import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_state():
    """Every test starts from the same global RNG state and frees compiled models after."""
    torch.manual_seed(0)
    yield
    gc.collect()


def pytest_collection_modifyitems(config, items):
    # long tests (whole matrices whose fast subset runs by default) run with SHFX_SLOW=1 or -m slow
    if not os.environ.get("SHFX_SLOW") and "slow" not in (config.getoption("-m") or ""):
        slow = pytest.mark.skip(reason="slow: run with SHFX_SLOW=1 (or -m slow)")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
