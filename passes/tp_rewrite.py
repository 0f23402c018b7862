"""Rewrite an exported graph for tensor parallelism: local weight shards, local shapes, explicit collectives.

Every value is in one of three states on a TP rank: R (whole, the same on every rank), S(d) (split along dim d,
each rank its part; stored as the int d), or P (partial sums, rowwise outputs only, reduced at once). The plan's `tp` map fixes each
layer's style (Megatron-LM, Shoeybi et al. 2019):

    colwise   Linear weight [out, in] split on out (HF Conv1D [in, out] on out); input R through `copy_to_tp`
              (identity forward, all-reduce backward); output S(last). A fused projection (GPT-2's c_attn) is split
              per piece, so every rank gets its own heads of q, of k and of v: the split or the slices that take
              one piece (Phi-3's qkv[..., h:2h] -> [h/t:2h/t]) find it in the local part, and a reader of the
              whole output gets the gathered parts put back in piece order.
    rowwise   weight split on in; input S(last); output P, then `reduce_from_tp` (all-reduce forward, identity
              backward) and the bias added once.
    Embedding rowwise: vocabulary rows split, masked lookup then `reduce_from_tp`; colwise: embedding dim split.
    replicate whole weights, R inputs and outputs.

Sequence parallelism (Korthikanti et al. 2022, Megatron-Core's): a rowwise output (Linear or vocabulary-split
Embedding) is reduce-scattered along its sequence dim (`reduce_scatter_to_sp`: S(seq)) instead of all-reduced; the
glue after it (residual adds, dropout, norms: `_generic` on the local part, where `shard_rule` proves each op
per-position) keeps that split; a colwise layer whose input is split so all-gathers it (`gather_from_sp`, its
backward a reduce-scatter) instead of `copy_to_tp`. A parameter applied to the local part of the sequence (a norm's
weight, a rowwise bias added after the reduce-scatter) has a partial gradient on each rank: it is read through
`copy_to_tp`, whose backward all-reduces it. A whole operand spanning the sequence (learned positions) is sliced
to the local part. An op that cannot be proven per-position gathers its input (`gather_from_tp`), as today.
A mixture of experts split inside runs as Megatron-Core's: its router on the local part (`_routers`), the experts'
inputs all-gathered (`_gather_sequence`), their partial output reduce-scattered (`_partial_to_sequence`). A stream
that enters whole (a vision transformer's patches) is scattered at the first norm (`_enter_sequence`); a pooled
head's norm output is gathered (`_pools`). The sum of colwise embeddings (GPT's token and learned positions) is
added on the feature shards and enters the sequence split once (`_embedding_sum`); a rowwise output layer whose
output is the model's reads the final norm's output gathered and all-reduces its logits (`_heads`).

Between layers each op keeps a split when `passes.shard.shard_rule` proves it per-shard (elementwise, views that
split features into heads, transposes, attention over heads, softmax over another dim): its size arguments are
rewritten to the local shape (``view(x, [b, s, 96, 128])`` -> ``[b, s, 96/t, 128]``), whole operands are sliced to
the local part (`scatter_to_tp`), and every op is re-run on meta tensors to check the local shape. An op that
is not provably per-shard gets its inputs gathered (`gather_from_tp`); a local shape that does not come out as
expected fails the compile with the op and its module named. A view is read on each rank's part
(`passes.shard.view_split`): heads merged behind the batch (nn.MultiheadAttention's (L, B*H, D) at B samples) are
held as B pieces, as a fused projection's output is held as 3.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.export.graph_signature import InputKind
from torch.fx import Node

from partc.errors import PartcError
from partc import collectives as C
from partc.ir import Layer
from partc.passes.experts import inner_split
from partc.passes.shard import BATCHED_OPS, VIEW_OPS, shard_rule, slice_piece, view_split
from partc.sharding import Shard, param_shard, weight_names

aten = torch.ops.aten
R, P = "R", "P"
_NORMS = {aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default}
"""Norms of the last dims, per position: under sequence parallelism they run on this rank's part of the sequence."""


@dataclass(kw_only=True, slots=True)
class Rewrite:
    shards: dict[str, Shard] = field(default_factory=dict)
    """Parameter FQN (the exported name) -> its split; parameters not listed are whole."""
    collectives: list[tuple[str, str]] = field(default_factory=list)
    """(collective, why) in graph order."""
    split: set[Node] = field(default_factory=set)
    """Nodes whose local value is not the whole tensor (split, or a partial sum): every TP rank holds another one."""
    sequence: set[Node] = field(default_factory=set)
    """Nodes split along the sequence (sequence parallelism): a subset of `split`."""
    sequence_gathers: list[str] = field(default_factory=list)
    """Under sequence parallelism, where the program does not keep the split along the sequence (one line each): a
    value split along it gathered whole because its reader is not proven per-position, a rowwise output without a
    sequence dim (all-reduced), a colwise layer whose input is whole (`copy_to_tp`). The plan prices every unit as
    sequence-parallel: the search takes sequence parallelism only where this stays empty."""


def _local_shape(shape, dim: int, t: int, what: str) -> list[int]:
    shape = list(shape)
    if shape[dim] % t:
        raise PartcError(f"tensor parallelism: {what} has size {shape[dim]} along the split dimension, not "
                         f"divisible by tp={t}")
    shape[dim] //= t
    return shape


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


class _Multi(tuple):
    """Per-output split dims of a multi-output op (split, native_dropout)."""


