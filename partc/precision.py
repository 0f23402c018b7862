"""Precision as plans, programs and the runtime use it (the plan's ``parallel.precision``).

``bf16`` (the default; Micikevicius et al. 2018, "Mixed Precision Training", with bf16 in place of fp16 and so no
loss scaling): parameters in compute, activations and the tensors pipeline stages and TP collectives exchange are
bf16; the master weights, the optimizer states and the gradients (accumulated over micro-batches and reduced over
the data-parallel ranks) are fp32; the loss is computed in fp32 from the model's outputs. ``fp32``: everything fp32.

The model is traced with its parameters and floating-point inputs in the compute dtype, so the program runs what the
model does at that precision (a Hugging Face RMSNorm's upcast to fp32 is in the graph), and the trace's byte counts
are those of the run. Buffers keep the dtype ``__init__`` gave them, and tensors the model makes in forward theirs:
where an op meets bf16 and fp32 inputs, `Autocast` casts them as ``torch.autocast`` would (a GEMM's to bf16), and
the casts are ops of the traced graph and so of the program (docs/precision.md).

What each ZeRO stage keeps and moves at each precision (bytes per parameter, and per collective) is tabled once, in
``partc.passes.zero``: the runtime (``partc.runtime.parallelize``, FSDP2 with ``MixedPrecisionPolicy(param_dtype=
compute dtype, reduce_dtype=fp32)`` for every stage) holds exactly that. Gradients are fp32 at every stage, as in
Megatron-LM (18 bytes per parameter at ZeRO-0 with bf16, against Rajbhandari et al.'s 16 with 16-bit gradients).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

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


_T = torch.Tensor
_F = torch.nn.functional
LOWER_PRECISION_OPS = frozenset({
    _F.linear, _F.conv1d, _F.conv2d, _F.conv3d, _F.conv_transpose1d, _F.conv_transpose2d,
    _F.conv_transpose3d, _F.conv_tbc, _F.prelu, _F.scaled_dot_product_attention,
    torch.matmul, _T.matmul, _T.__matmul__, _T.__rmatmul__, torch.mm, _T.mm, torch.bmm, _T.bmm, torch.mv, _T.mv,
    torch.addmm, _T.addmm, torch.baddbmm, _T.baddbmm, torch.addbmm, _T.addbmm, torch.addmv, _T.addmv,
    torch.addr, _T.addr, torch.einsum, torch.chain_matmul, torch.linalg.multi_dot, torch.linalg.vecdot,
})
"""Ops that run in the compute dtype when their floating inputs' dtypes differ: autocast's lower-precision list (the
GEMMs, convolutions and attention; ``torch/csrc/autograd/autocast_mode.cpp`` and the "CUDA Ops that can autocast
to float16" table of torch.amp's documentation)."""

WIDEST_DTYPE_OPS = frozenset({
    _F.layer_norm, _F.group_norm, _F.bilinear, _F.grid_sample, torch.dot, _T.dot, torch.vdot, _T.vdot,
    torch.tensordot, torch.cross, _T.cross, torch.linalg.cross, torch.scatter_add, _T.scatter_add, _T.index_put,
    _T.index_put_, torch.index_put,
})
"""Ops that take mixed floating inputs in the widest of their dtypes: those of autocast's promote list whose kernels
refuse mixed dtypes (the others, ``addcmul`` or ``atan2``, promote by themselves), and the LayerNorm and GroupNorm
kernels, which refuse an fp32 input with a bf16 weight on the GPU and the CPU (though not on meta)."""


class MixedPrecisionError(RuntimeError):
    """An op the bf16 forward cannot run with the floating dtypes it was given (named in the message)."""


class Autocast(TorchFunctionMode):
    """The bf16 forward's casts, as a torch function mode (what ``torch.autocast`` does per op, but independent of
    the device: the model is traced on meta, where autocast casts nothing, and the casts become ops of the traced
    graph, so the generated program, the cost model and ``partc check`` see them). An op whose floating inputs
    have more than one dtype gets them in `dtype` if it is one of `LOWER_PRECISION_OPS`, in the widest of them if
    it is one of `WIDEST_DTYPE_OPS`; every other op, and every op whose inputs agree, runs as PyTorch runs it
    (elementwise ops promote: a bf16 activation times an fp32 table is fp32). Unlike autocast, a GEMM of fp32
    tensors alone stays fp32: the model computed them in fp32 on purpose (Hugging Face's rotary frequencies, under
    ``torch.autocast(enabled=False)``), and a model that runs at bf16 without the casts traces as it did. The
    parameters are already in `dtype` (FSDP casts them, `cast_parameters` in a trace), so no cast copy of a weight
    is made for a GEMM: a cast copy is of an activation (or a norm's weight cast up to an fp32 input), saved for
    backward when the op that reads it saves its input.

    An op that fails with inputs of more than one floating dtype raises `MixedPrecisionError` naming it."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self._casts = WeakIdKeyDictionary()
        """source tensor -> (its version, dtype, its cast): one copy of a tensor several GEMMs read (the input of
        q, k and v), where autocast, which caches only casts of leaf tensors, would make one for each."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in LOWER_PRECISION_OPS or func in WIDEST_DTYPE_OPS:
            dtypes = _floating_dtypes((args, kwargs))
            if len(dtypes) > 1:
                to = self.dtype if func in LOWER_PRECISION_OPS else max(dtypes, key=lambda d: d.itemsize)
                args, kwargs = self._cast_to(to, args, kwargs)
        try:
            return func(*args, **kwargs)
        except (RuntimeError, TypeError) as e:
            dtypes = _floating_dtypes((args, kwargs))
            if len(dtypes) > 1 and not isinstance(e, MixedPrecisionError):
                names = " and ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
                raise MixedPrecisionError(f"{op_name(func)} does not run on {names} tensors together ({e})".split(
                    "\n")[0]) from e
            raise

    def _cast_to(self, dtype: torch.dtype, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """`args` and `kwargs` with every floating-point tensor in `dtype`: one already in it as it is (no cast
        in the graph), one cast before (and not changed in place since) as that cast."""
        def cast(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == dtype:
                return x
            hit = self._casts.get(x)
            if hit is not None and hit[0] == x._version and hit[1] == dtype:
                return hit[2]
            out = x.to(dtype)
            self._casts[x] = (x._version, dtype, out)
            return out
        return tree_map(cast, (args, kwargs))


def _floating_dtypes(value: Any) -> set[torch.dtype]:
    out: set[torch.dtype] = set()
    tree_map(lambda x: out.add(x.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else None, value)
    return out


def op_name(func: Any) -> str:
    """``torch.lerp``, ``Tensor.index_add``, ``torch.nn.functional.linear``: how a user would call `func`."""
    name = getattr(func, "__name__", repr(func))
    owner = getattr(func, "__objclass__", None) or getattr(func, "__self__", None)
    if isinstance(owner, type) and issubclass(owner, torch._C.TensorBase):
        return f"Tensor.{name}"
    module = getattr(func, "__module__", None) or ""
    if module.startswith("torch._C._nn") or module == "torch.nn.functional" or \
            getattr(_F, name, None) is func:
        return f"torch.nn.functional.{name}"
    return f"torch.{name}"


def forward_casts(precision: str) -> contextlib.AbstractContextManager:
    """The forward's casts at `precision` (`Autocast` for bf16; nothing for fp32): around the trace, and around a
    one-process run of the model (`partc.runtime.testing`). The generated program holds the casts as ops."""
    dtype = compute_dtype(precision)
    return Autocast(dtype) if dtype != MASTER_DTYPE else contextlib.nullcontext()
