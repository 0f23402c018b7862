"""Model families a user brings (issue #14): one row per family, as a markdown table.

    python benchmarks/zoo.py                                  # every family (a long while on a few cores)
    python benchmarks/zoo.py --families falcon opt --skip-tiny
    python benchmarks/zoo.py --skip-full --timeout 120 --gpus 64

Each run writes what it prints to benchmarks/results/zoo-<date>.md as well (`record.py`).

Each family is a model file this script writes into a temporary directory: a Hugging Face model built from its
config class at the published size (nothing downloaded; partc builds it on the meta device), or plain torch, and a
tiny one of the same code (2 layers or stages, hidden size 32-64, dropout off). Columns:

    family       the family's name (``--families`` takes these)
    size         the published configuration the full-size model file reproduces
    GPUs         GPUs of the full-size compile (8; Mixtral 16; ``--gpus`` overrides all)
    compile s    wall seconds of ``partc compile FILE --gpus G --cluster h100-80g -o OUT`` at full size in a fresh
                 process (Python and torch start-up included), nothing pinned, partc's default batch and length
    plan         the plan chosen: dp, tp, pp, ZeRO stage, schedule (v: virtual stages), micro-batch size
    predicted    the plan's MFU and throughput (tokens/s, or samples/s for models without tokens); or partc's one-line
                 ``error: ...`` if the compile failed, or the time-out (``--timeout``, default 300 s)
    pp 2         the tiny model trained 3 SGD steps on 2 gloo ranks, pipeline of 2 stages
    dp 2 ZeRO-3  the same, data parallel over 2 ranks with ZeRO-3
    tp 2         the same, tensor parallel over 2 ranks with Megatron-LM's map set by hand, as a user would with
                 ``--from-plan`` (`partc.passes.tp.MEGATRON_NAMES`: attention's query/key/value and the MLP's
                 first layers colwise, their output projections rowwise, a mixture of experts' experts split
                 inside, everything else whole; a tiny model is too small for the solver to split anything
                 itself): "ok (6 split)" says 6 layers were split; a map partc refuses shows its error

A tiny run is "ok" when each step's loss equals `partc.runtime.testing.reference_run` (the whole model in one
process, fp32, micro-batches of one sample) within 1e-5 relative; "FAIL" gives the worst relative difference;
otherwise the cell is the first error line (of the compile, partc's ``error: ...``, or of the run). Every tiny
program is compiled with fp32 precision and micro-batch size 1, 4 samples a step (16 tokens for token models), then
all of them run in one torchrun launch of 2 ranks (``python -m partc.runtime.testing jobs.json``). The driver runs
the programs in order, rank 0 writing each one's result as it ends: if the launch fails, the first program without
a result is the one that failed (its cell shows the launch's first error line), and those after it run in a new
launch, so one failure neither sinks the others nor is blamed on them. The line
under the table gives the worst relative loss difference over the tiny runs that passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zoo_families import BY_NAME, Family  # the script's directory is on sys.path

STEPS = 3
SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0}
TINY_BATCH = 4
TINY_SEQ = 16
RTOL = 1e-5
LAUNCH_TIMEOUT_S = 120
JOB_TIMEOUT_S = 120
CLUSTER = "h100-80g"

# name: (tp, pp, dp, zero)
TINY_RUNS = {"pp 2": (1, 2, 1, 0), "dp 2 ZeRO-3": (1, 1, 2, 3), "tp 2": (2, 1, 1, 0)}


def megatron_map(layers: dict[str, str]) -> dict[str, str]:
    """Each layer of a plan's ``tp`` map -> its Megatron-LM style by name (`partc.passes.tp.MEGATRON_NAMES`), or
    "replicate"."""
    from partc.passes.tp import megatron_style

    return {fqn: megatron_style(fqn) or "replicate" for fqn in layers}




# -- full size ------------------------------------------------------------------------------------------------------


EXCEPTION = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception)\b.*)$")
"""A Python exception's last traceback line (``KeyError: 'x'``), a worker's ``[rankN]:`` prefix stripped."""


def first_error(text: str) -> str:
    """partc's first ``error: ...`` line in `text` (a rank's prefix stripped), or else the first exception line that
    is not torchrun's own (``ChildFailedError``), or else the last line."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    for line in lines:
        if line.startswith("error:"):
            return line
    for line in lines:
        match = EXCEPTION.match(line)
        if match and "ChildFailedError" not in line and not line.startswith("Traceback"):
            return match.group(1)
    return lines[-1] if lines else "(no output)"


