"""Ops on meta tensors, run once per distinct op and shapes: the identical blocks of a large model repeat them.

Meta tensors carry no data, so an op's result on meta is a function of its arguments' shapes, strides, offsets and
dtypes and its other arguments. `SameShapes` (a dispatch mode) runs each distinct call once and afterwards hands
out fresh tensors of the shapes it gave. Measuring the traced graph, replaying it at the micro-batch size and the
TP rewrite each run thousands of ops on meta, most of them repeats (GPT-3 175B: 96 identical blocks).
"""

from __future__ import annotations

import torch
from torch import nn

from partc._torch import TorchDispatchMode

_PLAIN = (torch.Tensor, nn.Parameter)
"""The tensor types whose ops `SameShapes` may answer from its cache."""


class SameShapes(TorchDispatchMode):
    """Runs an op on meta tensors once per distinct (op, argument shapes, strides and dtypes, other arguments)
    and afterwards hands out fresh tensors of the shapes it gave. Views and in-place ops (which return their
    input) always run, and so do ops on tensor subclasses other than parameters (the fake tensors of
    torch.export)."""

    def __init__(self):
        super().__init__()
        self.results: dict[tuple, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.is_view or func._schema.is_mutable or any(t not in _PLAIN for t in types):
            return func(*args, **kwargs)
        try:
            key = (func, _key(args), _key(kwargs))
            out = self.results.get(key)
        except TypeError:  # an unhashable argument
            return func(*args, **kwargs)
        if out is not None:
            return fresh(out)
        out = func(*args, **kwargs)
        if plain(out):
            self.results[key] = out
        return out


def plain(out, *, fake: bool = False) -> bool:
    """Meta tensors (or tuples of them; with `fake`, fake ones too) that a fresh tensor of the same shape and
    strides stands for."""
    if isinstance(out, (list, tuple)):
        return all(plain(x, fake=fake) for x in out)
    return isinstance(out, torch.Tensor) and (fake or type(out) is torch.Tensor) and out.device.type == "meta"


def fresh(out):
    """A new meta tensor of `out`'s shape, strides, offset and dtype (a tuple of them for a tuple)."""
    if not isinstance(out, torch.Tensor):
        return type(out)(fresh(x) for x in out)
    if not out.storage_offset():
        return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="meta")
    span = 1 + sum((n - 1) * s for n, s in zip(out.shape, out.stride())) if out.numel() else 0
    base = torch.empty(out.storage_offset() + span, dtype=out.dtype, device="meta")
    return base.as_strided(out.shape, out.stride(), out.storage_offset())


def _key(a):
    """A hashable stand-in for an op's argument: a tensor by its metadata, anything else by its type and value."""
    if isinstance(a, torch.Tensor):
        return ("T", tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.device.type)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, *(_key(x) for x in a))
    if isinstance(a, dict):
        return ("D", *((k, _key(v)) for k, v in a.items()))
    if isinstance(a, float) and a != a:
        raise TypeError("nan")  # never equal to itself: no key
    return type(a), a  # 1, 1.0 and True are equal keys, but not equal arguments (int + 1.0 is a float)
