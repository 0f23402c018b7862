"""partc's predicted training throughput of convolutional networks against a published figure.

    python benchmarks/convnets.py            # about a minute: two traces on meta and a few searches

ResNet-50 v1.5 (benchmarks/models/resnet50.py, plain PyTorch) against NVIDIA's Deep Learning Examples, PyTorch
ResNet50 v1.5 (github.com/NVIDIA/DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md,
"Training performance: NVIDIA DGX A100 (8x A100 80GB)", pytorch-21.03 NGC container): mixed precision (AMP),
224 x 224 images, 256 images per GPU (ConvNets/configs.yml, resnet50 / DGXA100 / AMP: batch_size 256, NHWC),
data-parallel (PyTorch DDP), throughput averaged over a whole training epoch:

    1 GPU    2,470 img/s
    8 GPUs  16,621 img/s

Each row compiles the model for ``a100-80g`` with the published run pinned (``--gpus n --dp n
--micro-batch-size 256 --global-batch-size 256n``, bf16: A100's fp16 and bf16 tensor-core rates are equal) and
compares partc's predicted images/s with the published ones. A last column shows the plan partc picks with only
the global batch given. The published 8-GPU run is 16% slower per GPU than the 1-GPU run; partc's plan loses 2%
to the gradient all-reduce, and the rest (the input pipeline, part of an epoch's average) is outside the cost
model: the 1-GPU row is the one that measures the cost model of the GPU's work.

Then the U-Net of benchmarks/models/unet.py (128 x 128 pixels) compiled for 8 A100s with nothing pinned: its
predicted MFU (model FLOPs per second over the GPUs' peak), which an A100 bounds well below 100%.

The table is printed and written, with the date, to benchmarks/results/convnets-YYYY-MM-DD.md (and .json).
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESNET = HERE / "models" / "resnet50.py"
UNET = HERE / "models" / "unet.py"
CLUSTER = "a100-80g"
PER_GPU_BATCH = 256
TOLERANCE = 0.25
"""The issue's bar: predicted throughput within 25% of the published one."""


@dataclass(frozen=True, slots=True)
class Published:
    gpus: int
    images_per_s: float


PUBLISHED = [Published(1, 2470.0), Published(8, 16621.0)]
"""NVIDIA Deep Learning Examples, PyTorch ResNet50 v1.5, DGX A100 (8x A100 80GB), mixed precision."""


def trace_file(path: Path):
    from partc.model_file import build_on_meta, load_model_file
    from partc.passes.trace import trace

    spec = load_model_file(str(path))
    net = build_on_meta(spec)
    with torch.device("meta"):
        args, kwargs = spec.inputs(1)
    return trace(net, args, kwargs, name=spec.name, seq_len=spec.seq_len, path=str(path), fused_attention=True).graph


def predict(graph, gpus: int, global_batch: int, pins=None):
    from partc.cluster import load_cluster
    from partc.passes.search import search

    best = search(graph, load_cluster(CLUSTER), gpus, global_batch_size=global_batch, pins=pins).best
    assert best is not None, f"no plan fits on {gpus} GPUs"
    return best


def plan_text(c) -> str:
    p = c.parallel
    return f"dp {p.dp} tp {p.tp} pp {p.pp} ZeRO {p.zero} mb {p.micro_batch_size}"


def main() -> None:
    from partc.parallel import Pins

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    resnet = trace_file(RESNET)
    rows = []
    for pub in PUBLISHED:
        gbs = PER_GPU_BATCH * pub.gpus
        pinned = predict(resnet, pub.gpus, gbs, Pins(dp=pub.gpus, micro_batch_size=PER_GPU_BATCH))
        free = predict(resnet, pub.gpus, gbs)
        predicted = gbs / pinned.step_time_s
        pred = pinned.prediction
        rows.append({
            "model": "ResNet-50 v1.5 (224)", "gpus": pub.gpus, "global_batch": gbs,
            "published_images_per_s": pub.images_per_s, "predicted_images_per_s": predicted,
            "error": predicted / pub.images_per_s - 1, "mfu": pred.mfu, "step_s": pinned.step_time_s,
            "compute_s": pred.compute_s, "dp_comm_s": pred.dp_comm_s, "plan": plan_text(pinned),
            "free_plan": plan_text(free), "free_images_per_s": gbs / free.step_time_s,
        })
    unet = trace_file(UNET)
    from partc.compile import default_global_batch

    unet_gbs = default_global_batch(8, None)
    u = predict(unet, 8, unet_gbs)
    unet_row = {"model": "U-Net (128)", "gpus": 8, "global_batch": unet_gbs, "plan": plan_text(u),
                "mfu": u.prediction.mfu, "images_per_s": unet_gbs / u.step_time_s,
                "model_tflops_per_gpu": u.prediction.model_tflops_per_gpu}

    lines = [f"ResNet-50 v1.5 training on {CLUSTER}: NVIDIA Deep Learning Examples (PyTorch, DGX A100 80GB, AMP, "
             f"256 images/GPU) vs partc's prediction",
             "",
             "| GPUs | batch | published img/s | predicted img/s | error | MFU | plan (pinned dp, mb 256) | "
             "partc's pick | its img/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gpus']} | {r['global_batch']} | {r['published_images_per_s']:,.0f} | "
                     f"{r['predicted_images_per_s']:,.0f} | {100 * r['error']:+.1f}% | {100 * r['mfu']:.1f}% | "
                     f"{r['plan']} | {r['free_plan']} | {r['free_images_per_s']:,.0f} |")
    lines += ["",
              f"U-Net (128 x 128) on 8 x {CLUSTER}, nothing pinned (global batch {unet_gbs}): {unet_row['plan']}, "
              f"predicted MFU {100 * unet_row['mfu']:.1f}% ({unet_row['model_tflops_per_gpu']:.0f} TFLOP/s a GPU), "
              f"{unet_row['images_per_s']:,.0f} images/s"]
    within = [abs(r["error"]) <= TOLERANCE for r in rows]
    lines.append("")
    lines.append("within 25%: " + ", ".join(f"{r['gpus']} GPU{'s' if r['gpus'] > 1 else ''} "
                                             f"{'yes' if ok else 'no'}" for r, ok in zip(rows, within))
                 + f" ({time.perf_counter() - t0:.0f} s)")
    text = "\n".join(lines)
    print(text)
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    day = datetime.date.today().isoformat()
    (out / f"convnets-{day}.md").write_text(text + "\n")
    (out / f"convnets-{day}.json").write_text(json.dumps({"date": day, "cluster": CLUSTER, "resnet50": rows,
                                                          "unet": unet_row}, indent=2) + "\n")


if __name__ == "__main__":
    main()
