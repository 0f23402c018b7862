"""The tensor-parallel styles chosen with OR-Tools CP-SAT, over the semantics of `passes.tp` (the styles, their
collectives and costs, `evaluate_tp`).

Units of one `Unit.signature` share their styles: the CP-SAT model has one set of variables per signature class
(the first unit of the class represents it), every layer's costs are charged to its representative's variables,
and an edge between two blocks (block k's rowwise fc2 feeding block k+1's ln_1) maps onto the representative
itself. Identical sources are merged with a multiplicity, so 128 blocks solve as fast as 2.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence

from ortools.sat.python import cp_model

from partc.cluster import Cluster
from partc.errors import PartcError
from partc.ir import Layer, ModelGraph
from partc.sharding import param_shard
from partc.passes.tp import (CONVERSIONS, FACTS, NS, SEED, SolveCache, TPSolution, _check_degree, _check_styles,
                             _consumer_facts, _evaluate, _needs, _spans_nodes, allowed_styles, vocab_loss_collectives)

from . import hw

# 4. The CP-SAT model


def _tied_conflicts(graph: ModelGraph, tp: int):
    """(style of a, style of b, a, b) for layers a, b sharing a parameter that those styles would split
    differently."""
    for dup, canon in graph.tied.items():
        a, b = dup.rsplit(".", 1)[0], canon.rsplit(".", 1)[0]
        if a not in graph.layers or b not in graph.layers or a == b:
            continue
        la, lb = graph.layers[a], graph.layers[b]
        for sa in allowed_styles(la, tp):
            for sb in allowed_styles(lb, tp):
                ka, kb = param_shard(la, dup, sa), param_shard(lb, canon, sb)
                if (ka and (ka.dim, ka.fused)) != (kb and (kb.dim, kb.fused)):
                    yield sa, sb, a, b


class _CpModel(cp_model.CpModel):
    """OR-Tools' model without the deprecated camelCase aliases its constructor sets on every instance (a few ms
    each, and the search builds a model per component and TP solve): partc calls the snake_case methods only."""

    def _add_pre_pep8_methods(self) -> None:
        pass


def _neg(lit):
    return (not lit) if isinstance(lit, bool) else lit.Not()


def _or(model: cp_model.CpModel, lits: list):
    """A literal equal to OR(lits); Python booleans stand for constants."""
    if any(x is True for x in lits):
        return True
    lits = list({x.index: x for x in lits if x is not False}.values())  # CP-SAT literals: index < 0 for negations
    if len(lits) <= 1:
        return lits[0] if lits else False
    y = model.new_bool_var("")
    model.add_bool_or(lits).only_enforce_if(y)
    model.add_bool_and([_neg(x) for x in lits]).only_enforce_if(y.Not())
    return y


def _and(model: cp_model.CpModel, lits: list):
    return _neg(_or(model, [_neg(x) for x in lits]))


def _components(choices: dict[str, list[str]], groups: list[list[str]]) -> dict[str, str]:
    """Representative -> the first representative of its component: representatives with a choice are joined when
    one group (a source and its consumers, or a tied pair) names them, since they then share a cost term."""
    parent = {r: r for r in choices}

    def find(r: str) -> str:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for group in groups:
        open_ = [find(r) for r in group if len(choices[r]) > 1]
        for r in open_[1:]:
            parent[r] = open_[0]
    return {r: find(r) for r in choices}


def _solve_classes(graph: ModelGraph, tp: int, cluster: Cluster, b: int, rep: dict[str, str],
                   pins: dict[str, str], cache: SolveCache | None = None,
                   fronts: list | None = None) -> tuple[dict[str, str], int]:
    """(representative layer FQN -> style, the model's time in ns), minimizing the time of the whole model.

    The time is a sum of terms, each over the styles of one source layer and its consumers (or of a tied pair), so
    the model falls apart into independent components (mostly one unit's layers: units meet at norms, which have
    no choice); each is solved on its own, and components of the same shape and costs once (blocks of different
    signatures whose layers with a choice match: a block with one more norm or bias table, a stage of another
    width whose costs come out equal). With a `fronts` list, each component with more than one non-dominated
    (time, parameters) choice appends its front (`_solve_component`), the time-optimal choice first."""
    choices = {r: [pins[r]] if r in pins else allowed_styles(graph.layers[r], tp) for r in dict.fromkeys(rep.values())}
    cache = cache or SolveCache(graph, cluster)
    distinct = Counter()
    # A source's sum group (`ModelGraph.sums`): ("member", its members' representatives) for a member, whose own
    # conversions hold unless every member is colwise, ("sum", ...) for the sum, whose hold only then; None: neither.
    group_of = {m: tuple(rep[x] for x in s.members) for s in cache.sums for m in s.members}
    for src in cache.sources + cache.sums:
        consumers = tuple(sorted({(rep[c], ok) for c, ok in src.consumers.items()}))
        group = ("sum" if src.members else "member", group_of[src.layer]) if src.layer in group_of else None
        distinct[(rep[src.layer], src.nbytes, consumers, src.loss, group)] += 1
    tied = [(sa, sb, rep[a], rep[b]) for sa, sb, a, b in _tied_conflicts(graph, tp)]
    comp = _components(choices, [[r, *(c for c, _ in cons), *(group[1] if group else ())]
                                 for r, _, cons, _, group in distinct] + [[a, b] for _, _, a, b in tied])
    members: dict[str, list[str]] = {}
    for r in choices:
        members.setdefault(comp[r], []).append(r)

    def owner(reps) -> str | None:
        """The component of a term over `reps` (None: no representative in it has a choice)."""
        return next((comp[r] for r in reps if len(choices[r]) > 1), None)

    terms: dict[str | None, dict] = {c: {"sources": [], "tied": [], "layers": []} for c in [None, *members]}
    for key, count in distinct.items():
        terms[owner([key[0], *(c for c, _ in key[2]), *(key[4][1] if key[4] else ())])]["sources"].append(
            (key, count))
    for t in tied:
        terms[owner(t[2:])]["tied"].append(t)
    for fqn in graph.layers:
        terms[owner([rep[fqn]])]["layers"].append(fqn)

    total_ns, choice, solved = 0, {r: c[0] for r, c in choices.items() if len(c) == 1}, {}
    for c in [None, *(c for c in members if len(choices[c]) > 1)]:  # None: the terms without a choice
        reps = [r for r in members.get(c, []) if len(choices[r]) > 1]
        front = _solve_component(graph, tp, cluster, b, rep, choices, reps, terms[c], solved, cache,
                                 front=fronts is not None)
        picked, ns = front[0][:2]
        choice.update(picked)
        total_ns += ns
        if fronts is not None and len(front) > 1:
            fronts.append(front)
    return choice, total_ns


def _layer_params(layer: Layer, style: str, tp: int) -> int:
    """Parameters of `layer` on one GPU under `style` at degree `tp`, as `passes.cost` counts a unit's: a weight
    (ndim >= 2) split t ways by any split, a bias by colwise only."""
    total = 0
    for shape in layer.params.values():
        n = math.prod(shape)
        if tp > 1 and style != "replicate" and (len(shape) >= 2 or style == "colwise"):
            n = -(-n // tp)
        total += n
    return total


MAX_FRONT = 6
"""The most non-dominated (time, parameters) choices kept per component (the time-optimal one first)."""
FRONT_STEP = 0.99
"""Each point of a front holds at most this fraction of the parameters of the point before it: a style that saves
less (a colwise second Linear instead of rowwise saves only its bias, h/t numbers, for a gather) is not weighed,
as CP-SAT's integer nanoseconds treat times within a few ns as equal."""


def _solve_component(graph: ModelGraph, tp: int, cluster: Cluster, b: int, rep: dict[str, str],
                     choices: dict[str, list[str]], reps: list[str], terms: dict, solved: dict, cache: SolveCache,
                     front: bool = False) -> list[tuple[dict[str, str], int, int]]:
    """[(style of each representative in `reps`, time in ns of `terms`, parameters on one GPU of `terms`' layers)]
    by CP-SAT; representatives outside `reps` have one choice. The first entry is the least time (then the fewest
    collectives and split layers); with `front`, the entries after it are the rest of the component's Pareto front
    of (time, parameters), fewer parameters and more time each (the epsilon-constraint method: minimize the time
    with the parameters below the last point's by `FRONT_STEP`, until nothing is left or `MAX_FRONT` points; a point another
    matches in time with fewer parameters is dropped). Each point holds at most `FRONT_STEP` of the parameters of
    the point before it. `solved`: cache key -> that list of components solved
    before."""
    model = _CpModel()

    # 1. Variables: x[r][style] per representative layer with a choice (a constant for the others); collective
    #    indicators (defined by boolean constraints as they are created) per distinct source, with the number of
    #    layers it stands for.
    x: dict[str, dict[str, object]] = {r: {s: model.new_bool_var(f"{r}={s}") for s in choices[r]} for r in reps}

    def styles_of(r: str) -> dict[str, object]:
        return x[r] if r in x else {choices[r][0]: True}

    def lit(layer: str, style: str):
        return styles_of(rep[layer]).get(style, False)

    indicators: list[tuple[int, object]] = []  # (cost in ns for all layers it stands for, literal)
    spans = _spans_nodes(cluster, tp)
    for (r, nbytes, consumers, loss, group), count in terms["sources"]:
        all_s = _and(model, [lit(m, "colwise") for m in group[1]]) if group else False
        lits: dict[str, list] = {f: [] for f in FACTS}
        lits["need_r"].append(_neg(lit(r, "colwise")) if loss == "vocab" else loss)
        if loss == "vocab" and lit(r, "colwise") is not False:  # the vocab-parallel loss's all-reduces
            for coll in vocab_loss_collectives(graph):
                ns = round(NS * hw.collective_time(cluster, coll.kind, coll.nbytes * b, tp, spans_nodes=spans))
                indicators.append((ns * count, lit(r, "colwise")))
        for c, ok in consumers:
            styles = styles_of(c)
            for fact in FACTS:
                makes = [s for s in styles if fact in _consumer_facts(*_needs(graph.layers[c], s), ok)]
                lits[fact] += [True] if len(makes) == len(styles) else [styles[s] for s in makes]
        facts = {f: _or(model, v) for f, v in lits.items()}
        if group and group[0] == "sum":  # converted only when every member is colwise (then it is S)
            state = {"S": all_s, "P": False, "RP": False}
        else:
            state = {"S": lit(r, "colwise"), "P": lit(r, "rowwise"), "RP": _neg(lit(r, "colwise"))}
        for _phase, kind, states, cond in CONVERSIONS:
            cond = [state[states], _neg(all_s) if group and group[0] == "member" else True] + \
                   [facts[f] if want else _neg(facts[f]) for f, want in cond.items()]
            y = _and(model, cond)
            if y is not False:  # a literal, or True: a collective every choice left open pays
                ns = round(NS * hw.collective_time(cluster, kind, nbytes * b, tp, spans_nodes=spans))
                indicators.append((ns * count, y))

    # 2. Objective: time in ns, then fewer collective indicators, then fewer split layers (deterministic ties).
    compute: Counter = Counter()
    params: Counter = Counter()
    for fqn in terms["layers"]:
        for style in styles_of(rep[fqn]):
            compute[(rep[fqn], style)] += round(NS * cache.compute_s(fqn, style, tp, b))
            params[(rep[fqn], style)] += _layer_params(graph.layers[fqn], style, tp)
    const_ns = sum(ns for ns, y in indicators if y is True) + sum(c for (r, _), c in compute.items() if r not in x)
    const_params = sum(c for (r, _), c in params.items() if r not in x)
    indicators = [(ns, y) for ns, y in indicators if y is not True]
    compute = {k: c for k, c in compute.items() if k[0] in x}
    params = {k: c for k, c in params.items() if k[0] in x}
    if not x:
        return [({}, const_ns, const_params)]
    split_lits = [v for r in x for s, v in x[r].items() if s != "replicate"]
    w_coll = len(split_lits) + 1
    w_time = w_coll * (len(indicators) + 1)
    # CP-SAT's sums are 64-bit integers: times of years (a cluster file's rates in the wrong unit) do not fit.
    total_ns = sum(ns for ns, _ in indicators) + sum(compute.values())
    if w_time * total_ns >= 2**62:
        raise PartcError(f"the predicted times on cluster {cluster.name!r} are too large to optimize ({total_ns / NS:.3g} "
                         f"s per micro-batch at tp {tp}); check the cluster's rates (FLOP/s and bytes/s)")
    time_ns = sum(ns * v for ns, v in indicators) + sum(c * x[r][s] for (r, s), c in compute.items())

    # 3. Constraints: one style per representative layer; a tied parameter (GPT-2's wte and lm_head) is one tensor,
    #    so the layers holding it must split it alike (embedding rowwise with head colwise: both split the
    #    vocabulary).
    for r in x:
        model.add_exactly_one(list(x[r].values()))
    for a_style, b_style, a, b in terms["tied"]:
        la, lb = styles_of(a).get(a_style, False), styles_of(b).get(b_style, False)
        if la is False or lb is False:
            continue
        model.add_bool_or([_neg(la), _neg(lb)])

    # 4. Components of the same shape and costs (the model's proto up to variable names) are solved once.
    model.minimize(w_time * time_ns + w_coll * sum(v for _, v in indicators) + sum(split_lits))
    proto = model.proto
    for v in proto.variables:
        v.name = ""
    key = str(proto)  # text format
    param_of = lambda picked: sum(params[(r, s)] for r, s in zip(x, picked))  # noqa: E731
    if key not in solved:
        solved[key] = [_cp_solve(model, x, time_ns)]
    if front and (key, "front") not in solved:
        # 5. The Pareto front: the least time under fewer and fewer parameters. None below the fewest each layer
        #    can have alone (then the first point is the only one).
        points = solved[key]
        least = sum(min(params[(r, s)] for s in x[r]) for r in x)
        while len(points) < MAX_FRONT and param_of(points[-1][0]) > least:
            cap = min(math.floor(param_of(points[-1][0]) * FRONT_STEP), param_of(points[-1][0]) - 1)
            model.add(sum(c * x[r][s] for (r, s), c in params.items()) <= cap)
            found = _cp_solve(model, x, time_ns)
            if found is None:
                break
            points.append(found)
        solved[key, "front"] = [pt for pt in points if not any(
            other[1] <= pt[1] and param_of(other[0]) < param_of(pt[0]) for other in points)]
    first = solved[key][0]  # the least time first, as without a front (kept if a point of equal time has fewer
    points = [first, *(pt for pt in solved[key, "front"] if pt is not first)] if front else [first]  # parameters)
    return [(dict(zip(x, picked)), const_ns + ns, const_params + param_of(picked)) for picked, ns in points]


def _cp_solve(model: cp_model.CpModel, x: dict[str, dict[str, object]], time_ns) -> tuple[list[str], int] | None:
    """(the style of each representative of `x`, the time) of `model`'s optimum; None if it has no solution."""
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = SEED
    solver.parameters.max_deterministic_time = 60.0
    status = solver.solve(model)
    if status == cp_model.INFEASIBLE:
        return None
    assert status in (cp_model.OPTIMAL, cp_model.FEASIBLE), solver.status_name(status)
    return [next(s for s, v in x[r].items() if solver.boolean_value(v)) for r in x], solver.value(time_ns)


def solve_tp(graph: ModelGraph, tp: int, cluster: Cluster, micro_batch_size: int,
             pinned: dict[str, str] | None = None, *, cache: SolveCache | None = None) -> TPSolution:
    """The style map of least time per micro-batch at degree `tp`; units of one signature share their styles.

    `pinned` fixes some layers (a pin applies to the same layer in every unit of its signature class). `cache`:
    a `SolveCache` of the same graph and cluster, when the caller solves more than once.
    """
    return _solve_tp(graph, tp, cluster, micro_batch_size, pinned, cache, choices=False)[0]


MAX_CHOICES = 16
"""The most style maps `solve_tp_choices` returns (combinations of the components' fronts, in product order)."""


class TPChoices(Sequence):
    """`solve_tp_choices`' style maps, each priced (`_evaluate`) when first read: the search reads a map only
    when its configuration's bound reaches the front of its queue."""

    def __init__(self, first: TPSolution, combos: list[dict[str, str]], make):
        self._maps, self._combos, self._make = {0: first}, combos, make

    def __len__(self) -> int:
        return 1 + len(self._combos)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        if not 0 <= k < len(self):
            raise IndexError(k)
        if k not in self._maps:
            self._maps[k] = self._make(self._combos[k - 1])
        return self._maps[k]


def solve_tp_choices(graph: ModelGraph, tp: int, cluster: Cluster, micro_batch_size: int,
                     pinned: dict[str, str] | None = None, *,
                     cache: SolveCache | None = None) -> TPChoices:
    """The style maps the search weighs at degree `tp`: `solve_tp`'s (least time) first, then every other
    combination of the components' non-dominated (time, parameters on one GPU) choices (`_solve_component`),
    up to `MAX_CHOICES`. A style map outside these is slower than one inside with no fewer parameters in some
    component, so it can only win through the memory per rank or parameters its other components do not change.
    The layers whose style differs from the least-time map say so in `why` ("memory: ...")."""
    return _solve_tp(graph, tp, cluster, micro_batch_size, pinned, cache, choices=True)


def _solve_tp(graph: ModelGraph, tp: int, cluster: Cluster, micro_batch_size: int, pinned: dict[str, str] | None,
              cache: SolveCache | None, *, choices: bool) -> TPChoices:
    _check_degree(tp, micro_batch_size)
    pinned = dict(pinned or {})
    _check_styles(graph, pinned, tp, "pinned TP style names")
    cache = cache or SolveCache(graph, cluster)
    assert cache.graph is graph and cache.cluster is cluster, "a SolveCache serves one graph and cluster"
    rep = cache.rep if tp > 1 else {f: f for f in graph.layers}
    pins: dict[str, str] = {}
    for fqn, style in pinned.items():
        if pins.setdefault(rep[fqn], style) != style:
            raise PartcError(f"pinned TP style {style} of {fqn} conflicts with {pins[rep[fqn]]} pinned on a layer "
                             f"of an identical unit ({rep[fqn]})")
    fronts: list[list[tuple[dict[str, str], int, int]]] = []
    if tp == 1:
        choice = {f: pins.get(f, "replicate") for f in graph.layers}
    else:
        choice, _ = _solve_classes(graph, tp, cluster, micro_batch_size, rep, pins, cache,
                                   fronts if choices else None)
    given = {f for f in graph.layers if rep[f] in pins}
    first = _evaluate(graph, tp, {f: choice[rep[f]] for f in graph.layers}, cluster, micro_batch_size, given=given,
                      cache=cache)
    combos = itertools.product(*(range(len(front)) for front in fronts))
    next(combos)  # every component at its least time: `first`
    maps = []
    for combo in itertools.islice(combos, MAX_CHOICES - 1):
        picked = dict(choice)
        for front, k in zip(fronts, combo):
            picked.update(front[k][0])
        maps.append(picked)

    def make(picked: dict[str, str]) -> TPSolution:
        sol = _evaluate(graph, tp, {f: picked[rep[f]] for f in graph.layers}, cluster, micro_batch_size,
                        given=given, cache=cache)
        slower = (sol.time_s - first.time_s) * 1e3
        for fqn, style in sol.styles.items():
            fast = first.styles[fqn]
            if style != fast:
                layer = graph.layers[fqn]
                alone = f"{fast} is faster alone (the model by {slower:.3g} ms a micro-batch)" if slower > 1e-6 \
                    else f"{fast} is as fast alone and splits fewer layers"
                sol.why[fqn] = (f"memory: {style} keeps {_layer_params(layer, style, tp):,} of its parameters on "
                                f"a GPU where {fast} keeps {_layer_params(layer, fast, tp):,}; {alone}, but the "
                                f"plan is faster with {style}: the memory it frees lets the stages fit or balance, "
                                f"or the fewer parameters shorten the optimizer step and gradient traffic")
        return sol

    return TPChoices(first, maps, make)
