"""The traced graph at another micro-batch size, without a second torch.export.

The trace exports the model once, at one sample. Codegen needs the graph at the plan's micro-batch size b (an
exported graph carries concrete shapes) and a graph of its own (the TP rewrite edits it in place). `rebatch` copies
the traced graph and replays it on meta inputs of b samples, node by node, rewriting the sizes an op takes:

    view(x, [1, s, 96, 128])   x: [1, s, h] -> [b, s, h]   ->   view(x, [b, s, 96, 128])
    view(x, [s, h])            x: [1, s, h] -> [b, s, h]   ->   view(x, [b*s, h])    (the batch merges, outermost)

Each tensor's batch dims are those whose size changed (by the factor b); a view puts the batch where the element
order puts it, which is unique unless size-1 dims make it ambiguous. Everything else has to be provably independent
of the batch: an op whose other size arguments (``SymInt`` in its schema) hold a 1 (what a batch of one sample is
indistinguishable from), that slices, selects or splits a batch dim, or whose output's dims change other than by b,
makes `rebatch` return None, and the caller exports again. Last, the replayed outputs must have the shapes the
model's own forward gives at b samples on meta (an eager run, no tracing).
"""

from __future__ import annotations

import copy
import functools
import math
import operator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.export.graph_signature import InputKind, OutputKind

from partc._torch import LazyGraphModule, reorder_kwargs
from partc.passes.same_shapes import SameShapes, fresh, plain

aten = torch.ops.aten

VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
"""Ops whose size argument is the output's shape (a -1 is kept)."""

ON_DIM = {aten.slice.Tensor: 1, aten.select.int: 1, aten.narrow.default: 1, aten.split.Tensor: 2,
          aten.split_with_sizes.default: 2}
"""Ops taking sizes along one dim, and the position of that dim argument: fine unless it is a batch dim."""

BATCH_FREE = {aten.embedding.default}
"""Ops whose ``SymInt`` arguments are never sizes of an input (embedding's padding_idx)."""

ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
"""Factory ops whose length is a Scalar: a length of 1 might be the batch."""


class _Unproven(Exception):
    """The graph at b samples cannot be derived from the graph at one: export again."""

    def __init__(self, why: str = ""):
        super().__init__(why)


def rebatch(ep: torch.export.ExportedProgram, model: nn.Module, args: tuple, kwargs: dict
            ) -> torch.export.ExportedProgram | None:
    """A copy of `ep` (exported at one sample) for the meta inputs `args`, `kwargs` of b samples, or None when
    the sizes cannot be proven (then export at b). `ep` is left as it was."""
    try:
        with torch.no_grad(), SameShapes():
            return _rebatch(ep, model, args, kwargs)
    except _Unproven:
        return None


