"""What a run of a plan needs to know about the user's model, found in the model and its trace: one line each,
printed by the CLI as ``warning: LINE`` (`CompileResult.warnings`).

Training batch norms (statistics per micro-batch and dp rank), buffers the forward writes, the user's
torch.utils.checkpoint calls, sizes that depend on values, a tp degree that splits nothing, and initial values partc
cannot reproduce.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from partc.deferred_init import InitRecord
from partc.errors import PartcError
from partc.frames import innermost, stack_trace_frames
from partc.ir import ModelGraph
from partc.passes.tp import TPSolution
from partc.passes.trace import Traced


@dataclass(kw_only=True, slots=True)
class BatchNorms:
    layers: list[str]
    """FQNs of the BatchNorm modules in training mode, in module order."""
    single: list[str]
    """Those that see one value per channel in a sample (a 1 x 1 map, or BatchNorm1d on features)."""


def batch_norms(model: torch.nn.Module, traced: Traced) -> BatchNorms:
    layers = [n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
              and m.training]
    single = []
    for node in traced.exported.graph.nodes:
        x = node.args[0].meta.get("val") if node.op == "call_function" and "batch_norm" in str(node.target) \
            and node.args and isinstance(node.args[0], torch.fx.Node) else None
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.numel() == x.shape[1]:  # one sample's values
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            single.append(stack[-1][0] if stack else node.name)
    return BatchNorms(layers=layers, single=single)


def refuse_single_value_norms(norms: BatchNorms) -> None:
    raise PartcError(f"BatchNorm {norms.single[0]} sees one value per channel in a sample: it cannot train on "
                     f"micro-batches of 1 sample; use a micro-batch size of 2 or more")


def batch_norm_note(norms: BatchNorms, par) -> str:
    where = f" on each of {par.dp} data-parallel ranks" if par.dp > 1 else ""
    return (f"BatchNorm statistics ({len(norms.layers)} layers, {norms.layers[0]} first) are computed over each "
            f"micro-batch of {par.micro_batch_size} samples{where}, not over the global batch of "
            f"{par.global_batch_size}: the loss differs from one process's on the whole batch (partc does not "
            f"offer SyncBatchNorm)")


def written_buffers(model: torch.nn.Module, traced: Traced) -> dict[str, str]:
    """Buffers the forward writes in place (an EMA, a counter: ``self.running.mul_(0.9).add_(...)``), other than
    BatchNorm's (stated by `batch_norm_note`): FQN -> ``file:line`` of the first write. An op writes a buffer when
    its schema marks an argument written and that argument is the buffer or a view of it."""
    ep = traced.exported
    buffers = {spec.arg.name: spec.target for spec in ep.graph_signature.input_specs
               if spec.kind == torch.export.graph_signature.InputKind.BUFFER}
    norms = {n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    found: dict[str, str] = {}

    def base(x):
        while isinstance(x, torch.fx.Node) and x.op == "call_function" and isinstance(x.target, torch._ops.OpOverload) \
                and x.args and x.target._schema.returns and x.target._schema.returns[0].alias_info is not None:
            x = x.args[0]  # an in-place op or a view returns (an alias of) its first argument
        return x

    for node in ep.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        schema = node.target._schema
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            x = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            fqn = buffers.get(getattr(base(x), "name", None)) if isinstance(x, torch.fx.Node) else None
            if fqn is None or fqn in found or fqn.rpartition(".")[0] in norms:
                continue
            frame = innermost(stack_trace_frames(node.meta.get("stack_trace")))
            found[fqn] = f"{os.path.basename(frame.filename)}:{frame.lineno}" if frame is not None else node.name
    return found


def written_buffers_note(written: dict[str, str], par) -> str:
    names = sorted(written)
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    where = f" on each of {par.dp} data-parallel ranks, each rank writing its own copy" if par.dp > 1 else ""
    return (f"buffer{'s' if len(names) > 1 else ''} {', '.join(names[:3])}{more} ({written[names[0]]}) "
            f"{'are' if len(names) > 1 else 'is'} written in forward: once per micro-batch of {par.micro_batch_size} "
            f"sample{'s' if par.micro_batch_size > 1 else ''} ({par.num_microbatches} a step){where}, where one process on the global batch of "
            f"{par.global_batch_size} writes once a step: {'their values differ' if len(names) > 1 else 'its value differs'}"
            f" from one process's, and so may the loss")


def checkpoint_note(calls: list[str], par) -> str:
    where = ", ".join(sorted(set(calls))[:3])
    return (f"the model calls torch.utils.checkpoint ({where}); partc does not keep it: the plan's recompute "
            f"({par.recompute}) decides what backward recomputes (--recompute full recomputes every unit)")


def expected_sizes_note(sizes: dict) -> str:
    """One line for a model whose tensor sizes depend on values (`partc.value_sized`)."""
    return (f"sizes depend on values: {sizes['op']} at {sizes['where']} (one of {sizes['groups']} per routed "
            f"tensor) is priced and checked at the expected 1/{sizes['groups']} of its elements each (uniform "
            f"routing); the program runs at the real sizes, and no pipeline boundary cuts a tensor of such a size")


def tp_unsplit_note(graph: ModelGraph, sol: TPSolution, tp: int) -> str | None:
    """One line when tensor parallelism at degree `tp` > 1 splits no layer at all, with the first reason."""
    if tp == 1 or any(s != "replicate" for s in sol.styles.values()):
        return None
    linear = [f for f in sol.why if graph.layers[f].kind in ("linear", "embedding")]
    first = (linear or list(sol.why) or [None])[0]
    example = f" ({first}: {sol.why[first]})" if first else ""
    return f"tp {tp} splits no layer of the model: each GPU of a tp group holds and computes all of it{example}; " \
           f"tp_why in plan.json says why for each layer"


def init_warnings(init: InitRecord) -> list[str]:
    """Notes on the record (an initializer that failed on meta), then a line for the parameters and one for the
    buffers whose initial values partc cannot reproduce."""
    lines = list(init.notes)
    for kind, then in (("parameter", "a run without --init-checkpoint FILE stops"),
                       ("buffer", "without --init-checkpoint FILE they start uninitialized")):
        names = [n for n in init.problems if (n in init.parameters) == (kind == "parameter")]
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            lines.append(f"partc cannot reproduce the initial value of {kind} {', '.join(names[:3])}{more} "
                         f"({init.problems[names[0]]}); {then}")
    return lines
