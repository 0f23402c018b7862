"""partc's predicted throughput against Megatron-LM's published Table 2 (Narayanan et al. 2021): ZeRO-3 without
model parallelism against PTD-P (tensor + pipeline + data parallelism), 174.6B and 529.6B GPTs, 384 to 2240 A100s.

    python benchmarks/megatron_table2.py            # all 12 rows, about 2 minutes (two traces on meta)

Each run writes what it prints to benchmarks/results/megatron_table2-<date>.md as well (`record.py`).

Each row is compiled for `a100-80g` (math attention, as Megatron-LM ran in 2021; see megatron_table1.py) with the
run's choices pinned: ZeRO-3 over all GPUs (tp = pp = 1) with the row's micro-batch size, or PTD-P's t and p with
micro-batch 1, full recomputation in both; the search picks the rest (the schedule and its v for PTD-P). The
published TFLOP/s per GPU counts F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) FLOPs per iteration, so the published
iteration time is F / (n · TFLOP/s) (as for Table 1, megatron_table1.py).

What the table shows: ZeRO-3's traffic per step does not shrink with the GPU count (each micro-batch gathers every
parameter twice and reduce-scatters every gradient), while its compute per GPU does (the global batch is fixed), so
its throughput collapses as GPUs are added; PTD-P's traffic stays inside TP groups and between pipeline stages.

Two predictions for the ZeRO-3 rows: partc's own plan (FSDP2 over NCCL rings that use every InfiniBand adapter of a
node, fp32 gradient reduction), and `deepspeed_2021_s`, the program the paper measured as its published times imply
(fp16 gradients, one adapter's bandwidth a GPU). docs/cost-model.md ("Validation") discusses the gap.
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

    result = search(graph, load_cluster(cluster), row.gpus, global_batch_size=row.batch, pins=pins(row))
    if result.best is None:
        return None, result
    return result.best.step_time_s, result.best


def deepspeed_2021_s(best, graph, cluster: str = "a100-80g") -> float:
    """The ZeRO-3 step of Table 2's runs (DeepSpeed, 2021) from partc's prediction of its own: the same compute, and
    per micro-batch two all-gathers of the fp16 parameters and a reduce-scatter of the fp16 gradients (DeepSpeed's
    fp16 training reduces in fp16; partc's runtime reduces in fp32) at one InfiniBand adapter's bandwidth per GPU
    (22.5 GB/s; NCCL rings over all 8 adapters of a node reach 8x that, which is what partc's FSDP2 plan is
    charged), one ring latency per layer and call."""
    from partc.cluster import load_cluster
    from partc.passes import hw

    clus, par, pred = load_cluster(cluster), best.parallel, best.prediction
    n, m, psi = par.dp, par.num_microbatches, best.prediction.ranks[0].num_params
    calls = 3 * m * len(graph.units)
    one = hw.collective_time(clus, "all_gather", 2.0 * psi, n, spans_nodes=True)  # one adapter: ranks_per_node 1
    rest = hw.collective_time(clus, "all_gather", 0.0, n, spans_nodes=True, latency_only=True)
    return pred.step_time_s - pred.dp_comm_s + 3 * m * one + (calls - 3 * m) * rest


def main() -> None:
    t0 = time.perf_counter()
    graphs: dict = {}
    print("Megatron-LM Table 2 (Narayanan et al. 2021) on a100-80g: ZeRO-3 without model parallelism vs PTD-P,")
    print("published vs predicted TFLOP/s per GPU (96·B·s·l·h²·(...) FLOPs per iteration). 'partc': the plan partc")
    print("compiles and its runtime would run; 'DeepSpeed': the ZeRO-3 rows' own program (deepspeed_2021_s).")
    print(f"{'scheme':>6} {'params':>7} {'t':>2} {'p':>3} {'GPUs':>5} {'B':>5} {'b':>2} | {'published':>9} "
          f"{'partc':>6} {'error':>7} | {'DeepSpeed':>9} {'error':>7} | step: compute/tp/pp/bubble/dp (s) | plan")
    errors: dict[str, list[float]] = {"partc PTD-P": [], "partc ZeRO-3": [], "DeepSpeed ZeRO-3": []}
    for row in ROWS:
        if row.size not in graphs:
            graphs[row.size] = trace_size(row.size)
        predicted_s, best = predict_row(row, graphs[row.size])
        published_s = published_time(row)
        head = (f"{row.scheme:>6} {row.size:>7} {row.tp:>2} {row.pp:>3} {row.gpus:>5} {row.batch:>5} "
                f"{row.micro_batch:>2} | {row.tflops:9.0f}")
        if predicted_s is None:
            print(f"{head} {'-':>6} {'-':>7} | {'-':>9} {'-':>7} | no plan with these pins fits partc's runtime: "
                  f"it needs {(best.least_memory or float('nan')) / 2**30:.0f} GiB a GPU")
            continue

        def tflops(seconds: float) -> tuple[float, float]:
            value = row.tflops * published_s / seconds
            return value, (value - row.tflops) / row.tflops

        own, own_error = tflops(predicted_s)
        errors[f"partc {row.scheme}"].append(abs(own_error))
        ds = "-" * 9 + " " + "-" * 7
        if row.scheme == "ZeRO-3":
            value, error = tflops(deepspeed_2021_s(best, graphs[row.size]))
            errors["DeepSpeed ZeRO-3"].append(abs(error))
            ds = f"{value:9.1f} {100 * error:+6.1f}%"
        pred = best.prediction
        parts = "/".join(f"{x:.1f}" for x in (pred.compute_s, pred.tp_comm_s, pred.pp_comm_s, pred.bubble_s,
                                              pred.dp_comm_s))
        print(f"{head} {own:6.1f} {100 * own_error:+6.1f}% | {ds} | {predicted_s:5.1f}: {parts:<24} | "
              f"{best.parallel.summary()}")
    for what, errs in errors.items():
        if errs:
            print(f"{what}: {len(errs)} rows, mean absolute error {100 * sum(errs) / len(errs):.1f}%, "
                  f"max {100 * max(errs):.1f}%")
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    from record import recorded

    recorded("megatron_table2", main)
