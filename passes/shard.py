"""Which tensors of a traced graph stay feature-sharded when Linear outputs are split colwise.

Megatron-LM's tensor parallelism keeps a layer's output split along its features (the last dim) until a layer
that can take a split input (a rowwise Linear) consumes it. That is only correct when every op in between treats
the split dimension as a batch dimension: elementwise ops, views that split features into heads, transposes,
attention over heads, softmax over another dim. This pass propagates a "sharded dim" from the output of every
Linear layer through the exported ATen graph and records, for each op, whether it is provably per-shard.

The result answers three questions for the planner:
- can a colwise layer feed a rowwise layer with no collective (`Region.reaches[layer] is True`);
- how many independent groups (attention heads) the split must respect (`Region.groups`);
- is the output split into fused pieces (a fused QKV projection: `Region.fused`), by a split, by slices of equal
  pieces (Phi-3's ``qkv[..., :h]``, ``qkv[..., h:2h]``, ``qkv[..., 2h:]``) or by a view whose outermost part is
  only taken apart (timm's ``reshape(B, N, 3, H, D)`` then ``unbind``: `view_pieces`); slices of different sizes
  (q, k and v under grouped-query attention) make the region invalid.
An op it does not know makes the region invalid: the planner then gathers instead of guessing.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Node

aten = torch.ops.aten

# Ops that return their (first) input's layout unchanged, up to right-aligned broadcasting.
_PASSTHROUGH = {
    aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
    aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.type_as.default,
    aten.dropout.default, aten.lift_fresh_copy.default,
}
VIEW_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int}
_SOFTMAX = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default}
_REDUCE = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default}
_MATMUL = {aten.matmul.default, aten.bmm.default}
_SDPA = {aten.scaled_dot_product_attention.default}
BATCHED_OPS = _MATMUL | _SDPA
"""Ops whose split must be a batch dim shared by the operands (matmul, bmm, attention)."""


def _shape(node) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape)
    return None


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def view_dim_map(src: tuple[int, ...], dst: tuple[int, ...], dim: int) -> tuple[int | None, int | None]:
    """Where dim `dim` of shape `src` lands in `dst` after a view: (dst dim, groups).

    Shapes are matched as runs of dims with equal products. If `dim` is split into several dims, the outermost
    of them carries the split and `groups` is its size (features -> (heads, head_dim): groups = heads). If several
    dims merge and `dim` is the outermost non-1 of them, the merged dim carries the split. Else (None, None)."""
    dst = list(dst)
    if -1 in dst:
        known = math.prod(s for s in dst if s != -1)
        dst[dst.index(-1)] = math.prod(src) // max(known, 1)
    i = j = 0
    while i < len(src) or j < len(dst):
        # Consume one group of dims with equal products.
        i0, j0 = i, j
        ps = src[i] if i < len(src) else 1
        pd = dst[j] if j < len(dst) else 1
        i += 1
        j += 1
        while ps != pd:
            if ps < pd and i < len(src):
                ps *= src[i]
                i += 1
            elif j < len(dst):
                pd *= dst[j]
                j += 1
            else:
                return None, None
        if i0 <= dim < i:
            src_group = [d for d in range(i0, min(i, len(src))) if src[d] != 1]
            dst_group = [d for d in range(j0, min(j, len(dst))) if dst[d] != 1]
            if not dst_group:
                return None, None
            if len(src_group) <= 1:
                # dim split into dst_group (or kept): the outermost carries the split.
                return dst_group[0], dst[dst_group[0]]
            if src_group[0] == dim and len(dst_group) == 1:
                return dst_group[0], src[dim]
            if [src[d] for d in src_group] == [dst[d] for d in dst_group]:
                # Same dims, only size-1 dims moved.
                return dst_group[src_group.index(dim)], None
            return None, None
    return None, None


def view_pieces(node: Node, src: tuple[int, ...], dst: tuple[int, ...], dim: int):
    """(out dim, groups, pieces, "") when a view splits the features `dim` into (p, h, ...) whose outermost part p
    is only ever taken apart (unbind, select, split or chunk along it, after permutes and transposes), as timm's
    ``qkv.reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)`` does; else None.

    Such a p is a count of fused pieces (q, k and v), not a split to carry: the weight is laid out in p pieces each
    split over the ranks (`Region.fused`), so the local part viewed as (p, h/t, ...) holds this rank's part of
    every piece, and the split lands on h (groups = h when more dims follow it, as heads before head_dim). Any
    other use of p (attention over it, a reduction) keeps the reading of `view_dim_map`: p carries the split."""
    out, p = view_dim_map(src, dst, dim)
    if out is None or p is None or p <= 1 or dst[out] != p:
        return None
    size, end = p, out + 1
    while size < src[dim] and end < len(dst):
        size *= dst[end]
        end += 1
    rest = [d for d in range(out + 1, end) if dst[d] != 1]
    if size != src[dim] or not rest or not _taken_apart(node, out):
        return None
    return rest[0], (dst[rest[0]] if len(rest) > 1 else 0), p, ""


def _taken_apart(node: Node, d: int) -> bool:
    """Every use of dim `d` of `node` takes it apart into its slices (unbind, select, split or chunk along it),
    through permutes, transposes and copies; False when any use reads it otherwise (or there is none)."""
    if not node.users:
        return False
    ndim = len(_shape(node) or ())
    for user in node.users:
        t = user.target
        if not user.args or user.args[0] is not node:
            return False
        if t is aten.permute.default:
            ok = _taken_apart(user, [_norm_dim(a, ndim) for a in user.args[1]].index(d))
        elif t is aten.transpose.int:
            a, b = (_norm_dim(x, ndim) for x in user.args[1:3])
            ok = _taken_apart(user, b if d == a else a if d == b else d)
        elif t in (aten.clone.default, aten.contiguous.default, aten.alias.default):
            ok = _taken_apart(user, d)
        elif t is aten.unsqueeze.default:  # nn.MultiheadAttention: unsqueeze(0).transpose(0, -2).squeeze(-2)
            ok = _taken_apart(user, d + (_norm_dim(user.args[1], ndim + 1) <= d))
        elif t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            shape = _shape(node) or ()
            given = range(ndim) if len(user.args) < 2 else user.args[1] if isinstance(user.args[1], (list, tuple)) \
                else [user.args[1]]
            gone = {_norm_dim(a, ndim) for a in given if shape[_norm_dim(a, ndim)] == 1}
            ok = d not in gone and _taken_apart(user, d - sum(1 for a in gone if a < d))
        elif t in (aten.unbind.int, aten.select.int):
            ok = _norm_dim(user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0), ndim) == d
        elif t in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
            ok = _norm_dim(user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0), ndim) == d
        else:
            ok = False
        if not ok:
            return False
    return True


def view_split(src: tuple[int, ...], dst: tuple[int, ...], dim: int, pieces: int, t: int
               ) -> tuple[int, int] | None:
    """Where a split survives a view of each rank's part: (out dim, out pieces), or None.

    The input's dim `dim` is split over `t` ranks in `pieces` equal pieces, each split separately (1: one chunk
    per rank; 3: a fused projection's q, k and v). The view is read on the common refinement of both shapes
    (their dims cut into factors that are contiguous in both): a rank holds a contiguous part of the outermost
    factor f of a piece when t divides f, so the split lands on the dim holding f, in as many pieces as the
    factors before f in that dim (the batch merged before the heads: nn.MultiheadAttention's (L, B, E) ->
    (L, B*H, D)). The local view is then the same view with f/t in place of f."""
    dst = list(dst)
    if -1 in dst:
        dst[dst.index(-1)] = math.prod(src) // max(math.prod(s for s in dst if s != -1), 1)
    n = src[dim]
    if n % pieces or (n // pieces) % t:
        return None
    shape = list(src[:dim]) + ([pieces] if pieces > 1 else []) + [n // pieces] + list(src[dim + 1:])
    split = dim + (pieces > 1)
    factors = []  # (src dim, dst dim, size) in element order
    i = j = 0
    rs, rd = (shape[0] if shape else 1), (dst[0] if dst else 1)
    while i < len(shape) and j < len(dst):
        if rs == 1 or rd == 1:
            i, j = i + (rs == 1), j + (rd == 1)
            rs = shape[i] if rs == 1 and i < len(shape) else rs
            rd = dst[j] if rd == 1 and j < len(dst) else rd
            continue
        f = min(rs, rd)
        if max(rs, rd) % f:
            return None
        factors.append((i, j, f))
        rs, rd = rs // f, rd // f
    first = next((k for k, (a, _, _) in enumerate(factors) if a == split), None)
    if first is None or factors[first][2] % t:
        return None
    out = factors[first][1]
    return out, math.prod(f for a, b, f in factors[:first] if b == out)


@dataclass(kw_only=True, slots=True)
class Region:
    """What happens downstream of one Linear's output when it is split along features."""

    valid: bool = True
    reason: str = ""
    """The first op that cannot be proven per-shard and why, without node names (layers of identical blocks
    read alike; empty when valid)."""
    groups: int = 0
    """gcd of the group counts the split must respect (heads); 0 when no view splits the features."""
    fused: int = 1
    """Pieces the output is split into along features right after the layer (3 for fused QKV)."""
    pieces: dict = field(default_factory=dict)
    """Node -> how many equal pieces it cuts the split dimension into (a split, or a slice of one piece)."""
    reaches: dict[str, bool] = field(default_factory=dict)
    """Layer FQN -> True when the split tensor arrives there on its last dim (a rowwise input)."""
    nodes: set = field(default_factory=set)


