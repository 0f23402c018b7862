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

Tensor parallelism (`TPLayout`): a parameter the program splits over tp is allocated at its local shape only.
``--init-checkpoint`` slices it out of the file's whole tensor. Initialization must give the values one process
gives, and an initializer's numbers depend on the whole shape (fan-in, the random stream of the whole tensor), so
`init_weights` first initializes the whole tensors (split ones stand in as meta tensors of their whole shape),
then the split ones a few at a time: each group is allocated whole (at most `INIT_GROUP_BYTES`, or one
parameter), initialized with everything else on meta, sliced to this rank's shard and freed. The peak is one
group, never the whole model. This assumes, as the rest of this module does, that the initializer sets each
tensor from its own shape and seed (not by copying another parameter).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import Tensor, nn

from partc.errors import PartcError
from partc.model_file import ModelSpec, is_hf
from partc.runtime._torch import TorchDispatchMode
from partc.sharding import TPLayout

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


def materialize(model: nn.Module, names: Iterable[str], device: torch.device,
                layout: TPLayout | None = None) -> dict[str, Tensor]:
    """Allocate (uninitialized) the named parameters and buffers on `device`, in place in `model`; a parameter
    `layout` splits over tp at its local shape.

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
    local_shapes = {}
    if layout is not None:
        for n in names:
            if n in params and layout.shard(n) is not None:
                local_shapes[id(params[n])] = layout.local_shape(n, params[n].shape)
    new: dict[int, Tensor] = {}
    for module in model.modules():
        for table, make in ((module._parameters, _new_param), (module._buffers, _moved_buffer)):
            for key, t in table.items():
                if t is not None and id(t) in wanted:
                    if id(t) not in new:
                        new[id(t)] = make(t, device, local_shapes.get(id(t)))
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


def _new_param(p: Tensor, device: torch.device, shape: tuple[int, ...] | None = None) -> nn.Parameter:
    if shape is not None:  # a tensor-parallel shard
        return nn.Parameter(torch.empty(shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
    if p.is_meta:
        return nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
    return nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)


def _moved_buffer(b: Tensor, device: torch.device, shape: None = None) -> Tensor:
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


INIT_GROUP_BYTES = 256 * 2**20
"""Tensor-parallel shards are initialized from whole tensors allocated this many bytes at a time (or one tensor,
if larger)."""


def init_weights(model: nn.Module, tensors: dict[str, Tensor], seed: int, layout: TPLayout | None = None) -> None:
    """Fill `tensors` (canonical FQN -> tensor of `model`) by the model's own initialization, one seed each.

    - a Hugging Face ``PreTrainedModel``: ``_init_weights(module)`` children first (HF's ``smart_apply`` order),
      for each module holding one of `tensors`;
    - a model with ``init_weights()`` (torchtitan and partc's examples): called once on the whole model;
    - otherwise ``reset_parameters()`` of each module holding one of `tensors` directly.

    Tensors `layout` splits over tp are this rank's shards: each gets the matching part of what the whole tensor
    would get (see the module docstring).
    """
    split = {n: t for n, t in tensors.items() if layout is not None and layout.shard(n) is not None}
    if not split:
        return _init(model, tensors, seed)
    whole = {n: t for n, t in tensors.items() if n not in split}
    device = next(iter(split.values())).device
    # The split shards stand in as meta tensors of their whole shape (an initializer may read a shape: fan-in).
    stand_ins = {n: nn.Parameter(torch.empty(layout.full_shape(n, t.shape), dtype=t.dtype, device="meta"),
                                 requires_grad=t.requires_grad) for n, t in split.items()}
    with _swapped(model, {id(split[n]): stand_ins[n] for n in split}):
        if whole:
            _init(model, whole, seed)
        no_whole = {id(t): nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
                    for t in whole.values() if isinstance(t, nn.Parameter)}
        # Whole parameters are initialized once (meta from here on); buffers stay, and any refill of one is seeded
        # as before, so it gets the same values again.
        buffers = {n: t for n, t in whole.items() if not isinstance(t, nn.Parameter)}
        with _swapped(model, no_whole):
            for group in _groups(stand_ins):
                full = {n: nn.Parameter(torch.empty_like(stand_ins[n], device=device),
                                        requires_grad=stand_ins[n].requires_grad) for n in group}
                with _swapped(model, {id(stand_ins[n]): full[n] for n in group}):
                    _init(model, {**full, **buffers}, seed)
                with torch.no_grad():
                    for n in group:
                        split[n].copy_(layout.take(n, full[n]))
                del full


def _groups(tensors: dict[str, Tensor]) -> list[list[str]]:
    """Names in consecutive groups of at most `INIT_GROUP_BYTES` (a larger tensor alone)."""
    groups: list[list[str]] = []
    size = INIT_GROUP_BYTES
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if not groups or size + nbytes > INIT_GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


@contextmanager
def _swapped(model: nn.Module, new: dict[int, Tensor]) -> Iterator[None]:
    """Replace parameters (by id, under every alias) with others for the duration."""
    old: list[tuple[dict, str, Tensor]] = []
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None and id(p) in new:
                old.append((module._parameters, key, p))
                module._parameters[key] = new[id(p)]
    try:
        yield
    finally:
        for table, key, p in reversed(old):
            table[key] = p


def _init(model: nn.Module, tensors: dict[str, Tensor], seed: int) -> None:
    """`init_weights` for tensors of the shapes the model has (see there)."""
    holding = _modules_holding(model, tensors)
    with torch.no_grad(), SeedPerTensor(tensors, seed):
        if is_hf(model):
            def visit(prefix: str, module: nn.Module, init) -> None:
                for name, child in module.named_children():
                    child_init = child._init_weights if is_hf(child) else init
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
                 *, where: str, buffers: set[str], layout: TPLayout | None = None) -> None:
    """Copy each of `tensors` (canonical FQN -> tensor) from `state`, under any alias of a tied weight; a tensor
    `layout` splits over tp takes this rank's part of the whole one in `state`.
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
            shape = tuple(t.shape) if layout is None else layout.full_shape(name, t.shape)
            if tuple(src.shape) != shape:
                raise PartcError(f"{where}: {key} has shape {tuple(src.shape)}, the model's is {shape}")
            t.copy_(src if layout is None else layout.take(name, src))
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
