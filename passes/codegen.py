"""Write the sharded program: one readable Python file per pipeline stage, generated from the traced graph.

    generate = rewrite for TP -> name the graph's inputs -> place every node (stage, unit) -> liveness
               -> one function per unit and a forward per stage (`partc.passes.emit`) -> manifest

The exported graph (at the plan's micro-batch size: exported graphs carry concrete shapes) is rewritten in place
for the plan's TP styles (`partc.passes.tp_rewrite`), then split: a node goes with its unit (glue with the first
unit that uses it), a unit with its stage. Each unit becomes a function of straight-line ATen code that lets each
value go after its last use (``del``, as eager PyTorch frees an intermediate: a Python local would hold it to the
unit's end), and each stage's ``forward`` calls its units in order through ``run``:

    def blocks_0(p, embedding, *, device):
        # blocks.0.attn.qkv  gpt.py:71  q, k, v = self.qkv(x).split(h, dim=-1)
        linear_1 = aten.linear.default(layer_norm, p['blocks.0.attn.qkv.weight'], p['blocks.0.attn.qkv.bias'])
        del layer_norm
        ...

    def forward(p, input_ids, *, device, run=call):
        (embedding,) = run('tok', tok, p, input_ids, device=device)
        (add_3,) = run('blocks.0', blocks_0, p, embedding, device=device)

The default ``run`` calls the function; the runtime passes its own, which runs the unit as a module of its own (so
ZeRO shards and activation checkpointing wrap each unit, as torchtitan wraps each transformer block). A stage
receives exactly what the previous stage sends (the values live across its boundary, each once per micro-batch)
and sends what later stages need; a unit likewise. ``OUT/program/manifest.json`` ties the files together; the
runtime (`partc.runtime`) imports and runs them.

This module decides what each stage and unit holds, receives and sends, and writes the manifest; the stage files'
text is `passes.codegen_source`'s, and what the program's TP collectives and stage boundaries move (the plan's
promise that `partc check` measures) is `passes.codegen_traffic`'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.export.graph_signature import InputKind

from partc.errors import PartcError
from partc.ir import Layer
from partc.plan import Plan
from partc.passes import tp_rewrite
from partc.passes.context import ContextSplit, rewrite as context_rewrite
from partc.passes.constants import constant_values, literal
from partc.passes.experts_ep import EP_ROUTED, rewrite_for_ep
from partc.passes import fuse
from partc.passes.emit import py_name
from partc.passes.same_shapes import SameShapes
from partc.passes.assign import Assignment, assign
from partc.passes.codegen_source import StageCode, UnitCode, _render
from partc.passes.codegen_traffic import _needs_grad, _scatter_gather, _tp_traffic, _whole_boundaries
from partc.sharding import param_shard

SKIPPED = {torch.ops.aten._assert_tensor_metadata.default}
"""Ops that only check metadata at trace time (and name the meta device): not emitted."""

RESERVED = {"p", "device", "run", "call", "forward", "outputs", "flat", "aten", "torch", "operator", "tp", "fused",
            "checkpoint", "importlib", "MODULES", "UNITS", "INPUTS", "OUTPUTS", "PARAMETERS", "BUFFERS"}
"""Names the stage files define or import: no value or unit function takes them."""



@dataclass(kw_only=True, slots=True)
class GeneratedProgram:
    stages: list[StageCode]
    manifest: dict
    files: dict[str, str] = field(default_factory=dict)
    """File name (relative to OUT/program) -> text."""
    sequence_gathers: list[str] = field(default_factory=list)
    """Under sequence parallelism, the values gathered whole where a reader is not proven per-position
    (`tp_rewrite.Rewrite.sequence_gathers`)."""
    tp_traffic: dict[str, list[tuple[str, str, float]]] = field(default_factory=dict)
    """Unit FQN -> the TP collectives its code runs per micro-batch, (kind, phase, bytes) as the runtime counts
    them (`TP_TRAFFIC`); units without one are absent. The loss's collectives are not in the stage code."""


@dataclass(kw_only=True, slots=True)
class _GraphIO:
    """What the exported graph's placeholders and output are."""

    params: dict[torch.fx.Node, str]
    """Placeholder -> parameter FQN (the exported name)."""
    buffers: dict[torch.fx.Node, str]
    constants: dict[torch.fx.Node, str]
    """Placeholder -> tensor constant the model creates in forward (the exported name; `partc.passes.constants`)."""
    user_inputs: list[torch.fx.Node]
    """Tensor inputs of the model, in the graph's order."""
    outputs: list[torch.fx.Node]
    """The model's flat outputs."""


