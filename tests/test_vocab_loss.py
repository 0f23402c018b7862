"""The vocabulary-parallel cross-entropy (`partc.vocab_loss`, `partc.collectives.vocab_parallel_cross_entropy`):
which losses partc proves it can compute on the output layer's vocabulary shards, the plan that says so, and
programs that train like one process with the logits never gathered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import (EXAMPLES, assert_close_losses, assert_close_states, megatron_style, run_jobs, write_hf_model)
from partc.compile import compile_model
from partc.model_file import default_loss, load_model_file
from partc.parallel import Pins
from partc.runtime.testing import reference_run
from partc.vocab_loss import Match, match, trace_loss

V = 64


def _match(loss_fn, batch: int = 2):
    with torch.device("meta"):
        logits, targets = torch.empty(batch, 8, V), torch.randint(0, V, (batch, 8))
    gm, n = trace_loss(loss_fn, lambda flat: flat[0], [logits], targets)
    return match(gm, n, 0, V, batch)


def _hf_causal_lm_loss(logits, labels):
    """Hugging Face's ``ForCausalLMLoss`` with its mean reduction: upcast, shift, flatten, cross-entropy."""
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=-100)
    shift = labels[..., 1:].contiguous()
    return F.cross_entropy(logits.view(-1, logits.size(-1)), shift.view(-1), ignore_index=-100, reduction="mean")


@pytest.mark.parametrize("loss_fn,rows", [
    (default_loss, 8),
    (lambda l, t: F.cross_entropy(l.flatten(0, 1), t.flatten()), 8),  # examples/gpt.py, examples/llama.py
    (lambda l, t: F.cross_entropy(l[:, :-1].reshape(-1, V), t[:, 1:].reshape(-1), ignore_index=7), 7),
    (_hf_causal_lm_loss, 8),
])
def test_recognized_losses(loss_fn, rows):
    found = _match(loss_fn)
    assert isinstance(found, Match) and found.output == 0 and found.rows_per_sample == rows, found


@pytest.mark.parametrize("loss_fn,why", [
    (lambda l, t: F.cross_entropy(l.flatten(0, 1), t.flatten(), label_smoothing=0.1), "nll_loss"),
    (lambda l, t: F.cross_entropy(l.flatten(0, 1), t.flatten(), reduction="sum"), "not a mean"),
    (lambda l, t: F.cross_entropy(l.flatten(0, 1), t.flatten()) + l.pow(2).mean(), "more than once"),
    (lambda l, t: F.cross_entropy(l.transpose(1, 2), t), "transpose"),
    (lambda l, t: F.cross_entropy(l.reshape(-1, 2 * V), t[:, ::2].flatten()), "reshapes the vocabulary"),
    (lambda l, t: (l.exp() - 1).mean(), "does not see into"),
])
def test_other_losses_are_gathered_with_a_reason(loss_fn, why):
    found = _match(loss_fn)
    assert isinstance(found, str) and why in found, found


def test_plan_says_vocab_parallel_and_program_keeps_logits_split(tmp_path):
    """GPT at tp 2 with its head colwise: plan.json's tp_loss, the loss's all-reduces in the tp traffic, no
    gather of the logits in the program; turned off, the same plan gathers them."""
    out = _compile("gpt", tmp_path)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["tp_loss"] == "vocab-parallel"
    manifest = json.loads((out / "program" / "manifest.json").read_text())
    assert manifest["tp"]["vocab_loss"] == {"output": 0}
    assert "gather_from_tp" not in (out / "program" / "stage_0.py").read_text()
    off = _compile("gpt", tmp_path, vocab=False)
    plan_off = json.loads((off / "plan.json").read_text())
    assert plan_off["tp_loss"] == "gathered: turned off (--no-vocab-parallel-loss)"
    assert "gather_from_tp" in (off / "program" / "stage_0.py").read_text()
    # tp bytes: the all-gather of the fp32 logits (b·s·V, its output) replaced by 3 fp32 all-reduced per token
    (b, gbs), s, vocab = BATCH, 64, 512
    on, gathered = (p["predicted"]["ranks"][0]["comm_bytes"]["tp"] for p in (plan, plan_off))
    assert gathered - on == gbs // b * b * s * (vocab * 4 - 12)


def _model_path(model: str, tmp: Path) -> str:
    if model == "hf_llama":
        return write_hf_model(tmp, "llama")
    if model == "gpt_ignored":  # examples/gpt.py with a third of the targets ignored (-100)
        path = tmp / "gpt_ignored.py"
        path.write_text((EXAMPLES / "gpt.py").read_text() + IGNORED_TARGETS)
        return str(path)
    return str(EXAMPLES / f"{model}.py")


IGNORED_TARGETS = """

_all_targets = example_targets


def example_targets(batch_size: int) -> torch.Tensor:
    targets = _all_targets(batch_size)
    targets[:, ::3] = -100
    return targets
"""

SEQ_LEN = {"hf_llama": 32}
BATCH = (2, 4)  # micro-batch, global batch


