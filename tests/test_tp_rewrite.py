"""Tensor parallelism in the generated program: local shards and explicit collectives equal one process.

Each case compiles a plan with a hand-set `tp` map (through --from-plan, as a user would), then runs the program
on `tp` gloo ranks in one pipeline stage and compares logits and every gradient (gathered from the shards) with
the unsharded model. The cases of one tp share one launch (`tp_runs`): starting the ranks costs more than a case.
"""

import dataclasses
import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers import EXAMPLES, VOCAB, compile_program, launch, load_stage, megatron_style, model_file, trace_file
from partc.compile import compile_model
from partc.errors import PartcError
from partc.model_file import load_model_file
from partc.parallel import Pins
from partc.sharding import Shard, shard_tensor, unshard_tensor
from partc import collectives
from zoo_models import write_zoo_model


def megatron_plan(path: str, out: Path, tp: int, *, vocab: bool = False, extra: dict | None = None,
                  pattern: bool = True) -> dict:
    """Compile at `tp` (fp32: the workers run the fp32 model's shards against its own fp32 forward), set the Megatron
    pattern by hand (and `extra` styles), compile again --from-plan; returns the plan. The logits are gathered (no
    vocab-parallel loss): the workers compare them whole."""
    extra = extra or {}

    def styles(fqn: str, solved: str) -> str:
        return extra.get(fqn) or megatron_style(fqn, vocab=vocab) or solved

    compile_program(path, out, gpus=tp, global_batch_size=2, tp_styles=styles, vocab_parallel_loss=False, tp=tp,
                    pp=1, micro_batch_size=2, precision="fp32")
    plan = json.loads((out.parent / f"{out.name}.plan.json").read_text())
    matched = {fqn: style for fqn in plan["tp"] if (style := megatron_style(fqn, vocab=vocab))}
    # The pattern must match, or a case would test whatever the solver chose instead of Megatron's split.
    assert not pattern or ("colwise" in matched.values() and "rowwise" in matched.values()), sorted(plan["tp"])
    if vocab:
        assert matched.get("lm_head") == "colwise" and any(re.search(VOCAB, f) for f in matched), sorted(matched)
    return plan


