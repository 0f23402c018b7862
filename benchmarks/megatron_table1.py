"""partc's predicted iteration time against Megatron-LM's published Table 1 (Narayanan et al. 2021).

    python benchmarks/megatron_table1.py            # all 10 rows, about a minute (tracing the big models on meta)

Each run writes what it prints to benchmarks/results/megatron_table1-<date>.md as well (`record.py`).

For each row: the GPT of examples/gpt.py at that size, compiled for `a100-80g` with the paper's run pinned,
``--gpus n --tp t --pp p --global-batch-size B --recompute full --micro-batch-size b`` and
``--schedule interleaved-1f1b`` with v virtual stages where the run interleaved (``1f1b`` otherwise): b and v as
in Megatron-LM's examples/sc21/run_table_1.sh, the script behind the table (``MBS``, and the layers per rank over
``--num-layers-per-virtual-pipeline-stage``; 39B and 1T did not interleave). The search picks the ZeRO stage
(ZeRO-1 moves the same gradient bytes as the paper's all-reduce) and the TP styles and stage split. The last
columns show the plan partc picks when b and v are left to it as well. The published iteration time is
F / (n · TFLOP/s per GPU), F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) the FLOPs the paper counts per iteration
(recompute forward included, as the paper counts them).

A second table (issue 26) sets each row's configuration as the paper ran it, expressed in partc (t, p, b, v, full
recomputation and Megatron-LM's TP map pinned: qkv and fc1 colwise, proj and fc2 rowwise, the token embedding
split over the vocabulary with the tied head colwise, the position embedding and norms whole; the ZeRO stage
searched, as above), beside the plan partc picks with only the GPUs and the global batch pinned (``--gpus n
--global-batch-size B``): predicted seconds per step and MFU (model FLOPs 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)),
no recompute, over n · peak) for both. ``--rows 1.7b,1008b`` restricts both tables to those sizes.

This file is also the model file it compiles (``partc compile benchmarks/megatron_table1.py``): examples/gpt.py's
GPT at ``PARTC_GPT_SIZE``, with Megatron-LM's default dropout of 0.1 after the embedding, on the attention
probabilities and after both residual branches (``--hidden-dropout``, ``--attention-dropout``), which the
paper's runs kept. Steps 1-3 of `partc.compile.compile_model` (load, trace on meta, search) run here directly
so that each size is traced once.
"""

from __future__ import annotations

import dataclasses
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

_GPT_PATH = Path(__file__).resolve().parent.parent / "examples" / "gpt.py"
MEGATRON_DROPOUT = 0.1
"""Megatron-LM's defaults for ``--hidden-dropout`` and ``--attention-dropout``."""


def _examples_gpt():
    from partc.user_code import import_file

    return import_file(_GPT_PATH)


# --- the model file -------------------------------------------------------------------------------------------

def config():
    return dataclasses.replace(_examples_gpt().config(), dropout=MEGATRON_DROPOUT)


def model() -> torch.nn.Module:
    return _examples_gpt().GPT(config())


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return _examples_gpt().example_inputs(batch_size)  # the dropout does not change the tokens


def example_targets(batch_size: int) -> torch.Tensor:
    return _examples_gpt().example_targets(batch_size)


# --- the table ------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Row:
    """One row of Narayanan et al. 2021, Table 1."""

    size: str
    """Key of examples/gpt.py's SIZES."""
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float
    """Published TFLOP/s per GPU."""
    micro_batch: int
    """b of the paper's run (``MBS`` in Megatron-LM's examples/sc21/run_table_1.sh)."""
    virtual_stages: int
    """v of the paper's run: layers per rank / ``--num-layers-per-virtual-pipeline-stage`` (1: plain 1F1B)."""


ROWS = [
    Row("1.7b", 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1),
    Row("3.6b", 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1),
    Row("7.5b", 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1),
    Row("18.4b", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1),
    Row("39.1b", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1),
    Row("76.1b", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3),
    Row("145.6b", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2),
    Row("310.1b", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2),
    Row("529.6b", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3),
    Row("1008b", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1),
]
SEQ_LEN, VOCAB = 2048, 51200


