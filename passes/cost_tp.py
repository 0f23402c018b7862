"""A unit's tensor-parallel collectives per micro-batch (`unit_collectives`): those the TP solution places
(`passes.tp`), or under sequence parallelism the conjugate pairs Megatron runs in their place (Korthikanti et al.
2022, section 4.2.2), the gradients of the parameters applied to each rank's part of the sequence, and where the
stream enters and leaves the split; the phases a backward collective can run in besides "fwd" and "bwd"
(`REGATHER`, `REPLAY`). `passes.cost` prices them per unit, `passes.cost_step.tp_bytes` sums a rank's payload, and
`partc check` compares them with what the program runs.
"""

from __future__ import annotations

import math

from partc.ir import ModelGraph, Unit
from partc.parallel import Parallel
from partc.precision import compute_bytes
from partc.passes.cost_types import VOCAB_LOSS_REASON, TPPlan, recompute_mode, style_of, tokens


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
