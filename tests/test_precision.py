"""The default precision (bf16) runs models written for fp32 training: fp32 tables and tensors a model makes meet
bf16 activations under `partc.precision.Autocast`'s casts, which are ops of the traced graph and of the program.

The fast tests trace and compile; the slow one trains the two models of mixed_dtype_models.py under pp 2 x dp 2 and
under tp 2 x dp 2 (one torchrun launch of 4 gloo ranks), against an fp32 run in one process (losses within bf16
rounding) and against the plan (every rank's collective bytes, axis by axis), and runs `partc check` on the four
programs (traffic byte for byte, memory rows within its tolerance).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import assert_close_losses, assert_comm_matches_plan, megatron_style, run_jobs
from partc.compile import compile_model
from partc.errors import PartcError
from partc.model_file import load_model_file
from partc.parallel import Pins
from partc.runtime.check import check_program
from partc.runtime.testing import reference_run

MODELS = str(Path(__file__).resolve().parent / "mixed_dtype_models.py")


def _casts(out: Path) -> list[str]:
    return [line.strip() for f in sorted((out / "program").glob("stage_*.py"))
            for line in f.read_text().splitlines() if "aten.to.dtype(" in line or "aten._to_copy" in line]


def test_rope_tables_in_fp32_compile_at_the_default_precision(tmp_path):
    """q and k come out of the rotation fp32 (bf16 times an fp32 table); the attention op gets them cast to bf16,
    v as it is: two casts a layer, in the program as ops."""
    result = compile_model(MODELS, entry="rope_llama", gpus=1, global_batch_size=2, out_dir=tmp_path / "out")
    assert result.plan.parallel.precision == "bf16"
    down = [c for c in _casts(tmp_path / "out") if c.endswith("torch.bfloat16)")]  # RMSNorm's own .float() aside
    assert len(down) == 2 * 2, down
    code = (tmp_path / "out" / "program" / "stage_0.py").read_text()
    attention = [line for line in code.splitlines() if "aten.scaled_dot_product_attention" in line]
    assert len(attention) == 2 and all(line.count("to_") == 2 for line in attention), attention  # q, k; not v


def test_fp32_tensors_made_in_forward_compile_at_the_default_precision(tmp_path):
    """fp32 positions added to the embeddings make the residual stream fp32: the LayerNorms run in fp32 (their bf16
    weight and bias cast up), each GEMM's input is cast to bf16 once (q, k and v share one copy), the fp32 mask
    reaches attention cast to bf16."""
    compile_model(MODELS, entry="fp32_in_forward", gpus=1, global_batch_size=2, out_dir=tmp_path / "out")
    casts = _casts(tmp_path / "out")
    assert sum("torch.bfloat16" in c for c in casts) == 2 * 3 + 1, casts  # attention input, mask, MLP; lm_head
    assert sum("torch.float32" in c for c in casts) == 5 * 2, casts  # weight and bias of 5 LayerNorms


MIXED_OP = '''
import torch
from torch import nn


class Lerp(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.lerp(self.proj(x), torch.zeros(8, device=x.device), 0.5)


def model():
    return Lerp()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 8),)
'''


def test_an_op_that_takes_no_mixed_dtypes_is_named_with_the_way_out(tmp_path):
    path = tmp_path / "lerp.py"
    path.write_text(MIXED_OP)
    with pytest.raises(PartcError) as e:
        compile_model(str(path), gpus=1, global_batch_size=2)
    text = str(e.value)
    assert "\n" not in text and "torch.lerp" in text and "--precision fp32" in text and "in module " in text, text
    compile_model(str(path), gpus=1, global_batch_size=2, pins=Pins(precision="fp32"))  # and fp32 runs it


# name: (entry, tp, pp, dp, zero)
CONFIGS = {
    "rope_llama_pp2_dp2": ("rope_llama", 1, 2, 2, 1),
    "rope_llama_tp2_dp2": ("rope_llama", 2, 1, 2, 1),
    "fp32_in_forward_pp2_dp2": ("fp32_in_forward", 1, 2, 2, 1),
    "fp32_in_forward_tp2_dp2": ("fp32_in_forward", 2, 1, 2, 1),
}
GLOBAL_BATCH, MICRO_BATCH, STEPS = 4, 1, 3
SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0}
BF16_VS_FP32_RTOL = 2.0**-8
"""A bf16 program against fp32 in one process: within bf16's machine epsilon (8 significant bits), relative. Over
three SGD steps the four programs differ from fp32 by at most 1e-4 relative (measured)."""


def compile_config(name: str, tmp: Path) -> Path:
    """At the default precision; tp programs with Megatron's map (q/k/v, gate/up colwise, o/down rowwise, the
    vocabulary split), set in plan.json and compiled again with --from-plan as a user would."""
    entry, tp, pp, dp, zero = CONFIGS[name]
    out = tmp / name
    pins = Pins(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch_size=MICRO_BATCH, schedule="1f1b", recompute="none")
    result = compile_model(MODELS, entry=entry, gpus=tp * pp * dp, pins=pins, global_batch_size=GLOBAL_BATCH,
                           out_dir=out)
    assert result.plan.parallel.precision == "bf16"
    if tp > 1:
        plan = json.loads((out / "plan.json").read_text())
        plan["tp"] = {fqn: megatron_style(fqn, vocab=True) or "replicate" for fqn in plan["tp"]}
        edited = tmp / f"{name}.plan.json"
        edited.write_text(json.dumps(plan, indent=2))
        compile_model(MODELS, entry=entry, gpus=tp * pp * dp, from_plan=str(edited), out_dir=out)
    return out


@pytest.mark.slow  # one torchrun launch of 4 gloo ranks
def test_models_with_fp32_tensors_train_at_the_default_precision(tmp_path):
    torch.set_num_threads(1)
    inits, outs, jobs = {}, {}, []
    for entry in ("rope_llama", "fp32_in_forward"):
        torch.manual_seed(1234)
        inits[entry] = tmp_path / f"init_{entry}.pt"
        torch.save(load_model_file(MODELS, entry=entry).build().state_dict(), inits[entry])
    for name, (entry, *_rest) in CONFIGS.items():
        outs[name] = compile_config(name, tmp_path)
        jobs.append({"out": str(outs[name]), "steps": STEPS, "init": str(inits[entry]),
                     "result": str(tmp_path / f"{name}.pt"), **SGD})
    run_jobs(4, jobs, tmp_path)
    for name, (entry, *_rest) in CONFIGS.items():
        init = torch.load(inits[entry], weights_only=True)
        got = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        fp32, _ = reference_run(MODELS, init, entry=entry, steps=STEPS, seed=0, global_batch_size=GLOBAL_BATCH,
                                precision="fp32", **SGD)
        assert_close_losses(got["losses"], fp32, rtol=BF16_VS_FP32_RTOL)
        assert any(not torch.equal(got["state"][k], init[k]) for k in init), "training must change the weights"
        assert assert_comm_matches_plan(outs[name], got["comm"]) > 0, name
        assert got["replica_diff"] == 0.0, name
        for r in check_program(str(outs[name])):  # partc check: the same program on fake tensors, every pp rank
            assert r.comm_bytes == {k: int(v) for k, v in r.predicted_comm_bytes.items()}, (name, r.pp_rank)
            assert all(row.agrees for row in r.rows()), (name, [row.to_dict() for row in r.rows() if not row.agrees])
