"""Dated results files: what a benchmark script prints, kept under ``benchmarks/results/``.

A script's entry point runs its ``main`` through `recorded`: the output goes to the terminal as before and, when
``main`` returns, into ``benchmarks/results/<script>-<YYYY-MM-DD>.md`` under a header that says how it was measured
(command line, start time in UTC, wall seconds, CPU count and load average at the start and the end, Python, torch
and the partc commit). Measurements depend on the machine and its load, so they live in these files, each with its
date, and not in docstrings or the docs, which name the file a figure comes from. A results file is never
overwritten: a second run on the same day writes ``-2``, ``-3``, ... A run that raises writes nothing;
``PARTC_BENCH_RESULTS=0`` writes nothing either (a trial run).
"""

from __future__ import annotations

import datetime
import io
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).resolve().parent / "results"


class _Tee(io.TextIOBase):
    """Writes to the terminal and to a buffer."""

    def __init__(self, terminal, buffer: io.StringIO):
        self.terminal, self.buffer = terminal, buffer

    def write(self, text: str) -> int:
        self.terminal.write(text)
        self.buffer.write(text)
        return len(text)

    def flush(self) -> None:
        self.terminal.flush()

    def isatty(self) -> bool:
        return self.terminal.isatty()


def _commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head} (with uncommitted changes)" if dirty else head


def _load() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def results_path(name: str, day: datetime.date, directory: Path = RESULTS) -> Path:
    """``<name>-<day>.md`` in `directory`, or the first of ``-2``, ``-3``, ... that does not exist yet."""
    path = directory / f"{name}-{day.isoformat()}.md"
    k = 2
    while path.exists():
        path = directory / f"{name}-{day.isoformat()}-{k}.md"
        k += 1
    return path


def recorded(name: str, main: Callable[[], int | None], *, markdown: bool = False,
             directory: Path = RESULTS) -> int | None:
    """Run ``main()``, teeing its standard output into a dated results file (see the module docstring); returns
    what ``main`` returns. `markdown`: the output is a markdown table, kept as is rather than in a code block."""
    if os.environ.get("PARTC_BENCH_RESULTS") == "0":
        return main()
    start = datetime.datetime.now(datetime.timezone.utc)
    load_start, t0 = _load(), time.perf_counter()
    buffer, terminal = io.StringIO(), sys.stdout
    sys.stdout = _Tee(terminal, buffer)
    try:
        status = main()
    finally:
        sys.stdout = terminal
    import torch

    command = shlex.join([Path(sys.executable).name, *(sys.argv if sys.argv else [name])])
    body = buffer.getvalue().rstrip("\n")
    text = (f"# {name}, {start:%Y-%m-%d %H:%M} UTC\n\n"
            f"- command: `{command}` (exit status {status or 0})\n"
            f"- wall time: {time.perf_counter() - t0:.0f} s\n"
            f"- machine: {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, load average (1/5/15 min) "
            f"{load_start} at the start, {_load()} at the end\n"
            f"- Python {platform.python_version()}, torch {torch.__version__}, partc commit {_commit()}\n\n"
            + (f"{body}\n" if markdown else f"```text\n{body}\n```\n"))
    directory.mkdir(parents=True, exist_ok=True)
    while True:
        path = results_path(name, start.date(), directory)
        try:
            with open(path, "x") as f:  # never overwrite, not even a file another run just made
                f.write(text)
            break
        except FileExistsError:
            continue
    print(f"results written to {path}", file=sys.stderr)
    return status
