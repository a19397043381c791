"""Checkpoints with the parameter tier (``Offload(params="nvme", ...)``, issue 26 part 1): the
save streams what lives on the SSD one group at a time (:mod:`shfx._checkpoint_stream`) into the
same format as every other save, and the load reads it back one group at a time; the checkpoint
resumes bitwise in a fresh tier model (loaded before or after its first call) and in eager PyTorch
(``shfx.checkpoint.load_into``), and an eager ``save_from`` resumes in a tier model; what a save or
a load holds at once is one group, not the model; a refused load writes nothing to the SSD."""

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


def _save_eager(tmp_path, batches, path: str, **opt) -> tuple[torch.nn.Module, list[torch.Tensor], dict]:
    """An eager GPT trained on ``batches[:2]`` with torch's fused AdamW (the tier's kernel) and
    saved by ``shfx.checkpoint.save_from`` at ``path``; its fresh copy (made before training),
    the losses of ``batches[2:]`` after the save and the final weights."""
    torch.manual_seed(0)
    eager = GPT(SHAPE)
    fresh = copy.deepcopy(eager)
    adamw = torch.optim.AdamW(eager.parameters(), **{"lr": 1e-2, "weight_decay": 0.01, **opt}, fused=True)
    seeded_steps(eager, adamw, batches[:2])
    shfx.checkpoint.save_from(eager, adamw, path, extra={"next": 2})
    after = _go_on(eager, adamw, batches[2:])
    return fresh, after, {k: v.clone() for k, v in eager.state_dict().items()}


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_eager_save_resumes_bitwise_in_a_tier_model_loaded_before_or_after_its_first_call(tmp_path, when):
    batches = _batches(4)
    ckpt = str(tmp_path / "eager")
    fresh, after, final = _save_eager(tmp_path, batches, ckpt)
    torch.manual_seed(1)
    cm = _compile(GPT(SHAPE), tmp_path / "ssd")  # (other weights: the load overwrites every one)
    try:
        if when == "after":  # (other weights, states and steps on the SSD: the load overwrites every one)
            seeded_steps(cm, cm, _batches(1), seed=5)
        assert cm.load_checkpoint(ckpt) == {"next": 2}
        assert _equal(_go_on(cm, cm, batches[2:]), after)
        assert all(torch.equal(v, final[k]) for k, v in cm.state_dict().items())
    finally:
        cm.close()


def test_a_bf16_tier_checkpoint_resumes_bitwise_in_a_tier_model_that_has_run(tmp_path):
    # mixed precision: the fp32 masters load into the window's master buffer and the 16-bit image
    # is cast from them (p16.copy_(master)) before both go to the SSD
    torch.manual_seed(0)
    model = GPT(SHAPE)
    batches = _batches(4)
    ckpt = str(tmp_path / "ckpt")
    cm = _compile(model, tmp_path / "ssd", precision="bf16")
    try:
        seeded_steps(cm, cm, batches[:2])
        cm.save_checkpoint(ckpt)
        after = _go_on(cm, cm, batches[2:])
        final = {k: v.clone() for k, v in cm.state_dict().items()}
    finally:
        cm.close()
    torch.manual_seed(1)
    cm2 = _compile(GPT(SHAPE), tmp_path / "ssd2", precision="bf16")
    try:
        seeded_steps(cm2, cm2, _batches(1), seed=5)
        cm2.load_checkpoint(ckpt)
        assert _equal(_go_on(cm2, cm2, batches[2:]), after)
        assert all(torch.equal(v, final[k]) for k, v in cm2.state_dict().items())
    finally:
        cm2.close()


def _count_writes(monkeypatch, ssd, sample=None) -> list[tuple]:
    """The keys of every write to the SSD store of window ``ssd`` from now on, in order
    (``sample()`` called at each)."""
    writes: list[tuple] = []
    orig = ssd.ssd.write_from

    def write(key, buf):
        writes.append(key)
        if sample is not None:
            sample()
        return orig(key, buf)

    monkeypatch.setattr(ssd.ssd, "write_from", write)
    return writes


