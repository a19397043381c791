"""The partition pass: block detection, byte-balanced fallback, tied weights, pure stages."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from zoo import BNNet, SkipCNN, gpt_mask, gpt_tied, image_batch, token_batch, vector_batch

from shfx.passes.capture import capture_model
from shfx.passes.partition import PartitionError, find_blocks, partition_stages


def stages_of(model, args, **kw):
    return partition_stages(capture_model(model, args), model=model, **kw)


def test_blocks_detected_in_gpt():
    model = gpt_tied()
    assert find_blocks(model) == "transformer.h"
    g = stages_of(model, token_batch(0)[0])
    assert [s.name for s in g.stages] == ["head", "transformer.h.0", "transformer.h.1", "transformer.h.2", "tail"]
    assert g.method == "blocks:transformer.h"
    # each block stage reads only the stage before it
    assert [sorted(s.spec.producers) for s in g.stages] == [[], [0], [1], [2], [3]]


def test_tied_weight_owned_by_head_borrowed_by_tail():
    g = stages_of(gpt_tied(), token_batch(0)[0])
    assert g.owner["transformer.wte.weight"] == 0
    tail = g.stages[-1]
    assert "transformer.wte.weight" in tail.params
    assert tail.spec.grad_groups == {0, len(g.stages) - 1}
    assert g.stages[0].spec.update_group == 0
    # the tail's slot holds its own group and a copy of the borrowed weight
    assert len(tail.slot.prefetch) == 2 and len(tail.slot.grads) == 2


def test_untied_model_has_no_borrowing():
    g = stages_of(gpt_mask(), token_batch(0)[0])
    assert all(s.spec.grad_groups == {s.index} for s in g.stages)
    assert all(len(s.slot.prefetch) == 1 for s in g.stages)  # one transfer per stage


def test_fallback_by_bytes_for_cnn_with_skips():
    model = SkipCNN()
    assert find_blocks(model) is None
    g = stages_of(model, image_batch(0)[0], num_stages=3)
    assert g.method == "bytes" and len(g.stages) == 3
    sizes = [s.spec.prefetch_bytes for s in g.stages]
    assert max(sizes) < 0.7 * sum(sizes)
    # the skip across the downsample makes a value cross more than one boundary or feed two stages
    assert any(len(v.consumers) > 1 or (v.consumers and v.consumers[-1] - v.producer > 1) for v in g.values.values() if v.producer >= 0)


def test_blocks_false_forces_bytes_split():
    g = stages_of(gpt_tied(), token_batch(0)[0], blocks=False, num_stages=2)
    assert g.method == "bytes" and len(g.stages) == 2


def test_blocks_override_and_bad_path():
    model = BNNet()
    g = stages_of(model, vector_batch(0)[0], blocks="blocks")
    assert [s.name for s in g.stages] == ["head", "blocks.0", "blocks.1", "blocks.2", "tail"]
    with pytest.raises(PartitionError, match="no submodule of that name. Containers it has: blocks"):
        stages_of(model, vector_batch(0)[0], blocks="layers")


def test_mutated_buffers_stay_in_their_stage():
    g = stages_of(BNNet(), vector_batch(0)[0])
    for s in g.stages:
        expected = {f"{s.name}.bn.running_mean", f"{s.name}.bn.running_var", f"{s.name}.bn.num_batches_tracked"} if s.name.startswith("blocks.") else set()
        assert set(s.mutated_buffers) == expected
        assert (s.spec.buffer_out_bytes > 0) == bool(expected)


@pytest.mark.parametrize("make", [gpt_mask, gpt_tied, SkipCNN, BNNet])
def test_stages_compose_to_the_model(make):
    """Running the stage graphs one after another on host tensors gives the model's output:
    each stage is a pure function of (params, buffers, inputs)."""
    torch.manual_seed(0)
    model = make().eval()
    args = {gpt_mask: token_batch, gpt_tied: token_batch, SkipCNN: image_batch, BNNet: vector_batch}[make](0)[0]
    cap = capture_model(model, args)
    g = partition_stages(cap, model=model)
    tensors = {**cap.params, **cap.buffers, **cap.constants}
    values = {name: a for name, a in zip(g.inputs, [a for a in args if isinstance(a, torch.Tensor)])}
    with torch.no_grad():
        for s in g.stages:
            outs = s.gm(*[tensors[k] for k in s.params], *[tensors[k] for k in s.buffers], *[values[v] for v in s.inputs])
            outs2 = s.gm(*[tensors[k] for k in s.params], *[tensors[k] for k in s.buffers], *[values[v] for v in s.inputs])
            for a, b in zip(outs, outs2):
                torch.testing.assert_close(a, b, rtol=0, atol=0)  # no hidden state
            values.update(zip(s.outputs, outs))
        expected = model(*args)
    torch.testing.assert_close(values[g.outputs[0]], expected, rtol=0, atol=0)


class InPlace(nn.Module):
    def __init__(self, inplace_head: bool):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.out = nn.Sequential(nn.ReLU(inplace=inplace_head), nn.Linear(8, 2))

    def forward(self, x):
        for b in self.blocks:
            h = b(x)
            h.add_(x)  # fine: the model's own loop; stays with the block it continues
            x = h
        x.mul_(2)  # fine too: root-level code after the last block joins that block's stage
        return self.out(x).sum()


def test_in_place_within_a_stage_is_fine():
    g = stages_of(InPlace(False), (torch.randn(2, 8),))
    assert len(g.stages) == 4
    assert g.stages[-1].name == "tail" and g.stages[-1].num_ops == 3  # relu, linear, sum


def test_in_place_on_a_stage_input_is_refused():
    with pytest.raises(PartitionError, match="stage 'tail' modifies its input 'mul_' in place .*out of place"):
        stages_of(InPlace(True), (torch.randn(2, 8),))


def test_describe_lists_stages():
    text = stages_of(gpt_tied(), token_batch(0)[0]).describe()
    assert "5 stages (blocks:transformer.h)" in text and "transformer.h.1" in text
