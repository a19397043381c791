"""Checkpoints with the parameter tier (``Offload(params="nvme", ...)``, issue 26 part 1): the
save streams what lives on the SSD one group at a time (:mod:`shfx._checkpoint_stream`) into the
same format as every other save; the checkpoint resumes bitwise in a fresh tier model and in eager
PyTorch (``shfx.checkpoint.load_into``); what the save holds at once is one group, not the model."""

from __future__ import annotations

import copy
import ctypes
import os

import pytest
import torch
from zoo import seeded_steps

import shfx
import shfx._checkpoint_stream as stream
from shfx.errors import UsageError
from shfx.models import GPT, GPTShape

SHAPE = GPTShape(vocab=64, seq=16, layers=4, heads=2, hidden=32, dropout=0.1)
BATCH = 4


def _batches(n: int, shape: GPTShape = SHAPE):
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randint(0, shape.vocab, (BATCH, shape.seq), generator=g), torch.randint(0, shape.vocab, (BATCH, shape.seq), generator=g))
        for _ in range(n)
    ]


def _compile(model, path, precision="fp32"):
    return shfx.compile(
        model, device=shfx.EmulatedDevice(memory="64MiB", h2d=None, d2h=None), policy=shfx.Stronghold(window=2),
        optimizer=shfx.optim.AdamW(lr=1e-2, weight_decay=0.01), precision=precision,
        offload=shfx.Offload(params="nvme", gradients="nvme", optimizer="nvme", path=str(path), host_window=2),
    )  # fmt: skip


def _go_on(forward, optimizer, batches) -> list[torch.Tensor]:
    """Steps without seeding: the RNG where the run (or the checkpoint loaded) left it."""
    return seeded_steps(forward, optimizer, batches, seed=None)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_tier_checkpoint_resumes_bitwise_in_a_tier_model_and_in_eager(tmp_path):
    torch.manual_seed(0)
    model = GPT(SHAPE)
    fresh = copy.deepcopy(model)  # (its weights are overwritten by the loads)
    batches = _batches(4)
    ckpt = str(tmp_path / "ckpt")
    cm = _compile(model, tmp_path / "ssd")
    try:
        seeded_steps(cm, cm, batches[:2])
        cm.save_checkpoint(ckpt, extra={"next": 2})
        after = _go_on(cm, cm, batches[2:])  # the uninterrupted run
        final = {k: v.clone() for k, v in cm.state_dict().items()}
    finally:
        cm.close()
    # a fresh tier model (loaded before its first call)
    cm2 = _compile(copy.deepcopy(fresh), tmp_path / "ssd2")
    try:
        assert cm2.load_checkpoint(ckpt) == {"next": 2}
        assert _equal(_go_on(cm2, cm2, batches[2:]), after)
        assert all(torch.equal(v, final[k]) for k, v in cm2.state_dict().items())
    finally:
        cm2.close()
    # eager PyTorch with torch's fused AdamW (the tier's update kernel)
    eager = copy.deepcopy(fresh)
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    assert shfx.checkpoint.load_into(eager, opt, ckpt) == {"next": 2}
    assert _equal(_go_on(eager, opt, batches[2:]), after)
    assert all(torch.equal(v, final[k]) for k, v in eager.state_dict().items())


def test_the_format_is_an_eager_save_s_and_plain_dcp_loads_it(tmp_path):
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = GPT(SHAPE)
    eager = copy.deepcopy(model)
    cm = _compile(model, tmp_path / "ssd", precision="bf16")  # (the fp32 masters on the SSD too)
    try:
        seeded_steps(cm, cm, _batches(2))
        cm.save_checkpoint(str(tmp_path / "tier"))
        sd = {k: v.clone() for k, v in cm.state_dict().items()}
    finally:
        cm.close()
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.01)
    shfx.checkpoint.load_into(eager, opt, str(tmp_path / "tier"))
    shfx.checkpoint.save_from(eager, opt, str(tmp_path / "eager"))
    tier, ref = (shfx.checkpoint.read_info(str(tmp_path / p)) for p in ("tier", "eager"))
    assert tier["tensors"] == ref["tensors"]  # (names, shapes, dtypes)
    assert [g["params"] for g in tier["param_groups"]] == [g["params"] for g in ref["param_groups"]]
    assert sorted(os.listdir(tmp_path / "tier")) == sorted(os.listdir(tmp_path / "eager"))  # (.metadata, one shard, the state)
    # plain DCP reads every tensor into a dict of its own: the tier's values, bitwise the eager save's
    got, want = ({k: torch.empty(s, dtype=d) for k, (s, d) in tier["tensors"].items()} for _ in range(2))
    dcp.load(got, checkpoint_id=str(tmp_path / "tier"), no_dist=True)
    dcp.load(want, checkpoint_id=str(tmp_path / "eager"), no_dist=True)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(got[f"model.{k}"], v) for k, v in sd.items())


