"""Tensor-parallel collectives for the generated stage files: Megatron-LM's conjugate autograd functions.

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

(an all-reduce is a reduce-scatter and an all-gather: the same time on the wire, each collective half of it).

and, on the output layer split over the vocabulary (Megatron-Core's ``vocab_parallel_cross_entropy``):

    vocab_parallel_cross_entropy(logits, target, ignore_index)   the mean cross-entropy from each rank's
                                                                 vocabulary columns; the logits are never gathered

Each takes the ``tp`` process group, or uses the one the runtime set with `set_tp_group`. With one rank in the
group every function is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

_TP_GROUP: dist.ProcessGroup | None = None


def set_tp_group(group: dist.ProcessGroup | None) -> None:
    """The default ``tp`` group (the runtime sets it once the mesh exists)."""
    global _TP_GROUP
    _TP_GROUP = group


def get_tp_group() -> dist.ProcessGroup | None:
    return _TP_GROUP


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


def _apply(x: Tensor, dim: int | None, group: dist.ProcessGroup | None, forward_op, backward_op) -> Tensor:
    group = group or _TP_GROUP
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
    group = _TP_GROUP if group is None else group
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
        g.mul_(((grad / count) * ~ignored).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100,
                                 group: dist.ProcessGroup | None = None) -> Tensor:
    """``F.cross_entropy(logits_whole, target, ignore_index=ignore_index)`` (mean) from this rank's vocabulary
    columns `logits` [N, V/t] (rank r's are [r·V/t, (r+1)·V/t)) and the class indices `target` [N]; with one rank,
    torch's own cross-entropy."""
    group = group or _TP_GROUP
    if _size(group) == 1:
        return torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=ignore_index)
    return _VocabParallelCrossEntropy.apply(logits, target, ignore_index, group)


# -- expert parallelism ----------------------------------------------------------------------------------------------
#
# The routed experts of a mixture of experts divided among the ranks of an ``ep`` group, rank r holding experts
# [r·E/ep, (r+1)·E/ep) (torchtitan's and Megatron-Core's layout). After the router each (token, expert) pair goes to
# its expert's rank with one uneven ``all_to_all_single`` and its result comes back with another (dropless: every
# pair is computed; the splits are exchanged first, E integers). The backward sends the gradients the other way
# over the same splits.


class _AllToAll(torch.autograd.Function):
    """Rows of `x` sent in `send` counts to the group's ranks in order, `recv` counts received from each; the
    gradient goes back over the same splits."""

    @staticmethod
    def forward(ctx, x, recv, send, group):
        ctx.recv, ctx.send, ctx.group = recv, send, group
        return _all_to_all(x, recv, send, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.send, ctx.recv, ctx.group), None, None, None


