"""Precision as plans, programs and the runtime use it (the plan's ``parallel.precision``).

``bf16`` (the default; Micikevicius et al. 2018, "Mixed Precision Training", with bf16 in place of fp16 and so no
loss scaling): parameters in compute, activations and the tensors pipeline stages and TP collectives exchange are
bf16; the master weights, the optimizer states and the gradients (accumulated over micro-batches and reduced over
the data-parallel ranks) are fp32; the loss is computed in fp32 from the model's outputs. ``fp32``: everything fp32.

The model is traced with its parameters and floating-point inputs in the compute dtype, so the program runs what the
model does at that precision (a Hugging Face RMSNorm's upcast to fp32 is in the graph), and the trace's byte counts
are those of the run. Buffers keep the dtype ``__init__`` gave them.

What each ZeRO stage keeps and moves at each precision (bytes per parameter, and per collective) is tabled once, in
``partc.passes.zero``: the runtime (``partc.runtime.parallelize``, FSDP2 with ``MixedPrecisionPolicy(param_dtype=
compute dtype, reduce_dtype=fp32)`` for every stage) holds exactly that. Gradients are fp32 at every stage, as in
Megatron-LM (18 bytes per parameter at ZeRO-0 with bf16, against Rajbhandari et al.'s 16 with 16-bit gradients).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from partc._torch import tree_map
from partc.errors import PartcError

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""Precision name -> the compute dtype of parameters and activations."""

MASTER_DTYPE = torch.float32
"""Master weights, gradients and optimizer states."""


def compute_dtype(precision: str) -> torch.dtype:
    if precision not in DTYPES:
        raise PartcError(f"precision must be one of {', '.join(DTYPES)}, got {precision!r}")
    return DTYPES[precision]


def compute_bytes(precision: str) -> int:
    """Bytes of one element in the compute dtype (2 for bf16, 4 for fp32)."""
    return compute_dtype(precision).itemsize


@torch.no_grad()
def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Every floating-point parameter of `model` in `dtype`, in place (on meta too; a tied parameter stays one
    tensor under all its names); buffers unchanged."""
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                if id(p) not in cast:
                    cast[id(p)] = nn.Parameter(p.to(dtype), requires_grad=p.requires_grad)
                module._parameters[name] = cast[id(p)]
    return model


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """`value` with every floating-point tensor in it (a tensor, or any structure of them torch's pytree knows:
    tuples, dicts, a Hugging Face ``ModelOutput``) cast to `dtype`, the structure kept."""
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, value)
