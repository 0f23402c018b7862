"""What `partc compile` guarantees (issue #11, compile items 1, 2, 7 and 8), tried as a user or an attacker would:
the exit code, the one line on stderr, the files on disk before and after.

- Names from the model (module, parameter and buffer names: an ``nn.ModuleDict`` key read from a config file may
  hold anything but a dot; the model file's own name; its output class's keys) reach the generated program only as
  Python literals or sanitized comments: compiling, importing and running the program runs no injected code.
- ``-o DIR`` writes only into a new or empty directory or an earlier partc output, and never deletes or overwrites
  what partc did not write.
- Numbers are bounded and checked: GPU counts, batch sizes, plan and cluster fields.
- A model file that exits, prints or has no parameters gets one line and exit code 2.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from helpers import EXAMPLES, LAUNCH_TIMEOUT_S, run_in_session
from partc.cli.main import main as cli
from partc.errors import PartcError
from partc.model_file import load_model_file
from partc.runtime.program import read_program

GPT = str(EXAMPLES / "gpt.py")


def partc(*args: str):
    """`partc ARGS` in-process: (exit code, stdout, stderr)."""
    result = CliRunner().invoke(cli, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


def one_error(args, pattern: str) -> str:
    """`partc ARGS` must fail with exit code 2 and exactly one line ``error: ...`` matching `pattern`."""
    code, out, err = partc(*args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in out + err and out == ""
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under `root`: a file's SHA-256, or "dir"."""
    return {p.relative_to(root).as_posix(): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


# ---------------------------------------------------------------------------------------------------------------
# 1. Names reach the generated program as literals

PAYLOAD = 'open("PWNED", "w")'
"""What an injected name would run: it creates ./PWNED (no dots: a module name cannot hold one)."""

HOSTILE = textwrap.dedent('''
    from collections import OrderedDict

    import torch
    import torch.utils._pytree as pytree
    from torch import nn

    PAYLOAD = 'open("PWNED", "w")'
    # nn.ModuleDict keys, as a config file might give them: anything but a dot.
    KEYS = ["nl\\n" + PAYLOAD + "\\n#", "quote'] + " + PAYLOAD + " + p['", 'triple"""\\n' + PAYLOAD + '\\n"""',
            "backslash\\\\", "hash#" + PAYLOAD, "cr\\r" + PAYLOAD, "ls\\u2028" + PAYLOAD, "[/]markup", "[bold]b"]
    WEIGHT = "w\\n" + PAYLOAD + "\\n#"
    SCALE = "s'\\"\\"\\"" + PAYLOAD


    class Out(OrderedDict):
        """A ModelOutput-like result: keys from data."""


    pytree.register_pytree_node(Out, lambda o: (list(o.values()), list(o.keys())),
                                lambda values, keys: Out(zip(keys, values)))


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_parameter(WEIGHT, nn.Parameter(torch.ones(8)))
            self.register_buffer(SCALE, torch.full((8,), 0.5))

        def reset_parameters(self):
            nn.init.ones_(getattr(self, WEIGHT))

        def forward(self, x):
            return self.lin(x) * getattr(self, WEIGHT) + getattr(self, SCALE)


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({"embed": nn.Embedding(16, 8), **{k: Block() for k in KEYS},
                                         "head": nn.Linear(8, 16)})

        def forward(self, ids):
            x = ids
            for layer in self.layers.values():
                x = layer(x)
            return Out([("logits\\n" + PAYLOAD, x), ('quote"' + PAYLOAD, x.sum(-1))])


    def model():
        return Model()


    def example_inputs(batch_size):
        return (torch.randint(0, 16, (batch_size, 4)),)


    def example_targets(batch_size):
        return torch.randint(0, 16, (batch_size, 4))


    def loss_fn(outputs, targets):
        logits = outputs["logits\\n" + PAYLOAD]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
''')

HOSTILE_FILE = 'model\n"""\n' + PAYLOAD + '\n"""#.py'
"""A model file name that would end the stage files' docstring and run the payload."""


def write_hostile(directory: Path, name: str = "hostile.py") -> Path:
    path = directory / name
    path.write_text(HOSTILE)
    return path


def compile_hostile(tmp_path: Path, name: str) -> Path:
    """Compile the hostile model (two pipeline stages) through the CLI, in `tmp_path` as the working directory."""
    path = write_hostile(tmp_path, name)
    code, out, err = partc("compile", str(path), "--gpus", "2", "--pp", "2", "--dp", "1", "--tp", "1",
                           "--micro-batch-size", "1", "--global-batch-size", "2", "--precision", "fp32",
                           "-o", str(tmp_path / "out"))  # fp32: `check_program` runs the stages on the fp32 model's tensors
    assert code == 0, (out, err)
    assert not (tmp_path / "PWNED").exists()
    return tmp_path / "out"


def check_program(out: Path, model_path: Path) -> None:
    """Import the program as the runtime does, then run its stages one after another: the result is the model's."""
    prog = read_program(out)  # imports every stage file
    assert not (out.parent / "PWNED").exists()
    spec = load_model_file(str(model_path))
    assert not (out.parent / "PWNED").exists()
    torch.manual_seed(0)
    model = spec.build()
    (ids,), _ = spec.inputs(1)
    want = model(ids)
    p = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    x = (ids,)
    for stage in prog.stages:
        x = stage.code.forward(p, *x, device=torch.device("cpu"))
    got = prog.stages[-1].code.outputs(x)
    assert type(got) is type(want) and list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key])
    assert not (out.parent / "PWNED").exists()