def published_time(row: Row) -> float:
    """Seconds per iteration: F / (n · TFLOP/s), F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    s, h, l = SEQ_LEN, row.hidden, row.layers
    flops = 96 * row.batch * s * l * h * h * (1 + s / (6 * h) + VOCAB / (16 * l * h))
    return flops / (row.gpus * row.tflops * 1e12)


@contextmanager
def _size(size: str):
    old = os.environ.get("PARTC_GPT_SIZE")
    os.environ["PARTC_GPT_SIZE"] = size
    try:
        yield
    finally:
        if old is None:
            del os.environ["PARTC_GPT_SIZE"]
        else:
            os.environ["PARTC_GPT_SIZE"] = old


def trace_size(size: str):
    """compile_model's steps 1 and 2 for this file at `size`: the `ModelGraph` (one trace on meta)."""
    from partc.model_file import build_on_meta, load_model_file
    from partc.passes.trace import trace

    with _size(size):
        spec = load_model_file(__file__)
        net = build_on_meta(spec)
        with torch.device("meta"):
            args, kwargs = spec.inputs(1)
        return trace(net, args, kwargs, name=f"gpt-{size}", seq_len=spec.seq_len, path=__file__).graph


def pins(row: Row, *, search_batching: bool = False):
    """The run's choices: t, p, full recomputation, and (unless `search_batching`) its b and v."""
    from partc.parallel import Pins

    if search_batching:
        return Pins(tp=row.tp, pp=row.pp, recompute="full",
                    schedule="interleaved-1f1b" if row.pp > 1 else "1f1b")
    v = row.virtual_stages
    return Pins(tp=row.tp, pp=row.pp, recompute="full", micro_batch_size=row.micro_batch,
                schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v if v > 1 else None)


@dataclass(kw_only=True, slots=True)
class Result:
    row: Row
    published_s: float
    predicted_s: float
    candidate: object
    """The `passes.search.Candidate` chosen."""

    @property
    def error(self) -> float:
        return (self.predicted_s - self.published_s) / self.published_s


def predict_row(row: Row, graph, cluster="a100-80g", *, search_batching: bool = False) -> Result:
    """compile_model's step 3 with the row's pins."""
    from partc.cluster import load_cluster
    from partc.passes.search import search

    clus = load_cluster(cluster) if isinstance(cluster, str) else cluster
    best = search(graph, clus, row.gpus, global_batch_size=row.batch,
                  pins=pins(row, search_batching=search_batching)).best
    assert best is not None, f"no plan fits for {row.size}"
    return Result(row=row, published_s=published_time(row), predicted_s=best.step_time_s, candidate=best)


def megatron_map(graph, tp: int) -> dict[str, str] | None:
    """Megatron-LM's TP styles for every layer (`partc.passes.tp.megatron_style` with the vocabulary split; a layer
    the pattern names nothing for stays whole); None at tp 1."""
    from partc.passes.tp import megatron_style

    return {f: megatron_style(f, vocab=True) or "replicate" for f in graph.layers} if tp > 1 else None


def predict_paper_and_free(row: Row, graph, cluster="a100-80g") -> tuple[Result, Result]:
    """(the paper's run with Megatron's map pinned, partc's free choice with only n and B pinned)."""
    from partc.cluster import load_cluster
    from partc.passes.search import search

    clus = load_cluster(cluster) if isinstance(cluster, str) else cluster
    out = []
    for kwargs in (dict(pins=pins(row), tp_pins=megatron_map(graph, row.tp)), {}):
        best = search(graph, clus, row.gpus, global_batch_size=row.batch, **kwargs).best
        assert best is not None, f"no plan fits for {row.size} ({kwargs or 'free'})"
        out.append(Result(row=row, published_s=published_time(row), predicted_s=best.step_time_s, candidate=best))
    return out[0], out[1]


RECOMPUTE_LABEL = {"none": "no-rc", "selective": "sel-rc", "full": "full-rc"}


def _describe(par) -> str:
    """A configuration in one short cell: t, p, d, b, v (interleaved only), ZeRO stage, recomputation."""
    v = f" v{par.virtual_stages}" if par.virtual_stages > 1 else ""
    return (f"t{par.tp} p{par.pp} d{par.dp} b{par.micro_batch_size}{v} z{par.zero} "
            f"{RECOMPUTE_LABEL.get(par.recompute, par.recompute)}")


