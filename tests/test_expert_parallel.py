"""Expert parallelism (issue #25), the layer: Hugging Face's packed experts divided by experts among ep ranks.

`passes.experts_ep.expert_split` finds the experts' own computation and the routing around it (or says why not);
`partc.collectives.expert_parallel` sends each (token, expert) pair to its expert's rank with an uneven
``all_to_all_single`` and its result back. On 2 gloo ranks each holding 2 of 4 experts, the layer's output and every
gradient equal one process's, and with a uniform routing the bytes counted equal the cost model's."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from helpers import HF_EXPERT_MODELS, launch
from partc.collectives import expert_parallel
from partc.passes.cost_axes import ep_alltoall_bytes
from partc.passes.experts import param_placeholders
from partc.passes.experts_ep import expert_split, local_experts
from partc.passes.export import export_on_meta

T, H, I, E, K = 8, 16, 24, 4, 2


def config(**kw) -> MixtralConfig:
    return MixtralConfig(vocab_size=64, hidden_size=H, intermediate_size=I, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_local_experts=E, num_experts_per_tok=K,
                         **kw)


def split_of(precision: str = "fp32", **kw):
    """(the `expert_split` of a Mixtral MoE block's experts layer, its parameter placeholders)."""
    with torch.device("meta"):
        block = MixtralForCausalLM(config(**kw)).model.layers[0].mlp
    ep = export_on_meta(block, (torch.empty(1, T, H, device="meta"),), {}, precision=precision)
    nodes = [n for n in ep.graph.nodes if n.op == "call_function"
             and list(n.meta.get("nn_module_stack", {}).values())[-1][0].startswith("experts")]
    params = {ph: fqn for ph, fqn in param_placeholders(ep).items() if fqn.startswith("experts.")}
    return expert_split(nodes, params), params


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_split_finds_the_experts_and_their_routing(precision):
    """fp32 runs Hugging Face's `grouped_mm_fallback`, bf16 `aten._grouped_mm`: both are followed."""
    split, _ = split_of(precision)
    assert not isinstance(split, str), split
    assert split.num_experts == E and split.params == ["experts.gate_up_proj", "experts.down_proj"]
    products = [n for n in split.local if "grouped_mm" in str(n.target)]
    assert len(products) == 2 and split.last is products[-1]
    assert (split.hidden.meta["val"].shape, split.index.meta["val"].shape) == ((T, H), (T, K))


def test_a_routing_it_cannot_follow_is_refused(monkeypatch):
    """Experts whose output adds the token itself back: not a weighted sum of the experts' results, so the layer
    cannot be computed where the experts live; refused in one line."""
    from transformers.models.mixtral import modeling_mixtral

    forward = modeling_mixtral.MixtralExperts.forward
    monkeypatch.setattr(modeling_mixtral.MixtralExperts, "forward",
                        lambda self, h, idx, w: forward(self, h, idx, w) + h)
    split, _ = split_of()
    assert split == "aten.add.Tensor after the experts: not a weighted sum of each token's k results"


def test_one_rank_computes_the_layer():
    torch.manual_seed(0)
    experts = MixtralForCausalLM(config()).model.layers[0].mlp.experts
    split, params = split_of()
    fn = local_experts(split, params)
    weights = [dict(experts.named_parameters())[f.removeprefix("experts.")] for f in split.params]
    h, w = torch.randn(T, H), torch.rand(T, K)
    idx = torch.randint(0, E, (T, K))
    got = expert_parallel(h, idx, w, fn, *weights, num_experts=E)
    torch.testing.assert_close(got, experts(h, idx, w), rtol=0, atol=0)


def test_the_layer_returns_the_tokens_dtype():
    """Under bf16 the routing weights stay fp32 (Mixtral's router takes its softmax in fp32) and each result
    scaled by one is fp32: Hugging Face casts the sum back to the tokens' bf16, and so does `expert_parallel`.
    Returned in fp32, it left the residual stream after the first experts layer in fp32: twice the bytes a
    pipeline stage sends (measured by `partc check` at pp 2: 18 KiB against the plan's 10 KiB) and keeps."""
    torch.manual_seed(0)
    experts = MixtralForCausalLM(config()).model.layers[0].mlp.experts.to(torch.bfloat16)
    grouped = torch.ops.transformers.grouped_mm_fallback

    def fn(rows, offsets, gate_up, down):  # the split's computation (`local_experts`), in the dtype it is given
        gate, up = grouped(rows, gate_up.transpose(-2, -1), offsets).chunk(2, -1)
        return grouped(torch.nn.functional.silu(gate) * up, down.transpose(-2, -1), offsets)
    weights = [experts.gate_up_proj, experts.down_proj]
    h, w = torch.randn(T, H, dtype=torch.bfloat16), torch.rand(T, K)
    idx = torch.randint(0, E, (T, K))
    want = experts(h, idx, w)
    assert want.dtype == torch.bfloat16
    torch.testing.assert_close(expert_parallel(h, idx, w, fn, *weights, num_experts=E), want, rtol=0, atol=0)
    meta = expert_parallel(h.to("meta"), idx.to("meta"), w.to("meta"), fn, *(p.to("meta") for p in weights),
                           num_experts=E)
    assert meta.dtype == torch.bfloat16


WORKER = """
    import json, sys
    import torch
    import torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from test_expert_parallel import E, H, K, T, config, split_of, routing
    from transformers import MixtralForCausalLM
    from partc.collectives import expert_parallel
    from partc.passes.experts_ep import local_experts
    from partc.runtime.comm import CommCounter

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ep = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    experts = MixtralForCausalLM(config()).model.layers[0].mlp.experts
    split, params = split_of()
    fn = local_experts(split, params)
    mine = slice(rank * E // ep, (rank + 1) * E // ep)
    local = [torch.nn.Parameter(dict(experts.named_parameters())[f.removeprefix("experts.")][mine].clone())
             for f in split.params]
    out = {{}}
    for name in ("uniform", "skewed"):
        h, idx, w, g = routing(name, rank)
        h.requires_grad_(), w.requires_grad_()
        counter = CommCounter({{"ep": [dist.group.WORLD]}})
        with counter.counting() as counted:
            y = expert_parallel(h, idx, w, fn, *local, num_experts=E, group=dist.group.WORLD)
            (y * g).sum().backward()
        out[name] = {{"y": y.tolist(), "h": h.grad.tolist(), "w": w.grad.tolist(), "bytes": dict(counted),
                      "params": [p.grad.tolist() for p in local]}}
        for p in local:
            p.grad = None
    json.dump(out, open({result!r} + f".{{rank}}.json", "w"))
    dist.destroy_process_group()
"""


def routing(name: str, rank: int):
    """Rank `rank`'s tokens, the experts they chose, their weights and the gradient of the output. ``uniform``:
    every token picks one expert of each rank's two (so half of each rank's pairs stay and half leave);
    ``skewed``: random, uneven splits."""
    gen = torch.Generator().manual_seed(100 + rank)
    h, w, g = torch.randn(T, H, generator=gen), torch.rand(T, K, generator=gen), torch.randn(T, H, generator=gen)
    if name == "uniform":
        idx = torch.stack([torch.arange(T) % 2, 2 + (torch.arange(T) + rank) % 2], dim=1)
    else:
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        idx[: T // 2] = torch.tensor([0, 1])  # most pairs go to rank 0's experts
    return h, idx, w, g


@pytest.mark.slow  # one launch of 2 gloo ranks
def test_two_ranks_compute_the_layer_like_one(tmp_path):
    """ep = 2, each rank holding 2 of the 4 experts: the output, the tokens' and routing weights' gradients and the
    experts' gradients (summed over the ranks' tokens) equal one process's within 1e-5; the uniform routing's bytes
    equal `ep_alltoall_bytes`, the skewed one's differ from it."""
    from pathlib import Path
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(WORKER.format(tests=str(Path(__file__).parent), result=str(tmp_path / "out"))))
    launch(2, [str(worker)])
    got = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(2)]
    torch.manual_seed(0)
    experts = MixtralForCausalLM(config()).model.layers[0].mlp.experts
    names = [f.removeprefix("experts.") for f in split_of()[0].params]
    for name in ("uniform", "skewed"):
        experts.zero_grad()
        for rank in range(2):
            h, idx, w, g = routing(name, rank)
            h.requires_grad_(), w.requires_grad_()
            y = experts(h, idx, w)
            (y * g).sum().backward()
            mine = got[rank][name]
            torch.testing.assert_close(torch.tensor(mine["y"]), y, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(torch.tensor(mine["h"]), h.grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(torch.tensor(mine["w"]), w.grad, rtol=1e-5, atol=1e-6)
        full = dict(experts.named_parameters())
        for i, n in enumerate(names):  # each rank holds the gradient of its experts from both ranks' tokens
            whole = torch.cat([torch.tensor(got[r][name]["params"][i]) for r in range(2)])
            torch.testing.assert_close(whole, full[n].grad, rtol=1e-5, atol=1e-6)
    want = ep_alltoall_bytes(T, K, H, 4, 2, E)
    assert [got[r]["uniform"]["bytes"] for r in range(2)] == [{"ep": want}] * 2
    assert got[0]["skewed"]["bytes"]["ep"] != want


FAMILIES = {
    # DeepSeek-V3: group-limited routing (8 routed experts in 2 groups, the top group kept), a shared expert and a
    # dense first layer; the routed experts of its second layer are divided
    "deepseek_v3": ("DeepseekV3", dict(intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
                                       first_k_dense_replace=1, num_key_value_heads=2, n_routed_experts=8,
                                       n_shared_experts=1, n_group=2, topk_group=1, q_lora_rank=8, kv_lora_rank=8,
                                       qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)),
    "qwen3_moe": ("Qwen3Moe", dict(intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1,
                                   num_key_value_heads=1, num_experts=8)),
    "olmoe": ("Olmoe", dict(intermediate_size=8, num_hidden_layers=1, num_key_value_heads=1, num_experts=8,
                            eos_token_id=None, pad_token_id=None)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_families_are_followed(family):
    """Hugging Face's other packed experts (8 experts, top 2): the split is found and computes the layer."""
    import transformers

    prefix, kw = FAMILIES[family]
    make = lambda: getattr(transformers, f"{prefix}ForCausalLM")(getattr(transformers, f"{prefix}Config")(
        vocab_size=64, hidden_size=H, num_attention_heads=2, num_experts_per_tok=K, **kw))
    torch.manual_seed(0)
    experts = make().model.layers[-1].mlp.experts
    with torch.device("meta"):
        block = make().model.layers[-1].mlp
    ep = export_on_meta(block, (torch.empty(1, T, H, device="meta"),), {}, precision="fp32")
    nodes = [n for n in ep.graph.nodes if n.op == "call_function"
             and list(n.meta.get("nn_module_stack", {}).values())[-1][0].startswith("experts")]
    params = {ph: fqn for ph, fqn in param_placeholders(ep).items() if fqn.startswith("experts.")}
    split = expert_split(nodes, params)
    assert not isinstance(split, str), split
    assert split.num_experts == 8
    fn = local_experts(split, params)
    weights = [dict(experts.named_parameters())[f.removeprefix("experts.")] for f in split.params]
    h, w = torch.randn(T, H), torch.rand(T, K)
    idx = torch.stack([torch.randperm(8)[:K] for _ in range(T)])
    got = expert_parallel(h, idx, w, fn, *weights, num_experts=8)
    torch.testing.assert_close(got, experts(h, idx, w), rtol=0, atol=0)


def test_gpt_oss_expert_biases_are_refused():
    """gpt-oss adds a bias per expert, looked up by each row's expert id: the ids of the rows an ep rank receives
    are not followed yet, so the layer is refused in one line rather than divided wrongly."""
    from transformers import GptOssConfig, GptOssForCausalLM

    with torch.device("meta"):
        block = GptOssForCausalLM(GptOssConfig(vocab_size=64, hidden_size=H, intermediate_size=8, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, num_local_experts=E,
                                               num_experts_per_tok=K, head_dim=8)).model.layers[0].mlp
    ep = export_on_meta(block, (torch.empty(1, T, H, device="meta"),), {}, precision="fp32")
    nodes = [n for n in ep.graph.nodes if n.op == "call_function"
             and list(n.meta.get("nn_module_stack", {}).values())[-1][0].startswith("experts")]
    params = {ph: fqn for ph, fqn in param_placeholders(ep).items() if fqn.startswith("experts.")}
    split = expert_split(nodes, params)
    assert isinstance(split, str) and split.startswith("the experts' computation reads "), split


# -- the whole model, trained under ep ----------------------------------------------------------------------------

MODELS = {
    "mixtral": HF_EXPERT_MODELS["mixtral"],
    # DeepSeek-V3's layout: a dense first layer, then 8 fine-grained routed experts in 2 groups (group-limited
    # routing: the top group's experts only) beside a shared expert
    "deepseek_v3": """
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        def model():
            return DeepseekV3ForCausalLM(DeepseekV3Config(
                vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                max_position_embeddings=128))
    """,
}
UNIFORM = """
    import torch
    from torch import nn
    from transformers import MixtralConfig, MixtralForCausalLM


    class UniformRouter(nn.Module):
        \"\"\"Token t picks experts t % E and (t + 1) % E: every expert gets the same share of every rank's tokens.\"\"\"

        def __init__(self, hidden, num_experts, top_k):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
            self.num_experts, self.top_k = num_experts, top_k

        def forward(self, h):
            logits = nn.functional.linear(h, self.weight)
            t = torch.arange(h.shape[0], device=h.device)
            index = torch.stack([(t + j) % self.num_experts for j in range(self.top_k)], dim=-1)
            return logits, torch.softmax(logits.gather(1, index), dim=-1), index


    def model():
        m = MixtralForCausalLM(MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128))
        for layer in m.model.layers:
            layer.mlp.gate = UniformRouter(64, 4, 2)
        return m
"""
# Mixtures of experts as plain PyTorch writes them (`passes.experts_routed.routed_splits`): an nn.ModuleList of expert
# modules, routed with nonzero(choice == e) and combined with index_add. "user_moe" is tests/user_models.py's (top-1,
# index_select, index_add); "swiglu_top2" a second layout (SwiGLU experts without biases, top-2 renormalized, the
# rows gathered by x[tok], the weights by weight[tok, slot], in-place index_add_).
PLAIN = {
    "swiglu_top2": """
        import torch
        import torch.nn.functional as F
        from torch import nn


        class Expert(nn.Module):
            def __init__(self):
                super().__init__()
                self.w1 = nn.Linear(16, 32, bias=False)
                self.w2 = nn.Linear(32, 16, bias=False)
                self.w3 = nn.Linear(16, 32, bias=False)

            def forward(self, x):
                return self.w2(F.silu(self.w1(x)) * self.w3(x))


        class MoE(nn.Module):
            def __init__(self):
                super().__init__()
                self.gate = nn.Linear(16, 4, bias=False)
                self.experts = nn.ModuleList(Expert() for _ in range(4))

            def forward(self, x):
                flat = x.reshape(-1, 16)
                weight, choice = self.gate(flat).softmax(-1).topk(2, dim=-1)
                weight = weight / weight.sum(-1, keepdim=True)
                out = torch.zeros_like(flat)
                for e, expert in enumerate(self.experts):
                    hit = torch.nonzero(choice == e)
                    tok, slot = hit[:, 0], hit[:, 1]
                    out.index_add_(0, tok, expert(flat[tok]) * weight[tok, slot, None])
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
}
PLAIN_RUNS = ("ep2", "ep2_dp2_z1")
UNIFORM_PLAIN = ("weight, choice = self.router(flat).softmax(-1).max(-1)",
                 "t = torch.arange(flat.shape[0], device=flat.device)\n"
                 "        uniform = (t.unsqueeze(-1) % 4 == torch.arange(4, device=flat.device)) * 10.0\n"
                 "        weight, choice = (self.router(flat) * 0.0 + uniform).softmax(-1).max(-1)")
"""The user MoE's router made uniform: token t of a micro-batch picks expert t % 4 (12 tokens: 3 for each)."""
SKEWED = UNIFORM.replace('''\"\"\"Token t picks experts t % E and (t + 1) % E: every expert gets the same share of every rank's tokens.\"\"\"''',
                         '''\"\"\"Token t picks expert 0 and expert 1 + t % 4 % 3 (the same for any batch of sequences of 16):
        expert 0 gets half of every rank's (token, expert) pairs, the busiest of 4 ep ranks (one expert each)
        twice the mean.\"\"\"''').replace(
    "index = torch.stack([(t + j) % self.num_experts for j in range(self.top_k)], dim=-1)",
    "index = torch.stack([torch.zeros_like(t), 1 + t % 4 % 3], dim=-1)").replace("UniformRouter", "SkewedRouter")
S, GBS, STEPS = 16, 4, 3
RUNS = {  # name -> (ranks, pins): ep is carved from dp (dp 4 ep 2: two ep groups, each expert held by 2 ranks,
    # which ZeRO shards them over)
    "ep2": (2, dict(dp=2, pp=1, zero=1)),
    # 2 micro-batches: the sharded experts' gradients accumulate (ZeRO-1) or are reduced after each (ZeRO 2, 3)
    "ep2_dp2_z1": (4, dict(dp=4, pp=1, zero=1, global_batch_size=2 * GBS)),
    "ep2_dp2_z2": (4, dict(dp=4, pp=1, zero=2, global_batch_size=2 * GBS)),
    "ep2_dp2_z3": (4, dict(dp=4, pp=1, zero=3, global_batch_size=2 * GBS)),
    "ep2_pp2": (4, dict(dp=2, pp=2, zero=1)),
}
SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0}
UNIFORM_CP = UNIFORM.replace("return logits, torch.softmax(logits.gather(1, index), dim=-1), index",
                             "return logits, torch.softmax(logits[:, :self.top_k], dim=-1), index")
"""The uniform router without its gather along the experts (context parallelism refuses a gather of a tensor
holding the sequence): the token at (global) position t still picks experts t % E and (t + 1) % E, and each cp rank's
chunks hold every residue mod 4 equally often."""
CP_RUNS = {  # ep under cp, 4 ranks: dp 2 carved into one ep group of 2 at each cp coordinate; the 2 cp ranks hold
    # the same experts, their gradients reduced over them (ZeRO-0: all-reduced; ZeRO-3: sharded by FSDP)
    "mixtral_ep2_cp2_z3": ("mixtral", dict(ep=2, zero=3)),
    "uniform_ep2_cp2_z0": ("uniform_cp", dict(ep=2, zero=0)),
    # and without ep: the experts layer, sorting and gathering its tokens by expert, is per token (cp proves it
    # from the routing `passes.experts` follows)
    "mixtral_cp2": ("mixtral", dict(ep=1, zero=1)),
}


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    from user_models import write_user_model

    tmp = tmp_path_factory.mktemp("ep_models")
    for name, text in {**MODELS, **PLAIN}.items():
        (tmp / f"{name}.py").write_text(textwrap.dedent(text))
    files = {name: str(tmp / f"{name}.py") for name in {**MODELS, **PLAIN}}
    files["user_moe"] = write_user_model(tmp, "moe")
    uniform = tmp / "user_moe_uniform.py"
    text = Path(files["user_moe"]).read_text()
    assert UNIFORM_PLAIN[0] in text
    uniform.write_text(text.replace(*UNIFORM_PLAIN))
    files["user_moe_uniform"] = str(uniform)
    return files


@pytest.fixture(scope="module")
def runs(model_files, tmp_path_factory):
    """Every (model, configuration) trained in two torchrun launches: 2 ranks, then 4."""
    from helpers import compile_program, run_jobs
    from partc.model_file import load_model_file

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("ep_runs")
    jobs: dict[int, list[dict]] = {}
    for model, path in ((m, model_files[m]) for m in MODELS):
        torch.manual_seed(1234)
        torch.save(load_model_file(path, seq_len=S).build().state_dict(), tmp / f"{model}.init.pt")
        for name, (ranks, pins) in RUNS.items():
            out = tmp / f"{model}_{name}"
            compile_program(path, out, seq_len=S, tp=1, ep=2, micro_batch_size=1, schedule="1f1b",
                            recompute="none", precision="fp32", **{"global_batch_size": GBS, **pins})
            jobs.setdefault(ranks, []).append({"out": str(out), "steps": STEPS, "init": str(tmp / f"{model}.init.pt"),
                                               "result": str(tmp / f"{model}_{name}.pt"), **SGD})
    for model in ("user_moe", *PLAIN):  # plain-PyTorch experts (tokens from the model's own example_inputs)
        path = model_files[model]
        torch.manual_seed(1234)
        torch.save(load_model_file(path).build().state_dict(), tmp / f"{model}.init.pt")
        for name in PLAIN_RUNS:
            ranks, pins = RUNS[name]
            out = tmp / f"{model}_{name}"
            compile_program(path, out, tp=1, ep=2, micro_batch_size=1, schedule="1f1b", recompute="none",
                            precision="fp32", **{"global_batch_size": GBS, **pins})
            jobs[ranks].append({"out": str(out), "steps": STEPS, "init": str(tmp / f"{model}.init.pt"),
                                "result": str(tmp / f"{model}_{name}.pt"), **SGD})
    compile_program(model_files["user_moe_uniform"], tmp / "plain_uniform_ep2", global_batch_size=GBS, tp=1, ep=2,
                    dp=2, pp=1, zero=1, micro_batch_size=2, schedule="1f1b", recompute="none", precision="fp32")
    jobs[2].append({"out": str(tmp / "plain_uniform_ep2"), "steps": 2, "result": str(tmp / "plain_uniform_ep2.pt"),
                    **SGD})
    uniform = tmp / "uniform.py"  # the router made uniform: the all-to-all bytes are the plan's exactly
    uniform.write_text(textwrap.dedent(UNIFORM))
    compile_program(str(uniform), tmp / "uniform_ep2", global_batch_size=GBS, seq_len=S, tp=1, ep=2, dp=2, pp=1,
                    zero=1, micro_batch_size=1, schedule="1f1b", recompute="none", precision="fp32")
    jobs[2].append({"out": str(tmp / "uniform_ep2"), "steps": 2, "result": str(tmp / "uniform_ep2.pt"),
                    "records": True, **SGD})
    skewed = tmp / "skewed.py"  # the router made skewed: ep rank 0 receives twice the mean rows, as the plan prices
    skewed.write_text(textwrap.dedent(SKEWED))
    torch.manual_seed(1234)
    torch.save(load_model_file(str(skewed), seq_len=S).build().state_dict(), tmp / "skewed.init.pt")
    compile_program(str(skewed), tmp / "skewed_ep4", global_batch_size=2 * GBS, seq_len=S, tp=1, ep=4, dp=4, pp=1,
                    zero=1, micro_batch_size=1, schedule="1f1b", recompute="none", precision="fp32",
                    expert_imbalance=2.0)
    jobs[4].append({"out": str(tmp / "skewed_ep4"), "steps": 2, "init": str(tmp / "skewed.init.pt"),
                    "result": str(tmp / "skewed_ep4.pt"), "records": True, **SGD})
    uniform_cp = tmp / "uniform_cp.py"
    uniform_cp.write_text(textwrap.dedent(UNIFORM_CP))
    torch.manual_seed(1234)
    torch.save(load_model_file(str(uniform_cp), seq_len=S).build().state_dict(), tmp / "uniform_cp.init.pt")
    for name, (model, pins) in CP_RUNS.items():
        path = model_files[model] if model in model_files else str(uniform_cp)
        compile_program(path, tmp / name, global_batch_size=GBS, seq_len=S, tp=1, dp=2, cp=2, pp=1,
                        micro_batch_size=1, schedule="1f1b", recompute="none", precision="fp32", **pins)
        jobs[4].append({"out": str(tmp / name), "steps": STEPS, "init": str(tmp / f"{model}.init.pt"),
                        "result": str(tmp / f"{name}.pt"), **SGD})
    for ranks, batch in sorted(jobs.items()):
        run_jobs(ranks, batch, tmp)
    return tmp


@pytest.mark.slow  # two torchrun launches (2 and 4 gloo ranks)
@pytest.mark.parametrize("name", list(RUNS))
@pytest.mark.parametrize("model", list(MODELS))
def test_trains_like_one_process(runs, model_files, model, name):
    """Each rank holds 2 of Mixtral's 4 experts (4 of DeepSeek-V3's 8 routed ones) of every MoE layer; losses and
    the gathered weights after 3 SGD steps equal one process's within 1e-5 (fp32)."""
    from helpers import assert_close_losses, assert_close_states
    from partc.runtime.testing import reference_run

    init = torch.load(runs / f"{model}.init.pt", weights_only=True)
    got = torch.load(runs / f"{model}_{name}.pt", weights_only=True)
    losses, state = reference_run(model_files[model], init, steps=STEPS, seed=0, seq_len=S, **SGD,
                                  global_batch_size=RUNS[name][1].get("global_batch_size", GBS))
    assert_close_losses(got["losses"], losses)
    assert_close_states(got["state"], state)
    assert any(not torch.equal(state[k], init[k]) for k in state if "experts.gate_up_proj" in k), "experts train"
    manifest = json.loads((runs / f"{model}_{name}" / "program" / "manifest.json").read_text())
    moe_layers = {"mixtral": [0, 1], "deepseek_v3": [1]}[model]  # DeepSeek-V3's first layer is dense
    assert manifest["ep"] == {"degree": 2, "experts": sorted(f"model.layers.{i}.mlp.experts.{p}" for i in moe_layers
                                                              for p in ("down_proj", "gate_up_proj"))}
    # every rank sends tokens to the other's experts; under pp 2 the ranks of the stages holding an MoE layer
    senders = [step[r].get("ep", 0) > 0 for step in got["comm"] for r in range(len(step))]
    assert all(senders) if RUNS[name][1]["pp"] == 1 else any(senders), got["comm"]
    if RUNS[name][1]["pp"] == 1:  # dp: FSDP's traffic, the experts' over the dp / ep ranks holding them (ZeRO)
        dp = json.loads((runs / f"{model}_{name}" / "plan.json").read_text())["predicted"]["ranks"][0]["comm_bytes"]["dp"]
        assert [r["dp"] for step in got["comm"] for r in step] == [dp] * len(got["comm"]) * RUNS[name][0]


@pytest.mark.slow  # uses the launches above
@pytest.mark.parametrize("name", PLAIN_RUNS)
@pytest.mark.parametrize("model", ["user_moe", *PLAIN])
def test_plain_experts_train_like_one_process(runs, model_files, model, name):
    """A mixture of experts written in plain PyTorch: each rank holds 2 of the 4 expert modules (their parameters
    nowhere else), tokens travel to them and back; losses and the gathered weights after 3 SGD steps equal one
    process's within 1e-5 (fp32), and the data-parallel bytes the plan's in every step."""
    from helpers import assert_close_losses, assert_close_states
    from partc.runtime.testing import reference_run

    init = torch.load(runs / f"{model}.init.pt", weights_only=True)
    got = torch.load(runs / f"{model}_{name}.pt", weights_only=True)
    losses, state = reference_run(model_files[model], init, steps=STEPS, seed=0, **SGD,
                                  global_batch_size=RUNS[name][1].get("global_batch_size", GBS))
    assert_close_losses(got["losses"], losses)
    assert_close_states(got["state"], state)
    assert all(not torch.equal(state[k], init[k]) for k in state if k.startswith("moe.experts.")), "experts train"
    manifest = json.loads((runs / f"{model}_{name}" / "program" / "manifest.json").read_text())
    assert manifest["ep"]["routed"] == {f"moe.experts.{e}": e // 2 for e in range(4)}
    plan = json.loads((runs / f"{model}_{name}" / "plan.json").read_text())["predicted"]["ranks"][0]["comm_bytes"]
    assert all(r["ep"] > 0 for step in got["comm"] for r in step), got["comm"]
    assert [r["dp"] for step in got["comm"] for r in step] == [plan["dp"]] * len(got["comm"]) * RUNS[name][0]


@pytest.mark.slow  # uses the runs above
def test_uniform_routing_sends_the_planned_bytes(runs):
    """With every expert getting the same share of every rank's tokens, each rank's measured all-to-all bytes in
    every step equal the plan's ``predicted.ranks[].comm_bytes.ep`` (`passes.cost_axes.ep_bytes`): per MoE layer and
    micro-batch, half of the 16 x 2 (token, expert) rows of 64 fp32 leave, there and back, forward and backward, and
    half of the 4 split counts."""
    plan = json.loads((runs / "uniform_ep2" / "plan.json").read_text())
    want = plan["predicted"]["ranks"][0]["comm_bytes"]["ep"]
    assert plan["predicted"]["expert_routing"].startswith("uniform")
    assert want == 2 * 2 * (16 * 64 * 4 * 2 * 2 + 2 * 8)  # 2 layers x 2 micro-batches
    got = torch.load(runs / "uniform_ep2.pt", weights_only=True)
    assert [r["ep"] for step in got["comm"] for r in step] == [want] * 4
    # dp: FSDP's traffic of everything else; the experts' gradients are reduced over dp / ep = 1 rank: nothing
    dp = plan["predicted"]["ranks"][0]["comm_bytes"]["dp"]
    assert [r["dp"] for step in got["comm"] for r in step] == [dp] * 4


@pytest.mark.slow  # uses the runs above
def test_skewed_routing_sends_and_computes_as_planned(runs):
    """ep 4, one expert a rank, the router sending half of every rank's (token, expert) pairs to expert 0, and the
    plan priced at ``--expert-imbalance 2``: rank 0 (the busiest) receives twice the mean rows, and its measured
    all-to-all bytes equal the plan's in every step (`ep_alltoall_bytes` at F 2: of its 32 rows a micro-batch, 16
    leave for the other experts and the 48 it received from the others go back, there and back again in backward;
    uniform routing would be 48 in all). The step records show the measured imbalance (2.0) next to the plan's;
    with the uniform router of the ep 2 run, 1.0. It trains like one process (ep 4 holds one expert a rank)."""
    from helpers import assert_close_losses
    from partc.runtime.__main__ import expert_imbalance
    from partc.runtime.testing import reference_run

    plan = json.loads((runs / "skewed_ep4" / "plan.json").read_text())
    assert plan["parallel"]["expert_imbalance"] == 2.0 and plan["predicted"]["expert_routing"].startswith("skewed")
    want = plan["predicted"]["ranks"][0]["comm_bytes"]["ep"]
    rows = 16 * 2  # a micro-batch's (token, expert) pairs on a rank
    assert want == 2 * 2 * (rows * (1 - 2 / 4 + 2 * 3 / 4) * 64 * 4 * 2 + 4 * 8 * 3 / 4)  # 2 layers x 2 micro-batches
    assert want > 2 * 2 * (rows * 2 * 3 / 4 * 64 * 4 * 2 + 4 * 8 * 3 / 4)  # more than under uniform routing
    got = torch.load(runs / "skewed_ep4.pt", weights_only=True)
    assert [step[0]["ep"] for step in got["comm"]] == [want] * 2
    assert all(step[r]["ep"] < want for step in got["comm"] for r in (1, 2, 3)), got["comm"]
    for records in got["records"]:
        assert [r["expert_rows"] for r in records] == [2 * 2 * 64, 2 * 2 * 32, 2 * 2 * 16, 2 * 2 * 16]
        assert [r["expert_imbalance"] for r in records] == [2.0] * 4
        assert expert_imbalance(records) == {"expert_imbalance": 2.0, "predicted_expert_imbalance": 2.0}
    uniform = torch.load(runs / "uniform_ep2.pt", weights_only=True)["records"]
    assert [expert_imbalance(records) for records in uniform] == [
        {"expert_imbalance": 1.0, "predicted_expert_imbalance": 1.0}] * 2
    losses, _ = reference_run(str(runs / "skewed.py"), torch.load(runs / "skewed.init.pt", weights_only=True),
                              steps=2, seed=0, seq_len=S, **SGD, global_batch_size=2 * GBS)
    assert_close_losses(got["losses"], losses)


@pytest.mark.slow  # uses the launches above
@pytest.mark.parametrize("name", list(CP_RUNS))
def test_ep_under_cp_trains_like_one_process(runs, model_files, name):
    """dp 2 x cp 2, ep 2 carved from dp at each cp coordinate: each cp rank routes its own s/cp tokens to its ep
    group's experts, and the experts' gradients are reduced over the ``dp / ep`` x ``cp`` = 2 cp ranks holding the
    same experts (under ZeRO-0 all-reduced, under ZeRO-3 sharded over them by FSDP). Losses and the gathered
    weights after 3 SGD steps equal one process's within 1e-5 (fp32): reduced over ``dp / ep`` alone (one rank), the
    experts' gradients would miss the other cp rank's tokens. Every rank's bytes on dp, cp and tp are the plan's, and
    with the uniform router its ep bytes too (each rank routes its 8 tokens: half of its 16 (token, expert) rows
    leave)."""
    from helpers import assert_close_losses, assert_close_states, assert_comm_matches_plan, reference_once

    model = CP_RUNS[name][0]
    path = model_files[model] if model in model_files else str(runs / "uniform_cp.py")
    init = torch.load(runs / f"{model}.init.pt", weights_only=True)
    got = torch.load(runs / f"{name}.pt", weights_only=True)
    losses, state = reference_once(path, init, steps=STEPS, seed=0, seq_len=S, **SGD, global_batch_size=GBS)
    assert_close_losses(got["losses"], losses)
    assert_close_states(got["state"], state)
    assert any(not torch.equal(state[k], init[k]) for k in state if "experts.gate_up_proj" in k), "experts train"
    uniform = model == "uniform_cp"  # a real router sends other bytes than the uniform routing priced
    assert assert_comm_matches_plan(runs / name, got["comm"], rtol=0.0,
                                    axes=None if uniform else ("pp", "dp", "cp", "tp")) > 0
    plan = json.loads((runs / name / "plan.json").read_text())
    assert plan["parallel"]["cp"] == 2 and plan["parallel"]["ep"] == CP_RUNS[name][1]["ep"]
    if plan["parallel"]["ep"] == 1:
        return
    want = plan["predicted"]["ranks"][0]["comm_bytes"]
    assert want["ep"] == 2 * 2 * (8 * 2 * 64 * 4 * 2 + 2 * 8)  # 2 layers x 2 micro-batches; 8 tokens a rank
    assert all(r["ep"] > 0 for step in got["comm"] for r in step), got["comm"]


def check_rows(out: Path) -> dict[str, dict]:
    """`partc check OUT --format json` on pipeline rank 0: it agrees; its rows by what they measure."""
    from click.testing import CliRunner

    from partc.cli.main import main

    result = CliRunner().invoke(main, ["check", str(out), "--format", "json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["agrees"], result.output
    return {row["what"]: row for row in record["ranks"][0]["rows"]}


@pytest.mark.slow  # `partc check` of the plan above (one process, fake tensors)
def test_check_agrees_on_an_ep_plan(runs):
    rows = check_rows(runs / "uniform_ep2")
    assert rows["comm ep"]["measured"] == rows["comm ep"]["predicted"] > 0
    assert rows["comm dp"]["measured"] == rows["comm dp"]["predicted"]
    # plain-PyTorch experts, their router made uniform: the all-to-all bytes measured in training and by the check
    plan = json.loads((runs / "plain_uniform_ep2" / "plan.json").read_text())["predicted"]["ranks"][0]["comm_bytes"]
    assert plan["ep"] == 12 * 16 * 4 * 2 + 2 * 8  # 12 rows a micro-batch, half leave, there and back, twice
    got = torch.load(runs / "plain_uniform_ep2.pt", weights_only=True)
    assert [r["ep"] for step in got["comm"] for r in step] == [plan["ep"]] * 4
    assert [r["dp"] for step in got["comm"] for r in step] == [plan["dp"]] * 4
    rows = check_rows(runs / "plain_uniform_ep2")
    assert rows["comm ep"]["measured"] == rows["comm ep"]["predicted"] == plan["ep"]
    assert rows["comm dp"]["measured"] == rows["comm dp"]["predicted"]
    # dp 4 ep 2 ZeRO-1: each expert module sharded over the 2 ranks holding it (the other 2 experts nowhere on the
    # rank); the optimizer row within Adam's step counters (4 bytes a tensor, not priced)
    rows = check_rows(runs / "user_moe_ep2_dp2_z1")
    assert rows["comm dp"]["measured"] == rows["comm dp"]["predicted"] > 0
    assert rows["memory params"]["measured"] == pytest.approx(rows["memory params"]["predicted"], rel=1e-3)
    assert rows["memory optimizer"]["measured"] == pytest.approx(rows["memory optimizer"]["predicted"], rel=1e-2)
    # the skewed plan (ep 4, F 2): the check routes its fake tokens as the plan prices them and measures the busiest
    rows = check_rows(runs / "skewed_ep4")
    assert rows["comm ep"]["measured"] == rows["comm ep"]["predicted"] == json.loads(
        (runs / "skewed_ep4" / "plan.json").read_text())["predicted"]["ranks"][0]["comm_bytes"]["ep"]
    # ep 2 under cp 2 (dp 2): the experts' gradients over the 2 cp ranks holding them; ZeRO-0 all-reduces them,
    # ZeRO-3 shards them (and the other parameters over dp x cp); every axis's bytes as planned
    for name in ("uniform_ep2_cp2_z0", "mixtral_ep2_cp2_z3"):
        rows = check_rows(runs / name)
        for axis in ("dp", "cp", "ep"):
            assert rows[f"comm {axis}"]["measured"] == rows[f"comm {axis}"]["predicted"] > 0, (name, axis)
        assert rows["memory optimizer"]["measured"] == pytest.approx(rows["memory optimizer"]["predicted"], rel=1e-3)
    for what in ("memory params", "memory grads"):  # ZeRO-3: weights and gradients sharded as planned
        assert rows[what]["measured"] == pytest.approx(rows[what]["predicted"], rel=1e-3), what
    # dp 4 ep 2, ZeRO-1 and ZeRO-3: the experts sharded over the 2 ranks holding them, states and traffic as planned
    for name in ("mixtral_ep2_dp2_z1", "mixtral_ep2_dp2_z3"):
        rows = check_rows(runs / name)
        assert rows["comm dp"]["measured"] == rows["comm dp"]["predicted"] > 0
        for what in ("memory params", "memory optimizer"):  # the sharded experts' (and the gathered ones' below
            assert rows[what]["measured"] == pytest.approx(rows[what]["predicted"], rel=1e-3), what  # ZeRO-3)


@pytest.mark.slow  # compiles and `partc check`s of 8 ranks' plans
def test_check_agrees_on_experts_padded_by_fsdp(tmp_path, model_files):
    """dp 8, ep 2: each rank's 2 of Mixtral's 4 experts are sharded over the 4 ranks holding them, and FSDP cuts
    dim 0 (the experts), padded to 4 rows: each rank holds a whole expert of the padded tensor (half its experts,
    not a quarter), and under ZeRO 1 and 2 gathers the 4 padded rows. The plan prices the padded tensor
    (`cost_axes.expert_state_bytes`); `partc check` measures the same model states (it measured 62% more optimizer
    states than the plan priced unpadded). At ep 1 the 4 experts are in the ordinary dp groups, padded to 8 rows:
    each rank holds a whole expert (a quarter of them, not an eighth), priced padded as every parameter is
    (`zero.model_state_bytes`; `partc check` measured 62% more weights and optimizer states under ZeRO-3 than the
    plan priced unpadded), and ZeRO-3 gathers two layers of 8 padded rows at a time (`zero.working_bytes`: it
    measured 25% more activations than the plan priced them unpadded)."""
    from helpers import compile_program

    for ep, zero in ((2, 1), (2, 2), (1, 1), (1, 3)):
        out = tmp_path / f"ep{ep}_z{zero}"
        compile_program(model_files["mixtral"], out, global_batch_size=8, seq_len=S, tp=1, ep=ep, dp=8, pp=1,
                        zero=zero, micro_batch_size=1, schedule="1f1b", recompute="none", precision="bf16")
        rows = check_rows(out)
        for what in ("memory params", "memory grads", "memory optimizer"):
            assert rows[what]["measured"] == pytest.approx(rows[what]["predicted"], rel=0.01), (ep, zero, what)
        assert rows["comm dp"]["measured"] == rows["comm dp"]["predicted"] > 0, (ep, zero)
        if (ep, zero) == (1, 3):
            activations = rows["memory activations"]
            assert activations["measured"] == pytest.approx(activations["predicted"], rel=0.1)


@pytest.mark.slow  # a compile and `partc check` of 4 ranks' plan
def test_check_agrees_on_what_crosses_the_pipeline(tmp_path, model_files):
    """ep 2 x pp 2 under bf16: each stage sends and receives the bf16 hidden state (and the rotary tables) the plan
    prices. The experts layer returned fp32 (its bf16 results times the fp32 routing weights) and every later op
    of the residual stream followed: `partc check` measured 18 KiB of `comm pp` against 10 KiB predicted (+44%),
    as at Mixtral-8x7B's scale (+49%)."""
    from helpers import compile_program

    out = tmp_path / "ep2_pp2"
    compile_program(model_files["mixtral"], out, global_batch_size=4, seq_len=S, tp=1, ep=2, dp=2, pp=2, zero=1,
                    micro_batch_size=1, schedule="1f1b", recompute="none", precision="bf16")
    rows = check_rows(out)
    assert rows["comm pp"]["measured"] == rows["comm pp"]["predicted"] > 0
    assert rows["comm ep"]["measured"] == rows["comm ep"]["predicted"] > 0


WIDE_EXPERTS = """
    from transformers import MixtralConfig, MixtralForCausalLM

    def model():
        return MixtralForCausalLM(MixtralConfig(vocab_size=512, hidden_size=256, intermediate_size=1024,
                                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                num_local_experts=4, num_experts_per_tok=2,
                                                max_position_embeddings=128))
"""
"""A Mixtral whose experts are large beside its tokens (2 experts a rank of 0.79M parameters a layer, 32 tokens a
sample): their gathered copies, gradients and reductions are most of a stage's transient memory, as at
Mixtral-8x7B's dims."""


@pytest.mark.slow  # two compiles and `partc check`s of 8 ranks' plans
def test_check_agrees_on_large_experts(tmp_path):
    """dp 4 pp 2 ep 2 (2 layers a stage, each expert on the 2 ranks holding it), bf16: the transient memory the
    plan prices is what `partc check` measures. Before, under ZeRO-3 the experts' post-backward waited for the end
    of the stage's backward (the stage code does not call their module): each layer's gathered experts and their
    bf16 gradients stayed to the end, while the plan charged every unit's gathered experts twice (as if FSDP
    prefetched them) and not their reduction's output (-17.9% measured against predicted activations). Under
    ZeRO-1 the check counted DTensor's sharding propagation in the optimizer step (fake tensors of the experts'
    global shapes, three fp32 copies of a layer's) as activations (+39.2%)."""
    from helpers import compile_program

    from partc.runtime.check import TOLERANCE

    path = tmp_path / "wide_experts.py"
    path.write_text(textwrap.dedent(WIDE_EXPERTS))
    for zero in (3, 1):
        out = tmp_path / f"z{zero}"
        compile_program(path, out, global_batch_size=8, seq_len=32, tp=1, ep=2, dp=4, pp=2, zero=zero,
                        micro_batch_size=1, schedule="1f1b", recompute="none", precision="bf16")
        rows = check_rows(out)  # every row of every pipeline rank agrees
        for what in ("memory activations", "memory peak"):
            row = rows[what]
            assert row["measured"] > 8 << 20, (zero, row)  # a stage's experts' reduction: 3 MiB of bf16 a layer
            assert abs(row["error"]) <= TOLERANCE, (zero, row)


@pytest.mark.slow  # three compiles
def test_ep_is_refused_where_it_cannot_apply(tmp_path, model_files):
    """One line each: a model without packed experts, experts that do not divide among the ep ranks, an ep that
    does not divide dp, a plain mixture of experts whose routing cannot be followed, a routing imbalance below 1,
    not finite, or above ep."""
    from click.testing import CliRunner

    from partc.cli.main import main

    llama = tmp_path / "llama.py"
    from helpers import HF_MODELS
    llama.write_text(textwrap.dedent(HF_MODELS["llama"]))
    cases = [
        ([str(llama), "--gpus", "2", "--dp", "2", "--ep", "2"], "the model has no layer of packed experts"),
        ([model_files["mixtral"], "--gpus", "8", "--dp", "8", "--ep", "8"], "has 4 experts, which do not divide"),
        ([model_files["mixtral"], "--gpus", "4", "--dp", "2", "--tp", "2", "--ep", "4"], "--ep 4 does not divide --dp 2"),
        ([model_files["mixtral"], "--gpus", "4", "--cp", "2", "--ep", "4"],
         "--ep 4 does not divide the 2 data-parallel ranks left of 4 GPUs by --cp 2"),
        ([plain_refused(tmp_path), "--gpus", "2", "--dp", "2", "--ep", "2"],
         "--ep 2: a mixture of experts cannot be divided: the computation of an expert (add) reads mean besides"),
        # a routing imbalance below uniform, not a number, or more than the ep ranks can receive
        ([model_files["mixtral"], "--gpus", "4", "--expert-imbalance", "0.5"], "0.5 is not in the range x>=1.0"),
        ([model_files["mixtral"], "--gpus", "4", "--expert-imbalance", "nan"], "must be a finite number, got nan"),
        ([model_files["mixtral"], "--gpus", "4", "--dp", "4", "--ep", "2", "--expert-imbalance", "3"],
         "--expert-imbalance 3 is more than --ep 2 allows"),
    ]
    for args, why in cases:
        seq = [] if "user_moe" in args[0] else ["--seq-len", str(S)]  # a user model sets its tokens itself
        result = CliRunner().invoke(main, ["compile", *args, *seq, "--precision", "fp32",
                                           "--global-batch-size", "8", "--micro-batch-size", "1", "-o",
                                           str(tmp_path / "out")])
        assert result.exit_code == 2 and why in result.output, result.output
        assert "Traceback" not in result.output


@pytest.mark.parametrize("model", ["user_moe", "swiglu_top2"])
def test_plain_experts_are_followed(model_files, model):
    """A mixture of experts written in plain PyTorch is found in the trace: its 4 expert modules, (token, expert)
    rows per sample (6 tokens x k) and hidden size for the cost model, its expert count for the search; expert 0's
    ops, run on another expert's parameters, compute that expert."""
    from helpers import trace_file
    from partc.model_file import load_model_file
    from partc.passes.experts_routed import routed_splits
    from partc.passes.search_space import _expert_counts

    torch.manual_seed(0)
    _, traced = trace_file(model_files[model])
    (routed,) = traced.graph.routed_experts
    k = {"user_moe": 1, "swiglu_top2": 2}[model]
    assert (routed.fqn, routed.experts, routed.unit) == ("moe.experts", [f"moe.experts.{e}" for e in range(4)],
                                                         "moe.experts.0")
    assert (routed.rows, routed.hidden) == (6 * k, 16) and _expert_counts(traced.graph) == [4]
    (split,) = routed_splits(traced.exported.graph, param_placeholders(traced.exported))
    net = load_model_file(model_files[model]).build()
    params = dict(net.named_parameters())
    rows = torch.randn(5, 16)
    for e in range(4):
        got = split.local(rows, *(params[n] for n in split.params[e]))
        torch.testing.assert_close(got, net.moe.experts[e](rows), rtol=0, atol=0)
    # a skewed routing (`--expert-imbalance`) scales the expert modules' layers, and only those, on the busiest rank
    import dataclasses

    from partc.cluster import load_cluster
    from partc.parallel import Parallel
    from partc.passes import cost, cost_axes, memory

    graph = traced.graph
    assert cost_axes.routed_rows_layers(graph) == {f for f in graph.layers if f.startswith("moe.experts.")} != set()
    base = Parallel(dp=4, tp=1, pp=1, zero=1, micro_batch_size=1, global_batch_size=8, ep=4, precision="fp32")
    skew = dataclasses.replace(base, expert_imbalance=2.0)
    cluster = load_cluster("a100-80g")
    for i, u in enumerate(graph.units):
        fwd = [cost._forward_times(graph, cluster, p, None, u)[0] for p in (base, skew)]
        experts = [f for f in u.layers if f.startswith("moe.experts.")]
        assert (fwd[1] > fwd[0]) == bool(experts), u.fqn
    acts = [sum(memory.unit_activation_bytes(graph, p, None)) for p in (base, skew)]
    assert acts[1] - acts[0] == sum(graph.layers[f].saved_bytes for f in cost_axes.routed_rows_layers(graph))


def test_plain_routing_it_cannot_follow_is_refused(tmp_path):
    """An expert that reads the whole batch besides its routed rows cannot run where its tokens are sent: the
    mixture is refused in one line naming what it reads (and `--ep` says it, `test_ep_is_refused_where_it_cannot_
    apply`)."""
    from helpers import trace_file
    from partc.passes.experts_routed import routed_splits

    path = plain_refused(tmp_path)
    _, traced = trace_file(path)
    assert traced.graph.routed_experts == []
    (why,) = routed_splits(traced.exported.graph, param_placeholders(traced.exported))
    assert why == "the computation of an expert (add) reads mean besides its routed rows and its parameters", why


def plain_refused(tmp_path) -> str:
    """The user MoE whose experts add the mean of every token to their own rows' results."""
    from user_models import write_user_model

    path = Path(write_user_model(tmp_path, "moe"))
    text = path.read_text()
    old = "y = expert(flat.index_select(0, idx))"
    assert old in text
    path.write_text(text.replace(old, "y = (expert(flat.index_select(0, idx)) + flat.mean(0))"))
    return str(path)


def test_search_tries_ep_where_the_experts_divide(model_files):
    """Unpinned, the search tries every ep dividing dp and each layer's expert count (Mixtral's 4); pinned, only
    that one; a model without packed experts only ep 1."""
    from helpers import trace_file
    from partc.parallel import Pins
    from partc.passes.search_space import _ep_degrees, _expert_counts

    graph = trace_file(model_files["mixtral"], seq_len=S)[1].graph
    assert _expert_counts(graph) == [4, 4]
    assert _ep_degrees(Pins(), 8, _expert_counts(graph)) == [1, 2, 4]
    assert _ep_degrees(Pins(ep=2), 8, [4, 4]) == [2] and _ep_degrees(Pins(ep=2), 3, [4]) == []
    assert _ep_degrees(Pins(), 8, []) == [1]
    # with context parallelism: ep carved from dp at each cp coordinate, the two chosen together
    from partc.cluster import load_cluster
    from partc.passes.search_space import _config_values

    pairs = {(v["dp"], v["cp"], v["ep"]) for v in _config_values(graph, load_cluster("a100-80g"), 8, 8,
                                                                   Pins(cp=2, tp=1, pp=1))}
    assert pairs == {(4, 2, 1), (4, 2, 2), (4, 2, 4)}


def test_cp_takes_followed_experts_as_per_token(model_files):
    """A layer of packed experts sorts, gathers and counts its tokens by expert: ops that mix positions, one by
    one. The split ep follows proves that each token's output reads that token alone, so context parallelism's
    analysis takes the layer's nodes as per position (`experts_ep.token_wise_nodes`), and only those; without them it
    refuses the model at the experts' sort. The router's ``topk`` over the experts (its dim left to the default)
    keeps the sequence where it is."""
    from partc.cluster import load_cluster
    from partc.compile_traces import context_graph
    from partc.errors import PartcError
    from partc.model_file import build_on_meta, load_model_file
    from partc.passes.assign import assign
    from partc.passes.context import analyze
    from partc.passes.experts_ep import token_wise_nodes
    from partc.passes.trace import trace

    path = model_files["mixtral"]
    spec = load_model_file(path, seq_len=S)
    model = build_on_meta(spec)
    with torch.device("meta"):
        args, kwargs = spec.inputs(1)
    traced = trace(model, args, kwargs, name=spec.name, seq_len=S, path=path, precision="fp32",
                   fused_attention=load_cluster("a100-80g").fused_attention)  # as `partc compile` traces it
    local, split = context_graph(spec, model, traced, 2, path=path, precision="fp32")
    assert len(split.attention) == 2
    node_layer = assign(local, model).node_layer
    names = token_wise_nodes(local, node_layer, traced.graph.layers)
    layers = {node_layer[n] for n in local.graph.nodes if n.name in names}
    assert layers == {f"model.layers.{i}.mlp.experts" for i in range(2)}
    assert {n.target for n in local.graph.nodes if n.name in names} >= {torch.ops.aten.sort.default,
                                                                        torch.ops.aten.index.Tensor}
    with pytest.raises(PartcError, match="sort.default at moe.py.* mixes positions along the sequence"):
        analyze(traced.exported, local, 2, S)


def test_ep_groups_under_cp(monkeypatch):
    """The groups of ``ep`` (`runtime.mesh.sub_axis_groups`) at pp 2, dp 4, cp 2, tp 2, ep 2 (32 ranks): the
    tokens travel between ep neighbours on dp at one (pp, cp, tp) coordinate; the experts' gradients are reduced
    over the ``dp / ep`` x ``cp`` = 4 ranks at one ep coordinate (``dp_rank % ep``) of one (pp, tp) coordinate
    (`Parallel.expert_shard`). Every rank creates every group in the same order."""
    import types

    import torch.distributed as dist

    from partc.mesh_axes import SUB_AXES_BY_NAME
    from partc.parallel import Parallel
    from partc.runtime.mesh import sub_axis_groups

    par = Parallel(pp=2, dp=4, cp=2, tp=2, ep=2, zero=1, micro_batch_size=1, global_batch_size=4)
    assert par.expert_shard == 4 and Parallel(dp=2, cp=2, ep=2, tp=1, pp=1, zero=1, micro_batch_size=1,
                                              global_batch_size=2).expert_shard == 2
    created = []
    monkeypatch.setattr(dist, "new_group", lambda ranks: created.append(tuple(ranks)) or tuple(ranks))
    ep = SUB_AXES_BY_NAME["ep"]
    orders = []
    for rank in range(par.world_size):
        created.clear()
        mine, across, members = sub_axis_groups(types.SimpleNamespace(par=par, rank=rank), ep)
        orders.append(list(created))
        c = par.coords(rank)
        assert [par.coords(r)["dp"] for r in mine] == [c["dp"] // 2 * 2, c["dp"] // 2 * 2 + 1]
        assert all(par.coords(r) | {"dp": 0} == c | {"dp": 0} for r in mine)
        assert list(across) == members == sorted(members) and len(members) == par.expert_shard
        assert {(par.coords(r)["dp"], par.coords(r)["cp"]) for r in members} == {
            (d, k) for d in range(c["dp"] % 2, 4, 2) for k in range(2)}
        assert all((par.coords(r)["pp"], par.coords(r)["tp"]) == (c["pp"], c["tp"]) for r in members)
    assert all(o == orders[0] for o in orders)


def test_a_skewed_routing_is_priced_on_the_busiest_rank(model_files):
    """``--expert-imbalance F``: the busiest ep rank receives F times the mean rows. At F 1 nothing changes (the
    default plan is the uniform one); at F 2 and ep 4 its experts' compute and what they keep are twice the mean
    rows', each all-to-all takes as long as twice the uniform share, and the bytes that leave it are
    ``1 + F - 2F/ep`` of its rows (2 at F 2 against 1.5); capped at ep; nothing changes without ep. Under full
    recomputation the forward's all-to-alls count twice."""
    import dataclasses

    from helpers import trace_file
    from partc.parallel import Parallel
    from partc.passes import cost, cost_axes, hw, memory
    from partc.passes.assemble import predict
    from partc.cluster import load_cluster

    graph = trace_file(model_files["mixtral"], seq_len=S)[1].graph
    cluster = load_cluster("a100-80g")
    units = range(len(graph.units))
    base = Parallel(dp=4, tp=1, pp=1, zero=1, micro_batch_size=1, global_batch_size=8, ep=4, precision="fp32")
    skew = dataclasses.replace(base, expert_imbalance=2.0)
    assert (base.imbalance, skew.imbalance, dataclasses.replace(skew, expert_imbalance=9.0).imbalance) == (1, 2, 4)
    assert dataclasses.replace(skew, dp=4, ep=1).imbalance == 1.0 and "expert_imbalance" not in base.to_dict()
    assert Parallel.from_dict(skew.to_dict()) == skew and Parallel.from_dict({**skew.to_dict(), "expert_imbalance": 2}) == skew
    rows, layers, m = S * 2, 2, 2  # (token, expert) rows per sample, MoE layers, micro-batches
    counts = 4 * 8 * 3 / 4
    assert cost_axes.ep_bytes(graph, base, units) == layers * m * (rows * 2 * 3 / 4 * 64 * 4 * 2 + counts)
    assert cost_axes.ep_bytes(graph, skew, units) == layers * m * (rows * (1 - 2 / 4 + 2 * 3 / 4) * 64 * 4 * 2 + counts)
    full = dataclasses.replace(base, recompute="full")
    assert cost_axes.ep_bytes(graph, full, units) == layers * m * (rows * 2 * 3 / 4 * 64 * 4 * 3 + 2 * counts)
    once = lambda f: 2 * hw.collective_time(cluster, "all_to_all", f * rows * 3 / 4 * 64 * 4, 4, spans_nodes=False,
                                            ranks_per_node=4)
    assert cost_axes.ep_time(graph, cluster, base, units) == pytest.approx((layers * once(1), layers * once(1)))
    assert cost_axes.ep_time(graph, cluster, skew, units) == pytest.approx((layers * once(2), layers * once(2)))
    assert cost_axes.ep_time(graph, cluster, full, units) == pytest.approx((layers * once(1), 2 * layers * once(1)))
    # the experts' compute: a MoE block's forward grows by its experts layer's own time, and it keeps twice what
    # that layer saves (once more)
    tp = None  # every layer whole
    acts = {p: memory.unit_activation_bytes(graph, p, tp) for p in (base, skew)}
    for i, u in enumerate(graph.units):
        experts = [graph.layers[f] for f in u.layers if graph.layers[f].inner]
        own = sum(hw.memory_time(cluster, e.memory_bytes) + sum(hw.gemm_time(cluster, g, micro_batch_size=1)
                                                              for g in e.gemms) for e in experts)
        fwd = [cost._forward_times(graph, cluster, p, tp, u)[0] for p in (base, skew)]
        assert fwd[1] - fwd[0] == pytest.approx(own, abs=1e-15)
        assert acts[skew][i] - acts[base][i] == sum(e.saved_bytes for e in experts)
    assert sum(bool(graph.layers[f].inner) for u in graph.units for f in u.layers) == layers
    unskewed = dataclasses.replace(base, ep=1)
    assert (cost.unit_time_parts(graph, cluster, unskewed, tp)
            == cost.unit_time_parts(graph, cluster, dataclasses.replace(unskewed, expert_imbalance=2.0), tp))
    # under cp 4 each rank routes its s/4 tokens, inside an ep group of dp ranks 4 apart (cp x tp): 4 of them, on
    # 2 nodes of 8 GPUs, 2 a node (at cp 1 the 4 neighbours share a node)
    cp4 = dataclasses.replace(base, cp=4)
    assert cost_axes.ep_bytes(graph, cp4, units) == layers * m * (rows / 4 * 2 * 3 / 4 * 64 * 4 * 2 + counts)
    spread = 2 * hw.collective_time(cluster, "all_to_all", rows / 4 * 3 / 4 * 64 * 4, 4, spans_nodes=True,
                                    ranks_per_node=2)
    assert cost_axes.ep_time(graph, cluster, cp4, units) == pytest.approx((layers * spread, layers * spread))
    assert spread > once(1) / 4
    # the whole plan: slower, more activations, more bytes on the busiest rank
    bounds = [(0, len(graph.units))]
    a, b = predict(graph, cluster, base, tp, bounds), predict(graph, cluster, skew, tp, bounds)
    assert b.step_time_s > a.step_time_s and b.memory_per_gpu.activations > a.memory_per_gpu.activations
    assert b.ranks[0].comm_bytes["ep"] > a.ranks[0].comm_bytes["ep"]
