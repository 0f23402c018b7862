"""Models written the usual way for fp32 training that meet fp32 tensors of their own in forward, for the tests of
the default precision (bf16: parameters and activations in bf16, `partc.precision.Autocast`'s casts).

``rope_llama``: a LLaMA-style decoder whose rotary cos/sin tables are fp32 buffers made in ``__init__`` and applied
to q and k as they are (q and k come out fp32, v stays bf16: the attention op sees mixed dtypes).
``fp32_in_forward``: a pre-norm GPT-style decoder that makes fp32 tensors in ``forward``: sinusoidal positions added
to the token embeddings (so the residual stream is fp32 from there on, and LayerNorm meets an fp32 input with a bf16
weight) and an fp32 additive causal mask passed to the attention op.

Both run unchanged in fp32. Two layers, h 64, 4 heads, vocabulary 256, 32 tokens; Megatron-style names
(``q_proj``/``k_proj``/``v_proj``/``o_proj``, ``gate_proj``/``up_proj``/``down_proj``, ``tok``, ``lm_head``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 256, 32, 64, 4, 2, 128, 2


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RopeAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.q_proj = nn.Linear(HIDDEN, HEADS * self.head_dim, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias=False)
        self.o_proj = nn.Linear(HEADS * self.head_dim, HIDDEN, bias=False)
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        angles = torch.outer(torch.arange(SEQ, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = rotate(q, self.cos[:s], self.sin[:s]), rotate(k, self.cos[:s], self.sin[:s])
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(HIDDEN), RopeAttention()
        self.mlp_norm, self.mlp = RMSNorm(HIDDEN), SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class RopeLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(LlamaBlock() for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


class MaskedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.q_proj = nn.Linear(HIDDEN, HIDDEN)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)  # fp32, made here
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class GeluMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(HIDDEN, FFN)
        self.down_proj = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class GPTBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(HIDDEN), MaskedAttention()
        self.ln_2, self.mlp = nn.LayerNorm(HIDDEN), GeluMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Fp32InForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(GPTBlock() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        pos = torch.arange(s, device=ids.device, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, HIDDEN, 2, device=ids.device, dtype=torch.float32)
                         * (-math.log(10000.0) / HIDDEN))
        positions = torch.cat((torch.sin(pos * freq), torch.cos(pos * freq)), dim=-1)  # fp32, made here
        x = self.tok(ids) + positions
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def rope_llama() -> nn.Module:
    return RopeLlama()


def fp32_in_forward() -> nn.Module:
    return Fp32InForward()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
