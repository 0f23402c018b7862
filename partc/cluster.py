"""Clusters: the GPU, its node and its network, as the cost model sees them.

Rates are datasheet figures (NVIDIA's A100/H100/H200 datasheets; docs/cost-model.md) times an achievable fraction
that belongs to the hardware, never to a model. A cluster is a preset name or a JSON file with the same
fields (any field omitted takes the ``a100-80g`` value).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from partc.errors import PartcError
from partc.parallel import MAX_GPUS

GiB = 1024**3
MiB = 1024**2


@dataclass(kw_only=True, slots=True)
class Cluster:
    name: str
    """Preset name or file stem."""
    gpu: str
    """GPU model, for people."""
    gpus_per_node: int = 8
    memory_bytes: int
    """HBM per GPU, as the driver reports it."""
    memory_reserve_bytes: int = 1 * GiB
    """Held back from `memory_bytes`, with `memory_reserve_fraction` (`usable_memory_bytes`): the CUDA context and
    the cuBLAS/cuDNN workspaces (about 0.5-1 GiB), which the cost model does not count."""
    memory_reserve_fraction: float = 0.05
    """Fraction of `memory_bytes` held back for the caching allocator's fragmentation, which leaves blocks reserved
    but unusable when activations of different sizes come and go (commonly 5% of what is allocated). A plan must fit
    in `usable_memory_bytes` (the search never chooses one that does not, and ``--from-plan`` rejects it)."""
    communicator_bytes: int = 256 * MiB
    """Device memory of one NCCL communicator (its send and receive buffers: NCCL_BUFFSIZE, 4 MiB, per channel, peer
    and protocol), counted for every process group of more than one rank a GPU belongs to."""
    peak_flops: float
    """Dense 16-bit tensor-core FLOP/s (datasheet)."""
    peak_flops_fp32: float = 19.5e12
    """Dense fp32 FLOP/s without tensor cores (datasheet; PyTorch runs fp32 matmuls without TF32 by default), for
    ``precision: fp32`` plans."""
    peak_flops_tf32: float = 156e12
    """Dense TF32 tensor-core FLOP/s (datasheet), for the convolutions of ``precision: fp32`` plans: PyTorch lets
    cuDNN run fp32 convolutions in TF32 by default (``torch.backends.cudnn.allow_tf32`` is True), unlike matmuls."""
    tf32_conv_efficiency: float = 0.44
    """Fraction of the 16-bit efficiency (`gemm_efficiency` and `passes.hw.gemm_efficiency`'s factors) that a TF32
    convolution reaches of `peak_flops_tf32`: a calibrated figure, not a cause. A100: 0.44, fitted on ONE published
    run, NVIDIA Deep Learning Examples' PyTorch ResNet-50 v1.5 in TF32 on one A100 80GB (938 images/s,
    pytorch-21.03), and validated on the same README's 8-GPU TF32 run and on MXNet's 1- and 8-GPU TF32 runs
    (benchmarks/convnets.py, docs/convolutions.md). What partc prices already scales exactly with the precision (half
    the tensor-core rate, twice the bytes, the same roofline ridge), which makes a TF32 step twice a 16-bit one; the
    publications run it 2.6x (PyTorch) and 3.2x (MXNet) slower. Their TF32 runs also differ from their
    mixed-precision ones in layout (NCHW against NHWC), which partc does not model; this fraction holds both. 1:
    TF32 convolutions as efficient as 16-bit ones."""
    gemm_efficiency: float = 0.75
    """Fraction of `peak_flops` that a large GEMM reaches when compute-bound, before the tile, wave and
    short-k factors of `passes.hw.gemm_efficiency`. A100: 0.75, fitted on Megatron-LM's Table 1 (fp16,
    cuBLAS 11): an 8192³ product comes out at 0.73 (226 TFLOP/s), the QKV product of the 145.6B row (TP 8,
    b = 2: 4096 x 4608 x 12288) at 0.68 (213 TFLOP/s)."""
    num_sms: int = 108
    """Streaming multiprocessors (datasheet: A100 108, H100/H200 SXM 132). GEMM output tiles run in waves of
    this many; the last wave is partly idle (wave quantization)."""
    gemm_half_size: float = 64.0
    """An inner dimension k of this many elements halves the compute-bound efficiency (k / (k + this)): a short
    k leaves each tile's main loop too short to hide its prologue and epilogue. It matters for attention's score
    product (k = the head dimension, 0.67 at k = 128)."""
    memory_bandwidth: float
    """HBM bytes/s (datasheet)."""
    memory_efficiency: float = 0.9
    """Fraction of `memory_bandwidth` that memory-bound kernels (elementwise, norms, softmax, and GEMMs below the
    roofline's ridge point) reach: A100 80GB 0.9 (1.84 TB/s; stream benchmarks measure 1.7-1.9 TB/s)."""
    intra_node_bandwidth: float
    """Bytes/s each way per GPU inside a node (NVLink), datasheet."""
    inter_node_bandwidth: float
    """Bytes/s each way per GPU across nodes (InfiniBand), datasheet: one adapter per GPU."""
    intra_node_efficiency: float = 0.8
    """Fraction of `intra_node_bandwidth` that ring collectives reach (NCCL bus bandwidth): A100 0.8, 240 GB/s
    (nccl-tests all_reduce on DGX A100 NVSwitch: about 230 GB/s)."""
    inter_node_efficiency: float = 0.9
    """Fraction of `inter_node_bandwidth` that ring collectives reach: 22.5 GB/s of HDR's 25 GB/s per adapter. A
    group with r members per node crosses nodes on r adapters (`passes.hw.link`)."""
    intra_node_latency: float = 5e-6
    """Seconds per ring step inside a node."""
    inter_node_latency: float = 10e-6
    """Seconds per ring step across nodes."""
    fused_attention: bool = True
    """The attention op runs as a fused kernel (FlashAttention; memory-efficient attention with a mask), as PyTorch's
    ``scaled_dot_product_attention`` does on these GPUs: no s x s scores in HBM or saved for backward
    (`partc.passes.measure`). False: the math path's materialized scores and probabilities, as Megatron-LM's 2021
    runs (Table 1) had them."""
    kernel_launch_s: float = 5e-6
    """Seconds the host takes to issue one GPU kernel, the floor under a kernel's time when kernels are too small
    to keep the GPU busy. Launches are asynchronous, so the host issues kernels while earlier ones run: a unit's
    time per micro-batch is the larger of its GPU time and its kernels (forward and backward, `passes.cost`) times
    this. 5 us is the commonly quoted cost of a CUDA kernel launch (NVIDIA's "Getting Started with CUDA Graphs",
    2019, motivates CUDA graphs by launch overheads of a few microseconds a kernel, comparable to the kernels
    themselves); PyTorch's eager dispatch adds a few more microseconds of host time per op, so a model of many
    tiny ops is priced on the generous side. 0 turns the floor off."""
    dp_overlap: float = 0.0
    """Fraction of the data-parallel gradient reduction hidden behind backward compute. 0: the reduction runs
    after the last backward, as in Megatron-LM's own ("local") DDP that the pipelined Table 1 runs used."""

    @property
    def usable_memory_bytes(self) -> float:
        """What a plan may use of a GPU: `memory_bytes` less the reserves."""
        return self.memory_bytes * (1 - self.memory_reserve_fraction) - self.memory_reserve_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(data: dict, *, name: str | None = None) -> "Cluster":
        base = dataclasses.asdict(PRESETS["a100-80g"])
        known = {f.name for f in dataclasses.fields(Cluster)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PartcError(f"unknown cluster field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        base.update(data)
        if name is not None and "name" not in data:
            base["name"] = name
        try:
            cluster = Cluster(**base)
        except TypeError as e:  # pragma: no cover - all fields have values from the base preset
            raise PartcError(f"bad cluster description: {e}") from None
        for f in dataclasses.fields(Cluster):
            value = getattr(cluster, f.name)
            if f.name in ("name", "gpu"):
                if not isinstance(value, str):
                    raise PartcError(f"cluster field {f.name} must be a string, got {value!r}")
                continue
            if f.type in ("bool", bool):
                if not isinstance(value, bool):
                    raise PartcError(f"cluster field {f.name} must be true or false, got {value!r}")
                continue
            want = _check_number(f.name, value)
            if want:
                raise PartcError(f"cluster field {f.name} must be {want}, got {value!r}")
            if f.name in _COUNTS:
                setattr(cluster, f.name, int(value))
        if cluster.usable_memory_bytes <= 0:
            raise PartcError("cluster memory_bytes must exceed its reserves (memory_reserve_bytes and "
                             "memory_reserve_fraction)")
        return cluster


# The range of each number (`_check_number`). Rates and sizes have a floor far below any GPU or network partc plans
# for, which also catches a rate in the wrong unit (312 for peak_flops: TFLOP/s, not FLOP/s) before it makes step
# times of years; efficiencies are fractions; latencies at most a second; any other number (a field added later)
# finite and non-negative. A value outside would make a predicted time infinite, nan or negative.
_COUNTS = {"gpus_per_node": MAX_GPUS, "num_sms": 2**20}
"""Integer fields: 1 .. this."""
_FLOORS = {
    "memory_bytes": (2**20, "1 MiB: it is in bytes"),
    "peak_flops": (1e12, "1 TFLOP/s: it is in FLOP/s"),
    "peak_flops_fp32": (1e11, "0.1 TFLOP/s: it is in FLOP/s"),
    "peak_flops_tf32": (1e11, "0.1 TFLOP/s: it is in FLOP/s"),
    "memory_bandwidth": (1e10, "10 GB/s: it is in bytes/s"),
    "intra_node_bandwidth": (1e9, "1 GB/s: it is in bytes/s"),
    "inter_node_bandwidth": (1e8, "100 MB/s: it is in bytes/s"),
}
"""Rates and sizes: at least this (and what it means)."""
_RANGES = {
    "gemm_efficiency": (0.01, 1.0), "memory_efficiency": (0.01, 1.0), "intra_node_efficiency": (0.01, 1.0),
    "tf32_conv_efficiency": (0.01, 1.0),
    "inter_node_efficiency": (0.01, 1.0), "dp_overlap": (0.0, 1.0), "intra_node_latency": (0.0, 1.0),
    "inter_node_latency": (0.0, 1.0), "kernel_launch_s": (0.0, 1.0), "gemm_half_size": (0.0, 2.0**20), "memory_reserve_fraction": (0.0, 0.9),
}
"""Other numbers: low .. high."""


def _check_number(name: str, value) -> str | None:
    """What cluster field `name` must be, if `value` is not that; None if it is."""
    try:
        finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))
    except OverflowError:  # an integer beyond any float
        finite = False
    if name in _COUNTS:
        ok = finite and value == int(value) and 1 <= value <= _COUNTS[name]
        return None if ok else f"an integer from 1 to {_COUNTS[name]:,}"
    if name in _FLOORS:
        floor, why = _FLOORS[name]
        return None if finite and value >= floor else f"a finite number >= {floor:.3g} ({why})"
    low, high = _RANGES.get(name, (0.0, math.inf))
    if finite and low <= value <= high:
        return None
    return f"a finite number >= {low:g}" if high == math.inf else f"a number from {low:g} to {high:g}"


# Datasheet rates (NVIDIA's, docs/cost-model.md "The hardware"; NVLink: per direction; InfiniBand: 8x 200 Gb/s
# HDR per 8-GPU node = 25 GB/s per GPU each way; NDR 400 Gb/s = 50 GB/s for Hopper nodes). The achievable fractions (the
# field defaults) are A100's, calibrated against Megatron-LM's Table 1 (benchmarks/megatron_table1.py); the
# Hopper presets take them unmeasured, with their own datasheet rates and SM count.
PRESETS: dict[str, Cluster] = {
    "a100-80g": Cluster(
        name="a100-80g", gpu="NVIDIA A100 SXM 80GB", memory_bytes=81920 * MiB,
        peak_flops=312e12, memory_bandwidth=2.039e12,
        intra_node_bandwidth=300e9, inter_node_bandwidth=25e9,
    ),
    "h100-80g": Cluster(
        name="h100-80g", gpu="NVIDIA H100 SXM 80GB", memory_bytes=81559 * MiB,
        peak_flops=989e12, peak_flops_fp32=67e12, peak_flops_tf32=494.5e12, memory_bandwidth=3.35e12, num_sms=132,
        intra_node_bandwidth=450e9, inter_node_bandwidth=50e9,
    ),
    "h200-141g": Cluster(
        name="h200-141g", gpu="NVIDIA H200 SXM 141GB", memory_bytes=143771 * MiB,
        peak_flops=989e12, peak_flops_fp32=67e12, peak_flops_tf32=494.5e12, memory_bandwidth=4.8e12, num_sms=132,
        intra_node_bandwidth=450e9, inter_node_bandwidth=50e9,
    ),
}


def load_cluster(spec: str) -> Cluster:
    """A preset name, or a path to a JSON file of `Cluster` fields."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if spec.endswith(".json") or path.exists():
        if not path.is_file():
            raise PartcError(f"cluster file {spec} does not exist")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PartcError(f"cannot read cluster file {spec}: {e}") from None
        if not isinstance(data, dict):
            raise PartcError(f"cluster file {spec} must hold a JSON object")
        return Cluster.from_dict(data, name=path.stem)
    raise PartcError(f"unknown cluster {spec!r}; presets: {', '.join(PRESETS)}, or a path to a JSON file")
