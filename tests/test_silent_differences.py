"""No silently different training: what shfx cannot run as eager PyTorch does is refused at
capture, before any step, with the construct, where it is and what to do; what it accepts
trains bitwise like eager (issue "No silently different training", items 1-3).

Before the fix: a custom autograd.Function's backward was replaced by the derivative of its
forward (gradient reversal trained with the ordinary gradient; Bloom's GeLUFunction: 49 of 53
gradients differed at the first step), backward hooks were never called, reentrant
checkpointing gave a loss without grad_fn, a first call under torch.no_grad() dropped the
model's own no_grad regions from the graph later calls trained with, cm.generate was a bare
AttributeError, and a changed feature size got the generic "plain tensor operations" advice.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import shfx


def emulated() -> shfx.EmulatedDevice:
    return shfx.EmulatedDevice(memory="64MiB", h2d=None, d2h=None)


def compiled(model: nn.Module, **kw) -> shfx.CompiledModel:
    return shfx.compile(
        model, device=emulated(), optimizer=shfx.optim.AdamW(lr=1e-2), blocks=False, num_stages=2, **kw
    )


def batch(step: int, width: int = 8) -> torch.Tensor:
    return torch.randn(4, width, generator=torch.Generator().manual_seed(500 + step))


def train_both(model: nn.Module, ref: nn.Module, steps: int = 3, **kw) -> None:
    """``steps`` steps of shfx on ``model`` and eager AdamW (fused, shfx's kernel) on ``ref``;
    losses, gradients and weights bitwise equal at every step."""
    cm = compiled(model, overlap_update=False, **kw)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for step in range(steps):
        x = batch(step)
        loss = cm(x).square().mean()
        loss.backward()
        ref_loss = ref(x).square().mean()
        ref_loss.backward()
        assert torch.equal(loss.detach(), ref_loss.detach()), step
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: {n}"
        cm.step()
        cm.zero_grad()
        opt.step()
        opt.zero_grad()
    cm.sync()
    for (n, p), q in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(p, q), n
    cm.close()


def assert_refused_before_any_step(model: nn.Module, *patterns: str, x: torch.Tensor | None = None) -> str:
    """The first call raises CaptureError matching every pattern; the model's tensors are the
    same objects with the same values (nothing moved into a host store); returns the message."""
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    cm = compiled(model)
    with pytest.raises(shfx.CaptureError) as e:
        cm(batch(0) if x is None else x)
    msg = str(e.value)
    for pat in patterns:
        assert pat in msg, f"{pat!r} not in:\n{msg}"
    for k, v in model.state_dict().items():
        assert v.data_ptr() == before[k][0] and torch.equal(v, before[k][1]), k
    assert all(p.grad is None for p in model.parameters())
    cm.close()
    return msg


# ---- custom autograd.Function ------------------------------------------------------------------


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


class RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


def reverse_plain(x: torch.Tensor) -> torch.Tensor:
    """The advice's rewrite of GradReverse: the same value, gradient -g."""
    return x.detach() + -1.0 * (x - x.detach())


def round_plain(x: torch.Tensor) -> torch.Tensor:
    """The advice's rewrite of RoundSTE: round(x) (x + (round(x) - x) is exact: Sterbenz), gradient g."""
    return x + (torch.round(x) - x).detach()


class Through(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def net(fn) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Sequential(Through(fn)), nn.Linear(16, 8))


@pytest.mark.parametrize(
    "fn, name",
    [(GradReverse.apply, "GradReverse"), (RoundSTE.apply, "RoundSTE")],
    ids=["gradient-reversal", "straight-through"],
)
def test_custom_function_is_refused(fn, name):
    msg = assert_refused_before_any_step(
        net(fn),
        f"custom autograd.Function {name}",
        f"test_silent_differences.{name}.apply",
        "in module '2.0' (Through)",
        "test_silent_differences.py",
        "return self.fn(x)",
        "never runs its backward()",
        "replace the custom autograd.Function with plain tensor operations",
        "or run this model eagerly",
    )
    assert msg.startswith("shfx refuses Sequential")


@pytest.mark.parametrize("plain, fn", [(reverse_plain, GradReverse.apply), (round_plain, RoundSTE.apply)], ids=["reversal", "ste"])
def test_the_advised_plain_ops_train_like_the_function_in_eager(plain, fn):
    train_both(net(plain), net(fn))


def test_function_without_a_graph_is_accepted():
    """A Function under no_grad (or on constants) has no backward to miss: accepted, exact."""

    def under_no_grad(x):
        with torch.no_grad():
            shift = GradReverse.apply(x).mean()
        return x - shift

    train_both(net(under_no_grad), net(under_no_grad))


# ---- hooks -------------------------------------------------------------------------------------


def scale_grad(g):
    return g * 0.5


class HookInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        h.register_hook(scale_grad)
        return h


def hooked_net(where: str) -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), HookInForward() if where == "tensor" else nn.Linear(8, 8))
    handles = []
    if where == "param":
        handles.append(model[0].weight.register_hook(scale_grad))
    elif where == "post-accumulate":
        handles.append(model[0].weight.register_post_accumulate_grad_hook(lambda p: None))
    elif where == "full":
        handles.append(model[2].register_full_backward_hook(lambda m, gi, go: None))
    elif where == "old":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            handles.append(model[2].register_backward_hook(lambda m, gi, go: None))
    elif where == "pre":
        handles.append(model[2].register_full_backward_pre_hook(lambda m, go: None))
    elif where == "global":
        handles.append(nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: None))
    elif where == "global-pre":
        handles.append(nn.modules.module.register_module_full_backward_pre_hook(lambda m, go: None))
    return model, handles


