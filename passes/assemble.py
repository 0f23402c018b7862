"""A plan's step, assembled from the cost model's terms (`passes.cost`): per pipeline rank its units' time, memory
by category and collective payload by mesh axis, then the pipeline's step time (`predict`), and whether a split
fits (`fits_memory`). The search calls these once per candidate with a memo of the per-chunk terms, keyed by what
each reads of the configuration (`partc.reads.Reads`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from partc.cluster import Cluster
from partc.errors import PartcError
from partc.ir import ModelGraph
from partc.mesh_axes import AXES
from partc.parallel import Parallel
from partc.reads import Reads
from partc import timeline
from partc.passes.cost import _PER_MICRO_BATCH, unit_time_parts
from partc.passes.cost_tp import unit_collectives
from partc.passes.cost_step import (_tied_holders, bubble_fraction, communicators, copy_all_reduces, copy_moves,
                                    dp_comm_time, fits, gather_bytes, optimizer_time, p2p_round_trip, pp_bytes,
                                    shared_time, shared_weights, split_cut_bytes, tp_bytes)
from partc.passes.memory import (_extra_bytes, _held_bytes, _in_flight_bytes, _rebuilt_bytes, expert_groups,
                                 fsdp_groups, in_flight, model_state_bytes, stage_param_count, unit_activation_bytes,
                                 unit_backward_bytes, unit_local_shapes, unit_param_shards)
from partc.passes.cost_axes import (cp_bytes, cp_time, ep_bytes, ep_time, expert_dp_bytes, expert_keys,
                                    expert_state_bytes)
from partc.passes.cost_types import Prediction, RankPrediction, TPPlan, UnitTime, mesh_spans, tokens

from . import hw, schedule, zero

# `predict`'s per-chunk terms, kept in the caller's memo (one graph, its TP solution a function of (tp, micro-batch
# size)): each key is every field of `Parallel` but those the term ignores, then the derived values it reads.
TIED = Reads("tied", (*_PER_MICRO_BATCH, "recompute"))  # parameters held by two units: (tp, b)
COPIES = Reads("copies", (*_PER_MICRO_BATCH, "recompute"))  # the TP copies' readers (`copy_all_reduces`): (tp, b)
UNITS = Reads("units", (*_PER_MICRO_BATCH, "recompute"))  # parameters a unit holds on one GPU: (tp, b)
PADDED = Reads("padded", ("pp", "zero", "global_batch_size", "schedule", "virtual_stages", "recompute"))  # + dp
EXPERTS = Reads("experts", (*_PER_MICRO_BATCH, "recompute"))  # packed expert parameters on one GPU: (tp, ep)
EXPERT_PADDED = Reads("expert_padded", PADDED.ignores)  # FSDP's padded packed experts on one GPU: (tp, dp, ep)
EXPERT_GROUPS = Reads("expert_groups", ("pp", "global_batch_size", "schedule", "virtual_stages", "recompute"))  # each
# unit's packed experts in FSDP groups of their own (`expert_groups`): (tp, dp, ep, zero)
EP_TIME = Reads("ep_time", ("pp", "zero", "global_batch_size", "schedule", "virtual_stages"))
REBUILT = Reads("rebuilt", _PER_MICRO_BATCH)  # what recomputation rebuilds: (tp, b, recompute)
BACKWARD = Reads("backward", (*_PER_MICRO_BATCH, "recompute"))  # what a unit's backward holds: (tp, b)
EXTRA = Reads("extra", ("dp", "pp", "global_batch_size", "schedule", "virtual_stages"))  # + the chunks, FSDP's dp
# and the ranks sharding the packed experts under ep (dp / ep x cp: their groups' reductions)
TIME = Reads("time", _PER_MICRO_BATCH)  # + the chunks; with the forward's share, for the timeline
TP_BYTES = Reads("tp_bytes", _PER_MICRO_BATCH)  # + the micro-batch count and the chunks
CP_TIME = Reads("cp_time", ("dp", "zero", "global_batch_size", "schedule", "virtual_stages"))  # + the chunks
DP_TIME = Reads("dp_time", ("pp", "schedule", "virtual_stages", "recompute"))  # + the rank's parameters and groups
PP_TIME = Reads("pp_time", ("dp", "zero", "recompute", "global_batch_size", "schedule", "virtual_stages",
                            "fuse_pointwise"))  # + whether the pp groups cross nodes, and the chunks
COLLECTIVES = Reads("collectives", (*_PER_MICRO_BATCH, "recompute", "fuse_pointwise"))  # each unit's TP collectives
# All of `_RankTerms` at once, for a configuration: what every one of its terms reads (a lookup, not eight). Derived
# from their own keys: a term added to `_RankTerms` joins `_BUNDLED`.
_BUNDLED = (TIED, UNITS, PADDED, EXPERTS, EXPERT_PADDED, EXPERT_GROUPS, REBUILT, BACKWARD)
RANK_TERMS = Reads("rank_terms", frozenset.intersection(*(r.ignores for r in _BUNDLED)))


def collectives_of(graph: ModelGraph, par: Parallel, tp: TPPlan | None, memo: dict | None) -> list:
    """Every unit's `unit_collectives` under `par` and `tp`, once per key of what they read in `memo` (as
    `predict`'s)."""
    return _Memo(memo)(COLLECTIVES.key(par), lambda: [unit_collectives(graph, par, tp, u) for u in graph.units])


