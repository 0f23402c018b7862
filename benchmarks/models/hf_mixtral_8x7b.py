"""Hugging Face Mixtral-8x7B (Mistral AI's published configuration: 8 experts, 2 per token, 46.7B parameters of
which 12.9B run per token) built from its config, nothing downloaded; partc builds it on the meta device.

    partc compile benchmarks/models/hf_mixtral_8x7b.py --gpus 16 --cluster h100-80g

Without ``example_inputs`` partc synthesizes ``input_ids`` (``--seq-len``, default min(1024, max positions)). The
experts run Hugging Face's default ``grouped_mm`` implementation (docs/cost-model.md, "Time": mixture of experts).
Under tensor parallelism they are split inside, each as a Megatron MLP (TP style ``inner``, `partc.passes.experts`):
``--tp 2`` gives dp 1 tp 2 pp 8 at a predicted MFU of 35.5%; the search keeps tp 1 pp 16 (41.9%).
"""

from transformers import MixtralConfig, MixtralForCausalLM

CONFIG = MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                       max_position_embeddings=32768)


def model() -> MixtralForCausalLM:
    return MixtralForCausalLM(CONFIG)
