"""The cost model's memory terms: the parameters and model states one GPU holds, the activations its
micro-batches in flight keep, and a stage's transient working memory (the sources
it cites apply: Korthikanti et al. 2022 for activations, section 4; Rajbhandari et al. 2020 for model states,
Figure 1; Narayanan et al. 2021 for the micro-batches in flight)."""

from __future__ import annotations

import math
from typing import Sequence

from partc.ir import ModelGraph, Unit
from partc.parallel import Parallel
from partc.precision import compute_bytes
from partc.sharding import param_shard
from partc.vocab_loss import VOCAB_PARALLEL
from partc.passes.cost_types import Memory, TPPlan, _unit_list, is_split, recompute_mode, style_of, tokens
from partc.passes.cost_axes import away_experts, expert_keys, routed_rows_layers

from . import schedule, zero

LOSS_BYTES = 12
"""Bytes per logit the loss holds at its peak besides the compute-dtype logits, on the last stage, in its backward
(``_log_softmax_backward_data``): the fp32 log-probabilities cross-entropy saved, the fp32 gradient ``nll_loss``
hands back (dense) and the fp32 gradient of the logits' working copy being made from them (the copy itself, made
from the logits in forward, is freed once the log-probabilities exist; at fp32 the logits are the copy). Measured
by ``partc check`` to the byte (tests/test_context_parallel.py)."""


# --- 1. Parameters and model states ------------------------------------------------------------------------------

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


def model_state_bytes(num_params: float, par: Parallel, padded: float | None = None) -> Memory:
    """Model states per GPU of `num_params` parameters (already divided by TP and PP): the FSDP policies of the
    runtime under the plan's precision (`partc.passes.zero`'s table; Rajbhandari et al.'s 16Ψ, 4Ψ + 12Ψ/N_d...
    assume 16-bit gradients, Megatron-LM's 18Ψ fp32 ones, as here). `padded`: their elements as FSDP pads them
    over ``dp_shard`` (`zero.padded_numel`; unpadded unless given: a lower bound)."""
    params, grads, optimizer = zero.model_state_bytes(num_params, par, padded=padded)
    return Memory(params=params, grads=grads, optimizer=optimizer)


def _param_local_shapes(graph: ModelGraph, par: Parallel, tp: TPPlan | None, unit: Unit) -> dict[str, tuple]:
    """Parameter (canonical FQN) -> its shape on one GPU after TP, for one unit (parameters of the unit outside its
    layers as one flat tensor, replicated). The split is `partc.sharding.param_shard`'s: colwise and rowwise split a
    weight, a bias only under colwise (a rowwise bias is added after the reduction); norms and replicate layers stay
    whole."""
    out: dict[str, tuple] = {}
    in_layers = 0
    away = away_experts(graph, par)
    for fqn in unit.layers:
        layer, style = graph.layers[fqn], style_of(tp, fqn)
        in_layers += layer.num_params
        if any(fqn.startswith(m + ".") for m in away):  # an expert module another ep rank holds
            continue
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


def expert_groups(graph: ModelGraph, par: Parallel, shapes: dict[str, tuple]) -> zero.ExpertGroups:
    """The packed experts among one unit's parameters (`_param_local_shapes`) in FSDP groups of their own, one per
    module holding them (ep under ZeRO 1-3, `partc.runtime.parallelize.shard_experts`); none elsewhere (under
    ZeRO-0, or where each rank holds its experts alone, FSDP leaves them alone)."""
    if par.zero == 0 or par.expert_shard == 1:
        return zero.ExpertGroups()
    keys = expert_keys(graph, par)
    groups: dict[str, list[float]] = {}
    for name, shape in shapes.items():
        if name in keys:
            g = groups.setdefault(name.rsplit(".", 1)[0], [0.0, 0.0])
            g[0] += math.prod(shape)
            g[1] += zero.padded_numel(shape, par.expert_shard)
    if not groups:
        return zero.ExpertGroups()
    largest = max(groups.values(), key=lambda g: g[1])
    return zero.ExpertGroups(held=sum(g[0] for g in groups.values()), padded=sum(g[1] for g in groups.values()),
                             largest=largest[0], largest_padded=largest[1])


def unit_local_shapes(graph: ModelGraph, par: Parallel, tp: TPPlan | None) -> list[dict[str, tuple]]:
    """`_param_local_shapes` of every unit, in order (what `predict` and the search reuse across calls)."""
    return [_param_local_shapes(graph, par, tp, u) for u in graph.units]


