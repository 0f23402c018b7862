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

The experts divided among ep ranks instead are `passes.experts_ep`'s, the mixtures written in plain PyTorch
`passes.experts_routed`'s; both read the graph with this module's helpers (`is_product`, `param_placeholders`,
`_packed_layers`, `_ancestors`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import InputKind
from torch.fx import Node

from partc.ir import Layer
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
    for fqn, layer, nodes in _packed_layers(graph, node_layer, layers):
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


def _packed_layers(graph, node_layer: dict[Node, str],
                   layers: dict[str, Layer]) -> list[tuple[str, Layer, list[Node]]]:
    """The layers of kind ``other`` that run a grouped product (packed experts), in graph order: (FQN, layer, its
    op nodes in graph order). `mark_inner`, `passes.experts_ep.rewrite_for_ep` and `token_wise_nodes` read these."""
    by_layer: dict[str, list[Node]] = {}
    for n in graph.nodes:
        if n.op == "call_function" and n in node_layer:
            by_layer.setdefault(node_layer[n], []).append(n)
    return [(fqn, layers[fqn], nodes) for fqn, nodes in by_layer.items()
            if layers.get(fqn) is not None and layers[fqn].kind == "other" and any(is_product(n) for n in nodes)]


def _ancestors(node: Node, within: set[Node]) -> set[Node]:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a in within and a not in seen:
                seen.add(a)
                todo.append(a)
    return seen
