"""Which losses can run on the vocabulary shards of the output layer (`partc.collectives.vocab_parallel_cross_entropy`).

Under tensor parallelism a colwise output layer leaves each tp rank its columns [r·V/t, (r+1)·V/t) of the logits.
Megatron-LM computes the cross-entropy from those parts (the row maxima and sums of exponentials all-reduced, the
target's logit from the rank that owns it) instead of gathering the logits whole. partc does so when it can prove
the loss is that cross-entropy: it traces ``loss_fn(outputs, targets)`` on meta tensors (`torch.fx`'s ``make_fx``,
ATen ops) and matches the graph (`match`):

    logits -> ops that keep the vocabulary the last dimension, whole and in order
              (view / reshape keeping the last size, slices and selects of other dims, dtype casts, copies)
           -> log_softmax over the last dimension -> nll_loss (no class weights, mean) -> the loss, nothing else

Every other input (the targets, their shifts and flattenings) may go through any ops that do not read the logits.
That covers partc's default loss (``F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=-100)``),
``F.cross_entropy`` on the logits in a model file's ``loss_fn`` (shifted or not), and Hugging Face's causal-LM loss
with its mean reduction. Anything else (label smoothing, a weighted or summed loss, a second term) is not matched:
the logits are gathered as before and the plan says why (``tp_loss``).

`VocabParallelLoss` runs the traced graph again on the local logits: the matched ops on this rank's columns (a
view's last size becomes V/t), and the log_softmax with nll_loss replaced by the vocab-parallel cross-entropy.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx

from partc._torch import TorchDispatchMode, tree_flatten, tree_unflatten
from partc.collectives import vocab_parallel_cross_entropy
from partc.errors import PartcError

aten = torch.ops.aten

VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
SAME = {aten._to_copy.default, aten.clone.default, aten.alias.default, aten.contiguous.default}
"""Ops that keep every element where it is (a dtype cast, a copy)."""
OTHER_DIM = {aten.slice.Tensor, aten.select.int}
"""Ops on a dimension given as their second argument: allowed on any but the vocabulary's."""

VOCAB_PARALLEL = "vocab-parallel"


@dataclass(frozen=True, slots=True)
class Match:
    """A loss proven to be the cross-entropy of one of the model's outputs."""

    output: int
    """The flat output (the model's outputs in `tree_flatten` order) whose last dimension is the vocabulary."""
    rows_per_sample: int
    """Logit rows (positions) the cross-entropy reads per sample: the loss's all-reduces move 3 floats each."""
    ignore_index: int


def trace_loss(loss_fn: Callable, structure: Callable[[list[Tensor]], Any], flat: list[Tensor],
               targets: Any) -> tuple[GraphModule, int]:
    """``loss_fn(structure(flat), targets)`` traced to ATen ops on the given (meta) tensors; returns the graph and
    how many of its leading placeholders are the model's outputs (the targets' leaves follow)."""
    leaves, spec = tree_flatten(targets)
    tensors = [i for i, t in enumerate(leaves) if isinstance(t, Tensor)]

    def fn(*args):
        outs, given = list(args[:len(flat)]), list(leaves)
        for i, t in zip(tensors, args[len(flat):]):
            given[i] = t
        return loss_fn(structure(outs), tree_unflatten(given, spec))

    gm = make_fx(fn)(*flat, *[leaves[i] for i in tensors])
    return gm, len(flat)