def fsdp_groups(graph: ModelGraph, par: Parallel, tp: TPPlan | None, chunk: Sequence[int],
                local_shapes: list[dict[str, tuple]] | None = None) -> tuple[list[float], float, float, float]:
    """FSDP's groups for one model chunk, as `partc.runtime.parallelize.apply_zero` makes them: (parameters of each
    unit with a group of its own, their padded elements, the padded elements of the chunk's root group, its
    parameters). A parameter shared by two units of the chunk (a tied embedding and head) puts both units in the
    root group. The packed experts under ep are in groups of their own (`expert_keys`): left out of the elements.
    `local_shapes`: `unit_local_shapes`, when the caller has it."""
    shapes = [local_shapes[i] if local_shapes is not None else _param_local_shapes(graph, par, tp, graph.units[i])
              for i in chunk]
    owners: dict[str, int] = {}
    for j, s in enumerate(shapes):
        for key in s:
            owners[key] = owners.get(key, 0) + 1
    own, own_padded, rest, rest_padded, seen = [], 0.0, 0.0, 0.0, set(expert_keys(graph, par))
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


# --- 2. Activations ----------------------------------------------------------------------------------------------

def unit_activation_bytes(graph: ModelGraph, par: Parallel, tp: TPPlan | None) -> list[float]:
    """Bytes one micro-batch leaves saved on one GPU for each unit (Korthikanti et al., per transformer layer):
        none       s·b·h·(10 + 24/t + 5·a·s/(h·t))   = rep + (saved - rep) / t
        selective  s·b·h·(10 + 24/t)                 = rep + (saved - rep - core) / t
        full       2·s·b·h                           = input_bytes (2·s·b·h/t under sequence parallelism)
    where rep = saved_bytes_replicated (norm/residual inputs, the "10") and core = saved_bytes_core (what the
    attention core saves beyond its inputs: the 5·a·s²·b of scores, softmax and dropout, and the math kernel's
    scaled Q and K). A unit with no split layer keeps everything (rep = 0, t = 1), but under sequence parallelism
    after the first split unit (the final norm), where the program runs it on this rank's 1/t of the sequence: all
    of it / t. Under sequence parallelism the
    norms, dropout masks and residual inputs are 1/t too (Korthikanti et al.: 34·s·b·h/t with selective
    recomputation); partc's program keeps whole what its colwise Linears save, their all-gathered inputs
    (rep becomes saved_bytes_replicated_linear, 4·s·b·h of a GPT block's 10), unless `sp_regather` gathers them
    again in backward as Megatron-Core does (rep becomes 0: everything 1/t). A unit where the program does not keep
    the split along the sequence (`TPSolution.program`: a fallback, or the conversions at its edges) is priced as
    tensor parallelism alone runs it (rep whole): a bound from above for a unit that falls back in part.

    Checked against autograd's saved tensors on the CPU (tests/test_activations.py): exact at b = 1 for a GPT and
    a LLaMA, none / selective / full; at b >= 2 the GPT saves 4·s·b·h less a block (matmul copies attention's V
    instead of keeping the fused QKV output alive), so this is high by that much."""
    out: list[float] = []
    sp = par.sequence_parallel and par.tp > 1
    fallback = set(getattr(tp, "program", None) or ()) if sp else set()
    along = False  # whether a unit before this one splits the residual stream along the sequence
    for u in graph.units:
        split = is_split(par, tp, u)
        sequence = sp and u.fqn not in fallback and (split or along)
        along = along or (sp and split)
        out.append(_saved_bytes(par, tp, u, recompute_mode(u, par), sequence) + _skew_saved_bytes(graph, par, u))
    return out


def _skew_saved_bytes(graph: ModelGraph, par: Parallel, unit: Unit) -> float:
    """What the busiest ep rank keeps beyond the trace's share under a skewed routing (`Parallel.imbalance` F): its
    experts' layers (`routed_rows_layers`) save F times what they save for the mean rows, F - 1 times more (all
    they save counted as the experts' rows: the rows received, their intermediate products). Nothing under full
    recomputation (the block keeps its input) or uniform routing."""
    if par.imbalance == 1.0 or recompute_mode(unit, par) == "full":
        return 0.0
    routed = routed_rows_layers(graph)
    return (par.imbalance - 1) * sum(graph.layers[f].saved_bytes for f in unit.layers if f in routed) * tokens(par)


