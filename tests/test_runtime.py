"""Single-process runtime tests: building on meta, materializing a part, initialization, the stage wrapper,
reading programs, the command lines. The multi-process ones are in test_runtime_dist.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from helpers import EXAMPLES
from partc.cli.main import main as cli
from partc.compile import compile_model
from partc.errors import PartcError
from partc.model_file import load_model_file
from partc.parallel import Parallel, Pins
from partc import collectives
from partc.runtime.__main__ import main as runtime_main
from partc.runtime.api import shared_holders, stage_tensor_names
from partc.runtime.checkpoint import _canon_key
from partc.runtime.launch import torchrun_args
from partc.runtime.materialize import (build_initialized, build_model, canonical_names, init_weights, load_weights,
                                       materialize)
from partc.runtime.mesh import check_world_size
from partc.runtime.program import read_program
from partc.sharding import TPLayout
from partc.runtime.stage import StageModule, UnitModule
from partc.runtime.train import global_batch, stage_shapes

CPU = torch.device("cpu")


PINS = dict(tp=1, dp=1, zero=0, micro_batch_size=1, schedule="1f1b", recompute="none")


@pytest.fixture(scope="module")
def gpt_pp2(compiled):
    return compiled("gpt", pp=2, global_batch_size=4, **PINS)


@pytest.fixture(scope="module")
def hf_pp2(compiled):
    return compiled("hf_gpt2", pp=2, global_batch_size=4, **PINS)


# -- building on meta, materializing, initializing ---------------------------------------------------------------


class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8), persistent=False)


def test_build_model_is_on_meta_and_keeps_buffers():
    spec = SimpleNamespace(build=Rotary)
    m, init = build_model(spec)
    assert all(t.is_meta for t in [*m.parameters(), *m.buffers()]) and not init.problems
    whole = build_initialized(spec, seed=0)
    assert torch.equal(whole.inv_freq, Rotary().inv_freq)  # computed in __init__: replayed exactly


def test_hf_llama_rotary_buffer_survives(tmp_path):
    import transformers as tf
    config = tf.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=64, vocab_size=64)
    whole = build_initialized(SimpleNamespace(build=lambda: tf.LlamaForCausalLM(config)), seed=0)
    ref = tf.LlamaForCausalLM(config)
    assert torch.equal(whole.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)


@pytest.mark.parametrize("model,part", [("gpt", ("blocks.1.", "lm_head.")),
                                        ("hf_gpt2", ("transformer.h.1.", "lm_head."))])
def test_part_initializes_like_the_whole_model(model, part):
    spec = load_model_file(str(EXAMPLES / f"{model}.py"))
    whole = build_initialized(spec, seed=3).state_dict()
    m, init = build_model(spec)
    names = [n for n, _ in m.named_parameters(remove_duplicate=False) if n.startswith(part)]
    tensors = materialize(m, names, CPU)
    init_weights(init, tensors, seed=3)
    assert tensors
    for name, t in tensors.items():
        assert torch.equal(t, whole[name]), name
    held = {id(t) for t in tensors.values()}
    assert all(p.is_meta for p in m.parameters() if id(p) not in held)
    other = build_initialized(spec, seed=4).state_dict()
    assert not torch.equal(other["lm_head.weight"], whole["lm_head.weight"])  # the seed matters


def test_gpt_init_is_the_models_own():
    whole = build_initialized(load_model_file(str(EXAMPLES / "gpt.py")), seed=0)
    std = whole.blocks[0].attn.proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(2 * whole.config.layers), rel=0.1)  # GPT-2's scaled init
    assert torch.equal(whole.blocks[0].ln_1.weight, torch.ones(64))


def test_materialize_keeps_ties_and_canonical_names():
    spec = load_model_file(str(EXAMPLES / "hf_gpt2.py"))
    m, _ = build_model(spec)
    canon = canonical_names(m, [["lm_head.weight", "transformer.wte.weight"]])
    assert canon["lm_head.weight"] == "transformer.wte.weight"
    tensors = materialize(m, ["lm_head.weight"], CPU)
    assert list(tensors) == ["transformer.wte.weight"]
    assert m.lm_head.weight is m.transformer.wte.weight and not m.lm_head.weight.is_meta
    with pytest.raises(PartcError, match="ties"):
        canonical_names(m, [["lm_head.weight", "transformer.wpe.weight"]])


def test_load_weights_by_alias_and_errors():
    spec = load_model_file(str(EXAMPLES / "hf_gpt2.py"))
    ref = spec.build().state_dict()
    m, _ = build_model(spec)
    tensors = materialize(m, ["lm_head.weight", "transformer.ln_f.weight"], CPU)
    only_head = {"lm_head.weight": ref["lm_head.weight"], "transformer.ln_f.weight": ref["transformer.ln_f.weight"]}
    aliases = {"transformer.wte.weight": ["transformer.wte.weight", "lm_head.weight"]}
    assert load_weights(tensors, aliases, only_head, where="x.pt", buffers=set()) == []
    assert torch.equal(m.transformer.wte.weight, ref["transformer.wte.weight"])
    with pytest.raises(PartcError, match="x.pt has no transformer.ln_f.weight"):
        load_weights(tensors, aliases, {"lm_head.weight": ref["lm_head.weight"]}, where="x.pt", buffers=set())
    bad = dict(only_head, **{"lm_head.weight": torch.zeros(3)})
    with pytest.raises(PartcError, match="shape"):
        load_weights(tensors, aliases, bad, where="x.pt", buffers=set())


# -- tensor-parallel shards ----------------------------------------------------------------------------------------


def _gpt_layout(rank: int, canon: dict[str, str]) -> TPLayout:
    shards = {"blocks.0.attn.qkv.weight": {"dim": 0, "fused": 3}, "blocks.0.attn.qkv.bias": {"dim": 0, "fused": 3},
              "blocks.0.attn.proj.weight": {"dim": 1}, "blocks.0.mlp.fc1.weight": {"dim": 0},
              "tok.weight": {"dim": 0}, "lm_head.weight": {"dim": 0}}
    fused = {"blocks.0.attn.qkv.weight": {"dim": 0, "pieces": 3}}
    return TPLayout.from_manifest({"degree": 2, "shards": shards, "fused": fused}, rank, canon)


def test_tp_layout_shapes_and_parts():
    m, _ = build_model(load_model_file(str(EXAMPLES / "gpt.py")))
    layout = _gpt_layout(1, canonical_names(m))
    assert layout.local_shape("blocks.0.attn.qkv.weight", (192, 64)) == (96, 64)
    assert layout.full_shape("blocks.0.attn.proj.weight", (64, 32)) == (64, 64)
    assert layout.local_shape("blocks.0.ln_1.weight", (64,)) == (64,) and layout.shard("ln_f.weight") is None
    assert layout.fused("blocks.0.attn.qkv.weight") == (0, 3) and layout.fused("blocks.0.attn.qkv.bias") is None
    full = torch.arange(12.0)
    assert layout.take("blocks.0.attn.qkv.bias", full).tolist() == [2, 3, 6, 7, 10, 11]  # its half of q, k, v
    w = torch.arange(8.0).reshape(2, 4)
    assert torch.equal(layout.take("blocks.0.attn.proj.weight", w), w[:, 2:])
    assert layout.gather("ln_f.weight", full, None) is full  # whole: nothing to gather
    one = TPLayout.from_manifest({"degree": 1, "shards": {}, "fused": {}}, 0, {})
    assert one.take("tok.weight", w) is w


@pytest.mark.parametrize("model", ["gpt", "hf_gpt2"])
def test_shards_initialize_like_the_whole_model(model, monkeypatch):
    """Each tp rank's shards are the whole model's, sliced (the init runs on whole tensors a group at a time);
    the whole tensors are the model's own; a tied weight split by both its layers stays one tensor."""
    import partc.runtime.materialize as materialize_module

    monkeypatch.setattr(materialize_module, "INIT_GROUP_BYTES", 20_000)  # several groups
    spec = load_model_file(str(EXAMPLES / f"{model}.py"))
    whole = build_initialized(spec, seed=3).state_dict()
    for rank in range(2):
        m, init = build_model(spec)
        canon = canonical_names(m, [["lm_head.weight", "transformer.wte.weight"]] if model == "hf_gpt2" else [])
        if model == "gpt":
            layout = _gpt_layout(rank, canon)
            names = [n for n in canon if n.startswith(("blocks.0.", "tok.", "lm_head.", "pos."))]
        else:
            shards = {"transformer.wte.weight": {"dim": 0}, "lm_head.weight": {"dim": 0},
                      "transformer.h.0.attn.c_attn.weight": {"dim": 1, "fused": 3},
                      "transformer.h.0.attn.c_attn.bias": {"dim": 0, "fused": 3},
                      "transformer.h.0.attn.c_proj.weight": {"dim": 0}}
            layout = TPLayout.from_manifest({"degree": 2, "shards": shards}, rank, canon)
            names = [n for n in canon if n.startswith(("transformer.h.0.", "lm_head."))]
        tensors = materialize(m, names, CPU, layout)
        init_weights(init, tensors, seed=3, layout=layout)
        assert tensors["blocks.0.attn.qkv.weight" if model == "gpt" else "transformer.h.0.attn.c_attn.weight"] \
            .shape[0 if model == "gpt" else 1] == 96
        for name, t in tensors.items():
            assert torch.equal(t, layout.take(name, whole[name])), (rank, name)
        if model == "hf_gpt2":
            assert m.lm_head.weight is m.transformer.wte.weight and m.lm_head.weight.shape == (256, 64)
        assert all(p.is_meta for n, p in m.named_parameters() if n not in tensors)


