from __future__ import annotations

import gc
import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_state():
    """Every test starts from the same global RNG state (and frees its garbage after: below)."""
    torch.manual_seed(0)
    yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After each test (its fixtures torn down and its arguments dropped), collect its garbage:
    compiled models dropped without close() stop their threads and free their device.

    What survives is then frozen (``gc.freeze``): torch, the modules imported, the module's
    fixtures. The next test's collection walks only what that test made; a collection of the
    whole heap after every test took 0.2-0.5 s on 2 cores, a fifth of the suite's time. The whole
    heap is collected again at each module's end, where that module's fixtures are dropped."""
    try:
        return (yield)
    finally:
        if nextitem is None or nextitem.path != item.path:
            gc.unfreeze()
        gc.collect()
        gc.freeze()


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
