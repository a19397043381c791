"""Host groups and slot layouts: alignment, region order, one transfer per stage."""

from __future__ import annotations

import torch

from shfx.passes.layout import ALIGN, TensorInfo, plan_groups, plan_slot


def info(key, shape, kind="param", trainable=True, mutable=False, dtype=torch.float32):
    return TensorInfo(key, kind, shape, dtype, trainable, mutable)


def test_group_regions_in_order_and_aligned():
    (g,) = plan_groups(
        [
            [
                info("buf", (3,), kind="buffer", trainable=False),
                info("w", (5, 3)),
                info("frozen", (7,), trainable=False),
                info("stat", (2,), kind="buffer", trainable=False, mutable=True),
                info("b", (5,)),
                info("steps", (), kind="buffer", trainable=False, mutable=True, dtype=torch.int64),
            ]
        ]
    )
    assert g.keys == ("w", "b", "frozen", "stat", "steps", "buf")
    assert all(off % ALIGN == 0 for off in g.offsets.values())
    assert g.trainable_bytes == g.offsets["frozen"] == 2 * ALIGN
    assert g.mutable_range == (g.offsets["stat"], g.offsets["buf"])


def test_slot_of_owner_is_one_copy_and_borrowed_tensors_follow():
    groups = plan_groups([[info("emb", (10, 4))], [info("ln", (4,)), info("mean", (4,), kind="buffer", trainable=False, mutable=True)]])
    owner = {"emb": 0, "ln": 1, "mean": 1}
    head = plan_slot(0, ["emb"], [], ["emb"], groups, owner)
    assert len(head.prefetch) == 1 and head.prefetch[0].nbytes == groups[0].nbytes
    tail = plan_slot(1, ["ln", "mean", "emb"], ["mean"], ["ln", "emb"], groups, owner)
    assert [(c.group, c.slot_offset) for c in tail.prefetch] == [(1, 0), (0, groups[1].nbytes)]
    assert tail.offsets["emb"] == groups[1].nbytes
    # group 0 is used whole by the tail: its region is placed whole, and so are its grads
    assert [(c.group, c.nbytes) for c in tail.grads] == [(1, groups[1].trainable_bytes), (0, groups[0].trainable_bytes)]
    assert [(c.group, c.host_offset, c.nbytes) for c in tail.buffers_out] == [(1, groups[1].mutable_range[0], 64)]
    assert tail.nbytes == groups[1].nbytes + 192


def test_borrowing_part_of_a_group_copies_single_tensors():
    groups = plan_groups([[info("emb", (10, 4)), info("pos", (3, 4))], [info("ln", (4,))]])
    owner = {"emb": 0, "pos": 0, "ln": 1}
    tail = plan_slot(1, ["ln", "emb"], [], ["ln", "emb"], groups, owner)
    assert [(c.group, c.host_offset, c.nbytes) for c in tail.prefetch] == [(1, 0, 64), (0, groups[0].offsets["emb"], 160)]
    assert [(c.group, c.host_offset, c.nbytes) for c in tail.grads] == [(1, 0, 64), (0, groups[0].offsets["emb"], 160)]


def test_trainable_params_must_be_fp32():
    import pytest

    with pytest.raises(NotImplementedError, match="fp32"):
        plan_groups([[info("w", (2,), dtype=torch.bfloat16)]])


def test_sizes_come_from_the_copies_dtypes():
    """Each copy of a group's trainable region carries its dtype: an optimizer state kept in
    another dtype than the master is sized from it (the layout is the one place bytes come from)."""
    import pytest
    import torch

    from shfx.passes.layout import CopyDtypes, TensorInfo, plan_groups

    infos = [TensorInfo("w", "param", (10,), torch.float64, trainable=True), TensorInfo("b", "param", (3,), torch.float64, trainable=True)]
    f64 = torch.float64
    (g,) = plan_groups([infos], CopyDtypes(master=f64, grad=f64, state=torch.float32, working=f64, device_grad=f64))
    assert g.trainable_bytes == 128 + 64  # 80 and 24 bytes, each 64-byte aligned
    assert g.trainable_numel == 24 and g.grad_bytes == 192 and g.state_bytes == 96
    assert g.trainable_spans() == [(0, 10), (16, 3)]
    with pytest.raises(NotImplementedError, match="fp32 master weights"):
        plan_groups([infos])  # fp32 masters, fp64 parameters
    with pytest.raises(NotImplementedError, match="working copy"):
        CopyDtypes(working=torch.bfloat16)


def test_mixed_precision_group():
    """bf16 parameters and an fp32 one (a BatchNorm weight) in one group: two parts, element
    offsets shared by the image, the fp32 master and the gradient; a frozen parameter cast for
    the device keeps an fp32 master too; buffers stay in the image only."""
    import torch

    from shfx.passes.layout import Part, TensorInfo, copy_dtypes, plan_groups

    bf, f32 = torch.bfloat16, torch.float32
    infos = [
        TensorInfo("w", "param", (40,), bf, trainable=True, host_dtype=f32),
        TensorInfo("bn", "param", (8,), f32, trainable=True),
        TensorInfo("b", "param", (32,), bf, trainable=True, host_dtype=f32),
        TensorInfo("frozen", "param", (10,), bf, host_dtype=f32),
        TensorInfo("stat", "buffer", (8,), f32, mutable=True),
    ]
    (g,) = plan_groups([infos], copy_dtypes("bf16"))
    # bf16 part: w at element 0 (40 -> 64, 32-element units = 64 bytes of bf16), b at 64; fp32 part from 96
    assert g.parts == (Part(0, 96, 0, bf), Part(96, 32, 192, f32))
    assert g.offsets["w"] == 0 and g.offsets["b"] == 128 and g.offsets["bn"] == 192
    assert g.trainable_bytes == 192 + 128 and g.trainable_numel == 128 and g.master_bytes == 512
    assert g.trainable_spans() == [(0, 40), (64, 32), (96, 8)]
    assert g.master_offsets == {"w": 0, "b": 256, "bn": 384, "frozen": 512}
    assert g.separate_master and g.master_nbytes == 576
    assert g.param_end == g.offsets["stat"] and g.working_bytes == g.param_end
    assert g.host_master_bytes == g.master_nbytes + g.nbytes - g.param_end
    # a copy of the whole trainable region, part by part: (part, first element, numel, byte offset)
    assert [(p.dtype, e, n, o) for p, e, n, o in g.elements(0, g.trainable_bytes)] == [(bf, 0, 96, 0), (f32, 96, 32, 192)]
    assert [(e, n) for _, e, n, _ in g.elements(g.offsets["b"], 64)] == [(64, 32)]
    assert g.part_starts == (96,)