# --- the steps ------------------------------------------------------------------------------------------------

def generate(ep: torch.export.ExportedProgram, model: torch.nn.Module, plan: Plan, *, model_path: str,
             entry: str, layers: dict[str, Layer], vocab_loss: dict | None = None,
             context: ContextSplit | None = None, seq_len: int | None = None) -> GeneratedProgram:
    """Rewrite the exported graph for the plan's TP styles (in place), split it by the plan's stages and units
    and write each stage as Python. `vocab_loss` (`ModelGraph.vocab_loss`, where the plan's ``tp_loss`` is
    vocab-parallel): the last stage returns that output as this rank's vocabulary columns, not gathered; the
    manifest's ``tp.vocab_loss`` tells the runtime. `context` (a cp plan: `ep` is the graph at the rank's s/cp
    tokens): its position ops and causal attention are rewritten for context parallelism (`partc.passes.context`),
    and the manifest's ``cp`` tells the runtime how to cut the inputs and targets. `seq_len`: the tokens per sample
    (`ModelGraph.seq_len`), which sequence parallelism splits."""
    a = assign(ep, model)
    aliases = {n: names for names in a.by_id.values() for n in names}  # parameter FQN -> every name of its tensor
    with SameShapes():  # the rewrite runs each op on local shapes: once per distinct op and shapes
        rw = tp_rewrite.rewrite(ep, a.node_layer, layers, plan.tp, plan.parallel.tp, aliases,
                                sequence_parallel=plan.parallel.sequence_parallel,
                                regather=plan.parallel.sp_regather,
                                keep_split=None if vocab_loss is None else int(vocab_loss["output"]),
                                seq_len=seq_len)
    experts, routed = {}, {}
    if plan.parallel.ep > 1:
        experts, routed = rewrite_for_ep(ep, a.node_layer, layers, plan.parallel.ep)
    if context is not None:
        context_rewrite(ep, context)
    gqa = []
    if plan.parallel.fuse_pointwise and context is None:  # attention on the unrepeated keys and values
        gqa = fuse.gqa_attention(ep.graph.nodes)
        fuse.use_gqa(ep.graph, gqa)
    if plan.parallel.tp > 1 or experts or routed or context is not None or gqa:
        a = assign(ep, model)  # the rewrites added (or removed) nodes
    io = _graph_io(ep)
    nodes = [n for n in a.nodes if n.target not in SKIPPED]
    node_stage = _place(nodes, a, plan)
    for n in nodes:  # experts written as modules: their stage runs their layer's all-to-alls
        if EP_ROUTED in n.meta:
            held = plan.stages[node_stage[n]].modules
            away = [m for m in n.meta[EP_ROUTED][0] if not any(m == u or m.startswith(u + ".") for u in held)]
            if away:
                raise PartcError(f"--ep {plan.parallel.ep}: expert {away[0]} is not on pipeline stage "
                                 f"{node_stage[n]}, which routes its tokens: a mixture's experts and its routing "
                                 f"must share a stage")
    nodes = _copy_per_stage(ep.graph, nodes, node_stage, a)
    names = _names(ep)
    if io.constants:  # each use creates the constant again, a literal on the stage's device
        values = constant_values(ep, model)
        names.update({ph: literal(values[target]) for ph, target in io.constants.items()})
    receives, sends = _boundaries(nodes, node_stage, io, len(plan.stages))
    split = _scatter_gather(plan.parallel.tp, rw)
    if plan.parallel.sequence_parallel:
        # The plan prices each boundary as the ranks' parts of the sequence, but for the values that need no
        # gradient (rotary tables, masks, token ids): every TP rank holds those whole, each sends its 1/t part and
        # the next stage all-gathers them, as without sequence parallelism (`partc.passes.cost_step.gather_bytes`).
        grad = _needs_grad(ep, io)
        rw.sequence_gathers += [f"{names[x]} crosses a pipeline boundary whole: scattered and gathered again"
                                for st in sends[:-1] for x in st if split(x) and x in grad]
    last = len(plan.stages) - 1
    fusing = None
    if plan.parallel.fuse_pointwise:  # what the pointwise regions (`partc.passes.fuse.regions`) are found with
        fusing = (fuse.param_values(ep.graph, io.params), fuse.grad_values(ep.graph, io.params))
    stages = []
    for st in plan.stages:
        code = StageCode(index=st.index, inputs=[names[x] for x in receives[st.index]],
                         outputs=[names[x] for x in sends[st.index]], parameters=[], buffers=[],
                         modules=list(st.modules))
        if st.index > 0:
            code.gathered = {names[x]: tuple(x.meta["val"].shape) for x in receives[st.index] if split(x)}
        if st.index < last:
            code.scattered = [names[x] for x in sends[st.index] if split(x)]
        mine = [n for n in nodes if node_stage[n] == st.index]
        code.units = _units(mine, a, st.modules, receives[st.index], sends[st.index], names)
        _name_tensors(code, io, mine, aliases, names)
        code.source = _render(code, plan, names, model_path, ep.call_spec.out_spec if st.index == len(plan.stages) - 1
                              else None, fusing)
        stages.append(code)
    grad = _needs_grad(ep, io)
    traffic = _tp_traffic(stages, grad, plan.parallel.tp) if plan.parallel.tp > 1 else {}
    if plan.parallel.sequence_parallel and plan.parallel.tp > 1:
        _whole_boundaries(traffic, stages, receives, sends, split, grad)
    manifest = _manifest(ep, a, io, rw, layers, plan, stages, names, aliases, model_path=model_path, entry=entry)
    if experts or routed:  # the packed parameters each ep rank holds E/ep experts of (dim 0); the expert modules
        # (plain PyTorch) and the ep rank holding each
        manifest["ep"] = {"degree": plan.parallel.ep, "experts": sorted(
            alias for fqns in experts.values() for fqn in fqns for alias in aliases.get(fqn, [fqn])),
            **({"routed": routed} if routed else {})}
    if context is not None:
        user_input_names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
        manifest["cp"] = {**context.to_dict(), "input_dims": [context.input_dims.get(user_input_names.index(n.name))
                                                               for n in io.user_inputs]}
    if vocab_loss is not None and plan.parallel.tp > 1:
        manifest["tp"]["vocab_loss"] = {"output": int(vocab_loss["output"])}
    files = {f"stage_{s.index}.py": s.source for s in stages}
    files["manifest.json"] = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    return GeneratedProgram(stages=stages, manifest=manifest, files=files, sequence_gathers=rw.sequence_gathers,
                            tp_traffic=traffic)