def _worker(cases_file: str, result_file: str) -> None:
    """A rank of `tp_runs`' launch (`helpers.launch`: torchrun's environment): every case of `cases_file` (name ->
    (model file, compiled output)) in turn, in one process group; rank 0 writes name -> that case's result to
    `result_file`."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        collectives.set_groups({"tp": dist.group.WORLD})
        cases = json.loads(Path(cases_file).read_text())
        results = {name: _run_case(rank, world, path, out) for name, (path, out) in cases.items()}
        if rank == 0:
            Path(result_file).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
    # Leave without interpreter finalization: a gloo worker thread torn down there aborts the process now and
    # then ("terminate called without an active exception"), which would fail a passing test.
    os._exit(0)


def _run_case(rank, world, path, out) -> dict:
    """The program compiled in `out` on this rank's shards against the whole model of `path` in this process:
    the largest logit and (relative) gradient differences, the parameters without a gradient, and the number of
    all-reduces in forward and in backward."""
    manifest = json.loads((Path(out) / "program" / "manifest.json").read_text())
    spec = load_model_file(path)
    torch.manual_seed(0)
    model = spec.build()
    args, kwargs = spec.inputs(2)
    ref = model(*args, **kwargs)
    ref = ref if torch.is_tensor(ref) else ref.logits
    ref.float().square().sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    shards = {k: Shard(**v) for k, v in manifest["tp"]["shards"].items()}
    p, local = {}, {}
    for n, q in model.named_parameters(remove_duplicate=False):
        if id(q) not in local:  # tied names share one local parameter
            local[id(q)] = (torch.nn.Parameter(shard_tensor(q.detach(), shards[n], rank, world).clone())
                            if n in shards else q)
        p[n] = local[id(q)]
    p.update(dict(model.named_buffers(remove_duplicate=False)))
    model.zero_grad()
    # Count the all-reduces of forward and of backward.
    counts = {"fwd": 0, "bwd": 0}
    phase = ["fwd"]
    real = dist.all_reduce

    def counting(*a, **k):
        counts[phase[0]] += 1
        return real(*a, **k)

    dist.all_reduce = counting
    x = tuple(args[k] if isinstance(k, int) else kwargs[k] for k in manifest["input_keys"])
    for st in manifest["stages"]:
        mod = load_stage(Path(out) / "program" / st["file"])
        x = mod.forward(p, *x, device=torch.device("cpu"))
    got = mod.outputs(x)
    got = got if torch.is_tensor(got) else got.logits
    phase[0] = "bwd"
    got.float().square().sum().backward()
    dist.all_reduce = real
    logits_err = (got - ref).abs().max().item()
    scale = max(g.abs().max().item() for g in ref_grads.values())
    grad_err = 0.0
    # Every parameter must get a gradient from the program (a skipped one would not count in grad_err).
    no_grad = sorted(n for n, q in p.items() if isinstance(q, torch.nn.Parameter) and q.grad is None)
    for n, q in p.items():
        if not isinstance(q, torch.nn.Parameter) or q.grad is None:
            continue
        g = q.grad
        if n in shards:
            parts = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(parts, g.contiguous())
            g = unshard_tensor(parts, shards[n])
        grad_err = max(grad_err, (g - ref_grads[n]).abs().max().item() / scale)
    return {"logits": logits_err, "grads": grad_err, "no_grad": no_grad, **counts}


# name: (model file: examples/ or hf_dir's case, or ``zoo:NAME`` of zoo_models, tp, megatron_plan's keywords)
PROGRAMS = {
    "gpt": ("gpt", 4, dict(vocab=True)),
    "llama": ("llama", 2, dict(vocab=True)),
    "hf_gpt2": ("hf_gpt2", 2, dict(vocab=True)),
    "hf_llama": ("hf_llama", 2, dict(vocab=False)),
    "gpt_megatron": ("gpt", 2, {}),
    "gpt_tok_colwise": ("gpt", 2, dict(extra={"tok": "colwise"})),
    "phi3": ("zoo:phi3", 2, dict(vocab=True)),
    "falcon": ("zoo:falcon", 2, dict(pattern=False, extra={
        f"transformer.h.{i}.{name}": style for i in range(2) for name, style in (
            ("self_attention.query_key_value", "colwise"), ("self_attention.dense", "rowwise"),
            ("mlp.dense_h_to_4h", "colwise"), ("mlp.dense_4h_to_h", "rowwise"))})),
    "phi3_gqa": ("zoo:phi3_gqa", 2, dict(vocab=True)),
    "fused_slices": ("zoo:fused_slices", 2, dict(pattern=False, extra={"up": "colwise", "down": "rowwise",
                                                                       "mix": "colwise", "out": "replicate"})),
}


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory, hf_dir):
    """name -> (model file, output directory, plan.json as edited, result of `_run_case` on rank 0) for every
    program of PROGRAMS: each compiled through `megatron_plan`, then all of one tp run in one launch of `tp` ranks
    (`helpers.launch`: forked from the fork server, which has torch and transformers imported; a spawned rank
    imports them again, more than the cases themselves cost on two cores)."""
    tmp = tmp_path_factory.mktemp("tp_rewrite")
    compiled, by_world = {}, {}
    for name, (model, tp, kwargs) in PROGRAMS.items():
        path = write_zoo_model(tmp, model[4:]) if model.startswith("zoo:") else model_file(model, hf_dir)
        out = tmp / name
        compiled[name] = (path, out, megatron_plan(path, out, tp, **kwargs))
        by_world.setdefault(tp, {})[name] = (path, str(out))
    results = {}
    for tp, cases in by_world.items():
        result, cases_file = tmp / f"results_tp{tp}.json", tmp / f"cases_tp{tp}.json"
        cases_file.write_text(json.dumps(cases))
        launch(tp, [__file__, str(cases_file), str(result)])  # this file's __main__: `_worker`
        results.update(json.loads(result.read_text()))
    return {name: (*compiled[name], results[name]) for name in PROGRAMS}


def run_of(tp_runs, name: str) -> tuple[Path, dict, dict]:
    """(output directory, plan, result) of PROGRAMS[name]; every parameter got a gradient from the program."""
    _, out, plan, r = tp_runs[name]
    assert r["no_grad"] == [], f"parameters without a gradient from the program: {r['no_grad']}"
    return out, plan, r


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gpt", "llama", "hf_gpt2", "hf_llama"])
def test_tp_equals_one_process(tp_runs, case):
    """Fused QKV (gpt, HF GPT-2 Conv1D), GQA + RoPE + SwiGLU (llama), a vocabulary-parallel embedding and a tied,
    vocabulary-parallel LM head (HF GPT-2)."""
    out, _, r = run_of(tp_runs, case)
    manifest = json.loads((out / "program" / "manifest.json").read_text())
    assert manifest["tp"]["shards"]  # the program holds shards, not whole weights
    assert r["logits"] < 1e-5
    assert r["grads"] < 1e-5
    assert r["fwd"] > 0 and r["bwd"] > 0  # the ranks exchanged partial results


@pytest.mark.slow
def test_megatron_layer_costs_two_all_reduces_each_way(tp_runs):
    """One GPT block under Megatron's pattern: 2 all-reduces in forward, 2 in backward (4 blocks here)."""
    out, _, r = run_of(tp_runs, "gpt_megatron")
    assert r["logits"] < 1e-5 and r["grads"] < 1e-5
    assert (r["fwd"], r["bwd"]) == (2 * 4, 2 * 4)
    text = (out / "program" / "stage_0.py").read_text()
    calls = re.findall(r"= tp\.(\w+)\(", text)
    assert sorted(set(calls)) == ["copy_to_tp", "reduce_from_tp"]
    assert calls.count("copy_to_tp") == 8 and calls.count("reduce_from_tp") == 8
    # Every collective says why it is there, on the line above it.
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "= tp." in line:
            assert lines[i - 1].strip().startswith("# TP: "), line
    # Local shapes: 4 heads over 2 ranks.
    assert "aten.view.default(getitem, [2, 64, 2, 16])" in text


