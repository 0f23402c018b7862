"""What fused kernels keep for backward, given to the traced program (`Parallel.fuse_pointwise`).

Megatron-Core and Transformer Engine train with fused kernels that keep less for backward than the ATen ops a
model file writes: a fused RMSNorm keeps its input (not the fp32 copy and the normalized x), a fused SwiGLU keeps
gate and up (not silu(gate) as well), an attention kernel with grouped-query support reads the keys and values
unrepeated. partc does not swap the model's ops for such kernels (their numerics differ); it gives the program
their memory behaviour with the model's own ops:

* **Pointwise regions** (`regions`): a chain of elementwise ops and reductions over the last dim between the
  matmuls (``x.float() -> pow -> mean -> rsqrt -> mul -> type_as -> * weight``; ``silu(gate) * up``) runs as one
  ``torch.autograd.Function`` (`partc.fused.pointwise`): the same ATen ops in forward without autograd, only the
  region's inputs kept, and in backward the chain replayed from them and differentiated by autograd (the same
  backward ops as without it). No matmul runs again; the replay costs the region's memory-bound forward once more.
  A region is fused only where that keeps fewer bytes (its inputs) than its ops save (`keeps_less`): a
  residual add, a GeLU, a dropout or the rotary embedding's products stay as they are.
* **Grouped-query attention on unrepeated keys and values** (`gqa_attention`): ``repeat_interleave`` (or Hugging
  Face's ``repeat_kv``) feeding only ``scaled_dot_product_attention`` becomes the attention's ``enable_gqa=True``
  on the unrepeated tensors, which the attention kernel saves as they are.

The trace prices both from what autograd saves (`passes.trace`), the codegen writes them (`passes.codegen`), and
`partc check` measures what the program keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.fx

from partc import collectives
from partc.passes.context import kv_repeat
from partc.passes.export import GRAD_ENABLED

aten = torch.ops.aten

ELEMENTWISE = {
    aten.to.dtype, aten._to_copy.default, aten.type_as.default, aten.pow.Tensor_Scalar, aten.add.Tensor,
    aten.add.Scalar, aten.sub.Tensor, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.rsqrt.default,
    aten.sqrt.default, aten.silu.default, aten.sigmoid.default, aten.tanh.default, aten.gelu.default,
    aten.relu.default, aten.neg.default, aten.exp.default, aten.reciprocal.default,
}
"""Deterministic elementwise ops a region may hold (no random ops: a replay must compute the same values)."""
LAST_DIM = {aten.mean.dim, aten.sum.dim_IntList}
"""Reductions a region may hold when over the last dim only, keeping it (an RMSNorm's mean of squares)."""
MAY_ALIAS = {aten.to.dtype, aten.type_as.default}
"""Ops that return their input when it already has the dtype: never a region's output (an autograd.Function's
output must not be its input)."""
SKIPPED_USERS = {aten._assert_tensor_metadata.default}
"""Users that only check metadata at trace time (the program does not run them)."""


@dataclass(kw_only=True, slots=True)
class Region:
    """A pointwise region: `nodes` in execution order, the last its `output`; `inputs` the values it reads."""

    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node]

    @property
    def output(self) -> torch.fx.Node:
        return self.nodes[-1]


def _tensor(n) -> torch.Tensor | None:
    val = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _candidate(n: torch.fx.Node) -> bool:
    if n.op != "call_function" or n.meta.get(GRAD_ENABLED) is not None:
        return False
    val = _tensor(n)
    if val is None or not val.is_floating_point():
        return False
    if n.target is aten._to_copy.default and set(n.kwargs) - {"dtype"}:
        return False
    if n.target in LAST_DIM:
        src = _tensor(n.args[0])
        dims = n.args[1] if len(n.args) > 1 else None
        keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        return (src is not None and isinstance(dims, (list, tuple)) and len(dims) == 1 and keep is True
                and dims[0] % src.dim() == src.dim() - 1 and not n.kwargs.get("dtype"))
    return n.target in ELEMENTWISE


def regions(nodes: list[torch.fx.Node], *, params: set[torch.fx.Node],
            needs_grad: Callable[[torch.fx.Node], bool]) -> list[Region]:
    """The pointwise regions among `nodes` (one unit's, or one function's, in execution order): from each candidate
    output (latest first), the region grows backwards over the candidate ops all of whose users are already in it,
    so that nothing outside reads a value inside but its output. Kept where `keeps_less`. `params`: parameter
    values (not activations); `needs_grad`: whether a value needs a gradient (what autograd then saves)."""
    local = set(nodes)
    order = {n: i for i, n in enumerate(nodes)}
    taken: set[torch.fx.Node] = set()
    out: list[Region] = []
    for root in reversed(nodes):
        if root in taken or not _candidate(root) or root.target in MAY_ALIAS:
            continue
        members = {root}
        grown = True
        while grown:
            grown = False
            for m in list(members):
                for a in m.all_input_nodes:
                    if (a in members or a in taken or a not in local or not _candidate(a)
                            or any(u not in members for u in a.users if u.target not in SKIPPED_USERS)):
                        continue
                    members.add(a)
                    grown = True
        if len(members) < 2:
            continue
        body = sorted(members, key=order.__getitem__)
        inputs: list[torch.fx.Node] = []
        for m in body:
            for a in m.all_input_nodes:
                if a not in members and a not in inputs:
                    inputs.append(a)
        region = Region(nodes=body, inputs=inputs)
        if keeps_less(region, params, needs_grad):
            taken |= members
            out.append(region)
    return sorted(out, key=lambda r: order[r.output])


