"""Models as users write them in plain PyTorch (issue #30, `user_models.USER`): each either trains like one process
under pp 2 x dp 2 (and tp 2 where a layer splits), or is refused at compile time with one line. `partc compile`
never succeeds on a program that cannot run: the fast tests compile every model (and run each refusal); the slow
test trains every program in one torchrun launch of 4 gloo ranks against `reference_run`."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import pytest
import torch

from helpers import assert_close_losses, assert_close_states, reference_once, run_in_session, run_jobs
from partc.cluster import PRESETS
from partc.compile import compile_model
from partc.errors import PartcError, article, first_line
from partc.model_file import load_model_file
from partc.parallel import Pins
from partc.passes.export import VALUE_SHAPED_HINT
from user_models import USER, write_user_model

REFUSED = {  # name: what the one line must say
    "masked_rows": r"aten\.index\.Tensor at .*user_masked_rows\.py:\d+: its output's size depends on tensor values",
    "data_control": r"in module Net at .*user_data_control\.py:\d+: .*replace Python control flow on tensor values",
    "autocast": r"torch\.autocast in forward at .*user_autocast\.py:\d+ cannot be written into partc's program; .*"
                r"--precision",
    "cond": r"torch\.cond at .*user_cond\.py:\d+ cannot be written into partc's program; .*torch\.where\(pred, a, b\)",
}
TRAINED = [name for name in USER if name not in REFUSED]
TP = {  # name: Megatron's styles by name suffix, set by hand in plan.json at tp 2 (the solver replicates tiny layers)
    "vit": {"qkv": "colwise", "proj": "rowwise", "fc1": "colwise", "fc2": "rowwise"},
    "no_grad": {"fc1": "colwise", "fc2": "rowwise"},  # fc2 runs inside and outside the no_grad region
    "moe_dense": {"fc1": "colwise", "fc2": "rowwise"},
    "moe": {"fc1": "colwise", "fc2": "rowwise"},  # experts split on the tokens routed to them (value-sized)
}
PP_DP = Pins(tp=1, pp=2, dp=2, zero=1, micro_batch_size=2, schedule="1f1b", recompute="none", precision="fp32")
GBS = 8  # 2 micro-batches of 2 samples on each of 2 data-parallel ranks
STEPS = 2
SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0}


def compile_user(tmp, name, pins=PP_DP, gbs=GBS, out="out", **kwargs):
    torch.set_num_threads(1)
    path = write_user_model(tmp, name)
    return path, compile_model(path, gpus=pins.tp * pins.pp * pins.dp, pins=pins, global_batch_size=gbs,
                               out_dir=tmp / out, **kwargs)


def set_styles(tmp, name, path, out):
    """Compile `out` again from its plan with TP[name]'s styles."""
    plan = json.loads((tmp / out / "plan.json").read_text())
    plan["tp"].update({f: style for f in plan["tp"] for k, style in TP[name].items() if f.endswith(k)})
    assert any(s != "replicate" for s in plan["tp"].values())
    (tmp / f"{out}.plan.json").write_text(json.dumps(plan))
    compile_model(path, gpus=plan["parallel"]["tp"] * plan["parallel"]["pp"] * plan["parallel"]["dp"],
                  from_plan=str(tmp / f"{out}.plan.json"), out_dir=tmp / out, force=True)


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_at_compile_time_with_one_line(tmp_path, name):
    with pytest.raises(PartcError) as e:
        compile_user(tmp_path, name)
    line = str(e.value)
    assert "\n" not in line and "Traceback" not in line
    assert re.search(REFUSED[name], line), line
    assert not (tmp_path / "out").exists(), "a refused model writes no program"


def test_the_moe_refusal_recommends_what_compiles(tmp_path):
    """The hint names no value-shaped op as the fix, and the model written as it says compiles."""
    assert "such as torch.where" not in VALUE_SHAPED_HINT and "nonzero" in VALUE_SHAPED_HINT.split("(")[1]
    _, result = compile_user(tmp_path, "moe_dense")
    assert result.plan.parallel.pp == 2


