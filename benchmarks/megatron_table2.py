"""partc's predicted throughput against Megatron-LM's published Table 2 (Narayanan et al. 2021): ZeRO-3 without
model parallelism against PTD-P (tensor + pipeline + data parallelism), 174.6B and 529.6B GPTs, 384 to 2240 A100s.

    python benchmarks/megatron_table2.py            # all 12 rows, a few minutes (two traces on meta)

Each row is compiled for `a100-80g` (math attention, as Megatron-LM ran in 2021; see megatron_table1.py) with the
run's choices pinned: ZeRO-3 over all GPUs (tp = pp = 1) with the row's micro-batch size, or PTD-P's t and p with
micro-batch 1, full recomputation in both; the search picks the rest (the schedule and its v for PTD-P). The
published TFLOP/s per GPU counts F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) FLOPs per iteration, so the published
iteration time is F / (n · TFLOP/s) (calibration.md section 1).

What the table shows: ZeRO-3's traffic per step does not shrink with the GPU count (each micro-batch gathers every
parameter twice and reduce-scatters every gradient), while its compute per GPU does (the global batch is fixed), so
its throughput collapses as GPUs are added; PTD-P's traffic stays inside TP groups and between pipeline stages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from megatron_table1 import SEQ_LEN, VOCAB, trace_size


@dataclass(frozen=True, slots=True)
class Row:
    """One row of Narayanan et al. 2021, Table 2."""

    scheme: str
    """``ZeRO-3`` (no model parallelism) or ``PTD-P``."""
    size: str
    """Key of examples/gpt.py's SIZES."""
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    micro_batch: int
    tflops: float
    """Published TFLOP/s per GPU."""


ROWS = [
    Row("ZeRO-3", "174.6b", 12288, 96, 1, 1, 384, 1536, 4, 144),
    Row("ZeRO-3", "174.6b", 12288, 96, 1, 1, 768, 1536, 2, 88),
    Row("ZeRO-3", "174.6b", 12288, 96, 1, 1, 1536, 1536, 1, 44),
    Row("ZeRO-3", "529.6b", 20480, 105, 1, 1, 640, 2560, 4, 138),  # 560 GPUs did not fit (the paper's footnote)
    Row("ZeRO-3", "529.6b", 20480, 105, 1, 1, 1120, 2240, 2, 98),
    Row("ZeRO-3", "529.6b", 20480, 105, 1, 1, 2240, 2240, 1, 48),
    Row("PTD-P", "174.6b", 12288, 96, 8, 12, 384, 1536, 1, 153),
    Row("PTD-P", "174.6b", 12288, 96, 8, 12, 768, 1536, 1, 149),
    Row("PTD-P", "174.6b", 12288, 96, 8, 12, 1536, 1536, 1, 141),
    Row("PTD-P", "529.6b", 20480, 105, 8, 35, 560, 2240, 1, 171),
    Row("PTD-P", "529.6b", 20480, 105, 8, 35, 1120, 2240, 1, 167),
    Row("PTD-P", "529.6b", 20480, 105, 8, 35, 2240, 2240, 1, 159),
]


def published_time(row: Row) -> float:
    """Seconds per iteration: F / (n · TFLOP/s), F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    s, h, l = SEQ_LEN, row.hidden, row.layers
    flops = 96 * row.batch * s * l * h * h * (1 + s / (6 * h) + VOCAB / (16 * l * h))
    return flops / (row.gpus * row.tflops * 1e12)


def pins(row: Row):
    from partc.parallel import Pins

    if row.scheme == "ZeRO-3":
        return Pins(tp=1, pp=1, dp=row.gpus, zero=3, micro_batch_size=row.micro_batch, recompute="full")
    return Pins(tp=row.tp, pp=row.pp, micro_batch_size=row.micro_batch, recompute="full")


def predict_row(row: Row, graph, cluster: str = "a100-80g"):
    """The search's best plan for the row's pins: (predicted seconds, the candidate)."""
    from partc.cluster import load_cluster
    from partc.passes.search import search

    best = search(graph, load_cluster(cluster), row.gpus, global_batch_size=row.batch, pins=pins(row)).best
    assert best is not None, f"no plan fits for {row}"
    return best.step_time_s, best


def main() -> None:
    t0 = time.perf_counter()
    graphs: dict = {}
    print("Megatron-LM Table 2 (Narayanan et al. 2021) on a100-80g: ZeRO-3 without model parallelism vs PTD-P,")
    print("published vs predicted TFLOP/s per GPU (96·B·s·l·h²·(...) FLOPs per iteration).")
    print(f"{'scheme':>6} {'params':>7} {'t':>2} {'p':>3} {'GPUs':>5} {'B':>5} {'b':>2} | {'published':>9} "
          f"{'predicted':>9} {'error':>7} | step  compute/tp/pp/bubble/dp (s)   | plan")
    errors = []
    for row in ROWS:
        if row.size not in graphs:
            graphs[row.size] = trace_size(row.size)
        predicted_s, best = predict_row(row, graphs[row.size])
        published_s = published_time(row)
        tflops = row.tflops * published_s / predicted_s
        error = (tflops - row.tflops) / row.tflops
        errors.append(abs(error))
        pred = best.prediction
        parts = "/".join(f"{x:.1f}" for x in (pred.compute_s, pred.tp_comm_s, pred.pp_comm_s, pred.bubble_s,
                                              pred.dp_comm_s))
        print(f"{row.scheme:>6} {row.size:>7} {row.tp:>2} {row.pp:>3} {row.gpus:>5} {row.batch:>5} "
              f"{row.micro_batch:>2} | {row.tflops:9.0f} {tflops:9.1f} {100 * error:+6.1f}% | {predicted_s:5.1f} "
              f"{parts:<27} | {best.parallel.summary()}")
    print(f"mean absolute error {100 * sum(errors) / len(errors):.1f}%, max {100 * max(errors):.1f}% "
          f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
