"""What `partc run` guarantees when something goes wrong (issue #11, runtime items 3-6 and 8; issue #14 item 10),
tried as a user would: the exit code, the one line on stderr, the files on disk before and after.

Fast tests check the options and the checkpoint directory before any process starts, the checkpoint files (in
one process, on a one-rank plan) and the failure summary. The `slow` ones start `partc run` on one or two gloo
ranks: runs that share a checkpoint directory, a crafted checkpoint, nan, signals, a stalled rank and an error
on rank 1.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from partc.cli.main import main as cli
from partc.environ import environ
from partc.errors import PartcError
from partc.plan import read_plan
from partc.runtime import checkpoint_dir
from partc.runtime.checkpoint_dir import RunRecord
from partc.runtime.launch import failure_lines

from helpers import EXAMPLES, LAUNCH_TIMEOUT_S as RUN_TIMEOUT_S, compile_program, run_in_session

GPT = EXAMPLES / "gpt.py"


PINS = dict(tp=1, dp=1, zero=0, schedule="1f1b", recompute="none")


@pytest.fixture(scope="module")
def programs(compiled):
    """GPT (tiny) on one rank and on two pipeline ranks."""
    return SimpleNamespace(one=compiled(GPT, pp=1, micro_batch_size=2, global_batch_size=4, **PINS),
                           two=compiled(GPT, pp=2, micro_batch_size=1, global_batch_size=4, **PINS))


def partc_run(out: Path, *args: str, env: dict | None = None, timeout: float = RUN_TIMEOUT_S):
    """`partc run OUT ARGS` in a subprocess (its own session: a hang is killed whole); stdout and stderr apart."""
    return run_in_session("partc run", [sys.executable, "-m", "partc.cli.main", "run", str(out), *args], env=env,
                          timeout=timeout, stderr_apart=True)


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under `root`: a file's SHA-256, or "dir"."""
    return {p.relative_to(root).as_posix(): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def workers(marker: Path) -> list[int]:
    """Pids of live `python -m partc.runtime` processes whose command line names `marker` (Linux)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "-m partc.runtime" in cmd and str(marker) in cmd:
                pids.append(int(p.name))
    return pids


def strict_json(line: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(line, parse_constant=refuse)


# -- options: one line, exit 2, before any process starts ----------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--steps", "-1"], "error: --steps must be >= 0, got -1"),
    (["--lr", "nan"], "error: --lr must be a finite number >= 0, got nan"),
    (["--lr", "inf"], "error: --lr must be a finite number >= 0, got inf"),
    (["--weight-decay", "-0.1"], "error: --weight-decay must be a finite number >= 0, got -0.1"),
    (["--resume"], "error: --resume needs --checkpoint-dir (the directory of the run to continue)"),
    (["--init-checkpoint", "no-such-file.pt"],
     "error: --init-checkpoint no-such-file.pt does not exist; pass a torch.save(model.state_dict()) or "
     "safetensors file"),
    (["--collective-timeout", "0"], "error: --collective-timeout must be a positive number of seconds, got 0.0"),
    (["--log-jsonl", "no-such-dir/log.jsonl"], "error: --log-jsonl no-such-dir/log.jsonl: directory"),
    (["--steps", "x"], "error: argument --steps: invalid int value: 'x' (see python -m partc.runtime --help)"),
])
def test_partc_run_refuses_bad_options_before_starting(programs, monkeypatch, args, message):
    from torch.distributed import run as torchrun

    monkeypatch.setattr(torchrun, "run", lambda *a: pytest.fail("partc run started torchrun"))
    res = CliRunner().invoke(cli, ["run", str(programs.two), *args])
    assert res.exit_code == 2
    assert len(res.output.strip().splitlines()) == 1 and res.output.startswith(message), res.output


# -- one checkpoint directory, one run ----------------------------------------------------------------------------


def _run_dir(path: Path, plan_dir: Path, **fields) -> Path:
    """A checkpoint directory as `partc run` leaves it: its run record and one step folder."""
    record = RunRecord.of(read_plan(plan_dir / "plan.json"), seed=0, optimizer="adamw")
    path.mkdir()
    data = {**dataclasses.asdict(record), **fields}
    (path / checkpoint_dir.RUN_FILE).write_text(json.dumps(data))
    (path / "step-00000002").mkdir()
    (path / "step-00000002" / checkpoint_dir.MANIFEST).write_text("{}")
    return path


@pytest.mark.parametrize("args, message", [
    ([], "error: --checkpoint-dir {d} is not empty (newest checkpoint step-00000002): add --resume to continue "
         "its run, or pass a new directory"),
    (["--resume", "--seed", "1"], "error: --checkpoint-dir {d} belongs to another run: seed 0 there, 1 here"),
    (["--resume", "--optimizer", "sgd"],
     "error: --checkpoint-dir {d} belongs to another run: optimizer 'adamw' there, 'sgd' here"),
])
def test_checkpoint_dir_of_another_run_is_refused(programs, tmp_path, args, message):
    d = _run_dir(tmp_path / "ck", programs.two)
    before = snapshot(d)
    res = CliRunner().invoke(cli, ["run", str(programs.two), "--checkpoint-dir", str(d), *args])
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [message.format(d=d)]
    assert snapshot(d) == before


def test_checkpoint_dir_of_another_model_or_batch_is_refused(programs, tmp_path):
    d = _run_dir(tmp_path / "ck", programs.two, model="llama", global_batch_size=8)
    res = CliRunner().invoke(cli, ["run", str(programs.two), "--checkpoint-dir", str(d), "--resume"])
    assert res.exit_code == 2
    assert res.output.strip() == (f"error: --checkpoint-dir {d} belongs to another run: model 'llama' there, 'gpt' "
                                  f"here; global batch size 8 there, 4 here")


def test_checkpoint_dir_not_written_by_partc_is_not_resumed(programs, tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    res = CliRunner().invoke(cli, ["run", str(programs.two), "--checkpoint-dir", str(d), "--resume"])
    assert res.exit_code == 2
    assert res.output.strip() == (f"error: --checkpoint-dir {d} has no partc-run.json (1 entries, e.g. "
                                  f"'notes.txt'): not a directory of `partc run`, not resuming from it")
    assert (d / "notes.txt").read_text() == "mine" and sorted(os.listdir(d)) == ["notes.txt"]


def test_checkpoint_dir_in_use_by_another_run_is_refused(programs, tmp_path):
    """Rank 0 of a run holds an flock on DIR/partc-run.lock; another run (here: a process holding it) is refused."""
    d = tmp_path / "ck"
    d.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                               "os.write(fd, b'pid 4242 on elsewhere')\n"
                               "print('locked', flush=True)\n"
                               "time.sleep(60)\n", str(d / checkpoint_dir.LOCK_FILE)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        record = RunRecord.of(read_plan(programs.two / "plan.json"), seed=0, optimizer="adamw")
        with pytest.raises(PartcError, match=rf"--checkpoint-dir {d} is in use by another partc run \(pid 4242 on "
                                             rf"elsewhere\)"):
            checkpoint_dir.claim(d, record, resume=False)
        assert sorted(os.listdir(d)) == [checkpoint_dir.LOCK_FILE]
    finally:
        holder.kill()
        holder.wait()


def test_latest_skips_stray_names_and_finds_a_replaced_step(tmp_path):
    def step(name: str, manifest: bool = True) -> Path:
        (tmp_path / name).mkdir()
        if manifest:
            (tmp_path / name / "partc.json").write_text("{}")
        return tmp_path / name

    step("step-00000044")
    step("step-00000045.bak")
    step("step-00000047", manifest=False)  # not complete
    step(".tmp-step-00000048")
    (tmp_path / "step-00000046").write_text("a file")
    assert checkpoint_dir.latest(tmp_path) == tmp_path / "step-00000044"
    # A crash between the two renames of a replacement: .old-step-K is the complete copy.
    step(".old-step-00000050")
    assert checkpoint_dir.latest(tmp_path) == tmp_path / ".old-step-00000050"
    step("step-00000050")
    assert checkpoint_dir.latest(tmp_path) == tmp_path / "step-00000050"


def test_replacing_a_step_folder_leaves_no_gap(tmp_path, monkeypatch):
    """commit_step renames the old folder aside, the new one in, then deletes the old one; a crash between the
    renames leaves the old one where `latest` reads it."""
    def write(step: int, text: str) -> Path:
        tmp = checkpoint_dir.begin_step(tmp_path, step)
        (tmp / ".metadata").write_text(text)
        return tmp

    checkpoint_dir.commit_step(write(3, "first"), 3, {})
    checkpoint_dir.commit_step(write(3, "second"), 3, {})
    assert (tmp_path / "step-00000003" / ".metadata").read_text() == "second"
    assert sorted(os.listdir(tmp_path)) == ["step-00000003"]

    tmp = write(3, "third")
    real_rename = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: real_rename(a, b) if Path(b).name.startswith(".old-")
                        else (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(OSError, match="crash"):
        checkpoint_dir.commit_step(tmp, 3, {})
    newest = checkpoint_dir.latest(tmp_path)
    assert newest.name == ".old-step-00000003" and (newest / ".metadata").read_text() == "second"
    monkeypatch.setattr(os, "rename", real_rename)
    checkpoint_dir.commit_step(write(3, "fourth"), 3, {})
    assert sorted(os.listdir(tmp_path)) == ["step-00000003"]
    assert (checkpoint_dir.latest(tmp_path) / ".metadata").read_text() == "fourth"
    # a step-K that partc did not write is not replaced
    (tmp_path / "step-00000004").write_text("mine")
    with pytest.raises(PartcError, match=r"step-00000004 exists and is not a partc checkpoint: not replacing it"):
        checkpoint_dir.begin_step(tmp_path, 4)
    assert (tmp_path / "step-00000004").read_text() == "mine"


# -- checkpoint files: verified before anything is unpickled (one process, one rank) ------------------------------


@contextmanager
def one_rank(tmp_path: Path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Mkdir:
    """Unpickling this creates a directory: what a crafted pickle could do."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _rehash(step: Path, name: str) -> None:
    manifest = json.loads((step / "partc.json").read_text())
    manifest["files"][name] = checkpoint_dir.hash_file(step / name)
    (step / "partc.json").write_text(json.dumps(manifest))


def test_checkpoint_is_verified_before_it_is_unpickled(programs, tmp_path):
    import partc.runtime

    torch.set_num_threads(1)
    marker = tmp_path / "code-ran"
    with one_rank(tmp_path):
        prog = partc.runtime.load(programs.one, optimizer="adamw", lr=1e-3)
        prog.step(*prog.batch(0))
        good = prog.save(tmp_path / "ck", step=1)
        manifest = json.loads((good / "partc.json").read_text())
        assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp"]
        assert prog.load(good) == 1

        cases = {}
        for name in ("altered", "crafted", "old", "value"):
            cases[name] = tmp_path / name / good.name
            shutil.copytree(good, cases[name])
        with open(cases["altered"] / ".metadata", "ab") as f:
            f.write(b"\0")
        (cases["crafted"] / ".metadata").write_bytes(pickle.dumps(_Mkdir(marker)))
        _rehash(cases["crafted"], ".metadata")  # an attacker writes the manifest too
        old = json.loads((cases["old"] / "partc.json").read_text())
        del old["files"]
        (cases["old"] / "partc.json").write_text(json.dumps(old))

        with pytest.raises(PartcError, match=r"altered/step-00000001/.metadata does not match the checkpoint's "
                                             r"manifest \(\d+ bytes, the manifest says \d+\)"):
            prog.load(cases["altered"])
        with pytest.raises(PartcError, match=r"\.metadata is not a checkpoint partc reads: it names posix\.mkdir, "
                                             r"which is not part of DCP's metadata"):
            prog.load(cases["crafted"])
        with pytest.raises(PartcError, match=r"lists no content hashes .* partc does not load it"):
            prog.load(cases["old"])
        assert prog.load(good) == 1
    assert not marker.exists()


def test_checkpoint_values_load_as_plain_data(tmp_path):
    marker = tmp_path / "code-ran"
    evil, plain = io.BytesIO(), io.BytesIO()
    torch.save(_Mkdir(marker), evil)
    torch.save(0.5, plain)
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optim.param_groups.w.lr"))
    planner = checkpoint_dir.SafePlanner()
    evil.seek(0)
    with pytest.raises(PartcError, match=r"checkpoint value 'optim.param_groups.w.lr' is not plain data"):
        planner.load_bytes(item, evil)
    assert not marker.exists()
    planner.state_dict, planner.flatten_state_dict = {}, False
    plain.seek(0)
    planner.load_bytes(item, plain)
    assert planner.state_dict == {"optim.param_groups.w.lr": 0.5}


# -- nan and inf (one process, one rank) ---------------------------------------------------------------------------


def test_nonfinite_step_is_not_applied_and_not_saved(programs, tmp_path):
    import partc.runtime
    from partc.runtime.train import NonFiniteError

    torch.set_num_threads(1)
    with one_rank(tmp_path):
        prog = partc.runtime.load(programs.one, optimizer="adamw", lr=1e6)
        prog.step(*prog.batch(0))
        before = prog.full_state_dict()
        with pytest.raises(NonFiniteError, match=r"the loss is nan: the step was not applied"):
            prog.step(*prog.batch(1))
        after = prog.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        with torch.no_grad():
            prog.parameters()[0].fill_(float("inf"))
        with pytest.raises(NonFiniteError, match=r"the model or optimizer state holds nan or inf \(1 tensors\): "
                                                 r"not saving it"):
            prog.save(tmp_path / "ck", step=2)
        assert not (tmp_path / "ck" / "step-00000002").exists()


# -- the failure summary of partc run ----------------------------------------------------------------------------


def _failure(exitcode: int, message: str = "", kind: str | None = None, at: float = 0.0, stalled=()):
    data = {"message": message, "partc": {"kind": kind, "time": at, "stalled": list(stalled)}} if kind else {}
    return SimpleNamespace(exitcode=exitcode, message=message, error_file_data=data,
                           signal_name=lambda: signal.Signals(-exitcode).name if exitcode < 0 else "<N/A>")


def test_failure_lines():
    user = "--checkpoint-dir ck belongs to another run: seed 0 there, 1 here"
    # the same user error on two of four ranks (torchrun stopped the others): one line, exit 2
    assert failure_lines({0: _failure(2, user, "user"), 1: _failure(2, user, "user", 0.1), 2: _failure(-15)},
                         4) == ([f"error: {user}"], 2)
    # rank 1 fails, rank 0 fails after it (its peer is gone), rank 2 is stopped by torchrun: in order, exit 1
    lines, code = failure_lines({0: _failure(1, "RuntimeError: connection reset", "internal", 2.0),
                                 1: _failure(1, "RuntimeError: boom", "internal", 1.0), 2: _failure(-15)}, 3)
    assert lines == ["error: rank 1: RuntimeError: boom", "error: rank 0: RuntimeError: connection reset"]
    assert code == 1
    # a crash without a word, and a rank the OOM killer took
    assert failure_lines({1: _failure(1), 0: _failure(-15)}, 2)[0] == [
        "error: rank 1 exited with code 1 without an error message (see its output above)"]
    assert failure_lines({1: _failure(-9), 0: _failure(-15)}, 2) == (["error: rank 1 was killed by SIGKILL"], 1)
    # a stall report names the stalled rank; its SIGKILL is not another failure
    stall = "rank 1 stopped responding (...): stopping the job (--collective-timeout 5 s)"
    assert failure_lines({0: _failure(1, stall, "stall", stalled=[1]), 1: _failure(-9)}, 2) == ([f"error: {stall}"], 1)



def test_environ_puts_back_what_was_there(monkeypatch):
    """`partc run` sets the workers' environment with `partc.environ.environ`: afterwards, even after an error, a
    variable that was set has its value again and one that was not is gone."""
    monkeypatch.setenv("PARTC_TEST_SET", "before")
    monkeypatch.delenv("PARTC_TEST_UNSET", raising=False)
    with pytest.raises(RuntimeError):
        with environ({"PARTC_TEST_SET": "during", "PARTC_TEST_UNSET": "during"}):
            assert os.environ["PARTC_TEST_SET"] == os.environ["PARTC_TEST_UNSET"] == "during"
            raise RuntimeError("the job failed")
    assert os.environ["PARTC_TEST_SET"] == "before" and "PARTC_TEST_UNSET" not in os.environ

# -- partc run, end to end ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_checkpoint_dir_belongs_to_one_run(programs, tmp_path):
    """A run; the same command again is refused (nothing changes on disk); stray names do not stop --resume;
    a model with other tensors (same name) is refused by the workers, in one line."""
    ck = tmp_path / "ck"
    first = partc_run(programs.two, "--steps", "2", "--checkpoint-dir", str(ck), "--checkpoint-every", "1")
    assert first.returncode == 0, first.stderr
    assert sorted(os.listdir(ck)) == ["partc-run.json", "partc-run.lock", "step-00000001", "step-00000002"]
    record = json.loads((ck / "partc-run.json").read_text())
    assert (record["model"], record["seed"], record["global_batch_size"], record["optimizer"]) == \
        ("gpt", 0, 4, "adamw")
    assert record["tensors"][0] == ["tok.weight", [512, 64], "float32"]

    before = snapshot(ck)
    again = partc_run(programs.two, "--steps", "2", "--checkpoint-dir", str(ck))
    assert again.returncode == 2 and again.stderr.strip().startswith(f"error: --checkpoint-dir {ck} is not empty")
    assert len(again.stderr.strip().splitlines()) == 1 and snapshot(ck) == before

    shutil.copytree(ck / "step-00000002", ck / "step-00000045.bak")
    (ck / "step-00000046").write_text("not a checkpoint")
    resumed = partc_run(programs.two, "--steps", "3", "--checkpoint-dir", str(ck), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {ck / 'step-00000002'} (step 2)" in resumed.stdout and "step 3/3" in resumed.stdout
    assert sorted(os.listdir(ck)) == ["partc-run.json", "partc-run.lock", "step-00000001", "step-00000002",
                                      "step-00000003", "step-00000045.bak", "step-00000046"]

    narrow = tmp_path / "narrow" / "gpt.py"  # the same model name, other shapes
    narrow.parent.mkdir()
    narrow.write_text(GPT.read_text().replace("hidden: int = 64", "hidden: int = 32"))
    other = tmp_path / "other"
    compile_program(narrow, other, pp=2, micro_batch_size=1, global_batch_size=4, **PINS)
    before = snapshot(ck)
    refused = partc_run(other, "--steps", "4", "--checkpoint-dir", str(ck), "--resume")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"error: --checkpoint-dir {ck} belongs to another run: model tensor 'tok.weight' is [512, 64] float32 "
        f"there, [512, 32] float32 here"]
    assert snapshot(ck) == before


@pytest.fixture(scope="module")
def nan_run(programs, tmp_path_factory):
    """One rank at --lr 1e6 with a checkpoint every step: step 1 is saved, step 2's loss is nan. Its checkpoint
    directory, as `partc run` wrote it, also serves the crafted-checkpoint test (which so needs no run of its own to
    write one)."""
    tmp = tmp_path_factory.mktemp("nan")
    ck, log = tmp / "ck", tmp / "log.jsonl"
    res = partc_run(programs.one, "--steps", "6", "--lr", "1e6", "--checkpoint-dir", str(ck), "--checkpoint-every",
                    "1", "--log-jsonl", str(log))
    return SimpleNamespace(res=res, ck=ck, log=log)


@pytest.mark.slow
def test_crafted_checkpoint_runs_no_code(programs, nan_run, tmp_path):
    ck, marker = tmp_path / "ck", tmp_path / "code-ran"
    shutil.copytree(nan_run.ck, ck)  # a copy: the nan test reads the original
    step = ck / "step-00000001"
    assert sorted(p.name for p in ck.glob("step-*")) == [step.name]
    (step / ".metadata").write_bytes(pickle.dumps(_Mkdir(marker)))
    _rehash(step, ".metadata")
    res = partc_run(programs.one, "--steps", "2", "--checkpoint-dir", str(ck), "--resume")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"error: {step / '.metadata'} is not a checkpoint partc reads: it names posix.mkdir, which is not part of "
        f"DCP's metadata"]
    assert not marker.exists() and not (ck / "step-00000002").exists()