def _rebatch(ep: torch.export.ExportedProgram, model: nn.Module, args: tuple, kwargs: dict
             ) -> torch.export.ExportedProgram:
    # 1. The graph's inputs at b samples (the model's state as traced, the user inputs given) and the factor b:
    #    each user input is the traced one with some dims b times larger.
    in_spec = ep.call_spec.in_spec
    user_inputs, spec = pytree.tree_flatten((args, reorder_kwargs(kwargs, in_spec) if in_spec else kwargs))
    if spec != in_spec:
        raise _Unproven("the inputs at b samples have another structure")
    users = iter(user_inputs)
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    flat, factors = [], set()
    for s in ep.graph_signature.input_specs:
        old = placeholders[s.arg.name].meta.get("val") if getattr(s.arg, "name", None) in placeholders else None
        if s.kind != InputKind.USER_INPUT:
            flat.append(torch.empty_strided(old.shape, old.stride(), dtype=old.dtype, device="meta")
                        if isinstance(old, torch.Tensor) else old)
            continue
        new = next(users, None)
        flat.append(new)
        if isinstance(old, torch.Tensor):
            if not isinstance(new, torch.Tensor) or new.dim() != old.dim() or new.dtype != old.dtype or any(
                    n != o and (not o or n % o) for o, n in zip(old.shape, new.shape)):
                raise _Unproven("a user input of another kind than traced")
            factors |= {n // o for o, n in zip(old.shape, new.shape) if n != o}
    if next(users, None) is not None or len(flat) != len(placeholders) or len(factors) > 1:
        raise _Unproven("user inputs that do not match the traced ones")
    b = factors.pop() if factors else 1

    # 2. A copy of the graph (node meta copied, so `ep`'s values stay).
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    out, old_output = graph.graph_copy(ep.graph, env, return_output_node=True)
    output = graph.output(out)
    output.meta = dict(old_output.meta)

    if b > 1:
        _replay(graph, {new: old for old, new in env.items()}, flat, b)  # 3.
        _check_outputs(ep, output, model, args, kwargs)                  # 4.
    else:  # plain meta tensors for the values (the TP rewrite runs the graph again, `SameShapes` caches that)
        for node in graph.nodes:
            if "val" in node.meta and plain(node.meta["val"], fake=True):
                node.meta["val"] = fresh(node.meta["val"])
    new = copy.copy(ep)
    new._graph_module = LazyGraphModule(ep.graph_module, graph)  # its Python code only if something asks
    return new


def _replay(graph: torch.fx.Graph, old_of: dict, flat: list, b: int) -> None:
    """3. Run `graph` on meta at b samples, node by node, rewriting sizes; each node's ``val`` becomes its value.
    `old_of` maps each node to the traced one."""
    vals: dict[torch.fx.Node, object] = {}
    bdims: dict[torch.fx.Node, set[int]] = {}  # dims b times larger than traced
    feed = iter(flat)
    for node in graph.nodes:
        old = old_of.get(node)
        if node.op == "placeholder":
            vals[node] = next(feed)
        elif node.op == "call_function":
            _resize(node, vals, bdims, b)
            vals[node] = _run(node, vals)
        elif node.op == "output":
            continue
        else:
            raise _Unproven
        traced = old.meta.get("val")
        _check(traced, vals[node], b)
        if isinstance(traced, torch.Tensor):
            bdims[node] = {d for d, (o, n) in enumerate(zip(traced.shape, vals[node].shape)) if o != n}
        node.meta["val"] = vals[node]


def _check_outputs(ep, output: torch.fx.Node, model: nn.Module, args: tuple, kwargs: dict) -> None:
    """4. The model's own forward at b samples (on meta, eagerly) gives outputs of the replayed shapes."""
    got = [o.meta.get("val") if isinstance(o, torch.fx.Node) else o
           for o, spec in zip(output.args[0], ep.graph_signature.output_specs) if spec.kind == OutputKind.USER_OUTPUT]
    try:
        want = pytree.tree_leaves(model(*args, **kwargs))
    except Exception:  # noqa: BLE001 - the export at b samples will say what fails
        raise _Unproven from None
    if len(got) != len(want) or any(isinstance(g, torch.Tensor) != isinstance(w, torch.Tensor) or (
            isinstance(g, torch.Tensor) and g.shape != w.shape) for g, w in zip(got, want)):
        raise _Unproven("the model's outputs at b samples have other shapes")


@functools.cache
def _symint_args(op) -> dict[str, int]:
    """Name -> position of the arguments of `op` declared ``SymInt`` (sizes) in its schema."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return {}
    text = str(schema)
    params = text[text.index("(") + 1:text.rindex(") ->")].split(", ")
    names = [a.name for a in schema.arguments]
    declared = {p.split("=")[0].split(" ")[-1]: p.split(" ")[0] for p in params if " " in p}
    return {n: i for i, n in enumerate(names) if declared.get(n, "").startswith("SymInt")}


def _ints(value) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [i for v in value for i in _ints(v)]
    return []


def sizes_hold_one(node: torch.fx.Node) -> bool:
    """Whether `node` takes a size of 1 (an ``arange`` of length 1, a ``SymInt`` argument holding 1): traced at one
    sample, that 1 may be the batch (Hugging Face's causal mask is expanded to the batch this way)."""
    op = node.target
    if op in ARANGES:
        return 1 in _ints(node.args)
    sym = _symint_args(op)
    if not sym or op in BATCH_FREE:
        return False
    return 1 in [v for name, i in sym.items()
                 for v in _ints(node.args[i] if i < len(node.args) else node.kwargs.get(name))]


def _resize(node: torch.fx.Node, vals: dict, bdims: dict, b: int) -> None:
    """Rewrite `node`'s size arguments for b samples, or raise _Unproven."""
    op = node.target
    if b == 1:
        return
    if op in ARANGES and 1 in _ints(node.args):  # a length of 1: the batch of one sample, or not?
        raise _Unproven
    sym = _symint_args(op)
    if not sym or op in BATCH_FREE:
        return
    if op in VIEWS or op is aten.expand.default:
        x = node.args[0]
        sizes = list(node.args[1])
        node.args = (x, _view_sizes(op, vals[x], bdims.get(x, set()), sizes, node.meta["val"].shape, b),
                     *node.args[2:])
        return
    if op in ON_DIM:
        x = node.args[0]
        pos = ON_DIM[op]
        dim = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", 0)
        dim = dim % max(vals[x].dim(), 1)
        if dim in bdims.get(x, ()):
            raise _Unproven
        return
    values = [v for name, i in sym.items()
              for v in _ints(node.args[i] if i < len(node.args) else node.kwargs.get(name))]
    if 1 in values:  # a size of 1: the batch of one sample, or not?
        raise _Unproven


def _view_sizes(op, x: torch.Tensor, bd: set[int], sizes: list[int], old_out, b: int) -> list[int]:
    """The size argument of a view or expand of `x` (batch dims `bd`) at b samples; `sizes` at one sample."""
    if not bd:
        if 1 in sizes:  # the model's view(B, ...) of a tensor it built for B samples, or a view(1, ...)?
            raise _Unproven("a view to a size of 1 of a tensor without batch dims")
        return sizes
    old_out = list(old_out)
    if op is aten.expand.default:  # leading dims may be added; the others line up
        shift = len(old_out) - x.dim()
        new = list(sizes)
        for d in bd:
            if new[d + shift] != -1:
                new[d + shift] *= b
        return new
    # A view: the batch factor sits where the elements before it (in the traced shapes) number the same.
    old_in = [s // b if d in bd else s for d, s in enumerate(x.shape)]
    new = list(sizes)
    for d in sorted(bd):
        outer = math.prod(old_in[:d])
        cut = [j for j in range(len(old_out) + 1) if math.prod(old_out[:j]) == outer]
        ones = [j for j in cut if j < len(old_out) and old_out[j] == 1]
        if len(ones) == 1:
            j = ones[0]  # the batch dim, kept
        elif cut == [0] and old_out:
            j = 0  # merged into the first dim, outermost (after a non-1 dim it could be innermost of that one)
        else:
            raise _Unproven("a view that puts the batch between two dims")
        if any(s == 1 for i, s in enumerate(sizes) if i != j):  # view(T, B, H) at B = 1 reads [T, 1, H]
            raise _Unproven("a view to a size of 1 besides the batch")
        if new[j] != -1:  # a -1 takes the factor itself
            new[j] *= b
    return new


def _run(node: torch.fx.Node, vals: dict):
    def conv(a):
        if isinstance(a, torch.fx.Node):
            return vals[a]
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        return a

    args, kwargs = conv(node.args), {k: conv(v) for k, v in node.kwargs.items()}
    try:
        if node.target is operator.getitem:
            return args[0][args[1]]
        with torch.device("meta"):
            return node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - sizes that do not fit: not provable
        raise _Unproven from None


def _check(old, new, b: int) -> None:
    """`new` has the rank and dtype of `old`, each dim the same or b times larger (multi-output ops per output)."""
    if isinstance(old, (list, tuple)):
        if not isinstance(new, (list, tuple)) or len(old) != len(new):
            raise _Unproven
        for o, n in zip(old, new):
            _check(o, n, b)
        return
    if isinstance(old, torch.Tensor):
        if not isinstance(new, torch.Tensor) or new.dim() != old.dim() or new.dtype != old.dtype:
            raise _Unproven
        # At one sample a transposed batch dim can leave a tensor contiguous, and torch.export then drops a
        # `.contiguous()` or turns a reshape into a view: the graph at b samples would differ.
        if new.is_contiguous() != old.is_contiguous():
            raise _Unproven
        if any(n != o and n != o * b for o, n in zip(old.shape, new.shape)):
            raise _Unproven