def run_group(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, str, float]:
    """Run `cmd` in its own session (a time-out kills all it started); (exit status or None on time-out, stdout
    and stderr, wall seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out, time.perf_counter() - t0
    return proc.returncode, out, time.perf_counter() - t0


def plan_cell(par: dict) -> str:
    sched = par["schedule"] + (f" v{par['virtual_stages']}" if par["virtual_stages"] > 1 else "")
    return (f"dp {par['dp']} tp {par['tp']} pp {par['pp']}, ZeRO {par['zero']}, {sched}, "
            f"mb {par['micro_batch_size']}")


def compile_full(fam: Family, tmp: Path, gpus: int, timeout: float) -> dict:
    """``partc compile`` of the full-size file in a fresh process: the row's compile columns."""
    path = tmp / f"{fam.name}.py"
    path.write_text(fam.full)
    out = tmp / f"{fam.name}_out"
    cmd = [sys.executable, "-m", "partc.cli.main", "compile", str(path), "--gpus", str(gpus), "--cluster", CLUSTER,
           "-o", str(out), "--format", "json"]
    code, text, wall = run_group(cmd, timeout, env=fam.full_env)
    if code is None:
        return {"compile": f"> {timeout:.0f}", "plan": "", "predicted": f"timed out after {timeout:.0f} s"}
    if code != 0:
        return {"compile": f"{wall:.0f}", "plan": "", "predicted": first_error(text)}
    plan = json.loads((out / "plan.json").read_text())
    pred, unit = plan["predicted"], plan["model"].get("throughput_unit", "tokens")
    return {"compile": f"{wall:.0f}", "plan": plan_cell(plan["parallel"]),
            "predicted": f"MFU {pred['mfu'] * 100:.1f}%, {pred[f'{unit}_per_s']:,.0f} {unit}/s"}


# -- tiny runs ------------------------------------------------------------------------------------------------------


def compile_tiny(fam: Family, tmp: Path) -> tuple[dict[str, dict], dict[str, str]]:
    """Compile the tiny file under each of TINY_RUNS: (jobs by run, cells of the compiles partc refused)."""
    import torch

    from partc.compile import compile_model
    from partc.errors import PartcError
    from partc.model_file import load_model_file
    from partc.parallel import Pins

    path = tmp / f"tiny_{fam.name}.py"
    path.write_text(fam.tiny)
    seq_len = TINY_SEQ if fam.tokens else None
    init = tmp / f"tiny_{fam.name}.init.pt"
    jobs, cells = {}, {}
    try:
        torch.manual_seed(1234)
        torch.save(load_model_file(str(path), seq_len=seq_len).build().state_dict(), init)
    except Exception as e:  # noqa: BLE001 - a family that does not even build is a finding for every cell
        line = f"error: {e}" if isinstance(e, PartcError) else f"{type(e).__name__}: {e}"
        return {}, {run: line.splitlines()[0] for run in TINY_RUNS}
    for run, (tp, pp, dp, zero) in TINY_RUNS.items():
        key = f"{fam.name}_{run.replace(' ', '_')}"
        pins = Pins(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch_size=1, schedule="1f1b", recompute="none",
                    precision="fp32")
        try:
            res = compile_model(str(path), gpus=tp * pp * dp, pins=pins, global_batch_size=TINY_BATCH,
                                seq_len=seq_len, out_dir=tmp / key)
            if tp > 1:  # Megatron-LM's map by hand, as a user would: the plan edited, compiled again from it
                plan = json.loads((tmp / key / "plan.json").read_text())
                plan["tp"] = megatron_map(plan["tp"])
                edited = tmp / f"{key}.plan.json"
                edited.write_text(json.dumps(plan))
                res = compile_model(str(path), gpus=tp * pp * dp, from_plan=str(edited), seq_len=seq_len,
                                    out_dir=tmp / key, force=True)
        except Exception as e:  # noqa: BLE001 - one refused compile must not sink the others
            line = f"error: {e}" if isinstance(e, PartcError) else f"{type(e).__name__}: {e}"
            cells[run] = (line.splitlines() or ["?"])[0]
            continue
        split = sum(style != "replicate" for style in res.plan.tp.values())
        jobs[run] = {"out": str(tmp / key), "steps": STEPS, "init": str(init), "result": str(tmp / f"{key}.pt"),
                     "model": str(path), "seq_len": seq_len, "split": split if tp > 1 else None, **SGD}
    return jobs, cells