@pytest.mark.slow
def test_nan_stops_the_run_before_it_is_checkpointed(nan_run, tmp_path):
    res, ck, log = nan_run.res, nan_run.ck, nan_run.log
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: step 2: the loss is nan: the step was not applied; the run stops here, and no checkpoint holds nan "
        "or inf (a lower --lr than 1e+06 may help)"]
    assert [strict_json(line)["step"] for line in log.read_text().splitlines()] == [0]
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-00000001"]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(ck / "step-00000001", tmp_path / "step1.pt")
    state = torch.load(tmp_path / "step1.pt", weights_only=False)  # our own file
    flat = [v for part in state.values() for v in part.values()]
    assert flat and all(torch.isfinite(v).all() for v in flat if isinstance(v, torch.Tensor))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="looks for the workers in /proc")
def test_signals_stop_the_whole_job(programs, tmp_path):
    """SIGTERM to partc run stops every rank (exit 143, one line); SIGKILL to partc run kills the workers too (each
    worker dies with its launcher on its own (`runtime.supervise`): one worker shows it)."""
    def start(program: Path, log: Path) -> subprocess.Popen:
        out = open(log, "w")
        proc = subprocess.Popen([sys.executable, "-m", "partc.cli.main", "run", str(program), "--steps",
                                 "100000"], stdout=out, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        deadline = time.time() + RUN_TIMEOUT_S
        while "step 2/" not in log.read_text():
            if time.time() > deadline or proc.poll() is not None:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"partc run did not start training: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        assert len(workers(program)) == (2 if program == programs.two else 1)
        return proc

    def gone(program: Path, deadline_s: float) -> bool:
        end = time.time() + deadline_s
        while workers(program) and time.time() < end:
            time.sleep(0.2)
        return not workers(program)

    proc = start(programs.two, tmp_path / "term.log")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert stderr.strip().splitlines() == ["error: partc run got SIGTERM: stopped all 2 ranks"]
    assert gone(programs.two, 10)

    proc = start(programs.one, tmp_path / "kill.log")
    proc.kill()
    proc.communicate(timeout=60)
    assert gone(programs.one, 10), "workers outlived partc run"


@pytest.mark.slow
def test_stalled_rank_is_named_within_the_timeout(programs, tmp_path):
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "partc.cli.main", "run", str(programs.two), "--steps", "50",
                                 "--collective-timeout", "5"], stdout=out, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PARTC_FAULT_STOP": "1:1"},
                                start_new_session=True)
        deadline, stopped_at = time.time() + RUN_TIMEOUT_S, None
        while proc.poll() is None and time.time() < deadline:
            if stopped_at is None and "step 2/" in log.read_text():
                stopped_at = time.time()
            time.sleep(0.2)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("a stopped rank hung the job")
        stderr = proc.stderr.read()
    assert proc.returncode == 1
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 1 stopped responding (no heartbeat for "), stderr
    assert re.search(r"the last during step [12]; pid \d+ on ", lines[0]) and "(--collective-timeout 5 s)" in lines[0]
    assert stopped_at is not None and time.time() - stopped_at < 5 + 25
    assert not workers(programs.two)


@pytest.mark.slow
def test_error_on_rank_1_reaches_the_user(programs):
    res = partc_run(programs.two, "--steps", "3", env={"PARTC_FAULT_RAISE": "1:0"})
    assert res.returncode == 1
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert errors[0] == "error: rank 1: RuntimeError: injected fault (PARTC_FAULT_RAISE) after step 1"
    assert "ChildFailedError" not in res.stderr and "torch/distributed/run.py" not in res.stderr
