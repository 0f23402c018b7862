"""A fork server for the tests' launches of many ranks ("zygote"): one process per test process imports torch,
partc and its runtime once, and each launch forks the ranks from it instead of starting torchrun, which starts a
launcher and then a fresh interpreter per rank, each importing torch and partc again (about 3.6 CPU seconds a rank
before it does anything, on the CI's cores).

What a launch looks like to the ranks is torchrun's: each rank is a fresh process (forked, so no gloo thread and no
mesh cache of a job before it survives into the next), its environment is the test's with torchrun's variables
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*), and the store at MASTER_ADDR:MASTER_PORT
is served by another process, as torchrun's agent serves it (the ranks join it as clients; partc's heartbeat and
error lines use it). It runs ``python -m MODULE ARGS`` (or ``python SCRIPT ARGS``) through `runpy`, and leaves with
``os._exit``. As torchrun does, the launch stops every rank when one fails or the time is up; it returns the first
failure's exit code and every rank's output, in one stream.

Fork-safety: the server never runs a torch operation, never creates a process group and never starts a thread (it
checks that it has one thread before each fork), so the ranks start as a fresh interpreter would, with no
intra-op pool and no gloo state. Launches run one at a time. This is test machinery: the tests that exercise
torchrun itself and `partc run` still start the real ones (helpers.torchrun, run_in_session).

    python tests/zygote.py      # serves requests: one JSON line in on stdin, one JSON line out on stdout
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.device_mesh",
           "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.pipelining",
           "torch.export", "torch.utils.data", "partc.runtime.testing", "partc.runtime.api",
           "partc.runtime.__main__", "partc.runtime.check",
           "transformers", "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
           "transformers.models.bert.modeling_bert", "transformers.models.vit.modeling_vit",
           "transformers.models.mixtral.modeling_mixtral")
"""What the ranks import (partc's runtime and the tiny Hugging Face models of helpers.py), imported once here.
A module that fails to import is left to the ranks (they then fail as they would under torchrun)."""

_replies_fd: int | None = None
"""The server's end of the replies pipe (closed in the children, so the client sees the server leave)."""

STOP_AFTER_S, KILL_AFTER_S = 0.1, 10.0
"""When a rank fails, the others get SIGTERM this long after (torchrun's agent notices a failed worker within its
monitor interval, 0.1 s), and SIGKILL if they are still there (the agent's grace period is longer: 30 s)."""

OUTPUT_TAIL = 60_000
"""The characters of a launch's output sent back (the end of it)."""


# --- the server ---------------------------------------------------------------------------------------------------


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


def _fork_child(setup) -> int:
    """Fork; the child runs `setup()` (which must not return: it leaves with os._exit)."""
    assert _threads() == 1, f"the fork server has {_threads()} threads: forking it is not safe"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            if _replies_fd is not None:
                os.close(_replies_fd)
            os.setsid()  # its own process group: a kill reaches what it starts (data-loader workers)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_DFL)
            setup()
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(1)
    return pid


def _serve_store(port_w: int) -> None:
    """A store child: serve torchrun's TCPStore on a free port (written to `port_w`) until killed."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=900))
    os.write(port_w, f"{store.port}\n".encode())
    os.close(port_w)
    while True:
        signal.pause()


def _run_rank(req: dict, rank: int, port: int, log_fd: int) -> None:
    """A rank: torchrun's environment, then ``python ARGS``."""
    n = req["nproc"]
    _run(req, log_fd, log_fd, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
         ROLE_NAME="default", WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), GROUP_WORLD_SIZE="1",
         ROLE_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0",
         TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID=f"zygote-{port}", TORCHELASTIC_USE_AGENT_STORE="True")


def _run(req: dict, out_fd: int, err_fd: int, **more_env: str) -> None:
    """``python -m MODULE ARGS`` / ``python SCRIPT ARGS`` (``req["args"]``) in this forked process, under
    ``req["env"]`` and `more_env`, in ``req["cwd"]``; leaves with its exit code."""
    import runpy

    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.environ.clear()
    os.environ.update(req["env"])
    os.environ.update(more_env)
    os.chdir(req["cwd"])
    args = req["args"]
    code = 1
    try:
        if args[0] == "-m":
            sys.modules.pop(args[1], None)  # preloaded here; `python -m` runs it as __main__ only
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = req["cwd"]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def run_process(req: dict) -> dict:
    """Run one process (``{"args", "env", "cwd", "timeout", "join"}``) as ``python ARGS`` would, with no launcher
    variables; returns ``{"returncode", "timed_out", "stdout", "stderr"}`` (with "join", stderr is in stdout, in
    the order written, and "stderr" is empty)."""
    out = tempfile.TemporaryFile()
    err = out if req.get("join") else tempfile.TemporaryFile()
    pid = _fork_child(lambda: _run(req, out.fileno(), err.fileno()))
    deadline = time.monotonic() + req["timeout"]
    timed_out = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if not timed_out and time.monotonic() > deadline:
            timed_out = True
            _kill([pid])
        time.sleep(0.02)
    texts = []
    for f in (out, err):
        f.seek(0)
        texts.append("" if f is out and err is out and texts else f.read().decode(errors="replace")[-OUTPUT_TAIL:])
    out.close()
    err.close()
    return {"returncode": os.waitstatus_to_exitcode(status), "timed_out": timed_out, "stdout": texts[0],
            "stderr": texts[1]}


