"""The outer search: every parallel configuration the pins allow, each with its best TP map and stage split.

Candidates are (dp, tp, pp) factorizations of the GPU count (tp inside a node unless pinned), micro-batch sizes
dividing the per-replica batch, ZeRO stages 0-3, recomputation none/selective/full and the schedules 1F1B,
GPipe and interleaved 1F1B (v chunks a rank). For each, `passes.tp_solve` offers the per-layer TP style maps (the least
time first, then maps that trade time for parameters a GPU: `solve_tp_choices`, docs/joint-search.md), each a
candidate of its own, and `passes.stages` the stage boundaries; `passes.assemble.predict` gives the step time and
memory.

Pruning never loses the optimum of the cost model: a candidate is evaluated in full only while a lower bound of
its step time, (m + (p - 1)/v) * sum(unit times) / p (a rank runs at least its share of the units, m times plus
the fill/drain slots), is below the k-th best step time found so far; once its stage split is known, the same
bound with the busiest rank's actual time decides whether `predict` runs. A configuration whose model states alone
cannot fit (1/p of the parameters, each sharded t ways: `_Costs.state_floor`) is dropped before its TP solve, and
two necessary memory conditions skip the stage DP for others that cannot fit. `prune=False` evaluates all of them
(the tests compare the two).
"""

from __future__ import annotations

import copy
import heapq
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterator

from partc.cluster import Cluster
from partc.errors import PartcError
from partc.ir import ModelGraph
from partc.parallel import RECOMPUTE, SCHEDULES, ZERO_STAGES, Parallel, Pins, Reads, check_pins
from partc.passes import assemble, cost
from partc.passes.stages import FreeSplits, partition_stages, stage_memory
from partc.passes.tp import SolveCache, TPSolution
from partc.passes.tp_solve import solve_tp_choices


MAX_VIRTUAL_STAGES = 8
"""Interleaved 1F1B tries v = 2 .. 8 model chunks a rank (Megatron-LM's runs use 2-4)."""


@dataclass(kw_only=True, slots=True)
class Candidate:
    parallel: Parallel
    tp: TPSolution
    bounds: list[tuple[int, int]]
    prediction: cost.Prediction

    @property
    def step_time_s(self) -> float:
        return self.prediction.step_time_s


@dataclass(kw_only=True, slots=True)
class SearchResult:
    best: Candidate | None
    alternatives: list[Candidate]
    """The next best candidates after `best`, fastest first."""
    evaluated: int
    considered: int
    least_memory: float | None = None
    """When nothing fits: the least peak memory per GPU any candidate needs."""
    least_memory_candidate: Candidate | None = None


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending: each d <= sqrt(n) that divides n, and n // d (O(sqrt(n)) steps)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def max_stages(graph: ModelGraph) -> int:
    """The most pipeline stages (model chunks) a contiguous split can have: one unit each, except that the units
    required on the first stage (embeddings) share it, and so do those required on the last (final norm, head)."""
    n = len(graph.units)
    return max(1, n - max(len(graph.first_unit_required) - 1, 0) - max(len(graph.last_unit_required) - 1, 0))


def _configs(graph: ModelGraph, cluster: Cluster, gpus: int, global_batch: int, pins: Pins) -> Iterator[Parallel]:
    """Every Parallel the pins allow, in a fixed order (ties in the search go to the first): degrees, then the
    micro-batch size, then the memory and schedule policies."""
    for values in _config_values(graph, cluster, gpus, global_batch, pins):
        yield Parallel(**values)