def test_routed_moe_is_priced_at_expected_sizes(tmp_path):
    """nonzero(choice == e) per expert: traced with unbacked sizes, measured at 1/4 of the tokens per expert (stated
    in the plan and a warning), no pipeline boundary where a routed tensor would cross, torch.export's checks of
    the traced sizes not in the program; a plan that cuts between experts is refused in one line."""
    path, result = compile_user(tmp_path, "moe")
    stated = result.plan.model["expected_sizes"]
    assert stated["groups"] == 4 and stated["calls"] == 4 and stated["where"].startswith("user_moe.py:")
    assert any(w.startswith("sizes depend on values:") and "1/4" in w for w in result.warnings)
    fc1 = result.graph.layers["moe.experts.0.fc1"].gemms[0]
    assert fc1.m == 2 and fc1.k == 16 and fc1.n == 32  # ceil(6 tokens / 4) rows at one sample
    stages = [list(st.modules) for st in result.plan.stages]
    experts = [k for k, mods in enumerate(stages) if any(m.startswith("moe.experts.") for m in mods)]
    assert len(experts) == 1 and "head" in stages[experts[0]], stages
    code = "".join((tmp_path / "out" / "program" / f"stage_{k}.py").read_text() for k in range(2))
    assert "aten.nonzero.default(" in code and "_assert_scalar" not in code and "sym_size" not in code
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    mods = [m for st in plan["stages"] for m in st["modules"]]
    cut = mods.index("moe.experts.1") + 1
    plan["stages"][0]["modules"], plan["stages"][1]["modules"] = mods[:cut], mods[cut:]
    (tmp_path / "cut.plan.json").write_text(json.dumps(plan))
    with pytest.raises(PartcError, match="cannot end at moe.experts.1: a tensor whose size depends on values .* would cross it"):
        compile_model(path, gpus=4, from_plan=str(tmp_path / "cut.plan.json"), out_dir=tmp_path / "cut")


def test_no_grad_region_is_written_as_no_grad_code(tmp_path):
    """torch.export leaves `with torch.no_grad():` as a higher-order op over a submodule; the program runs its ops
    under torch.no_grad() (no call of the higher-order op, no undefined submodule), with or without tp."""
    path, _ = compile_user(tmp_path, "no_grad")
    code = "".join((tmp_path / "out" / "program" / f"stage_{k}.py").read_text() for k in range(2))
    assert "with torch.no_grad():" in code and "higher_order" not in code and "submod" not in code
    tp = Pins(tp=2, pp=1, dp=1, zero=0, micro_batch_size=2, schedule="1f1b", recompute="none", precision="fp32")
    compile_user(tmp_path, "no_grad", pins=tp, gbs=2, out="tp")
    set_styles(tmp_path, "no_grad", path, "tp")
    code = (tmp_path / "tp" / "program" / "stage_0.py").read_text()
    assert "with torch.no_grad():" in code and "higher_order" not in code and "tp." in code


def test_buffer_written_in_forward_is_stated(tmp_path):
    _, result = compile_user(tmp_path, "ema")
    stated = result.plan.model["buffers_written_in_forward"]
    assert stated["buffers"] == ["running"] and stated["where"][0].startswith("user_ema.py:")
    assert stated["updates_per_step"] == 2 and stated["copies"] == 2
    note = [w for w in result.warnings if w.startswith("buffer running")]
    assert len(note) == 1 and "2 data-parallel ranks" in note[0] and "differs from one process" in note[0]
    # one micro-batch of the whole batch on one data-parallel rank: as one process, nothing to say
    pins = Pins(tp=1, pp=2, dp=1, zero=0, micro_batch_size=4, schedule="1f1b", recompute="none", precision="fp32")
    _, result = compile_user(tmp_path, "ema", pins=pins, gbs=4, out="whole")
    assert not any("buffer" in w for w in result.warnings)


