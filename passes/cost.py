"""The cost model's time of one unit per micro-batch on one GPU: its forward GEMMs and memory-bound ops under the
plan's TP styles, the backward and the recomputation derived from them, the host's kernel launches as a floor, and
the unit's TP collectives priced over its group (`unit_time_parts`); and a lower bound of it without a TP solve
that the search orders configurations by (`unit_time_floor`). `passes.assemble.predict` puts the terms together
into a plan's step. The other terms, each in a module of its own: a unit's TP collectives in `passes.cost_tp`, the
pipeline, data-parallel and optimizer terms of a step in `passes.cost_step`, the memory terms in `passes.memory`,
the context- and expert-parallel traffic in `passes.cost_axes`, how the terms read a plan (`style_of`, `is_split`,
`recompute_mode`, `mesh_spans`, `tokens`) in `passes.cost_types`.

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
it (scatter/gather, `passes.cost_step.p2p_round_trip`).

Validated (the figures in docs/cost-model.md and benchmarks/results/): Megatron-LM's Table 1 iteration times
(benchmarks/megatron_table1.py, tests/test_calibration.py); Table 2's PTD-P rows (benchmarks/megatron_table2.py);
activation bytes against autograd's saved tensors (tests/test_activations.py); every collective's payload against
the runtime's (the multi-process tests).
"""

from __future__ import annotations

from typing import Sequence

from partc.cluster import Cluster
from partc.ir import ModelGraph, Unit
from partc.parallel import TP_STYLES, Parallel
from partc.reads import Reads
from partc.sharding import GEMM_SPLIT
from partc.passes.cost_types import TPPlan, UnitTime, is_split, mesh_spans, recompute_mode, style_of, tokens
from partc.passes.cost_axes import routed_rows_layers
from partc.passes.cost_tp import REGATHER, unit_collectives

from . import hw


# `predict`'s per-chunk terms and `unit_time_floor`'s per-unit ones, kept in the caller's memo (one graph, its TP
# solution a function of (tp, micro-batch size)): each key is every field of `Parallel` but those the term ignores
# (`partc.reads.Reads`), then the derived values it reads (the rank's chunks, its parameters, ...).
_PER_MICRO_BATCH = ("dp", "pp", "zero", "global_batch_size", "schedule", "virtual_stages")
FORWARD_FLOOR = Reads("forward_floor", (*_PER_MICRO_BATCH, "recompute", "precision"))  # + the unit's signature


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


def regather_hidden_time(graph: ModelGraph, cluster: Cluster, par: Parallel, tp: TPPlan | None, unit: Unit) -> float:
    """Seconds of `unit`'s re-gathers (`sp_regather`) that its colwise Linears' input-gradient GEMMs hide: the
    program issues each all-gather before those GEMMs and waits for it after them (as Megatron-Core does), and an
    input gradient's GEMM takes what its forward GEMM takes (the same FLOPs: `hw.gemm_time` of the forward)."""
    b, t = tokens(par), par.tp
    return sum(hw.gemm_time(cluster, g, micro_batch_size=b, split=GEMM_SPLIT["colwise"], degree=t)
               for fqn in unit.layers if graph.layers[fqn].kind == "linear" and style_of(tp, fqn) == "colwise"
               for g in graph.layers[fqn].gemms)


def _fwd_bwd_time(fwd: float, core: float, mode: str) -> float:
    """A unit's GPU seconds from its forward `fwd` (of which `core` in the attention core) under recomputation
    `mode`: the forward, a backward of twice it, and the forward again in full (``full``) or the core's
    (``selective``). `unit_time_parts` and its floor `unit_time_floor` both price a unit so."""
    return 3 * fwd + (fwd if mode == "full" else core if mode == "selective" else 0.0)


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
        compute = max(_fwd_bwd_time(fwd, core, mode) + _replay_time(cluster, par, tp, unit),
                      launch_time(cluster, unit, mode))
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
            seen[key] = max(_fwd_bwd_time(fwd, core, mode), launch_time(cluster, unit, mode))
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
