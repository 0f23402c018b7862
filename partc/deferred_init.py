"""Deferred initialization: build a model on the meta device, recording how its construction gives every
parameter and buffer its values, and compute any of them later, on any device, from the record.

Why: partc builds the whole model on every rank but allocates only the rank's part. Built on the meta device a
model costs nothing, but the values its ``__init__`` sets are lost: ``nn.Parameter(torch.ones(d))``, a
zero-initialized gate, ``torch.randn(v, h) * 0.02``, a positional table computed with ``arange``, ``sin`` and
``cos``, a weight derived from another. So `record` builds the model on meta and keeps every step that writes a
storage (a "step" holds tensors as `_Ref`: a storage id and a view of it):

- every ATen op (a `TorchDispatchMode`): its arguments, and the storages it creates, reads and writes;
- ``torch.nn.init``'s ``trunc_normal_``, ``orthogonal_``, ``sparse_`` and ``dirac_``, which return early on meta
  (rejection sampling and a QR decomposition read values): one step each, run whole on replay (also when called
  through Hugging Face's ``transformers.initialization``; a reference to one of the last three bound before the
  build is not seen, and the tensor keeps its earlier value);
- data that no op makes: ``torch.tensor`` / ``as_tensor`` / ``asarray`` / ``Tensor.new_tensor`` of Python or
  NumPy data (a `TorchFunctionMode` makes the values on the CPU and moves them to meta by a recorded op), and real
  tensors the build uses (``torch.from_numpy``, ``torch.load``): kept by reference, copied before a recorded op
  writes them.

Then the model's own initializers run on the meta model, recorded too, as partc ran them before it recorded
anything (so the bundled examples and Hugging Face models keep their initialization): a Hugging Face
``PreTrainedModel``'s ``_init_weights(module)`` over all modules, children first (Hugging Face skips it on meta);
otherwise a model-wide ``init_weights()`` (torchtitan's convention: the trainer calls it after building on meta;
a model whose ``__init__`` calls it already, as partc's examples do, gets the same values again).
Last, a tensor that still has no reproducible value gets its module's ``reset_parameters()``, if it has one. An
initializer that fails on meta (it reads a value, or wants arguments) is noted (`InitRecord.notes`, a compile
warning): what it did not set keeps the value ``__init__`` gives it.

Replay (`InitRecord.replay`, in `partc.init_replay`) walks the record backwards from the wanted tensors' storages to
the steps their final values depend on (a step that overwrites a whole storage without reading it, as ``normal_`` or
``copy_`` do, ends the walk for that storage), runs those steps forward on the target device, hands over each tensor
as soon as its storage is final and frees every storage after its last use. A random step gets a generator seeded by
``seed_of(seed, name)``: name is the FQN of the tensor whose storage the step fills (``fqn@offset`` for a fill of
part of it, e.g. one row), or ``#i``, its place in the record, for a temporary such as the ``randn`` of
``randn(v, h) * 0.02``. So a tensor gets the same values whatever else is replayed with it: under every plan, and as
the whole model gets in one process.

`InitRecord.problems` names what cannot be reproduced: values read from a meta tensor made outside the build (no
recorded step created it), and ``torch.empty`` memory nothing wrote.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from partc._torch import TorchDispatchMode, storage_key
from partc.frames import exception_frames, innermost
from partc.hf_model import is_hf
from partc.init_replay import InitRecord, _leaves, _map, _ref, _Step

_FILLS = {"fill_", "zero_", "copy_", "normal_", "uniform_", "random_", "bernoulli_", "exponential_", "cauchy_",
          "log_normal_", "geometric_"}
"""In-place ops that set every element of their first argument without reading it."""
_EMPTY = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
"""Ops whose result holds whatever the memory held."""
_METADATA = {"set_", "resize_", "resize_as_", "as_strided_"}
"""In-place ops that change which storage (or how much of it) a tensor views, not the values in it: not steps.
(A tensor's value is its storage's, looked up at the end.)"""
_INIT_FUNCTIONS = ("_no_grad_trunc_normal_", "orthogonal_", "sparse_", "dirac_")
"""``torch.nn.init`` functions that do nothing on meta: recorded as one step each. ``trunc_normal_`` is recorded
through the helper it looks up when called, so that a reference bound before the build (``from torch.nn.init
import trunc_normal_``) is seen too."""
_DATA_FUNCTIONS = (torch.tensor, torch.as_tensor, torch.asarray, Tensor.new_tensor)
"""Factories whose values come from Python data, not from an op."""


class _Recorder:
    """The steps of one build, and every storage they touched (kept alive, so that storage ids stay unique)."""

    def __init__(self):
        self.steps: list[_Step] = []
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.shared: dict[int, int] = {}
        """Storage -> index of the step holding its data by reference (the user's tensor)."""
        self.quiet = False

    @contextmanager
    def quietly(self) -> Iterator[None]:
        """partc's own tensor work, not recorded."""
        quiet, self.quiet = self.quiet, True
        try:
            yield
        finally:
            self.quiet = quiet

    def see(self, t: Tensor) -> None:
        """Note the storage of a tensor the build uses; real data that no step made becomes a step."""
        k = storage_key(t)
        if k in self.storages:
            return
        self.storages[k] = t.untyped_storage()
        if not t.is_meta:
            with self.quietly():
                whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            self.shared[k] = len(self.steps)
            self.steps.append(_Step(fn=None, creates=frozenset({k}), value=whole))

    def before_write(self, t: Tensor) -> None:
        """Copy data held by reference before the build changes it."""
        index = self.shared.pop(storage_key(t), None)
        if index is not None:
            with self.quietly():
                self.steps[index].value = self.steps[index].value.clone()

    def op(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        """Run one ATen op of the build and record it if it creates or writes a storage."""
        written, whole = [], []  # tensors written in place; of those, the ones overwritten without being read
        for index, name, overwrites in _written_args(func):
            value = args[index] if index < len(args) else kwargs.get(name)
            ts = _tensors(value)
            written += ts
            if overwrites:
                whole += ts
        inputs = _tensors((args, kwargs))
        for t in inputs:
            self.see(t)
        for t in written:
            self.before_write(t)
        out = _meta_normal(func, args, kwargs)
        if out is None:
            out = func(*args, **kwargs)
        outs = _tensors(out)
        creates = set()
        for t in outs:
            k = storage_key(t)
            if k not in self.storages:
                self.storages[k] = t.untyped_storage()
                creates.add(k)
        if not creates and not written:
            return out  # a view, or a question about a tensor
        not_read = {id(t) for t in whole}
        variant = _generator_variant(func)
        self.steps.append(_Step(
            fn=variant or func, args=_map(_as_ref, args), kwargs=_map(_as_ref, kwargs), out=_map(_as_ref, out),
            creates=frozenset(creates), reads=frozenset(storage_key(t) for t in inputs if id(t) not in not_read),
            writes=frozenset(storage_key(t) for t in written),
            kills=frozenset(storage_key(t) for t in whole if _covers(t)), random=variant is not None,
            seed_ref=_ref(written[0]) if written else _ref(outs[0]),
            empty=func.overloadpacket.__name__ in _EMPTY))
        return out

    def call(self, fn: Callable, tensor: Tensor, args: tuple, kwargs: dict) -> Tensor:
        """Run an ``nn.init`` function that fills `tensor` whole, as one step."""
        with self.quietly():
            self.see(tensor)
            self.before_write(tensor)
            k = storage_key(tensor)
            random = "generator" in inspect.signature(fn).parameters
            self.steps.append(_Step(
                fn=fn, args=(_ref(tensor), *_map(_as_ref, args)), kwargs=_map(_as_ref, kwargs), writes=frozenset({k}),
                kills=frozenset({k}) if _covers(tensor) else frozenset(), random=random, seed_ref=_ref(tensor)))
            fn(tensor, *args, **kwargs)  # on meta: nothing; on a real tensor the build made: its values now
        return tensor


def _meta_normal(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Tensor | None:
    """``normal_`` of a floating-point meta tensor with numbers for its mean and std: the tensor, after the check
    PyTorch makes (std >= 0), without its meta kernel (a Python decomposition that builds the samples' shape, about
    a millisecond a call; a large model's build makes a thousand). None for any other call."""
    if func is not torch.ops.aten.normal_.default or kwargs.get("generator") is not None:
        return None
    t = args[0]
    mean = args[1] if len(args) > 1 else kwargs.get("mean", 0)
    std = args[2] if len(args) > 2 else kwargs.get("std", 1)
    if not (t.is_meta and t.dtype.is_floating_point and isinstance(mean, (int, float))
            and isinstance(std, (int, float))):
        return None
    torch._check(std >= 0, lambda: f"normal expects std >= 0.0, but found std {std}")
    return t


class _OpRecorder(TorchDispatchMode):
    def __init__(self, rec: _Recorder):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.rec.quiet or func.overloadpacket.__name__ in _METADATA:
            return func(*args, **kwargs)
        return self.rec.op(func, args, kwargs)


class _DataRecorder(TorchFunctionMode):
    """``torch.tensor(data)`` on meta keeps no values: make them on the CPU and move them by a recorded op."""

    def __init__(self, rec: _Recorder):
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _DATA_FUNCTIONS and not self.rec.quiet and isinstance(out, Tensor) and out.is_meta:
            data = args[1:2] if func is Tensor.new_tensor else args[:1]  # (data,), or () if passed by keyword
            if data and not _holds_tensor(data[0]):
                value = func(*args, **{**kwargs, "device": "cpu"})
                out = value.detach().to(out.device).requires_grad_(out.requires_grad)
        return out


def _holds_tensor(data: Any) -> bool:
    if isinstance(data, Tensor):
        return True
    return isinstance(data, (list, tuple)) and any(_holds_tensor(x) for x in data)


@contextmanager
def _init_functions_recorded(rec: _Recorder) -> Iterator[None]:
    """Replace the ``nn.init`` functions that skip meta tensors (in ``torch.nn.init`` and in Hugging Face's table
    of them) with recording wrappers."""
    hf = sys.modules.get("transformers.initialization")
    tables = [vars(torch.nn.init)]
    if isinstance(getattr(hf, "TORCH_INIT_FUNCTIONS", None), dict):
        tables.append(hf.TORCH_INIT_FUNCTIONS)
    saved = []
    for name in _INIT_FUNCTIONS:
        original = getattr(torch.nn.init, name, None)
        if original is None:  # not in this PyTorch
            continue

        def wrapper(tensor, *args, _fn=original, **kwargs):
            if rec.quiet:
                return _fn(tensor, *args, **kwargs)
            return rec.call(_fn, tensor, args, kwargs)

        functools.update_wrapper(wrapper, original)
        for table in tables:
            if table.get(name) is original:
                saved.append((table, name, original))
                table[name] = wrapper
    try:
        yield
    finally:
        for table, name, original in saved:
            table[name] = original


@contextmanager
def _recording(rec: _Recorder) -> Iterator[None]:
    with torch.device("meta"), _DataRecorder(rec), _OpRecorder(rec), _init_functions_recorded(rec):
        yield


def record(build: Callable[[], nn.Module]) -> tuple[nn.Module, InitRecord]:
    """Build the model on meta with `build` and run its initializers, recording both (see the module doc)."""
    rec = _Recorder()
    notes: list[str] = []
    with _recording(rec):
        model = build()
        _call(lambda: _run_initializers(model), notes)
    init = InitRecord(rec, model, notes)
    holders = [m for name, m in model.named_modules() if callable(getattr(m, "reset_parameters", None))
               and any(n.rpartition(".")[0] == name for n in init.problems)]
    if holders:
        with _recording(rec):
            for m in holders:
                _call(m.reset_parameters, notes)
        init = InitRecord(rec, model, notes)
    return model, init


def _run_initializers(model: nn.Module) -> None:
    """The model-wide initializer partc runs: Hugging Face's ``_init_weights`` or ``init_weights()``."""
    if is_hf(model):
        def visit(module: nn.Module, init: Callable[[nn.Module], None]) -> None:
            for child in module.children():
                visit(child, child._init_weights if is_hf(child) else init)
            init(module)
        visit(model, model._init_weights)
    elif callable(getattr(model, "init_weights", None)):
        model.init_weights()


def _call(fn: Callable[[], Any], notes: list[str]) -> None:
    """Run an initializer of the model on meta; if it fails there, note why (the steps it took stay recorded:
    every rank records the same)."""
    try:
        with torch.no_grad():
            fn()
    except Exception as e:
        text = " ".join(str(e).split())[:200]
        notes.append(f"the model's initializer failed on the meta device ({_user_line(e)}{type(e).__name__}: "
                     f"{text}); what it did not set keeps the value __init__ gives it")


def _user_line(e: BaseException) -> str:
    """'file:line: ' of the innermost frame of `e` in the user's own files; or ''."""
    frame = innermost(exception_frames(e), installed_packages=False)
    return f"{Path(frame.filename).name}:{frame.lineno}: " if frame is not None else ""


def _tensors(tree: Any) -> list[Tensor]:
    return [x for x in _leaves(tree) if isinstance(x, Tensor)]


def _as_ref(a: Any) -> Any:
    return _ref(a) if isinstance(a, Tensor) else a


@functools.cache
def _written_args(func: torch._ops.OpOverload) -> tuple[tuple[int, str, bool], ...]:
    """(position, name, overwritten without being read) of each argument `func` writes in place: an ``out=``
    argument, or the first argument of a fill (`_FILLS`)."""
    fill = func.overloadpacket.__name__ in _FILLS
    return tuple((i, a.name, a.kwarg_only or (fill and a.name == "self"))
                 for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def _covers(t: Tensor) -> bool:
    """Whether `t` views every byte of its storage exactly once."""
    if t.storage_offset() != 0 or t.numel() * t.element_size() != t.untyped_storage().nbytes():
        return False
    expected = 1
    for size, stride in sorted(((sz, st) for sz, st in zip(t.shape, t.stride()) if sz != 1), key=lambda x: x[1]):
        if stride != expected:
            return False
        expected *= size
    return True


@functools.cache
def _generator_variant(func: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The overload of a random op that takes a ``generator`` (``randn.default`` -> ``randn.generator``); None
    for an op that draws no random numbers."""
    names = {a.name for a in func._schema.arguments}
    if "generator" in names:
        return func
    packet = func.overloadpacket
    for overload in packet.overloads():
        op = getattr(packet, overload)
        if {a.name for a in op._schema.arguments} == names | {"generator"}:
            return op
    return None
