"""A U-Net for segmentation in plain PyTorch (Ronneberger et al. 2015, with padded convolutions and BatchNorm, as
most reimplementations write it): four down levels of two 3x3 convolutions and a 2x2 max-pool, channels 64 to 1024,
four up levels of a 2x2 transposed convolution, a skip concatenation and two 3x3 convolutions, then a 1x1
convolution to the classes; 128 x 128 RGB images. ``PARTC_UNET_SIZE=tiny``: 16 x 16 pixels, channels 4 to 32, for
tests.

    partc compile benchmarks/models/unet.py --gpus 8
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class UNetConfig:
    width: int = 64
    """Channels of the first level (doubled per level)."""
    depth: int = 4
    """Down (and up) levels."""
    classes: int = 2
    image: int = 128


SIZES = {
    "base": UNetConfig(),
    "tiny": UNetConfig(width=4, depth=3, classes=2, image=16),
}


class DoubleConv(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(x)))


class Down(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = DoubleConv(c_in, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.max_pool2d(x, 2))


class Up(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_in // 2, 2, stride=2)
        self.conv = DoubleConv(c_in, c_out)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    def __init__(self, c: UNetConfig):
        super().__init__()
        w = c.width
        self.inc = DoubleConv(3, w)
        self.downs = nn.ModuleList(Down(w * 2 ** i, w * 2 ** (i + 1)) for i in range(c.depth))
        self.ups = nn.ModuleList(Up(w * 2 ** (i + 1), w * 2 ** i) for i in reversed(range(c.depth)))
        self.outc = nn.Conv2d(w, c.classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images [b, 3, image, image] -> per-pixel logits [b, classes, image, image]."""
        skips = [self.inc(x)]
        for down in self.downs:
            skips.append(down(skips[-1]))
        x = skips.pop()
        for up in self.ups:
            x = up(x, skips.pop())
        return self.outc(x)


def config() -> UNetConfig:
    size = os.environ.get("PARTC_UNET_SIZE", "base").lower()
    if size not in SIZES:
        raise ValueError(f"PARTC_UNET_SIZE={size!r} is not one of {', '.join(SIZES)}")
    return SIZES[size]


def model() -> UNet:
    return UNet(config())


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    c = config()
    return (torch.randn(batch_size, 3, c.image, c.image),)


def example_targets(batch_size: int) -> torch.Tensor:
    c = config()
    return torch.randint(0, c.classes, (batch_size, c.image, c.image))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)