def _all_to_all(x: Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def _inverse(perm: Tensor) -> Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


_EP_GROUP: dist.ProcessGroup | None = None


def set_ep_group(group: dist.ProcessGroup | None) -> None:
    """The default ``ep`` group (the runtime sets it once the mesh exists; None: one rank holds every expert)."""
    global _EP_GROUP
    _EP_GROUP = group


def expert_parallel(hidden: Tensor, index: Tensor, weights: Tensor, experts, *params: Tensor, num_experts: int,
                    group: dist.ProcessGroup | None = None) -> Tensor:
    """A routed mixture of experts over an ``ep`` group: ``out[t] = sum_j weights[t, j] · expert_{index[t, j]}(
    hidden[t])``, as Hugging Face's packed experts compute it (pairs sorted by expert, one grouped GEMM per weight,
    each pair's result scaled by its routing weight, the k results of a token summed).

    `hidden` (T, H), `index` (T, k) the experts each token chose (global ids), `weights` (T, k) their routing
    weights. `experts(rows, offsets, *params)` runs this rank's E/ep experts (`params`: its part of the packed
    parameters) on `rows` sorted by local expert, `offsets` the int32 cumulative count of rows per local expert (the
    grouped GEMMs' offsets). The routing weights never leave the rank: the results come back unscaled and are
    scaled where the token lives. `group`: the ``ep`` group (default: the one `set_ep_group` set)."""
    group = group or _EP_GROUP
    # Packed experts are this rank's own fp32 master weights under ep (FSDP leaves them alone): cast for compute
    # (a differentiable cast, the gradient comes back in fp32), as FSDP's mixed precision casts the others.
    params = tuple(p.to(hidden.dtype) if p.is_floating_point() else p for p in params)
    run = experts
    experts = lambda rows, offsets: run(rows, offsets, *params)  # noqa: E731
    ep = _size(group)
    tokens, k = index.shape
    if hidden.is_meta:  # shapes only (the runtime learns a stage's shapes on meta): every pair at home
        local = num_experts // ep
        counts = torch.full((local,), tokens * k // local, dtype=torch.int32, device=hidden.device)
        y = experts(hidden.new_empty((tokens * k, hidden.shape[-1])), counts.cumsum(0, dtype=torch.int32))
        return (y * weights.reshape(-1, 1)).view(tokens, k, -1).sum(1)
    if _is_fake(hidden):  # `partc check`: no values to route by; routing taken uniform, as the plan prices it
        return _uniform(hidden, weights, experts, num_experts, group, ep)
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = hidden[order // k]
    counts = torch.bincount(flat, minlength=num_experts)
    if ep == 1:
        y = experts(rows, counts.cumsum(0, dtype=torch.int32))
    else:
        local = num_experts // ep
        assert local * ep == num_experts, (num_experts, ep)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)  # [source rank, local expert] counts
        received = received.view(ep, local)
        send = counts.view(ep, local).sum(1).tolist()
        recv = received.sum(1).tolist()
        x = _AllToAll.apply(rows, recv, send, group)
        # The rows came grouped by source rank, each group sorted by local expert: sort them by local expert.
        ids = torch.arange(local, device=flat.device).repeat(ep)
        perm = torch.argsort(torch.repeat_interleave(ids, received.reshape(-1)), stable=True)
        y = experts(x[perm], received.sum(0).cumsum(0, dtype=torch.int32))
        y = _AllToAll.apply(y[_inverse(perm)], send, recv, group)
    y = y * weights.reshape(-1)[order].unsqueeze(-1)
    return y[_inverse(order)].view(tokens, k, -1).sum(1)


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _uniform(hidden: Tensor, weights: Tensor, experts, num_experts: int, group, ep: int) -> Tensor:
    """`expert_parallel` without tensor values (fake tensors): every expert gets an equal share of every rank's
    (token, expert) pairs, the same collectives with the splits that gives."""
    tokens, k = weights.shape
    pairs, device = tokens * k, hidden.device
    per = [pairs // num_experts + (e < pairs % num_experts) for e in range(num_experts)]
    rows = hidden[torch.arange(pairs, device=device) // k]
    if ep == 1:
        y = experts(rows, torch.tensor(per, device=device).cumsum(0, dtype=torch.int32))
    else:
        local = num_experts // ep
        counts = torch.tensor(per, device=device)
        dist.all_to_all_single(torch.empty_like(counts), counts, group=group)
        send = [sum(per[r * local:(r + 1) * local]) for r in range(ep)]
        mine = per[dist.get_rank(group) * local:(dist.get_rank(group) + 1) * local]  # from each rank alike
        recv = [sum(mine)] * ep
        x = _AllToAll.apply(rows, recv, send, group)
        ids = [e for _ in range(ep) for e, n in enumerate(mine) for _ in range(n)]
        perm = torch.tensor(sorted(range(len(ids)), key=ids.__getitem__), device=device)
        offsets = torch.tensor([n * ep for n in mine], device=device).cumsum(0, dtype=torch.int32)
        y = experts(x[perm], offsets)
        y = _AllToAll.apply(y[_inverse(perm)], send, recv, group)
    return (y * weights.reshape(-1, 1)).view(tokens, k, -1).sum(1)