def torchrun(jobs: list[dict], tmp: Path, name: str, timeout: float) -> tuple[int | None, str]:
    path = tmp / f"jobs_{name}.json"
    keys = ("out", "steps", "init", "result", "optimizer", "lr", "weight_decay")
    path.write_text(json.dumps([{k: j[k] for k in keys} for j in jobs]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "partc.runtime.testing", str(path)]
    code, out, _ = run_group(cmd, timeout, env={"OMP_NUM_THREADS": "1"})
    return code, out


def run_tiny(jobs: list[dict], tmp: Path) -> dict[str, str]:
    """All jobs in one launch. The driver runs them in order and rank 0 writes each result as its job ends, so when
    a launch fails, the first job without a result is the one that failed: it gets the launch's first error line,
    and the jobs after it run in a new launch. Returns the error line of each job that failed, by its result path."""
    errors: dict[str, str] = {}
    launch = 0
    while jobs:
        code, out = torchrun(jobs, tmp, str(launch), LAUNCH_TIMEOUT_S + JOB_TIMEOUT_S * len(jobs))
        launch += 1
        if code == 0:
            break
        failed = next((i for i, j in enumerate(jobs) if not Path(j["result"]).exists()), None)
        if failed is None:  # every job wrote its result, then the launch failed on the way out
            break
        errors[jobs[failed]["result"]] = first_error(out) if code is not None else "timed out"
        print(f"tiny run {Path(jobs[failed]['out']).name} failed: {errors[jobs[failed]['result']]}", file=sys.stderr)
        jobs = jobs[failed + 1:]
    return errors


def judge(job: dict) -> tuple[str, float | None]:
    """Compare a job's losses with one process: (cell, worst relative difference)."""
    import torch

    from partc.runtime.testing import reference_run

    got = torch.load(job["result"], weights_only=True)["losses"]
    init = torch.load(job["init"], weights_only=True)
    want, _ = reference_run(job["model"], init, steps=STEPS, seed=0, global_batch_size=TINY_BATCH,
                            seq_len=job["seq_len"], micro_batch_size=1, **SGD)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    split = "" if job["split"] is None else f" ({job['split'] or 'none'} split)"
    if len(got) == len(want) and worst <= RTOL:
        return f"ok{split}", worst
    return f"FAIL{split}: rel. diff {worst:.1e}", None


# -- table ----------------------------------------------------------------------------------------------------------


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", choices=list(BY_NAME), default=list(BY_NAME), metavar="NAME",
                    help=f"a subset, of: {' '.join(BY_NAME)}")
    ap.add_argument("--skip-full", action="store_true", help="no full-size compiles")
    ap.add_argument("--skip-tiny", action="store_true", help="no tiny runs on 2 gloo ranks")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per full-size compile (default 300)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs of every full-size compile (default: the family's)")
    args = ap.parse_args(argv)
    fams = [BY_NAME[n] for n in args.families]
    rows = {f.name: {"family": f.name, "size": f.size, "gpus": str(args.gpus or f.gpus)} for f in fams}

    with tempfile.TemporaryDirectory(prefix="partc_zoo_") as d:
        tmp = Path(d)
        if not args.skip_full:
            for f in fams:
                print(f"compiling {f.name} ({f.size}) on {args.gpus or f.gpus} GPUs ...", file=sys.stderr)
                rows[f.name].update(compile_full(f, tmp, args.gpus or f.gpus, args.timeout))
        worst = 0.0
        if not args.skip_tiny:
            import torch

            torch.set_num_threads(1)
            all_jobs: list[tuple[str, str, dict]] = []
            for f in fams:
                print(f"compiling tiny {f.name} ...", file=sys.stderr)
                jobs, cells = compile_tiny(f, tmp)
                rows[f.name].update(cells)
                all_jobs += [(f.name, run, job) for run, job in jobs.items()]
            print(f"running {len(all_jobs)} tiny programs on 2 gloo ranks ...", file=sys.stderr)
            errors = run_tiny([job for *_, job in all_jobs], tmp) if all_jobs else {}
            for name, run, job in all_jobs:
                if job["result"] in errors:
                    rows[name][run] = errors[job["result"]]
                    continue
                try:
                    rows[name][run], diff = judge(job)
                except Exception as e:  # noqa: BLE001 - the reference of one family must not sink the table
                    rows[name][run], diff = f"reference: {type(e).__name__}: {e}".splitlines()[0], None
                worst = max(worst, diff or 0.0)

    cols = ["family", "size", "gpus"]
    heads = ["family", "size", "GPUs"]
    if not args.skip_full:
        cols += ["compile", "plan", "predicted"]
        heads += ["compile s", "plan", "predicted"]
    if not args.skip_tiny:
        cols += list(TINY_RUNS)
        heads += list(TINY_RUNS)
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for f in fams:
        print("| " + " | ".join(cell(rows[f.name].get(c, "")) for c in cols) + " |")
    if not args.skip_tiny:
        print(f"\nworst relative loss difference of the tiny runs that passed: {worst:.1e} (bar {RTOL:.0e})")
    return 0


if __name__ == "__main__":
    from record import recorded

    sys.exit(recorded("zoo", main, markdown=True))
