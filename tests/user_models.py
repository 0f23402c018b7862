"""Tiny model files as a user writes them in plain PyTorch (issue #30): not standard transformer LMs, each with the
pattern it is named for. Width 8-32, two layers or stages, no dropout, so a program can be compared with one
process exactly. `write_user_model(dir, name)` writes USER[name] as DIR/user_NAME.py and returns its path.

Each entry states what is its own; `model_file` adds what every file has (``model()`` building ``Net``,
``example_inputs``), and the classes several files share are written once (`mlp`, `two_layer`, `moe`). The files
written stay whole, standalone Python, as a user writes them."""

from __future__ import annotations

import textwrap
from pathlib import Path

HEAD = """
    import torch
    import torch.nn.functional as F
    from torch import nn
"""

FEATURES = "(torch.randn(batch_size, 8),)"
"""The inputs of the models on 8 features."""
TOKENS = "(torch.randint(0, 32, (batch_size, 6)),)"
"""The inputs of the models on 6 tokens of a vocabulary of 32."""
IMAGES = "(torch.randn(batch_size, 3, 8, 8),)"
"""The inputs of the models on 8 x 8 RGB images."""
CLASSES = "torch.randint(0, 8, (batch_size,))"
"""Targets: one of 8 classes a sample."""
PLAIN = """
    import torch
    from torch import nn
"""


def _code(text: str, indent: str = "") -> str:
    return textwrap.indent(textwrap.dedent(text).strip("\n"), indent)


def model_file(*parts: str, inputs: str = FEATURES, targets: str | None = None) -> str:
    """A model file after its imports: `parts` (statements and classes, the model being ``Net``), ``model()``,
    ``example_inputs(batch_size)`` returning `inputs` (an expression; statements ending in ``return`` when it spans
    lines) and, with `targets` (an expression), ``example_targets(batch_size)``."""
    body = inputs if "\n" in inputs else f"return {inputs}"
    return ("\n" + "\n\n".join(_code(p) for p in parts) + "\n\ndef model():\n    return Net()\n\n"
            f"def example_inputs(batch_size):\n{_code(body, '    ')}\n"
            + (f"\ndef example_targets(batch_size):\n    return {targets}\n" if targets else ""))


def write_model(path: Path, *parts: str, inputs: str = FEATURES, targets: str | None = None,
                imports: str = PLAIN) -> Path:
    """Write the model file of `model_file` with `imports` at `path`; returns `path`."""
    path.write_text(textwrap.dedent(imports) + model_file(*parts, inputs=inputs, targets=targets))
    return path


def mlp(name: str = "Block", residual: bool = True) -> str:
    """A two-layer perceptron 16 -> 32 -> 16 with GELU: a residual block, or a mixture's expert."""
    return f"""
        class {name}(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(16, 32)
                self.fc2 = nn.Linear(32, 16)

            def forward(self, x):
                return {"x + " if residual else ""}self.fc2(F.gelu(self.fc1(x)))
    """


def two_layer(forward: str, extra: str = "") -> str:
    """``Net``: fc1 8 -> 16 and fc2 16 -> 4 (then the `extra` statement of ``__init__``), with `forward`."""
    return ("class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.fc1 = nn.Linear(8, 16)\n        self.fc2 = nn.Linear(16, 4)\n"
            + (f"        {extra}\n" if extra else "") + "\n" + _code(forward, "    "))


def moe(forward: str) -> str:
    """A mixture of 4 experts (`mlp`) chosen by a linear router, its `forward` given, between an embedding of 32
    tokens and a head back to them."""
    router = _code("""
        class MoE(nn.Module):
            def __init__(self):
                super().__init__()
                self.router = nn.Linear(16, 4)
                self.experts = nn.ModuleList(Expert() for _ in range(4))
    """) + "\n\n" + _code(forward, "    ")
    net = """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(32, 16)
                self.moe = MoE()
                self.head = nn.Linear(16, 32)

            def forward(self, ids):
                return self.head(self.moe(self.embed(ids)))
    """
    return "\n\n".join(_code(p) for p in (mlp("Expert", residual=False), router, net))


