"""`compile_model` end to end: unmodified Hugging Face models, determinism, `--from-plan`, GPT-3 175B.

The Hugging Face models are tiny configs in model files that define only ``model()``: partc synthesizes the
inputs (``input_ids``, or ``pixel_values`` for ViT) and traces them on meta as they are. Most tests check the plan
(``out_dir=None``: no generated program; codegen has its own tests); the determinism and GPT-3 175B tests run the
whole ``partc compile``.
"""

import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from helpers import EXAMPLES, HF_MODELS, GiB
from partc.cli.main import main
from partc.cluster import Cluster
from partc.compile import compile_model
from partc.errors import PartcError
from partc.model_file import build_on_meta
from partc.parallel import Pins
from partc.passes.tp import style_error
from partc.plan import read_plan, write_plan

# A GPT wide enough that tensor parallelism pays (h 1024, 16 heads, s 512), two blocks: cheap to trace on meta.
MID_GPT = f"""
    import sys
    sys.path.insert(0, {str(EXAMPLES)!r})
    import torch
    from gpt import GPT, GPTConfig

    CONFIG = GPTConfig(vocab_size=8192, seq_len=512, hidden=1024, heads=16, layers=2)

    def model():
        return GPT(CONFIG)

    def example_inputs(batch_size):
        return (torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.seq_len)),)
"""