def test_load_weights_takes_this_ranks_shard():
    spec = load_model_file(str(EXAMPLES / "gpt.py"))
    ref = spec.build().state_dict()
    m, _ = build_model(spec)
    layout = _gpt_layout(1, canonical_names(m))
    tensors = materialize(m, ["blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight"], CPU, layout)
    load_weights(tensors, {}, ref, where="x.pt", buffers=set(), layout=layout)
    assert torch.equal(m.blocks[0].attn.proj.weight, ref["blocks.0.attn.proj.weight"][:, 32:])
    q, k, v = ref["blocks.0.attn.qkv.weight"].chunk(3)
    assert torch.equal(m.blocks[0].attn.qkv.weight, torch.cat([q[32:], k[32:], v[32:]]))
    bad = dict(ref, **{"blocks.0.attn.proj.weight": torch.zeros(64, 32)})  # a shard is not the model's tensor
    with pytest.raises(PartcError, match=r"x.pt: blocks.0.attn.proj.weight has shape \(64, 32\), the model's is "
                                         r"\(64, 64\)"):
        load_weights(tensors, {}, bad, where="x.pt", buffers=set(), layout=layout)


def test_stage_shapes_on_shards(tmp_path):
    """A tp=2 program chains on meta with its shards' shapes, not the model's (no tp group here: the collectives
    are the identity, which changes no shape between Megatron's pairs)."""
    out = tmp_path / "out"
    compile_model(str(EXAMPLES / "gpt.py"), gpus=2, pins=Pins(tp=2, pp=1, micro_batch_size=1), global_batch_size=2,
                  out_dir=out)
    plan = json.loads((out / "plan.json").read_text())
    plan["tp"] = {k: "colwise" if k.endswith(("qkv", "fc1")) else "rowwise" if k.endswith(("proj", "fc2"))
                  else "replicate" for k in plan["tp"]}
    (tmp_path / "edited.json").write_text(json.dumps(plan))
    compile_model(str(EXAMPLES / "gpt.py"), gpus=2, from_plan=str(tmp_path / "edited.json"), out_dir=out)
    prog = read_program(out)
    spec = load_model_file(prog.model_path)
    m, _ = build_model(spec)
    collectives.set_groups({})
    with pytest.raises(RuntimeError):  # whole weights do not fit the program's local shapes
        stage_shapes(prog, m, spec)
    layout = TPLayout.from_manifest(prog.tp, 0, canonical_names(m))
    assert layout.local_shape("blocks.0.mlp.fc1.weight", (256, 64)) == (128, 64)
    ((ids,), (logits,)), = stage_shapes(prog, m, spec, layout)
    assert ids.shape == (1, 64) and logits.shape == (1, 64, 512) and logits.is_meta


