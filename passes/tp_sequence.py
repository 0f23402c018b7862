"""Sequence parallelism in the tensor-parallel rewrite (Korthikanti et al. 2022, Megatron-Core's): where a value
enters, keeps and leaves the split along the sequence.

A rowwise output (Linear or vocabulary-split Embedding) is reduce-scattered along its sequence dim
(`reduce_scatter_to_sp`: S(seq)) instead of all-reduced; the glue after it (residual adds, dropout, norms:
`_generic` on the local part, where `shard_rule` proves each op per-position) keeps that split; a colwise layer
whose input is split so all-gathers it (`gather_from_sp`, its backward a reduce-scatter) instead of `copy_to_tp`.
A parameter applied to the local part of the sequence (a norm's weight, a rowwise bias added after the
reduce-scatter) has a partial gradient on each rank: it is read through `copy_to_tp`, whose backward all-reduces it
(`grad_sum`). A whole operand spanning the sequence (learned positions) is sliced to the local part. An op that
cannot be proven per-position gathers its input (`gather_from_tp`), as tensor parallelism does.
A mixture of experts split inside runs as Megatron-Core's: its router on the local part (`_routers`), the experts'
inputs all-gathered (`_gather_sequence`), their partial output reduce-scattered (`_partial_to_sequence`). A stream
that enters whole (a vision transformer's patches) is scattered at the first norm (`_enter_sequence`); a pooled
head's norm output is gathered (`_pools`). The sum of colwise embeddings (GPT's token and learned positions) is
added on the feature shards and enters the sequence split once (`_embedding_sum`); a rowwise output layer whose
output is the model's reads the final norm's output gathered and all-reduces its logits (`_heads`). Under
`sp_regather` the gathers before colwise Linears become one `linears_from_sp` each (`_fuse_regathers`).

`passes.tp_rewrite` calls these from its layer and op rewrites; the states and conversions are `passes.tp_local`'s.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from partc.errors import PartcError
from partc import collectives as C
from partc.ir import Layer
from partc.passes.shard import VIEW_OPS
from partc.passes.tp_local import P, R, LocalRewriter, Multi, local_shape, norm_dim

aten = torch.ops.aten


class SequenceRewriter(LocalRewriter):
    """The rewrite's steps for sequence parallelism (`self.sp`: asked for, and tp > 1)."""

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

    def _to_sequence(self, x: Node, d: int, what: str) -> Node:
        """The partial sums `x` reduce-scattered along the sequence dim `d` (instead of all-reduced)."""
        return self._split_sequence(x, C.reduce_scatter_to_sp, d,
                                    f"sum the partial outputs of {what}, each rank keeping 1/{self.t} of the sequence "
                                    f"(reduce-scatter forward, all-gather backward)", x)

    def _split_sequence(self, x: Node, fn, d: int, why: str, anchor: Node) -> Node:
        """`fn(x, d)` inserted after `x`, a collective that leaves each rank 1/t of `x` along its sequence dim `d`
        (`reduce_scatter_to_sp`, `scatter_to_tp`), with its local shape; its output is split along the sequence."""
        v = self.val[x]
        local = torch.empty(local_shape(v.shape, d, self.t, x.name), dtype=v.dtype, device="meta")
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
        The plan charges it (`passes.cost_tp.unit_collectives`): an all-gather forward, nothing backward (the head is
        whole, its gradient the same on every rank)."""
        src = self.layers.get(self.node_layer.get(x, ""))
        return src is not None and src.kind == "norm" and self.node_layer.get(user) is None

    def _heads(self, x: Node, user: Node) -> bool:
        """Whether gathering `x` (split along the sequence) for `user` is the edge of a rowwise output layer
        (`heads`): the output of a norm (the final norm) read by it. The plan charges it
        (`passes.cost_tp.unit_collectives`): an all-gather forward, nothing backward."""
        src = self.layers.get(self.node_layer.get(x, ""))
        return user in self.heads and src is not None and src.kind == "norm"

    def _norm_of_positions(self, node: Node, d: int):
        """(out dim, why-not) of a layer norm (or RMS norm) of a tensor split along the sequence dim `d`: per
        position when it normalizes only dims after `d`."""
        x = node.args[0].meta["val"]
        if not isinstance(d, int) or d >= x.dim() - len(node.args[1]):
            return None, "norm over the split dimension"
        if node.target is aten.native_layer_norm.default:
            return Multi((d, d, d)), ""
        return d, ""

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
            if norm_dim(dim, x.dim()) != d:
                return Multi((d, d)), ""
        return None, "op not known to be per-position"

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