"""The runtime's own initialization under torchrun (gloo, CPU): the plain model of plain_init.py (parameters set
in ``__init__``, some on the root) trained without an init state dict under pp 2, tp 2 and dp 2 with ZeRO 1 and 3,
in one launch of 2 ranks. Every plan must start from the same parameters, those `build_initialized` gives one
process, and train like one process from them; a checkpoint of the root's tensors saved under one plan resumes
under another."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import assert_close_losses, assert_close_states, megatron_style, run_jobs
from partc.model_file import load_model_file
from partc.runtime.materialize import build_initialized
from partc.runtime.testing import reference_run

pytestmark = pytest.mark.slow  # one torchrun launch of 2 gloo ranks

PLAIN = Path(__file__).resolve().parent / "plain_init.py"
SEED = 3
STEPS = 2
GBS = 4
SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0}
ADAMW = {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.1}
# name: (tp, pp, dp, zero, micro-batch size)
PLANS = {"pp2": (1, 2, 1, 0, 1), "tp2": (2, 1, 1, 0, 2), "dp2_z1": (1, 1, 2, 1, 1), "dp2_z3": (1, 1, 2, 3, 1)}


def compile_plan(name: str, compiled) -> Path:
    """Compile PLANS[name]; with tp, split the MLPs Megatron's way in plan.json and compile that (--from-plan)."""
    tp, pp, dp, zero, mb = PLANS[name]
    out = compiled(PLAIN, global_batch_size=GBS, tp=tp, pp=pp, dp=dp, zero=zero, micro_batch_size=mb,
                   schedule="1f1b", recompute="none",
                   precision="fp32",  # initialization is the subject: fp32 programs equal one fp32 process to 1e-5
                   tp_styles=megatron_or_whole if tp > 1 else None)
    if tp > 1:
        assert "blocks.0.fc1.weight" in json.loads((out / "program" / "manifest.json").read_text())["tp"]["shards"]
    return out


def megatron_or_whole(fqn: str, style: str) -> str:
    return megatron_style(fqn) or "replicate"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, compiled):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("runtime_init")
    outs = {name: compile_plan(name, compiled) for name in PLANS}
    jobs = [{"out": str(outs[name]), "steps": STEPS, "seed": SEED, "initial": True,
             "result": str(tmp / f"{name}.pt"), **SGD} for name in PLANS]
    ck = str(tmp / "ck")
    jobs += [{"out": str(outs["pp2"]), "steps": 2, "seed": SEED, "save": ck, "result": str(tmp / "ck_first.pt"),
              **ADAMW},
             {"out": str(outs["dp2_z3"]), "steps": 4, "seed": SEED, "load": ck, "result": str(tmp / "ck_then.pt"),
              **ADAMW}]
    run_jobs(2, jobs, tmp)
    return tmp


def test_every_plan_starts_from_what_one_process_gives_and_trains_like_it(runs):
    init = build_initialized(load_model_file(str(PLAIN)), seed=SEED).state_dict()
    assert torch.equal(init["blocks.0.norm.weight"], torch.ones(32)) and init["blocks.1.alpha"].eq(0.1).all()
    losses, final = reference_run(str(PLAIN), init, steps=STEPS, seed=SEED, global_batch_size=GBS, **SGD)
    for name in PLANS:
        got = torch.load(runs / f"{name}.pt", weights_only=True)
        assert list(got["initial"]) == list(init), name
        for k in init:
            assert torch.equal(got["initial"][k], init[k]), (name, k)
        assert_close_losses(got["losses"], losses)
        assert_close_states(got["state"], final)
        assert got["replica_diff"] == 0.0


def test_root_tensors_checkpoint_under_one_plan_and_resume_under_another(runs):
    init = build_initialized(load_model_file(str(PLAIN)), seed=SEED).state_dict()
    losses, final = reference_run(str(PLAIN), init, steps=4, seed=SEED, global_batch_size=GBS, **ADAMW)
    first = torch.load(runs / "ck_first.pt", weights_only=True)
    then = torch.load(runs / "ck_then.pt", weights_only=True)
    assert then["start"] == 2
    assert_close_losses(first["losses"] + then["losses"], losses)
    assert_close_states(then["state"], final, rtol=1e-5, atol=1e-5)  # AdamW: see test_runtime_dist
