"""How long `partc compile` takes, from 1.7B to 1T parameters: trace, passes, solve and total seconds.

    python benchmarks/compile_time.py                  # 1.7B, 18.4B, 175B, 529.6B, 1008B (a few minutes)
    python benchmarks/compile_time.py --sizes 1.7b 175b

Each row compiles examples/gpt.py at ``PARTC_GPT_SIZE`` (Megatron-LM's Table 1 sizes, Narayanan et al. 2021, and
GPT-3 175B) for the GPU count of that row of Table 1 (175B: 512 GPUs, the README's command) on ``a100-80g``, with
`partc compile`'s defaults: nothing pinned (the whole search runs) and the default global batch (about 2M tokens,
a multiple of the GPU count). Columns are `compile_model`'s timings:

    trace    torch.export.export on the meta device (one sample)
    passes   measuring the exported graph on meta and building the layer graph (FLOPs, bytes, shard regions)
    solve    the outer search: TP styles (CP-SAT), stage splits (DP) and the cost model for every configuration
    total    everything, loading the model file included (no program is generated: no output directory)

The issue's bar is that searching and solving take no longer than tracing; the last column checks solve <= trace
for each row, and the script exits with status 1 if any row misses it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from partc.compile import compile_model

GPT = str(Path(__file__).resolve().parent.parent / "examples" / "gpt.py")

# size -> GPUs: Narayanan et al. 2021, Table 1; GPT-3 175B (Brown et al. 2020) on 512 GPUs as in the README.
ROWS = {"1.7b": 32, "18.4b": 256, "175b": 512, "529.6b": 2520, "1008b": 3072}


def run(size: str) -> dict:
    gpus = ROWS[size]
    os.environ["PARTC_GPT_SIZE"] = size
    result = compile_model(GPT, gpus=gpus)
    t, par = result.timings, result.plan.parallel
    return {"model": f"GPT {size.upper()}", "params": f"{result.graph.num_params / 1e9:.1f}B", "gpus": gpus,
            "batch": par.global_batch_size,
            "trace": t["trace"], "passes": t["passes"], "solve": t["solve"], "total": t["total"],
            "plans": f"{result.search.considered}/{result.search.evaluated}",
            "chosen": f"({par.dp},{par.tp},{par.pp})", "ok": t["solve"] <= t["trace"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(ROWS), choices=list(ROWS), metavar="SIZE",
                        help=f"model sizes to compile (default: all of {', '.join(ROWS)})")
    args = parser.parse_args()
    head = ("model", "params", "GPUs", "batch", "trace s", "passes s", "solve s", "total s",
            "plans considered/evaluated", "chosen (dp,tp,pp)", "solve <= trace")
    widths = (12, 8, 5, 5, 8, 9, 8, 8, 27, 18, 14)
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    all_ok = True
    for size in args.sizes:
        r = run(size)
        all_ok &= r["ok"]
        cells = (r["model"], r["params"], str(r["gpus"]), str(r["batch"]), f"{r['trace']:.2f}", f"{r['passes']:.2f}",
                 f"{r['solve']:.2f}", f"{r['total']:.2f}", r["plans"], r["chosen"], "yes" if r["ok"] else "NO")
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths)), flush=True)
    print("solve <= trace for every model" if all_ok else "solve > trace for some model (see the last column)")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