def keeps_less(region: Region, params: set[torch.fx.Node], needs_grad: Callable[[torch.fx.Node], bool]) -> bool:
    """Whether the region's inputs (what the fused region keeps, parameters aside) are fewer bytes than what its
    ops save for backward, run once on meta tensors of the traced shapes under ``saved_tensors_hooks``."""
    env: dict[torch.fx.Node, torch.Tensor] = {}
    alive: list[torch.Tensor] = []
    kept = 0
    for x in region.inputs:
        val = _tensor(x)
        if val is None:
            return False
        t = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device="meta")
        if val.is_floating_point() and needs_grad(x):
            t.requires_grad_(True)
        env[x] = t
        if x not in params:
            kept += val.numel() * val.element_size()
    skip = {env[x].untyped_storage()._cdata for x in params if x in env}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        alive.append(t)
        key = t.untyped_storage()._cdata
        if key not in skip:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for n in region.nodes:
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
            env[n] = n.target(*args, **kwargs)
            alive.append(env[n])
    return kept < sum(saved.values())


def param_values(graph: torch.fx.Graph, params: Iterable[torch.fx.Node]) -> set[torch.fx.Node]:
    """The parameters' placeholders and the values that are a parameter as the program uses it (`partc.
    collectives`' identity in forward, ``tp.copy_to_tp(p[...])`` under sequence parallelism)."""
    out = set(params)
    for n in graph.nodes:
        if (n.op == "call_function" and collectives.is_collective(n.target)
                and n.args and n.args[0] in out and n.target.__name__ == "copy_to_tp"):
            out.add(n)
    return out


def grad_values(graph: torch.fx.Graph, params: Iterable[torch.fx.Node]) -> set[torch.fx.Node]:
    """The values that need a gradient: floating-point values computed from a floating-point parameter."""
    def floating(n: torch.fx.Node) -> bool:
        val = n.meta.get("val")
        return any(isinstance(v, torch.Tensor) and v.is_floating_point()
                   for v in (val if isinstance(val, (list, tuple)) else [val]))
    grad = {n for n in params if floating(n)}
    for n in graph.nodes:
        if n.op == "call_function" and floating(n) and any(x in grad for x in n.all_input_nodes):
            grad.add(n)
    return grad


@dataclass(kw_only=True, slots=True)
class GQA:
    """A ``scaled_dot_product_attention`` reading keys and values repeated only for it."""

    attention: torch.fx.Node
    repeated: tuple[torch.fx.Node, torch.fx.Node]
    """The key and value as the attention reads them today (repeated to the query heads)."""
    unrepeated: tuple[torch.fx.Node, torch.fx.Node]
    chains: tuple[list[torch.fx.Node], list[torch.fx.Node]]
    """The nodes that repeat each (`partc.passes.context.kv_repeat`), the repeated value first."""


def gqa_attention(nodes: Iterable[torch.fx.Node]) -> list[GQA]:
    """The attention ops whose key and value are both repeated by the same factor along the heads, each repeat
    read by nothing else (then ``enable_gqa`` on the unrepeated tensors computes the same)."""
    out = []
    for n in nodes:
        if n.op != "call_function" or n.target is not aten.scaled_dot_product_attention.default:
            continue
        if n.kwargs.get("enable_gqa") or n.meta.get(GRAD_ENABLED) is not None or len(n.args) < 3:
            continue
        k, v = kv_repeat(n.args[1]), kv_repeat(n.args[2])
        if k is None or v is None or k[1] != v[1] or n.args[1] is n.args[2]:
            continue
        if not all(len([u for u in x.users if u.target not in SKIPPED_USERS]) == 1 for x in (*k[2], *v[2])):
            continue
        out.append(GQA(attention=n, repeated=(n.args[1], n.args[2]), unrepeated=(k[0], v[0]), chains=(k[2], v[2])))
    return out


def use_gqa(graph: torch.fx.Graph, found: list[GQA]) -> None:
    """Rewrite each found attention to read the unrepeated key and value with ``enable_gqa=True``, in place."""
    for g in found:
        n = g.attention
        args = list(n.args)
        args[1], args[2] = g.unrepeated
        n.args = tuple(args)
        n.kwargs = {**n.kwargs, "enable_gqa": True}
        for chain in g.chains:
            for x in chain:
                for u in list(x.users):
                    if u.target in SKIPPED_USERS:
                        graph.erase_node(u)
                graph.erase_node(x)