class ShardAnalysis:
    """Joint propagation from every Linear output (the Megatron hypothesis: all of them split colwise)."""

    def __init__(self, graph: torch.fx.Graph, layer_of: dict[Node, str], linear_outputs: dict[str, Node]):
        self.layer_of = layer_of
        self.dims: dict[Node, int | tuple] = {}
        self.sources: dict[Node, set[str]] = {}
        self.regions = {name: Region() for name in linear_outputs}
        self.bad: dict[Node, str] = {}
        # 1. Propagate dims from every linear output (a BFS in graph order is enough: FX graphs are topological).
        for name, out in linear_outputs.items():
            shape = _shape(out)
            if shape is None:
                self.regions[name].valid = False
                self.regions[name].reason = "its output has no tensor shape"
                continue
            self.dims[out] = len(shape) - 1
            self.sources[out] = {name}
        seeds = set(self.dims)
        for node in graph.nodes:
            if node.op != "call_function" or node.target is aten._assert_tensor_metadata.default:
                continue  # an assertion (a `.to`'s dtype) reads no values: the program skips it
            ins = [a for a in node.all_input_nodes if a in self.dims]
            if not ins:
                continue
            srcs = set().union(*(self.sources[a] for a in ins))
            layer = self.layer_of.get(node)
            if layer is not None and layer not in srcs:
                # Entering another layer: record whether the split arrives on the input features.
                for a in ins:
                    shape = _shape(a)
                    dim = self.dims[a]
                    ok = isinstance(dim, int) and shape is not None and dim == len(shape) - 1
                    for s in self.sources[a]:
                        prev = self.regions[s].reaches.get(layer, True)
                        self.regions[s].reaches[layer] = prev and ok
                continue
            if layer is not None or node in seeds:
                continue  # ops inside the source layer itself (e.g. Conv1D's view around addmm)
            out_dim, groups, fused, why = shard_rule(node, self.dims, ins)
            for s in srcs:
                r = self.regions[s]
                r.nodes.add(node)
                if why and r.valid:
                    r.valid = False
                    r.reason = f"{node.target}: {why}"
                if groups:
                    r.groups = math.gcd(r.groups, groups) if r.groups else groups
                if fused > 1:
                    r.pieces[node] = fused
            if why:
                self.bad[node] = why
                continue
            if out_dim is not None:
                self.dims[node] = out_dim
                self.sources[node] = srcs
        # 2. Pieces: the weight is split in `fused` pieces, each over the ranks, so that every op taking one piece
        #    (a split, or slices as Phi-3 takes q, k and v) finds it in this rank's part. Pieces of different sizes
        #    (q, k and v under grouped-query attention) admit no such layout: one piece, gathered at the first.
        for r in self.regions.values():
            counts = sorted(set(r.pieces.values()))
            if len(counts) > 1:
                node = next(n for n, c in r.pieces.items() if c != counts[-1])
                if r.valid:
                    r.valid = False
                    r.reason = f"{node.target}: pieces of different sizes along the split dimension (1/" \
                               f"{' and 1/'.join(map(str, counts))} of it)"
            elif counts:
                r.fused = counts[0]
        # 3. A split tensor that reaches the graph output (logits, loss) is not per-shard.
        for node in graph.nodes:
            if node.op == "output":
                for a in node.all_input_nodes:
                    if a in self.dims:
                        for s in self.sources[a]:
                            r = self.regions[s]
                            if r.valid:
                                r.valid = False
                                r.reason = "the split tensor reaches the model output"


