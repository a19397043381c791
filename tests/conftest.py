from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_state():
    """Every test starts from the same global RNG state and frees compiled models after."""
    torch.manual_seed(0)
    yield
    gc.collect()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
