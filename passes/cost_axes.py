"""The cost model's terms of the context-parallel and expert-parallel axes: what one
GPU passes over cp (its keys and values all-gathered, their gradients reduce-scattered;
`partc.collectives.cp_attention`) and over ep (the all-to-alls to the routed experts and back;
`partc.collectives.expert_parallel`), their time, and the model states of the packed experts ep divides."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from partc.cluster import Cluster
from partc.ir import ModelGraph
from partc.mesh_axes import group_spans_nodes
from partc.parallel import Parallel
from partc.precision import compute_bytes
from partc.passes.cost_types import Memory, TPPlan, recompute_mode, style_of, tokens

from . import hw, zero


# --- 1. Context parallelism --------------------------------------------------------------------------------------

def cp_bytes(graph: ModelGraph, par: Parallel, tp: TPPlan | None, units: Sequence[int]) -> float:
    """What one GPU passes to collectives over cp in a step: per causal attention of its units and micro-batch, its
    keys and values all-gathered in forward (counted as the gathered output: the whole sequence's, b samples, this
    tp rank's heads) and their gradients reduce-scattered in backward (counted as the input: as many bytes), the
    forward's once more in a block recomputed in full (`partc.collectives.cp_attention`)."""
    if par.cp == 1:
        return 0.0
    total = 0.0
    for i in units:
        u = graph.units[i]
        fwd = 2 if par.recompute == "full" and u.kind == "block" else 1
        total += (fwd + 1) * sum(nbytes / (par.tp if style_of(tp, layer) == "colwise" else 1)
                                 for nbytes, layer, _ in u.cp_kv)
    return par.num_microbatches * par.micro_batch_size * total


def cp_time(graph: ModelGraph, cluster: Cluster, par: Parallel, tp: TPPlan | None,
            units: Sequence[int]) -> tuple[float, float]:
    """(seconds of one micro-batch's cp collectives on one GPU, of which in forward): per causal attention of its
    units, its keys and values all-gathered in forward (again in a block recomputed in full) and their gradients
    reduce-scattered in backward, as rings over the cp group (NVLink inside a node, InfiniBand across:
    `mesh_spans`). Counted as exposed: the gather precedes the attention that needs it (Llama 3 gathers them
    before attention too: the keys and values are small beside the attention's compute at long sequences)."""
    if par.cp == 1:
        return 0.0, 0.0
    spans = par.spans_nodes("cp", cluster.gpus_per_node)
    per_node = par.ranks_per_node("cp", cluster.gpus_per_node)
    total = fwd = 0.0
    for i in units:
        u = graph.units[i]
        again = 2 if par.recompute == "full" and u.kind == "block" else 1
        for nbytes, layer, _ in u.cp_kv:
            whole = nbytes * par.micro_batch_size / (par.tp if style_of(tp, layer) == "colwise" else 1)
            gather = hw.collective_time(cluster, "all_gather", whole, par.cp, spans_nodes=spans,
                                        ranks_per_node=per_node)
            scatter = hw.collective_time(cluster, "reduce_scatter", whole, par.cp, spans_nodes=spans,
                                         ranks_per_node=per_node)
            fwd += gather
            total += again * gather + scatter
    return total, fwd


# --- 2. Expert parallelism ---------------------------------------------------------------------------------------

def ep_alltoall_bytes(tokens: int, k: int, hidden: int, nbytes: int, ep: int, num_experts: int,
                      *, backward: bool = True, imbalance: float = 1.0, forwards: int = 1) -> float:
    """Bytes one rank passes to the ``ep`` all-to-alls of one layer of routed experts for one micro-batch of
    `tokens` tokens (`partc.collectives.expert_parallel`): the rows that leave the rank, as the runtime counts an
    all-to-all (`partc.runtime.comm`). Under uniform routing the share ``(ep - 1) / ep`` of its ``tokens x k``
    (token, expert) rows of `hidden` elements of `nbytes` bytes leaves the rank, once to the experts and once
    back; the backward sends their gradients the same two ways. The split counts (`num_experts` int64, the same
    share leaving) are exchanged once, in the forward. Nothing when ``ep`` is 1.

    Under an `imbalance` F (`Parallel.imbalance`), the busiest rank's: every rank sends it the share ``F/ep`` of its
    rows, so of its own rows ``1 - F/ep`` leave to the experts, and the ``F·(ep - 1)/ep`` rows (of its size) it
    received from the others leave on their way back: ``(1 + F - 2F/ep)`` of its rows instead of ``2·(ep - 1)/ep``
    (the same at ep 2, where what it receives is what the other rank does not keep).

    `forwards`: 2 where the layer's block is recomputed in full, its forward (all-to-alls and counts) replayed in
    the backward."""
    if ep == 1:
        return 0.0
    leaving = (ep - 1) / ep
    share = 2 * leaving if imbalance == 1.0 else (1 - imbalance / ep) + imbalance * leaving
    rows = tokens * k * share * hidden * nbytes * (forwards + (1 if backward else 0))
    return rows + num_experts * leaving * 8 * forwards


def _expert_layers(graph: ModelGraph, units: Sequence[int], par: Parallel):
    """(rows per sample, hidden size, experts, forwards) of each layer of packed experts of `units` (`Layer.inner`:
    its first grouped product holds E experts of ``m`` rows each per sample, ``m·E`` = s·k at uniform routing, and
    multiplies the tokens' hidden size ``k``; forwards: 2 where its block is recomputed in full, its forward
    replayed in the backward, all-to-alls included)."""
    for i in units:
        forwards = 2 if recompute_mode(graph.units[i], par) == "full" else 1
        for fqn in graph.units[i].layers:
            layer = graph.layers[fqn]
            first = next((g for g in layer.gemms if g.inner_split == "n"), None) if layer.inner else None
            if first is not None:
                yield first.batch * first.m, first.k, first.batch, forwards
        for routed in graph.routed_experts:  # experts as modules: their layer's all-to-alls on the first's unit
            if routed.unit == graph.units[i].fqn:
                yield routed.rows, routed.hidden, len(routed.experts), forwards


def ep_time(graph: ModelGraph, cluster: Cluster, par: Parallel, units: Sequence[int]) -> tuple[float, float]:
    """(forward, backward) seconds of the ep all-to-alls of one micro-batch on one GPU of `units`: per layer of
    packed experts two all-to-alls each way (to the experts and back), each moving the share of the (token,
    expert) rows that leaves the rank, over NVLink or InfiniBand by where the ep group sits (neighbouring dp
    ranks, ``cp`` x ``tp`` apart), the forward's again in the backward where a block is recomputed in full. Not
    overlapped with compute. Under an imbalance F (`Parallel.imbalance`) every rank waits for the busiest: it
    receives F times the uniform share on the way to the experts and sends as much back, so each all-to-all takes
    as long as F times the uniform share takes through its link."""
    if par.ep == 1:
        return 0.0, 0.0
    stride = par.cp * par.tp  # dp's neighbours are cp x tp ranks apart (`Parallel.coords`)
    spans = group_spans_nodes(par.ep, stride, cluster.gpus_per_node)
    per_node = max(1, min(par.ep, cluster.gpus_per_node // stride))
    c, total = compute_bytes(par.precision), 0.0
    fwd = 0.0
    for rows, hidden, _, forwards in _expert_layers(graph, units, par):
        leaving = tokens(par) * rows * (par.ep - 1) / par.ep * hidden * c  # each cp rank routes its s/cp tokens
        leaving *= par.imbalance
        once = 2 * hw.collective_time(cluster, "all_to_all", leaving, par.ep, spans_nodes=spans,
                                      ranks_per_node=per_node)
        fwd += once
        total += once * forwards  # the backward's, and the forward's again where the block is recomputed in full
    return fwd, total


def ep_bytes(graph: ModelGraph, par: Parallel, units: Sequence[int]) -> float:
    """What one GPU passes to the ``ep`` all-to-alls in a step, for its `units`: `ep_alltoall_bytes` of each layer of
    packed experts (`Layer.inner`: its first grouped product holds E experts of ``m`` rows each per sample, ``m·E``
    = s·k at uniform routing, and multiplies the tokens' hidden size ``k``), per micro-batch, times the
    micro-batches (under cp each rank routes the rows of its s/cp tokens, `tokens`); under an imbalance
    (`Parallel.imbalance`) the busiest rank's. Under the routing priced the
    runtime measures exactly this (on the busiest rank); otherwise its per-step record shows it next to this."""
    if par.ep == 1:
        return 0.0
    total = sum(ep_alltoall_bytes(tokens(par) * rows, 1, hidden, compute_bytes(par.precision), par.ep,
                                  experts, imbalance=par.imbalance, forwards=forwards)
                for rows, hidden, experts, forwards in _expert_layers(graph, units, par))
    return total * par.num_microbatches


def expert_keys(graph: ModelGraph, par: Parallel) -> frozenset[str]:
    """The packed expert parameters divided among the ep ranks (none when ``ep`` is 1). The dp FSDP groups leave
    them out (`partc.runtime.parallelize.apply_zero`): under ZeRO 1-3 they are sharded over the ``dp / ep`` x ``cp``
    ranks holding the same experts (`Parallel.expert_shard`), in an FSDP group of their own per module
    (`shard_experts`); under ZeRO-0 (or where that is one rank) each rank keeps them whole and all-reduces their
    gradients over those ranks."""
    if par.ep == 1:
        return frozenset()
    return packed_expert_keys(graph) | frozenset(
        graph.tied.get(n, n) for routed in graph.routed_experts for n in routed.params)


def packed_expert_keys(graph: ModelGraph) -> frozenset[str]:
    """The packed experts' parameters (`Layer.inner`): one tensor of all E experts, which FSDP cuts along dim 0."""
    return frozenset(graph.tied.get(n, n) for layer in graph.layers.values() for n in layer.inner)


def routed_rows_layers(graph: ModelGraph) -> frozenset[str]:
    """The layers whose rows the routing decides: packed experts (`Layer.inner`) and the layers of a plain mixture's
    expert modules (`ModelGraph.routed_experts`). A skewed routing scales their work on the busiest ep rank."""
    prefixes = tuple(f"{m}." for routed in graph.routed_experts for m in routed.experts)
    return frozenset(f for f, layer in graph.layers.items() if layer.inner or (prefixes and f.startswith(prefixes)))


def away_experts(graph: ModelGraph, par: Parallel) -> tuple[str, ...]:
    """The expert modules (of plain mixtures of experts) one GPU does not hold under ep: rank 0 of an ep group
    holds the first E/ep of each list, and every rank holds as many of the same experts."""
    if par.ep == 1:
        return ()
    return tuple(m for routed in graph.routed_experts for m in routed.experts[len(routed.experts) // par.ep:])


def expert_state_bytes(num_params: float, par: Parallel, padded: float | None = None) -> Memory:
    """Model states of `num_params` packed expert parameters on one GPU under ep: ZeRO's stage over the ``dp /
    ep`` x ``cp`` ranks holding the same experts (`Parallel.expert_shard`, `zero.model_state_bytes`, of their
    `padded` elements as FSDP pads them over those ranks, `zero.padded_numel`: FSDP cuts dim 0, this rank's E/ep
    experts, so where E/ep is below n a rank holds a whole expert of the padded tensor, Mixtral-8x7B at ep 4 over
    16 ranks: 1 of its 2 experts a rank, not 1/16 of them); under ZeRO-0, or where each rank holds its experts
    alone (``dp == ep`` without cp), as it keeps them whole (fp32 weights, gradients and Adam moments, and the
    compute-dtype copy the forward casts)."""
    if par.zero > 0 and par.expert_shard > 1:
        params, grads, optimizer = zero.model_state_bytes(num_params, par, shards=par.expert_shard, padded=padded)
        return Memory(params=params, grads=grads, optimizer=optimizer)
    params, grads, optimizer = zero.model_state_bytes(num_params, dataclasses.replace(par, zero=0))
    if compute_bytes(par.precision) == zero.MASTER_BYTES:  # fp32: the cast is the weight itself, no copy
        params = num_params * zero.MASTER_BYTES
    return Memory(params=params, grads=grads, optimizer=optimizer)


def expert_dp_bytes(num_params: float, padded: float, par: Parallel) -> float:
    """Bytes one GPU passes to its experts' collectives over the ``dp / ep`` x ``cp`` ranks holding the same experts
    (`Parallel.expert_shard`) in a step (nothing in a group of one): under ZeRO 1-3 FSDP's all-gathers and
    reduce-scatters of `padded` elements (each module of experts a group of its own: gathered twice a micro-batch
    under ZeRO-3, `zero.dp_bytes`); under ZeRO-0 the all-reduce of their `num_params` fp32 gradients."""
    n = par.expert_shard
    if n == 1:
        return 0.0
    if par.zero > 0:
        return sum(zero.dp_bytes(par, num_params, padded, 0.0, shards=n).values())
    return zero.MASTER_BYTES * num_params
