"""A GPT in plain PyTorch (the shape of GPT-2 / STRONGHOLD's Megatron GPT).

Blocks live in ``transformer.h`` (a ModuleList), so shfx finds them; the embedding and the
output head share their weight (``tie_weights``); attention uses
``scaled_dot_product_attention`` with a causal mask, or an explicit mask buffer
(``mask_buffer=True``, like older GPT code) to exercise buffers.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from shfx.cost_model.shapes import GPTShape

__all__ = ["GPTShape", "GPT", "Block"]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTShape):
        super().__init__()
        assert cfg.hidden % cfg.heads == 0, "hidden must be divisible by heads"
        self.c_attn = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head = cfg.heads
        self.dropout = cfg.dropout
        self.mask_buffer = cfg.mask_buffer
        if cfg.mask_buffer:
            mask = torch.tril(torch.ones(cfg.seq, cfg.seq, dtype=torch.bool))
            self.register_buffer("mask", mask.view(1, 1, cfg.seq, cfg.seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        if self.mask_buffer:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
            att = F.dropout(F.softmax(att, dim=-1), p=p, training=self.training)
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTShape):
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden, 4 * cfg.hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTShape):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``GPT(shape)(idx, targets=None)`` returns the mean cross-entropy loss when ``targets``
    is given, else the logits (``shape``: a :class:`~shfx.cost_model.shapes.GPTShape`; its
    batch and planner fields are not the model's concern)."""

    def __init__(self, cfg: GPTShape):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab, cfg.hidden),
                wpe=nn.Embedding(cfg.seq, cfg.hidden),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.layers)]),
                ln_f=nn.LayerNorm(cfg.hidden, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.seq:
            raise ValueError(f"sequence of length {T} is longer than the model's seq {self.config.seq}")
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        if targets is None:
            return logits
        # The loss in fp32 whatever the model's dtype (as Hugging Face's causal LMs do): a no-op in
        # fp32; in 16 bits, log-softmax over the vocabulary in bf16 loses ~7% of the final loss.
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
