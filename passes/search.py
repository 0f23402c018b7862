"""The outer search: every parallel configuration the pins allow (`passes.search_space`), each with its best TP map
and stage split.

For each configuration, `passes.tp_solve` offers the per-layer TP style maps (the least time first, then maps
that trade time for parameters a GPU: `solve_tp_choices`, docs/joint-search.md), each a candidate of its own, and
`passes.stages` the stage boundaries; `passes.assemble.predict` gives the step time and memory
(`passes.search_costs` computes each once per key).

Pruning never loses the optimum of the cost model: a candidate is evaluated in full only while a lower bound of
its step time, (m + (p - 1)/v) * sum(unit times) / p (a rank runs at least its share of the units, m times plus
the fill/drain slots), is below the k-th best step time found so far; once its stage split is known, the same
bound with the busiest rank's actual time decides whether `predict` runs. A configuration whose model states alone
cannot fit (1/p of the parameters, each sharded t ways: `_Costs.state_floor`) is dropped before its TP solve, and
two necessary memory conditions skip the stage DP for others that cannot fit. `prune=False` evaluates all of them
(the tests compare the two).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from partc.cluster import Cluster
from partc.errors import PartcError
from partc.ir import ModelGraph
from partc.parallel import Parallel, Pins, check_pins
from partc.passes import cost_step, cost_types
from partc.passes.search_costs import _Costs
from partc.passes.search_space import _config_values, max_stages
from partc.passes.tp import TPSolution


@dataclass(kw_only=True, slots=True)
class Candidate:
    parallel: Parallel
    tp: TPSolution
    bounds: list[tuple[int, int]]
    prediction: cost_types.Prediction

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
    unfit: list[tuple[_Costs, Parallel, TPSolution, list[tuple[int, int]], cost_types.Prediction | None]] = []
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
        if not cost_step.fits(costs.cluster, pred.memory_per_gpu):
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
