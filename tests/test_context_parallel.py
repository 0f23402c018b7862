"""Context parallelism (docs/context-parallel.md): the load balance, the proof in the graph and its refusals, the
plan's cp traffic, and training under torchrun on CPU (gloo) compared with one process.

The multi-process test runs every program in one launch of 8 ranks: the bundled GPT at cp 2 x tp 2 x pp 2 and
cp 4 x dp 2, the bundled LLaMA at cp 2 x tp 2 x pp 2; Hugging Face's LLaMA (its causal mask proven,
`partc.passes.causal_mask`) at cp 2 x tp 2 x pp 2 and cp 4 x dp 2 with ZeRO-3; with sequence parallelism, the
bundled GPT at cp 2 x dp 2 x tp 2 (ZeRO-1) and cp 2 x tp 2 x pp 2, the bundled LLaMA at cp 2 x tp 2 x pp 2 and
cp 2 x dp 2 x tp 2 with ZeRO-3 and `sp_regather`, Hugging Face's LLaMA at cp 2 x dp 2 x tp 2 with ZeRO-3; the
bundled LLaMA with targets ignored unevenly over samples and cp ranks at cp 2 x dp 2 x tp 2 and cp 2 x dp 2 x pp 2.
Each job trains with SGD in fp32 from a saved state dict; its losses and gathered state dict must equal
`reference_run` within 1e-5 (relative; with ignored targets, one process's loss over the whole batch), and every
rank's collective payload must equal the plan's ``predicted.ranks[].comm_bytes`` axis by axis (``cp`` and ``dp``
over dp x cp included). The same launch saves a checkpoint under one cp plan (AdamW) and resumes it under another.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import (EXAMPLES, assert_close_losses, assert_close_states, assert_comm_matches_plan, compile_program,
                     llama_variant, megatron_style, reference_once, run_jobs, write_hf_model)
from partc.collectives import cp_rank_positions
from partc.compile import compile_model
from partc.errors import PartcError
from partc.model_file import load_model_file
from partc.parallel import Pins
from partc.runtime.check import check_program


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_chunks_cover_the_sequence_and_balance_causal_work(cp):
    s = 32
    pos = [cp_rank_positions(s // cp, r, cp) for r in range(cp)]
    assert sorted(torch.cat(pos).tolist()) == list(range(s))
    work = {int((p + 1).sum()) for p in pos}  # keys a causal query at position p attends to: p + 1
    assert len(work) == 1, work


TIME_CONV = """
import torch
import torch.nn.functional as F
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(64, 32)
        self.qkv = nn.Linear(32, 96)
        self.mix = nn.Conv1d(32, 32, 3, padding=1)
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        x = self.tok(ids)
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 16)).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal={causal}).transpose(1, 2).flatten(2)
        {mix}
        return self.head(y)


def model():
    return Model()


def example_inputs(batch_size):
    return (torch.randint(0, 64, (batch_size, 16)),)
"""


@pytest.mark.parametrize("causal, mix, why", [
    (True, "y = self.mix(y.transpose(1, 2)).transpose(1, 2)", "mixes positions"),
    (False, "", "not causal"),
    (True, "y = y - y.mean(1, keepdim=True)", "reduces over the sequence"),
    (True, "y = torch.cumsum(y, 1)", "mixes positions along the sequence"),
])
def test_refuses_what_mixes_positions(tmp_path, causal, mix, why):
    path = tmp_path / "m.py"
    path.write_text(TIME_CONV.format(causal=causal, mix=mix))
    with pytest.raises(PartcError, match=why) as err:
        compile_model(str(path), gpus=2, pins=Pins(cp=2, dp=1, tp=1, pp=1), global_batch_size=2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("loss, why", [
    ("F.cross_entropy(y.flatten(0, 1), t.flatten()) + 1e-3 * y.pow(2).mean()", "more than one cross-entropy"),
    ("F.cross_entropy(y.flatten(0, 1), t.flatten(), reduction='sum')", "not a mean"),
    ("(F.cross_entropy(y.flatten(0, 1), t.flatten(), reduction='none') * (t.flatten() > 3)).sum() / 7",
     "more than one cross-entropy"),
    # Hugging Face's causal-LM loss shifts its labels (the next token's, the last position -100): under cp each
    # rank would shift its own chunks
    ("F.cross_entropy(y.flatten(0, 1), F.pad(t, (0, 1), value=-100)[:, 1:].flatten(), ignore_index=-100)",
     "moves positions"),
    ("F.cross_entropy(y[:, :-1].flatten(0, 1), t[:, 1:].flatten())", "moves positions"),
])
def test_refuses_a_loss_not_proven_a_mean_over_tokens(tmp_path, loss, why):
    """Each cp rank's loss is weighed by the tokens its cross-entropy counts (or is a mean over as many elements
    as every other rank's): a second term, a sum, or a mean by hand is not proven the batch's mean."""
    path = tmp_path / "m.py"
    path.write_text(TIME_CONV.format(causal=True, mix="") + f"""