# -- the program and the stage wrapper ---------------------------------------------------------------------------


def test_stage_module_runs_the_stage_file_under_the_models_names(gpt_pp2):
    prog = read_program(gpt_pp2)
    spec = load_model_file(prog.model_path)
    whole = build_initialized(spec, seed=0)
    m, init = build_model(spec)
    canon = canonical_names(m)
    st = prog.stages[1]
    tensors = materialize(m, stage_tensor_names(st, m), CPU)
    init_weights(init, tensors, seed=0)
    mod = StageModule(st, m, canon, CPU)
    keys = list(mod.state_dict())
    assert keys and all(any(k.startswith(u + ".") for u in st.modules) for k in keys)
    assert set(keys) == {k for k in whole.state_dict() if any(k.startswith(u + ".") for u in st.modules)}
    x = torch.randn(1, 64, 64)
    p = dict(whole.named_parameters())
    want = st.code.forward(p, x, device=CPU)
    got = mod(x)
    assert isinstance(got, tuple) and torch.allclose(got[0], want[0])
    got[0].sum().backward()
    assert all(q.grad is not None for q in mod.parameters())


def test_stage_module_resolves_aliases_and_outside_tensors(hf_pp2):
    prog = read_program(hf_pp2)
    m, _ = build_model(load_model_file(prog.model_path))
    canon = canonical_names(m, prog.tied)
    last = prog.stages[-1]
    fake = SimpleNamespace(index=9, code=last.code, modules=["lm_head"], units=["lm_head"],
                           parameters=["transformer.wte.weight", "transformer.ln_f.weight"], buffers=[],
                           foreign_reads=set())
    materialize(m, ["lm_head.weight", "transformer.ln_f.weight"], CPU)
    mod = StageModule(fake, m, canon, CPU)
    t = mod.tensors()
    assert t["transformer.wte.weight"] is mod.lm_head.weight  # the alias the stage's own module holds
    assert t["transformer.ln_f.weight"] is mod.transformer.ln_f.weight  # attached at its own FQN
    assert set(mod.state_dict()) == {"lm_head.weight", "transformer.ln_f.weight"}
    # The unit the stage file runs is a module of its own (FSDP and recomputation wrap it), holding the same
    # tensors under the same names.
    assert isinstance(mod.lm_head, UnitModule) and set(mod.units) == {"lm_head"}
    assert mod.lm_head.weight is m.lm_head.weight


