"""Attention masks that are exactly causal, proven from the graph, become ``is_causal=True``.

Hugging Face transformers builds the causal mask of ``scaled_dot_product_attention`` explicitly under
``torch.export`` (a ``[b, 1, s, s]`` boolean tensor from the position ids, with its packed-sequence detection:
``diff`` of the positions, ``cumsum`` of the breaks, and "same document" compared per query and key), because an
exported graph cannot read the values that tell it, in eager mode, to pass no mask and ``is_causal=True``
(``masking_utils._ignore_causal_mask_sdpa``). partc's graph has the values' provenance: when the mask is made only
from ``arange`` and constants (no model input, parameter or buffer reaches it) and its value at query ``i`` and key
``j`` is ``j <= i`` for every index, the attention is causal attention without a mask. `drop_causal_masks` proves
that symbolically and rewrites the attention to ``is_causal=True``, erasing the mask's ops: the program then holds no
``s x s`` tensor, the fused kernels run, and context parallelism (`partc.passes.context`) splits it like the bundled
models' causal attention. What is not proven keeps its mask: padding (a mask from an input), packed documents (from
given position ids), a sliding window (``j <= i and i - j < w`` is not ``j <= i``), anything built by an op the
prover does not follow.

The proof evaluates the mask's ops on symbolic values (sympy): each tensor is an expression in the indices
``I0, I1, ...`` of its own dims (an index ranges over its dim; a dim of size 1 has index 0), ``arange(n)`` is
``I0``, a comparison is a relation, ``diff``/``cumsum`` are evaluated where their operand's difference or summand
is the same at every position, and advanced indexing substitutes the index tensors' expressions. Exact, for every
size of the traced graph, not a sample of values.
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx

aten = torch.ops.aten

ATTENTION = aten.scaled_dot_product_attention.default

_IDX = sympy.symbols("I0:8", integer=True, nonnegative=True)


class Unproven(Exception):
    """An op of the mask that the prover does not follow, or a value it cannot state exactly."""


class _Sym:
    """A tensor as an expression of the indices of its dims (``I0`` the first)."""

    __slots__ = ("shape", "expr", "boolean")

    def __init__(self, shape, expr, boolean: bool):
        self.shape = tuple(int(s) for s in shape)
        if len(self.shape) > len(_IDX):
            raise Unproven("too many dims")
        # a dim of one element has index 0: the expression must not tell its index apart
        self.expr = sympy.sympify(expr).subs({_IDX[d]: 0 for d, s in enumerate(self.shape) if s == 1},
                                             simultaneous=True)
        self.boolean = boolean


def _remap(x: _Sym, mapping: dict[int, object], shape, boolean=None) -> _Sym:
    """`x` read at other indices: its dim d's index becomes ``mapping[d]`` (an expression in the new indices)."""
    subs = {_IDX[d]: mapping[d] for d in range(len(x.shape))}
    return _Sym(shape, x.expr.subs(subs, simultaneous=True), x.boolean if boolean is None else boolean)


def _broadcast(xs: list[_Sym]) -> tuple[tuple[int, ...], list[_Sym]]:
    shape = torch.broadcast_shapes(*[x.shape for x in xs])
    out = []
    for x in xs:
        off = len(shape) - len(x.shape)
        out.append(_remap(x, {d: (0 if s == 1 else _IDX[d + off]) for d, s in enumerate(x.shape)}, shape))
    return tuple(shape), out


def _as_int(x: _Sym):
    return sympy.Piecewise((1, x.expr), (0, True)) if x.boolean else x.expr


def _const(shape, value) -> _Sym:
    if isinstance(value, bool):
        return _Sym(shape, sympy.true if value else sympy.false, True)
    if isinstance(value, int):
        return _Sym(shape, sympy.Integer(value), False)
    raise Unproven(f"constant {value!r}")


def _val_shape(node: torch.fx.Node):
    v = node.meta.get("val")
    if not isinstance(v, torch.Tensor):
        raise Unproven(f"{node.name} is not a tensor")
    return tuple(v.shape)


def _is_bool(node: torch.fx.Node) -> bool:
    return node.meta["val"].dtype == torch.bool


