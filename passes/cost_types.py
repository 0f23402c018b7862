"""What the cost model takes and gives: the TP plan it reads, memory, unit times and step predictions.

The formulas live in `passes.cost`, which re-exports these names (``cost.Memory``, ``cost.Prediction``...).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Protocol


class TPPlan(Protocol):
    """What the cost model reads of a `passes.tp.TPSolution` (duck-typed; None: everything replicated)."""

    styles: dict[str, str]
    """Layer FQN -> colwise | rowwise | replicate (a missing layer is replicated)."""
    collectives: dict[str, list]
    """Unit FQN -> collectives with ``kind``, ``phase`` (fwd | bwd) and ``nbytes`` per sample."""


@dataclass(kw_only=True, slots=True)
class Memory:
    """Bytes on one GPU."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    """Saved activations of the micro-batches in flight plus transient working memory."""
    buffers: float = 0.0
    """The communication libraries' own buffers (NCCL communicators)."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def to_dict(self) -> dict:
        return {k: int(round(getattr(self, k))) for k in ("params", "grads", "optimizer", "activations", "buffers",
                                                          "total")}


@dataclass(kw_only=True, slots=True)
class UnitTime:
    """Seconds per micro-batch of one unit on one GPU."""

    compute_s: float
    """Forward + backward (2x forward) + recomputed forward: GEMMs and memory-bound ops."""
    tp_comm_s: float
    """TP collectives (forward, backward, and forward again under full recomputation)."""
    fwd_compute_s: float = 0.0
    """The forward's share of `compute_s` (the rest runs in the backward, recomputation included)."""
    fwd_tp_comm_s: float = 0.0
    """The forward's share of `tp_comm_s`."""


@dataclass(kw_only=True, slots=True)
class RankPrediction:
    """One pipeline rank (every GPU of it: they hold the same share)."""

    rank: int
    """Pipeline rank: it holds model chunks rank, rank + p, rank + 2p, ... (p chunks apart when interleaved)."""
    time_s: float
    """Seconds per micro-batch on this rank: all its chunks, forward + backward, TP and p2p comm included."""
    memory: Memory
    num_params: int = 0
    """Parameters on one GPU of this rank after TP sharding (before ZeRO sharding)."""
    chunks: list[tuple[int, int]] = field(default_factory=list)
    """Half-open unit ranges [start, end) of the model chunks on this rank."""
    comm_bytes: dict[str, float] = field(default_factory=dict)
    timeline_s: dict = field(default_factory=dict)
    """What `partc.timeline.step` walks: seconds of one micro-batch's forward and backward on this rank (all its
    chunks) by part (``fwd``/``bwd``: ``compute``, ``tp``, ``pp``), its exposed DP traffic and optimizer step."""
    """Mesh axis (``tp``, ``pp``, ``dp``) -> the collective payload one GPU of this rank passes in a step
    (`partc.passes.zero`'s definition; what the runtime measures)."""


@dataclass(kw_only=True, slots=True)
class Prediction:
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    mfu: float
    bubble_fraction: float
    memory_per_gpu: Memory
    """Memory of the most loaded pipeline rank."""
    ranks: list[RankPrediction]
    """One per pipeline rank, in rank order."""
    # The step on the slowest rank, split up: step_time_s is the sum of these six.
    compute_s: float = 0.0
    tp_comm_s: float = 0.0
    pp_comm_s: float = 0.0
    bubble_s: float = 0.0
    dp_comm_s: float = 0.0
    optimizer_s: float = 0.0

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("memory_per_gpu", "ranks")}
        out["memory_per_gpu"] = self.memory_per_gpu.to_dict()
        out["ranks"] = [{"rank": r.rank, "time_s": r.time_s, "num_params": r.num_params,
                         "chunks": [list(c) for c in r.chunks], "memory": r.memory.to_dict(),
                         "comm_bytes": r.comm_bytes} for r in self.ranks]
        return out
