"""Attention in a forward without autograd runs as in eager's training forward.

On the CPU, ``scaled_dot_product_attention`` computes another way (other bits) when its inputs
require grad, as they do in eager's training forward. shfx runs a training step's forward
without autograd (each stage is recomputed in its backward), so q, k and v did not require grad
there: T5, mT5 and UMT5 (whose learned position bias is the mask) and Swin trained with a
first loss a few ulps from eager's (benchmarks/hf_zoo.py). ``passes/attention.py``
(``pin_attention_grad_mode``, ``sdpa_as_trained``) runs the op with the inputs flagged as in
training; no reseeding between steps here, the losses compared from the first.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from equivalence import run_pair

import shfx
from shfx.passes.attention import requires_grad_in_training


class BiasAttention(nn.Module):
    """T5's attention: no scaling, a learned position bias (one per head) as the mask."""

    def __init__(self, h: int = 32, heads: int = 4, seq: int = 16):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))
        self.bias = nn.Parameter(torch.randn(1, heads, seq, seq) * 0.1)
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        split = lambda t: t.view(b, s, self.heads, h // self.heads).transpose(1, 2)  # noqa: E731
        mask = self.bias.expand(b, -1, -1, -1) * self.gain  # computed, as T5's (not a view of a parameter)
        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), attn_mask=mask, scale=1.0)
        return x + self.o(y.transpose(1, 2).reshape(b, s, h))


class Net(nn.Module):
    def __init__(self, n: int = 3):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(BiasAttention() for _ in range(n))
        self.out = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.out(x).flatten(0, 1), target.flatten())


def batch(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(500 + 7 * step + micro)
    return (torch.randn(2, 16, 8, generator=g), torch.randint(0, 5, (2, 16), generator=g)), {}, {}


def assert_bitwise(window: int, steps: int) -> object:
    """Losses and every parameter bitwise equal to eager's (fused AdamW), one seed, no reseeding;
    returns the compiled model (open)."""
    losses, ref_losses, cm, model, ref = run_pair(Net, batch, window=window, steps=steps)
    try:
        assert [float(x).hex() for x in losses] == [float(x).hex() for x in ref_losses]
        for (k, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
            assert torch.equal(a, b), k
    except AssertionError:
        cm.close()
        raise
    return cm


@pytest.mark.parametrize("window", [1, 2])
def test_learned_bias_attention_trains_like_eager(window):
    cm = assert_bitwise(window, 3)
    try:
        gm = cm.variant.captured.gm
        pinned = [n for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "__name__", "") == "sdpa_as_trained"]
        assert len(pinned) == 3 and all(n.kwargs["_shfx_grads"] == (True, True, True, True) for n in pinned)
    finally:
        cm.close()


def test_without_the_pin_the_first_loss_differs(monkeypatch):
    """The companion: the same model with the checkpointed forward's attention run as it comes
    (the inputs not requiring grad) is not eager's first loss, so the test above can fail."""
    from shfx.runtime import engine

    monkeypatch.setattr(engine, "training_forward", contextlib.nullcontext)
    with pytest.raises(AssertionError):
        assert_bitwise(2, 1)


def test_requires_grad_in_training_follows_the_parameters():
    """The flags: from trainable parameters through floating-point ops; not through a
    ``zeros_like`` or a ``torch.no_grad()`` region; a frozen parameter's uses do not."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))
            self.frozen = nn.Parameter(torch.ones(4), requires_grad=False)

        def forward(self, x):
            a = x * self.w
            z = torch.zeros_like(a)
            f = x * self.frozen
            with torch.no_grad():
                n = x * self.w
            return a + z + f + n

    ep = torch.export.export(M(), (torch.ones(4),))
    gm = ep.graph_module
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ph = {spec.target: n for n, spec in zip(phs, ep.graph_signature.input_specs)}
    rg = requires_grad_in_training(gm, {ph["w"].name})
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    mul = {a.name: n for n in calls if n.target is torch.ops.aten.mul.Tensor for a in n.args if a in (ph["w"], ph["frozen"])}
    assert rg[mul[ph["w"].name]] is True and rg[mul[ph["frozen"].name]] is False
    assert not any(rg[n] for n in calls if "zeros_like" in str(n.target))
    region = [n for n in calls if "getitem" in str(n.target)]
    assert region and not any(rg[n] for n in region)  # x * w under no_grad
    assert rg[calls[-1]] is True  # the sum


def test_evaluation_runs_attention_as_eager_no_grad():
    """Under torch.no_grad() (an evaluation) eager runs the op with inputs not requiring grad,
    and so does shfx: the pin acts only inside a training step's forward."""
    torch.manual_seed(0)
    model = Net()
    ref = __import__("copy").deepcopy(model)
    cm = shfx.compile(model, device=shfx.EmulatedDevice(memory="256MiB", h2d=None, d2h=None), window=2,
                      optimizer=shfx.optim.AdamW(lr=1e-2))  # fmt: skip
    try:
        (x, y), _, _ = batch(0)
        with torch.no_grad():
            assert torch.equal(cm(x, y), ref(x, y))
    finally:
        cm.close()
