"""Tensor parallelism inside a mixture of experts: the ``inner`` style of a layer holding packed expert weights.

Hugging Face's experts (Mixtral's ``MixtralExperts``) hold every expert's weights in 3-D parameters, ``gate_up_proj``
(E, 2I, H) and ``down_proj`` (E, H, I), and run them as grouped GEMMs over the (token, expert) rows the router picked.
Megatron-LM splits an MLP over the tp ranks along its intermediate dim I (Shoeybi et al. 2019, section 3): the first
products colwise (gate and up, two pieces of one packed parameter: each rank gets its part of I of each piece), the
last rowwise (down: its part of I is the contraction), so that every rank holds a partial sum of the output. The
ops after the last product (each row scaled by its routing weight, the k rows of a token gathered and summed) are
linear, so one all-reduce of the layer's output completes it: the traffic of a Megatron MLP (its output all-reduced
forward, its input gradient backward; and the routing weights' gradient, tokens x k values, backward).

`inner_split` proves this for one layer on the exported graph, or says why not. From the layer's inputs (whole),
it propagates three states: whole (R), split along a dim (an int: a first product's output, then only ops that
`passes.shard.shard_rule` proves per-shard, such as the chunk into gate and up, the activation and their product),
and partial sums (P: a last product's output, then only linear ops). Every parameter of the layer must be the
weight of one product, reached through transposes only; the layer's outputs must be partial sums. The TP rewrite
(`passes.tp_rewrite`) runs the same analysis and writes the program from its states.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import InputKind
from torch.fx import Node

from partc import collectives
from partc.errors import PartcError
from partc.ir import Layer, RoutedExperts
from partc.passes.measure import GROUPED_GEMM_OPS, NodeStats, grouped_gemm
from partc.passes.shard import shard_rule

aten = torch.ops.aten
R, P = "R", "P"

_WEIGHT_OPS = {aten.transpose.int, aten.t.default, aten.permute.default, aten._to_copy.default, aten.to.dtype,
               aten.clone.default, aten.contiguous.default, aten.alias.default}
"""Ops between a packed parameter and the product that multiplies by it (dims map through them)."""
_LINEAR_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.transpose.int, aten.t.default, aten.permute.default,
    aten.expand.default, aten.clone.default, aten.contiguous.default, aten.alias.default, aten._to_copy.default,
    aten.to.dtype, aten.to.dtype_layout, aten.neg.default, aten.sum.dim_IntList, aten.sum.default, aten.mean.dim,
    aten.select.int, aten.slice.Tensor, aten.narrow.default, aten.index.Tensor,
}
"""Ops linear in their first operand (the others whole: indices): a partial sum in, a partial sum out."""
_ZEROS = {aten.zeros_like.default, aten.zeros.default, aten.new_zeros.default}


@dataclass(kw_only=True, slots=True)
class InnerSplit:
    """How one layer is split inside (`inner_split`)."""

    params: dict[str, tuple[int, int]]
    """Parameter FQN -> (dim, fused pieces) of its split (`Layer.inner`)."""
    states: dict[Node, object] = field(default_factory=dict)
    """Every call_function node of the layer -> ``R``, ``P``, the dim it is split along, or a tuple of those (one per
    output of a split); the nodes between a parameter and its product hold the parameter's split dim too."""
    gemms: dict[Node, str] = field(default_factory=dict)
    """Product node -> the GEMM dim its split divides: ``n`` (first products) or ``k`` (last)."""


def _val(a):
    return a.meta.get("val") if isinstance(a, Node) else a


def is_product(node: Node) -> bool:
    """A grouped GEMM over experts (`passes.measure.grouped_gemm`): ``aten._grouped_mm``, or a custom op that
    multiplies like one (``transformers::grouped_mm_fallback``)."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return False
    if t.overloadpacket not in GROUPED_GEMM_OPS and t.namespace in ("aten", "prims"):
        return False
    args = tuple(_val(a) for a in node.args)
    kwargs = {k: _val(v) for k, v in node.kwargs.items()}
    return grouped_gemm(args, kwargs, node.meta.get("val")) is not None


def _operands(node: Node) -> tuple[Node, Node]:
    """(activation, weight): the first two tensor operands of a product, as `grouped_gemm` reads them."""
    nodes = [a for a in (*node.args, *node.kwargs.values()) if isinstance(_val(a), torch.Tensor)]
    return nodes[0], nodes[1]


def _weight_chain(b: Node, params: dict[Node, str]) -> tuple[str, list[Node]] | str:
    """(parameter FQN, the ops from it to `b`, first to last) of a product's weight operand, or why not."""
    chain = []
    node = b
    while node.op == "call_function" and node.target in _WEIGHT_OPS:
        chain.append(node)
        node = node.args[0]
    if node not in params:
        return f"the weight operand {b.name} of a product is not a parameter of the layer"
    return params[node], chain[::-1]


def _dim_back(node: Node, d: int) -> int:
    """The input dim of a weight op (`_WEIGHT_OPS`) that lands in its output dim `d`."""
    ndim = node.args[0].meta["val"].dim()
    if node.target is aten.transpose.int:
        a, b = (x % ndim for x in node.args[1:3])
        return b if d == a else a if d == b else d
    if node.target is aten.t.default:
        return 1 - d
    if node.target is aten.permute.default:
        return node.args[1][d] % ndim
    return d


