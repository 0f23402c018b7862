"""Hugging Face models in a model file without ``example_inputs``: the inputs and targets partc synthesizes from the
model's class and config (the rules are in `partc.model_file`'s docstring, the contract a user reads).

Apart from `partc.model_file` because these rules read transformers' conventions (``main_input_name``, the config's
``vocab_size``, ``max_position_embeddings``, ``image_size``, ``num_labels``, the class-name suffixes), not the
model file's; transformers stays optional (`is_hf` never imports it).
"""

from __future__ import annotations

import inspect
import sys
from typing import Callable

import torch
from torch import Tensor, nn

from partc.errors import PartcError

DEFAULT_MAX_SEQ_LEN = 1024
"""Default tokens per sample for a Hugging Face token model: min(this, the config's max positions)."""

_HF_LM_SUFFIXES = ("LMHeadModel", "ForCausalLM", "ForMaskedLM", "ForConditionalGeneration")


def is_hf(model: nn.Module) -> bool:
    """True for a Hugging Face ``PreTrainedModel`` (without importing transformers when the model file did not)."""
    transformers = sys.modules.get("transformers")  # a PreTrainedModel means the file imported transformers
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _hf_inputs(model: nn.Module, shown: str, seq_len: int | None
               ) -> tuple[Callable[[int], tuple[tuple, dict]], int | None] | None:
    """(inputs, seq_len) synthesized for a Hugging Face model; None if `model` is not one."""
    if not is_hf(model):
        return None
    config = model.config
    cls = type(model).__name__
    main = getattr(model, "main_input_name", "input_ids")
    scalars = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    cannot = f"{shown}: partc cannot synthesize inputs for {cls}"

    if main == "input_ids":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        vocab = getattr(text, "vocab_size", None)
        if not isinstance(vocab, int) or vocab < 1:
            raise PartcError(f"{cannot} (its config has no vocab_size); define example_inputs(batch_size)")
        limit = getattr(text, "max_position_embeddings", None)
        limit = limit if isinstance(limit, int) and limit > 0 else None
        if seq_len is None:
            seq_len = min(limit, DEFAULT_MAX_SEQ_LEN) if limit else DEFAULT_MAX_SEQ_LEN
        elif limit is not None and seq_len > limit:
            raise PartcError(f"--seq-len {seq_len} exceeds the {limit} positions of {cls} in {shown}; "
                             f"pass --seq-len {limit} or less")
        names = ("input_ids", "decoder_input_ids") if getattr(config, "is_encoder_decoder", False) else ("input_ids",)
        shape = seq_len

        def inputs(batch_size: int) -> tuple[tuple, dict]:
            return (), {**{n: torch.randint(0, vocab, (batch_size, shape)) for n in names}, **scalars}

        return inputs, seq_len

    if main == "pixel_values":
        if seq_len is not None:
            raise PartcError(f"--seq-len does not apply to {cls} in {shown}, an image model")
        vision = getattr(config, "vision_config", None)  # CLIP and other two-tower models keep it there
        config = config if getattr(config, "image_size", None) is not None or vision is None else vision
        size = getattr(config, "image_size", None)
        size = (size, size) if isinstance(size, int) else tuple(size) if isinstance(size, (list, tuple)) else None
        if size is None or len(size) != 2:
            raise PartcError(f"{cannot} (its config has no image_size); define example_inputs(batch_size)")
        channels = int(getattr(config, "num_channels", 3))

        def pixels(batch_size: int) -> tuple[tuple, dict]:
            return (), {"pixel_values": torch.randn(batch_size, channels, *size), **scalars}

        return pixels, None

    raise PartcError(f"{cannot} (main input '{main}'); define example_inputs(batch_size) in the file")


def _hf_targets(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple[int, ...], int] | None:
    """(target shape after the batch dim, number of classes) of a Hugging Face model, read from its class name
    and config (its forward cannot run on the meta device); None if not a Hugging Face model or not recognized."""
    if not is_hf(model):
        return None
    cls = type(model).__name__
    config = model.config
    ids = kwargs.get("decoder_input_ids", kwargs.get("input_ids"))
    if ids is None and args and isinstance(args[0], Tensor):
        ids = args[0]
    positions = tuple(ids.shape[1:]) if isinstance(ids, Tensor) else None
    if cls.endswith(_HF_LM_SUFFIXES) and positions is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        vocab = getattr(text, "vocab_size", None)
        return (positions, vocab) if isinstance(vocab, int) else None
    labels = getattr(config, "num_labels", None)
    if not isinstance(labels, int) or "For" not in cls:
        return None
    if cls.endswith("ForTokenClassification") and positions is not None:
        return positions, labels
    if cls.endswith("Classification"):
        return (), labels
    return None
