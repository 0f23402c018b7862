"""The cost model's terms of a step beyond one unit's time: the pipeline (bubble, point-to-point traffic and its
scatter/gather, the boundaries' payload), the data-parallel traffic and the optimizer step, a rank's TP payload
summed over its units and micro-batches (with the copies whose gradient each stage all-reduces), the weights shared
across pipeline ranks, the communicators a GPU holds, and whether a plan fits. `passes.assemble.predict` puts them
together with `passes.cost`'s unit times; the sources are those `passes.cost` cites (Narayanan et al. 2021 for the
pipeline, Rajbhandari et al. 2020 for the data-parallel traffic).
"""

from __future__ import annotations

import bisect
from typing import Sequence

from partc.cluster import Cluster
from partc.ir import ModelGraph
from partc.parallel import Parallel
from partc.passes.cost_types import Memory, TPPlan, recompute_mode, style_of, tokens
from partc.passes.cost_tp import unit_collectives
from partc.passes.memory import unit_local_shapes

from . import hw, zero

# HBM bytes of one Adam step per local parameter (memory-bound): read the fp32 master, gradient, momentum and
# variance (16); write the master and the two moments (12). The compute copy comes from FSDP's next all-gather.
ADAM_STEP_BYTES = 28


def bubble_fraction(par: Parallel) -> float:
    """Idle fraction of the step (Narayanan et al.): (p - 1)/(m + p - 1) for GPipe and 1F1B; interleaved with v
    chunks per rank the bubble shrinks v times: ((p - 1)/v) / (m + (p - 1)/v)."""
    p, m, v = par.pp, par.num_microbatches, par.chunks_per_rank
    return ((p - 1) / v) / (m + (p - 1) / v)


def dp_comm_time(cluster: Cluster, par: Parallel, params_per_gpu: float, spans_nodes: bool, *,
                 padded: tuple[float, float] | None = None, groups: int = 1) -> float:
    """Exposed data-parallel traffic per step (`partc.passes.zero.dp_bytes`: ZeRO-0 all-reduces fp32 gradients
    once, ZeRO-1 gathers and reduce-scatters once, ZeRO-2 every micro-batch, ZeRO-3 gathers twice a micro-batch),
    as NCCL rings with one latency term per call. `padded`: (elements in units of their own, in the root group)
    after FSDP's padding; `groups`: FSDP groups (calls). Left out, they give a lower bound (no padding, one
    group), which the search prunes with. The exposed part is (1 - cluster.dp_overlap) of the total. A group
    spanning nodes uses the InfiniBand adapters of all its members in a node (`Parallel.ranks_per_node`)."""
    unit_padded, rest_padded = padded if padded is not None else (params_per_gpu, 0.0)
    per_node = par.ranks_per_node("dp", cluster.gpus_per_node)
    calls = zero.dp_calls(par, groups)
    total = 0.0
    for kind, nbytes in zero.dp_bytes(par, params_per_gpu, unit_padded, rest_padded).items():
        total += hw.collective_time(cluster, kind, nbytes, par.dp_shard, spans_nodes=spans_nodes, ranks_per_node=per_node)
        total += (calls[kind] - 1) * hw.collective_time(cluster, kind, 0.0, par.dp_shard, spans_nodes=spans_nodes,
                                                        ranks_per_node=per_node, latency_only=True)
    return (1.0 - cluster.dp_overlap) * total


def p2p_round_trip(cluster: Cluster, par: Parallel, nbytes: float, spans_nodes: bool,
                   grad_bytes: float | None = None, split_bytes: float = 0.0) -> float:
    """One boundary of one micro-batch (`nbytes`, `ModelGraph.boundary_bytes`): the activation forward and its
    gradient backward (`grad_bytes`: what of it needs a gradient, all of it by default). Scatter/gather
    (Narayanan et al. 2021, section 4.1; the program does it, `partc.collectives.scatter_to_next_stage`): the t
    ranks of a TP group hold the same boundary tensor, so each sends only 1/t of it, over its own link, and the
    receiving group all-gathers it over NVLink:
        p2p(b·s·h/t) + all_gather(b·s·h over t ranks)     instead of p2p(b·s·h).
    `split_bytes`: the part of `nbytes` (and of its gradient) that the TP ranks hold split already (`split_cut_bytes`):
    each sends its part, and nothing is gathered."""
    if par.pp <= 1 or nbytes <= 0:
        return 0.0
    t = par.tp
    grad = nbytes if grad_bytes is None else grad_bytes
    tp_spans = par.spans_nodes("tp", cluster.gpus_per_node)
    total = 0.0
    for size, gathered in ((nbytes, max(nbytes - grad, 0.0) if par.sequence_parallel else nbytes - split_bytes),
                           (grad, 0.0 if par.sequence_parallel else max(grad - split_bytes, 0.0))):
        if size > 0:
            total += hw.collective_time(cluster, "p2p", size / t, 2, spans_nodes=spans_nodes)
            # Under sequence parallelism each rank's part of the sequence is its own: only what needs no gradient
            # (rotary tables, masks) is held whole, and gathered (`gather_bytes`).
            if t > 1 and gathered > 0:
                total += hw.collective_time(cluster, "all_gather", gathered, t, spans_nodes=tp_spans,
                                            ranks_per_node=par.ranks_per_node("tp", cluster.gpus_per_node))
    return total


