"""The cost model's terms: time, memory and traffic of units, ranks and collectives, as pure functions over the IR
(`passes.assemble.predict` puts them together into a plan's step). The memory terms live in `passes.memory`, the
context- and expert-parallel traffic terms in `passes.cost_axes`, how the terms read a plan (`style_of`,
`is_split`, `recompute_mode`, `mesh_spans`, `tokens`) in `passes.cost_types`; all are re-exported here.

Sources (docs/cost-model.md cites each): Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM" (bubble, in-flight micro-batches, TP/PP traffic, model FLOPs; Table 1);
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (activation bytes
per layer, section 4); Rajbhandari et al. 2020, "ZeRO" (model states, Figure 1; DP traffic, section 7). Hardware rates come
from `passes.hw`. The IR is per sample and unsharded: here it is multiplied by the micro-batch size b and divided
by the TP degree t. Symbols as in the papers: b, s, h, a, t, p, m, v, Ψ, N_d.

The mesh is `partc.mesh_axes.MESH` (torchtitan's ("pp", "dp", "cp", "tp"), tp innermost): a TP group crosses nodes
when t > gpus_per_node, a DP group when dp·t > gpus_per_node, a pipeline hop when the world exceeds one node
(`Parallel.spans_nodes`). A group crossing nodes uses the InfiniBand adapters of all its members in a node
(`Parallel.ranks_per_node`, `hw.link`); a pipeline hop sends 1/t of the boundary from each TP rank and all-gathers
it (scatter/gather, `p2p_round_trip`).

Validated (the figures in docs/cost-model.md and benchmarks/results/): Megatron-LM's Table 1 iteration times
(benchmarks/megatron_table1.py, tests/test_calibration.py); Table 2's PTD-P rows (benchmarks/megatron_table2.py);
activation bytes against autograd's saved tensors (tests/test_activations.py); every collective's payload against
the runtime's (the multi-process tests).
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

from partc.cluster import Cluster
from partc.ir import ModelGraph, Unit
from partc.parallel import TP_STYLES, Parallel
from partc.reads import Reads
from partc.precision import compute_bytes
from partc.sharding import GEMM_SPLIT
from partc.passes.cost_types import (VOCAB_LOSS_REASON, Memory, TPPlan, UnitTime, _unit_list, is_split, mesh_spans,
                                     recompute_mode, style_of, tokens)
# The memory terms and the cp and ep terms (re-exported: the search, `predict` and the tests read them as cost.NAME).
from partc.passes.memory import (LOSS_BYTES, _cp_saved_bytes, _extra_bytes, _held_bytes, _in_flight_bytes,
                                 _param_local_shapes, _param_shards, _rebuilt_bytes, _saved_bytes, fsdp_groups,
                                 in_flight, model_state_bytes, stage_extra_bytes, stage_param_count, tp_loss,
                                 unit_activation_bytes, unit_backward_bytes, unit_local_shapes, unit_param_counts,
                                 unit_param_shards, vocab_loss_bytes)
from partc.passes.cost_axes import (_expert_layers, routed_rows_layers, cp_bytes, cp_time, ep_alltoall_bytes, ep_bytes, ep_time,
                                    expert_dp_bytes, expert_keys, expert_state_bytes)

from . import hw, zero

# HBM bytes of one Adam step per local parameter (memory-bound): read the fp32 master, gradient, momentum and
# variance (16); write the master and the two moments (12). The compute copy comes from FSDP's next all-gather.
ADAM_STEP_BYTES = 28


# `predict`'s per-chunk terms and `unit_time_floor`'s per-unit ones, kept in the caller's memo (one graph, its TP
# solution a function of (tp, micro-batch size)): each key is every field of `Parallel` but those the term ignores
# (`partc.reads.Reads`), then the derived values it reads (the rank's chunks, its parameters, ...).
_PER_MICRO_BATCH = ("dp", "pp", "zero", "global_batch_size", "schedule", "virtual_stages")
FORWARD_FLOOR = Reads("forward_floor", (*_PER_MICRO_BATCH, "recompute", "precision"))  # + the unit's signature


# --- 1. Time of one unit per micro-batch -------------------------------------------------------------------------

def _forward_times(graph: ModelGraph, cluster: Cluster, par: Parallel, tp: TPPlan | None,
                   unit: Unit) -> tuple[float, float]:
    """(forward seconds of the unit, of which the attention-core GEMMs) for one micro-batch on one GPU."""
    t, b = par.tp, tokens(par)
    split = is_split(par, tp, unit)
    fwd = 0.0
    skewed = routed_rows_layers(graph) if par.imbalance != 1.0 else frozenset()
    for fqn in unit.layers:
        layer, style = graph.layers[fqn], style_of(tp, fqn)
        # A colwise layer's output (and so its bias add / elementwise traffic) is sharded; a rowwise output is the
        # full partial sum. An embedding is a lookup, not a GEMM: rowwise (vocab shards) costs only the gather.
        mem_div = t if style == "colwise" else 1
        fwd += hw.memory_time(cluster, layer.memory_bytes * b / mem_div)
        if layer.kind == "embedding":
            continue
        for g in layer.gemms:
            fwd += hw.gemm_time(cluster, g, micro_batch_size=b, split=GEMM_SPLIT[style], degree=t)
        if fqn in skewed:  # experts under a skewed ep routing: the busiest rank runs F times the mean rows
            # through them (`Parallel.imbalance`), F - 1 times more than the above
            fwd += (par.imbalance - 1) * (hw.memory_time(cluster, layer.memory_bytes * b / mem_div) + sum(
                hw.gemm_time(cluster, g, micro_batch_size=b, split=GEMM_SPLIT[style], degree=t) for g in layer.gemms))
    # Attention scores/context: Megatron TP splits them over heads, i.e. the bmm batch (Narayanan et al.).
    core = sum(hw.gemm_time(cluster, g, micro_batch_size=b, split="batch" if split else None, degree=t)
               for g in unit.core_gemms)
    # Non-layer ops (softmax, dropout, activation, residual): the IR has no per-op split, so the share one GPU
    # handles is that of what those ops save (elementwise ops read what they save): (rep + (saved - rep)/t) / saved.
    share = 1.0
    if split and unit.op_saved_bytes > 0:
        rep = unit.op_saved_bytes_replicated
        share = (rep + (unit.op_saved_bytes - rep) / t) / unit.op_saved_bytes
    fwd += core + hw.memory_time(cluster, unit.memory_bytes * b * share)
    return fwd, core


def _replay_time(cluster: Cluster, par: Parallel, tp: TPPlan | None, unit: Unit) -> float:
    """Seconds the backward of `unit` spends replaying its pointwise regions under `fuse_pointwise` (their
    memory-bound forward once more, `Unit.fused_replay_bytes`; the part on split values 1/t)."""
    if not par.fuse_pointwise or not unit.fused_replay_bytes:
        return 0.0
    rep = unit.fused_replay_bytes_replicated
    nbytes = rep + (unit.fused_replay_bytes - rep) / par.tp if is_split(par, tp, unit) else unit.fused_replay_bytes
    return hw.memory_time(cluster, nbytes * tokens(par))


REGATHER = "bwd-regather"
"""The phase of the backward all-gather of the colwise layers' inputs under `sp_regather`: a backward collective
that `unit_time_parts` overlaps with the input gradient's GEMMs."""