def match(gm: GraphModule, n_outputs: int, output: int, vocab: int, batch: int) -> Match | str:
    """`Match` when the traced loss `gm` is the mean cross-entropy of flat output `output` (last size `vocab`) at
    `batch` samples; else why not (a phrase)."""
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    logits = ph[output]
    for i, p in enumerate(ph[:n_outputs]):
        if i != output and p.users:
            return f"the loss reads another output of the model ({p.name})"
    x = logits
    while True:
        users = list(x.users)
        if len(users) != 1:
            return "the loss reads the logits more than once" if users else "the loss does not read the logits"
        node = users[0]
        if node.target in VIEWS:
            out = node.meta["val"]
            if x.meta["val"].shape[-1] != vocab or out.shape[-1] != vocab:
                return f"{node.target} reshapes the vocabulary dimension"
        elif node.target in OTHER_DIM:
            dim = node.args[1] if len(node.args) > 1 else 0
            if dim % x.meta["val"].dim() == x.meta["val"].dim() - 1:
                return f"{node.target} slices the vocabulary dimension"
        elif node.target in SAME:
            if node.target is aten._to_copy.default and set(node.kwargs) - {"dtype", "layout", "device"}:
                return f"{node.target} with {sorted(node.kwargs)}"
        elif node.target is aten._log_softmax.default:
            if node.args[1] % x.meta["val"].dim() != x.meta["val"].dim() - 1:
                return "log_softmax over another dimension than the vocabulary"
            break
        else:
            return f"the logits go through {node.target}, which partc does not see into"
        x = node
    lsm = node
    users = list(lsm.users)
    if len(users) != 1 or users[0].target is not aten.nll_loss_forward.default:
        return "the log-probabilities feed something other than one nll_loss"
    nll = users[0]
    if lsm.meta["val"].dim() != 2:
        return "the cross-entropy is not over rows of logits [N, V]"
    target, weight, reduction, ignore_index = nll.args[1], *nll.args[2:5]
    if weight is not None:
        return "the cross-entropy weighs the classes"
    if reduction != 1:
        return "the cross-entropy is not a mean (reduction='mean')"
    if _reads(target, logits):
        return "the targets are computed from the logits"
    out = gm.graph.output_node().args[0]
    out = out[0] if isinstance(out, (list, tuple)) and len(out) == 1 else out
    if not (isinstance(out, Node) and out.target is operator.getitem and out.args == (nll, 0)):
        return "the loss is more than the cross-entropy of the logits"
    rows = lsm.meta["val"].shape[0]
    if rows % batch:
        return "the loss's rows do not scale with the batch"
    return Match(output=output, rows_per_sample=rows // batch, ignore_index=int(ignore_index))


def _reads(node: Node, source: Node) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is source:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


class VocabParallelLoss:
    """The model file's loss on the local logits of a vocabulary-split output layer: the traced loss (`match`ed)
    run again with this rank's columns, its log_softmax and nll_loss replaced by `vocab_parallel_cross_entropy`."""

    def __init__(self, gm: GraphModule, n_outputs: int, found: Match, tp: int):
        self.gm, self.n_outputs, self.found, self.tp = gm, n_outputs, found, tp
        self.count: Tensor | None = None
        """The last call's tokens: its targets not ``ignore_index`` (the cross-entropy's ``total_weight``)."""
        self.rows = 0
        """The last call's targets, ignored or not."""

    def __call__(self, flat: tuple[Tensor, ...], targets: Any) -> Tensor:
        leaves, _ = tree_flatten(targets)
        args = list(flat) + [t for t in leaves if isinstance(t, Tensor)]
        env: dict[Node, Any] = {}
        logits = None
        for i, node in enumerate(n for n in self.gm.graph.nodes if n.op == "placeholder"):
            env[node] = args[i]
            if i == self.found.output:
                logits = node
        chain = {logits}
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                out = node.args[0]
                return env[out[0] if isinstance(out, (list, tuple)) else out]
            a = torch.fx.node.map_arg(node.args, env.__getitem__)
            kw = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
            if node.target is aten._log_softmax.default and node.args[0] in chain:
                env[node] = env[node.args[0]]  # the vocab-parallel cross-entropy takes the logits themselves
                continue
            if node.target is aten.nll_loss_forward.default and node.args[0].target is aten._log_softmax.default \
                    and node.args[0].args[0] in chain:
                loss = vocab_parallel_cross_entropy(a[0], a[1], self.found.ignore_index)
                self.count, self.rows = (a[1] != self.found.ignore_index).sum(), a[1].numel()
                env[node] = (loss, None)
                continue
            if node.args and node.args[0] in chain:
                chain.add(node)
                if node.target in VIEWS:
                    sizes = list(a[1])
                    sizes[-1] = sizes[-1] if sizes[-1] == -1 else sizes[-1] // self.tp
                    a = (a[0], sizes, *a[2:])
            env[node] = node.target(*a, **kw)
        raise AssertionError("the traced loss has no output")


def trace_program_loss(loss_fn: Callable, structure: Callable[[list[Tensor]], Any], local: list[Tensor],
                       targets: Any, output: int | None, tp: int) -> tuple[GraphModule, int]:
    """`trace_loss` of the last stage's outputs: meta tensors shaped like this rank's `local` ones (flat output
    `output`, split over the vocabulary, `tp` times wider: whole), in fp32 as the loss sees them."""
    flat = [torch.empty((*t.shape[:-1], t.shape[-1] * (tp if i == output else 1)) if t.dim() else t.shape,
                        dtype=torch.float32 if t.is_floating_point() else t.dtype, device="meta")
            for i, t in enumerate(local)]
    return trace_loss(loss_fn, structure, flat, targets)


def program_loss(gm: GraphModule, n: int, output: int, vocab: int, tp: int, batch: int) -> VocabParallelLoss:
    """The runtime's loss for a program whose last stage returns flat output `output` split over the vocabulary:
    the loss traced on the whole outputs (`trace_program_loss`; `vocab` the whole last dimension) and the
    micro-batch's targets, matched as at compile time."""
    found = match(gm, n, output, vocab, batch)
    if isinstance(found, str):
        raise PartcError(f"the program computes the loss on the vocabulary shards, but the model file's loss is no "
                         f"longer a cross-entropy partc can split ({found}); compile again")
    return VocabParallelLoss(gm, n, found, tp)


TOKENS = "tokens"
"""`reduction`: the loss is one nll_loss's mean over the rows it counts, its ``total_weight`` (the targets not
``ignore_index``, or their class weights): a count a micro-batch's targets decide."""
ELEMENTS = "elements"
"""`reduction`: the loss is a mean over every element of one tensor (``aten.mean``, a loss op's mean): as many in
every micro-batch and on every rank."""
NLL = {aten.nll_loss_forward.default, aten.nll_loss2d_forward.default}
MEAN_LOSSES = {aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default,
               aten.binary_cross_entropy.default, aten.binary_cross_entropy_with_logits.default,
               aten.soft_margin_loss.default}
"""Loss ops whose ``reduction`` argument 1 (mean) divides by the number of elements."""


def reduction(gm: GraphModule) -> str:
    """How the traced loss `gm` reduces over the batch: `TOKENS`, `ELEMENTS`, or why neither (a phrase).

    The runtime splits a global batch over micro-batches, dp and cp ranks and averages their losses. That average
    is the whole batch's loss for `ELEMENTS` (every part has as many elements); for `TOKENS` it is not when the
    parts count different numbers of tokens (ignored targets, Hugging Face's -100 labels), so the runtime sums the
    parts' token losses and divides by the tokens counted over the whole batch (`partc.runtime.train`), as
    Megatron-LM and torchtitan do. Any other loss (a second term beside a cross-entropy, label smoothing, a masked
    mean written by hand) is a mean over micro-batches and ranks, not proven to be the whole batch's."""
    out = gm.graph.output_node().args[0]
    out = out[0] if isinstance(out, (list, tuple)) and len(out) == 1 else out
    nll = [n for n in gm.graph.nodes if n.target in NLL]
    if len(nll) > 1:
        return "the loss holds several cross-entropies"
    if nll:
        if not (isinstance(out, Node) and out.target is operator.getitem and out.args == (nll[0], 0)):
            return "the loss is more than one cross-entropy (nll_loss), whose token count partc would weigh"
        if nll[0].args[3] != 1:
            return "the cross-entropy is not a mean (reduction='mean')"
        return TOKENS
    if isinstance(out, Node) and out.target is aten.mean.default:
        return ELEMENTS
    if isinstance(out, Node) and out.target is aten.mean.dim and out.meta["val"].dim() == 0:
        return ELEMENTS
    if isinstance(out, Node) and out.target in MEAN_LOSSES and \
            (out.args[2] if len(out.args) > 2 else out.kwargs.get("reduction", 1)) == 1:
        return ELEMENTS
    return "the loss is not a mean over the elements of one tensor or a cross-entropy's over its tokens"


SOFTMAX = {aten._log_softmax.default, aten._softmax.default}
"""Normalizations of one row: per position when over the last dim (the classes)."""


def moved_positions(gm: GraphModule) -> str:
    """The first op of the traced loss `gm` that may read one position's value at another (a shift of the targets,
    as Hugging Face's causal-LM loss pads its labels and drops the first, a slice, a roll), named; empty when every
    op keeps each position where it is (views, casts, elementwise ops, a softmax over the classes, the loss op).
    Under context parallelism each rank holds chunks of the sequence: a loss that moves positions would read its
    neighbours' tokens from its own chunk, so it is refused (`partc.compile_traces.context_graph`)."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        t = n.target
        if t in VIEWS | SAME | NLL | MEAN_LOSSES or t in (aten.mean.default, aten.mean.dim, aten.detach.default) or \
                torch.Tag.pointwise in getattr(t, "tags", ()):
            continue
        if t in SOFTMAX and n.args[1] in (-1, n.args[0].meta["val"].dim() - 1):
            continue
        return f"{t} ({n.name})"
    return ""


class CountTokens(TorchDispatchMode):
    """While active, ``count`` is the ``total_weight`` of the last nll_loss run (the tokens a `TOKENS` loss divides
    by), a tensor (no device synchronization), and ``rows`` the number of its targets."""

    def __init__(self):
        super().__init__()
        self.count: Tensor | None = None
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in NLL:
            self.count, self.rows = out[1].detach(), args[1].numel()
        return out
