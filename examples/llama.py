"""A LLaMA-style decoder in plain PyTorch: RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP.

    PARTC_LLAMA_SIZE=llama3-8b partc compile examples/llama.py

`PARTC_LLAMA_SIZE` picks a configuration from `SIZES` (default ``tiny``). The rotary tables are computed in
`forward` from the sequence length rather than kept in buffers, so a model built on the meta device needs only
`init_weights()` after ``to_empty``.

Module names: ``tok``, ``blocks.{i}.attn_norm``, ``blocks.{i}.attn.{q,k,v,o}``, ``blocks.{i}.mlp_norm``,
``blocks.{i}.mlp.{gate,up,down}``, ``norm``, ``lm_head`` (not tied to ``tok``). No linear layer has a bias.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, slots=True)
class LlamaConfig:
    vocab_size: int = 512
    """Tokens in the vocabulary (V)."""
    seq_len: int = 64
    """Tokens per sample (s) of `example_inputs`; rotary positions have no hard limit."""
    hidden: int = 64
    """Model width (h)."""
    heads: int = 4
    """Query heads; must divide `hidden`."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide `heads`."""
    layers: int = 4
    """Transformer blocks."""
    ffn_hidden: int = 176
    """Width of the SwiGLU MLP (LLaMA uses about 8h/3, rounded up)."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""


SIZES: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(),
    # Touvron et al. 2023, "Llama 2" (the released params.json of each model)
    "llama2-7b": LlamaConfig(vocab_size=32000, seq_len=4096, hidden=4096, heads=32, kv_heads=32, layers=32,
                             ffn_hidden=11008),
    "llama2-70b": LlamaConfig(vocab_size=32000, seq_len=4096, hidden=8192, heads=64, kv_heads=8, layers=80,
                              ffn_hidden=28672),
    # Llama 3 (Meta 2024)
    "llama3-8b": LlamaConfig(vocab_size=128256, seq_len=8192, hidden=4096, heads=32, kv_heads=8, layers=32,
                             ffn_hidden=14336, rope_theta=500000.0),
    "llama3-70b": LlamaConfig(vocab_size=128256, seq_len=8192, hidden=8192, heads=64, kv_heads=8, layers=80,
                              ffn_hidden=28672, rope_theta=500000.0),
    "llama3-405b": LlamaConfig(vocab_size=128256, seq_len=8192, hidden=16384, heads=128, kv_heads=8, layers=126,
                               ffn_hidden=53248, rope_theta=500000.0),
}


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight, computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def apply_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotates each (i, i + d/2) pair of `x` [b, heads, s, d] by position · theta^(-2i/d) (Su et al. 2021)."""
    s, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(s, device=x.device, dtype=torch.float32), inv_freq)  # [s, d/2]
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        assert config.hidden % config.heads == 0 and config.heads % config.kv_heads == 0
        self.heads, self.kv_heads = config.heads, config.kv_heads
        self.head_dim = config.hidden // config.heads
        self.theta = config.rope_theta
        self.q = nn.Linear(config.hidden, config.heads * self.head_dim, bias=False)
        self.k = nn.Linear(config.hidden, config.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(config.hidden, config.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(config.heads * self.head_dim, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, self.theta), apply_rope(k, self.theta)
        # grouped-query attention: each key/value head serves heads // kv_heads query heads
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) · up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(config.hidden, config.ffn_hidden, bias=False)
        self.up = nn.Linear(config.hidden, config.ffn_hidden, bias=False)
        self.down = nn.Linear(config.ffn_hidden, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.hidden)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self) -> None:
        """N(0, 0.02) for embeddings and linear layers, ones for the norms. Call again after ``to_empty``."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [b, s] -> logits [b, s, V]."""
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def config() -> LlamaConfig:
    size = os.environ.get("PARTC_LLAMA_SIZE", "tiny").lower()
    if size not in SIZES:
        raise ValueError(f"PARTC_LLAMA_SIZE={size!r} is not one of {', '.join(SIZES)}")
    return SIZES[size]


def model() -> Llama:
    return Llama(config())


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    c = config()
    return (torch.randint(0, c.vocab_size, (batch_size, c.seq_len)),)


def example_targets(batch_size: int) -> torch.Tensor:
    c = config()
    return torch.randint(0, c.vocab_size, (batch_size, c.seq_len))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