@pytest.mark.parametrize(
    "where, patterns",
    [
        ("tensor", ["registers a gradient hook in forward: tensor.register_hook(scale_grad", "in module '2' (HookInForward)",
                    "h.register_hook(scale_grad)", "x = x.detach() + s * (x - x.detach())"]),
        ("param", ["parameter '0.weight' has a gradient hook (register_hook: scale_grad", "overlap_update=False",
                   "edit p.grad between loss.backward() and cm.step()"]),
        ("post-accumulate", ["parameter '0.weight' has a post-accumulate-grad hook", "as soon as their gradients are complete"]),
        ("full", ["module '2' (Linear) has a backward hook (register_full_backward_hook", "activation gradients"]),
        ("old", ["module '2' (Linear) has a backward hook (register_backward_hook"]),
        ("pre", ["module '2' (Linear) has a backward pre-hook (register_full_backward_pre_hook"]),
        ("global", ["a global module backward hook (torch.nn.modules.module.register_module_full_backward_hook"]),
        ("global-pre", ["a global module backward pre-hook (torch.nn.modules.module.register_module_full_backward_pre_hook"]),
    ],
)
def test_backward_hook_is_refused(where, patterns):
    model, handles = hooked_net(where)
    try:
        msg = assert_refused_before_any_step(model, *patterns, "never call")
        assert msg.startswith("shfx refuses Sequential")
    finally:
        for h in handles:
            h.remove()


def test_after_removing_the_hook_it_trains_like_eager():
    model, handles = hooked_net("param")
    ref = copy.deepcopy(model)
    cm = compiled(model)
    with pytest.raises(shfx.CaptureError, match="gradient hook"):
        cm(batch(0))
    cm.close()
    handles[0].remove()
    if ref[0].weight._backward_hooks:  # (in case the deep copy took the hook along)
        ref[0].weight._backward_hooks.clear()
    train_both(model, ref)


# ---- activation checkpointing ------------------------------------------------------------------


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.inner = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


def checkpointed_net(reentrant: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), Checkpointed(reentrant), nn.Linear(8, 8))


def test_reentrant_checkpoint_is_refused():
    assert_refused_before_any_step(
        checkpointed_net(True),
        "uses reentrant activation checkpointing",
        "in module '2' (Checkpointed)",
        "return checkpoint(self.inner, x, use_reentrant=self.reentrant)",
        "no_grad region",
        "use_reentrant=False",
    )


