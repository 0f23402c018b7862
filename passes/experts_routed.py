"""Mixtures of experts as plain PyTorch writes them, read in the exported graph for expert parallelism.

A mixture of experts written by hand: an ``nn.ModuleList`` of identical expert modules, a router whose top-k (or
max) picks each token's experts, and a loop over the experts that gathers each one's tokens (``nonzero(choice ==
e)``, ``index_select`` or ``x[tok]``), runs the expert on them, scales its rows by their routing weights and adds
them back in token order (``index_add``) into zeros. `routed_splits` reads such a layer in the exported graph and
proves it computes ``out[t] = sum_j weights[t, j] · expert_{choice[t, j]}(hidden[t])``, the function
`partc.collectives.expert_parallel` computes over the ep ranks, or says in one line what it could not follow:

- the accumulator is zeros of the tokens' shape, and each expert's rows are added into it once, along dim 0, at
  the rows of the tokens that chose it;
- the tokens of expert module ``L.e`` are those where ``choice == e``, and ``choice`` is the index output of a
  top-k (or max) over the router's E outputs, so every id is an expert of the list and each is computed once;
- each expert's result is its module's computation of its own rows (no other input) times the routing weight of
  the same (token, slot) pair, and every expert computes as expert 0 does (the same ops on its own parameters);
  so expert 0's ops, run on another expert's parameters, are that expert.

`passes.experts_ep` rewrites each such mixture for ep; `routed_experts` gives the cost model and the search what
they price of one (`partc.ir.RoutedExperts`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Node

from partc.ir import Layer, RoutedExperts
from partc.passes.experts import _ZEROS, _ancestors, _val

aten = torch.ops.aten

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
    (`RoutedSplit`) or one line saying what of its routing could not be followed (the module docstring). A chain of
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