def _ints(*xs):
    for x in xs:
        if not isinstance(x, int) or isinstance(x, bool):
            raise Unproven(f"a size or step {x!r} that is not a constant")


_COMPARE = {aten.le: sympy.Le, aten.lt: sympy.Lt, aten.ge: sympy.Ge, aten.gt: sympy.Gt, aten.eq: sympy.Eq,
            aten.ne: sympy.Ne}
_ARITH = {aten.add: operator.add, aten.sub: operator.sub, aten.mul: operator.mul}
_LOGIC = {aten.__and__: sympy.And, aten.bitwise_and: sympy.And, aten.logical_and: sympy.And,
          aten.__or__: sympy.Or, aten.bitwise_or: sympy.Or, aten.logical_or: sympy.Or}
_SAME = {aten.alias.default, aten.clone.default, aten.contiguous.default, aten.lift_fresh_copy.default,
         aten.detach.default}
_CASTS = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.to.device}
IGNORED = {aten._assert_tensor_metadata.default}
"""Checks on a tensor's dtype and device that export leaves in the graph: no value, erased with the mask."""


def _evaluate(node: torch.fx.Node, env: dict[torch.fx.Node, _Sym]) -> _Sym:
    """The symbolic value of `node` from those of its inputs (already in `env`)."""
    t, a, kw = node.target, node.args, node.kwargs
    shape = _val_shape(node)
    packet = getattr(t, "_overloadpacket", None)

    def arg(x):
        if isinstance(x, torch.fx.Node):
            return env[x]
        if isinstance(x, (bool, int)):
            return _const((), x)
        raise Unproven(f"an argument {x!r}")

    if t in (aten.arange.default, aten.arange.start, aten.arange.start_step):
        start, end, step = ((0, a[0], 1) if t == aten.arange.default else
                            (a[0], a[1], 1) if t == aten.arange.start else a[:3])
        _ints(start, end, step)
        if node.meta["val"].dtype.is_floating_point:
            raise Unproven("a floating-point arange")
        return _Sym(shape, start + step * _IDX[0], False)
    if t in (aten.ones.default, aten.zeros.default, aten.new_ones.default, aten.new_zeros.default,
             aten.full.default, aten.new_full.default, aten.scalar_tensor.default):
        value = (1 if "ones" in t.__name__ else 0 if "zeros" in t.__name__ else
                 a[-1] if t in (aten.full.default, aten.new_full.default) else a[0])
        value = bool(value) if _is_bool(node) else value
        return _const(shape, value)
    if t in _SAME or t in _CASTS:
        x = env[a[0]]
        if _is_bool(node) == x.boolean:
            return _Sym(shape, x.expr, x.boolean)
        if _is_bool(node):
            return _Sym(shape, sympy.Ne(x.expr, 0), True)
        if node.meta["val"].dtype.is_floating_point:
            raise Unproven("a cast to floating point")
        return _Sym(shape, _as_int(x), False)
    if t == aten.unsqueeze.default:
        x, d = env[a[0]], a[1] % (len(a[0].meta["val"].shape) + 1)
        return _remap(x, {i: _IDX[i if i < d else i + 1] for i in range(len(x.shape))}, shape)
    if t in (aten.squeeze.dim, aten.squeeze.dims, aten.view.default, aten.reshape.default,
             aten._unsafe_view.default, aten.squeeze.default):
        x = env[a[0]]
        kept_in = [d for d, s in enumerate(x.shape) if s != 1]
        kept_out = [d for d, s in enumerate(shape) if s != 1]
        if [x.shape[d] for d in kept_in] != [shape[d] for d in kept_out]:
            raise Unproven("a view that merges or splits dims")
        to = dict(zip(kept_in, kept_out))
        return _remap(x, {d: (_IDX[to[d]] if d in to else 0) for d in range(len(x.shape))}, shape)
    if t == aten.expand.default:
        x = env[a[0]]
        off = len(shape) - len(x.shape)
        return _remap(x, {d: (0 if s == 1 else _IDX[d + off]) for d, s in enumerate(x.shape)}, shape)
    if t == aten.slice.Tensor:
        x = env[a[0]]
        d = (a[1] if len(a) > 1 else 0) % len(x.shape)
        start = a[2] if len(a) > 2 and a[2] is not None else 0
        step = a[4] if len(a) > 4 else 1
        _ints(start, step)
        start = start + x.shape[d] if start < 0 else start
        return _remap(x, {i: (start + step * _IDX[i] if i == d else _IDX[i]) for i in range(len(x.shape))},
                      shape)
    if packet in _COMPARE:
        (out_shape, (x, y)) = _broadcast([arg(a[0]), arg(a[1])])
        if x.boolean or y.boolean:
            if packet not in (aten.eq, aten.ne):
                raise Unproven("an order between booleans")
            rel = sympy.Equivalent(x.expr, y.expr)
            return _Sym(shape, rel if packet == aten.eq else sympy.Not(rel), True)
        return _Sym(shape, _COMPARE[packet](x.expr, y.expr), True)
    if packet in _ARITH:
        if len(a) > 2 or kw.get("alpha", 1) != 1:
            raise Unproven("an add or sub with alpha")
        _, (x, y) = _broadcast([arg(a[0]), arg(a[1])])
        if x.boolean or y.boolean:
            raise Unproven("arithmetic on booleans")
        return _Sym(shape, _ARITH[packet](x.expr, y.expr), False)
    if packet in _LOGIC:
        _, (x, y) = _broadcast([arg(a[0]), arg(a[1])])
        if not (x.boolean and y.boolean):
            raise Unproven("a bitwise op on integers")
        return _Sym(shape, _LOGIC[packet](x.expr, y.expr), True)
    if t in (aten.logical_not.default, aten.bitwise_not.default):
        x = env[a[0]]
        if not x.boolean:
            raise Unproven("a bitwise not on integers")
        return _Sym(shape, sympy.Not(x.expr), True)
    if t == aten.diff.default:
        return _diff(node, env, shape)
    if t == aten.cumsum.default:
        x = env[a[0]]
        d = a[1] % len(x.shape)
        summand = _as_int(x)
        if _IDX[d] in summand.free_symbols:
            raise Unproven("a cumulative sum of a summand that changes along its dim")
        return _Sym(shape, summand * (_IDX[d] + 1), False)
    if t == aten.index.Tensor:
        x, indices = env[a[0]], a[1]
        if any(i is None for i in indices) or len(indices) > len(x.shape):
            raise Unproven("indexing with a None or too many indices")
        ix = [env[i] for i in indices]
        if any(i.boolean for i in ix):
            raise Unproven("indexing by a boolean mask")
        lead, ix = _broadcast(ix)
        k = len(indices)
        mapping = {d: ix[d].expr for d in range(k)}
        mapping.update({d: _IDX[len(lead) + d - k] for d in range(k, len(x.shape))})
        for d in range(k):  # an index must stay in its dim for the read to be the value the graph reads
            _in_range(ix[d], x.shape[d])
        return _remap(x, mapping, shape)
    raise Unproven(f"the op {t}")


