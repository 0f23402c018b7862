"""The cost model's terms: time, memory and traffic of units, ranks and collectives, as pure functions over the IR
(`passes.assemble.predict` puts them together into a plan's step).

Sources (docs/cost-model.md cites each): Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM" (bubble, in-flight micro-batches, TP/PP traffic, model FLOPs; Table 1);
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (activation bytes
per layer, section 4); Rajbhandari et al. 2020, "ZeRO" (model states, Figure 1; DP traffic, section 7). Hardware rates come
from `passes.hw`. The IR is per sample and unsharded: here it is multiplied by the micro-batch size b and divided
by the TP degree t. Symbols as in the papers: b, s, h, a, t, p, m, v, Ψ, N_d.

The mesh is `partc.parallel.MESH` (torchtitan's ("pp", "dp", "cp", "tp"), tp innermost): a TP group crosses nodes
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
import dataclasses
import math
from typing import Sequence

from partc.cluster import Cluster
from partc.ir import ModelGraph, Unit
from partc.parallel import MESH_AXES, TP_STYLES, Parallel, Reads, group_spans_nodes
from partc.precision import compute_bytes
from partc.sharding import GEMM_SPLIT, param_shard
from partc.vocab_loss import VOCAB_PARALLEL
from partc.passes.cost_types import Memory, TPPlan, UnitTime

from . import hw, schedule, zero

# HBM bytes of one Adam step per local parameter (memory-bound): read the fp32 master, gradient, momentum and
# variance (16); write the master and the two moments (12). The compute copy comes from FSDP's next all-gather.
ADAM_STEP_BYTES = 28

LOSS_BYTES = 12
"""Bytes per logit the loss holds at its peak besides the compute-dtype logits, on the last stage: the fp32 copy
the runtime computes the loss from, the fp32 log-probabilities cross-entropy saves, and their fp32 gradient."""


# `predict`'s per-chunk terms and `unit_time_floor`'s per-unit ones, kept in the caller's memo (one graph, its TP
# solution a function of (tp, micro-batch size)): each key is every field of `Parallel` but those the term ignores
# (`partc.parallel.Reads`), then the derived values it reads (the rank's chunks, its parameters, ...).
_PER_MICRO_BATCH = ("dp", "pp", "zero", "global_batch_size", "schedule", "virtual_stages")
FORWARD_FLOOR = Reads("forward_floor", (*_PER_MICRO_BATCH, "recompute", "precision"))  # + the unit's signature


# --- 1. Helpers: styles, recomputation, mesh placement -----------------------------------------------------------

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


# --- 2. Time of one unit per micro-batch -------------------------------------------------------------------------

def _forward_times(graph: ModelGraph, cluster: Cluster, par: Parallel, tp: TPPlan | None,
                   unit: Unit) -> tuple[float, float]:
    """(forward seconds of the unit, of which the attention-core GEMMs) for one micro-batch on one GPU."""
    t, b = par.tp, tokens(par)
    split = is_split(par, tp, unit)
    fwd = 0.0
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
    output added to the sequence-split stream (learned positions: [s, h], the same for every micro-batch size)."""
    b = tokens(par)
    colls = [] if tp is None else tp.collectives.get(unit.fqn, [])
    if not (par.sequence_parallel and par.tp > 1):
        return [(c.kind, c.phase, float(c.nbytes * b)) for c in colls]
    out, params = [], 0
    for c in colls:
        layer = graph.layers.get(c.src)
        n = float(c.nbytes * b)
        if c.kind == "all_reduce" and c.phase == "fwd" and style_of(tp, c.src) == "rowwise":
            out += [("reduce_scatter", "fwd", n), ("all_gather", "bwd", n)]
            if layer is not None and layer.kind == "linear":
                params += sum(math.prod(shape) for name, shape in layer.params.items() if name.endswith(".bias"))
        elif c.kind == "all_reduce" and c.phase == "bwd" and layer is not None and layer.kind == "norm":
            out += [("all_gather", "fwd", n), ("reduce_scatter", "bwd", n)]
            params += sum(math.prod(shape) for shape in layer.params.values())
        elif c.kind == "all_gather" and c.phase == "fwd" and layer is not None and layer.kind == "embedding":
            # a colwise embedding's output gathered, then each rank's part of the sequence kept: the backward
            # all-gathers the gradient over the sequence (`tp_rewrite._colwise_embedding_to_sequence`)
            out += [("all_gather", "fwd", n), ("all_gather", "bwd", n)]
        else:
            out.append((c.kind, c.phase, n))
    if params:
        out.append(("all_reduce", "bwd", float(params * compute_bytes(par.precision))))
    if any(style_of(tp, f) in ("rowwise", "colwise") and graph.layers[f].kind == "embedding" for f in graph.layers):
        for f in unit.layers:
            layer = graph.layers[f]
            if layer.kind == "embedding" and style_of(tp, f) == "replicate":
                out.append(("all_gather", "bwd", float(layer.out_bytes)))
    return out


