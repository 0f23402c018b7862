"""`compile_model`'s trace, done once per session for each distinct model (the tests compile the same tiny models
under many plans, and `helpers.compile_program` compiles each twice: the solver's plan, then the edited one).

The key is everything the trace reads: the model file's bytes, the ``PARTC_*`` environment it may read, the
model's class and parameter shapes, the inputs' shapes and dtypes, and `trace`'s own arguments. A hit does to the
model what `trace` does to it (casts its parameters to the compute dtype, in place) and returns a deep copy of the
first result, so no caller sees another's changes."""

from __future__ import annotations

import copy
import hashlib
import os
import warnings
from pathlib import Path

import torch

from partc._torch import tree_flatten
from partc.precision import cast_parameters, compute_dtype


def _signature(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in model.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in model.named_buffers())
    leaves = tree_flatten((args, kwargs))[0]
    inputs = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in leaves)
    return type(model).__qualname__, params, buffers, inputs


def memoized(trace):
    cache: dict[tuple, object] = {}

    def traced(model, args, kwargs, *, name, seq_len=None, path="", precision="bf16", fused_attention=False):
        source = Path(path).read_bytes() if path and Path(path).is_file() else b""
        env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("PARTC_")))
        key = (path, hashlib.sha256(source).hexdigest(), env, name, seq_len, precision, fused_attention,
               _signature(model, args, kwargs))
        if key not in cache:
            result = trace(model, args, kwargs, name=name, seq_len=seq_len, path=path, precision=precision,
                           fused_attention=fused_attention)
            cache[key] = _copy(result)
            return result
        cast_parameters(model, compute_dtype(precision))
        return _copy(cache[key])

    return traced


def _copy(traced):
    with warnings.catch_warnings():  # torch's pytree spec deprecation note from copying the exported program
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(traced)
