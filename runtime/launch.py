"""`partc run OUT [args]`: check the options, then run torchrun on this machine with the plan's world size.

    partc run partc_out --steps 100
    # = python -m torch.distributed.run --standalone --nproc-per-node W -m partc.runtime partc_out --steps 100

W = dp x tp x pp from ``OUT/plan.json``. ``--standalone`` rendezvouses on a free local port, so several runs can
share a machine. For several machines, call torchrun yourself (``--nnodes``, ``--rdzv-endpoint``) with
``-m partc.runtime OUT``.

Before any process starts, the runtime's options are parsed and checked with the runtime's own parser
(`partc.runtime.options`) and the checkpoint directory against the run (`checkpoint_dir.check`): a bad option is
one line and exit 2 here, not a line per rank and torchrun's traceback.

torchrun's agent runs in this process (``torch.distributed.run.run``, what the ``torchrun`` command calls), so:

- SIGTERM, SIGINT, SIGHUP or SIGQUIT to `partc run` reach every worker (the agent sends the signal, then SIGKILL
  after 30 s), and `partc run` exits with 128 + the signal; if `partc run` is killed outright, its workers get
  SIGKILL (`supervise.die_with_parent`);
- when the job fails, `partc run` prints one line per failure, from the ranks' error files (`supervise.report`):
  a message that every failing rank gave is printed once; exit 2 if every failure is a user error, else 1. The
  agent's own log lines and traceback are not printed.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from partc.environ import environ
from partc.errors import PartcError
from partc.plan import read_plan

_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")


def torchrun_args(out_dir: str, extra: list[str], nproc_per_node: int | None = None) -> list[str]:
    """Check the plan, the options and the machine; the arguments of torchrun."""
    from partc.runtime import checkpoint_dir, options

    plan = read_plan(Path(out_dir) / "plan.json")
    args = options.parse([out_dir, *extra])
    options.check_paths(args)
    if args.checkpoint_dir:
        record = checkpoint_dir.RunRecord.of(plan, seed=args.seed, optimizer=args.optimizer)
        checkpoint_dir.check(args.checkpoint_dir, record, resume=args.resume)
    world = plan.parallel.world_size
    if nproc_per_node is not None and nproc_per_node != world:
        raise PartcError(f"the plan needs {plan.parallel.world_text()} processes, not --nproc-per-node "
                         f"{nproc_per_node}; compile a plan for {nproc_per_node} GPUs")
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and gpus < world:
        raise PartcError(f"the plan needs {world} GPUs but this machine has {gpus}; run torchrun on several "
                         f"machines (--nnodes) with -m partc.runtime {out_dir}")
    return ["--standalone", "--nproc-per-node", str(world), "-m", "partc.runtime", out_dir, *extra]


def run(out_dir: str, extra: list[str], nproc_per_node: int | None = None) -> int:
    """Run the job in the foreground; returns the exit code (see the module docstring)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from partc.runtime.supervise import LAUNCHER_ENV, summary_line

    argv = torchrun_args(out_dir, extra, nproc_per_node)
    world = int(argv[2])
    for name in _AGENT_LOGGERS:
        logger = logging.getLogger(name)
        logger.propagate = False
        if not logger.handlers:
            logger.addHandler(logging.NullHandler())
    env = {LAUNCHER_ENV: "1"}
    if world > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # torchrun's default, without its banner
    with environ(env):  # the workers inherit this process's environment
        try:
            torchrun.run(torchrun.parse_args(argv))
        except ChildFailedError as e:
            lines, code = failure_lines(e.failures, world)
            for line in lines:
                print(line, file=sys.stderr, flush=True)
            return code
        except SignalException as e:
            print(f"error: partc run got {e.sigval.name}: stopped all {world} ranks", file=sys.stderr, flush=True)
            return 128 + int(e.sigval)
        except Exception as e:  # the agent itself (rendezvous, ports)
            print(f"error: torchrun failed: {summary_line(e)}", file=sys.stderr, flush=True)
            return 1
    return 0


def failure_lines(failures: dict, world: int) -> tuple[list[str], int]:
    """The lines `partc run` prints for torchrun's failures (global rank -> ``ProcessFailure``), and the exit
    code. Ranks that torchrun's agent stopped (SIGTERM, or SIGKILL of a rank a stall report names) because
    another failed are not failures of their own and are left out, unless nothing else failed."""
    reported, crashed, signalled = [], [], []
    stalled: set[int] = set()
    for rank, f in sorted(failures.items()):
        info = f.error_file_data.get("partc") if isinstance(f.error_file_data, dict) else None
        if info:
            reported.append((info.get("time", 0.0), rank, f.message, info.get("kind")))
            stalled.update(info.get("stalled", []))
        elif f.exitcode > 0:
            crashed.append((rank, f"exited with code {f.exitcode} without an error message (see its output above)"))
        else:
            signalled.append((rank, f.signal_name()))
    own = [(r, s) for r, s in signalled if s not in ("SIGTERM", "SIGKILL") or (s == "SIGKILL" and r not in stalled)]
    if not reported and not crashed:
        own = own or signalled
    entries = [(r, f"was killed by {s}") for r, s in own] + crashed
    lines = _merge([(r, text, "rank") for r, text in entries], world)
    lines += _merge([(r, msg, kind) for _, r, msg, kind in sorted(reported)], world)
    user = bool(reported) and not entries and all(kind == "user" for *_, kind in reported)
    return lines, 2 if user else 1


def _merge(items: list[tuple[int, str, str]], world: int) -> list[str]:
    """One line per distinct message, in order. An internal error is prefixed with the ranks that gave it (when
    there are several ranks); a user error or a stall report is not (a user error is mostly the same on every
    rank, whose lines torchrun may not all have collected; a stall report names its rank)."""
    by_text: dict[str, list[int]] = {}
    kinds: dict[str, str] = {}
    for rank, text, kind in items:
        by_text.setdefault(text, []).append(rank)
        kinds[text] = kind
    out = []
    for text, ranks in by_text.items():
        if kinds[text] == "rank":
            out.append(f"error: {_ranks(ranks)} {text}")
        elif kinds[text] == "internal" and world > 1:
            out.append(f"error: {_ranks(ranks)}: {text}")
        else:
            out.append(f"error: {text}")
    return out


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
