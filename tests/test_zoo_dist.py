"""Model families a user brings (issue #14), on 2 gloo ranks against one process: a tiny model of each family
trains 3 SGD steps under pp 2, dp 2 with ZeRO-3 or tp 2 with Megatron's styles set by hand, and its losses and
gathered state dict must equal `reference_run`. All programs share one torchrun launch (`partc.runtime.testing`)."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close_losses, assert_close_states, compile_program, run_jobs
from partc.compile import compile_model
from partc.model_file import load_model_file
from partc.parallel import Pins
from partc.runtime.testing import reference_run
from user_models import CLASSES, write_model
from zoo_models import write_zoo_model

pytestmark = pytest.mark.slow  # one torchrun launch of 2 gloo ranks

# name: (family in zoo_models.ZOO, pp, dp, zero, micro-batch size, global batch, seq_len)
CONFIGS = {
    "roberta_pp2": ("roberta", 2, 1, 0, 1, 4, 16),  # stage 0 sends an expanded attention mask
    "opt_pp2": ("opt", 2, 1, 0, 1, 4, 16),
    "swin_pp2": ("swin", 2, 1, 0, 1, 4, None),  # an image model: the runtime keeps its own inputs
    "clip_pp2": ("clip", 2, 1, 0, 1, 4, None),  # image_size in config.vision_config
    "falcon_pp2": ("falcon", 2, 1, 0, 1, 4, 16),  # tensor constants created in forward
    "deberta_dp2_z3": ("deberta", 1, 2, 3, 1, 4, 16),
    "whisper_pp2": ("whisper", 2, 1, 0, 1, 4, None),  # units in data-flow order (encoder.embed_positions)
    # BatchNorm (1 x 1 maps in the last stage): one micro-batch of the whole batch, so its statistics are one
    # process's (with dp > 1 or more micro-batches they are per micro-batch and rank: compile warns)
    "resnet_pp2": ("resnet", 2, 1, 0, 4, 4, None),
    "timm_vit_tp2": ("timm_vit", 1, 1, 0, 2, 4, None),  # qkv viewed as (3, heads, head_dim): 3 fused pieces
    # nn.MultiheadAttention: packed in_proj_weight (3 fused pieces); at 2 samples the batch merges before the heads
    "mha_tp2": ("mha", 1, 1, 0, 2, 4, None),
}
TP = {  # name: Megatron's styles, set by hand in plan.json (by name suffix) and compiled --from-plan, at tp 2
    "timm_vit_tp2": {"attn.qkv": "colwise", "attn.proj": "rowwise", "fc1": "colwise", "fc2": "rowwise"},
    "mha_tp2": {"attn": "colwise", "attn.out_proj": "rowwise", "fc1": "colwise", "fc2": "rowwise"},
}
STEPS = 3
SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("zoo")
    paths, jobs = {}, []
    for name, (family, pp, dp, zero, mb, gbs, seq_len) in CONFIGS.items():
        paths[name] = path = write_zoo_model(tmp, family)
        torch.manual_seed(1234)
        torch.save(load_model_file(path, seq_len=seq_len).build().state_dict(), tmp / f"{name}.init.pt")
        tp = 2 if name in TP else 1
        styles = TP.get(name, {})
        compile_program(path, tmp / name, global_batch_size=gbs, seq_len=seq_len,
                        tp_styles=(lambda f, s: next((st for k, st in styles.items() if f.endswith(k)), s))
                        if name in TP else None,
                        tp=tp, pp=pp, dp=dp, zero=zero, micro_batch_size=mb, schedule="1f1b", recompute="none",
                        precision="fp32")  # the families are the subject: fp32 equals one fp32 process to 1e-5
        jobs.append({"out": str(tmp / name), "steps": STEPS, "init": str(tmp / f"{name}.init.pt"),
                     "result": str(tmp / f"{name}.pt"), **SGD})
    run_jobs(2, jobs, tmp)
    return tmp, paths


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_one_process(runs, name):
    tmp, paths = runs
    *_, gbs, seq_len = CONFIGS[name]
    init = torch.load(tmp / f"{name}.init.pt", weights_only=True)
    got = torch.load(tmp / f"{name}.pt", weights_only=True)
    losses, state = reference_run(paths[name], init, steps=STEPS, seed=0, global_batch_size=gbs, seq_len=seq_len,
                                  **SGD)
    assert_close_losses(got["losses"], losses)
    # Attention's key bias has a zero gradient (softmax ignores a shift): there both sides hold rounding noise.
    assert_close_states(got["state"], state, atol=1e-8)
    assert any(not torch.equal(state[k], init[k]) for k in state), "training must change the weights"


NO_LOGITS = """
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x):
            return {"hidden": self.b(torch.relu(self.a(x)))}
"""


def test_error_of_the_last_stage_reaches_the_user_under_torchrun(tmp_path):
    """The default loss finds no logits: a user error on rank 1 (the last stage) only. Under plain torchrun its line
    is printed, and rank 0, whose send fails because rank 1 left, names rank 1 without a traceback."""
    from helpers import torchrun

    path = write_model(tmp_path / "no_logits.py", NO_LOGITS, targets=CLASSES)
    pins = Pins(tp=1, pp=2, dp=1, zero=0, micro_batch_size=1, schedule="1f1b", recompute="none")
    compile_model(str(path), gpus=2, pins=pins, global_batch_size=4, out_dir=tmp_path / "out")
    res = torchrun(2, ["-m", "partc.runtime", str(tmp_path / "out"), "--steps", "2"], check=False)
    assert res.returncode != 0
    errors = [line for line in res.stdout.splitlines() if line.startswith("error:")]
    line = "error: cannot find logits in the model's outputs (dict); define loss_fn(outputs, targets) in the model file"
    assert errors.count(line) == 1, res.stdout
    # rank 0 may be stopped by torchrun before its send fails; if it says something, it names rank 1
    assert all(e.startswith("error: rank 0: after rank 1 failed: ") for e in errors if e != line), res.stdout
    assert "pipelining/schedules.py" not in res.stdout, "no worker traceback"
