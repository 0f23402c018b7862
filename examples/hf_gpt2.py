"""A tiny Hugging Face GPT-2 built from its config (nothing is downloaded).

    partc compile examples/hf_gpt2.py

A file with a Hugging Face model needs only `model()`: without `example_inputs` partc synthesizes ``input_ids``.
This one spells the functions out to show the keyword form: a dict of tensors plus Python scalars
(``use_cache=False``: no key/value cache in training).
"""

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

# Dropout off, so a sharded run can be compared with one process exactly.
CONFIG = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128,
                    bos_token_id=511, eos_token_id=511, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
SEQ_LEN = 128


def model() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(CONFIG)


def example_inputs(batch_size: int) -> dict:
    return {"input_ids": torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ_LEN)), "use_cache": False}


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ_LEN))


def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits; `outputs` is a CausalLMOutputWithCrossAttentions."""
    return F.cross_entropy(outputs.logits.flatten(0, 1), targets.flatten())