def _saved_bytes(par: Parallel, tp: TPPlan | None, unit: Unit, mode: str, sequence: bool | None = None) -> float:
    """`unit_activation_bytes` of one unit; `sequence`: whether the program runs it split along the sequence
    (default: under sequence parallelism, a unit with a split layer)."""
    split = is_split(par, tp, unit)
    if sequence is None:
        sequence = split and par.sequence_parallel
    if mode == "full":  # the block's input: under sequence parallelism, this rank's part of the sequence
        return float(unit.input_bytes * tokens(par)) / (par.tp if sequence or (split and par.sequence_parallel)
                                                         else 1)
    saved, replicated = unit.saved_bytes, unit.saved_bytes_replicated
    if par.fuse_pointwise:  # fused kernels' memory: the regions at their inputs, keys and values unrepeated
        saved, replicated = saved - unit.fused_saved_bytes, replicated - unit.fused_saved_bytes_replicated
        if par.cp == 1:  # under cp the attention is context parallelism's, which repeats them as before
            saved -= unit.fused_gqa_saved_bytes
            replicated -= unit.fused_gqa_saved_bytes_replicated
    rep = replicated if split else 0
    sharded = saved - rep - (unit.saved_bytes_core if mode == "selective" else 0)
    # the tables and positions without the batch (counted whole below, each a sample): once a micro-batch
    once = min(unit.saved_bytes_once, saved) * (tokens(par) - 1 / par.cp)
    if not split:  # all of it whole, or on this rank's part of the sequence (but the tables and positions)
        fixed = min(unit.saved_bytes_fixed, sharded) if sequence else 0
        return ((sharded - fixed) / (par.tp if sequence else 1) + fixed) * tokens(par) - once + \
            _cp_saved_bytes(par, tp, unit)
    if sequence:  # the norms, dropout and residual on 1/t of the sequence
        # and, gathered again in backward (`sp_regather`), the colwise Linears' inputs; the tables and positions
        # whole
        kept = min(rep, (0 if par.sp_regather else unit.saved_bytes_replicated_linear) + unit.saved_bytes_fixed)
        sharded += rep - kept
        rep = kept
    return (rep + sharded / (par.tp if split else 1)) * tokens(par) - once + _cp_saved_bytes(par, tp, unit)


def _cp_saved_bytes(par: Parallel, tp: TPPlan | None, unit: Unit) -> float:
    """Under context parallelism, what attention saves beyond its share of the trace: the keys and values of the
    whole sequence it was given (gathered, and repeated for grouped-query attention) rather than this rank's
    s/cp tokens of them; and its output a second time. A fused kernel's output is laid out [b, s, heads, d], so
    the output projection's input (heads and d merged) is a view of it and the trace saves one tensor; under cp
    each query chunk's kernel saves its own output and `cp_attention` concatenates them in a new tensor, which the
    output projection saves: one more [s/cp, h/t] a block and micro-batch (`tests/test_context_parallel.py`)."""
    if par.cp == 1:
        return 0.0
    split = lambda layer: par.tp if style_of(tp, layer) == "colwise" else 1  # noqa: E731
    kv = sum(post / split(layer) for _, layer, post in unit.cp_kv) * (1 - 1 / par.cp)
    out = sum(nbytes / split(layer) for nbytes, layer in unit.cp_out) / par.cp
    return (kv + out) * par.micro_batch_size


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
    """What one micro-batch's forward of each chunk holds until its backward (`_in_flight_bytes`): its units' saved
    activations and, of the boundaries it received and sent (1/t of each under tp, as they cross), the parts that
    need no gradient. The runtime frees the data of the others once the forward has used them, as Megatron-LM does
    (`partc.runtime.schedule.PipeStage`): the output once its send is posted, the received input when no op saved
    it. Where an op saved the received input (a LayerNorm its input, a block recomputed in full its input, under
    sequence parallelism the received part itself) it is among that unit's saved activations, counted once."""
    b, t = tokens(par), par.tp

    def kept(i: int) -> float:  # the part of the boundary after unit i that needs no gradient
        return (graph.boundary_bytes(i, b, par.cp) - graph.boundary_grad_bytes(i, b, par.cp)) / t

    return [sum(acts[lo:hi]) + kept(lo - 1) + kept(hi - 1) for lo, hi in chunks]


