"""How long `partc check` takes on the default plans of large models, and whether they pass.

    python benchmarks/check_time.py                          # every case, every pipeline rank (long on 2 cores)
    python benchmarks/check_time.py --cases gpt3-175b --pp-ranks 0

Each case compiles its model with `partc compile`'s defaults (nothing pinned) into a temporary directory, then runs
`partc.runtime.check` on the representative of each pipeline rank (``--pp-ranks``: a subset), one after another in
this process, and prints per rank: seconds, the measured peak against the plan's, the worst row and whether it agrees.

    gpt3-175b    examples/gpt3_175b.py, 512 x a100-80g
    llama2-70b   PARTC_LLAMA_SIZE=llama2-70b examples/llama.py, 64 x h100-80g

Measured 2026-11-30 on the development machine (2 CPU cores shared with other jobs, so wall seconds run 2-5x the CPU
seconds; torch 2.13 CPU), with `partc check OUT --format json` (GPT-3, every rank) and `check_rank` (LLaMA):

GPT-3 175B / 512 A100 (default plan: dp 16, tp 4, pp 8, ZeRO-1, interleaved 1F1B v = 6, 64 micro-batches of 1):
27.6 min wall, 11.2 min CPU for the 8 pipeline ranks (130-355 s wall a rank; rank 0 alone: 96 s CPU). Exit 1.

    pp  peak GB (plan)   activations   params        grads         dp comm GB      tp, pp comm   fits 80.5 GB usable
    0   83.8 (70.7)      55.2 (31.4)   7.2 (12.6)    22.5 (23.9)   125.7 (33.7)    = plan        no  (85.1 needed)
    1   81.9 (68.3)      54.1 (30.3)   6.8 (12.2)    21.7 (23.1)   121.4 (32.6)    = plan        no  (82.9)
    2   80.4 (67.2)      52.6 (29.2)   6.8 (12.2)    21.7 (23.1)   121.4 (32.6)    = plan        no  (81.4)
    3   78.8 (66.1)      51.4 (28.1)   6.8 (12.2)    21.7 (23.1)   121.4 (32.6)    = plan        yes (79.9)
    4   77.3 (65.0)      49.6 (26.9)   6.8 (12.2)    21.7 (23.1)   117.8 (32.6)    = plan        yes (78.4)
    5   75.8 (63.9)      48.1 (25.8)   6.8 (12.2)    21.7 (23.1)   117.8 (32.6)    = plan        yes (76.9)
    6   74.3 (62.8)      46.6 (24.7)   6.8 (12.2)    21.7 (23.1)   117.8 (32.6)    = plan        yes (75.4)
    7   73.6 (64.4)      44.9 (25.3)   7.1 (12.6)    22.4 (23.8)   120.9 (33.5)    = plan        yes (74.9)

(optimizer states equal the plan's on every rank.) Two disagreements, both in the program as the runtime builds it:
torch's ScheduleInterleaved1F1B (a ``_PipelineScheduleRuntime``) lowers the schedule with ``_add_unshard_reshard
(max_active_stages=3)``: with v = 6 chunks a rank it reshards a chunk's FSDP groups when the chunk is not among the
next three to run and gathers them again later (rank 0: 130 all-gathers over dp in the step for 14 FSDP groups;
the 14 reduce-scatters are the plan's), so dp traffic is 3.6-3.7x the plan's and fewer gathered parameters are
held at once; and the activations are 1.7-1.8x the plan's, of which the pipeline stages' receive buffers, allocated
for every micro-batch of every chunk and kept (rank 0: 704 of 12 MiB, 8.9 GB, the bytes of its 704 ``irecv``s),
are one part the cost model does not charge. With v = 2 (tests/test_check.py; also checked with 32 micro-batches)
the traffic equals the plan's byte for byte; v = 3 to 5 was not tried.

LLaMA-2 70B / 64 H100 (default plan: dp 64, ZeRO-3, pp 1, full recomputation, 2 micro-batches of 4): 195 s wall,
57 s CPU, one pipeline rank. Agrees and fits: dp traffic 1103.6 GB = the plan's byte for byte (332 all-gathers,
166 reduce-scatters); params, grads and optimizer states equal the plan's; activations 41.1 GB (plan 44.4, -7.5%);
peak 58.3 GB (plan 61.6, -5.4%).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from partc.compile import compile_model
from partc.runtime.check import check_rank, representatives
from partc.runtime.program import read_program

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# case -> (model file, GPUs, cluster, environment)
CASES = {
    "gpt3-175b": (EXAMPLES / "gpt3_175b.py", 512, "a100-80g", {}),
    "llama2-70b": (EXAMPLES / "llama.py", 64, "h100-80g", {"PARTC_LLAMA_SIZE": "llama2-70b"}),
}

GiB = 1024**3


def run(case: str, pp_ranks: list[int] | None, out: Path) -> list[dict]:
    path, gpus, cluster, env = CASES[case]
    os.environ.update(env)
    start = time.perf_counter()
    result = compile_model(str(path), gpus=gpus, cluster=cluster, out_dir=out)
    par = result.plan.parallel
    print(f"{case}: {par.summary()} compiled in {time.perf_counter() - start:.0f} s", flush=True)
    files = read_program(out)
    reps = representatives(par)
    rows = []
    for pp_rank in pp_ranks if pp_ranks is not None else range(par.pp):
        cpu = time.process_time()
        r = check_rank(files, reps[pp_rank])
        cpu = time.process_time() - cpu
        worst = max(r.rows(), key=lambda row: abs(row.error))
        pred_peak = r.predicted_memory_bytes["total"] - r.predicted_memory_bytes["buffers"]
        rows.append({"case": case, "pp_rank": pp_rank, "seconds": r.seconds, "cpu_seconds": cpu,
                     "peak_gib": r.memory_bytes["total"] / GiB, "predicted_gib": pred_peak / GiB,
                     "worst": f"{worst.what} {worst.error * 100:+.1f}%",
                     "agrees": all(row.agrees for row in r.rows()), "fits": r.fits,
                     "categories": {k: round(v / GiB, 2) for k, v in r.memory_bytes.items()},
                     "predicted": {k: round(v / GiB, 2) for k, v in r.predicted_memory_bytes.items()},
                     "comm": r.comm_bytes, "predicted_comm": r.predicted_comm_bytes})
        print(f"  pp rank {pp_rank}: {r.seconds:.0f} s ({cpu:.0f} s of CPU), peak {rows[-1]['peak_gib']:.2f} GiB (plan "
              f"{rows[-1]['predicted_gib']:.2f}), worst {rows[-1]['worst']}, agrees {rows[-1]['agrees']}, "
              f"fits {r.fits}", flush=True)
        print(f"    measured GiB {rows[-1]['categories']}\n    plan GiB     {rows[-1]['predicted']}\n"
              f"    comm {r.comm_bytes}\n    plan {r.predicted_comm_bytes}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--pp-ranks", nargs="+", type=int, default=None,
                        help="pipeline ranks to check (default: all)")
    args = parser.parse_args()
    ok = True
    for case in args.cases:
        with tempfile.TemporaryDirectory() as tmp:
            rows = run(case, args.pp_ranks, Path(tmp) / "out")
        ok &= all(r["agrees"] and r["fits"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
