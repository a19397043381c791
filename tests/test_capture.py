"""Capture: inputs and outputs of any structure, recapture on new signatures, clear errors."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
import torch.nn as nn
from zoo import HFStyleLM, LMOutput, gpt_tied, hf_batch, token_batch

import shfx
from shfx.passes.capture import OutputStructure, capture_model, flatten_inputs


def emulated():
    return shfx.EmulatedDevice(memory="64MiB", h2d=None, d2h=None)


def test_hf_style_kwargs_and_dataclass_output():
    torch.manual_seed(0)
    model = HFStyleLM()
    cm = shfx.compile(model, device=emulated(), window=2)
    _, kwargs, _ = hf_batch(0)
    out = cm(**kwargs)
    assert isinstance(out, LMOutput)
    assert out.hidden_states is None and out.loss.dim() == 0 and out.logits.shape == (2, 16, 64)
    out.loss.backward()
    no_labels = dict(kwargs)
    no_labels.pop("labels")
    out2 = cm(**no_labels)  # a new signature: recaptured
    assert out2.loss is None
    assert len(cm._variants) == 2
    cm.close()


Pair = namedtuple("Pair", ["a", "b"])


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x, scale: float = 1.0, flag: bool = True):
        for b in self.blocks:
            x = torch.relu(b(x)) * scale
        return {"out": x, "pair": Pair(x.sum(), None), "list": [x.mean(), 3], "flag": flag, "n": x.argmax()}


def test_nested_outputs_and_constant_inputs():
    torch.manual_seed(0)
    model = Structured()
    ref = Structured()
    ref.load_state_dict(model.state_dict())
    cm = shfx.compile(model, device=emulated(), window=1)
    x = torch.randn(2, 4)
    out = cm(x, scale=2.0, flag=False)
    exp = ref(x, scale=2.0, flag=False)
    assert set(out) == {"out", "pair", "list", "flag", "n"}
    assert isinstance(out["pair"], Pair) and out["pair"].b is None
    assert out["list"][1] == 3 and out["flag"] is False
    assert out["n"].dtype == torch.int64 and not out["n"].requires_grad
    torch.testing.assert_close(out["out"], exp["out"])
    out["pair"].a.backward()
    cm(x, scale=3.0)  # a non-tensor input value changes: recapture
    assert len(cm._variants) == 2
    cm.close()


def test_new_shape_recaptures_and_shares_weights():
    torch.manual_seed(0)
    cm = shfx.compile(gpt_tied(), device=emulated(), window=2, optimizer=shfx.optim.AdamW(lr=1e-2))
    (x, y), _, _ = token_batch(0)
    cm(x, y).backward()
    cm.step()
    cm.zero_grad()
    cm(x[:, :8].contiguous(), y[:, :8].contiguous()).backward()  # shorter sequence: a second capture, same host store
    cm.step()
    assert len(cm._variants) == 2
    a, b = cm._variants.values()
    assert a.graph.groups == b.graph.groups
    cm.close()


def test_input_requiring_grad_gets_its_gradient():
    torch.manual_seed(0)
    model = Structured()
    ref = Structured()
    ref.load_state_dict(model.state_dict())
    cm = shfx.compile(model, device=emulated(), window=2)
    x = torch.randn(2, 4, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    cm(x)["out"].pow(2).sum().backward()
    ref(x2)["out"].pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    cm.close()


def test_signature_and_flatten():
    tensors, sig, rebuild = flatten_inputs((torch.zeros(2, 3),), {"k": 3, "t": torch.ones(1)}, True)
    assert len(tensors) == 2
    assert "tensor[2, 3]:float32" in sig.describe() and "3" in sig.describe()
    args, kwargs = rebuild([torch.ones(2, 3), torch.zeros(1)])
    assert kwargs["k"] == 3 and args[0].sum() == 6


def test_output_structure_rebuilds_dataclass():
    s = OutputStructure(LMOutput(loss=torch.tensor(1.0), logits=torch.zeros(2), hidden_states=None))
    out = s.rebuild([torch.tensor(2.0), torch.ones(2)])
    assert isinstance(out, LMOutput) and out.loss.item() == 2.0 and out.hidden_states is None


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
            if x.sum() > 0:
                x = x * 2
        return x.sum()


class BuildsCache(nn.Module):
    """Stands in for a transformers model run with use_cache=True."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, use_cache=True):
        if use_cache:
            raise RuntimeError("Unsupported: cannot trace a DynamicCache in past_key_values")
        return self.lin(x).sum()


def test_uncapturable_data_dependent_control_flow():
    cm = shfx.compile(DataDependent(), device=emulated())
    with pytest.raises(shfx.CaptureError) as e:
        cm(torch.randn(2, 4))
    msg = str(e.value)
    assert "could not capture DataDependent" in msg
    assert "if x.sum() > 0:" in msg and "test_capture.py" in msg  # the model's own line
    assert "torch.cond" in msg  # the suggested fix
    cm.close()


def test_uncapturable_cache_suggests_use_cache_false():
    cm = shfx.compile(BuildsCache(), device=emulated())
    with pytest.raises(shfx.CaptureError, match="use_cache=False"):
        cm(torch.randn(2, 4))
    assert cm(torch.randn(2, 4), use_cache=False).dim() == 0
    cm.close()


class MutatesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)
        return self.lin(x).sum()


def test_input_mutation_is_refused():
    cm = shfx.compile(MutatesInput(), device=emulated())
    with pytest.raises(shfx.CaptureError, match="modifies its input tensors in place"):
        cm(torch.randn(2, 4))
    cm.close()


def test_capture_records_mutated_buffers():
    from zoo import BNNet, vector_batch

    args, _, _ = vector_batch(0)
    c = capture_model(BNNet(), args)
    assert c.mutated_buffers == {f"blocks.{i}.bn.{n}" for i in range(3) for n in ("running_mean", "running_var", "num_batches_tracked")}
    assert c.trainable == set(dict(BNNet().named_parameters()))
