"""A plain PyTorch decoder that sets its parameters in ``__init__``, the way reference implementations do: no
``reset_parameters()`` of its own, no ``init_weights()``. For the tests of `partc.deferred_init`.

- ``blocks.{i}.norm.weight``, ``norm.weight``: ones (an RMSNorm);
- ``blocks.{i}.gate``: zeros (each block starts as the identity); ``blocks.{i}.alpha``: the constant 0.1;
- ``blocks.{i}.fc1``, ``blocks.{i}.fc2``: ``nn.Linear``'s own initialization;
- ``tok``: ``torch.randn(V, H) * 0.02`` on the root, also the output projection (read by the first and the last
  pipeline stage);
- ``pos``: a sinusoid table computed with ``arange``, ``exp``, ``sin`` and ``cos``;
- ``scale``: derived from ``tok`` (each row's norm over the mean norm); ``gate``: zeros; ``temperature``: a buffer
  from ``torch.tensor(2.0)``. All on the root: the logits are ``(x @ tok.T) * scale / temperature + gate``.
- ``version``: a buffer on the root that ``forward`` does not read.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

V, H, S, L = 64, 32, 16, 2


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(H)
        self.fc1 = nn.Linear(H, 4 * H)
        self.fc2 = nn.Linear(4 * H, H)
        self.gate = nn.Parameter(torch.zeros(H))
        self.alpha = nn.Parameter(torch.full((H,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.gate + self.alpha) * self.fc2(F.gelu(self.fc1(self.norm(x))))


def sinusoid(n: int, d: int) -> torch.Tensor:
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    table = torch.zeros(n, d)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Parameter(torch.randn(V, H) * 0.02)
        self.pos = nn.Parameter(sinusoid(S, H))
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.norm = RMSNorm(H)
        norms = self.tok.detach().norm(dim=1)
        self.scale = nn.Parameter(norms / norms.mean())
        self.gate = nn.Parameter(torch.zeros(V))
        self.register_buffer("temperature", torch.tensor(2.0))
        self.register_buffer("version", torch.tensor([1.0, 0.0]))  # read by no stage: the state dict still has it

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.tok) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.norm(x) @ self.tok.t()
        return logits * self.scale / self.temperature + self.gate


def model() -> Plain:
    return Plain()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, V, (batch_size, S)),)


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, V, (batch_size, S))
