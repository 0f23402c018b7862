"""The order in which a pipeline rank runs its forwards and backwards under interleaved 1F1B, as
torch.distributed.pipelining's ``ScheduleInterleaved1F1B`` (the runtime's, `partc.runtime.schedule`) orders them, and
the most memory that the micro-batches in flight hold at once on that rank.

With v chunks a rank, the chunks in flight at any moment are not an even mix: the warm-up runs (v - 1)·r' forwards
of the first v - 1 chunks (r' micro-batches a round) before the first forward of the last chunk, whose backward comes
first. When the chunks hold unequal activations (the first rank's embedding, the last rank's head), the peak is not
the average chunk times the number in flight (`partc.passes.cost.in_flight`): on the first rank of a GPT it is more
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
    between two backwards): forwards in flight per local chunk (rows), and the chunk whose backward runs."""
    live = [0] * v
    rows: set[tuple[int, ...]] = set()
    for forward, chunk in interleaved_order(p, v, m, rank):
        if forward:
            live[chunk] += 1
        else:
            rows.add((*live, chunk))
            live[chunk] -= 1
    table = np.array(sorted(rows), dtype=np.int64).reshape(-1, v + 1)
    return table[:, :v].astype(float), table[:, v]


def peak_bytes(p: int, v: int, m: int, rank: int, held: Sequence[float], grad_buffer: Sequence[float]) -> float:
    """The most the in-flight micro-batches of pipeline rank `rank` hold at once: `held[j]` bytes per forward of local
    chunk j in flight, plus `grad_buffer[j]` while chunk j's backward runs (module docstring)."""
    counts, chunk = _before_backwards(p, v, m, rank)
    return float((counts @ np.asarray(held, dtype=float) + np.asarray(grad_buffer, dtype=float)[chunk]).max())