def test_on_a_machine_with_cuda_the_writer_still_takes_one_tensor_at_a_time(tmp_path, monkeypatch):
    # DCP's writer resolves ahead (and sorts by size) where CUDA is available unless its copy-ahead
    # is 0: the streaming save, which frees each copy once written, must not get that loader
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    cm = _compile(GPT(SHAPE), tmp_path / "ssd")
    try:
        seeded_steps(cm, cm, _batches(1))
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_available", lambda: True)
            cm.save_checkpoint(str(tmp_path / "ckpt"))
        sd = cm.state_dict()
        opt = {n: cm.optimizer.state[p] for n, p in cm.module.named_parameters()}
    finally:
        cm.close()
    tensors = shfx.checkpoint.read_info(str(tmp_path / "ckpt"))["tensors"]
    got = {k: torch.empty(s, dtype=d) for k, (s, d) in tensors.items()}
    dcp.load(got, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert all(torch.equal(got[f"model.{k}"], v) for k, v in sd.items())
    assert all(torch.equal(got[f"optimizer.state.{n}.{f}"], t) for n, st in opt.items() for f, t in st.items())


def _heap_bytes():
    """glibc's bytes in use (every arena and mmapped block: what torch's CPU tensors take), or
    None off glibc."""
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    f = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if f is None:
        return None
    f.restype = Info
    return lambda: f().uordblks + f().hblkhd


def test_a_save_holds_one_group_at_a_time(tmp_path, monkeypatch):
    # a deeper, wider GPT (7 paged groups, images up to 3.0 MiB, AdamW states up to 6.0 MiB, 54.5
    # MiB in the checkpoint): the save reads each group's image once and its states once, in order,
    # and the heap in use while the writer writes (sampled as it takes each item) grows by at most
    # one group's largest read (its states), the copy of the tensor being written and DCP's
    # bookkeeping of the items (the plan, the metadata, the write results: kilobytes per item).
    # Measured: 7.5 MiB; without freeing the copies written (DCP keeps a reference to each) 61 MiB,
    # and the save before streaming (the state dict and the states materialized) 91 MiB
    heap = _heap_bytes()
    if heap is None:
        pytest.skip("needs glibc's mallinfo2 to count the heap")
    shape = GPTShape(vocab=64, seq=16, layers=6, heads=2, hidden=256, dropout=0.0)
    torch.manual_seed(0)
    cm = _compile(GPT(shape), tmp_path / "ssd")
    try:
        seeded_steps(cm, cm, _batches(1, shape))
        ssd = cm.engine.ssd
        reads: list[tuple] = []
        orig_read = ssd.ssd.read_into
        monkeypatch.setattr(ssd.ssd, "read_into", lambda key, buf: (reads.append(key), orig_read(key, buf))[1])
        samples: list[int] = []
        orig_resolve = stream.StreamingSavePlanner.resolve_data

        def resolve(self, item):
            out = orig_resolve(self, item)
            samples.append(heap())  # (the group held and the copy handed to the writer)
            return out

        monkeypatch.setattr(stream.StreamingSavePlanner, "resolve_data", resolve)
        before = heap()
        cm.save_checkpoint(str(tmp_path / "ckpt"))
        monkeypatch.undo()
        paged, groups = sorted(ssd.paged), sorted(ssd.groups)
        assert reads == [("image", g) for g in paged] + [(s, g) for g in groups for s in ("m", "v")]
        tensors = shfx.checkpoint.read_info(str(tmp_path / "ckpt"))["tensors"]
        nbytes = [torch.Size(s).numel() * d.itemsize for s, d in tensors.values()]
        group = max(sum(n * ssd.dtype.itemsize for _, n in ssd.layout[g]) for g in groups)  # (the states: m and v)
        bound = group + max(nbytes) + 4096 * len(tensors)
        peak = max(samples) - before
        assert peak <= bound, (peak, group, max(nbytes), sum(nbytes))
        assert sum(nbytes) > 6 * bound  # (what a save of the materialized state held beyond training)
    finally:
        cm.close()


def test_async_save_with_the_tier_is_refused_naming_the_fix(tmp_path):
    torch.manual_seed(0)
    cm = _compile(GPT(SHAPE), tmp_path / "ssd")
    try:
        seeded_steps(cm, cm, _batches(1))
        with pytest.raises(UsageError, match=r"async_save=True with the parameter tier .* call cm.save_checkpoint\(path\) \(async_save=False"):
            cm.save_checkpoint(str(tmp_path / "ckpt"), async_save=True)
        assert not os.path.exists(tmp_path / "ckpt")
    finally:
        cm.close()