def _partial_rule(node: Node, state: dict[Node, object]) -> str:
    """Why `node`, reading a partial sum, does not give a partial sum of its result (empty: it does)."""
    t = node.target
    tensors = [a for a in node.all_input_nodes if isinstance(_val(a), torch.Tensor)]
    ins = {a: state.get(a, R) for a in tensors}
    if any(s not in (R, P) for s in ins.values()):
        return "mixes a partial sum with a split tensor"
    partial = [a for a, s in ins.items() if s == P]
    if t in _LINEAR_OPS:
        return "" if partial == [node.args[0]] else "a partial sum as an index"
    if t in (aten.add.Tensor, aten.sub.Tensor):
        return "" if len(partial) == len(tensors) else "adds a whole tensor to a partial sum"
    if t is aten.mul.Tensor:
        return "" if len(partial) == 1 else "multiplies two partial sums"
    if t is aten.div.Tensor:
        return "" if partial == [node.args[0]] else "divides by a partial sum"
    if t in (aten.index_add.default, aten.index_add_.default):
        dest, src = node.args[0], node.args[3]
        if ins.get(src) != P or node.args[2] in partial:
            return "a partial sum as an index"
        zeros = isinstance(dest, Node) and dest.target in _ZEROS  # zero is a partial sum of zeros
        return "" if ins.get(dest) == P or zeros else "adds a partial sum into a whole tensor"
    if t is aten.cat.default:
        return "" if len(partial) == len(tensors) else "concatenates a partial sum with a whole tensor"
    return "op not known to be linear"


def inner_split(nodes: list[Node], params: dict[Node, str]) -> InnerSplit | str:
    """The ``inner`` split of a layer whose call_function `nodes` (in graph order) multiply by its packed weights
    `params` (placeholder -> parameter FQN), or one line saying why it cannot be split inside (see the module doc)."""
    mine = set(nodes)
    split = InnerSplit(params={})
    weight_dims: dict[Node, tuple[str, list[Node]]] = {}  # product -> (parameter, chain)
    for n in nodes:
        if is_product(n):
            chain = _weight_chain(_operands(n)[1], params)
            if isinstance(chain, str):
                return chain
            weight_dims[n] = chain
    if not weight_dims:
        return "no grouped product in the layer"
    used = [fqn for fqn, _ in weight_dims.values()]
    for ph, fqn in params.items():
        if used.count(fqn) != 1:
            return f"{fqn} is the weight of {used.count(fqn)} products, not one" if used.count(fqn) else \
                f"{fqn} is not the weight of a grouped product"
        chain = next(c for f, c in weight_dims.values() if f == fqn)
        for x, nxt in zip([ph, *chain], [*chain, None]):
            if nxt is not None and len(x.users) != 1:
                return f"{fqn} is read by {', '.join(u.name for u in x.users if u is not nxt)} besides its product"
    chained = {c for _, chain in weight_dims.values() for c in chain}

    state = split.states
    whole: dict[Node, frozenset] = {}  # split node -> the first products whose whole (unchunked) output it holds
    pieces: dict[Node, set[int]] = {}  # first product -> the piece counts its output is cut into
    lasts: list[tuple[Node, frozenset]] = []
    for n in nodes:
        if n in chained:
            continue
        val = n.meta.get("val")
        if n in weight_dims:
            a, b = _operands(n)
            fqn, chain = weight_dims[n]
            sa = state.get(a, R)
            others = [x for x in n.all_input_nodes if x is not a and x is not b and state.get(x, R) != R]
            if others:
                return f"{n.target}: a split or partial operand besides the activation"
            if sa == R:  # a first product: the weight's output features split
                d, gemm = b.meta["val"].dim() - 1, "n"
                state[n], whole[n] = val.dim() - 1, frozenset([n])
            elif sa == a.meta["val"].dim() - 1:  # a last product: the contraction split, partial sums out
                d, gemm = b.meta["val"].dim() - 2, "k"
                state[n] = P
                lasts.append((n, whole.get(a, frozenset())))
            else:
                return f"{n.target}: multiplies a tensor split along another dim than its features"
            split.gemms[n] = gemm
            for c in reversed(chain):
                state[c] = d
                d = _dim_back(c, d)
            split.params[fqn] = (d, 1)
            continue
        tensors = [a for a in n.all_input_nodes if a in state and state[a] != R]
        if not tensors:
            state[n] = R
            continue
        if not isinstance(val, (torch.Tensor, list, tuple)):
            state[n] = R  # an assertion (`_assert_tensor_metadata`): the program skips it
            continue
        if any(state[a] == P for a in tensors):
            why = _partial_rule(n, state)
            if why:
                return f"{n.target}: {why}"
            state[n] = P
            continue
        out_dim, groups, fused, why = shard_rule(n, state, tensors)
        if why or out_dim is None:
            return f"{n.target}: {why or 'no split output'}"
        if groups:
            return f"{n.target}: a view splits the intermediate dim into groups"
        glob = val if isinstance(val, torch.Tensor) else None
        for a in n.all_input_nodes:  # a whole operand of an elementwise op must broadcast along the split
            va = _val(a)
            if a in tensors or not isinstance(va, torch.Tensor) or glob is None or not isinstance(out_dim, int):
                continue
            aligned = out_dim - (glob.dim() - va.dim())
            if aligned >= 0 and va.shape[aligned] != 1:
                return f"{n.target}: a whole operand {a.name} along the split dim"
        held = frozenset().union(*(whole.get(a, frozenset()) for a in tensors))
        if fused > 1:
            if not held:
                return f"{n.target}: cuts a piece into pieces"
            for g in held:
                pieces.setdefault(g, set()).add(fused)
            held = frozenset()
        whole[n] = held
        state[n] = out_dim
    for n in nodes:
        for u in n.users:
            if u not in mine and state.get(n, R) != R and state[n] != P:
                return f"the split output of {n.name} reaches {u.name} outside the layer"
            if u not in mine and state.get(n, R) == R and isinstance(_val(n), torch.Tensor) and \
                    _val(n).is_floating_point():
                return f"{n.name} leaves the layer whole: its gradient would be summed over the tp ranks"
    if not lasts or len(lasts) == len(weight_dims):
        return "no first and last product (an MLP's up and down projections)"
    for g, counts in pieces.items():
        if len(counts) > 1:
            return f"the output of {g.name} is cut into {' and '.join(map(str, sorted(counts)))} pieces"
        fqn = weight_dims[g][0]
        split.params[fqn] = (split.params[fqn][0], counts.pop())
    for n, held in lasts:
        if any(split.params[weight_dims[g][0]][1] > 1 for g in held):
            return f"{n.target}: multiplies the pieces of a packed product still together"
    return split


