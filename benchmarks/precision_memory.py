"""What the default precision's casts cost: activation bytes saved for backward per block and sample, and the
casts in the traced graph, for models that meet fp32 tensors of their own in forward, at LLaMA-2 7B's block size
(h 4096, 32 heads, FFN 11008, 4096 tokens; Touvron et al. 2023).

    python benchmarks/precision_memory.py       # traces on meta, about a minute on 2 cores

Rows (one sample, the second of two blocks, the trace's own count: every tensor autograd saves, at its dtype,
`partc.passes.measure`, which is what the plan charges and `partc check` measures):
- ``llama, tables cast``: examples/llama.py at ``llama2-7b`` (its cos/sin tables cast to the activations' dtype);
- ``llama, fp32 tables``: tests/mixed_dtype_models.py's ``rope_llama`` at the same size (fp32 cos/sin buffers
  applied as they are: q and k come out fp32 and are cast back to bf16 for attention);
- ``gpt, bf16 positions`` / ``gpt, fp32 positions``: that file's ``fp32_in_forward`` (sinusoidal positions and the
  causal mask made in fp32 in forward: the residual stream is fp32), and the same with the positions cast to bf16;
- each also at ``--precision fp32``, for scale.
Writes benchmarks/results/precision_memory_DATE.md.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def load_models(size: dict):
    spec = importlib.util.spec_from_file_location("mixed_dtype_models", ROOT / "tests" / "mixed_dtype_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for k, v in size.items():
        setattr(module, k, v)
    return module


def measure(build, inputs, precision: str) -> dict:
    from partc.passes.trace import trace
    from partc.precision import cast_floating, compute_dtype

    with torch.device("meta"):
        model = build()
    args = cast_floating(inputs, compute_dtype(precision))
    t0 = time.perf_counter()
    tr = trace(model, args, {}, name="m", precision=precision)
    block = [u for u in tr.graph.units if u.kind == "block"][-1]  # the first also holds what feeds it (positions)
    casts = [n for n in tr.exported.graph.nodes if n.op == "call_function"
             and n.target in (torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default)]
    down = sum(1 for n in casts if n.meta["val"].dtype == torch.bfloat16)
    return {"saved": block.saved_bytes, "input": block.input_bytes, "casts": len(casts), "down": down,
            "blocks": sum(1 for u in tr.graph.units if u.kind == "block"), "s": time.perf_counter() - t0}


def main() -> None:
    torch.set_num_threads(1)
    size = {"VOCAB": 32000, "SEQ": 4096, "HIDDEN": 4096, "HEADS": 32, "KV_HEADS": 32, "FFN": 11008, "LAYERS": 2}
    m = load_models(size)
    os.environ["PARTC_LLAMA_SIZE"] = "llama2-7b"
    sys.path.insert(0, str(ROOT / "examples"))
    import llama as example

    example.SIZES["llama2-7b"].layers = 2  # the same two blocks as the other rows

    class BF16Positions(m.Fp32InForward):
        def forward(self, ids):  # the positions cast to the embeddings' dtype: the model written for bf16
            s = ids.shape[1]
            pos = torch.arange(s, device=ids.device, dtype=torch.float32)[:, None]
            freq = torch.exp(torch.arange(0, m.HIDDEN, 2, device=ids.device, dtype=torch.float32)
                             * (-torch.log(torch.tensor(10000.0)).item() / m.HIDDEN))
            x = self.tok(ids)
            x = x + torch.cat((torch.sin(pos * freq), torch.cos(pos * freq)), dim=-1).to(x.dtype)
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    ids = (torch.zeros(1, m.SEQ, dtype=torch.long, device="meta"),)
    rows = [("llama, tables cast", example.model), ("llama, fp32 tables", m.rope_llama),
            ("gpt, bf16 positions", BF16Positions), ("gpt, fp32 positions", m.fp32_in_forward)]
    lines = ["| model | precision | saved / block / sample | block input | casts (to bf16) in the 2-block graph |",
             "|---|---|---:|---:|---:|"]
    for name, build in rows:
        for precision in ("bf16", "fp32"):
            r = measure(build, ids, precision)
            lines.append(f"| {name} | {precision} | {r['saved'] / MiB:,.0f} MiB | {r['input'] / MiB:,.0f} MiB | "
                         f"{r['casts']} ({r['down']}) |")
            print(lines[-1], flush=True)
    day = datetime.date.today().isoformat()
    out = ROOT / "benchmarks" / "results" / f"precision_memory_{day}.md"
    out.write_text(f"# Activation memory of the default precision's casts ({day})\n\n"
                   f"LLaMA-2 7B block size: h 4096, 32 heads, FFN 11008, 4096 tokens, one sample, torch "
                   f"{torch.__version__}.\n\n" + "\n".join(lines) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
