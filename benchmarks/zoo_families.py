"""The model families of `zoo.py`: for each, the model file at its published size and a tiny one of the same code.

A Hugging Face family is built from its config class (nothing downloaded; partc builds it on the meta device); a
plain-torch family from a template filled with its sizes. The tiny files have 2 layers or stages, hidden size 32-64
and dropout off, so a program can be compared with one process exactly.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(kw_only=True, slots=True)
class Family:
    """One model family: how to write its model file at full size and tiny."""

    name: str
    """Short name (``--families``)."""
    size: str
    """The published configuration the full-size file reproduces, e.g. ``Falcon-7B``."""
    full: str
    """Source of the full-size model file."""
    tiny: str
    """Source of the tiny model file (same code, 2 layers, hidden 32-64, dropout off)."""
    gpus: int = 8
    """GPUs of the full-size compile."""
    tokens: bool = True
    """A Hugging Face token model whose inputs partc synthesizes: the tiny runs pass ``seq_len``."""
    full_env: dict = field(default_factory=dict)
    """Environment of the full-size compile (a bundled example's size: ``PARTC_VIT_SIZE``)."""


def hf(config: str, model: str, kwargs: dict, extra: str = "") -> str:
    """A model file building Hugging Face's `model` from `config`(**kwargs); `extra` is appended (example inputs)."""
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return (f"import torch\nfrom transformers import {config}, {model}\n\n\n"
            f"def model():\n    return {model}({config}({args}))\n" + textwrap.dedent(extra))


NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}

WHISPER_INPUTS = """

    def example_inputs(batch_size):  # {frames} mel frames, {tokens} decoder tokens
        return {{"input_features": torch.randn(batch_size, {mels}, {frames}),
                "decoder_input_ids": torch.randint(0, {vocab}, (batch_size, {tokens})), "use_cache": False}}


    def example_targets(batch_size):
        return torch.randint(0, {vocab}, (batch_size, {tokens}))
"""

VIT = (Path(__file__).resolve().parent.parent / "examples" / "vit.py").read_text()
"""timm's Vision Transformer (the bundled example; `PARTC_VIT_SIZE` picks its size, tiny by default)."""

TORCH_ENCODER = """
    import torch
    from torch import nn

    VOCAB, SEQ, DIM, HEADS, FFN, LAYERS = {sizes!r}


    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.pos = nn.Parameter(torch.randn(1, SEQ, DIM) * 0.02)
            layer = nn.TransformerEncoderLayer(DIM, HEADS, FFN, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.head = nn.Linear(DIM, VOCAB)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens) + self.pos))


    def model():
        return Encoder()


    def example_inputs(batch_size):
        return (torch.randint(0, VOCAB, (batch_size, SEQ)),)
"""

MLP = """
    import torch
    from torch import nn

    DIM, HIDDEN, BLOCKS, CLASSES = {sizes!r}


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(DIM, HIDDEN)
            self.fc2 = nn.Linear(HIDDEN, DIM)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x)))


    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
            self.head = nn.Linear(DIM, CLASSES)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)


    def model():
        return MLP()


    def example_inputs(batch_size):
        return (torch.randn(batch_size, DIM),)
"""


def plain(template: str, sizes: tuple) -> str:
    return textwrap.dedent(template).format(sizes=sizes).lstrip()


TINY_LM = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}

