"""Hardware primitives of the cost model: GEMM, memory-bound and collective times on a `Cluster`.

Collectives follow NCCL's ring algorithms (calibration.md section 5): with S bytes, n ranks, bus bandwidth B
and per-step latency a,
    all-reduce              2(n-1)/n * S/B + 2(n-1) a
    all-gather, reduce-scatter (n-1)/n * S/B + (n-1) a     (S = the full, gathered tensor)
    broadcast, reduce, p2p  S/B + a
A collective whose group spans nodes runs at the inter-node bandwidth.
"""

from __future__ import annotations

from partc.cluster import Cluster
from partc.ir import Gemm

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")


def gemm_efficiency(cluster: Cluster, m: float, n: float, k: float) -> float:
    """Achievable fraction of peak for an (m x k) @ (k x n) product: saturates with each dimension."""
    h = cluster.gemm_half_size
    return cluster.gemm_efficiency * (m / (m + h)) * (n / (n + h)) * (k / (k + h))


def gemm_time(cluster: Cluster, gemm: Gemm, *, micro_batch_size: int = 1, split: str | None = None,
              degree: int = 1) -> float:
    """Seconds for one GEMM of a micro-batch, optionally split `degree` ways along ``m``, ``n``, ``k`` or
    ``batch`` (tensor parallelism)."""
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
    flops = 2.0 * batch * m * n * k
    return flops / (cluster.peak_flops * gemm_efficiency(cluster, m, n, k))


def memory_time(cluster: Cluster, nbytes: float) -> float:
    """Seconds for a memory-bound kernel moving `nbytes` through HBM."""
    return nbytes / (cluster.memory_bandwidth * cluster.memory_efficiency)


def link(cluster: Cluster, *, spans_nodes: bool) -> tuple[float, float]:
    """(bus bandwidth in bytes/s, per-step latency in s) of a collective group."""
    if spans_nodes:
        return (cluster.inter_node_bandwidth * cluster.inter_node_efficiency, cluster.inter_node_latency)
    return (cluster.intra_node_bandwidth * cluster.intra_node_efficiency, cluster.intra_node_latency)


def collective_time(cluster: Cluster, kind: str, nbytes: float, n: int, *, spans_nodes: bool = False) -> float:
    """Seconds for one ring collective of `nbytes` over `n` ranks (0 when n == 1)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, alpha = link(cluster, spans_nodes=spans_nodes)
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes / bw + (n - 1) * alpha
    if kind in ("broadcast", "p2p"):
        return nbytes / bw + alpha
    raise AssertionError(f"unknown collective {kind}")