def backward_of(graph: ModelGraph, par: Parallel, tp: TPPlan | None, memo: dict | None) -> list[float]:
    """`unit_backward_bytes` under `par` and `tp`, once per key of what it reads in `memo` (as `predict`'s)."""
    return _Memo(memo)(BACKWARD.key(par), lambda: unit_backward_bytes(graph, par, tp))


def rebuilt_of(graph: ModelGraph, par: Parallel, tp: TPPlan | None, memo: dict | None) -> list[float]:
    """What recomputation rebuilds of each unit (`_rebuilt_bytes`), once per key of what it reads in `memo`."""
    return _Memo(memo)(REBUILT.key(par), lambda: [_rebuilt_bytes(par, tp, u) for u in graph.units])


def expert_groups_of(graph: ModelGraph, par: Parallel, local_shapes: list[dict[str, tuple]],
                     memo: dict | None) -> list[zero.ExpertGroups]:
    """`expert_groups` of each unit (its `unit_local_shapes` under `par`), once per key of what it reads in `memo`."""
    return _Memo(memo)(EXPERT_GROUPS.key(par), lambda: [expert_groups(graph, par, s) for s in local_shapes])


# --- 6. The whole step -------------------------------------------------------------------------------------------

@dataclass(kw_only=True, slots=True)
class _UnitSizes:
    """Per unit on one GPU (`predict`'s sums over a rank's units)."""

    counts: list[int]
    """Parameters of each unit (`unit_param_shards` summed)."""
    params: list[int]
    """Prefix sums of `counts`: params[i] = sum(counts[:i])."""
    numel: list[int]
    """Elements of each unit's local parameter shapes (`unit_local_shapes`), as `fsdp_groups` counts them."""

    @staticmethod
    def of(shards: list[dict[str, int]], local_shapes: list[dict[str, tuple]]) -> _UnitSizes:
        counts = [sum(d.values()) for d in shards]
        return _UnitSizes(counts=counts, params=[0, *itertools.accumulate(counts)],
                          numel=[sum(math.prod(v) for v in s.values()) for s in local_shapes])


def _holds_tie(tied: list[tuple[str, list[int], tuple]], chunks: Sequence[tuple[int, int]]) -> bool:
    """Whether the units of `chunks` hold a parameter (`_tied_holders`) twice."""
    return any(sum(1 for i in units if any(lo <= i < hi for lo, hi in chunks)) > 1 for _, units, _ in tied)


class _Memo:
    """`predict`'s per-chunk terms, kept in the caller's dict when it passes one."""

    __slots__ = ("store",)

    def __init__(self, store: dict | None):
        self.store = store

    def __call__(self, key: tuple, make):
        if self.store is None:
            return make()
        value = self.store.get(key, _MISSING)  # one lookup a hit
        if value is _MISSING:
            value = self.store[key] = make()
        return value


