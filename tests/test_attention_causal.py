"""The capture gives ``scaled_dot_product_attention`` back the call eager PyTorch makes
(``passes/attention.py``): a Hugging Face Llama's export-only causal mask becomes
``is_causal=True`` (and its repeated keys/values ``enable_gqa=True``), so bf16 training is
bitwise the eager recipe's; a mask that reads a user input stays; a model's own hand-written
mask stays (eager runs it masked); the mask analysis itself, run on any source
(``sources=None``), rewrites hand-written masks only when they are exactly the causal pattern.

The Llama tests skip without transformers (built from a config, nothing downloaded).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mixed_reference import train_mixed_eager
from mixed_shfx import train_mixed_shfx

from shfx.passes.attention import restore_causal_attention, sdpa_as_trained
from shfx.passes.capture import DynamicDim, capture_model, capture_model_dynamic

SDPA = torch.ops.aten.scaled_dot_product_attention.default
VOCAB, SEQ = 64, 16


def sdpa_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The attention nodes (a captured graph calls the op through ``sdpa_as_trained`` where its
    inputs require grad in training: tests/test_attention_grad_mode.py)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (SDPA, sdpa_as_trained)]


def mask_of(n: torch.fx.Node):
    return n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")


def causal_of(n: torch.fx.Node) -> bool:
    return bool(n.args[5] if len(n.args) > 5 else n.kwargs.get("is_causal", False))


# ---- a Hugging Face Llama ------------------------------------------------------------------------


def llama(kv_heads: int = 1):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=kv_heads, max_position_embeddings=SEQ, attention_dropout=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    assert model.config._attn_implementation == "sdpa"  # the default
    return model


def batch(step: int, micro: int = 0, padded: bool = False):
    g = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    kwargs = {"input_ids": x, "labels": x}
    if padded:
        mask = torch.ones_like(x)
        mask[0, -3:] = 0
        kwargs["attention_mask"] = mask
    return (), kwargs, {}


def loss_fn(out, aux):
    return out.loss


def same_bits(a: dict, b: dict) -> bool:
    return a["loss_bits"] == b["loss_bits"] and all(torch.equal(a["master"][k], b["master"][k]) for k in a["master"])


def train_pair(make_batch, monkeypatch=None, *, without_pass: bool = False):
    if without_pass:
        # the capture as it was before the pass (the pass, a no-op)
        monkeypatch.setattr("shfx.passes.capture.restore_causal_attention_in_export", lambda ep: [])
    eager = train_mixed_eager(llama, make_batch, "bf16", 3, loss_fn=loss_fn)
    ours = train_mixed_shfx(llama, make_batch, "bf16", 3, loss_fn=loss_fn)
    ours["cm"].close()
    return eager, ours


def test_llama_bf16_trains_like_the_eager_recipe():
    eager, ours = train_pair(batch)
    assert same_bits(eager, ours), (eager["losses"], ours["losses"])


def test_llama_bf16_differs_without_the_pass(monkeypatch):
    # what the pass fixes: the export-only mask and repeat_kv (eager: is_causal, enable_gqa)
    eager, ours = train_pair(batch, monkeypatch, without_pass=True)
    assert not same_bits(eager, ours)


def test_llama_graph_has_causal_sdpa_and_no_mask():
    torch.manual_seed(0)
    model = llama()
    _, kwargs, _ = batch(0)
    gm = capture_model(model, (), kwargs, working_dtype=torch.bfloat16).gm
    nodes = sdpa_nodes(gm)
    assert len(nodes) == 2
    for n in nodes:
        assert causal_of(n) and mask_of(n) is None
        assert n.kwargs.get("enable_gqa") is True
        assert n.args[1].meta["val"].shape[1] == 1  # the unrepeated key (1 KV head)
    # the mask's computation is gone (no bool [B, 1, S, S] left in the graph)
    assert not any(
        isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dtype == torch.bool and n.meta["val"].dim() == 4
        for n in gm.graph.nodes
    )
    assert restore_causal_attention(gm) == []  # nothing left to rewrite


def test_llama_dynamic_capture_is_rewritten():
    torch.manual_seed(0)
    model = llama()
    _, kwargs, _ = batch(0)
    dims = [DynamicDim(0, 1, "seq", lo=2, hi=SEQ), DynamicDim(1, 1, "seq", lo=2, hi=SEQ)]
    gm = capture_model_dynamic(model, (), kwargs, dims, working_dtype=torch.bfloat16).gm
    assert all(causal_of(n) and mask_of(n) is None for n in sdpa_nodes(gm))


def test_padding_mask_is_kept_and_trains_like_eager():
    torch.manual_seed(0)
    _, kwargs, _ = batch(0, padded=True)
    gm = capture_model(llama(), (), kwargs, working_dtype=torch.bfloat16).gm
    nodes = sdpa_nodes(gm)
    assert nodes and all(mask_of(n) is not None and not causal_of(n) for n in nodes)
    # eager builds the same mask (a padded batch): the same recipe, bitwise
    eager, ours = train_pair(lambda s, m: batch(s, m, padded=True))
    assert same_bits(eager, ours), (eager["losses"], ours["losses"])


# ---- hand-written attention ------------------------------------------------------------------


class Attention(nn.Module):
    """One attention layer whose mask ``mask(S)`` is built inside forward."""

    def __init__(self, mask, d: int = 16, heads: int = 2):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.heads, self.mask = heads, mask

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(s, x))
        return y.transpose(1, 2).reshape(b, s, d).sum()


def tril_bool(s, x):
    return torch.ones(s, s, dtype=torch.bool).tril()


def tril_additive(s, x):
    # 0 / finfo.min, as Hugging Face's eager masks
    allowed = torch.arange(s)[:, None] >= torch.arange(s)[None, :]
    return torch.zeros(s, s, dtype=x.dtype).masked_fill(~allowed, torch.finfo(x.dtype).min)[None, None]


def tril_inf(s, x):
    return torch.full((s, s), float("-inf")).triu(1).expand(x.shape[0], 1, s, s)


def band(s, x):
    return torch.ones(s, s, dtype=torch.bool).tril() & torch.ones(s, s, dtype=torch.bool).triu(-2)


def upper(s, x):
    return torch.ones(s, s, dtype=torch.bool).triu()


def from_input(s, x):
    return torch.ones(s, s, dtype=torch.bool).tril() & (x[0, :, :1] > -100)  # reads x's values


@pytest.fixture
def any_source(monkeypatch):
    """The capture's pass on SDPA calls from any source (by default only those traced from
    transformers, where eager would have called SDPA causally itself)."""
    from shfx.passes import attention

    monkeypatch.setattr(
        "shfx.passes.capture.restore_causal_attention_in_export",
        lambda ep: attention.restore_causal_attention_in_export(ep, sources=None),
    )


def test_a_models_own_causal_mask_is_kept():
    # eager runs the model's masked SDPA call: so does shfx (on a GPU another kernel than is_causal)
    model = Attention(tril_bool)
    captured = capture_model(model, (torch.randn(2, 8, 16),), {})
    (node,) = sdpa_nodes(captured.gm)
    assert mask_of(node) is not None and not causal_of(node)


@pytest.mark.parametrize("mask, rewritten", [
    (tril_bool, True), (tril_additive, True), (tril_inf, True),
    (band, False), (upper, False), (from_input, False),
])  # fmt: skip
def test_hand_written_masks(mask, rewritten, any_source):
    torch.manual_seed(0)
    model = Attention(mask)
    x = torch.randn(2, 8, 16)
    captured = capture_model(model, (x,), {})
    (node,) = sdpa_nodes(captured.gm)
    assert (causal_of(node) and mask_of(node) is None) == rewritten
    assert (mask_of(node) is not None) == (not rewritten)
    # and the graph computes what the model computes (the causal kernel: bitwise on the CPU)
    params = {p.name: captured.params[p.key] for p in captured.placeholders if p.kind == "param"}
    args = [params[p.name] if p.kind == "param" else x for p in captured.placeholders]
    (out,) = captured.gm(*args)
    assert torch.equal(out, model(x))


def test_non_square_mask_is_left(any_source):
    # q_len != kv_len: is_causal is top-left aligned, a cache's mask bottom-right; not rewritten
    class Cross(nn.Module):
        def forward(self, q, kv):
            m = torch.ones(q.shape[-2], kv.shape[-2], dtype=torch.bool).tril()
            return F.scaled_dot_product_attention(q, kv, kv, attn_mask=m)

    captured = capture_model(Cross(), (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8)), {})
    (node,) = sdpa_nodes(captured.gm)
    assert mask_of(node) is not None and not causal_of(node)


def causal_only_at_8(s, x):
    # the causal pattern at S = 8, not at other sizes (columns >= 8 always visible)
    return torch.ones(s, s, dtype=torch.bool).tril() | (torch.arange(s) >= 8)[None, :]


@pytest.mark.parametrize("mask, rewritten", [(tril_bool, True), (causal_only_at_8, False)])
def test_dynamic_masks_are_checked_at_a_second_size(mask, rewritten, any_source):
    torch.manual_seed(0)
    model = Attention(mask)
    x = torch.randn(2, 8, 16)
    captured = capture_model_dynamic(model, (x,), {}, [DynamicDim(0, 1, "seq", lo=2, hi=16)])
    (node,) = sdpa_nodes(captured.gm)
    assert (causal_of(node) and mask_of(node) is None) == rewritten
