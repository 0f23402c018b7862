"""LLaMA-3.1 8B at long context, in plain PyTorch: the bundled LLaMA (examples/llama.py) at Meta's published
dimensions of Llama 3.1 8B (32 layers, h 4096, 32 query and 8 key/value heads, SwiGLU 14336, vocabulary 128,256)
and `PARTC_SEQ_LEN` tokens a sample (default 131,072, its context length). Llama 3.1's rotary scaling changes
which angles the positions get, not what a step computes, holds or sends, so the plan is that of the Hugging Face
model; the Hugging Face model itself is refused under context parallelism (docs/context-parallel.md).

    PARTC_SEQ_LEN=131072 partc compile benchmarks/models/llama31_8b.py --gpus 64 --cluster h100-80g
"""

import importlib.util
import os
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("partc_example_llama",
                                               Path(__file__).resolve().parents[2] / "examples" / "llama.py")
_llama = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _llama  # its dataclasses look their module up
_spec.loader.exec_module(_llama)

CONFIG = _llama.LlamaConfig(vocab_size=128256, seq_len=int(os.environ.get("PARTC_SEQ_LEN", "131072")), hidden=4096,
                            heads=32, kv_heads=8, layers=32, ffn_hidden=14336, rope_theta=500000.0)


def model():
    return _llama.Llama(CONFIG)


def example_inputs(batch_size: int):
    import torch
    return (torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.seq_len)),)


def example_targets(batch_size: int):
    import torch
    return torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.seq_len))


loss_fn = _llama.loss_fn
