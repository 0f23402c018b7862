"""The record of a model's construction (`partc.deferred_init.record` makes it) and its replay: the steps, the
walk from the wanted tensors back to the steps their values depend on, and running those steps on a device, each
random fill seeded by the name of the tensor it fills.

Apart from the recording (`partc.deferred_init`) because the two run at different times and places: the recording
hooks PyTorch while the model is built on meta; the replay runs on each rank, for its own tensors only, with PyTorch
unhooked. What they share is the step (`_Step`) and the tensor reference (`_Ref`) defined here.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from partc._torch import storage_key
from partc.errors import PartcError

if TYPE_CHECKING:
    from partc.deferred_init import _Recorder


def seed_of(seed: int, name: str) -> int:
    """The seed of one random fill: a hash of the run's seed and the name of the tensor it fills."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Ref:
    """A tensor of the record: a view of one storage."""

    key: int
    """The storage (`storage_key`)."""
    dtype: torch.dtype
    """The view's element type (the storage has none)."""
    size: tuple[int, ...]
    """The view's shape."""
    stride: tuple[int, ...]
    """The view's strides, in elements."""
    offset: int
    """Storage offset, in elements of `dtype`."""


def _ref(t: Tensor) -> _Ref:
    return _Ref(key=storage_key(t), dtype=t.dtype, size=tuple(t.shape), stride=tuple(t.stride()),
                offset=t.storage_offset())


@dataclass(kw_only=True, slots=True)
class _Step:
    """One recorded step: an op, an ``nn.init`` function, or data from outside the build (`value`)."""

    fn: Callable | None
    """What to call (its generator variant for a random step); None for `value`."""
    args: tuple = ()
    """Positional arguments, tensors as `_Ref`; devices are replaced by the replay's."""
    kwargs: dict | None = None
    """Keyword arguments, likewise."""
    out: Any = None
    """The result's structure, tensors as `_Ref` (to find the storages the step creates)."""
    creates: frozenset[int] = frozenset()
    """Storages the step allocates (its results', or `value`'s)."""
    reads: frozenset[int] = frozenset()
    """Storages whose values the step reads."""
    writes: frozenset[int] = frozenset()
    """Storages written in place (not created)."""
    kills: frozenset[int] = frozenset()
    """Of `writes`, those overwritten whole without being read: the step does not depend on their values."""
    random: bool = False
    """Replayed with a generator seeded by the name of `seed_ref`'s storage."""
    seed_ref: _Ref | None = None
    """The tensor a random step fills (written in place, or its result)."""
    empty: bool = False
    """Creates its storages uninitialized (``torch.empty``)."""
    value: Tensor | None = None
    """Data from outside the build: every byte of its storage (uint8), by reference until a step writes it."""


