"""`partc compile`: every user error is one line ``error: ...`` on stderr, exit code 2, no traceback.

Most cases run in-process with click's CliRunner; the data-dependent model runs in a real subprocess, where
torch's own logging and prints (which CliRunner cannot capture) would show up on stderr.
"""

import io
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from helpers import BRANCHY, EXAMPLES, ROOT, GiB
from partc.cli.main import compress_modules, main, phase_progress
from partc.compile import PHASES

GPT = str(EXAMPLES / "gpt.py")

BAD_FILES = {
    "syntax.py": ("def model(:\n", r"syntax\.py:1: syntax error"),
    "imports.py": ("import partc_no_such_package_xyz\n", r"no module named 'partc_no_such_package_xyz'"),
    "no_entry.py": ("import torch\n\ndef build():\n    return torch.nn.Linear(2, 2)\n",
                    r"has no 'model' \(it defines: build\)"),
    "raises.py": ("def model():\n    raise RuntimeError('boom')\n",
                  r"raises\.py:2: model\(\) raised RuntimeError: boom"),
    "not_module.py": ("import torch\n\ndef model():\n    return 42\n\ndef example_inputs(b):\n"
                      "    return (torch.zeros(b, 2),)\n", r"model\(\) returned int, expected a torch\.nn\.Module"),
    "no_inputs.py": ("import torch\n\ndef model():\n    return torch.nn.Linear(2, 2)\n",
                     r"defines no example_inputs\(batch_size\)"),
}


def run_error(args, pattern: str | None = None, tmp_path=None) -> str:
    """Run `partc` in-process; it must fail with exit code 2 and exactly one line ``error: ...`` on stderr."""
    if tmp_path is not None and "-o" not in args:
        args = [*args, "-o", str(tmp_path / "out")]
    result = CliRunner().invoke(main, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output and result.stdout == ""
    if pattern is not None:
        assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------
# The model file


def test_missing_file(tmp_path):
    run_error(["compile", str(tmp_path / "nope.py"), "--gpus", "1"], r"nope\.py does not exist", tmp_path)


def test_directory(tmp_path):
    run_error(["compile", str(tmp_path), "--gpus", "1"], r"is a directory", tmp_path)


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_bad_model_files(name, tmp_path, monkeypatch):
    text, pattern = BAD_FILES[name]
    (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)  # messages name files relative to the working directory
    run_error(["compile", name, "--gpus", "1"], pattern, tmp_path)


@pytest.mark.slow
def test_model_torch_export_cannot_trace_names_module_and_line(tmp_path):
    """A real subprocess: exit code 2 and one stderr line, even though torch.export prints the partial graph."""
    path = tmp_path / "branchy.py"
    path.write_text(textwrap.dedent(BRANCHY))
    line = path.read_text().splitlines().index("        if y.sum() > 0:") + 1
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "PARTC_GPT_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "partc.cli.main", "compile", str(path), "--gpus", "1",
                           "-o", str(tmp_path / "out")], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cannot trace"), proc.stderr
    assert "in module gate" in lines[0] and f"{path}:{line}" in lines[0]
    assert "torch.where" in lines[0]  # what to change
    assert proc.stdout == "" and not (tmp_path / "out" / "plan.json").exists()


# ---------------------------------------------------------------------------------------------------------------
# Options


@pytest.mark.parametrize("gpus, pattern", [("0", r"--gpus must be a positive integer, got 0"),
                                           ("-1", r"--gpus must be a positive integer, got -1"),
                                           ("eight", r"'--gpus': 'eight' is not a valid integer"),
                                           ("1.5", r"'--gpus': '1.5' is not a valid integer")])
def test_bad_gpus(gpus, pattern, tmp_path):
    run_error(["compile", GPT, "--gpus", gpus], pattern, tmp_path)


def test_missing_gpus_and_bad_option_values(tmp_path):
    run_error(["compile", GPT], r"Missing option '--gpus'", tmp_path)
    run_error(["compile", GPT, "--gpus", "8", "--tp", "0"], r"'--tp': must be a positive integer", tmp_path)
    run_error(["compile", GPT, "--gpus", "8", "--zero", "4"], r"'--zero'", tmp_path)
    run_error(["compile", GPT, "--gpus", "8", "--schedule", "zigzag"], r"'--schedule'", tmp_path)


