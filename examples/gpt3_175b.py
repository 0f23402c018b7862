"""GPT-3 175B (Brown et al. 2020): 96 layers, hidden 12288, 96 heads, 2048 tokens, vocabulary 50,257.

    partc compile examples/gpt3_175b.py

The model is `gpt.GPT` from the sibling file (partc imports a model file with its directory on sys.path), with
the output layer tied to the token embedding as in GPT-2 and GPT-3.
Build it only on the meta device: its parameters take 350 GB in 16-bit.
"""

import torch
import torch.nn.functional as F

from gpt import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=50257, seq_len=2048, hidden=12288, heads=96, layers=96, tie_weights=True)


def model() -> GPT:
    return GPT(CONFIG)


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.seq_len)),)


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.seq_len))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
