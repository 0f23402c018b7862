"""Training data: each rank reads its share of every global batch, in an order that does not depend on the plan.

Sources. The model file's ``dataset()`` (`partc.model_file`: items are one sample's ``(inputs, targets)``), or
for a token model a flat file of token ids (`TokenFile`: a ``.bin`` of uint16 as nanoGPT's ``prepare.py`` writes
it, or a 1-D ``.npy`` of integers) cut into samples of seq_len + 1 tokens: the inputs, and the targets shifted by
one.

Order. The data is a sequence of samples, numbered by position p = 0, 1, 2, ... over the whole run: position p
is sample ``perm_e[p mod N]`` of a map-style dataset of N samples, where ``perm_e`` is a permutation of epoch
``e = p div N`` drawn from a generator seeded by (seed, e) (`GlobalOrder`; ``shuffle=False``: the identity), and
the p-th item of an ``IterableDataset``'s stream. Global batch k holds positions ``[start + k·G, start + (k+1)·G)``
(G the plan's global batch size), the same samples in the same order whatever dp, tp, pp and the micro-batch size
are; a checkpoint records the next position, so a run resumed under another plan (even another G) continues the
same sequence.

Shares. Data-parallel rank r takes the batch's slice ``[r·G/dp, (r+1)·G/dp)`` (the slice the schedule splits into
micro-batches, `partc.runtime.train`). Only the ranks that need them read anything: the inputs on the first
pipeline stage's ranks, the targets on the last's; a middle stage reads nothing. (The tensor-parallel ranks of one
dp rank read the same share: each needs all of it.) A map-style dataset is read through ``torch.utils.data``'s
``DataLoader`` with a batch sampler of exactly those indices, with worker processes and pinned memory when the
device is an accelerator (``num_workers`` 2 by default); an ``IterableDataset`` cannot be indexed, so every
reading rank walks the stream and keeps its positions (only those are collated and sent to the device).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset

from partc.errors import PartcError

DEFAULT_WORKERS = 2
"""Loader processes per rank on an accelerator (none on a CPU, where they would compete with the ranks)."""


class TokenFile(Dataset):
    """A flat file of token ids as samples of seq_len + 1 consecutive tokens (the inputs and the targets shifted by
    one), without overlap: sample i is tokens ``[i·seq_len, (i+1)·seq_len + 1)``. Memory-mapped: a sample reads
    its own tokens only."""

    def __init__(self, path: str | Path, seq_len: int):
        path = Path(path)
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "does not exist"
            raise PartcError(f"--data {path} {what}; pass a .bin (uint16 token ids) or a 1-D .npy file")
        if path.suffix == ".bin":
            size = path.stat().st_size
            if size % 2:
                raise PartcError(f"--data {path}: {size} bytes is not a whole number of uint16 tokens")
            tokens = np.memmap(path, dtype=np.uint16, mode="r") if size else np.zeros(0, np.uint16)
        elif path.suffix == ".npy":
            try:
                tokens = np.load(path, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError) as e:
                raise PartcError(f"--data {path} is not a readable .npy file ({e})") from None
            if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
                raise PartcError(f"--data {path} holds a {tokens.ndim}-D {tokens.dtype} array; pass a 1-D array of "
                                 f"token ids (integers)")
        else:
            raise PartcError(f"--data {path}: expected a .bin (uint16 token ids, as nanoGPT writes) or .npy file")
        if seq_len < 1:
            raise PartcError(f"--data needs a token model (inputs [batch, seq_len] of token ids)")
        self.path, self.tokens, self.seq_len = path, tokens, seq_len
        if len(self) == 0:
            raise PartcError(f"--data {path} holds {len(tokens)} tokens, fewer than one sample of {seq_len} + 1")

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        s = self.seq_len
        chunk = torch.from_numpy(np.array(self.tokens[i * s:(i + 1) * s + 1], dtype=np.int64))
        return chunk[:-1], chunk[1:]


def token_dataset(path: str | Path, spec: Any, input_keys: list[int | str]) -> Dataset:
    """`TokenFile` for a model whose one tensor input is its token ids (``[batch, seq_len]`` integers), its samples
    shaped as the model takes them (positional, or ``input_ids`` by keyword)."""
    if len(input_keys) != 1 or spec.seq_len is None:
        raise PartcError(f"--data reads token ids for a model with one token input; {spec.name} takes "
                         f"{len(input_keys)} tensor inputs ({', '.join(map(str, input_keys))}): define dataset() in "
                         f"the model file instead")
    return _Keyed(TokenFile(path, spec.seq_len), input_keys[0])


class _Keyed(Dataset):
    """Samples whose inputs are one tensor, as the argument `key` (a position or a keyword)."""

    def __init__(self, inner: TokenFile, key: int | str):
        self.inner, self.key = inner, key

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> tuple[Any, Tensor]:
        x, y = self.inner[i]
        return ({self.key: x} if isinstance(self.key, str) else (x,)), y


def _seed_of(seed: int, epoch: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + 1) % 2**63


class GlobalOrder:
    """Position p -> dataset index (module docstring): the same on every rank and under every plan."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        assert n > 0
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._epoch: tuple[int, Tensor] | None = None

    def __call__(self, p: int) -> int:
        epoch, i = divmod(p, self.n)
        if not self.shuffle:
            return i
        if self._epoch is None or self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(_seed_of(self.seed, epoch))
            self._epoch = (epoch, torch.randperm(self.n, generator=g))
        return int(self._epoch[1][i])