def mark_inner(graph: torch.fx.Graph, node_layer: dict[Node, str], param_of: dict[Node, str],
               layers: dict[str, Layer], stats: dict[Node, NodeStats]) -> None:
    """Set `Layer.inner` (or, where it cannot be split inside, `Layer.split_stop`) of every layer of kind ``other``
    that runs a grouped product, and the `Gemm.inner_split` of its products. `param_of`: parameter placeholder ->
    FQN."""
    for fqn, nodes in _nodes_by_layer(graph, node_layer).items():
        layer = layers.get(fqn)
        if layer is None or layer.kind != "other" or not any(is_product(n) for n in nodes):
            continue
        params = {ph: p for ph, p in param_of.items() if p in layer.params}
        split = inner_split(nodes, params)
        if isinstance(split, str):
            layer.split_stop = split
            continue
        layer.inner = split.params
        for n, dim in split.gemms.items():
            for g in stats[n].gemms if n in stats else ():
                g.inner_split = dim


def param_placeholders(ep: torch.export.ExportedProgram) -> dict[Node, str]:
    """Parameter placeholder -> its FQN, of an exported program."""
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    return {placeholders[s.arg.name]: s.target for s in ep.graph_signature.input_specs
            if s.kind == InputKind.PARAMETER}


# -- expert parallelism ------------------------------------------------------------------------------------------
#
# Under ``ep`` a layer of packed experts is divided by experts, not inside: rank r of an ep group holds experts
# [r·E/ep, (r+1)·E/ep) of every packed parameter (dim 0), and the (token, expert) pairs travel to their expert's rank
# and back (`partc.collectives.expert_parallel`). The program keeps the layer's own expert computation (its grouped
# products and the ops between them: Hugging Face's gate/up product, activation and down product) and replaces the
# routing around it: the sort of the pairs by expert, the offsets of the grouped products, the scaling by the
# routing weights and the sum of a token's k results. `expert_split` finds these parts, or says why not.

_CASTS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout}
_AFTER_EXPERTS = {
    aten.mul.Tensor, aten.unsqueeze.default, aten.index.Tensor, aten.view.default, aten.reshape.default,
    aten._unsafe_view.default, aten.sum.dim_IntList, aten.index_add.default, aten.index_add_.default,
    *_CASTS, *_ZEROS,
}
"""Ops allowed between the last product and the layer's output: each pair's result scaled by its routing weight,
put back in token order and summed over the token's k pairs (and casts)."""


@dataclass(kw_only=True, slots=True)
class ExpertSplit:
    """How one layer of packed experts is divided among ep ranks (`expert_split`)."""

    hidden: Node
    """The tokens (T, H): the layer's input the experts read."""
    index: Node
    """The experts each token chose (T, k), global ids."""
    weights: Node
    """Their routing weights (T, k)."""
    rows: Node
    """The tokens' rows in expert order (``hidden[...]``), the first products' activation: replaced by the rows
    the ep group sends this rank."""
    offsets: Node
    """The grouped products' offsets (cumulative rows per expert): replaced by this rank's experts' offsets."""
    local: list[Node]
    """The experts' computation from `rows` to `last`, in graph order: what each rank runs on its experts."""
    last: Node
    """The last product: one row per (token, expert) pair, before the routing weight."""
    output: Node
    """The layer's output (T, H), the node read outside the layer."""
    num_experts: int
    params: list[str]
    """The packed parameters (FQNs), each with the `num_experts` experts along dim 0."""


def _casts_back(node: Node) -> Node:
    while node.op == "call_function" and node.target in _CASTS:
        node = node.args[0]
    return node


