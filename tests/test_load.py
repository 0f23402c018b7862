"""Loading model files: the contract of partc/model_file.py and one clear line for every mistake."""

import sys
import textwrap

import pytest
import torch

from partc.errors import PartcError
from partc.hf_model import DEFAULT_MAX_SEQ_LEN
from partc.model_file import build_on_meta, load_model_file

PLAIN = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, ids):
        return self.head(self.emb(ids))

def model():
    return Net()

def example_inputs(batch_size):
    return (torch.randint(0, 16, (batch_size, 5)),)
"""

TINY_GPT2 = """
from transformers import GPT2Config, GPT2LMHeadModel

def model():
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)
"""


def write(directory, text, name="model.py"):
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def error(path, **kwargs) -> str:
    """The message of the PartcError that loading `path` raises; it must be one line."""
    with pytest.raises(PartcError) as info:
        load_model_file(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------------------------------------
# Good files


def test_plain_model(tmp_path):
    spec = load_model_file(write(tmp_path, PLAIN))
    assert spec.name == "model" and spec.path == str(tmp_path / "model.py")
    assert spec.seq_len == 5
    m = build_on_meta(spec)
    assert all(p.is_meta for p in m.parameters())
    with torch.device("meta"):
        args, kwargs = spec.inputs(3)
    assert kwargs == {} and args[0].shape == (3, 5) and args[0].is_meta

    # defaults: targets from a meta forward (logits [b, 5, 16]), cross-entropy loss, on the ambient device
    torch.manual_seed(0)
    real = spec.build()
    args, kwargs = spec.inputs(3)
    targets = spec.targets(3)
    assert targets.shape == (3, 5) and targets.dtype == torch.long and not targets.is_meta
    assert 0 <= targets.min() and targets.max() < 16
    loss = spec.loss_fn(real(*args, **kwargs), targets)
    loss.backward()
    assert loss.dim() == 0 and real.head.weight.grad is not None


def test_dict_inputs_with_scalars_and_own_targets_and_loss(tmp_path):
    path = write(tmp_path, """
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 2)

            def forward(self, x, mask=None, scale=1.0):
                return {"out": self.lin(x) * scale}

        def model():
            return Net()

        def example_inputs(batch_size):
            return {"x": torch.randn(batch_size, 4), "scale": 2.0}

        def example_targets(batch_size):
            return torch.zeros(batch_size, 2)

        def loss_fn(outputs, targets):
            return ((outputs["out"] - targets) ** 2).mean()
    """)
    spec = load_model_file(path)
    assert spec.seq_len is None
    args, kwargs = spec.inputs(2)
    assert args == () and kwargs["x"].shape == (2, 4) and kwargs["scale"] == 2.0
    loss = spec.loss_fn(spec.build()(*args, **kwargs), spec.targets(2))
    assert loss.dim() == 0


def test_other_entry_name(tmp_path):
    path = write(tmp_path, PLAIN.replace("def model():", "def build_net():"))
    assert isinstance(load_model_file(path, entry="build_net").build(), torch.nn.Module)


def test_same_file_names_do_not_collide_and_sys_path_is_restored(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write(tmp_path / "a", "WIDTH = 3\n", name="sibling_a.py")
    write(tmp_path / "b", "WIDTH = 7\n", name="sibling_b.py")
    model_a = "from sibling_a import WIDTH\n" + PLAIN.replace("nn.Linear(8, 16)", "nn.Linear(8, WIDTH)")
    model_b = "from sibling_b import WIDTH\n" + PLAIN.replace("nn.Linear(8, 16)", "nn.Linear(8, WIDTH)")
    path_before = list(sys.path)
    spec_a = load_model_file(write(tmp_path / "a", model_a))
    spec_b = load_model_file(write(tmp_path / "b", model_b))
    assert sys.path == path_before
    assert spec_a.module is not spec_b.module
    assert build_on_meta(spec_a).head.out_features == 3
    assert build_on_meta(spec_b).head.out_features == 7


def test_hf_gpt2_default_inputs_targets_and_loss(tmp_path):
    pytest.importorskip("transformers")
    spec = load_model_file(write(tmp_path, TINY_GPT2))
    assert spec.seq_len == min(1024, DEFAULT_MAX_SEQ_LEN)  # GPT2Config's n_positions is 1024
    with torch.device("meta"):
        args, kwargs = spec.inputs(2)
        targets = spec.targets(2)
    assert args == () and kwargs["input_ids"].shape == (2, 1024) and kwargs["input_ids"].dtype == torch.long
    assert kwargs["use_cache"] is False
    assert targets.shape == (2, 1024)

    spec = load_model_file(write(tmp_path, TINY_GPT2), seq_len=16)
    assert spec.seq_len == 16
    m = spec.build()
    args, kwargs = spec.inputs(2)
    assert kwargs["input_ids"].shape == (2, 16) and kwargs["input_ids"].max() < 128
    outputs = m(*args, **kwargs)
    loss = spec.loss_fn(outputs, spec.targets(2))  # default loss reads outputs.logits
    loss.backward()
    assert loss.dim() == 0


def test_hf_vit_pixel_values(tmp_path):
    pytest.importorskip("transformers")
    spec = load_model_file(write(tmp_path, """
        from transformers import ViTConfig, ViTForImageClassification

        def model():
            return ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                       intermediate_size=64, image_size=16, patch_size=8,
                                                       num_labels=5))
    """))
    assert spec.seq_len is None
    with torch.device("meta"):
        args, kwargs = spec.inputs(2)
        targets = spec.targets(2)
    assert kwargs["pixel_values"].shape == (2, 3, 16, 16) and "use_cache" not in kwargs
    assert targets.shape == (2,)


# ---------------------------------------------------------------------------------------------------------------
# Errors


def test_missing_file(tmp_path):
    assert "does not exist" in error(str(tmp_path / "nope.py"))


def test_directory(tmp_path):
    assert "is a directory" in error(str(tmp_path))


def test_not_python(tmp_path):
    assert "not a Python file" in error(write(tmp_path, "x = 1", name="model.txt"))


def test_syntax_error_has_line_number(tmp_path):
    message = error(write(tmp_path, "import torch\n\ndef model(:\n    pass\n"))
    assert "model.py:3" in message and "syntax error" in message


def test_import_error_names_the_module(tmp_path):
    message = error(write(tmp_path, "import torch\nimport partc_no_such_module\n"))
    assert "'partc_no_such_module'" in message and "model.py:2" in message


def test_exception_at_import(tmp_path):
    message = error(write(tmp_path, "x = 1\nraise RuntimeError('boom')\n"))
    assert "model.py:2" in message and "RuntimeError: boom" in message


def test_missing_entry_lists_callables(tmp_path):
    path = write(tmp_path, PLAIN.replace("def model():", "def make():"))
    message = error(path)
    assert "no 'model'" in message and "Net" in message and "make" in message and "--entry" in message
    assert "no 'gpt'" in error(path, entry="gpt")


def test_entry_not_callable(tmp_path):
    assert "'model' is an int" in error(write(tmp_path, "model = 3\n"))


def test_model_raising_names_type_message_and_line(tmp_path):
    spec = load_model_file(write(tmp_path, PLAIN.replace("return Net()", "raise KeyError('layers')")))
    with pytest.raises(PartcError, match=r"model\.py:15: model\(\) raised KeyError: 'layers'"):
        build_on_meta(spec)


def test_model_raising_inside_torch_points_at_user_line(tmp_path):
    spec = load_model_file(write(tmp_path, PLAIN.replace("nn.Linear(8, 16)", "nn.Linear(8, 'x')")))
    with pytest.raises(PartcError, match=r"model\.py:9: model\(\) raised TypeError"):
        build_on_meta(spec)


def test_model_not_a_module(tmp_path):
    spec = load_model_file(write(tmp_path, PLAIN.replace("return Net()", "return {'net': 1}")))
    with pytest.raises(PartcError, match="returned dict, expected a torch.nn.Module"):
        build_on_meta(spec)


def test_missing_example_inputs(tmp_path):
    text = PLAIN[: PLAIN.index("def example_inputs")]
    assert "defines no example_inputs" in error(write(tmp_path, text))


@pytest.mark.parametrize("body, expected", [
    ("[torch.zeros(batch_size, 5, dtype=torch.long)]", "returned list, expected a tuple"),
    ("torch.zeros(batch_size, 5, dtype=torch.long)", "return (x,)"),
    ("(torch.zeros(batch_size, 5, dtype=torch.long), [1, 2])", "input item 1 is list"),
    ("{'ids': torch.zeros(4, 5, dtype=torch.long)}", "input 'ids' has shape (4, 5)"),
    ("(1, 2)", "returned no tensors"),
])
def test_bad_example_inputs(tmp_path, body, expected):
    text = PLAIN.replace("return (torch.randint(0, 16, (batch_size, 5)),)", f"return {body}")
    assert expected in error(write(tmp_path, text))


def test_example_inputs_raising(tmp_path):
    text = PLAIN.replace("return (torch.randint(0, 16, (batch_size, 5)),)", "return 1 / 0")
    assert "model.py:18: example_inputs(1) raised ZeroDivisionError" in error(write(tmp_path, text))


def test_seq_len_with_own_example_inputs(tmp_path):
    assert "--seq-len applies only" in error(write(tmp_path, PLAIN), seq_len=8)


def test_targets_that_cannot_be_inferred_fail_only_when_asked(tmp_path):
    spec = load_model_file(write(tmp_path, PLAIN.replace("return self.head(self.emb(ids))",
                                                         "return {'hidden': self.emb(ids)}")))
    with pytest.raises(PartcError, match="define example_targets"):
        spec.targets(2)


def test_hf_inputs_that_cannot_be_synthesized(tmp_path):
    pytest.importorskip("transformers")
    text = TINY_GPT2.replace("    return GPT2LMHeadModel(config)",
                             "    m = GPT2LMHeadModel(config)\n    m.main_input_name = 'input_features'\n    return m")
    message = error(write(tmp_path, text))
    assert "cannot synthesize inputs for GPT2LMHeadModel" in message and "'input_features'" in message
    assert "define example_inputs" in message


def test_hf_seq_len_beyond_positions(tmp_path):
    pytest.importorskip("transformers")
    assert "exceeds the 1024 positions" in error(write(tmp_path, TINY_GPT2), seq_len=4096)
