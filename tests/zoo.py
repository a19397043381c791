"""Small models for the tests, each exercising one thing shfx must get right."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from shfx.models import GPT, GPTShape

VOCAB, SEQ = 64, 16


def gpt(**kw) -> GPT:
    cfg = dict(vocab=VOCAB, seq=SEQ, layers=3, heads=4, hidden=32, dropout=0.0)
    cfg.update(kw)
    return GPT(GPTShape(**cfg))


def gpt_mask() -> nn.Module:
    """Attention through an explicit causal-mask buffer, untied head."""
    return gpt(mask_buffer=True, tie_weights=False)


def gpt_tied() -> nn.Module:
    """Embedding and output head share one weight (owned by the head stage, borrowed by the tail)."""
    return gpt(tie_weights=True)


def gpt_dropout() -> nn.Module:
    """Dropout everywhere: recompute must replay the same masks."""
    return gpt(dropout=0.2, tie_weights=True)


def token_batch(step: int, micro: int = 0, batch: int = 2) -> tuple[tuple, dict, dict]:
    """A batch is ``(args, kwargs, aux)``: the model's arguments and what a loss outside the
    model needs."""
    g = torch.Generator().manual_seed(1000 + 17 * step + micro)
    x = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    return (x, y), {}, {}


class SkipCNN(nn.Module):
    """A CNN with skip connections and no repeated block list: partitioned by parameter bytes."""

    def __init__(self, c: int = 8, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.conv_a = nn.Conv2d(c, c, 3, padding=1)
        self.conv_b = nn.Conv2d(c, c, 3, padding=1)
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.conv_c = nn.Conv2d(2 * c, 2 * c, 3, padding=1)
        self.proj = nn.Conv2d(c, 2 * c, 1, stride=2)
        self.head = nn.Linear(2 * c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        skip = x
        x = F.relu(self.conv_a(x))
        x = F.relu(self.conv_b(x) + skip)  # skip over two convs
        y = F.relu(self.down(x))
        y = F.relu(self.conv_c(y) + self.proj(x))  # skip across a downsample
        return self.head(y.mean(dim=(2, 3)))


def image_batch(step: int, micro: int = 0, batch: int = 4) -> tuple[tuple, dict, dict]:
    g = torch.Generator().manual_seed(2000 + 17 * step + micro)
    return (torch.randn(batch, 3, 12, 12, generator=g),), {}, {"target": torch.randint(0, 10, (batch,), generator=g)}


class BNBlock(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.fc = nn.Linear(h, h)
        self.bn = nn.BatchNorm1d(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.bn(self.fc(x)))


class BNNet(nn.Module):
    """Repeated blocks with BatchNorm: running statistics update once per forward."""

    def __init__(self, h: int = 32, n: int = 3, classes: int = 10):
        super().__init__()
        self.inp = nn.Linear(20, h)
        self.blocks = nn.ModuleList([BNBlock(h) for _ in range(n)])
        self.out = nn.Linear(h, classes)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.out(x), target)


def vector_batch(step: int, micro: int = 0, batch: int = 8) -> tuple[tuple, dict, dict]:
    g = torch.Generator().manual_seed(3000 + 17 * step + micro)
    return (torch.randn(batch, 20, generator=g), torch.randint(0, 10, (batch,), generator=g)), {}, {}


@dataclass
class LMOutput:
    """Hugging Face style output: a dataclass with optional fields."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple | None = None


