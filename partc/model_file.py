"""Load a user's model file (``partc compile model.py``) into a `ModelSpec`.

The file contract (``examples/gpt.py`` is a complete example)::

    def model() -> nn.Module                        # the entry; another name with --entry NAME
    def example_inputs(batch_size) -> tuple | dict  # positional or keyword arguments for batch_size samples
    def example_targets(batch_size)                 # optional
    def loss_fn(outputs, targets) -> Tensor         # optional
    def dataset() -> Dataset | IterableDataset      # optional: the training data (``partc run``)

partc calls ``model()`` under ``with torch.device("meta"):``, so building a 175B model costs no memory; the tracer
calls ``example_inputs`` under the meta device too, and the runtime calls it under the real device. Functions
therefore create tensors without a ``device=`` argument.

Inputs. A tuple is positional arguments, a dict keyword arguments. Values are tensors whose dim 0 is the batch
(the runtime splits micro-batches along it), or Python scalars (``use_cache=False``); at least one tensor.

Hugging Face models (a ``transformers.PreTrainedModel``; transformers is optional) need no ``example_inputs``:
- token models (``main_input_name == "input_ids"``): ``input_ids`` LongTensor [batch, seq_len] drawn uniformly from
  [0, vocab_size), plus ``decoder_input_ids`` of the same shape for encoder-decoder models. ``seq_len`` is the
  caller's (``--seq-len``), default ``min(max_position_embeddings, 1024)`` (1024 when the config has no limit):
  long enough for realistic costs, short enough that an 128k-context config does not mean 128k-token samples;
- image models (``main_input_name == "pixel_values"``): ``pixel_values`` [batch, num_channels, image_size, image_size]
  from the standard normal;
- ``use_cache=False`` whenever ``forward`` takes ``use_cache`` (no KV cache in training).

Targets, when the file has no ``example_targets``: class indices drawn with ``torch.randint`` from the ambient RNG
on the ambient device, shaped like the logits without their last dim, in [0, V) where V is the logits' last dim:
- Hugging Face models, by class name (their forward cannot run eagerly on the meta device): ``*LMHeadModel``,
  ``*ForCausalLM``, ``*ForMaskedLM``, ``*ForConditionalGeneration``: shaped like ``input_ids`` (``decoder_input_ids``
  if present), V = vocab_size; ``*ForTokenClassification``: the same shape, V = num_labels; other
  ``*For*Classification``: [batch], V = num_labels.
- any other model: V and the shape come from one forward on the meta device at batch size 1 (done on the first
  call, then cached; dim 0 of the logits is the batch).
Only if that fails does ``targets`` raise, asking for ``example_targets``: models it cannot handle still load,
compile and trace.

Data. ``dataset()`` returns a ``torch.utils.data.Dataset`` (or ``IterableDataset``) whose items are one sample's
``(inputs, targets)``: the inputs as ``example_inputs`` gives them without the batch dimension (a tensor, a tuple
or a dict), the targets as ``example_targets`` would (`partc.runtime.data` reads it). A file with ``dataset()``
needs neither ``example_inputs`` nor ``example_targets``: partc takes one sample (item 0, or the stream's first)
and repeats it ``batch_size`` times, so the shapes and dtypes the compiler traces are the data's.

Loss, when the file has no ``loss_fn``: ``F.cross_entropy(logits.flatten(0, -2), targets.flatten())`` (mean,
``ignore_index=-100``), where logits are ``outputs`` itself, ``outputs.logits`` (a Hugging Face ``ModelOutput``),
``outputs["logits"]`` or ``outputs[0]``.

Every problem a user can cause raises `PartcError` with one line naming the file and what to do.

Importing the file and calling its functions: `partc.user_code`; the Hugging Face rules above: `partc.hf_model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from partc.errors import PartcError, article
from partc.hf_model import _hf_inputs, _hf_targets
from partc.user_code import _call_user, _callables, _describe, _import_file, _shown, _user_frame
from partc.value_sized import ExpectedSizes

_SCALARS = (bool, int, float, str, type(None))


@dataclass(kw_only=True, slots=True)
class ModelSpec:
    """What partc needs from a model file. All callables raise `PartcError` for mistakes in the file."""

    path: str
    """Absolute path of the model file."""
    name: str
    """The file's stem (``gpt`` for ``examples/gpt.py``): a short name for output files and reports."""
    module: ModuleType
    """The imported file, for optional extras a pass may look up."""
    build: Callable[[], nn.Module]
    """Calls the entry and checks it returned an ``nn.Module``; builds on the ambient device (see `build_on_meta`)."""
    inputs: Callable[[int], tuple[tuple, dict]]
    """batch_size -> (args, kwargs) for ``model(*args, **kwargs)``, on the ambient device, validated."""
    targets: Callable[[int], Any]
    """batch_size -> targets for `loss_fn`, on the ambient device (the default is described in the module doc)."""
    loss_fn: Callable[[Any, Any], Tensor]
    """(outputs, targets) -> scalar loss. The file's own ``loss_fn`` is returned unwrapped."""
    seq_len: int | None
    """Tokens per sample: the synthesized length, else dim 1 of ``input_ids`` (or of the first positional
    integer tensor) from ``example_inputs``; None when there is no such input."""
    dataset: Callable[[], Any] | None = None
    """The file's ``dataset()``, called once (later calls return the same object); None if it has none."""