def test_hostile_names_are_literals_in_the_program(tmp_path, monkeypatch):
    """ModuleDict keys, parameter and buffer names and output keys with newlines, quotes, triple quotes,
    backslashes, ``#``, rich markup: the program runs no injected code and computes the model."""
    monkeypatch.chdir(tmp_path)
    out = compile_hostile(tmp_path, "hostile.py")
    text = (out / "program" / "stage_1.py").read_text()
    assert "PWNED" in text  # the names are there, as literals
    plan = json.loads((out / "plan.json").read_text())
    assert any("[/]markup" in m for s in plan["stages"] for m in s["modules"])
    check_program(out, tmp_path / "hostile.py")


def test_hostile_model_file_name(tmp_path, monkeypatch):
    """A model file whose name holds a newline and ``\"\"\"`` (it would end the docstring of every stage file)."""
    monkeypatch.chdir(tmp_path)
    out = compile_hostile(tmp_path, HOSTILE_FILE)
    first = (out / "program" / "stage_0.py").read_text().splitlines()[0]
    assert re.match(r'"""partc program: stage 0 of \d+ ', first) and 'model \\"\\"\\" open' in first
    check_program(out, tmp_path / HOSTILE_FILE)


@pytest.mark.slow
def test_hostile_program_trains_under_partc_run(tmp_path):
    """`partc run` (two gloo ranks) of the hostile model in the hostile file: it trains, and nothing injected
    runs in either worker."""
    out = compile_hostile(tmp_path, HOSTILE_FILE)
    log = tmp_path / "log.jsonl"
    proc = run_in_session("partc run", [sys.executable, "-m", "partc.cli.main", "run", str(out), "--steps", "2",
                                        "--log-jsonl", str(log)], env=None, timeout=LAUNCH_TIMEOUT_S,
                          stderr_apart=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)
    assert not (tmp_path / "PWNED").exists()


def test_output_class_not_importable_by_its_name_is_refused(tmp_path, monkeypatch):
    """An output class whose name is not where it lives cannot be rebuilt by the program: one line, no output."""
    monkeypatch.chdir(tmp_path)
    path = write_hostile(tmp_path)
    path.write_text(HOSTILE.replace("\npytree.", "\nOut.__name__ = Out.__qualname__ = 'Out\\n' + PAYLOAD\npytree."))
    one_error(["compile", str(path), "--gpus", "1", "-o", str(tmp_path / "out")],
              r"cannot rebuild the model's output type 'Out\\nopen")
    assert not (tmp_path / "out").exists() and not (tmp_path / "PWNED").exists()


