"""Activation memory of one transformer layer with and without sequence parallelism: what the plan predicts and
what `partc check` measures, beside Korthikanti et al. 2022's formulas.

    python benchmarks/sequence_parallel_memory.py        # 8 compiles and 8 checks on fake tensors, minutes on 2 cores

examples/gpt.py at h 1024, 16 heads, s 1024, V 1024, no dropout, bf16, one sample a micro-batch, tp 2 (Megatron's
map: QKV and fc1 colwise, proj and fc2 rowwise, the vocabulary split), one micro-batch a step. Each configuration
is compiled at 2 and at 4 layers; the activations of one layer are half the difference of the rank's
``activations`` row (`partc.runtime.check`: every tensor the step holds beyond parameters, gradients and optimizer
states, at its peak), predicted and measured, which cancels what is not per layer (the embeddings, the loss).

Korthikanti et al.'s bytes per layer (their section 4, bf16, without dropout, whose masks are 2·s·b·h of their 10,
and with attention fused, so selective recomputation has nothing left to drop):
    tensor parallelism                     s·b·h·(8 + 24/t)
    tensor and sequence parallelism        s·b·h·32/t          (Megatron-Core gathers the colwise inputs again in
                                                                backward)
    partc's program, sequence parallelism  s·b·h·(4 + 28/t)    (its colwise Linears save their gathered inputs)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
H, S, HEADS, V, T = 1024, 1024, 16, 1024, 2
MiB = 2**20


def megatron_style(fqn: str) -> str:
    """tests/helpers.py's map of the example GPT, the vocabulary split."""
    if fqn.endswith(("attn.qkv", "mlp.fc1")) or fqn == "lm_head":
        return "colwise"
    if fqn.endswith(("attn.proj", "mlp.fc2")) or fqn == "tok":
        return "rowwise"
    return "replicate"


def activations(tmp: Path, src: Path, layers: int, sp: bool, recompute: str) -> tuple[float, float]:
    from partc.compile import compile_model
    from partc.parallel import Pins
    from partc.runtime.check import check_program

    os.environ["PARTC_GPT_SIZE"] = f"sp{layers}"
    out = tmp / f"{sp}_{recompute}_{layers}"
    pins = Pins(tp=T, pp=1, dp=1, zero=0, micro_batch_size=1, schedule="1f1b", recompute=recompute,
                sequence_parallel=sp)
    compile_model(str(src), gpus=T, pins=pins, global_batch_size=1, out_dir=out)
    plan = json.loads((out / "plan.json").read_text())
    plan["tp"] = {f: megatron_style(f) for f in plan["tp"]}
    edited = tmp / f"{out.name}.json"
    edited.write_text(json.dumps(plan))
    compile_model(str(src), gpus=T, from_plan=str(edited), out_dir=out)
    (r,) = check_program(str(out), slack_bytes=0)
    return r.predicted_memory_bytes["activations"], r.memory_bytes["activations"]


def main() -> int:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        src = tmp / "gpt.py"
        src.write_text((ROOT / "examples" / "gpt.py").read_text() + "\n" + "\n".join(
            f'SIZES["sp{n}"] = GPTConfig(vocab_size={V}, seq_len={S}, hidden={H}, heads={HEADS}, layers={n})'
            for n in (2, 4)) + "\n")
        sbh = S * H  # b = 1; Korthikanti et al.'s coefficients are bytes (16-bit activations)
        formulas = {False: 8 + 24 / T, True: 32 / T}
        partc_formula = {False: 8 + 24 / T, True: 4 + 28 / T}
        print(f"GPT h {H}, {HEADS} heads, s {S}, b 1, bf16, tp {T}; s·b·h = {sbh / MiB:.0f} Mi\n")
        print("| sequence parallel | recompute | Korthikanti et al. | partc's program (formula) | predicted | "
              "measured (`partc check`) |")
        print("|---|---|---:|---:|---:|---:|")
        for sp in (False, True):
            for recompute in ("none", "selective"):
                p2, m2 = activations(tmp, src, 2, sp, recompute)
                p4, m4 = activations(tmp, src, 4, sp, recompute)
                print(f"| {'on' if sp else 'off'} | {recompute} | {formulas[sp]:.0f}·sbh = "
                      f"{formulas[sp] * sbh / MiB:.2f} MiB | {partc_formula[sp]:.0f}·sbh = "
                      f"{partc_formula[sp] * sbh / MiB:.2f} MiB | {(p4 - p2) / 2 / MiB:.2f} MiB | "
                      f"{(m4 - m2) / 2 / MiB:.2f} MiB |", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from record import recorded

    sys.exit(recorded("sequence_parallel_memory", main, markdown=True))
