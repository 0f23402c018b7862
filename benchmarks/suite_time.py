"""How long the test suite takes, module by module: what the 8-minute budget of .ci/run (two cores) is spent on.

    python benchmarks/suite_time.py                        # .ci/run's command: pytest -n 2 --dist loadfile
    python benchmarks/suite_time.py --serial               # one pytest process
    python benchmarks/suite_time.py -- -m "not slow"       # the fast tier (arguments after -- go to pytest)
    python benchmarks/suite_time.py --cpu [tests/test_x.py ...]   # CPU seconds per module, one pytest each

Runs pytest with a JUnit XML report and prints one row per test module, longest first:

    module       the test module
    tests        its tests that ran
    seconds      the sum of its tests' durations (setup, call and teardown: a module-scoped fixture, such as one
                 torchrun launch of many jobs, counts in the first test that asks for it)

(``--cpu``: every module, or the given ones, in a pytest process of its own, one after another, one thread a
process (the workers' setting under xdist), with its CPU seconds: user + system of pytest and every process it
waited for; what .ci/run spends is about their sum, since the test processes' start-up is small next to it)
and a last line with the run's wall seconds and CPU seconds (user + system of pytest, its xdist workers and every
process they waited for: torchrun launches, `partc run`, spawned checks). Under xdist the modules run two at a time,
so the module seconds add up to about twice the wall; on a machine that others share, the wall and the module
seconds grow with the load and the CPU seconds much less (the load average before and after is printed). The table
is also written to benchmarks/results/suite_time-DATE.txt.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def module_times(junit: Path) -> dict[str, tuple[int, float]]:
    """Test module -> (tests, seconds) from a JUnit XML report."""
    out: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        module = case.get("classname", "").split(".")
        name = next((part for part in module if part.startswith("test_")), ".".join(module))
        out[name][0] += 1
        out[name][1] += float(case.get("time", 0.0))
    return {k: (n, s) for k, (n, s) in out.items()}


def per_module_cpu(modules: list[str], pytest_args: list[str]) -> tuple[list[str], int]:
    """Rows of (module, tests, wall seconds, CPU seconds), each module in its own pytest process."""
    modules = modules or sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py"))
    lines, worst = [f"{'module':<26} {'tests':>5} {'wall s':>7} {'CPU s':>7}"], 0
    total_wall = total_cpu = 0.0
    total_n = 0
    for module in modules:
        with tempfile.TemporaryDirectory() as tmp:
            junit = Path(tmp) / "junit.xml"
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", module,
                   *pytest_args]
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            n = sum(t for t, _ in module_times(junit).values()) if junit.exists() else 0
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        worst = worst or proc.returncode
        name = Path(module).stem + ("" if proc.returncode == 0 else f" (exit {proc.returncode})")
        lines.append(f"{name:<26} {n:>5} {wall:>7.1f} {cpu:>7.1f}")
        print(lines[-1], flush=True)
        total_wall, total_cpu, total_n = total_wall + wall, total_cpu + cpu, total_n + n
    lines.append(f"{'all modules':<26} {total_n:>5} {total_wall:>7.1f} {total_cpu:>7.1f}")
    return lines, worst


def _report(lines: list[str], name: str | None) -> None:
    """Print the table and, unless `name` is None, write it under benchmarks/results/."""
    text = "\n".join(lines)
    print(text)
    if name is not None:
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / name
        path.write_text(text + "\n")
        print(f"wrote {path.relative_to(ROOT)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serial", action="store_true", help="one pytest process (no -n 2 --dist loadfile)")
    ap.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/suite_time-DATE.txt")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    ap.add_argument("--cpu", action="store_true", help="CPU seconds per module: each module (pytest_args "
                    "naming tests/test_*.py files, else all) in a pytest process of its own")
    ap.add_argument("--tag", default="", help="a suffix for the results file name (before, after...)")
    args = ap.parse_args(argv)
    stamp = datetime.date.today().isoformat() + (f"-{args.tag}" if args.tag else "")

    if args.cpu:
        modules = [a for a in args.pytest_args if a.endswith(".py")]
        load_before = os.getloadavg()[0]
        lines, rc = per_module_cpu(modules, [a for a in args.pytest_args if not a.endswith(".py")])
        lines.append(f"load average {os.getloadavg()[0]:.1f} at the end ({load_before:.1f} at the start); "
                     f"{os.cpu_count()} CPUs; PARTC_TEST_LAUNCHER={os.environ.get('PARTC_TEST_LAUNCHER', '')}")
        _report(lines, None if args.no_save else f"suite_cpu-{stamp}.txt")
        return rc

    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
               *([] if args.serial else ["-n", "2", "--dist", "loadfile"]), *args.pytest_args]
        load_before = os.getloadavg()[0]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        load_after = os.getloadavg()[0]
        times = module_times(junit) if junit.exists() else {}
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)

    lines = [f"{'module':<26} {'tests':>5} {'seconds':>8}"]
    for name, (n, s) in sorted(times.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"{name:<26} {n:>5} {s:>8.1f}")
    total_n, total_s = sum(n for n, _ in times.values()), sum(s for _, s in times.values())
    lines.append(f"{'all modules':<26} {total_n:>5} {total_s:>8.1f}")
    lines.append(f"run: {wall:.0f} s wall, {cpu:.0f} s CPU, pytest exit {proc.returncode}; "
                 f"load average {load_before:.1f} before, {load_after:.1f} after; {os.cpu_count()} CPUs")
    lines.append("command: " + " ".join(cmd[1:]).replace(str(junit), "JUNIT"))
    _report(lines, None if args.no_save else f"suite_time-{stamp}.txt")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