def _config_values(graph: ModelGraph, cluster: Cluster, gpus: int, global_batch: int,
                   pins: Pins) -> Iterator[dict]:
    """`_configs`' fields, without building (and validating) a `Parallel`: the search builds one only for the
    configurations it reaches (a few thousand of 62,244 at 529.6B)."""
    n_units = len(graph.units)
    pinned = pins.pinned().items()
    precision = pins.precision or "bf16"
    imbalance = pins.expert_imbalance or 1.0  # an assumption stated, not searched
    experts = _expert_counts(graph)
    for dp, tp, pp, cp in _degrees(cluster, gpus, global_batch, pins, n_units, cp_degrees(graph, gpus, pins)):
        sp_choices = sequence_parallel_choices(graph, tp, pins, cp)
        if not sp_choices:
            continue
        per_replica = global_batch // dp
        for ep in _ep_degrees(pins, dp, experts):  # ep is carved from dp (at each cp coordinate)
            for b in divisors(per_replica):
                for zero, recompute, schedule, v in _policies(pins, dp, pp, per_replica // b, n_units):
                    for sp in sp_choices:
                        for regather in regather_choices(sp, pins):
                            for fused in fuse_choices(graph, recompute, pins):
                                values = dict(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, micro_batch_size=b,
                                              global_batch_size=global_batch, schedule=schedule, virtual_stages=v,
                                              recompute=recompute, precision=precision, sequence_parallel=sp,
                                              ep=ep, sp_regather=regather, expert_imbalance=imbalance,
                                              fuse_pointwise=fused)
                                if all(values[name] == value for name, value in pinned):
                                    yield values


def sequence_parallel_choices(graph: ModelGraph, tp: int, pins: Pins, cp: int = 1) -> tuple[bool, ...]:
    """The values of ``sequence_parallel`` the search weighs at TP degree `tp` and context-parallel degree `cp`:
    the pin, where given (True needs tp >= 2); else both under tp > 1 when the model has a sequence whose s/cp tokens
    a rank holds divide over tp (the program splits them along it), and off otherwise. Neither dominates: sequence
    parallelism moves the same bytes in two collectives (two latencies) and all-reduces the norms' gradients, for
    activations 1/t between the layers. Under cp a pinned ``--sequence-parallel`` whose s/cp tokens do not divide
    over tp is refused in one line where cp is pinned too, and skips that cp where the search chooses it."""
    local = graph.seq_len // cp if graph.seq_len and graph.seq_len % cp == 0 else 0
    if pins.sequence_parallel is not None:
        if pins.sequence_parallel and tp > 1 and cp > 1 and local % tp:
            if pins.cp is not None:
                raise PartcError(f"sequence parallelism: a cp rank's {graph.seq_len}/{cp} = {graph.seq_len / cp:g} "
                                 f"tokens do not divide over tp={tp}; compile with --no-sequence-parallel, another "
                                 f"--cp or another --tp")
            return ()
        return (pins.sequence_parallel,) if tp > 1 or not pins.sequence_parallel else ()
    if tp > 1 and local > 1 and local % tp == 0:
        return (False, True)
    return (False,)


def regather_choices(sequence_parallel: bool, pins: Pins) -> tuple[bool, ...]:
    """The values of ``sp_regather`` the search weighs: off without sequence parallelism; the pin, where given; else
    both. Neither dominates: gathering the colwise layers' inputs again in backward divides what they keep by t,
    for one more all-gather each (hidden behind the input gradient's GEMMs where those are longer)."""
    if not sequence_parallel:
        return (False,)
    return (pins.sp_regather,) if pins.sp_regather is not None else (False, True)


def fuse_choices(graph: ModelGraph, recompute: str, pins: Pins) -> tuple[bool, ...]:
    """The values of ``fuse_pointwise`` the search weighs: the pin, where given; else both where the model has a
    pointwise region or a repeated key and value to keep smaller and the blocks are not recomputed in full (which
    keeps only their inputs anyway); off otherwise. Neither dominates: it keeps less for the replay of the
    regions' memory-bound forward in backward, so a plan that fits without it is faster without it."""
    if pins.fuse_pointwise is not None:
        return (pins.fuse_pointwise,)
    if recompute != "full" and any(u.fused_saved_bytes + u.fused_gqa_saved_bytes > 0 for u in graph.units):
        return (False, True)
    return (False,)


def _expert_counts(graph: ModelGraph) -> list[int]:
    """The expert counts of the model's layers of packed experts (`Layer.inner`: their first grouped product's
    batch), which ep must divide."""
    return [g.batch for layer in graph.layers.values() if layer.inner
            for g in layer.gemms[:1] if g.inner_split == "n"] + [len(r.experts) for r in graph.routed_experts]


def _ep_degrees(pins: Pins, dp: int, experts: list[int]) -> list[int]:
    """The ep degrees to try at `dp`: the pinned one where it divides dp; else 1 and, for a model of packed experts,
    every divisor of dp that divides each layer's expert count (`Parallel.ep`)."""
    if pins.ep is not None:
        return [pins.ep] if dp % pins.ep == 0 else []
    return [e for e in divisors(dp) if e == 1 or (experts and all(n % e == 0 for n in experts))]


MIN_CP_CHUNK = 1024
"""The fewest tokens of a context-parallel chunk the search considers unpinned (each rank holds two chunks of
s/(2·cp)): below it the keys' and values' gathers and the smaller GEMMs cost more than cp saves (Llama 3 and
torchtitan use cp for sequences of tens of thousands of tokens). A pin (``--cp``) is taken as given."""


def cp_degrees(graph: ModelGraph, gpus: int, pins: Pins) -> list[int]:
    """The context-parallel degrees to search: the pinned one; else 1, and, for a model with causal attention
    (`Unit.cp_kv`), each divisor of the GPU count that cuts the sequence in chunks of `MIN_CP_CHUNK` tokens or
    more."""
    if pins.cp is not None:
        return [pins.cp]
    if not any(u.cp_kv for u in graph.units) or not graph.seq_len:
        return [1]
    return [cp for cp in divisors(gpus) if cp == 1 or (graph.seq_len % (2 * cp) == 0
                                                       and graph.seq_len // (2 * cp) >= MIN_CP_CHUNK)]


def _degrees(cluster: Cluster, gpus: int, global_batch: int, pins: Pins, n_units: int, cps: list[int]):
    """(dp, tp, pp, cp) with dp * tp * pp * cp = gpus: cp of `cps` (`cp_degrees`), tp inside a node unless pinned,
    pp at most one unit a stage, dp dividing the global batch."""
    for cp in cps:
        if gpus % cp:
            continue
        for tp in divisors(gpus // cp):
            if pins.tp is None and tp > cluster.gpus_per_node:
                continue
            for pp in divisors(gpus // (cp * tp)):
                dp = gpus // (cp * tp * pp)
                if pp <= n_units and global_batch % dp == 0:
                    yield dp, tp, pp, cp


def _policies(pins: Pins, dp: int, pp: int, m: int, n_units: int):
    """(zero, recompute, schedule, v) for one (dp, pp) and m micro-batches. Unpinned, the choices that change
    nothing are skipped: ZeRO without data parallelism, and any schedule but 1F1B without a pipeline."""
    for zero in ZERO_STAGES:
        if pins.zero is None and dp == 1 and zero:
            continue
        for recompute in RECOMPUTE:
            for schedule in SCHEDULES:
                if pins.schedule is None and pp == 1 and schedule != "1f1b":
                    continue
                if schedule != "interleaved-1f1b":
                    yield zero, recompute, schedule, 1
                elif pp >= 2 and m % pp == 0:
                    for v in range(2, MAX_VIRTUAL_STAGES + 1):
                        if n_units >= pp * v:
                            yield zero, recompute, schedule, v


# The search's cached quantities (`partc.parallel.Reads`): each key is every field of `Parallel` but those the
# quantity declares it ignores, so a field added to `Parallel` is part of every key until a quantity declares itself
# independent of it. A quantity that depends on a function of ignored fields (say, whether the pipeline has more
# than one rank) adds that value to its key explicitly.
_PIPELINE = ("pp", "global_batch_size", "schedule", "virtual_stages")
# The TP map and the parameters do not depend on these; activations, traffic and (the replay) unit times do.
_SP = ("sequence_parallel", "sp_regather", "fuse_pointwise")
TP = Reads("tp", ("dp", "zero", "recompute", *_PIPELINE, *_SP))  # the TP solve: (tp, b)
PARTS = Reads("parts", ("dp", "zero", *_PIPELINE))  # unit times: (tp, b, recompute)
SHARDS = Reads("shards", ("dp", "zero", "recompute", *_PIPELINE, *_SP))  # parameters on one GPU: (tp, b)
ACTS = Reads("acts", ("dp", "zero", *_PIPELINE))  # activations a micro-batch leaves: (tp, b, recompute)
EXTRA = Reads("stage_extra", ("dp", *_PIPELINE))  # ZeRO's working memory depends on the stage, not on dp
CUT = Reads("cut", ("dp", "zero", "recompute", *_PIPELINE))  # + pp > 1 and whether a pipeline hop crosses nodes
FREE = Reads("free", ("dp", "zero", *_PIPELINE))  # + pp > 1 and the pipeline hop's nodes (then the chunk count)
FLOOR_SUM = Reads("floor_sum", ("dp", "zero", *_PIPELINE, *_SP))  # `cost.unit_time_floor` summed: (tp, b, recompute)
FLOOR_CUT = Reads("floor_cut", ("zero", "recompute", "global_batch_size", "schedule", "virtual_stages"))
FLOOR_RANK = Reads("floor_rank", ("zero", "global_batch_size", "schedule", "virtual_stages"))  # the two above
FLOOR_DP = Reads("floor_dp", ("recompute", "schedule", "virtual_stages", *_SP))  # DP traffic and optimizer at 1/p
FLOOR_PARAMS = Reads("floor_params", ("dp", "pp", "zero", "micro_batch_size", "recompute", "precision",
                                      "global_batch_size", "schedule", "virtual_stages", *_SP))  # every layer t ways
STATE_FLOOR = Reads("state_floor", ("micro_batch_size", "recompute", "global_batch_size", *_SP))  # model states
# at 1/p (ZeRO-1's gradients read the chunks a rank: `_Costs.state_floor`), and the communicators


class _Costs:
    """The search's caches: each quantity is computed once per key (its `Reads`)."""

    def __init__(self, graph: ModelGraph, cluster: Cluster, tp_pins: dict[str, str] | None):
        self.graph, self.cluster, self.tp_pins = graph, cluster, tp_pins
        self._cache: dict[tuple, object] = {}
        self._memo: dict[tuple, object] = {}  # `assemble.predict`'s per-chunk terms (the TP solve is one per (tp, b))
        self._tp_cache = SolveCache(graph, cluster)
        self.variant = 0
        """Which of `tp_choices` this object prices: each other one is a view (`at`) with caches of its own."""
        self._views: dict[int, _Costs] = {0: self}
        # A TP plan whose every layer is colwise: each parameter t ways, the fewest it can have on a GPU.
        self._all_sharded = SimpleNamespace(styles={fqn: "colwise" for fqn in graph.layers}, collectives={})

    def _get(self, reads: Reads, par: Parallel, make, *derived):
        key = reads.key(par, *derived)
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def at(self, variant: int) -> _Costs:
        """The same caches for style map `variant` of `tp_choices`: a view sharing the TP solve and the
        variant-free terms (the floors), with its own caches of everything the style map changes."""
        if variant not in self._views:
            view = copy.copy(self)
            view.variant, view._cache, view._memo = variant, {}, {}
            self._views[variant] = view
        return self._views[variant]

    def tp_choices(self, par: Parallel) -> list[TPSolution]:
        """The style maps the search weighs for `par` (`solve_tp_choices`: the least time first)."""
        base = self._views[0]
        return base._get(TP, par,
                         lambda: solve_tp_choices(self.graph, par.tp, self.cluster, par.micro_batch_size,
                                                  self.tp_pins, cache=self._tp_cache), "choices")

    def tp(self, par: Parallel) -> TPSolution:
        return self.tp_choices(par)[self.variant]

    def parts(self, par: Parallel) -> list[cost.UnitTime]:
        return self._get(PARTS, par, lambda: cost.unit_time_parts(
            self.graph, self.cluster, par, self.tp(par),
            collectives=assemble.collectives_of(self.graph, par, self.tp(par), self._memo)))

    def times(self, par: Parallel) -> list[float]:
        return self._get(PARTS, par, lambda: [u.compute_s + u.tp_comm_s for u in self.parts(par)], "times")

    def shards(self, par: Parallel) -> list[dict[str, int]]:
        return self._get(SHARDS, par, lambda: cost.unit_param_shards(self.graph, par, self.tp(par)))

    def local_shapes(self, par: Parallel) -> list[dict[str, tuple]]:
        return self._get(SHARDS, par, lambda: cost.unit_local_shapes(self.graph, par, self.tp(par)), "shapes")

    def params(self, par: Parallel) -> list[int]:
        return self._get(SHARDS, par, lambda: [sum(d.values()) for d in self.shards(par)], "params")

    def predict(self, par: Parallel, bounds: list[tuple[int, int]]) -> cost.Prediction:
        return assemble.predict(self.graph, self.cluster, par, self.tp(par), bounds, parts=self.parts(par),
                            acts=self.acts(par), shards=self.shards(par), local_shapes=self.local_shapes(par),
                            memo=self._memo)

    def fits_memory(self, par: Parallel, bounds: list[tuple[int, int]]) -> bool:
        """Whether `predict(par, bounds)` fits, from its memory terms alone (`assemble.fits_memory`)."""
        return assemble.fits_memory(self.graph, self.cluster, par, self.tp(par), bounds, acts=self.acts(par),
                                shards=self.shards(par), local_shapes=self.local_shapes(par), memo=self._memo)

    def params_all(self, par: Parallel) -> int:
        """Parameters of the whole model on one GPU after TP sharding, a tied tensor counted once: no more than the
        sum over pipeline ranks of what each holds (a rank holding both ends of a tie holds the tensor once)."""
        return self._get(SHARDS, par, lambda: cost.stage_param_count(self.graph, par, self.tp(par),
                                                                       range(len(self.graph.units))), "all")

    def acts(self, par: Parallel) -> list[float]:
        return self._get(ACTS, par, lambda: cost.unit_activation_bytes(self.graph, par, self.tp(par)))

    def extra(self, par: Parallel) -> tuple[float, float]:
        """Transient stage memory: (any stage, the last stage), bounded over all units."""
        units = list(range(len(self.graph.units)))

        def make() -> tuple[float, float]:
            backward = assemble.backward_of(self.graph, par, self.tp(par), self._memo)
            return (cost.stage_extra_bytes(self.graph, par, self.tp(par), units[:-1] or units, self.shards(par),
                                           backward=backward),
                    cost.stage_extra_bytes(self.graph, par, self.tp(par), units, self.shards(par), backward=backward))

        return self._get(EXTRA, par, make)

    def cut_time(self, par: Parallel) -> list[float]:
        spans = par.spans_nodes("pp", self.cluster.gpus_per_node)
        graph = self.graph
        ok = graph.cut_ok or [True] * len(graph.cut_bytes)  # a cut the program cannot make costs inf
        b = cost.tokens(par)

        def make() -> list[float]:
            once: dict[tuple[int, int], float] = {}  # the boundaries of identical blocks carry the same bytes
            out = []
            for i in range(len(graph.cut_bytes)):
                sizes = (graph.boundary_bytes(i, b, par.cp), graph.boundary_grad_bytes(i, b, par.cp))
                if sizes not in once:
                    once[sizes] = cost.p2p_round_trip(self.cluster, par, sizes[0], spans, sizes[1])
                out.append(once[sizes] if ok[i] else math.inf)
            return out

        return self._get(CUT, par, make, par.pp > 1, spans)

    def floor_bound(self, par: Parallel) -> float:
        """A lower bound of `lower_bound` that needs no TP solve (`cost.unit_time_floor`, and each parameter
        sharded t ways): the search refines it to `lower_bound` only for the configurations it reaches. The margin
        keeps float rounding on the safe side."""
        return self._floor_bound(par.__getattribute__, lambda: par)

    def _floor_bound(self, get, make) -> float:
        """`floor_bound` of the configuration whose fields `get(name)` reads; `make()` builds its `Parallel`,
        needed only when a term is not cached yet (they are cached by what they depend on: all but the micro-batch
        count and the chunks a rank)."""
        p, b, dp = get("pp"), get("micro_batch_size"), get("dp")
        v = get("virtual_stages") if get("schedule") == "interleaved-1f1b" else 1  # `Parallel.chunks_per_rank`
        m = get("global_batch_size") // (dp * b)  # `Parallel.num_microbatches`
        key = FLOOR_RANK.key_of(get)
        rank = self._cache.get(key)
        if rank is None:
            rank = self._cache[key] = self._floor_rank(make())
        share, least_cut = rank
        per_rank = share
        if p > 1:
            per_rank += v * least_cut
        key = FLOOR_DP.key_of(get)
        dp_term = self._cache.get(key)
        if dp_term is None:
            par = make()
            params = self._floor_params(par) / p
            spans = par.spans_nodes("dp", self.cluster.gpus_per_node)
            dp_term = self._cache[key] = (cost.dp_comm_time(self.cluster, par, params, spans)
                                          + cost.optimizer_time(self.cluster, par, params))
        return ((m + (p - 1) / v) * per_rank + dp_term) * (1 - 1e-9)

    def _floor_rank(self, par: Parallel) -> tuple[float, float]:
        """`floor_bound`'s rank terms: its share of the unit times (at each layer's cheapest style), and the
        cheapest boundary (0 without a pipeline)."""
        p = par.pp
        key = FLOOR_SUM.key(par)
        if key not in self._cache:
            self._cache[key] = sum(cost.unit_time_floor(self.graph, self.cluster, par, memo=self._memo))
        share = self._cache[key] / p
        least_cut = 0.0
        if p > 1:
            key = FLOOR_CUT.key(par)  # `cut_time`'s dependencies
            if key not in self._cache:
                self._cache[key] = min(self.cut_time(par), default=0.0)
            least_cut = self._cache[key]
        return share, least_cut

    def _floor_params(self, par: Parallel) -> int:
        """Parameters on one GPU with every layer sharded t ways (the fewest a TP plan leaves)."""
        key = FLOOR_PARAMS.key(par)
        if key not in self._cache:
            self._cache[key] = cost.stage_param_count(self.graph, par, self._all_sharded, range(len(self.graph.units)))
        return self._cache[key]

    def state_floor(self, get, make) -> float:
        """Bytes one GPU needs at least whatever the TP map and stage split: the model states of 1/p of the model's
        parameters, each sharded t ways (`_floor_params`; the busiest rank holds at least the average, and model
        states are linear in the parameters), and the communicators' buffers of its tp, dp and pp groups. Read
        like `_floor_bound` (`get(name)`, `make()`)."""
        key = STATE_FLOOR.key_of(get)
        floor = self._cache.get(key)
        if floor is None:
            par = make()
            states = cost.model_state_bytes(self._floor_params(par) / par.pp, par)
            if par.zero == 1 and par.chunks_per_rank > 1:  # at least its largest chunk's accumulation at once
                states.grads /= par.chunks_per_rank  # (`schedule.most_gradient_bytes`)
            floor = self._cache[key] = (states.total
                                        + self.cluster.communicator_bytes * cost.communicators(par, False))
        return floor

    def lower_bound(self, par: Parallel) -> float:
        """A step-time bound no stage split can beat: a rank runs at least 1/p of the unit time and holds at
        least 1/p of the parameters (for DP traffic and the optimizer); with p > 1 each chunk crosses at least
        the cheapest boundary."""
        p, v = par.pp, par.chunks_per_rank
        per_rank = sum(self.times(par)) / p
        cuts = self.cut_time(par)
        if p > 1 and cuts:
            per_rank += v * min(cuts)
        return self._step_bound(par, per_rank)

    def split_bound(self, par: Parallel, bounds: list[tuple[int, int]]) -> float:
        """The same bound for a given stage split, with the busiest rank's own time per micro-batch (its units
        and, per chunk, the larger of its two boundaries, as `assemble.predict` counts them): cheaper than `predict`."""
        p, times, cuts = par.pp, self.times(par), self.cut_time(par)
        n = len(times)

        def rank_time(r: int) -> float:
            total = 0.0
            for lo, hi in bounds[r::p]:
                total += sum(times[lo:hi])
                if p > 1:
                    total += max(cuts[lo - 1] if lo > 0 else 0.0, cuts[hi - 1] if hi < n else 0.0)
            return total

        return self._step_bound(par, max(rank_time(r) for r in range(p)))

    def _step_bound(self, par: Parallel, per_rank: float) -> float:
        """`assemble.predict`'s step time for a slowest rank of at least `per_rank` seconds per micro-batch."""
        p, v, m = par.pp, par.chunks_per_rank, par.num_microbatches
        params = self.params_all(par) / p  # the most loaded rank holds at least the average
        spans = par.spans_nodes("dp", self.cluster.gpus_per_node)
        return ((m + (p - 1) / v) * per_rank + cost.dp_comm_time(self.cluster, par, params, spans)
                + cost.optimizer_time(self.cluster, par, params))

    def split_stages(self, par: Parallel, *, mem_limit: float) -> list[tuple[int, int]] | None:
        """Stage boundaries of least max time that fit `mem_limit` (None if none fits)."""
        graph = self.graph
        v = par.chunks_per_rank
        chunks = par.pp * v
        per_param = cost.model_state_bytes(1, par).total  # ZeRO model states are linear in the parameters
        static = self._get(SHARDS, par, lambda: [per_param * n for n in self.params(par)], "static", per_param)
        extra_any, extra_last = self.extra(par)
        # Chunk k runs on rank k % p. With v chunks a rank, each chunk gets 1/v of the memory (`predict` checks
        # the rank's exact total afterwards).
        per_rank = [cost.in_flight(par, r) for r in range(par.pp)]
        in_flight = [per_rank[k % par.pp] for k in range(chunks)]
        extra = [extra_any] * (chunks - 1) + [extra_last]
        # Two necessary conditions, cheap next to the DP, that rule out most configurations that cannot fit:
        # summed over the chunks, memory is at least all static memory plus all activations at the fewest
        # micro-batches in flight; and the largest unit must fit in some chunk on its own.
        # Every GPU also holds its communicators' buffers (at least those of its tp, dp and pp groups).
        buffers = self.cluster.communicator_bytes * cost.communicators(par, shares_weights=False)
        acts, least, limit = self.acts(par), min(in_flight), (mem_limit - buffers) / v
        if sum(static) + least * sum(acts) + sum(extra) > chunks * limit * (1 + 1e-9):
            return None
        if max(st + least * a for st, a in zip(static, acts)) + min(extra) > limit * (1 + 1e-9):
            return None
        # The split of least time ignoring memory depends on neither ZeRO nor the schedule's in-flight counts:
        # computed once, it is also the answer under the memory limit whenever it fits (the constrained optimum
        # and tie-break range over a subset of the splits that contains it).
        free = self.free_split(par, chunks)
        if free is not None:
            mems = stage_memory(free, static, acts, in_flight, extra)
            if all(mk <= limit for mk in mems):
                return free
        part = partition_stages(self.times(par), self.cut_time(par), static, acts, num_stages=chunks,
                                in_flight=in_flight, mem_limit=limit, extra_mem=extra,
                                first_required=len(graph.first_unit_required),
                                last_required=len(graph.last_unit_required))
        return None if part is None else [tuple(b) for b in part.bounds]

    def free_split(self, par: Parallel, chunks: int) -> list[tuple[int, int]] | None:
        """The least-time split into `chunks` stages with no memory limit (cached; one `FreeSplits` serves every
        chunk count of the same unit and boundary times)."""
        graph = self.graph
        spans = par.spans_nodes("pp", self.cluster.gpus_per_node)
        splits = self._get(FREE, par, lambda: (FreeSplits(self.times(par), self.cut_time(par),
                                                            first_required=len(graph.first_unit_required),
                                                            last_required=len(graph.last_unit_required)), {}),
                           par.pp > 1, spans)
        splitter, done = splits
        if chunks not in done:
            bounds = splitter.split(chunks)
            done[chunks] = None if bounds is None else [tuple(b) for b in bounds]
        return done[chunks]


def _builder(values: dict):
    """A function that builds the `Parallel` of `values` once, when first called."""
    built: list[Parallel] = []

    def make() -> Parallel:
        if not built:
            built.append(Parallel(**values))
        return built[0]

    return make


def _run(costs: _Costs, configs: list[dict], *, mem_limit: float, keep: int, prune: bool, state_floor: bool,
         idle_tp: bool = True):
    """`search`'s loop: (the best candidates, one per configuration, as a max-heap of (-step time, -index,
    -style map, candidate), the candidates that do not fit in the order evaluated, how many configurations were
    evaluated). A candidate is a configuration with one of its style maps (`_Costs.tp_choices`): each enters the
    queue with its own bound, so the pruning is as exact over the joint choice (style maps, split, the rest) as
    over the configurations. With `state_floor`, a configuration whose model states alone cannot fit
    (`_Costs.state_floor`) is dropped before its TP solve and stage split. Without `idle_tp`, one whose TP degree
    t > 1 splits no layer is dropped after its TP solve: its t ranks would compute the same micro-batches, all of
    them whole (`idle_tp_degree`)."""
    # In the order of `lower_bound` (ties: the order of enumeration, which is deterministic). Each configuration
    # enters with `floor_bound`, no more than its `lower_bound` and without a TP solve, and is refined to it when
    # it comes first: the order of the refined ones is that of sorting them all by `lower_bound`. Only then is its
    # `Parallel` built. A configuration whose model states cannot fit leaves before its bound is computed. Its other
    # style maps enter with the floor bound too and are priced only when they come first (stage 1).
    # A configuration and its twin with `sp_regather` on (enumerated next to it) are one configuration to the
    # alternatives, as a configuration's style maps are: the faster of the two (ties: the one without it) is kept.
    # So are its twins with `fuse_pointwise` on (the first of the twins, all off, is the slot).
    twins: dict[tuple, int] = {}
    slots = []
    for i, values in enumerate(configs):
        key = tuple(sorted(dict(values, sp_regather=False, fuse_pointwise=False).items()))
        slots.append(twins.setdefault(key, i))
    queue = []
    for i, values in enumerate(configs):
        make = _builder(values)
        if not state_floor or costs.state_floor(values.__getitem__, make) <= mem_limit:
            queue.append((costs._floor_bound(values.__getitem__, make), i, 0, 0, values))
    heapq.heapify(queue)
    best: list[tuple[float, int, int, Candidate]] = []  # max-heap by step time via negation
    held: dict[int, tuple[float, int, int, Candidate]] = {}  # configuration slot -> its entry in `best`
    evaluated: set[int] = set()
    # The candidates that do not fit, in the order evaluated: the one needing the least memory (the first of
    # equals) is reported when nothing fits. A least-time split found not to fit by `fits_memory` is predicted only
    # then (until something fits: after that, no such candidate is reported).
    unfit: list[tuple[_Costs, Parallel, TPSolution, list[tuple[int, int]], cost.Prediction | None]] = []
    while queue:
        lb, i, k, stage, item = heapq.heappop(queue)
        if prune and len(best) >= keep and lb > -best[0][0]:
            break
        if stage == 0:  # `item` holds the fields: its Parallel enters with `lower_bound` of the least-time styles,
            par = Parallel(**item)  # and once per other style map with the floor bound, which holds for every map
            heapq.heappush(queue, (costs.lower_bound(par), i, 0, 2, par))
            for k in range(1, len(costs.tp_choices(par))):
                heapq.heappush(queue, (lb, i, k, 1, par))
            continue
        if stage == 1:  # style map k: priced now, its own `lower_bound`
            heapq.heappush(queue, (costs.at(k).lower_bound(item), i, k, 2, item))
            continue
        par, costs_k = item, costs.at(k)
        tp = costs_k.tp(par)
        evaluated.add(i)
        if not idle_tp and idle_tp_degree(par, tp):
            continue  # evaluated, and dropped
        bounds = costs_k.split_stages(par, mem_limit=mem_limit)
        if bounds is None:
            # The stage DP bounds each stage's transient memory by the largest over all units: it may reject a
            # configuration whose least-time split fits after all; `fits_memory` says exactly.
            loose = costs_k.free_split(par, par.num_stages)
            if loose is None or (prune and len(best) >= keep and costs_k.split_bound(par, loose) > -best[0][0]):
                continue
            if not costs_k.fits_memory(par, loose):
                if not best:
                    unfit.append((costs_k, par, tp, loose, None))
                continue
            bounds = loose
        if prune and len(best) >= keep and costs_k.split_bound(par, bounds) * (1 - 1e-9) > -best[0][0]:
            continue  # this split cannot beat the k-th best (the margin keeps float rounding on the safe side)
        pred = costs_k.predict(par, bounds)
        if not cost.fits(costs.cluster, pred.memory_per_gpu):
            unfit.append((costs_k, par, tp, bounds, pred))
            continue
        cand = Candidate(parallel=par, tp=tp, bounds=bounds, prediction=pred)
        item = (-pred.step_time_s, -i, -k, cand)
        slot = slots[i]
        if slot in held:  # one candidate per configuration: its best style map (the alternatives differ in more)
            if item > held[slot]:
                best[best.index(held[slot])] = held[slot] = item
                heapq.heapify(best)
        elif len(best) < keep:
            heapq.heappush(best, item)
            held[slot] = item
        elif item > best[0]:
            del held[slots[-heapq.heapreplace(best, item)[1]]]
            held[slot] = item
    return best, unfit, len(evaluated)


def idle_tp_degree(par: Parallel, tp: TPSolution) -> bool:
    """Whether TP degree t > 1 splits no layer: each of the t ranks holds the whole model and computes the same
    micro-batches whole, copies of one GPU's work. The cost model would price such a plan near one of t times more
    data parallelism when its units are launch-bound or its gradients' all-reduce dominates (tiny models), but the
    t - 1 copies do no useful work: `search` takes one only when pinned (``--tp``, or a plan's TP map) or when
    nothing else fits."""
    return par.tp > 1 and all(style == "replicate" for style in tp.styles.values())


def search(graph: ModelGraph, cluster: Cluster, gpus: int, *, global_batch_size: int, pins: Pins | None = None,
           tp_pins: dict[str, str] | None = None, keep: int = 6, prune: bool = True) -> SearchResult:
    """The fastest plan that fits, and the next `keep - 1`."""
    pins = pins or Pins()
    check_pins(pins, gpus, num_units=len(graph.units), max_stages=max_stages(graph))
    mem_limit = cluster.usable_memory_bytes
    costs = _Costs(graph, cluster, tp_pins)
    configs = list(_config_values(graph, cluster, gpus, global_batch_size, pins))
    if not configs and pins.dp is not None and global_batch_size % (pins.dp * (pins.micro_batch_size or 1)):
        raise PartcError(f"global batch size {global_batch_size} is not divisible by dp x micro-batch size = "
                         f"{pins.dp} x {pins.micro_batch_size or 1}")
    if not configs:
        raise PartcError(f"no parallel configuration of {gpus} GPUs matches the pins and a global batch of "
                         f"{global_batch_size} (it must be divisible by dp x micro-batch size)")
    idle_tp = pins.tp is not None or bool(tp_pins)
    best, unfit, evaluated = _run(costs, configs, mem_limit=mem_limit, keep=keep, prune=prune, state_floor=prune,
                                  idle_tp=idle_tp)
    if not best and not idle_tp:  # only a TP degree that splits nothing fits (or the batch allows no other)
        best, unfit, evaluated = _run(costs, configs, mem_limit=mem_limit, keep=keep, prune=prune,
                                      state_floor=prune, idle_tp=True)
    if not best and prune:
        # Nothing fits: the configurations the memory floor left out are evaluated too, for the one that needs the
        # least memory (the error message's).
        best, unfit, evaluated = _run(costs, configs, mem_limit=mem_limit, keep=keep, prune=prune, state_floor=False)
    least: tuple[float, Candidate] | None = None
    for costs_k, par, tp, bounds, pred in (unfit if not best else []):
        pred = pred or costs_k.predict(par, bounds)
        if least is None or pred.memory_per_gpu.total < least[0]:
            least = (pred.memory_per_gpu.total, Candidate(parallel=par, tp=tp, bounds=bounds, prediction=pred))
    ranked = [c for *_, c in sorted(best, key=lambda x: (-x[0], -x[1], -x[2]))]
    return SearchResult(best=ranked[0] if ranked else None, alternatives=ranked[1:], evaluated=evaluated,
                        considered=len(configs), least_memory=least[0] if least and not ranked else None,
                        least_memory_candidate=least[1] if least and not ranked else None)
