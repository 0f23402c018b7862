"""Hardware primitives of the cost model: GEMM, memory-bound and collective times on a `Cluster`.

GEMMs follow the roofline: the larger of the compute time, FLOPs / (peak · efficiency), and the memory time,
16-bit operands and product / (HBM bandwidth · memory efficiency). The compute-bound efficiency falls with the
wave quantization of the output tiles over the SMs and with a short inner dimension (`gemm_efficiency`).
Memory-bound kernels move their bytes at HBM bandwidth · memory efficiency.

Collectives follow NCCL's ring algorithms (nccl-tests' doc/PERFORMANCE.md): with S bytes, n ranks, bus bandwidth B
and per-step latency a,
    all-reduce              2(n-1)/n * S/B + 2(n-1) a
    all-gather, reduce-scatter (n-1)/n * S/B + (n-1) a     (S = the full, gathered tensor)
    broadcast, reduce, p2p  S/B + a
A collective whose group spans nodes runs at the inter-node bandwidth, aggregated over the group's members in one
node: a DGX node has one InfiniBand adapter per GPU and NCCL runs one ring channel through each, so a group with
r members per node crosses nodes r links wide (bus bandwidth r x the per-GPU InfiniBand rate, capped by NVLink).
"""

from __future__ import annotations

from partc.cluster import Cluster
from partc.ir import ACTIVATION_BYTES, Gemm

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")


# The output tiles cuBLAS chooses among for 16-bit GEMMs: (output elements of one tile, its compute-bound
# throughput relative to the largest tile's). Smaller tiles reuse each operand load less.
GEMM_TILES = ((256 * 128, 1.0), (128 * 128, 0.9), (128 * 64, 0.8), (64 * 64, 0.65))


def gemm_efficiency(cluster: Cluster, m: float, n: float, k: float, batch: float = 1) -> float:
    """Achievable fraction of peak FLOP/s for `batch` (m x k) @ (k x n) products when compute-bound.

    The output is cut into tiles, one per SM at a time, so a tile size T runs in W = batch·m·n / (T · num_sms)
    waves, the last one partly idle: on average W / (W + 1/2) of the SMs work (wave quantization). cuBLAS picks
    the tile that does best (large tiles for large products, small ones to fill the SMs on small products). A
    short inner dimension k leaves each tile's main loop short: k / (k + gemm_half_size).
    """
    best = 0.0
    for tile, tile_eff in GEMM_TILES:
        waves = batch * m * n / (tile * cluster.num_sms)
        best = max(best, tile_eff * waves / (waves + 0.5))
    return cluster.gemm_efficiency * best * k / (k + cluster.gemm_half_size)


def gemm_bytes(batch: float, m: float, n: float, k: float, dtype_bytes: int = ACTIVATION_BYTES) -> float:
    """HBM bytes of a GEMM that reads both operands and writes the product once."""
    return dtype_bytes * batch * (m * k + k * n + m * n)


def gemm_time(cluster: Cluster, gemm: Gemm, *, micro_batch_size: int = 1, split: str | None = None,
              degree: int = 1) -> float:
    """Seconds for one GEMM of a micro-batch, optionally split `degree` ways along ``m``, ``n``, ``k`` or
    ``batch`` (tensor parallelism); ``inner``: along the GEMM's own `Gemm.inner_split` (an ``inner`` layer's)."""
    if split == "inner":
        split = gemm.inner_split
    batch, m, n, k = gemm.batch, gemm.m, gemm.n, gemm.k
    if gemm.batch_scales:
        batch *= micro_batch_size
    else:
        m *= micro_batch_size
    if split == "batch":
        batch = batch / degree
    elif split == "m":
        m = m / degree
    elif split == "n":
        n = n / degree
    elif split == "k":
        k = k / degree
    else:
        assert split is None, split
    # Roofline: the larger of the compute time and the memory time. Attention's score and context products
    # (k or n = the head dim, 64-160) move about as many bytes as they do FLOPs / 100, below A100's ridge point of
    # peak_flops / memory_bandwidth = 153 FLOP/byte, so they run at memory speed.
    flops = 2.0 * batch * m * n * k
    # fp32: matmuls at the fp32 rate, convolutions in TF32 (PyTorch's defaults: `Cluster.peak_flops_tf32`), at the
    # calibrated fraction of the 16-bit efficiency that TF32 convolutions reach (`Cluster.tf32_conv_efficiency`).
    peak = cluster.peak_flops if gemm.dtype_bytes <= 2 else \
        cluster.peak_flops_tf32 * cluster.tf32_conv_efficiency if gemm.io_bytes else cluster.peak_flops_fp32
    compute = flops / (peak * gemm_efficiency(cluster, m, n, k, batch))
    if gemm.fused:  # inside a fused kernel: the kernel's own HBM traffic is counted with it
        return compute
    if gemm.io_bytes:  # a convolution: its input and output (a split's share of them) and its weight, once
        share = batch * m * n * k / (gemm.batch * gemm.m * micro_batch_size * gemm.n * gemm.k)
        nbytes = gemm.io_bytes * micro_batch_size * share + gemm.dtype_bytes * batch * k * n
        return max(compute, memory_time(cluster, nbytes))
    return max(compute, memory_time(cluster, gemm_bytes(batch, m, n, k, gemm.dtype_bytes)))


def memory_time(cluster: Cluster, nbytes: float) -> float:
    """Seconds for a memory-bound kernel moving `nbytes` through HBM."""
    return nbytes / (cluster.memory_bandwidth * cluster.memory_efficiency)


def link(cluster: Cluster, *, spans_nodes: bool, ranks_per_node: int = 1) -> tuple[float, float]:
    """(bus bandwidth in bytes/s, per-step latency in s) of a collective group; `ranks_per_node`: members of a
    group that spans nodes sharing each node (each with its own InfiniBand adapter)."""
    intra = cluster.intra_node_bandwidth * cluster.intra_node_efficiency
    if spans_nodes:
        inter = cluster.inter_node_bandwidth * cluster.inter_node_efficiency * max(1, ranks_per_node)
        return (min(inter, intra), cluster.inter_node_latency)
    return (intra, cluster.intra_node_latency)


def collective_time(cluster: Cluster, kind: str, nbytes: float, n: int, *, spans_nodes: bool = False,
                    ranks_per_node: int = 1, latency_only: bool = False) -> float:
    """Seconds for one ring collective of `nbytes` over `n` ranks (0 when n == 1); `latency_only`: its latency
    terms alone (a further call moving bytes already counted)."""
    if n <= 1 or (nbytes <= 0 and not latency_only):
        return 0.0
    bw, alpha = link(cluster, spans_nodes=spans_nodes, ranks_per_node=ranks_per_node)
    if latency_only:
        nbytes = 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes / bw + (n - 1) * alpha
    if kind in ("broadcast", "p2p"):
        return nbytes / bw + alpha
    if kind == "all_to_all":  # `nbytes`: what leaves the rank, to the n - 1 others
        return nbytes / bw + (n - 1) * alpha
    raise AssertionError(f"unknown collective {kind}")