def _in_range(index: _Sym, size: int) -> None:
    """Raise Unproven unless `index` (affine in its indices) lies in ``[0, size)`` at every index of its shape."""
    e = sympy.expand(index.expr)
    if not e.is_polynomial(*_IDX) or sympy.Poly(e, *_IDX).total_degree() > 1:
        raise Unproven("an index that is not affine in the positions")
    lo = hi = e.subs({s: 0 for s in _IDX})
    for d, n in enumerate(index.shape):
        c = e.coeff(_IDX[d])
        lo, hi = (lo + c * (n - 1), hi) if c < 0 else (lo, hi + c * (n - 1))
    if not (lo >= 0 and hi < size):
        raise Unproven("an index outside its dim")


def _diff(node, env, shape) -> _Sym:
    """``diff(x, n=1, dim, prepend)``: out[i] = y[i+1] - y[i] of y = cat(prepend, x) along dim."""
    a, kw = node.args, node.kwargs
    x = env[a[0]]
    n = a[1] if len(a) > 1 else kw.get("n", 1)
    d = (a[2] if len(a) > 2 else kw.get("dim", -1)) % len(x.shape)
    prepend = a[3] if len(a) > 3 else kw.get("prepend")
    append = a[4] if len(a) > 4 else kw.get("append")
    if n != 1 or append is not None or x.boolean:
        raise Unproven("a diff other than of integers, once, with at most a prepend")
    i = _IDX[d]
    if prepend is None:
        return _Sym(shape, sympy.expand(x.expr.subs(i, i + 1) - x.expr), False)
    p = env[prepend]
    if p.shape[d] != 1 or len(p.shape) != len(x.shape):
        raise Unproven("a diff with a prepend of more than one position")
    first = sympy.expand(x.expr.subs(i, 0) - p.expr)
    rest = sympy.expand(x.expr - x.expr.subs(i, i - 1))
    if sympy.expand(rest.subs(i, 0) - first) == 0:  # the first position follows the same expression
        return _Sym(shape, rest, False)
    return _Sym(shape, sympy.Piecewise((first, sympy.Eq(i, 0)), (rest, True)), False)


