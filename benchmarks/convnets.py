"""partc's predicted training throughput of convolutional networks against published figures.

    python benchmarks/convnets.py            # a minute or two: two traces on meta and a few searches

ResNet-50 v1.5 (benchmarks/models/resnet50.py, plain PyTorch) on DGX A100 (8x A100 80GB), mixed precision,
224 x 224 images, from two of NVIDIA's Deep Learning Examples (github.com/NVIDIA/DeepLearningExamples):

- PyTorch (PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "Training performance: NVIDIA DGX A100 (8x
  A100 80GB)", pytorch-21.03 NGC container): AMP, 256 images per GPU, NHWC (ConvNets/configs.yml, resnet50 /
  DGXA100 / AMP), PyTorch DDP, 1 GPU 2,470 img/s and 8 GPUs 16,621 (TF32: 938 and 7,248). The benchmark command
  the README gives (``launch.py --mode benchmark_training``) takes its input pipeline from configs.yml:
  ``data_backend: pytorch`` (torchvision's ImageFolder, JPEG decoded and cropped by PIL in DataLoader worker
  processes on the CPU), ``workers: 16`` per GPU on DGXA100. Its TF32 configuration sets no ``memory_format``, so
  the TF32 runs are NCHW (``main.py``'s default).
- MXNet (MxNet/Classification/RN50v1.5/README.md, same section title, mxnet-22.10-py3): float16, 512 images per
  GPU (``benchmark.py -b 512``), Horovod, DALI decoding on the GPU (the runner's default ``dali-gpu``), total
  images/s with data loading: 1 GPU 3,410.52 and 8 GPUs 26,673.72 (TF32: 1,055.78 and 8,247.44). Its float16 runs
  fuse batch norm with ReLU and with the residual add and use CUDA graphs (the runner's flags): a faster program
  than the plain PyTorch model partc prices. The runner sets those fusions and the NHWC layouts for float16 only:
  its float32 (TF32) runs are NCHW and unfused.

Table 1 compiles the model for ``a100-80g`` with each published run pinned (``--gpus n --dp n --zero 0
--micro-batch-size B --global-batch-size Bn``: DDP and Horovod are ZeRO-0's fp32 all-reduce of the gradients once a
step), in bf16 for the mixed-precision runs (A100's fp16 and bf16 tensor-core rates are equal) and in fp32 for the
TF32 ones (partc prices fp32 convolutions at the TF32 rate, PyTorch's default for cuDNN), and compares the
predicted images/s with the published ones; a last column shows the plan partc picks with only the global batch
given. The TF32 rows depend on `Cluster.tf32_conv_efficiency`, the fraction of the 16-bit GEMM efficiency a TF32
convolution reaches: the script fits it on one row (``FIT``: PyTorch, TF32, 1 GPU), prints the fit next to the
cluster's value, and marks the other TF32 rows as its validation; the TF32 rows' errors at 1 (the efficiency of a
16-bit convolution) are in the last column.

Table 2 compares each publication's scaling from 1 to 8 GPUs (8-GPU images/s over 8 x the 1-GPU ones) with
partc's at the same images per GPU, and gives the time each published 8-GPU step takes beyond its 1-GPU step. Every
per-GPU term of the cost model (convolutions, batch norms, kernel launches) is the same in the 1- and 8-GPU
predictions, which run the same images per GPU: only the data-parallel collectives tell them apart. The lines after
it are what the 8-GPU prediction does with the kernel-launch floor off and with the gradient reduction fully
overlapped with backward (the cost model charges it all, `Cluster.dp_overlap` 0), and the NVLink bus bandwidth at
which the published run's fp32 gradient all-reduce would take its whole extra step time.

Then the U-Net of benchmarks/models/unet.py (128 x 128 pixels) compiled for 8 A100s with nothing pinned: its
predicted MFU (model FLOPs per second over the GPUs' peak), which an A100 bounds well below 100%.

The tables are printed and written, with the date, to benchmarks/results/convnets-YYYY-MM-DD.md (and .json; a
second run on a day writes -2, ...).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESNET = HERE / "models" / "resnet50.py"
UNET = HERE / "models" / "unet.py"
CLUSTER = "a100-80g"
TOLERANCE = 0.25
"""The issue's bar: predicted throughput within 25% of the published one."""
FIT = ("PyTorch DLE (pytorch-21.03)", "fp32", 1)
"""The one published row `Cluster.tf32_conv_efficiency` is fitted on (source, partc's precision, GPUs): plain PyTorch,
the program partc writes for the model; one GPU, so no collective; its CPU input pipeline keeps up with 2.6 times
its rate in the same README's 1-GPU mixed-precision run."""


