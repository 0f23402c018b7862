"""A Vision Transformer as timm writes it: a convolutional patch embedding, a class token, pre-LN blocks whose fused
qkv output is viewed as (batch, tokens, 3, heads, head_dim) and taken apart with ``unbind``.

    PARTC_VIT_SIZE=vit-l16 partc compile examples/vit.py --gpus 8

`PARTC_VIT_SIZE` picks a configuration from `SIZES` (default ``tiny``). ``vit-l16`` is ViT-L/16 at 224 x 224
(Dosovitskiy et al. 2021: 24 layers, width 1024, 16 heads, MLP 4096; 304M parameters). The file defines neither
targets nor a loss: partc draws class indices and takes the cross-entropy of the logits, as for any model file
without `example_targets` and `loss_fn`.

Module names: ``patch_embed``, ``blocks.{i}.norm1``, ``blocks.{i}.attn.qkv``, ``blocks.{i}.attn.proj``,
``blocks.{i}.norm2``, ``blocks.{i}.mlp.fc1``, ``blocks.{i}.mlp.fc2``, ``norm``, ``head``; parameters ``cls_token``
and ``pos_embed``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(kw_only=True, slots=True)
class ViTConfig:
    image: int = 32
    """Image side in pixels (square RGB images)."""
    patch: int = 8
    """Patch side in pixels; (image / patch)^2 patches plus the class token are the tokens."""
    dim: int = 64
    """Model width."""
    depth: int = 2
    """Transformer blocks."""
    heads: int = 4
    """Attention heads; must divide `dim`."""
    mlp: int = 128
    """Hidden width of each block's MLP."""
    classes: int = 10
    """Outputs of the classification head."""


SIZES: dict[str, ViTConfig] = {
    "tiny": ViTConfig(),
    "vit-l16": ViTConfig(image=224, patch=16, dim=1024, depth=24, heads=16, mlp=4096, classes=1000),
}


class Attention(nn.Module):
    def __init__(self, c: ViTConfig):
        super().__init__()
        self.heads = c.heads
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class Mlp(nn.Module):
    def __init__(self, c: ViTConfig):
        super().__init__()
        self.fc1 = nn.Linear(c.dim, c.mlp)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(c.mlp, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, c: ViTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(c.dim)
        self.attn = Attention(c)
        self.norm2 = nn.LayerNorm(c.dim)
        self.mlp = Mlp(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, c: ViTConfig):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, c.dim, c.patch, stride=c.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (c.image // c.patch) ** 2 + 1, c.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.depth))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images [b, 3, image, image] -> logits [b, classes] (read from the class token)."""
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def config() -> ViTConfig:
    size = os.environ.get("PARTC_VIT_SIZE", "tiny").lower()
    if size not in SIZES:
        raise ValueError(f"PARTC_VIT_SIZE={size!r} is not one of {', '.join(SIZES)}")
    return SIZES[size]


def model() -> VisionTransformer:
    return VisionTransformer(config())


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    c = config()
    return (torch.randn(batch_size, 3, c.image, c.image),)