def _snapshot(cm) -> tuple[dict, dict, list]:
    """The weights, the optimizer states (read through the SSD) and the hyperparameters."""
    sd = {k: v.clone() for k, v in cm.state_dict().items()}
    states = {n: {f: t.clone() for f, t in cm.optimizer.state[p].items()} for n, p in cm.module.named_parameters()}
    return sd, states, [dict((k, v) for k, v in g.items() if k != "params") for g in cm.optimizer.param_groups]


def _same(a, b) -> bool:
    (sa, oa, ha), (sb, ob, hb) = a, b
    return (
        all(torch.equal(v, sb[k]) for k, v in sa.items())
        and all(torch.equal(t, ob[n][f]) for n, st in oa.items() for f, t in st.items())
        and ha == hb
    )


def test_a_refused_load_writes_nothing_to_the_ssd(tmp_path, monkeypatch):
    # each refusal is found from the checkpoint's metadata (and its steps) before anything is
    # written: no SSD write, the weights, states and hyperparameters as they were
    name = "transformer.h.1.mlp.c_fc.weight"  # (a paged group's)
    batches = _batches(2)
    torch.manual_seed(0)
    eager = GPT(SHAPE)
    adamw = torch.optim.AdamW(eager.parameters(), lr=5e-3, weight_decay=0.01, fused=True)  # (another lr: applied only on success)
    seeded_steps(eager, adamw, batches)
    p = dict(eager.named_parameters())[name]
    missing = str(tmp_path / "missing")
    def drop(module, sd, prefix, local) -> None:
        del sd[name]

    hook = eager._register_state_dict_hook(drop)
    shfx.checkpoint.save_from(eager, adamw, missing)
    hook.remove()
    misshapen = str(tmp_path / "misshapen")  # (a stage's state of another shape: refused once stage by stage)
    good = adamw.state[p]["exp_avg"]
    adamw.state[p]["exp_avg"] = torch.zeros(3, 4)
    shfx.checkpoint.save_from(eager, adamw, misshapen)
    adamw.state[p]["exp_avg"] = good
    steps = str(tmp_path / "steps")  # (one parameter of the stage one step ahead)
    adamw.state[p]["step"] = adamw.state[p]["step"] + 1
    shfx.checkpoint.save_from(eager, adamw, steps)
    wider = str(tmp_path / "wider")
    big = GPT(GPTShape(vocab=64, seq=16, layers=4, heads=2, hidden=48, dropout=0.1))
    shfx.checkpoint.save_from(big, torch.optim.AdamW(big.parameters()), wider)

    torch.manual_seed(1)
    cm = _compile(GPT(SHAPE), tmp_path / "ssd")
    try:
        seeded_steps(cm, cm, _batches(1), seed=5)
        writes = _count_writes(monkeypatch, cm.engine.ssd)
        before = _snapshot(cm)
        for path, error in [
            (missing, rf"does not match the model: missing \['{name}'\]"),
            (misshapen, r"state 'exp_avg' of a parameter of shape \(128, 32\) is \(3, 4\)"),
            (steps, r"different steps"),
            (wider, r"has shape \(64, 48\) in the checkpoint and \(64, 32\) in the model"),
        ]:
            with pytest.raises(UsageError, match=error):
                cm.load_checkpoint(path)
            assert writes == []
        assert _same(_snapshot(cm), before)
        cm.load_checkpoint(missing, strict=False)  # (the names both have: every other tensor written)
        assert writes
    finally:
        cm.close()


def test_a_state_refused_at_the_first_call_is_raised_there_and_at_every_call_until_another_load(tmp_path):
    # before the first call the store's stages are not laid out: what only they can tell (a
    # stage's parameters with different steps) is checked at the first call, before its states
    # are written; the weights loaded then
    batches = _batches(4)
    good = str(tmp_path / "good")
    fresh, after, final = _save_eager(tmp_path, batches, good)
    eager = copy.deepcopy(fresh)
    adamw = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    seeded_steps(eager, adamw, batches[:1])
    p = dict(eager.named_parameters())["transformer.h.1.mlp.c_fc.weight"]
    adamw.state[p]["step"] = adamw.state[p]["step"] + 1
    bad = str(tmp_path / "bad")
    shfx.checkpoint.save_from(eager, adamw, bad)
    cm = _compile(copy.deepcopy(fresh), tmp_path / "ssd")
    try:
        cm.load_checkpoint(bad)
        for _ in range(2):
            with pytest.raises(UsageError, match=r"loaded before the first call .* different steps"):
                cm(*batches[2])
        cm.load_checkpoint(good)
        assert _equal(_go_on(cm, cm, batches[2:]), after)
    finally:
        cm.close()


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