@dataclass(frozen=True, slots=True)
class Published:
    source: str
    per_gpu_batch: int
    images_per_s: dict[int, float]
    """GPUs -> mixed-precision images/s."""
    tf32_images_per_s: dict[int, float]
    """GPUs -> TF32 images/s (the same program at A100's TF32 rate)."""
    input_pipeline: str


PYTORCH = Published("PyTorch DLE (pytorch-21.03)", 256, {1: 2470.0, 8: 16621.0}, {1: 938.0, 8: 7248.0},
                    "PyTorch DataLoader, PIL JPEG decode on the CPU, 16 workers/GPU")
MXNET = Published("MXNet DLE (mxnet-22.10)", 512, {1: 3410.52, 8: 26673.72}, {1: 1055.78, 8: 8247.44},
                  "DALI, JPEG decode on the GPU")
"""NVIDIA Deep Learning Examples, ResNet-50 v1.5, DGX A100 (8x A100 80GB): see the module docstring."""


def trace_file(path: Path, precision: str = "bf16"):
    from partc.compile_traces import meta_inputs
    from partc.model_file import build_on_meta, load_model_file
    from partc.passes.trace import trace

    spec = load_model_file(str(path))
    net = build_on_meta(spec)
    args, kwargs = meta_inputs(spec, 1, precision)
    return trace(net, args, kwargs, name=spec.name, seq_len=spec.seq_len, path=str(path), fused_attention=True,
                 precision=precision).graph


def predict(graph, gpus: int, global_batch: int, pins=None, cluster=None):
    from partc.cluster import load_cluster
    from partc.passes.search import search

    cluster = cluster or load_cluster(CLUSTER)
    best = search(graph, cluster, gpus, global_batch_size=global_batch, pins=pins).best
    assert best is not None, f"no plan fits on {gpus} GPUs"
    return best


def ddp(gpus: int, per_gpu_batch: int, precision: str = "bf16"):
    """The published runs' configuration: data parallel, one micro-batch of the per-GPU batch, the gradients
    all-reduced once a step (ZeRO-0)."""
    from partc.parallel import Pins

    return Pins(dp=gpus, zero=0, micro_batch_size=per_gpu_batch, precision=precision)


def fit_tf32_conv_efficiency(graph, gpus: int, per_gpu_batch: int, published: float, cluster) -> float:
    """The `Cluster.tf32_conv_efficiency` at which the pinned fp32 prediction of `graph` matches `published` images/s
    (bisection: the prediction grows with it)."""
    def rate(eff: float) -> float:
        c = dataclasses.replace(cluster, tf32_conv_efficiency=eff)
        return gpus * per_gpu_batch / predict(graph, gpus, gpus * per_gpu_batch, ddp(gpus, per_gpu_batch, "fp32"),
                                              c).step_time_s

    low, high = 0.01, 1.0
    assert rate(low) < published < rate(high), "the published rate is out of the fit's range"
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if rate(mid) < published else (low, mid)
    return (low + high) / 2


def plan_text(c) -> str:
    p = c.parallel
    return f"dp {p.dp} tp {p.tp} pp {p.pp} ZeRO {p.zero} mb {p.micro_batch_size}"


def scaling(rates: dict[int, float]) -> float:
    """8-GPU throughput over 8 x the 1-GPU throughput."""
    return rates[8] / (8 * rates[1])


def extra_step_s(rates: dict[int, float], per_gpu_batch: int) -> float:
    """Seconds an 8-GPU step takes beyond a 1-GPU step (the same images per GPU)."""
    return 8 * per_gpu_batch / rates[8] - per_gpu_batch / rates[1]