def print_paper_vs_free(pairs: list[tuple[Result, Result]]) -> None:
    print("\nThe paper's configuration (t, p, b, v, full recompute, Megatron's TP map pinned) against partc's free")
    print("choice (only --gpus and --global-batch-size pinned): predicted seconds per step and MFU.")
    print(f"{'params':>7} {'GPUs':>5} {'B':>5} | {'paper config':<28} {'step':>8} {'MFU':>6} | "
          f"{'partc free':<28} {'step':>8} {'MFU':>6} | {'free vs paper':>13}")
    for paper, free in pairs:
        row, a, b = paper.row, paper.candidate, free.candidate
        print(f"{row.size:>7} {row.gpus:>5} {row.batch:>5} | {_describe(a.parallel):<28} {paper.predicted_s:7.2f}s "
              f"{100 * a.prediction.mfu:5.1f}% | {_describe(b.parallel):<28} {free.predicted_s:7.2f}s "
              f"{100 * b.prediction.mfu:5.1f}% | {100 * (free.predicted_s / paper.predicted_s - 1):+12.1f}%")
    slower = [p.row.size for p, f in pairs if f.predicted_s > p.predicted_s * (1 + 1e-9)]
    print(f"partc's free choice predicted slower than the paper's configuration on: {', '.join(slower) or 'no row'}")


def table(rows=ROWS, cluster="a100-80g", graphs: dict | None = None, *, search_batching: bool = False
          ) -> list[Result]:
    """One `Result` a row; `graphs` (size -> ModelGraph) caches the traces across calls."""
    graphs = {} if graphs is None else graphs
    out = []
    for row in rows:
        if row.size not in graphs:
            graphs[row.size] = trace_size(row.size)
        out.append(predict_row(row, graphs[row.size], cluster, search_batching=search_batching))
    return out


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=None, help="comma-separated sizes (default: all ten)")
    parser.add_argument("--skip-published", action="store_true",
                        help="print only the second table (the paper's configuration against partc's free choice)")
    args = parser.parse_args()
    rows = [r for r in ROWS if args.rows is None or r.size in args.rows.split(",")]
    t0 = time.perf_counter()
    graphs: dict = {}
    if not args.skip_published:
        print_published(table(rows, graphs=graphs), table(rows, graphs=graphs, search_batching=True), t0)
    pairs = []
    for row in rows:
        if row.size not in graphs:
            graphs[row.size] = trace_size(row.size)
        pairs.append(predict_paper_and_free(row, graphs[row.size]))
    print_paper_vs_free(pairs)
    print(f"({time.perf_counter() - t0:.0f} s)")


def print_published(results: list[Result], free: list[Result], t0: float) -> None:
    print("Megatron-LM Table 1 (Narayanan et al. 2021) on a100-80g: published vs predicted iteration time, with the")
    print("paper's micro-batch b and virtual stages v; last columns: the plan partc picks with b and v free.")
    print(f"{'params':>7} {'t':>2} {'p':>3} {'GPUs':>5} {'B':>5} {'b':>2} {'v':>2} | {'published':>9} {'predicted':>9} "
          f"{'error':>7} {'TFLOP/s':>7} | compute/tp/pp/bubble/dp (s)    | partc's pick: b  v  predicted")
    for r, f in zip(results, free):
        c, row = r.candidate, r.row
        par, pred = c.parallel, c.prediction
        tflops = row.tflops * r.published_s / r.predicted_s
        parts = "/".join(f"{x:.2f}" for x in (pred.compute_s, pred.tp_comm_s, pred.pp_comm_s, pred.bubble_s,
                                              pred.dp_comm_s))
        fp = f.candidate.parallel
        print(f"{row.size:>7} {row.tp:>2} {row.pp:>3} {row.gpus:>5} {row.batch:>5} {par.micro_batch_size:>2} "
              f"{par.virtual_stages:>2} | {r.published_s:8.2f}s {r.predicted_s:8.2f}s {100 * r.error:+6.1f}% "
              f"{tflops:7.1f} | {parts:<30} | {fp.micro_batch_size:>14} {fp.virtual_stages:>2} {f.predicted_s:9.2f}s")
    errors = [abs(r.error) for r in results]
    print(f"mean absolute error {100 * sum(errors) / len(errors):.1f}%, max {100 * max(errors):.1f}% "
          f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    from record import recorded

    recorded("megatron_table1", main)
