"""Encoder-decoder models and several block lists: detection of every list of repeated blocks,
a stage per block of each, ``blocks=`` with several paths and its errors, the warning when the
stages are not what ``num_stages`` asks, a value read by many stages (the encoder output every
decoder block cross-attends to) and its gradient, and T5 (Hugging Face transformers, built from
a config, no download) trained bitwise like eager PyTorch.

The toy encoder-decoder needs nothing but torch; the T5 tests skip without transformers.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from equivalence import run_pair
from zoo import gpt_tied, token_batch

import shfx
from shfx.passes.capture import capture_model
from shfx.passes.partition import PartitionError, find_block_lists, partition_stages

# ---- a toy encoder-decoder (torch only) -----------------------------------------------------


class EncBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)

    def forward(self, h):
        return h + self.proj(torch.tanh(self.fc(self.norm(h))))


class DecBlock(nn.Module):
    """Reads the encoder output twice (a key and a value projection), as cross-attention does."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)

    def forward(self, y, mem):
        q, k, v = self.q(self.norm(y)), self.k(mem), self.v(mem)
        att = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        return y + F.dropout(att @ v, 0.1, self.training)


class ToyEncDec(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, n_enc: int = 2, n_dec: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.enc = nn.ModuleList(EncBlock(d) for _ in range(n_enc))
        self.enc_norm = nn.LayerNorm(d)
        self.dec = nn.ModuleList(DecBlock(d) for _ in range(n_dec))
        self.head = nn.Linear(d, vocab)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(2))  # small, not blocks

    def forward(self, src, tgt, labels):
        h = self.emb(src)
        for b in self.enc:
            h = b(h)
        mem = self.enc_norm(h)
        y = self.emb(tgt)
        for b in self.dec:
            y = b(y, mem)
        logits = self.head(self.norms[1](self.norms[0](y)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def toy_batch(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 + 10 * step + micro)
    src, tgt, lab = (torch.randint(0, 32, (2, n), generator=g) for n in (7, 5, 5))
    return (src, tgt, lab), {}, {}


def toy_stages(model, **kw):
    return partition_stages(capture_model(model, toy_batch(0)[0]), model=model, **kw)


TOY_NAMES = ["head", "enc.0", "enc.1", "between", "dec.0", "dec.1", "dec.2", "tail"]


def test_every_block_list_is_detected_and_small_lists_are_not():
    assert sorted(find_block_lists(ToyEncDec())) == ["dec", "enc"]  # not the two LayerNorms
    assert find_block_lists(gpt_tied()) == ["transformer.h"]  # one list: unchanged


def test_a_stage_per_block_of_each_list_and_a_between_stage():
    g = toy_stages(ToyEncDec())
    assert [s.name for s in g.stages] == TOY_NAMES
    assert g.method == "blocks:enc,dec"
    between = g.stages[3]
    assert "enc_norm.weight" in between.params and "emb.weight" in between.params  # borrowed embedding
    assert g.owner["emb.weight"] == 0
    # the encoder output (the between stage's output) is read by every decoder stage
    (mem,) = [v for v in between.outputs if g.values[v].shape == (2, 7, 16)]
    assert g.values[mem].consumers == (4, 5, 6)
    assert g.values[mem].differentiable


def test_several_paths_and_modules_in_blocks():
    model = ToyEncDec()
    assert [s.name for s in toy_stages(model, blocks=["enc", "dec"]).stages] == TOY_NAMES
    assert [s.name for s in toy_stages(model, blocks=("dec", model.enc)).stages] == TOY_NAMES
    one = toy_stages(model, blocks="dec")
    assert [s.name for s in one.stages] == ["head", "dec.0", "dec.1", "dec.2", "tail"] and one.method == "blocks:dec"


@pytest.mark.parametrize(
    "blocks, match",
    [
        (["enc", "decoder"], r"blocks=\['enc', 'decoder'\]: the model has no submodule 'decoder'"),
        (["enc", "enc.0"], r"'enc' and 'enc.0' are nested"),
        (["dec", "dec"], r"'dec' and 'dec' are the same module"),
        ([nn.Linear(2, 2)], r"the module Linear is not part of the model"),
    ],
)
def test_a_wrong_path_lists_the_candidate_lists(blocks, match):
    with pytest.raises(PartitionError, match=match) as e:
        toy_stages(ToyEncDec(), blocks=blocks)
    msg = str(e.value)
    assert "dec (3 x DecBlock" in msg and "enc (2 x EncBlock" in msg and "norms (2 x LayerNorm" in msg
    assert "blocks=False to split by parameter bytes" in msg


def test_empty_and_wrongly_typed_blocks_are_refused():
    with pytest.raises(PartitionError, match=r"blocks=\[\] names no module"):
        toy_stages(ToyEncDec(), blocks=[])
    with pytest.raises(PartitionError, match="blocks= must be a module path .* got 3"):
        toy_stages(ToyEncDec(), blocks=3)


def test_a_list_that_never_runs_is_refused():
    class Unused(ToyEncDec):
        def __init__(self):
            super().__init__()
            self.spare = nn.ModuleList(EncBlock(16) for _ in range(2))

    with pytest.raises(PartitionError, match=r"no operation of the graph runs inside 'spare' \(named in blocks=\)"):
        toy_stages(Unused(), blocks=["enc", "spare"])


def test_interleaved_lists_are_refused_when_named_and_fall_back_when_detected():
    class Interleaved(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.b = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            for a, b in zip(self.a, self.b):
                x = b(torch.relu(a(x)))
            return x.sum()

    model = Interleaved()
    cap = capture_model(model, (torch.randn(3, 8),))
    with pytest.raises(PartitionError, match=r"the blocks of 'a' do not run one after another: block a.1"):
        partition_stages(cap, model=model, blocks=["a", "b"])
    with pytest.warns(UserWarning, match=r"the lists 'a', 'b' were detected, but .* Staged by 'a' alone"):
        g = partition_stages(cap, model=model)
    assert g.method == "blocks:a" and [s.name for s in g.stages] == ["a.0", "a.1", "tail"]


def test_num_stages_that_cannot_be_honoured_is_warned_and_noted():
    model = ToyEncDec()
    with pytest.warns(UserWarning, match=r"num_stages=6 is not used when staging by repeated blocks \('enc', 'dec'\)"):
        g = toy_stages(model, num_stages=6)
    assert len(g.stages) == len(TOY_NAMES)
    assert any("num_stages=6 is not used" in n for n in g.notes)
    assert "note: num_stages=6 is not used" in g.describe()
    # by bytes the same model gives what it is asked, without a note
    g = toy_stages(model, blocks=False, num_stages=6)
    assert len(g.stages) == 6 and g.notes == ()


@pytest.mark.parametrize("window", [1, 2, 99])
def test_toy_encoder_decoder_trains_bitwise_like_eager(window):
    """The encoder output's gradient, summed over three decoder stages (two uses each), is
    eager's running sum to the bit; dropout in the decoder blocks replays exactly."""
    losses, ref_losses, cm, model, ref = run_pair(
        ToyEncDec, toy_batch, window=window, steps=3, loss_fn=lambda out, aux: out
    )
    assert [s.name for s in cm.stages.stages] == TOY_NAMES
    assert losses == ref_losses
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    cm.close()


# ---- T5 (transformers) ------------------------------------------------------------------------


def t5(dropout: float = 0.0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=dropout, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(cfg)


def t5_batch(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(10 * step + micro)
    return (), {"input_ids": torch.randint(1, 64, (2, 8), generator=g), "labels": torch.randint(1, 64, (2, 6), generator=g)}, {}


T5_NAMES = ["head", "encoder.block.0", "encoder.block.1", "between", "decoder.block.0", "decoder.block.1", "tail"]


def t5_stages(model, **kw):
    _, kwargs, _ = t5_batch(0)
    return partition_stages(capture_model(model, (), kwargs), model=model, **kw)


def test_t5_both_lists_detected_a_stage_per_block():
    model = t5()
    assert sorted(find_block_lists(model)) == ["decoder.block", "encoder.block"]
    g = t5_stages(model)
    assert [s.name for s in g.stages] == T5_NAMES and g.method == "blocks:encoder.block,decoder.block"
    # the shared embedding is owned by the head, borrowed by the between stage (decoder input)
    assert g.owner["shared.weight"] == 0 and "shared.weight" in g.stages[3].params
    assert "encoder.final_layer_norm.weight" in g.stages[3].params
    # the encoder's output, from the between stage, is read by both decoder blocks
    read_by_decoder = [v for v in g.stages[3].outputs if g.values[v].consumers == (4, 5) and g.values[v].differentiable]
    assert [g.values[v].shape for v in read_by_decoder] == [(2, 8, 32)]
    named = t5_stages(model, blocks=["encoder.block", "decoder.block"])
    assert [s.name for s in named.stages] == T5_NAMES
    with pytest.raises(PartitionError, match=r"no submodule 'decoder.blocks'.*decoder.block \(2 x T5Block.*encoder.block \(2 x T5Block"):
        t5_stages(model, blocks=["encoder.block", "decoder.blocks"])


def test_t5_gradients_after_one_backward_are_eager_bitwise():
    """Every parameter's .grad after one backward, the encoder's included (its output's
    gradient sums the cross-attention of both decoder stages)."""
    model = t5()
    ref = copy.deepcopy(model)
    cm = shfx.compile(
        model, device=shfx.EmulatedDevice(memory="64MiB"), window=2, optimizer=shfx.optim.AdamW(), recompute="early-stop"
    )
    _, kwargs, _ = t5_batch(0)
    cm(**kwargs).loss.backward()
    ref(**kwargs).loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    cm.close()


# NOTE: recompute="early-stop" (the default on a GPU): T5's attention passes its learned
# position bias to scaled_dot_product_attention as the mask, and on the CPU PyTorch picks the
# math kernel when that mask requires grad and the flash kernel under torch.no_grad(); the
# emulated device's "auto" runs tiny stages' forwards under no_grad, so a forward would differ
# from eager's in the last bit (docs/usage.md, "Encoder-decoder models and several block lists").
@pytest.mark.parametrize(
    "dropout, window",
    [
        (0.0, 1),
        (0.1, 2),
        pytest.param(0.0, 2, marks=pytest.mark.slow),
        pytest.param(0.0, 99, marks=pytest.mark.slow),
        pytest.param(0.1, 1, marks=pytest.mark.slow),
        pytest.param(0.1, 99, marks=pytest.mark.slow),
    ],
)
def test_t5_trains_bitwise_like_eager(dropout, window):
    losses, ref_losses, cm, model, ref = run_pair(
        lambda: t5(dropout), t5_batch, window=window, steps=3, loss_fn=lambda out, aux: out.loss, recompute="early-stop"
    )
    assert [s.name for s in cm.stages.stages] == T5_NAMES
    assert cm.program.num_slots == min(window, len(T5_NAMES))
    assert losses == ref_losses
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    cm.close()