def _graph_io(ep: torch.export.ExportedProgram) -> _GraphIO:
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    io = _GraphIO(params={}, buffers={}, constants={}, user_inputs=[], outputs=list(ep.graph.output_node().args[0]))
    for spec in ep.graph_signature.input_specs:
        node = placeholders.get(getattr(spec.arg, "name", None))
        if spec.kind == InputKind.PARAMETER:
            io.params[node] = spec.target
        elif spec.kind == InputKind.BUFFER:
            io.buffers[node] = spec.target
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            io.constants[node] = spec.target
        elif spec.kind == InputKind.USER_INPUT and node is not None and isinstance(node.meta.get("val"), torch.Tensor):
            io.user_inputs.append(node)
    if not all(isinstance(o, torch.fx.Node) for o in io.outputs):
        raise PartcError("the model returns a non-tensor value; partc needs tensor outputs")
    return io


def _place(nodes: list[torch.fx.Node], a: Assignment, plan: Plan) -> dict[torch.fx.Node, int]:
    """Node -> stage index. Ops after every unit that feed only the model output go to the last stage."""
    stage_of_unit = {u: st.index for st in plan.stages for u in st.modules}
    missing = [u for u in a.unit_names if u not in stage_of_unit]
    if missing:
        raise PartcError(f"the plan's stages do not place unit {missing[0]!r}")
    last = len(plan.stages) - 1
    node_stage = {n: last if a.node_unit.get(n) is None else stage_of_unit[a.node_unit[n]] for n in nodes}
    for n in nodes:  # stage order must follow data flow: a node's inputs come from its own or earlier stages
        for x in n.all_input_nodes:
            if x in node_stage and node_stage[x] > node_stage[n]:
                raise PartcError(f"stage split breaks data flow: {n.name} in stage {node_stage[n]} needs "
                                 f"{x.name} from stage {node_stage[x]}")
    return node_stage