@pytest.mark.slow
def test_split_embedding_dim_is_gathered_once_not_per_block(tp_runs):
    """A colwise (embedding-dim) split of `tok` meets the whole `pos` output in the embedding sum: the rewrite
    gathers there, once, so the residual stream stays whole through every block (as the solver charges it)."""
    out, _, r = run_of(tp_runs, "gpt_tok_colwise")
    text = (out / "program" / "stage_0.py").read_text()
    assert text.count("= tp.gather_from_tp(") == 1 and "= tp.scatter_to_tp(" not in text
    assert r["logits"] < 1e-5 and r["grads"] < 1e-5


def test_gqa_with_fewer_kv_heads_than_tp_is_refused(tmp_path):
    path = str(EXAMPLES / "llama.py")  # 2 KV heads
    with pytest.raises(PartcError, match="attn.k.*divisible by tp=4"):
        megatron_plan(path, tmp_path / "out", 4)


def test_solver_never_splits_kv_heads_beyond_their_count(tmp_path):
    path = str(EXAMPLES / "llama.py")
    res = compile_model(path, gpus=4, pins=Pins(tp=4, pp=1), global_batch_size=4, out_dir=tmp_path / "o")
    kv = {fqn: style for fqn, style in res.plan.tp.items() if re.search(r"attn\.[kv]$", fqn)}
    assert len(kv) == 2 * sum(u.kind == "block" for u in res.graph.units) > 0  # k and v of every block
    assert set(kv.values()) == {"replicate"}


def test_shard_round_trip_with_fused_pieces():
    full = torch.arange(24.0).reshape(12, 2)
    shard = Shard(dim=0, fused=3)
    parts = [shard_tensor(full, shard, r, 2) for r in range(2)]
    # Rank 0 holds the first half of each of q, k and v.
    assert parts[0][:, 0].tolist() == [0, 2, 8, 10, 16, 18]
    assert torch.equal(unshard_tensor(parts, shard), full)


@pytest.mark.slow
def test_phi3_fused_qkv_split_by_slices_stays_split(tp_runs, tmp_path):
    """Phi-3 takes q, k and v from its fused projection by slicing (qkv[..., :h], ...): the weight is split in 3
    pieces, the slice bounds become the local ones, attention runs on this rank's heads and o_proj is rowwise with
    no gather; the program equals one process."""
    out, plan, r = run_of(tp_runs, "phi3")
    assert plan["tp"]["model.layers.0.self_attn.qkv_proj"] == "colwise"
    manifest = json.loads((out / "program" / "manifest.json").read_text())
    assert manifest["tp"]["shards"]["model.layers.0.self_attn.qkv_proj.weight"] == {"dim": 0, "fused": 3}
    text = (out / "program" / "stage_0.py").read_text()
    assert "gather_from_tp(" not in text.split("lm_head")[0]  # only the vocabulary-parallel head's logits
    assert "aten.slice.Tensor(linear, 2, 32, 64)" in text  # k: qkv[..., 64:128] of 192 -> [32:64] of 96
    assert r["logits"] < 1e-5 and r["grads"] < 1e-5
    path = tp_runs["phi3"][0]
    res = compile_model(path, gpus=2, pins=Pins(tp=2, pp=1), global_batch_size=2, out_dir=tmp_path / "solved")
    qkv = res.graph.layers["model.layers.0.self_attn.qkv_proj"]
    assert (qkv.fused, qkv.col_groups, qkv.split_stop) == (3, 4, "")


@pytest.mark.slow
def test_falcon_weight_transposed_is_a_linear(tp_runs):
    """Falcon's linear layers compute ``x @ self.weight.T`` (aten.numpy_T, then matmul), which the TP rewrite
    refused; the export reads it as ``linear(x, weight)``, the same product, so Megatron's split applies and the
    program equals one process."""
    out, _, r = run_of(tp_runs, "falcon")
    text = (out / "program" / "stage_0.py").read_text()
    assert "numpy_T" not in text and "aten.linear.default(" in text
    assert r["logits"] < 1e-5 and r["grads"] < 1e-5


@pytest.mark.slow
def test_pieces_of_different_sizes_are_gathered_not_split_wrong(tp_runs, tmp_path):
    """Phi-3 with grouped-query attention slices q, k and v of different sizes: no piece count shards the weight
    so that each slice is local, so the split is gathered at the first slice (exact), and the plan says why."""
    _, _, r = run_of(tp_runs, "phi3_gqa")
    assert r["logits"] < 1e-5 and r["grads"] < 1e-5
    path = tp_runs["phi3_gqa"][0]
    res = compile_model(path, gpus=2, pins=Pins(tp=2, pp=1), global_batch_size=2, out_dir=tmp_path / "solved")
    qkv = res.graph.layers["model.layers.0.self_attn.qkv_proj"]
    assert qkv.fused == 1 and "pieces of different sizes" in qkv.split_stop, qkv.split_stop


