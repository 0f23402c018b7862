"""Expert parallelism: a mixture of experts divided among the ep ranks by experts, and the program rewritten for it.

Under ``ep`` a layer of packed experts is divided by experts, not inside: rank r of an ep group holds experts
[r·E/ep, (r+1)·E/ep) of every packed parameter (dim 0), and the (token, expert) pairs travel to their expert's rank
and back (`partc.collectives.expert_parallel`). The program keeps the layer's own expert computation (its grouped
products and the ops between them: Hugging Face's gate/up product, activation and down product) and replaces the
routing around it: the sort of the pairs by expert, the offsets of the grouped products, the scaling by the
routing weights and the sum of a token's k results. `expert_split` finds these parts, or says why not.

`rewrite_for_ep` replaces every layer of packed experts (`expert_split`) and every plain-PyTorch mixture
(`passes.experts_routed.routed_splits`) by one `collectives.expert_parallel` call; `token_wise_nodes` tells context
parallelism which layers compute each token from its own row alone. Splitting experts inside over tp (``inner``) is
`passes.experts`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from partc import collectives
from partc.errors import PartcError
from partc.ir import Layer
from partc.passes.experts import (_ZEROS, _ancestors, _operands, _packed_layers, _val, _weight_chain,
                                  is_product, param_placeholders)
from partc.passes.experts_routed import RoutedSplit, routed_splits

aten = torch.ops.aten

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


def expert_split(nodes: list[Node], params: dict[Node, str]) -> ExpertSplit | str:
    """The ep division of a layer whose call_function `nodes` (in graph order) run its packed experts `params`
    (placeholder -> parameter FQN), or one line saying why its routing cannot be followed (the module docstring)."""
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
    for fqn, layer, nodes in _packed_layers(ep.graph, node_layer, layers):
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
    for fqn, layer, nodes in _packed_layers(ep.graph, node_layer, layers):
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