def _copy_per_stage(graph: torch.fx.Graph, nodes: list[torch.fx.Node], node_stage: dict[torch.fx.Node, int],
                    a: Assignment) -> list[torch.fx.Node]:
    """Give each stage its own `copy_to_tp` of a value read by colwise layers of several stages (a mixture of
    experts whose experts read the block's input directly). The copy's gradient is a partial sum on each TP rank
    until its backward all-reduces it; sent across a stage boundary as each rank's 1/tp part, the parts of different
    ranks' partial sums would be put together as if they were one tensor's. The value itself crosses instead
    (its gradient is whole on every rank), and the stage that reads it copies it again. Returns `nodes` with the
    new copies, each before its stage's first reader."""
    from partc import collectives

    added: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for c in [n for n in nodes if n.target is collectives.copy_to_tp]:
        by_stage: dict[int, list[torch.fx.Node]] = {}
        for u in c.users:
            if u in node_stage and node_stage[u] != node_stage[c]:
                by_stage.setdefault(node_stage[u], []).append(u)
        for stage, users in sorted(by_stage.items()):
            first = min(users, key=nodes.index)
            with graph.inserting_before(first):
                new = graph.call_function(collectives.copy_to_tp, (c.args[0],))
            new.meta.update(c.meta)
            for u in users:
                u.replace_input_with(c, new)
            node_stage[new] = stage
            a.node_unit[new] = a.node_unit.get(first)
            added.setdefault(first, []).append(new)
    if not added:
        return nodes
    out = []
    for n in nodes:
        out += added.get(n, [])
        out.append(n)
    return out


def _names(ep: torch.export.ExportedProgram) -> dict[torch.fx.Node, str]:
    """Every node's Python name: its FX name made a unique identifier."""
    taken = set(RESERVED)
    return {n: py_name(n.name, taken) for n in ep.graph.nodes}


def _live(values: list[torch.fx.Node], produced: dict, used: dict, boundary) -> list[torch.fx.Node]:
    """Of `values` (in graph order), those produced before `boundary` and used at or after it."""
    return [x for x in values if produced[x] < boundary <= used.get(x, boundary - 1)]


def _boundaries(nodes: list[torch.fx.Node], node_stage: dict[torch.fx.Node, int], io: _GraphIO,
                num_stages: int) -> tuple[list[list[torch.fx.Node]], list[list[torch.fx.Node]]]:
    """(what each stage receives, what it sends): the values live across its boundaries, in graph order. Stage 0
    receives the model's inputs; the last stage sends the model's outputs."""
    produced = {n: -1 for n in io.user_inputs} | node_stage
    used: dict[torch.fx.Node, int] = {}
    for n in nodes:
        for x in n.all_input_nodes:
            if x in produced:
                used[x] = max(used.get(x, -1), node_stage[n])
    for o in io.outputs:
        used[o] = num_stages  # the model's output leaves the last stage
    # live[k]: `_live` at boundary k, 0 < k < num_stages (one pass over the values).
    live: list[list[torch.fx.Node]] = [[] for _ in range(num_stages)]
    for x in io.user_inputs + nodes:
        if x in used:
            for k in range(max(produced[x] + 1, 1), min(used[x], num_stages - 1) + 1):
                live[k].append(x)
    receives = [io.user_inputs] + live[1:]
    sends = [list(x) for x in live[1:]] + [io.outputs]
    return receives, sends


