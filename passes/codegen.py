"""Write the sharded program: one readable Python file per pipeline stage, generated from the traced graph.

The model is exported again on meta at the plan's micro-batch size (exported graphs carry concrete shapes), its
nodes are split by the plan's stages (a node goes with its unit; glue with the first unit that uses it), and
each stage becomes straight-line ATen code:

    # blocks.0.attn.qkv                            gpt.py:71  q, k, v = self.qkv(x).split(h, dim=-1)
    linear_1 = aten.linear.default(layer_norm, p["blocks.0.attn.qkv.weight"], p["blocks.0.attn.qkv.bias"])

A stage receives exactly what the previous stage sends (the values live across its boundary, each once per
micro-batch) and sends what later stages need. ``OUT/program/manifest.json`` ties the files together; the
runtime (`partc.runtime`) imports and runs them.
"""

from __future__ import annotations

import json
import keyword
import math
import operator
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx
from torch.export.graph_signature import InputKind

from partc import collectives
from partc.errors import PartcError
from partc.frames import innermost, stack_trace_frames
from partc.ir import Layer
from partc.plan import Plan
from partc.passes import tp_rewrite
from partc.passes.measure import CORE_OPS, stack_fqns
from partc.passes.trace import assign
from partc.sharding import param_shard

SKIPPED = {torch.ops.aten._assert_tensor_metadata.default}
"""Ops that only check metadata at trace time (and name the meta device): not emitted."""


@dataclass(kw_only=True, slots=True)
class StageCode:
    index: int
    inputs: list[str]
    outputs: list[str]
    parameters: list[str]
    buffers: list[str]
    modules: list[str]
    source: str = ""


@dataclass(kw_only=True, slots=True)
class Program:
    stages: list[StageCode]
    manifest: dict
    files: dict[str, str] = field(default_factory=dict)
    """File name (relative to OUT/program) -> text."""


def _source_line(node: torch.fx.Node) -> str:
    """``file:line  code`` of the model's source for this node: its innermost frame of model code."""
    frame = innermost(stack_trace_frames(node.meta.get("stack_trace")))
    return "" if frame is None else f"{os.path.basename(frame.filename)}:{frame.lineno}  {frame.line}"


def _module_of(node: torch.fx.Node) -> str:
    """FQN of the innermost module the node ran in ('' for the model itself)."""
    return (stack_fqns(node) or [""])[-1]


class _Emitter:
    """Python source for one node's arguments."""

    def __init__(self, names: dict[torch.fx.Node, str]):
        self.names = names
        self.needs: set[str] = set()

    def arg(self, a) -> str:
        if isinstance(a, torch.fx.Node):
            return self.names[a]
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.arg(x) for x in a)
            if isinstance(a, tuple):
                return f"({inner},)" if len(a) == 1 else f"({inner})"
            return f"[{inner}]"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k!r}: {self.arg(v)}" for k, v in a.items()) + "}"
        if isinstance(a, torch.device):
            return "device"
        if isinstance(a, torch.dtype):
            return str(a)
        if isinstance(a, torch.memory_format):
            return str(a)
        if isinstance(a, torch.layout):
            return str(a)
        if isinstance(a, float):
            if math.isinf(a):
                return "float('inf')" if a > 0 else "-float('inf')"
            if math.isnan(a):
                return "float('nan')"
            return repr(a)
        if isinstance(a, (bool, int, str)) or a is None:
            return repr(a)
        if isinstance(a, slice):
            return f"slice({self.arg(a.start)}, {self.arg(a.stop)}, {self.arg(a.step)})"
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise PartcError(f"codegen: symbolic value {a} in the graph; partc needs static shapes")
        raise PartcError(f"codegen cannot write the argument {a!r} ({type(a).__name__})")

    def call(self, node: torch.fx.Node) -> str:
        t = node.target
        if t is operator.getitem:
            return f"{self.arg(node.args[0])}[{self.arg(node.args[1])}]"
        if isinstance(t, torch._ops.OpOverload):
            ns = t.namespace
            packet = t._overloadpacket.__name__ if hasattr(t, "_overloadpacket") else t.__name__.split(".")[0]
            fn = f"{'aten' if ns == 'aten' else f'torch.ops.{ns}'}.{packet}.{t._overloadname}"
        elif isinstance(t, torch._ops.OpOverloadPacket):
            fn = f"torch.ops.{t._qualified_op_name.replace('::', '.')}"
        elif getattr(t, "__module__", None) == collectives.__name__:
            fn = f"tp.{t.__name__}"
            self.needs.add("tp")
        elif getattr(t, "__module__", None) == "_operator" or t in vars(operator).values():
            fn = f"operator.{t.__name__}"
            self.needs.add("operator")
        elif getattr(t, "__module__", "").startswith("torch") and hasattr(t, "__name__"):
            fn = f"{t.__module__}.{t.__name__}"
        else:
            raise PartcError(f"codegen cannot call {t!r} (node {node.name}); only ATen ops and getitem are supported")
        args = [self.arg(a) for a in node.args]
        args += [f"{k}={self.arg(v)}" for k, v in node.kwargs.items()]
        return f"{fn}({', '.join(args)})"


