"""The joint choice of TP styles and stage split: the plan with each component's least-time styles only (as the
search chose before) against the plan the search picks among every component's non-dominated (time, parameters)
styles (docs/joint-search.md).

    python benchmarks/joint_search.py                 # GPT 1T pinned as Megatron-LM ran it, and GPT-3 175B free

Each run writes what it prints to benchmarks/results/joint_search-<date>.md as well (`record.py`).

Rows:
- GPT 1T, Megatron-LM's Table 1 shape (Narayanan et al. 2021: 128 layers, hidden 25,600, 160 heads, vocabulary
  51,200; benchmarks/megatron_table1.py's model file) on 512 A100-80GB with t 8, p 64, b 1, global batch 512 and
  full recomputation pinned (dp 1: ZeRO shards nothing); "tok replicate" pins the token embedding replicated: the plan
  issue 26 measured (148.5 s there), which the least-time styles of this version no longer pick;
- GPT-3 175B (examples/gpt3_175b.py's shape, examples/gpt.py at ``175b``) on 512 A100-80GB, nothing pinned but the
  global batch of `partc compile`'s default: the search's CPU seconds with and without the other styles (the
  compile-time bar is benchmarks/compile_time.py's).

"least time only" is the same search with `passes.tp_solve.MAX_CHOICES` set to 1: every component at its least-time
styles, the search before the joint choice. Columns: the token embedding's style, the units of the first and of
the busiest pipeline rank, the slowest rank's seconds per micro-batch, the predicted step time, and the search's
CPU seconds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import megatron_table1 as mt

from partc.cluster import load_cluster
from partc.compile import default_global_batch
from partc.parallel import Pins
from partc.passes import search as search_mod
from partc.passes import tp_solve as tp_mod
from partc.passes.trace import trace

GPT = Path(__file__).resolve().parent.parent / "examples" / "gpt.py"


def trace_gpt(size: str):
    """examples/gpt.py at `size`, traced on meta (as `partc compile` does)."""
    import torch

    from partc.model_file import build_on_meta, load_model_file

    old = os.environ.get("PARTC_GPT_SIZE")
    os.environ["PARTC_GPT_SIZE"] = size
    try:
        spec = load_model_file(str(GPT))
        net = build_on_meta(spec)
        with torch.device("meta"):
            args, kwargs = spec.inputs(1)
        return trace(net, args, kwargs, name=f"gpt-{size}", seq_len=spec.seq_len, path=str(GPT)).graph
    finally:
        if old is None:
            del os.environ["PARTC_GPT_SIZE"]
        else:
            os.environ["PARTC_GPT_SIZE"] = old


def run(graph, gpus: int, batch: int, pins: Pins, choices: int, tp_pins: dict[str, str] | None = None):
    """(the search's result, its CPU seconds) with at most `choices` style maps per (tp, b)."""
    saved = tp_mod.MAX_CHOICES
    tp_mod.MAX_CHOICES = choices
    try:
        c0 = time.process_time()
        result = search_mod.search(graph, load_cluster("a100-80g"), gpus, global_batch_size=batch, pins=pins,
                                   tp_pins=tp_pins)
        return result, time.process_time() - c0
    finally:
        tp_mod.MAX_CHOICES = saved


def row(name: str, graph, result, cpu: float) -> str:
    best = result.best
    emb = next(f for f, layer in graph.layers.items() if layer.kind == "embedding")
    ranks = best.prediction.ranks
    slow = max(ranks, key=lambda r: r.time_s)
    units = [sum(hi - lo for lo, hi in r.chunks) for r in ranks]
    par = best.parallel
    return (f"| {name:<15} | {par.dp},{par.tp},{par.pp} | {best.tp.styles[emb]:<9} | {units[0]:>2} | "
            f"{units[slow.rank]:>2} | {slow.time_s:8.4f} | {best.step_time_s:8.2f} | {cpu:6.1f} |")


def main() -> None:
    print("| plan            | dp,tp,pp | embedding | units rank 0 | units busiest | slowest rank s/micro-batch "
          "| step s | search cpu s |")
    print("|---|---|---|---|---|---|---|---|")
    graph = mt.trace_size("1008b")
    pins = Pins(tp=8, pp=64, micro_batch_size=1, recompute="full")
    for name, choices, tp_pins in (("1T least time", 1, None), ("1T joint", tp_mod.MAX_CHOICES, None),
                                   ("1T tok replicate", 1, {"tok": "replicate"})):
        result, cpu = run(graph, 512, 512, pins, choices, tp_pins)
        print(row(name, graph, result, cpu), flush=True)
        if choices > 1:
            print("    the joint plan's memory choices: " + "; ".join(
                f"{f}: {w}" for f, w in result.best.tp.why.items() if w.startswith("memory: ")) or "none")
    graph = trace_gpt("175b")
    batch = default_global_batch(512, graph.seq_len)  # `partc compile`'s default
    for name, choices in (("175B least time", 1), ("175B joint", tp_mod.MAX_CHOICES)):
        result, cpu = run(graph, 512, batch, Pins(), choices)
        print(row(name, graph, result, cpu), flush=True)


if __name__ == "__main__":
    from record import recorded

    recorded("joint_search", main)
