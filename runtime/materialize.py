"""Build the model with its parameters on meta, then allocate and initialize only this rank's part.

Why parameters on meta but buffers real: ``with torch.device("meta"): model()`` costs nothing, but buffers
computed in ``__init__`` (Hugging Face LLaMA's rotary ``inv_freq``, BERT's ``position_ids``, a causal mask) would
have no values, and ``to_empty`` would turn them into garbage. So `parameters_on_meta` builds the model on the
ambient device and moves each parameter to meta the moment it is registered (accelerate's
``init_empty_weights(include_buffers=False)``): buffers keep the values ``__init__`` computed, parameters cost no
memory, and initializers run in ``__init__`` on meta are no-ops.

Then a rank allocates the parameters and buffers of its stages (`materialize`: every alias of a tied weight gets
the same new tensor, so the model's own ties survive) and fills them, either from ``--init-checkpoint``
(`load_weights`: only this rank's keys are read) or by the model's own initialization (`init_weights`) run with one
seed per parameter: ``seed_of(seed, fqn)``. The model's initializer runs over the whole model, but only the
tensors this rank allocated are real (the rest are meta: no-ops), and `SeedPerTensor` reseeds each random fill by
the tensor's FQN, so a parameter gets the same values under every plan, and the same as `build_initialized`
gives one process.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import Tensor, nn

from partc.errors import PartcError
from partc.passes.load import ModelSpec
from partc.runtime._torch import TorchDispatchMode

_RANDOM_FILLS = {torch.ops.aten.normal_, torch.ops.aten.uniform_, torch.ops.aten.bernoulli_,
                 torch.ops.aten.random_, torch.ops.aten.exponential_, torch.ops.aten.cauchy_,
                 torch.ops.aten.log_normal_, torch.ops.aten.geometric_}


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device; buffers stay where ``__init__`` made them."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_model(spec: ModelSpec) -> nn.Module:
    with parameters_on_meta():
        return spec.build()


def canonical_names(model: nn.Module, tied: Iterable[list[str]] = ()) -> dict[str, str]:
    """Every parameter FQN (every alias of a tied weight) -> the one name ``model.named_parameters()`` gives it.

    `tied` (the manifest's groups) must agree with the model's own ties; a group the model does not tie is an
    error: the runtime could not keep the copies equal.
    """
    canon: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canon[name] = first.setdefault(id(p), name)
    for group in tied:
        names = {canon.get(n) for n in group}
        if None in names or len(names) != 1:
            raise PartcError(f"the program ties {group}, but the model does not (or has no such parameters); "
                             f"compile again")
    return canon


def materialize(model: nn.Module, names: Iterable[str], device: torch.device) -> dict[str, Tensor]:
    """Allocate (uninitialized) the named parameters and buffers on `device`, in place in `model`.

    Returns canonical FQN -> new tensor. All aliases of a tied weight point to the same new Parameter.
    """
    names = set(names)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    unknown = sorted(n for n in names if n not in params and n not in buffers)
    if unknown:
        raise PartcError(f"the program reads {unknown[0]!r}, which the model does not have; compile again")
    old = [params[n] for n in names if n in params] + [buffers[n] for n in names if n in buffers]
    wanted = {id(t) for t in old}  # `old` keeps the objects alive, so ids stay unique
    new: dict[int, Tensor] = {}
    for module in model.modules():
        for table, make in ((module._parameters, _new_param), (module._buffers, _moved_buffer)):
            for key, t in table.items():
                if t is not None and id(t) in wanted:
                    if id(t) not in new:
                        new[id(t)] = make(t, device)
                    table[key] = new[id(t)]
    out: dict[str, Tensor] = {}
    ids = {id(t) for t in new.values()}
    for name, p in model.named_parameters():
        if id(p) in ids:
            out[name] = p
    for name, b in model.named_buffers():
        if id(b) in ids:
            out[name] = b
    return out


def _new_param(p: Tensor, device: torch.device) -> nn.Parameter:
    if p.is_meta:
        return nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
    return nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)


def _moved_buffer(b: Tensor, device: torch.device) -> Tensor:
    if b.is_meta:
        raise PartcError("a buffer of the model is on the meta device after building it; build buffers without "
                         "device='meta' in __init__")
    return b.to(device)


def seed_of(seed: int, name: str) -> int:
    """The seed of one tensor's initialization: a hash of the run's seed and the tensor's FQN."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)


class SeedPerTensor(TorchDispatchMode):
    """Runs every in-place random fill of a known tensor with a generator seeded by ``seed_of(seed, fqn)``.

    A fill of part of a tensor (a view) is seeded by the FQN and the view's offset, so two slices of one weight
    do not get the same numbers. Fills of other tensors (meta, temporaries) run unchanged.
    """

    def __init__(self, tensors: dict[str, Tensor], seed: int):
        super().__init__()
        self.seed = seed
        self.names = {t.untyped_storage().data_ptr(): name for name, t in tensors.items()
                      if t.numel() and not t.is_meta}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func.overloadpacket in _RANDOM_FILLS and args and isinstance(args[0], Tensor) and not args[0].is_meta:
            t = args[0]
            name = self.names.get(t.untyped_storage().data_ptr())
            if name is not None:
                key = name if t.storage_offset() == 0 else f"{name}@{t.storage_offset()}"
                gen = torch.Generator(device=t.device)
                gen.manual_seed(seed_of(self.seed, key))
                kwargs["generator"] = gen
        return func(*args, **kwargs)


def init_weights(model: nn.Module, tensors: dict[str, Tensor], seed: int) -> None:
    """Fill `tensors` (canonical FQN -> tensor of `model`) by the model's own initialization, one seed each.

    - a Hugging Face ``PreTrainedModel``: ``_init_weights(module)`` children first (HF's ``smart_apply`` order),
      for each module holding one of `tensors`;
    - a model with ``init_weights()`` (torchtitan and partc's examples): called once on the whole model;
    - otherwise ``reset_parameters()`` of each module holding one of `tensors` directly.
    """
    holding = _modules_holding(model, tensors)
    with torch.no_grad(), SeedPerTensor(tensors, seed):
        if _is_hf(model):
            def visit(prefix: str, module: nn.Module, init) -> None:
                for name, child in module.named_children():
                    child_init = child._init_weights if _is_hf(child) else init
                    visit(f"{prefix}{name}.", child, child_init)
                if prefix.rstrip(".") in holding:
                    init(module)
            visit("", model, model._init_weights)
        elif callable(getattr(model, "init_weights", None)):
            model.init_weights()
        else:
            ids = {id(t) for t in tensors.values()}
            for module in model.modules():
                own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
                if callable(getattr(module, "reset_parameters", None)) and any(id(t) in ids for t in own):
                    module.reset_parameters()


def _modules_holding(model: nn.Module, tensors: dict[str, Tensor]) -> set[str]:
    """Names of the modules whose subtree holds one of `tensors` (under any alias); the root is ''."""
    ids = {id(t) for t in tensors.values()}
    names = [n for n, t in [*model.named_parameters(remove_duplicate=False),
                            *model.named_buffers(remove_duplicate=False)] if id(t) in ids]
    holding = {""}
    for n in names:
        parts = n.split(".")[:-1]
        holding.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return holding


def _is_hf(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


class _SafetensorsFile(Mapping):
    """A safetensors file as a read-only mapping that reads a tensor when asked for it."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self._file = safe_open(str(path), framework="pt", device="cpu")
        self._keys = list(self._file.keys())
        self._set = set(self._keys)

    def __getitem__(self, key: str) -> Tensor:
        if key not in self._set:
            raise KeyError(key)
        return self._file.get_tensor(key)

    def __contains__(self, key: object) -> bool:
        return key in self._set

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def open_checkpoint(path: str | Path) -> Mapping[str, Tensor]:
    """A full state dict file (``torch.save(model.state_dict())`` or safetensors), memory-mapped: only the
    tensors a rank reads are paged in."""
    path = Path(path)
    if not path.exists():
        raise PartcError(f"checkpoint {path} does not exist")
    if path.suffix == ".safetensors":
        return _SafetensorsFile(path)
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise PartcError(f"cannot load {path} with torch.load(weights_only=True): {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None
    if not isinstance(sd, dict) or not all(isinstance(v, Tensor) for v in sd.values()):
        raise PartcError(f"{path} must hold a flat state dict (name -> tensor), as torch.save(model.state_dict())")
    return sd


def load_weights(tensors: dict[str, Tensor], aliases: dict[str, list[str]], state: Mapping[str, Tensor],
                 *, where: str, buffers: set[str]) -> None:
    """Copy each of `tensors` (canonical FQN -> tensor) from `state`, under any alias of a tied weight.
    Buffers missing from `state` keep the values ``__init__`` computed (non-persistent buffers are not saved)."""
    missing = []
    with torch.no_grad():
        for name, t in tensors.items():
            key = next((a for a in aliases.get(name, [name]) if a in state), None)
            if key is None:
                if name not in buffers:
                    missing.append(name)
                continue
            src = state[key]
            if tuple(src.shape) != tuple(t.shape):
                raise PartcError(f"{where}: {key} has shape {tuple(src.shape)}, the model's is {tuple(t.shape)}")
            t.copy_(src)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise PartcError(f"{where} has no {', '.join(missing[:3])}{more}; pass a state dict of this model")


def build_initialized(spec: ModelSpec, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """The whole model in one process, initialized exactly as the runtime initializes its parts (a reference)."""
    model = build_model(spec)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    tensors = materialize(model, names, torch.device(device))
    init_weights(model, tensors, seed)
    return model