def test_users_checkpoint_is_stated(tmp_path):
    _, result = compile_user(tmp_path, "checkpoint")
    stated = result.plan.model["user_checkpoint"]
    assert stated["kept"] is False and stated["recompute"] == "none"
    assert stated["calls"] and all(c.startswith("user_checkpoint.py:") for c in stated["calls"])
    assert any("torch.utils.checkpoint" in w and "recompute (none)" in w for w in result.warnings)
    _, result = compile_user(tmp_path, "shared_depth", out="plain")
    assert "user_checkpoint" not in result.plan.model


@pytest.mark.slow  # a process of its own: 5-15 s on 2 shared cores
def test_wrong_input_width_prints_one_line(tmp_path):
    """No fake-tensor traceback logged before partc's line (torch's log handler writes to the process's stderr:
    the CLI runs in a process of its own)."""
    path = write_user_model(tmp_path, "no_grad")
    text = open(path).read().replace("torch.randn(batch_size, 8)", "torch.randn(batch_size, 9)")
    open(path, "w").write(text)
    proc = run_in_session("partc compile", [sys.executable, "-m", "partc.cli.main", "compile", path, "--gpus", "1",
                                            "-o", str(tmp_path / "out")], env=None, timeout=300, stderr_apart=True)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and proc.stdout == "", proc.stderr
    assert "in module fc1" in lines[0] and "shapes of example_inputs do not fit" in lines[0], lines[0]


SP_PINS = pytest.mark.parametrize("sp", [None, True], ids=["searched", "sequence_parallel"])
"""The search's choice, and sequence parallelism pinned: its program falls back to tensor parallelism around the
experts (values crossing the pipeline boundary whole, scattered and gathered), priced as the program runs."""


@pytest.mark.slow  # partc check spawns a process per pipeline rank: 30-60 s on 2 shared cores
@SP_PINS
def test_copied_value_all_reduce_is_priced_to_the_byte(tmp_path, sp):
    """moe_dense under tp 2 x pp 2 with its experts split: experts on both stages read the block's input, each
    stage copies it (`copy_to_tp`) and all-reduces its gradient; the plan's tp bytes equal partc check's on every
    pipeline rank with no slack. Under sequence parallelism the program's ``zeros_like`` of the stream, scattered
    along the sequence, has no gradient to gather."""
    from partc.runtime.check import check_program

    tp_pp = Pins(tp=2, pp=2, dp=1, zero=0, micro_batch_size=2, schedule="1f1b", recompute="none", precision="fp32",
                 sequence_parallel=sp)
    # Without the kernel-launch floor (which prices this tiny model's units by their kernel counts, and so puts
    # every expert on the first stage), the stage DP splits the experts over the two stages: the case under test.
    no_launches = dataclasses.replace(PRESETS["a100-80g"], kernel_launch_s=0.0)
    path, _ = compile_user(tmp_path, "moe_dense", pins=tp_pp, out="c", cluster=no_launches)
    set_styles(tmp_path, "moe_dense", path, "c")
    plan = json.loads((tmp_path / "c" / "plan.json").read_text())
    experts = [{m for m in st["modules"] if m.startswith("moe.experts.")} for st in plan["stages"]]
    assert all(experts), f"experts on both stages: {plan['stages']}"
    results = check_program(str(tmp_path / "c"), slack_bytes=0)
    assert len(results) == 2
    for r in results:
        assert r.comm_bytes["tp"] > 0 and r.comm_bytes["tp"] == r.predicted_comm_bytes["tp"], r