def _py_name(name: str) -> str:
    name = re.sub(r"\W", "_", name)
    if not name or name[0].isdigit() or keyword.iskeyword(name):
        name = f"v_{name}"
    return name


def _structure_expr(spec, names: list[str]) -> tuple[str, set[str]]:
    """Python expression rebuilding the model's output structure from flat output names; and imports."""
    it = iter(names)
    imports: set[str] = set()

    def build(s) -> str:
        if s.is_leaf():
            return next(it)
        typ = s.type
        kids = [build(c) for c in s.children()]
        if typ is tuple:
            return f"({', '.join(kids)},)" if len(kids) == 1 else f"({', '.join(kids)})"
        if typ is list:
            return f"[{', '.join(kids)}]"
        if typ is dict:
            return "{" + ", ".join(f"{k!r}: {v}" for k, v in zip(s.context, kids)) + "}"
        keys = s.context
        if isinstance(keys, (list, tuple)) and all(isinstance(k, str) for k in keys) and len(keys) == len(kids):
            imports.add(f"from {typ.__module__} import {typ.__name__}")
            return f"{typ.__name__}({', '.join(f'{k}={v}' for k, v in zip(keys, kids))})"
        raise PartcError(f"codegen cannot rebuild the model output type {typ.__name__}")

    return build(spec), imports


