"""`StageModule`: one generated ``stage_K.py`` as an ``nn.Module`` with the model's own parameter names.

The stage's units (``blocks.3``, ``lm_head``) are attached under their FQNs in a tree of plain container modules,
so ``state_dict()`` keys are the model's (``blocks.3.attn.qkv.weight``), and everything keyed by FQN (FSDP, the
optimizer, ``torch.distributed.checkpoint``, ``--save-full-state-dict``) works unchanged. A tensor the code reads
outside those units (a parameter on the model's root, or an alias of a tied weight the stage's modules do not
hold) is attached at its own FQN; so is every tensor of the root unit "" (a model of bare parameters, whose root
is its only unit).

``forward(*inputs)`` looks the tensors up again on every call (FSDP swaps sharded and unsharded parameters in
the modules) and calls ``stage.forward(p, *inputs, **self.call_kwargs)``; ``call_kwargs`` is ``{"device": ...}``.
With tensor parallelism the module's parameters are this tp rank's shards (at their local shapes, under the
model's names) and the stage code's collectives use the group `partc.collectives.set_tp_group` set.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from partc.runtime.program import StageFile


class StageModule(nn.Module):
    def __init__(self, stage: StageFile, model: nn.Module, canon: dict[str, str], device: torch.device):
        """`model` is the meta-built model with this stage's tensors materialized; `canon` maps every parameter
        FQN to its canonical name (`materialize.canonical_names`)."""
        super().__init__()
        self.stage_index = stage.index
        self.code = stage.code
        self.call_kwargs: dict[str, Any] = {"device": device}
        self.recompute = False
        """Recompute the forward in backward (activation checkpointing of the whole stage)."""
        for unit in stage.modules:
            if unit:
                _attach_module(self, unit, model.get_submodule(unit))
            else:  # the root unit (a model of bare parameters): every tensor at its own FQN
                for name, t in [*model.named_parameters(), *model.named_buffers()]:
                    _attach_tensor(self, name, t, model)
        own_params = {n: canon[n] for n, _ in self.named_parameters(remove_duplicate=False)}
        local_by_canon = {c: n for n, c in own_params.items()}
        own_buffers = {n for n, _ in self.named_buffers(remove_duplicate=False)}
        # name in the stage code -> (module holding it, attribute, is a parameter)
        self._refs: dict[str, tuple[nn.Module, str, bool]] = {}
        for name in stage.parameters:
            local = name if name in own_params else local_by_canon.get(canon.get(name, name))
            if local is None:
                local = name
                _attach_tensor(self, name, model.get_parameter(name), model)
                local_by_canon[canon[name]] = name
            self._refs[name] = (*_owner(self, local), True)
        for name in stage.buffers:
            if name not in own_buffers:
                _attach_tensor(self, name, model.get_buffer(name), model)
            self._refs[name] = (*_owner(self, name), False)

    def tensors(self) -> dict[str, Tensor]:
        """FQN (as the stage code names it) -> the tensor the module holds now."""
        return {name: (mod._parameters if is_param else mod._buffers)[attr]
                for name, (mod, attr, is_param) in self._refs.items()}

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._run, *inputs, use_reentrant=False)
        return self._run(*inputs)

    def _run(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        # Contiguous: a stage may hand over a view (BERT's and OPT's attention mask, expanded from a row), and the
        # pipeline sends and receives dense buffers (`train.stage_shapes` gives them the same contiguous layout).
        return tuple(t.contiguous() for t in self.code.forward(self.tensors(), *inputs, **self.call_kwargs))


def _container(root: nn.Module, path: list[str]) -> nn.Module:
    """The module at `path` under `root`, creating empty containers on the way."""
    mod = root
    for part in path:
        child = mod._modules.get(part)
        if child is None:
            child = nn.Module()
            mod.add_module(part, child)
        mod = child
    return mod


def _attach_module(root: nn.Module, fqn: str, module: nn.Module) -> None:
    *path, last = fqn.split(".")
    parent = _container(root, path)
    assert last not in parent._modules, f"unit {fqn} attached twice"
    parent.add_module(last, module)


def _attach_tensor(root: nn.Module, fqn: str, t: Tensor, model: nn.Module) -> None:
    *path, last = fqn.split(".")
    parent = _container(root, path)
    if isinstance(t, nn.Parameter):
        parent.register_parameter(last, t)
    else:
        owner = model.get_submodule(".".join(path))
        parent.register_buffer(last, t, persistent=last not in owner._non_persistent_buffers_set)


def _owner(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    *path, last = fqn.split(".")
    return root.get_submodule(".".join(path)), last
