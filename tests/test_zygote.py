"""The tests' fork server (zygote.py), which `helpers.run_jobs` launches its ranks from instead of torchrun: the ranks
see torchrun's environment and store, each starts fresh (no process group, one thread), and a launch stops all its
ranks when one fails or the time is up, as torchrun does."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time

import pytest

from helpers import ZYGOTE, launch, run_in_session

pytestmark = [pytest.mark.slow,  # forks gloo ranks
              pytest.mark.skipif(os.environ.get("PARTC_TEST_LAUNCHER") == "torchrun", reason="no fork server")]

WORKER = """
    import json, os, sys, threading, time
    import torch, torch.distributed as dist

    fresh = {"initialized": dist.is_initialized(), "threads": len(os.listdir("/proc/self/task")),
             "python_threads": threading.active_count(), "pid": os.getpid()}
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.full((2,), float(rank + 1))
    dist.all_reduce(x)
    store_key = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    store_key.set(f"seen/{rank}", "1")
    with open(sys.argv[1] + f".{rank}", "w") as f:
        json.dump({**fresh, "sum": x.tolist(), "argv": sys.argv[1:], "env": {k: os.environ[k] for k in (
            "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE")},
            "marker": os.environ.get("ZYGOTE_TEST")}, f)
    fail = os.environ.get("FAIL_RANK")
    if fail is not None:
        if rank == int(fail):
            print(f"rank {rank} fails", flush=True)
            raise SystemExit(3)
        time.sleep(600)  # the others hang: the launch must stop them
    dist.destroy_process_group()
"""


def test_launch_is_torchrun_without_a_launcher(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(WORKER))
    out = tmp_path / "out"

    res = launch(3, [str(worker), str(out)], env={"ZYGOTE_TEST": "yes"})
    assert res.returncode == 0, res.stdout
    got = [json.loads(out.with_name(f"out.{r}").read_text()) for r in range(3)]
    for r, g in enumerate(got):
        assert g["env"] == {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3",
                            "TORCHELASTIC_USE_AGENT_STORE": "True"}
        assert g["sum"] == [6.0, 6.0] and g["argv"] == [str(out)] and g["marker"] == "yes"
        assert not g["initialized"] and g["threads"] == 1 and g["python_threads"] == 1, g  # a fresh process
    assert len({g["pid"] for g in got}) == 3 and ZYGOTE.proc.pid not in {g["pid"] for g in got}

    again = launch(3, [str(worker), str(out)])  # new processes, no state of the launch before
    pids = {json.loads(out.with_name(f"out.{r}").read_text())["pid"] for r in range(3)}
    assert again.returncode == 0 and not pids & {g["pid"] for g in got}

    t0 = time.monotonic()
    failed = launch(3, [str(worker), str(out)], env={"FAIL_RANK": "1"}, check=False)
    assert failed.returncode == 3 and "rank 1 fails" in failed.stdout
    assert time.monotonic() - t0 < 60, "the ranks left hanging were not stopped"

    reply = ZYGOTE.launch(2, [str(worker), str(out)], env={"FAIL_RANK": "5"}, timeout=5)  # every rank hangs
    assert reply["timed_out"] and reply["returncode"] != 0 and set(reply["exits"].values()) == {-9}


def test_python_dash_m_in_a_session_is_forked_as_a_fresh_process(tmp_path, monkeypatch):
    """`helpers.run_in_session` forks ``python -m MODULE`` from the server: stdout and stderr apart or joined in
    order, the exit code, the environment asked for and none of torchrun's, the current directory's modules."""
    (tmp_path / "probe_mod.py").write_text(textwrap.dedent("""
        import os, sys
        print("out", os.environ.get("PROBE"), "RANK" in os.environ, "MASTER_PORT" in os.environ, flush=True)
        print("err", sys.argv[1:], file=sys.stderr, flush=True)
        print("out again", flush=True)
        raise SystemExit(4)
    """))
    monkeypatch.chdir(tmp_path)
    apart = run_in_session("probe", [sys.executable, "-m", "probe_mod", "a"], env={"PROBE": "x"}, timeout=60,
                           stderr_apart=True)
    assert (apart.returncode, apart.stdout, apart.stderr) == (4, "out x False False\nout again\n", "err ['a']\n")
    joined = run_in_session("probe", [sys.executable, "-m", "probe_mod"], env=None, timeout=60)
    assert (joined.returncode, joined.stdout) == (4, "out None False False\nerr []\nout again\n")