def generate(ep: torch.export.ExportedProgram, model: torch.nn.Module, plan: Plan, *, model_path: str,
             entry: str, layers: dict[str, Layer]) -> Program:
    """Rewrite the exported graph for the plan's TP styles (in place), split it by the plan's stages and write
    each stage as Python."""
    a = assign(ep, model)
    aliases: dict[str, list[str]] = {}
    for names_ in a.by_id.values():
        for n in names_:
            aliases[n] = names_
    t = plan.parallel.tp
    rw = tp_rewrite.rewrite(ep, a.node_layer, layers, plan.tp, t, aliases)
    if t > 1:
        a = assign(ep, model)
    sig = ep.graph_signature
    stage_of_unit: dict[str, int] = {}
    for st in plan.stages:
        for u in st.modules:
            stage_of_unit[u] = st.index
    last = len(plan.stages) - 1
    missing = [u for u in a.unit_names if u not in stage_of_unit]
    if missing:
        raise PartcError(f"the plan's stages do not place unit {missing[0]!r}")

    # Placeholders: what each one is.
    param_of: dict[str, str] = {}
    buffer_of: dict[str, str] = {}
    user_inputs: list[torch.fx.Node] = []
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    for spec in sig.input_specs:
        node = placeholders[spec.arg.name] if hasattr(spec.arg, "name") else None
        if spec.kind == InputKind.PARAMETER:
            param_of[node.name] = spec.target
        elif spec.kind == InputKind.BUFFER:
            buffer_of[node.name] = spec.target
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            raise PartcError(f"the model creates a tensor constant ({spec.target}) inside forward; partc cannot "
                             f"carry its value from the meta device: register it as a buffer in __init__")
        elif spec.kind == InputKind.USER_INPUT and node is not None:
            if isinstance(node.meta.get("val"), torch.Tensor):
                user_inputs.append(node)
    # Tied parameters: a stage names a parameter by the alias its own modules own.

    def stage_of(node: torch.fx.Node) -> int:
        u = a.node_unit.get(node)
        return last if u is None else stage_of_unit[u]

    nodes = [n for n in a.nodes if n.target not in SKIPPED]
    node_stage = {n: stage_of(n) for n in nodes}
    # Stage order must follow graph order (a node's inputs come from its own or earlier stages).
    for n in nodes:
        for x in n.all_input_nodes:
            if x in node_stage and node_stage[x] > node_stage[n]:
                raise PartcError(f"stage split breaks data flow: {n.name} in stage {node_stage[n]} needs "
                                 f"{x.name} from stage {node_stage[x]}")
    output_node = ep.graph.output_node()
    flat_outputs = [o for o in output_node.args[0]]
    for o in flat_outputs:
        if not isinstance(o, torch.fx.Node):
            raise PartcError("the model returns a non-tensor value; partc needs tensor outputs")

    # Names: python-safe, stable.
    names: dict[torch.fx.Node, str] = {}
    for n in ep.graph.nodes:
        names[n] = _py_name(n.name)
    produced_at: dict[torch.fx.Node, int] = {n: -1 for n in user_inputs}
    produced_at.update(node_stage)
    last_use: dict[torch.fx.Node, int] = {}
    for n in nodes:
        for x in n.all_input_nodes:
            if x in produced_at:
                last_use[x] = max(last_use.get(x, -1), node_stage[n])
    for o in flat_outputs:
        last_use[o] = max(last_use.get(o, -1), last + 1)  # the model output leaves the last stage

    def live_at(boundary: int) -> list[torch.fx.Node]:
        """Values crossing into stage `boundary` (produced before it, used at or after it), in graph order."""
        out = [x for x in list(user_inputs) + nodes
               if produced_at[x] < boundary <= last_use.get(x, -2) and x in produced_at]
        return out

    stages: list[StageCode] = []
    files: dict[str, str] = {}
    selective = plan.parallel.recompute == "selective"
    for st in plan.stages:
        k = st.index
        receives = user_inputs if k == 0 else live_at(k)
        sends = flat_outputs if k == last else live_at(k + 1)
        body_nodes = [n for n in nodes if node_stage[n] == k]
        em = _Emitter(names)
        params: list[str] = []
        buffers: list[str] = []

        def stage_name(fqn: str) -> str:
            for alias in aliases.get(fqn, [fqn]):
                owner = alias.rsplit(".", 1)[0] if "." in alias else ""
                unit = next((u for u in st.modules if owner == u or owner.startswith(u + ".") or u == ""), None)
                if unit is not None:
                    return alias
            return fqn

        for ph_name, fqn in list(param_of.items()) + list(buffer_of.items()):
            ph = placeholders[ph_name]
            if any(node_stage.get(u) == k for u in ph.users):
                name = stage_name(fqn) if ph_name in param_of else fqn
                names[ph] = f'p["{name}"]'
                (params if ph_name in param_of else buffers).append(name)
        lines = []
        prev_comment = None
        for n in body_nodes:
            mod = _module_of(n)
            src = _source_line(n)
            comment = f"# {mod or '(model)'}" + (f"  {src}" if src else "")
            if comment != prev_comment:
                lines.append(f"    {comment}")
                prev_comment = comment
            if "partc_why" in n.meta:
                lines.append(f"    # TP: {n.meta['partc_why']}")
            if selective and n.target in CORE_OPS:
                # Selective recomputation (Korthikanti et al. 2022): keep only the attention core's inputs and
                # recompute the core in backward.
                lines.append("    # recompute=selective: the attention core runs again in backward instead of "
                             "keeping its activations")
                call = em.call(n)
                fn, args = call.split("(", 1)
                lines.append(f"    {names[n]} = checkpoint({fn}, {args[:-1]}, use_reentrant=False)")
                em.needs.add("checkpoint")
                continue
            lines.append(f"    {names[n]} = {em.call(n)}")
        ret = ", ".join(names[x] for x in sends)
        lines.append(f"    return ({ret},)" if len(sends) == 1 else f"    return ({ret})")
        code = StageCode(index=k, inputs=[names[x] for x in receives], outputs=[names[x] for x in sends],
                         parameters=sorted(set(params)), buffers=sorted(set(buffers)), modules=list(st.modules))
        extra_imports = set()
        tail = ""
        if k == last:
            expr, extra_imports = _structure_expr(ep.call_spec.out_spec, [f"flat[{i}]" for i in range(len(sends))])
            tail = ("\n\ndef outputs(flat):\n    \"\"\"The model's output structure, for loss_fn(outputs, targets).\"\"\"\n"
                    f"    return {expr}\n")
        code.source = _render(code, plan, lines, em.needs, extra_imports, tail, model_path)
        stages.append(code)
        files[f"stage_{k}.py"] = code.source

    tied = sorted(sorted(names_) for names_ in a.by_id.values() if len(names_) > 1)
    input_keys: list[int | str] = []
    in_spec = ep.call_spec.in_spec  # ((args...), {kwargs})
    args_spec, kwargs_spec = in_spec.children()
    flat_keys: list[int | str] = list(range(args_spec.num_leaves)) + list(kwargs_spec.context)
    user_input_names = [s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    for node in user_inputs:
        input_keys.append(flat_keys[user_input_names.index(node.name)])
    shards = {}
    for fqn, sh in rw.shards.items():
        for alias in aliases.get(fqn, [fqn]):
            shards[alias] = {"dim": sh.dim, "fused": sh.fused}
    # Parameters of fused projections (q, k and v in one weight), whatever their style: a checkpoint stores them
    # as [pieces, rows / pieces, ...] so that their TP split is a plain split and any plan can read them back.
    fused = {}
    for layer in layers.values():
        if layer.fused > 1:
            for fqn in layer.params:
                sh = param_shard(layer, fqn, "colwise")
                if sh is not None and sh.fused > 1:
                    fused[fqn] = {"dim": sh.dim, "pieces": sh.fused}
    manifest = {
        "tp": {"degree": t, "shards": shards, "fused": fused},
        "model_path": model_path, "entry": entry, "micro_batch_size": plan.parallel.micro_batch_size,
        "num_stages": len(plan.stages),
        "stages": [{"index": s.index, "file": f"stage_{s.index}.py", "rank": s.index % plan.parallel.pp}
                   for s in stages],
        "tied": tied, "inputs": [names[n] for n in user_inputs], "input_keys": input_keys,
    }
    files["manifest.json"] = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    return Program(stages=stages, manifest=manifest, files=files)


def _render(code: StageCode, plan: Plan, lines: list[str], needs: set[str], extra_imports: set[str], tail: str,
            model_path: str) -> str:
    par = plan.parallel
    st = plan.stages[code.index]
    pred = st.predicted or {}
    header = [
        f'"""partc program: stage {code.index} of {len(plan.stages)} (pipeline rank {st.rank}), generated by '
        f"`partc compile` from {os.path.basename(model_path)}.",
        "",
        f"Plan: {par.summary()}, {par.num_microbatches} micro-batches of {par.micro_batch_size}",
        f"Modules: {', '.join(code.modules)}",
    ]
    if pred:
        header.append(f"Predicted: {pred.get('time_s', 0) * 1e3:.2f} ms per micro-batch (forward + backward, this "
                      f"pipeline rank), {pred.get('memory_bytes', 0) / 2**30:.2f} GiB per GPU")
    header += [
        "",
        "Generated code: edit the model or plan.json and compile again rather than this file.",
        "forward(p, *inputs, device): p maps parameter and buffer FQNs to tensors; inputs are INPUTS in order.",
        '"""',
        "",
    ]
    imports = ["import torch"] + [f"import {m}" for m in sorted(needs - {"tp", "checkpoint"})] + sorted(extra_imports)
    if "checkpoint" in needs:
        imports.append("from torch.utils.checkpoint import checkpoint")
    if "tp" in needs:
        imports.append("from partc import collectives as tp")
    body = [
        *imports,
        "",
        "aten = torch.ops.aten",
        "",
        f"MODULES = {code.modules!r}",
        f"INPUTS = {code.inputs!r}",
        f"OUTPUTS = {code.outputs!r}",
        f"PARAMETERS = {code.parameters!r}",
        f"BUFFERS = {code.buffers!r}",
        "",
        "",
        f"def forward(p, {''.join(n + ', ' for n in code.inputs)}*, device):",
        *lines,
    ]
    return "\n".join(header + body) + "\n" + tail


def write_program(program: Program, out_dir: str | Path) -> Path:
    """Write ``OUT/program/`` atomically: a new directory, then renamed over the old one."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = out / "program"
    tmp = Path(tempfile.mkdtemp(prefix=".program.", dir=out))
    for name, text in program.files.items():
        (tmp / name).write_text(text)
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=".program-old.", dir=out))
        os.rename(final, old / "program")
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    return final