@pytest.mark.slow
def test_fused_pieces_read_whole_are_put_back_in_order(tp_runs):
    """A projection sliced in 3 (slice) and one in 2 (narrow) stay split into a rowwise layer; the same outputs
    read whole (softmax over the features, a cat) are gathered and their pieces put back in order."""
    out, _, r = run_of(tp_runs, "fused_slices")
    manifest = json.loads((out / "program" / "manifest.json").read_text())
    assert manifest["tp"]["shards"]["up.weight"] == {"dim": 0, "fused": 3}
    assert manifest["tp"]["shards"]["mix.weight"] == {"dim": 0, "fused": 2}
    text = (out / "program" / "stage_0.py").read_text()
    assert "put the 3 pieces of" in text
    assert r["logits"] < 1e-5 and r["grads"] < 1e-5


def _hand_set(path: str, out: Path, styles: dict[str, str]) -> None:
    """Compile at tp 2, set `styles` (by name suffix) in plan.json by hand, compile that plan (the logits gathered,
    as the workers compare them)."""
    compile_model(path, gpus=2, pins=Pins(tp=2, pp=1, micro_batch_size=2, precision="fp32"), global_batch_size=2,
                  out_dir=out, vocab_parallel_loss=False)
    plan = json.loads((out / "plan.json").read_text())
    plan["tp"].update({f: style for f in plan["tp"] for k, style in styles.items() if f.endswith(k)})
    (out / "edited.json").write_text(json.dumps(plan))
    compile_model(path, gpus=2, from_plan=str(out / "edited.json"), out_dir=out, vocab_parallel_loss=False)


class _ViewAttention(torch.nn.Module):
    """timm's attention: qkv viewed as (B, N, 3, heads, head_dim), the 3 moved first; `use` is how it is read."""

    def __init__(self, use: str):
        super().__init__()
        self.qkv, self.proj, self.use = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32), use

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, 4, 8).permute(2, 0, 3, 1, 4)
        if self.use == "unbind":
            q, k, v = qkv.unbind(0)
        elif self.use == "select":
            q, k, v = qkv[0], qkv[1], qkv[2]
        elif self.use == "chunk":
            q, k, v = (t.squeeze(0) for t in qkv.chunk(3, dim=0))
        elif self.use == "sum":  # the 3 reduced: not pieces
            q = k = v = qkv.sum(0)
        else:  # "unbind+mean": taken apart, and read whole too: not pieces
            q, k, v = qkv.unbind(0)
            v = v + qkv.mean(0)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(o.transpose(1, 2).reshape(B, N, C))


@pytest.mark.parametrize("use,fused,groups,reason", [
    ("unbind", 3, 4, ""), ("select", 3, 4, ""), ("chunk", 3, 4, ""),
    ("sum", 1, 3, "aten.sum.dim_IntList: reduction over the split dimension"),
    ("unbind+mean", 1, 3, "aten.unbind.int: unbind along the split dimension"),
])
def test_view_whose_outer_part_is_taken_apart_reads_as_fused_pieces(use, fused, groups, reason):
    """A view of the features into (3, heads, head_dim) whose 3 is only taken apart (unbind, select, chunk after a
    permute) is 3 fused pieces: the split lands on the heads and reaches proj on its input features. Any other
    read of the 3 keeps the old reading (the 3 carries the split), which the analysis refuses as before."""
    from partc.passes.shard import ShardAnalysis
    from partc.passes.assign import assign, layer_outputs

    model = _ViewAttention(use)
    ep = torch.export.export(model, (torch.randn(2, 5, 32),))
    a = assign(ep, model)
    region = ShardAnalysis(ep.graph, a.node_layer, layer_outputs(a)).regions["qkv"]
    assert (region.valid, region.reason, region.fused, region.groups) == (not reason, reason, fused, groups)
    if not reason:
        assert region.reaches == {"proj": True}


@pytest.mark.slow
def test_timm_attention_splits_its_heads_in_three_pieces(tmp_path):
    """timm's qkv.reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0): the 3 is a count of fused pieces, the
    split lands on the heads. The solver weighs qkv colwise and proj rowwise on cost (replicate wins at this tiny
    size); set by hand, the weight is split in 3 pieces and each rank views its part as (B, N, 3, H/tp, D).
    (Training at tp 2 against one process: tests/test_zoo_dist.py.)"""
    timm = write_zoo_model(tmp_path, "timm_vit")
    res = compile_model(timm, gpus=2, pins=Pins(tp=2, pp=1), global_batch_size=2, out_dir=tmp_path / "timm")
    qkv = res.graph.layers["blocks.0.attn.qkv"]
    assert (qkv.fused, qkv.col_groups, qkv.split_stop) == (3, 4, "")
    assert res.graph.layers["blocks.0.attn.proj"].row_groups == 4
    assert res.plan.tp_why["blocks.0.attn.qkv"].startswith("cost: "), res.plan.tp_why["blocks.0.attn.qkv"]
    _hand_set(timm, tmp_path / "timm_hand", {"attn.qkv": "colwise", "attn.proj": "rowwise", "fc1": "colwise",
                                              "fc2": "rowwise"})
    manifest = json.loads((tmp_path / "timm_hand" / "program" / "manifest.json").read_text())
    assert manifest["tp"]["shards"]["blocks.0.attn.qkv.weight"] == {"dim": 0, "fused": 3}
    assert manifest["tp"]["shards"]["blocks.0.attn.proj.weight"] == {"dim": 1, "fused": 1}
    text = (tmp_path / "timm_hand" / "program" / "stage_0.py").read_text()
    assert "aten.reshape.default(linear, [2, 17, 3, 2, 16])" in text  # 4 heads of 16 over 2 ranks, 17 tokens
    assert "gather_from_tp(" not in text and "scatter_to_tp(" not in text