def p2p_time(cluster: Cluster, par: Parallel, nbytes: float, spans_nodes: bool) -> float:
    """Pipeline traffic per micro-batch of one rank, `nbytes` a boundary (Narayanan et al.: b·s·h per micro-batch
    between stages, v times as much when interleaved): one send forward and one backward per chunk."""
    return par.chunks_per_rank * p2p_round_trip(cluster, par, nbytes, spans_nodes)


def optimizer_time(cluster: Cluster, par: Parallel, params_per_gpu: float) -> float:
    """Adam step, memory-bound: ADAM_STEP_BYTES per parameter this GPU updates (its shard of Ψ/N_d with ZeRO >=
    1; all of Ψ with ZeRO-0)."""
    local = params_per_gpu / (par.dp_shard if par.zero >= 1 else 1)
    return hw.memory_time(cluster, ADAM_STEP_BYTES * local)


def fits(cluster: Cluster, mem: Memory) -> bool:
    return mem.total <= cluster.usable_memory_bytes


def communicators(par: Parallel, shares_weights: bool) -> int:
    """NCCL communicators one GPU holds: one per process group of more than one rank it belongs to (the world, its
    tp, dp, cp and pp groups, the dp x cp group FSDP shards over under context parallelism, under expert
    parallelism the ep group and the dp / ep x cp ranks holding the same experts, and the group summing a weight
    shared across pipeline ranks)."""
    sizes = [par.world_size, par.tp, par.dp, par.cp, par.pp] + ([par.dp_shard] if par.cp > 1 else []) + \
        ([par.ep, par.expert_shard] if par.ep > 1 else []) + ([2] if shares_weights else [])
    return sum(1 for n in sizes if n > 1)


def tp_bytes(graph: ModelGraph, par: Parallel, tp: TPPlan | None, units: Sequence[int],
             collectives: Sequence[list[tuple[str, str, float]]] | None = None) -> float:
    """TP collective payload of one GPU in a step: m x b x every collective of its units, a forward one twice in a
    block recomputed in full (its forward runs again in backward). `collectives`: every unit's `unit_collectives`,
    where the caller has them."""
    if tp is None or par.tp == 1:
        return 0.0
    total = 0.0
    for i in units:
        unit = graph.units[i]
        full = recompute_mode(unit, par) == "full"
        total += sum(nbytes * (2 if full and phase == "fwd" else 1)
                     for _, phase, nbytes in (unit_collectives(graph, par, tp, unit) if collectives is None
                                              else collectives[i]))
    return total * par.num_microbatches


def copy_all_reduces(graph: ModelGraph, tp: TPPlan | None) -> list[tuple[int, tuple[int, ...], int]]:
    """The backward all-reduces of `copy_to_tp` whose readers are not all in the source's unit: (source unit index,
    reader unit indices, bytes per sample). `tp_bytes` and `unit_time_parts` charge each once, to its source's unit;
    the program runs it once on each stage that holds a reader (`copy_moves`)."""
    if tp is None:
        return []
    index = {u.fqn: i for i, u in enumerate(graph.units)}
    program = getattr(tp, "program", {})  # units charged what their program runs, copies included
    out = []
    for fqn, colls in tp.collectives.items():
        for c in colls:
            readers = tuple(index[u] for u in getattr(c, "reader_units", ()))
            if program and (fqn in program or any(graph.units[r].fqn in program for r in readers)):
                continue
            if readers and set(readers) != {index[fqn]}:
                out.append((index[fqn], readers, c.nbytes))
    return out