def prove_causal(mask: torch.fx.Node, env: dict[torch.fx.Node, _Sym]) -> bool:
    """Whether `mask` (an attention mask of shape [.., L, S]) is ``key <= query`` at every index with L == S;
    `env` caches the symbolic values of the nodes evaluated so far (shared between the layers' attentions)."""
    order: list[torch.fx.Node] = []
    seen: set[torch.fx.Node] = set()

    def visit(n):  # the mask's inputs, depth first, in an order where inputs come first
        stack = [(n, False)]
        while stack:
            m, done = stack.pop()
            if done:
                order.append(m)
                continue
            if m in seen or m in env:
                continue
            seen.add(m)
            if m.op != "call_function":
                raise Unproven(f"{m.name} comes from the model's inputs, parameters or buffers")
            stack.append((m, True))
            stack.extend((x, False) for x in m.all_input_nodes)
    try:
        visit(mask)
        for n in order:
            env[n] = _evaluate(n, env)
    except (Unproven, KeyError, TypeError, ValueError, IndexError, AttributeError):
        return False
    m = env[mask]
    if not m.boolean or len(m.shape) < 2 or m.shape[-1] != m.shape[-2]:
        return False
    q, k = _IDX[len(m.shape) - 2], _IDX[len(m.shape) - 1]
    expr = sympy.simplify_logic(m.expr) if not isinstance(m.expr, sympy.core.relational.Relational) else m.expr
    if not isinstance(expr, sympy.core.relational.Relational):
        return False
    # k <= q over integers, in any of its forms: k - q <= 0, q - k >= 0, k < q + 1, ...
    diff = sympy.expand(expr.lhs - expr.rhs)
    forms = {sympy.Le: k - q, sympy.Ge: q - k, sympy.Lt: k - q - 1, sympy.Gt: q - k + 1}
    want = forms.get(type(expr))
    return want is not None and sympy.expand(diff - want) == 0


def drop_causal_masks(ep: torch.export.ExportedProgram) -> int:
    """Rewrite each ``scaled_dot_product_attention`` whose mask `prove_causal` proves to ``is_causal=True`` without
    the mask, and erase the ops only the mask used; in place. Returns how many attentions were rewritten."""
    env: dict[torch.fx.Node, _Sym] = {}
    rewritten = 0
    for node in list(ep.graph.nodes):
        if node.op != "call_function" or node.target != ATTENTION:
            continue
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
        if not isinstance(mask, torch.fx.Node) or causal:
            continue
        q, k = node.args[0].meta.get("val"), node.args[1].meta.get("val")
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)) or q.shape[-2] != k.shape[-2]:
            continue
        if not prove_causal(mask, env) or tuple(mask.meta["val"].shape[-2:]) != (q.shape[-2], k.shape[-2]):
            continue
        kwargs = {x: v for x, v in node.kwargs.items() if x not in ("attn_mask", "dropout_p", "is_causal")}
        dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        node.args = (*node.args[:3], None, dropout, True)
        node.kwargs = kwargs
        rewritten += 1
    if rewritten:
        for n in reversed(list(ep.graph.nodes)):
            if n not in env:
                continue
            for u in list(n.users):
                if u.target in IGNORED and not u.users:
                    ep.graph.erase_node(u)
            if not n.users:
                ep.graph.erase_node(n)
        ep.graph.lint()
        ep.graph_module.recompile()
    return rewritten