def example_targets(batch_size):
    return torch.randint(0, 64, (batch_size, 16))


def loss_fn(y, t):
    return {loss}
""")
    with pytest.raises(PartcError, match=f"not proven for this loss: .*{why}") as err:
        compile_model(str(path), gpus=2, pins=Pins(cp=2, dp=1, tp=1, pp=1), global_batch_size=2)
    assert "\n" not in str(err.value)


@pytest.mark.slow  # partc check in a process of its own (as tests/test_check.py marks it)
def test_plan_prices_the_key_value_gathers(tmp_path):
    """LLaMA tiny: 4 layers, 2 key/value heads of 16 (gathered before grouped-query attention repeats them), 64
    tokens, fp32: per layer and micro-batch the keys and values gathered in forward and reduce-scattered back."""
    result = compile_model(str(EXAMPLES / "llama.py"), gpus=2, global_batch_size=4, out_dir=tmp_path / "out",
                           pins=Pins(cp=2, dp=1, tp=1, pp=1, micro_batch_size=1, precision="fp32"))
    kv = 64 * 2 * 16 * 4  # one sample's keys (or values), bytes
    assert result.plan.parallel.cp == 2
    layers, micro_batches = 4, 4
    assert result.plan.to_dict()["predicted"]["ranks"][0]["comm_bytes"]["cp"] == layers * micro_batches * 2 * 2 * kv
    stage = (tmp_path / "out" / "program" / "stage_0.py").read_text()
    assert stage.count("tp.cp_attention(") == 4 and "repeats=2" in stage
    assert "tp.cp_arange(" in stage and "scaled_dot_product_attention.default" not in stage
    # `partc check` runs rank 0 on fake tensors at full world size and measures the same traffic
    (rank,) = check_program(str(tmp_path / "out"), slack_bytes=0)
    assert rank.comm_bytes["cp"] == rank.predicted_comm_bytes["cp"] > 0
    assert rank.comm_bytes["dp"] == rank.predicted_comm_bytes["dp"] > 0  # reduced over dp x cp = 1 x 2
    assert all(row.agrees for row in rank.rows() if row.what.startswith("comm"))


def test_search_tries_cp_for_long_causal_sequences():
    """The search's cp degrees: 1, and those keeping chunks of MIN_CP_CHUNK tokens, for a model with causal
    attention; a pin as given. The tiny LLaMA's graph at a longer sequence stands for a long-context model."""
    import dataclasses

    from helpers import trace_file
    from partc.passes.search_space import MIN_CP_CHUNK, cp_degrees

    _, traced = trace_file(EXAMPLES / "llama.py")
    graph = traced.graph
    assert all(len(u.cp_kv) == 2 for u in graph.units if u.kind == "block")  # keys and values of each attention
    assert cp_degrees(graph, 8, Pins()) == [1]  # 64 tokens: chunks far below MIN_CP_CHUNK
    graph = dataclasses.replace(graph, seq_len=4 * MIN_CP_CHUNK)
    assert cp_degrees(graph, 8, Pins()) == [1, 2]
    assert cp_degrees(graph, 8, Pins(cp=4)) == [4]
    graph.units = [dataclasses.replace(u, cp_kv=[]) for u in graph.units]  # no causal attention
    assert cp_degrees(graph, 8, Pins()) == [1]


