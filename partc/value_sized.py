"""Ops whose output size depends on tensor values (a hand-written mixture of experts' routing), at expected sizes.

torch.export traces ``idx = torch.nonzero(choice == e)`` with an unbacked size (``i64[u0, 1]``): how many tokens
chose expert e is known only when the program runs. The generated program runs the op as written, at the real
sizes. Everything that prices or checks the program on meta or fake tensors (the measurement, the TP rewrite,
`partc check`) runs it at an expected size instead: `ExpectedSizes` answers the op with an output of
``ceil(fraction x elements of the mask)`` rows, where the mask is compared with one of `groups` values (the
experts), each expected to hold an equal share (uniform routing). plan.json states it (``model.expected_sizes``).
"""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import FakeTensor

from partc._torch import TorchDispatchMode

aten = torch.ops.aten

VALUE_SIZED_OPS = (aten.nonzero.default,)
"""The ops answered at an expected size (others whose size depends on values are refused at the trace)."""
EXPECTED_SIZES = "partc_expected_sizes"
"""Graph-module meta key: the expectation (`ExpectedSizes.to_dict`) of a graph holding a value-sized op."""
VALUE_SIZED = "partc_value_sized"
"""Node meta key: True on a node whose value's size depends on tensor values (traced unbacked)."""


def expected_rows(numel: int, fraction: float, samples: int = 1) -> int:
    """Rows of a value-sized op's output over a mask of `numel` elements of `samples` samples, `fraction` of them
    expected set: a whole number per sample (the trace's, at one sample, times `samples`), so that what the plan
    prices per sample and scales by the micro-batch is what a check at the micro-batch runs."""
    if samples < 1 or numel % samples:
        samples = 1
    return max(1, math.ceil(numel // samples * fraction - 1e-9)) * samples


class ExpectedSizes(TorchDispatchMode):
    """`VALUE_SIZED_OPS` on meta or fake tensors give an output of `expected_rows` rows (a mask compared with one
    of `groups` values: 1/groups of its elements); every other op runs as it is."""

    def __init__(self, groups: int, samples: int = 1):
        super().__init__()
        self.groups, self.samples = groups, samples

    @property
    def fraction(self) -> float:
        return 1.0 / self.groups

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if func in VALUE_SIZED_OPS and isinstance(x, torch.Tensor) and (x.is_meta or isinstance(x, FakeTensor)):
            return torch.empty((expected_rows(x.numel(), self.fraction, self.samples), x.dim()), dtype=torch.long,
                               device=x.device)
        return func(*args, **kwargs)


def expected_sizes(meta: dict | None, samples: int = 1):
    """An `ExpectedSizes` mode for a graph module's meta or a plan's ``model`` dict holding ``expected_sizes``
    (`EXPECTED_SIZES`), its masks of `samples` samples, or None when it has none."""
    stated = (meta or {}).get(EXPECTED_SIZES) or (meta or {}).get("expected_sizes")
    return ExpectedSizes(stated["groups"], samples) if stated else None