@pytest.mark.parametrize("src,dst,dim,pieces,want", [
    ((16, 2, 64), (16, 8, 16), 2, 1, (1, 2)),  # MHA: (L, B, E) -> (L, B*H, D): the batch merged before the heads
    ((8, 16, 16), (2, 4, 16, 16), 0, 2, (1, 1)),  # ... and back: (B*H, L, D) -> (B, H, L, D)
    ((16, 2, 192), (16, 2, 3, 64), 2, 3, (3, 1)),  # a fused qkv unflattened into (3, E): the split on E
    ((2, 16, 192), (2, 16, 12, 16), 2, 3, (2, 3)),  # ... viewed as 3 * 4 heads: still 3 pieces
    ((2, 16, 4, 16), (32, 64), 2, 1, (1, 1)),  # heads merged with head_dim: one chunk per rank
    ((16, 2, 64), (16, 8, 16), 2, 1, None),  # t = 8 does not divide the 4 heads
    ((2, 3, 8), (3, 2, 8), 1, 1, None),  # no common refinement
])
def test_view_split_on_local_parts(src, dst, dim, pieces, want):
    """Where a split lands after a view of each rank's part, and in how many pieces (t = 2 unless the heads are
    4 and t = 8)."""
    from partc.passes.shard import view_split

    t = 8 if want is None and src == (16, 2, 64) else 2
    assert view_split(src, dst, dim, pieces, t) == want


def test_view_that_regroups_the_split_dimension_is_not_read_dim_to_dim():
    """(B, E) -> (B*H, D) has as many dims on both sides but other sizes: the split does not stay on dim 2."""
    from partc.passes.shard import view_dim_map

    assert view_dim_map((16, 2, 64), (16, 8, 16), 2) == (None, None)
    assert view_dim_map((16, 1, 64), (16, 64), 2)[0] == 1  # a size-1 dim dropped


class _MHA(torch.nn.Module):
    def __init__(self, cross: bool = False):
        super().__init__()
        self.attn, self.cross = torch.nn.MultiheadAttention(64, 4, batch_first=True), cross

    def forward(self, x):
        kv = x.flip(1) if self.cross else x
        return self.attn(x, kv, kv, need_weights=False)[0]


def test_multihead_attention_reads_as_a_linear_of_three_pieces_and_out_proj():
    """Self-attention: the in-proj linear is the MHA layer's, its output unflattened to (3, E) and taken apart
    through unsqueeze, transpose and squeeze: 3 fused pieces split on 4 heads, reaching out_proj on its input
    features; out_proj's linear is out_proj's, the core no layer's. Cross-attention splits the weight in forward:
    the MHA layer stays whole, with its reason."""
    from partc.passes.shard import ShardAnalysis
    from partc.passes.assign import assign, layer_outputs

    model = _MHA()
    ep = torch.export.export(model, (torch.randn(1, 16, 64),))
    a = assign(ep, model)
    assert sorted({(n.target.__name__, a.node_layer[n]) for n in a.node_layer}) == \
        [("linear.default", "attn"), ("linear.default", "attn.out_proj")]
    assert (a.attention, a.kind("attn")) == ({"attn": ""}, "linear")
    region = ShardAnalysis(ep.graph, a.node_layer, layer_outputs(a)).regions["attn"]
    assert (region.valid, region.reason, region.fused, region.groups) == (True, "", 3, 4)
    assert region.reaches == {"attn.out_proj": True}

    model = _MHA(cross=True)
    ep = torch.export.export(model, (torch.randn(1, 16, 64),))
    a = assign(ep, model)
    assert set(a.node_layer.values()) == {"attn"} and a.kind("attn") == "other"
    assert a.attention["attn"].startswith("pattern: nn.MultiheadAttention reads its packed in_proj_weight in "
                                          "aten.split_with_sizes.default, not in one linear"), a.attention