@pytest.mark.slow  # partc check in a process of its own (as tests/test_check.py marks it)
def test_sequence_parallel_under_cp_splits_each_ranks_tokens(tmp_path):
    """cp 2 x tp 2 with sequence parallelism (tiny LLaMA, 64 tokens): between the tp regions each tp rank holds 1/2
    of its cp rank's 32 tokens; `partc check` measures every axis's bytes as the plan predicts them."""
    pins = dict(cp=2, tp=2, dp=1, pp=1, micro_batch_size=1, precision="fp32", recompute="none", zero=0)
    styles = lambda f, s: megatron_style(f, vocab=True) or "replicate"  # noqa: E731 - the tiny model's solve
    plan = compile_program("llama", tmp_path / "out", global_batch_size=2, tp_styles=styles, **pins,  # replicates
                           sequence_parallel=True, sp_regather=False).plan.to_dict()
    assert plan["parallel"]["sequence_parallel"] and "sequence_parallel_gathers" not in plan["model"]
    stage = (tmp_path / "out" / "program" / "stage_0.py").read_text()
    assert stage.count("tp.cp_attention(") == 4 and "tp.gather_from_sp(" in stage and \
        "tp.reduce_scatter_to_sp(" in stage
    (rank,) = check_program(str(tmp_path / "out"), slack_bytes=0)
    for axis in ("tp", "cp", "dp"):
        assert rank.comm_bytes[axis] == rank.predicted_comm_bytes[axis] > 0, axis


@pytest.mark.slow
def test_check_measures_the_replayed_embedding_gather(tmp_path):
    """A colwise token embedding's output is all-gathered where it is first read, in the first block's code, so that
    block's full recomputation runs the gather again: the plan charges the replay (`passes.cost_tp.REPLAY`) and `partc
    check` measures the plan's tp bytes to the byte (tiny LLaMA, cp 2 x tp 2, bf16)."""
    pins = dict(cp=2, tp=2, dp=1, pp=1, micro_batch_size=1, precision="bf16", recompute="full", zero=0)
    styles = lambda f, s: "colwise" if f == "tok" else megatron_style(f, vocab=True) or "replicate"  # noqa: E731
    compile_program("llama", tmp_path / "out", global_batch_size=2, tp_styles=styles, sequence_parallel=False,
                    **pins)
    stage = (tmp_path / "out" / "program" / "stage_0.py").read_text()
    block = stage[stage.index("def blocks_0("):stage.index("def blocks_1(")]
    assert "tp.gather_from_tp(embedding, 2)" in block  # in the recomputed block, not in tok's code
    (rank,) = check_program(str(tmp_path / "out"), slack_bytes=0)
    # charged once, the plan was 2 micro-batches x a cp rank's 32 tokens x 64 features x 2 bytes short
    assert rank.comm_bytes["tp"] == rank.predicted_comm_bytes["tp"] == 221952


def test_sequence_parallel_needs_each_cp_ranks_tokens_to_divide_over_tp():
    """The search weighs sequence parallelism under cp where a rank's s/cp tokens divide over tp; a pin that
    cannot be is refused in one line (cp pinned) or skips that cp (cp searched)."""
    import dataclasses

    from helpers import trace_file
    from partc.passes.search_space import sequence_parallel_choices

    _, traced = trace_file(EXAMPLES / "llama.py")
    graph = traced.graph  # 64 tokens
    assert sequence_parallel_choices(graph, 2, Pins(), cp=2) == (False, True)
    assert sequence_parallel_choices(graph, 2, Pins(sequence_parallel=True, cp=2), cp=2) == (True,)
    odd = dataclasses.replace(graph, seq_len=36)  # 18 tokens a cp rank at cp 2
    assert sequence_parallel_choices(odd, 4, Pins(), cp=2) == (False,)
    assert sequence_parallel_choices(odd, 4, Pins(sequence_parallel=True), cp=2) == ()
    with pytest.raises(PartcError, match="do not divide over tp=4") as err:
        sequence_parallel_choices(odd, 4, Pins(sequence_parallel=True, cp=2), cp=2)
    assert "\n" not in str(err.value)


