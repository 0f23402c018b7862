"""Tensor-parallel style of every layer (Megatron-LM), chosen with OR-Tools CP-SAT.

Styles and the state of a layer's output (Shoeybi et al. 2019, "Megatron-LM", section 3):

    replicate -> R (replicated)     colwise -> S (sharded on the feature dim)     rowwise -> P (partial sums)

An Embedding rowwise shards the vocabulary (masked lookup, output P); colwise shards the embedding dim (output S).
A layer of packed expert weights may be ``inner`` (`passes.experts`): split inside as a Megatron MLP, it reads its
input whole and hands back a P gradient, as colwise does, and gives P, as rowwise does. Norms and other layers are
replicate only. A consumer needs its input in state R (colwise, replicate) or S
(rowwise) and hands back its input gradient in state P (colwise: Megatron's "f", identity forward and all-reduce
backward), S (rowwise) or R (replicate). The loss is a replicate consumer of every layer without out-edges;
graph inputs (token ids) are R and need no gradient.

Conversions happen once per source layer and phase: one converted tensor serves every consumer (a local split
of R gives S for free), and gradients are summed before the conversion (R and S gradients fold into a P sum for
free: R/t, zero-padded S). "S needed across an edge with shard_ok False" means the path reshapes the features,
so the shards do not line up: gather to R, then split locally.

    forward,  source S:  all_gather      if a consumer needs R, or S across a shard_ok False edge
    forward,  source P:  all_reduce      if any consumer needs R or S (S is then a local split)
    backward, source R or P (needs an R gradient):  all_reduce if a gradient is P, else all_gather if one is S
    backward, source S (needs an S gradient):       all_reduce if a gradient is P (the whole gradient, then the
                                                    local part), else all_gather if an S gradient crosses a
                                                    shard_ok False edge

Layers whose outputs are read only through their sum (`ModelGraph.sums`: GPT's token and position embeddings
added) are one source when every one is colwise: the rewrite keeps an add of split operands split, so the sum is
converted once for the readers of all of them (its bytes the widest member's), charged to the last member's unit.
Otherwise each is its own source, as the rewrite gathers a split operand that meets a whole one.

These are the collectives `passes.tp_rewrite` writes into the program: a rowwise output is always all-reduced
(then split where a reader needs it split), and a colwise reader of a split tensor gets it gathered, its P
gradient all-reduced.

Seconds: collective  passes.hw.collective_time(cluster, kind, bytes * b, t)  (ring formulas, nccl-tests'
performance notes), bytes = the source's output per sample (the largest of its out-edges, else `Layer.out_bytes`);
compute  3 * sum of passes.hw.gemm_time over the layer's GEMMs (forward + backward, backward = 2 x forward as in
Narayanan et al. 2021), colwise splitting n and rowwise k. time_s = compute + collectives, per micro-batch.

The CP-SAT model that picks the styles is `passes.tp_solve`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


from partc.cluster import Cluster
from partc.errors import PartcError, article
from partc.ir import Layer, ModelGraph
from partc.mesh_axes import group_spans_nodes
from partc.parallel import TP_STYLES
from partc.sharding import GEMM_SPLIT
from partc.passes.cost_types import VOCAB_LOSS_REASON

from . import hw

STATE = {"replicate": "R", "colwise": "S", "rowwise": "P", "inner": "P"}
NS = 1e9  # CP-SAT costs are integer nanoseconds: options within a few ns count as equal, then tie-breaks decide
SEED = 0


@dataclass(kw_only=True, slots=True)
class Collective:
    kind: str
    """``all_reduce``, ``all_gather`` or ``reduce_scatter``."""
    phase: str
    """``fwd`` or ``bwd``."""
    nbytes: int
    """Bytes per sample of the full (unsharded) tensor; multiply by the micro-batch size."""
    src: str
    """FQN of the layer whose output (forward) or output gradient (backward) it converts."""
    reason: str
    """A short sentence for people."""
    reader_units: tuple[str, ...] = ()
    """A backward all-reduce of partial input gradients (the backward of `copy_to_tp`): the units of the layers
    that hand them back. The program runs it once on each pipeline stage holding one of them (each stage copies the
    value itself, `passes.codegen`), not on the source's stage: `passes.cost_step.copy_all_reduces` moves the charge."""
    runs_in: str = ""
    """A forward all-gather of a split output for readers that need it whole: the unit of its first reader, whose
    code runs it (`passes.tp_rewrite` gathers before the first reader), so a recomputation of that unit runs it
    again (`passes.cost_tp.unit_collectives`). Empty where the loss reads it, or for other collectives."""