class HFStyleLM(nn.Module):
    """Keyword arguments in, a dataclass out; padding mask as an input."""

    def __init__(self):
        super().__init__()
        self.gpt = gpt(tie_weights=True)

    def forward(self, input_ids=None, attention_mask=None, labels=None, use_cache=False, return_dict=True):
        t = self.gpt.transformer
        pos = torch.arange(input_ids.shape[1])
        x = t.wte(input_ids) + t.wpe(pos)
        if attention_mask is not None:
            x = x * attention_mask.unsqueeze(-1).to(x.dtype)
        for b in t.h:
            x = b(x)
        logits = self.gpt.lm_head(t.ln_f(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
        return LMOutput(loss=loss, logits=logits, hidden_states=None)


def hf_batch(step: int, micro: int = 0, batch: int = 2) -> tuple[tuple, dict, dict]:
    (x, y), _, _ = token_batch(step, micro, batch)
    mask = torch.ones_like(x)
    mask[0, -3:] = 0
    return (), {"input_ids": x, "attention_mask": mask, "labels": y}, {}


def seeded_steps(forward, optimizer, batches, seed: int | None = 123) -> list[torch.Tensor]:
    """One step per ``(x, y)`` batch (``loss = forward(x, y)``, backward, ``optimizer.step()``,
    ``zero_grad()``; a compiled model is its own optimizer); the losses. Seeded once, before the
    first step: every step's dropout masks come from the user's stream (no reseeding between
    steps, which would hide a feature that draws from it). ``seed=None``: not seeded (the stream
    where the run, or a checkpoint loaded, left it)."""
    if seed is not None:
        torch.manual_seed(seed)
    losses = []
    for x, y in batches:
        loss = forward(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def loss_of(out, aux: dict) -> torch.Tensor:
    """The loss whatever the model returned: a scalar, an output dataclass, or logits
    (then cross-entropy against ``aux["target"]``, computed outside the model)."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    if isinstance(out, LMOutput):
        return out.loss
    return F.cross_entropy(out, aux["target"])


# the models that compute their loss in fp32 whatever their dtype (the GPT: on logits.float());
# the others compute it in their parameters' dtype
LOSS_IN_FP32 = {"gpt_mask", "gpt_tied", "gpt_dropout"}

ZOO = {
    "gpt_mask": (gpt_mask, token_batch),
    "gpt_tied": (gpt_tied, token_batch),
    "gpt_dropout": (gpt_dropout, token_batch),
    "skip_cnn": (SkipCNN, image_batch),
    "bn_net": (BNNet, vector_batch),
    "hf_style": (HFStyleLM, hf_batch),
}


def capture_gpt_template(fam: GPTShape):
    """A two-block GPT of ``fam``'s vocab, seq, heads and hidden, captured on the meta device and
    partitioned: the template ``shfx.cost_model.analytic.repeat_blocks`` copies to any depth
    (the planner's closed form is tested against it)."""
    from shfx.passes.capture import capture_model
    from shfx.passes.partition import partition_stages

    cfg = GPTShape(vocab=fam.vocab, seq=fam.seq, layers=2, heads=fam.heads, hidden=fam.hidden)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.zeros(fam.batch, fam.seq, dtype=torch.long)
    return partition_stages(capture_model(model, (idx, idx)), model=model)


class SharedLayer(nn.Module):
    """ALBERT's shape: one layer (several tensors) applied ``n`` times, each application a stage
    of its own that borrows every tensor of the first one's group."""

    def __init__(self, h: int = 32, n: int = 4, classes: int = 10):
        super().__init__()
        self.inp = nn.Linear(20, h)
        self.layer = nn.Sequential(nn.Linear(h, h), nn.Tanh(), nn.Linear(h, h), nn.LayerNorm(h))
        # the first application only: their tensors come between the layer's in its owner's
        # group (first-use order), so the later applications borrow three separate ranges
        self.first = nn.ModuleList([nn.Linear(h, h), nn.Linear(h, h)])
        self.mix = nn.ModuleList(nn.Linear(h, h) for _ in range(n))  # its own after each application
        self.out = nn.Linear(h, classes)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i, m in enumerate(self.mix):
            h = torch.tanh(self.layer[0](x))
            if i == 0:
                h = self.first[0](h)
            h = self.layer[2](h)
            if i == 0:
                h = self.first[1](h)
            x = m(x + self.layer[3](h))
        return F.cross_entropy(self.out(x), target)