# name: (model, cp, tp, pp, dp, zero, global batch)
CONFIGS = {
    "gpt_cp2_tp2_pp2": ("gpt", 2, 2, 2, 1, 1, 4),
    "llama_cp2_tp2_pp2": ("llama", 2, 2, 2, 1, 1, 4),
    "llama_cp2_dp2_tp2_z3_sp": ("llama", 2, 2, 1, 2, 3, 4),
    "gpt_cp4_dp2_z0": ("gpt", 4, 1, 1, 2, 0, 4),
    "hf_llama_cp2_tp2_pp2": ("hf_llama", 2, 2, 2, 1, 1, 4),
    "hf_llama_cp2_dp2_tp2_z3_sp": ("hf_llama", 2, 2, 1, 2, 3, 4),
    "hf_llama_cp4_dp2_z3": ("hf_llama", 4, 1, 1, 2, 3, 4),
    # with sequence parallelism: each tp rank holds 1/t of its cp rank's s/cp tokens between the tp regions
    "gpt_cp2_dp2_tp2_z1_sp": ("gpt", 2, 2, 1, 2, 1, 4),
    "gpt_cp2_tp2_pp2_sp": ("gpt", 2, 2, 2, 1, 1, 4),
    "llama_cp2_tp2_pp2_sp": ("llama", 2, 2, 2, 1, 1, 4),
    # with expert parallelism: ep 2 carved from dp 4 at each cp coordinate (two ep groups), the experts' gradients
    # reduced and ZeRO-3-sharded over the dp / ep x cp = 4 ranks holding them
    "hf_mixtral_cp2_dp4_ep2_z3": ("hf_mixtral", 2, 1, 1, 4, 3, 8),
    # a cross-entropy that ignores targets (-100), unevenly over samples, micro-batches and cp ranks: the loss is
    # weighed by the tokens each counts; the vocab-parallel loss (tp 2) and the gathered logits' (pp 2)
    "ignored_cp2_dp2_tp2": ("ignored", 2, 2, 1, 2, 1, 4),
    "ignored_cp2_dp2_pp2": ("ignored", 2, 1, 2, 2, 0, 4),
}
EP = {"hf_mixtral_cp2_dp4_ep2_z3": 2}
"""Configurations pinned to expert parallelism, and its degree (the others have no experts)."""
SP = {name for name in CONFIGS if name.endswith("_sp")}
"""Configurations pinned to sequence parallelism (the others pinned without it)."""
REGATHER = {"llama_cp2_dp2_tp2_z3_sp"}
"""Of those, pinned to `sp_regather` (the colwise layers' inputs gathered again in backward)."""
STEPS = 2
SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0}
ADAMW = {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.1}
CHECKPOINT = ("llama_cp2_dp2_tp2_z3_sp", "llama_cp2_tp2_pp2")
"""A checkpoint written at step 1 of 2 under the first plan (AdamW, its states sharded over dp x cp by ZeRO-3) and
resumed under the second (ZeRO-1 over cp alone, pp 2), against the first run uninterrupted."""
HF_SEQ_LEN = 32
"""Tokens of the tiny Hugging Face LLaMA's samples (its config allows 128): 8 chunks of 4 at cp 4."""


IGNORED = f"""
import importlib.util
import sys

import torch

_spec = importlib.util.spec_from_file_location("partc_example_llama_ignored", {str(EXAMPLES / "llama.py")!r})
llama = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = llama
_spec.loader.exec_module(llama)
model, example_inputs = llama.model, llama.example_inputs

SHARE = (3 / 8, 1.0, 5 / 8, 0.0, 1 / 8)  # of each sample's positions, from the first, ignored: sample 1 counts none


def example_targets(batch_size):
    c = llama.config()
    t = torch.randint(0, c.vocab_size, (batch_size, c.seq_len))
    for j in range(batch_size):
        t[j, :int(SHARE[j % len(SHARE)] * c.seq_len)] = -100
    return t


def loss_fn(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
"""
"""The bundled LLaMA whose targets are ignored at the start of each sample: at cp 2 (chunks 0 and 3 of 16 tokens on
rank 0, 1 and 2 on rank 1) the ranks count 16 and 24 of their 32 tokens of sample 0, none of sample 1."""


def _path(model: str, tmp: Path) -> str:
    if model == "ignored":
        path = tmp / "llama_ignored.py"
        path.write_text(IGNORED)
        return str(path)
    return write_hf_model(tmp, model[3:]) if model.startswith("hf_") else str(EXAMPLES / f"{model}.py")