def test_shared_holders_span_stages(hf_pp2):
    prog = read_program(hf_pp2)
    m, _ = build_model(load_model_file(prog.model_path))
    holders = shared_holders(prog, m, canonical_names(m, prog.tied))
    assert holders["transformer.wte.weight"] == [0, 1]
    assert all(len(v) == 1 for k, v in holders.items() if k != "transformer.wte.weight")


def test_stage_shapes_chain_on_meta(gpt_pp2):
    prog = read_program(gpt_pp2)
    spec = load_model_file(prog.model_path)
    (in0, out0), (in1, out1) = stage_shapes(prog, build_model(spec)[0], spec)
    assert in0[0].dtype == torch.long and not in0[0].requires_grad
    assert out0[0].shape == (1, 64, 64) and out0[0].requires_grad and out0[0].is_meta
    assert in1[0].shape == out0[0].shape and out1[0].shape == (1, 64, 512)


def test_read_program_errors(tmp_path, gpt_pp2):
    with pytest.raises(PartcError, match="not a directory"):
        read_program(tmp_path / "missing")
    broken = tmp_path / "broken"
    (broken / "program").mkdir(parents=True)
    (broken / "plan.json").write_text((gpt_pp2 / "plan.json").read_text())
    with pytest.raises(PartcError, match="manifest.json does not exist"):
        read_program(broken)
    for f in (gpt_pp2 / "program").iterdir():
        (broken / "program" / f.name).write_text(f.read_text())
    stage1 = broken / "program" / "stage_1.py"
    stage1.write_text(stage1.read_text().replace("INPUTS = [", "INPUTS = ['extra', "))
    with pytest.raises(PartcError, match="must be stage 0's OUTPUTS"):
        read_program(broken)