REPLAY = "bwd-replay"
"""The phase of a forward all-gather run again in backward by the full recomputation of the unit whose code runs it
(`Collective.runs_in`, its first reader's: a colwise embedding's output gathered in the first block) where its
source's unit is not recomputed (the embedding): counted once, exposed, as a backward collective."""


def _replays(par: Parallel, colls, unit: Unit, units: dict[str, Unit]) -> list[tuple[str, str, float]]:
    """`REPLAY`s of `unit`'s forward all-gathers: where the unit running one (`Collective.runs_in`) is recomputed in
    full and `unit` is not (when both are, `tp_bytes` and `unit_time_parts` count the forward twice already)."""
    if recompute_mode(unit, par) == "full":
        return []
    return [(c.kind, REPLAY, float(c.nbytes * tokens(par))) for c in colls
            if c.phase == "fwd" and c.runs_in and c.runs_in != unit.fqn
            and recompute_mode(units[c.runs_in], par) == "full"]


def regather_hidden_time(graph: ModelGraph, cluster: Cluster, par: Parallel, tp: TPPlan | None, unit: Unit) -> float:
    """Seconds of `unit`'s re-gathers (`sp_regather`) that its colwise Linears' input-gradient GEMMs hide: the
    program issues each all-gather before those GEMMs and waits for it after them (as Megatron-Core does), and an
    input gradient's GEMM takes what its forward GEMM takes (the same FLOPs: `hw.gemm_time` of the forward)."""
    b, t = tokens(par), par.tp
    return sum(hw.gemm_time(cluster, g, micro_batch_size=b, split=GEMM_SPLIT["colwise"], degree=t)
               for fqn in unit.layers if graph.layers[fqn].kind == "linear" and style_of(tp, fqn) == "colwise"
               for g in graph.layers[fqn].gemms)