def launch_time(cluster: Cluster, unit: Unit, mode: str) -> float:
    """Host seconds to issue the unit's kernels for one micro-batch (`Cluster.kernel_launch_s`): its forward
    kernels, twice as many in backward (a GEMM's or a convolution's input and weight gradients; an elementwise op's
    gradient and the accumulation into its input's), and the forward again under full recomputation. The same on
    every TP rank: a split divides a kernel's work, not the kernels."""
    return (3 + (mode == "full")) * unit.kernels * cluster.kernel_launch_s


def unit_time_parts(graph: ModelGraph, cluster: Cluster, par: Parallel, tp: TPPlan | None) -> list[UnitTime]:
    """Compute and TP-communication seconds per micro-batch of each unit on one GPU.

    Backward = 2 x forward (two GEMMs per forward GEMM: input and weight gradients; Narayanan et al. count
    3 x forward FLOPs per step without recompute, 4 x with full recompute). Full recomputation adds one more
    forward; selective adds the attention-core GEMMs' forward (Korthikanti et al.: about s/(6h) extra FLOPs).
    Launches are asynchronous: the compute time is at least the host's time to issue the kernels (`launch_time`),
    which only a unit of many small kernels reaches.
    """
    t = par.tp
    spans_tp = mesh_spans(cluster, par)["tp"]
    per_node = par.ranks_per_node("tp", cluster.gpus_per_node)
    out = []
    seen: dict[tuple, UnitTime] = {}  # identical blocks with identical styles and collectives cost the same
    for unit in graph.units:
        collectives = unit_collectives(graph, par, tp, unit)
        # Blocks of one signature differ only where glue ops were assigned to them (the embedding sum goes with
        # blocks.0): the unit's own totals are part of the key.
        key = (unit.signature if unit.kind == "block" else unit.fqn, unit.fwd_flops, unit.memory_bytes, unit.kernels,
               unit.saved_bytes, unit.saved_bytes_core, unit.saved_bytes_replicated, len(unit.core_gemms),
               tuple(style_of(tp, f) for f in unit.layers), tuple(collectives))
        if key in seen:
            out.append(seen[key])
            continue
        fwd, core = _forward_times(graph, cluster, par, tp, unit)
        mode = recompute_mode(unit, par)
        compute = max(3 * fwd + (fwd if mode == "full" else core if mode == "selective" else 0.0),
                      launch_time(cluster, unit, mode))
        comm = fwd_comm = 0.0
        for kind, phase, nbytes in collectives:
            once = hw.collective_time(cluster, kind, nbytes, t, spans_nodes=spans_tp, ranks_per_node=per_node)
            # Recomputing a whole block replays its forward, collectives included.
            comm += 2 * once if (mode == "full" and phase == "fwd") else once
            fwd_comm += once if phase == "fwd" else 0.0
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


# --- 3. Parameters and model states ------------------------------------------------------------------------------

def _param_shards(graph: ModelGraph, par: Parallel, tp: TPPlan | None, unit: Unit) -> dict[str, int]:
    """Parameter (canonical FQN of a tied one) -> elements one GPU holds, for one unit: the product of its
    `_param_local_shapes` (one sharding rule, `partc.sharding.param_shard`, the layout the runtime allocates)."""
    return {k: math.prod(v) for k, v in _param_local_shapes(graph, par, tp, unit).items()}


def unit_param_shards(graph: ModelGraph, par: Parallel, tp: TPPlan | None) -> list[dict[str, int]]:
    """`_param_shards` of every unit, in order (what `predict` and the search reuse across calls)."""
    return [_param_shards(graph, par, tp, u) for u in graph.units]


def unit_param_counts(graph: ModelGraph, par: Parallel, tp: TPPlan | None) -> list[int]:
    """Parameters each unit holds on one GPU after TP sharding; a tied parameter counts on every unit holding it,
    once within the unit."""
    return [sum(d.values()) for d in unit_param_shards(graph, par, tp)]