@pytest.mark.parametrize("pins, pattern", [
    (["--tp", "3"], r"--tp 3 does not divide the GPU count 8"),
    (["--pp", "3"], r"--pp 3 does not divide the GPU count 8"),
    (["--dp", "5"], r"--dp 5 does not divide the GPU count 8"),
    (["--tp", "4", "--pp", "4"], r"pinned degrees 4 x 4 do not divide the GPU count 8"),
    (["--tp", "2", "--pp", "2", "--dp", "1"], r"dp x tp x pp = 4 but --gpus is 8"),
    (["--tp", "1", "--sequence-parallel"], r"--sequence-parallel needs tensor parallelism"),
])
def test_pins_that_do_not_divide_the_gpu_count(pins, pattern, tmp_path):
    run_error(["compile", GPT, "--gpus", "8", *pins], pattern, tmp_path)


def test_unknown_cluster(tmp_path):
    run_error(["compile", GPT, "--gpus", "8", "--cluster", "tpu-v9"], r"unknown cluster 'tpu-v9'; presets: a100-80g",
              tmp_path)
    run_error(["compile", GPT, "--gpus", "8", "--cluster", str(tmp_path / "mine.json")], r"does not exist",
              tmp_path)
    (tmp_path / "typo.json").write_text('{"memory_byts": 1}')
    run_error(["compile", GPT, "--gpus", "8", "--cluster", str(tmp_path / "typo.json")],
              r"unknown cluster field\(s\) memory_byts", tmp_path)


def test_global_batch_not_divisible(tmp_path):
    run_error(["compile", GPT, "--gpus", "8", "--dp", "8", "--global-batch-size", "12"],
              r"global batch size 12 is not divisible by dp x micro-batch size = 8 x 1", tmp_path)
    run_error(["compile", GPT, "--gpus", "8", "--dp", "2", "--micro-batch-size", "4", "--global-batch-size", "12"],
              r"global batch size 12 is not divisible by dp x micro-batch size = 2 x 4", tmp_path)


def test_more_stages_than_layers(tmp_path):
    # the tiny GPT has 8 units: pos, tok, blocks.0-3, ln_f, lm_head
    run_error(["compile", GPT, "--gpus", "64", "--pp", "64"],
              r"--pp 64 asks for more pipeline stages than the model has units \(8\)", tmp_path)
    # the embeddings share the first stage and ln_f/lm_head the last: at most 6 stages
    run_error(["compile", GPT, "--gpus", "8", "--pp", "8"], r"at most 6 stages", tmp_path)


def test_model_that_fits_no_plan(tmp_path, monkeypatch):
    """GPT 1.7B on one GPU with 1 GiB usable: the message gives the least memory a plan needs."""
    monkeypatch.setenv("PARTC_GPT_SIZE", "1.7b")
    cluster = tmp_path / "tiny_gpu.json"
    cluster.write_text(json.dumps({"gpu": "Tiny GPU", "memory_bytes": 2 * GiB, "memory_reserve_bytes": GiB,
                                   "memory_reserve_fraction": 0.0}))
    line = run_error(["compile", GPT, "--gpus", "1", "--cluster", str(cluster)], tmp_path=tmp_path)
    need = float(re.search(r"needs is ([\d.]+) GiB per GPU", line).group(1))
    params = 1.7e9
    assert 16 * params / GiB <= need < 1.5 * 16 * params / GiB  # at least the 16 bytes/param of model states
    assert "a Tiny GPU has 1.0 GiB usable" in line and "more GPUs" in line


# ---------------------------------------------------------------------------------------------------------------
# --from-plan


@pytest.fixture()
def good_plan(tmp_path):
    result = CliRunner().invoke(main, ["compile", GPT, "--gpus", "2", "--global-batch-size", "64",
                                       "-o", str(tmp_path / "good")])
    assert result.exit_code == 0, result.output
    return json.loads((tmp_path / "good" / "plan.json").read_text())


