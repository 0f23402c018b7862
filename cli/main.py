"""The `partc` command line.

    partc compile examples/gpt3_175b.py --gpus 512

Every user error prints one line (``error: ...``) and exits with code 2, without a traceback.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from partc.cluster import PRESETS, Cluster
from partc.errors import PartcError
from partc.parallel import PINNABLE, SHOWN_AXES, Parallel, Pins, check_gpus

GiB = 1024**3


class _Group(click.Group):
    """Turns `PartcError` and click's usage errors (bad option values, missing options) into one line and exit
    code 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except PartcError as e:
            click.echo(f"error: {one_line(str(e))}", err=True)
            sys.exit(2)
        except click.UsageError as e:
            command = e.ctx.command_path if e.ctx is not None else ctx.command_path
            click.echo(f"error: {one_line(e.format_message())} (see '{command} --help')", err=True)
            sys.exit(2)


def one_line(text: str) -> str:
    """An error message as one line, whatever names from the user's files it quotes."""
    return " ".join(text.splitlines())


@click.group(cls=_Group)
@click.version_option(package_name="partc")
def main():
    """partc: plan and run DP x TP x PP x ZeRO training for an unmodified PyTorch model."""


def _pos_int(ctx, param, value):
    if value is not None and value < 1:
        raise click.BadParameter("must be a positive integer")
    return value


def _pin_options(command):
    """One ``--NAME`` option per choice of `Parallel` a user may pin (`PINNABLE`), from the field's metadata."""
    for f in reversed(PINNABLE):
        meta = f.metadata
        if f.type in ("bool", bool):  # a flag and its negation: --sequence-parallel / --no-sequence-parallel
            name = f.name.replace('_', '-')
            command = click.option(f"--{name}/--no-{name}", f.name, default=None, help=meta["help"])(command)
            continue
        if meta["choices"] is not None and f.type in ("int", int):
            kind = click.IntRange(min(meta["choices"]), max(meta["choices"]))
        elif meta["choices"] is not None:
            kind = click.Choice(meta["choices"])
        elif f.type in ("float", float):  # finite, from its minimum (`partc.parallel._check_value` says why not)
            kind = click.FloatRange(min=meta["min"])
        else:
            kind = int
        command = click.option(f"--{f.name.replace('_', '-')}", f.name, type=kind, default=None, help=meta["help"],
                               callback=_pos_int if meta["min"] == 1 and kind is int else None)(command)
    return command


@main.command("compile")
@click.argument("model_file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--gpus", type=int, required=True, help="Number of GPUs to plan for.")
@click.option("--entry", default="model", show_default=True, help="Function in MODEL_FILE that returns the model.")
@click.option("--cluster", default="a100-80g", show_default=True,
              help=f"Preset ({', '.join(PRESETS)}) or a JSON file of cluster fields.")
@click.option("--gpus-per-node", type=int, default=None, callback=_pos_int,
              help="GPUs per node (default: the cluster's, 8).")
@click.option("--global-batch-size", type=int, default=None, callback=_pos_int,
              help="Samples per optimizer step (default: about 2M tokens, a multiple of --gpus).")
@click.option("--seq-len", type=int, default=None, callback=_pos_int,
              help="Tokens per sample for a Hugging Face model without example_inputs (default: min(1024, max "
                   "positions)).")
@_pin_options
@click.option("--from-plan", "from_plan", type=str, default=None,
              help="Skip the search: validate and re-predict this plan.json (it replaces the pins).")
@click.option("-o", "--out", "out_dir", default="partc_out", show_default=True,
              help="Output directory: new, empty, or an earlier output of partc compile (which it replaces).")
@click.option("--force", is_flag=True,
              help="Replace an earlier output even where its plan.json or program/ was changed since partc wrote it.")
@click.option("--dump-dir", default=None, help="Also write graph.txt and costs.json here.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True,
              help="json: print the plan JSON to stdout instead of the summary.")
@click.option("--no-vocab-parallel-loss", "no_vocab_loss", is_flag=True,
              help="Under tp, gather the logits whole for the loss even where partc can compute it on the "
                   "vocabulary shards (docs/vocab-parallel-loss.md).")