def load_model_file(path: str, *, entry: str = "model", seq_len: int | None = None) -> ModelSpec:
    """Imports the model file at `path` and checks the contract in the module doc.

    `seq_len` sets the tokens per sample of synthesized Hugging Face inputs; it is an error for a file with its own
    ``example_inputs``, which sets the length itself. To report mistakes early, this calls ``example_inputs(1)`` on
    the meta device, or for a file without it ``model()`` on the meta device (to recognize a Hugging Face model).
    """
    file = Path(path).expanduser()
    if not file.exists():
        raise PartcError(f"model file {path} does not exist")
    if file.is_dir():
        raise PartcError(f"{path} is a directory; pass the Python file that defines {entry}()")
    if file.suffix != ".py":
        raise PartcError(f"{path} is not a Python file (.py); pass the file that defines {entry}()")
    file = file.resolve()
    shown = _shown(file)
    module = _import_file(file, shown)

    fn = getattr(module, entry, None)
    if fn is None:
        found = _callables(module)
        listing = f"it defines: {', '.join(found)}" if found else "it defines no functions or classes"
        raise PartcError(f"{shown} has no '{entry}' ({listing}); define {entry}() returning the nn.Module "
                         f"or pass --entry NAME")
    if not callable(fn):
        raise PartcError(f"{shown}: '{entry}' is {article(type(fn).__name__)}, not a function; define {entry}() "
                         f"returning the nn.Module or pass --entry NAME")

    def build() -> nn.Module:
        m = _call_user(fn, f"{entry}()", shown)
        if not isinstance(m, nn.Module):
            raise PartcError(f"{shown}: {entry}() returned {type(m).__name__}, expected a torch.nn.Module")
        return m

    user_inputs = getattr(module, "example_inputs", None)
    user_targets = getattr(module, "example_targets", None)
    user_loss = getattr(module, "loss_fn", None)
    user_dataset = getattr(module, "dataset", None)
    for fname, obj in (("example_inputs", user_inputs), ("example_targets", user_targets), ("loss_fn", user_loss),
                       ("dataset", user_dataset)):
        if obj is not None and not callable(obj):
            raise PartcError(f"{shown}: '{fname}' is {article(type(obj).__name__)}, not a function")
    if seq_len is not None and seq_len < 1:
        raise PartcError(f"--seq-len must be at least 1, got {seq_len}")

    dataset = None
    if user_dataset is not None:
        made: list = []

        def dataset() -> Any:
            if not made:
                with torch.device("cpu"):  # data is made on the CPU, even when first asked for on meta
                    ds = _call_user(user_dataset, "dataset()", shown)
                if not isinstance(ds, (torch.utils.data.Dataset, torch.utils.data.IterableDataset)):
                    raise PartcError(f"{shown}: dataset() returned {type(ds).__name__}, expected a "
                                     f"torch.utils.data.Dataset or IterableDataset")
                made.append(ds)
            return made[0]

        sample: list = []

        def first_sample() -> tuple[Any, Any]:
            if not sample:
                with torch.device("cpu"):
                    sample.append(_first_sample(dataset(), shown))
            return sample[0]

    if user_inputs is not None:
        if seq_len is not None:
            raise PartcError(f"--seq-len applies only to inputs partc synthesizes for a Hugging Face model; "
                             f"{shown} defines example_inputs, so set the sequence length there")

        def inputs(batch_size: int) -> tuple[tuple, dict]:
            raw = _call_user(user_inputs, f"example_inputs({batch_size})", shown, batch_size)
            return _normalize_inputs(raw, batch_size, f"{shown}: example_inputs({batch_size})")

        with torch.device("meta"):
            args, kwargs = inputs(1)
        seq_len = infer_seq_len(args, kwargs)
    elif dataset is not None:
        if seq_len is not None:
            raise PartcError(f"--seq-len applies only to inputs partc synthesizes for a Hugging Face model; "
                             f"{shown} defines dataset(), whose samples set the sequence length")

        def inputs(batch_size: int) -> tuple[tuple, dict]:
            raw, _ = first_sample()
            raw = raw if isinstance(raw, (tuple, dict)) else (raw,)
            return _normalize_inputs(_repeat(raw, batch_size), batch_size,
                                     f"{shown}: dataset()'s first sample (its inputs)")

        with torch.device("meta"):
            args, kwargs = inputs(1)
        seq_len = infer_seq_len(args, kwargs)
    else:
        hf = _hf_inputs(_build_on_meta(build), shown, seq_len)
        if hf is None:
            raise PartcError(f"{shown} defines no example_inputs(batch_size); add one returning the inputs for "
                             f"batch_size samples as a tuple (positional) or dict (keyword) of tensors")
        inputs, seq_len = hf

    if user_targets is not None:
        def targets(batch_size: int) -> Any:
            out = _call_user(user_targets, f"example_targets({batch_size})", shown, batch_size)
            if not _has_tensor(out):
                raise PartcError(f"{shown}: example_targets({batch_size}) returned {type(out).__name__}, "
                                 f"expected a tensor (or a tuple/dict of tensors)")
            return out
    elif dataset is not None:
        def targets(batch_size: int) -> Any:
            return _repeat(first_sample()[1], batch_size)
    else:
        targets = _default_targets(build, inputs, shown)

    return ModelSpec(path=str(file), name=file.stem, module=module, build=build, inputs=inputs, targets=targets,
                     loss_fn=user_loss if user_loss is not None else default_loss, seq_len=seq_len,
                     dataset=dataset)


