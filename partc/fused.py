"""A pointwise region kept at its inputs, as the generated programs call it (`Parallel.fuse_pointwise`,
`partc.passes.fuse`): what a fused RMSNorm or SwiGLU kernel keeps for backward, with the model's own ops.

    y = fused.pointwise(fn, x, weight)

runs ``fn(x, weight)`` (the region's ATen ops, written out in the stage file) without autograd and keeps only its
inputs; its backward runs ``fn`` again on them under autograd and differentiates that (``torch.autograd.grad``):
the forward values are the same ops', and the gradients are made by the same backward ops as without the region.
"""

from __future__ import annotations

from typing import Callable

import torch


class _Pointwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        out = fn(*inputs)
        assert all(out is not x for x in inputs), "a fused region returns a value of its own"
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        needs = ctx.needs_input_grad[1:]
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(True) if need else x.detach()
                      for x, need in zip(ctx.saved_tensors, needs)]
            out = ctx.fn(*leaves)
        wanted = [x for x, need in zip(leaves, needs) if need]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
        return (None, *(next(grads) if need else None for need in needs))


def pointwise(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)``, keeping only `inputs` for backward (the region replayed there)."""
    return _Pointwise.apply(fn, *inputs)