def compile_cmd(model_file, gpus, entry, cluster, gpus_per_node, global_batch_size, seq_len, from_plan, out_dir,
                force, dump_dir, fmt, no_vocab_loss, **pinned):
    """Plan MODEL_FILE for --gpus GPUs: write OUT/plan.json and print why."""
    from partc.compile import compile_model

    check_gpus(gpus)
    pins = Pins(**pinned)
    # The model's code runs inside (import, model(), example_inputs, its forward while traced): what it prints goes
    # to stderr, so stdout holds partc's output alone (--format json: the plan, nothing else).
    try:
        with contextlib.redirect_stdout(sys.stderr), phase_progress() as on_phase:
            result = compile_model(model_file, gpus=gpus, entry=entry, cluster=cluster, gpus_per_node=gpus_per_node,
                                   global_batch_size=global_batch_size, seq_len=seq_len, pins=pins,
                                   from_plan=from_plan, out_dir=out_dir, dump_dir=dump_dir, force=force,
                                   on_phase=on_phase, vocab_parallel_loss=not no_vocab_loss)
    except SystemExit as e:  # the model's forward called sys.exit() while traced
        raise PartcError(f"the model's code called sys.exit({e.code!r}) during partc compile") from None
    if fmt == "json":
        click.echo(result.plan.to_json(), nl=False)
    else:
        print_summary(result, Path(out_dir) / "plan.json")
    for line in result.warnings:
        click.echo(f"warning: {one_line(line)}", err=True)


@contextlib.contextmanager
def phase_progress():
    """A progress bar over `partc.compile.PHASES` on stderr while partc compile works, when stderr is a terminal
    (never in a pipe or a log); yields the `on_phase` callback."""
    from partc.compile import PHASES

    if not sys.stderr.isatty():
        yield None
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=Console(file=sys.stderr), transient=True) as bar:
        task = bar.add_task(PHASES[0], total=len(PHASES))

        def on_phase(i: int, what: str) -> None:
            bar.update(task, completed=i, description=what, refresh=True)

        yield on_phase


def compress_modules(modules: list[str]) -> str:
    """``blocks.0, blocks.1, blocks.2`` -> ``blocks.0-2``."""
    out: list[str] = []
    run: tuple[str, int, int] | None = None
    for m in modules:
        match = re.fullmatch(r"(.*)\.(\d+)", m)
        if match and run and run[0] == match.group(1) and run[2] + 1 == int(match.group(2)):
            run = (run[0], run[1], int(match.group(2)))
            continue
        if run:
            out.append(f"{run[0]}.{run[1]}" + (f"-{run[2]}" if run[2] != run[1] else ""))
            run = None
        if match:
            run = (match.group(1), int(match.group(2)), int(match.group(2)))
        else:
            out.append(m)
    if run:
        out.append(f"{run[0]}.{run[1]}" + (f"-{run[2]}" if run[2] != run[1] else ""))
    return ", ".join(out)


TP_WHY_ROWS = 12
"""Rows of the summary's table of layers tensor parallelism keeps whole (the rest: plan.json's tp_why)."""


def tp_why_table(why: dict[str, str], styles: dict[str, str], tp: int) -> Table:
    """Layers kept whole (or off Megatron's pattern) at degree `tp`, one row per layer name (block indices as
    ``*``), style and reason."""
    groups: dict[tuple[str, str, str], int] = {}
    for fqn, reason in why.items():
        key = (re.sub(r"\.\d+(?=\.|$)", ".*", fqn), styles[fqn], reason)
        groups[key] = groups.get(key, 0) + 1
    t = Table(title=f"Layers not split as Megatron-LM splits them (tp={tp})", title_justify="left")
    for col in ("layers", "count", "style", "why"):
        t.add_column(col, justify="right" if col == "count" else "left")
    for (name, style, reason), n in list(groups.items())[:TP_WHY_ROWS]:
        t.add_row(escape(name), str(n), style, escape(reason))
    if len(groups) > TP_WHY_ROWS:
        t.add_row(f"and {len(groups) - TP_WHY_ROWS} more", "", "", "see tp_why in plan.json")
    return t