@pytest.mark.slow
def test_multihead_attention_splits_its_packed_in_projection(tmp_path):
    """nn.MultiheadAttention under self-attention: in_proj_weight colwise in 3 fused pieces over the 4 heads,
    out_proj rowwise. The solver weighs them on cost (replicate wins at this tiny size); set by hand at micro-batch
    2, each rank views its q as (L, B * H/tp, D): the batch merged before its own heads, no collective between.
    (Training at tp 2 against one process: tests/test_zoo_dist.py.)"""
    mha = write_zoo_model(tmp_path, "mha")
    res = compile_model(mha, gpus=2, pins=Pins(tp=2, pp=1), global_batch_size=2, out_dir=tmp_path / "mha")
    attn, out = res.graph.layers["blocks.0.attn"], res.graph.layers["blocks.0.attn.out_proj"]
    assert (attn.kind, attn.fused, attn.col_groups, attn.split_stop, len(attn.gemms)) == ("linear", 3, 4, "", 1)
    assert (out.row_groups, len(out.gemms)) == (4, 1)
    assert res.plan.tp_why["blocks.0.attn"].startswith("cost: "), res.plan.tp_why["blocks.0.attn"]
    _hand_set(mha, tmp_path / "mha_hand", {"attn": "colwise", "attn.out_proj": "rowwise", "fc1": "colwise",
                                            "fc2": "rowwise"})
    manifest = json.loads((tmp_path / "mha_hand" / "program" / "manifest.json").read_text())
    assert manifest["tp"]["shards"]["blocks.0.attn.in_proj_weight"] == {"dim": 0, "fused": 3}
    assert manifest["tp"]["shards"]["blocks.0.attn.in_proj_bias"] == {"dim": 0, "fused": 3}
    assert manifest["tp"]["shards"]["blocks.0.attn.out_proj.weight"] == {"dim": 1, "fused": 1}
    text = (tmp_path / "mha_hand" / "program" / "stage_0.py").read_text()
    assert "aten.unflatten.int(linear, -1, [3, 32])" in text
    assert "aten.view.default(select, [16, 4, 16])" in text  # 2 samples x 2 of the 4 heads
    assert "aten.view.default(transpose_2, [2, 2, 16, 16])" in text
    assert "gather_from_tp(" not in text and "scatter_to_tp(" not in text


CROSS = """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
            self.head = nn.Linear(64, 10)

        def forward(self, x):
            memory = x.flip(1)
            return self.head(self.attn(x, memory, memory, need_weights=False)[0])

    def model():
        return Net()

    def example_inputs(batch_size):
        return (torch.randn(batch_size, 16, 64),)
"""


@pytest.mark.slow
def test_cross_attention_is_kept_whole_with_a_reason(tmp_path):
    """nn.MultiheadAttention with query other than key and value splits in_proj_weight inside forward: the plan
    keeps it whole and says why; a hand-set split is refused in one line."""
    import textwrap

    path = tmp_path / "cross.py"
    path.write_text(textwrap.dedent(CROSS))
    res = compile_model(str(path), gpus=2, pins=Pins(tp=2, pp=1), global_batch_size=2, out_dir=tmp_path / "c")
    assert res.plan.tp["attn"] == "replicate"
    assert res.plan.tp_why["attn"].startswith("pattern: nn.MultiheadAttention reads its packed in_proj_weight in "
                                              "aten.split_with_sizes.default"), res.plan.tp_why["attn"]
    with pytest.raises(PartcError, match=r"^layer attn \(MultiheadAttention, other\) can only be replicate, not "
                                         r"colwise \(nn\.MultiheadAttention reads its packed in_proj_weight"):
        _hand_set(str(path), tmp_path / "c_hand", {"attn": "colwise"})


def test_sequence_parallel_gathers_are_said_in_the_plan(tmp_path):
    """Under sequence parallelism a whole layer reading the sequence-split stream (a replicated LM head) gets it
    all-gathered: the program stays correct, and the plan and the compile's warnings say where."""
    path, out = str(EXAMPLES / "gpt.py"), tmp_path / "sp"
    pins = Pins(tp=2, pp=1, dp=1, zero=0, micro_batch_size=1, precision="fp32", sequence_parallel=True)
    first = compile_model(path, gpus=2, pins=pins, global_batch_size=2, out_dir=out)
    plan = json.loads((out / "plan.json").read_text())
    plan["tp"] = {f: "replicate" if f == "lm_head" else megatron_style(f, vocab=True) or "replicate"
                  for f in first.plan.tp}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    result = compile_model(path, gpus=2, from_plan=str(tmp_path / "plan.json"), out_dir=out)
    gathers = json.loads((out / "plan.json").read_text())["model"]["sequence_parallel_gathers"]
    assert len(gathers) == 1 and "lm_head" in gathers[0], gathers
    assert any(w.startswith("sequence parallelism: 1 place(s) where the program does not keep")
               for w in result.warnings)
    assert "tp.gather_from_tp(" in (out / "program" / "stage_0.py").read_text()