def _seq_len(model: str) -> int | None:
    return HF_SEQ_LEN if model.startswith("hf_") else None


def test_hf_causal_mask_is_proven(tmp_path):
    """Hugging Face builds its causal mask explicitly under torch.export (positions compared, packed documents
    detected): proven exactly causal, the attention becomes is_causal=True with no mask and no s x s op left."""
    from helpers import trace_file
    from partc.passes.context import is_causal_attention

    _, traced = trace_file(write_hf_model(tmp_path, "llama"), seq_len=16)
    nodes = list(traced.exported.graph.nodes)
    attention = [n for n in nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]
    assert len(attention) == 2 and all(is_causal_attention(n) for n in attention)
    assert not any(len(n.meta["val"].shape) == 4 and tuple(n.meta["val"].shape[-2:]) == (16, 16)
                   for n in nodes if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
                   and n.meta["val"].dtype == torch.bool)
    assert all(len(u.cp_kv) == 2 for u in traced.graph.units if u.kind == "block")


HF_MASKED = {
    "sliding window": """
        from transformers import MistralConfig, MistralForCausalLM

        def model():
            return MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=1, num_attention_heads=2,
                                                    num_key_value_heads=1, max_position_embeddings=64,
                                                    sliding_window=4))
    """,
    "padding": """
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        class Padded(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lm = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                       num_hidden_layers=1, num_attention_heads=2,
                                                       num_key_value_heads=1, max_position_embeddings=64))

            def forward(self, ids, attention_mask):
                return self.lm(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits

        def model():
            return Padded()

        def example_inputs(batch_size):
            return (torch.randint(0, 64, (batch_size, 16)), torch.ones(batch_size, 16, dtype=torch.long))

        def example_targets(batch_size):
            return torch.randint(0, 64, (batch_size, 16))
    """,
}


@pytest.mark.parametrize("case", list(HF_MASKED))
def test_refuses_hf_masks_not_proven_causal(tmp_path, case):
    """A sliding window (``j <= i`` and ``i - j < w``) or a mask from an input (padding) is not causal attention:
    the mask keeps its two sequence dims and cp is refused in one line."""
    import textwrap

    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent(HF_MASKED[case]))
    with pytest.raises(PartcError, match="not proven") as err:
        compile_model(str(path), gpus=2, pins=Pins(cp=2, dp=1, tp=1, pp=1), global_batch_size=2,
                      seq_len=None if case == "padding" else 16)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("cp")
    inits = {}
    for m in ("gpt", "llama", "hf_llama", "hf_mixtral", "ignored"):
        torch.manual_seed(1234)
        inits[m] = load_model_file(_path(m, tmp), seq_len=_seq_len(m)).build().state_dict()
        torch.save(inits[m], tmp / f"init_{m}.pt")
    jobs = []
    for name, (model, cp, tp, pp, dp, zero, gbs) in CONFIGS.items():
        styles = (lambda f, s: megatron_style(f, vocab=True) or "replicate") if tp > 1 else None
        compile_program(_path(model, tmp), tmp / name, global_batch_size=gbs, seq_len=_seq_len(model),
                        tp_styles=styles, cp=cp, tp=tp, pp=pp, dp=dp, zero=zero, micro_batch_size=1,
                        schedule="1f1b", recompute="none", precision="fp32",
                        sequence_parallel=name in SP if tp > 1 else None, ep=EP.get(name),
                        sp_regather=(name in REGATHER) if name in SP else None)
        # HF LLaMA starts from --init-checkpoint (each rank slices its shards from the file), as in
        # test_runtime_tp; the rest from Program.load_state_dict
        jobs.append({"out": str(tmp / name), "steps": STEPS, "result": str(tmp / f"{name}.pt"), **SGD,
                     ("init_checkpoint" if model == "hf_llama" else "init"): str(tmp / f"init_{model}.pt")})
    whole, resumed = CHECKPOINT
    jobs += [{"out": str(tmp / whole), "steps": STEPS, "init": str(tmp / "init_llama.pt"), "save": str(tmp / "ck"),
              "save_at": 1, "result": str(tmp / "ck_whole.pt"), **ADAMW},
             {"out": str(tmp / resumed), "steps": STEPS, "load": str(tmp / "ck"), "result": str(tmp / "ck_resumed.pt"),
              **ADAMW}]
    run_jobs(8, jobs, tmp)
    return tmp, inits


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_trains_like_one_process(runs, name):
    tmp, inits = runs
    model, cp, tp, pp, dp, zero, gbs = CONFIGS[name]
    got = torch.load(tmp / f"{name}.pt", weights_only=True)
    # ignored targets: one process's loss over the whole batch (its mean over every counted token), not the mean of
    # its micro-batches' means; configurations of one model, batch and tying: one reference
    losses, state = reference_once(_path(model, tmp), inits[model], steps=STEPS, seed=0, seq_len=_seq_len(model),
                                   global_batch_size=gbs, precision="fp32",
                                   micro_batch_size=None if model == "ignored" else 1, untied=pp > 1, **SGD)
    assert_close_losses(got["losses"], losses)
    assert_close_states(got["state"], state)
    if name in EP:  # a real router: its all-to-alls send other bytes than the uniform routing the plan prices
        assert_comm_matches_plan(tmp / name, got["comm"], rtol=0.0, axes=("pp", "dp", "cp", "tp"))
        assert all(rank["ep"] > 0 for step in got["comm"] for rank in step)
    else:
        assert_comm_matches_plan(tmp / name, got["comm"])
    assert all(rank.get("cp", 0) > 0 for step in got["comm"] for rank in step)
    if name in SP:
        plan = json.loads((tmp / name / "plan.json").read_text())
        assert plan["parallel"]["sequence_parallel"] and "sequence_parallel_gathers" not in plan["model"]
        assert got["replica_diff"] == 0.0  # the norms, applied to each rank's part, stay identical over tp


