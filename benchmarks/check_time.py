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

`main` writes what it prints to a dated file under benchmarks/results/ (`record.py`); the results of earlier runs,
and what each found, are there too.
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
    from record import recorded

    sys.exit(recorded("check_time", main))
