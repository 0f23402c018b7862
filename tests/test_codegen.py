"""The generated stage programs, run one after another in one process, equal the model (outputs and grads)."""

import json
from pathlib import Path

import pytest
import torch

from helpers import EXAMPLES, load_stage, model_file
from partc.compile import compile_model
from partc.model_file import load_model_file
from partc.parallel import Pins
from partc.precision import cast_floating, cast_parameters


def run_program(out: Path, model, args, kwargs):
    """Chain stage_K.forward over the program in OUT/program; returns the model-structured outputs."""
    manifest = json.loads((out / "program" / "manifest.json").read_text())
    p = dict(model.named_parameters(remove_duplicate=False))
    p.update(dict(model.named_buffers(remove_duplicate=False)))
    x = tuple(args[k] if isinstance(k, int) else kwargs[k] for k in manifest["input_keys"])
    for st in manifest["stages"]:
        mod = load_stage(out / "program" / st["file"])
        assert len(x) == len(mod.INPUTS)
        x = mod.forward(p, *x, device=torch.device("cpu"))
        assert isinstance(x, tuple) and len(x) == len(mod.OUTPUTS)
    return mod.outputs(x)


def _logits(out):
    return out if torch.is_tensor(out) else out.logits


CASES = ("gpt", "llama", "hf_gpt2", "hf_llama", "hf_bert", "hf_vit")


@pytest.mark.parametrize("case", sorted(CASES))
def test_stages_chain_equals_model(case, hf_dir, tmp_path):
    torch.manual_seed(0)
    path = model_file(case, hf_dir)
    out = tmp_path / "out"
    compile_model(path, gpus=2, pins=Pins(pp=2, dp=1, micro_batch_size=2, schedule="1f1b"), global_batch_size=4, out_dir=out,
                  seq_len=None)
    spec = load_model_file(path)
    model = cast_parameters(spec.build(), torch.bfloat16)  # the plan's default precision, as the trace ran
    args, kwargs = cast_floating(spec.inputs(2), torch.bfloat16)
    ref = _logits(model(*args, **kwargs))
    ref.float().square().sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = _logits(run_program(out, model, args, kwargs))
    assert got.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    got.float().square().sum().backward()
    for n, p in model.named_parameters():  # bf16 gradients, summed over tokens in another order: 1% in norm
        error = (p.grad.float() - ref_grads[n].float()).norm() / ref_grads[n].float().norm().clamp_min(1e-12)
        assert error < 1e-2, (n, float(error))


def test_program_is_readable(tmp_path):
    out = tmp_path / "out"
    compile_model(str(EXAMPLES / "gpt.py"), gpus=2, pins=Pins(pp=2, dp=1, micro_batch_size=2, schedule="1f1b"),
                  global_batch_size=4, out_dir=out)
    text = (out / "program" / "stage_0.py").read_text()
    # A header with the plan, the stage's modules and its predictions.
    assert "Plan: dp=1 tp=1 pp=2" in text and "Modules: " in text and "Predicted: " in text
    # The module FQN and the user's source line above the statements they produce.
    assert "# blocks.0.attn.qkv  gpt.py:" in text and "self.qkv(x)" in text
    # Parameters by their original FQNs; the meta device never leaks into the program.
    assert "p['blocks.0.attn.qkv.weight']" in text and "meta" not in text
    # One function a unit, called in order by the stage's forward.
    assert "def blocks_0(p, " in text and "run('blocks.0', blocks_0, p, " in text
    s0, s1 = load_stage(out / "program" / "stage_0.py"), load_stage(out / "program" / "stage_1.py")
    assert s1.INPUTS == s0.OUTPUTS
    assert s0.MODULES[-1].startswith("blocks.") and s1.MODULES[-1] == "lm_head"
    # The same inputs give the same program (byte for byte).
    out2 = tmp_path / "out2"
    compile_model(str(EXAMPLES / "gpt.py"), gpus=2, pins=Pins(pp=2, dp=1, micro_batch_size=2, schedule="1f1b"),
                  global_batch_size=4, out_dir=out2)
    for f in ("stage_0.py", "stage_1.py", "manifest.json"):
        assert (out / "program" / f).read_text() == (out2 / "program" / f).read_text()


def test_tied_weights_named_by_the_stage_that_owns_them(tmp_path):
    out = tmp_path / "out"
    compile_model(str(EXAMPLES / "hf_gpt2.py"), gpus=2, pins=Pins(pp=2, dp=1, micro_batch_size=2, schedule="1f1b"),
                  global_batch_size=4, out_dir=out)
    manifest = json.loads((out / "program" / "manifest.json").read_text())
    assert ["lm_head.weight", "transformer.wte.weight"] in manifest["tied"]
    s0, s1 = load_stage(out / "program" / "stage_0.py"), load_stage(out / "program" / "stage_1.py")
    assert "transformer.wte.weight" in s0.PARAMETERS
    assert "lm_head.weight" in s1.PARAMETERS and "transformer.wte.weight" not in s1.PARAMETERS


def test_selective_recompute_checkpoints_the_attention_core(tmp_path):
    path = str(EXAMPLES / "gpt.py")
    out = tmp_path / "out"
    compile_model(path, gpus=2, pins=Pins(pp=2, dp=1, micro_batch_size=2, schedule="1f1b", recompute="selective"),
                  global_batch_size=4, out_dir=out)
    text = (out / "program" / "stage_0.py").read_text()
    assert "= checkpoint(aten.scaled_dot_product_attention.default," in text
    torch.manual_seed(0)
    spec = load_model_file(path)
    model = spec.build()
    args, kwargs = spec.inputs(2)
    ref = model(*args, **kwargs)
    ref.square().sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = run_program(out, model, args, kwargs)
    torch.testing.assert_close(got, ref)
    got.square().sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], msg=n)
