"""Sparse mixture of experts (issue #14, item 5): Hugging Face Mixtral, a top-k-of-n MoE, from its config class.

The trace counts what each token runs (k experts' GEMMs, the router, attention) while all n experts' parameters are
held; the program it yields runs on any device, and trains on 2 gloo ranks exactly like one process."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from helpers import (assert_close_losses, assert_close_states, assert_comm_matches_plan, compile_program,
                     reference_once, run_jobs)
from partc.cli.main import main
from partc.cluster import PRESETS
from partc.errors import PartcError
from partc.model_file import build_on_meta, load_model_file
from partc.passes import hw
from partc.passes.experts import inner_split, param_placeholders
from partc.passes.export import export_on_meta
from partc.passes.tp import evaluate_tp, megatron_styles
from partc.passes.tp_solve import solve_tp
from partc.passes.trace import trace
from partc.runtime.testing import reference_run
from partc.sharding import GEMM_SPLIT

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


def trace_file(path: str, precision: str = "bf16"):
    spec = load_model_file(path, seq_len=S)
    with torch.device("meta"):
        args, kwargs = spec.inputs(1)
    return trace(build_on_meta(spec), args, kwargs, name=spec.name, seq_len=S, precision=precision).graph


def test_experts_split_inside_cost_a_megatron_mlp(mixtral_file, tmp_path):
    """Split inside at tp 2 (gate and up colwise in two pieces, down rowwise), the experts move what a dense
    Mistral's Megatron MLP of the same sizes moves: the output all-reduced forward, the input gradient backward;
    and, backward, the routing weights' gradient (S x k fp32 values: their product with the partial outputs is a
    partial sum). Each GPU runs half of every expert GEMM."""
    dense = tmp_path / "mistral.py"
    dense.write_text(textwrap.dedent(MIXTRAL).replace("Mixtral", "Mistral").replace(
        f", num_local_experts={E},", ",").replace(f"num_experts_per_tok={K}, ", ""))
    moe, mlp = trace_file(mixtral_file), trace_file(str(dense))
    cluster = PRESETS["h100-80g"]
    experts = moe.layers["model.layers.0.mlp.experts"]
    assert experts.inner == {"model.layers.0.mlp.experts.gate_up_proj": (1, 2),
                             "model.layers.0.mlp.experts.down_proj": (2, 1)}
    assert megatron_styles(moe)["model.layers.0.mlp.experts"] == "inner"

    def mlp_collectives(graph, prefix):
        sol = evaluate_tp(graph, 2, {f: megatron_styles(graph).get(f, "replicate") for f in graph.layers}, cluster, 1)
        return sorted((c.kind, c.phase, c.nbytes, c.src.removeprefix(prefix)) for c in sol.collectives[prefix[:-1]]
                      if c.src.startswith(prefix + "mlp") or c.src.endswith("post_attention_layernorm"))

    got = mlp_collectives(moe, "model.layers.0.")
    want = mlp_collectives(mlp, "model.layers.0.")
    assert want == [("all_reduce", "bwd", S * H * 2, "post_attention_layernorm"),
                    ("all_reduce", "fwd", S * H * 2, "mlp.down_proj")]
    assert got == sorted([("all_reduce", "bwd", S * H * 2, "post_attention_layernorm"),
                          ("all_reduce", "fwd", S * H * 2, "mlp.experts"),
                          ("all_reduce", "bwd", S * K * 4, "mlp.gate")])
    assert [g.inner_split for g in experts.gemms] == ["n", "k"]  # gate/up's n = 2I, down's k = I: FLOPs / tp
    whole = sum(hw.gemm_time(cluster, g) for g in experts.gemms)
    split = sum(hw.gemm_time(cluster, g, split=GEMM_SPLIT["inner"], degree=2) for g in experts.gemms)
    assert split < whole
    assert [hw.gemm_time(cluster, g, split="inner", degree=2) for g in experts.gemms] == \
        [hw.gemm_time(cluster, g, split=g.inner_split, degree=2) for g in experts.gemms]


def test_experts_under_sequence_parallelism_move_what_megatron_core_moves(mixtral_file):
    """Under sequence parallelism (Megatron-Core's MoE): each all-reduce of a Mixtral block becomes a reduce-scatter
    and an all-gather of the same tensor (the experts' output; the tokens before the experts and attention, the
    routing weights), twice the payload as the plan counts it; the chosen experts (S x k int64) are all-gathered
    with the tokens, and the router's and the norms' weights, applied to each rank's part of the sequence, have
    their gradients all-reduced."""
    from partc.parallel import Parallel
    from partc.passes import cost_tp
    graph = trace_file(mixtral_file)
    styles = {f: megatron_styles(graph).get(f, "replicate") for f in graph.layers}
    sol = evaluate_tp(graph, 2, styles, PRESETS["h100-80g"], 1)
    plain = Parallel(dp=1, tp=2, pp=1, zero=0, micro_batch_size=1, global_batch_size=1, precision="bf16")
    sp = Parallel(dp=1, tp=2, pp=1, zero=0, micro_batch_size=1, global_batch_size=1, precision="bf16",
                  sequence_parallel=True)
    block = graph.units[1]
    tp_colls = cost_tp.unit_collectives(graph, plain, sol, block)
    sp_colls = cost_tp.unit_collectives(graph, sp, sol, block)
    assert sorted(k for k, *_ in tp_colls) == ["all_reduce"] * 5
    assert {k for k, *_ in sp_colls} == {"all_gather", "reduce_scatter", "all_reduce"}
    norms_and_router = (2 * H + E * H) * 2  # input and post-attention RMSNorm weights, the router's [E, H], bf16
    assert sum(n for *_, n in sp_colls) == 2 * sum(n for *_, n in tp_colls) + S * K * 8 + norms_and_router
    assert ("all_gather", "fwd", S * K * 8) in sp_colls and ("all_gather", "fwd", S * K * 4) in sp_colls


def test_solver_splits_experts_when_it_pays(tmp_path, mixtral_file):
    """At a realistic width the solver splits the experts inside; at the tiny one the all-reduces cost more than
    the GEMMs they save, and tp_why says so."""
    wide = tmp_path / "wide.py"
    wide.write_text(textwrap.dedent(MIXTRAL).replace(f"hidden_size={H}", "hidden_size=1024").replace(
        f"intermediate_size={I}", "intermediate_size=4096"))
    cluster = PRESETS["h100-80g"]
    sol = solve_tp(trace_file(str(wide)), 2, cluster, 1)
    assert [sol.styles[f"model.layers.{i}.mlp.experts"] for i in range(2)] == ["inner", "inner"]
    assert "model.layers.0.mlp.experts" not in sol.why
    sol = solve_tp(trace_file(mixtral_file), 2, cluster, 1)
    assert sol.styles["model.layers.0.mlp.experts"] == "replicate"
    assert sol.why["model.layers.0.mlp.experts"] == "cost: the solver found replicate faster here than a split inside"


class PackedExperts(nn.Module):
    """Experts as Hugging Face packs them (gate and up in one parameter), and variants the split must refuse."""

    def __init__(self, variant: str = ""):
        super().__init__()
        self.variant = variant
        self.gate_up = nn.Parameter(torch.empty(4, 2 * 8, 16, dtype=torch.bfloat16))
        self.down = nn.Parameter(torch.empty(4, 16, 8, dtype=torch.bfloat16))
        if variant == "bias":
            self.bias = nn.Parameter(torch.empty(16, dtype=torch.bfloat16))
        if variant == "together":
            self.down_both = nn.Parameter(torch.empty(4, 16, 2 * 8, dtype=torch.bfloat16))

    def forward(self, x, offs, weights):
        h = torch._grouped_mm(x, self.gate_up.transpose(-2, -1), offs=offs)
        if self.variant == "bias":
            h = h + self.bias
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(torch.nn.functional.silu(gate) * up, self.down.transpose(-2, -1), offs=offs)
        if self.variant == "together":  # a product of gate and up still packed: rank r's half of each piece
            y = y + torch._grouped_mm(h, self.down_both.transpose(-2, -1), offs=offs)  # is not its half of 2I
        y = y * weights
        if self.variant == "relu":
            y = torch.relu(y)
        if self.variant == "residual":
            y = y + x
        return y.sum(0)


@pytest.mark.parametrize("variant, why", [
    ("", None),
    ("bias", "bias is not the weight of a grouped product"),
    ("relu", "aten.relu.default: op not known to be linear"),
    ("residual", "aten.add.Tensor: adds a whole tensor to a partial sum"),
    ("together", "aten._grouped_mm.default: multiplies the pieces of a packed product still together"),
])
def test_split_inside_is_proved_or_refused(variant, why):
    model = PackedExperts(variant).to("meta")
    meta = dict(device="meta")
    ep = export_on_meta(model, (torch.empty(32, 16, dtype=torch.bfloat16, **meta),
                                torch.empty(4, dtype=torch.int32, **meta),
                                torch.empty(32, 1, dtype=torch.bfloat16, **meta)), {})
    split = inner_split([n for n in ep.graph.nodes if n.op == "call_function"], param_placeholders(ep))
    if why is None:
        assert split.params == {"gate_up": (1, 2), "down": (2, 1)}
        assert sorted(split.gemms.values()) == ["k", "n"]
    else:
        assert split == why


def test_inner_on_a_plain_layer_is_refused(mixtral_file):
    graph = trace_file(mixtral_file)
    styles = {f: "replicate" for f in graph.layers}
    for fqn, why in (("model.layers.0.self_attn.q_proj", "it holds no packed weights"),
                     ("model.layers.0.mlp.gate", "it holds no packed weights")):
        with pytest.raises(PartcError, match=f"layer {fqn} .* cannot be split inside: {why}"):
            evaluate_tp(graph, 2, {**styles, fqn: "inner"}, PRESETS["h100-80g"], 1)
    with pytest.raises(PartcError, match=r"inner needs its intermediate dim \(96\) divisible by tp=5"):
        evaluate_tp(graph, 5, {**styles, "model.layers.0.mlp.experts": "inner"}, PRESETS["h100-80g"], 1)


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
        out = tmp / name
        styles = {**TP_STYLES, **INNER.get(name, {})}
        compile_program(mixtral_file, out, global_batch_size=gbs, seq_len=S,
                        # the Megatron map, set by hand as a user would (`--from-plan`)
                        tp_styles=(lambda fqn, solved: next((s for k, s in styles.items() if fqn.endswith(k)),
                                                            "replicate")) if tp > 1 else None,
                        tp=tp, pp=pp, dp=dp, zero=zero, micro_batch_size=mb, schedule="1f1b", recompute="none",
                        precision="fp32")
        # A checkpoint saved with the experts split inside (gate and up stored as pieces), after step 2 of the
        # tp2_inner run, resumes under dp 2 ZeRO-3 (the job below).
        saved = {"save": str(tmp / "ck"), "save_at": 2} if name == "tp2_inner" else {}
        jobs.append({"out": str(out), "steps": STEPS, "init": str(tmp / f"{name}.init.pt"),
                     "result": str(tmp / f"{name}.pt"), **saved, **SGD})
    jobs.append({"out": str(tmp / "dp2_z3"), "steps": 4, "load": str(tmp / "ck"), "result": str(tmp / "ck_resumed.pt"),
                 **SGD})
    run_jobs(2, jobs, tmp)
    return tmp


@pytest.mark.slow  # one torchrun launch of 2 gloo ranks
@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixtral_trains_like_one_process(runs, mixtral_file, name):
    tmp = runs
    *_, gbs = CONFIGS[name]
    init = torch.load(tmp / f"{name}.init.pt", weights_only=True)
    got = torch.load(tmp / f"{name}.pt", weights_only=True)
    losses, state = reference_once(mixtral_file, init, steps=STEPS, seed=0, global_batch_size=gbs, seq_len=S,
                                   **SGD)  # the configs share their init and batch: run once
    assert_close_losses(got["losses"], losses)
    assert_close_states(got["state"], state)
    assert any(not torch.equal(state[k], init[k]) for k in state if "experts" in k), "the experts must train"
    if name.startswith("tp"):  # what the program all-reduced is what the plan priced (experts split inside or not)
        assert assert_comm_matches_plan(tmp / name, got["comm"]) > 0
    if name in INNER:  # each rank holds its half of I of gate, of up and of down: the program ran on expert shards
        manifest = json.loads((tmp / name / "program" / "manifest.json").read_text())
        shards = {k: v for k, v in manifest["tp"]["shards"].items() if "experts" in k}
        assert shards == {f"model.layers.{i}.mlp.experts.{p}": s for i in range(2) for p, s in
                          (("gate_up_proj", {"dim": 1, "fused": 2}), ("down_proj", {"dim": 2, "fused": 1}))}


@pytest.mark.slow  # uses the runs above
def test_checkpoint_of_split_experts_resumes_unsplit(runs, mixtral_file):
    init = torch.load(runs / "tp2_inner.init.pt", weights_only=True)
    losses, state = reference_run(mixtral_file, init, steps=4, seed=0, global_batch_size=4, seq_len=S, **SGD)
    first = torch.load(runs / "tp2_inner.pt", weights_only=True)  # it saved the checkpoint after step 2
    resumed = torch.load(runs / "ck_resumed.pt", weights_only=True)
    assert resumed["start"] == 2
    assert_close_losses(first["losses"][:2] + resumed["losses"], losses)
    assert_close_states(resumed["state"], state)


@pytest.mark.slow  # uses the runs above
def test_summary_says_the_experts_are_split_inside(runs, mixtral_file):
    result = CliRunner().invoke(main, ["compile", mixtral_file, "--gpus", "2", "--seq-len", str(S), "--from-plan",
                                       str(runs / "tp2_inner.plan.json"), "-o", str(runs / "cli")])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if "experts" in line)
    assert "2 layers split inside over tp=2" in row, result.output