def print_summary(result, plan_path: Path) -> None:
    plan = result.plan.to_dict()
    pred, par, model = plan["predicted"], plan["parallel"], plan["model"]
    console = Console(highlight=False, width=max(Console().width, 100))
    # Names from the model and the cluster file are text, never markup: each goes through `escape`.
    console.print(f"[bold]{escape(model['name'])}[/]: {model['num_params'] / 1e9:.2f}B parameters, "
                  f"{model['num_units']} units; {result.plan.parallel.world_size} x "
                  f"{escape(result.plan.cluster['gpu'])}")
    t = Table(title="Plan", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    shown = result.plan.parallel
    row = "  ".join(f"{axis}={par[axis]}" for axis in shown.shown_axes()) + f"  zero={par['zero']}"
    row += f"  ep={shown.ep}" if shown.ep > 1 else ""
    row += "  sequence parallel" if shown.sequence_parallel else ""
    row += " (inputs re-gathered)" if shown.sp_regather else ""
    row += "  fused pointwise" if shown.fuse_pointwise else ""
    t.add_row("parallel", row)
    t.add_row("batch", f"global {par['global_batch_size']} = dp {par['dp']} x micro-batch {par['micro_batch_size']} "
                       f"x {par['num_microbatches']} micro-batches")
    sched = par["schedule"] + (f" (v={par['virtual_stages']})" if par["virtual_stages"] > 1 else "")
    t.add_row("schedule", f"{sched}, recompute {par['recompute']}")
    inner = [f for f, style in plan["tp"].items() if style == "inner"]
    if inner:  # a mixture of experts (`partc.passes.experts`)
        out = "the tokens all-gathered, the output reduce-scattered" if par.get("sequence_parallel") else \
            "the output all-reduced once"
        t.add_row("experts", f"{len(inner)} layers split inside over tp={par['tp']} (gate and up colwise, down "
                             f"rowwise, {out})")
    t.add_row("step time", f"{pred['step_time_s']:.3f} s")
    unit = model.get("throughput_unit", "tokens")
    t.add_row("throughput", f"{pred[f'{unit}_per_s']:,.0f} {unit}/s")
    t.add_row("model TFLOP/s per GPU", f"{pred['model_tflops_per_gpu']:.1f}  (MFU {pred['mfu'] * 100:.1f}%)")
    t.add_row("pipeline bubble", f"{pred['bubble_fraction'] * 100:.1f}%")
    b = pred["breakdown_s"]
    t.add_row("step breakdown", "  ".join(f"{k} {v:.3f}s" for k, v in b.items()))
    mem = pred["memory_per_gpu"]
    usable = Cluster.from_dict(result.plan.cluster).usable_memory_bytes / GiB
    t.add_row("memory (most loaded GPU)",
              f"params {mem['params'] / GiB:.1f} + grads {mem['grads'] / GiB:.1f} + optimizer "
              f"{mem['optimizer'] / GiB:.1f} + activations {mem['activations'] / GiB:.1f} = "
              f"{mem['total'] / GiB:.1f} GiB of {usable:.1f} GiB usable")
    console.print(t)

    if plan["tp_why"]:
        console.print(tp_why_table(plan["tp_why"], plan["tp"], par["tp"]))

    s = Table(title="Stages (per pipeline rank)", title_justify="left")
    for col in ("rank", "modules", "time/micro-batch", "memory"):
        s.add_column(col, justify="left" if col == "modules" else "right")
    ranks: dict[int, list[str]] = {}
    for st in plan["stages"]:
        ranks.setdefault(st["rank"], []).extend(st["modules"])
    for rank in result.best.prediction.ranks:
        s.add_row(str(rank.rank), escape(compress_modules(ranks.get(rank.rank, []))), f"{rank.time_s * 1e3:.1f} ms",
                  f"{rank.memory.total / GiB:.1f} GiB")
    console.print(s)

    if plan["alternatives"]:
        a = Table(title="Next best plans", title_justify="left")
        for col in ("plan", "step time", "vs chosen", "memory"):
            a.add_column(col, justify="left" if col == "plan" else "right")
        for alt in plan["alternatives"]:
            a.add_row(Parallel.from_dict(alt["parallel"]).summary(), f"{alt['step_time_s']:.3f} s",
                      f"+{(alt['step_time_s'] / pred['step_time_s'] - 1) * 100:.1f}%",
                      f"{alt['memory_bytes'] / GiB:.1f} GiB")
        console.print(a)
    timings = result.timings
    searched = ""
    if result.search is not None:
        searched = f"; {result.search.considered} plans considered, {result.search.evaluated} evaluated in full"
    program = plan_path.parent / "program"
    files = f"{len(plan['stages'])} stage file" + ("s" if len(plan["stages"]) > 1 else "")
    console.print(f"wrote {escape(str(plan_path))} and {escape(str(program))}/ ({files})  (trace "
                  f"{timings['trace']:.1f}s, passes {timings['passes']:.1f}s, solve {timings['solve']:.1f}s, codegen "
                  f"{timings['codegen']:.1f}s{searched})")
    out = escape(str(plan_path.parent))
    console.print(f"run it: partc run {out} --steps N   (or torchrun --nproc-per-node "
                  f"{result.plan.parallel.world_size} -m partc.runtime {out} ...)")


@main.command("run", context_settings={"ignore_unknown_options": True})
@click.argument("out_dir", type=str)
@click.option("--nproc-per-node", type=int, default=None, callback=_pos_int,
              help=f"Processes to start; must equal the plan's {' x '.join(SHOWN_AXES)} (the default).")
@click.argument("runtime_args", nargs=-1, type=click.UNPROCESSED)
def run_cmd(out_dir, nproc_per_node, runtime_args):
    """Train OUT_DIR's program here: torchrun with the plan's world size.

    RUNTIME_ARGS go to `python -m partc.runtime` (--steps, --lr, --optimizer, --checkpoint-dir, --resume,
    --collective-timeout, ...; see `python -m partc.runtime --help`); they are checked before any process starts.
    SIGTERM or Ctrl-C stops every rank; a failure prints one line per failing rank."""
    from partc.runtime.launch import run

    sys.exit(run(out_dir, list(runtime_args), nproc_per_node))


@main.command("check")
@click.argument("out_dir", type=str)
@click.option("--optimizer", type=click.Choice(["adamw", "sgd"]), default="adamw", show_default=True,
              help="The optimizer `partc run` will use (its states are part of the memory).")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True,
              help="json: print the measurements and the comparison as JSON to stdout.")
