"""Tiny model files of the families issue #14 found failing, built from their config classes (no downloads):
two layers (or stages), hidden size 32-64, dropout off, so a program can be compared with one process exactly.
`write_zoo_model(dir, name)` writes ZOO[name] as DIR/zoo_NAME.py and returns its path."""

from __future__ import annotations

import textwrap
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

ZOO = {
    "roberta": """
        from transformers import RobertaConfig, RobertaForMaskedLM

        def model():
            return RobertaForMaskedLM(RobertaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                                                    num_attention_heads=4, intermediate_size=128,
                                                    max_position_embeddings=130, hidden_dropout_prob=0.0,
                                                    attention_probs_dropout_prob=0.0))
    """,
    "opt": """
        from transformers import OPTConfig, OPTForCausalLM

        def model():
            return OPTForCausalLM(OPTConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                                            num_attention_heads=4, max_position_embeddings=128,
                                            word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0,
                                            layerdrop=0.0))
    """,
    "swin": """
        from transformers import SwinConfig, SwinForImageClassification

        def model():
            return SwinForImageClassification(SwinConfig(image_size=32, patch_size=4, num_channels=3, embed_dim=16,
                                                         depths=[1, 1], num_heads=[2, 4], window_size=4,
                                                         num_labels=10, hidden_dropout_prob=0.0,
                                                         attention_probs_dropout_prob=0.0, drop_path_rate=0.0))
    """,
    "clip": """
        from transformers import CLIPConfig, CLIPForImageClassification, CLIPVisionConfig

        def model():
            vision = CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, attention_dropout=0.0)
            return CLIPForImageClassification(CLIPConfig(vision_config=vision.to_dict(), num_labels=10))
    """,
    "falcon": """
        from transformers import FalconConfig, FalconForCausalLM

        def model():  # indexes the fused qkv with a list: a tensor constant made on the meta device
            return FalconForCausalLM(FalconConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, num_kv_heads=1, multi_query=True,
                                                  new_decoder_architecture=False, parallel_attn=True, bias=False,
                                                  alibi=False, max_position_embeddings=128, hidden_dropout=0.0,
                                                  attention_dropout=0.0))
    """,
    "deberta": """
        from transformers import DebertaV2Config, DebertaV2ForMaskedLM

        def model():  # torch.tensor(...) of sizes and scales in forward: constants with values
            return DebertaV2ForMaskedLM(DebertaV2Config(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                                                        num_attention_heads=4, intermediate_size=128,
                                                        max_position_embeddings=128, relative_attention=True,
                                                        position_buckets=32, max_relative_positions=64,
                                                        pos_att_type=["p2c", "c2p"], hidden_dropout_prob=0.0,
                                                        attention_probs_dropout_prob=0.0))
    """,
    "whisper": """
        import torch
        from transformers import WhisperConfig, WhisperForConditionalGeneration

        def model():
            return WhisperForConditionalGeneration(WhisperConfig(
                vocab_size=512, num_mel_bins=16, encoder_layers=2, decoder_layers=2, d_model=64,
                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                max_source_positions=16, max_target_positions=32, dropout=0.0, attention_dropout=0.0,
                activation_dropout=0.0, pad_token_id=0, decoder_start_token_id=1, eos_token_id=2, bos_token_id=1))

        def example_inputs(batch_size):  # 32 mel frames (16 positions after the stride-2 conv), 8 tokens
            return {"input_features": torch.randn(batch_size, 16, 32),
                    "decoder_input_ids": torch.randint(0, 512, (batch_size, 8)), "use_cache": False}

        def example_targets(batch_size):
            return torch.randint(0, 512, (batch_size, 8))
    """,
    "resnet": """
        from transformers import ResNetConfig, ResNetForImageClassification

        def model():  # 8 x 8 images: the last stage's maps are 1 x 1 (one value per channel in a sample)
            return ResNetForImageClassification(ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32],
                                                             depths=[1, 1], layer_type="basic", num_labels=10,
                                                             image_size=8))
    """,
    "phi3": """
        from transformers import Phi3Config, Phi3ForCausalLM

        def model():  # q, k and v of one size: qkv[..., :h], qkv[..., h:2h], qkv[..., 2h:]
            return Phi3ForCausalLM(Phi3Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                              max_position_embeddings=128, pad_token_id=0, resid_pdrop=0.0,
                                              embd_pdrop=0.0, attention_dropout=0.0))
    """,
    "phi3_gqa": """
        from transformers import Phi3Config, Phi3ForCausalLM

        def model():  # 4 query heads, 2 KV heads: slices of different sizes
            return Phi3ForCausalLM(Phi3Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=128, pad_token_id=0, resid_pdrop=0.0,
                                              embd_pdrop=0.0, attention_dropout=0.0))
    """,
    "fused_slices": """
        import torch
        from torch import nn

        class Net(nn.Module):  # a fused projection sliced in 2 (narrow) and in 3 places, read whole too
            def __init__(self):
                super().__init__()
                self.up = nn.Linear(16, 48)
                self.mix = nn.Linear(16, 48)
                self.down = nn.Linear(16, 16)
                self.out = nn.Linear(48, 4)

            def forward(self, x):
                a = self.up(x)
                h = a[..., :16] * torch.sigmoid(a[..., 16:32]) + a[..., -16:]
                m = self.mix(torch.relu(self.down(h)))
                m = m.narrow(-1, 0, 24) * m.narrow(-1, 24, 24)
                return self.out(torch.cat([m, m], -1) + a.softmax(-1))

        def model():
            return Net()

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 16),)
    """,
    "timm_vit": (EXAMPLES / "vit.py").read_text(),  # timm's qkv viewed as (3, heads, head_dim); tiny by default
    "mha": """
        import torch
        from torch import nn

        class Block(nn.Module):
            def __init__(self, dim=64, heads=4):
                super().__init__()
                self.norm = nn.LayerNorm(dim)
                self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)  # packed in_proj_weight
                self.fc1 = nn.Linear(dim, 4 * dim)
                self.fc2 = nn.Linear(4 * dim, dim)

            def forward(self, x):
                h = self.norm(x)
                x = x + self.attn(h, h, h, need_weights=False)[0]
                return x + self.fc2(torch.relu(self.fc1(x)))

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList([Block(), Block()])
                self.head = nn.Linear(64, 10)

            def forward(self, x):
                for b in self.blocks:
                    x = b(x)
                return self.head(x)

        def model():
            return Net()

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 16, 64),)
    """,
}
"""Model files; those that define only ``model()`` get inputs partc synthesizes."""


def write_zoo_model(directory: Path, name: str) -> str:
    path = Path(directory) / f"zoo_{name}.py"
    path.write_text(textwrap.dedent(ZOO[name]))
    return str(path)