@dataclass(kw_only=True, slots=True)
class TPSolution:
    styles: dict[str, str]
    """Every layer FQN -> ``colwise``, ``rowwise`` or ``replicate``."""
    collectives: dict[str, list[Collective]]
    """Unit FQN (the unit of the source layer) -> its collectives per micro-batch; every unit has a key."""
    time_s: float
    """Seconds per micro-batch: compute of all layers (forward + backward) + all collectives."""
    unit_time_s: dict[str, float]
    """The same per unit: its layers' compute + its collectives."""
    why: dict[str, str] = field(default_factory=dict)
    """At tp > 1: layer FQN -> why it is kept whole, or why its style is not Megatron's (`explain`); layers split
    as Megatron splits them, and norms, are not listed."""
    program: dict[str, list[tuple[str, str, float]]] = field(default_factory=dict)
    """Under sequence parallelism, unit FQN -> the TP collectives its program runs per micro-batch (kind, phase,
    bytes), for the units where the program does not keep the split along the sequence and those at their edges
    (`partc.compile.price_sequence_fallbacks`); the cost model charges these instead of its formulas."""


@dataclass(kw_only=True, slots=True)
class _Source:
    """A layer and who reads its output: consumer FQN -> shard_ok of every edge between them."""

    layer: str
    nbytes: int
    consumers: dict[str, bool]
    loss: bool | str
    """True: the loss reads the output whole; ``"vocab"``: the loss can read it split over the vocabulary (colwise),
    `partc.collectives.vocab_parallel_cross_entropy`, with its two all-reduces (`vocab_loss_collectives`)."""
    members: tuple[str, ...] = ()
    """A sum of colwise layers' outputs (`ModelGraph.sums`; `layer` is the last of them): converted once when every
    member is colwise, in place of the members' own conversions. Empty: one layer's output."""


# 1. Semantics, shared by the evaluator and the CP-SAT model


