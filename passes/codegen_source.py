"""The text of the sharded program's stage files: the code of a stage (`StageCode`: its units' functions, what it
receives and sends) rendered as readable Python, one function of straight-line ATen code per unit, each line under
a comment naming the module and the model's source line, each value ``del``-ed after its last use, and a
``forward`` that calls the units through ``run`` (`passes.codegen` explains the program's shape; `passes.emit`
writes each statement). Kept apart from `passes.codegen`, which decides what each stage and unit holds: this module
only decides how it reads.
"""


from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import torch.fx

from partc.frames import innermost, stack_trace_frames
from partc.plan import Plan
from partc.passes.experts_ep import EP_LOCAL, EP_ROUTED
from partc.passes.export import GRAD_ENABLED
from partc.passes import fuse
from partc.passes.emit import Emitter, comment, doc_text, structure_expr, tuple_expr
from partc.passes.measure import CORE_OPS, stack_fqns


@dataclass(kw_only=True, slots=True)
class UnitCode:
    """One function of a stage file: the nodes of one unit, or of several when their nodes interleave."""

    units: list[str]
    """Unit FQNs, in order (one, except for units whose ops depend on each other both ways)."""
    name: str
    """The Python function's name."""
    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node] = field(default_factory=list)
    outputs: list[torch.fx.Node] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class StageCode:
    index: int
    inputs: list[str]
    outputs: list[str]
    parameters: list[str]
    buffers: list[str]
    modules: list[str]
    units: list[UnitCode] = field(default_factory=list)
    gathered: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Inputs that arrive as this TP rank's part (`scatter_to_next_stage`) -> the whole tensor's shape."""
    scattered: list[str] = field(default_factory=list)
    """Outputs this TP rank sends only its part of (Megatron's scatter/gather)."""
    source: str = ""


def _source_line(node: torch.fx.Node) -> str:
    """``file:line  code`` of the model's source for this node: its innermost frame of model code."""
    return _stack_source_line(node.meta.get("stack_trace"))


@functools.lru_cache(maxsize=4096)
def _stack_source_line(stack_trace: str | None) -> str:
    """`_source_line` of a stack trace (the identical blocks of a model share theirs)."""
    frame = innermost(stack_trace_frames(stack_trace))
    return "" if frame is None else f"{os.path.basename(frame.filename)}:{frame.lineno}  {frame.line}"


def _frees(reads: list[list], *, keep: set, order: list) -> list[list]:
    """For each statement of a function (the values it reads, and the one it makes), the values to ``del`` after it:
    those no later statement reads, in `order`, less `keep` (what the function returns). None after the last
    statement: the ``return`` that follows lets them go."""
    last = {x: i for i, xs in enumerate(reads) for x in xs}
    out: list[list] = [[] for _ in reads]
    for x in order:
        if x in last and x not in keep and last[x] < len(reads) - 1:
            out[last[x]].append(x)
    return out


def _unit_lines(unit: UnitCode, em: Emitter, names: dict[torch.fx.Node, str], selective: bool,
                fusing: tuple[set, set] | None = None) -> list[str]:
    """The body of one unit's function: a comment with the module and the model's source line above each run of
    statements from one line, one statement a line, and after a statement a ``del`` of the values it read last (as
    eager PyTorch lets them go: a unit holds no more than its outputs and what autograd saves). `fusing` (the
    parameters' values and the values needing a gradient, under `fuse_pointwise`): each pointwise region
    (`partc.passes.fuse.regions`) is a function of its own, called through ``fused.pointwise``."""
    values = unit.inputs + unit.nodes
    local = set(values)
    found = [] if fusing is None else fuse.regions(unit.nodes, params=fusing[0], needs_grad=fusing[1].__contains__)
    inside = {n: r for r in found for n in r.nodes}
    stmts = [inside.get(n, n) for n in unit.nodes if n not in inside or n is inside[n].output]
    reads = [[x for x in (*s.inputs, s.output) if x in local] if isinstance(s, fuse.Region) else
             [x for x in (*s.all_input_nodes, s) if x in local] for s in stmts]
    frees = _frees(reads, keep=set(unit.outputs), order=values)
    lines, prev, mode = [], None, None
    for s, gone in zip(stmts, frees):
        n = s.output if isinstance(s, fuse.Region) else s
        # An op of the model's no_grad / set_grad_enabled region (`partc.passes.export.inline_grad_regions`) runs
        # in a ``with torch.set_grad_enabled(...)`` block; consecutive ones share it.
        want = n.meta.get(GRAD_ENABLED)
        if want != mode:
            mode, prev = want, None
            if want is not None:
                lines.append("with torch.no_grad():" if want is False else "with torch.enable_grad():")
        pad = "    " if mode is not None else ""
        module = (stack_fqns(n) or [""])[-1]
        src = _source_line(n)
        text = "# " + comment(f"{module or '(model)'}" + (f"  {src}" if src else ""))
        if text != prev:
            lines.append(pad + text)
            prev = text
        if "partc_why" in n.meta:
            lines.append(pad + "# " + comment(f"TP: {n.meta['partc_why']}"))
        if isinstance(s, fuse.Region):
            lines += [pad + line for line in _region_lines(s, em, names)]
        elif selective and n.target in CORE_OPS and mode is not False:
            # Selective recomputation (Korthikanti et al. 2022): keep only the attention core's inputs and
            # recompute the core in backward.
            lines.append(pad + "# recompute=selective: the attention core runs again in backward instead of keeping "
                         "its activations")
            lines.append(pad + f"{names[n]} = checkpoint({em.function(n)}, {em.args(n)}, use_reentrant=False)")
            em.needs.add("checkpoint")
        elif EP_LOCAL in n.meta:
            lines += [pad + line for line in _expert_lines(n, em, names)]
        else:
            lines.append(pad + f"{names[n]} = {em.call(n)}")
        if gone:
            lines.append(pad + f"del {', '.join(names[x] for x in gone)}")
    lines.append(f"return {tuple_expr([names[x] for x in unit.outputs])}" if unit.outputs else "return ()")
    return lines


def _region_lines(region: fuse.Region, em: Emitter, names: dict[torch.fx.Node, str]) -> list[str]:
    """A pointwise region (`partc.passes.fuse`): its ops as a function of its inputs, and the call that keeps only
    those for backward and runs the function again there."""
    fn = f"{names[region.output]}_region"
    inner = Emitter({**names, **{x: f"x{i}" for i, x in enumerate(region.inputs)}})
    lines = ["# fuse_pointwise: kept at its inputs, replayed in backward (a fused kernel's memory)",
             f"def {fn}({', '.join(f'x{i}' for i in range(len(region.inputs)))}):"]
    lines += [f"    {names[n]} = {inner.call(n)}" for n in region.nodes]
    lines.append(f"    return {names[region.output]}")
    em.needs |= inner.needs | {"fused"}
    lines.append(f"{names[region.output]} = fused.pointwise({fn}, {', '.join(em.arg(x) for x in region.inputs)})")
    return lines


def _expert_lines(node: torch.fx.Node, em: Emitter, names: dict[torch.fx.Node, str]) -> list[str]:
    """A layer of packed experts under ep (`partc.passes.experts_ep.rewrite_for_ep`): its experts' own computation as
    a function of the rows sent to this rank, their offsets and this rank's part of the packed parameters, and the
    call that sends each token's rows to its experts' ranks and brings the results back."""
    local = node.meta[EP_LOCAL]
    fn = f"{names[node]}_experts"
    inner = Emitter({n: n.name for n in local.graph.nodes})
    args = [n.name for n in local.graph.nodes if n.op == "placeholder"]
    lines = ["# ep: each (token, expert) pair computed on its expert's rank (all-to-all there and back)",
             f"def {fn}({', '.join(args)}):"]
    for n in local.graph.nodes:
        if n.op == "call_function":
            lines.append(f"    {n.name} = {inner.call(n)}")
        elif n.op == "output":
            lines.append(f"    return {inner.arg(n.args[0])}")
    em.needs |= inner.needs
    hidden, index, weights, *params = (em.arg(a) for a in node.args)
    if EP_ROUTED in node.meta:  # experts written as modules: this rank's experts looked up, each run on its rows
        experts, held = node.meta[EP_ROUTED]
        per = len(held[0])
        lines[0] = (f"# ep: each (token, expert) pair computed on its expert's rank (all-to-all there and back); this "
                    f"rank holds {len(experts)}/ep of the experts {experts[0]} ... {experts[-1]}")
        listed = ", ".join(repr(n) for e in held for n in e)
        lines.append(f"{names[node]} = {em.function(node)}({hidden}, {index}, {weights}, "
                     f"tp.each_expert({fn}, {per}), *tp.held_experts(p, [{listed}], {per}), "
                     f"num_experts={node.kwargs['num_experts']}, sizes=True)")
        em.needs.add("tp")
        return lines
    lines.append(f"{names[node]} = {em.function(node)}({hidden}, {index}, {weights}, {fn}, {', '.join(params)}, "
                 f"num_experts={node.kwargs['num_experts']})")
    return lines


def _render(code: StageCode, plan: Plan, names: dict[torch.fx.Node, str], model_path: str, out_spec,
            fusing: tuple[set, set] | None = None) -> str:
    par = plan.parallel
    em = Emitter(names)
    selective = par.recompute == "selective"
    functions = []
    for unit in code.units:
        params = "".join(f", {names[x]}" for x in unit.inputs)
        what = ", ".join(repr(u) for u in unit.units)
        body = _unit_lines(unit, em, names, selective, fusing)
        functions += ["", "", f"def {unit.name}(p{params}, *, device):",
                      f'    """Unit{"s" if len(unit.units) > 1 else ""} {doc_text(what)}."""',
                      *(f"    {line}" for line in body)]
    calls = []
    held = code.inputs + [names[x] for unit in code.units for x in unit.outputs]  # what forward holds, in order
    frees = _frees([[names[x] for x in (*unit.inputs, *unit.outputs)] for unit in code.units],
                   keep=set(code.outputs), order=held)
    for unit, gone in zip(code.units, frees):
        args = "".join(f", {names[x]}" for x in unit.inputs)
        key = repr(unit.units[0]) if len(unit.units) == 1 else repr(tuple(unit.units))
        call = f"run({key}, {unit.name}, p{args}, device=device)"
        calls.append(f"    {tuple_expr([names[x] for x in unit.outputs])} = {call}" if unit.outputs else f"    {call}")
        if gone:
            calls.append(f"    del {', '.join(gone)}")
    inputs = "".join(n + ", " for n in code.inputs)
    receive = []
    for name, shape in code.gathered.items():
        receive += ["    # pipeline: the previous stage sent each TP rank's part of this tensor (scatter/gather): "
                    "all-gather it over tp", f"    {name} = tp.gather_from_previous_stage({name}, {shape!r})"]
    sent = [f"tp.scatter_to_next_stage({n})" if n in code.scattered else n for n in code.outputs]
    if code.scattered:
        calls.append("    # pipeline: every TP rank holds these whole; each sends its 1/tp part (scatter/gather)")
    if code.gathered or code.scattered:
        em.needs.add("tp")
    forward = ["", "", f"def forward(p, {inputs}*, device, run=call):",
               '    """This stage for one micro-batch: its units in order; `run(unit, fn, *args)` runs one."""',
               *receive, *calls, f"    return {tuple_expr(sent)}"]
    tail = []
    if out_spec is not None:
        expr = structure_expr(out_spec, [f"flat[{i}]" for i in range(len(code.outputs))])
        if "importlib." in expr:
            em.needs.add("importlib")
        tail = ["", "", "def outputs(flat):", '    """The model\'s output structure, for loss_fn(outputs, targets)."""',
                f"    return {expr}"]
    st = plan.stages[code.index]
    pred = st.predicted or {}
    header = [
        f'"""partc program: stage {code.index} of {len(plan.stages)} (pipeline rank {st.rank}), generated by '
        f"`partc compile` from {doc_text(os.path.basename(model_path))}.",
        "",
        f"Plan: {par.summary()}; {par.num_microbatches} micro-batch{'es' if par.num_microbatches != 1 else ''} "
        f"of {par.micro_batch_size} per step",
        f"Modules: {doc_text(', '.join(code.modules))}",
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
    imports = ["import torch"] + [f"import {m}" for m in sorted(em.needs - {"tp", "checkpoint", "fused"})]
    if "checkpoint" in em.needs:
        imports.append("from torch.utils.checkpoint import checkpoint")
    if "tp" in em.needs:
        imports.append("from partc import collectives as tp")
    if "fused" in em.needs:
        imports.append("from partc import fused")
    units = [u.units[0] if len(u.units) == 1 else tuple(u.units) for u in code.units]
    body = [
        *imports,
        "",
        "aten = torch.ops.aten",
        "",
        f"MODULES = {code.modules!r}",
        f"UNITS = {units!r}",
        f"INPUTS = {code.inputs!r}",
        f"OUTPUTS = {code.outputs!r}",
        f"PARAMETERS = {code.parameters!r}",
        f"BUFFERS = {code.buffers!r}",
        "",
        "",
        "def call(unit, fn, *args, **kwargs):",
        '    """Run one unit: fn(*args, **kwargs). The runtime passes its own `run`, which runs the unit as a module."""',
        "    return fn(*args, **kwargs)",
        *functions,
        *forward,
        *tail,
    ]
    return "\n".join(header + body) + "\n"
