"""The partition pass: block detection, byte-balanced fallback, tied weights, pure stages."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from zoo import BNNet, SkipCNN, gpt_mask, gpt_tied, image_batch, token_batch, vector_batch

from shfx.passes.capture import InputSignature, capture_model
from shfx.passes.partition import (
    PartitionError,
    StageLabels,
    assign_owners,
    assign_update_groups,
    build_stages,
    check_mutated_buffers,
    check_stage_inputs_unmodified,
    collect_boundary_values,
    collect_user_inputs,
    find_blocks,
    label_stages,
    mark_differentiable,
    merge_tensorless_stages,
    partition_stages,
)


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
    with pytest.raises(PartitionError, match=r"blocks='layers': the model has no submodule 'layers'. Lists of repeated blocks .* in BNNet: blocks \(3 x BNBlock, 77% of the parameters\)\. Name one"):
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


# ---- the sub-passes, one at a time --------------------------------------------------------


class Tiny(nn.Module):
    """Two blocks, parameter-free code before and after them, a detached value and a no_grad
    region crossing a stage boundary, an input requiring grad and an input no stage reads."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.act = nn.ReLU()

    def forward(self, x, y, unused):
        x = self.blocks[0](x * 2)
        d = x.detach()
        with torch.no_grad():
            w = x * 3
        x = self.blocks[1](x)
        with torch.no_grad():
            v = x * 5
        return self.act(x + d + w + y + v).sum()


def tiny():
    model = Tiny()
    return model, capture_model(model, (torch.randn(2, 4), torch.randn(2, 4).requires_grad_(), torch.randn(2)))


def merged_labels(model, cap, **kw):
    return merge_tensorless_stages(cap, label_stages(cap, model=model, **kw))


def by_name(mapping):
    return {n.name: v for n, v in mapping.items()}


def test_label_stages_by_blocks():
    model, cap = tiny()
    labels = label_stages(cap, model=model)
    assert labels.names == ("head", "blocks.0", "blocks.1", "tail") and labels.method == "blocks:blocks"
    # code between blocks joins the block before it; get_attr (a no_grad body) and getitem
    # follow the higher-order op they belong to
    assert by_name(labels.stage_of) == {
        "mul": 0,
        "linear": 1, "detach": 1, "submod_5": 1, "mul_1": 1, "getitem_2": 1,
        "linear_1": 2, "add": 2, "add_1": 2, "add_2": 2,
        "submod_6": 3, "mul_2": 3, "getitem_3": 3, "add_3": 3, "relu": 3, "sum_1": 3,
    }  # fmt: skip
    assert [n.name for n in labels.nodes] == [n.name for n in cap.gm.graph.nodes if n.op == "call_function" or n.op == "get_attr"]


def test_label_stages_by_bytes_and_refuses_a_foreign_capture():
    model, cap = tiny()
    labels = label_stages(cap, model=model, blocks=False, num_stages=2)
    # "blocks" holds every byte: the split goes into it (top-level cuts gave ("blocks", "act"),
    # and "act", with no parameters, merged away: one stage of the two asked)
    assert labels.method == "bytes" and labels.names == ("blocks.0", "blocks.1..act")
    with pytest.raises(PartitionError, match="label_stages: graph placeholder 'p_m_blocks_0_weight' is not in"):
        label_stages(replace(cap, placeholders=cap.placeholders[1:]), model=model)


def test_merge_tensorless_stages_merges_and_drops_empty_stages():
    model, cap = tiny()
    labels = label_stages(cap, model=model)
    # an extra empty stage between the head and the first block
    gap = StageLabels(
        labels.nodes,
        {n: s if s == 0 else s + 1 for n, s in labels.stage_of.items()},
        ("head", "gap", *labels.names[1:]),
        labels.method,
    )
    merged = merge_tensorless_stages(cap, gap)
    # the head (x * 2) merges forward, the tail (relu, sum) back; the empty stage disappears
    assert merged.names == ("head+blocks.0", "blocks.1+tail")
    assert {n.name for n in merged.members()[0]} == {"mul", "linear", "detach", "submod_5", "mul_1", "getitem_2"}
    assert merged_labels(model, cap) == merged
    without_relu = {n: s for n, s in labels.stage_of.items() if n.name != "relu"}
    broken = StageLabels(labels.nodes, without_relu, labels.names, labels.method)
    with pytest.raises(PartitionError, match="merge_tensorless_stages: node 'relu' has stage None"):
        merge_tensorless_stages(cap, broken)


def test_assign_owners_tied_weight_owned_by_its_first_user():
    model = gpt_tied()
    cap = capture_model(model, token_batch(0)[0])
    labels = merged_labels(model, cap)
    own = assign_owners(cap, labels)
    wte = "transformer.wte.weight"
    assert own.owner[wte] == 0 and wte in own.stage_keys[0] and wte in own.stage_keys[-1]
    assert wte in own.groups[0].keys and wte not in own.groups[-1].keys
    assert own.tensors[wte].kind == "param" and own.tensors[wte].trainable
    # reusing the groups keeps every owner
    assert assign_owners(cap, labels, own.groups).owner == own.owner
    with pytest.raises(PartitionError, match=r"assign_owners: groups\[0\] has index 1"):
        assign_owners(cap, labels, own.groups[1:])
    with pytest.raises(PartitionError, match=f"{wte!r} is used by this capture but was not used"):
        assign_owners(cap, labels, [replace(own.groups[0], infos=own.groups[0].infos[1:])])  # wte left out


class SharedBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        x = self.bn(x)
        for b in self.blocks:
            x = b(x)
        return self.bn(x).sum()