def _kill(pids, sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass


def launch(req: dict) -> dict:
    """Run one launch (``{"nproc", "args", "env", "cwd", "timeout"}``); returns ``{"returncode", "timed_out",
    "exits": {rank: code}, "output"}``. A rank killed by a signal has the negative signal number as its code."""
    port_r, port_w = os.pipe()
    store = _fork_child(lambda: _serve_store(port_w))
    os.close(port_w)
    with os.fdopen(port_r) as f:
        line = f.readline()
    if not line:
        _kill([store])
        os.waitpid(store, 0)
        return {"returncode": 1, "timed_out": False, "exits": {}, "output": "the store process failed to start"}
    port = int(line)
    log = tempfile.TemporaryFile()
    ranks = {_fork_child(lambda r=r: _run_rank(req, r, port, log.fileno())): r for r in range(req["nproc"])}
    exits: dict[int, int] = {}
    first_failure = None
    timed_out = False
    deadline = time.monotonic() + req["timeout"]
    stop_at = kill_at = None  # after a failure: when the others get SIGTERM, then SIGKILL
    while len(exits) < len(ranks):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            left = [p for p, r in ranks.items() if r not in exits]
            if now > deadline:
                timed_out = True
                _kill(left)
                deadline = float("inf")
            elif stop_at is not None and now > stop_at:
                _kill(left, signal.SIGTERM)
                stop_at = None
            elif kill_at is not None and now > kill_at:
                _kill(left)
                kill_at = None
            time.sleep(0.02)
            continue
        if pid not in ranks:
            continue  # the store process, which should not leave first
        code = os.waitstatus_to_exitcode(status)
        exits[ranks[pid]] = code
        if code != 0 and first_failure is None:  # torchrun stops the others: SIGTERM, then SIGKILL
            first_failure = code
            stop_at, kill_at = time.monotonic() + STOP_AFTER_S, time.monotonic() + KILL_AFTER_S
    _kill([store])
    os.waitpid(store, 0)
    log.seek(0)
    output = log.read().decode(errors="replace")
    log.close()
    returncode = 0 if first_failure is None and not timed_out else (first_failure or -signal.SIGKILL)
    return {"returncode": returncode, "timed_out": timed_out, "exits": exits, "output": output[-OUTPUT_TAIL:]}


def serve() -> None:
    import importlib

    global _replies_fd
    requests = sys.stdin
    _replies_fd = os.dup(1)
    replies = os.fdopen(_replies_fd, "w")
    os.dup2(2, 1)  # a stray print must not reach the replies
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    replies.write(json.dumps({"ready": os.getpid(), "threads": _threads()}) + "\n")
    replies.flush()
    for line in requests:
        try:
            req = json.loads(line)
            reply = launch(req) if "nproc" in req else run_process(req)
        except Exception:
            reply = {"returncode": 1, "timed_out": False, "exits": {}, "output": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


# --- the client (in the test process) -------------------------------------------------------------------------------


class Zygote:
    """The test process's fork server, started on the first launch and kept for the session."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                         start_new_session=True)
            ready = self.proc.stdout.readline()
            assert ready, "the fork server did not start"
            threads = json.loads(ready)["threads"]
            assert threads == 1, f"the fork server has {threads} threads after its imports: forking it is not safe"
        return self.proc

    def launch(self, nproc: int, args: list[str], *, env: dict | None, timeout: float) -> dict:
        """Launch `nproc` ranks of ``python ARGS`` (as ``torchrun --nproc-per-node NPROC ARGS`` does) under this
        process's environment, updated by `env`, with one thread a process; see `launch`."""
        return self._ask({"nproc": nproc, "args": list(args), "cwd": os.getcwd(), "timeout": timeout,
                          "env": {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}})

    def run(self, args: list[str], *, env: dict, timeout: float, join: bool, cwd=None) -> dict:
        """One process of ``python ARGS`` under exactly `env`, in `cwd` (default: the current directory); see
        `run_process`."""
        return self._ask({"args": list(args), "cwd": str(cwd or os.getcwd()), "timeout": timeout, "env": env,
                          "join": join})

    def _ask(self, req: dict) -> dict:
        proc = self._start()
        proc.stdin.write(json.dumps(req) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server exited with {proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


if __name__ == "__main__":
    serve()
