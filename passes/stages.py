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
below is exact for any non-negative inputs. Stage k can only start in [k, k + w) and end in [k + 1, k + 1 + w),
w = n - p + 1 (every other stage holds a unit), so it costs O(p * w^2) element operations, done as NumPy arrays
over all stages at once where it can: a few milliseconds for n = 130 at any p.

    1. matrices  T[s, e] = time_k(s, e) (stage independent), S[s, e], A[s, e] = memory sums (prefix differences),
                 and each stage's w x w window of them
    2. min-max   best_k[e] = min_s max(best_{k-1}[s], T_k[s, e])   (T_k: T with inf where stage k's memory fails)
                 T* = min_{s <= n - last_required} max(best_{p-2}[s], T_{p-1}[s, n])
    3. ties      among partitions with every time_k <= T*, the most balanced one: minimal sum_k time_k^2 (a suffix
                 DP, cost_k[s] = min_e T_k[s, e]^2 + cost_{k+1}[e], over the entries within T* only), then the
                 earliest boundaries (the lexicographically smallest ends), so identical inputs give identical splits
                 and early 1F1B stages, which hold the most micro-batches in flight, get the lighter share.
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


def span_matrices(time: Sequence[float], cut_time: Sequence[float], static_mem: Sequence[float],
                  act_mem: Sequence[float], *, num_stages: int, in_flight: Sequence[float],
                  extra_mem: Sequence[float] | None = None, first_required: int = 0,
                  last_required: int = 0) -> tuple[int, int, list[float], np.ndarray, np.ndarray, np.ndarray] | None:
    """The inputs checked, and (n, p, extra, times, static, act): the time, model states and activations of a stage
    spanning units [s, e), as (n + 1) x (n + 1) matrices; None when no split exists (more stages than units, the
    required ends overlap)."""
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
    ps = np.concatenate(([0.0], np.cumsum(np.asarray(static_mem, dtype=float))))
    pa = np.concatenate(([0.0], np.cumsum(np.asarray(act_mem, dtype=float))))
    times = time_matrix(time, cut_time)
    static = ps[None, :] - ps[:, None]
    act = pa[None, :] - pa[:, None]
    return n, p, extra, times, static, act


def time_matrix(time: Sequence[float], cut_time: Sequence[float]) -> np.ndarray:
    """T[s, e] = time_k(s, e), an (n + 1) x (n + 1) matrix, inf where e <= s."""
    n = len(time)
    pt = np.concatenate(([0.0], np.cumsum(np.asarray(time, dtype=float))))
    cut = np.asarray(cut_time, dtype=float)
    front = np.zeros(n + 1)  # front[s] = cut_time[s-1]: paid by a stage that starts at 0 < s < n
    front[1:n] = cut
    back = np.zeros(n + 1)  # back[e] = cut_time[e-1]: paid by a stage that ends at 0 < e < n
    back[1:n] = cut
    valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
    return np.where(valid, (pt[None, :] - pt[:, None]) + front[:, None] + back[None, :], INF)


class FreeSplits:
    """`partition_stages` without a memory limit for one list of unit times and any number of stages, with the
    same answers (the tests compare them). Without memory, stage k's times are T's whatever the stage count, so the
    min-max DP's prefix (step 2: best_k over the full matrix, one NumPy step each) is computed once for all stage
    counts, and the tie-break (step 3) runs over the full matrix, restricted to the rows a split within T* can
    reach. Each min and max is exact and each sum adds the same two numbers as `partition_stages`, so the splits
    are the same bit for bit."""

    def __init__(self, time: Sequence[float], cut_time: Sequence[float], *, first_required: int = 0,
                 last_required: int = 0):
        n = len(time)
        assert len(cut_time) == max(n - 1, 0), "per-unit lists differ"
        assert 0 <= first_required <= n and 0 <= last_required <= n
        self.n, self.first_required, self.last_required = n, first_required, last_required
        self.times = time_matrix(time, cut_time)
        first = self.times[0].copy()
        first[:max(first_required, 1)] = INF  # stage 0 ends at or after the units required on it
        self._prefix = [first]  # _prefix[k][e]: the least max time of stages 0..k covering units [0, e)

    def split(self, num_stages: int) -> list[tuple[int, int]] | None:
        """The bounds `partition_stages` returns for `num_stages` stages and no memory limit (None: no split)."""
        n, p, a, z, times = self.n, num_stages, self.first_required, self.last_required, self.times
        assert p >= 1, p
        if n == 0 or p > n or (p > 1 and a > n - z):
            return None
        if p == 1:
            return None if times[0, n] == INF else [(0, n)]
        while len(self._prefix) < p - 1:
            self._prefix.append(np.maximum(self._prefix[-1][:, None], times).min(axis=0))
        # The last stage [s, n) starts at or before the units required on it.
        t_star = float(np.maximum(self._prefix[p - 2][:n - z + 1], times[:n - z + 1, n]).min())
        if t_star == INF:
            return None
        squares = np.where(times <= t_star, times, INF)
        squares *= squares
        # costs[k][i]: the least sum of squares of stages k..p-1 covering [k + i, n), each within T*; stage k
        # starts at k + i and ends at k + 1 + j, 0 <= i, j < w (`partition_stages`' windows).
        w = n - p + 1
        costs = [None] * p
        costs[p - 1] = squares[p - 1:n, n].copy()
        costs[p - 1][max(n - z - p + 2, 0):] = INF  # the last stage starts at or before the units required on it
        for k in range(p - 2, 0, -1):
            costs[k] = (squares[k:k + w, k + 1:k + 1 + w] + costs[k + 1][None, :]).min(axis=1)
        bounds, s = [], 0
        for k in range(p - 1):
            row = squares[s, k + 1:k + 1 + w] + costs[k + 1]
            if k == 0:
                row[:max(a - 1, 0)] = INF  # stage 0 ends at or after the units required on it
            target = row.min()
            assert target < INF  # the split that reached T* is within every mask
            e = k + 1 + int(np.flatnonzero(row <= target + 1e-12 * abs(target))[0])  # earliest of (near-)equal ends
            bounds.append((s, e))
            s = e
        bounds.append((s, n))
        return bounds


def partition_stages(time: Sequence[float], cut_time: Sequence[float], static_mem: Sequence[float],
                     act_mem: Sequence[float], *, num_stages: int, in_flight: Sequence[float], mem_limit: float,
                     extra_mem: Sequence[float] | None = None, first_required: int = 0,
                     last_required: int = 0) -> StagePartition | None:
    """Exact min-max split of n units into `num_stages` contiguous non-empty stages (see the module docstring).

    Returns None when no split fits: more stages than units, the required ends overlap, or memory.
    """
    mats = span_matrices(time, cut_time, static_mem, act_mem, num_stages=num_stages, in_flight=in_flight,
                         extra_mem=extra_mem, first_required=first_required, last_required=last_required)
    if mats is None:
        return None
    n, p, extra, times, static, act = mats
    a, z = first_required, last_required

    # Stage k starts at s = k + i and ends at e = k + 1 + j, 0 <= i, j < w = n - p + 1: the k stages before it
    # and the p - 1 - k after it hold a unit each. Its window of a matrix is the w x w block at (k, k + 1) (all
    # stages at once: a strided view of shape (p, w, w)), and the end index j of stage k - 1 is the start index i
    # of stage k.
    w = n - p + 1

    def windows(mat: np.ndarray) -> np.ndarray:
        s0, s1 = mat.strides
        return np.lib.stride_tricks.as_strided(mat[:, 1:], shape=(p, w, w), strides=(s0 + s1, s0, s1),
                                               writeable=False)

    # T[k]: stage k's times, inf where it would not fit in memory (inputs are finite: nothing fails an infinite
    # limit), where stage 0 does not start at unit 0 or ends before the first_required units, and where the last
    # stage does not end at n or starts after the last_required units.
    if mem_limit == INF:
        mats = windows(times).copy()
    else:
        fits = (windows(static) + np.asarray(in_flight, dtype=float)[:, None, None] * windows(act)
                + np.asarray(extra, dtype=float)[:, None, None] <= mem_limit)
        mats = np.where(fits, windows(times), INF)
    mats[0, 1:, :] = INF
    mats[0, :, :max(a - 1, 0)] = INF  # e = 1 + j >= a
    mats[p - 1, :, :w - 1] = INF
    mats[p - 1, max(n - z - p + 2, 0):, :] = INF  # s = p - 1 + i <= n - z

    # 2. Min-max DP: best[j] = the best max time of stages 0..k covering units [0, k + 1 + j).
    best = mats[0, 0].copy()
    for k in range(1, p):
        best = np.maximum(best[:, None], mats[k]).min(axis=0)
    t_star = float(best[w - 1])
    if t_star == INF:
        return None

    # 3. Ties: minimal sum of squared stage times among the T*-feasible splits, then the earliest ends. Only the
    #    entries within T* take part (a few percent of the windows): they are listed by stage, start and end.
    kk, ii, jj = np.nonzero(mats <= t_star)
    times_e = mats[kk, ii, jj]
    squares = times_e * times_e
    at = np.searchsorted(kk, np.arange(p + 1))  # stage k's entries: at[k]:at[k + 1]
    first = np.ones(len(kk), dtype=bool)  # the first entry of each (stage, start)
    first[1:] = (ii[1:] != ii[:-1]) | (kk[1:] != kk[:-1])
    costs = np.full((p, w), INF)  # costs[k][i]: min sum of squares of stages k..p-1 covering [k + i, n)
    costs[p - 1][ii[at[p - 1]:]] = squares[at[p - 1]:]  # the last stage's one end: n
    for k in range(p - 2, -1, -1):
        lo, hi = at[k], at[k + 1]
        if hi > lo:
            starts = np.flatnonzero(first[lo:hi])
            costs[k][ii[lo:hi][starts]] = np.minimum.reduceat(squares[lo:hi] + costs[k + 1][jj[lo:hi]], starts)
    assert costs[0][0] < INF  # the split that reached T* satisfies every mask
    bounds, i = [], 0
    for k in range(p - 1):
        lo, hi = np.searchsorted(ii[at[k]:at[k + 1]], (i, i + 1)) + at[k]  # stage k's entries starting at i
        row = squares[lo:hi] + costs[k + 1][jj[lo:hi]]
        target = row.min()
        j = int(jj[lo + np.flatnonzero(row <= target + 1e-12 * abs(target))[0]])  # earliest of (near-)equal ends
        bounds.append((k + i, k + 1 + j))
        i = j
    bounds.append((p - 1 + i, n))

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
