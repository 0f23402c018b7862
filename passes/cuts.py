"""What crosses a pipeline boundary placed after each unit, from the exported graph.

A boundary after unit i carries every value produced at or before unit i and read after it. Values that depend on a
user input carry the batch and scale with the micro-batch size; values computed from parameters, buffers and
constants alone (Hugging Face's rotary cos/sin tables, 1 x s x head_dim, broadcast over the batch) cross once a
micro-batch whatever its size; a value built from a size of 1 (at one sample, maybe the batch: Hugging Face's causal
mask is expanded to it) is taken to carry the batch. Both are kept apart (`ModelGraph.cut_bytes`, `ModelGraph.cut_fixed_bytes`), and so
is the part that needs a gradient (a pipeline sends that back).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.fx

from partc.ir import Unit
from partc.value_sized import VALUE_SIZED
from partc.passes.measure import NodeStats, activation_bytes
from partc.passes.rebatch import sizes_hold_one

if TYPE_CHECKING:
    from partc.passes.assign import Assignment


@dataclass(kw_only=True, slots=True)
class Cuts:
    """What crosses a pipeline boundary placed after each unit (all but the last), as `ModelGraph` keeps it."""
    per_sample: list[int]
    """Bytes per sample of the tensors that carry the batch (they scale with the micro-batch size)."""
    grad_per_sample: list[int]
    """The part of `per_sample` that needs a gradient."""
    fixed: list[int]
    """Bytes per micro-batch of the tensors that do not depend on a batched input (rotary tables broadcast over
    the batch): sent once a micro-batch, whatever its size."""
    grad_fixed: list[int]
    """The part of `fixed` that needs a gradient."""
    fixed_seq: list[int]
    """The part of `fixed` in tensors along the sequence (a dim of the sample's tokens: rotary tables)."""
    grad_fixed_seq: list[int]
    """The part of `fixed_seq` that needs a gradient."""
    layer_outputs: list[dict[str, tuple[int, int, int]]]
    """Per boundary: layer FQN -> (bytes per sample, per micro-batch, of those along the sequence) of that layer's
    own output crossing it (`layer_outputs`; empty where none does), as `per_sample`, `fixed` and `fixed_seq` count
    it. A colwise layer's output crosses as each TP rank's part (`passes.cost_step.gather_bytes`)."""


def batched_nodes(ep: torch.export.ExportedProgram) -> set[torch.fx.Node]:
    """The nodes whose value may carry the batch: those that depend on a user input (every user input carries the
    batch) or on a size of 1 (`sizes_hold_one`: at one sample, the batch size itself). What depends only on
    parameters, buffers, constants and other sizes (a rotary table from the sequence positions) is the same for any
    micro-batch size."""
    user = {spec.arg.name for spec in ep.graph_signature.input_specs
            if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT}
    batched: set[torch.fx.Node] = set()
    for n in ep.graph.nodes:
        if n.op == "placeholder":
            if n.name in user:
                batched.add(n)
        elif n.op == "call_function" and (any(x in batched for x in n.all_input_nodes) or sizes_hold_one(n)):
            batched.add(n)
    return batched


def pipeline_cuts(ep: torch.export.ExportedProgram, a: Assignment, units: dict[str, Unit],
                  stats: dict[torch.fx.Node, NodeStats], seq_len: int | None = None,
                  layer_out: dict[str, torch.fx.Node] | None = None) -> Cuts:
    """The bytes crossing a pipeline boundary after each unit (all but the last), per sample for what carries the
    batch and per micro-batch for what does not (and of that, what lies along the `seq_len` tokens); sets each
    unit's `input_bytes` (what enters it from elsewhere)."""
    unit_index = {u: i for i, u in enumerate(a.unit_names)}
    producer_pos: dict[torch.fx.Node, int] = {}
    for n in ep.graph.nodes:
        if n.op == "placeholder":
            producer_pos[n] = -1
        elif n.op == "call_function":
            producer_pos[n] = unit_index.get(a.node_unit[n], -1)
    param_nodes = {spec.arg.name for spec in ep.graph_signature.input_specs
                   if spec.kind != torch.export.graph_signature.InputKind.USER_INPUT}
    batched = batched_nodes(ep)
    # diffs[batched, gradient]: difference arrays over the boundaries of the bytes that carry the batch or not, all
    # of them (gradient False) or the part that needs a gradient (True)
    diffs = {key: [0] * (len(a.unit_names) + 1) for key in ((True, False), (True, True), (False, False), (False, True),
                                                            ("seq", False), ("seq", True))}
    input_bytes: dict[str, int] = defaultdict(int)
    out_layer = {n: m for m, n in (layer_out or {}).items()}
    outputs: list[dict[str, tuple[int, int, int]]] = [{} for _ in range(max(len(a.unit_names) - 1, 0))]
    for n, pu in producer_pos.items():
        if n.op == "placeholder" and n.name in param_nodes:
            continue
        consumers = {unit_index[a.node_unit[u]] for u in n.users if u.op == "call_function" and a.node_unit.get(u)}
        if not consumers:
            continue
        nbytes = val_bytes(n)
        for c in consumers:
            if c != pu:
                input_bytes[a.unit_names[c]] += nbytes
        last = max(consumers)
        start = max(pu, 0)
        if last > start:
            grad = n in stats and stats[n].requires_grad
            along = n not in batched and bool(seq_len) and seq_len > 1 and _along(n, seq_len)
            for g in {False, grad}:
                diffs[n in batched, g][start] += nbytes
                diffs[n in batched, g][last] -= nbytes
                if along:
                    diffs["seq", g][start] += nbytes
                    diffs["seq", g][last] -= nbytes
            if n in out_layer:
                for i in range(start, last):
                    outputs[i][out_layer[n]] = (nbytes, 0, 0) if n in batched else (0, nbytes, nbytes if along else 0)
    for u, b in input_bytes.items():
        units[u].input_bytes = b
    sums = {key: list(itertools.accumulate(d[:len(a.unit_names) - 1])) for key, d in diffs.items()}
    return Cuts(per_sample=sums[True, False], grad_per_sample=sums[True, True], fixed=sums[False, False],
                grad_fixed=sums[False, True], fixed_seq=sums["seq", False], grad_fixed_seq=sums["seq", True],
                layer_outputs=outputs)


def _along(n: torch.fx.Node, seq_len: int) -> bool:
    """Whether `n`'s value has a dim of `seq_len` (the sequence)."""
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and seq_len in tuple(v.shape)


def realizable_cuts(a: Assignment) -> tuple[list[bool], list[bool]]:
    """For each boundary after a unit (all but the last): whether no op of a unit before it reads an op of a unit
    after it (codegen's stages follow data flow) and no value whose size depends on tensor values crosses it; and
    whether one does (`partc.value_sized.VALUE_SIZED`: a mixture's routed tokens; the pipeline's send and receive
    need shapes known before the step)."""
    pos = {u: i for i, u in enumerate(a.unit_names)}
    ok = [True] * max(len(a.unit_names) - 1, 0)
    sized = [False] * len(ok)
    for n in a.nodes:
        if a.node_unit.get(n) is None:
            continue
        for x in n.all_input_nodes:
            if a.node_unit.get(x) is None:
                continue
            if pos[a.node_unit[x]] > pos[a.node_unit[n]]:
                for i in range(pos[a.node_unit[n]], pos[a.node_unit[x]]):
                    ok[i] = False
            elif x.meta.get(VALUE_SIZED):
                for i in range(pos[a.node_unit[x]], pos[a.node_unit[n]]):
                    ok[i], sized[i] = False, True
    return ok, sized


def val_bytes(n: torch.fx.Node) -> int:
    """Bytes of the tensors a node's value holds (one or a tuple)."""
    val = n.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    return sum(activation_bytes(v) for v in vals if isinstance(v, torch.Tensor))
