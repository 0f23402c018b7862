"""How a job ends: workers die with their launcher, a failing rank says why in one line, and a stalled rank is
named.

Parent death. `die_with_parent`: a worker gets SIGKILL when the process that started it (torchrun, or `partc
run`, which runs torchrun's agent in its own process) dies, whatever killed it (Linux: ``prctl(PR_SET_PDEATHSIG)``;
elsewhere a thread that watches the parent pid). So no worker trains on, or writes checkpoints, after its job.

Error reports. `report`: a rank that fails writes one line to torchrun's per-rank error file
(``TORCHELASTIC_ERROR_FILE``, which torchrun's agent reads into its failure summary) with partc's ``kind``:
``user`` (a `PartcError`; the worker exits 2), ``internal`` (any other exception; exit 1, after the traceback)
or ``stall``. `partc run` prints these lines (`partc.runtime.launch`). Under torchrun itself every rank prints
its own line, once per distinct message (a user error is mostly the same on every rank, but one only the last
stage sees, in the loss, is not): the ranks claim each message in torchrun's store, ``partc/errors/``, where each
also leaves its line. A rank whose collective fails after another rank has reported (its peer is gone) names
that rank and prints no traceback (`peer_failure`): the first failure is the cause, the rest its echo.

Heartbeat. `Heartbeat`: every rank sets ``partc/heartbeat/<rank>`` in torchrun's store (time, step, pid) every
``--collective-timeout / 10`` seconds (0.5 to 10 s) from a thread, which runs while the main thread waits in a
collective. Ranks 0 and 1 watch: a rank silent for longer than ``--collective-timeout`` (stopped, or stuck
holding the interpreter) is named in a ``stall`` report, killed if it is a sibling process on this host, and the
job stops; rank 1 reports only when rank 0 is the silent one. When a collective fails, the failing rank names
the ranks that are silent for three intervals (`Heartbeat.stalled`).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

KINDS = ("user", "internal", "stall")
LAUNCHER_ENV = "PARTC_LAUNCHER"
"""Set by `partc run` for its workers: they leave the printing of error lines to it."""
WATCHERS = 2
"""Ranks 0 .. WATCHERS - 1 watch the others' heartbeats."""

_current: Heartbeat | None = None
_errors: list = []
"""[the store of error lines (torchrun's, under ``partc/errors/``) or None], once looked up."""


def rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def report(message: str, *, kind: str, stalled: list[int] | None = None) -> bool:
    """Say why this rank stops (see the module docstring). With a heartbeat running, only the first report is
    made (a collective that times out and the watcher may both see a stall). Returns whether this one was made."""
    assert kind in KINDS, kind
    message = " ".join(message.split()) or "(no message)"
    if _current is not None:
        with _current.lock:
            if _current.reported:
                return False
            _current.reported = True
    rank, world = rank_and_world()
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        data = {"message": message, "timestamp": int(time.time()),
                "partc": {"kind": kind, "time": time.time(), "stalled": stalled or []}}
        try:
            with open(path, "w") as f:
                json.dump(data, f)
        except OSError:
            pass
    store = error_store()
    first = rank == 0 or kind != "user"  # without a store: user errors are mostly the same on every rank
    if store is not None:
        try:
            first = store.add(f"line/{hashlib.sha256(message.encode()).hexdigest()}", 1) == 1
        except Exception:  # the store is gone: the job is ending
            pass
    if not os.environ.get(LAUNCHER_ENV) and first:
        prefix = f"rank {rank}: " if world > 1 and kind == "internal" else ""
        print(f"error: {prefix}{message}", file=sys.stderr, flush=True)
    if store is not None:  # after the line: a rank that then fails because this one left prints after it
        try:
            store.set(f"rank/{rank}", json.dumps({"message": message, "time": time.time()}))
        except Exception:
            pass
    return True


def error_store():
    """torchrun's store under ``partc/errors/<restart>/`` (see the module docstring); None in one process or when
    it cannot be joined."""
    if not _errors:
        _errors.append(None)
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if rank_and_world()[1] > 1 and addr and port:
            try:
                import torch.distributed as dist

                store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=5))
                attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                _errors[0] = dist.PrefixStore(f"partc/errors/{attempt}/", store)
            except Exception:
                pass
    return _errors[0]