def _write(tmp_path, data, name="plan.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_corrupt_from_plan(tmp_path, good_plan):
    base = ["compile", GPT, "--gpus", "2", "--from-plan"]
    run_error([*base, _write(tmp_path, "{not json")], r"is not valid JSON \(line 1", tmp_path)
    run_error([*base, _write(tmp_path, "[1, 2]")], r"must hold a JSON object", tmp_path)
    run_error([*base, str(tmp_path / "missing.json")], r"plan file .*missing\.json does not exist", tmp_path)
    run_error([*base, _write(tmp_path, {**good_plan, "schema_version": 2})], r"schema_version 2; this partc reads 1",
              tmp_path)
    no_parallel = {k: v for k, v in good_plan.items() if k != "parallel"}
    run_error([*base, _write(tmp_path, no_parallel)], r"missing field 'parallel'", tmp_path)
    stages = json.loads(json.dumps(good_plan["stages"]))
    stages[0]["modules"][0] = "transformer.h.0"
    run_error([*base, _write(tmp_path, {**good_plan, "stages": stages})],
              r"names 'transformer\.h\.0', which is not a unit of the model", tmp_path)
    tp = dict(good_plan["tp"])
    tp["blocks.9.mlp.fc1"] = "colwise"
    run_error([*base, _write(tmp_path, {**good_plan, "tp": tp})],
              r"tp map names 'blocks\.9\.mlp\.fc1', which is not a layer of the model", tmp_path)
    tp = dict(good_plan["tp"])
    tp["blocks.0.mlp.fc1"] = "diagonal"
    run_error([*base, _write(tmp_path, {**good_plan, "tp": tp})], r"must be one of colwise, rowwise, replicate",
              tmp_path)


def test_from_plan_must_agree_with_options(tmp_path, good_plan):
    plan = _write(tmp_path, good_plan)
    run_error(["compile", GPT, "--gpus", "4", "--from-plan", plan], r"the plan is for .* = 2 GPUs, but --gpus is 4",
              tmp_path)
    run_error(["compile", GPT, "--gpus", "2", "--from-plan", plan, "--tp", "2"], r"takes the place of the pins",
              tmp_path)
    run_error(["compile", GPT, "--gpus", "2", "--from-plan", plan, "--cluster", "h100-80g"],
              r"made for cluster 'a100-80g'", tmp_path)
    run_error(["compile", GPT, "--gpus", "2", "--from-plan", plan, "--global-batch-size", "128"],
              r"global batch is 64, but --global-batch-size is 128", tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# Success


def test_summary_and_json_output(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["compile", GPT, "--gpus", "2", "--global-batch-size", "64",
                                  "-o", str(tmp_path / "t")])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for text in ("Plan", "step time", "MFU", "Stages (per pipeline rank)", "Next best plans",
                 f"wrote {tmp_path / 't' / 'plan.json'}", "plans considered"):
        assert text in out, text
    result = runner.invoke(main, ["compile", GPT, "--gpus", "2", "--global-batch-size", "64", "--format", "json",
                                  "-o", str(tmp_path / "j")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json.loads((tmp_path / "j" / "plan.json").read_text())
    assert result.stdout == (tmp_path / "t" / "plan.json").read_text()


ODD_MLP = """
    import torch
    from torch import nn

    def model():
        return nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))

    def example_inputs(batch_size):
        return (torch.randn(batch_size, 7),)
"""


def test_tp_that_splits_nothing_says_why(tmp_path):
    """--tp 2 on a model whose features (7 -> 5 -> 3) no layer can split: one warning line, the summary's table
    and plan.json's tp_why name each layer and the divisibility that keeps it whole."""
    path = tmp_path / "odd.py"
    path.write_text(textwrap.dedent(ODD_MLP))
    result = CliRunner().invoke(main, ["compile", str(path), "--gpus", "2", "--tp", "2", "-o", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    warnings = [l for l in result.stderr.splitlines() if l.startswith("warning: tp 2")]
    assert len(warnings) == 1 and "splits no layer" in warnings[0], result.stderr
    assert "divisibility: colwise needs its output features (5) divisible by tp=2" in warnings[0]
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert set(plan["tp"].values()) == {"replicate"}
    assert plan["tp_why"] == {
        "0": "divisibility: colwise needs its output features (5) divisible by tp=2; rowwise needs its input "
             "features (7) divisible by tp=2",
        "2": "divisibility: colwise needs its output features (3) divisible by tp=2; rowwise needs its input "
             "features (5) divisible by tp=2"}
    assert "Layers not split as Megatron-LM splits them (tp=2)" in result.stdout


def test_progress_bar_only_on_a_terminal(monkeypatch):
    """The phases of partc compile show as a progress bar on stderr when it is a terminal, and not at all in a pipe
    or a log (CliRunner's stderr, a file)."""
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        with phase_progress() as on_phase:
            assert (on_phase is not None) == shown
            for i, what in enumerate(PHASES):
                if on_phase:
                    on_phase(i, what)
        text = stream.getvalue()
        assert all((what in text) == shown for what in PHASES), text


def test_compress_modules():
    assert compress_modules(["pos", "tok", "blocks.0", "blocks.1", "blocks.2", "ln_f"]) == "pos, tok, blocks.0-2, ln_f"
    assert compress_modules(["blocks.3", "blocks.5"]) == "blocks.3, blocks.5"


def test_readme_quick_start_is_the_175b_command():
    readme = (ROOT / "README.md").read_text()
    assert "partc compile examples/gpt3_175b.py --gpus 512" in readme.split("## The model file")[0]