def _ancestors(node: Node, within: set[Node]) -> set[Node]:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a in within and a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


def expert_split(nodes: list[Node], params: dict[Node, str]) -> ExpertSplit | str:
    """The ep division of a layer whose call_function `nodes` (in graph order) run its packed experts `params`
    (placeholder -> parameter FQN), or one line saying why its routing cannot be followed (see above)."""
    mine = set(nodes)
    products = [n for n in nodes if is_product(n)]
    if not products:
        return "no grouped product over experts in the layer"
    experts, offsets, first_rows = set(), set(), set()
    for n in products:
        a, b = _operands(n)
        chain = _weight_chain(b, params)
        if isinstance(chain, str):
            return chain
        ph = next(p for p, f in params.items() if f == chain[0])
        experts.add(ph.meta["val"].shape[0])
        offsets |= {x for x in n.all_input_nodes if x is not a and x is not b}
        src = _casts_back(a)
        if src.target is aten.index.Tensor and src.args[0] not in mine:
            first_rows.add(src)
    if len(experts) != 1 or len(offsets) != 1 or len(first_rows) != 1:
        return (f"the grouped products do not share one expert count, one offsets tensor and one gather of the "
                f"tokens ({len(experts)}, {len(offsets)}, {len(first_rows)})")
    (num_experts,), (offs,), (rows,) = experts, offsets, first_rows
    last = products[-1]
    before_last = _ancestors(last, mine | set(params))
    if any(p not in before_last for p in products[:-1]):
        return "the grouped products are not one chain (an MLP's up and down projections)"
    routing = _ancestors(rows, mine) | _ancestors(offs, mine) | {rows, offs}
    local = [n for n in nodes if (n in before_last or n is last) and n not in routing
             and n.target is not aten._assert_tensor_metadata.default]
    allowed = set(local) | {rows, offs} | set(params)
    for n in local:
        stray = [a for a in n.all_input_nodes if a not in allowed]
        if stray:
            return f"the experts' computation reads {stray[0].name} besides the routed tokens and their weights"
    outside = [a for n in nodes for a in n.all_input_nodes if a not in mine and a not in params]
    inputs = list(dict.fromkeys(a for a in outside if isinstance(_val(a), torch.Tensor)))
    hidden = rows.args[0]
    others = [a for a in inputs if a is not hidden]
    ints = [a for a in others if not _val(a).is_floating_point()]
    floats = [a for a in others if _val(a).is_floating_point()]
    h = _val(hidden)
    if (hidden not in inputs or len(ints) != 1 or len(floats) != 1 or h.dim() != 2
            or _val(ints[0]).dim() != 2 or _val(ints[0]).shape != _val(floats[0]).shape
            or _val(ints[0]).shape[0] != h.shape[0]):
        return ("the layer's inputs are not tokens (T, H), the experts they chose (T, k) and their weights (T, k): "
                f"{', '.join(a.name for a in inputs)}")
    leaving = [n for n in nodes if any(u not in mine for u in n.users)]
    if len(leaving) != 1 or _val(leaving[0]).shape != h.shape or _val(leaving[0]).dtype != h.dtype:
        return (f"the layer's output is not one tensor of its tokens' shape and dtype (what `expert_parallel` "
                f"returns): {', '.join(n.name for n in leaving)}")
    after = [n for n in nodes if last in _ancestors(n, mine)]
    if leaving[0] not in after:
        return "the layer's output does not come from its experts"
    odd = [n for n in after if n.target not in _AFTER_EXPERTS and n.target is not aten._assert_tensor_metadata.default]
    if odd:
        return f"{odd[0].target} after the experts: not a weighted sum of each token's k results"
    weighted = any(n.target is aten.mul.Tensor and floats[0] in _ancestors(n, mine | {floats[0]}) for n in after)
    if not weighted:
        return "the experts' results are not scaled by the routing weights"
    return ExpertSplit(hidden=hidden, index=ints[0], weights=floats[0], rows=rows, offsets=offs, local=local,
                       last=last, output=leaving[0], num_experts=num_experts,
                       params=list(dict.fromkeys(params[p] for p in params)))



def local_experts(split: ExpertSplit, params: dict[Node, str]) -> torch.fx.GraphModule:
    """The experts' computation of `split` as a module ``(rows, offsets, *packed parameters in split.params order)
    -> the last product's rows``: what each ep rank runs on the rows sent to it, with its own experts."""
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {split.rows: graph.placeholder("rows"), split.offsets: graph.placeholder("offsets")}
    by_fqn = {fqn: graph.placeholder(f"p{i}") for i, fqn in enumerate(split.params)}
    env |= {ph: by_fqn[fqn] for ph, fqn in params.items()}
    for n in split.local:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[split.last])
    return torch.fx.GraphModule(torch.nn.Module(), graph)


EP_LOCAL = "partc_ep_local"
"""Node meta key: on the `collectives.expert_parallel` node that replaces a layer of packed experts under ep, the
experts' own computation (`local_experts`), which the stage file defines as a function beside the call."""