def peer_failure(wait_s: float = 2.0) -> tuple[int, str] | None:
    """(rank, its line) of the first other rank that reported a failure, waiting up to `wait_s` for one (a peer
    that failed may still be writing its report when this rank's collective notices it is gone); None if none
    did or there is no store."""
    store = error_store()
    if store is None:
        return None
    rank, world = rank_and_world()
    keys = [f"rank/{r}" for r in range(world) if r != rank]
    deadline = time.monotonic() + wait_s
    while True:
        try:
            found = [(json.loads(store.get(k)), int(k.split("/")[1])) for k in keys if store.check([k])]
        except Exception:
            return None
        if found:
            info, r = min(found, key=lambda x: x[0]["time"])
            return r, info["message"]
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def summary_line(e: BaseException) -> str:
    """``Type: first line of the message``."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


# -- parent death ------------------------------------------------------------------------------------------------


def die_with_parent() -> None:
    """Get SIGKILL when the parent process dies (see the module docstring)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0:  # PR_SET_PDEATHSIG
                if os.getppid() != parent or parent == 1:  # the parent died already (orphans go to init)
                    os.kill(os.getpid(), signal.SIGKILL)
                return
        except (OSError, AttributeError):
            pass
    threading.Thread(target=_watch_parent, args=(parent,), name="partc-parent", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


# -- heartbeat ---------------------------------------------------------------------------------------------------


def current_heartbeat() -> Heartbeat | None:
    """The heartbeat `Heartbeat.start` started in this process, if any."""
    return _current


class Heartbeat:
    """This rank's heartbeat and, on ranks 0 and 1, the watch over the others (see the module docstring)."""

    def __init__(self, store, *, rank: int, world: int, timeout_s: float):
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self.interval = min(max(timeout_s / 10, 0.5), 10.0)
        self.step = 0
        """The step this rank is in (the training loop sets it)."""
        self.host = socket.gethostname()
        self.lock = threading.Lock()
        self.reported = False
        """Whether this process has reported its failure (`report`)."""
        self._keys = [str(r) for r in range(world)]
        self._beat()
        threading.Thread(target=self._run, name="partc-heartbeat", daemon=True).start()

    @classmethod
    def start(cls, timeout_s: float) -> Heartbeat | None:
        """Under torchrun (its store at MASTER_ADDR:MASTER_PORT) with more than one rank; else None."""
        import torch.distributed as dist

        rank, world = rank_and_world()
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if world < 2 or not addr or not port:
            return None
        try:
            store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=30))
        except Exception:  # no store to join: run without a heartbeat (the collective timeout still holds)
            return None
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        global _current
        _current = cls(dist.PrefixStore(f"partc/heartbeat/{attempt}/", store), rank=rank, world=world,
                       timeout_s=timeout_s)
        return _current

    def _beat(self) -> None:
        self.store.set(str(self.rank), json.dumps({"time": time.time(), "step": self.step, "pid": os.getpid(),
                                                   "ppid": os.getppid(), "host": self.host}))

    def _run(self) -> None:
        try:
            while True:
                time.sleep(self.interval)
                self._beat()
                if self.rank < WATCHERS:
                    self._watch()
        except Exception:  # the store is gone: the job is ending
            return

    def beats(self) -> dict[int, dict]:
        """The last heartbeat of every rank that has sent one."""
        if not self.store.check(self._keys):
            return {r: json.loads(self.store.get(k)) for r, k in enumerate(self._keys) if self.store.check([k])}
        return {r: json.loads(v) for r, v in enumerate(self.store.multi_get(self._keys))}

    def stalled(self, silent_s: float | None = None) -> list[tuple[int, float, dict]]:
        """(rank, seconds silent, last heartbeat) of the other ranks silent for longer than `silent_s`
        (default: three intervals); empty if the store cannot be read."""
        limit = 3 * self.interval if silent_s is None else silent_s
        try:
            beats = self.beats()
        except Exception:  # the store is gone
            return []
        now = time.time()
        return [(r, now - b["time"], b) for r, b in sorted(beats.items())
                if r != self.rank and now - b["time"] > limit]

    def _watch(self) -> None:
        stalled = self.stalled(self.timeout_s)
        ranks = [r for r, _, _ in stalled]
        if not stalled or any(w not in ranks for w in range(min(self.rank, WATCHERS))):
            return
        if report(stall_message(stalled, self.timeout_s), kind="stall", stalled=ranks):
            kill_siblings(stalled)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)


def stall_message(stalled: list[tuple[int, float, dict]], timeout_s: float) -> str:
    parts = [f"rank {r} stopped responding (no heartbeat for {silent:.0f} s, the last during step {b['step'] + 1}; "
             f"pid {b['pid']} on {b['host']})" for r, silent, b in stalled]
    return f"{'; '.join(parts)}: stopping the job (--collective-timeout {timeout_s:g} s)"


def kill_siblings(stalled: list[tuple[int, float, dict]]) -> None:
    """SIGKILL the stalled ranks that are processes of this host with this process's parent (a stopped process
    would not act on torchrun's SIGTERM): checked in /proc, so a pid that was reused is left alone."""
    host, parent = socket.gethostname(), os.getppid()
    for _, _, b in stalled:
        if b["host"] != host or b["ppid"] != parent:
            continue
        try:
            with open(f"/proc/{b['pid']}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
            if ppid == parent:
                os.kill(b["pid"], signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass
