"""Tracing on meta and the layer graph (passes/trace.py, passes/shard.py) on small real models.

The numbers are checked against the models themselves (parameter counts from ``model.parameters()``) and against
the formulas of Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", section 5.1): per transformer block and sample, forward GEMM FLOPs 24·s·h² + 4·s²·h, the LM head
2·s·h·V.
"""

import json
import textwrap

import pytest
import torch

from helpers import BRANCHY, EXAMPLES, trace_file, write_hf_model
from partc.compile import compile_model
from partc.errors import PartcError
from partc.ir import ACTIVATION_BYTES
from partc.model_file import build_on_meta
from user_models import write_model

BLOCK_LAYERS = ["ln_1", "attn.qkv", "attn.proj", "ln_2", "mlp.fc1", "mlp.fc2"]


@pytest.fixture(scope="module")
def gpt(traced_example):
    """The tiny examples/gpt.py (h 64, 4 heads, 4 blocks, s 64, V 512, untied), its config and its graph."""
    spec, traced = traced_example("gpt")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PARTC_GPT_SIZE", raising=False)
        torch.manual_seed(0)
        real = spec.build()  # on the CPU: the reference for parameter counts
        return spec.module.config(), traced.graph, real


@pytest.fixture(scope="module")
def llama(traced_example):
    spec, traced = traced_example("llama")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PARTC_LLAMA_SIZE", raising=False)
        return spec.module.config(), traced.graph


# ---------------------------------------------------------------------------------------------------------------
# examples/gpt.py, tiny


def test_gpt_units_in_execution_order(gpt):
    cfg, graph, _ = gpt
    names = [u.fqn for u in graph.units]
    # tok(ids) + pos(positions): both embeddings run before the first block, in either order
    assert set(names[:2]) == {"tok", "pos"}
    assert names[2:] == [f"blocks.{i}" for i in range(cfg.layers)] + ["ln_f", "lm_head"]
    assert [u.kind for u in graph.units] == ["module"] * 2 + ["block"] * cfg.layers + ["module"] * 2
    assert set(graph.first_unit_required) == {"tok", "pos"}
    assert graph.last_unit_required == ["ln_f", "lm_head"]
    # units of one structure share a signature (the TP solver decides once for all blocks)
    assert len({u.signature for u in graph.units if u.kind == "block"}) == 1


def test_gpt_layers_kinds_and_owners(gpt):
    cfg, graph, _ = gpt
    block = [f"blocks.2.{m}" for m in BLOCK_LAYERS]
    assert graph.unit("blocks.2").layers == block  # execution order inside the block
    kinds = {m: graph.layers[m].kind for m in ["tok", "pos", "ln_f", "lm_head", *block]}
    assert kinds == {"tok": "embedding", "pos": "embedding", "ln_f": "norm", "lm_head": "linear",
                     "blocks.2.ln_1": "norm", "blocks.2.attn.qkv": "linear", "blocks.2.attn.proj": "linear",
                     "blocks.2.ln_2": "norm", "blocks.2.mlp.fc1": "linear", "blocks.2.mlp.fc2": "linear"}
    assert graph.layers["blocks.2.attn.qkv"].type == "Linear" and graph.layers["ln_f"].type == "LayerNorm"
    assert all(graph.layers[m].unit == "blocks.2" for m in block)
    qkv = graph.layers["blocks.0.attn.qkv"]
    assert (qkv.in_features, qkv.out_features) == (cfg.hidden, 3 * cfg.hidden)
    tok = graph.layers["tok"]
    assert (tok.out_features, tok.in_features) == (cfg.vocab_size, cfg.hidden)  # vocabulary, embedding dim
    assert graph.info["vocab_size"] == cfg.vocab_size and graph.info["hidden_size"] == cfg.hidden
    assert graph.info["num_blocks"] == cfg.layers


def test_gpt_parameter_counts_match_the_model(gpt):
    _, graph, real = gpt
    assert graph.num_params == sum(p.numel() for p in real.parameters())
    for unit in graph.units:
        prefix = unit.fqn + "."
        expected = sum(p.numel() for n, p in real.named_parameters() if n.startswith(prefix) or n == unit.fqn)
        assert unit.num_params == expected, unit.fqn
    for name, layer in graph.layers.items():
        module = real.get_submodule(name)
        assert layer.num_params == sum(p.numel() for p in module.parameters(recurse=False)), name
        assert layer.params == {f"{name}.{k}": tuple(p.shape) for k, p in module.named_parameters(recurse=False)}
    assert graph.tied == {}