def main() -> None:
    from partc.cluster import load_cluster
    from partc.parallel import Pins

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cluster = load_cluster(CLUSTER)
    resnet = trace_file(RESNET)
    resnet_fp32 = trace_file(RESNET, "fp32")
    fit_pub = next(p for p in (PYTORCH, MXNET) if p.source == FIT[0])
    fitted = fit_tf32_conv_efficiency(resnet_fp32, FIT[2], fit_pub.per_gpu_batch, fit_pub.tf32_images_per_s[FIT[2]],
                                      cluster)
    as_16bit = dataclasses.replace(cluster, tf32_conv_efficiency=1.0)
    rows = []
    for pub, precision, gpus in ((pub, precision, gpus) for pub in (PYTORCH, MXNET) for precision in ("bf16", "fp32")
                                 for gpus in pub.images_per_s):
        published = (pub.images_per_s if precision == "bf16" else pub.tf32_images_per_s)[gpus]
        graph = resnet if precision == "bf16" else resnet_fp32
        gbs = pub.per_gpu_batch * gpus
        pinned = predict(graph, gpus, gbs, ddp(gpus, pub.per_gpu_batch, precision))
        free = predict(graph, gpus, gbs, Pins(precision=precision))
        predicted = gbs / pinned.step_time_s
        pred = pinned.prediction
        role = "16-bit" if precision == "bf16" else "fit" if (pub.source, precision, gpus) == FIT else "validation"
        at_one = None if precision == "bf16" else \
            gbs / predict(graph, gpus, gbs, ddp(gpus, pub.per_gpu_batch, precision), as_16bit).step_time_s
        rows.append({
            "model": "ResNet-50 v1.5 (224)", "source": pub.source, "gpus": gpus, "global_batch": gbs,
            "published_precision": "AMP" if precision == "bf16" else "TF32", "precision": precision,
            "published_images_per_s": published, "predicted_images_per_s": predicted,
            "error": predicted / published - 1, "mfu": pred.mfu, "step_s": pinned.step_time_s,
            "compute_s": pred.compute_s, "dp_comm_s": pred.dp_comm_s, "plan": plan_text(pinned),
            "free_plan": plan_text(free), "free_images_per_s": gbs / free.step_time_s, "role": role,
            "tf32_conv_efficiency_1_images_per_s": at_one,
            "tf32_conv_efficiency_1_error": None if at_one is None else at_one / published - 1,
        })

    scalings = []
    for pub in (PYTORCH, MXNET):
        b = pub.per_gpu_batch
        one, eight = (predict(resnet, n, b * n, ddp(n, b)) for n in (1, 8))
        predicted = {1: b / one.step_time_s, 8: 8 * b / eight.step_time_s}
        scalings.append({
            "source": pub.source, "per_gpu_batch": b, "input_pipeline": pub.input_pipeline,
            "published_scaling": scaling(pub.images_per_s), "published_tf32_scaling": scaling(pub.tf32_images_per_s),
            "published_extra_step_s": extra_step_s(pub.images_per_s, b),
            "published_tf32_extra_step_s": extra_step_s(pub.tf32_images_per_s, b),
            "predicted_scaling": scaling(predicted), "predicted_extra_step_s": extra_step_s(predicted, b),
            "predicted_dp_comm_s": eight.prediction.dp_comm_s,
        })

    eight = PYTORCH.per_gpu_batch * 8
    pins = ddp(8, PYTORCH.per_gpu_batch)
    no_launch = eight / predict(resnet, 8, eight, pins, dataclasses.replace(cluster, kernel_launch_s=0.0)).step_time_s
    overlapped = eight / predict(resnet, 8, eight, pins, dataclasses.replace(cluster, dp_overlap=1.0)).step_time_s
    params = predict(resnet, 8, eight, pins).prediction.ranks[0].num_params
    # The bus bandwidth at which a ring all-reduce of the fp32 gradients (4 bytes a parameter, 2(n-1)/n of them
    # over the bus: nccl-tests' doc/PERFORMANCE.md) would take the whole extra step time of the published 8-GPU run.
    implied_busbw = 2 * 7 / 8 * 4 * params / scalings[0]["published_extra_step_s"]
    sensitivity = {"tf32_conv_efficiency": cluster.tf32_conv_efficiency, "tf32_conv_efficiency_fitted": fitted,
                   "tf32_conv_efficiency_fitted_on": list(FIT),
                   "kernel_launch_s_0_images_per_s": no_launch, "dp_overlap_1_images_per_s": overlapped,
                   "params": params, "implied_allreduce_bus_bandwidth": implied_busbw,
                   "cluster_allreduce_bus_bandwidth": cluster.intra_node_bandwidth * cluster.intra_node_efficiency}

    unet = trace_file(UNET)
    from partc.compile import default_global_batch

    unet_gbs = default_global_batch(8, None)
    u = predict(unet, 8, unet_gbs)
    unet_row = {"model": "U-Net (128)", "gpus": 8, "global_batch": unet_gbs, "plan": plan_text(u),
                "mfu": u.prediction.mfu, "images_per_s": unet_gbs / u.step_time_s,
                "model_tflops_per_gpu": u.prediction.model_tflops_per_gpu}

    lines = [f"ResNet-50 v1.5 training on {CLUSTER}: NVIDIA Deep Learning Examples (DGX A100 80GB, mixed precision "
             f"and TF32; PyTorch: 256 images/GPU, DDP; MXNet: 512 images/GPU, Horovod) vs partc's prediction",
             "",
             "| publication | precision (partc's) | GPUs | batch | published img/s | predicted img/s | error | MFU | "
             "plan (pinned as published) | partc's pick | its img/s | TF32 row | error at tf32_conv_efficiency 1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        before = "" if r["tf32_conv_efficiency_1_error"] is None else f"{100 * r['tf32_conv_efficiency_1_error']:+.1f}%"
        lines.append(f"| {r['source']} | {r['published_precision']} ({r['precision']}) | {r['gpus']} | "
                     f"{r['global_batch']} | {r['published_images_per_s']:,.0f} | "
                     f"{r['predicted_images_per_s']:,.0f} | {100 * r['error']:+.1f}% | {100 * r['mfu']:.1f}% | "
                     f"{r['plan']} | {r['free_plan']} | {r['free_images_per_s']:,.0f} | "
                     f"{'' if r['role'] == '16-bit' else r['role']} | {before} |")
    lines += ["",
              f"tf32_conv_efficiency (the fraction of the 16-bit GEMM efficiency a TF32 convolution reaches): "
              f"{cluster.tf32_conv_efficiency:g} in {CLUSTER}; fitted on {FIT[0]}, TF32, {FIT[2]} GPU: {fitted:.3f}; "
              f"validated on the other TF32 rows"]
    lines += ["",
              "Scaling from 1 to 8 GPUs (8-GPU img/s over 8 x 1-GPU img/s) at the same images per GPU, and the time "
              "an 8-GPU step takes beyond a 1-GPU step",
              "",
              "| publication | img/GPU | input pipeline | published AMP | its extra step | published TF32 | "
              "its extra step | predicted (bf16) | its extra step |",
              "|---|---|---|---|---|---|---|---|---|"]
    for s in scalings:
        lines.append(f"| {s['source']} | {s['per_gpu_batch']} | {s['input_pipeline']} | "
                     f"{100 * s['published_scaling']:.1f}% | {1e3 * s['published_extra_step_s']:.1f} ms | "
                     f"{100 * s['published_tf32_scaling']:.1f}% | {1e3 * s['published_tf32_extra_step_s']:.1f} ms | "
                     f"{100 * s['predicted_scaling']:.1f}% | {1e3 * s['predicted_extra_step_s']:.1f} ms |")
    pt = next(r for r in rows if r["source"] == PYTORCH.source and r["gpus"] == 8 and r["precision"] == "bf16")[
        "predicted_images_per_s"]
    lines += ["",
              f"8 GPUs, 256 images/GPU: predicted {pt:,.0f} img/s; with kernel_launch_s 0: {no_launch:,.0f} "
              f"({100 * (no_launch / pt - 1):+.1f}%); with the gradient all-reduce fully overlapped (dp_overlap 1): "
              f"{overlapped:,.0f} ({100 * (overlapped / pt - 1):+.1f}%)",
              f"The published PyTorch 8-GPU step's extra {1e3 * scalings[0]['published_extra_step_s']:.1f} ms would "
              f"be the fp32 all-reduce of {params / 1e6:.1f}M gradients at a bus bandwidth of "
              f"{implied_busbw / 1e9:.1f} GB/s (the cluster's: "
              f"{sensitivity['cluster_allreduce_bus_bandwidth'] / 1e9:.0f} GB/s)",
              "",
              f"U-Net (128 x 128) on 8 x {CLUSTER}, nothing pinned (global batch {unet_gbs}): {unet_row['plan']}, "
              f"predicted MFU {100 * unet_row['mfu']:.1f}% ({unet_row['model_tflops_per_gpu']:.0f} TFLOP/s a GPU), "
              f"{unet_row['images_per_s']:,.0f} images/s"]
    within = [abs(r["error"]) <= TOLERANCE for r in rows]
    lines.append("")
    lines.append("within 25%: " + ", ".join(f"{r['source'].split()[0]} {r['published_precision']} {r['gpus']} "
                                             f"GPU{'s' if r['gpus'] > 1 else ''} "
                                             f"{'yes' if ok else 'no'}" for r, ok in zip(rows, within))
                 + f" ({time.perf_counter() - t0:.0f} s)")
    print("\n".join(lines))
    if os.environ.get("PARTC_BENCH_RESULTS") != "0":
        from record import results_path

        day = datetime.datetime.now(datetime.timezone.utc).date()
        path = results_path("convnets", day).with_suffix(".json")  # the name recorded() gives the table
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"date": day.isoformat(), "cluster": CLUSTER, "resnet50": rows,
                                    "scaling": scalings, "sensitivity": sensitivity, "unet": unet_row},
                                   indent=2) + "\n")


if __name__ == "__main__":
    from record import recorded

    recorded("convnets", main, markdown=True)