def check_plan(result, gpus: int) -> None:
    """What every compiled plan must satisfy."""
    plan, graph = result.plan, result.graph
    par = plan.parallel
    assert par.world_size == gpus
    assert par.global_batch_size == par.dp * par.micro_batch_size * par.num_microbatches
    assert set(plan.tp) == set(graph.layers)
    for fqn, style in plan.tp.items():
        assert style_error(graph.layers[fqn], style, par.tp) is None
    assert [m for s in plan.stages for m in s.modules] == [u.fqn for u in graph.units]
    assert len(plan.stages) == par.pp * par.virtual_stages
    assert set(graph.first_unit_required) <= set(plan.stages[0].modules)
    assert set(graph.last_unit_required) <= set(plan.stages[-1].modules)
    usable = Cluster.from_dict(plan.cluster).usable_memory_bytes
    assert 0 < plan.predicted["memory_per_gpu"]["total"] <= usable
    assert plan.predicted["step_time_s"] > 0 and 0 < plan.predicted["mfu"] < 1
    model = build_on_meta(result.spec)
    assert plan.model["num_params"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("gpus", [1, 2, 8])
@pytest.mark.parametrize("name", list(HF_MODELS))
def test_hf_models_compile_unmodified(name, gpus, hf_dir, tmp_path):
    pytest.importorskip("transformers")
    result = compile_model(str(hf_dir / f"hf_{name}.py"), gpus=gpus)
    check_plan(result, gpus)
    graph = result.graph
    assert sum(u.kind == "block" for u in graph.units) == 2  # both transformer layers found as repeated blocks
    written = read_plan(write_plan(result.plan, tmp_path))
    assert (written.parallel, written.tp) == (result.plan.parallel, result.plan.tp)
    if name == "gpt2":
        assert graph.tied == {"lm_head.weight": "transformer.wte.weight"}
    elif name == "bert":  # the MLM decoder is tied to the word embeddings
        assert graph.tied.get("cls.predictions.decoder.weight") == "bert.embeddings.word_embeddings.weight"
    elif name == "llama":
        k = next(layer for f, layer in graph.layers.items() if f.endswith("layers.0.self_attn.k_proj"))
        assert k.col_groups == 2  # num_key_value_heads
    elif name == "vit":
        assert result.spec.seq_len is None and graph.seq_len == (32 // 8) ** 2 + 1  # patches + [CLS]


@pytest.mark.slow
@pytest.mark.parametrize("enabled", [True, False])
def test_compile_pauses_the_cyclic_collector_and_restores_it(enabled, monkeypatch):
    """The collector is off while a compile runs (its heap would be walked again at every automatic collection) and
    back as it was afterwards, also when the compile fails."""
    monkeypatch.setenv("PARTC_GPT_SIZE", "tiny")
    seen = []
    (gc.enable if enabled else gc.disable)()
    try:
        compile_model(str(EXAMPLES / "gpt.py"), gpus=2, on_phase=lambda i, what: seen.append(gc.isenabled()))
        assert seen and not any(seen) and gc.isenabled() == enabled
        with pytest.raises(PartcError):
            compile_model(str(EXAMPLES / "gpt.py"), gpus=0)
        assert gc.isenabled() == enabled
    finally:
        gc.enable()


def test_compile_is_deterministic_across_processes(tmp_path):
    """Byte-identical plan.json from a fresh interpreter (another hash seed) and from this one."""
    model = str(EXAMPLES / "gpt.py")
    args = ["compile", model, "--gpus", "8", "--global-batch-size", "256"]
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    env.pop("PARTC_GPT_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "partc.cli.main", *args, "-o", str(tmp_path / "a")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    runner = CliRunner()
    for out in ("b", "c"):
        result = runner.invoke(main, [*args, "-o", str(tmp_path / out)])
        assert result.exit_code == 0, result.output
    a, b, c = ((tmp_path / d / "plan.json").read_bytes() for d in "abc")
    assert a == b == c
    assert json.loads(a)["schema_version"] == 1


@pytest.fixture(scope="module")
def mid_gpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("mid")
    path = d / "mid_gpt.py"
    path.write_text(textwrap.dedent(MID_GPT))
    return str(path)


def test_from_plan_round_trip(mid_gpt, tmp_path):
    first = compile_model(mid_gpt, gpus=8)
    again = compile_model(mid_gpt, gpus=8, from_plan=str(write_plan(first.plan, tmp_path / "a")))
    assert again.search is None
    a, b = first.plan.to_dict(), again.plan.to_dict()
    for key in ("parallel", "tp", "stages", "predicted", "model", "cluster", "schema_version"):
        assert a[key] == b[key], key
    assert b["alternatives"] == []
    # and the written file, read back, holds the same choices
    back = read_plan(write_plan(again.plan, tmp_path / "b"))
    assert (back.parallel, back.tp, [s.modules for s in back.stages]) == \
        (first.plan.parallel, first.plan.tp, [s.modules for s in first.plan.stages])


def test_from_plan_honours_a_hand_edited_tp_map(mid_gpt, tmp_path):
    first = compile_model(mid_gpt, gpus=8, global_batch_size=64, pins=Pins(tp=2))
    data = json.loads(first.plan.to_json())
    colwise = sorted(f for f, s in data["tp"].items() if s == "colwise" and f.startswith("blocks.0."))
    assert colwise, data["tp"]
    edited = colwise[0]
    data["tp"][edited] = "replicate"
    (tmp_path / "edited.json").write_text(json.dumps(data))
    again = compile_model(mid_gpt, gpus=8, from_plan=str(tmp_path / "edited.json"), global_batch_size=64)
    written = json.loads(write_plan(again.plan, tmp_path / "b").read_text())
    assert written["tp"][edited] == "replicate"
    assert {f: s for f, s in written["tp"].items() if f != edited} == \
        {f: s for f, s in first.plan.tp.items() if f != edited}
    assert written["parallel"] == first.plan.to_dict()["parallel"]
    # the edited layer now runs whole on every TP rank: more time, more memory, other collectives
    assert again.plan.predicted["step_time_s"] != first.plan.predicted["step_time_s"]
    held = [sum(s.num_params for s in r.best.prediction.ranks) for r in (first, again)]
    assert held[1] > held[0]
    block0 = [(c.kind, c.phase) for c in again.best.tp.collectives["blocks.0"]]
    block1 = [(c.kind, c.phase) for c in again.best.tp.collectives["blocks.1"]]
    assert block0 != block1  # only blocks.0 was edited


@pytest.mark.slow
def test_gpt3_175b_on_512_gpus_fits_80gb(tmp_path):
    """The README's first command, `partc compile examples/gpt3_175b.py --gpus 512`, prints a plan that fits
    80 GB (about 15 s: trace on meta, search, and the generated program)."""
    result = CliRunner().invoke(main, ["compile", str(EXAMPLES / "gpt3_175b.py"), "--gpus", "512",
                                       "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "Next best plans" in result.stdout and "GiB usable" in result.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    par, pred = plan["parallel"], plan["predicted"]
    assert par["dp"] * par["tp"] * par["pp"] == 512 and par["tp"] <= 8  # TP inside a node
    assert 174e9 < plan["model"]["num_params"] < 176e9
    assert plan["cluster"]["memory_bytes"] == 80 * GiB
    usable = Cluster.from_dict(plan["cluster"]).usable_memory_bytes
    assert pred["memory_per_gpu"]["total"] <= usable
    assert all(s["predicted"]["memory_bytes"] <= usable for s in plan["stages"])
    modules = [m for s in plan["stages"] for m in s["modules"]]
    assert modules.count("lm_head") == 1 and sum(m.startswith("blocks.") for m in modules) == 96
    # sequence parallelism, as searched: its program keeps the split everywhere (the embeddings' sum and the tied
    # output layer are its edges, not fallbacks; docs/sequence-parallel.md)
    assert par["sequence_parallel"] and "sequence_parallel_gathers" not in plan["model"]
    assert {"tok", "pos"} <= set(plan["stages"][0]["modules"]) and "lm_head" in plan["stages"][-1]["modules"]
    # 16 bytes per parameter of model states alone are 2.8 TB: the model must be split or ZeRO-3 sharded
    assert par["tp"] * par["pp"] > 1 or par["zero"] == 3
    assert len(plan["alternatives"]) == 5
    assert all(a["step_time_s"] >= pred["step_time_s"] for a in plan["alternatives"])


def test_the_search_s_sequence_parallel_program_is_the_one_written(tmp_path, monkeypatch):
    """When the search takes sequence parallelism (forced here at tp 2) and its program keeps the split everywhere
    (its gathers cleared here), the program generated to find out is the one written: the model is rewritten once."""
    import partc.compile as compile_module
    import partc.passes.search_space as search_space
    made, real = [], compile_module.make_program

    def counted(*args, **kwargs):
        program = real(*args, **kwargs)
        program.sequence_gathers = []  # as if the program kept the split along the sequence everywhere
        made.append(program)
        return program

    monkeypatch.setattr(compile_module, "make_program", counted)
    monkeypatch.setattr(search_space, "sequence_parallel_choices",
                        lambda graph, tp, pins, cp=1: (pins.sequence_parallel,) if pins.sequence_parallel is not None
                        else (tp > 1,))
    out = tmp_path / "gpt"
    result = compile_model(str(EXAMPLES / "gpt.py"), gpus=2, pins=Pins(tp=2, precision="fp32"),
                           global_batch_size=2, out_dir=out)
    assert result.plan.parallel.sequence_parallel and len(made) == 1
    assert (out / "program" / "stage_0.py").read_text() == made[0].files["stage_0.py"]
