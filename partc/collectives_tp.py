"""Tensor-parallel and sequence-parallel collectives for the generated stage files: Megatron-LM's conjugate
autograd functions.

Shoeybi et al. 2019 (Megatron-LM, section 3): a column-parallel layer followed by a row-parallel one needs one
all-reduce in forward and one in backward, placed by a conjugate pair:

    copy_to_tp(x)       forward: identity             backward: all-reduce   (before the column split: f)
    reduce_from_tp(x)   forward: all-reduce           backward: identity     (after the row split: g)

and for other resharding (sequence parallelism, gathered logits):

    gather_from_tp(x, dim)          forward: all-gather along dim        backward: keep this rank's chunk
    scatter_to_tp(x, dim)           forward: keep this rank's chunk      backward: all-gather along dim
    reduce_scatter_to_tp(x, dim)    forward: reduce-scatter along dim    backward: all-gather along dim

Sequence parallelism (Korthikanti et al. 2022; Megatron-Core's ``gather_from_sequence_parallel_region`` and
``reduce_scatter_to_sequence_parallel_region``): between the tensor-parallel regions each rank holds 1/t of the
sequence, so Megatron's f and g become

    gather_from_sp(x, dim)          forward: all-gather along dim        backward: reduce-scatter along dim
    reduce_scatter_to_sp(x, dim)    forward: reduce-scatter along dim    backward: all-gather along dim

and, with the colwise layers' inputs gathered again in backward (Megatron-Core's default under sequence
parallelism), the gather and the Linears that read it in one function that keeps only this rank's part:

    linears_from_sp(x, dim, w, b, ...)   forward: all-gather along dim, the Linears   backward: all-gather again,
                                         the gradients, reduce-scatter of the input's along dim

(an all-reduce is a reduce-scatter and an all-gather: the same time on the wire, each collective half of it).

and, on the output layer split over the vocabulary (Megatron-Core's ``vocab_parallel_cross_entropy``):

    vocab_parallel_cross_entropy(logits, target, ignore_index)   the mean cross-entropy from each rank's
                                                                 vocabulary columns; the logits are never gathered

Each takes the ``tp`` process group, or uses the one in the table the runtime fills
(`partc.collectives_groups.set_groups`). With one rank in the group every function is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from partc.collectives_groups import (_Conjugate, _all_gather, _all_reduce, _chunk, _identity, _reduce_scatter,
                                      _size, axis_group)


def _apply(x: Tensor, dim: int | None, group: dist.ProcessGroup | None, forward_op, backward_op) -> Tensor:
    group = group or axis_group("tp")
    return x if _size(group) == 1 else _Conjugate.apply(x, dim, group, forward_op, backward_op)


def copy_to_tp(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    return _apply(x, None, group, _identity, _all_reduce)


def reduce_from_tp(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    return _apply(x, None, group, _all_reduce, _identity)


def gather_from_tp(x: Tensor, dim: int, group: dist.ProcessGroup | None = None) -> Tensor:
    return _apply(x, dim, group, _all_gather, _chunk)


def scatter_to_tp(x: Tensor, dim: int, group: dist.ProcessGroup | None = None) -> Tensor:
    return _apply(x, dim, group, _chunk, _all_gather)


def reduce_scatter_to_tp(x: Tensor, dim: int, group: dist.ProcessGroup | None = None) -> Tensor:
    return _apply(x, dim, group, _reduce_scatter, _all_gather)


def gather_from_sp(x: Tensor, dim: int, group: dist.ProcessGroup | None = None) -> Tensor:
    """Before a colwise layer under sequence parallelism: the ranks' parts of the sequence put together; the
    gradient (a partial sum on each rank: each holds the product with its own columns) is summed and each rank
    keeps its part of the sequence."""
    return _apply(x, dim, group, _all_gather, _reduce_scatter)


def reduce_scatter_to_sp(x: Tensor, dim: int, group: dist.ProcessGroup | None = None) -> Tensor:
    """After a rowwise layer under sequence parallelism: the partial sums summed, each rank keeping its part of the
    sequence; the gradient's parts are all-gathered (the rowwise layer needs the whole gradient)."""
    return _apply(x, dim, group, _reduce_scatter, _all_gather)


