"""A layer applied several times (ALBERT): every application after the first borrows all of the
layer's tensors, one gradient copy each; trains like eager (it hung before: each copy took a
staging buffer of the pool's two, and the third waited for the OG that held them)."""

from __future__ import annotations

import pytest
import torch
from equivalence import assert_trains_like_eager
from faults import run_with_deadline
from mixed_reference import train_mixed_eager
from mixed_shfx import train_mixed_shfx
from zoo import SharedLayer, vector_batch


def _borrowing(cm) -> list:
    return [st for st in cm.stages.stages if any(c.group != st.spec.update_group for c in st.slot.grads)]


@pytest.mark.parametrize("window", [1, 2])
def test_a_shared_layer_trains_like_eager(window):
    _, _, cm, _, _ = run_with_deadline(
        lambda: assert_trains_like_eager(lambda: SharedLayer(), vector_batch, window=window, blocks="mix"), 120,
        "a gradient copy waits for a staging buffer it holds",
    )
    try:
        # the layer's later applications are stages of their own, each sending the layer's tensors back
        b = _borrowing(cm)
        assert len(b) >= 2 and max(len(st.slot.grads) for st in b) >= 3
    finally:
        cm.close()


def test_a_shared_layer_accumulates_like_eager():
    _, _, cm, _, _ = assert_trains_like_eager(lambda: SharedLayer(), vector_batch, window=2, accum=3, blocks="mix")
    cm.close()


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_shared_layer_trains_like_the_bf16_recipe(grad_accum):
    ref = train_mixed_eager(lambda: SharedLayer(), vector_batch, "bf16", 3, grad_accum=grad_accum)
    got = train_mixed_shfx(lambda: SharedLayer(), vector_batch, "bf16", 3, window=2, grad_accum=grad_accum, blocks="mix")
    try:
        assert got["loss_bits"] == ref["loss_bits"], (got["losses"], ref["losses"])
        for k, v in ref["master"].items():
            assert torch.equal(got["master"][k], v), k
        assert len(_borrowing(got["cm"])) >= 2
    finally:
        got["cm"].close()
