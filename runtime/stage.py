"""`StageModule`: one generated ``stage_K.py`` as an ``nn.Module`` with the model's own parameter names, and one
`UnitModule` per unit the stage file calls (``blocks.3``, ``lm_head``), so that ZeRO shards and activation
checkpointing wrap each unit, as torchtitan wraps each transformer block.

The stage's units are attached under their FQNs in a tree of plain container modules, so ``state_dict()`` keys are
the model's (``blocks.3.attn.qkv.weight``), and everything keyed by FQN (FSDP, the optimizer,
``torch.distributed.checkpoint``, ``--save-full-state-dict``) works unchanged. At a unit's FQN sits a `UnitModule`
holding that model module's own parameters, buffers and children (the same tensors, under the same names). A tensor
the code reads outside those units (a parameter of the model's root, or an alias of a tied weight the stage's units
do not hold) is attached at its own FQN; so is every tensor of the root unit "" (a model of bare parameters, whose
root is its only unit).

``forward(*inputs)`` calls the stage file's ``forward(p, *inputs, device=..., run=...)``; its ``run(unit, fn, ...)``
calls the unit's `UnitModule`, which looks its tensors up again (FSDP swaps sharded and unsharded parameters in the
modules around each unit's call) and calls ``fn(p, *args, device=...)``, under ``torch.utils.checkpoint`` when the
plan recomputes that unit. With tensor parallelism the parameters are this tp rank's shards (at their local shapes,
under the model's names) and the stage code's collectives use the groups `partc.collectives.set_groups` set.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from partc.runtime.program import StageFile


class UnitModule(nn.Module):
    """One unit of a stage: the model module's own parameters, buffers and children, called with the unit's function
    from the stage file."""

    def __init__(self, module: nn.Module, fqn: str, lookup: Callable[[], dict[str, Tensor]], device: torch.device):
        super().__init__()
        for name, p in module._parameters.items():
            self.register_parameter(name, p)
        for name, b in module._buffers.items():
            self.register_buffer(name, b, persistent=name not in module._non_persistent_buffers_set)
        for name, child in module._modules.items():
            self.add_module(name, child)
        self.fqn = fqn
        self.recompute = False
        """Recompute the unit's forward in its backward (full recomputation: only the unit's inputs are kept)."""
        self._lookup = lookup  # the stage's `tensors` (a bound method, not a submodule)
        self._device = device

    def forward(self, fn: Callable, *args: Any) -> tuple[Tensor, ...]:
        def run(*inputs: Any) -> tuple[Tensor, ...]:
            return fn(self._lookup(), *inputs, device=self._device)

        if self.recompute and torch.is_grad_enabled():
            # The whole unit runs again (no early stop after its last saved tensor): the collectives at its end
            # too, as the cost model charges a full recomputation.
            with set_checkpoint_early_stop(False):
                return checkpoint(run, *args, use_reentrant=False)
        return run(*args)


class StageModule(nn.Module):
    def __init__(self, stage: StageFile, model: nn.Module, canon: dict[str, str], device: torch.device):
        """`model` is the meta-built model with this stage's tensors materialized; `canon` maps every parameter
        FQN to its canonical name (`materialize.canonical_names`)."""
        super().__init__()
        self.stage_index = stage.index
        self.code = stage.code
        self.device = device
        self.foreign_reads = stage.foreign_reads
        """Tensors the code reads outside their own unit's function (`StageFile.foreign_reads`)."""
        self.units: dict[str, UnitModule] = {}
        """Unit FQN -> its module, for every unit the stage file runs on its own (not the model's root)."""
        called = {u for u in stage.units if isinstance(u, str)}
        for fqn in stage.modules:
            if not fqn:  # the root unit (a model of bare parameters): every tensor at its own FQN
                for name, t in [*model.named_parameters(), *model.named_buffers()]:
                    _attach_tensor(self, name, t, model)
            elif fqn in called:
                self.units[fqn] = UnitModule(model.get_submodule(fqn), fqn, self.tensors, device)
                _attach_module(self, fqn, self.units[fqn])
            else:
                _attach_module(self, fqn, model.get_submodule(fqn))
        self.recompute_inputs: set[int] = set()
        """``id`` of each tensor the last forward passed to a unit it recomputes: ``torch.utils.checkpoint`` keeps
        them for the replay (`partc.runtime.schedule.PipeStage` must not free their data)."""
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
        # Contiguous: a stage may hand over a view (BERT's and OPT's attention mask, expanded from a row), and the
        # pipeline sends and receives dense buffers (`train.stage_shapes` gives them the same contiguous layout).
        self.recompute_inputs = set()
        outputs = self.code.forward(self.tensors(), *inputs, device=self.device, run=self._run)
        return tuple(t.contiguous() for t in outputs)

    def _run(self, unit: str | tuple, fn: Callable, p: dict[str, Tensor], *args: Any, device: torch.device):
        module = self.units.get(unit) if isinstance(unit, str) else None
        if module is None:  # the model's root, or units whose ops interleave: they run in the stage's own call
            return fn(p, *args, device=device)
        if module.recompute and torch.is_grad_enabled():
            self.recompute_inputs.update(id(a) for a in args if isinstance(a, Tensor))
        return module(fn, *args)


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