@pytest.mark.slow  # partc check spawns a process per pipeline rank: 30-60 s on 2 shared cores
@SP_PINS
def test_routed_moe_checks_at_expected_sizes(tmp_path, sp):
    """partc check runs nonzero on fake tensors (no values) at the plan's expected size per expert: the traffic of
    every axis, tp's collectives on the routed tokens included, is the plan's to the byte. Each expert's colwise
    fc1 reads its own routed rows, whose gradient the program all-reduces per expert (`Edge.routed`), and the
    router reaches fc1 only through integer indices, which carry no gradient (the last stage's tp bytes were 256 of
    15,104 off). Memory rows agree within the default slack (a tiny model's differ by a few KiB). The program is
    generated at the expected size per sample, as the check runs it (its tp bytes, which price a sequence-parallel
    plan, were 512 a micro-batch short: an expert's rows were 3 of the micro-batch's 12 tokens, not 2 of each
    sample's 6)."""
    from partc.runtime.check import check_program

    tp_pp = Pins(tp=2, pp=2, dp=1, zero=0, micro_batch_size=2, schedule="1f1b", recompute="none", precision="fp32",
                 sequence_parallel=sp)
    path, _ = compile_user(tmp_path, "moe", pins=tp_pp, out="c")
    set_styles(tmp_path, "moe", path, "c")
    results = check_program(str(tmp_path / "c"))
    assert len(results) == 2
    for r in results:
        assert all(row.agrees for row in r.rows()), r
        assert r.comm_bytes["tp"] > 0 and r.comm_bytes == {k: int(v) for k, v in r.predicted_comm_bytes.items()}


def test_wording():
    assert article("Albert") == "an Albert" and article("Conv2d") == "a Conv2d"
    cut = first_line(ValueError("word " * 100), limit=32)
    assert cut == "word word word word word word ..."


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every trained model's program under pp 2 x dp 2, some under tp 2 x pp 2 with Megatron's styles, and the EMA
    model under pp 2 x tp 2 on one micro-batch of the whole batch (where its buffer is one process's): one torchrun
    launch of 4 ranks."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("user")
    jobs, cases = [], {}
    tp_pp = Pins(tp=2, pp=2, dp=1, zero=0, micro_batch_size=2, schedule="1f1b", recompute="none", precision="fp32")
    whole = Pins(tp=2, pp=2, dp=1, zero=0, micro_batch_size=GBS, schedule="1f1b", recompute="none",
                 precision="fp32")
    plan = [(name, PP_DP, f"{name}_pp2_dp2") for name in TRAINED if name != "ema"]
    plan += [(name, tp_pp, f"{name}_tp2_pp2") for name in TP] + [("ema", whole, "ema_tp2_pp2_whole")]
    full = dataclasses.replace(PP_DP, recompute="full")  # a no_grad region inside a unit recomputed in backward
    plan += [(name, full, f"{name}_pp2_dp2_full") for name in ("no_grad", "nested_grad")]
    for name, pins, case in plan:
        path, _ = compile_user(tmp, name, pins=pins, out=case)
        if case == f"{name}_tp2_pp2":
            set_styles(tmp, name, path, case)
        torch.manual_seed(1234)
        torch.save(load_model_file(path).build().state_dict(), tmp / f"{case}.init.pt")
        jobs.append({"out": str(tmp / case), "steps": STEPS, "init": str(tmp / f"{case}.init.pt"),
                     "result": str(tmp / f"{case}.pt"), **SGD})
        cases[case] = path
    run_jobs(4, jobs, tmp)
    return tmp, cases


CASES = [f"{n}_pp2_dp2" for n in TRAINED if n != "ema"] + [f"{n}_tp2_pp2" for n in TP] + ["ema_tp2_pp2_whole"] \
    + ["no_grad_pp2_dp2_full", "nested_grad_pp2_dp2_full"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_trains_like_one_process(runs, case):
    tmp, cases = runs
    init = torch.load(tmp / f"{case}.init.pt", weights_only=True)
    got = torch.load(tmp / f"{case}.pt", weights_only=True)
    losses, state = reference_run(cases[case], init)
    assert_close_losses(got["losses"], losses)
    assert_close_states(got["state"], state, atol=1e-8)
    assert any(not torch.equal(state[k], init[k]) for k in state if k != "running"), "training must change weights"


def reference_run(path, init):
    """One process's STEPS steps of the model file `path` from `init` (a model under two plans starts from one
    state, the same seed: run once, `reference_once`)."""
    return reference_once(path, init, steps=STEPS, seed=0, global_batch_size=GBS, **SGD)