# -- data, mesh, checkpoint keys ---------------------------------------------------------------------------------


def test_global_batch_is_deterministic():
    spec = load_model_file(str(EXAMPLES / "gpt.py"))
    a, b, c = global_batch(spec, 0, 5, 4), global_batch(spec, 0, 5, 4), global_batch(spec, 0, 6, 4)
    assert torch.equal(a[0][0], b[0][0]) and torch.equal(a[2], b[2])
    assert not torch.equal(a[0][0], c[0][0])
    torch.manual_seed(5)
    assert torch.equal(a[0][0], spec.inputs(4)[0][0])  # what one process draws after manual_seed(seed + k)


def test_mesh_coordinates_and_world_size():
    par = Parallel(pp=2, dp=3, tp=2, zero=0, micro_batch_size=1, global_batch_size=3)
    assert [par.rank_of(**par.coords(r)) for r in range(12)] == list(range(12))
    assert par.coords(7) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}  # 7 = ((1 * 3 + 0) * 1 + 0) * 2 + 1
    cp = Parallel(pp=2, dp=1, cp=2, tp=2, zero=0, micro_batch_size=1, global_batch_size=1)
    assert cp.coords(7) == {"pp": 1, "dp": 0, "cp": 1, "tp": 1}  # 7 = ((1 * 1 + 0) * 2 + 1) * 2 + 1
    check_world_size(par, 12)
    with pytest.raises(PartcError, match=r"dp x tp x pp = 3 x 2 x 2 = 12 processes, but 8 were started"):
        check_world_size(par, 8)


def test_canonical_checkpoint_keys():
    canon = {"lm_head.weight": "tok.weight", "tok.weight": "tok.weight"}
    assert _canon_key("lm_head.weight", canon) == "tok.weight"
    assert _canon_key("state.lm_head.weight.exp_avg", canon) == "state.tok.weight.exp_avg"
    assert _canon_key("param_groups.lm_head.weight.lr", canon) == "param_groups.tok.weight.lr"
    assert _canon_key("state.blocks.0.w.step", canon) == "state.blocks.0.w.step"


# -- command lines -----------------------------------------------------------------------------------------------