def unit_collectives(graph: ModelGraph, par: Parallel, tp: TPPlan | None, unit: Unit) -> list[tuple[str, str, float]]:
    """(kind, phase, bytes) of each TP collective of `unit` per micro-batch: the TP solution's, or under sequence
    parallelism (Korthikanti et al. 2022, section 4.2.2; `partc.passes.tp_rewrite`) Megatron's conjugate pairs:
        rowwise output, all-reduce forward      -> reduce-scatter forward + all-gather backward (same tensor)
        colwise input (a norm's output), all-reduce backward -> all-gather forward + reduce-scatter backward
    (each pair moves what the all-reduce moved, in the same time: `hw.collective_time`), and per micro-batch the
    backward all-reduce of the gradients of the parameters applied to each rank's part of the sequence (the norms
    feeding colwise layers and the rowwise layers' biases), the backward all-gather of a colwise embedding's output
    (gathered over its features, then each rank's part of the sequence kept), and the backward all-gather of a
    replicated embedding's
    output added to the sequence-split stream (learned positions: [s, h], the same for every micro-batch size;
    [s/cp, h] on a context-parallel rank).
    A mixture of experts split inside (``inner``) is Megatron-Core's under sequence parallelism: its router runs on
    each rank's part of the sequence (its weight's gradient all-reduced backward), the tokens, the routing weights
    and the chosen experts are all-gathered before the experts (the routing weights' gradient reduce-scattered
    back), and the experts' output is reduce-scattered (all-gathered backward) in place of its all-reduce.
    With `sp_regather` each all-gather before colwise layers runs again in backward (phase `REGATHER`), the
    same bytes. Without sequence parallelism, a forward all-gather the full recomputation of its first reader's
    block runs again (`REPLAY`)."""
    b = tokens(par)
    colls = [] if tp is None else tp.collectives.get(unit.fqn, [])
    if not (par.sequence_parallel and par.tp > 1):
        replays = _replays(par, colls, unit, {u.fqn: u for u in graph.units}) if par.recompute == "full" else []
        return [(c.kind, c.phase, float(c.nbytes * b)) for c in colls] + replays
    program = getattr(tp, "program", {})
    if unit.fqn in program:  # where the program falls back to tensor parallelism: what it runs, and the loss's
        return list(program[unit.fqn]) + [(c.kind, c.phase, float(c.nbytes * b)) for c in colls
                                           if c.reason.startswith(VOCAB_LOSS_REASON)]
    out, params = [], 0
    for c in colls:
        layer = graph.layers.get(c.src)
        n = float(c.nbytes * b)
        if c.kind == "all_reduce" and c.phase == "fwd" and heads(graph, tp, c.src):
            # the model's output (an output layer tied to a colwise token embedding): all-reduced whole for the
            # loss, its input the final norm's output all-gathered (Megatron-LM's edge of sequence parallelism)
            out.append((c.kind, c.phase, n))
            out += [("all_gather", "fwd", float(graph.layers[s].out_bytes * b)) for s in _norms_into(graph, c.src)]
        elif c.kind == "all_reduce" and c.phase == "fwd" and style_of(tp, c.src) in ("rowwise", "inner"):
            out += [("reduce_scatter", "fwd", n), ("all_gather", "bwd", n)]
            if layer is not None and layer.kind == "linear":
                params += sum(math.prod(shape) for name, shape in layer.params.items() if name.endswith(".bias"))
        elif c.kind == "all_reduce" and c.phase == "bwd" and layer is not None and layer.kind == "norm":
            out += [("all_gather", "fwd", n), ("reduce_scatter", "bwd", n)]
            if par.sp_regather:  # the colwise layers kept this rank's part: all-gathered again in backward
                out.append(("all_gather", REGATHER, n))
            params += sum(math.prod(shape) for shape in layer.params.values())
        elif c.kind == "all_gather" and c.phase == "fwd" and layer is not None and layer.kind == "embedding":
            # a colwise embedding's output gathered, then each rank's part of the sequence kept: the backward
            # all-gathers the gradient over the sequence (`tp_sequence._colwise_embedding_to_sequence`)
            out += [("all_gather", "fwd", n), ("all_gather", "bwd", n)]
        elif c.kind == "all_reduce" and c.phase == "bwd" and layer is not None and routes(graph, tp, c.src):
            # a router's output (the routing weights) read by experts split inside, and the experts they chose
            index = sum(e.index_bytes for e in graph.edges if e.src == c.src and style_of(tp, e.dst) == "inner")
            out += [("all_gather", "fwd", n), ("reduce_scatter", "bwd", n)]
            out += [("all_gather", "fwd", float(index * b))] if index else []
            params += sum(math.prod(shape) for shape in layer.params.values())
        else:
            out.append((c.kind, c.phase, n))
    if params:
        out.append(("all_reduce", "bwd", float(params * compute_bytes(par.precision))))
    out += _stream_ends(graph, par, tp, unit, b)
    if any(style_of(tp, f) in ("rowwise", "colwise") and graph.layers[f].kind == "embedding" for f in graph.layers):
        for f in unit.layers:
            layer = graph.layers[f]
            if layer.kind == "embedding" and style_of(tp, f) == "replicate":  # a cp rank's s/cp positions of it
                out.append(("all_gather", "bwd", float(layer.out_bytes) / par.cp))
    return out