def shard_rule(node: Node, dims: dict, ins: list[Node]):
    """(out dim, groups, fused, why-not) for one op whose inputs `ins` are split (their split dim in `dims`;
    other inputs are whole). `why` is empty when the op is provably per-shard."""
    t = node.target
    x = ins[0]
    dim = dims[x]
    in_shape, out_shape = _shape(x), _shape(node)
    if t is operator.getitem:
        idx = node.args[1]
        if isinstance(dim, tuple) and isinstance(idx, int) and idx < len(dim):
            return dim[idx], 0, 1, ""  # one piece of a split / dropout
        return None, 0, 1, "getitem of an unsupported value"
    if not isinstance(dim, int) or in_shape is None:
        return None, 0, 1, "unsupported input"
    if t in _SPLITS:
        split_dim = _norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), len(in_shape)) \
            if t is not aten.unbind.int else _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(in_shape))
        n = len(node.meta.get("val") or ())
        if t is aten.unbind.int:
            if split_dim == dim:
                return None, 0, 1, "unbind along the split dimension"
            d = dim - (1 if split_dim < dim else 0)
            return tuple([d] * n), 0, 1, ""
        return tuple([dim] * n), 0, (n if split_dim == dim else 1), ""
    if out_shape is None:
        return None, 0, 1, "no output shape"
    if torch.Tag.pointwise in getattr(t, "tags", ()) or t in _PASSTHROUGH:
        out = dim + len(out_shape) - len(in_shape)
        for a in ins[1:]:
            sa = _shape(a)
            if sa is not None and dims[a] + len(out_shape) - len(sa) != out:
                return None, 0, 1, "operands split on different dimensions"
        return out, 0, 1, ""
    if t is aten.native_dropout.default:
        return (dim, dim), 0, 1, ""
    if t in VIEW_OPS or t is aten.unflatten.int:
        split = view_pieces(node, in_shape, out_shape, dim)
        if split is not None:
            return split
        out, groups = view_dim_map(in_shape, out_shape, dim)
        if out is None:
            return None, 0, 1, f"view {list(in_shape)} -> {list(out_shape)} moves the split dimension"
        g = groups if (groups is not None and groups != in_shape[dim]) else 0  # features split into (heads, ...)
        return out, g, 1, ""
    if t is aten.transpose.int:
        a, b = (_norm_dim(d, len(in_shape)) for d in node.args[1:3])
        return (b if dim == a else a if dim == b else dim), 0, 1, ""
    if t is aten.t.default:
        return 1 - dim, 0, 1, ""
    if t is aten.permute.default:
        perm = [_norm_dim(d, len(in_shape)) for d in node.args[1]]
        return perm.index(dim), 0, 1, ""
    if t is aten.unsqueeze.default:
        d = _norm_dim(node.args[1], len(out_shape))
        return (dim + 1 if d <= dim else dim), 0, 1, ""
    if t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        out, groups = view_dim_map(in_shape, out_shape, dim)
        return (out, 0, 1, "") if out is not None else (None, 0, 1, "squeeze of the split dimension")
    if t is aten.expand.default:
        out = dim + len(out_shape) - len(in_shape)
        if in_shape[dim] != out_shape[out]:
            return None, 0, 1, "expand of the split dimension"
        return out, 0, 1, ""
    if t in (aten.slice.Tensor, aten.select.int, aten.narrow.default):
        d = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(in_shape))
        if d == dim and not (t is aten.slice.Tensor and out_shape[d] == in_shape[d]):
            piece = slice_piece(node, in_shape[d])
            if piece is None:
                return None, 0, 1, "slice of the split dimension that is not one of equal pieces"
            return dim, 0, in_shape[d] // piece[1], ""
        return (dim - 1 if t is aten.select.int and d < dim else dim), 0, 1, ""
    if t is aten.cat.default:
        d = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(out_shape))
        if d == dim or any(a not in dims for a in node.args[0]):
            return None, 0, 1, "cat with unsplit operands or along the split dimension"
        return dim, 0, 1, ""
    if t in (aten.repeat_interleave.self_int, aten.repeat_interleave.self_Tensor):
        d = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if d is None:
            return None, 0, 1, "repeat_interleave over a flattened tensor"
        return dim, 0, 1, ""
    if t in _SOFTMAX:
        if _norm_dim(node.args[1], len(in_shape)) == dim:
            return None, 0, 1, "softmax over the split dimension"
        return dim, 0, 1, ""
    if t in _REDUCE:
        dims = node.args[1] if len(node.args) > 1 else None
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        dims = [_norm_dim(d, len(in_shape)) for d in (dims if isinstance(dims, (list, tuple)) else [dims])] \
            if dims is not None else list(range(len(in_shape)))
        if dim in dims:
            return None, 0, 1, "reduction over the split dimension"
        return (dim if keep else dim - sum(1 for d in dims if d < dim)), 0, 1, ""
    if t in _MATMUL or t in _SDPA:
        return _batched(node, dims, t)
    return None, 0, 1, "op not known to be per-shard"

