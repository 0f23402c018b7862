"""A GPT in plain PyTorch (nanoGPT style): learned positions, pre-LN blocks, fused QKV, GELU MLP.

    PARTC_GPT_SIZE=39.1b partc compile examples/gpt.py

`PARTC_GPT_SIZE` picks a configuration from `SIZES` (default ``tiny``), so benchmarks reuse this one file. The
published configurations are the Megatron-LM paper's Table 1 (Narayanan et al. 2021, V = 51,200, s = 2048) and
GPT-3 175B (Brown et al. 2020, V = 50,257, s = 2048). Both papers tie the output layer to the token embedding, so
those entries set ``tie_weights``; with it the parameter count is Megatron's
P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)).

Module names (what partc's plans refer to): ``tok``, ``pos``, ``blocks.{i}.ln_1``, ``blocks.{i}.attn.qkv``,
``blocks.{i}.attn.proj``, ``blocks.{i}.ln_2``, ``blocks.{i}.mlp.fc1``, ``blocks.{i}.mlp.fc2``, ``ln_f``, ``lm_head``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int = 512
    """Tokens in the vocabulary (V)."""
    seq_len: int = 64
    """Maximum tokens per sample (s); also the number of learned positions."""
    hidden: int = 64
    """Model width (h)."""
    heads: int = 4
    """Attention heads (a); must divide `hidden`."""
    layers: int = 4
    """Transformer blocks (l)."""
    dropout: float = 0.0
    """Dropout probability after the embedding, the attention output and the MLP output."""
    tie_weights: bool = False
    """Share the token embedding with the output layer (``lm_head.weight is tok.weight``)."""


SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "tiny-deep": GPTConfig(layers=8),  # enough units for 4 chunks on each of 2 pipeline ranks (tests)
    # Megatron-LM PTD-P, Table 1: heads, hidden, layers
    "1.7b": GPTConfig(vocab_size=51200, seq_len=2048, heads=24, hidden=2304, layers=24, tie_weights=True),
    "3.6b": GPTConfig(vocab_size=51200, seq_len=2048, heads=32, hidden=3072, layers=30, tie_weights=True),
    "7.5b": GPTConfig(vocab_size=51200, seq_len=2048, heads=32, hidden=4096, layers=36, tie_weights=True),
    "18.4b": GPTConfig(vocab_size=51200, seq_len=2048, heads=48, hidden=6144, layers=40, tie_weights=True),
    "39.1b": GPTConfig(vocab_size=51200, seq_len=2048, heads=64, hidden=8192, layers=48, tie_weights=True),
    "76.1b": GPTConfig(vocab_size=51200, seq_len=2048, heads=80, hidden=10240, layers=60, tie_weights=True),
    "145.6b": GPTConfig(vocab_size=51200, seq_len=2048, heads=96, hidden=12288, layers=80, tie_weights=True),
    "174.6b": GPTConfig(vocab_size=51200, seq_len=2048, heads=96, hidden=12288, layers=96, tie_weights=True),
    "310.1b": GPTConfig(vocab_size=51200, seq_len=2048, heads=128, hidden=16384, layers=96, tie_weights=True),
    "529.6b": GPTConfig(vocab_size=51200, seq_len=2048, heads=128, hidden=20480, layers=105, tie_weights=True),
    "1008b": GPTConfig(vocab_size=51200, seq_len=2048, heads=160, hidden=25600, layers=128, tie_weights=True),
    # GPT-3 175B (Brown et al. 2020, Table 2.1)
    "175b": GPTConfig(vocab_size=50257, seq_len=2048, heads=96, hidden=12288, layers=96, tie_weights=True),
}


class Attention(nn.Module):
    """Causal multi-head self-attention with one fused QKV projection."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.hidden % config.heads == 0, "heads must divide hidden"
        self.heads = config.heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)
        # [b, s, h] -> [b, heads, s, head_dim]
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(b, s, h)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden, 4 * config.hidden)
        self.fc2 = nn.Linear(4 * config.hidden, config.hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.hidden)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.hidden)
        self.pos = nn.Embedding(config.seq_len, config.hidden)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.tok.weight
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2 initialization: N(0, 0.02), output projections scaled by 1/sqrt(2·layers), zero biases.
        Call again after materializing a meta-built model (``to_empty``)."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln_" in name:
                nn.init.ones_(p)
            elif name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.config.layers))
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [b, s] -> logits [b, s, V]."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.dropout(self.tok(ids) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def config() -> GPTConfig:
    size = os.environ.get("PARTC_GPT_SIZE", "tiny").lower()
    if size not in SIZES:
        raise ValueError(f"PARTC_GPT_SIZE={size!r} is not one of {', '.join(SIZES)}")
    return SIZES[size]


def model() -> GPT:
    return GPT(config())


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    c = config()
    return (torch.randint(0, c.vocab_size, (batch_size, c.seq_len)),)


def example_targets(batch_size: int) -> torch.Tensor:
    c = config()
    return torch.randint(0, c.vocab_size, (batch_size, c.seq_len))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