_MISSING = object()


def check_bounds(graph: ModelGraph, par: Parallel, bounds: Sequence[tuple[int, int]]) -> None:
    """`bounds`: one half-open unit range [start, end) per model chunk, contiguous, covering every unit."""
    want = par.pp * par.chunks_per_rank
    if len(bounds) != want:
        raise PartcError(f"expected {want} pipeline chunks (pp x virtual stages), got {len(bounds)}")
    prev = 0
    for lo, hi in bounds:
        if lo != prev or hi <= lo:
            raise PartcError(f"pipeline chunks must be contiguous, non-empty [start, end) ranges: {list(bounds)}")
        prev = hi
    if prev != len(graph.units):
        raise PartcError(f"pipeline chunks cover {prev} of {len(graph.units)} units")


@dataclass(kw_only=True, slots=True)
class _RankTerms:
    """`_rank_memory`'s per-unit terms of one configuration and TP plan (each memoized by its own key too)."""

    tied: list
    units: _UnitSizes
    padded_sums: list
    expert_sums: list
    expert_padded: list
    grouped: list[zero.ExpertGroups]
    rebuilt: list[float]
    backward: list[float]


def _rank_terms(graph: ModelGraph, par: Parallel, tp: TPPlan | None, shards: list[dict[str, int]],
                local_shapes: list[dict[str, tuple]], keep: _Memo) -> _RankTerms:
    return keep(RANK_TERMS.key(par), lambda: _make_rank_terms(graph, par, tp, shards, local_shapes, keep))


def _make_rank_terms(graph: ModelGraph, par: Parallel, tp: TPPlan | None, shards: list[dict[str, int]],
                     local_shapes: list[dict[str, tuple]], keep: _Memo) -> _RankTerms:
    tied = keep(TIED.key(par), lambda: _tied_holders(graph, par, local_shapes))
    units = keep(UNITS.key(par), lambda: _UnitSizes.of(shards, local_shapes))
    experts = expert_keys(graph, par)  # FSDP leaves them out of its groups
    padded_sums = keep(PADDED.key(par), lambda: [0, *itertools.accumulate(
        sum(zero.padded_numel(x, par.dp_shard) for k, x in shapes.items() if k not in experts) for shapes in local_shapes)])
    expert_sums = keep(EXPERTS.key(par), lambda: [0, *itertools.accumulate(
        sum(n for k, n in s.items() if k in experts) for s in shards)])
    expert_padded = keep(EXPERT_PADDED.key(par), lambda: [0, *itertools.accumulate(  # over the dp / ep x cp holders
        sum(zero.padded_numel(x, par.expert_shard) for k, x in shapes.items() if k in experts)
        for shapes in local_shapes)])
    rebuilt = rebuilt_of(graph, par, tp, keep.store)
    grouped = expert_groups_of(graph, par, local_shapes, keep.store)
    backward = backward_of(graph, par, tp, keep.store)
    return _RankTerms(tied=tied, units=units, padded_sums=padded_sums, expert_sums=expert_sums,
                      expert_padded=expert_padded, grouped=grouped, rebuilt=rebuilt, backward=backward)


