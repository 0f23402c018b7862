"""The model traced again for what a plan needs beyond the layer graph: the model file's loss (to prove the
vocabulary-parallel loss, `find_vocab_loss`, and context parallelism's mean over tokens) and the model at one
cp rank's s/cp tokens (`context_graph`, the proof that it computes per position). `compile_model` asks for them
before and after its search; `make_program` builds the context-parallel program from `context_graph`'s graph.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from partc import vocab_loss
from partc._torch import tree_unflatten
from partc.errors import PartcError
from partc.model_file import ModelSpec
from partc.precision import cast_floating, compute_dtype
from partc.passes.assign import assign
from partc.passes.context import ContextSplit, analyze as analyze_context, local_inputs
from partc.passes.experts_ep import token_wise_nodes
from partc.passes.export import export_on_meta
from partc.passes.trace import Traced


def meta_inputs(spec: ModelSpec, batch_size: int, precision: str) -> tuple[tuple, dict]:
    """The model's example inputs on meta, floating-point ones in the compute dtype (as the runtime feeds them)."""
    with torch.device("meta"):
        args, kwargs = spec.inputs(batch_size)
    return cast_floating((args, kwargs), compute_dtype(precision))


def find_vocab_loss(spec: ModelSpec, model: torch.nn.Module, traced: Traced) -> tuple[dict, str]:
    """(`ModelGraph.vocab_loss`, why not): the model output that is an output layer's logits (the layer's linear,
    then at most casts and views that keep its last dimension), with the loss traced on meta and proven to be the
    mean cross-entropy of those logits (`partc.vocab_loss.match`)."""
    ep, graph = traced.exported, traced.graph
    readers = {e.src for e in graph.edges if e.src != e.dst}
    heads = {f for f, layer in graph.layers.items() if layer.kind == "linear" and f not in readers}
    node_layer = assign(ep, model).node_layer
    outs = list(ep.graph.output_node().args[0])
    found = []
    for i, o in enumerate(outs):
        x = o
        while isinstance(x, torch.fx.Node) and x.target in vocab_loss.SAME | vocab_loss.VIEWS and \
                x.args[0].meta["val"].shape[-1:] == x.meta["val"].shape[-1:]:
            x = x.args[0]
        fqn = node_layer.get(x) if isinstance(x, torch.fx.Node) else None
        if fqn in heads and x.target is torch.ops.aten.linear.default and \
                o.meta["val"].shape[-1] == graph.layers[fqn].out_features:
            found.append((i, fqn))
    if len(found) != 1:
        return {}, "no model output is one output layer's logits" if not found else \
            "several model outputs are output layers' logits"
    (i, fqn), = found
    gm = model_loss(spec, traced)
    if isinstance(gm, str):  # a loss partc cannot trace is gathered as before
        return {}, gm
    m = vocab_loss.match(gm, len(outs), i, graph.layers[fqn].out_features, 1)
    if isinstance(m, str):
        return {}, m
    return {"head": fqn, "output": i, "rows": m.rows_per_sample}, ""


def model_loss(spec: ModelSpec, traced: Traced) -> GraphModule | str:
    """The model file's loss traced to ATen ops on meta tensors shaped like the traced model's outputs at one sample
    (`partc.vocab_loss.trace_loss`); or why it could not be traced (a phrase)."""
    ep = traced.exported
    outs = list(ep.graph.output_node().args[0])
    flat = [torch.empty(o.meta["val"].shape, dtype=torch.float32 if o.meta["val"].is_floating_point()
                        else o.meta["val"].dtype, device="meta") for o in outs]
    try:
        with torch.device("meta"):
            targets = spec.targets(1)
        gm, _ = vocab_loss.trace_loss(spec.loss_fn, lambda f: tree_unflatten(f, ep.call_spec.out_spec), flat, targets)
    except Exception as e:  # noqa: BLE001 - the model file's code
        return f"the loss could not be traced on meta tensors ({type(e).__name__})"
    return gm


def context_graph(spec: ModelSpec, model: torch.nn.Module, traced: Traced, cp: int, *, path: str,
                  precision: str) -> tuple[torch.export.ExportedProgram, ContextSplit]:
    """The model exported at one sample of s/cp tokens, and the proof that it computes per position but for the
    ops `partc.passes.context` rewrites (PartcError naming the first op that mixes positions otherwise)."""
    seq_len = traced.graph.seq_len
    if not seq_len:
        raise PartcError(f"--cp {cp}: partc found no sequence in the model's inputs")
    args, kwargs = local_inputs(*meta_inputs(spec, 1, precision), seq_len, cp)
    with torch.device("meta"):
        targets = spec.targets(1)
    for t in torch.utils._pytree.tree_leaves(targets):
        if isinstance(t, torch.Tensor) and [d for d in range(1, t.dim()) if t.shape[d] == seq_len] == []:
            raise PartcError(f"--cp {cp}: a target of shape {list(t.shape)} has no dim of {seq_len} tokens; context "
                             f"parallelism needs a loss over the tokens (the mean over every token of the batch)")
    gm = model_loss(spec, traced)
    kind = gm if isinstance(gm, str) else vocab_loss.reduction(gm)
    if kind not in (vocab_loss.TOKENS, vocab_loss.ELEMENTS):
        raise PartcError(f"context parallelism (--cp {cp}) is not proven for this loss: {kind}; each cp rank's "
                         f"loss must be a mean over its tokens (a cross-entropy, whose counted tokens partc "
                         f"weighs) or over as many elements as every other rank's")
    moved = vocab_loss.moved_positions(gm)
    if moved:
        raise PartcError(f"context parallelism (--cp {cp}) is not proven for this loss: it moves positions "
                         f"({moved}: a shift of the targets or outputs along the sequence, as Hugging Face's "
                         f"causal-LM loss shifts its labels), and each cp rank holds only chunks of the sequence; "
                         f"give targets already aligned with the positions (examples/llama.py's loss_fn)")
    local = export_on_meta(model, args, kwargs, path=path, precision=precision)
    experts = token_wise_nodes(local, assign(local, model).node_layer, traced.graph.layers)
    return local, analyze_context(traced.exported, local, cp, seq_len, token_wise=experts)