def test_non_reentrant_checkpoint_trains_bitwise_like_eager():
    model = checkpointed_net(False)
    train_both(model, copy.deepcopy(model), steps=3)


# ---- Hugging Face ------------------------------------------------------------------------------


def tiny_bloom():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=64, hidden_size=16, n_layer=2, n_head=2, use_cache=False)
    return transformers.BloomForCausalLM(cfg).train()


def test_bloom_gelu_function_is_refused():
    model = tiny_bloom()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    msg = assert_refused_before_any_step(
        model,
        "shfx refuses BloomForCausalLM",
        "custom autograd.Function GeLUFunction",
        "in modules 'transformer.h.0.mlp.gelu_impl', 'transformer.h.1.mlp.gelu_impl' (BloomGelu)",
        "modeling_bloom.py",
        "GeLUFunction.apply(x)",
        x=ids,
    )
    assert "plain tensor operations" in msg


def test_hf_reentrant_gradient_checkpointing_is_refused():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, use_cache=False,
    )
    model = transformers.LlamaForCausalLM(cfg).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    assert_refused_before_any_step(
        model,
        "uses reentrant activation checkpointing",
        "in modules 'model.layers.0', 'model.layers.1' (LlamaDecoderLayer)",
        "gradient_checkpointing_kwargs={'use_reentrant': False}",
        x=ids,
    )


# ---- grad mode of the first call ---------------------------------------------------------------


class NoGradInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            gate = torch.sigmoid(h)
        return self.b(h * gate)


def test_first_call_under_no_grad_keeps_the_models_no_grad_regions():
    torch.manual_seed(0)
    model = NoGradInside()
    ref = copy.deepcopy(model)
    cm = compiled(model, overlap_update=False)
    with torch.no_grad():
        assert torch.equal(cm(batch(9)), ref(batch(9)))
    cm(batch(0)).square().mean().backward()
    ref(batch(0)).square().mean().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), n
    cm.close()


# ---- generate and a changed feature size -------------------------------------------------------


def test_generate_says_how_to_generate():
    cm = compiled(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    with pytest.raises(AttributeError, match=r"CompiledModel has no generate\(\)") as e:
        cm.generate
    assert "cm.sync()" in str(e.value) and "load_state_dict(cm.state_dict())" in str(e.value)
    assert "torch.no_grad()" in str(e.value)
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        cm.nonsense
    assert not hasattr(cm, "generate")
    cm.close()


def test_changed_feature_size_names_input_dimension_and_sizes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    cm = compiled(model)
    cm(batch(0)).sum().backward()
    cm.step()
    cm.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "could not capture with dynamic dimensions" warning
        with pytest.raises(shfx.CaptureError) as e:
            cm(batch(1, width=9))
    msg = str(e.value)
    assert "tensor input 0 (args[0]): dimension 1 is 9, earlier calls had 8 (shape [4, 9], captured with [4, 8])" in msg
    assert "pass inputs with dimension 1 of tensor input 0 = 8" in msg
    assert "plain tensor operations" not in msg
    assert cm.stats()["dynamic_off"] is None  # one wrong call does not turn dynamic capture off
    cm(batch(2)).sum().backward()  # the right size still trains
    cm.step()
    cm.close()


# ---- a torch.library custom op with its own autograd: exact -----------------------------------------
@torch.library.custom_op("shfx_test::reverse_grad", mutates_args=())
def _reverse_grad_op(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_reverse_grad_op.register_fake
def _(x):
    return torch.empty_like(x)


def _reverse_grad_backward(ctx, g):
    return -g  # not the derivative of the forward (identity): only running this backward gives it


torch.library.register_autograd("shfx_test::reverse_grad", _reverse_grad_backward)


def test_custom_op_with_registered_autograd_trains_like_eager():
    """A torch.library custom op stays one node of the captured graph, and autograd runs its
    registered backward in shfx's backward as eagerly (Mixtral's grouped_mm_fallback): accepted,
    bitwise — with a backward that is not the forward's derivative, so a derivative of the
    forward's operations could not pass."""
    train_both(net(_reverse_grad_op), net(_reverse_grad_op))