def _stream_ends(graph: ModelGraph, par: Parallel, tp: TPPlan | None, unit: Unit,
                 b: int) -> list[tuple[str, str, float]]:
    """Under sequence parallelism, where the stream enters and leaves the split without a split layer
    (`passes.tp_rewrite`): a norm whose every input is whole (a vision transformer's patches and class token,
    made by replicated layers, not the model's inputs) has it scattered along the sequence, its gradient
    all-gathered backward; a replicated head reading fewer rows than the sequence from a norm (the class token,
    the tokens' mean) has the norm's output all-gathered forward (backward, each rank keeps its part of the same
    gradient), and that norm, read by no split layer, has its parameters' gradients all-reduced (it ran on each
    rank's part)."""
    into = {f: graph.edges_into[f] for f in unit.layers if f in graph.edges_into}
    outof = {f: graph.edges_out_of[f] for f in unit.layers if f in graph.edges_out_of}

    def pools(f: str) -> bool:
        layer = graph.layers[f]
        return layer.kind != "norm" and style_of(tp, f) == "replicate" and bool(layer.gemms) and \
            max(g.m for g in layer.gemms) < graph.seq_len and not routes(graph, tp, f)

    out = []
    for f in unit.layers:
        layer = graph.layers[f]
        if layer.kind == "norm":
            if into.get(f) and all(style_of(tp, s) == "replicate" and graph.layers[s].kind != "norm" and
                                   not routes(graph, tp, s) for s in into[f]):
                out.append(("all_gather", "bwd", float(layer.out_bytes * b)))
            if outof.get(f) and all(pools(d) or heads(graph, tp, d) for d in outof[f]):
                out.append(("all_reduce", "bwd", float(sum(math.prod(s) for s in layer.params.values())
                                                       * compute_bytes(par.precision))))
        elif pools(f):
            out += [("all_gather", "fwd", float(graph.layers[s].out_bytes * b)) for s in dict.fromkeys(into.get(f, []))
                    if graph.layers[s].kind == "norm"]
    return out