@pytest.mark.slow
def test_checkpoint_resumes_under_another_cp_plan(runs):
    """Saved at step 1 under cp 2 x dp 2 x tp 2 (ZeRO-3, the optimizer's states sharded over dp x cp), resumed under
    cp 2 x tp 2 x pp 2 (ZeRO-1): its step 2 is the uninterrupted run's."""
    tmp, _ = runs
    whole = torch.load(tmp / "ck_whole.pt", weights_only=True)
    resumed = torch.load(tmp / "ck_resumed.pt", weights_only=True)
    assert resumed["start"] == 1 and len(resumed["losses"]) == STEPS - 1
    assert_close_losses(resumed["losses"], whole["losses"][1:])
    assert_close_states(resumed["state"], whole["state"], rtol=1e-5, atol=1e-5)  # AdamW: as test_runtime_dist
    assert_comm_matches_plan(tmp / CHECKPOINT[1], resumed["comm"])


@pytest.fixture(scope="module")
def loss_bound_llama(tmp_path_factory):
    return llama_variant(tmp_path_factory.mktemp("loss_bound") / "llama_wide_vocab.py", "vocab_size=4096, seq_len=512, "
                         "hidden=128, heads=4, kv_heads=2, layers=2, ffn_hidden=256", targets=True)


@pytest.mark.slow  # partc check in a process of its own (as tests/test_check.py marks it)
@pytest.mark.parametrize("tp, vocab_parallel", [(1, True), (2, True), (2, False)])
def test_check_agrees_on_the_loss_moment(tmp_path, loss_bound_llama, tp, vocab_parallel):
    """The shape of LLaMA-3.1 8B's searched 128K plan (dp 16, cp 4, ZeRO-3 over dp x cp, full recomputation, tp 1,
    the loss on the only stage) in small: the bundled LLaMA with a vocabulary 32 times its width, cp 2 x dp 2,
    bf16, where the loss's peak is most of the activations. `partc check` measures the plan's activations within
    a few percent: the loss's peak is a moment of its own (`partc.passes.memory.stage_extra_bytes`), the logits
    and their log-probabilities and gradients with no block's recomputation, unit gradient or ZeRO-3 gathered unit
    beside it (the plan added those to it at tp 1, 25% over; and at tp 2 the vocab-parallel loss's two gathered
    units, 10% over). Also at tp 2, whether the loss runs on the vocabulary shards or on the logits gathered."""
    from helpers import compile_program

    styles = (lambda f, s: megatron_style(f, vocab=True) or "replicate") if tp > 1 else None
    compile_program(loss_bound_llama, tmp_path / "out", global_batch_size=4, tp_styles=styles,
                    vocab_parallel_loss=vocab_parallel, cp=2, dp=2, tp=tp, pp=1, zero=3, micro_batch_size=1,
                    recompute="full", precision="bf16")
    (rank,) = check_program(str(tmp_path / "out"))
    rows = {row.what: row for row in rank.rows()}
    assert rows["memory activations"].predicted > 3 * rank.memory_bytes["params"]  # the loss dominates
    for what in ("memory activations", "memory peak"):
        assert abs(rows[what].error) < 0.01, rows[what].to_dict()
    assert all(row.agrees for row in rows.values()), [r.to_dict() for r in rows.values() if not r.agrees]