class _LinearsFromSP(torch.autograd.Function):
    """Linears ``F.linear(x_whole, w_i, b_i)`` of `x` all-gathered along `dim`, saving only this rank's part of
    `x` for backward (Megatron-Core's ``LinearWithGradAccumulationAndAsyncCommunication`` under sequence
    parallelism). Backward: the all-gather of `x` again, issued first and waited for after the input gradient's
    GEMMs (which do not need it: on NCCL it runs beside them); then the weight gradients, rank by rank part of the
    sequence (no concatenated copy), and the input gradient reduce-scattered along `dim`."""

    @staticmethod
    def forward(ctx, x, dim, group, *params):
        weights, biases = params[0::2], params[1::2]
        whole = _all_gather(x, dim, group)
        ctx.dim, ctx.group, ctx.has_bias = dim, group, [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        return tuple(torch.nn.functional.linear(whole, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        dim, group, n = ctx.dim, ctx.group, dist.get_world_size(ctx.group)
        parts = [torch.empty_like(x) for _ in range(n)]
        work = None if x.is_meta else dist.all_gather(parts, x.contiguous(), group=group, async_op=True)
        flat = [g.reshape(-1, g.shape[-1]) for g in grads]
        gx = flat[0] @ weights[0]
        for g, w in zip(flat[1:], weights[1:]):
            gx.addmm_(g, w)  # in place: one input gradient however many layers read the input
        if work is not None:
            work.wait()
        out = []
        for g, w, has_bias in zip(grads, weights, ctx.has_bias):
            gw = None
            for r, (gr, xr) in enumerate(zip(g.chunk(n, dim=dim), parts)):
                gr, xr = gr.reshape(-1, gr.shape[-1]), xr.reshape(-1, xr.shape[-1])
                gw = gr.t() @ xr if gw is None else gw.addmm_(gr.t(), xr)
            out += [gw, g.reshape(-1, g.shape[-1]).sum(0) if has_bias else None]
        del parts
        shape = list(x.shape)
        shape[dim] *= n
        return (_reduce_scatter(gx.view(shape), dim, group), None, None, *out)


def linears_from_sp(x: Tensor, dim: int, *params: Tensor | None, group: dist.ProcessGroup | None = None
                    ) -> tuple[Tensor, ...]:
    """Under sequence parallelism with `sp_regather`, the colwise Linears that read `x` (this rank's part of the
    sequence along `dim`): ``params`` = (weight, bias or None) of each, their outputs in that order. Forward as
    `gather_from_sp` followed by each ``F.linear``; backward the same gradients, but only `x`'s 1/t was kept: it is
    all-gathered again (`_LinearsFromSP`)."""
    group = group or axis_group("tp")
    if _size(group) == 1:
        return tuple(torch.nn.functional.linear(x, w, b) for w, b in zip(params[0::2], params[1::2]))
    return _LinearsFromSP.apply(x, dim, group, *params)


def scatter_to_next_stage(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Megatron-LM's scatter/gather (Narayanan et al. 2021, section 4.1): every rank of the TP group holds the same
    boundary tensor `x`, so each sends only its 1/t of it (flattened) to its peer of the next pipeline stage, over its
    own link. Backward: the gradient's parts are all-gathered (every TP rank of the next stage computed the same
    gradient, so each sent its part)."""
    return _apply(x.reshape(-1), 0, group, _chunk, _all_gather)


def gather_from_previous_stage(x: Tensor, shape: tuple[int, ...], group: dist.ProcessGroup | None = None) -> Tensor:
    """The receiving side of `scatter_to_next_stage`: all-gather the TP group's parts of the boundary tensor (over
    NVLink) and view them at its `shape`. Backward: this rank's part of the gradient goes back."""
    return _apply(x, 0, group, _all_gather, _chunk).view(shape)


def masked_embedding(weight: Tensor, ids: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Lookup in this rank's rows of a vocabulary-split embedding (Megatron's VocabParallelEmbedding): rank r holds
    rows [r·V/t, (r+1)·V/t); ids outside give zeros, and `reduce_from_tp` then sums the ranks' parts."""
    group = axis_group("tp") if group is None else group
    rank = 0 if group is None else dist.get_rank(group)
    start = rank * weight.shape[0]
    outside = (ids < start) | (ids >= start + weight.shape[0])
    local = torch.where(outside, torch.zeros_like(ids), ids - start)
    return torch.nn.functional.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits split over the vocabulary (Megatron-Core, ``tensor_parallel/cross_entropy.py``).

    Rank r holds columns [r·V/t, (r+1)·V/t) of logits [N, V]. Forward: the row maxima all-reduced (MAX, N floats),
    then the target's logit (from the rank that owns it, zero elsewhere) and the sum of exponentials all-reduced
    together (SUM, 2N floats): loss_i = log(sum_j exp(x_ij - m_i)) - (x_i,target - m_i), the mean over the rows whose
    target is not `ignore_index` (torch's ``reduction="mean"``). Backward, local: (softmax - onehot(target)) / count
    on this rank's columns, zero on ignored rows. Computes in fp32 whatever the logits' dtype: one fp32 working
    copy of this rank's columns, which becomes the softmax saved for backward and then, in place, the gradient
    (returned in the logits' dtype)."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, group):
        x = logits.float()
        if x is logits:
            x = x.clone()  # the exponentials are computed in place: never in the caller's tensor
        local = x.shape[-1]
        start = dist.get_rank(group) * local
        row_max = x.detach().amax(dim=-1)
        if not x.is_meta:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        x.sub_(row_max.unsqueeze(-1))
        ignored = target == ignore_index
        mine = (target >= start) & (target < start + local) & ~ignored
        index = torch.where(mine, target - start, torch.zeros_like(target)).unsqueeze(-1)
        both = torch.stack([x.gather(-1, index).squeeze(-1) * mine, x.exp_().sum(dim=-1)])
        if not x.is_meta:
            dist.all_reduce(both, group=group)
        picked, sums = both[0], both[1]
        count = (~ignored).sum()
        loss = (sums.log() - picked).masked_fill(ignored, 0.0).sum() / count
        x.div_(sums.unsqueeze(-1))  # softmax, this rank's columns
        ctx.save_for_backward(x, index, mine, ignored, count)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, index, mine, ignored, count = ctx.saved_tensors
        g = softmax  # in place, as Megatron-Core: the saved softmax is not needed again
        g.scatter_add_(-1, index, -mine.unsqueeze(-1).to(g.dtype))
        g.mul_(((grad / count.clamp(min=1)) * ~ignored).unsqueeze(-1))  # no row counted: zero, as torch's
        return g.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100,
                                 group: dist.ProcessGroup | None = None) -> Tensor:
    """``F.cross_entropy(logits_whole, target, ignore_index=ignore_index)`` (mean) from this rank's vocabulary
    columns `logits` [N, V/t] (rank r's are [r·V/t, (r+1)·V/t)) and the class indices `target` [N]; with one rank,
    torch's own cross-entropy."""
    group = group or axis_group("tp")
    if _size(group) == 1:
        return torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=ignore_index)
    return _VocabParallelCrossEntropy.apply(logits, target, ignore_index, group)