def heads(graph: ModelGraph, tp: TPPlan | None, fqn: str) -> bool:
    """Whether layer `fqn` is a rowwise Linear whose output only the loss reads (an output layer tied to a colwise
    token embedding): under sequence parallelism its partial outputs are all-reduced whole and its input, the final
    norm's output split along the sequence, is all-gathered first (`passes.tp_rewrite`: the ranks' gradients of it
    are the same, each keeps its part); the norm's parameters, applied to each rank's part, have their gradients
    all-reduced."""
    layer = graph.layers[fqn]
    return layer.kind == "linear" and style_of(tp, fqn) == "rowwise" and fqn not in graph.edges_out_of


def _norms_into(graph: ModelGraph, fqn: str) -> list[str]:
    """The norms whose outputs layer `fqn` reads, each once."""
    return [s for s in dict.fromkeys(graph.edges_into.get(fqn, [])) if graph.layers[s].kind == "norm"]


def routes(graph: ModelGraph, tp: TPPlan | None, fqn: str) -> bool:
    """Whether layer `fqn` is a router: replicated, not a norm, its output read by a layer split inside (under
    sequence parallelism it runs on each rank's part of the sequence, `passes.tp_rewrite`)."""
    layer = graph.layers[fqn]
    return layer.kind != "norm" and style_of(tp, fqn) == "replicate" and \
        any(style_of(tp, d) == "inner" for d in graph.edges_out_of.get(fqn, ()))


def launch_time(cluster: Cluster, unit: Unit, mode: str) -> float:
    """Host seconds to issue the unit's kernels for one micro-batch (`Cluster.kernel_launch_s`): its forward
    kernels, twice as many in backward (a GEMM's or a convolution's input and weight gradients; an elementwise op's
    gradient and the accumulation into its input's), and the forward again under full recomputation. The same on
    every TP rank: a split divides a kernel's work, not the kernels."""
    return (3 + (mode == "full")) * unit.kernels * cluster.kernel_launch_s


def unit_time_parts(graph: ModelGraph, cluster: Cluster, par: Parallel, tp: TPPlan | None,
                    collectives: Sequence[list[tuple[str, str, float]]] | None = None) -> list[UnitTime]:
    """Compute and TP-communication seconds per micro-batch of each unit on one GPU (`collectives`: each unit's
    `unit_collectives`, where the caller has them).

    Backward = 2 x forward (two GEMMs per forward GEMM: input and weight gradients; Narayanan et al. count
    3 x forward FLOPs per step without recompute, 4 x with full recompute). Full recomputation adds one more
    forward; selective adds the attention-core GEMMs' forward (Korthikanti et al.: about s/(6h) extra FLOPs).
    Launches are asynchronous: the compute time is at least the host's time to issue the kernels (`launch_time`),
    which only a unit of many small kernels reaches.
    """
    t = par.tp
    spans_tp = mesh_spans(cluster, par)["tp"]
    per_node = par.ranks_per_node("tp", cluster.gpus_per_node)
    all_collectives = collectives
    out = []
    seen: dict[tuple, UnitTime] = {}  # identical blocks with identical styles and collectives cost the same
    for n, unit in enumerate(graph.units):
        collectives = unit_collectives(graph, par, tp, unit) if all_collectives is None else all_collectives[n]
        # Blocks of one signature differ only where glue ops were assigned to them (the embedding sum goes with
        # blocks.0): the unit's own totals are part of the key.
        key = (unit.signature if unit.kind == "block" else unit.fqn, unit.fwd_flops, unit.memory_bytes, unit.kernels,
               unit.saved_bytes, unit.saved_bytes_core, unit.saved_bytes_replicated, len(unit.core_gemms),
               unit.fused_replay_bytes, unit.fused_replay_bytes_replicated,
               tuple(style_of(tp, f) for f in unit.layers), tuple(collectives))
        if key in seen:
            out.append(seen[key])
            continue
        fwd, core = _forward_times(graph, cluster, par, tp, unit)
        mode = recompute_mode(unit, par)
        compute = max(3 * fwd + (fwd if mode == "full" else core if mode == "selective" else 0.0)
                      + _replay_time(cluster, par, tp, unit), launch_time(cluster, unit, mode))
        comm = fwd_comm = regather = 0.0
        for kind, phase, nbytes in collectives:
            once = hw.collective_time(cluster, kind, nbytes, t, spans_nodes=spans_tp, ranks_per_node=per_node)
            if phase == REGATHER:
                regather += once
                continue
            # Recomputing a whole block replays its forward, collectives included.
            comm += 2 * once if (mode == "full" and phase == "fwd") else once
            fwd_comm += once if phase == "fwd" else 0.0
        if regather:  # what the input gradient's GEMMs do not hide
            comm += max(0.0, regather - regather_hidden_time(graph, cluster, par, tp, unit))
        # The forward's share, for the report's timeline: at least its own launches when those floor the unit.
        fwd_drawn = max(fwd, unit.kernels * cluster.kernel_launch_s)
        seen[key] = UnitTime(compute_s=compute, tp_comm_s=comm, fwd_compute_s=fwd_drawn, fwd_tp_comm_s=fwd_comm)
        out.append(seen[key])
    return out