def _first_sample(ds: Any, shown: str) -> tuple[Any, Any]:
    """Item 0 of a Dataset (the first item of an IterableDataset), checked to be ``(inputs, targets)``."""
    what = f"{shown}: dataset()"
    try:
        if isinstance(ds, torch.utils.data.IterableDataset):
            item = next(iter(ds), None)
            if item is None:
                raise PartcError(f"{what} is empty; it must yield (inputs, targets) samples")
        else:
            if len(ds) == 0:
                raise PartcError(f"{what} is empty; it must hold (inputs, targets) samples")
            item = ds[0]
    except PartcError:
        raise
    except Exception as e:
        raise PartcError(f"{_user_frame(e) or shown}: reading dataset()'s first sample raised {_describe(e)}") \
            from None
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise PartcError(f"{what}'s items must be (inputs, targets) pairs, got {type(item).__name__}")
    inputs, targets = item
    if not _has_tensor(targets):
        raise PartcError(f"{what}'s targets are {type(targets).__name__}; expected a tensor (or a tuple/dict of "
                         f"tensors)")
    return inputs, targets


def _repeat(x: Any, batch_size: int) -> Any:
    """`x` (one sample: tensors, tuples, dicts, scalars) as a batch of `batch_size` copies, on the ambient device."""
    if isinstance(x, Tensor):
        out = torch.empty((batch_size, *x.shape), dtype=x.dtype)
        if out.device.type != "meta":
            out.copy_(x.unsqueeze(0).expand(batch_size, *x.shape))
        return out
    if isinstance(x, tuple):
        return tuple(_repeat(v, batch_size) for v in x)
    if isinstance(x, list):
        return [_repeat(v, batch_size) for v in x]
    if isinstance(x, dict):
        return {k: _repeat(v, batch_size) for k, v in x.items()}
    return x


def build_on_meta(spec: ModelSpec) -> nn.Module:
    """Builds the model on the meta device: shapes and dtypes only, no memory, no initialization cost."""
    return _build_on_meta(spec.build)


def _build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return build()  # `build` checks the result is an nn.Module


def default_loss(outputs: Any, targets: Tensor) -> Tensor:
    """Cross-entropy of logits [..., V] against class indices [...] (mean over positions, -100 ignored)."""
    logits = _logits(outputs)
    if logits is None:
        raise PartcError(f"cannot find logits in the model's outputs ({type(outputs).__name__}); define "
                         f"loss_fn(outputs, targets) in the model file")
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=-100)