def stage_param_count(graph: ModelGraph, par: Parallel, tp: TPPlan | None,
                      units: Sequence[int] | Sequence[Unit], shards: list[dict[str, int]] | None = None) -> int:
    """Parameters on one GPU of a stage (or rank) holding `units`, tied parameters counted once. `shards`:
    `unit_param_shards`, when the caller has it."""
    merged: dict[str, int] = {}
    index = {u.fqn: i for i, u in enumerate(graph.units)} if shards is not None else {}
    for u in _unit_list(graph, units):
        own = shards[index[u.fqn]] if shards is not None else _param_shards(graph, par, tp, u)
        for key, n in own.items():
            merged[key] = max(merged.get(key, 0), n)
    return sum(merged.values())


def model_state_bytes(num_params: float, par: Parallel) -> Memory:
    """Model states per GPU of `num_params` parameters (already divided by TP and PP): the FSDP policies of the
    runtime under the plan's precision (`partc.passes.zero`'s table; Rajbhandari et al.'s 16Ψ, 4Ψ + 12Ψ/N_d...
    assume 16-bit gradients, Megatron-LM's 18Ψ fp32 ones, as here)."""
    params, grads, optimizer = zero.model_state_bytes(num_params, par)
    return Memory(params=params, grads=grads, optimizer=optimizer)


