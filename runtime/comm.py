"""Count what this rank passes to collectives, by mesh axis: the runtime's side of the plan's
``predicted.ranks[].comm_bytes``.

While a `CommCounter` is active, every torch.distributed collective and point-to-point call (FSDP's
``all_gather_single`` / ``reduce_scatter_single``, the pipeline's ``isend`` / ``irecv``, the program's TP
all-reduces and all-gathers, the loss's all-reduce) adds the bytes of the tensors it is given to the axis of its
process group, by the definition the plan uses:

    all-reduce, broadcast, send, recv      the tensor
    all-gather                             the gathered output
    reduce-scatter                         the input
    all-to-all                             the rows of the input that leave the rank (its own split stays)

A group of one rank moves nothing and counts nothing. Groups are named by the caller (`World.groups`, the shared
weights' groups as ``pp``); the default group is ``world``.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import Tensor


def _nbytes(t: Any) -> int:
    if isinstance(t, Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


# Function name -> (the position and keyword of the argument whose bytes count, the position of `group`).
_COUNTED: dict[str, tuple[int, str, int]] = {
    "all_reduce": (0, "tensor", 2),
    "broadcast": (0, "tensor", 2),
    "send": (0, "tensor", 2),
    "recv": (0, "tensor", 2),
    "isend": (0, "tensor", 2),
    "irecv": (0, "tensor", 2),
    "all_gather": (0, "tensor_list", 2),
    "all_gather_into_tensor": (0, "output_tensor", 2),
    "all_gather_single": (0, "output_tensor", 2),
    "reduce_scatter": (1, "input_list", 3),
    "reduce_scatter_tensor": (1, "input", 3),
    "reduce_scatter_single": (1, "input", 3),
    "all_to_all_single": (1, "input", 4),  # counted by `_all_to_all_single`
}


class CommCounter:
    """Bytes this rank passes to collectives, by axis, while `counting()` is active."""

    def __init__(self, groups: dict[str, list[dist.ProcessGroup]]):
        """`groups`: axis name -> the process groups that belong to it."""
        self._axis = {id(g): axis for axis, gs in groups.items() for g in gs}
        self.bytes: dict[str, int] = defaultdict(int)

    def axis(self, group: dist.ProcessGroup | None) -> str:
        group = group or dist.group.WORLD
        return self._axis.get(id(group), "world" if group is dist.group.WORLD else "other")

    def add(self, group: dist.ProcessGroup | None, nbytes: int) -> None:
        if nbytes and dist.get_world_size(group) > 1:
            self.bytes[self.axis(group)] += nbytes

    @contextlib.contextmanager
    def counting(self) -> Iterator[dict[str, int]]:
        """Count from here to the end of the block; yields the counts (axis -> bytes) of this block."""
        self.bytes = defaultdict(int)
        with _patched(self):
            yield self.bytes


_ACTIVE: list[CommCounter] = []


def _all_to_all_single(fn: Callable) -> Callable:
    """``all_to_all_single(output, input, output_split_sizes, input_split_sizes, group)``: the input's bytes but
    those of this rank's own split."""

    @functools.wraps(fn)
    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, *args, **kwargs):
        if _ACTIVE and dist.get_world_size(group) > 1:
            n, me = dist.get_world_size(group), dist.get_rank(group)
            row = input[0].numel() * input.element_size() if input.shape[0] else 0
            own = input_split_sizes[me] if input_split_sizes else input.shape[0] // n
            _ACTIVE[-1].add(group, (input.shape[0] - own) * row)
        return fn(output, input, output_split_sizes, input_split_sizes, group, *args, **kwargs)

    return counted


def _wrap(name: str, fn: Callable) -> Callable:
    if name == "all_to_all_single":
        return _all_to_all_single(fn)
    position, keyword, group_position = _COUNTED[name]

    @functools.wraps(fn)
    def counted(*args, **kwargs):
        if _ACTIVE:
            value = kwargs[keyword] if keyword in kwargs else args[position] if len(args) > position else None
            group = kwargs["group"] if "group" in kwargs else \
                args[group_position] if len(args) > group_position else None
            _ACTIVE[-1].add(group, _nbytes(value))
        return fn(*args, **kwargs)

    return counted


@contextlib.contextmanager
def _patched(counter: CommCounter) -> Iterator[None]:
    """torch.distributed's functions replaced by counting ones (in the package and in distributed_c10d, where
    ``P2POp`` and ``batch_isend_irecv`` look them up) while `counter` is active."""
    originals = {name: getattr(c10d, name) for name in _COUNTED if hasattr(c10d, name)}
    wrapped = {name: _wrap(name, fn) for name, fn in originals.items()}
    _ACTIVE.append(counter)
    try:
        for name, fn in wrapped.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)
        yield
    finally:
        for name, fn in originals.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)
        _ACTIVE.pop()


def peak_memory_bytes(device: torch.device) -> int | None:
    """The device's peak allocated bytes since the last reset (CUDA), or None where the device does not say."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None
