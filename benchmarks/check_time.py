"""How long `partc check` takes on the default plans of large models, and whether they pass.

    python benchmarks/check_time.py                          # every case, every pipeline rank (long on 2 cores)
    python benchmarks/check_time.py --cases gpt3-175b --pp-ranks 0

Each case compiles its model with `partc compile`'s defaults (nothing pinned) into a temporary directory, then runs
`partc.runtime.check` on the representative of each pipeline rank (``--pp-ranks``: a subset), one after another in
this process, and prints per rank: seconds, the measured peak against the plan's, the worst row and whether it agrees.

    gpt3-175b    examples/gpt3_175b.py, 512 x a100-80g
    llama2-70b   PARTC_LLAMA_SIZE=llama2-70b examples/llama.py, 64 x h100-80g
    hf-llama3-8b benchmarks/models/hf_llama3_8b.py (Hugging Face transformers, from its config), 8 x h100-80g
    gpt-1t       PARTC_GPT_SIZE=1008b examples/gpt.py (Megatron-LM's Table 1 1T GPT), 3072 x a100-80g

Measured 2026-11-30 on the development machine (2 CPU cores shared with other jobs, so wall seconds run 2-5x the CPU
seconds; torch 2.13 CPU), with `partc check OUT --format json` (GPT-3, every rank) and `check_rank` (LLaMA):

GPT-3 175B / 512 A100 (default plan: dp 8, tp 4, pp 16, ZeRO-1, interleaved 1F1B v = 3, 128 micro-batches of 1),
`partc check OUT --jobs 2 --format json`: 12.9 min wall (shared with two benchmarks), 21.3 min CPU for the 16
pipeline ranks (64-122 s wall a rank, two at a time). **Exit 0: agrees and fits.** Traffic equals the plan's byte for
byte on every rank (dp 16.3-17.4, tp 193.3-219.6, pp 16.2-19.3 GB), and so do parameters, gradients and optimizer
states (6.8 / 10.9 / 2.7 GB on a middle rank); activations within 0.2% on every rank (rank 0: 47.5 GB, plan 47.4);
peak within 2.1% (rank 0: 68.2 GB, plan 69.2; needed with the communicators 69.5 of 80.5 GB usable).

The previous default plan (dp 16, tp 4, pp 8, v = 6, 64 micro-batches) was checked three times this session. First
(27.6 min wall): dp traffic 3.7x the plan's (torch's interleaved schedule kept 3 of the 6 chunks gathered and gathered
the others again), activations 1.7-1.8x (receive buffers kept for every micro-batch and chunk, 8.9 GB on rank 0),
three ranks not fitting. After the runtime's schedule (`partc.runtime.schedule`: each chunk gathered once a step,
receive buffers only while used) and the cost model's walk of the schedule's order (`partc.passes.schedule`), ZeRO-1
gradients at 4 bytes a parameter, and the check no longer counting what its tracker's hooks kept alive: traffic and
model states equal to the byte, activations 1.4x (under tp 4). After tensor parallelism's whole tensors (the inputs
of colwise layers and what follows rowwise ones: Korthikanti et al.'s "10"), the logit gather, and scattered
boundaries held as copies of their 1/t part: agrees (activations within 2.8%) and fits (80.1 of 80.5 GB). Then the
1T GPT's last stage showed ZeRO-1's fp32 reduction input (4 bytes a parameter of the largest unit, charged as 2);
charged, that plan needs 0.8 GB more and no longer fits, so the search now picks the plan above.

LLaMA-2 70B / 64 H100 (default plan: dp 64, ZeRO-3, pp 1, full recomputation, 2 micro-batches of 4): 195 s wall,
57 s CPU, one pipeline rank. Agrees and fits: dp traffic 1103.6 GB = the plan's byte for byte (332 all-gathers,
166 reduce-scatters); params, grads and optimizer states equal the plan's; activations 41.1 GB (plan 44.4, -7.5%);
peak 58.3 GB (plan 61.6, -5.4%).

Hugging Face LLaMA-3 8B / 8 H100 (default plan, 2026-12-01: dp 4, pp 2, ZeRO-1, interleaved 1F1B v = 5, 128
micro-batches of 4 sequences of 1024 tokens), `check_time.py --cases hf-llama3-8b`: 427 s and 318 s of CPU for the two
pipeline ranks (1713 s and 552 s wall on a machine loaded 4-8 by other jobs; 5.7 min wall for both at load ~2 the day
before). **Both agree and fit**: dp and pp traffic equal the plan's byte for byte (rank 0: 25.4 and 82.7 GB), params,
grads and optimizer states equal; activations -3.3% and -4.6% (31.69 and 30.61 GiB against 32.76 and 32.08), peak
67.17 and 62.44 GiB against 68.25 and 63.90. Two gaps closed for it, each found by this check:
- pp traffic was -2.1%: the rotary tables (cos, sin: 1 x s x head_dim, the same for every sample) cross each pipeline
  boundary once a micro-batch, and the cost model, which traces one sample, charged them per sample, 4x at b = 4. The
  trace now tells what carries the batch (`partc.passes.cuts`: what depends on a user input or on a size of 1, as
  Hugging Face's causal mask, expanded to the batch) from what does not (`ModelGraph.cut_fixed_bytes`); a tiny
  Hugging Face LLaMA at b = 2 is exact to the byte (was -7.1%; tests/test_check.py).
- the last stage's activations were +10.5% (35.0 GB against 31.4, v = 3): torch's schedule keeps each micro-batch's
  loss to the end of the step, and a loss's graph ended in the gradient accumulator of the stage's received input,
  so the last stage held every micro-batch's input (b x s x h) to the end of the step, growing with the number of
  micro-batches (a runtime leak, not only a measurement). The runtime now detaches each loss after its backward
  (`partc.runtime.schedule.PipeStage`; tests/test_check.py: the last rank's activations no longer grow with m).

GPT 1T / 3072 A100 (default plan: dp 12, tp 8, pp 32, ZeRO-1, 1F1B, 256 micro-batches of 1), `--pp-ranks 0 31` (the
first and the last of 32; all 32 take about an hour here): 58 s and 103 s a rank. Both agree and fit: traffic and
model states equal to the byte; rank 0 activations 38.67 GiB (plan 38.44), peak -3.6%; rank 31 activations 7.35 GiB
(plan 7.19), peak 33.96 (plan 33.90). Before ZeRO-1's fp32 reduction input was charged, rank 31's activations were
+27.1% (plan 5.36 GiB).
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
    "hf-llama3-8b": (Path(__file__).resolve().parent / "models" / "hf_llama3_8b.py", 8, "h100-80g", {}),
    "gpt-1t": (EXAMPLES / "gpt.py", 3072, "a100-80g", {"PARTC_GPT_SIZE": "1008b"}),
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
