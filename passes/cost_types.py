"""What the cost model takes and gives: the TP plan it reads, memory, unit times and step predictions; and how
its terms read a plan (a layer's TP style, whether a unit is split, its recomputation, which mesh axes cross nodes,
the samples one GPU computes of a micro-batch).

The formulas live in `passes.cost` (a unit's time), `passes.cost_tp` (its TP collectives), `passes.cost_step` (the
pipeline, data-parallel and optimizer terms), `passes.memory` and `passes.cost_axes`; each imports these names from
here, as do their callers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Protocol, Sequence

from partc.cluster import Cluster
from partc.ir import ModelGraph, Unit
from partc.mesh_axes import MESH_AXES
from partc.parallel import TP_STYLES, Parallel


class TPPlan(Protocol):
    """What the cost model reads of a `passes.tp.TPSolution` (duck-typed; None: everything replicated)."""

    styles: dict[str, str]
    """Layer FQN -> colwise | rowwise | replicate (a missing layer is replicated)."""
    collectives: dict[str, list]
    """Unit FQN -> collectives with ``kind``, ``phase`` (fwd | bwd) and ``nbytes`` per sample."""


VOCAB_LOSS_REASON = "vocab-parallel cross-entropy of "
"""How the reason of each of the vocab-parallel loss's collectives begins (`passes.tp.vocab_loss_collectives`): the
loss runs them, not the stage code."""


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


# --- How the terms read a plan: styles, recomputation, mesh placement, tokens ------------------------------------

def style_of(tp: TPPlan | None, layer_fqn: str) -> str:
    style = "replicate" if tp is None else tp.styles.get(layer_fqn, "replicate")
    assert style in TP_STYLES, f"unknown TP style {style!r} for {layer_fqn}"
    return style


def is_split(par: Parallel, tp: TPPlan | None, unit: Unit) -> bool:
    """True when TP shards this unit: some layer is colwise/rowwise and t > 1 (then its heads are split too).
    Experts split inside (``inner``) do not split the heads; their GEMMs are split by `Gemm.inner_split`, and what
    their ops save is counted whole (`Unit.saved_bytes_replicated`), a bound from above."""
    return par.tp > 1 and any(style_of(tp, f) not in ("replicate", "inner") for f in unit.layers)


def recompute_mode(unit: Unit, par: Parallel) -> str:
    """Recomputation applies to repeated blocks only, as torchtitan wraps each block (not embedding, head)."""
    return par.recompute if unit.kind == "block" else "none"


def mesh_spans(cluster: Cluster, par: Parallel) -> dict[str, bool]:
    """Mesh axis -> whether its groups cross nodes (`Parallel.spans_nodes`)."""
    return {axis: par.spans_nodes(axis, cluster.gpus_per_node) for axis in MESH_AXES}


def tokens(par: Parallel) -> float:
    """What one GPU computes, holds and sends of a micro-batch, in samples: b, or under context parallelism b/cp
    (each cp rank holds s/cp tokens of every sample). Every activation-proportional term reads it; the parameters,
    their gradients and the optimizer do not depend on it."""
    return par.micro_batch_size / par.cp


def _unit_list(graph: ModelGraph, units: Sequence[int] | Sequence[Unit]) -> list[Unit]:
    return [graph.units[u] if isinstance(u, int) else u for u in units]
