"""The order in which a pipeline rank runs its forwards and backwards under interleaved 1F1B, as
torch.distributed.pipelining's ``ScheduleInterleaved1F1B`` (the runtime's, `partc.runtime.schedule`) orders them, and
the most memory that the micro-batches in flight hold at once on that rank.

With v chunks a rank, the chunks in flight at any moment are not an even mix: the warm-up runs (v - 1)·r' forwards
of the first v - 1 chunks (r' micro-batches a round) before the first forward of the last chunk, whose backward comes
first. When the chunks hold unequal activations (the first rank's embedding, the last rank's head), the peak is not
the average chunk times the number in flight (`partc.passes.memory.in_flight`): on the first rank of a GPT it is more
(its heavy first chunk is all in flight during the warm-up), on the last less. `peak_bytes` walks the order with each
chunk's bytes per micro-batch: what it saves for backward, the input it received and the output it sent (the
pipeline stage keeps both until the micro-batch's backward), and, while a backward runs, the gradient buffer it
received. Measured by ``partc check`` on a 1.7B GPT, pp 4, v 6, 16 micro-batches: within 1% of the tracked peak of
the first rank. The receives that torch posts ahead of the compute that consumes them (one or two boundaries) are
not counted.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np


def interleaved_order(p: int, v: int, m: int, rank: int) -> list[tuple[bool, int]]:
    """(is_forward, local chunk) of every compute action of pipeline rank `rank`, in order: torch 2.13's
    ``ScheduleInterleaved1F1B._calculate_single_rank_operations`` (warm-up forwards, then one forward and one
    backward at a time, then the remaining backwards; rounds of ``m // max(1, m // p)`` micro-batches)."""
    per_round = m // max(1, m // p)
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
    steady = m * v - warmup

    def fwd(step: int) -> int:
        return (step // per_round) % v

    def bwd(step: int) -> int:
        return v - 1 - ((step - warmup) // per_round) % v

    out: list[tuple[bool, int]] = []
    for op in range(warmup + steady + warmup):
        if op < warmup:
            out.append((True, fwd(op)))
        elif op < warmup + steady:
            out += [(True, fwd(op)), (False, bwd(op))]
        else:
            out.append((False, bwd(op)))
    return out


@functools.lru_cache(maxsize=1 << 16)
def _before_backwards(p: int, v: int, m: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct states just before each backward of the rank (the candidates for its peak: memory only grows
    between two backwards): forwards in flight per local chunk (rows), and the chunk whose backward runs. The
    order of `interleaved_order` as arrays: the running count of each chunk's forwards less its backwards."""
    per_round = m // max(1, m // p)
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
    steady = m * v - warmup
    fwd = np.arange(warmup + steady)
    fwd_chunk = (fwd // per_round) % v
    bwd = np.arange(warmup, 2 * warmup + steady)
    bwd_chunk = v - 1 - ((bwd - warmup) // per_round) % v
    # Action k of the order: the warm-up forwards, then forward(op), backward(op) for each steady op, then the
    # remaining backwards; a backward's position is that of its op plus the forwards before it.
    n = 2 * m * v
    chunk = np.empty(n, dtype=np.int64)
    forward = np.zeros(n, dtype=bool)
    fwd_at = np.where(fwd < warmup, fwd, warmup + 2 * (fwd - warmup))
    bwd_at = np.where(bwd < warmup + steady, warmup + 2 * (bwd - warmup) + 1, bwd + steady)
    chunk[fwd_at], forward[fwd_at] = fwd_chunk, True
    chunk[bwd_at] = bwd_chunk
    delta = np.zeros((n, v), dtype=np.int64)
    delta[np.arange(n), chunk] = np.where(forward, 1, -1)
    live = np.cumsum(delta, axis=0) - delta  # before each action
    rows = np.concatenate([live[bwd_at], bwd_chunk[:, None]], axis=1)
    table = np.unique(rows, axis=0)
    return table[:, :v].astype(float), table[:, v]


def peak_bytes(p: int, v: int, m: int, rank: int, held: Sequence[float], grad_buffer: Sequence[float]) -> float:
    """The most the in-flight micro-batches of pipeline rank `rank` hold at once: `held[j]` bytes per forward of local
    chunk j in flight, plus `grad_buffer[j]` while chunk j's backward runs (module docstring)."""
    counts, chunk = _before_backwards(p, v, m, rank)
    return float((counts @ np.asarray(held, dtype=float) + np.asarray(grad_buffer, dtype=float)[chunk]).max())


def most_gradient_bytes(p: int, v: int, m: int, rank: int, accumulated: Sequence[float],
                        reduced: Sequence[float]) -> float:
    """The most gradient bytes pipeline rank `rank` holds at once below ZeRO-2 with v chunks: chunk j's unsharded
    accumulation (`accumulated[j]`) lives from its first backward to its last, after which torch's schedule reduces
    it (``REDUCE_GRAD`` right after a stage's last backward, FSDP's post-backward) and frees it, leaving its shards
    (`reduced[j]`) to the optimizer step. With m <= p the backwards of a chunk run one after another and only one
    chunk's accumulation is held at a time (measured by ``partc check``: Llama 3 405B at pp 16, v 8, 16 micro-batches
    held one chunk's, 1.55 GiB, where all of them is 11.37)."""
    first, last = _backward_spans(p, v, m, rank)
    most = 0.0
    for k in sorted(first.values()):  # the held bytes only grow at a chunk's first backward
        most = max(most, sum(accumulated[j] if first[j] <= k <= last[j] else reduced[j] if last[j] < k else 0.0
                             for j in first))
    return most


@functools.lru_cache(maxsize=1 << 16)
def _backward_spans(p: int, v: int, m: int, rank: int) -> tuple[dict[int, int], dict[int, int]]:
    """Local chunk -> the position of its first backward in `interleaved_order`, and of its last (the search asks
    for the same few orders thousands of times; callers only read them)."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for k, (forward, chunk) in enumerate(interleaved_order(p, v, m, rank)):
        if not forward:
            first.setdefault(chunk, k)
            last[chunk] = k
    return first, last


def held_at_reductions(p: int, v: int, m: int, rank: int, held: Sequence[float]) -> list[float]:
    """Per local chunk, what the in-flight micro-batches of pipeline rank `rank` hold when torch reduces that chunk's
    gradients (in and right after its last backward, `most_gradient_bytes`): `held[j]` bytes per forward of local
    chunk j in flight. Below ZeRO-2 that is when the reduction's fp32 input is made, after the backwards that ran
    the pipeline's peak."""
    out = [0.0] * v
    for chunk, counts in _in_flight_at_reductions(p, v, m, rank):
        out[chunk] = sum(c * h for c, h in zip(counts, held))
    return out


@functools.lru_cache(maxsize=1 << 16)
def _in_flight_at_reductions(p: int, v: int, m: int, rank: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(local chunk, forwards in flight per local chunk) at each chunk's last backward, in the order of
    `interleaved_order` (`held_at_reductions`' walk, kept for the orders the search asks for again)."""
    counts = [0] * v
    backwards = [0] * v
    out = []
    for forward, chunk in interleaved_order(p, v, m, rank):
        if not forward:
            backwards[chunk] += 1
            if backwards[chunk] == m:  # with the micro-batch of that backward, as the one-chunk charge counts it
                out.append((chunk, tuple(counts)))
        counts[chunk] += 1 if forward else -1
    return tuple(out)