@dataclass(kw_only=True, slots=True)
class Batch:
    """This rank's share of one global batch."""

    step: int
    inputs: list[Tensor] | None
    """The model's tensor inputs in the program's order (manifest ``input_keys``), [G/dp, ...]: on the first
    pipeline stage's ranks; None elsewhere."""
    targets: Any
    """The targets, [G/dp, ...]: on the last stage's ranks; None elsewhere."""


class _Share(Dataset):
    """The part of each sample this rank needs (inputs flattened in the program's order, targets), counting the
    reads of the dataset (`read`: its indices, in order; in this process, without loader workers)."""

    def __init__(self, dataset: Dataset, input_keys: list[int | str], inputs: bool, targets: bool):
        self.dataset, self.input_keys, self.inputs, self.targets = dataset, input_keys, inputs, targets
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> tuple[list[Tensor], Any]:
        self.read.append(i)
        return self.part(self.dataset[i])

    def part(self, item: Any) -> tuple[list[Tensor], Any]:
        x, y = item
        args, kwargs = (x, {}) if isinstance(x, (tuple, list)) else ((), x) if isinstance(x, dict) else ((x,), {})
        xs = [args[k] if isinstance(k, int) else kwargs[k] for k in self.input_keys] if self.inputs else []
        return xs, (y if self.targets else None)


def _collate(items: list[tuple[list[Tensor], Any]]) -> tuple[list[Tensor], Any]:
    xs = [torch.stack([torch.as_tensor(it[0][j]) for it in items]) for j in range(len(items[0][0]))]
    ys = torch.utils.data.default_collate([it[1] for it in items]) if items[0][1] is not None else None
    return xs, ys


class _StepSampler(torch.utils.data.Sampler):
    """Batch sampler: for each step from `first_step` on, the dataset indices of this rank's slice."""

    def __init__(self, order: GlobalOrder, start: int, batch: int, lo: int, hi: int, first_step: int, steps: int):
        self.order, self.start, self.batch, self.lo, self.hi = order, start, batch, lo, hi
        self.first_step, self.steps = first_step, steps

    def __len__(self) -> int:
        return max(0, self.steps - self.first_step)

    def __iter__(self) -> Iterator[list[int]]:
        for k in range(self.first_step, self.steps):
            base = self.start + k * self.batch
            yield [self.order(base + j) for j in range(self.lo, self.hi)]