def _param_local_shapes(graph: ModelGraph, par: Parallel, tp: TPPlan | None, unit: Unit) -> dict[str, tuple]:
    """Parameter (canonical FQN) -> its shape on one GPU after TP, for one unit (parameters of the unit outside its
    layers as one flat tensor, replicated). The split is `partc.sharding.param_shard`'s: colwise and rowwise split a
    weight, a bias only under colwise (a rowwise bias is added after the reduction); norms and replicate layers stay
    whole."""
    out: dict[str, tuple] = {}
    in_layers = 0
    for fqn in unit.layers:
        layer, style = graph.layers[fqn], style_of(tp, fqn)
        in_layers += layer.num_params
        for name, shape in layer.params.items():
            shape = list(shape)
            sh = param_shard(layer, name, style) if par.tp > 1 else None
            if sh is not None:
                shape[sh.dim] = -(-shape[sh.dim] // par.tp)
            if par.ep > 1 and name in layer.inner:
                shape[0] //= par.ep
            out[graph.tied.get(name, name)] = tuple(shape)
    if unit.num_params > in_layers:
        out[f"{unit.fqn}:<direct>"] = (unit.num_params - in_layers,)
    return out


def unit_local_shapes(graph: ModelGraph, par: Parallel, tp: TPPlan | None) -> list[dict[str, tuple]]:
    """`_param_local_shapes` of every unit, in order (what `predict` and the search reuse across calls)."""
    return [_param_local_shapes(graph, par, tp, u) for u in graph.units]


def fsdp_groups(graph: ModelGraph, par: Parallel, tp: TPPlan | None, chunk: Sequence[int],
                local_shapes: list[dict[str, tuple]] | None = None) -> tuple[list[float], float, float, float]:
    """FSDP's groups for one model chunk, as `partc.runtime.parallelize.apply_zero` makes them: (parameters of each
    unit with a group of its own, their padded elements, the padded elements of the chunk's root group, its
    parameters). A parameter shared by two units of the chunk (a tied embedding and head) puts both units in the
    root group. `local_shapes`: `unit_local_shapes`, when the caller has it."""
    shapes = [local_shapes[i] if local_shapes is not None else _param_local_shapes(graph, par, tp, graph.units[i])
              for i in chunk]
    owners: dict[str, int] = {}
    for j, s in enumerate(shapes):
        for key in s:
            owners[key] = owners.get(key, 0) + 1
    own, own_padded, rest, rest_padded, seen = [], 0.0, 0.0, 0.0, set()
    for s in shapes:
        shared = any(owners[k] > 1 for k in s)
        numel = sum(math.prod(v) for k, v in s.items() if k not in seen)
        padded = sum(zero.padded_numel(v, par.dp_shard) for k, v in s.items() if k not in seen)
        seen |= set(s)
        if shared:
            rest, rest_padded = rest + numel, rest_padded + padded
        else:
            own.append(float(numel))
            own_padded += padded
    return own, own_padded, rest_padded, rest


# --- 4. Activations ----------------------------------------------------------------------------------------------

def unit_activation_bytes(graph: ModelGraph, par: Parallel, tp: TPPlan | None) -> list[float]:
    """Bytes one micro-batch leaves saved on one GPU for each unit (Korthikanti et al., per transformer layer):
        none       s·b·h·(10 + 24/t + 5·a·s/(h·t))   = rep + (saved - rep) / t
        selective  s·b·h·(10 + 24/t)                 = rep + (saved - rep - core) / t
        full       2·s·b·h                           = input_bytes (2·s·b·h/t under sequence parallelism)
    where rep = saved_bytes_replicated (norm/residual inputs, the "10") and core = saved_bytes_core (what the
    attention core saves beyond its inputs: the 5·a·s²·b of scores, softmax and dropout, and the math kernel's
    scaled Q and K). A unit with no split layer keeps everything (rep = 0, t = 1). Under sequence parallelism the
    norms, dropout masks and residual inputs are 1/t too (Korthikanti et al.: 34·s·b·h/t with selective
    recomputation); partc's program still keeps whole what its colwise Linears save, their all-gathered inputs
    (rep becomes saved_bytes_replicated_linear, 4·s·b·h of a GPT block's 10), where Megatron-Core gathers them
    again in backward.

    Checked against autograd's saved tensors on the CPU (tests/test_activations.py): exact at b = 1 for a GPT and
    a LLaMA, none / selective / full; at b >= 2 the GPT saves 4·s·b·h less a block (matmul copies attention's V
    instead of keeping the fused QKV output alive), so this is high by that much."""
    return [_saved_bytes(par, tp, u, recompute_mode(u, par)) for u in graph.units]


def _saved_bytes(par: Parallel, tp: TPPlan | None, unit: Unit, mode: str) -> float:
    split = is_split(par, tp, unit)
    if mode == "full":  # the block's input: under sequence parallelism, this rank's part of the sequence
        return float(unit.input_bytes * tokens(par)) / (par.tp if split and par.sequence_parallel else 1)
    rep = unit.saved_bytes_replicated if split else 0
    sharded = unit.saved_bytes - rep - (unit.saved_bytes_core if mode == "selective" else 0)
    if split and par.sequence_parallel:  # the norms, dropout and residual on 1/t of the sequence
        sharded += rep - unit.saved_bytes_replicated_linear
        rep = unit.saved_bytes_replicated_linear
    return (rep + sharded / (par.tp if split else 1)) * tokens(par) + _cp_saved_bytes(par, tp, unit)


def _cp_saved_bytes(par: Parallel, tp: TPPlan | None, unit: Unit) -> float:
    """Under context parallelism, what attention saves beyond its share of the trace: the keys and values of the
    whole sequence it was given (gathered, and repeated for grouped-query attention) rather than this rank's
    s/cp tokens of them."""
    if par.cp == 1:
        return 0.0
    return sum(post / (par.tp if style_of(tp, layer) == "colwise" else 1)
               for _, layer, post in unit.cp_kv) * par.micro_batch_size * (1 - 1 / par.cp)


def in_flight(par: Parallel, rank: int) -> float:
    """Micro-batches whose activations pipeline rank `rank` (i) holds at peak. GPipe: m. 1F1B (Narayanan et
    al.): i runs p - i forwards before its first backward: min(p - i, m). Interleaved, v chunks a rank: Megatron's
    and torch.distributed.pipelining's schedules run W = (v - 1)·p + 2·(p - 1 - i) chunk forwards before the first
    backward, then one more; a chunk is 1/v of the rank, so min(W + 1, m·v) / v. For rank 0, p + (p - 1)/v =
    p·(1 + (p - 1)/(p·v)): Korthikanti et al.'s factor, whose "m" is the number of interleaved chunks (v here),
    not of micro-batches. Later ranks hold more than (p - i)·(1 + ...)."""
    p, m = par.pp, par.num_microbatches
    assert 0 <= rank < p, rank
    if par.schedule == "gpipe":
        return float(m)
    v = par.chunks_per_rank
    if v == 1:
        return float(min(p - rank, m))
    warmup = (v - 1) * p + 2 * (p - 1 - rank)
    return min(warmup + 1, m * v) / v


def _held_bytes(graph: ModelGraph, par: Parallel, chunks: Sequence[tuple[int, int]], acts: Sequence[float]
                ) -> list[float]:
    """What one micro-batch's forward of each chunk holds until its backward (`_in_flight_bytes`). Under sequence
    parallelism a block recomputed in full keeps its input, this rank's part of the sequence, which is the
    received boundary itself (nothing gathers it): counted once."""
    b, t = tokens(par), par.tp

    def received(lo: int) -> float:
        got = graph.boundary_bytes(lo - 1, b) / t
        unit = graph.units[lo] if lo < len(graph.units) else None
        if (lo > 0 and unit is not None and par.sequence_parallel and recompute_mode(unit, par) == "full"
                and math.isclose(acts[lo], unit.input_bytes * tokens(par) / t)):  # the split block's input
            return got - min(got, acts[lo])
        return got

    return [sum(acts[lo:hi]) + received(lo) + graph.boundary_bytes(hi - 1, b) / t for lo, hi in chunks]


def _in_flight_bytes(graph: ModelGraph, par: Parallel, rank: int, chunks: Sequence[tuple[int, int]],
                     acts: Sequence[float]) -> float:
    """What the micro-batches in flight on pipeline rank `rank` hold at its peak: each forward in flight holds its
    chunk's saved activations and the boundaries it received and sent (1/t of each under tp, as they cross; the
    pipeline stage keeps both until the micro-batch's backward). One chunk a rank: `in_flight` micro-batches of
    that. Interleaved: the peak of the schedule's own order (`partc.passes.schedule`), where a backward also holds
    the gradient it received."""
    b, t = tokens(par), par.tp
    held = _held_bytes(graph, par, chunks, acts)
    if par.chunks_per_rank == 1:
        return in_flight(par, rank) * held[0]
    grad = [graph.boundary_grad_bytes(hi - 1, b) / t for lo, hi in chunks]
    return schedule.peak_bytes(par.pp, par.chunks_per_rank, par.num_microbatches, rank, held, grad)


def stage_extra_bytes(graph: ModelGraph, par: Parallel, tp: TPPlan | None,
                      units_in_stage: Sequence[int] | Sequence[Unit],
                      shards: list[dict[str, int]] | None = None, *, last: bool = True) -> float:
    """Transient working memory of a stage besides the saved activations, for one micro-batch:
    - full recompute: the backward of a block first rebuilds all its activations (as without recomputation):
      the largest recomputed unit's; selective: the largest recomputed attention core;
    - ZeRO's transient memory (`partc.passes.zero.working_bytes`): gathered units and one unit's gradients;
    - the backward of one unit at a time (`unit_backward_bytes`): the gradients it holds besides the saved
      activations, the largest unit's;
    - last stage: the loss, `LOSS_BYTES` per logit besides the logits themselves (kept whole when the head is
      colwise but the loss gathers them: then the gather's parts are one more copy at its peak); with the
      vocab-parallel loss (`tp_loss`) `vocab_loss_bytes` per logit of this rank's columns, at a moment of its
      own (before any unit's backward).
    `shards`: `unit_param_shards`, when the caller has it. `last` False: in a micro-batch's backward before the last
    (`zero.working_bytes`; the search bounds every stage by the last one's, the larger).
    """
    units = _unit_list(graph, units_in_stage)
    index = {u.fqn: i for i, u in enumerate(graph.units)}
    sizes = [sum((shards[index[u.fqn]] if shards is not None else _param_shards(graph, par, tp, u)).values())
             for u in units]
    last_unit = graph.units[-1]
    backward = unit_backward_bytes(graph, par, tp)
    return _extra_bytes(graph, par, tp, [_rebuilt_bytes(par, tp, u) for u in units], sizes,
                        any(u.fqn == last_unit.fqn for u in units), [backward[index[u.fqn]] for u in units], last)


def vocab_loss_bytes(precision: str) -> int:
    """Bytes per logit of this rank's vocabulary columns at the vocab-parallel loss's peak: the logits (compute
    dtype), the fp32 softmax it saves (its working copy, which becomes the gradient in place), and either the
    compute-dtype gradient it hands back (bf16, made from the fp32 one) or, fp32, the working copy it makes in
    forward beside the logits. 8 bytes either way; measured by ``partc check`` (docs/vocab-parallel-loss.md)."""
    c = compute_bytes(precision)
    return c + 4 + (4 if c == 4 else c)


def tp_loss(graph: ModelGraph, par: Parallel, tp: TPPlan | None) -> str:
    """How the last stage computes the loss under tp (plan.json's ``tp_loss``): ``vocab-parallel`` on the output
    layer's vocabulary columns (`partc.vocab_loss`), or ``gathered: <why>`` from the logits gathered whole; "" at
    tp 1."""
    if par.tp == 1:
        return ""
    head = graph.vocab_loss.get("head")
    if not head:
        return f"gathered: {graph.vocab_loss_why or 'the loss is not a cross-entropy partc can split'}"
    style = style_of(tp, head)
    if style != "colwise":
        return f"gathered: the output layer {head} is {style}, not split over the vocabulary (colwise)"
    return VOCAB_PARALLEL


def _rebuilt_bytes(par: Parallel, tp: TPPlan | None, unit: Unit) -> float:
    """What recomputation rebuilds of the unit for its backward (`stage_extra_bytes`): 0 without recomputation."""
    mode = recompute_mode(unit, par)
    if mode == "none":
        return 0.0
    rebuilt = _saved_bytes(par, tp, unit, "none")  # full: the block's activations, rebuilt for its backward
    if mode == "selective":
        rebuilt -= _saved_bytes(par, tp, unit, "selective")  # only the attention core is rebuilt
    return rebuilt


def unit_backward_bytes(graph: ModelGraph, par: Parallel, tp: TPPlan | None) -> list[float]:
    """Gradients the backward of each unit holds at its peak for one micro-batch on one GPU, besides the saved
    activations: the gradient of the unit's output (the residual stream's; under tp both the 1/t part a pipeline
    stage receives and the whole it gathers) and the widest gradient inside it, made early in its backward while
    everything the unit saved is still held. That is the gradient of a layer's input (GPT's fc2: 4·b·s·h; measured
    by ``partc check``, 14% of a rank holding one block and two micro-batches), or the gradients of the unit's layers
    that feed that input, which the ops between them make from it (SwiGLU's gate and up, 2·b·s·I, while down's
    saved input is freed). The gradients that follow are no larger than the saved tensors freed before them. Under
    tp a rowwise layer's input and a colwise layer's output are 1/t; an embedding's input (token ids) has no
    gradient. Checked against one block's backward on the CPU (tests/test_activations.py)."""
    b, t = tokens(par), par.tp
    fed: dict[str, float] = {}  # layer -> gradients of the layers of its unit that feed its input
    for e in graph.edges:
        if graph.layers[e.src].unit == graph.layers[e.dst].unit:
            split = t > 1 and style_of(tp, e.src) == "colwise"
            fed[e.dst] = fed.get(e.dst, 0.0) + e.bytes / (t if split else 1)
    out = []
    for i, unit in enumerate(graph.units):
        grad = graph.boundary_grad_bytes(i, b)
        largest = 0.0
        for fqn in unit.layers:
            layer = graph.layers[fqn]
            if layer.kind == "embedding":
                continue
            nbytes = float(layer.out_bytes)
            if layer.kind == "linear" and layer.out_features > 0:
                nbytes = layer.out_bytes * layer.in_features / layer.out_features
                if t > 1 and style_of(tp, fqn) == "rowwise":
                    nbytes /= t
            largest = max(largest, nbytes * b, fed.get(fqn, 0.0) * b)
        out.append(grad + (grad / t if t > 1 else 0.0) + largest)
    return out


def _extra_bytes(graph: ModelGraph, par: Parallel, tp: TPPlan | None, rebuilt: Sequence[float],
                 sizes: Sequence[float], holds_last: bool, backward: Sequence[float], last: bool = True) -> float:
    """`stage_extra_bytes` of a stage whose units rebuild `rebuilt`, hold `sizes` parameters on one GPU and hold
    `backward` in their backward (`unit_backward_bytes`), the last unit of the model among them if `holds_last`;
    `last` False: in a micro-batch's backward before the last (`zero.working_bytes`)."""
    extra = max([0.0, *rebuilt]) + zero.working_bytes(par, sizes, last=last) + max([0.0, *backward])
    last = graph.units[-1]
    if holds_last and last.layers and tp_loss(graph, par, tp) == VOCAB_PARALLEL:
        # The loss on this rank's vocabulary columns (`partc.collectives.vocab_parallel_cross_entropy`), nothing
        # gathered. Its peak, in its own backward, comes before any unit's backward: no recomputation, unit
        # gradient or ZeRO reduction yet, only ZeRO-3's gathered units beside it. The larger of the two moments.
        head = graph.layers[last.layers[-1]]
        local = head.out_bytes / compute_bytes(par.precision) * tokens(par) / par.tp
        gathered = compute_bytes(par.precision) * sum(sorted(sizes, reverse=True)[:2]) if par.zero == 3 else 0.0
        return max(extra, vocab_loss_bytes(par.precision) * local + gathered)
    if holds_last and last.layers:
        head = graph.layers[last.layers[-1]]
        logits = head.out_bytes / compute_bytes(par.precision) * tokens(par)
        extra += LOSS_BYTES * logits
        if par.tp > 1 and style_of(tp, head.fqn) == "colwise":
            # the head's output gathered whole: the all-gather's parts, besides the concatenated logits
            extra += compute_bytes(par.precision) * logits
    return extra


# --- 5. Pipeline, data-parallel and optimizer terms --------------------------------------------------------------

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
                   grad_bytes: float | None = None) -> float:
    """One boundary of one micro-batch (`nbytes`, `ModelGraph.boundary_bytes`): the activation forward and its
    gradient backward (`grad_bytes`: what of it needs a gradient, all of it by default). Scatter/gather
    (Narayanan et al. 2021, section 4.1; the program does it, `partc.collectives.scatter_to_next_stage`): the t
    ranks of a TP group hold the same boundary tensor, so each sends only 1/t of it, over its own link, and the
    receiving group all-gathers it over NVLink:
        p2p(b·s·h/t) + all_gather(b·s·h over t ranks)     instead of p2p(b·s·h)."""
    if par.pp <= 1 or nbytes <= 0:
        return 0.0
    t = par.tp
    grad = nbytes if grad_bytes is None else grad_bytes
    tp_spans = par.spans_nodes("tp", cluster.gpus_per_node)
    total = 0.0
    for size in (nbytes, grad):
        if size > 0:
            total += hw.collective_time(cluster, "p2p", size / t, 2, spans_nodes=spans_nodes)
            if t > 1 and not par.sequence_parallel:  # under it, each rank's part of the sequence is its own
                total += hw.collective_time(cluster, "all_gather", size, t, spans_nodes=tp_spans,
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
    tp, dp, cp and pp groups, the dp x cp group FSDP shards over under context parallelism, and the group summing
    a weight shared across pipeline ranks)."""
    sizes = [par.world_size, par.tp, par.dp, par.cp, par.pp] + ([par.dp_shard] if par.cp > 1 else []) + \
        ([2] if shares_weights else [])
    return sum(1 for n in sizes if n > 1)


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


def tp_bytes(graph: ModelGraph, par: Parallel, tp: TPPlan | None, units: Sequence[int]) -> float:
    """TP collective payload of one GPU in a step: m x b x every collective of its units, a forward one twice in a
    block recomputed in full (its forward runs again in backward)."""
    if tp is None or par.tp == 1:
        return 0.0
    total = 0.0
    for i in units:
        unit = graph.units[i]
        full = recompute_mode(unit, par) == "full"
        total += sum(nbytes * (2 if full and phase == "fwd" else 1)
                     for _, phase, nbytes in unit_collectives(graph, par, tp, unit))
    return total * par.num_microbatches


def copy_all_reduces(graph: ModelGraph, tp: TPPlan | None) -> list[tuple[int, tuple[int, ...], int]]:
    """The backward all-reduces of `copy_to_tp` whose readers are not all in the source's unit: (source unit index,
    reader unit indices, bytes per sample). `tp_bytes` and `unit_time_parts` charge each once, to its source's unit;
    the program runs it once on each stage that holds a reader (`copy_moves`)."""
    if tp is None:
        return []
    index = {u.fqn: i for i, u in enumerate(graph.units)}
    out = []
    for fqn, colls in tp.collectives.items():
        for c in colls:
            readers = tuple(index[u] for u in getattr(c, "reader_units", ()))
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
        total += graph.boundary_bytes(lo - 1, b) + graph.boundary_bytes(hi - 1, b)
        total += graph.boundary_grad_bytes(lo - 1, b) + graph.boundary_grad_bytes(hi - 1, b)
    return total * par.num_microbatches / par.tp


def gather_bytes(graph: ModelGraph, par: Parallel, chunks: Sequence[tuple[int, int]]) -> float:
    """TP payload of scatter/gather on one GPU in a step: per micro-batch and chunk, the all-gather (its output, the
    whole boundary) of what the chunk receives forward and of the gradient of what it sends backward."""
    if par.pp == 1 or par.tp == 1 or par.sequence_parallel:  # the boundary is each rank's part of the sequence
        return 0.0
    b, total = tokens(par), 0
    for lo, hi in chunks:
        total += graph.boundary_bytes(lo - 1, b) + graph.boundary_grad_bytes(hi - 1, b)
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


def ep_alltoall_bytes(tokens: int, k: int, hidden: int, nbytes: int, ep: int, num_experts: int,
                      *, backward: bool = True) -> float:
    """Bytes one rank passes to the ``ep`` all-to-alls of one layer of routed experts for one micro-batch of
    `tokens` tokens (`partc.collectives.expert_parallel`), under uniform routing: the share ``(ep - 1) / ep`` of its
    ``tokens x k`` (token, expert) rows of `hidden` elements of `nbytes` bytes leaves the rank, once to the experts
    and once back; the backward sends their gradients the same two ways. The split counts (`num_experts` int64, the
    same share leaving) are exchanged once, in the forward. Nothing when ``ep`` is 1."""
    if ep == 1:
        return 0.0
    leaving = (ep - 1) / ep
    rows = tokens * k * leaving * hidden * nbytes * 2 * (2 if backward else 1)
    return rows + num_experts * leaving * 8


def _expert_layers(graph: ModelGraph, units: Sequence[int]):
    """(rows per sample, hidden size, experts) of each layer of packed experts of `units` (`Layer.inner`: its
    first grouped product holds E experts of ``m`` rows each per sample, ``m·E`` = s·k at uniform routing, and
    multiplies the tokens' hidden size ``k``)."""
    for i in units:
        for fqn in graph.units[i].layers:
            layer = graph.layers[fqn]
            first = next((g for g in layer.gemms if g.inner_split == "n"), None) if layer.inner else None
            if first is not None:
                yield first.batch * first.m, first.k, first.batch


def ep_time(graph: ModelGraph, cluster: Cluster, par: Parallel, units: Sequence[int]) -> tuple[float, float]:
    """(forward, backward) seconds of the ep all-to-alls of one micro-batch on one GPU of `units`: per layer of
    packed experts two all-to-alls each way (to the experts and back), each moving the share of the (token,
    expert) rows that leaves the rank, over NVLink or InfiniBand by where the ep group sits (neighbouring dp
    ranks, ``tp`` apart). Not overlapped with compute."""
    if par.ep == 1:
        return 0.0, 0.0
    stride = par.tp  # dp's neighbours are tp ranks apart (`Parallel.coords`)
    spans = group_spans_nodes(par.ep, stride, cluster.gpus_per_node)
    per_node = max(1, min(par.ep, cluster.gpus_per_node // stride))
    c, total = compute_bytes(par.precision), 0.0
    for rows, hidden, _ in _expert_layers(graph, units):
        leaving = par.micro_batch_size * rows * (par.ep - 1) / par.ep * hidden * c
        total += 2 * hw.collective_time(cluster, "all_to_all", leaving, par.ep, spans_nodes=spans,
                                        ranks_per_node=per_node)
    return total, total


def ep_bytes(graph: ModelGraph, par: Parallel, units: Sequence[int]) -> float:
    """What one GPU passes to the ``ep`` all-to-alls in a step, for its `units`: `ep_alltoall_bytes` of each layer of
    packed experts (`Layer.inner`: its first grouped product holds E experts of ``m`` rows each per sample, ``m·E``
    = s·k at uniform routing, and multiplies the tokens' hidden size ``k``), per micro-batch, times the
    micro-batches. Under uniform routing the runtime measures exactly this; otherwise its per-step record shows it
    next to this."""
    if par.ep == 1:
        return 0.0
    total = sum(ep_alltoall_bytes(par.micro_batch_size * rows, 1, hidden, compute_bytes(par.precision), par.ep,
                                  experts) for rows, hidden, experts in _expert_layers(graph, units))
    return total * par.num_microbatches


def expert_keys(graph: ModelGraph, par: Parallel) -> frozenset[str]:
    """The packed expert parameters divided among the ep ranks (none when ``ep`` is 1). FSDP leaves them alone
    (`partc.runtime.parallelize.apply_zero`): each rank keeps their fp32 weights, gradients and optimizer states
    whole, their gradients all-reduced over the ``dp / ep`` ranks holding the same experts."""
    if par.ep == 1:
        return frozenset()
    return frozenset(graph.tied.get(n, n) for layer in graph.layers.values() for n in layer.inner)


def expert_state_bytes(num_params: float, par: Parallel) -> Memory:
    """Model states of `num_params` packed expert parameters on one GPU under ep: as ZeRO-0 keeps them (fp32
    weights, gradients and Adam moments, and the compute-dtype copy the forward casts), whatever the plan's stage."""
    params, grads, optimizer = zero.model_state_bytes(num_params, dataclasses.replace(par, zero=0))
    if compute_bytes(par.precision) == zero.MASTER_BYTES:  # fp32: the cast is the weight itself, no copy
        params = num_params * zero.MASTER_BYTES
    return Memory(params=params, grads=grads, optimizer=optimizer)


def expert_dp_bytes(num_params: float, par: Parallel) -> float:
    """Bytes one GPU passes to the all-reduce of its experts' fp32 gradients over the ``dp / ep`` ranks holding
    the same experts, once a step (nothing in a group of one)."""
    return zero.MASTER_BYTES * num_params if par.dp // par.ep > 1 else 0.0