def test_gpt_forward_flops_are_megatrons(gpt):
    cfg, graph, _ = gpt
    s, h, V = cfg.seq_len, cfg.hidden, cfg.vocab_size
    block = 24 * s * h * h + 4 * s * s * h  # QKV 6sh², scores and context 4s²h, proj 2sh², MLP 16sh²
    for u in graph.units:
        if u.kind == "block":
            assert u.fwd_flops == block, u.fqn
            # the attention core (scores, context) is the part outside the layers
            assert sum(g.flops for g in u.core_gemms) == 4 * s * s * h
    assert graph.unit("lm_head").fwd_flops == 2 * s * h * V
    assert graph.unit("tok").fwd_flops == graph.unit("pos").fwd_flops == 0  # lookups, not GEMMs
    assert graph.layers["blocks.0.mlp.fc1"].fwd_flops == 8 * s * h * h
    assert graph.layers["blocks.0.attn.qkv"].fwd_flops == 6 * s * h * h
    # the whole forward per sample: Megatron's 24·l·s·h²·(1 + s/(6h) + V/(12·l·h)) (a third of its 72·B·l·s·h²·...)
    l = cfg.layers
    megatron = 24 * l * s * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    assert sum(u.fwd_flops for u in graph.units) == pytest.approx(megatron, rel=1e-12)


def test_gpt_saved_and_cut_bytes(gpt):
    cfg, graph, _ = gpt
    s, h, a = cfg.seq_len, cfg.hidden, cfg.heads
    act = s * h * ACTIVATION_BYTES  # one [s, h] activation in 16-bit
    for u in graph.units:
        if u.kind != "block":
            continue
        # At least the inputs of the four GEMMs (h, h, h, 4h wide) and the attention probabilities (a·s²), at
        # most Korthikanti et al.'s s·h·(34 + 5·a·s/h) bytes per sample (which also counts dropout masks).
        assert u.saved_bytes >= 7 * act + a * s * s * ACTIVATION_BYTES
        assert u.saved_bytes <= s * h * (34 + 5 * a * s / h)
        assert 0 < u.saved_bytes_core <= u.saved_bytes
        assert 0 < u.saved_bytes_replicated < u.saved_bytes
        assert u.input_bytes >= act  # the residual stream entering the block
    # a boundary after unit i carries what later units read: the residual stream between blocks
    names = [u.fqn for u in graph.units]
    assert len(graph.cut_bytes) == len(names) - 1
    assert all(c > 0 for c in graph.cut_bytes)
    for i in range(names.index("blocks.0"), names.index(f"blocks.{cfg.layers - 1}")):
        assert graph.cut_bytes[i] == act, names[i]
    assert graph.cut_bytes[names.index("ln_f")] == act  # normalized hidden states into the head
    # both embeddings' outputs into blocks.0: the tokens' per sample, the positions' (1 x s x h, the same for every
    # sample, broadcast in the add) once a micro-batch, with its gradient
    assert graph.cut_bytes[1] == act and graph.cut_fixed_bytes[1] == graph.cut_grad_fixed_bytes[1] == act
    assert sum(graph.cut_fixed_bytes) == act


def test_what_does_not_carry_the_batch_crosses_once(tmp_path):
    """Hugging Face LLaMA's rotary tables (cos, sin: 1 x s x head_dim, from the positions, no gradient) cross every
    boundary between blocks once a micro-batch, s/cp positions of them under context parallelism; the hidden
    states per sample (its causal mask, proven causal, is gone: `partc.passes.causal_mask`)."""
    _, traced = trace_file(write_hf_model(tmp_path, "llama"), seq_len=32)
    graph = traced.graph
    s, h, head = 32, 64, 16
    table = s * head * ACTIVATION_BYTES
    names = [u.fqn for u in graph.units]
    for i in range(names.index("model.layers.0"), names.index("model.layers.1")):  # between blocks
        assert graph.cut_fixed_bytes[i] == 2 * table, names[i]
        assert graph.cut_grad_fixed_bytes[i] == 0
        assert graph.cut_bytes[i] == s * h * ACTIVATION_BYTES  # the hidden states
        assert graph.boundary_bytes(i, 4) == 4 * graph.cut_bytes[i] + 2 * table
        assert graph.boundary_grad_bytes(i, 4) == 4 * s * h * ACTIVATION_BYTES
        assert graph.cut_fixed_seq_bytes[i] == 2 * table  # along the sequence: a cp rank sends its s/cp rows
        assert graph.boundary_bytes(i, 4 / 2, 2) == 2 * graph.cut_bytes[i] + table


