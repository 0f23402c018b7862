"""Pipeline stage partition: split units into contiguous stages so that the slowest stage is as fast as possible.

A pure function over plain lists (Alpa's stage DP, Zheng et al. OSDI'22 section 5, without its sum term), so the
outer search can call it thousands of times and the tests can check it against brute force.

Units 0..n-1 in execution order go to stages 0..p-1; stage k owns units [s, e). Per micro-batch, on one GPU:

    time_k(s, e) = sum(time[s:e]) + cut_time[s-1] (if s > 0) + cut_time[e-1] (if e < n)
    mem_k(s, e)  = sum(static_mem[s:e]) + in_flight[k] * sum(act_mem[s:e]) + extra_mem[k]    must be <= mem_limit

A boundary after unit i costs cut_time[i] to both stages next to it (the sender and the receiver of the p2p).
The first `first_required` units sit on stage 0, the last `last_required` on stage p-1.

    T* = min over partitions of  max_k time_k

Why a DP and not "binary search T + greedy fill from the left": the greedy is exact only when a stage that fits
still fits after units are removed from its front. Here it does not hold: moving a boundary moves which
cut_time[i] both neighbours pay (cut times are not monotone in i), and extra_mem[k] is arbitrary per stage. The DP
below is exact for any non-negative inputs and costs O(p * n^2) element operations, done as NumPy rows: about a
millisecond per stage for n = 130.

    1. matrices  T[s, e] = time_k(s, e) (stage independent), S[s, e], A[s, e] = memory sums (prefix differences)
    2. min-max   best_k[e] = min_s max(best_{k-1}[s], T_k[s, e])   (T_k: T with inf where stage k's memory fails)
                 T* = min_{s <= n - last_required} max(best_{p-2}[s], T_{p-1}[s, n])
    3. ties      among partitions with every time_k <= T*, the most balanced one: minimal sum_k time_k^2 (a suffix
                 DP, cost_k[s] = min_e T_k[s, e]^2 + cost_{k+1}[e]), then the earliest boundaries (the lexicographically
                 smallest ends), so identical inputs give identical splits and early 1F1B stages, which hold the most
                 micro-batches in flight, get the lighter share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

INF = float("inf")


@dataclass(kw_only=True, slots=True)
class StagePartition:
    bounds: list[tuple[int, int]]
    """Stage k owns units [start, end) (end exclusive), in order; together they cover 0..n."""
    max_time: float
    """Seconds of the slowest stage per micro-batch: the optimum T*."""
    stage_times: list[float]
    """time_k of each stage, boundary p2p included."""
    stage_mem: list[float]
    """mem_k of each stage in bytes (model states + in-flight activations + extra)."""


def partition_stages(time: Sequence[float], cut_time: Sequence[float], static_mem: Sequence[float],
                     act_mem: Sequence[float], *, num_stages: int, in_flight: Sequence[float], mem_limit: float,
                     extra_mem: Sequence[float] | None = None, first_required: int = 0,
                     last_required: int = 0) -> StagePartition | None:
    """Exact min-max split of n units into `num_stages` contiguous non-empty stages (see the module docstring).

    Returns None when no split fits: more stages than units, the required ends overlap, or memory.
    """
    n, p = len(time), num_stages
    extra = [0.0] * p if extra_mem is None else list(extra_mem)
    assert p >= 1, p
    assert len(cut_time) == max(n - 1, 0) and len(static_mem) == n and len(act_mem) == n, "per-unit lists differ"
    assert len(in_flight) == p and len(extra) == p, "per-stage lists must have num_stages entries"
    assert 0 <= first_required <= n and 0 <= last_required <= n
    if n == 0 or p > n:
        return None
    a, z = first_required, last_required
    if p > 1 and a > n - z:  # stage 0 must end at or after a, the last stage start at or before n - z
        return None

    # 1. Matrices over (start s, end e), 0 <= s < e <= n; inf where e <= s.
    pt = np.concatenate(([0.0], np.cumsum(np.asarray(time, dtype=float))))
    ps = np.concatenate(([0.0], np.cumsum(np.asarray(static_mem, dtype=float))))
    pa = np.concatenate(([0.0], np.cumsum(np.asarray(act_mem, dtype=float))))
    cut = np.asarray(cut_time, dtype=float)
    front = np.zeros(n + 1)  # front[s] = cut_time[s-1]: paid by a stage that starts at 0 < s < n
    front[1:n] = cut
    back = np.zeros(n + 1)  # back[e] = cut_time[e-1]: paid by a stage that ends at 0 < e < n
    back[1:n] = cut
    valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
    times = np.where(valid, (pt[None, :] - pt[:, None]) + front[:, None] + back[None, :], INF)
    static = ps[None, :] - ps[:, None]
    act = pa[None, :] - pa[:, None]

    def stage_matrix(k: int) -> np.ndarray:
        """T_k: stage times with inf where stage k would not fit in memory."""
        fits = static + in_flight[k] * act + extra[k] <= mem_limit
        tk = np.where(fits, times, INF)
        if k == 0:
            tk[1:, :] = INF  # stage 0 starts at unit 0 ...
            tk[:, :a] = INF  # ... and ends at or after the first_required units
        if k == p - 1:
            tk[:, :n] = INF  # the last stage ends at n ...
            tk[n - z + 1:, :] = INF  # ... and starts at or before the last_required units
        return tk

    # 2. Min-max DP: best[e] = the best max time of stages 0..k covering units [0, e).
    mats = [stage_matrix(k) for k in range(p)]
    best = mats[0][0].copy()
    for k in range(1, p):
        best = np.maximum(best[:, None], mats[k]).min(axis=0)
    t_star = float(best[n])
    if t_star == INF:
        return None

    # 3. Ties: minimal sum of squared stage times among the T*-feasible splits, then the earliest ends.
    squares = [np.where(m <= t_star, m * m, INF) for m in mats]
    costs = [np.empty(0)] * p  # costs[k][s]: min sum of squares of stages k..p-1 covering [s, n)
    costs[p - 1] = squares[p - 1][:, n].copy()
    for k in range(p - 2, -1, -1):
        costs[k] = (squares[k] + costs[k + 1][None, :]).min(axis=1)
    assert costs[0][0] < INF  # the split that reached T* satisfies every mask
    bounds, s = [], 0
    for k in range(p - 1):
        row = squares[k][s] + costs[k + 1]
        target = row.min()
        e = int(np.flatnonzero(row <= target + 1e-12 * abs(target))[0])  # earliest end among (near-)equal ones
        bounds.append((s, e))
        s = e
    bounds.append((s, n))

    stage_times = [float(times[s, e]) for s, e in bounds]
    stage_mem = [float(static[s, e] + in_flight[k] * act[s, e] + extra[k]) for k, (s, e) in enumerate(bounds)]
    return StagePartition(bounds=bounds, max_time=max(stage_times), stage_times=stage_times, stage_mem=stage_mem)


def stage_memory(bounds: Sequence[tuple[int, int]], static_mem: Sequence[float], act_mem: Sequence[float],
                 in_flight: Sequence[float], extra_mem: Sequence[float] | None = None) -> list[float]:
    """mem_k of each stage of a given split, computed exactly as `partition_stages` does (prefix sums)."""
    ps = np.concatenate(([0.0], np.cumsum(np.asarray(static_mem, dtype=float))))
    pa = np.concatenate(([0.0], np.cumsum(np.asarray(act_mem, dtype=float))))
    extra = [0.0] * len(bounds) if extra_mem is None else list(extra_mem)
    return [float((ps[e] - ps[s]) + in_flight[k] * (pa[e] - pa[s]) + extra[k]) for k, (s, e) in enumerate(bounds)]