FAMILIES = [
    Family(name="llama3", size="LLaMA-3 8B", full=hf("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False)),
        tiny=hf("LlamaConfig", "LlamaForCausalLM", TINY_LM)),
    Family(name="mistral", size="Mistral-7B v0.1", full=hf("MistralConfig", "MistralForCausalLM", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=32768, rope_theta=10000.0, sliding_window=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
        tiny=hf("MistralConfig", "MistralForCausalLM", TINY_LM)),
    Family(name="qwen2", size="Qwen2-7B", full=hf("Qwen2Config", "Qwen2ForCausalLM", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6,
        use_sliding_window=False, tie_word_embeddings=False)),
        tiny=hf("Qwen2Config", "Qwen2ForCausalLM", TINY_LM)),
    Family(name="phi3", size="Phi-3-mini-4k", full=hf("Phi3Config", "Phi3ForCausalLM", dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
        sliding_window=2047, pad_token_id=32000, bos_token_id=1, eos_token_id=32000, tie_word_embeddings=False)),
        tiny=hf("Phi3Config", "Phi3ForCausalLM", {**TINY_LM, "num_key_value_heads": 4, "pad_token_id": 0,
                                                 "bos_token_id": 1, "eos_token_id": 2, "resid_pdrop": 0.0,
                                                 "embd_pdrop": 0.0, "attention_dropout": 0.0})),
    Family(name="gemma2", size="Gemma-2 9B", full=hf("Gemma2Config", "Gemma2ForCausalLM", dict(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, max_position_embeddings=8192, query_pre_attn_scalar=256,
        sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
        tiny=hf("Gemma2Config", "Gemma2ForCausalLM", {**TINY_LM, "head_dim": 16, "query_pre_attn_scalar": 16,
                                                     "sliding_window": 8})),
    Family(name="neox", size="GPT-NeoX (Pythia-6.9B)", full=hf("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        vocab_size=50432, hidden_size=4096, intermediate_size=16384, num_hidden_layers=32, num_attention_heads=32,
        rotary_pct=0.25, max_position_embeddings=2048, use_parallel_residual=True, tie_word_embeddings=False)),
        tiny=hf("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            rotary_pct=0.25, max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0))),
    Family(name="bloom", size="BLOOM-7B1", full=hf("BloomConfig", "BloomForCausalLM", dict(
        vocab_size=250880, hidden_size=4096, n_layer=30, n_head=32)),
        tiny=hf("BloomConfig", "BloomForCausalLM", dict(
            vocab_size=512, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0))),
    Family(name="falcon", size="Falcon-7B", full=hf("FalconConfig", "FalconForCausalLM", dict(
        vocab_size=65024, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71, multi_query=True,
        new_decoder_architecture=False, parallel_attn=True, bias=False, alibi=False, max_position_embeddings=2048)),
        tiny=hf("FalconConfig", "FalconForCausalLM", dict(
            vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=1,
            multi_query=True, new_decoder_architecture=False, parallel_attn=True, bias=False, alibi=False,
            max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0))),
    Family(name="opt", size="OPT-6.7B", full=hf("OPTConfig", "OPTForCausalLM", dict(
        vocab_size=50272, hidden_size=4096, num_hidden_layers=32, ffn_dim=16384, num_attention_heads=32,
        max_position_embeddings=2048, word_embed_proj_dim=4096, do_layer_norm_before=True)),
        tiny=hf("OPTConfig", "OPTForCausalLM", dict(
            vocab_size=512, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
            max_position_embeddings=128, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0,
            layerdrop=0.0))),
    Family(name="roberta", size="RoBERTa-large", full=hf("RobertaConfig", "RobertaForMaskedLM", dict(
        vocab_size=50265, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
        max_position_embeddings=514, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2)),
        tiny=hf("RobertaConfig", "RobertaForMaskedLM", dict(
            vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=130, **NO_DROPOUT))),
    Family(name="deberta", size="DeBERTa-v2-xlarge", full=hf("DebertaV2Config", "DebertaV2ForMaskedLM", dict(
        vocab_size=128100, hidden_size=1536, num_hidden_layers=24, num_attention_heads=24, intermediate_size=6144,
        max_position_embeddings=512, relative_attention=True, position_buckets=256, norm_rel_ebd="layer_norm",
        share_att_key=True, pos_att_type=["p2c", "c2p"], position_biased_input=False, type_vocab_size=0,
        max_relative_positions=-1, conv_kernel_size=3, conv_act="gelu")),
        tiny=hf("DebertaV2Config", "DebertaV2ForMaskedLM", dict(
            vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=128, relative_attention=True, position_buckets=32, max_relative_positions=64,
            pos_att_type=["p2c", "c2p"], **NO_DROPOUT))),
    Family(name="mixtral", size="Mixtral-8x7B", gpus=16, full=hf("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
        tiny=hf("MixtralConfig", "MixtralForCausalLM", {**TINY_LM, "num_local_experts": 4,
                                                       "num_experts_per_tok": 2})),
    Family(name="swin", size="Swin-B (224, window 7)", tokens=False, full=hf(
        "SwinConfig", "SwinForImageClassification", dict(
            image_size=224, patch_size=4, num_channels=3, embed_dim=128, depths=[2, 2, 18, 2],
            num_heads=[4, 8, 16, 32], window_size=7, num_labels=1000)),
        tiny=hf("SwinConfig", "SwinForImageClassification", dict(
            image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
            window_size=4, num_labels=10, drop_path_rate=0.0, **NO_DROPOUT))),
    Family(name="clip", size="CLIP ViT-L/14 (vision)", tokens=False, full=hf(
        "CLIPConfig", "CLIPForImageClassification", dict(
            vision_config=dict(image_size=224, patch_size=14, hidden_size=1024, intermediate_size=4096,
                               num_hidden_layers=24, num_attention_heads=16), num_labels=1000)),
        tiny=hf("CLIPConfig", "CLIPForImageClassification", dict(
            vision_config=dict(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, attention_dropout=0.0),
            num_labels=10))),
    Family(name="vit", size="ViT-L/16 (224)", tokens=False, full=hf("ViTConfig", "ViTForImageClassification", dict(
        image_size=224, patch_size=16, num_channels=3, hidden_size=1024, num_hidden_layers=24,
        num_attention_heads=16, intermediate_size=4096, num_labels=1000)),
        tiny=hf("ViTConfig", "ViTForImageClassification", dict(
            image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=128, num_labels=10, **NO_DROPOUT))),
    Family(name="whisper", size="Whisper-large-v3 (30 s, 448 tokens)", tokens=False, full=hf(
        "WhisperConfig", "WhisperForConditionalGeneration", dict(
            vocab_size=51866, num_mel_bins=128, encoder_layers=32, decoder_layers=32, d_model=1280,
            encoder_attention_heads=20, decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120,
            max_source_positions=1500, max_target_positions=448, pad_token_id=50256, bos_token_id=50257,
            eos_token_id=50257, decoder_start_token_id=50258),
        WHISPER_INPUTS.format(mels=128, frames=3000, vocab=51866, tokens=448)),
        tiny=hf("WhisperConfig", "WhisperForConditionalGeneration", dict(
            vocab_size=512, num_mel_bins=16, encoder_layers=2, decoder_layers=2, d_model=64,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
            max_source_positions=16, max_target_positions=32, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, pad_token_id=0, decoder_start_token_id=1, eos_token_id=2, bos_token_id=1),
            WHISPER_INPUTS.format(mels=16, frames=32, vocab=512, tokens=8))),
    Family(name="t5", size="T5 v1.1-XL", full=hf("T5Config", "T5ForConditionalGeneration", dict(
        vocab_size=32128, d_model=2048, d_kv=64, d_ff=5120, num_layers=24, num_decoder_layers=24, num_heads=32,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0)),
        tiny=hf("T5Config", "T5ForConditionalGeneration", dict(
            vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
            feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0))),
    Family(name="bart", size="BART-large", full=hf("BartConfig", "BartForConditionalGeneration", dict(
        vocab_size=50265, d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
        decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, max_position_embeddings=1024)),
        tiny=hf("BartConfig", "BartForConditionalGeneration", dict(
            vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))),
    # ResNet's config has no image size; the file sets one (partc's synthesized pixel_values read it). The tiny one
    # is 32 x 32, so that a micro-batch of one sample still gives BatchNorm more than one value per channel.
    Family(name="resnet", size="ResNet-50 (224)", tokens=False, full=hf(
        "ResNetConfig", "ResNetForImageClassification", dict(
            num_channels=3, embedding_size=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 4, 6, 3],
            layer_type="bottleneck", num_labels=1000, image_size=224)),
        tiny=hf("ResNetConfig", "ResNetForImageClassification", dict(
            num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
            num_labels=10, image_size=32))),
    Family(name="timm_vit", size="timm-style ViT-L/16 (224)", tokens=False,  # examples/vit.py, tiny by default
           full=VIT, tiny=VIT, full_env={"PARTC_VIT_SIZE": "vit-l16"}),
    Family(name="torch_encoder", size="nn.TransformerEncoder (24 x d 1024, 1024 tokens)", tokens=False,
           full=plain(TORCH_ENCODER, (32000, 1024, 1024, 16, 4096, 24)),
           tiny=plain(TORCH_ENCODER, (512, 16, 64, 4, 128, 2))),
    Family(name="mlp", size="MLP (16 x 4096 -> 16384 -> 4096)", tokens=False,
           full=plain(MLP, (4096, 16384, 16, 1000)),
           tiny=plain(MLP, (32, 64, 2, 10))),
]
BY_NAME = {f.name: f for f in FAMILIES}
