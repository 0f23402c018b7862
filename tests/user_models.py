"""Tiny model files as a user writes them in plain PyTorch (issue #30): not standard transformer LMs, each with the
pattern it is named for. Width 8-32, two layers or stages, no dropout, so a program can be compared with one
process exactly. `write_user_model(dir, name)` writes USER[name] as DIR/user_NAME.py and returns its path."""

from __future__ import annotations

import textwrap
from pathlib import Path

HEAD = """
    import torch
    import torch.nn.functional as F
    from torch import nn
"""

USER = {
    # One block applied at every depth (ALBERT-like): the same parameters in every stage that runs it.
    "shared_depth": """
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(16, 32)
                self.fc2 = nn.Linear(32, 16)

            def forward(self, x):
                return x + self.fc2(F.gelu(self.fc1(x)))

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.inp = nn.Linear(8, 16)
                self.block = Block()
                self.head = nn.Linear(16, 4)

            def forward(self, x):
                x = self.inp(x)
                for _ in range(3):
                    x = self.block(x)
                return self.head(x)

        def model():
            return Net()

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 8),)
    """,
    # A small U-Net: convolutions, down- and up-sampling, a skip connection by concatenation.
    "unet": """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.down1 = nn.Conv2d(3, 8, 3, padding=1)
                self.down2 = nn.Conv2d(8, 16, 3, padding=1)
                self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
                self.out = nn.Conv2d(16, 4, 1)

            def forward(self, x):
                a = F.relu(self.down1(x))
                b = F.relu(self.down2(F.max_pool2d(a, 2)))
                u = self.up(b)
                return self.out(torch.cat([a, u], dim=1)).mean(dim=(2, 3))

        def model():
            return Net()

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 3, 8, 8),)
    """,
    # torch.utils.checkpoint in the user's own forward.
    "checkpoint": """
        from torch.utils.checkpoint import checkpoint

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(16, 32)
                self.fc2 = nn.Linear(32, 16)

            def forward(self, x):
                return x + self.fc2(F.gelu(self.fc1(x)))

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.inp = nn.Linear(8, 16)
                self.blocks = nn.ModuleList(Block() for _ in range(2))
                self.head = nn.Linear(16, 4)

            def forward(self, x):
                x = self.inp(x)
                for block in self.blocks:
                    x = checkpoint(block, x, use_reentrant=False)
                return self.head(x)

        def model():
            return Net()

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 8),)
    """,
    # A buffer written in forward: an exponential moving average of the features, under no_grad.
    "ema": """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(8, 16)
                self.fc2 = nn.Linear(16, 4)
                self.register_buffer("running", torch.zeros(16))

            def forward(self, x):
                h = F.relu(self.fc1(x))
                with torch.no_grad():
                    self.running.mul_(0.9).add_(0.1 * h.mean(dim=0))
                return self.fc2(h - self.running)

        def model():
            return Net()

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 8),)
    """,
    # The output projection shares the input embedding's weight.
    "tied": """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(32, 16)
                self.fc1 = nn.Linear(16, 16)
                self.fc2 = nn.Linear(16, 16)
                self.lm_head = nn.Linear(16, 32, bias=False)
                self.lm_head.weight = self.embed.weight

            def forward(self, ids):
                x = self.embed(ids)
                x = x + self.fc2(F.gelu(self.fc1(x)))
                return self.lm_head(x)

        def model():
            return Net()

        def example_inputs(batch_size):
            return (torch.randint(0, 32, (batch_size, 6)),)
    """,
    # Keyword inputs of two modalities, each with its own encoder, fused by a head.
    "two_modalities": """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.image = nn.Linear(12, 16)
                self.text = nn.Embedding(20, 16)
                self.fuse = nn.Linear(32, 16)
                self.head = nn.Linear(16, 4)

            def forward(self, image, tokens):
                a = F.relu(self.image(image))
                b = self.text(tokens).mean(dim=1)
                return self.head(F.relu(self.fuse(torch.cat([a, b], dim=-1))))

        def model():
            return Net()

        def example_inputs(batch_size):
            return {"image": torch.randn(batch_size, 12), "tokens": torch.randint(0, 20, (batch_size, 5))}
    """,
    # An explicit float attention mask (additive, -inf above the diagonal) passed to scaled_dot_product_attention.
    "float_mask": """
        class Attn(nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv = nn.Linear(16, 48)
                self.proj = nn.Linear(16, 16)

            def forward(self, x, mask):
                b, n, _ = x.shape
                q, k, v = self.qkv(x).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                return x + self.proj(y.transpose(1, 2).reshape(b, n, 16))

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(32, 16)
                self.layers = nn.ModuleList(Attn() for _ in range(2))
                self.head = nn.Linear(16, 32)

            def forward(self, ids, mask):
                x = self.embed(ids)
                for layer in self.layers:
                    x = layer(x, mask)
                return self.head(x)

        def model():
            return Net()

        def example_inputs(batch_size):
            mask = torch.full((6, 6), float("-inf")).triu(1).expand(batch_size, 1, 6, 6).contiguous()
            return (torch.randint(0, 32, (batch_size, 6)), mask)
    """,
    # A mixture of experts as plain PyTorch writes it: top-1 routing, a loop over experts with nonzero,
    # index_select and index_add_.
    "moe": """
        class Expert(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(16, 32)
                self.fc2 = nn.Linear(32, 16)

            def forward(self, x):
                return self.fc2(F.gelu(self.fc1(x)))

        class MoE(nn.Module):
            def __init__(self):
                super().__init__()
                self.router = nn.Linear(16, 4)
                self.experts = nn.ModuleList(Expert() for _ in range(4))

            def forward(self, x):
                flat = x.reshape(-1, 16)
                weight, choice = self.router(flat).softmax(-1).max(-1)
                out = torch.zeros_like(flat)
                for e, expert in enumerate(self.experts):
                    idx = torch.nonzero(choice == e).squeeze(-1)
                    y = expert(flat.index_select(0, idx)) * weight.index_select(0, idx).unsqueeze(-1)
                    out = out.index_add(0, idx, y)
                return x + out.reshape(x.shape)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(32, 16)
                self.moe = MoE()
                self.head = nn.Linear(16, 32)

            def forward(self, ids):
                return self.head(self.moe(self.embed(ids)))

        def model():
            return Net()

        def example_inputs(batch_size):
            return (torch.randint(0, 32, (batch_size, 6)),)
    """,
    # The same mixture of experts with fixed shapes, as the refusal of "moe" suggests: every expert runs on all
    # tokens, its output multiplied by its routing weight times the routing mask.
    "moe_dense": """
        class Expert(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(16, 32)
                self.fc2 = nn.Linear(32, 16)

            def forward(self, x):
                return self.fc2(F.gelu(self.fc1(x)))

        class MoE(nn.Module):
            def __init__(self):
                super().__init__()
                self.router = nn.Linear(16, 4)
                self.experts = nn.ModuleList(Expert() for _ in range(4))

            def forward(self, x):
                weight, choice = self.router(x).softmax(-1).max(-1)
                y = torch.zeros_like(x)
                for e, expert in enumerate(self.experts):
                    y = y + expert(x) * (weight * (choice == e)).unsqueeze(-1)
                return x + y

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(32, 16)
                self.moe = MoE()
                self.head = nn.Linear(16, 32)

            def forward(self, ids):
                return self.head(self.moe(self.embed(ids)))

        def model():
            return Net()

        def example_inputs(batch_size):
            return (torch.randint(0, 32, (batch_size, 6)),)
    """,
    # Python control flow on a tensor's value.
    "data_control": """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(8, 16)
                self.fc2 = nn.Linear(16, 4)

            def forward(self, x):
                h = self.fc1(x)
                if h.sum() > 0:
                    h = F.relu(h)
                return self.fc2(h)

        def model():
            return Net()

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 8),)
    """,
    # A ViT classifier: convolutional patches, a class token, pre-LN blocks.
    "vit": """
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.norm1 = nn.LayerNorm(16)
                self.qkv = nn.Linear(16, 48)
                self.proj = nn.Linear(16, 16)
                self.norm2 = nn.LayerNorm(16)
                self.fc1 = nn.Linear(16, 32)
                self.fc2 = nn.Linear(32, 16)

            def forward(self, x):
                b, n, _ = x.shape
                q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
                y = F.scaled_dot_product_attention(q, k, v)
                x = x + self.proj(y.transpose(1, 2).reshape(b, n, 16))
                return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.patch = nn.Conv2d(3, 16, 4, stride=4)
                self.cls = nn.Parameter(torch.randn(1, 1, 16) * 0.02)
                self.pos = nn.Parameter(torch.randn(1, 5, 16) * 0.02)
                self.blocks = nn.ModuleList(Block() for _ in range(2))
                self.norm = nn.LayerNorm(16)
                self.head = nn.Linear(16, 10)

            def forward(self, x):
                x = self.patch(x).flatten(2).transpose(1, 2)
                x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
                for block in self.blocks:
                    x = block(x)
                return self.head(self.norm(x)[:, 0])

        def model():
            return Net()

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 3, 8, 8),)
    """,
    # torch.no_grad() around part of forward whose result the rest uses (a fixed target computed without gradient).
    "no_grad": """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(8, 16)
                self.fc2 = nn.Linear(16, 16)
                self.fc3 = nn.Linear(16, 4)

            def forward(self, x):
                h = F.relu(self.fc1(x))
                with torch.no_grad():
                    scale = self.fc2(h).abs().mean(dim=-1, keepdim=True) + 1.0
                h = F.relu(self.fc2(h)) / scale
                return self.fc3(h)

        def model():
            return Net()

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 8),)
    """,
    # Grad-mode regions nested: an enable_grad region inside a no_grad one, whose result trains fc3.
    "nested_grad": """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(8, 16)
                self.fc2 = nn.Linear(16, 16)
                self.fc3 = nn.Linear(16, 16)
                self.head = nn.Linear(16, 4)

            def forward(self, x):
                h = F.relu(self.fc1(x))
                with torch.no_grad():
                    g = self.fc2(h).sigmoid()
                    with torch.enable_grad():
                        k = self.fc3(h)
                    g = g * 2.0
                return self.head(F.relu(self.fc2(h)) * g + k)

        def model():
            return Net()

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 8),)
    """,
    # An autocast region in forward.
    "autocast": """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(8, 16)
                self.fc2 = nn.Linear(16, 4)

            def forward(self, x):
                with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                    h = F.relu(self.fc1(x))
                return self.fc2(h.float())

        def model():
            return Net()

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 8),)
    """,
    # Boolean-mask selection of the rows a threshold keeps: a size that depends on values, but no routing over
    # groups to expect a share from.
    "masked_rows": """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(8, 16)
                self.fc2 = nn.Linear(16, 4)

            def forward(self, x):
                h = self.fc1(x)
                keep = h[h.sum(-1) > 0]
                return self.fc2(h) + self.fc2(keep).sum()

        def model():
            return Net()

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 8),)
    """,
    # torch.cond: both branches traced, one taken at run time by a tensor's value.
    "cond": """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(8, 16)
                self.fc2 = nn.Linear(16, 4)

            def forward(self, x):
                h = self.fc1(x)
                h = torch.cond(h.sum() > 0, lambda t: F.relu(t), lambda t: t * 0.5, (h,))
                return self.fc2(h)

        def model():
            return Net()

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 8),)
    """,
}


def write_user_model(directory: Path, name: str) -> str:
    path = Path(directory) / f"user_{name}.py"
    path.write_text(textwrap.dedent(HEAD) + textwrap.dedent(USER[name]))
    return str(path)
