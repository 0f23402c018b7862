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

and, with the colwise layers' inputs gathered again in backward (Megatron-Core's default under sequence
parallelism), the gather and the Linears that read it in one function that keeps only this rank's part:

    linears_from_sp(x, dim, w, b, ...)   forward: all-gather along dim, the Linears   backward: all-gather again,
                                         the gradients, reduce-scatter of the input's along dim

(an all-reduce is a reduce-scatter and an all-gather: the same time on the wire, each collective half of it).

and, on the output layer split over the vocabulary (Megatron-Core's ``vocab_parallel_cross_entropy``):

    vocab_parallel_cross_entropy(logits, target, ignore_index)   the mean cross-entropy from each rank's
                                                                 vocabulary columns; the logits are never gathered

Each takes the ``tp`` process group, or uses the one the runtime set with `set_tp_group`. With one rank in the
group every function is the identity.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

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
    group = group or _TP_GROUP
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
_EP_IMBALANCE = 1.0
_EP_ROWS: list[int] | None = None


def set_ep_group(group: dist.ProcessGroup | None, imbalance: float = 1.0) -> None:
    """The default ``ep`` group (the runtime sets it once the mesh exists; None: one rank holds every expert) and
    the routing imbalance the plan prices (`partc.parallel.Parallel.imbalance`), which `partc check` routes its
    fake tensors by (`_uniform`)."""
    global _EP_GROUP, _EP_IMBALANCE
    _EP_GROUP, _EP_IMBALANCE = group, imbalance


@contextlib.contextmanager
def counting_expert_rows() -> Iterator[list[int]]:
    """Yields a list to which every `expert_parallel` call under ep > 1 in the block appends the rows this rank's
    experts received (a recomputed forward once more): the measured side of the plan's routing imbalance (the
    runtime compares the ep ranks' lists, `partc.runtime.api.Program.expert_imbalance`)."""
    global _EP_ROWS
    outer, _EP_ROWS = _EP_ROWS, []
    try:
        yield _EP_ROWS
    finally:
        _EP_ROWS = outer


def expert_parallel(hidden: Tensor, index: Tensor, weights: Tensor, experts, *params: Tensor, num_experts: int,
                    group: dist.ProcessGroup | None = None, sizes: bool = False) -> Tensor:
    """A routed mixture of experts over an ``ep`` group: ``out[t] = sum_j weights[t, j] · expert_{index[t, j]}(
    hidden[t])``, as Hugging Face's packed experts compute it (pairs sorted by expert, one grouped GEMM per weight,
    each pair's result scaled by its routing weight, the k results of a token summed).

    `hidden` (T, H), `index` (T, k) the experts each token chose (global ids), `weights` (T, k) their routing
    weights. `experts(rows, offsets, *params)` runs this rank's E/ep experts (`params`: its part of the packed
    parameters) on `rows` sorted by local expert, `offsets` the int32 cumulative count of rows per local expert (the
    grouped GEMMs' offsets). The routing weights never leave the rank: the results come back unscaled and are
    scaled where the token lives. `group`: the ``ep`` group (default: the one `set_ep_group` set). `sizes`:
    `experts` takes the rows of each local expert as a list of ints instead of the offsets (`each_expert`)."""
    group = group or _EP_GROUP
    # Packed experts are this rank's own fp32 master weights under ep (FSDP leaves them alone): cast for compute
    # (a differentiable cast, the gradient comes back in fp32), as FSDP's mixed precision casts the others.
    params = tuple(p.to(hidden.dtype) if p.is_floating_point() else p for p in params)
    run = experts

    def experts(rows, counts):  # counts: rows per local expert (a list of ints, or an int tensor)
        if sizes:
            return run(rows, [int(c) for c in counts], *params)
        counts = torch.as_tensor(counts, device=rows.device)
        return run(rows, counts.cumsum(0, dtype=torch.int32), *params)
    ep = _size(group)
    tokens, k = index.shape
    if hidden.is_meta:  # shapes only (the runtime learns a stage's shapes on meta): every pair at home
        local = num_experts // ep
        y = experts(hidden.new_empty((tokens * k, hidden.shape[-1])),
                    [tokens * k // local + (e < tokens * k % local) for e in range(local)])
        return (y * weights.reshape(-1, 1)).view(tokens, k, -1).sum(1)
    if _is_fake(hidden):  # `partc check`: no values to route by; routing taken uniform, as the plan prices it
        return _uniform(hidden, weights, experts, num_experts, group, ep)
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = hidden[order // k]
    counts = torch.bincount(flat, minlength=num_experts)
    if ep == 1:
        y = experts(rows, counts.tolist() if sizes else counts)
    else:
        local = num_experts // ep
        assert local * ep == num_experts, (num_experts, ep)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)  # [source rank, local expert] counts
        received = received.view(ep, local)
        send = counts.view(ep, local).sum(1).tolist()
        recv = received.sum(1).tolist()
        if _EP_ROWS is not None:
            _EP_ROWS.append(sum(recv))
        x = _AllToAll.apply(rows, recv, send, group)
        # The rows came grouped by source rank, each group sorted by local expert: sort them by local expert.
        ids = torch.arange(local, device=flat.device).repeat(ep)
        perm = torch.argsort(torch.repeat_interleave(ids, received.reshape(-1)), stable=True)
        per = received.sum(0)
        y = experts(x[perm], per.tolist() if sizes else per)
        y = _AllToAll.apply(y[_inverse(perm)], send, recv, group)
    y = y * weights.reshape(-1)[order].unsqueeze(-1)
    return y[_inverse(order)].view(tokens, k, -1).sum(1)


def each_expert(expert, per_expert: int):
    """`expert_parallel`'s `experts` (with ``sizes=True``) for experts written as modules (an ``nn.ModuleList``):
    ``expert(rows, *its parameters)`` run on each local expert's rows, `per_expert` parameters each, in order."""

    def run(rows: Tensor, sizes: list[int], *params: Tensor) -> Tensor:
        parts = rows.split(sizes)
        return torch.cat([expert(part, *params[j * per_expert:(j + 1) * per_expert]) for j, part in enumerate(parts)])
    return run


def held_experts(p: dict[str, Tensor], names: list[str], per_expert: int,
                 group: dist.ProcessGroup | None = None) -> list[Tensor]:
    """The parameters of the experts this rank holds, from `p` (the stage's tensors): `names` lists every expert's
    `per_expert` parameters, expert by expert; rank r of the ``ep`` group holds experts [r·E/ep, (r+1)·E/ep) and
    only their modules."""
    group = group or _EP_GROUP
    ep, rank = _size(group), (0 if _size(group) == 1 else dist.get_rank(group))
    local = len(names) // per_expert // ep
    return [p[n] for n in names[rank * local * per_expert:(rank + 1) * local * per_expert]]


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _spread(n: int, parts: int) -> list[int]:
    """`n` as `parts` integers differing by at most one, the larger first."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def _uniform(hidden: Tensor, weights: Tensor, experts, num_experts: int, group, ep: int) -> Tensor:
    """`expert_parallel` without tensor values (fake tensors): every expert gets an equal share of every rank's
    (token, expert) pairs, the same collectives with the splits that gives. Under the plan's imbalance F
    (`set_ep_group`), the routing it prices: every rank sends the share F/ep of its pairs to ep rank 0's experts
    (the busiest rank, the one `partc check` measures) and spreads the rest evenly over the others'."""
    tokens, k = weights.shape
    pairs, device = tokens * k, hidden.device
    per = _spread(pairs, num_experts)
    if ep > 1 and _EP_IMBALANCE != 1.0:
        local = num_experts // ep
        busy = min(pairs, round(pairs * min(_EP_IMBALANCE, ep) / ep))
        per = _spread(busy, local) + _spread(pairs - busy, num_experts - local)
    rows = hidden[torch.arange(pairs, device=device) // k]
    if ep == 1:
        y = experts(rows, per)
    else:
        local = num_experts // ep
        counts = torch.tensor(per, device=device)
        dist.all_to_all_single(torch.empty_like(counts), counts, group=group)
        send = [sum(per[r * local:(r + 1) * local]) for r in range(ep)]
        mine = per[dist.get_rank(group) * local:(dist.get_rank(group) + 1) * local]  # from each rank alike
        recv = [sum(mine)] * ep
        if _EP_ROWS is not None:
            _EP_ROWS.append(sum(recv))
        x = _AllToAll.apply(rows, recv, send, group)
        ids = [e for _ in range(ep) for e, n in enumerate(mine) for _ in range(n)]
        perm = torch.tensor(sorted(range(len(ids)), key=ids.__getitem__), device=device)
        y = experts(x[perm], [n * ep for n in mine])
        y = _AllToAll.apply(y[_inverse(perm)], send, recv, group)
    return (y * weights.reshape(-1, 1)).view(tokens, k, -1).sum(1)


# -- context parallelism (docs/context-parallel.md) ---------------------------------------------------------------
#
# Each of the cp ranks of a data-parallel replica holds part of every sequence: the sequence is cut in 2·cp chunks
# and rank i holds chunks i and 2·cp-1-i, so that under causal attention every rank does the same work (Llama 3,
# torchtitan). Everything in the model but attention is computed position by position on the rank's own tokens; the
# ops that make positions (``arange``, a slice of a table by position) are given the rank's global positions, and
# causal attention sees every key and value: all-gathered over cp in forward, their gradients reduce-scattered back
# in backward (Llama 3's all-gather design, simple and exact with grouped-query attention's few key/value heads).

_CP_GROUP: dist.ProcessGroup | None = None


def set_cp_group(group: dist.ProcessGroup | None) -> None:
    """The ``cp`` group of the stage files' context-parallel ops (the runtime sets it once the mesh exists)."""
    global _CP_GROUP
    _CP_GROUP = group


def get_cp_group() -> dist.ProcessGroup | None:
    return _CP_GROUP


def cp_rank_positions(n: int, rank: int, size: int, device=None) -> Tensor:
    """The global positions of the `n` tokens cp rank `rank` of `size` holds: chunks ``rank`` and
    ``2·size-1-rank`` of ``n // 2`` tokens each (all of ``0..n-1`` when size is 1)."""
    if size == 1:
        return torch.arange(n, device=device)
    if n % 2:
        raise ValueError(f"{n} tokens on a context-parallel rank do not split in two chunks")
    c = n // 2
    return torch.cat((torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c, device=device)))


def cp_cut(x: Tensor, dim: int, seq_len: int) -> Tensor:
    """This cp rank's tokens of `x` (a model input or a target holding whole samples) along its sequence `dim`."""
    rank, size = _cp_where(_CP_GROUP)
    if size == 1:
        return x
    if x.shape[dim] != seq_len:
        raise ValueError(f"dim {dim} of a tensor of shape {list(x.shape)} is not the plan's {seq_len} tokens")
    return x.index_select(dim, cp_rank_positions(seq_len // size, rank, size, x.device))


def cp_cut_targets(targets, seq_len: int):
    """`cp_cut` of every tensor in `targets` along its one dim (after the batch) of `seq_len` tokens (a target per
    token; the compiler refuses targets without one)."""
    if _size(_CP_GROUP) == 1:
        return targets

    def cut(t):
        if not isinstance(t, Tensor):
            return t
        dims = [d for d in range(1, t.dim()) if t.shape[d] == seq_len]
        return cp_cut(t, dims[0], seq_len) if dims else t
    import torch.utils._pytree as pytree
    return pytree.tree_map(cut, targets)


def _cp_where(group: dist.ProcessGroup | None) -> tuple[int, int]:
    size = _size(group)
    return (0 if size == 1 else dist.get_rank(group)), size


def cp_arange(start, end, step=1, *, dtype=None, device=None, layout=None, pin_memory=None) -> Tensor:
    """``arange(start, end, step)`` of this rank's tokens: the graph at the rank's ``n`` tokens had the positions
    ``start + step·j`` for ``j < n``; each j becomes its global position."""
    rank, size = _cp_where(_CP_GROUP)
    n = len(range(start, end, step))
    pos = start + step * cp_rank_positions(n, rank, size, device)
    return pos.to(dtype) if dtype is not None else pos


def cp_slice(x: Tensor, dim: int, start=None, end=None, step: int = 1) -> Tensor:
    """``x[start:end:step]`` along `dim` of a table indexed by position (a buffer of every position): the rows of
    this rank's tokens."""
    rank, size = _cp_where(_CP_GROUP)
    start = start or 0
    n = len(range(start, min(end if end is not None else x.shape[dim], x.shape[dim]), step))
    index = start + step * cp_rank_positions(n, rank, size, x.device)
    return x.index_select(dim, index)


def cp_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask=None, dropout_p: float = 0.0,
                 is_causal: bool = False, *, scale=None, enable_gqa: bool = False, repeats: int = 1) -> Tensor:
    """Causal ``scaled_dot_product_attention`` of this rank's queries against the keys and values of the whole
    sequence: `key` and `value` all-gathered over cp (their gradients reduce-scattered back) and put in sequence
    order, then `repeats` copies of each key/value head (grouped-query attention gathers its few heads before they
    are repeated). Each of the rank's two query chunks attends to the keys up to its own end, causally aligned at
    the lower right (``causal_lower_right``): the fused kernels run it without a mask in memory and skip what is
    masked, so the rank's attention work is that of its chunks, the same on every rank."""
    assert attn_mask is None and is_causal, "cp_attention replaces causal attention only"
    group = _CP_GROUP
    rank, size = _cp_where(group)
    if size > 1:
        dim = key.dim() - 2
        key, value = _in_sequence_order(gather_from_sp(key, dim, group), size), \
            _in_sequence_order(gather_from_sp(value, dim, group), size)
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    if size == 1:
        return torch.ops.aten.scaled_dot_product_attention(query, key, value, None, dropout_p, True, scale=scale,
                                                           enable_gqa=enable_gqa)
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.nn.attention.bias import causal_lower_right

    c = query.shape[-2] // 2
    out = []
    for q, chunk in zip(query.split(c, dim=-2), (rank, 2 * size - 1 - rank)):
        end = (chunk + 1) * c  # the keys this chunk's queries see: positions 0 .. end - 1
        k, v = key[..., :end, :], value[..., :end, :]
        if isinstance(q, FakeTensor):
            # `partc check` on fake tensors (a tensor subclass such as CausalBias cannot wrap one): the flash
            # kernel CausalBias calls on a GPU, whose causal flag aligns at the lower right when L < S.
            out.append(torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal=True, scale=scale if scale is not None else q.shape[-1] ** -0.5)[0])
        else:
            out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(c, end),
                                                      dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa))
    return torch.cat(out, dim=-2)


def _in_sequence_order(x: Tensor, size: int) -> Tensor:
    """The gathered keys (or values) of every rank, [rank 0's chunks 0 and 2·size-1, rank 1's, ...] along dim -2,
    put in sequence order: chunk j is the first half of rank j's part for j < size, else the second half of rank
    2·size-1-j's."""
    parts = x.chunk(2 * size, dim=-2)
    return torch.cat([parts[2 * j] if j < size else parts[2 * (2 * size - 1 - j) + 1] for j in range(2 * size)],
                     dim=-2)
