"""Expert parallelism's collectives for the generated stage files (docs/expert-parallel.md).

The routed experts of a mixture of experts divided among the ranks of an ``ep`` group, rank r holding experts
[r·E/ep, (r+1)·E/ep) (torchtitan's and Megatron-Core's layout). After the router each (token, expert) pair goes to
its expert's rank with one uneven ``all_to_all_single`` and its result comes back with another (dropless: every
pair is computed; the splits are exchanged first, E integers). The backward sends the gradients the other way
over the same splits.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from partc.collectives_groups import _size, axis_group


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


_EP_IMBALANCE = 1.0
_EP_ROWS: list[int] | None = None


def set_expert_imbalance(imbalance: float) -> None:
    """The routing imbalance the plan prices (`partc.parallel.Parallel.imbalance`), which `partc check` routes its
    fake tensors by (`_uniform`); the runtime sets it with the groups."""
    global _EP_IMBALANCE
    _EP_IMBALANCE = imbalance


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
    scaled where the token lives. The sum is returned in the tokens' dtype, as the layer it replaces returns it
    (Hugging Face casts its sum back to the tokens' dtype, a plain loop adds into zeros of it): under bf16 the
    routing weights are fp32, and the sum would otherwise leave the rest of the model in fp32. `group`: the ``ep``
    group (default: the table's, `partc.collectives_groups.set_groups`). `sizes`: `experts` takes the rows of each
    local expert as a list of ints instead of the offsets (`each_expert`)."""
    group = group or axis_group("ep")
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
        return (y * weights.reshape(-1, 1)).view(tokens, k, -1).sum(1).to(hidden.dtype)
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
    return y[_inverse(order)].view(tokens, k, -1).sum(1).to(hidden.dtype)


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
    group = group or axis_group("ep")
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
    (`set_expert_imbalance`), the routing it prices: every rank sends the share F/ep of its pairs to ep rank 0's experts
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
    return (y * weights.reshape(-1, 1)).view(tokens, k, -1).sum(1).to(hidden.dtype)