def test_runtime_takes_stage_files_only_from_program(tmp_path, monkeypatch):
    """A manifest naming a stage file outside program/ (path traversal) is refused before anything is imported."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert partc("compile", GPT, "--gpus", "1", "-o", str(out))[0] == 0
    (tmp_path / "evil.py").write_text(PAYLOAD + "\n")
    manifest = json.loads((out / "program" / "manifest.json").read_text())
    for bad in ("../../evil.py", str(tmp_path / "evil.py"), "stage_1.py"):
        manifest["stages"][0]["file"] = bad
        (out / "program" / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(PartcError, match=r"stage 0's file must be 'stage_0\.py'"):
            read_program(out)
    assert not (tmp_path / "PWNED").exists()


# ---------------------------------------------------------------------------------------------------------------
# 2. -o DIR: only a new or empty directory, or partc's own earlier output

TINY = textwrap.dedent('''
    import torch
    from torch import nn


    def model():
        return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))


    def example_inputs(batch_size):
        return (torch.randint(0, 16, (batch_size, 4)),)
''')


@pytest.fixture()
def tiny(tmp_path) -> str:
    path = tmp_path / "tiny.py"
    path.write_text(TINY)
    return str(path)


def compile_into(model: str, out: Path, *extra: str) -> tuple[int, str, str]:
    return partc("compile", model, "--gpus", "1", "-o", str(out), *extra)


def test_out_naming_a_file_is_refused(tmp_path, tiny):
    (tmp_path / "file").write_text("mine\n")
    before = snapshot(tmp_path)
    one_error(["compile", tiny, "--gpus", "1", "-o", str(tmp_path / "file")], r"-o .*file is a file; pass a directory")
    one_error(["compile", tiny, "--gpus", "1", "-o", str(tmp_path / "file" / "sub")],
              r"-o .*file/sub: .*file is a file, not a directory")
    assert snapshot(tmp_path) == before


def test_out_of_someone_else_is_refused(tmp_path, tiny):
    """A directory with files partc did not write (their own plan.json, a program/ folder) is never written."""
    out = tmp_path / "out"
    (out / "program").mkdir(parents=True)
    (out / "plan.json").write_text('{"mine": true}\n')
    (out / "program" / "notes.txt").write_text("my notes\n")
    before = snapshot(out)
    one_error(["compile", tiny, "--gpus", "1", "-o", str(out)], r"is not empty and is not an output of partc compile")
    one_error(["compile", tiny, "--gpus", "1", "-o", str(out), "--force"], r"is not an output of partc compile")
    assert snapshot(out) == before


def test_earlier_output_is_replaced_and_nothing_else(tmp_path, tiny):
    """An earlier output is replaced (plan.json, program/, the record); a file of the user's beside them stays."""
    out = tmp_path / "out"
    assert compile_into(tiny, out)[0] == 0
    record = json.loads((out / "partc-output.json").read_text())
    assert record["written_by"] == "partc compile"
    assert set(record["files"]) == {"plan.json", "report.html", "program/manifest.json", "program/stage_0.py"}
    (out / "notes.txt").write_text("my notes\n")
    read_program(out)  # importing the stage files may leave program/__pycache__: it is partc's, in effect
    code, stdout, err = compile_into(tiny, out, "--global-batch-size", "2")
    assert code == 0, err
    assert (out / "notes.txt").read_text() == "my notes\n"
    assert json.loads((out / "plan.json").read_text())["parallel"]["global_batch_size"] == 2
    assert sorted(p.name for p in (out / "program").iterdir()) == ["manifest.json", "stage_0.py"]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "partc-output.json", "plan.json", "program",
                                                    "report.html"]


def test_a_file_of_the_user_in_program_is_refused_even_with_force(tmp_path, tiny):
    out = tmp_path / "out"
    assert compile_into(tiny, out)[0] == 0
    (out / "program" / "notes.txt").write_text("my notes\n")
    before = snapshot(out)
    for extra in ((), ("--force",)):
        one_error(["compile", tiny, "--gpus", "1", "-o", str(out), *extra],
                  r"program/notes\.txt was not written by partc, which would replace it: move it out")
    assert snapshot(out) == before


def test_a_plan_edited_by_hand_is_replaced_only_with_force_or_as_the_input(tmp_path, tiny):
    out = tmp_path / "out"
    assert compile_into(tiny, out)[0] == 0
    plan = json.loads((out / "plan.json").read_text())
    plan["parallel"].update(global_batch_size=2, micro_batch_size=1, num_microbatches=2)
    (out / "plan.json").write_text(json.dumps(plan))
    before = snapshot(out)
    one_error(["compile", tiny, "--gpus", "1", "-o", str(out)],
              r"plan\.json was changed since partc wrote it; pass --force to replace it")
    assert snapshot(out) == before
    # The edited plan as --from-plan: it comes back with its choices, predicted again.
    code, _, err = compile_into(tiny, out, "--from-plan", str(out / "plan.json"))
    assert code == 0, err
    assert json.loads((out / "plan.json").read_text())["parallel"]["global_batch_size"] == 2
    # Edited again, then replaced with --force.
    (out / "plan.json").write_text(json.dumps(plan) + " ")
    code, _, err = compile_into(tiny, out, "--force")
    assert code == 0, err
    assert json.loads((out / "plan.json").read_text())["parallel"]["global_batch_size"] != 2