def test_search_keeps_sequence_parallelism_only_where_the_program_does(tmp_path, monkeypatch):
    """The search prices a sequence-parallel plan as its program runs at the edges of the split; where the program
    falls back elsewhere (forced here at tp 2 with the tiny GPT's map, which leaves the layers feeding its rowwise
    fc2 whole), compile prices the plan as its program runs (`price_sequence_fallbacks`) and keeps it only if it
    still beats the best plan without it: here it does not, and the plan says nothing is gathered. Priced as
    faster than every plan (a stand-in for the pricing), it is kept, and the plan names the places. Where the
    program keeps the split (Megatron's map), `sequence_fallbacks` is empty."""
    import partc.compile as compile_module
    import partc.passes.search_space as search_space
    found, priced = [], []

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        found.append(out[0])
        return out

    def price(*args, **kwargs):
        out = real_price(*args, **kwargs)
        priced.append(out)
        return out

    real, real_price = compile_module.sequence_fallbacks, compile_module.price_sequence_fallbacks
    monkeypatch.setattr(compile_module, "sequence_fallbacks", spy)
    monkeypatch.setattr(compile_module, "price_sequence_fallbacks", price)
    monkeypatch.setattr(search_space, "sequence_parallel_choices",
                        lambda graph, tp, pins, cp=1: (pins.sequence_parallel,) if pins.sequence_parallel is not None
                        else (tp > 1,))
    path, out = str(EXAMPLES / "gpt.py"), tmp_path / "gpt"
    result = compile_model(path, gpus=2, pins=Pins(tp=2, precision="fp32"), global_batch_size=2, out_dir=out)
    assert len(found) == 1 and found[0], "the search's sequence-parallel plan was checked, and not kept"
    assert any("not split along the sequence" in line or "whole" in line for line in found[0]), found[0]
    assert not result.plan.parallel.sequence_parallel
    assert priced and priced[0].parallel.sequence_parallel and priced[0].tp.program
    assert priced[0].step_time_s >= result.best.step_time_s  # decided with the priced numbers
    assert "sequence_parallel_gathers" not in json.loads((out / "plan.json").read_text())["model"]
    assert not [w for w in result.warnings if w.startswith("sequence parallelism")]

    monkeypatch.setattr(compile_module, "price_sequence_fallbacks", lambda graph, clus, best, program:
                        dataclasses.replace(best, prediction=dataclasses.replace(best.prediction, step_time_s=1e-6)))
    kept = compile_model(path, gpus=2, pins=Pins(tp=2, precision="fp32"), global_batch_size=2,
                         out_dir=tmp_path / "kept")
    assert kept.plan.parallel.sequence_parallel
    assert kept.plan.model["sequence_parallel_gathers"] == found[-1]
    assert all(not a["parallel"].get("sequence_parallel") for a in kept.plan.alternatives)

    pinned = Pins(tp=2, pp=1, dp=1, zero=0, micro_batch_size=1, precision="fp32", sequence_parallel=True)
    first = compile_model(path, gpus=2, pins=pinned, global_batch_size=2)
    first.plan.tp = {f: megatron_style(f, vocab=True) or "replicate" for f in first.plan.tp}
    assert real(first.spec, first.spec.build(), first.traced, first.plan, path=path, entry="model")[0] == []


WIDE_GPT = """
    import importlib.util
    import sys

    import torch

    # examples/gpt.py at GPT-3's widths, 2 layers
    _spec = importlib.util.spec_from_file_location("partc_example_gpt", {path!r})
    gpt = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = gpt
    _spec.loader.exec_module(gpt)
    CONFIG = gpt.GPTConfig(vocab_size=50257, seq_len=2048, hidden=12288, heads=96, layers=2)
    loss_fn = gpt.loss_fn

    def model():
        return gpt.GPT(CONFIG)

    def example_inputs(batch_size):
        return (torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.seq_len)),)

    def example_targets(batch_size):
        return torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.seq_len))
"""


def test_searched_sequence_parallel_gpt_keeps_the_split_and_the_plan_s_bytes(tmp_path):
    """GPT-3's widths (h 12,288, 96 heads, s 2,048, V 50,257, which does not divide over tp: the token and position
    embeddings are split colwise, the output layer rowwise, as for GPT-3 175B), 2 layers, 4 GPUs at tp 2 and pp 2:
    with sequence parallelism (pinned: the plan without it is 0.03% faster here, its embeddings' outputs crossing
    the cut split, `passes.cost_step.split_cut_bytes`), the program keeps the split everywhere: the embeddings' sum
    enters it once (gathered over the features, each rank keeping its part of the sequence), the output layer reads
    the final norm's output all-gathered and all-reduces the logits (Megatron-LM's edges), so the plan is kept as
    searched. `partc check` measures the plan's bytes on every axis of both pipeline ranks, to the byte (the sum is
    converted where the first block adds the embeddings, past the boundary after them)."""
    from partc.runtime.check import check_rank, representatives
    from partc.runtime.program import read_program
    path, out = tmp_path / "gpt_wide.py", tmp_path / "out"
    path.write_text(textwrap.dedent(WIDE_GPT.format(path=str(EXAMPLES / "gpt.py"))))
    result = compile_model(str(path), gpus=4, pins=Pins(tp=2, pp=2, sequence_parallel=True), global_batch_size=4,
                           out_dir=out)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["parallel"]["sequence_parallel"], plan["parallel"]
    assert not [p for p in plan["alternatives"] if p["step_time_s"] < plan["predicted"]["step_time_s"]]
    assert "sequence_parallel_gathers" not in plan["model"]
    assert not [w for w in result.warnings if w.startswith("sequence parallelism")], result.warnings
    assert {f: plan["tp"][f] for f in ("tok", "pos", "lm_head")} == {"tok": "colwise", "pos": "colwise",
                                                                      "lm_head": "rowwise"}
    assert plan["stages"][0]["modules"] == ["tok", "pos"]  # the boundary between the embeddings and their sum
    source = "".join(f.read_text() for f in sorted((out / "program").glob("stage_*.py")))
    assert source.count("tp.scatter_to_tp(") == 2  # the sum's part of the sequence, the output layer's features
    assert source.count("tp.reduce_from_tp(") == 1  # the logits
    files = read_program(str(out))
    torch.set_num_threads(1)
    for rank in representatives(result.plan.parallel):
        r = check_rank(files, rank, slack_bytes=0)
        assert r.comm_bytes == {k: int(v) for k, v in r.predicted_comm_bytes.items()}, (rank, r.comm_bytes)
        assert r.comm_bytes["tp"] > 0