def test_gpt_shard_regions_and_groups(gpt):
    cfg, graph, _ = gpt
    edges = {(e.src, e.dst): e for e in graph.edges}
    for i in range(cfg.layers):
        b = f"blocks.{i}"
        # Megatron's pairs: the colwise output stays split through heads / GELU into the rowwise layer
        assert edges[(f"{b}.attn.qkv", f"{b}.attn.proj")].shard_ok
        assert edges[(f"{b}.mlp.fc1", f"{b}.mlp.fc2")].shard_ok
        # norms reduce over the features: nothing split passes through them
        assert not edges[(f"{b}.ln_1", f"{b}.attn.qkv")].shard_ok
        assert not edges[(f"{b}.ln_2", f"{b}.mlp.fc1")].shard_ok
        assert not edges[(f"{b}.attn.proj", f"{b}.ln_2")].shard_ok
        assert edges[(f"{b}.attn.qkv", f"{b}.attn.proj")].bytes == 3 * cfg.seq_len * cfg.hidden * ACTIVATION_BYTES
    assert ("ln_f", "lm_head") in edges and not edges[("ln_f", "lm_head")].shard_ok
    for e in graph.edges:
        if graph.layers[e.src].kind == "norm" or graph.layers[e.dst].kind == "norm":
            assert not e.shard_ok, (e.src, e.dst)
        assert e.src in graph.layers and e.dst in graph.layers
    qkv, proj = graph.layers["blocks.1.attn.qkv"], graph.layers["blocks.1.attn.proj"]
    fc1, fc2 = graph.layers["blocks.1.mlp.fc1"], graph.layers["blocks.1.mlp.fc2"]
    assert (qkv.col_groups, qkv.fused) == (cfg.heads, 3)
    assert proj.row_groups == cfg.heads and proj.fused == 1
    assert fc1.col_groups == 4 * cfg.hidden and fc2.row_groups == 4 * cfg.hidden
    nx_graph = graph.to_networkx()
    assert set(nx_graph.nodes) == set(graph.layers) and nx_graph.number_of_edges() == len(edges)


def test_parameters_at_the_root_own_only_the_ops_that_read_them():
    """examples/vit.py holds its class token and positions at the root, beside weight-bearing children: the root
    layer owns what reads them (the token's expand, the positions' add), not the attention core of every block,
    which is glue between qkv and proj, so the split of qkv reaches proj (3 pieces of 4 heads)."""
    _, traced = trace_file(EXAMPLES / "vit.py")
    graph = traced.graph
    edges = {(e.src, e.dst): e for e in graph.edges}
    assert edges[("blocks.0.attn.qkv", "blocks.0.attn.proj")].shard_ok
    qkv = graph.layers["blocks.1.attn.qkv"]
    assert (qkv.fused, qkv.col_groups, qkv.split_stop) == (3, 4, "")
    root = graph.layers[""]
    assert sorted(root.params) == ["cls_token", "pos_embed"] and root.fwd_flops <= 2 * 17 * 64  # the add, at most


# ---------------------------------------------------------------------------------------------------------------
# examples/llama.py (GQA, RoPE, RMSNorm, SwiGLU) and Hugging Face GPT-2 (Conv1D, fused QKV, tied head)