@pytest.mark.parametrize("when", ["after", "before"])
def test_a_load_holds_one_group_at_a_time(tmp_path, monkeypatch, when):
    # the GPT of the save's test (7 paged groups, AdamW states up to 6.0 MiB a group, 54.5 MiB in
    # the checkpoint), loaded after its first call or before it (the states then at that call):
    # everything is checked on the metadata first, then each paged group's image is read and
    # written once, in order, and each group's states written once, in order; the heap in use
    # (sampled at each tensor DCP reads and each SSD write) grows by at most one group's states
    # (the entries read from the checkpoint; the group's image, master and states are written
    # from the window's buffers), the tensor being read and DCP's bookkeeping. Measured: 7.4 MiB
    # after the first call; before streaming, the load took 133 MiB (every paged weight and
    # state at once, and a copy of the current states to undo a refusal)
    heap = _heap_bytes()
    if heap is None:
        pytest.skip("needs glibc's mallinfo2 to count the heap")
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    shape = GPTShape(vocab=64, seq=16, layers=6, heads=2, hidden=256, dropout=0.0)
    torch.manual_seed(0)
    model = GPT(shape)
    fresh = copy.deepcopy(model)
    batches = _batches(2, shape)
    ckpt = str(tmp_path / "ckpt")
    cm = _compile(model, tmp_path / "ssd")
    try:
        seeded_steps(cm, cm, batches[:1])
        cm.save_checkpoint(ckpt)
        if when == "before":
            cm.close()
            cm = _compile(fresh, tmp_path / "ssd2")
        samples: list[int] = []
        on = [False]  # (sampling while the load reads and writes)

        def sample() -> None:
            if on[0]:
                samples.append(heap())

        orig_resolve = DefaultLoadPlanner.resolve_tensor
        monkeypatch.setattr(DefaultLoadPlanner, "resolve_tensor", lambda self, item: (sample(), orig_resolve(self, item))[1])
        base: list[int] = []
        writes: list[tuple] = []

        def loading(cm_, load) -> None:
            counted = _count_writes(monkeypatch, cm_.engine.ssd, sample)
            base.append(heap())
            on[0] = True
            load()
            on[0] = False
            writes.extend(counted)

        if when == "after":
            loading(cm, lambda: cm.load_checkpoint(ckpt))
        else:
            cm.load_checkpoint(ckpt)  # (the weights into the model's own tensors; the states at the first call)
            orig_apply = shfx.checkpoint.apply_pending
            monkeypatch.setattr(shfx.checkpoint, "apply_pending", lambda cm_, v: loading(cm_, lambda: orig_apply(cm_, v)))
            cm(*batches[1])  # (the store and the SSD window laid out, then the states read)
        monkeypatch.undo()
        ssd = cm.engine.ssd
        paged, groups = sorted(ssd.paged), sorted(ssd.groups)
        states = [(s, g) for g in groups for s in ("m", "v")]
        assert writes == (states + [("image", g) for g in paged] if when == "after" else states)
        tensors = shfx.checkpoint.read_info(ckpt)["tensors"]
        nbytes = [torch.Size(s).numel() * d.itemsize for s, d in tensors.values()]
        group = max(sum(n * ssd.dtype.itemsize for _, n in ssd.layout[g]) for g in groups)  # (the states: m and v)
        bound = group + max(nbytes) + 4096 * len(tensors)
        peak = max(samples) - base[0]
        assert peak <= bound, (peak, group, max(nbytes), sum(nbytes))
        assert sum(nbytes) > 6 * bound  # (what the load that read every tensor at once held)
    finally:
        cm.close()