def _rank_memory(graph: ModelGraph, cluster: Cluster, par: Parallel, tp: TPPlan | None,
                 bounds: Sequence[tuple[int, int]], acts: list[float], shards: list[dict[str, int]],
                 local_shapes: list[dict[str, tuple]], shared: dict[int, float], keep: _Memo, terms: _RankTerms):
    """Per pipeline rank, in order: (rank, its chunks, its units, parameters on one GPU, FSDP's padded elements
    (in groups of their own, in the root group), FSDP groups, memory), as `predict` counts them."""
    p, v = par.pp, par.chunks_per_rank
    tied, units, padded_sums, expert_sums = terms.tied, terms.units, terms.padded_sums, terms.expert_sums
    expert_padded, grouped, rebuilt, backward = terms.expert_padded, terms.grouped, terms.rebuilt, terms.backward
    fsdp = par.dp_shard if par.zero else 1  # what FSDP pads over: the working memory's key besides the chunks
    shard = par.expert_shard if par.ep > 1 else 1  # and what it shards the packed experts' own groups over

    def unit_padded(lo: int, hi: int) -> list[float]:
        # Each unit's elements as its FSDP group pads them (`zero.working_bytes`). The packed experts under ep are
        # in groups of their own (`expert_groups`, padded over their ranks there): unpadded here, where
        # `zero.working_bytes` takes them out of the unit's own group.
        return [padded_sums[i + 1] - padded_sums[i] + expert_sums[i + 1] - expert_sums[i] for i in range(lo, hi)]

    for r in range(p):
        chunks = [tuple(bounds[r + j * p]) for j in range(v)]
        idx = [i for lo, hi in chunks for i in range(lo, hi)]
        if _holds_tie(tied, chunks):  # a parameter held by two units of the rank counts once, they share a group
            params = stage_param_count(graph, par, tp, idx, shards)
            groups = [fsdp_groups(graph, par, tp, range(lo, hi), local_shapes) for lo, hi in chunks]
            chunk_padded = [g[1] + g[2] for g in groups]
            padded = (sum(g[1] for g in groups), sum(g[2] for g in groups))
            groups_n = sum(len(g[0]) + (g[3] > 0) for g in groups)  # with the chunk's root group, if it holds any
        else:  # sums over the units (exact: integers), each unit an FSDP group of its own (`fsdp_groups`)
            params = sum(units.params[hi] - units.params[lo] for lo, hi in chunks)
            chunk_padded = [padded_sums[hi] - padded_sums[lo] for lo, hi in chunks]
            padded = (float(sum(chunk_padded)), 0.0)
            groups_n = len(idx)
        held = sum(expert_sums[hi] - expert_sums[lo] for lo, hi in chunks)  # packed experts (ep), FSDP apart
        held_padded = sum(expert_padded[hi] - expert_padded[lo] for lo, hi in chunks)
        mem = model_state_bytes(params - held, par, padded=sum(padded))  # as FSDP pads them (`zero.model_state_bytes`)
        if par.zero == 1 and v > 1:  # one chunk's accumulation at a time, not all (`schedule.most_gradient_bytes`)
            own = [units.params[hi] - units.params[lo] - expert_sums[hi] + expert_sums[lo] for lo, hi in chunks]
            scale = mem.grads / max(1, sum(own))  # a parameter tied between two chunks of the rank counts once
            mem.grads = schedule.most_gradient_bytes(p, v, par.num_microbatches, r, [scale * n for n in own],
                                                     [scale * n / par.dp_shard for n in chunk_padded])
        if held:
            own = expert_state_bytes(held, par, held_padded)
            mem.params, mem.grads, mem.optimizer = (mem.params + own.params, mem.grads + own.grads,
                                                    mem.optimizer + own.optimizer)
        def extra(last: bool = True) -> float:
            return keep(EXTRA.key(par, tuple(chunks), last, fsdp, shard),
                        lambda: _extra_bytes(graph, par, tp, [rebuilt[i] for i in idx], [units.counts[i] for i in idx],
                                             idx[-1] == len(graph.units) - 1, [backward[i] for i in idx], last,
                                             [n for lo, hi in chunks for n in unit_padded(lo, hi)],
                                             [grouped[i] for i in idx]))

        held_j = _held_bytes(graph, par, chunks, acts)
        flight = _in_flight_bytes(graph, par, r, chunks, acts, held=held_j)
        mem.activations = flight + extra()
        if v == 1 and par.zero < 2 and in_flight(par, r) > 1:
            # Below ZeRO-2 the reduction's fp32 input is made in the last micro-batch's backward, when only that
            # micro-batch is in flight; the backwards before it only fold a compute-dtype gradient.
            mem.activations = max(flight + extra(last=False), held_j[0] + extra())
        elif v > 1 and par.zero < 2:  # the same, when torch reduces each chunk (`schedule.held_at_reductions`),
            # with that chunk's largest unit's reduction instead of its fold
            # with that chunk's largest unit's reduction instead of its fold; and each backward with the working
            # memory of its own chunk's units (the last rank's loss and head are not in flight in a block's backward)
            at = schedule.held_at_reductions(p, v, par.num_microbatches, r, held_j)
            b = tokens(par)
            own_extra = [keep(EXTRA.key(par, ((lo, hi),), False, fsdp, shard), lambda lo=lo, hi=hi: _extra_bytes(
                graph, par, tp, rebuilt[lo:hi], units.counts[lo:hi], hi == len(graph.units), backward[lo:hi], False,
                unit_padded(lo, hi), grouped[lo:hi])) for lo, hi in chunks]
            mem.activations = schedule.peak_bytes(p, v, par.num_microbatches, r, held_j, [
                graph.boundary_grad_bytes(hi - 1, b, par.cp) / par.tp + e for (lo, hi), e in zip(chunks, own_extra)])
            for j, (lo, hi) in enumerate(chunks):
                own, own_padded, groups = units.counts[lo:hi], unit_padded(lo, hi), grouped[lo:hi]
                mem.activations = max(mem.activations, at[j] + own_extra[j]
                                      + zero.working_bytes(par, own, padded=own_padded, experts=groups)
                                      - zero.working_bytes(par, own, last=False, padded=own_padded, experts=groups))
        reduced = zero.reduction_bytes(par, [units.counts[i] for i in idx], [grouped[i] for i in idx],
                                       [n for lo, hi in chunks for n in unit_padded(lo, hi)])
        if reduced:  # a group of experts reduced: in a micro-batch's backward (ZeRO 2, 3), or after the last one
            mem.activations = max(mem.activations, reduced + (
                flight if par.zero >= 2 else 0.0))
        mem.buffers = cluster.communicator_bytes * communicators(par, bool(shared.get(r)))
        yield r, chunks, idx, params, padded, groups_n, mem, (held, held_padded)