def test_llama_gqa_groups(llama):
    cfg, graph = llama
    assert cfg.kv_heads < cfg.heads
    b = "blocks.1"
    q, k, v, o = (graph.layers[f"{b}.attn.{x}"] for x in "qkvo")
    assert q.col_groups == cfg.heads
    assert k.col_groups == v.col_groups == cfg.kv_heads
    # o's input is split by heads, not by features; a rowwise split must keep every KV group whole too
    assert o.row_groups != o.in_features
    assert cfg.heads % o.row_groups == 0 and o.row_groups % cfg.kv_heads == 0
    edges = {(e.src, e.dst): e.shard_ok for e in graph.edges}
    for x in "qkv":
        assert edges[(f"{b}.attn.{x}", f"{b}.attn.o")], x  # RoPE, repeat_interleave and attention keep heads
    assert edges[(f"{b}.mlp.gate", f"{b}.mlp.down")] and edges[(f"{b}.mlp.up", f"{b}.mlp.down")]
    assert graph.layers[f"{b}.mlp.down"].row_groups == cfg.ffn_hidden
    assert graph.layers[f"{b}.attn_norm"].kind == "norm"  # a custom RMSNorm class is recognized by name
    assert [u.fqn for u in graph.units] == ["tok"] + [f"blocks.{i}" for i in range(cfg.layers)] + ["norm", "lm_head"]
    s, h, kvh = cfg.seq_len, cfg.hidden, cfg.kv_heads * (cfg.hidden // cfg.heads)
    gemm = 2 * s * h * (h + 2 * kvh + h) + 2 * s * 3 * h * cfg.ffn_hidden  # q, k, v, o; gate, up, down
    assert graph.unit(b).fwd_flops == gemm + 4 * s * s * h


def test_hf_gpt2_tied_head_counted_once(traced_example):
    pytest.importorskip("transformers")
    spec, traced = traced_example("hf_gpt2")
    graph, cfg = traced.graph, spec.module.CONFIG
    model = build_on_meta(spec)
    assert graph.tied == {"lm_head.weight": "transformer.wte.weight"}
    unique = sum(p.numel() for p in model.parameters())  # parameters() yields a shared tensor once
    every = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert every - unique == cfg.vocab_size * cfg.n_embd
    assert graph.num_params == unique
    assert sum(u.num_params for u in graph.units) == unique
    assert graph.layers["lm_head"].num_params == 0
    assert graph.layers["transformer.wte"].num_params == cfg.vocab_size * cfg.n_embd
    c_attn = graph.layers["transformer.h.0.attn.c_attn"]
    assert c_attn.type == "Conv1D" and c_attn.kind == "linear"
    assert (c_attn.in_features, c_attn.out_features) == (cfg.n_embd, 3 * cfg.n_embd)  # Conv1D weight is [in, out]
    assert (c_attn.col_groups, c_attn.fused) == (cfg.n_head, 3)
    assert graph.layers["transformer.h.0.attn.c_proj"].row_groups == cfg.n_head
    assert [u.fqn for u in graph.units][-2:] == ["transformer.ln_f", "lm_head"]
    edges = {(e.src, e.dst): e.shard_ok for e in graph.edges}
    assert edges[("transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj")]
    assert edges[("transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj")]


# ---------------------------------------------------------------------------------------------------------------
# --dump-dir and a model export rejects


def test_dump_dir_files(tmp_path, gpt):
    cfg, graph, _ = gpt
    result = compile_model(str(EXAMPLES / "gpt.py"), gpus=2, dump_dir=tmp_path / "dump")
    text = (tmp_path / "dump" / "graph.txt").read_text()
    lines = text.splitlines()
    assert lines[0].startswith(f"# gpt: {graph.num_params:,} parameters, {len(graph.units)} units")
    assert [l.split()[1] for l in lines if l.startswith("unit ")] == [u.fqn for u in graph.units]
    assert sum(l.startswith("  layer ") for l in lines) == len(graph.layers)
    assert sum(l.startswith("edge ") for l in lines) == len(graph.edges)
    assert "edge blocks.0.attn.qkv -> blocks.0.attn.proj" in text and "shard_ok=True" in text
    costs = json.loads((tmp_path / "dump" / "costs.json").read_text())
    assert [u["unit"] for u in costs["units"]] == [u.fqn for u in graph.units]
    assert costs["cut_bytes_per_sample"] == graph.cut_bytes
    assert costs["parallel"]["dp"] * costs["parallel"]["tp"] * costs["parallel"]["pp"] == 2
    assert costs["prediction"]["step_time_s"] == pytest.approx(result.plan.predicted["step_time_s"])
    assert all(u["compute_s"] > 0 for u in costs["units"] if u["unit"].startswith("blocks."))


def test_untraceable_model_names_module_and_line(tmp_path):
    path = tmp_path / "branchy.py"
    path.write_text(textwrap.dedent(BRANCHY))
    with pytest.raises(PartcError) as info:
        trace_file(path)
    message = str(info.value)
    assert "\n" not in message
    line = path.read_text().splitlines().index("        if y.sum() > 0:") + 1
    assert "in module gate" in message and f"{path}:{line}" in message
    assert "torch.where" in message


def test_data_dependent_shape_is_one_line(tmp_path):
    """Boolean-mask indexing exports (with an unbacked size) but cannot run on meta: still one clear line."""
    path = write_model(tmp_path / "masked.py", """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)

            def forward(self, x):
                y = self.lin(x)
                return y[y > 0].sum() + y
    """)
    with pytest.raises(PartcError) as info:
        trace_file(path)
    message = str(info.value)
    assert "\n" not in message
    line = path.read_text().splitlines().index("        return y[y > 0].sum() + y") + 1
    assert f"{path}:{line}" in message and "mask" in message