def test_check_mutated_buffers():
    model = BNNet()
    cap = capture_model(model, vector_batch(0)[0])
    assert check_mutated_buffers(cap, merged_labels(model, cap)) is None
    model = SharedBN()
    cap = capture_model(model, (torch.randn(4, 8),))
    with pytest.raises(PartitionError, match="buffer 'bn.running_mean' .* used by stages 'head' and 'tail'"):
        check_mutated_buffers(cap, merged_labels(model, cap))


def test_mark_differentiable_detach_no_grad_and_inputs():
    _, cap = tiny()
    needs_grad = by_name(mark_differentiable(cap))
    assert needs_grad["p_m_blocks_0_weight"] and needs_grad["linear"] and needs_grad["sum_1"]
    assert needs_grad["tensors_1"] and not needs_grad["tensors_0"]  # y requires grad, x does not
    assert not needs_grad["mul"]  # x * 2 reads only x
    assert not needs_grad["detach"]
    assert not needs_grad["mul_1"] and not needs_grad["getitem_2"]  # inside torch.no_grad()
    bad = replace(cap, signature=InputSignature(cap.signature.training, cap.signature.tree, cap.signature.leaves[:1]))
    with pytest.raises(PartitionError, match="mark_differentiable: input placeholder 'tensors_1' has index 1"):
        mark_differentiable(bad)


class ReturnsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.sum(), self.blocks[0].weight


def test_collect_boundary_values():
    model, cap = tiny()
    values = collect_boundary_values(cap, merged_labels(model, cap), mark_differentiable(cap))
    assert [(v.name, v.producer, v.consumers, v.differentiable) for v in values.values()] == [
        ("tensors_0", -1, (0,), False),
        ("linear", 0, (1,), True),
        ("detach", 0, (1,), False),  # a detached value crosses without a gradient
        ("getitem_2", 0, (1,), False),
        ("tensors_1", -1, (1,), True),
        ("sum_1", 1, (), True),
    ]
    assert values["tensors_1"].input_index == 1 and values["linear"].shape == (2, 4) and values["linear"].nbytes == 32
    model = ReturnsWeight()
    cap = capture_model(model, (torch.randn(2, 8),))
    with pytest.raises(PartitionError, match="returns the param 'blocks.0.weight' itself"):
        collect_boundary_values(cap, merged_labels(model, cap), mark_differentiable(cap))


def test_check_stage_inputs_unmodified():
    model = InPlace(False)
    cap = capture_model(model, (torch.randn(2, 8),))
    assert check_stage_inputs_unmodified(cap, merged_labels(model, cap)) is None
    model = InPlace(True)
    cap = capture_model(model, (torch.randn(2, 8),))
    with pytest.raises(PartitionError, match="stage 'tail' modifies its input 'mul_' in place"):
        check_stage_inputs_unmodified(cap, merged_labels(model, cap))


def test_build_stages_signatures_and_specs():
    model, cap = tiny()
    labels = merged_labels(model, cap)
    own = assign_owners(cap, labels)
    values = collect_boundary_values(cap, labels, mark_differentiable(cap))
    stages = build_stages(cap, labels, own, values)
    assert [[n.target for n in s.gm.graph.nodes if n.op == "placeholder"] for s in stages] == [
        ["blocks_0_weight", "blocks_0_bias", "in_tensors_0"],
        ["blocks_1_weight", "blocks_1_bias", "in_linear", "in_detach", "in_getitem_2", "in_tensors_1"],
    ]
    assert [s.outputs for s in stages] == [("linear", "detach", "getitem_2"), ("sum_1",)]
    assert [s.spec.producers for s in stages] == [frozenset(), {0}]
    assert [s.spec.update_group for s in stages] == [0, 1]
    assert stages[0].spec.activation_bytes == 3 * 32 and stages[0].num_ops == 5
    with pytest.raises(PartitionError, match="build_stages: the ownership covers 4 stages but the labels have 2"):
        build_stages(cap, labels, assign_owners(cap, label_stages(cap, model=model)), values)


def test_assign_update_groups_gives_an_unclaimed_group_to_its_first_user():
    g = stages_of(gpt_tied(), token_batch(0)[0])
    assert g.stages[0].spec.update_group == 0 and g.stages[-1].spec.grad_groups == {0, len(g.stages) - 1}
    stripped = [replace(s, spec=replace(s.spec, update_group=None, update_bytes=0)) if s.index == 0 else s for s in g.stages]
    # group 0 goes back to the head, not to the tail that also sends it gradients
    assert [s.spec for s in assign_update_groups(stripped, g.groups)] == [s.spec for s in g.stages]
    assert stripped[0].spec.update_group is None  # the input is not modified
    with pytest.raises(PartitionError, match="assign_update_groups: stage 'tail' has index 4 but is at position 0"):
        assign_update_groups(g.stages[::-1], g.groups)


def test_collect_user_inputs_adds_unread_inputs():
    model, cap = tiny()
    values = collect_boundary_values(cap, merged_labels(model, cap), mark_differentiable(cap))
    inputs, with_inputs = collect_user_inputs(cap, values)
    assert inputs == ["tensors_0", "tensors_1", "tensors_2"]
    assert "tensors_2" not in values  # the input is not modified
    unused = with_inputs["tensors_2"]
    assert (unused.producer, unused.consumers, unused.differentiable) == (-1, (), False)
    assert (unused.input_index, unused.shape) == (2, (2,))
    assert list(with_inputs)[: len(values)] == list(values)
    bad = replace(cap, placeholders=[replace(p, index=5) if p.name == "tensors_2" else p for p in cap.placeholders])
    with pytest.raises(PartitionError, match=r"collect_user_inputs: the input placeholders' indices \[0, 1, 5\]"):
        collect_user_inputs(bad, values)
