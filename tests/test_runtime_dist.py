"""Multi-process runtime tests: torchrun on CPU (gloo), tiny models, compared with one process and with the plan.

A covering subset of pp in {1, 2, 4}, dp in {1, 2, 4}, ZeRO 0-3, the three schedules, m from 1 to 8 and the three
recomputation modes for GPT, LLaMA and HF GPT-2, at the default precision, bf16 (not the cross product: CI has two
cores; tests/test_runtime_tp.py adds tp). Programs of one world size run as jobs of one launch
(`partc.runtime.testing`), so start-up is paid once per launch. Each job trains from a saved state dict on the
runtime's batches; its losses and gathered final state dict must equal `reference_run` under the same precision
policy and micro-batches (SGD: 1e-5 relative), and every rank's collective payload in every step must equal the
plan's ``predicted.ranks[].comm_bytes`` within 2%, axis by axis.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import (EXAMPLES, assert_close_losses, assert_close_states, assert_comm_matches_plan, compile_program,
                     launch, run_jobs)
from partc.model_file import load_model_file
from partc.runtime.materialize import build_initialized
from partc.runtime.testing import reference_run

pytestmark = pytest.mark.slow  # torchrun launches of 2 and 4 gloo ranks

# name: (model file, world size, pp, dp, zero, schedule, micro-batch size, global batch, recompute)
CONFIGS = {
    "gpt_pp2_dp2_z1_1f1b": ("gpt", 4, 2, 2, 1, "1f1b", 1, 8, "none"),
    "gpt_pp1_dp4_z3": ("gpt", 4, 1, 4, 3, "1f1b", 1, 8, "none"),
    "llama_pp4_z0_gpipe": ("llama", 4, 4, 1, 0, "gpipe", 1, 4, "full"),
    "hf_gpt2_pp2_dp2_z2_interleaved": ("hf_gpt2", 4, 2, 2, 2, "interleaved-1f1b", 1, 8, "none"),
    "llama_pp2_dp2_z3_interleaved": ("llama", 4, 2, 2, 3, "interleaved-1f1b", 1, 8, "none"),
    "hf_gpt2_pp2_z0_1f1b": ("hf_gpt2", 2, 2, 1, 0, "1f1b", 1, 4, "none"),
    "gpt_pp1_dp2_z2_gpipe_selective": ("gpt", 2, 1, 2, 2, "gpipe", 2, 8, "selective"),
    "llama_pp2_z1_gpipe": ("llama", 2, 2, 1, 1, "gpipe", 2, 8, "none"),
    "gpt_pp2_dp1_z0_1f1b_m1": ("gpt", 2, 2, 1, 0, "1f1b", 4, 4, "full"),
    "gpt_pp2_dp2_z2_1f1b_m8": ("gpt", 4, 2, 2, 2, "1f1b", 1, 16, "selective"),
}
STEPS = 3
SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0}
ADAMW = {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.1}


def compile_config(name: str, out: Path, *, model: str, world: int, pp: int, dp: int, zero: int, schedule: str,
                   mb: int, gbs: int, recompute: str = "none") -> Path:
    result = compile_program(model, out / name, gpus=world, global_batch_size=gbs, tp=1, pp=pp, dp=dp, zero=zero,
                             micro_batch_size=mb, schedule=schedule, recompute=recompute)
    par = result.plan.parallel
    assert (par.pp, par.dp, par.zero, par.schedule) == (pp, dp, zero, schedule)
    return out / name


def save_init(model: str, path: Path, seed: int = 1234) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    m = load_model_file(str(EXAMPLES / f"{model}.py")).build()
    sd = m.state_dict()
    torch.save(sd, path)
    return sd


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Compile every config, run them (one launch per world size), return the results by name."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("runtime")
    inits = {m: tmp / f"init_{m}.pt" for m in ("gpt", "llama", "hf_gpt2")}
    for m, p in inits.items():
        save_init(m, p)
    jobs: dict[int, list[dict]] = {}
    for name, (model, world, pp, dp, zero, sched, mb, gbs, rec) in CONFIGS.items():
        out = compile_config(name, tmp, model=model, world=world, pp=pp, dp=dp, zero=zero, schedule=sched, mb=mb,
                             gbs=gbs, recompute=rec)
        jobs.setdefault(world, []).append({"out": str(out), "steps": STEPS, "init": str(inits[model]),
                                           "result": str(tmp / f"{name}.pt"), **SGD})
    # A checkpoint written under pp=1, dp=4, ZeRO-3 (AdamW), resumed under pp=2, dp=2, ZeRO-1 (the CLI test goes
    # the other way).
    ck = tmp / "ckpt"
    jobs[4] += [{"out": str(tmp / "gpt_pp1_dp4_z3"), "steps": 2, "init": str(inits["gpt"]), "save": str(ck),
                 "result": str(tmp / "ckpt_first.pt"), **ADAMW},
                {"out": str(tmp / "gpt_pp2_dp2_z1_1f1b"), "steps": 4, "load": str(ck),
                 "result": str(tmp / "ckpt_resumed.pt"), **ADAMW},
                # no init state dict: the runtime's own initialization, under pp=4
                {"out": str(tmp / "llama_pp4_z0_gpipe"), "steps": 0, "seed": 7, "result": str(tmp / "init_pp4.pt")}]
    jobs[2].insert(0, {"check": "collectives", "result": str(tmp / "collectives.pt")})
    for nproc, js in sorted(jobs.items()):
        run_jobs(nproc, js, tmp)
    return tmp, inits


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_one_process(runs, name):
    tmp, inits = runs
    model, world, pp, dp, zero, sched, mb, gbs, rec = CONFIGS[name]
    got = torch.load(tmp / f"{name}.pt", weights_only=True)
    init = torch.load(inits[model], weights_only=True)
    # GPT-2's tied embedding and head: on two pipeline ranks the runtime sums their bf16 gradients in fp32.
    losses, state = reference_run(str(EXAMPLES / f"{model}.py"), init, steps=STEPS, seed=0, global_batch_size=gbs,
                                  precision="bf16", micro_batch_size=mb, untied=pp > 1, **SGD)
    assert_close_losses(got["losses"], losses)
    assert_close_states(got["state"], state)
    assert any(not torch.equal(state[k], init[k]) for k in state), "training must change the weights"
    moved = assert_comm_matches_plan(tmp / name, got["comm"])
    assert (moved > 0) == (world > 1)


def test_checkpoint_resumes_under_another_plan(runs):
    tmp, inits = runs
    init = torch.load(inits["gpt"], weights_only=True)
    losses, state = reference_run(str(EXAMPLES / "gpt.py"), init, steps=4, seed=0, global_batch_size=8,
                                  precision="bf16", micro_batch_size=1, **ADAMW)
    first = torch.load(tmp / "ckpt_first.pt", weights_only=True)
    resumed = torch.load(tmp / "ckpt_resumed.pt", weights_only=True)
    assert resumed["start"] == 2
    assert_close_losses(first["losses"] + resumed["losses"], losses)
    # AdamW divides by sqrt(v): on near-zero gradients (a key bias) rounding noise moves weights by ~lr, so the
    # comparison is absolute (per element, RMS) as well as relative.
    assert_close_states(resumed["state"], state, rtol=1e-5, atol=1e-5)


def test_own_initialization_is_plan_independent(runs):
    tmp, _ = runs
    got = torch.load(tmp / "init_pp4.pt", weights_only=True)["state"]
    want = build_initialized(load_model_file(str(EXAMPLES / "llama.py")), seed=7).state_dict()
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_cli_kill_and_resume_under_another_plan(tmp_path):
    """python -m partc.runtime: rank 1 dies after step 2; --resume (under pp=1, dp=4) continues from the step-2
    checkpoint and ends where one uninterrupted process ends."""
    torch.set_num_threads(1)
    init = save_init("gpt", tmp_path / "init.pt")
    a = compile_config("a", tmp_path, model="gpt", world=4, pp=2, dp=2, zero=1, schedule="1f1b", mb=1, gbs=8)
    b = compile_config("b", tmp_path, model="gpt", world=4, pp=1, dp=4, zero=2, schedule="gpipe", mb=2, gbs=8)
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    common = ["--steps", "5", "--init-checkpoint", str(tmp_path / "init.pt"), "--checkpoint-dir", str(ck),
              "--checkpoint-every", "2", "--log-jsonl", str(log), "--optimizer", "sgd", "--lr", "0.5"]
    crashed = launch(4, ["-m", "partc.runtime", str(a), *common], env={"PARTC_FAULT_EXIT": "1:2"}, check=False)
    assert crashed.returncode != 0
    assert sorted(p.name for p in ck.iterdir()) == ["partc-run.json", "partc-run.lock", "step-00000002"]
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]
    assert all(x["tokens_per_s"] > 0 and x["step_time_s"] > 0 for x in lines)

    full = tmp_path / "full.pt"
    done = launch(4, ["-m", "partc.runtime", str(b), *common, "--resume", "--save-full-state-dict", str(full)])
    assert "resumed from" in done.stdout and "step 5/5" in done.stdout
    # Micro-batches of 1 sample for steps 0-1 (plan a), then of 2 (plan b): at bf16 they round differently.
    losses, mid = reference_run(str(EXAMPLES / "gpt.py"), init, steps=2, seed=0, global_batch_size=8,
                                precision="bf16", micro_batch_size=1, **SGD)
    more, state = reference_run(str(EXAMPLES / "gpt.py"), mid, steps=5, start=2, seed=0, global_batch_size=8,
                                precision="bf16", micro_batch_size=2, **SGD)
    losses += more
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 2, 3, 4]
    # Each line holds every rank's traffic of that step next to its plan's prediction (plan a, then plan b).
    for plan, part in ((a, lines[:3]), (b, lines[3:])):
        assert [[r["rank"] for r in x["ranks"]] for x in part] == [[0, 1, 2, 3]] * len(part)
        assert all(r["comm_bytes"] and r["predicted_comm_bytes"] and r["peak_memory_bytes"] is None
                   for x in part for r in x["ranks"])
        assert assert_comm_matches_plan(plan, [[r["comm_bytes"] for r in x["ranks"]] for x in part]) > 0
        assert all(r["predicted_comm_bytes"] == json.loads((plan / "plan.json").read_text())["predicted"]["ranks"][
            r["pp_rank"]]["comm_bytes"] for x in part for r in x["ranks"])
    assert_close_losses([x["loss"] for x in lines[:2] + lines[3:]], losses)
    assert_close_states(torch.load(full, weights_only=True), state)
    assert sorted(p.name for p in ck.iterdir()) == ["partc-run.json", "partc-run.lock", "step-00000002",
                                                    "step-00000004", "step-00000005"]



def test_tp_collectives_are_megatrons_conjugates(runs):
    """copy_to_tp / reduce_from_tp / gather / scatter / reduce-scatter over 2 gloo ranks (checked in the ranks)."""
    tmp, _ = runs
    assert torch.load(tmp / "collectives.pt", weights_only=True) == {"ok": True}