def _in_flight_bytes(graph: ModelGraph, par: Parallel, rank: int, chunks: Sequence[tuple[int, int]],
                     acts: Sequence[float], held: list[float] | None = None) -> float:
    """What the micro-batches in flight on pipeline rank `rank` hold at its peak: each forward in flight holds its
    chunk's saved activations and what the pipeline stage keeps of the boundaries it received and sent until the
    micro-batch's backward (`_held_bytes`). One chunk a rank: `in_flight` micro-batches of that. Interleaved: the
    peak of the schedule's own order (`partc.passes.schedule`), where a backward also holds the gradient it
    received. `held`: `_held_bytes` of the same chunks, when the caller has it."""
    b, t = tokens(par), par.tp
    held = _held_bytes(graph, par, chunks, acts) if held is None else held
    if par.chunks_per_rank == 1:
        return in_flight(par, rank) * held[0]
    grad = [graph.boundary_grad_bytes(hi - 1, b, par.cp) / t for lo, hi in chunks]
    return schedule.peak_bytes(par.pp, par.chunks_per_rank, par.num_microbatches, rank, held, grad)


def stage_extra_bytes(graph: ModelGraph, par: Parallel, tp: TPPlan | None,
                      units_in_stage: Sequence[int] | Sequence[Unit],
                      shards: list[dict[str, int]] | None = None, *, last: bool = True,
                      backward: list[float] | None = None) -> float:
    """Transient working memory of a stage besides the saved activations, for one micro-batch:
    - full recompute: the backward of a block first rebuilds all its activations (as without recomputation):
      the largest recomputed unit's; selective: the largest recomputed attention core;
    - ZeRO's transient memory (`partc.passes.zero.working_bytes`): gathered units and one unit's gradients;
    - the backward of one unit at a time (`unit_backward_bytes`): the gradients it holds besides the saved
      activations, the largest unit's;
    - last stage: the loss, at a moment of its own: its peak, in its own backward, comes before any unit's
      backward (no recomputation, unit gradient or ZeRO reduction yet, and under ZeRO-3 every unit resharded
      after its forward, the head's gathered again only once the loss's backward is done): the logits and
      `LOSS_BYTES` per logit (the whole vocabulary: at tp 1, or gathered under tp, the gather's parts freed by
      then), or with the vocab-parallel loss (`tp_loss`) `vocab_loss_bytes` per logit of this rank's columns.
      The larger of the two moments; measured by ``partc check``.
    `shards`: `unit_param_shards`, when the caller has it. `last` False: in a micro-batch's backward before the last
    (`zero.working_bytes`; the search bounds every stage by the last one's, the larger; unpadded, as the search
    keeps it whatever dp: `partc.passes.assemble.predict` prices FSDP's padding). `backward`:
    `unit_backward_bytes`, when the caller has it.
    """
    units = _unit_list(graph, units_in_stage)
    index = {u.fqn: i for i, u in enumerate(graph.units)}
    sizes = [sum((shards[index[u.fqn]] if shards is not None else _param_shards(graph, par, tp, u)).values())
             for u in units]
    last_unit = graph.units[-1]
    backward = unit_backward_bytes(graph, par, tp) if backward is None else backward
    experts = [expert_groups(graph, par, _param_local_shapes(graph, par, tp, u)) for u in units]
    return stage_extra_bytes_of(graph, par, tp, [_rebuilt_bytes(par, tp, u) for u in units], sizes,
                                any(u.fqn == last_unit.fqn for u in units), [backward[index[u.fqn]] for u in units],
                                experts, last=last)