class Loader:
    """This rank's batches, step by step (`batches`); see the module docstring.

    `start`: the position of step 0's first sample (a run resumed under another global batch size keeps the
    position, not the step: `Program.load` gives it)."""

    def __init__(self, dataset: Dataset | IterableDataset, *, input_keys: list[int | str], global_batch_size: int,
                 dp: int, dp_rank: int, inputs: bool, targets: bool, seed: int = 0, shuffle: bool = True,
                 start: int = 0, device: torch.device | None = None, num_workers: int | None = None):
        if global_batch_size % dp:
            raise PartcError(f"a global batch of {global_batch_size} samples does not split over {dp} "
                             f"data-parallel ranks")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.share = _Share(dataset, input_keys, inputs, targets)
        per = global_batch_size // dp
        self.lo, self.hi = dp_rank * per, (dp_rank + 1) * per
        self.reads = inputs or targets
        self.seed, self.shuffle, self.start = seed, shuffle, start
        self.iterable = isinstance(dataset, IterableDataset)
        if not self.iterable and len(dataset) == 0:
            raise PartcError("the dataset holds no samples")
        accel = device is not None and device.type != "cpu"
        self.num_workers = (DEFAULT_WORKERS if accel else 0) if num_workers is None else num_workers
        self.pin_memory = accel and device.type == "cuda"

    @property
    def read(self) -> list[int]:
        """The dataset indices this process read (positions for an ``IterableDataset``), in order (without loader
        workers: those read in their own processes)."""
        return self.share.read

    def position(self, step: int) -> int:
        """The position of global batch `step`'s first sample."""
        return self.start + step * self.global_batch_size

    def batches(self, first_step: int, steps: int) -> Iterator[Batch]:
        """This rank's share of global batches `first_step` .. `steps` - 1."""
        if not self.reads:
            for k in range(first_step, steps):
                yield Batch(step=k, inputs=None, targets=None)
            return
        if self.iterable:
            yield from self._stream(first_step, steps)
            return
        order = GlobalOrder(len(self.dataset), self.seed, self.shuffle)
        sampler = _StepSampler(order, self.start, self.global_batch_size, self.lo, self.hi, first_step, steps)
        loader = DataLoader(self.share, batch_sampler=sampler, collate_fn=_collate, num_workers=self.num_workers,
                            pin_memory=self.pin_memory, persistent_workers=False)
        for k, (xs, ys) in zip(range(first_step, steps), loader):
            yield Batch(step=k, inputs=xs if self.share.inputs else None, targets=ys)

    def _stream(self, first_step: int, steps: int) -> Iterator[Batch]:
        g = self.global_batch_size
        it = iter(self.dataset)
        p = 0
        for k in range(first_step, steps):
            base = self.start + k * g
            items = []
            while p < base + self.hi:
                try:
                    item = next(it)
                except StopIteration:
                    raise PartcError(f"the dataset's stream ended after {p} samples; step {k + 1} needs "
                                     f"{base + g}") from None
                if base + self.lo <= p:
                    self.share.read.append(p)
                    items.append(self.share.part(item))
                p += 1
            xs, ys = _collate(items)
            yield Batch(step=k, inputs=xs if self.share.inputs else None, targets=ys)


def data_state(loader: Loader, next_step: int) -> dict:
    """What a checkpoint records of the data: the next position and what the order depends on."""
    return {"position": loader.position(next_step), "seed": loader.seed, "shuffle": loader.shuffle,
            "samples": None if loader.iterable else len(loader.dataset)}


def check_resumable(recorded: dict | None, dataset: Dataset | IterableDataset, seed: int) -> None:
    """A checkpoint's data position means the same samples only on the same data in the same order: refuse a
    dataset of another length or another seed (`data_state`'s record; None: the checkpoint recorded none)."""
    if not recorded:
        return
    n = None if isinstance(dataset, IterableDataset) else len(dataset)
    if recorded.get("samples") != n:
        raise PartcError(f"the checkpoint was written training on a dataset of {recorded.get('samples')} samples, "
                         f"this one has {n}: its data position would not continue the same sequence")
    if recorded.get("seed") != seed:
        raise PartcError(f"the checkpoint's data order has seed {recorded.get('seed')}, this loader {seed}")