def test_colwise_embeddings_cross_the_cut_split_as_the_plan_prices_them(tmp_path):
    """A small GPT at tp 2, pp 2 without sequence parallelism, the token and position embeddings colwise and alone
    on the first stage: their outputs cross the cut as each TP rank's half (the sum that gathers them is on the
    next stage), so nothing is scattered or gathered at the cut. The plan charges no all-gather there, forward or
    backward, and each rank's half on the pipeline: `partc check` measures both, to the byte, on both ranks."""
    from partc.runtime.check import check_rank, representatives
    from partc.runtime.program import read_program
    path = tmp_path / "gpt_small.py"
    path.write_text(textwrap.dedent(WIDE_GPT.format(path=str(EXAMPLES / "gpt.py"))).replace(
        "vocab_size=50257, seq_len=2048, hidden=12288, heads=96, layers=2",
        "vocab_size=101, seq_len=16, hidden=64, heads=4, layers=2"))
    pins = Pins(tp=2, pp=2, sequence_parallel=False, micro_batch_size=4)
    compile_model(str(path), gpus=4, pins=pins, global_batch_size=4, out_dir=tmp_path / "searched")
    plan = json.loads((tmp_path / "searched" / "plan.json").read_text())
    plan["tp"].update(tok="colwise", pos="colwise")
    plan["stages"][0]["modules"], plan["stages"][1]["modules"] = ["tok", "pos"], ["blocks.0", "blocks.1", "ln_f",
                                                                                  "lm_head"]
    (tmp_path / "edited.json").write_text(json.dumps(plan))
    out = tmp_path / "out"
    result = compile_model(str(path), gpus=4, global_batch_size=4, from_plan=str(tmp_path / "edited.json"),
                           out_dir=out)
    assert not result.plan.parallel.sequence_parallel
    source = (out / "program" / "stage_0.py").read_text() + (out / "program" / "stage_1.py").read_text()
    assert "scatter_to_next_stage" not in source and "gather_from_previous_stage" not in source, source
    files = read_program(str(out))
    torch.set_num_threads(1)
    halves = (4 * 16 * 64 + 16 * 64) * 2 // 2  # bf16 token and position outputs, each rank's half
    for rank in representatives(result.plan.parallel):
        r = check_rank(files, rank, slack_bytes=0)
        assert r.comm_bytes == {k: int(v) for k, v in r.predicted_comm_bytes.items()}, (rank, r.comm_bytes)
        assert r.comm_bytes["pp"] == 2 * halves  # forward and backward
    assert check_rank(files, 0, slack_bytes=0).comm_bytes["tp"] == 0  # the first stage runs no TP collective


def test_vision_transformer_tokens_come_from_the_trace(tmp_path):
    """A vision transformer's tokens appear after the patch embedding (its input is an image): sequence
    parallelism splits the graph's tokens (16 patches and the class token in the bundled ViT), not the image's
    channels. 17 do not divide over tp 2: the search does not weigh it, and a pin is refused in one line."""
    from partc.passes.search_space import sequence_parallel_choices
    path = str(EXAMPLES / "vit.py")
    graph = trace_file(path)[1].graph
    assert graph.seq_len == 17 and sequence_parallel_choices(graph, 2, Pins()) == (False,)
    pins = Pins(tp=2, pp=1, dp=1, zero=0, micro_batch_size=1, precision="fp32")
    with pytest.raises(PartcError, match=r"^sequence parallelism: the sequence \(17 tokens\) does not divide over "
                                         r"tp=2; compile with --no-sequence-parallel or another --tp$"):
        compile_model(path, gpus=2, pins=dataclasses.replace(pins, sequence_parallel=True), global_batch_size=2,
                      out_dir=tmp_path / "vit")


if __name__ == "__main__":  # a rank of `tp_runs`' launch
    _worker(*sys.argv[1:])
