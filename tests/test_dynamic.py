"""Variable input shapes without recapture: dynamic captures, the LRU capture cache, ranges.

Every check is against eager PyTorch with the same seed and data, bitwise (torch.equal) on the
CPU; captures are counted by ``cm.stats()["captures"]`` (a counter, not timing)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn
from equivalence import run_pair
from zoo import VOCAB, gpt, gpt_tied, hf_batch, token_batch, HFStyleLM

import shfx
from shfx.errors import OutOfDeviceMemory, UsageError

SEQS = (16, 8, 12)  # three sequence lengths, the longest first and last-but-one


def emulated(memory: str = "256MiB") -> shfx.EmulatedDevice:
    return shfx.EmulatedDevice(memory=memory, h2d=None, d2h=None)


def cut(t: torch.Tensor, n: int) -> torch.Tensor:
    return t[:, :n].contiguous()


def varlen_tokens(step: int, micro: int = 0):
    (x, y), kw, aux = token_batch(step, micro)
    n = SEQS[step % len(SEQS)]
    return (cut(x, n), cut(y, n)), kw, aux


def varlen_hf(step: int, micro: int = 0):
    _, kw, aux = hf_batch(step, micro)
    n = SEQS[step % len(SEQS)]
    return (), {k: cut(v, n) for k, v in kw.items()}, aux


def assert_bitwise(losses, ref_losses, model, ref) -> None:
    assert losses == ref_losses  # python floats of fp32 losses: equal iff the tensors are
    sd, rsd = model.state_dict(), ref.state_dict()
    assert sd.keys() == rsd.keys()
    for k in sd:
        assert torch.equal(sd[k], rsd[k]), k


@pytest.mark.parametrize(
    "make_model, make_batch", [(gpt_tied, varlen_tokens), (HFStyleLM, varlen_hf)], ids=["gpt", "hf_style"]
)
def test_declared_seq_range_one_capture_trains_bitwise(make_model, make_batch):
    losses, ref_losses, cm, model, ref = run_pair(
        make_model, make_batch, window=2, steps=len(SEQS) + 1, dynamic={"seq": (1, 16)}
    )
    assert_bitwise(losses, ref_losses, model, ref)
    st = cm.stats()
    assert st["captures"] == 1 and st["dynamic_captures"] == 1, st
    assert st["cache_hits"] == len(SEQS)  # every later step reused the one capture
    assert st["dynamic_ranges"] == ["seq in [1, 16]"]
    # the ledger and stage specs are sized for the range's largest shape, not the first call's
    v = cm.variant
    assert v.captured.dynamic.sized_for == {"seq": 16}
    inputs = [v.graph.values[name] for name in v.graph.inputs]
    assert all(val.shape[1] == 16 for val in inputs)
    cm.close()


def test_automatic_mode_recaptures_once_with_the_varying_dimension_dynamic():
    """The default (dynamic="auto"): the first shape is captured as it is, the second distinct
    sequence length captures once more with that dimension dynamic, and the third reuses it."""
    losses, ref_losses, cm, model, ref = run_pair(gpt_tied, varlen_tokens, window=2, steps=len(SEQS) + 1)
    assert_bitwise(losses, ref_losses, model, ref)
    st = cm.stats()
    assert st["captures"] == 2 and st["dynamic_captures"] == 1, st
    (dyn,) = [v.captured.dynamic for v in cm._variants.values() if v.captured.dynamic is not None]
    assert [d for _, d, _ in dyn.dims] == [1, 1]  # the sequence dimension of both inputs, not the batch
    lo, hi = next(iter(dyn.ranges.values()))
    assert lo <= 8 and hi == 16  # torch.export derives the GPT's own maximum (its `T > seq` check)
    cm.close()


def test_greedy_generation_one_capture_logits_equal_eager_at_every_step():
    seq = 24
    torch.manual_seed(0)
    model = gpt(seq=seq, tie_weights=True)
    ref = copy.deepcopy(model)
    cm = shfx.compile(model, device=emulated(), window=2, dynamic={"seq": (1, seq)})
    cm.eval()
    ref.eval()
    ids = torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(7))
    ref_ids = ids.clone()
    with torch.no_grad():
        for _ in range(20):
            logits, ref_logits = cm(ids), ref(ref_ids)
            assert torch.equal(logits, ref_logits)
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            ref_ids = torch.cat([ref_ids, ref_logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert ids.shape[1] == seq and torch.equal(ids, ref_ids)
    st = cm.stats()
    assert st["captures"] == 1 and st["cache_hits"] == 19, st
    cm.close()


def small_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))


def small_compile(model: nn.Module, **kw) -> shfx.CompiledModel:
    return shfx.compile(model, device=kw.pop("device", emulated()), window=1, blocks=False, num_stages=2, **kw)


def test_cache_bound_evicts_least_recently_used_and_frees_it():
    torch.manual_seed(0)
    model = small_model()
    ref = copy.deepcopy(model)
    cm = small_compile(model, dynamic=False, max_captures=2)
    xs = [torch.randn(b, 8, generator=torch.Generator().manual_seed(b)) for b in (2, 3, 4)]
    with torch.no_grad():
        for x in xs[:2]:
            assert torch.equal(cm(x), ref(x))
        first = weakref.ref(next(iter(cm._variants.values())).captured.gm)
        assert torch.equal(cm(xs[2]), ref(xs[2]))  # a third shape: the batch-2 capture goes
        st = cm.stats()
        assert (st["captures"], st["evictions"], st["cached_captures"]) == (3, 1, 2), st
        gc.collect()
        assert first() is None, "an evicted capture's graph is freed"
        assert torch.equal(cm(xs[1]), ref(xs[1]))  # still cached: a hit, no capture
        assert cm.stats()["captures"] == 3 and cm.stats()["cache_hits"] == 1
        assert torch.equal(cm(xs[0]), ref(xs[0]))  # evicted: captured again, and equal again
        assert cm.stats()["captures"] == 4 and cm.stats()["evictions"] == 2
    cm.close()


def test_a_shape_beyond_the_declared_range_is_a_clear_error():
    torch.manual_seed(0)
    cm = small_compile(small_model(), dynamic={"batch": (1, 8)})
    with torch.no_grad():
        cm(torch.randn(4, 8))
        cm(torch.randn(8, 8))
        with pytest.raises(UsageError, match=r"dimension 0 of tensor input 0 is 9, outside the captured range \[1, 8\].*declare"):
            cm(torch.randn(9, 8))
    assert cm.stats()["captures"] == 1
    cm.close()
    cm = small_compile(small_model(), dynamic={"batch": (1, 8)})
    with pytest.raises(UsageError, match="is 12, outside the dynamic range batch=\\(1, 8\\)"):
        cm(torch.randn(12, 8))  # the first call already outside
    cm.close()


def test_bad_dynamic_options_say_what_is_accepted():
    with pytest.raises(ValueError, match="'batch'.*'seq'"):
        small_compile(small_model(), dynamic={"length": (1, 8)})
    with pytest.raises(ValueError, match="1 <= lo <= hi"):
        small_compile(small_model(), dynamic={"batch": (8, 1)})
    with pytest.raises(ValueError, match="max_captures"):
        small_compile(small_model(), max_captures=0)


class Specialises(nn.Module):
    """Branches on the batch size in Python: torch.export cannot keep it dynamic."""

    def __init__(self):
        super().__init__()
        self.body = small_model()

    def forward(self, x):
        y = self.body(x)
        return y * 2 if x.shape[0] > 4 else y


def test_a_model_that_specialises_falls_back_to_per_shape_captures_with_one_warning():
    torch.manual_seed(0)
    model = Specialises()
    ref = copy.deepcopy(model)
    cm = small_compile(model, dynamic={"batch": (1, 8)})
    with torch.no_grad():
        with pytest.warns(UserWarning, match="could not capture Specialises with dynamic dimensions.*Why: .*torch.export"):
            assert torch.equal(cm(torch.ones(2, 8)), ref(torch.ones(2, 8)))
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            for b in (6, 3):
                x = torch.randn(b, 8)
                assert torch.equal(cm(x), ref(x))
    st = cm.stats()
    assert st["dynamic_off"] and st["dynamic_captures"] == 0 and st["captures"] == 3
    cm.close()


def test_capacity_check_counts_the_largest_declared_shape():
    """A budget that holds a small batch's step but not the declared maximum's is refused at
    the first call, not overflowed later."""
    big = 1 << 14
    torch.manual_seed(0)
    with pytest.raises(OutOfDeviceMemory, match=r"largest shape of the dynamic range \(batch in \[1, 16384\]\)"):
        small_compile(small_model(), dynamic={"batch": (1, big)}, device=emulated("200KiB"))(torch.randn(2, 8))
    cm = small_compile(small_model(), dynamic={"batch": (1, 64)}, device=emulated("200KiB"))
    cm(torch.randn(2, 8)).sum().backward()
    cm.close()


def test_bf16_dynamic_capture_trains_like_the_eager_mixed_recipe_bitwise():
    from mixed_reference import train_mixed_eager
    from mixed_shfx import train_mixed_shfx

    steps = len(SEQS)
    got = train_mixed_shfx(gpt_tied, varlen_tokens, "bf16", steps, dynamic={"seq": (1, 16)})
    ref = train_mixed_eager(gpt_tied, varlen_tokens, "bf16", steps)
    assert got["loss_bits"] == ref["loss_bits"]
    for k, v in ref["master"].items():
        assert torch.equal(got["master"][k], v), k
    assert got["cm"].stats()["captures"] == 1
    got["cm"].close()


def test_automatic_mode_outside_the_range_captures_that_shape_or_a_wider_range():
    """Automatic ranges: batch 4 then 6 capture [2, 6] (the Linear model sets no limit; the
    largest size seen caps it). Batch 1 is below what torch.export keeps dynamic: captured on
    its own, once. Batch 8 is above the cap: one wider dynamic capture, then batch 7 reuses it."""
    torch.manual_seed(0)
    model = small_model()
    ref = copy.deepcopy(model)
    cm = small_compile(model)
    counts = []
    with torch.no_grad():
        for b in (4, 6, 5, 1, 1, 8, 7):
            x = torch.randn(b, 8)
            assert torch.equal(cm(x), ref(x))
            counts.append((cm.stats()["captures"], cm.stats()["dynamic_captures"]))
    assert counts == [(1, 0), (2, 1), (2, 1), (3, 1), (3, 1), (4, 2), (4, 2)]
    assert sorted(cm.stats()["dynamic_ranges"]) == ["d0_0 in [2, 6]", "d0_0 in [2, 8]"]
    cm.close()
