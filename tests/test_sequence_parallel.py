"""Sequence parallelism (Korthikanti et al. 2022) in the runtime: torchrun on CPU (gloo), tiny models, compared
with one process.

Each program is compiled with ``sequence_parallel`` pinned (and ``sp_regather`` on or off, `REGATHER`: the colwise
layers' inputs gathered again in backward) and Megatron's style map set by hand (as
tests/test_runtime_tp.py does), then trained under torchrun in one launch: SGD losses and the gathered state dict
must equal `reference_run` (fp32 within 1e-5; bf16 within today's 1e-2 against a bf16 process), the parameters
the program keeps whole (the norms, applied to each rank's part of the sequence, their gradients all-reduced) must
stay identical on the tp ranks, and every rank's collective payload must equal the plan's
``predicted.ranks[].comm_bytes`` axis by axis.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import (EXAMPLES, assert_close_losses, assert_close_states, assert_comm_matches_plan, megatron_style,
                     reference_once, run_jobs, write_hf_model)
from partc.compile import compile_model
from partc.model_file import load_model_file
from partc.parallel import Pins
from partc.runtime.check import SLACK_BYTES, check_program

pytestmark = pytest.mark.slow  # torchrun launches of 2 and 8 gloo ranks

# name: (model, tp, pp, dp, zero, micro-batch size, global batch)
CONFIGS = {
    "gpt_tp2_sp": ("gpt", 2, 1, 1, 0, 1, 2),
    "llama_tp2_sp": ("llama", 2, 1, 1, 0, 1, 2),
    "gpt_tp2_sp_bf16": ("gpt", 2, 1, 1, 0, 1, 2),
    # the token embedding colwise (the joint search's choice at scale): gathered, then each rank's part kept
    "llama_tp2_sp_tok_colwise": ("llama", 2, 1, 1, 0, 1, 2),
    # 8 ranks: the pipeline boundary is each rank's part of the sequence, ZeRO-1 and 3 over dp
    "gpt_tp2_pp2_dp2_z1_sp": ("gpt", 2, 2, 2, 1, 1, 4),
    "llama_tp2_pp2_dp2_z1_sp": ("llama", 2, 2, 2, 1, 1, 4),
    "llama_tp2_pp2_dp2_z3_sp": ("llama", 2, 2, 2, 3, 1, 4),
    "gpt_tp4_dp2_z3_sp": ("gpt", 4, 1, 2, 3, 1, 4),
    # a mixture of experts split inside (Megatron-Core's under SP: the router on each rank's part of the sequence,
    # the tokens, routing weights and chosen experts all-gathered, the experts' output reduce-scattered), two
    # samples a micro-batch (the flattened tokens held as two pieces); and a vision transformer (the tokens appear
    # after the patch embedding; the class token read after a gather)
    "hf_mixtral_tp2_sp": ("hf_mixtral", 2, 1, 1, 0, 2, 2),
    "vit_tp2_sp": ("vit", 2, 1, 1, 0, 2, 2),
    "hf_mixtral_tp2_pp2_dp2_z1_sp": ("hf_mixtral", 2, 2, 2, 1, 1, 4),
    # a unit that falls back to tensor parallelism (its MLP kept whole): priced as the program runs it
    "gpt_tp2_sp_block1_mlp_whole": ("gpt", 2, 1, 1, 0, 1, 2),
    # Hugging Face: GPT-2's Conv1D rowwise output [b*s, h] reduce-scattered after its view back to [b, s, h]; at two
    # samples a micro-batch its colwise input is each sample's part of the sequence, flattened (gathered in pieces)
    "hf_gpt2_tp2_sp": ("hf_gpt2", 2, 1, 1, 0, 2, 2),
    "hf_llama_tp2_sp": ("hf_llama", 2, 1, 1, 0, 1, 2),
    # LLaMA's rotary tables and causal mask cross the pipeline boundary whole (no gradient): gathered, and charged
    "hf_llama_tp2_pp2_dp2_z1_sp": ("hf_llama", 2, 2, 2, 1, 1, 4),
    "hf_gpt2_tp2_pp2_dp2_z1_sp": ("hf_gpt2", 2, 2, 2, 1, 1, 4),
    "hf_gpt2_tp2_pp2_dp2_z3_sp": ("hf_gpt2", 2, 2, 2, 3, 1, 4),
    # fused kernels' memory (`fuse_pointwise`): the RMSNorms and SwiGLU kept at their inputs and replayed in
    # backward, attention on the unrepeated keys and values
    "llama_tp2_sp_fused": ("llama", 2, 1, 1, 0, 1, 2),
    "llama_tp2_pp2_dp2_z1_sp_fused": ("llama", 2, 2, 2, 1, 1, 4),
}
REGATHER = {"llama_tp2_sp", "gpt_tp2_sp_bf16", "gpt_tp2_pp2_dp2_z1_sp", "llama_tp2_pp2_dp2_z3_sp", "gpt_tp4_dp2_z3_sp"}
"""Configurations pinned to `sp_regather` (the colwise layers' inputs gathered again in backward); the others
pinned without it."""
FUSED = {"llama_tp2_sp_fused", "llama_tp2_pp2_dp2_z1_sp_fused"}
"""Configurations pinned to `fuse_pointwise`; the others pinned without it."""
WHOLE_ACROSS = {"hf_llama": 2, "hf_mixtral": 2}
"""Values that cross a pipeline boundary whole (they need no gradient): LLaMA's and Mixtral's rotary cos and sin
(Hugging Face's causal mask is proven causal and dropped from the trace: `passes.causal_mask`)."""
SEQ_LEN = {"hf_mixtral": 16}
"""Tokens per sample of a Hugging Face model where not `HF_SEQ_LEN`."""
HF_SEQ_LEN = 32
"""Tokens of the tiny Hugging Face models' synthesized inputs (`helpers.HF_MODELS`)."""
VIT = f"""
    import importlib.util
    import sys

    import torch

    # examples/vit.py at 24 x 24 pixels: 9 patches and the class token, 10 tokens (at 32 x 32 the 17 do not divide
    # over tp 2)
    _spec = importlib.util.spec_from_file_location("partc_example_vit", {str(EXAMPLES / "vit.py")!r})
    vit = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = vit
    _spec.loader.exec_module(vit)

    def model():
        return vit.VisionTransformer(vit.ViTConfig(image=24, patch=8))

    def example_inputs(batch_size):
        return (torch.randn(batch_size, 3, 24, 24),)
"""

STYLES = {"llama_tp2_sp_tok_colwise": {"tok": "colwise"},
          "gpt_tp2_sp_block1_mlp_whole": {"blocks.1.mlp.fc1": "replicate", "blocks.1.mlp.fc2": "replicate"}}
"""Styles set over Megatron's map."""
FALLBACKS = {"gpt_tp2_sp_block1_mlp_whole": 1}
"""Configs whose program does not keep the split along the sequence somewhere: how many places it names (the
whole fc1 reads the norm's output gathered; its output is scattered back where it meets the residual stream)."""


BF16_RTOL = 1e-2
"""Today's tolerance of a bf16 TP run against one bf16 process (tests/test_runtime_tp.py): the partial sums are
rounded to bf16 before they are added."""


def precision_of(name: str) -> str:
    return "bf16" if name.endswith("_bf16") else "fp32"

STEPS = 2
SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0}


def plan_of(out: Path) -> dict:
    return json.loads((out / "plan.json").read_text())


def model_path(model: str, tmp: Path) -> str:
    """examples/MODEL.py, for ``hf_NAME`` the tiny Hugging Face model NAME written in `tmp`, or the bundled ViT at
    10 tokens."""
    if model.startswith("hf_"):
        path = tmp / f"{model}.py"
        return str(path) if path.exists() else write_hf_model(tmp, model.removeprefix("hf_"))
    if model == "vit":
        path = tmp / "vit_sp.py"
        path.write_text(textwrap.dedent(VIT))
        return str(path)
    return str(EXAMPLES / f"{model}.py")


def seq_len(model: str) -> int | None:
    return SEQ_LEN.get(model, HF_SEQ_LEN) if model.startswith("hf_") else None


def compile_sp(name: str, tmp: Path) -> Path:
    model, tp, pp, dp, zero, mb, gbs = CONFIGS[name]
    path, out = model_path(model, tmp), tmp / name
    pins = Pins(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch_size=mb, schedule="1f1b", recompute="none",
                precision=precision_of(name), sequence_parallel=True, sp_regather=name in REGATHER,
                fuse_pointwise=name in FUSED)
    compile_model(path, gpus=tp * pp * dp, pins=pins, global_batch_size=gbs, out_dir=out, seq_len=seq_len(model))
    plan = json.loads((out / "plan.json").read_text())
    for fqn in plan["tp"]:
        plan["tp"][fqn] = megatron_style(fqn, vocab=True) or "replicate"
    plan["tp"].update(STYLES.get(name, {}))
    edited = tmp / f"{name}.plan.json"
    edited.write_text(json.dumps(plan, indent=2))
    result = compile_model(path, gpus=tp * pp * dp, from_plan=str(edited), out_dir=out, seq_len=seq_len(model))
    assert len([w for w in result.warnings if "sequence parallelism" in w]) == (name in FALLBACKS), result.warnings
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("sequence_parallel")
    inits = {}
    for m in sorted({model for model, *_ in CONFIGS.values()}):
        inits[m] = tmp / f"init_{m}.pt"
        torch.manual_seed(1234)
        torch.save(load_model_file(model_path(m, tmp), seq_len=seq_len(m)).build().state_dict(), inits[m])
    outs = {name: compile_sp(name, tmp) for name in CONFIGS}
    jobs: dict[int, list[dict]] = {}
    for name, (model, tp, pp, dp, *_rest) in CONFIGS.items():
        jobs.setdefault(tp * pp * dp, []).append({"out": str(outs[name]), "steps": STEPS, "init": str(inits[model]),
                                                  "result": str(tmp / f"{name}.pt"), **SGD})
    # Megatron's conjugate functions, the two of sequence parallelism included, checked on 2 ranks first.
    jobs[2].insert(0, {"check": "collectives", "result": str(tmp / "collectives.pt")})
    for nproc, js in sorted(jobs.items()):
        run_jobs(nproc, js, tmp)
    return tmp, outs, inits


def test_collectives_forward_and_backward(runs):
    tmp, _, _ = runs
    assert torch.load(tmp / "collectives.pt", weights_only=True) == {"ok": True}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sequence_parallel_matches_one_process(runs, name):
    tmp, outs, inits = runs
    model, _, pp, _, _, mb, gbs = CONFIGS[name]
    got = torch.load(tmp / f"{name}.pt", weights_only=True)
    init = torch.load(inits[model], weights_only=True)
    # configurations of one model, batch, precision and tying share one reference (`reference_once`)
    losses, state = reference_once(model_path(model, tmp), init, steps=STEPS, seed=0, global_batch_size=gbs,
                                   seq_len=seq_len(model), precision=precision_of(name), micro_batch_size=mb,
                                   untied=pp > 1, **SGD)
    rtol = BF16_RTOL if precision_of(name) == "bf16" else 1e-5
    assert_close_losses(got["losses"], losses, rtol=rtol)
    # bf16: a norm's gradient is the sum of the ranks' parts of the sequence, each rounded to bf16; a bias still
    # near its zero initialization differs by that rounding (absolute 1e-4 an element).
    assert_close_states(got["state"], state, rtol=rtol, atol=1e-4 if precision_of(name) == "bf16" else 0.0)
    assert got["replica_diff"] == 0.0, "parameters the program keeps whole must stay identical on the tp ranks"
    source = "".join(f.read_text() for f in sorted((outs[name] / "program").glob("stage_*.py")))
    assert "tp.reduce_scatter_to_sp(" in source
    if name in REGATHER:  # every gather before colwise layers is gathered again in backward
        assert "tp.linears_from_sp(" in source and "tp.gather_from_sp(" not in source
        assert plan_of(outs[name])["parallel"]["sp_regather"] is True
    else:
        assert "tp.gather_from_sp(" in source and "tp.linears_from_sp(" not in source
    assert "tp.reduce_from_tp(" not in source, "every all-reduce of an activation is a reduce-scatter"
    if name in FUSED:  # two RMSNorms and SwiGLU a block kept at their inputs, attention on unrepeated k and v
        assert source.count("= fused.pointwise(") == 3 * 4 + 1, source  # and the final norm
        assert source.count("enable_gqa=True") == 4 and "repeat_interleave" not in source
        assert plan_of(outs[name])["parallel"]["fuse_pointwise"] is True
    # a stage receives its part of the sequence; only values that need no gradient (Hugging Face's causal mask,
    # LLaMA's rotary tables) cross whole, each rank sending its 1/tp part, gathered on arrival
    gathered = [line for line in source.splitlines() if "tp.gather_from_previous_stage(" in line]
    assert len(gathered) == WHOLE_ACROSS.get(model, 0) * (pp - 1), gathered
    gathers = json.loads((outs[name] / "plan.json").read_text())["model"].get("sequence_parallel_gathers", [])
    assert len(gathers) == FALLBACKS.get(name, 0), gathers
    assert assert_comm_matches_plan(outs[name], got["comm"]) > 0  # pp: the schedule's few bytes of warm-up vote
    plan = json.loads((outs[name] / "plan.json").read_text())
    per_pp = plan["parallel"]["dp"] * plan["parallel"]["tp"]
    for step in got["comm"]:  # the tp traffic is the plan's to the byte
        assert [r["tp"] for r in step] == [plan["predicted"]["ranks"][i // per_pp]["comm_bytes"]["tp"]
                                           for i in range(len(step))]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_check_agrees_on_a_sequence_parallel_plan(runs, name):
    """`partc check` runs the program on fake tensors: its traffic equals the plan's to the byte (slack 0), and
    every row agrees at the default slack (a tiny model's activations are dominated by its loss)."""
    _, outs, _ = runs
    for r in check_program(str(outs[name]), slack_bytes=0):
        assert r.comm_bytes == {k: int(v) for k, v in r.predicted_comm_bytes.items()}, r.pp_rank
        assert r.comm_bytes["tp"] > 0
        wrong = [row for row in r.rows() if not row.agrees and abs(row.measured - row.predicted) > SLACK_BYTES]
        assert not wrong, wrong