def test_runtime_world_size_mismatch(gpt_pp2, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert runtime_main([str(gpt_pp2)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: the plan needs dp x tp x pp = 1 x 1 x 2 = 2 processes, but 3 were started; run "
                   "`partc run OUT` or torchrun --nproc-per-node 2")


def test_runtime_needs_torchrun(gpt_pp2, monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert runtime_main([str(gpt_pp2), "--steps", "1"]) == 2
    assert "runs under torchrun" in capsys.readouterr().err


def test_partc_run(gpt_pp2):
    argv = torchrun_args(str(gpt_pp2), ["--steps", "3"])
    assert argv == ["--standalone", "--nproc-per-node", "2", "-m", "partc.runtime", str(gpt_pp2), "--steps", "3"]
    res = CliRunner().invoke(cli, ["run", str(gpt_pp2), "--nproc-per-node", "3", "--steps", "1"])
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [
        "error: the plan needs dp x tp x pp = 1 x 1 x 2 = 2 processes, not --nproc-per-node 3; compile a plan for "
        "3 GPUs"]


def test_collectives_are_identity_on_one_rank():
    x = torch.randn(2, 4, requires_grad=True)
    collectives.set_groups({})
    for fn in (collectives.copy_to_tp, collectives.reduce_from_tp):
        assert fn(x) is x
    for fn in (collectives.gather_from_tp, collectives.scatter_to_tp, collectives.reduce_scatter_to_tp):
        assert fn(x, -1) is x


def test_api_in_one_process(tmp_path, compiled):
    """partc.runtime.load on a one-rank plan in this process: steps, load_state_dict, --init-checkpoint
    (safetensors), save / load, full_state_dict, against the single-process reference."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    import partc.runtime
    from partc.runtime.testing import reference_run

    out = compiled("gpt", pp=1, global_batch_size=4, **{**PINS, "micro_batch_size": 2})
    spec = load_model_file(str(EXAMPLES / "gpt.py"))
    torch.manual_seed(0)
    init = spec.build().state_dict()
    save_file(init, str(tmp_path / "init.safetensors"))
    losses, want = reference_run(str(EXAMPLES / "gpt.py"), init, steps=2, seed=0, global_batch_size=4,
                                 optimizer="sgd", lr=0.5, precision="bf16", micro_batch_size=2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        prog = partc.runtime.load(out, optimizer="sgd", lr=0.5, init_checkpoint=tmp_path / "init.safetensors")
        got = [prog.step(*prog.batch(k)) for k in range(2)]
        assert got == pytest.approx(losses, rel=1e-6)
        sd = prog.full_state_dict()
        assert list(sd) == list(want) and all(torch.allclose(sd[k], want[k], rtol=1e-5, atol=1e-7) for k in want)
        assert prog.save(tmp_path / "ck", step=2).name == "step-00000002"
        prog.load_state_dict(init)
        assert torch.equal(prog.full_state_dict()["lm_head.weight"], init["lm_head.weight"])
        assert prog.load(tmp_path / "ck") == 2
        assert all(torch.equal(v, sd[k]) for k, v in prog.full_state_dict().items())
        with pytest.raises(ValueError, match="global batch is 4 samples, got 2"):
            prog.step((torch.zeros(2, 64, dtype=torch.long),), torch.zeros(2, 64, dtype=torch.long))
    finally:
        dist.destroy_process_group()


# -- parameters on the model's root --------------------------------------------------------------------------------

PLAIN = Path(__file__).resolve().parent / "plain_init.py"
BARE = '''import torch
from torch import nn


class Bare(nn.Module):
    """Bare parameters: the root is the only unit."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 16) * 0.3)
        self.w2 = nn.Parameter(torch.randn(16, 4) * 0.3)
        self.register_buffer("shift", torch.full((4,), 0.5))

    def forward(self, x):
        return torch.relu(x @ self.w1) @ self.w2 + self.shift


def model():
    return Bare()


def example_inputs(b):
    return (torch.randn(b, 8),)


def example_targets(b):
    return torch.randint(0, 4, (b,))
'''


def test_root_parameters_go_with_the_stages_that_read_them(tmp_path):
    """tok (embedding and output projection), pos, scale and gate live on the root: no unit "", no leading dot,
    each stage holds the root tensors its code reads, under their own names; tok is shared by both stages."""
    pins = Pins(tp=1, pp=2, dp=1, zero=0, micro_batch_size=1, schedule="1f1b", recompute="none")
    compile_model(str(PLAIN), gpus=2, pins=pins, global_batch_size=4, out_dir=tmp_path / "out")
    prog = read_program(tmp_path / "out")
    assert [st.modules for st in prog.stages] == [["blocks.0"], ["blocks.1", "norm"]]
    assert {"tok", "pos"} <= set(prog.stages[0].parameters) and "scale" not in prog.stages[0].parameters
    assert {"tok", "scale", "gate"} <= set(prog.stages[1].parameters) and prog.stages[1].buffers == ["temperature"]
    spec = load_model_file(str(PLAIN))
    whole = build_initialized(spec, seed=0).state_dict()
    m, init = build_model(spec)
    canon = canonical_names(m)
    assert shared_holders(prog, m, canon)["tok"] == [0, 1]
    for st in prog.stages:
        names = stage_tensor_names(st, m)
        assert not [n for n in names if n.startswith(".")]
        init_weights(init, materialize(m, names, CPU), seed=0)
        mod = StageModule(st, m, canon, CPU)
        assert set(mod.state_dict()) == set(names)
        for k, v in mod.state_dict().items():
            assert torch.equal(v, whole[k]), k


def test_api_in_one_process_with_root_parameters(tmp_path):
    """partc.runtime.load without --init-checkpoint: the plain model starts from its own init (as one process
    builds it), trains like one process; a checkpoint and the full state dict hold the root's tensors; a model of
    bare parameters (the root its only unit) runs too."""
    import torch.distributed as dist

    import partc.runtime
    from partc.runtime.testing import reference_run

    (tmp_path / "bare.py").write_text(BARE)
    pins = Pins(tp=1, pp=1, dp=1, zero=0, micro_batch_size=2, schedule="1f1b", recompute="none")
    for name, path in (("plain", PLAIN), ("bare", tmp_path / "bare.py")):
        compile_model(str(path), gpus=1, pins=pins, global_batch_size=4, out_dir=tmp_path / name)
    assert json.loads((tmp_path / "bare" / "plan.json").read_text())["stages"][0]["modules"] == [""]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        for name, path in (("plain", PLAIN), ("bare", tmp_path / "bare.py")):
            init = build_initialized(load_model_file(str(path)), seed=4).state_dict()
            losses, want = reference_run(str(path), init, steps=2, seed=4, global_batch_size=4, optimizer="sgd",
                                         lr=0.5, precision="bf16", micro_batch_size=2)
            prog = partc.runtime.load(tmp_path / name, seed=4, optimizer="sgd", lr=0.5)
            start = prog.full_state_dict()
            assert list(start) == list(init) and all(torch.equal(start[k], init[k]) for k in init), name
            got = [prog.step(*prog.batch(k)) for k in range(2)]
            assert got == pytest.approx(losses, rel=1e-6) and all(math.isfinite(x) for x in got)
            sd = prog.full_state_dict()
            assert all(torch.allclose(sd[k], want[k], rtol=1e-5, atol=1e-7) for k in want), name
            prog.save(tmp_path / f"ck_{name}", step=2)
            prog.load_state_dict(init)
            assert prog.load(tmp_path / f"ck_{name}") == 2
            assert all(torch.equal(v, sd[k]) for k, v in prog.full_state_dict().items()), name
    finally:
        dist.destroy_process_group()


def test_foreign_reads_are_the_tensors_read_outside_their_units_function():
    """DeBERTa's layers read the encoder's relative-position table: that unit cannot be an FSDP group of its own."""
    from partc.runtime.program import foreign_reads

    source = '''
def enc_rel(p, *, device):
    return (p['enc.rel.weight'],)


def enc_layer_0(p, x, *, device):
    return (x @ p['enc.layer.0.w'] + p['enc.rel.weight'].sum(),)


def forward(p, x, *, device, run=call):
    (r,) = run('enc.rel', enc_rel, p, device=device)
    (y,) = run('enc.layer.0', enc_layer_0, p, x, device=device)
    return (y * p['root.scale'],)
'''
    assert foreign_reads(source) == {"enc.rel.weight", "root.scale"}