def test_a_crash_while_writing_leaves_an_output_partc_can_replace(tmp_path, tiny, monkeypatch):
    """A crash between plan.json and program/ leaves files the record knows: the next compile replaces them."""
    from partc import output
    from partc.compile import compile_model

    out = tmp_path / "out"
    compile_model(tiny, gpus=1, out_dir=out)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(output, "_write_program", crash)
    with pytest.raises(KeyboardInterrupt):
        compile_model(tiny, gpus=1, global_batch_size=2, out_dir=out)
    monkeypatch.undo()
    assert json.loads((out / "plan.json").read_text())["parallel"]["global_batch_size"] == 2  # new plan, old program
    code, _, err = compile_into(tiny, out)
    assert code == 0, err


# ---------------------------------------------------------------------------------------------------------------
# 7. Numbers: bounded, finite, in range

@pytest.mark.parametrize("args, pattern", [
    (["--gpus", str(10**9)], r"--gpus 1,000,000,000 is more than partc plans for \(1,048,576"),
    (["--gpus", str(10**30)], r"--gpus 1,000,000,000,000,000,000,000,000,000,000 is more than partc plans for"),
    (["--gpus", "8", "--global-batch-size", str(10**30)], r"--global-batch-size must be between 1 and 16,777,216"),
])
def test_absurd_counts_are_refused_at_once(tmp_path, args, pattern):
    """A process with a deadline (forked by `run_in_session`): these used to list divisors for minutes."""
    proc = run_in_session("partc compile", [sys.executable, "-m", "partc.cli.main", "compile", GPT, *args, "-o",
                                            str(tmp_path / "o")], env=None, timeout=60, stderr_apart=True)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and re.search(pattern, lines[0]), proc.stderr
    assert not (tmp_path / "o").exists()


def test_divisors_take_square_root_time():
    from partc.passes.search_space import divisors

    for n in range(1, 2000):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    assert divisors(2**24) == [2**k for k in range(25)]
    assert divisors(2**31 - 1) == [1, 2**31 - 1]  # a prime: 2.1e9 steps to list every candidate, 46,341 here


@pytest.mark.parametrize("pin, pattern", [
    (["--dp", str(10**30)], r"pins\.dp must be <= 1,048,576"),
    (["--micro-batch-size", str(2**30)], r"pins\.micro_batch_size must be <= 16,777,216"),
    (["--gpus-per-node", str(10**12)], r"--gpus-per-node must be between 1 and 1,048,576"),
])
def test_absurd_pins_are_refused(tmp_path, pin, pattern):
    one_error(["compile", GPT, "--gpus", "8", *pin, "-o", str(tmp_path / "o")], pattern)


@pytest.mark.parametrize("field, value, pattern", [
    ("peak_flops", "0", r"peak_flops must be a finite number >= 1e\+12"),
    ("peak_flops", "-1", r"peak_flops must be a finite number >= 1e\+12"),
    ("peak_flops", "NaN", r"peak_flops must be .*got nan"),
    ("peak_flops", "Infinity", r"peak_flops must be .*got inf"),
    ("peak_flops", "312", r"1 TFLOP/s: it is in FLOP/s\), got 312"),  # TFLOP/s for FLOP/s
    ("memory_bytes", "1" + "0" * 400, r"memory_bytes must be a finite number"),
    ("inter_node_bandwidth", "25", r"inter_node_bandwidth must be .*bytes/s"),
    ("intra_node_latency", "1e300", r"intra_node_latency must be a number from 0 to 1"),
    ("gemm_efficiency", "0", r"gemm_efficiency must be a number from 0.01 to 1"),
    ("dp_overlap", "5", r"dp_overlap must be a number from 0 to 1"),  # made the step time negative
    ("gpus_per_node", "0", r"gpus_per_node must be an integer from 1"),
    ("num_sms", "1.5", r"num_sms must be an integer from 1"),
    ("memory_reserve_bytes", "-1", r"memory_reserve_bytes must be a finite number >= 0"),
])
def test_cluster_file_numbers(tmp_path, field, value, pattern):
    cluster = tmp_path / "cluster.json"
    cluster.write_text(f'{{"{field}": {value}}}')
    one_error(["compile", GPT, "--gpus", "16", "--dp", "2", "--cluster", str(cluster), "-o", str(tmp_path / "o")],
              pattern)
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("plan") / "out"
    assert partc("compile", GPT, "--gpus", "2", "--pp", "2", "-o", str(out))[0] == 0
    return json.loads((out / "plan.json").read_text())


