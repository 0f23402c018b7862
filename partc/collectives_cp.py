"""Context parallelism's collectives for the generated stage files (docs/context-parallel.md).

Each of the cp ranks of a data-parallel replica holds part of every sequence: the sequence is cut in 2·cp chunks
and rank i holds chunks i and 2·cp-1-i, so that under causal attention every rank does the same work (Llama 3,
torchtitan). Everything in the model but attention is computed position by position on the rank's own tokens; the
ops that make positions (``arange``, a slice of a table by position) are given the rank's global positions, and
causal attention sees every key and value: all-gathered over cp in forward, their gradients reduce-scattered back
in backward (Llama 3's all-gather design, simple and exact with grouped-query attention's few key/value heads).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from partc.collectives_groups import _size, axis_group
from partc.collectives_tp import gather_from_sp


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
    rank, size = _cp_where(axis_group("cp"))
    if size == 1:
        return x
    if x.shape[dim] != seq_len:
        raise ValueError(f"dim {dim} of a tensor of shape {list(x.shape)} is not the plan's {seq_len} tokens")
    return x.index_select(dim, cp_rank_positions(seq_len // size, rank, size, x.device))


def cp_cut_targets(targets, seq_len: int):
    """`cp_cut` of every tensor in `targets` along its one dim (after the batch) of `seq_len` tokens (a target per
    token; the compiler refuses targets without one)."""
    if _size(axis_group("cp")) == 1:
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
    rank, size = _cp_where(axis_group("cp"))
    n = len(range(start, end, step))
    pos = start + step * cp_rank_positions(n, rank, size, device)
    return pos.to(dtype) if dtype is not None else pos


def cp_slice(x: Tensor, dim: int, start=None, end=None, step: int = 1) -> Tensor:
    """``x[start:end:step]`` along `dim` of a table indexed by position (a buffer of every position): the rows of
    this rank's tokens."""
    rank, size = _cp_where(axis_group("cp"))
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
    group = axis_group("cp")
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
