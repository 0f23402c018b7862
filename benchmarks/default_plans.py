"""The plans partc picks by default (no pins) for three large runs, with what each GPU holds and moves per step.

    python benchmarks/default_plans.py          # three compiles on meta, a few minutes on 2 cores

Each run writes what it prints to benchmarks/results/default_plans-<date>.md as well (`record.py`).

GPT-3 175B on 512 A100-80GB (examples/gpt3_175b.py), LLaMA-2 70B on 64 H100-80GB (examples/llama.py at
``llama2-70b``, 4096 tokens) and a 1T GPT on 3072 A100-80GB (examples/gpt.py at ``1008b``, Megatron-LM's Table 1
model), each at partc's default global batch (about 4M tokens: `partc.compile.default_global_batch`). Each row is
`partc compile`'s choice and its prediction: memory by category on the most loaded pipeline rank against the GPU's
usable memory, and the largest collective payload per GPU and step of any pipeline rank by mesh axis
(`predicted.ranks`, which `partc run --log-jsonl` measures).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RUNS = [
    # (name, model file, size variable, size, GPUs, cluster)
    ("GPT-3 175B", "examples/gpt3_175b.py", None, None, 512, "a100-80g"),
    ("LLaMA-2 70B", "examples/llama.py", "PARTC_LLAMA_SIZE", "llama2-70b", 64, "h100-80g"),
    ("GPT 1T", "examples/gpt.py", "PARTC_GPT_SIZE", "1008b", 3072, "a100-80g"),
]

GiB = 2**30
GB = 1e9


def main() -> None:
    from partc.cluster import load_cluster
    from partc.compile import compile_model

    print("Default plans (no pins, default global batch); per GPU: memory of the most loaded pipeline rank, the most "
          "traffic of any.")
    print(f"{'run':<12} {'GPUs':>5} {'cluster':<9} | {'plan':<62} | {'step':>6} {'MFU':>5} | "
          f"{'params/grads/optim/act/buf = total (usable) GiB':<46} | tp/pp/dp GB | compile")
    for name, path, var, size, gpus, cluster in RUNS:
        if var:
            os.environ[var] = size
        t0 = time.perf_counter()
        result = compile_model(str(ROOT / path), gpus=gpus, cluster=cluster)
        seconds = time.perf_counter() - t0
        best, plan = result.best, result.plan
        pred = best.prediction
        m = pred.memory_per_gpu  # the most loaded pipeline rank
        usable = load_cluster(cluster).usable_memory_bytes
        mem = (f"{m.params / GiB:.1f}/{m.grads / GiB:.1f}/{m.optimizer / GiB:.1f}/{m.activations / GiB:.1f}/"
               f"{m.buffers / GiB:.1f} = {m.total / GiB:.1f} ({usable / GiB:.1f})")
        comm = "/".join(f"{max(r.comm_bytes[a] for r in pred.ranks) / GB:.0f}" for a in ("tp", "pp", "dp"))
        print(f"{name:<12} {gpus:>5} {cluster:<9} | {plan.parallel.summary():<62} | {pred.step_time_s:5.1f}s "
              f"{100 * pred.mfu:4.1f}% | {mem:<46} | {comm:<11} | {seconds:.0f} s")


if __name__ == "__main__":
    from record import recorded

    recorded("default_plans", main)
