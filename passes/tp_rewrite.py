"""Rewrite an exported graph for tensor parallelism: local weight shards, local shapes, explicit collectives.

Every value is R (whole), S(d) (split along dim d) or P (partial sums) on a TP rank (`passes.tp_local`, with the
conversions between them). The plan's `tp` map fixes each layer's style (Megatron-LM, Shoeybi et al. 2019):

    colwise   Linear weight [out, in] split on out (HF Conv1D [in, out] on out); input R through `copy_to_tp`
              (identity forward, all-reduce backward); output S(last). A fused projection (GPT-2's c_attn) is split
              per piece, so every rank gets its own heads of q, of k and of v: the split or the slices that take
              one piece (Phi-3's qkv[..., h:2h] -> [h/t:2h/t]) find it in the local part, and a reader of the
              whole output gets the gathered parts put back in piece order.
    rowwise   weight split on in; input S(last); output P, then `reduce_from_tp` (all-reduce forward, identity
              backward) and the bias added once.
    Embedding rowwise: vocabulary rows split, masked lookup then `reduce_from_tp`; colwise: embedding dim split.
    inner     a mixture of experts split inside (`partc.passes.experts`): its ops' states from that analysis.
    replicate whole weights, R inputs and outputs.

Sequence parallelism (activations between the tensor-parallel layers split along the sequence) is
`passes.tp_sequence`'s: this rewrite calls it where a layer's input or output meets the sequence split.

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

from dataclasses import dataclass, field

import torch
import torch.fx
from torch.export.graph_signature import InputKind
from torch.fx import Node

from partc.errors import PartcError
from partc import collectives as C
from partc.ir import Layer
from partc.passes.experts import inner_split
from partc.passes.shard import BATCHED_OPS, VIEW_OPS, shard_rule, view_split
from partc.passes.tp_local import P, R, Multi, local_shape
from partc.passes.tp_sequence import SequenceRewriter
from partc.sharding import Shard, param_shard, weight_names

aten = torch.ops.aten
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


class _Rewriter(SequenceRewriter):
    """The pass over the graph in order: each layer by its style (`_split_layer`, `_inner_node`), the ops between
    layers by what `shard_rule` proves (`_generic`)."""

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
        self.val[node] = torch.empty(local_shape(val.shape, shard.dim, self.t, fqn), dtype=val.dtype,
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
            self._run_local(node, Multi(state))
        else:
            self._rewrite_sizes(node, state)
            self._run_local(node, state)
        glob, local = node.meta.get("val"), self.val[node]
        if isinstance(glob, torch.Tensor):
            want = list(glob.shape) if state in (R, P) else \
                local_shape(glob.shape, state, self.t, f"{node.name} ({layer.fqn})")
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

    def _generic(self, node: Node) -> None:
        ins = [a for a in node.all_input_nodes if isinstance(self.state.get(a), (int, Multi))]
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
            return self._run_local(node, Multi(out_dim))
        self._rewrite_sizes(node, out_dim)
        self._run_local(node, out_dim)
        self._check_local(node, out_dim)
        if node in self.sums:
            self._to_stream(node, "the sum of colwise embeddings")

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