def _compile(model: str, tmp: Path, *, vocab: bool = True) -> Path:
    """`model` at tp 2, fp32, Megatron's map with the vocabulary split (the head colwise), through --from-plan."""
    path, out = _model_path(model, tmp), tmp / f"{model}{'' if vocab else '_gathered'}"
    mb, gbs = BATCH
    compile_model(path, gpus=2, pins=Pins(tp=2, pp=1, dp=1, micro_batch_size=mb, precision="fp32"),
                  global_batch_size=gbs, seq_len=SEQ_LEN.get(model), out_dir=out, vocab_parallel_loss=vocab)
    plan = json.loads((out / "plan.json").read_text())
    plan["tp"] = {fqn: megatron_style(fqn, vocab=True) or "replicate" for fqn in plan["tp"]}
    edited = tmp / f"{out.name}.plan.json"
    edited.write_text(json.dumps(plan))
    compile_model(path, gpus=2, from_plan=str(edited), seq_len=SEQ_LEN.get(model), out_dir=out,
                  vocab_parallel_loss=vocab)
    return out


TRAINED = ("gpt", "llama", "hf_llama", "gpt_ignored")
SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0}
STEPS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every model at tp 2 with the vocab-parallel loss, in one torchrun launch of 2 ranks."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("vocab_loss")
    jobs, inits, outs = [], {}, {}
    for model in TRAINED:
        inits[model] = tmp / f"init_{model}.pt"
        torch.manual_seed(1234)
        spec = load_model_file(_model_path(model, tmp), seq_len=SEQ_LEN.get(model))
        torch.save(spec.build().state_dict(), inits[model])
        outs[model] = _compile(model, tmp)
        jobs.append({"out": str(outs[model]), "steps": STEPS, "result": str(tmp / f"{model}.pt"),
                     "init": str(inits[model]), **SGD})
    run_jobs(2, jobs, tmp)
    return tmp, outs, inits


@pytest.mark.slow
@pytest.mark.parametrize("model", TRAINED)
def test_trains_like_one_process(runs, model):
    tmp, outs, inits = runs
    assert json.loads((outs[model] / "plan.json").read_text())["tp_loss"] == "vocab-parallel"
    got = torch.load(tmp / f"{model}.pt", weights_only=True)
    init = torch.load(inits[model], weights_only=True)
    mb, gbs = BATCH
    losses, state = reference_run(_model_path(model, tmp), init, steps=STEPS, seed=0, global_batch_size=gbs,
                                  seq_len=SEQ_LEN.get(model), precision="fp32", micro_batch_size=mb, **SGD)
    assert_close_losses(got["losses"], losses, rtol=1e-5)
    assert_close_states(got["state"], state, rtol=1e-5)
    assert got["replica_diff"] == 0.0
    # measured tp bytes equal the plan's, exactly (the loss's all-reduces included)
    plan = json.loads((outs[model] / "plan.json").read_text())
    want = plan["predicted"]["ranks"][0]["comm_bytes"]["tp"]
    assert [rank["tp"] for step in got["comm"] for rank in step] == [want] * (STEPS * 2)


LLAMA_32K = """
from transformers import LlamaConfig, LlamaForCausalLM

def model():
    return LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                        max_position_embeddings=256))
"""


@pytest.mark.slow
def test_check_measures_the_last_stage_smaller_as_predicted(tmp_path):
    """Hugging Face LLaMA with a 32K vocabulary (tiny widths: the logits dominate) at tp 4 x pp 2: `partc check` on
    the last pipeline rank agrees with each plan, with and without the vocab-parallel loss, and measures the
    activations smaller by what the plans predict (the logits' gather, their whole fp32 copies and
    log-probabilities, against 8 bytes a logit of this rank's columns)."""
    from partc.runtime.check import TOLERANCE, check_program

    torch.set_num_threads(1)
    path = tmp_path / "hf_llama_32k.py"
    path.write_text(LLAMA_32K)
    got = {}
    for vocab in (True, False):
        out = tmp_path / f"out_{vocab}"
        kw = {"gpus": 8, "seq_len": 128, "out_dir": out, "force": True, "vocab_parallel_loss": vocab}
        compile_model(str(path), pins=Pins(tp=4, pp=2, dp=1, zero=0, micro_batch_size=2, schedule="1f1b"),
                      global_batch_size=4, **kw)
        plan = json.loads((out / "plan.json").read_text())
        plan["tp"] = {fqn: megatron_style(fqn, vocab=True) or "replicate" for fqn in plan["tp"]}
        (tmp_path / "edited.json").write_text(json.dumps(plan))
        compile_model(str(path), from_plan=str(tmp_path / "edited.json"), **kw)
        plan = json.loads((out / "plan.json").read_text())
        assert plan["tp_loss"] == ("vocab-parallel" if vocab else "gathered: turned off (--no-vocab-parallel-loss)")
        (rank,) = check_program(str(out), pp_ranks=[1])
        assert all(row.agrees for row in rank.rows()), [r.to_dict() for r in rank.rows() if not r.agrees]
        assert rank.comm_bytes["tp"] == rank.predicted_comm_bytes["tp"]
        got[vocab] = (rank.predicted_memory_bytes["activations"], rank.memory_bytes["activations"])
    predicted = got[False][0] - got[True][0]
    measured = got[False][1] - got[True][1]
    assert measured > 0.8 * got[False][1], got  # the loss was most of the last stage's activations
    assert abs(predicted - measured) <= TOLERANCE * measured, (predicted, measured)