class _Rewriter:
    def __init__(self, ep: torch.export.ExportedProgram, node_layer: dict[Node, str], layers: dict[str, Layer],
                 styles: dict[str, str], t: int, aliases: dict[str, list[str]], sequence_parallel: bool = False,
                 keep_split: int | None = None, seq_len: int | None = None, regather: bool = False):
        self.ep, self.graph, self.aliases = ep, ep.graph, aliases
        self.sp = sequence_parallel and t > 1
        self.regather = self.sp and regather
        """`sp_regather`: the colwise Linears keep this rank's part of their gathered input and gather it again in
        backward (`_fuse_regathers`)."""
        self.seq: set[Node] = set()
        """Nodes split along the sequence (their state is that dim)."""
        self.keep_split = keep_split
        """The flat output left split over its last dimension (the logits of a vocab-parallel loss)."""
        self.node_layer, self.layers, self.styles, self.t = node_layer, layers, styles, t
        self.state: dict[Node, object] = {}
        self.pieces: dict[Node, int] = {}
        """Split nodes whose local part holds this rank's part of each of several equal pieces (a colwise fused
        projection's output, `Shard.fused`), not one contiguous chunk; absent: one piece."""
        self.val: dict[Node, torch.Tensor] = {}
        self.memo: dict[tuple, Node] = {}
        self.result = Rewrite()
        self.param_of = {}
        placeholders = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        for spec in ep.graph_signature.input_specs:
            if spec.kind == InputKind.PARAMETER:
                self.param_of[placeholders[spec.arg.name]] = spec.target
        self._param_pos = {p: i for i, p in enumerate(self.param_of)}
        inputs = [placeholders.get(getattr(s.arg, "name", None)) for s in ep.graph_signature.input_specs
                  if s.kind == InputKind.USER_INPUT]
        vals = [x.meta.get("val") for x in inputs if x is not None]
        self.seq_len = seq_len if seq_len and seq_len > 1 else \
            next((int(v.shape[1]) for v in vals if isinstance(v, torch.Tensor) and v.dim() >= 2), None)
        """Tokens per sample: the traced graph's (`ModelGraph.seq_len`: a vision transformer's patches and class
        token, which its input, an image, does not have), else dim 1 of the model's first input of two or more dims
        (the model file's contract: batch first)."""
        self.done: set[Node] = set()
        """Nodes already rewritten by the op before them (the view a rowwise output is reduce-scattered after)."""
        self.inner = self._inner_states()
        """Nodes of the layers split inside (``inner``) -> their state (`partc.passes.experts.InnerSplit.states`)."""
        self.routers = self._routers() if self.sp else set()
        """Under sequence parallelism, the replicated layers a layer split inside reads (a mixture of experts'
        router): they run on this rank's part of the sequence (`_router_op`)."""
        self.sums: set[Node] = set()
        """Under sequence parallelism, the adds of colwise embeddings' outputs (GPT's token and position
        embeddings): the sum stays split over the features and enters the sequence split once (`_embedding_sum`)."""
        self.heads: set[Node] = set()
        """Under sequence parallelism, the rowwise layers' ops whose output is the model's (an output layer tied to
        a colwise token embedding): their input is the stream all-gathered, their output all-reduced, as Megatron-LM
        all-gathers the final norm's output before its output layer (`_split_layer`)."""

    # ------------------------------------------------------------------ helpers
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
            local = torch.empty(_local_shape(v.shape, d, self.t, x.name), dtype=v.dtype, device="meta")
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

    def _gather_sequence(self, x: Node, user: Node, what: str) -> Node:
        """`x`, split along the sequence, all-gathered whole before `user` (its first reader that needs it whole:
        a colwise layer, a layer split inside; in its unit and pipeline stage), once per value: a floating value
        through `gather_from_sp` (its gradient, a partial sum on each rank, reduce-scattered back), an integer one
        (a router's choice of experts) through `gather_from_tp`. A local part held in k pieces (the tokens of k
        samples flattened, [b*s/t, h] of Hugging Face's Conv1D: `view_split`) is viewed as [k, n/k] along its split
        dim, gathered on the second and viewed back: every sample gets its whole sequence, in order."""
        key = (x, "gather_sp")
        if key in self.memo:
            return self.memo[key]
        v, d, k = self.val[x], self.state[x], self.pieces.get(x, 1)
        fn = C.gather_from_sp if v.is_floating_point() else C.gather_from_tp
        why = (f"{what}: all-gather the sequence forward, reduce-scatter its gradient backward"
               if fn is C.gather_from_sp else f"{what}: all-gather the sequence forward")
        meta = {k_: user.meta[k_] for k_ in ("nn_module_stack", "stack_trace") if k_ in user.meta}

        def add(fn, args, local):
            with self.graph.inserting_before(user):
                n = self.graph.call_function(fn, args)
            n.meta = dict(meta, val=local, partc_why=why)
            self.val[n], self.state[n] = local, R
            return n

        shape = list(v.shape)
        src, dim = x, d
        if k > 1:
            parts = shape[:d] + [k, shape[d] // k] + shape[d + 1:]
            src, dim = add(aten.reshape.default, (x, parts), torch.empty(parts, dtype=v.dtype, device="meta")), d + 1
        have = list(self.val[src].shape)
        whole = [n * (self.t if i == dim else 1) for i, n in enumerate(have)]
        g = add(fn, (src, dim), torch.empty(whole, dtype=v.dtype, device="meta"))
        self.result.collectives.append((fn.__name__, why))
        if k > 1:
            out = shape[:d] + [shape[d] * self.t] + shape[d + 1:]
            g = add(aten.reshape.default, (g, out), torch.empty(out, dtype=v.dtype, device="meta"))
        self.memo[key] = g
        return g

    def _partial_to_sequence(self, x: Node, what: str) -> Node | None:
        """The partial sums `x` (a layer split inside) reduce-scattered along the sequence: along its sequence dim,
        or, for tokens flattened in front ([b·s, ...], a mixture of experts' rows), viewed as [b, s, ...] for the
        reduce-scatter and flattened again (this rank's part of each sample's sequence: b pieces). None when `x`
        holds no sequence."""
        d = self.seq_dim(x)
        if d is not None:
            return self._to_sequence(x, d, what)
        v, s = self.val[x], self.seq_len
        if s is None or v.dim() < 2 or v.shape[0] % s:
            return None
        b = v.shape[0] // s
        why = f"the partial outputs of {what} as [samples, sequence, ...] for the reduce-scatter"
        shape = [b, s, *v.shape[1:]]
        view = self._insert(x, aten.view.default, (x, shape), why, x, v.view(shape), P)
        if s % self.t:
            raise PartcError(f"sequence parallelism: the sequence ({s} tokens) does not divide over tp={self.t}; "
                             f"compile with --no-sequence-parallel or another --tp")
        part = self._to_sequence(view, 1, what)
        flat = [b * s // self.t, *v.shape[1:]]
        out = self._insert(part, aten.view.default, (part, flat), f"this rank's part of {what}'s output, its tokens "
                           f"flattened again", x, self.val[part].reshape(flat), 0)
        self.seq.add(out)
        if b > 1:
            self.pieces[out] = b
        return out

    def seq_dim(self, node: Node) -> int | None:
        """The sequence dim of `node`'s whole value under sequence parallelism: the one dim between the batch (0)
        and the features (last) of the model's sequence length; None when there is none. PartcError when the
        sequence does not divide by t."""
        val = node.meta.get("val")
        if not self.sp or self.seq_len is None or not isinstance(val, torch.Tensor):
            return None
        dims = [i for i in range(1, val.dim() - 1) if val.shape[i] == self.seq_len]
        if len(dims) == 1 and self.seq_len % self.t:
            raise PartcError(f"sequence parallelism: the sequence ({self.seq_len} tokens) does not divide over "
                             f"tp={self.t}; compile with --no-sequence-parallel or another --tp")
        return dims[0] if len(dims) == 1 else None

    def _to_sequence(self, x: Node, d: int, what: str) -> Node:
        """The partial sums `x` reduce-scattered along the sequence dim `d` (instead of all-reduced)."""
        return self._split_sequence(x, C.reduce_scatter_to_sp, d,
                                    f"sum the partial outputs of {what}, each rank keeping 1/{self.t} of the sequence "
                                    f"(reduce-scatter forward, all-gather backward)", x)

    def _split_sequence(self, x: Node, fn, d: int, why: str, anchor: Node) -> Node:
        """`fn(x, d)` inserted after `x`, a collective that leaves each rank 1/t of `x` along its sequence dim `d`
        (`reduce_scatter_to_sp`, `scatter_to_tp`), with its local shape; its output is split along the sequence."""
        v = self.val[x]
        local = torch.empty(_local_shape(v.shape, d, self.t, x.name), dtype=v.dtype, device="meta")
        out = self._insert(x, fn, (x, d), why, anchor, local, d)
        self.seq.add(out)
        return out

    def grad_sum(self, p: Node, user: Node) -> Node:
        """Parameter `p` read on the local part of the sequence: through `copy_to_tp`, whose backward all-reduces
        the ranks' partial gradients (inserted before its first such reader)."""
        key = (p, "grad_sum")
        if key not in self.memo:
            with self.graph.inserting_before(user):
                node = self.graph.call_function(C.copy_to_tp, (p,))
            node.meta = {k: user.meta[k] for k in ("nn_module_stack", "stack_trace") if k in user.meta}
            node.meta["val"] = self.val[p]
            why = f"{self.param_of[p]} is applied to 1/{self.t} of the sequence: all-reduce its gradient backward"
            node.meta["partc_why"] = why
            self.val[node], self.state[node] = self.val[p], R
            self.result.collectives.append((C.copy_to_tp.__name__, why))
            self.memo[key] = node
        return self.memo[key]

    def copy_to_tp(self, x: Node, user: Node, style: str = "colwise") -> Node:
        key = (x, "copy")
        if key not in self.memo:
            self.memo[key] = self._insert(
                x, C.copy_to_tp, (x,),
                f"input of {style} {self._where(user)}: identity forward, all-reduce of its gradient backward",
                user, self.val[x], R)
        return self.memo[key]

    # ------------------------------------------------------------------ the pass
    def run(self) -> Rewrite:
        for node in list(self.graph.nodes):
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "call_function" and node not in self.done:
                self._call(node)
            elif node.op == "output":
                outs = node.args[0]
                new = [o if i == self.keep_split else self.need(o, R, node) if isinstance(o, Node) else o
                       for i, o in enumerate(outs)]
                if self.keep_split is not None:
                    # The vocab-parallel loss reads this output as this rank's columns of the vocabulary, in order
                    # (`partc.collectives.vocab_parallel_cross_entropy`): never gathered.
                    o = outs[self.keep_split]
                    assert self.state.get(o) == self.val[o].dim() - 1 and self.pieces.get(o, 1) == 1, \
                        (o.name, self.state.get(o))
                node.args = (type(outs)(new),)
        if self.regather:
            self._fuse_regathers()
        self.graph.lint()
        self.result.split = {n for n, st in self.state.items() if st is not R}
        self.result.sequence = set(self.seq)
        return self.result

    def _fuse_regathers(self) -> None:
        """`sp_regather`: each all-gather before colwise Linears (`gather_from_sp`) and the Linears reading it
        become one `linears_from_sp`, which keeps this rank's part of the input for backward and gathers it again
        there; its outputs replace the Linears'. A gather read otherwise (an addmm, a layer that is not a Linear)
        stays as it is and is listed in `sequence_gathers`: the plan prices every one gathered again."""
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        for key, g in list(self.memo.items()):
            if key[1] != "gather_sp":
                continue
            x, d = g.args
            users = sorted(g.users, key=order.__getitem__)
            if not users or not all(u.target is aten.linear.default and u.args[0] is g and not u.kwargs
                                    and all(a is None or (isinstance(a, Node) and a.op == "placeholder")
                                            for a in u.args[1:]) for u in users):
                self.result.sequence_gathers.append(
                    f"the gathered input {g.name} of colwise {self._where(users[0]) if users else '?'} is not read "
                    f"by Linears only: kept whole for backward, not gathered again (sp_regather)")
                continue
            params = [a for u in users for a in (u.args[1], u.args[2] if len(u.args) > 2 else None)]
            why = (f"input of colwise {', '.join(self._where(u) for u in users)}: all-gather the sequence forward and "
                   f"again in backward (this rank's part kept), reduce-scatter of its gradient")
            with self.graph.inserting_before(users[0]):
                fused = self.graph.call_function(C.linears_from_sp, (x, d, *params))
            fused.meta = {k: users[0].meta[k] for k in ("nn_module_stack", "stack_trace") if k in users[0].meta}
            fused.meta["val"] = tuple(self.val[u] for u in users)
            fused.meta["partc_why"] = why
            i = self.result.collectives.index((C.gather_from_sp.__name__, g.meta["partc_why"]))
            self.result.collectives[i] = (C.linears_from_sp.__name__, why)
            last = fused
            for j, u in enumerate(users):
                with self.graph.inserting_after(last):
                    out = self.graph.call_function(operator.getitem, (fused, j))
                out.meta = {k: u.meta[k] for k in ("nn_module_stack", "stack_trace") if k in u.meta}
                out.meta["val"] = self.val[out] = self.val[u]
                self.state[out] = self.state.pop(u)
                if u in self.pieces:
                    self.pieces[out] = self.pieces.pop(u)
                u.replace_all_uses_with(out)
                self.graph.erase_node(u)
                last = out
            self.graph.erase_node(g)
            del self.memo[key]

    def _placeholder(self, node: Node) -> None:
        val = node.meta.get("val")
        self.state[node] = R
        if not isinstance(val, torch.Tensor):
            return
        self.val[node] = val
        fqn = self.param_of.get(node)
        if fqn is None:
            return
        # A tied parameter is one tensor: every layer holding it must split it the same way.
        shards = {}
        for alias in self.aliases.get(fqn, [fqn]):
            layer = self.layers.get(alias.rsplit(".", 1)[0])
            style = self.styles.get(layer.fqn, "replicate") if layer else "replicate"
            shards[alias] = param_shard(layer, alias, style) if layer else None
        if len({(s.dim, s.fused) if s else None for s in shards.values()}) > 1:
            desc = ", ".join(f"{a} {'whole' if s is None else f'split on dim {s.dim}'}" for a, s in shards.items())
            raise PartcError(f"tensor parallelism: tied parameter split two ways ({desc}); give the layers "
                             f"sharing it styles that split it alike")
        shard = next(iter(shards.values()))
        if shard is None:
            return
        self.result.shards[fqn] = shard
        if shard.fused > 1 and val.shape[shard.dim] % (shard.fused * self.t):
            raise PartcError(f"tensor parallelism: {fqn} has {val.shape[shard.dim]} rows in {shard.fused} fused "
                             f"pieces, not divisible by tp={self.t}")
        self.val[node] = torch.empty(_local_shape(val.shape, shard.dim, self.t, fqn), dtype=val.dtype,
                                     device="meta")

    def _weight_op(self, node: Node, layer: Layer) -> str | None:
        """The op of a split layer that multiplies by its weight: 'linear', 'addmm', 'embedding' or None."""
        name = f"{layer.fqn}.{weight_names(layer)[0]}" if layer.fqn else weight_names(layer)[0]
        # A tied weight may reach the op through any of its names' placeholders.
        hits = [p for p in node.all_input_nodes if p in self.param_of
                and name in self.aliases.get(self.param_of[p], [self.param_of[p]])]
        weight = min(hits, key=self._param_pos.__getitem__, default=None)  # the first placeholder, as declared
        if weight is None:
            return None
        if node.target is aten.linear.default and node.args[1] is weight:
            return "linear"
        if node.target is aten.addmm.default and node.args[2] is weight:
            return "addmm"
        if node.target is aten.embedding.default and node.args[0] is weight:
            return "embedding"
        raise PartcError(f"tensor parallelism: {layer.fqn} uses its weight in {node.target}, which the rewrite does "
                         f"not support; set tp[{layer.fqn!r}] to 'replicate'")

    def _call(self, node: Node) -> None:
        if node.target is aten._assert_tensor_metadata.default:
            return None  # an assertion on the traced tensor (a `.to`'s dtype): the program skips it, split or not
        layer_name = self.node_layer.get(node)
        layer = self.layers.get(layer_name) if layer_name else None
        style = self.styles.get(layer_name, "replicate") if layer else "replicate"
        if layer is not None and style == "inner":
            return self._inner_node(node, layer)
        if layer is not None and style != "replicate":
            kind = self._weight_op(node, layer)
            if kind is not None:
                return self._split_layer(node, layer, style, kind)
        if self.sp and layer is not None and layer.kind == "norm":
            self._enter_sequence(node)
        if self.sp and layer is not None and (layer.kind == "norm" or layer_name in self.routers) and \
                any(a in self.seq for a in node.all_input_nodes):
            return self._generic(node)  # a norm (a router) of each position: on this rank's part of the sequence
        if layer is not None and style == "replicate" and layer.kind != "other":
            # A whole layer (norm, replicated Linear) takes whole inputs.
            self._replace_inputs(node, {a: self.need(a, R, node) for a in node.all_input_nodes})
            return self._run_local(node, R)
        self._generic(node)

    def _inner_states(self) -> dict[Node, object]:
        """Every node of a layer split inside -> its state, from the analysis of the graph as exported."""
        nodes: dict[str, list[Node]] = {}
        for n in self.graph.nodes:
            if n.op == "call_function" and self.styles.get(self.node_layer.get(n, "")) == "inner":
                nodes.setdefault(self.node_layer[n], []).append(n)
        out = {}
        for fqn, ns in nodes.items():
            layer = self.layers[fqn]
            params = {ph: p for ph, p in self.param_of.items() if p in layer.params}
            split = inner_split(ns, params)
            if isinstance(split, str):
                raise PartcError(f"tensor parallelism: {fqn} cannot be split inside: {split}; set tp[{fqn!r}] to "
                                 f"'replicate'")
            assert split.params == layer.inner, (fqn, split.params, layer.inner)
            out.update(split.states)
        return out

    def _enter_sequence(self, node: Node) -> None:
        """Under sequence parallelism, an op of a norm reading the stream whole from outside its layer (a vision
        transformer's patches and class token, where no token embedding splits it; not a model input): the stream
        is scattered along the sequence first, each rank keeping its part (backward: the gradient all-gathered),
        once for every reader (the residual add reads the same part)."""
        for a in node.all_input_nodes:
            v = self.val.get(a)
            if a.op == "placeholder" or self.state.get(a, R) != R or not isinstance(v, torch.Tensor) or \
                    not v.is_floating_point() or self.node_layer.get(a) == self.node_layer.get(node):
                continue
            d = self.seq_dim(a)
            if d is not None:
                part = self.need(a, d, node)
                self.seq.add(part)
                node.replace_input_with(a, part)

    def _pools(self, x: Node, user: Node) -> bool:
        """Whether gathering `x` (split along the sequence) for `user` is a classifier head's: the output of a norm
        read by an op outside the layers that is not per-position (the class token taken, the tokens averaged).
        The plan charges it (`passes.cost.unit_collectives`): an all-gather forward, nothing backward (the head is
        whole, its gradient the same on every rank)."""
        src = self.layers.get(self.node_layer.get(x, ""))
        return src is not None and src.kind == "norm" and self.node_layer.get(user) is None

    def _heads(self, x: Node, user: Node) -> bool:
        """Whether gathering `x` (split along the sequence) for `user` is the edge of a rowwise output layer
        (`heads`): the output of a norm (the final norm) read by it. The plan charges it
        (`passes.cost.unit_collectives`): an all-gather forward, nothing backward."""
        src = self.layers.get(self.node_layer.get(x, ""))
        return user in self.heads and src is not None and src.kind == "norm"

    def _routers(self) -> set[str]:
        """The replicated layers (not norms) whose outputs a layer split inside reads: a mixture of experts' router.
        Under sequence parallelism it runs on this rank's part of the sequence, as Megatron-Core's router does, its
        parameters read through `copy_to_tp` (their gradients, partial sums, all-reduced over tp); the experts then
        all-gather the tokens, the routing weights and the chosen experts (`_inner_node`)."""
        out = set()
        for n in self.graph.nodes:
            fqn = self.node_layer.get(n)
            if n.op != "call_function" or self.styles.get(fqn) != "inner":
                continue
            for a in n.all_input_nodes:
                src = self.node_layer.get(a)
                if src and src != fqn and src in self.layers and self.layers[src].kind != "norm" and \
                        self.styles.get(src, "replicate") == "replicate":
                    out.add(src)
        return out

    def _router_op(self, node: Node, d: int):
        """(out dim, why-not) of an op of a router (`_routers`) on a tensor split along the sequence dim `d`: its
        product with the whole weight (a linear of the features) and the choice of the top experts of each token are
        per position."""
        x = node.args[0].meta["val"]
        if not isinstance(d, int):
            return None, "unsupported input"
        if node.target is aten.linear.default and d < x.dim() - 1 and \
                not any(self.state.get(a, R) != R for a in node.args[1:] if isinstance(a, Node)):
            return d, ""
        if node.target is aten.topk.default:
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
            if _norm(dim, x.dim()) != d:
                return _Multi((d, d)), ""
        return None, "op not known to be per-position"

    def _inner_node(self, node: Node, layer: Layer) -> None:
        """One op of a layer split inside (`partc.passes.experts`): its inputs from outside the layer whole, the
        floating ones through `copy_to_tp` (their gradients are partial sums); split ops on local shapes; a partial
        sum that leaves the layer all-reduced once (`reduce_from_tp`), before its first reader outside."""
        state = self.inner.get(node, R)
        if not isinstance(node.meta.get("val"), (torch.Tensor, list, tuple)):
            return None  # an assertion on the traced tensor (`_assert_tensor_metadata`): the program skips it
        for a in node.all_input_nodes:
            if a in self.inner or a in self.param_of or not isinstance(self.val.get(a), torch.Tensor):
                continue
            if a in self.seq and isinstance(self.state.get(a), int):  # Megatron-Core's MoE under SP: the tokens,
                # the routing weights and the chosen experts all-gathered; the gradients, partial sums, scattered
                node.replace_input_with(a, self._gather_sequence(a, node, f"input of split-inside {layer.fqn}"))
                continue
            whole = self.need(a, R, node)
            node.replace_input_with(a, self.copy_to_tp(whole, node, "split-inside")
                                    if whole.meta["val"].is_floating_point() else whole)
        if state == R or state == P:
            self._run_local(node, state)
        elif isinstance(state, tuple):
            self._rewrite_sizes(node, None)
            self._run_local(node, _Multi(state))
        else:
            self._rewrite_sizes(node, state)
            self._run_local(node, state)
        glob, local = node.meta.get("val"), self.val[node]
        if isinstance(glob, torch.Tensor):
            want = list(glob.shape) if state in (R, P) else \
                _local_shape(glob.shape, state, self.t, f"{node.name} ({layer.fqn})")
            if list(local.shape) != want:
                raise PartcError(f"tensor parallelism: {node.target} ({node.name}, in {layer.fqn}) gives local "
                                 f"shape {list(local.shape)}, expected {want}; set tp[{layer.fqn!r}] to 'replicate'")
        outside = [u for u in node.users if u not in self.inner]
        if state == P and outside:
            out = self._partial_to_sequence(node, f"{layer.fqn}, split inside") if self.sp else None
            if out is None and self.sp:
                self.result.sequence_gathers.append(
                    f"{layer.fqn}'s output {node.name} has no sequence dim: all-reduced (tensor parallelism)")
            if out is None:
                out = self._insert(node, C.reduce_from_tp, (node,),
                                   f"sum the partial outputs of {layer.fqn}, split inside (all-reduce forward, "
                                   f"identity backward)", node, local, R)
            for u in outside:
                u.replace_input_with(node, out)
        return None

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

    def _generic(self, node: Node) -> None:
        ins = [a for a in node.all_input_nodes if isinstance(self.state.get(a), (int, _Multi))]
        if not ins:
            return self._run_local(node, R)
        if (node.target in VIEW_OPS or node.target is aten.unflatten.int) and isinstance(self.state[ins[0]], int):
            return self._view(node, ins[0])
        dims = {a: self.state[a] for a in ins}
        out_dim, _groups, fused, why = shard_rule(node, dims, ins)
        if why and node.target in _NORMS and all(a in self.seq for a in ins):
            out_dim, why = self._norm_of_positions(node, dims[ins[0]])
        elif why and self.node_layer.get(node) in self.routers and all(a in self.seq for a in ins):
            out_dim, why = self._router_op(node, dims[ins[0]])
        # Pieces: an op taking one of `fused` pieces finds it in this rank's part only if the source was split in
        # that many pieces (`Shard.fused`); operands split in different pieces do not line up.
        pieces = {self.pieces.get(a, 1) for a in ins}
        if len(pieces) > 1 or (fused > 1 and pieces != {fused}):
            why = why or "pieces do not line up"
        if why or out_dim is None:
            self._replace_inputs(node, {a: self.need(a, R, node) for a in ins})
            return self._run_local(node, R)
        glob = node.meta.get("val")
        seq = any(a in self.seq for a in ins)
        # Whole operands with the full split dimension. Attention and matmuls over split heads take each rank's
        # part of them (a replicated K/V under GQA). An elementwise op meeting a whole tensor (the residual add
        # of a split embedding output) gathers its split inputs instead: the residual stream stays whole, as the
        # TP solver's cost model assumes (one conversion at the source, not one per block).
        if isinstance(glob, torch.Tensor) and isinstance(out_dim, int) and node.target is not aten.linear.default:
            whole = []
            for a in node.all_input_nodes:
                va = self.val.get(a)
                if a in dims or not isinstance(va, torch.Tensor) or va.dim() == 0:
                    continue
                aligned = out_dim - (glob.dim() - va.dim())
                if aligned >= 0 and va.shape[aligned] != 1 and va.shape[aligned] == glob.shape[out_dim]:
                    whole.append((a, aligned))
            if whole and not seq and (node.target not in BATCHED_OPS or pieces != {1}):
                self._replace_inputs(node, {a: self.need(a, R, node) for a in ins})
                return self._run_local(node, R)
            for a, aligned in whole:
                node.replace_input_with(a, self.need(a, aligned, node))
        if seq:  # a parameter broadcast over this rank's part of the sequence: its gradient is a partial sum
            for a in node.all_input_nodes:
                if a in self.param_of and self.state.get(a, R) == R and self.val[a].is_floating_point():
                    node.replace_input_with(a, self.grad_sum(a, node))
            self.seq.add(node)
        if pieces != {1} and fused == 1:
            self.pieces[node] = pieces.pop()
        if isinstance(out_dim, tuple):  # split / native_dropout: one split dim per output; getitem picks one
            self._rewrite_sizes(node, None)
            return self._run_local(node, _Multi(out_dim))
        self._rewrite_sizes(node, out_dim)
        self._run_local(node, out_dim)
        self._check_local(node, out_dim)
        if node in self.sums:
            self._to_stream(node, "the sum of colwise embeddings")

    def _norm_of_positions(self, node: Node, d: int):
        """(out dim, why-not) of a layer norm (or RMS norm) of a tensor split along the sequence dim `d`: per
        position when it normalizes only dims after `d`."""
        x = node.args[0].meta["val"]
        if not isinstance(d, int) or d >= x.dim() - len(node.args[1]):
            return None, "norm over the split dimension"
        if node.target is aten.native_layer_norm.default:
            return _Multi((d, d, d)), ""
        return d, ""

    def _check_local(self, node: Node, out_dim: int) -> None:
        glob = node.meta.get("val")
        if isinstance(glob, torch.Tensor):
            want = _local_shape(glob.shape, out_dim, self.t, f"{node.name} ({self._where(node)})")
            if list(self.val[node].shape) != want:
                raise PartcError(f"tensor parallelism: {node.target} ({node.name}, in {self._where(node)}) gives "
                                 f"local shape {list(self.val[node].shape)}, expected {want}; the rewrite cannot "
                                 f"prove it correct, so set the layers feeding it to 'replicate'")

    def _view(self, node: Node, x: Node) -> None:
        """A view (or unflatten) of a split tensor: the split lands where `view_split` proves it on every rank's
        part, with the pieces it leaves (the batch merged before the heads keeps B pieces, a fused projection
        viewed as (3, heads, ...) none); else the input is gathered."""
        split = view_split(tuple(x.meta["val"].shape), tuple(node.meta["val"].shape), self.state[x],
                           self.pieces.get(x, 1), self.t)
        if split is None:
            node.replace_input_with(x, self.need(x, R, node))
            return self._run_local(node, R)
        out_dim, pieces = split
        if pieces > 1:
            self.pieces[node] = pieces
        if x in self.seq:
            self.seq.add(node)
        self._rewrite_sizes(node, out_dim)
        self._run_local(node, out_dim)
        self._check_local(node, out_dim)

    def _rewrite_sizes(self, node: Node, out_dim) -> None:
        glob = node.meta.get("val")
        t = node.target
        if t in VIEW_OPS or t is aten.expand.default:
            sizes = list(node.args[1])
            local = _local_shape(glob.shape, out_dim, self.t, f"{node.name} ({self._where(node)})")
            new = [-1 if s == -1 else local[i] for i, s in enumerate(sizes)]
            node.args = (node.args[0], new, *node.args[2:])
        elif t is aten.unflatten.int:  # unflatten(x, d, sizes): the sizes are the output's dims d, d+1, ...
            sizes = list(node.args[2])
            local = _local_shape(glob.shape, out_dim, self.t, f"{node.name} ({self._where(node)})")
            d = _norm(node.args[1], node.args[0].meta["val"].dim())
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

    def _colwise_embedding_to_sequence(self, node: Node, layer: Layer) -> None:
        """Under sequence parallelism, a colwise Embedding's output (its features split) enters the stream split
        along the sequence instead: all-gathered over its features (backward: this rank's part), then this rank's
        part of the sequence kept (backward: the gradient all-gathered over the sequence). Added only to other
        colwise embeddings' outputs (GPT's token and learned position embeddings), it stays split over the
        features and their sum enters the sequence split (`_embedding_sum`)."""
        add = self._embedding_sum(node)
        if add is not None:
            self.sums.add(add)
            return
        self._to_stream(node, f"colwise {layer.fqn}'s output")

    def _to_stream(self, node: Node, what: str) -> None:
        """`node`, split over its features, all-gathered over them and split along the sequence for its readers
        (one line in `sequence_gathers` where it has no sequence dim: then it is gathered whole)."""
        d = self.seq_dim(node)
        if d is None:
            self.result.sequence_gathers.append(
                f"{what} has no sequence dim: gathered whole (tensor parallelism)")
            return
        users = list(node.users)
        out = self._split_sequence(self.need(node, R, node), C.scatter_to_tp, d,
                                   f"{what} gathered, each rank keeping 1/{self.t} of the "
                                   f"sequence (all-gather of its gradient backward)", node)
        for u in users:
            u.replace_input_with(node, out)

    def _embedding_sum(self, node: Node) -> Node | None:
        """The add that is the only reader of `node`, a colwise embedding's output, where every operand of it is
        a colwise embedding's output (`ModelGraph.sums`: the TP solver converts such a sum once, charged to its
        last member): under sequence parallelism it runs on the feature shards and its output enters the
        sequence split once, as Megatron-LM scatters the embeddings' sum. None otherwise."""
        users = list(node.users)
        if len(users) != 1 or users[0].target is not aten.add.Tensor:
            return None
        add = users[0]
        for a in add.all_input_nodes:
            fqn = self.node_layer.get(a)
            layer = self.layers.get(fqn) if fqn else None
            if layer is None or layer.kind != "embedding" or self.styles.get(fqn) != "colwise" or \
                    a.target is not aten.embedding.default or len(a.users) != 1:
                return None
        return add if len(add.all_input_nodes) > 1 else None

    def _view_to_sequence(self, node: Node) -> tuple[Node, int] | None:
        """(view, its sequence dim) where a rowwise output without a sequence dim (Hugging Face's Conv1D: the
        `addmm` of the flattened tokens, [b*s, h]) is read only by a view to a shape with one that keeps the last
        dim ([b, s, h]): the partial sums are summed after that view instead (a view of the ranks' partial sums is
        the partial sums of the view, and the bias, broadcast over the last dim, adds alike on either shape)."""
        users = list(node.users)
        if len(users) != 1 or users[0].target not in VIEW_OPS or users[0].args[0] is not node:
            return None
        view = users[0]
        glob, out = node.meta.get("val"), view.meta.get("val")
        if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.shape[-1] != glob.shape[-1]:
            return None
        d = self.seq_dim(view)
        return None if d is None else (view, d)

    def _split_layer(self, node: Node, layer: Layer, style: str, kind: str) -> None:
        t = self.t
        if kind == "embedding":
            weight, ids = node.args[0], node.args[1]
            if style == "colwise":  # embedding dim split
                self._run_local(node, node.meta["val"].dim() - 1)
                if self.sp:
                    self._colwise_embedding_to_sequence(node, layer)
                return None
            # rowwise: vocabulary split; masked lookup of this rank's rows, then sum over ranks.
            with self.graph.inserting_after(node):
                lookup = self.graph.call_function(C.masked_embedding, (weight, ids))
            lookup.meta = {k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta}
            lookup.meta["val"] = node.meta["val"]
            lookup.meta["partc_why"] = f"{layer.fqn} holds vocabulary rows [rank*V/{t}, (rank+1)*V/{t}): other ids " \
                                       f"give zeros"
            node.replace_all_uses_with(lookup)
            self.graph.erase_node(node)
            self.val[lookup], self.state[lookup] = node.meta["val"], P
            d = self.seq_dim(node)
            if d is None and self.sp:
                self.result.sequence_gathers.append(
                    f"rowwise {layer.fqn}'s output has no sequence dim: all-reduced (tensor parallelism)")
            out = self._to_sequence(lookup, d, f"rowwise {layer.fqn}") if d is not None else \
                self._insert(lookup, C.reduce_from_tp, (lookup,), f"sum the vocabulary shards of rowwise {layer.fqn}",
                             lookup, node.meta["val"], R)
            lookup.replace_all_uses_with(out, delete_user_cb=lambda u: u is not out)
            return None
        x = node.args[1] if kind == "addmm" else node.args[0]
        if style == "colwise" and x in self.seq:  # before the first colwise reader: in its unit and pipeline stage
            node.replace_input_with(x, self._gather_sequence(x, node, f"input of colwise {self._where(node)}"))
        elif style == "colwise":
            if self.sp:
                self.result.sequence_gathers.append(
                    f"colwise {layer.fqn} reads {x.name}, not split along the sequence: identity forward, "
                    f"all-reduce of its gradient backward (tensor parallelism)")
            xr = self.need(x, R, node)
            xc = self.copy_to_tp(xr, node)
            node.replace_input_with(x, xc)
        if style == "colwise":
            self._run_local(node, node.meta["val"].dim() - 1)
            if layer.fused > 1:
                self.pieces[node] = layer.fused
            return None
        # rowwise: the input split on its features; partial outputs summed, then the bias added once.
        head = self.sp and bool(node.users) and all(u.op == "output" for u in node.users)
        if head:  # the model's output: all-reduced, its input the stream gathered (SP's edge, not a fallback)
            self.heads.add(node)
        xs = self.need(x, x.meta["val"].dim() - 1, node)
        if kind == "linear":
            bias = node.args[2] if len(node.args) > 2 else None
            node.args = (xs, node.args[1], None)
        else:  # addmm(bias, x, w) -> mm(x, w)
            bias = node.args[0]
            node.target = aten.mm.default
            node.args = (xs, node.args[2])
        self._run_local(node, P)
        users = list(node.users)
        d = None if head else self.seq_dim(node)
        through = self._view_to_sequence(node) if d is None and self.sp and not head else None
        if through is not None:  # summed after the view back to [b, s, h]: the view runs on the partial sums
            view, d = through
            self._run_local(view, P)
            self.done.add(view)
            users = list(view.users)
            out = self._to_sequence(view, d, f"rowwise {layer.fqn} (after the view of its flat tokens)")
        elif d is not None:
            out = self._to_sequence(node, d, f"rowwise {layer.fqn}")
        else:
            if self.sp and not head:
                self.result.sequence_gathers.append(
                    f"rowwise {layer.fqn}'s output {node.name} has no sequence dim: all-reduced (tensor parallelism)")
            out = self._insert(node, C.reduce_from_tp, (node,),
                               f"sum the partial outputs of rowwise {layer.fqn} (all-reduce forward, identity "
                               f"backward)", node, self.val[node], R)
        final = out
        if bias is not None:
            with self.graph.inserting_after(out):
                final = self.graph.call_function(aten.add.Tensor, (out, bias))
            final.meta = {k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta}
            final.meta["val"] = self.val[out]
            final.meta["partc_why"] = f"bias of rowwise {layer.fqn}, added once after the sum"
            self.val[final], self.state[final] = self.val[out], self.state[out]
            if d is not None:
                self.seq.add(final)
                final.replace_input_with(bias, self.grad_sum(bias, final))
        for u in users:
            u.replace_input_with(view if through is not None else node, final)
        return None


def rewrite(ep: torch.export.ExportedProgram, node_layer: dict[Node, str], layers: dict[str, Layer],
            styles: dict[str, str], t: int, aliases: dict[str, list[str]], *,
            sequence_parallel: bool = False, keep_split: int | None = None, seq_len: int | None = None,
            regather: bool = False) -> Rewrite:
    """Rewrite `ep.graph` in place for TP degree `t` (with sequence parallelism where asked); returns the parameter
    splits and collectives. `aliases` maps a parameter FQN to every FQN of the same (tied) tensor; `keep_split`: the
    flat output left split over its last dimension (a colwise output layer's logits, for the vocab-parallel loss);
    `seq_len`: the tokens per sample (`ModelGraph.seq_len`), where the sequence parallelism looks for them;
    `regather`: under sequence parallelism, the colwise Linears' inputs gathered again in backward."""
    if t == 1:
        return Rewrite()
    return _Rewriter(ep, node_layer, layers, styles, t, aliases, sequence_parallel, keep_split, seq_len,
                     regather).run()
