"""The search's costs of a configuration, each computed once per key: the TP solve, unit times, parameters,
activations, the stage split and the prediction, and the lower bounds the search prunes with.

A configuration's quantities mostly depend on few of its fields (the TP solve on (tp, micro-batch), the unit times
also on the recomputation): `_Costs` keys each by its `Reads` (every field of `Parallel` but those it declares it
ignores), so configurations that differ elsewhere share it. The bounds (`lower_bound`, `split_bound`,
`state_floor`, `floor_bound`) never exceed what `passes.assemble.predict` gives the same configuration: the
search (`passes.search`) drops a candidate on them without losing the cost model's optimum.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

from partc.cluster import Cluster
from partc.ir import ModelGraph
from partc.parallel import Parallel
from partc.reads import Reads
from partc.passes import assemble, cost, cost_step, cost_types, memory
from partc.passes.stages import FreeSplits, partition_stages, stage_memory
from partc.passes.tp import SolveCache, TPSolution
from partc.passes.tp_solve import solve_tp_choices

# The search's cached quantities (`partc.reads.Reads`): each key is every field of `Parallel` but those the
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

_MISSING = object()


class _Costs:
    """The search's caches: each quantity is computed once per key (its `Reads`)."""

    def __init__(self, graph: ModelGraph, cluster: Cluster, tp_pins: dict[str, str] | None):
        self.graph, self.cluster, self.tp_pins = graph, cluster, tp_pins
        self._cache: dict[tuple, object] = {}
        self._memo: dict[tuple, object] = {}  # `assemble.predict`'s per-chunk terms (the TP solve is one per (tp, b))
        self._last: tuple[Parallel | None, dict] = (None, {})  # `_get`'s answers for the last configuration asked
        self._tp_cache = SolveCache(graph, cluster)
        self.variant = 0
        """Which of `tp_choices` this object prices: each other one is a view (`at`) with caches of its own."""
        self._views: dict[int, _Costs] = {0: self}
        # A TP plan whose every layer is colwise: each parameter t ways, the fewest it can have on a GPU.
        self._all_sharded = SimpleNamespace(styles={fqn: "colwise" for fqn in graph.layers}, collectives={})

    def _get(self, reads: Reads, par: Parallel, make, *derived):
        # The search asks one configuration (the same `Parallel` object, frozen) for the same quantities many times
        # in a row: what it got for the last one is at hand, under the quantity's name and derived values alone.
        last = self._last
        if last[0] is not par:
            last = self._last = (par, {})
        asked = (reads.name, *derived)  # the names tell the quantities apart, as in the keys
        value = last[1].get(asked, _MISSING)
        if value is not _MISSING:
            return value
        key = reads.key(par, *derived)
        value = self._cache.get(key, _MISSING)  # one lookup: hashing a key tuple is most of the cost
        if value is _MISSING:
            value = self._cache[key] = make()
        last[1][asked] = value
        return value

    def at(self, variant: int) -> _Costs:
        """The same caches for style map `variant` of `tp_choices`: a view sharing the TP solve and the
        variant-free terms (the floors), with its own caches of everything the style map changes."""
        if variant not in self._views:
            view = copy.copy(self)
            view.variant, view._cache, view._memo, view._last = variant, {}, {}, (None, {})
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

    def parts(self, par: Parallel) -> list[cost_types.UnitTime]:
        return self._get(PARTS, par, lambda: cost.unit_time_parts(
            self.graph, self.cluster, par, self.tp(par),
            collectives=assemble.collectives_of(self.graph, par, self.tp(par), self._memo)))

    def times(self, par: Parallel) -> list[float]:
        return self._get(PARTS, par, lambda: [u.compute_s + u.tp_comm_s for u in self.parts(par)], "times")

    def shards(self, par: Parallel) -> list[dict[str, int]]:
        return self._get(SHARDS, par, lambda: memory.unit_param_shards(self.graph, par, self.tp(par)))

    def local_shapes(self, par: Parallel) -> list[dict[str, tuple]]:
        return self._get(SHARDS, par, lambda: memory.unit_local_shapes(self.graph, par, self.tp(par)), "shapes")

    def params(self, par: Parallel) -> list[int]:
        return self._get(SHARDS, par, lambda: [sum(d.values()) for d in self.shards(par)], "params")

    def predict(self, par: Parallel, bounds: list[tuple[int, int]]) -> cost_types.Prediction:
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
        return self._get(SHARDS, par, lambda: memory.stage_param_count(self.graph, par, self.tp(par),
                                                                       range(len(self.graph.units))), "all")

    def acts(self, par: Parallel) -> list[float]:
        return self._get(ACTS, par, lambda: memory.unit_activation_bytes(self.graph, par, self.tp(par)))

    def extra(self, par: Parallel) -> tuple[float, float]:
        """Transient stage memory: (any stage, the last stage), bounded over all units."""

        def make() -> tuple[float, float]:  # `memory.stage_extra_bytes` of all units but the last, and of all
            graph, tp = self.graph, self.tp(par)  # (its per-unit lists read from the caches, not made again)
            backward = assemble.backward_of(graph, par, tp, self._memo)
            rebuilt = assemble.rebuilt_of(graph, par, tp, self._memo)
            experts = assemble.expert_groups_of(graph, par, self.local_shapes(par), self._memo)
            sizes = self.params(par)
            whole = memory.stage_extra_bytes_of(graph, par, tp, rebuilt, sizes, True, backward, experts)
            if len(sizes) == 1:
                return whole, whole
            return memory.stage_extra_bytes_of(graph, par, tp, rebuilt[:-1], sizes[:-1], False, backward[:-1],
                                               experts[:-1]), whole

        return self._get(EXTRA, par, make)

    def cut_time(self, par: Parallel) -> list[float]:
        spans = par.spans_nodes("pp", self.cluster.gpus_per_node)
        graph = self.graph
        ok = graph.cut_ok or [True] * len(graph.cut_bytes)  # a cut the program cannot make costs inf
        b = cost_types.tokens(par)

        def make() -> list[float]:
            once: dict[tuple[int, int], float] = {}  # the boundaries of identical blocks carry the same bytes
            out = []
            for i in range(len(graph.cut_bytes)):
                sizes = (graph.boundary_bytes(i, b, par.cp), graph.boundary_grad_bytes(i, b, par.cp))
                if sizes not in once:
                    once[sizes] = cost_step.p2p_round_trip(self.cluster, par, sizes[0], spans, sizes[1])
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
            dp_term = self._cache[key] = (cost_step.dp_comm_time(self.cluster, par, params, spans)
                                          + cost_step.optimizer_time(self.cluster, par, params))
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
            self._cache[key] = memory.stage_param_count(self.graph, par, self._all_sharded, range(len(self.graph.units)))
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
            states = memory.model_state_bytes(self._floor_params(par) / par.pp, par)
            if par.zero == 1 and par.chunks_per_rank > 1:  # at least its largest chunk's accumulation at once
                states.grads /= par.chunks_per_rank  # (`schedule.most_gradient_bytes`)
            floor = self._cache[key] = (states.total
                                        + self.cluster.communicator_bytes * cost_step.communicators(par, False))
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
        return ((m + (p - 1) / v) * per_rank + cost_step.dp_comm_time(self.cluster, par, params, spans)
                + cost_step.optimizer_time(self.cluster, par, params))

    def split_stages(self, par: Parallel, *, mem_limit: float) -> list[tuple[int, int]] | None:
        """Stage boundaries of least max time that fit `mem_limit` (None if none fits)."""
        graph = self.graph
        v = par.chunks_per_rank
        chunks = par.pp * v
        per_param = memory.model_state_bytes(1, par).total  # ZeRO model states are linear in the parameters
        static = self._get(SHARDS, par, lambda: [per_param * n for n in self.params(par)], "static", per_param)
        extra_any, extra_last = self.extra(par)
        # Chunk k runs on rank k % p. With v chunks a rank, each chunk gets 1/v of the memory (`predict` checks
        # the rank's exact total afterwards).
        per_rank = [memory.in_flight(par, r) for r in range(par.pp)]
        in_flight = [per_rank[k % par.pp] for k in range(chunks)]
        extra = [extra_any] * (chunks - 1) + [extra_last]
        # Two necessary conditions, cheap next to the DP, that rule out most configurations that cannot fit:
        # summed over the chunks, memory is at least all static memory plus all activations at the fewest
        # micro-batches in flight; and the largest unit must fit in some chunk on its own.
        # Every GPU also holds its communicators' buffers (at least those of its tp, dp and pp groups).
        buffers = self.cluster.communicator_bytes * cost_step.communicators(par, shares_weights=False)
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