USER = {
    # One block applied at every depth (ALBERT-like): the same parameters in every stage that runs it.
    "shared_depth": model_file(mlp(), """
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
    """),
    # A small U-Net: convolutions, down- and up-sampling, a skip connection by concatenation.
    "unet": model_file("""
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
    """, inputs=IMAGES),
    # torch.utils.checkpoint in the user's own forward.
    "checkpoint": model_file("from torch.utils.checkpoint import checkpoint", mlp(), """
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
    """),
    # A buffer written in forward: an exponential moving average of the features, under no_grad.
    "ema": model_file(two_layer("""
        def forward(self, x):
            h = F.relu(self.fc1(x))
            with torch.no_grad():
                self.running.mul_(0.9).add_(0.1 * h.mean(dim=0))
            return self.fc2(h - self.running)
    """, extra='self.register_buffer("running", torch.zeros(16))')),
    # The output projection shares the input embedding's weight.
    "tied": model_file("""
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
    """, inputs=TOKENS),
    # Keyword inputs of two modalities, each with its own encoder, fused by a head.
    "two_modalities": model_file("""
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
    """, inputs='{"image": torch.randn(batch_size, 12), "tokens": torch.randint(0, 20, (batch_size, 5))}'),
    # An explicit float attention mask (additive, -inf above the diagonal) passed to scaled_dot_product_attention.
    "float_mask": model_file("""
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
    """, inputs="""
        mask = torch.full((6, 6), float("-inf")).triu(1).expand(batch_size, 1, 6, 6).contiguous()
        return (torch.randint(0, 32, (batch_size, 6)), mask)
    """),
    # A mixture of experts as plain PyTorch writes it: top-1 routing, a loop over experts with nonzero,
    # index_select and index_add_.
    "moe": model_file(moe("""
        def forward(self, x):
            flat = x.reshape(-1, 16)
            weight, choice = self.router(flat).softmax(-1).max(-1)
            out = torch.zeros_like(flat)
            for e, expert in enumerate(self.experts):
                idx = torch.nonzero(choice == e).squeeze(-1)
                y = expert(flat.index_select(0, idx)) * weight.index_select(0, idx).unsqueeze(-1)
                out = out.index_add(0, idx, y)
            return x + out.reshape(x.shape)
    """), inputs=TOKENS),
    # The same mixture of experts with fixed shapes, as the refusal of "moe" suggests: every expert runs on all
    # tokens, its output multiplied by its routing weight times the routing mask.
    "moe_dense": model_file(moe("""
        def forward(self, x):
            weight, choice = self.router(x).softmax(-1).max(-1)
            y = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                y = y + expert(x) * (weight * (choice == e)).unsqueeze(-1)
            return x + y
    """), inputs=TOKENS),
    # Python control flow on a tensor's value.
    "data_control": model_file(two_layer("""
        def forward(self, x):
            h = self.fc1(x)
            if h.sum() > 0:
                h = F.relu(h)
            return self.fc2(h)
    """)),
    # A ViT classifier: convolutional patches, a class token, pre-LN blocks.
    "vit": model_file("""
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
    """, inputs=IMAGES),
    # torch.no_grad() around part of forward whose result the rest uses (a fixed target computed without gradient).
    "no_grad": model_file("""
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
    """),
    # Grad-mode regions nested: an enable_grad region inside a no_grad one, whose result trains fc3.
    "nested_grad": model_file("""
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
    """),
    # An autocast region in forward.
    "autocast": model_file(two_layer("""
        def forward(self, x):
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                h = F.relu(self.fc1(x))
            return self.fc2(h.float())
    """)),
    # Boolean-mask selection of the rows a threshold keeps: a size that depends on values, but no routing over
    # groups to expect a share from.
    "masked_rows": model_file(two_layer("""
        def forward(self, x):
            h = self.fc1(x)
            keep = h[h.sum(-1) > 0]
            return self.fc2(h) + self.fc2(keep).sum()
    """)),
    # torch.cond: both branches traced, one taken at run time by a tensor's value.
    "cond": model_file(two_layer("""
        def forward(self, x):
            h = self.fc1(x)
            h = torch.cond(h.sum() > 0, lambda t: F.relu(t), lambda t: t * 0.5, (h,))
            return self.fc2(h)
    """)),
}


def write_user_model(directory: Path, name: str) -> str:
    path = Path(directory) / f"user_{name}.py"
    path.write_text(textwrap.dedent(HEAD) + USER[name])
    return str(path)
