"""`compile_model`: the whole pipeline, one named step a line.

    load model file -> trace on meta -> layer graph -> search (TP solve, stage split, cost model) -> plan

Each step is a function over typed data; `--dump-dir` writes the intermediate results (`graph.txt`,
`costs.json`) and `--from-plan` replaces the search by a plan read back from disk. The plan of the chosen candidate
(and a plan read back, checked and predicted again) is `partc.compile_plan`'s; the model's further traces (its loss,
its graph at s/cp tokens) are `partc.compile_traces`'. Here: the steps, the check of a sequence-parallel plan
against the program that runs it, and the program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from partc import output, report
from partc.cluster import Cluster, load_cluster
from partc.deferred_init import record
from partc.errors import PartcError
from partc.ir import ModelGraph
from partc.parallel import MAX_BATCH, MAX_GPUS, Pins, check_gpus
from partc.plan import Plan, read_plan
from partc.passes import assemble, cost_step, cost_tp, cost_types
from partc.model_file import ModelSpec, load_model_file
from partc.passes.search import Candidate, SearchResult, search
from partc.passes.codegen import GeneratedProgram, generate
from partc.passes.context import local_inputs
from partc.passes.export import CHECKPOINT_CALLS, export_on_meta
from partc.passes.rebatch import rebatch
from partc.value_sized import EXPECTED_SIZES, expected_sizes
from partc.passes.trace import Traced, trace
from partc import vocab_loss
from partc.compile_plan import dump, make_plan, no_fit_message, replan
from partc.compile_traces import context_graph, find_vocab_loss, meta_inputs
from partc.compile_notes import (batch_norm_note, batch_norms, checkpoint_note, expected_sizes_note,
                                  init_warnings, refuse_single_value_norms, tp_unsplit_note, written_buffers,
                                  written_buffers_note)

DEFAULT_BATCH_TOKENS = 2 * 1024 * 1024
"""Default global batch of a model with token inputs: the smallest multiple of the GPU count holding at least
this many tokens (about 2M, the scale GPT-3 and Megatron-LM trained at)."""
DEFAULT_BATCH_SAMPLES = 1024
"""Default global batch of a model without token inputs (images, features): the smallest multiple of the GPU
count of at least this many samples (ResNet-50 and ViT train on ImageNet with 256 to 4096)."""


@dataclass(kw_only=True, slots=True)
class CompileResult:
    plan: Plan
    best: Candidate
    graph: ModelGraph
    spec: ModelSpec
    traced: Traced
    search: SearchResult | None
    """None with `--from-plan`."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds: trace (export + measure on meta), passes (graph build), solve (search), total."""
    warnings: list[str] = field(default_factory=list)
    """What a run of the program needs to know, one line each (the CLI prints ``warning: LINE``)."""


PHASES = ("loading the model", "tracing", "searching plans", "writing the plan and the program")
"""The phases of `compile_model`, in order (`on_phase`)."""