@click.option("--slack-bytes", type=click.IntRange(min=0), default=2**20, show_default=True,
              help="Differences up to this many bytes agree whatever the fraction.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=1, show_default=True,
              help="Pipeline ranks checked at once, each in a process of its own (one CPU core and the memory of "
                   "one rank's bookkeeping each).")
@click.option("--pp-ranks", callback=lambda ctx, param, value: _rank_list(value), metavar="LIST",
              help="Check only these pipeline ranks: comma-separated numbers or ranges, e.g. 0,15 (the first and "
                   "last of 16) or 0-3. Default: every pipeline rank.")
def check_cmd(out_dir, optimizer, fmt, slack_bytes, jobs, pp_ranks):
    """Run one step of every pipeline rank of OUT_DIR's program on this CPU (fake tensors, a fake process group of
    the plan's world size) and compare its memory and traffic with the plan.

    Exit 0 when every number agrees with the plan within 10% (or --slack-bytes) and every rank fits its GPU; 1
    otherwise, listing the rows that disagree."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from partc.runtime.check import TOLERANCE, check_program

    err = Console(stderr=True, highlight=False)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, transient=fmt == "json") as bar:
        task = bar.add_task("checking", total=None)

        def progress(done: int, rank: int) -> None:
            what = f"checking pipeline rank {done} (global rank {rank})" if rank >= 0 else "checked"
            bar.update(task, completed=done, description=what)

        def started(total: int) -> None:
            bar.update(task, total=total)

        # The model's code runs inside: what it prints goes to stderr, so stdout holds partc's output alone.
        with contextlib.redirect_stdout(sys.stderr):
            try:
                results = check_program(out_dir, optimizer=optimizer, slack_bytes=slack_bytes, jobs=jobs,
                                        pp_ranks=pp_ranks, progress=progress, started=started)
            except PartcError:
                raise
            except Exception as e:  # any other failure of the check: one line too (exit 2), not a traceback
                what = (str(e).strip().splitlines() or [""])[0].strip()[:300]
                raise PartcError(f"partc check failed: {type(e).__name__}: {what}") from None
    rows = [row for r in results for row in r.rows()]
    bad = [row for row in rows if not row.agrees]
    unfit = [r for r in results if not r.fits]
    worst = max(rows, key=lambda row: abs(row.error))
    if fmt == "json":
        click.echo(json.dumps({"tolerance": TOLERANCE, "ranks": [r.to_dict() for r in results],
                               "worst_error": worst.error, "worst": worst.what, "worst_pp_rank": worst.pp_rank,
                               "pp_ranks_checked": [r.pp_rank for r in results],
                               "agrees": not bad, "fits": not unfit}, indent=2, sort_keys=True))
    else:
        print_check(results, worst, bad, unfit, TOLERANCE, subset=pp_ranks is not None)
    _report(out_dir, measured=[r.to_dict() for r in results])
    sys.exit(1 if bad or unfit else 0)


def _rank_list(text: str | None) -> list[int] | None:
    """'0,15' or '0-3,7' -> the numbers it names (None: every rank); click's one-line error otherwise."""
    if text is None:
        return None
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if m is None or (m[2] is not None and int(m[2]) < int(m[1])):
            raise click.BadParameter(f"{part.strip()!r} is not a rank or a range such as 0-3 (the list: numbers "
                                     f"and ranges separated by commas, e.g. 0,15)", param_hint="--pp-ranks")
        out += range(int(m[1]), int(m[2] or m[1]) + 1)
    return out