def _group_error(layer: Layer, style: str, tp: int) -> str | None:
    if style == "inner":  # each packed piece of each weight split alike: the intermediate dim
        size, what = min(layer.params[p][d] // n for p, (d, n) in layer.inner.items()), "intermediate dim"
    elif layer.kind == "embedding":
        size, what = (layer.out_features, "vocabulary") if style == "rowwise" else (layer.in_features, "embedding dim")
    elif style == "colwise":
        size = layer.col_groups or layer.out_features
        what = "output features" if size == layer.out_features else "features per fused piece" \
            if layer.fused > 1 and size * layer.fused == layer.out_features else \
            "heads (or fused pieces)"
    else:
        size = layer.row_groups or layer.in_features
        what = "input features" if size == layer.in_features else "input heads"
    if size <= 0 or size % tp:
        return f"layer {layer.fqn}: {style} needs its {what} ({size}) divisible by tp={tp}"
    return None


def style_error(layer: Layer, style: str, tp: int) -> str | None:
    """Why `layer` cannot take `style` at degree `tp` (one line), or None."""
    if style not in TP_STYLES:
        return f"layer {layer.fqn}: unknown TP style {style!r}; expected one of {', '.join(TP_STYLES)}"
    if style == "replicate":
        return None
    if style == "inner":
        if not layer.inner:
            why = layer.split_stop or "it holds no packed weights that grouped products multiply by (experts)"
            return f"layer {layer.fqn} ({layer.type}) cannot be split inside: {why}"
        return _group_error(layer, style, tp)
    if layer.kind not in ("linear", "embedding"):
        why = f" ({layer.split_stop.partition(': ')[2]})" if layer.split_stop else ""
        return f"layer {layer.fqn} ({layer.type}, {layer.kind}) can only be replicate, not {style}{why}"
    if layer.kind == "linear" and not layer.gemms:
        return f"layer {layer.fqn}: the model never calls it; its parent uses its weight directly " \
               f"(nn.MultiheadAttention's out_proj), so it can only be replicate, not {style}"
    return _group_error(layer, style, tp)


def allowed_styles(layer: Layer, tp: int) -> list[str]:
    """Styles `layer` may take at degree `tp`, replicate first."""
    return [s for s in ("replicate", "colwise", "rowwise", "inner") if style_error(layer, s, tp) is None]


def _needs(layer: Layer, style: str) -> tuple[str, str | None]:
    """(input state, input-gradient state) of a consumer; an Embedding reads ids and returns no gradient."""
    if layer.kind == "embedding":
        return "R", None
    return {"colwise": ("R", "P"), "rowwise": ("S", "S"), "replicate": ("R", "R"), "inner": ("R", "P")}[style]


# The collectives, as rules over the source's state and four facts about who reads it (Megatron's f and g, and
# the gathers a split that does not line up needs). One table serves the evaluator (`_conversions`) and the
# CP-SAT model (`_solve_classes`), so the solver charges exactly what the rewrite writes:
#   need_r      the loss reads the source, or a consumer needs it whole (R), or split across an edge whose
#               shards do not line up (gather to R, then split locally)
#   need_s      a consumer needs it split (S: a rowwise input)
#   grad_p      a consumer hands back a partial-sum gradient (P: colwise's input gradient)
#   grad_s_bad  a consumer hands back a split gradient across an edge whose shards do not line up
# Rows of one phase exclude each other. (phase, collective, source states, facts that must hold or not hold)
CONVERSIONS = (
    ("fwd", "all_gather", "S", {"need_r": True}),
    ("fwd", "all_reduce", "P", {"need_r": True}),
    ("fwd", "all_reduce", "P", {"need_r": False, "need_s": True}),
    ("bwd", "all_reduce", "S", {"grad_p": True}),
    ("bwd", "all_gather", "S", {"grad_p": False, "grad_s_bad": True}),
    ("bwd", "all_reduce", "RP", {"grad_p": True}),
    ("bwd", "all_gather", "RP", {"grad_p": False, "need_s": True}),
)
FACTS = ("need_r", "need_s", "grad_p", "grad_s_bad")


def _consumer_facts(inp: str, grad: str | None, shard_ok: bool) -> set[str]:
    """The facts a consumer taking its input in state `inp` and handing back its gradient in state `grad` makes
    true of its source (`shard_ok`: the edge's shards line up)."""
    facts = set()
    if inp == "R" or (inp == "S" and not shard_ok):
        facts.add("need_r")
    if inp == "S":
        facts.add("need_s")
    if grad == "P":
        facts.add("grad_p")
    if grad == "S" and not shard_ok:
        facts.add("grad_s_bad")
    return facts


def _facts(needs: list[tuple[str, str | None, bool]], loss: bool) -> set[str]:
    """The facts of a source read by consumers with (input, gradient, shard_ok) `needs`, and by the loss."""
    facts = {"need_r"} if loss else set()
    for inp, grad, ok in needs:
        facts |= _consumer_facts(inp, grad, ok)
    return facts


def _conversions(state: str, facts: set[str]) -> dict[str, str]:
    """Phase -> collective of a source in `state` whose readers make `facts` true (`CONVERSIONS`)."""
    out = {}
    for phase, kind, states, cond in CONVERSIONS:
        if state in states and all((f in facts) == want for f, want in cond.items()):
            assert phase not in out, (state, facts)
            out[phase] = kind
    return out


def _sources(graph: ModelGraph) -> list[_Source]:
    """One source per layer, and one per routed edge (`Edge.routed`: the part of the output one expert reads,
    converted for it alone, at its expected bytes)."""
    consumers: dict[str, dict[str, bool]] = {f: {} for f in graph.layers}
    nbytes = {f: 0 for f in graph.layers}
    read = {f: False for f in graph.layers}
    routed = []
    for e in graph.edges:
        assert e.src in graph.layers and e.dst in graph.layers, f"edge {e.src} -> {e.dst} names an unknown layer"
        if e.src == e.dst:
            continue
        read[e.src] = True
        if e.routed:
            routed.append(_Source(layer=e.src, nbytes=e.bytes, consumers={e.dst: e.shard_ok}, loss=False))
            continue
        consumers[e.src][e.dst] = consumers[e.src].get(e.dst, True) and e.shard_ok
        nbytes[e.src] = max(nbytes[e.src], e.bytes)
    head = graph.vocab_loss.get("head")
    return [_Source(layer=f, nbytes=nbytes[f] or layer.out_bytes, consumers=consumers[f],
                    loss="vocab" if f == head and not read[f] else not read[f])
            for f, layer in graph.layers.items()] + routed


def _sum_sources(graph: ModelGraph, sources: list[_Source]) -> list[_Source]:
    """One source per `ModelGraph.sums` group: the readers of any member (an edge's shards line up only if they do
    for every member), the widest member's bytes, read by the loss if any member is."""
    by_layer = {s.layer: s for s in sources}
    out = []
    for members in graph.sums:
        assert len(members) > 1 and all(m in by_layer for m in members), members
        consumers: dict[str, bool] = {}
        for m in members:
            for c, ok in by_layer[m].consumers.items():
                consumers[c] = consumers.get(c, True) and ok
        out.append(_Source(layer=members[-1], nbytes=max(by_layer[m].nbytes for m in members), consumers=consumers,
                           loss=any(bool(by_layer[m].loss) for m in members), members=tuple(members)))
    return out


def summed(sums: list[_Source], styles: dict[str, str]) -> tuple[list[_Source], set[str]]:
    """(the sum sources whose members are all colwise under `styles`, the members they stand for)."""
    live = [s for s in sums if all(styles[m] == "colwise" for m in s.members)]
    return live, {m for s in live for m in s.members}


def vocab_loss_collectives(graph: ModelGraph) -> list[Collective]:
    """The vocab-parallel cross-entropy's all-reduces per sample (`partc.collectives.vocab_parallel_cross_entropy`):
    the row maxima (one fp32 a logit row), then the target's logit and the sum of exponentials (two)."""
    head, rows = graph.vocab_loss["head"], int(graph.vocab_loss["rows"])
    why = VOCAB_LOSS_REASON + "{}: {} all-reduced over tp (the logits stay split)"
    return [Collective(kind="all_reduce", phase="fwd", nbytes=4 * rows, src=head,
                       reason=why.format(head, "the row maxima")),
            Collective(kind="all_reduce", phase="fwd", nbytes=8 * rows, src=head,
                       reason=why.format(head, "the target's logit and the sum of exponentials"))]


def _compute_s(cluster: Cluster, layer: Layer, style: str, tp: int, b: int) -> float:
    """Forward + backward GEMM seconds of one layer: 3 x forward."""
    return 3 * sum(hw.gemm_time(cluster, g, micro_batch_size=b, split=GEMM_SPLIT[style], degree=tp)
                   for g in layer.gemms)


class SolveCache:
    """What `solve_tp` derives from the graph and the cluster alone, kept across its calls (the search solves every
    TP degree and micro-batch size of one graph): the layers' sources, the representatives of identical units, and
    each layer's GEMM seconds by its GEMMs' shapes, style, degree and micro-batch size (identical blocks repeat
    them). The graph and the cluster must not change while it is in use."""

    def __init__(self, graph: ModelGraph, cluster: Cluster):
        self.graph, self.cluster = graph, cluster
        self.sources = _sources(graph)
        self.sums = _sum_sources(graph, self.sources)
        self.rep = representatives(graph)
        self._shapes = {f: tuple((g.batch, g.m, g.n, g.k, g.batch_scales, g.dtype_bytes, g.fused, g.inner_split,
                                 g.io_bytes)
                                 for g in layer.gemms) for f, layer in graph.layers.items()}
        self._seconds: dict[tuple, float] = {}

    def compute_s(self, fqn: str, style: str, tp: int, b: int) -> float:
        """`_compute_s` of layer `fqn`."""
        key = (self._shapes[fqn], style, tp, b)
        if key not in self._seconds:
            self._seconds[key] = _compute_s(self.cluster, self.graph.layers[fqn], style, tp, b)
        return self._seconds[key]


def _readers(phase: str, kind: str, consumers: list[str], needs: list[tuple[str, str | None, bool]]) -> list[str]:
    """The consumers a collective serves (for its reason)."""
    if phase == "fwd":
        return [c for c, (inp, _, ok) in zip(consumers, needs) if inp in ("R", "S") or not ok]
    want = "S" if kind == "all_gather" else "P"
    return [c for c, (_, grad, _) in zip(consumers, needs) if grad == want]


def _reason(phase: str, kind: str, src: Layer, style: str, readers: list[str], reader_style: str = "colwise",
            members: tuple[str, ...] = ()) -> str:
    who = readers[0] + (f" and {len(readers) - 1} more" if len(readers) > 1 else "") if readers else "the loss"
    name = f"{style} {src.fqn}" if not members else \
        f"the sum of {style} {', '.join(members[:-1])} and {members[-1]}"
    if phase == "fwd":
        if kind == "all_gather":
            return f"gather the feature shards of {name} for {who}"
        what = "masked lookups of vocab-parallel" if src.kind == "embedding" else \
            "partial outputs of split-inside" if style == "inner" else "partial outputs of rowwise"
        return f"sum {what} {src.fqn}"
    if kind == "all_reduce":
        return f"sum partial input gradients of {reader_style} {who} into {name}"
    return f"gather sharded input gradients of rowwise {who} for {name}"


# 2. Why a layer is kept whole (or off Megatron's pattern)


MEGATRON_NAMES = {
    "colwise": r"(q_proj|k_proj|v_proj|qkv_proj|query_key_value|(^|\.)(query|key|value|qkv|q|k|v|self_attn)|"
               r"query_proj|key_proj|value_proj|gate_proj|up_proj|gate_up_proj|dense_h_to_4h|fc1|c_attn|c_fc|"
               r"intermediate\.dense|wi|wi_0|wi_1|linear1|^blocks\.\d+\.mlp\.(gate|up))$",
    "rowwise": r"(o_proj|out_proj|down_proj|dense_4h_to_h|fc2|c_proj|(attention|self_attention|attn)\.dense|"
               r"attention\.output\.dense|(^|\.)output\.dense|wo|(^|\.)(o|proj)|linear2|^blocks\.\d+\.mlp\.down)$",
    "inner": r"(^|\.)experts$",
}
"""Megatron-LM's pattern by layer name, across the model families partc is tried on (its examples, Hugging Face's
and timm's layer names, ``nn.MultiheadAttention``): the inputs of attention (query, key, value, fused or not) and of
the MLP (first layer, gate, up; examples/llama.py's ``blocks.N.mlp.gate`` and ``up``, not a mixture's router
``mlp.gate``) split by output features, the projections after them by input features (an
``nn.MultiheadAttention`` named self_attn is the Linear of its packed q, k and v); packed experts split inside, each
as a Megatron MLP (`partc.passes.experts`). This is the map a user writes into a plan's ``tp`` by hand
(``--from-plan``) to run Megatron's split; `megatron_styles` reads the pattern off a traced model's data flow."""

MEGATRON_VOCAB = {"rowwise": r"(^tok|wte|embed_tokens)$", "colwise": r"^lm_head$"}
"""Megatron-LM's vocabulary split by layer name: the token embedding rowwise, the LM head colwise."""


def megatron_style(fqn: str, *, vocab: bool = False) -> str | None:
    """A layer's style in Megatron's pattern by its name (`MEGATRON_NAMES`; with `vocab`, also `MEGATRON_VOCAB`);
    None where the pattern names nothing (the layer stays whole)."""
    for table in (MEGATRON_NAMES, MEGATRON_VOCAB if vocab else {}):
        for style, pattern in table.items():
            if re.search(pattern, fqn):
                return style
    return None


def megatron_styles(graph: ModelGraph) -> dict[str, str]:
    """Layer FQN -> its style in Megatron's pattern, for the layers the pattern names: a Linear whose split output
    reaches another Linear of its unit still split is colwise, and those it reaches rowwise (in execution order: a
    layer already rowwise is not colwise too); an Embedding rowwise (the vocabulary)."""
    out = {f: "rowwise" for f, layer in graph.layers.items() if layer.kind == "embedding"}
    out.update({f: "inner" for f, layer in graph.layers.items() if layer.inner})  # experts: a Megatron MLP each
    pairs = {}
    for e in graph.edges:  # pairs inside one unit (qkv -> proj, fc1 -> fc2), not a block's output -> the head
        if e.shard_ok and e.src != e.dst and graph.layers[e.src].unit == graph.layers[e.dst].unit:
            pairs.setdefault(e.src, []).append(e.dst)
    for f in graph.layers:  # in execution order; q, k and v all pair with o
        if f in pairs and f not in out:
            partners = [d for d in pairs[f] if out.get(d, "rowwise") == "rowwise"]
            if partners:
                out[f] = "colwise"
                out.update(dict.fromkeys(partners, "rowwise"))
    return out


def _style_reason(layer: Layer, style: str, tp: int) -> str | None:
    """`style_error` without the layer's name (one reason serves many layers)."""
    err = style_error(layer, style, tp)
    return err and err.removeprefix(f"layer {layer.fqn}: ")


def explain(graph: ModelGraph, tp: int, styles: dict[str, str], *, given: set[str] | frozenset = frozenset(),
            solved: bool = True) -> dict[str, str]:
    """Layer FQN -> why the style map keeps it whole at degree `tp` or gives it another style than Megatron's
    (`megatron_styles`): divisibility (heads or features by tp), a pattern the shard analysis cannot split (the
    op named), the kind of layer, a style `given` by the user, or cost (the solver chose it as the faster; with
    `solved` False the styles are a plan's, read from a file). Empty at tp 1."""
    if tp == 1:
        return {}
    pattern = megatron_styles(graph)
    why = {}
    for fqn, layer in graph.layers.items():
        style, want = styles[fqn], pattern.get(fqn)
        if layer.kind == "other" and layer.split_stop and style == "replicate" \
                and not layer.split_stop.startswith("pattern: "):  # not a whole reason of its own (attention's)
            why[fqn] = f"pattern: it multiplies by packed weights (experts) but cannot be split inside " \
                       f"({layer.split_stop})"
            continue
        if layer.kind not in ("linear", "embedding") and not layer.inner:
            if layer.kind == "other":
                why[fqn] = layer.split_stop or f"kind: {article(layer.type)} layer is always whole (tensor " \
                                               f"parallelism splits Linear and Embedding layers)"
            continue
        if style == want or (want is None and style != "replicate"):
            continue
        if layer.kind == "linear" and not layer.gemms:
            why[fqn] = "kind: the model never calls it, its parent uses its weight directly (nn.MultiheadAttention's " \
                       "out_proj): the TP rewrite splits a layer's own ops"
            continue
        tried = [want] if want else (["colwise", "rowwise"] if layer.kind == "linear" else ["rowwise", "colwise"])
        errors = [_style_reason(layer, s, tp) for s in tried]
        if all(errors):
            why[fqn] = "divisibility: " + "; ".join(errors)
        elif fqn in given:
            why[fqn] = f"given: {style} was set by hand"
        elif layer.split_stop and "colwise" in tried and style == "replicate":
            why[fqn] = f"pattern: a colwise split of its output must be gathered ({layer.split_stop}), which " \
                       f"costs more than the split saves"
        else:
            told = ("a split inside" if want == "inner" else "Megatron's " + want) if want else "a split"
            why[fqn] = f"cost: the solver found {style} faster here than {told}" if solved else \
                f"given: the plan sets {style} here, not {told}"
    return why


# 3. Evaluation of a complete style map


def _spans_nodes(cluster: Cluster, tp: int) -> bool:
    """Whether a tp group crosses nodes (the innermost mesh axis: neighbouring ranks)."""
    return group_spans_nodes(tp, 1, cluster.gpus_per_node)


def _evaluate(graph: ModelGraph, tp: int, styles: dict[str, str], cluster: Cluster, b: int, *,
              given: set[str] | frozenset = frozenset(), solved: bool = True,
              cache: SolveCache | None = None) -> TPSolution:
    cache = cache or SolveCache(graph, cluster)
    order = {u.fqn: i for i, u in enumerate(graph.units)}
    unit_time = {u.fqn: 0.0 for u in graph.units}
    collectives: dict[str, list[Collective]] = {u.fqn: [] for u in graph.units}
    for fqn, layer in graph.layers.items():
        unit_time[layer.unit] = unit_time.get(layer.unit, 0.0) + cache.compute_s(fqn, styles[fqn], tp, b)
    if tp > 1:
        sums, merged = summed(cache.sums, styles)
        for src in [s for s in cache.sources if s.layer not in merged] + sums:
            layer, style = graph.layers[src.layer], styles[src.layer]
            # A sum's conversion runs where the program adds the members (glue goes with the first unit that reads
            # it, `passes.assign`): the unit of its first reader, not the last member's (a pipeline boundary may
            # lie between them).
            unit = min((graph.layers[c].unit for c in src.consumers), key=order.__getitem__, default=layer.unit) \
                if src.members else layer.unit
            needs = [(*_needs(graph.layers[c], styles[c]), ok) for c, ok in src.consumers.items()]
            vocab = src.loss == "vocab" and style == "colwise"
            for coll in vocab_loss_collectives(graph) if vocab else ():
                collectives.setdefault(layer.unit, []).append(coll)
                unit_time[layer.unit] = unit_time.get(layer.unit, 0.0) + hw.collective_time(
                    cluster, coll.kind, coll.nbytes * b, tp, spans_nodes=_spans_nodes(cluster, tp))
            loss = src.loss is True or (src.loss == "vocab" and not vocab)
            for phase, kind in _conversions(STATE[style], _facts(needs, loss)).items():
                readers = _readers(phase, kind, list(src.consumers), needs)
                inner = {styles[r] == "inner" for r in readers}
                reader_style = "colwise" if inner == {False} else "split-inside" if inner == {True} else \
                    "colwise or split-inside"
                coll = Collective(kind=kind, phase=phase, nbytes=src.nbytes, src=src.layer,
                                  reason=_reason(phase, kind, layer, style, readers, reader_style, src.members),
                                  reader_units=tuple(dict.fromkeys(graph.layers[r].unit for r in readers))
                                  if (phase, kind) == ("bwd", "all_reduce") else (),
                                  runs_in=min((graph.layers[r].unit for r in readers), key=order.__getitem__)
                                  if (phase, kind) == ("fwd", "all_gather") and readers else "")
                collectives.setdefault(unit, []).append(coll)
                unit_time[unit] = unit_time.get(unit, 0.0) + hw.collective_time(
                    cluster, kind, src.nbytes * b, tp, spans_nodes=_spans_nodes(cluster, tp))
    return TPSolution(styles=dict(styles), collectives=collectives, time_s=float(sum(unit_time.values())),
                      unit_time_s=unit_time, why=explain(graph, tp, styles, given=given, solved=solved))


def _check_degree(tp: int, b: int) -> None:
    if not isinstance(tp, int) or tp < 1:
        raise PartcError(f"tp must be a positive integer, got {tp!r}")
    if not isinstance(b, int) or b < 1:
        raise PartcError(f"micro_batch_size must be a positive integer, got {b!r}")


def _check_styles(graph: ModelGraph, styles: dict[str, str], tp: int, what: str) -> None:
    """Every named layer exists and can take its style at degree `tp`; PartcError otherwise."""
    for fqn, style in styles.items():
        if fqn not in graph.layers:
            raise PartcError(f"{what} unknown layer {fqn!r}")
        err = style_error(graph.layers[fqn], style, tp)
        if err:
            raise PartcError(err)


def evaluate_tp(graph: ModelGraph, tp: int, styles: dict[str, str], cluster: Cluster,
                micro_batch_size: int) -> TPSolution:
    """Collectives and time of a complete style map (say, a hand-edited plan). PartcError for an unknown or
    missing layer, an unknown style, a style the layer's kind cannot take or a divisibility violation."""
    _check_degree(tp, micro_batch_size)
    _check_styles(graph, styles, tp, "TP styles name")
    missing = [f for f in graph.layers if f not in styles]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise PartcError(f"TP styles miss layer {missing[0]}{more}")
    return _evaluate(graph, tp, styles, cluster, micro_batch_size, solved=False)


def representatives(graph: ModelGraph) -> dict[str, str]:
    """Layer FQN -> the FQN of the same layer in the first unit with the same signature (itself if none)."""
    rep = {f: f for f in graph.layers}
    first: dict[str, object] = {}
    for unit in graph.units:
        if not unit.signature:
            continue
        head = first.setdefault(unit.signature, unit)
        if head is unit:
            continue
        assert len(head.layers) == len(unit.layers), f"units {head.fqn} and {unit.fqn} share a signature"
        for mine, theirs in zip(unit.layers, head.layers):
            assert mine[len(unit.fqn):] == theirs[len(head.fqn):], f"{mine} and {theirs} share a signature"
            rep[mine] = theirs
    return rep