@pytest.mark.slow  # partc check in a process of its own (as tests/test_check.py marks it)
def test_plan_prices_what_a_cp_block_keeps(tmp_path):
    """cp 2, bf16, no recomputation: what a block keeps a micro-batch, measured by `partc check` as the difference
    between the model cut to 1 and to 2 blocks, is what the plan charges (within 1%): beyond the trace's share, the
    whole sequence's repeated keys and values and the attention's output a second time (each query chunk's kernel
    saves its own, the output projection their concatenation: one [s/cp, h] tensor, 6% of this block)."""
    block = {}
    for layers in (1, 2):
        # examples/llama.py at 512 tokens, h 128, 4 query heads a key/value head (LLaMA-3 8B's grouping)
        path = llama_variant(tmp_path / f"llama_{layers}.py", "vocab_size=64, seq_len=512, hidden=128, heads=4, "
                             f"kv_heads=1, layers={layers}, ffn_hidden=352")
        compile_model(str(path), gpus=2, global_batch_size=1, out_dir=tmp_path / f"out{layers}",
                      pins=Pins(cp=2, dp=1, tp=1, pp=1, micro_batch_size=1, precision="bf16", recompute="none",
                                zero=0))
        (rank,) = check_program(str(tmp_path / f"out{layers}"), slack_bytes=0)
        (row,) = [r for r in rank.rows() if r.what == "memory activations"]
        block[layers] = (row.predicted, row.measured)
    predicted, measured = (block[2][i] - block[1][i] for i in (0, 1))
    assert measured == pytest.approx(predicted, rel=0.01), (predicted / 2**20, measured / 2**20)


@pytest.mark.slow
def test_plan_prices_what_a_sequence_parallel_block_keeps(tmp_path):
    """cp 2 x tp 2 with sequence parallelism and `sp_regather`, bf16: what a block keeps a micro-batch (1 and 2
    blocks, as above) is what the plan charges, to a few bytes. The rotary tables the attention multiplies its
    colwise queries and keys by (their bf16 casts, [s/cp, head_dim] each) are whole on every tp rank: the plan
    once divided them by t, as the split op that saves them, one [s/cp, h/t] tensor a block short."""
    block = {}
    styles = lambda f, s: megatron_style(f, vocab=True) or "replicate"  # noqa: E731
    for layers in (1, 2):
        # 2 key/value heads: the tp ranks split the attention by heads
        path = llama_variant(tmp_path / f"llama_{layers}.py", "vocab_size=64, seq_len=512, hidden=128, heads=4, "
                             f"kv_heads=2, layers={layers}, ffn_hidden=352")
        compile_program(path, tmp_path / f"out{layers}", global_batch_size=1, tp_styles=styles, cp=2, tp=2, dp=1,
                        pp=1, micro_batch_size=1, precision="bf16", recompute="none", zero=0, sequence_parallel=True,
                        sp_regather=True, fuse_pointwise=False)
        (rank,) = check_program(str(tmp_path / f"out{layers}"), slack_bytes=0)
        (row,) = [r for r in rank.rows() if r.what == "memory activations"]
        block[layers] = (row.predicted, row.measured)
    predicted, measured = (block[2][i] - block[1][i] for i in (0, 1))
    assert measured == pytest.approx(predicted, abs=64), (predicted, measured)  # a block: 899 KiB
