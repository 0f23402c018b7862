"""Hugging Face LLaMA-3.1 8B (Meta's published configuration: 131,072 positions, Llama 3's rope scaling) built from
its config, nothing downloaded; partc builds it on the meta device.

    partc compile benchmarks/models/hf_llama31_8b.py --gpus 64 --cluster h100-80g --seq-len 131072

Without ``example_inputs`` partc synthesizes ``input_ids`` (``--seq-len``, default min(1024, max positions)).
Under torch.export transformers builds the causal mask explicitly; partc proves it causal and attends with
``is_causal`` (docs/context-parallel.md), which context parallelism splits.
"""

from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                     rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192})


def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(CONFIG)