def unit_time_floor(graph: ModelGraph, cluster: Cluster, par: Parallel, memo: dict | None = None) -> list[float]:
    """A lower bound of `unit_times` under any TP styles, without a TP solve: per layer the cheapest style, the
    attention core and the non-layer ops split or not, whichever is cheaper, and no TP collectives. (Each term of
    `_forward_times` is at least its least value over the styles; compute grows with the forward and core times.)
    `memo` keeps each unit's forward and core floors, which do not depend on the recomputation, across calls."""
    t, b = par.tp, tokens(par)
    out = []
    seen: dict[tuple, float] = {}
    memo = {} if memo is None else memo
    if "floor_keys" not in memo:  # what each unit's floor depends on (identical blocks share it)
        memo["floor_keys"] = [(u.signature if u.kind == "block" else u.fqn, u.fwd_flops, u.memory_bytes, u.kernels,
                               u.op_saved_bytes, u.op_saved_bytes_replicated, len(u.core_gemms))
                              for u in graph.units]
    for unit, key in zip(graph.units, memo["floor_keys"]):
        if key not in seen:
            floor = FORWARD_FLOOR.key(par, key)
            if floor not in memo:
                memo[floor] = _forward_floor(graph, cluster, t, b, unit)
            fwd, core = memo[floor]
            mode = recompute_mode(unit, par)
            seen[key] = max(3 * fwd + (fwd if mode == "full" else core if mode == "selective" else 0.0),
                            launch_time(cluster, unit, mode))
        out.append(seen[key])
    return out


def _forward_floor(graph: ModelGraph, cluster: Cluster, t: int, b: int, unit: Unit) -> tuple[float, float]:
    """`unit_time_floor`'s forward and attention-core seconds of one unit (the least over the TP styles)."""
    fwd = 0.0
    for fqn in unit.layers:
        layer = graph.layers[fqn]
        fwd += min(hw.memory_time(cluster, layer.memory_bytes * b / (t if style == "colwise" else 1))
                   + (0.0 if layer.kind == "embedding" else
                      sum(hw.gemm_time(cluster, g, micro_batch_size=b, split=GEMM_SPLIT[style], degree=t)
                          for g in layer.gemms))
                   for style in TP_STYLES)
    core = min(sum(hw.gemm_time(cluster, g, micro_batch_size=b, split=split, degree=t)
                   for g in unit.core_gemms) for split in (None, "batch"))
    share = 1.0
    if t > 1 and unit.op_saved_bytes > 0:
        rep = unit.op_saved_bytes_replicated
        share = min(1.0, (rep + (unit.op_saved_bytes - rep) / t) / unit.op_saved_bytes)
    fwd += core + hw.memory_time(cluster, unit.memory_bytes * b * share)
    return fwd, core


def unit_times(graph: ModelGraph, cluster: Cluster, par: Parallel, tp: TPPlan | None) -> list[float]:
    """Seconds per micro-batch (forward + backward, recompute forward included, TP collectives included) of each
    unit on one GPU."""
    return [u.compute_s + u.tp_comm_s for u in unit_time_parts(graph, cluster, par, tp)]


# --- 2. Pipeline, data-parallel and optimizer terms --------------------------------------------------------------

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
    each TP rank sends its own part and the next stage gathers nothing (`passes.codegen._scatter_gather`)."""
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