def fits_memory(graph: ModelGraph, cluster: Cluster, par: Parallel, tp: TPPlan | None,
                bounds: list[tuple[int, int]], *, acts: list[float], shards: list[dict[str, int]],
                local_shapes: list[dict[str, tuple]], memo: dict | None = None) -> bool:
    """`fits(cluster, predict(...).memory_per_gpu)` without the time terms, rank by rank until one does not fit (the
    same memory, computed the same way; arguments as `predict`'s)."""
    check_bounds(graph, par, bounds)
    keep = _Memo(memo)
    terms = _rank_terms(graph, par, tp, shards, local_shapes, keep)
    shared = shared_weights(graph, par, tp, bounds, local_shapes, tied=terms.tied)
    return all(fits(cluster, mem) for *_, mem, _ in _rank_memory(graph, cluster, par, tp, bounds, acts, shards,
                                                              local_shapes, shared, keep, terms))


def predict(graph: ModelGraph, cluster: Cluster, par: Parallel, tp: TPPlan | None,
            bounds: list[tuple[int, int]], *, parts: list[UnitTime] | None = None,
            acts: list[float] | None = None, shards: list[dict[str, int]] | None = None,
            local_shapes: list[dict[str, tuple]] | None = None, memo: dict | None = None) -> Prediction:
    """Step time, throughput and memory of a plan. Pipeline (Narayanan et al.): every rank runs m micro-batches;
    the slowest rank, T_max seconds per micro-batch (compute + TP comm + p2p), sets the steady-state pace, and
    filling and draining the pipeline costs p - 1 more slots (an upper bound when stages are unbalanced):
        1F1B, GPipe:      (m + p - 1) · T_max
        interleaved 1F1B: (m + (p - 1)/v) · T_max, T_max summing the v chunks of a rank: the ideal time is still
                          m · T_max, and the fill/drain slot is one chunk, T_max / v (bubble (1/v)·(p - 1)/m).
    Then the exposed DP gradient traffic and the optimizer step of the rank with the most parameters.
    `parts`, `acts`, `shards` and `local_shapes` (`unit_time_parts`, `unit_activation_bytes`, `unit_param_shards`,
    `unit_local_shapes` of the same graph, par and tp) save recomputing them when the caller has them. `memo`: a
    dict kept across calls on one graph whose TP solution is a function of (tp, micro-batch size), as in the search:
    the per-chunk terms (parameters, FSDP groups, working memory, TP payload) are then computed once per key of
    what each depends on (a model of identical blocks repeats most chunks).
    """
    check_bounds(graph, par, bounds)
    p, v, m, b = par.pp, par.chunks_per_rank, par.num_microbatches, tokens(par)
    if m < 1:
        raise PartcError(f"global batch {par.global_batch_size} is smaller than dp x micro-batch ({par.dp} x "
                         f"{par.micro_batch_size})")
    parts = parts if parts is not None else unit_time_parts(graph, cluster, par, tp)
    acts = acts if acts is not None else unit_activation_bytes(graph, par, tp)
    shards = shards if shards is not None else unit_param_shards(graph, par, tp)
    local_shapes = local_shapes if local_shapes is not None else unit_local_shapes(graph, par, tp)
    spans = mesh_spans(cluster, par)

    ranks, comps, dp_times, opt_times = [], [], [], []
    keep = _Memo(memo)
    terms = _rank_terms(graph, par, tp, shards, local_shapes, keep)
    shared = shared_weights(graph, par, tp, bounds, local_shapes, tied=terms.tied)
    copies = keep(COPIES.key(par), lambda: copy_all_reduces(graph, tp)) if par.tp > 1 else None
    in_use = tuple(a.name for a in AXES if a.in_use(par))
    for r, chunks, idx, params, padded, groups_n, mem, (held, held_padded) in _rank_memory(
            graph, cluster, par, tp, bounds, acts, shards, local_shapes, shared, keep, terms):
        ck = tuple(chunks)  # the memo's key of the rank's units
        compute, tp_comm, fwd_compute, fwd_tp = keep(TIME.key(par, ck), lambda: (
            sum(parts[i].compute_s for i in idx), sum(parts[i].tp_comm_s for i in idx),
            sum(parts[i].fwd_compute_s for i in idx), sum(parts[i].fwd_tp_comm_s for i in idx)))
        # Per chunk, the boundary in and the one out run concurrently (full-duplex links): the larger counts.
        def hop(lo: int, hi: int) -> tuple[float, float, float]:  # (bytes, gradient bytes, of them split over tp)
            into, out = graph.boundary_bytes(lo - 1, b, par.cp), graph.boundary_bytes(hi - 1, b, par.cp)
            return (max(into, out), max(graph.boundary_grad_bytes(lo - 1, b, par.cp),
                                        graph.boundary_grad_bytes(hi - 1, b, par.cp)),
                    split_cut_bytes(graph, tp, lo - 1 if into >= out else hi - 1, b, par.cp))

        def pp_time() -> tuple[float, float]:  # (forward and backward, the activations' half)
            hops = [hop(lo, hi) for lo, hi in chunks]
            return (sum(p2p_round_trip(cluster, par, n, spans["pp"], g, split) for n, g, split in hops),
                    sum(p2p_round_trip(cluster, par, n, spans["pp"], 0.0, split) for n, _, split in hops))

        pp_comm, pp_fwd = keep(PP_TIME.key(par, spans["pp"], ck), pp_time)
        # The cp collectives (keys and values of each attention) are exposed, with the tp ones inside a
        # micro-batch (`cp_time`).
        cp_s, cp_fwd = keep(CP_TIME.key(par, ck), lambda: cp_time(graph, cluster, par, tp, idx))
        tp_comm, fwd_tp = tp_comm + cp_s, fwd_tp + cp_fwd
        tp_payload = keep(TP_BYTES.key(par, par.num_microbatches, ck),
                          lambda: tp_bytes(graph, par, tp, idx, collectives_of(graph, par, tp, memo)))
        if par.tp > 1:  # a copied value's gradient all-reduced on each stage that reads it (`copy_moves`)
            for count, nbytes in copy_moves(copies, bounds, chunks):
                once = hw.collective_time(cluster, "all_reduce", nbytes * b, par.tp, spans_nodes=spans["tp"],
                                          ranks_per_node=par.ranks_per_node("tp", cluster.gpus_per_node))
                tp_comm += count * once
                tp_payload += count * nbytes * b * m
        if par.ep > 1:  # the experts' all-to-alls, per micro-batch, with the in-layer communication
            ep_fwd, ep_bwd = keep(EP_TIME.key(par, ck), lambda: ep_time(graph, cluster, par, idx))
            tp_comm, fwd_tp = tp_comm + ep_fwd + ep_bwd, fwd_tp + ep_fwd
        # What one GPU of the rank passes to collectives in a step, on each axis in use (`MeshAxis.in_use`; the
        # runtime counts the same, `partc.runtime.comm`): every such axis has its payload, in `AXES` order.
        comm = {"pp": pp_bytes(graph, par, chunks) + shared.get(r, 0.0),
                "dp": (sum(zero.dp_bytes(par, params - held, *padded).values())
                       + expert_dp_bytes(held, held_padded, par)),
                "cp": cp_bytes(graph, par, tp, idx),
                "tp": tp_payload + gather_bytes(graph, par, chunks, tp)}
        if par.ep > 1:  # the experts' all-to-alls over the ep groups carved from dp, inside a cp coordinate
            comm["ep"] = ep_bytes(graph, par, idx)
        assert tuple(comm) == in_use, tuple(comm)
        comps.append((compute, tp_comm, pp_comm))
        dp_time = keep(DP_TIME.key(par, spans["dp"], params, padded, groups_n),
                       lambda: dp_comm_time(cluster, par, params, spans["dp"], padded=padded, groups=groups_n))
        dp_times.append(dp_time + shared_time(cluster, par, shared.get(r, 0.0)))
        opt_times.append(optimizer_time(cluster, par, params))
        timeline_s = {"fwd": {"compute": fwd_compute, "tp": fwd_tp, "pp": pp_fwd},
                      "bwd": {"compute": compute - fwd_compute, "tp": tp_comm - fwd_tp, "pp": pp_comm - pp_fwd},
                      "dp_comm": dp_times[-1], "optimizer": opt_times[-1]}
        ranks.append(RankPrediction(rank=r, time_s=compute + tp_comm + pp_comm, memory=mem, num_params=params,
                                    chunks=chunks, comm_bytes=comm, timeline_s=timeline_s))

    slow = max(range(p), key=lambda r: ranks[r].time_s)
    t_max = ranks[slow].time_s
    bubble_s = (p - 1) / v * t_max
    dp_s, opt_s = max(dp_times), max(opt_times)
    # The pipeline walk's end (`partc.timeline`, which the report draws): m slots of T_max and the fill/drain.
    step = timeline.pipeline_span(p, v, m, t_max, 0.0) + dp_s + opt_s

    # Model FLOPs: 3 x forward (forward + backward, no recompute) over the global batch; for a GPT, Megatron's
    # 72·B·L·s·h²·(1 + s/(6h) + V/(12·h·L)) (Korthikanti et al.; Narayanan et al.'s 96 counts the recompute).
    model_flops = 3.0 * par.global_batch_size * sum(u.fwd_flops for u in graph.units)
    tflops = model_flops / step / par.world_size / 1e12
    compute, tp_comm, pp_comm = comps[slow]
    return Prediction(
        step_time_s=step,
        tokens_per_s=par.global_batch_size * graph.seq_len / step,
        model_tflops_per_gpu=tflops,
        mfu=tflops * 1e12 / cluster.peak_flops,
        bubble_fraction=bubble_fraction(par),
        memory_per_gpu=max((r.memory for r in ranks), key=lambda mem: mem.total),
        ranks=ranks,
        compute_s=m * compute, tp_comm_s=m * tp_comm, pp_comm_s=m * pp_comm,
        bubble_s=bubble_s, dp_comm_s=dp_s, optimizer_s=opt_s,
    )
