"""A graph's values on one tensor-parallel rank: their states, the collectives that convert between them, their local
shapes.

Every value is in one of three states on a TP rank: R (whole, the same on every rank), S(d) (split along dim d,
each rank its part; stored as the int d), or P (partial sums, rowwise outputs only, reduced at once). `need`
converts a value to the state its reader wants (an all-gather of a split, this rank's part of a whole value), once
per (value, state); every op is re-run on meta tensors with its local inputs (`_run_local`), and the size
arguments of views, slices and splits are rewritten to the local shape (`_rewrite_sizes`). The rewrite itself
(which layer splits how, which op keeps a split) is `passes.tp_rewrite`'s, sequence parallelism's
`passes.tp_sequence`'s; this base holds what both read and write (the rewriter's fields are set up in
`tp_rewrite._Rewriter.__init__`).
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from partc.errors import PartcError
from partc import collectives as C
from partc.passes.shard import VIEW_OPS, slice_piece

aten = torch.ops.aten
R, P = "R", "P"


def local_shape(shape, dim: int, t: int, what: str) -> list[int]:
    shape = list(shape)
    if shape[dim] % t:
        raise PartcError(f"tensor parallelism: {what} has size {shape[dim]} along the split dimension, not "
                         f"divisible by tp={t}")
    shape[dim] //= t
    return shape


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


class Multi(tuple):
    """Per-output split dims of a multi-output op (split, native_dropout)."""


class LocalRewriter:
    """The states of a graph's values on one TP rank and the conversions between them (`need`)."""

    def _insert(self, after: Node, fn, args: tuple, why: str, anchor: Node, local: torch.Tensor, state) -> Node:
        with self.graph.inserting_after(after):
            node = self.graph.call_function(fn, args)
        node.meta = {k: anchor.meta[k] for k in ("nn_module_stack", "stack_trace") if k in anchor.meta}
        node.meta["val"] = local
        node.meta["partc_why"] = why
        self.val[node] = local
        self.state[node] = state
        if C.is_collective(fn):
            self.result.collectives.append((fn.__name__, why))
        return node

    def _where(self, x: Node) -> str:
        layer = self.node_layer.get(x)
        return layer or x.name

    def need(self, x: Node, want, user: Node) -> Node:
        """`x` converted to state `want` (R or a split dim), inserted once per (value, state)."""
        have = self.state.get(x, R)
        if not isinstance(self.val.get(x), torch.Tensor):
            return x
        if have == want and (want == R or self.pieces.get(x, 1) == 1):  # a reader of a split takes one piece
            return x
        key = (x, want)
        if key in self.memo:
            return self.memo[key]
        v = self.val[x]
        if want == R and isinstance(have, int):
            d = have
            if x in self.seq and not self._pools(x, user) and not self._heads(x, user):
                self.result.sequence_gathers.append(
                    f"{user.target} ({user.name}, in {self._where(user)}) takes {x.name} whole (a whole layer, or "
                    f"an op not proven per-position): all-gathered over the sequence")
            local = torch.empty([s * (self.t if i == d else 1) for i, s in enumerate(v.shape)], dtype=v.dtype,
                                device="meta")
            node = self._insert(x, C.gather_from_tp, (x, d),
                                f"{user.name} ({self._where(user)}) needs {x.name} whole: all-gather its split dim {d}",
                                user, local, R)
            node = self._in_order(node, x, d, user)
        elif isinstance(want, int) and have == R:
            d = want
            local = torch.empty(local_shape(v.shape, d, self.t, x.name), dtype=v.dtype, device="meta")
            node = self._insert(x, C.scatter_to_tp, (x, d),
                                f"{self._where(user)} works on a split along dim {d}: keep this rank's part of "
                                f"{x.name}", user, local, want)
        elif isinstance(want, int) and isinstance(have, int):  # another dim, or from several pieces to one
            gathered = self.need(x, R, user)
            return self.need(gathered, want, user)
        else:
            raise AssertionError((have, want))
        self.memo[key] = node
        return node

    def _in_order(self, node: Node, x: Node, d: int, user: Node) -> Node:
        """`node`, the ranks' parts of `x` gathered along `d`, with the pieces of a split held in several
        (`pieces`) put back in order: ranks' parts [r0: p0 p1 p2, r1: p0 p1 p2] -> pieces [p0: r0 r1, p1: r0 r1,
        ...]."""
        pieces = self.pieces.get(x, 1)
        if pieces == 1:
            return node
        local = self.val[node]
        shape = list(local.shape)
        parts = shape[:d] + [self.t, pieces, shape[d] // (self.t * pieces)] + shape[d + 1:]
        why = f"put the {pieces} pieces of {x.name} back in order after the gather"
        node = self._insert(node, aten.view.default, (node, parts), why, user, local.view(parts), R)
        node = self._insert(node, aten.transpose.int, (node, d, d + 1), why, user,
                            self.val[node].transpose(d, d + 1), R)
        return self._insert(node, aten.reshape.default, (node, shape), why, user, local, R)

    def copy_to_tp(self, x: Node, user: Node, style: str = "colwise") -> Node:
        key = (x, "copy")
        if key not in self.memo:
            self.memo[key] = self._insert(
                x, C.copy_to_tp, (x,),
                f"input of {style} {self._where(user)}: identity forward, all-reduce of its gradient backward",
                user, self.val[x], R)
        return self.memo[key]

    def _replace_inputs(self, node: Node, mapping: dict[Node, Node]) -> None:
        for old, new in mapping.items():
            if old is not new:
                node.replace_input_with(old, new)

    def _run_local(self, node: Node, state) -> None:
        """Execute the op on meta tensors with local shapes to get (and check) its local output."""
        def conv(a):
            if isinstance(a, Node):
                return self.val.get(a, a.meta.get("val"))
            if isinstance(a, (list, tuple)):
                return type(a)(conv(x) for x in a)
            return a
        args, kwargs = conv(node.args), {k: conv(v) for k, v in node.kwargs.items()}
        if node.target is operator.getitem:
            out = args[0][args[1]]
        else:
            try:
                with torch.device("meta"):
                    out = node.target(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - any failure means the local program would be wrong
                raise PartcError(f"tensor parallelism: {node.target} ({node.name}, in "
                                 f"{self._where(node)}) fails on local shards: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:200]}") from None
        self.val[node] = out
        self.state[node] = state

    def _check_local(self, node: Node, out_dim: int) -> None:
        glob = node.meta.get("val")
        if isinstance(glob, torch.Tensor):
            want = local_shape(glob.shape, out_dim, self.t, f"{node.name} ({self._where(node)})")
            if list(self.val[node].shape) != want:
                raise PartcError(f"tensor parallelism: {node.target} ({node.name}, in {self._where(node)}) gives "
                                 f"local shape {list(self.val[node].shape)}, expected {want}; the rewrite cannot "
                                 f"prove it correct, so set the layers feeding it to 'replicate'")

    def _rewrite_sizes(self, node: Node, out_dim) -> None:
        glob = node.meta.get("val")
        t = node.target
        if t in VIEW_OPS or t is aten.expand.default:
            sizes = list(node.args[1])
            local = local_shape(glob.shape, out_dim, self.t, f"{node.name} ({self._where(node)})")
            new = [-1 if s == -1 else local[i] for i, s in enumerate(sizes)]
            node.args = (node.args[0], new, *node.args[2:])
        elif t is aten.unflatten.int:  # unflatten(x, d, sizes): the sizes are the output's dims d, d+1, ...
            sizes = list(node.args[2])
            local = local_shape(glob.shape, out_dim, self.t, f"{node.name} ({self._where(node)})")
            d = norm_dim(node.args[1], node.args[0].meta["val"].dim())
            new = [-1 if s == -1 else local[d + i] for i, s in enumerate(sizes)]
            node.args = (*node.args[:2], new, *node.args[3:])
        elif t in (aten.slice.Tensor, aten.narrow.default) and \
                (node.args[1] if len(node.args) > 1 else 0) % glob.dim() == out_dim:
            # One of equal pieces, and the source split in as many (checked in `_generic`): the same piece of the
            # local part.
            piece = slice_piece(node, node.args[0].meta["val"].shape[out_dim])
            if piece is None:  # the whole dim (x[..., :] with bounds that are not plain ints): nothing to rewrite
                return
            start, length = piece
            if t is aten.narrow.default:
                node.args = (*node.args[:2], start // self.t, length // self.t)
            else:
                node.args = (*node.args[:2], start // self.t, (start + length) // self.t, *node.args[4:])
        elif t in (aten.split.Tensor, aten.split_with_sizes.default):
            x = node.args[0]
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
            dim = dim + x.meta["val"].dim() if dim < 0 else dim
            if dim == self.state[x]:
                size = node.args[1]
                div = (lambda s: s // self.t) if isinstance(size, int) else None
                new = div(size) if div else [s // self.t for s in size]
                node.args = (x, new, *node.args[2:])