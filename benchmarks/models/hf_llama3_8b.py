"""Hugging Face LLaMA-3 8B (Meta's published configuration) built from its config, nothing downloaded; partc builds it
on the meta device (16 GB of bf16 parameters otherwise).

    partc compile benchmarks/models/hf_llama3_8b.py --gpus 8 --cluster h100-80g

Without ``example_inputs`` partc synthesizes ``input_ids`` (``--seq-len``, default min(1024, max positions)).
"""

from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                     rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(CONFIG)