def copy_moves(copies: Sequence[tuple[int, tuple[int, ...], int]], bounds: Sequence[tuple[int, int]],
               chunks: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """(count, bytes per sample) to add to the collectives of the rank holding `chunks` of the plan's `bounds`: a
    value read by colwise (or split-inside) layers of several stages is copied by each of them (`passes.codegen`),
    and each copy's backward all-reduces the value's gradient over tp on that stage. One all-reduce per stage that
    holds a reader, where the unit sums charged one to the source's stage (+1 on each reader stage, -1 on the
    source's)."""
    if not copies:
        return []
    starts = [lo for lo, _ in bounds]
    mine = {bisect.bisect_right(starts, lo) - 1 for lo, _ in chunks}
    out = []
    for src, readers, nbytes in copies:
        held = {bisect.bisect_right(starts, r) - 1 for r in readers}
        count = len(held & mine) - (bisect.bisect_right(starts, src) - 1 in mine)
        if count:
            out.append((count, nbytes))
    return out


def pp_bytes(graph: ModelGraph, par: Parallel, chunks: Sequence[tuple[int, int]]) -> float:
    """Pipeline payload of one GPU in a step: per micro-batch and chunk, the boundary received and sent forward and
    the gradients sent and received backward (what needs one: `ModelGraph.cut_grad_bytes`), each its 1/t part
    (scatter/gather, `p2p_round_trip`)."""
    if par.pp == 1:
        return 0.0
    b, total = tokens(par), 0
    for lo, hi in chunks:
        total += graph.boundary_bytes(lo - 1, b, par.cp) + graph.boundary_bytes(hi - 1, b, par.cp)
        total += graph.boundary_grad_bytes(lo - 1, b, par.cp) + graph.boundary_grad_bytes(hi - 1, b, par.cp)
    return total * par.num_microbatches / par.tp


def split_cut_bytes(graph: ModelGraph, tp: TPPlan | None, i: int, micro_batch_size: float,
                    cp: int = 1) -> float:
    """Bytes of one micro-batch of the boundary after units[i] that cross split over tp: the outputs of colwise
    layers read only past it (`ModelGraph.cut_layer_outputs`; a token and a position embedding before their sum).
    The program converts such an output where it is read (`passes.assign`: glue goes with its first reader), so
    each TP rank sends its own part and the next stage gathers nothing (`passes.codegen_traffic._scatter_gather`)."""
    if tp is None or not graph.cut_layer_outputs or not 0 <= i < len(graph.cut_layer_outputs):
        return 0.0
    return float(graph.boundary_layer_bytes(i, {f for f in graph.cut_layer_outputs[i] if style_of(tp, f) == "colwise"},
                                            micro_batch_size, cp))


def gather_bytes(graph: ModelGraph, par: Parallel, chunks: Sequence[tuple[int, int]],
                 tp: TPPlan | None = None) -> float:
    """TP payload of scatter/gather on one GPU in a step: per micro-batch and chunk, the all-gather (its output, the
    whole boundary) of what the chunk receives forward and of the gradient of what it sends backward, but for what
    crosses split already (`split_cut_bytes`: sent as each rank's part, never gathered). Under sequence
    parallelism the activations cross as each rank's part of the sequence: only what needs no gradient (rotary
    tables, masks, token ids: every TP rank holds it whole) is gathered, forward (`passes.codegen`)."""
    if par.pp == 1 or par.tp == 1:
        return 0.0
    b, total = tokens(par), 0
    for lo, hi in chunks:
        if par.sequence_parallel:
            total += graph.boundary_bytes(lo - 1, b, par.cp) - graph.boundary_grad_bytes(lo - 1, b, par.cp)
        else:
            total += graph.boundary_bytes(lo - 1, b, par.cp) - split_cut_bytes(graph, tp, lo - 1, b, par.cp)
            total += max(graph.boundary_grad_bytes(hi - 1, b, par.cp)
                         - split_cut_bytes(graph, tp, hi - 1, b, par.cp), 0)
    return float(total * par.num_microbatches)


def _tied_holders(graph: ModelGraph, par: Parallel, local_shapes: list[dict[str, tuple]]
                  ) -> list[tuple[str, list[int], tuple]]:
    """The parameters held by more than one unit (a tied embedding and head): (canonical FQN, the units holding it,
    its shape on one GPU in the last of them), in the order of first appearance."""
    holders: dict[str, list[int]] = {}
    shapes: dict[str, tuple] = {}
    for i in range(len(graph.units)):
        for key, shape in local_shapes[i].items():
            holders.setdefault(key, []).append(i)
            shapes[key] = shape
    return [(key, units, shapes[key]) for key, units in holders.items() if len(units) > 1]


def shared_weights(graph: ModelGraph, par: Parallel, tp: TPPlan | None, bounds: Sequence[tuple[int, int]],
                   local_shapes: list[dict[str, tuple]] | None = None,
                   tied: list[tuple[str, list[int], tuple]] | None = None) -> dict[int, float]:
    """Pipeline rank -> bytes it all-reduces once a step for the weights it shares with other pipeline ranks (a tied
    embedding and head on the first and the last stage): the fp32 gradient of its shard (after TP, and FSDP's dp
    shard, padded). `local_shapes`: `unit_local_shapes`, when the caller has it; `tied`: `_tied_holders` of them."""
    if par.pp == 1 or not graph.tied:
        return {}
    if tied is None:
        local_shapes = local_shapes if local_shapes is not None else unit_local_shapes(graph, par, tp)
        tied = _tied_holders(graph, par, local_shapes)
    ends = [hi for _, hi in bounds]
    out: dict[int, float] = {}
    for key, units, shape in tied:
        ranks = {bisect.bisect_right(ends, i) % par.pp for i in units}  # chunk k holds units [.., ends[k])
        if len(ranks) > 1:
            nbytes = zero.MASTER_BYTES * zero.padded_numel(shape, par.dp_shard) / par.dp_shard
            for r in ranks:
                out[r] = out.get(r, 0.0) + nbytes
    return out


def shared_time(cluster: Cluster, par: Parallel, nbytes: float) -> float:
    """The all-reduce of shared weights' gradients over pipeline ranks (two of them; across nodes when the
    pipeline spans nodes)."""
    return hw.collective_time(cluster, "all_reduce", nbytes, 2, spans_nodes=par.spans_nodes("pp", cluster.gpus_per_node))