def rewrite_for_ep(ep: torch.export.ExportedProgram, node_layer: dict[Node, str], layers: dict[str, Layer],
                   degree: int) -> tuple[dict[str, list[str]], dict[str, int]]:
    """Replace every layer of packed experts of the exported graph (in place) by one `collectives.expert_parallel`
    call over its tokens, choices and routing weights, reading its packed parameters (`EP_LOCAL`: the experts'
    computation it runs on this rank's experts), and every plain-PyTorch mixture of experts (`routed_splits`) by
    one such call reading every expert's parameters. Returns (layer FQN -> its packed parameters, expert module
    FQN -> the ep rank holding it); PartcError (one line) where a layer's routing cannot be followed, its experts do
    not divide by `degree`, or there is none."""
    params = param_placeholders(ep)
    done, routed = {}, {}
    for fqn, nodes in _nodes_by_layer(ep.graph, node_layer).items():
        layer = layers.get(fqn)
        if layer is None or layer.kind != "other" or not any(is_product(n) for n in nodes):
            continue
        mine = {ph: p for ph, p in params.items() if p in layer.params}
        split = expert_split(nodes, mine)
        if isinstance(split, str):
            raise PartcError(f"--ep {degree}: the experts of {fqn} cannot be divided: {split}")
        if split.num_experts % degree:
            raise PartcError(f"--ep {degree}: {fqn} has {split.num_experts} experts, which do not divide among "
                             f"{degree} ranks")
        placeholders = [next(ph for ph, f in mine.items() if f == name) for name in split.params]
        graph = ep.graph
        with graph.inserting_before(split.output):
            call = graph.call_function(collectives.expert_parallel,
                                       (split.hidden, split.index, split.weights, *placeholders),
                                       {"num_experts": split.num_experts})
        call.meta = {**split.output.meta, EP_LOCAL: local_experts(split, mine)}
        split.output.replace_all_uses_with(call)
        for n in reversed(nodes):
            if not n.users:
                graph.erase_node(n)
        done[fqn] = split.params
    for split in routed_splits(ep.graph, params):
        if isinstance(split, str):
            raise PartcError(f"--ep {degree}: a mixture of experts cannot be divided: {split}")
        if split.num_experts % degree:
            raise PartcError(f"--ep {degree}: {split.fqn} has {split.num_experts} experts, which do not divide among "
                             f"{degree} ranks")
        _rewrite_routed(ep.graph, split, params)
        local = split.num_experts // degree
        routed |= {m: e // local for e, m in enumerate(split.experts)}
    if not done and not routed:
        raise PartcError(f"--ep {degree}: the model has no layer of packed experts, nor an nn.ModuleList of experts "
                         f"routed by nonzero(choice == e) and summed with index_add, to divide among ep ranks")
    return done, routed


def token_wise_nodes(ep: torch.export.ExportedProgram, node_layer: dict[Node, str],
                     layers: dict[str, Layer]) -> set[str]:
    """The names of the nodes of every layer of experts whose routing is followed: each layer of packed experts
    `expert_split` divides, each plain mixture `routed_splits` divides. Such a layer sorts, gathers and counts its
    tokens by expert, yet computes ``out[t] = sum_j weights[t, j] · expert_{choice[t, j]}(hidden[t])``: token t's
    output reads token t's row, choices and weights alone (what `expert_split` and `routed_splits` prove, and
    `collectives.expert_parallel` relies on). Context parallelism (`partc.passes.context.analyze`) takes such a
    layer as per position, with or without ep."""
    params = param_placeholders(ep)
    out: set[str] = set()
    for fqn, nodes in _nodes_by_layer(ep.graph, node_layer).items():
        layer = layers.get(fqn)
        if layer is None or layer.kind != "other" or not any(is_product(n) for n in nodes):
            continue
        if isinstance(expert_split(nodes, {ph: p for ph, p in params.items() if p in layer.params}), ExpertSplit):
            out |= {n.name for n in nodes}
    for split in routed_splits(ep.graph, params):
        if not isinstance(split, str):
            out |= {n.name for n in split.nodes}
    return out


EP_ROUTED = "partc_ep_routed"
"""Node meta key: on the `collectives.expert_parallel` node that replaces a plain-PyTorch mixture of experts under
ep, (the expert modules in expert order, each expert's parameter FQNs in the order of `EP_LOCAL`'s parameters)."""


def _rewrite_routed(graph: torch.fx.Graph, split: RoutedSplit, params: dict[Node, str]) -> None:
    """Replace a plain mixture of experts by one `collectives.expert_parallel` call over its tokens, choices (T, k)
    and routing weights (T, k), reading every expert's parameters; `EP_LOCAL` is one expert's computation, which
    the program runs on each of this rank's experts (`collectives.each_expert`)."""
    by_fqn = {f: ph for ph, f in params.items()}
    out = split.output
    with graph.inserting_before(out):
        choice, weights = split.choice, split.weights
        if split.k == 1 and _val(choice).dim() == 1:  # top-1 (max): one slot a token
            choice = graph.call_function(aten.unsqueeze.default, (choice, -1))
            choice.meta = {**out.meta, "val": _val(split.choice).unsqueeze(-1)}
            weights = graph.call_function(aten.unsqueeze.default, (weights, -1))
            weights.meta = {**out.meta, "val": _val(split.weights).unsqueeze(-1)}
        call = graph.call_function(collectives.expert_parallel,
                                   (split.hidden, choice, weights, *(by_fqn[n] for names in split.params
                                                                     for n in names)),
                                   {"num_experts": split.num_experts})
    call.meta = {**out.meta, EP_LOCAL: split.local, EP_ROUTED: (split.experts, split.params)}
    out.replace_all_uses_with(call)
    for n in reversed(split.nodes):
        if not n.users:
            graph.erase_node(n)


def _nodes_by_layer(graph, node_layer: dict[Node, str]) -> dict[str, list[Node]]:
    """The graph's op nodes grouped by the layer each belongs to, in graph order."""
    by_layer: dict[str, list[Node]] = {}
    for n in graph.nodes:
        if n.op == "call_function" and n in node_layer:
            by_layer.setdefault(node_layer[n], []).append(n)
    return by_layer


# -- experts as plain PyTorch writes them ----------------------------------------------------------------------------
#
# A mixture of experts written by hand: an ``nn.ModuleList`` of identical expert modules, a router whose top-k (or
# max) picks each token's experts, and a loop over the experts that gathers each one's tokens (``nonzero(choice ==
# e)``, ``index_select`` or ``x[tok]``), runs the expert on them, scales its rows by their routing weights and adds
# them back in token order (``index_add``) into zeros. `routed_splits` reads such a layer in the exported graph and
# proves it computes ``out[t] = sum_j weights[t, j] · expert_{choice[t, j]}(hidden[t])``, the function
# `partc.collectives.expert_parallel` computes over the ep ranks, or says in one line what it could not follow:
#
# - the accumulator is zeros of the tokens' shape, and each expert's rows are added into it once, along dim 0, at
#   the rows of the tokens that chose it;
# - the tokens of expert module ``L.e`` are those where ``choice == e``, and ``choice`` is the index output of a
#   top-k (or max) over the router's E outputs, so every id is an expert of the list and each is computed once;
# - each expert's result is its module's computation of its own rows (no other input) times the routing weight of
#   the same (token, slot) pair, and every expert computes as expert 0 does (the same ops on its own parameters);
#   so expert 0's ops, run on another expert's parameters, are that expert.

_INDEX_ADDS = {aten.index_add.default, aten.index_add_.default}
_SIZE_ONE = {aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default}
"""Ops that only add or remove dims of size one here (checked by the element count)."""


@dataclass(kw_only=True, slots=True)
class RoutedSplit:
    """A plain-PyTorch mixture of experts that ep can divide (`routed_splits`)."""

    fqn: str
    """The ``nn.ModuleList`` holding the experts."""
    hidden: Node
    """The tokens (T, H) the experts' rows are gathered from."""
    choice: Node
    """The experts each token chose: (T,) under top-1 (max), (T, k) under top-k."""
    weights: Node
    """Their routing weights, the shape of `choice`."""
    output: Node
    """The last ``index_add``: the sum of every expert's weighted rows (T, H)."""
    experts: list[str]
    """The expert modules, in expert order (module ``fqn.e`` for the tokens that chose e)."""
    params: list[list[str]]
    """Each expert's parameters (FQNs) in the order its computation reads them, expert 0's order."""
    local: torch.fx.GraphModule
    """Expert 0's computation, ``(rows, *its parameters) -> its rows' results``: every expert's, on its own
    parameters."""
    nodes: list[Node]
    """The layer's nodes from the accumulator to `output` (the routing, the experts, the combine)."""

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    @property
    def k(self) -> int:
        shape = _val(self.choice).shape
        return 1 if len(shape) == 1 else int(shape[1])


def _strip(node: Node, ops: set) -> Node:
    while isinstance(node, Node) and node.op == "call_function" and node.target in ops:
        node = node.args[0]
    return node


def _expert_module(names: list[str]) -> tuple[str, int] | None:
    """(the list's FQN, the element's index) of the ``nn.ModuleList`` element holding all of `names`."""
    parts = [n.split(".") for n in names]
    common = []
    for seg in zip(*parts):
        if len(set(seg)) != 1:
            break
        common.append(seg[0])
    digits = [i for i, s in enumerate(common) if s.isdigit() and i < min(len(p) for p in parts) - 1]
    if not digits:
        return None
    i = digits[-1]
    return ".".join(common[:i]), int(common[i])


def _one_expert(y: Node, rows: Node, params: dict[Node, str]) -> list[Node] | str:
    """The nodes computing `y` from `rows` and parameters only (graph order), or what else they read."""
    reach, todo = set(), [rows]  # what the rows flow into
    while todo:
        for u in todo.pop().users:
            if u not in reach:
                reach.add(u)
                todo.append(u)
    found, todo = set(), [y]
    while todo:
        n = todo.pop()
        if n is rows or n in params or n in found:
            continue
        if n.op != "call_function" or (n not in reach and n.all_input_nodes):
            return f"reads {n.name} besides its routed rows and its parameters"
        found.add(n)
        todo.extend(n.all_input_nodes)
    for n in found:
        stray = [u for u in n.users if u not in found and n is not y]
        if stray:
            return f"{n.name} is read by {stray[0].name} besides the expert's own computation"
    return [n for n in y.graph.nodes if n in found]


def _tokens(tok: Node, choice_shape) -> tuple[Node, Node | None, object] | str:
    """(the nonzero, the slot index or None, the expert id) behind `tok`, the tokens of one expert."""
    if tok.target is aten.squeeze.dim and tok.args[0].target is aten.nonzero.default:
        nz, slot = tok.args[0], None
    elif tok.target is aten.select.int and tok.args[1:] == (1, 0) and tok.args[0].target is aten.nonzero.default:
        nz = tok.args[0]
        slot = next((u for u in nz.users if u.target is aten.select.int and u.args[1:] == (1, 1)), None)
    else:
        return f"the tokens {tok.name} are not picked by nonzero(choice == e)"
    eq = nz.args[0]
    if eq.target is not aten.eq.Scalar or not isinstance(eq.args[1], int):
        return f"the tokens {tok.name} are not picked by nonzero(choice == e)"
    return nz, slot, eq


def routed_splits(graph: torch.fx.Graph, params: dict[Node, str]) -> list[RoutedSplit | str]:
    """Every plain-PyTorch mixture of experts of `graph` (`params`: parameter placeholder -> FQN), each divided
    (`RoutedSplit`) or one line saying what of its routing could not be followed (see above). A chain of
    ``index_add`` into zeros at rows no ``nonzero`` picked, or whose added rows read no parameter, is not a mixture
    of experts: left out."""
    out = []
    for start in graph.nodes:
        if start.op != "call_function" or start.target not in _ZEROS:
            continue
        first = [u for u in start.users if u.target in _INDEX_ADDS and u.args[0] is start]
        if not first:
            continue
        chain = [first[0]]
        while True:
            nxt = [u for u in chain[-1].users if u.target in _INDEX_ADDS and u.args[0] is chain[-1]]
            if not nxt:
                break
            chain.append(nxt[0])
        nodes = set(graph.nodes)
        before = _ancestors(chain[-1], nodes)
        routed = any(a.target is aten.nonzero.default for add in chain for a in _ancestors(add.args[2], nodes)
                     if isinstance(add.args[2], Node))
        if not routed or not any(p in before for p in params):
            continue
        try:
            out.append(_routed_split(start, chain, params))
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:  # a shape not expected anywhere
            out.append(f"{chain[-1].name}: the routing is not followed ({type(e).__name__})")
    return out


def _routed_split(start: Node, chain: list[Node], params: dict[Node, str]) -> RoutedSplit | str:
    where = f"{chain[-1].name}"
    for acc in (start, *chain[:-1]):
        if len(acc.users) != 1:
            return f"{where}: the sum {acc.name} is read besides the next index_add"
    hidden = choice = weights = None
    experts: dict[int, tuple[str, list[str], list[Node], Node]] = {}
    for add in chain:
        if len(add.args) < 4 or add.args[1] != 0 or add.kwargs.get("alpha", 1) != 1 or len(add.args) > 4:
            return f"{add.name}: not an index_add along the tokens (dim 0)"
        tok, src = add.args[2], add.args[3]
        if src.target is not aten.mul.Tensor or len(src.users) != 1:
            return f"{add.name}: the rows added are not an expert's results times their routing weights"
        parsed = _tokens(tok, None)
        if isinstance(parsed, str):
            return parsed
        nz, slot, eq = parsed
        c = _val(eq.args[0])
        if choice is None:
            choice = eq.args[0]
        if eq.args[0] is not choice:
            return f"{eq.name}: the experts are picked from two tensors, {choice.name} and {eq.args[0].name}"
        if (slot is None) != (c.dim() == 1) or c.dim() > 2:
            return f"{tok.name}: the tokens and their slots of the choice {choice.name} are not followed"
        # the routing weight of each (token, slot) pair, and the rows of the expert
        y = w = None
        for a, b in ((src.args[0], src.args[1]), (src.args[1], src.args[0])):
            base = _strip(b, _SIZE_ONE)
            if isinstance(base, Node) and base.target in (aten.index_select.default, aten.index.Tensor):
                y, w = a, (b, base)
                break
        if y is None:
            return f"{src.name}: the expert's results are not scaled by the routing weights of its tokens"
        b, base = w
        if _val(b).dim() != 2 or _val(b).shape[-1] != 1:
            return f"{b.name}: the routing weights do not scale each row by one number"
        if base.target is aten.index_select.default:
            ok, wt = base.args[1] == 0 and base.args[2] is tok and slot is None, base.args[0]
        else:
            idx = list(base.args[1])
            ok, wt = idx == ([tok] if slot is None else [tok, slot]), _strip(base.args[0], {aten.unsqueeze.default})
        if not ok or _val(wt).shape != c.shape or not _val(wt).is_floating_point():
            return f"{base.name}: the weights scaling expert rows are not those of their (token, slot) pairs"
        if weights is None:
            weights = wt
        if wt is not weights:
            return f"{base.name}: the routing weights come from two tensors, {weights.name} and {wt.name}"
        rows = [n for n in _ancestors(y, set(y.graph.nodes)) | {y}
                if n.target in (aten.index_select.default, aten.index.Tensor)
                and (n.args[1] == 0 and n.args[2] is tok if n.target is aten.index_select.default
                     else list(n.args[1]) == [tok])]
        if len(rows) != 1:
            return f"{y.name}: the expert does not read one gather of its tokens' rows"
        rows = rows[0]
        if hidden is None:
            hidden = rows.args[0]
        if rows.args[0] is not hidden:
            return f"{rows.name}: the experts read the rows of two tensors, {hidden.name} and {rows.args[0].name}"
        nodes = _one_expert(y, rows, params)
        if isinstance(nodes, str):
            return f"the computation of an expert ({y.name}) {nodes}"
        used = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a in params))
        module = _expert_module([params[p] for p in used]) if used else None
        if module is None:
            return f"{y.name}: the expert's parameters are not those of one element of an nn.ModuleList"
        if eq.args[1] in experts:
            return f"{eq.name}: expert {eq.args[1]} is computed twice"
        experts[eq.args[1]] = (module, [params[p] for p in used], nodes, rows)
    h = _val(hidden)
    c = _val(choice)
    if h.dim() != 2 or c.shape[0] != h.shape[0] or _val(start).shape != h.shape:
        return f"{where}: the tokens {hidden.name} are not (T, H) rows summed into zeros of their shape"
    lists = {m[0] for m, *_ in experts.values()}
    if len(lists) != 1:
        return f"{where}: the experts are not elements of one nn.ModuleList: {', '.join(sorted(lists))}"
    (fqn,) = lists
    num = len(experts)
    if sorted(experts) != list(range(num)) or any(m[1] != e for e, (m, *_) in experts.items()):
        return f"{where}: the tokens with choice == e do not go to {fqn}.e for every expert e"
    held = {n[len(fqn) + 1:].split(".")[0] for n in params.values() if n.startswith(fqn + ".")}
    held = {int(i) if i.isdigit() else i for i in held}
    if held != set(range(num)):
        return f"{fqn} holds {len(held)} experts, {num} of which are routed to"
    router = choice.args[0] if choice.target is operator.getitem and choice.args[1] == 1 else None
    if (router is None or router.target not in (aten.max.dim, aten.topk.default)
            or _val(router.args[0]).shape[-1] != num
            or (router.args[2] if len(router.args) > 2 else -1) % _val(router.args[0]).dim()
            != _val(router.args[0]).dim() - 1):
        return f"the expert ids {choice.name} are not the top-k of {num} router outputs (ids outside the experts)"
    # every expert computes as expert 0: the same ops on its own parameters
    m0, names0, nodes0, rows0 = experts[0]
    rel0 = [n[len(f"{fqn}.0."):] for n in names0]
    for e in range(1, num):
        _, names, nodes, rows = experts[e]
        if [n[len(f"{fqn}.{e}."):] for n in names] != rel0 or len(nodes) != len(nodes0):
            return f"{fqn}.{e} does not compute as {fqn}.0"
        env = {rows0: rows, **{p0: p for p0, p in zip(
            [next(ph for ph, f in params.items() if f == n) for n in names0],
            [next(ph for ph, f in params.items() if f == n) for n in names])}}
        for a, b in zip(nodes0, nodes):
            mapped = torch.fx.map_arg((a.args, a.kwargs), lambda x: env.get(x, x))
            if a.target != b.target or repr(mapped) != repr((b.args, b.kwargs)):
                return f"{fqn}.{e} does not compute as {fqn}.0 ({b.name} against {a.name})"
            env[a] = b
    g = torch.fx.Graph()
    env = {rows0: g.placeholder("rows")}
    for i, n in enumerate(names0):
        env[next(ph for ph, f in params.items() if f == n)] = g.placeholder(f"p{i}")
    for n in nodes0:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[nodes0[-1]])
    if _val(chain[-1]).dtype != _val(hidden).dtype:  # `expert_parallel` returns the tokens' dtype
        return f"{where}: the sum is {_val(chain[-1]).dtype}, the tokens {_val(hidden).dtype}"
    region = _ancestors(chain[-1], set(chain[-1].graph.nodes)) | {chain[-1]}
    keep = _ancestors(hidden, region) | _ancestors(choice, region) | _ancestors(weights, region) \
        | {hidden, choice, weights}
    return RoutedSplit(fqn=fqn, hidden=hidden, choice=choice, weights=weights, output=chain[-1],
                       experts=[f"{fqn}.{e}" for e in range(num)], params=[experts[e][1] for e in range(num)],
                       local=torch.fx.GraphModule(torch.nn.Module(), g),
                       nodes=[n for n in chain[-1].graph.nodes if n in region and n not in keep
                              and n.op == "call_function"])


def routed_experts(graph: torch.fx.Graph, params: dict[Node, str], layers: dict[str, Layer]) -> list[RoutedExperts]:
    """The plain-PyTorch mixtures of experts of `graph` that ep can divide (`routed_splits`), for the cost model
    and the search; one whose routing cannot be followed is left out (``--ep`` then says why, `rewrite_for_ep`)."""
    out = []
    for split in routed_splits(graph, params):
        if isinstance(split, str):
            continue
        first = next(layer for fqn, layer in layers.items() if fqn.startswith(split.experts[0] + "."))
        out.append(RoutedExperts(fqn=split.fqn, experts=split.experts,
                                 params=[n for names in split.params for n in names], unit=first.unit,
                                 rows=int(_val(split.choice).numel()), hidden=int(_val(split.hidden).shape[-1])))
    return out