def _units(nodes: list[torch.fx.Node], a: Assignment, modules: list[str], receives: list[torch.fx.Node],
           sends: list[torch.fx.Node], names: dict[torch.fx.Node, str]) -> list[UnitCode]:
    """The stage's functions: one per unit in the stage's order (units whose ops depend on each other both ways
    share one), with the values each receives and returns."""
    pos = {u: i for i, u in enumerate(modules)}
    unit_pos = {n: pos[a.node_unit[n]] if a.node_unit.get(n) in pos else len(modules) - 1 for n in nodes}
    # Group units: an op of unit i reading an op of a later unit j puts units i..j in one function.
    group_end = list(range(len(modules)))
    for n in nodes:
        for x in n.all_input_nodes:
            if x in unit_pos and unit_pos[x] > unit_pos[n]:
                group_end[unit_pos[n]] = max(group_end[unit_pos[n]], unit_pos[x])
    groups, start = [], 0
    while start < len(modules):
        end = start
        i = start
        while i <= end:
            end = max(end, group_end[i])
            i += 1
        groups.append((start, end + 1))
        start = end + 1
    group_of = {i: g for g, (lo, hi) in enumerate(groups) for i in range(lo, hi)}
    node_group = {n: group_of[unit_pos[n]] for n in nodes}
    produced = {x: -1 for x in receives} | node_group
    used: dict[torch.fx.Node, int] = {}
    for n in nodes:
        for x in n.all_input_nodes:
            if x in produced:
                used[x] = max(used.get(x, -1), node_group[n])
    for x in sends:
        used[x] = len(groups)
    values = receives + nodes
    taken = set(names.values()) | RESERVED
    out = []
    for g, (lo, hi) in enumerate(groups):
        mine = [n for n in nodes if node_group[n] == g]
        if not mine:
            continue
        needed = {x for n in mine for x in n.all_input_nodes}
        units = modules[lo:hi]
        out.append(UnitCode(units=units, name=py_name(units[0] or "model", taken), nodes=mine,
                            inputs=[x for x in _live(values, produced, used, g) if x in needed],
                            outputs=[x for x in _live(values, produced, used, g + 1) if node_group.get(x) == g]))
    return out


def _name_tensors(code: StageCode, io: _GraphIO, nodes: list[torch.fx.Node], aliases: dict[str, list[str]],
                  names: dict[torch.fx.Node, str]) -> None:
    """Name the parameters and buffers the stage reads ``p['FQN']`` (a tied parameter by the alias the stage's own
    modules hold) and list them in `code`."""
    mine = set(nodes)

    def own_alias(fqn: str) -> str:
        for alias in aliases.get(fqn, [fqn]):
            owner = alias.rpartition(".")[0]
            if any(u == "" or owner == u or owner.startswith(u + ".") for u in code.modules):
                return alias
        return fqn

    for table, listed, is_param in ((io.params, code.parameters, True), (io.buffers, code.buffers, False)):
        for ph, fqn in table.items():
            if any(u in mine for u in ph.users):
                name = own_alias(fqn) if is_param else fqn
                names[ph] = f"p[{name!r}]"
                listed.append(name)
    code.parameters[:] = sorted(set(code.parameters))
    code.buffers[:] = sorted(set(code.buffers))


def _manifest(ep: torch.export.ExportedProgram, a: Assignment, io: _GraphIO, rw: tp_rewrite.Rewrite,
              layers: dict[str, Layer], plan: Plan, stages: list[StageCode], names: dict[torch.fx.Node, str],
              aliases: dict[str, list[str]], *, model_path: str, entry: str) -> dict:
    args_spec, kwargs_spec = ep.call_spec.in_spec.children()  # ((args...), {kwargs})
    flat_keys: list[int | str] = list(range(args_spec.num_leaves)) + list(kwargs_spec.context)
    user_input_names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    shards = {alias: {"dim": sh.dim, "fused": sh.fused}
              for fqn, sh in rw.shards.items() for alias in aliases.get(fqn, [fqn])}
    # Parameters of fused projections (q, k and v in one weight; experts' gate and up), whatever their style: a
    # checkpoint stores them as [pieces, rows / pieces, ...] so that their TP split is a plain split and any plan can
    # read them back.
    fused = {}
    for layer in layers.values():
        for fqn in layer.params if layer.fused > 1 else ():
            sh = param_shard(layer, fqn, "colwise")
            if sh is not None and sh.fused > 1:
                fused[fqn] = {"dim": sh.dim, "pieces": sh.fused}
        for fqn, (dim, pieces) in layer.inner.items():  # packed experts' gate and up (`partc.passes.experts`)
            if pieces > 1:
                fused[fqn] = {"dim": dim, "pieces": pieces}
    return {
        "tp": {"degree": plan.parallel.tp, "shards": shards, "fused": fused},
        "model_path": model_path, "entry": entry, "micro_batch_size": plan.parallel.micro_batch_size,
        "num_stages": len(plan.stages),
        "stages": [{"index": s.index, "file": f"stage_{s.index}.py", "rank": s.index % plan.parallel.pp}
                   for s in stages],
        "tied": sorted(sorted(names_) for names_ in a.by_id.values() if len(names_) > 1),
        "blocks": [u for u in a.unit_names if a.unit_kind.get(u) == "block"],
        "inputs": [names[n] for n in io.user_inputs],
        "input_keys": [flat_keys[user_input_names.index(n.name)] for n in io.user_inputs],
    }