def slice_piece(node: Node, size: int) -> tuple[int, int] | None:
    """(start, length) of a slice or narrow of a dim of `size` that takes one of equal pieces (``qkv[..., h:2h]``),
    else None."""
    if node.target is aten.narrow.default:
        start, length, step = node.args[2], node.args[3], 1
    elif node.target is aten.slice.Tensor:
        args = list(node.args) + [None] * (5 - len(node.args))
        start, end, step = args[2] or 0, args[3], args[4] or 1
        if not all(isinstance(v, int) for v in (start, step)) or not isinstance(end, (int, type(None))):
            return None
        start = min(max(start + size if start < 0 else start, 0), size)
        end = size if end is None else min(max(end + size if end < 0 else end, 0), size)
        length = end - start
    else:
        return None
    if not all(isinstance(v, int) for v in (start, length)) or step != 1 or length <= 0:
        return None
    return (start, length) if size % length == 0 and start % length == 0 else None


def _batched(node: Node, dims: dict, t):
    """matmul / bmm / attention: the split must be a batch dim shared by the operands."""
    operands = node.args[:3] if t in _SDPA else node.args[:2]
    out_shape = _shape(node)
    out_dims = set()
    for a in operands:
        sa = _shape(a)
        if sa is None:
            continue
        if a not in dims:
            continue
        d = dims[a]
        if not isinstance(d, int) or d >= len(sa) - 2:
            return None, 0, 1, "contraction or matrix dimension split"
        out_dims.add(d + len(out_shape) - len(sa))
    if len(out_dims) != 1:
        return None, 0, 1, "operands split on different dimensions"
    out = out_dims.pop()
    # An unsplit operand (a replicated K/V, a mask) is sliced to the local part by each rank: valid.
    return out, 0, 1, ""
