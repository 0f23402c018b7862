"""Build the model on meta, then allocate and initialize only this rank's part.

`build_model` builds the model on the meta device (no memory) under `partc.deferred_init.record`, which records
how the model's construction and its initializers set every parameter and buffer (a Hugging Face model's
``_init_weights``, a model-wide ``init_weights()``, else what ``__init__`` does, with ``reset_parameters()`` for
a tensor nothing else sets). A rank then allocates the parameters and buffers of its stages (`materialize`: every
alias of a tied weight gets the same new tensor, so the model's own ties survive) and fills them, either from
``--init-checkpoint`` (`load_weights`: only this rank's keys are read; buffers the file lacks are replayed) or by
replaying the record for them (`init_weights`): only the steps their values depend on run, on the rank's device,
each random fill seeded by the name of the tensor it fills (``seed_of(seed, fqn)``), so a tensor gets the same
values under every plan, and the same as `build_initialized` gives one process. A parameter the record cannot
reproduce (`InitRecord.problems`: read from a meta tensor made outside the build, or ``torch.empty`` memory
nothing wrote) stops a run without ``--init-checkpoint`` (`check_initializable`); a buffer starts uninitialized,
as in the model itself (``partc compile`` warns about both).

Tensor parallelism (`TPLayout`): a parameter the program splits over tp is allocated at its local shape only.
``--init-checkpoint`` slices it out of the file's whole tensor. Initialization must give the values one process
gives, and an initializer's numbers depend on the whole shape (fan-in, the random stream of the whole tensor), so
`init_weights` replays the split parameters whole, a few at a time (at most `INIT_GROUP_BYTES`, or one
parameter), slices this rank's shard out of each and frees it: the peak is one group (and what its values are
computed from), never the whole model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import Tensor, nn

from partc.deferred_init import InitRecord, record
from partc.errors import PartcError
from partc.model_file import ModelSpec
from partc.sharding import TPLayout

def build_model(spec: ModelSpec) -> tuple[nn.Module, InitRecord]:
    """The model on the meta device, and the record of how its construction sets each tensor."""
    return record(spec.build)


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
    """Allocate (uninitialized) the named parameters and buffers on `device`, in place in `model` (replacing its
    meta tensors); a parameter `layout` splits over tp at its local shape.

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
            if n in params and layout.splits(n):
                local_shapes[id(params[n])] = layout.local_shape(n, params[n].shape)
    new: dict[int, Tensor] = {}
    for module in model.modules():
        for table, make in ((module._parameters, _new_param), (module._buffers, _new_buffer)):
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
    return nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)


def _new_buffer(b: Tensor, device: torch.device, shape: None = None) -> Tensor:
    return torch.empty_like(b, device=device)


def check_initializable(init: InitRecord, names: Iterable[str]) -> None:
    """Raise if a parameter among `names` has no initial value partc can reproduce (a run needs
    ``--init-checkpoint`` then)."""
    bad = [n for n in names if n in init.problems and n in init.parameters]
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise PartcError(f"partc cannot reproduce the initial value of parameter {bad[0]}{more} ("
                         f"{init.problems[bad[0]]}); pass --init-checkpoint FILE, a state dict of the model")


INIT_GROUP_BYTES = 256 * 2**20
"""Tensor-parallel shards are initialized from whole tensors replayed this many bytes at a time (or one tensor,
if larger)."""


def init_weights(init: InitRecord, tensors: dict[str, Tensor], seed: int, layout: TPLayout | None = None) -> None:
    """Fill `tensors` (canonical FQN -> tensor of the model) with the values the model's construction gives them
    (`partc.deferred_init`), each random fill seeded by its tensor's name.

    Tensors `layout` splits over tp are this rank's shards: each gets the matching part of its whole tensor,
    replayed a group at a time (see the module docstring).
    """
    if not tensors:
        return
    device = next(iter(tensors.values())).device
    split = {n: t for n, t in tensors.items() if layout is not None and layout.splits(n)}
    whole = [n for n in tensors if n not in split]

    def put(name: str, value: Tensor) -> None:
        with torch.no_grad():
            t = tensors[name]
            t.copy_(value if name not in split else layout.take(name, value))

    init.replay(whole, device, seed, put)
    sizes = {n: math.prod(layout.full_shape(n, t.shape)) * t.element_size() for n, t in split.items()}
    for group in _groups(sizes):
        init.replay(group, device, seed, put)


def _groups(sizes: dict[str, int]) -> list[list[str]]:
    """Names in consecutive groups of at most `INIT_GROUP_BYTES` (a larger tensor alone)."""
    groups: list[list[str]] = []
    size = INIT_GROUP_BYTES
    for name, nbytes in sizes.items():
        if not groups or size + nbytes > INIT_GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


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
                 *, where: str, buffers: set[str], layout: TPLayout | None = None) -> list[str]:
    """Copy each of `tensors` (canonical FQN -> tensor) from `state`, under any alias of a tied weight; a tensor
    `layout` splits over tp takes this rank's part of the whole one in `state`.
    Returns the buffers `state` lacks (non-persistent buffers are not saved): `init_weights` gives them the values
    the model's construction computes."""
    missing, unset = [], []
    with torch.no_grad():
        for name, t in tensors.items():
            key = next((a for a in aliases.get(name, [name]) if a in state), None)
            if key is None:
                (unset if name in buffers else missing).append(name)
                continue
            src = state[key]
            shape = tuple(t.shape) if layout is None else layout.full_shape(name, t.shape)
            if tuple(src.shape) != shape:
                raise PartcError(f"{where}: {key} has shape {tuple(src.shape)}, the model's is {shape}")
            t.copy_(src if layout is None else layout.take(name, src))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise PartcError(f"{where} has no {', '.join(missing[:3])}{more}; pass a state dict of this model")
    return unset


def build_initialized(spec: ModelSpec, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """The whole model in one process, initialized exactly as the runtime initializes its parts (a reference)."""
    model, init = build_model(spec)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    tensors = materialize(model, names, torch.device(device))
    check_initializable(init, tensors)
    init_weights(init, tensors, seed)
    return model