def _report(out_dir, **measurements) -> None:
    """Draw OUT/report.html again with `measurements`; a report that cannot be written is a warning."""
    from partc import report

    try:
        path = report.write(out_dir, **measurements)
    except PartcError as e:
        click.echo(f"warning: report.html not written: {one_line(str(e))}", err=True)
    else:
        click.echo(f"wrote {path}", err=True)


@main.command("report")
@click.argument("out_dir", type=str)
@click.option("--log", "log_path", default=None, help="A `partc run --log-jsonl` log: the loss curve and the measured "
                                                       "step time and memory against the predicted.")
@click.option("--check", "check_path", default=None,
              help="`partc check --format json` saved to a file: the measured memory and traffic.")
def report_cmd(out_dir, log_path, check_path):
    """Draw OUT_DIR/report.html again from its plan, with a training log and partc check's measurements."""
    from partc import report

    log = report.read_log(log_path) if log_path else None
    measured = report.read_check(check_path) if check_path else None
    click.echo(f"wrote {report.write(out_dir, measured=measured, log=log)}")


def _bytes(n: float) -> str:
    """Bytes as GiB, MiB or KiB, whichever reads best."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def print_check(results, worst, bad, unfit, tolerance: float, subset: bool = False) -> None:
    console = Console(highlight=False, width=max(Console().width, 100))
    for r in results:
        coords = ", ".join(f"{axis} {r.coords[axis]}" for axis in SHOWN_AXES if axis != "pp")
        t = Table(title=f"Pipeline rank {r.pp_rank} (global rank {r.rank}: {coords}; {r.seconds:.1f} s)",
                  title_justify="left")
        for col in ("", "predicted", "measured", "error", ""):
            t.add_column(col, justify="left" if not col else "right")
        for row in r.rows():
            t.add_row(row.what, _bytes(row.predicted), _bytes(row.measured), f"{row.error * 100:+.1f}%",
                      "ok" if row.agrees else "[bold red]DISAGREES[/]")
        fit = "fits" if r.fits else "[bold red]DOES NOT FIT[/]"
        t.caption = (f"peak {_bytes(r.memory_bytes['total'])} + communicators "
                     f"{_bytes(r.predicted_memory_bytes.get('buffers', 0))} = {_bytes(r.needed_bytes)} of "
                     f"{_bytes(r.usable_bytes)} usable: {fit}")
        t.caption_justify = "left"
        console.print(t)
    console.print(f"worst error {worst.error * 100:+.1f}% ({worst.what}, pipeline rank {worst.pp_rank}); tolerance "
                  f"{tolerance * 100:.0f}% or {_bytes(worst.slack)}")
    for row in bad:
        console.print(f"[bold red]disagrees[/]: pipeline rank {row.pp_rank} {row.what}: predicted "
                      f"{_bytes(row.predicted)}, measured {_bytes(row.measured)} ({row.error * 100:+.1f}%)")
    for r in unfit:
        console.print(f"[bold red]does not fit[/]: pipeline rank {r.pp_rank} needs {_bytes(r.needed_bytes)}, "
                      f"{_bytes(r.usable_bytes)} usable")
    if not bad and not unfit:
        if subset:
            console.print(f"pipeline ranks {', '.join(str(r.pp_rank) for r in results)} agree with the plan and fit "
                          f"(the other pipeline ranks were not checked)")
        else:
            console.print("the program agrees with the plan and fits")


if __name__ == "__main__":  # pragma: no cover
    main()
