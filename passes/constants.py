"""Tensor constants a model creates inside forward, carried into the stage files as literals.

``torch.tensor(d ** 0.5)`` (DeBERTa-v2) or indexing with a list, ``fused_qkv[..., [-2], :]`` (Falcon), makes
torch.export lift a tensor constant into the program. Its value depends on the model's configuration and the
traced shapes only, never on weights or data (a value that did would fail the trace), so the stage files can
create it again: ``torch.tensor([-2], dtype=torch.int64, device=device)``.

A constant created from Python numbers has its value in the trace already (a CPU tensor). One made on the device
of a meta tensor (the list index) has none: its module (``transformer.h.0.self_attention``) is built once more
on the CPU (uninitialized) and exported alone, on placeholder inputs of the shapes it gets in the
model's trace; its constants, in order, are the ones the whole model's trace lifted under that module.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from torch.export.graph_signature import InputKind

from partc.errors import PartcError

MAX_CONSTANT_NUMEL = 4096
"""Larger constants are refused (a literal that size belongs in a buffer, registered in ``__init__``)."""


def constant_values(ep: torch.export.ExportedProgram, model: nn.Module) -> dict[str, Tensor]:
    """Target (``transformer.h.0.self_attention.lifted_tensor_0``) -> value on the CPU of every tensor constant
    the exported program lifted."""
    targets = [s.target for s in ep.graph_signature.input_specs if s.kind == InputKind.CONSTANT_TENSOR]
    values: dict[str, Tensor] = {}
    owners: dict[str, list[str]] = {}
    for t in targets:
        c = ep.constants[t]
        if c.numel() > MAX_CONSTANT_NUMEL:
            raise PartcError(f"the model creates a tensor constant of {c.numel():,} elements ({t}) inside forward; "
                             f"register it as a buffer in __init__")
        if c.is_meta:
            owners.setdefault(t.rpartition(".")[0], []).append(t)
        else:
            values[t] = c.detach().cpu().clone()
    if owners:
        calls = _module_calls(model, list(owners), *ep.example_inputs)
        done: dict[str, list[Tensor]] = {}  # modules alike (every block's attention) are exported once
        for owner, names in owners.items():
            key = _signature(model.get_submodule(owner), calls.get(owner))
            if key not in done:
                done[key] = _exported_constants(model, owner, calls.get(owner))
            got = done[key]
            want = [ep.constants[t] for t in names]
            if len(got) != len(want) or any(g.shape != w.shape or g.dtype != w.dtype for g, w in zip(got, want)):
                raise PartcError(f"the model creates a tensor constant ({names[0]}) inside forward whose value "
                                 f"partc cannot recompute on the CPU; register it as a buffer in __init__")
            values.update(zip(names, got))
    return values


def literal(value: Tensor) -> str:
    """Python source that creates `value` on the stage's ``device``."""
    data = value.tolist()
    return f"torch.tensor({_literal_data(data)}, dtype={value.dtype}, device=device)"


def _literal_data(data) -> str:
    if isinstance(data, list):
        return "[" + ", ".join(_literal_data(x) for x in data) + "]"
    if isinstance(data, float) and data != data:
        return "float('nan')"
    if isinstance(data, float) and data in (float("inf"), -float("inf")):
        return "float('inf')" if data > 0 else "-float('inf')"
    assert isinstance(data, (bool, int, float, complex)), type(data)
    return repr(data)


def _module_calls(model: nn.Module, owners: list[str], args: tuple, kwargs: dict) -> dict[str, tuple]:
    """Module FQN -> (args, kwargs) of its first call when the model is exported again, with each tensor as a
    `_TensorSpec` (the hooks run under export's fake tensors, which a forward on meta cannot replace: Hugging Face
    code checks values unless it is being traced)."""
    calls: dict[str, tuple] = {}
    hooks = []
    for name in owners:
        def hook(mod, a, kw, name=name):
            calls.setdefault(name, _specs((a, kw)))
        hooks.append(model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        torch.export.export(model, args, kwargs, strict=False)
    except Exception:  # noqa: BLE001 - the trace succeeded before; a module not reached is reported by the caller
        pass
    finally:
        for h in hooks:
            h.remove()
    return calls


def _signature(module: nn.Module, call: tuple | None) -> str:
    """Equal for modules of one class, with equal tensors, called alike."""
    tensors = [(n, tuple(t.shape), t.dtype) for n, t in [*module.named_parameters(), *module.named_buffers()]]
    return repr((type(module).__module__, type(module).__qualname__, tensors, call))


class _TensorSpec:
    def __init__(self, t: Tensor):
        self.shape, self.dtype = tuple(int(d) for d in t.shape), t.dtype

    def __repr__(self) -> str:
        return f"T({self.shape}, {self.dtype})"

    def cpu(self) -> Tensor:
        """Random floats, zeros otherwise."""
        if self.dtype.is_floating_point:
            return torch.randn(self.shape, dtype=self.dtype)
        return torch.zeros(self.shape, dtype=self.dtype)


def _exported_constants(model: nn.Module, owner: str, call: tuple | None) -> list[Tensor]:
    """The tensor constants the module `owner` lifts itself when exported on the CPU with placeholder values."""
    if call is None:
        return []
    # Uninitialized weights: export runs on fake tensors and reads no value, only the constants it lifts are real.
    module = copy.deepcopy(model.get_submodule(owner)).to_empty(device="cpu")
    args, kwargs = _on_cpu(call)
    try:
        ep = torch.export.export(module, args, kwargs, strict=False)
    except Exception:  # noqa: BLE001 - reported by the caller, with the constant's name
        return []
    return [ep.constants[s.target].detach().cpu().clone() for s in ep.graph_signature.input_specs
            if s.kind == InputKind.CONSTANT_TENSOR and "." not in s.target]


def _specs(value):
    """`value` (a structure) with every tensor replaced by its `_TensorSpec`."""
    if isinstance(value, Tensor):
        return _TensorSpec(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_specs(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_specs(v) for v in value)
    if isinstance(value, dict):
        return {k: _specs(v) for k, v in value.items()}
    return value


def _on_cpu(value):
    """`_specs`'s structure with a CPU tensor for every spec."""
    if isinstance(value, _TensorSpec):
        return value.cpu()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_on_cpu(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    return value
