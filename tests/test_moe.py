"""Sparse mixture of experts (issue #14, item 5): Hugging Face Mixtral, a top-k-of-n MoE, from its config class.

The trace counts what each token runs (k experts' GEMMs, the router, attention) while all n experts' parameters are
held; the program it yields runs on any device, and trains on 2 gloo ranks exactly like one process."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn

from helpers import assert_close_losses, assert_close_states, run_jobs
from partc.compile import compile_model
from partc.errors import PartcError
from partc.model_file import build_on_meta, load_model_file
from partc.parallel import Pins
from partc.passes.export import export_on_meta
from partc.passes.trace import trace
from partc.runtime.testing import reference_run

S, H, I, HEADS, KV_HEADS, E, K, V = 16, 64, 96, 4, 2, 4, 2, 512
MIXTRAL = f"""
    from transformers import MixtralConfig, MixtralForCausalLM

    def model():
        return MixtralForCausalLM(MixtralConfig(vocab_size={V}, hidden_size={H}, intermediate_size={I},
                                                num_hidden_layers=2, num_attention_heads={HEADS},
                                                num_key_value_heads={KV_HEADS}, num_local_experts={E},
                                                num_experts_per_tok={K}, max_position_embeddings=128))
"""


@pytest.fixture(scope="module")
def mixtral_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "tiny_mixtral.py"
    path.write_text(textwrap.dedent(MIXTRAL))
    return str(path)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_flops_are_attention_router_and_k_of_n_experts(mixtral_file, precision):
    """At bf16 the experts run `torch.nn.functional.grouped_mm` (aten._grouped_mm); at fp32 Hugging Face's custom
    op `transformers::grouped_mm_fallback`: both counted by their shapes. The count is exact (tolerance 0): the
    grouped GEMMs' rows are the S x k (token, expert) pairs, whatever the routing."""
    spec = load_model_file(mixtral_file, seq_len=S)
    with torch.device("meta"):
        args, kwargs = spec.inputs(1)
    graph = trace(build_on_meta(spec), args, kwargs, name=spec.name, seq_len=S, precision=precision).graph
    head_dim = H // HEADS
    attention = 2 * S * H * H * 2 + 2 * 2 * S * H * KV_HEADS * head_dim + 4 * S * S * H  # q, o; k, v; core
    router = 2 * S * H * E
    experts = K * (2 * S * H * 2 * I + 2 * S * I * H)  # per token: k experts' gate+up and down projections
    blocks = [u for u in graph.units if u.kind == "block"]
    assert len(blocks) == 2
    for u in blocks:
        assert u.fwd_flops == attention + router + experts, u.fqn
        layer = graph.layers[f"{u.fqn}.mlp.experts"]
        assert layer.fwd_flops == experts
        # uniform routing: each of the E experts' GEMMs takes S k / E rows; all E experts' weights are held
        assert [(g.batch, g.m, g.n, g.k) for g in layer.gemms] == [(E, S * K // E, 2 * I, H), (E, S * K // E, H, I)]
        assert layer.num_params == E * 3 * H * I
    assert graph.unit("lm_head").fwd_flops == 2 * S * H * V


def test_eager_experts_get_a_hint(tmp_path):
    path = tmp_path / "eager.py"
    path.write_text(textwrap.dedent(MIXTRAL).replace("max_position_embeddings=128)",
                                                     "max_position_embeddings=128, experts_implementation='eager')"))
    spec = load_model_file(str(path), seq_len=S)
    with torch.device("meta"):
        args, kwargs = spec.inputs(1)
    with pytest.raises(PartcError, match="experts_implementation='eager' loops over the experts .* set "
                                         "experts_implementation='grouped_mm' in its config"):
        trace(build_on_meta(spec), args, kwargs, name=spec.name, seq_len=S)


class IntHistogram(nn.Module):
    """Branches on the device type as Hugging Face's experts do: integer `histc` off CPU (the meta trace's branch)."""

    def forward(self, x):
        ids = x.argmax(-1)
        ids = ids.float() if x.device.type == "cpu" else ids.int()
        return x * torch.histc(ids, bins=4, min=0, max=3).to(x.dtype).sum()


def test_integer_histc_of_the_meta_trace_runs_on_cpu():
    x = torch.randn(6, 4)
    ep = export_on_meta(IntHistogram(), (x.to("meta"),), {})
    histc = [n for n in ep.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.histc.default]
    assert len(histc) == 1 and histc[0].args[0].meta["val"].dtype == torch.float32
    assert histc[0].meta["val"].dtype == torch.float32
    assert [u.meta["val"].dtype for u in histc[0].users] == [torch.int32]  # cast back to the traced dtype
    gm = ep.graph_module  # as the generated program runs it: without the trace's device assertions
    for n in list(gm.graph.nodes):
        if n.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(n)
    gm.recompile()
    torch.testing.assert_close(gm(x)[0], IntHistogram()(x), rtol=0, atol=0)


# name: (tp, pp, dp, zero, micro-batch size, global batch)
CONFIGS = {
    "pp2": (1, 2, 1, 0, 1, 4),
    "dp2_z3": (1, 1, 2, 3, 1, 4),
    "tp2": (2, 1, 1, 0, 2, 4),  # attention split (Megatron), the router and the experts replicated
    "tp2_inner": (2, 1, 1, 0, 2, 4),  # and the experts split inside (gate/up colwise, down rowwise), the router whole
}
TP_STYLES = {r"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
             "self_attn.o_proj": "rowwise", "model.embed_tokens": "rowwise", "lm_head": "colwise"}
INNER = {"tp2_inner": {"mlp.experts": "inner"}}
"""Styles a config sets besides `TP_STYLES`."""
STEPS = 3
SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0}


@pytest.fixture(scope="module")
def runs(mixtral_file, tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("moe_runs")
    jobs = []
    for name, (tp, pp, dp, zero, mb, gbs) in CONFIGS.items():
        torch.manual_seed(1234)
        torch.save(load_model_file(mixtral_file, seq_len=S).build().state_dict(), tmp / f"{name}.init.pt")
        pins = Pins(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch_size=mb, schedule="1f1b", recompute="none",
                    precision="fp32")
        out = tmp / name
        compile_model(mixtral_file, gpus=tp * pp * dp, pins=pins, global_batch_size=gbs, seq_len=S, out_dir=out)
        if tp > 1:  # the Megatron map, set by hand as a user would (`--from-plan`)
            plan = json.loads((out / "plan.json").read_text())
            styles = {**TP_STYLES, **INNER.get(name, {})}
            plan["tp"] = {fqn: next((s for k, s in styles.items() if fqn.endswith(k)), "replicate")
                          for fqn in plan["tp"]}
            (tmp / f"{name}.plan.json").write_text(json.dumps(plan))
            compile_model(mixtral_file, gpus=tp * pp * dp, from_plan=str(tmp / f"{name}.plan.json"), seq_len=S,
                          out_dir=out)
        jobs.append({"out": str(out), "steps": STEPS, "init": str(tmp / f"{name}.init.pt"),
                     "result": str(tmp / f"{name}.pt"), **SGD})
    run_jobs(2, jobs, tmp)
    return tmp


@pytest.mark.slow  # one torchrun launch of 2 gloo ranks
@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixtral_trains_like_one_process(runs, mixtral_file, name):
    tmp = runs
    *_, gbs = CONFIGS[name]
    init = torch.load(tmp / f"{name}.init.pt", weights_only=True)
    got = torch.load(tmp / f"{name}.pt", weights_only=True)
    losses, state = reference_run(mixtral_file, init, steps=STEPS, seed=0, global_batch_size=gbs, seq_len=S, **SGD)
    assert_close_losses(got["losses"], losses)
    assert_close_states(got["state"], state)
    assert any(not torch.equal(state[k], init[k]) for k in state if "experts" in k), "the experts must train"
    if name in INNER:  # each rank holds its half of I of gate, of up and of down: the program ran on expert shards
        manifest = json.loads((tmp / name / "program" / "manifest.json").read_text())
        shards = {k: v for k, v in manifest["tp"]["shards"].items() if "experts" in k}
        assert shards == {f"model.layers.{i}.mlp.experts.{p}": s for i in range(2) for p, s in
                          (("gate_up_proj", {"dim": 1, "fused": 2}), ("down_proj", {"dim": 2, "fused": 1}))}
