"""Tensor parallelism in the runtime: torchrun on CPU (gloo), tiny models, compared with one process.

Every program is compiled with a hand-set `tp` map (Megatron's pattern: QKV / fc1 / gate / up colwise, the output
projections rowwise, and where asked the vocabulary split: the token embedding rowwise, the LM head colwise),
through ``--from-plan`` as a user would, then trained under torchrun: SGD losses and the gathered final state dict
(the model's own keys and shapes) must equal `reference_run` (1e-5 relative), and every parameter the program does
not split must stay identical on the tp ranks, and every rank's collective payload must equal the plan's
``predicted.ranks[].comm_bytes`` (2%). Programs of one world size share a launch (`partc.runtime.testing`): CI has
two cores, and eight ranks on them are slow, so steps and sizes are tiny.

The programs run at ``precision: fp32`` except where a config says bf16: a rowwise layer's partial sums are reduced
in the compute dtype, so a bf16 program differs from one process by bf16 rounding (checked within 1%), while an fp32
one equals it up to the order of fp32 sums (1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import (EXAMPLES, assert_close_losses, assert_close_states, assert_comm_matches_plan, compile_program,
                     launch, megatron_style, run_jobs, write_hf_model)
from partc.model_file import load_model_file
from partc.runtime.materialize import build_initialized
from partc.runtime.testing import reference_run

pytestmark = pytest.mark.slow  # torchrun launches of 2, 4 and 8 gloo ranks

HF_LLAMA_SEQ_LEN = 32

# name: (model, tp, pp, dp, zero, schedule, micro-batch size, global batch, recompute, extra style edits)
CONFIGS = {
    # 2 ranks
    "gpt_tp2": ("gpt", 2, 1, 1, 0, "1f1b", 2, 4, "none", {}),
    "hf_llama_tp2": ("hf_llama", 2, 1, 1, 0, "1f1b", 1, 2, "none", {}),
    "gpt_tp2_block1_mlp_whole": ("gpt", 2, 1, 1, 0, "1f1b", 2, 4, "none",
                                 {"blocks.1.mlp.fc1": "replicate", "blocks.1.mlp.fc2": "replicate"}),
    "gpt_dp2_z3": ("gpt", 1, 1, 2, 3, "1f1b", 1, 4, "none", {}),
    # 4 ranks
    "gpt_tp4": ("gpt", 4, 1, 1, 0, "1f1b", 2, 4, "none", {}),
    "llama_tp2_pp2": ("llama", 2, 2, 1, 0, "1f1b", 1, 4, "none", {}),
    "hf_gpt2_tp2_dp2_z1": ("hf_gpt2", 2, 1, 2, 1, "1f1b", 1, 4, "none", {}),
    "hf_gpt2_tp2_pp2_interleaved": ("hf_gpt2", 2, 2, 1, 0, "interleaved-1f1b", 1, 4, "none", {}),
    "llama_tp2_dp2_z2_full_recompute": ("llama", 2, 1, 2, 2, "gpipe", 1, 4, "full", {}),
    "gpt_tp2_dp2_z1": ("gpt", 2, 1, 2, 1, "1f1b", 1, 4, "none", {}),
    "gpt_tp2_dp2_z3": ("gpt", 2, 1, 2, 3, "1f1b", 1, 4, "none", {}),
    # 8 ranks
    "gpt_tp2_pp2_dp2_z1": ("gpt", 2, 2, 2, 1, "1f1b", 1, 4, "none", {}),
    "llama_tp2_pp2_dp2_z3": ("llama", 2, 2, 2, 3, "1f1b", 1, 4, "none", {}),
}
BF16 = {"llama_tp2_pp2"}
"""Configs compiled at the default precision, bf16 (the others pin fp32)."""
BF16_RTOL = 1e-2
CHECKPOINT_ONLY = {"gpt_dp2_z3", "gpt_tp2_dp2_z1"}
"""Configs only the checkpoint jobs run."""
STEPS = 2
CHECKPOINT_PAIRS = [
    ("gpt_tp2", "gpt_dp2_z3"),  # tp=2 -> tp=1 under FSDP (fused QKV gathered over dp to load)
    ("gpt_dp2_z3", "gpt_tp2"),  # and back
    ("gpt_tp2_dp2_z3", "gpt_tp4"),  # FSDP inside each tp shard (nested Shard(0)) -> tp=4
    ("gpt_tp4", "gpt_tp2_dp2_z1"),  # -> ZeRO-1 with tp=2: each dp rank loads its partition's AdamW states
    ("gpt_tp2_dp2_z1", "gpt_tp2_dp2_z3"),  # ZeRO-1 partitions saved -> FSDP inside tp shards
]
SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0}
ADAMW = {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.1}


def model_path(model: str, tmp: Path) -> str:
    if model == "hf_llama":
        path = tmp / "hf_llama.py"
        return str(path) if path.exists() else write_hf_model(tmp, "llama")
    return str(EXAMPLES / f"{model}.py")


def seq_len(model: str) -> int | None:
    return HF_LLAMA_SEQ_LEN if model == "hf_llama" else None


def compile_tp(name: str, tmp: Path) -> Path:
    """Compile CONFIGS[name] with the solver, set the Megatron map (and the config's edits) in plan.json by hand,
    and compile that file with --from-plan."""
    model, tp, pp, dp, zero, schedule, mb, gbs, recompute, edits = CONFIGS[name]
    out = tmp / name

    def styles(fqn: str, solved: str) -> str:
        return edits.get(fqn, "replicate" if tp == 1 else megatron_style(fqn, vocab=True) or "replicate")

    compile_program(model_path(model, tmp), out, global_batch_size=gbs, seq_len=seq_len(model), tp_styles=styles,
                    tp=tp, pp=pp, dp=dp, zero=zero, micro_batch_size=mb, schedule=schedule, recompute=recompute,
                    precision="bf16" if name in BF16 else "fp32")
    if tp > 1:  # the pattern matched: both halves of Megatron's pairs, the embedding and the head split
        edited = json.loads((tmp / f"{name}.plan.json").read_text())["tp"]
        assert {"colwise", "rowwise"} <= set(edited.values()) and edited["lm_head"] == "colwise", name
    return out


_REFERENCES: dict[tuple, tuple[list[float], dict]] = {}


def reference(name: str, tmp: Path, init: dict, *, steps: int = STEPS, **opt) -> tuple[list[float], dict]:
    """One process from `init` (always the config's model's saved initial state here): computed once per
    arguments, as the five checkpoint pairs compare with the same AdamW run (callers only read the result)."""
    key = (name, str(tmp), steps, tuple(sorted((opt or SGD).items())))
    if key not in _REFERENCES:
        model, _, pp, _, _, _, mb, gbs, _, _ = CONFIGS[name]
        _REFERENCES[key] = reference_run(model_path(model, tmp), init, steps=steps, seed=0, global_batch_size=gbs,
                                         seq_len=seq_len(model), precision="bf16" if name in BF16 else "fp32",
                                         micro_batch_size=mb, untied=pp > 1, **(opt or SGD))
    return _REFERENCES[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Compile every config and run them: one launch per world size (2, 4, 8 ranks)."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("runtime_tp")
    inits = {}
    for m in ("gpt", "llama", "hf_gpt2", "hf_llama"):
        inits[m] = tmp / f"init_{m}.pt"
        torch.manual_seed(1234)
        spec = load_model_file(model_path(m, tmp), seq_len=seq_len(m))
        torch.save(spec.build().state_dict(), inits[m])
    outs = {name: compile_tp(name, tmp) for name in CONFIGS}
    jobs: dict[int, list[dict]] = {}
    for name, (model, tp, pp, dp, *_rest) in CONFIGS.items():
        if name in CHECKPOINT_ONLY:
            continue
        job = {"out": str(outs[name]), "steps": STEPS, "result": str(tmp / f"{name}.pt"), **SGD}
        # HF LLaMA starts from --init-checkpoint (each rank slices its shards from the file), the rest from
        # Program.load_state_dict.
        job["init_checkpoint" if model == "hf_llama" else "init"] = str(inits[model])
        jobs.setdefault(tp * pp * dp, []).append(job)
    # The runtime's own initialization (no state dict) equals one process's: sharded, tied (HF GPT-2), HF init.
    jobs[2].append({"out": str(outs["gpt_tp2"]), "steps": 0, "seed": 7, "result": str(tmp / "own_init_gpt.pt")})
    jobs[4].append({"out": str(outs["hf_gpt2_tp2_dp2_z1"]), "steps": 0, "seed": 7,
                    "result": str(tmp / "own_init_hf_gpt2.pt")})
    # Checkpoints across plans (AdamW, 2 steps saved, 2 more resumed): saved under one plan, resumed under another.
    for first, then in CHECKPOINT_PAIRS:
        ck = str(tmp / f"ck_{first}_{then}")
        world = {n: CONFIGS[n][1] * CONFIGS[n][2] * CONFIGS[n][3] for n in (first, then)}
        assert world[first] == world[then]
        jobs[world[first]] += [
            {"out": str(outs[first]), "steps": 2, "init": str(inits["gpt"]), "save": ck,
             "result": str(tmp / f"ck_{first}_{then}_first.pt"), **ADAMW},
            {"out": str(outs[then]), "steps": 4, "load": ck, "result": str(tmp / f"ck_{first}_{then}_resumed.pt"),
             **ADAMW},
        ]
    for nproc, js in sorted(jobs.items()):
        run_jobs(nproc, js, tmp)
    return tmp, outs, inits


@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in CHECKPOINT_ONLY])
def test_matches_one_process(runs, name):
    tmp, outs, inits = runs
    model = CONFIGS[name][0]
    got = torch.load(tmp / f"{name}.pt", weights_only=True)
    init = torch.load(inits[model], weights_only=True)
    losses, state = reference(name, tmp, init)
    rtol = BF16_RTOL if name in BF16 else 1e-5
    assert_close_losses(got["losses"], losses, rtol=rtol)
    assert_close_states(got["state"], state, rtol=rtol)  # the model's own keys, order and shapes: shards gathered
    assert assert_comm_matches_plan(outs[name], got["comm"]) > 0
    assert got["replica_diff"] == 0.0, "parameters the program keeps whole must stay identical on the tp ranks"
    assert any(not torch.equal(state[k], init[k]) for k in state), "training must change the weights"


@pytest.mark.parametrize("name,model", [("own_init_gpt", "gpt"), ("own_init_hf_gpt2", "hf_gpt2")])
def test_own_initialization_of_shards_equals_one_process(runs, name, model):
    tmp, _, _ = runs
    got = torch.load(tmp / f"{name}.pt", weights_only=True)["state"]
    want = build_initialized(load_model_file(model_path(model, tmp)), seed=7).state_dict()
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("first,then", CHECKPOINT_PAIRS)
def test_checkpoint_resumes_under_another_plan(runs, first, then):
    """Parameters and AdamW states of tensor-parallel shards (fused QKV stored as pieces) reshard on load."""
    tmp, _, inits = runs
    init = torch.load(inits["gpt"], weights_only=True)
    losses, state = reference("gpt_tp2", tmp, init, steps=4, **ADAMW)
    a = torch.load(tmp / f"ck_{first}_{then}_first.pt", weights_only=True)
    b = torch.load(tmp / f"ck_{first}_{then}_resumed.pt", weights_only=True)
    assert b["start"] == 2
    assert_close_losses(a["losses"] + b["losses"], losses)
    # AdamW divides by sqrt(v): rounding noise on near-zero gradients moves weights by ~lr (see test_runtime_dist).
    assert_close_states(b["state"], state, rtol=1e-5, atol=1e-5)


def test_hand_edited_map_runs_what_the_file_says(runs):
    """blocks.1's MLP left whole in plan.json: its weights are not split and its code has no collective."""
    _, outs, _ = runs
    out = outs["gpt_tp2_block1_mlp_whole"]
    assert json.loads((out / "plan.json").read_text())["tp"]["blocks.1.mlp.fc1"] == "replicate"
    shards = json.loads((out / "program" / "manifest.json").read_text())["tp"]["shards"]
    assert "blocks.0.mlp.fc1.weight" in shards and "blocks.2.mlp.fc2.weight" in shards
    assert not any(k.startswith("blocks.1.mlp.") for k in shards)
    calls: dict[str, list[str]] = {}
    module = ""
    for line in (out / "program" / "stage_0.py").read_text().splitlines():
        line = line.strip()
        if line.startswith("# ") and not line.startswith("# TP:"):
            module = line[2:].split()[0]
        elif "= tp." in line:
            calls.setdefault(module, []).append(line)
    assert not [m for m in calls if m.startswith("blocks.1.mlp")], calls
    assert calls["blocks.0.mlp.fc1"] and calls["blocks.2.mlp.fc1"]
    # (that it still trains like one process: test_matches_one_process[gpt_tp2_block1_mlp_whole])


def test_cli_tp_init_checkpoint_and_full_state_dict(runs, tmp_path):
    """python -m partc.runtime on a tp=2 program: safetensors --init-checkpoint sliced per rank,
    --save-full-state-dict gathered, a clean exit."""
    from safetensors.torch import save_file

    tmp, outs, inits = runs
    init = torch.load(inits["gpt"], weights_only=True)
    save_file(init, str(tmp_path / "init.safetensors"))
    full, log = tmp_path / "full.pt", tmp_path / "log.jsonl"
    done = launch(2, ["-m", "partc.runtime", str(outs["gpt_tp2"]), "--steps", "2", "--optimizer", "sgd",
                      "--lr", "0.5", "--init-checkpoint", str(tmp_path / "init.safetensors"),
                      "--log-jsonl", str(log), "--save-full-state-dict", str(full)])
    assert done.returncode == 0 and "step 2/2" in done.stdout
    losses, state = reference("gpt_tp2", tmp, init)
    assert_close_losses([json.loads(x)["loss"] for x in log.read_text().splitlines()], losses)
    got = torch.load(full, weights_only=True)
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in state.items()}
    assert_close_states(got, state)
