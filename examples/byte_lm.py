"""A byte-level language model (the GPT of `gpt.py`, 256 tokens: one per byte) trained on real text, with
``dataset()`` and no ``example_inputs``: partc takes the shapes from the data (docs/data.md).

    python examples/make_corpus.py                       # stdlib_bytes.bin: the standard library's source
    partc compile examples/byte_lm.py --gpus 1 --precision fp32 -o byte_lm_out
    partc run byte_lm_out --steps 300 --lr 1e-3 --lr-schedule cosine --warmup-steps 30 --grad-clip 1

``PARTC_CORPUS`` names the corpus (default ``stdlib_bytes.bin`` in the working directory: a flat file of uint16
token ids, nanoGPT's ``.bin``); ``PARTC_BYTE_LM_SIZE`` picks a configuration from `SIZES` (default ``small``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from gpt import GPT, GPTConfig  # the sibling file: partc imports a model file with its directory on sys.path

SIZES = {
    "small": GPTConfig(vocab_size=256, seq_len=64, hidden=128, heads=4, layers=4),
    "cpu": GPTConfig(vocab_size=256, seq_len=64, hidden=64, heads=4, layers=2),  # docs/data.md's run
    "test": GPTConfig(vocab_size=256, seq_len=16, hidden=32, heads=2, layers=2),
}


def config() -> GPTConfig:
    size = os.environ.get("PARTC_BYTE_LM_SIZE", "small")
    if size not in SIZES:
        raise ValueError(f"PARTC_BYTE_LM_SIZE={size!r} is not one of {', '.join(SIZES)}")
    return SIZES[size]


class Bytes(Dataset):
    """Samples of seq_len + 1 consecutive tokens of a uint16 token file (memory-mapped): the inputs, and the
    targets shifted by one."""

    def __init__(self, path: str, seq_len: int):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.seq_len
        chunk = torch.from_numpy(self.tokens[i * s:(i + 1) * s + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def model() -> GPT:
    return GPT(config())


def dataset() -> Bytes:
    path = os.environ.get("PARTC_CORPUS", "stdlib_bytes.bin")
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: run `python examples/make_corpus.py` first (or set PARTC_CORPUS)")
    return Bytes(path, config().seq_len)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