def stage_extra_bytes_of(graph: ModelGraph, par: Parallel, tp: TPPlan | None, rebuilt: Sequence[float],
                         sizes: Sequence[float], holds_last: bool, backward: Sequence[float],
                         experts: Sequence[zero.ExpertGroups], *, last: bool = True) -> float:
    """`stage_extra_bytes` from its units' lists (`_extra_bytes`'s, and `expert_groups` of each unit): what the
    search computes from the lists it caches per configuration, not made again per stage."""
    extra = _extra_bytes(graph, par, tp, rebuilt, sizes, holds_last, backward, last, experts=experts)
    return max(extra, zero.reduction_bytes(par, sizes, experts))  # the experts' reduction: a moment of its own


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
    gradient. Under `sp_regather` a colwise Linear's backward also holds its input, all-gathered again. Under
    `fuse_pointwise` a pointwise region's backward runs it again beside those gradients: the largest region's
    replayed values too. Checked against one block's backward on the CPU (tests/test_activations.py)."""
    b, t, c = tokens(par), par.tp, compute_bytes(par.precision)
    fed: dict[str, float] = {}  # layer -> gradients of the layers of its unit that feed its input
    for e in graph.edges:
        if graph.layers[e.src].unit == graph.layers[e.dst].unit:
            split = t > 1 and style_of(tp, e.src) == "colwise"
            fed[e.dst] = fed.get(e.dst, 0.0) + e.bytes / (t if split else 1)
    out = []
    for i, unit in enumerate(graph.units):
        grad = graph.boundary_grad_bytes(i, b, par.cp)
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
                elif par.sp_regather and style_of(tp, fqn) == "colwise":
                    nbytes *= 2  # its input all-gathered again, beside that input's gradient
            largest = max(largest, nbytes * b, fed.get(fqn, 0.0) * b, _combine_backward_bytes(layer, c) * b)
        if par.fuse_pointwise:  # a region replayed beside those gradients (recomputed or not)
            split = is_split(par, tp, unit)
            largest += b * max(unit.fused_replay_peak_bytes_replicated / (t if split and par.sequence_parallel else 1),
                               unit.fused_replay_peak_bytes / (t if split else 1))
        out.append(grad + (grad / t if t > 1 else 0.0) + largest)
    return out


def _combine_backward_bytes(layer, c: int) -> float:
    """Per sample, what the backward of a layer of packed experts (`Layer.inner`) holds first: the gradients of
    its weighted sum, in fp32 where the routing weights are (Hugging Face's routers take their softmax or sigmoid in
    fp32, and each (token, expert) row's result times its weight is fp32): the sum's (s x h), the rows' put back in
    expert order, their product with the routing weights and the one with the results that gives the weights'
    gradient (3 x s·k x h), all while the layer's saved tensors are held. Measured on the CPU, Hugging Face's layer
    and `expert_parallel`'s alike (tests/test_activations.py): 7.5 times the rows' compute-dtype bytes at k = 2, not
    the layer's output gradient (s x h) alone. 0 for any other layer."""
    first = next((g for g in layer.gemms if g.inner_split == "n"), None) if layer.inner else None
    if first is None:
        return 0.0
    rows = first.batch * first.m  # s·k (token, expert) rows of h = first.k elements
    return float(layer.out_bytes) / c * 4 + 3 * rows * first.k * 4  # out_bytes: s x h in the compute dtype


def _extra_bytes(graph: ModelGraph, par: Parallel, tp: TPPlan | None, rebuilt: Sequence[float],
                 sizes: Sequence[float], holds_last: bool, backward: Sequence[float], last: bool = True,
                 padded: Sequence[float] | None = None, experts: Sequence[zero.ExpertGroups] | None = None) -> float:
    """`stage_extra_bytes` of a stage whose units rebuild `rebuilt`, hold `sizes` parameters on one GPU (`experts`
    of them packed experts in groups of their own, `expert_groups`) and hold `backward` in their backward
    (`unit_backward_bytes`), the last unit of the model among them if `holds_last`; `last` False: in a
    micro-batch's backward before the last; `padded`: the units' elements as FSDP pads them
    (`zero.working_bytes`)."""
    extra = (max([0.0, *rebuilt]) + zero.working_bytes(par, sizes, last=last, padded=padded, experts=experts)
             + max([0.0, *backward]))
    last_unit = graph.units[-1]
    if not (holds_last and last_unit.layers):
        return extra
    # The loss's own moment (`stage_extra_bytes`), before any unit's backward: nothing else of the list above is
    # held beside it.
    c = compute_bytes(par.precision)
    logits = graph.layers[last_unit.layers[-1]].out_bytes / c * tokens(par)
    if tp_loss(graph, par, tp) == VOCAB_PARALLEL:  # this rank's vocabulary columns, nothing gathered
        # (`partc.collectives.vocab_parallel_cross_entropy`)
        return max(extra, vocab_loss_bytes(par.precision) * logits / par.tp)
    return max(extra, (c + LOSS_BYTES) * logits)
