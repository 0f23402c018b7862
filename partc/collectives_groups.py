"""The process groups of the program's collectives, one per mesh axis, and the primitives every axis's collectives
share (`partc.collectives`).

The runtime fills the table once the mesh exists (`set_groups`, from `partc.runtime.mesh.World`); a collective
takes its axis's group as an argument or reads it here (`axis_group`). An axis with no group in the table has one
rank, and every collective over it is the identity.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from partc.mesh_axes import AXES_BY_NAME

_GROUPS: dict[str, dist.ProcessGroup | None] = {}


def set_groups(groups: Mapping[str, dist.ProcessGroup | None]) -> None:
    """The process group of each axis (`partc.mesh_axes.AXES`), replacing the whole table: an axis left out has
    none, and ``set_groups({})`` forgets every group."""
    unknown = sorted(set(groups) - set(AXES_BY_NAME))
    assert not unknown, f"not axes of the mesh: {unknown}"
    _GROUPS.clear()
    _GROUPS.update(groups)


def axis_group(axis: str) -> dist.ProcessGroup | None:
    """The group of `axis` in the table (None: one rank)."""
    assert axis in AXES_BY_NAME, axis
    return _GROUPS.get(axis)


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


# On the meta device (the runtime runs the stage files on meta to learn the shapes a stage sends) each
# collective only computes its output's shape.

def _identity(x: Tensor, dim: int | None, group: dist.ProcessGroup) -> Tensor:
    return x


def _all_reduce(x: Tensor, dim: int | None, group: dist.ProcessGroup) -> Tensor:
    x = x.clone()
    if x.is_meta:
        return x
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    if x.is_meta:
        return torch.cat(parts, dim=dim)
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _chunk(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    n = dist.get_world_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {n} tensor-parallel ranks")
    # A copy, not a view: a view of the whole tensor keeps all of it alive (a pipeline stage holds what it sent
    # forward until the micro-batch's backward, and should hold its 1/t part only).
    return x.chunk(n, dim=dim)[dist.get_rank(group)].clone(memory_format=torch.contiguous_format)


def _reduce_scatter(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    # Reduce-scatter = all-reduce, then keep this rank's chunk. Simple and correct on every backend (gloo has no
    # reduce-scatter); on NCCL a fused `reduce_scatter_tensor` moves half the bytes.
    if dist.get_backend(group) == "nccl" and not x.is_meta:
        moved = x.movedim(dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // dist.get_world_size(group), *moved.shape[1:]))
        dist.reduce_scatter_tensor(out, moved, group=group)
        return out.movedim(0, dim).contiguous()
    return _chunk(_all_reduce(x, None, group), dim, group)


class _Conjugate(torch.autograd.Function):
    """`forward_op` on the value and `backward_op` on its gradient, both over `dim` of `group`."""

    @staticmethod
    def forward(ctx, x, dim, group, forward_op, backward_op):
        ctx.dim, ctx.group, ctx.backward_op = dim, group, backward_op
        return forward_op(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.dim, ctx.group), None, None, None, None