def default_global_batch(gpus: int, seq_len: int | None) -> int:
    """Samples of the default global batch; `seq_len` None for a model without token inputs."""
    samples = -(-DEFAULT_BATCH_TOKENS // seq_len) if seq_len else DEFAULT_BATCH_SAMPLES
    return max(gpus, -(-samples // gpus) * gpus)


def _collector_paused(fn):
    """`fn` with Python's cyclic garbage collector paused while it runs (its state restored after). A compile builds
    a large heap that lives to its end (the model, its record, the exported graph, the layer graph) and allocates
    millions of short-lived objects on top: each automatic collection walks that heap again, a tenth or more of
    torch.export's time on a large model. Reference counting still frees what is not in a cycle; the cycles left
    are collected afterwards (a few MB on GPT 1008B)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()
    return run


@_collector_paused
def compile_model(path: str, *, gpus: int, entry: str = "model", cluster: str | Cluster = "a100-80g",
                  gpus_per_node: int | None = None, global_batch_size: int | None = None,
                  seq_len: int | None = None, pins: Pins | None = None, from_plan: str | None = None,
                  out_dir: str | Path | None = None, dump_dir: str | Path | None = None,
                  force: bool = False, on_phase: Callable[[int, str], None] | None = None,
                  vocab_parallel_loss: bool = True) -> CompileResult:
    """Plan the model of the file at `path`; with `out_dir`, write the plan and the program there (`partc.output`:
    `force` replaces an earlier output whose files were changed since partc wrote them). `on_phase(i, what)` is
    called as phase i of `PHASES` starts (a progress display). `vocab_parallel_loss` False: under tp, gather the
    logits whole for the loss even where it could run on the vocabulary shards (`partc.vocab_loss`)."""
    on_phase = on_phase or (lambda i, what: None)
    t0 = time.perf_counter()
    check_gpus(gpus)
    clus = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    if gpus_per_node is not None:
        if not 1 <= gpus_per_node <= MAX_GPUS:
            raise PartcError(f"--gpus-per-node must be between 1 and {MAX_GPUS:,}, got {gpus_per_node:,}")
        clus = Cluster.from_dict({**clus.to_dict(), "gpus_per_node": gpus_per_node})
    if global_batch_size is not None and not 1 <= global_batch_size <= MAX_BATCH:
        raise PartcError(f"--global-batch-size must be between 1 and {MAX_BATCH:,} samples, "
                         f"got {global_batch_size:,}")
    plan_in = read_plan(from_plan) if from_plan else None
    if out_dir is not None:
        output.check(out_dir, force=force, keep=from_plan)  # before the work, and again before writing
    if plan_in is not None and pins is not None and pins.pinned():
        raise PartcError(f"--from-plan takes the place of the pins (--{', --'.join(pins.pinned()).replace('_', '-')}); "
                         f"edit the plan instead")

    # 1. Load the model file and build the model on the meta device, recording how it sets each tensor (to name
    #    those `partc run` cannot initialize).
    pins = pins or Pins()
    precision = plan_in.parallel.precision if plan_in is not None else pins.precision or "bf16"
    pins = dataclasses.replace(pins, precision=precision)
    on_phase(0, PHASES[0])
    spec = load_model_file(path, entry=entry, seq_len=seq_len)
    model, init = record(spec.build)
    with torch.device("meta"):
        args, kwargs = spec.inputs(1)

    # 2. Trace (torch.export on meta, at the plan's precision) and build the layer graph.
    on_phase(1, PHASES[1])
    traced = trace(model, args, kwargs, name=spec.name, seq_len=spec.seq_len, path=path, precision=precision,
                   fused_attention=clus.fused_attention)
    graph = traced.graph
    if not graph.units:
        raise PartcError(f"{path}: {entry}() returned a model without parameters ({type(model).__name__}); partc "
                         f"plans the training of a model with parameters")
    graph.vocab_loss, graph.vocab_loss_why = find_vocab_loss(spec, model, traced) if vocab_parallel_loss else \
        ({}, "turned off (--no-vocab-parallel-loss)")
    cp_refused = None
    if pins.cp is not None and pins.cp > 1:  # refused before the search when not proven (one line)
        context_graph(spec, model, traced, pins.cp, path=path, precision=precision)
    t_trace = time.perf_counter()

    # 3. Search, or re-predict a plan read from disk. A BatchNorm that sees one value per channel in a sample
    #    needs micro-batches of two samples or more (its statistics of one value are undefined).
    norms = batch_norms(model, traced)
    on_phase(2, PHASES[2])
    program = None  # a sequence-parallel plan's program, generated to price it and then written
    if plan_in is None:
        gbs = global_batch_size or default_global_batch(gpus, spec.seq_len)
        result = search(graph, clus, gpus, global_batch_size=gbs, pins=pins)
        if result.best is not None and result.best.parallel.micro_batch_size == 1 and norms.single:
            if pins is not None and pins.micro_batch_size == 1:
                refuse_single_value_norms(norms)
            result = search(graph, clus, gpus, global_batch_size=gbs,
                            pins=dataclasses.replace(pins or Pins(), micro_batch_size=2))
        if result.best is not None and result.best.parallel.cp > 1 and pins.cp is None:
            try:  # the search chose context parallelism: the model must be proven for it (else plan without)
                context_graph(spec, model, traced, result.best.parallel.cp, path=path, precision=precision)
            except PartcError as e:
                pins = dataclasses.replace(pins, cp=1)  # and without it below, if sequence parallelism is dropped
                result = search(graph, clus, gpus, global_batch_size=gbs, pins=pins)
                cp_refused = str(e)
        if result.best is None:
            raise PartcError(no_fit_message(clus, result))
        if result.best.parallel.sequence_parallel and pins.sequence_parallel is None:
            # The search chose sequence parallelism, priced with its edges (the embeddings' sum scattered, the
            # final norm's output gathered for the output layer) as the program runs them. Where the program does
            # not keep the split elsewhere (`sequence_fallbacks`), the plan is priced as its program runs
            # (`price_sequence_fallbacks`) and kept only if it still beats the best plan without it.
            sp_plan = make_plan(graph, clus, result.best, result, path=path, entry=entry,
                                tokens=spec.seq_len is not None)
            fallbacks, program = sequence_fallbacks(spec, model, traced, sp_plan, path=path, entry=entry)
            if fallbacks:
                result, program = settle_sequence_parallel(graph, clus, gpus, gbs, pins, result, program)
        best = result.best
    else:
        result = None
        best = replan(graph, clus, gpus, plan_in, global_batch_size)
        if best.parallel.micro_batch_size == 1 and norms.single:
            refuse_single_value_norms(norms)
    t_solve = time.perf_counter()

    # 4. The plan. A sequence-parallel plan whose program falls back to tensor parallelism in places (pinned, or
    #    read from a file) is priced as that program runs: its program is generated here (or was, by the search's
    #    check above) and written in step 5.
    on_phase(3, PHASES[3])
    if best.parallel.sequence_parallel and not best.tp.program:
        program = program or make_program(spec, model, traced, make_plan(graph, clus, best, result, path=path,
                                                                         entry=entry, tokens=spec.seq_len is not None),
                                          path=path, entry=entry)
        if program.sequence_gathers:
            best = price_sequence_fallbacks(graph, clus, best, program)
    plan = make_plan(graph, clus, best, result, path=path, entry=entry, tokens=spec.seq_len is not None)
    if plan_in is not None:
        plan.alternatives = []
    warnings = init_warnings(init)
    if cp_refused:
        warnings.append(f"planned without context parallelism: {cp_refused}")
    unsplit = tp_unsplit_note(graph, best.tp, best.parallel.tp)
    if unsplit:
        warnings.append(unsplit)
    if norms.layers:
        par = best.parallel
        plan.model["batch_norm"] = {"layers": len(norms.layers), "statistics_over_samples": par.micro_batch_size}
        if par.micro_batch_size < par.global_batch_size:
            warnings.append(batch_norm_note(norms, par))
    written = written_buffers(model, traced)
    if written:
        par = best.parallel
        plan.model["buffers_written_in_forward"] = {
            "buffers": sorted(written), "where": [written[b] for b in sorted(written)],
            "updates_per_step": par.num_microbatches, "copies": par.dp}
        if par.micro_batch_size < par.global_batch_size:
            warnings.append(written_buffers_note(written, par))
    calls = traced.exported.graph_module.meta.get(CHECKPOINT_CALLS) or []
    if calls:
        plan.model["user_checkpoint"] = {"calls": sorted(set(calls)), "kept": False,
                                         "recompute": best.parallel.recompute}
        warnings.append(checkpoint_note(calls, best.parallel))

    sizes = traced.exported.graph_module.meta.get(EXPECTED_SIZES)
    if sizes:
        plan.model["expected_sizes"] = dict(sizes, tokens_per_group=f"1/{sizes['groups']}")
        warnings.append(expected_sizes_note(sizes))

    # 5. The sharded program: the traced graph at the micro-batch size, split by stages.
    t_codegen = time.perf_counter()
    if out_dir is not None:
        program = program or make_program(spec, model, traced, plan, path=path, entry=entry)
        if program.sequence_gathers:  # said in the plan, before it is written
            plan.model["sequence_parallel_gathers"] = list(program.sequence_gathers)
            warnings.append(f"sequence parallelism: {len(program.sequence_gathers)} place(s) where the program does "
                            f"not keep the split along the sequence (a whole layer, an op not proven per-position), "
                            f"tensor parallelism there, priced as the program runs it; "
                            f"first: "
                            f"{program.sequence_gathers[0]} (plan.json: model.sequence_parallel_gathers)")
        output.write(out_dir, {"plan.json": plan.to_json(), output.REPORT: report.render(plan.to_dict()),
                               **{f"program/{name}": text for name, text in program.files.items()}},
                     force=force, keep=from_plan)
    t_end = time.perf_counter()
    if dump_dir is not None:
        dump(graph, clus, best, dump_dir)
    timings = {"trace": traced.trace_s, "passes": traced.measure_s, "solve": t_solve - t_trace,
               "codegen": t_end - t_codegen, "total": t_end - t0}
    return CompileResult(plan=plan, best=best, graph=graph, spec=spec, traced=traced, search=result,
                         timings=timings, warnings=warnings)


def sequence_fallbacks(spec: ModelSpec, model: torch.nn.Module, traced: Traced, plan: Plan, *, path: str,
                       entry: str) -> tuple[list[str], GeneratedProgram | None]:
    """Where the program of a sequence-parallel `plan` does not keep the activations split along the sequence
    (`tp_rewrite.Rewrite.sequence_gathers`, one line each; empty: everywhere, as the plan prices it), and that
    program (None where it cannot be generated), which compile writes when it keeps the plan."""
    try:
        program = make_program(spec, model, traced, plan, path=path, entry=entry)
    except PartcError as e:  # the sequence found by the rewrite does not divide over tp
        return [str(e)], None
    return program.sequence_gathers, program


def settle_sequence_parallel(graph: ModelGraph, clus: Cluster, gpus: int, global_batch_size: int, pins: Pins,
                             result: SearchResult, program: GeneratedProgram | None
                             ) -> tuple[SearchResult, GeneratedProgram | None]:
    """The search's best plan, with sequence parallelism, falls back to tensor parallelism somewhere in its
    `program` (None: it cannot be generated): the plan priced as that program runs (`price_sequence_fallbacks`)
    against the best plan without sequence parallelism, the faster that fits kept (ties: without). The best plan
    without it is the first such among the search's alternatives (they are the fastest plans of all, so no plan
    without it beats that one); only when none is there is the search run again, pinned without it. The result's
    alternatives are the plans without sequence parallelism (the others are priced as if they kept the split).
    Returns (the result, the program to write: None when the plan without it is kept)."""
    best = result.best
    priced = price_sequence_fallbacks(graph, clus, best, program) if program is not None else None
    plain = [c for c in result.alternatives if not c.parallel.sequence_parallel]
    if plain:
        without = SearchResult(best=plain[0], alternatives=plain[1:], evaluated=result.evaluated,
                               considered=result.considered)
    else:
        without = search(graph, clus, gpus, global_batch_size=global_batch_size,
                         pins=dataclasses.replace(pins, sequence_parallel=False, sp_regather=None))
    if priced is not None and cost_step.fits(clus, priced.prediction.memory_per_gpu) and \
            (without.best is None or priced.step_time_s < without.best.step_time_s):
        return dataclasses.replace(result, best=priced, alternatives=[c for c in [without.best, *without.alternatives]
                                                                      if c is not None]), program
    if without.best is None:
        raise PartcError(no_fit_message(clus, without))
    return without, None


def price_sequence_fallbacks(graph: ModelGraph, clus: Cluster, best: Candidate,
                             program: GeneratedProgram) -> Candidate:
    """`best`, a sequence-parallel plan, predicted again with the TP collectives its `program` runs
    (`GeneratedProgram.tp_traffic`) charged to the units where their bytes by kind and phase differ from the cost
    model's sequence-parallel ones: where the program falls back to tensor parallelism (a whole layer, an op not
    proven per-position, a rowwise output without a sequence dim), today's collectives inside the unit, and the
    conversions at its edges (the gather of the sequence-split input, the scatter of its whole output: each in the
    unit that runs it). A stage whose units' formulas and program move the same bytes by kind and phase has
    nothing charged: the program runs a collective in a neighbouring unit of the stage (the embeddings' sum enters
    the sequence split in the first block, where the sum is computed; the output layer's input gradient is
    gathered in its unit, not the final norm's), which changes no GPU's bytes or time."""
    par, tp = best.parallel, best.tp

    def key(colls):  # bytes by kind and phase (the formulas sum the norms' gradients in one all-reduce)
        out: dict[tuple[str, str], float] = {}
        for kind, phase, nbytes in colls:
            out[kind, phase] = out.get((kind, phase), 0.0) + nbytes
        return {k: round(v) for k, v in out.items() if round(v)}
    loss = cost_types.VOCAB_LOSS_REASON
    differ = {}
    for lo, hi in best.bounds:
        formulas, runs = [], []
        for unit in graph.units[lo:hi]:
            charged = [(c.kind, c.phase, float(c.nbytes * cost_types.tokens(par)))
                       for c in tp.collectives.get(unit.fqn, []) if c.reason.startswith(loss)]
            formula = cost_tp.unit_collectives(graph, par, tp, unit)
            for c in charged:  # the loss runs these, not the stage code
                formula.remove(c)
            formulas.append(formula)
            runs.append(program.tp_traffic.get(unit.fqn, []))
        if key([c for f in formulas for c in f]) == key([c for r in runs for c in r]):
            continue
        for unit, formula, run in zip(graph.units[lo:hi], formulas, runs):
            if key(formula) != key(run):
                differ[unit.fqn] = run
    priced = dataclasses.replace(tp, program=differ)
    return Candidate(parallel=par, tp=priced, bounds=best.bounds,
                     prediction=assemble.predict(graph, clus, par, priced, best.bounds))


def make_program(spec: ModelSpec, model: torch.nn.Module, traced: Traced, plan: Plan, *, path: str,
                 entry: str) -> GeneratedProgram:
    """The program from the traced graph at the plan's micro-batch size: a copy (codegen rewrites it in place for
    TP) with the batch rescaled (`rebatch`), or, where the rescaling cannot be proven, a second export."""
    b = plan.parallel.micro_batch_size
    ep = traced.exported
    cp = plan.parallel.cp
    split = None
    if cp > 1:  # the graph at the rank's s/cp tokens, proven per position but for what the rewrite replaces
        ep, split = context_graph(spec, model, traced, cp, path=path, precision=plan.parallel.precision)
    if b != 1 or plan.parallel.tp > 1:
        args, kwargs = meta_inputs(spec, b, plan.parallel.precision)
        if split is not None:
            args, kwargs = local_inputs(args, kwargs, split.seq_len, cp)
        ep = rebatch(ep, model, args, kwargs) or export_on_meta(model, args, kwargs, path=path,
                                                                precision=plan.parallel.precision, samples=b)
    vocab = traced.graph.vocab_loss if plan.tp_loss == vocab_loss.VOCAB_PARALLEL else None
    # The TP rewrite runs ops on meta: a value-sized op at its expected size over b samples, as `partc check` does
    with expected_sizes(ep.graph_module.meta, b) or contextlib.nullcontext():
        return generate(ep, model, plan, model_path=spec.path, entry=entry, layers=traced.graph.layers,
                        vocab_loss=vocab, context=split,
                        seq_len=traced.graph.seq_len // cp if traced.graph.seq_len else None)
