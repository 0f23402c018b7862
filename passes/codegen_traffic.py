"""What crosses the generated program's TP collectives and stage boundaries: the TP collectives each unit's code
runs per micro-batch, as the runtime counts them (`TP_TRAFFIC`, `GeneratedProgram.tp_traffic`: the plan's promise
that `partc compile` and `partc check` compare with the cost model's), the values that cross a stage boundary as
each TP rank's part (Megatron's scatter/gather), and the values that need a gradient (a backward collective runs
only for those). `passes.codegen` asks these questions while it writes the program.
"""


from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx

from partc.passes import tp_rewrite
from partc.passes.codegen_source import StageCode

if TYPE_CHECKING:
    from partc.passes.codegen import _GraphIO

TP_TRAFFIC = {
    "copy_to_tp": (("all_reduce", "bwd", "out"),),
    "reduce_from_tp": (("all_reduce", "fwd", "out"),),
    "gather_from_tp": (("all_gather", "fwd", "out"),),
    "scatter_to_tp": (("all_gather", "bwd", "in"),),
    "reduce_scatter_to_tp": (("reduce_scatter", "fwd", "in"), ("all_gather", "bwd", "in")),
    "reduce_scatter_to_sp": (("reduce_scatter", "fwd", "in"), ("all_gather", "bwd", "in")),
    "gather_from_sp": (("all_gather", "fwd", "out"), ("reduce_scatter", "bwd", "out")),
    # `sp_regather`: the gather, again in backward (`passes.cost_tp.REGATHER`), and the input gradient's reduce-scatter
    "linears_from_sp": (("all_gather", "fwd", "gathered"), ("all_gather", "bwd-regather", "gathered"),
                        ("reduce_scatter", "bwd", "gathered")),
}
"""`partc.collectives`' TP functions in the stage code -> (kind, phase, whose bytes) of each collective they run:
an all-gather counted by its output, a reduce-scatter by its input, an all-reduce by its tensor (`partc.runtime.
comm`); "in": the whole tensor the function takes (a partial sum, or a value every rank holds whole), "out": the
tensor it gives; "gathered": the whole sequence of the input (t times its local part). A backward one runs only
for a value that needs a gradient."""


def _tp_traffic(stages: list[StageCode], grad: set[torch.fx.Node], t: int) -> dict[str, list[tuple[str, str, float]]]:
    """`GeneratedProgram.tp_traffic`: each TP collective of the stage code, charged to the first unit of the
    function that runs it. The rewrite gives every collective's output its local shape (`tp_rewrite`), and its
    input here is a partial sum or a whole value, whose local shape is the traced one."""
    from partc import collectives
    from partc.passes.cuts import val_bytes
    out: dict[str, list[tuple[str, str, float]]] = {}
    for st in stages:
        for uc in st.units:
            for n in uc.nodes:
                fn = getattr(n.target, "__name__", None)
                if not collectives.is_collective(n.target) or fn not in TP_TRAFFIC:
                    continue
                for kind, phase, whose in TP_TRAFFIC[fn]:
                    if phase.startswith("bwd") and n.args[0] not in grad:
                        continue
                    nbytes = t * val_bytes(n.args[0]) if whose == "gathered" else val_bytes(
                        n if whose == "out" else n.args[0])
                    out.setdefault(uc.units[0], []).append((kind, phase, float(nbytes)))
    return out


def _whole_boundaries(traffic: dict[str, list[tuple[str, str, float]]], stages: list[StageCode],
                      receives: list[list[torch.fx.Node]], sends: list[list[torch.fx.Node]], split,
                      grad: set[torch.fx.Node]) -> None:
    """Add to `traffic` (`_tp_traffic`) the scatter/gather of the values that need a gradient and cross a stage
    boundary whole under sequence parallelism (a fallback to tensor parallelism, listed in `sequence_gathers`):
    the receiving stage all-gathers each forward (charged to its first unit), the sending stage the gradient
    backward (charged to its last unit). `partc.passes.cost_step.gather_bytes` counts only the values that need no
    gradient under sequence parallelism, so these are priced as the program's (`partc.compile.
    price_sequence_fallbacks`)."""
    from partc.passes.cuts import val_bytes
    for st in stages:
        if not st.units:
            continue
        if st.index > 0:
            for x in receives[st.index]:
                if split(x) and x in grad:
                    traffic.setdefault(st.units[0].units[0], []).append(("all_gather", "fwd", float(val_bytes(x))))
        if st.index < len(stages) - 1:
            for x in sends[st.index]:
                if split(x) and x in grad:
                    traffic.setdefault(st.units[-1].units[0], []).append(("all_gather", "bwd", float(val_bytes(x))))


def _scatter_gather(t: int, rw: tp_rewrite.Rewrite):
    """Which values crossing a stage boundary go as each TP rank's 1/t part (`partc.collectives.
    scatter_to_next_stage`): with tp > 1, a tensor every TP rank holds whole whose size divides by t. The cost model
    charges every boundary so (`partc.passes.cost_step.pp_bytes`)."""
    def split(x: torch.fx.Node) -> bool:
        val = x.meta.get("val")
        return t > 1 and x not in rw.split and isinstance(val, torch.Tensor) and val.numel() % t == 0
    return split


def _needs_grad(ep: torch.export.ExportedProgram, io: _GraphIO) -> set[torch.fx.Node]:
    """The nodes whose value needs a gradient: a floating-point value computed from a floating-point parameter
    (what `partc.passes.cuts` counts as a boundary's gradient; buffers, constants and inputs need none)."""
    def floating(n: torch.fx.Node) -> bool:
        val = n.meta.get("val")
        return any(isinstance(v, torch.Tensor) and v.is_floating_point()
                   for v in (val if isinstance(val, (list, tuple)) else [val]))
    grad = {n for n in io.params if floating(n)}
    for n in ep.graph.nodes:
        if n.op == "call_function" and floating(n) and n.target not in NO_GRADIENT and \
                any(x in grad for x in n.all_input_nodes):
            grad.add(n)
    return grad


_aten = torch.ops.aten
NO_GRADIENT = {_aten.zeros_like.default, _aten.ones_like.default, _aten.empty_like.default, _aten.full_like.default,
               _aten.rand_like.default, _aten.randn_like.default, _aten.new_zeros.default, _aten.new_ones.default,
               _aten.new_empty.default, _aten.new_full.default}
"""Ops whose floating output autograd does not track whatever their input (a value of the input's shape made
anew, `torch.zeros_like(x)`): no TP collective's backward runs for it (`_tp_traffic`)."""