@pytest.mark.parametrize("field, value, pattern", [
    ("global_batch_size", str(10**30), r"global_batch_size must be <= 16,777,216"),  # OOM-killed rank 0
    ("micro_batch_size", "NaN", r"NaN is not a JSON number"),
    ("dp", "Infinity", r"Infinity is not a JSON number"),
    ("dp", "0", r"parallel\.dp must be >= 1"),
    ("tp", "-2", r"parallel\.tp must be >= 1"),
    ("pp", "1.5", r"parallel\.pp must be an integer"),
    ("virtual_stages", str(10**20), r"virtual_stages must be <= 1,048,576"),
])
def test_plan_numbers(tmp_path, gpt_plan, field, value, pattern):
    """--from-plan and `partc run` read plan.json alike: every number in range, strict JSON."""
    text = json.dumps({**gpt_plan, "parallel": {**gpt_plan["parallel"], field: "@"}}).replace('"@"', value)
    (tmp_path / "plan.json").write_text(text)
    one_error(["compile", GPT, "--gpus", "2", "--from-plan", str(tmp_path / "plan.json"), "-o", str(tmp_path / "o")],
              pattern)
    one_error(["run", str(tmp_path), "--steps", "1"], pattern)


def test_written_plans_are_strict_json(tmp_path, gpt_plan):
    """The plan file and --format json parse as strict JSON (no NaN or Infinity), with a positive step time."""
    def strict(text):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the plan"))

    code, stdout, _ = partc("compile", GPT, "--gpus", "2", "--pp", "2", "-o", str(tmp_path / "o"), "--format", "json")
    assert code == 0
    for plan in (strict(stdout), strict((tmp_path / "o" / "plan.json").read_text()), gpt_plan):
        assert 0 < plan["predicted"]["step_time_s"] < 1e6


# ---------------------------------------------------------------------------------------------------------------
# 8. The model file's exits, prints and emptiness: one line, exit code 2 (or, for prints, output left intact)

TWO_LINEARS = textwrap.dedent('''
    import sys

    import torch
    from torch import nn


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            {forward}
            return self.b(self.a(x))


    def model():
        {model}
        return Model()


    def example_inputs(batch_size):
        {inputs}
        return (torch.randn(batch_size, 4),)


    def example_targets(batch_size):
        return torch.randn(batch_size, 4)


    def loss_fn(outputs, targets):
        return ((outputs - targets) ** 2).mean()
''')


def two_linears(tmp_path: Path, *, top: str = "", forward: str = "pass", model: str = "pass",
                inputs: str = "pass") -> str:
    path = tmp_path / "m.py"
    path.write_text(TWO_LINEARS.format(forward=forward, model=model, inputs=inputs) + top)
    return str(path)


@pytest.mark.parametrize("where, pattern", [
    ("top", r"m\.py:\d+: the model file called sys\.exit\(0\) while partc imported it"),
    ("model", r"m\.py:\d+: model\(\) raised SystemExit: 0"),
    ("inputs", r"m\.py:\d+: example_inputs\(1\) raised SystemExit: 0"),
    ("forward", r"the model's code called sys\.exit\(0\) during partc compile"),
])
def test_model_file_calling_sys_exit(tmp_path, monkeypatch, where, pattern):
    """sys.exit(0) in the file used to end `partc compile` with exit code 0, no plan and no word."""
    monkeypatch.chdir(tmp_path)
    path = two_linears(tmp_path, **{where: "\nsys.exit(0)\n" if where == "top" else "sys.exit(0)"})
    one_error(["compile", path, "--gpus", "1", "-o", str(tmp_path / "out")], pattern)
    assert not (tmp_path / "out").exists()


def test_model_prints_do_not_corrupt_json(tmp_path):
    """Whatever the model prints (at import, in model(), example_inputs, its forward) goes to stderr."""
    path = two_linears(tmp_path, top="\nprint('imported')\n", forward="print('forward')", model="print('model')",
                       inputs="print('inputs')")
    code, stdout, stderr = partc("compile", path, "--gpus", "1", "-o", str(tmp_path / "out"), "--format", "json")
    assert code == 0, stderr
    assert json.loads(stdout) == json.loads((tmp_path / "out" / "plan.json").read_text())
    assert {"imported", "model", "inputs", "forward"} <= set(stderr.split())


def test_model_without_parameters(tmp_path, monkeypatch):
    """It used to get 'no parallel configuration ... matches the pins', with no pins given."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "m.py"
    path.write_text(TWO_LINEARS.format(forward="pass", model="pass", inputs="pass").replace(
        "self.a = nn.Linear(4, 4)\n        self.b = nn.Linear(4, 4)", "self.a = self.b = nn.ReLU()"))
    for gpus in ("1", "2"):
        one_error(["compile", str(path), "--gpus", gpus, "-o", str(tmp_path / "out")],
                  r"m\.py: model\(\) returned a model without parameters \(Model\); partc plans the training of a "
                  r"model with parameters")
