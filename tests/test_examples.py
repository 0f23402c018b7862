"""The bundled model files in examples/ load, build on meta and train one step on the CPU at tiny size."""

import pytest
import torch

from helpers import EXAMPLES
from partc.errors import PartcError
from partc.model_file import build_on_meta, load_model_file


@pytest.mark.parametrize("name", ["gpt", "llama", "hf_gpt2"])
def test_tiny_example_trains_on_cpu(name):
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    spec = load_model_file(str(EXAMPLES / f"{name}.py"))
    assert spec.seq_len in (64, 128)
    torch.manual_seed(0)
    model = spec.build()
    args, kwargs = spec.inputs(2)
    loss = spec.loss_fn(model(*args, **kwargs), spec.targets(2))
    loss.backward()
    vocab = 512
    assert abs(loss.item() - torch.log(torch.tensor(vocab)).item()) < 0.5  # random init: about ln V
    assert all(p.grad is not None for p in model.parameters())


def test_vit_example_trains_on_cpu_and_is_vit_l16_at_full_size(monkeypatch):
    """examples/vit.py: an image model without targets or loss in the file (partc's class indices and
    cross-entropy); at ``vit-l16`` it has ViT-L/16's 304M parameters."""
    spec = load_model_file(str(EXAMPLES / "vit.py"))
    assert spec.seq_len is None
    torch.manual_seed(0)
    model = spec.build()
    args, kwargs = spec.inputs(2)
    loss = spec.loss_fn(model(*args, **kwargs), spec.targets(2))
    loss.backward()
    assert spec.targets(2).shape == (2,) and 0 < loss.item() < 2 * torch.log(torch.tensor(10.0)).item()  # 10 classes
    assert all(p.grad is not None for p in model.parameters())
    monkeypatch.setenv("PARTC_VIT_SIZE", "vit-l16")
    model = build_on_meta(load_model_file(str(EXAMPLES / "vit.py")))
    assert round(sum(p.numel() for p in model.parameters()) / 1e6) == 304


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_meta_build_and_init_weights(name):
    spec = load_model_file(str(EXAMPLES / f"{name}.py"))
    model = build_on_meta(spec)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_gpt_module_names():
    names = {n for n, _ in build_on_meta(load_model_file(str(EXAMPLES / "gpt.py"))).named_modules()}
    assert {"tok", "pos", "blocks", "ln_f", "lm_head", "blocks.3.ln_1", "blocks.3.attn.qkv", "blocks.3.attn.proj",
            "blocks.3.ln_2", "blocks.3.mlp.fc1", "blocks.3.mlp.fc2"} <= names


def test_gpt_sizes_match_megatron_parameter_counts(monkeypatch):
    """Megatron-LM (Narayanan et al. 2021): P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)); our model also has the
    final LayerNorm (2h)."""
    for size in ("1.7b", "39.1b", "1008b"):
        monkeypatch.setenv("PARTC_GPT_SIZE", size)
        spec = load_model_file(str(EXAMPLES / "gpt.py"))
        c = spec.module.SIZES[size]
        model = build_on_meta(spec)
        l, h, V, s = c.layers, c.hidden, c.vocab_size, c.seq_len
        expected = 12 * l * h * h + 13 * l * h + (V + s) * h + 2 * h
        assert sum(p.numel() for p in model.parameters()) == expected
        assert round(expected / 1e9, 1) == float(size.removesuffix("b"))


def test_gpt3_175b_on_meta():
    spec = load_model_file(str(EXAMPLES / "gpt3_175b.py"))
    assert spec.seq_len == 2048
    model = build_on_meta(spec)
    assert len(model.blocks) == 96 and model.config.hidden == 12288
    assert 174e9 < sum(p.numel() for p in model.parameters()) < 176e9
    with torch.device("meta"):
        (ids,), _ = spec.inputs(8)
        assert ids.shape == (8, 2048) and spec.targets(8).shape == (8, 2048)


def test_unknown_size_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PARTC_GPT_SIZE", "huge")
    with pytest.raises(PartcError, match="PARTC_GPT_SIZE='huge' is not one of tiny, tiny-deep, 1.7b"):
        load_model_file(str(EXAMPLES / "gpt.py"))  # load calls example_inputs(1) on meta


# The units partc's tracer must find: the leading modules, the repeated blocks, the trailing modules.
UNITS = {"gpt": (["tok", "pos"], "blocks", ["ln_f", "lm_head"]),
         "llama": (["tok"], "blocks", ["norm", "lm_head"]),
         "hf_gpt2": (["transformer.wte", "transformer.wpe"], "transformer.h", ["transformer.ln_f", "lm_head"])}


@pytest.mark.parametrize("name", list(UNITS))
def test_traces_on_meta(name, traced_example):
    """partc's trace of each example (export on meta, one sample): the expected units in execution order, every
    parameter counted once, and nothing materialized."""
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    _, traced = traced_example(name)
    graph, model = traced.graph, traced.model
    first, blocks, last = UNITS[name]
    num_blocks = len(model.get_submodule(blocks))
    names = [u.fqn for u in graph.units]
    assert set(names[:len(first)]) == set(first)  # embeddings run before the first block, in either order
    assert names[len(first):] == [f"{blocks}.{i}" for i in range(num_blocks)] + last
    assert [u.kind for u in graph.units if u.fqn.startswith(blocks + ".")] == ["block"] * num_blocks
    assert graph.first_unit_required == names[:len(first)] and graph.last_unit_required == last
    assert graph.num_params == sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())


def test_gpt_tie_weights():
    gpt = load_model_file(str(EXAMPLES / "gpt.py")).module
    untied = gpt.GPT(gpt.GPTConfig())
    assert untied.lm_head.weight is not untied.tok.weight
    tied = gpt.GPT(gpt.GPTConfig(tie_weights=True))
    assert tied.lm_head.weight is tied.tok.weight