# ---------------------------------------------------------------------------------------------------------------
# Inputs and targets


def _normalize_inputs(raw: Any, batch_size: int, what: str) -> tuple[tuple, dict]:
    """Checks `raw` is a tuple (positional) or dict (keyword) of tensors with the batch in dim 0, or scalars."""
    if isinstance(raw, tuple):
        args, kwargs, items = raw, {}, [(f"item {i}", v) for i, v in enumerate(raw)]
    elif isinstance(raw, dict):
        if not all(isinstance(k, str) for k in raw):
            raise PartcError(f"{what} returned a dict with non-string keys; keys must be argument names")
        args, kwargs, items = (), dict(raw), [(f"'{k}'", v) for k, v in raw.items()]
    else:
        hint = "; return (x,) for a single positional input" if isinstance(raw, Tensor) else ""
        raise PartcError(f"{what} returned {type(raw).__name__}, expected a tuple (positional arguments) or "
                         f"dict (keyword arguments) of tensors{hint}")
    for label, v in items:
        if isinstance(v, Tensor):
            if v.dim() == 0 or v.shape[0] != batch_size:
                raise PartcError(f"{what}: input {label} has shape {tuple(v.shape)}; dim 0 of every tensor input "
                                 f"must be the batch ({batch_size})")
        elif not isinstance(v, _SCALARS):
            raise PartcError(f"{what}: input {label} is {type(v).__name__}; inputs must be tensors "
                             f"(or Python scalars such as use_cache=False)")
    if not any(isinstance(v, Tensor) for _, v in items):
        raise PartcError(f"{what} returned no tensors; return the model's tensor inputs")
    return tuple(args), kwargs


def infer_seq_len(args: tuple, kwargs: dict) -> int | None:
    """Tokens per sample of the model's inputs: dim 1 of ``input_ids``, else of the first integer tensor input
    with a sequence dim ([batch, seq, ...]: token ids), positional before keyword; None if there is none."""
    candidates = [kwargs.get("input_ids"), *args, *kwargs.values()]
    for ids in candidates:
        if isinstance(ids, Tensor) and ids.dim() >= 2 and not ids.is_floating_point() and not ids.is_complex():
            return int(ids.shape[1])
    return None


def _has_tensor(x: Any) -> bool:
    if isinstance(x, Tensor):
        return True
    if isinstance(x, (tuple, list)):
        return bool(x) and all(_has_tensor(v) for v in x)
    if isinstance(x, dict):
        return bool(x) and all(_has_tensor(v) for v in x.values())
    return False


def _logits(outputs: Any) -> Tensor | None:
    if isinstance(outputs, Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(outputs, dict) and isinstance(outputs.get("logits"), Tensor):
        return outputs["logits"]
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], Tensor):
        return outputs[0]
    return None


def _default_targets(build: Callable[[], nn.Module], inputs: Callable[[int], tuple[tuple, dict]],
                     shown: str) -> Callable[[int], Tensor]:
    """Random class indices shaped like the logits without their last dim (see the module doc)."""
    found: list[tuple[tuple[int, ...], int]] = []  # [(shape after the batch dim, number of classes)], cached

    def shape_and_classes() -> tuple[tuple[int, ...], int]:
        if found:
            return found[0]
        try:
            with torch.device("meta"), torch.no_grad():
                model = build()
                args, kwargs = inputs(1)
                rule = _hf_targets(model, args, kwargs)
                # a value-sized op (a mixture's routing, `partc.value_sized`) at all of its rows: only the logits'
                # shape is read
                with ExpectedSizes(1):
                    logits = None if rule else _logits(model(*args, **kwargs))
        except Exception as e:  # a PartcError from build/inputs too: the hint is what matters here
            raise PartcError(f"{shown} defines no example_targets, and partc could not infer them from a forward on "
                             f"the meta device ({_describe(e)}); define example_targets(batch_size)") from None
        if rule is None:
            if logits is None or logits.dim() < 2 or logits.shape[0] != 1:
                raise PartcError(f"{shown} defines no example_targets, and the model's outputs have no logits "
                                 f"[batch, ..., classes]; define example_targets(batch_size) and "
                                 f"loss_fn(outputs, targets)")
            rule = (tuple(logits.shape[1:-1]), int(logits.shape[-1]))
        found.append(rule)
        return rule

    def targets(batch_size: int) -> Tensor:
        rest, classes = shape_and_classes()
        return torch.randint(0, classes, (batch_size, *rest))

    return targets
