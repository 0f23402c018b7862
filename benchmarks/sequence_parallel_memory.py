"""Activation memory of one transformer layer with and without sequence parallelism: what the plan predicts and
what `partc check` measures, beside Korthikanti et al. 2022's formulas.

    python benchmarks/sequence_parallel_memory.py        # 8 compiles and 8 checks on fake tensors, minutes on 2 cores

examples/gpt.py at h 1024, 16 heads, s 1024, V 1024, no dropout, bf16, one sample a micro-batch, tp 2 (Megatron's
map: QKV and fc1 colwise, proj and fc2 rowwise, the vocabulary split), one micro-batch a step. Each configuration
is compiled at 4 and at 6 layers; the activations of one layer are half the difference of the rank's
``activations`` row (`partc.runtime.check`: every tensor the step holds beyond parameters, gradients and optimizer
states, at its peak), predicted and measured, which cancels what is not per layer (the embeddings, the loss).

Korthikanti et al.'s bytes per layer (their section 4, bf16, without dropout, whose masks are 2·s·b·h of their 10,
and with attention fused, so selective recomputation has nothing left to drop):
    tensor parallelism                     s·b·h·(8 + 24/t)
    tensor and sequence parallelism        s·b·h·32/t          (Megatron-Core gathers the colwise inputs again in
                                                                backward)
    partc's program, sequence parallelism  s·b·h·(4 + 28/t)    (its colwise Linears save their gathered inputs)
    and `sp_regather`                      s·b·h·32/t          (they keep 1/t and gather it again in backward)

and, with `sp_regather`, the tp bytes one layer adds a step (the plan's ``comm_bytes.tp`` and the check's counters):
the backward all-gathers of the two gathered inputs (QKV's and fc1's), 2·s·b·h more than without it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
H, S, HEADS, V, T = 1024, 1024, 16, 1024, 2
LAYERS = (4, 6)
"""The two depths whose difference gives one layer: deep enough that the step's most activation memory is where
every layer's saved activations are held (at 2 layers the loss's moment is higher, and the difference is not a
layer's)."""
MiB = 2**20


def megatron_style(fqn: str) -> str:
    """tests/helpers.py's map of the example GPT, the vocabulary split."""
    if fqn.endswith(("attn.qkv", "mlp.fc1")) or fqn == "lm_head":
        return "colwise"
    if fqn.endswith(("attn.proj", "mlp.fc2")) or fqn == "tok":
        return "rowwise"
    return "replicate"


def measure(tmp: Path, src: Path, layers: int, sp: bool, recompute: str, regather: bool = False
            ) -> tuple[float, float, float, float]:
    """(activations predicted, measured, tp bytes predicted, measured) of the one rank."""
    from partc.compile import compile_model
    from partc.parallel import Pins
    from partc.runtime.check import check_program

    os.environ["PARTC_GPT_SIZE"] = f"sp{layers}"
    out = tmp / f"{sp}_{regather}_{recompute}_{layers}"
    pins = Pins(tp=T, pp=1, dp=1, zero=0, micro_batch_size=1, schedule="1f1b", recompute=recompute,
                sequence_parallel=sp, sp_regather=regather if sp else None)
    compile_model(str(src), gpus=T, pins=pins, global_batch_size=1, out_dir=out)
    plan = json.loads((out / "plan.json").read_text())
    plan["tp"] = {f: megatron_style(f) for f in plan["tp"]}
    edited = tmp / f"{out.name}.json"
    edited.write_text(json.dumps(plan))
    compile_model(str(src), gpus=T, from_plan=str(edited), out_dir=out)
    (r,) = check_program(str(out), slack_bytes=0)
    return (r.predicted_memory_bytes["activations"], r.memory_bytes["activations"], r.predicted_comm_bytes["tp"],
            r.comm_bytes["tp"])


def main() -> int:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        src = tmp / "gpt.py"
        src.write_text((ROOT / "examples" / "gpt.py").read_text() + "\n" + "\n".join(
            f'SIZES["sp{n}"] = GPTConfig(vocab_size={V}, seq_len={S}, hidden={H}, heads={HEADS}, layers={n})'
            for n in LAYERS) + "\n")
        sbh = S * H  # b = 1; Korthikanti et al.'s coefficients are bytes (16-bit activations)
        formulas = {False: 8 + 24 / T, True: 32 / T}
        partc_formula = {False: 8 + 24 / T, True: 4 + 28 / T}
        print(f"GPT h {H}, {HEADS} heads, s {S}, b 1, bf16, tp {T}; s·b·h = {sbh / MiB:.0f} Mi; per layer\n")
        print("| sequence parallel | recompute | Korthikanti et al. | partc's program (formula) | predicted | "
              "measured (`partc check`) | gathered again in backward (`sp_regather`): formula | predicted | "
              "measured | its tp bytes a step, predicted / measured |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")

        def per_layer(f):
            lo, hi = LAYERS
            return tuple((b - a) / (hi - lo) / MiB for a, b in zip(f(lo), f(hi)))

        for sp in (False, True):
            for recompute in ("none", "selective"):
                p, m, _, tp0 = per_layer(lambda n: measure(tmp, src, n, sp, recompute))
                row = (f"| {'on' if sp else 'off'} | {recompute} | {formulas[sp]:.0f}·sbh = "
                       f"{formulas[sp] * sbh / MiB:.2f} MiB | {partc_formula[sp]:.0f}·sbh = "
                       f"{partc_formula[sp] * sbh / MiB:.2f} MiB | {p:.2f} MiB | {m:.2f} MiB |")
                if sp:
                    rp, rm, tpp, tpm = per_layer(lambda n: measure(tmp, src, n, sp, recompute, regather=True))
                    row += (f" {32 / T:.0f}·sbh = {32 / T * sbh / MiB:.2f} MiB | {rp:.2f} MiB | {rm:.2f} MiB | "
                            f"{tpp:.2f} / {tpm:.2f} MiB ({tpm - tp0:+.2f} MiB) |")
                else:
                    row += " | | | |"
                print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from record import recorded

    sys.exit(recorded("sequence_parallel_memory", main, markdown=True))