class InitRecord:
    """How a model's construction and initializers set each of its parameters and buffers (see the module doc)."""

    def __init__(self, rec: _Recorder, model: nn.Module, notes: list[str]):
        self._rec = rec
        self.notes = list(notes)
        """What to tell the user about the record, one line each (an initializer that failed on meta)."""
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        for _, t in named:
            rec.see(t)  # a real tensor no step made (``torch.load`` into a parameter): its values
        self.tensors: dict[str, _Ref] = {name: _ref(t) for name, t in named}
        """Every parameter and buffer FQN (every alias of a tied weight) -> its storage and view."""
        self.parameters = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        self._names: dict[int, str] = {}
        """Storage -> the FQN its random fills are seeded by: the canonical name of its tensor."""
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            self._names.setdefault(storage_key(t), name)
        targets: dict[int, set[str]] = {}
        for name, ref in self.tensors.items():
            if math.prod(ref.size):
                targets.setdefault(ref.key, set()).add(name)
        _, problems = self._walk(targets)
        self.problems: dict[str, str] = {n: problems[n] for n in self.tensors if n in problems}
        """FQN -> why its initial value cannot be reproduced (in model order)."""

    def replay(self, names: Iterable[str], device: torch.device | str, seed: int,
               put: Callable[[str, Tensor], None]) -> None:
        """Compute the named tensors (FQNs) on `device`: ``put(name, value)`` for each, as soon as it is final.
        `value` is the whole tensor (copy it: its memory is freed afterwards). A tensor in `problems` comes out
        uninitialized."""
        device = torch.device(device)
        targets: dict[int, set[str]] = {}
        for n in names:
            targets.setdefault(self.tensors[n].key, set()).add(n)
        picked, _ = self._walk(targets)
        last: dict[int, int] = {}
        for i in picked:
            s = self._rec.steps[i]
            for k in (*s.creates, *s.reads, *s.writes):
                last[k] = i
        env: dict[int, torch.UntypedStorage] = {}
        done: set[int] = set()
        with torch.no_grad(), self._rec.quietly():
            for i in picked:
                s = self._rec.steps[i]
                self._run(i, env, device, seed)
                for k in {*s.creates, *s.reads, *s.writes}:
                    if last[k] != i:
                        continue
                    for n in sorted(targets.get(k, ())):
                        put(n, self._view(env, self.tensors[n], device))
                    done.add(k)
                    env.pop(k, None)
            for k in targets.keys() - done:  # no step: empty (a tensor with no elements, or a problem)
                for n in sorted(targets[k]):
                    put(n, self._view(env, self.tensors[n], device))

    def _walk(self, targets: dict[int, set[str]]) -> tuple[list[int], dict[str, str]]:
        """The steps the final values of `targets` (storage -> names) depend on, in record order; and the names
        whose values cannot be reproduced, with why."""
        steps, storages = self._rec.steps, self._rec.storages
        need = {k: set(v) for k, v in targets.items()}
        written: set[int] = set()  # storages written in part after the point of the walk
        picked: list[int] = []
        problems: dict[str, str] = {}
        for i in range(len(steps) - 1, -1, -1):
            s = steps[i]
            hit = [k for k in (*s.creates, *s.writes) if k in need]
            if not hit:
                continue
            picked.append(i)
            who = set().union(*(need[k] for k in hit))
            for k in hit:
                if k in s.creates:
                    if s.empty and k not in written and storages[k].nbytes():
                        for n in need[k]:
                            problems.setdefault(n, "never set: its memory comes from torch.empty and nothing in "
                                                   "the model's construction or initializers writes it")
                    del need[k]
                elif k in s.kills:
                    del need[k]
                else:
                    written.add(k)
            for k in s.reads:
                need.setdefault(k, set()).update(who)
        for k, names in need.items():
            for n in names:
                problems.setdefault(n, "computed from a meta tensor made outside the model's construction")
        picked.reverse()
        return picked, problems

    def _run(self, i: int, env: dict[int, torch.UntypedStorage], device: torch.device, seed: int) -> None:
        s = self._rec.steps[i]
        if s.fn is None:
            (k,) = s.creates
            env[k] = s.value.to(device, copy=True).untyped_storage()
            return

        def real(a: Any) -> Any:
            if isinstance(a, _Ref):
                return self._view(env, a, device)
            return device if isinstance(a, torch.device) else a

        args, kwargs = _map(real, s.args), _map(real, s.kwargs)
        if s.random:
            name = self._names.get(s.seed_ref.key)
            if name is None:
                name = f"#{i}"
            elif s.seed_ref.offset:
                name = f"{name}@{s.seed_ref.offset}"
            kwargs["generator"] = torch.Generator(device=device).manual_seed(seed_of(seed, name))
        try:
            out = s.fn(*args, **kwargs)
        except Exception as e:
            text = " ".join(str(e).split())[:300]
            raise PartcError(f"cannot replay {getattr(s.fn, '__name__', s.fn)} of the model's construction on "
                             f"{device}: {type(e).__name__}: {text}; pass --init-checkpoint") from None
        if s.creates:
            for ref, t in zip(_leaves(s.out), _leaves(out)):
                if isinstance(ref, _Ref) and ref.key in s.creates and ref.key not in env:
                    env[ref.key] = self._adopt(t, ref, device)

    def _adopt(self, t: Tensor, ref: _Ref, device: torch.device) -> torch.UntypedStorage:
        """The storage of a step's result, laid out as in the record."""
        nbytes = self._rec.storages[ref.key].nbytes()
        st = t.untyped_storage()
        if st.nbytes() == nbytes and t.storage_offset() == ref.offset and tuple(t.stride()) == ref.stride:
            return st
        new = torch.empty(nbytes, dtype=torch.uint8, device=device).untyped_storage()
        _set(new, ref, device).copy_(t)
        return new

    def _view(self, env: dict[int, torch.UntypedStorage], ref: _Ref, device: torch.device) -> Tensor:
        """`ref` on the replay's storages (a storage no step made yet, e.g. one the step overwrites whole: new,
        uninitialized)."""
        if ref.key not in env:
            nbytes = self._rec.storages[ref.key].nbytes()
            env[ref.key] = torch.empty(nbytes, dtype=torch.uint8, device=device).untyped_storage()
        return _set(env[ref.key], ref, device)


def _set(storage: torch.UntypedStorage, ref: _Ref, device: torch.device) -> Tensor:
    return torch.empty(0, dtype=ref.dtype, device=device).set_(storage, ref.offset, ref.size, ref.stride)


def _leaves(tree: Any) -> list:
    """The leaves of nested tuples, lists and dicts (the structures ATen ops take and return)."""
    if isinstance(tree, (tuple, list)):
        return [x for item in tree for x in _leaves(item)]
    if isinstance(tree, dict):
        return [x for item in tree.values() for x in _leaves(item)]
    return [tree]


def _tensors(tree: Any) -> list[Tensor]:
    return [x for x in _leaves(tree) if isinstance(x, Tensor)]


def _map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """`tree` (nested tuples, lists and dicts) with `fn` applied to its leaves."""
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map(fn, x) for x in tree)
    if isinstance(tree, dict):
        return {k: _map(fn, v) for k, v in tree.items()}
    return fn(tree)
