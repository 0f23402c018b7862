"""ResNet-50 v1.5 in plain PyTorch (no torchvision), as NVIDIA's Deep Learning Examples train it: the stride-2
of a downsampling bottleneck on its 3x3 convolution (v1.5), BatchNorm after every convolution, 1,000 classes,
224 x 224 images. ``PARTC_RESNET_SIZE=tiny`` builds the same code at 32 x 32 pixels with one block per stage and
narrow stages (for tests).

    partc compile benchmarks/models/resnet50.py --gpus 8 --global-batch-size 2048
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class ResNetConfig:
    layers: tuple[int, ...] = (3, 4, 6, 3)
    """Bottleneck blocks per stage."""
    width: int = 64
    """Channels of the stem and of the first stage's 3x3 convolutions (doubled per stage)."""
    expansion: int = 4
    classes: int = 1000
    image: int = 224


SIZES = {
    "50": ResNetConfig(),
    "tiny": ResNetConfig(layers=(1, 1), width=8, classes=10, image=32),
}


class Bottleneck(nn.Module):
    def __init__(self, c_in: int, width: int, stride: int, expansion: int):
        super().__init__()
        c_out = width * expansion
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu(out + shortcut)


class ResNet(nn.Module):
    def __init__(self, c: ResNetConfig):
        super().__init__()
        self.conv1 = nn.Conv2d(3, c.width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(c.width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        blocks = []
        c_in = c.width
        for stage, n in enumerate(c.layers):
            width = c.width * 2 ** stage
            for i in range(n):
                blocks.append(Bottleneck(c_in, width, 2 if (i == 0 and stage > 0) else 1, c.expansion))
                c_in = width * c.expansion
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(c_in, c.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images [b, 3, image, image] -> logits [b, classes]."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for block in self.blocks:
            x = block(x)
        return self.fc(torch.flatten(x.mean((2, 3)), 1))


def config() -> ResNetConfig:
    size = os.environ.get("PARTC_RESNET_SIZE", "50").lower()
    if size not in SIZES:
        raise ValueError(f"PARTC_RESNET_SIZE={size!r} is not one of {', '.join(SIZES)}")
    return SIZES[size]


def model() -> ResNet:
    return ResNet(config())


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    c = config()
    return (torch.randn(batch_size, 3, c.image, c.image),)


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, config().classes, (batch_size,))
