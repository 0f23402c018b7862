"""passes.stages.partition_stages against brute force over every contiguous split."""

from __future__ import annotations

import itertools
import random

import numpy as np

from partc.passes.stages import FreeSplits, partition_stages, span_matrices

INF = float("inf")


def brute_force(time, cut, static, act, p, in_flight, limit, extra, a, z):
    """All feasible splits as (max time, sum of squares, ends, bounds, stage times, stage memory), best first."""
    n = len(time)
    found = []
    for cuts in itertools.combinations(range(1, n), p - 1):
        ends = list(cuts) + [n]
        bounds = list(zip([0] + list(cuts), ends))
        if bounds[0][1] < a or bounds[-1][0] > n - z:
            continue
        times, mems = [], []
        for k, (s, e) in enumerate(bounds):
            times.append(sum(time[s:e]) + (cut[s - 1] if s > 0 else 0) + (cut[e - 1] if e < n else 0))
            mems.append(sum(static[s:e]) + in_flight[k] * sum(act[s:e]) + extra[k])
        if all(m <= limit for m in mems):
            found.append((max(times), sum(t * t for t in times), ends, bounds, times, mems))
    return sorted(found, key=lambda f: f[:3])


def dense_reference(time, cut_time, static_mem, act_mem, *, num_stages, in_flight, mem_limit, extra_mem=None,
                    first_required=0, last_required=0):
    """The DP as first written: (n + 1) x (n + 1) matrices for every stage, dense tie-break (exact, slower)."""
    mats = span_matrices(time, cut_time, static_mem, act_mem, num_stages=num_stages, in_flight=in_flight,
                         extra_mem=extra_mem, first_required=first_required, last_required=last_required)
    if mats is None:
        return None
    n, p, extra, times, static, act = mats
    a, z = first_required, last_required

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
    return dict(bounds=bounds, max_time=max(stage_times), stage_times=stage_times, stage_mem=stage_mem)


def test_random_small_instances_match_brute_force():
    rng = random.Random(0)
    checked = infeasible = 0
    for _ in range(1500):
        n, p = rng.randint(1, 8), rng.randint(1, 4)
        time = [rng.randint(0, 9) for _ in range(n)]  # integers: sums are exact, so ties are exact too
        cut = [rng.choice([0, 0, 1, 3]) for _ in range(n - 1)]
        static = [rng.randint(0, 5) for _ in range(n)]
        act = [rng.randint(0, 4) for _ in range(n)]
        in_flight = [p - k for k in range(p)] if rng.random() < 0.6 else [rng.randint(0, 4) for _ in range(p)]
        extra = [rng.randint(0, 6) for _ in range(p)] if rng.random() < 0.5 else None
        limit = rng.randint(4, 40)
        a, z = rng.randint(0, min(2, n)), rng.randint(0, min(2, n))
        got = partition_stages(time, cut, static, act, num_stages=p, in_flight=in_flight, mem_limit=limit,
                               extra_mem=extra, first_required=a, last_required=z)
        want = brute_force(time, cut, static, act, p, in_flight, limit, extra or [0] * p, a, z)
        if not want:
            assert got is None, (time, cut, p)
            infeasible += 1
            continue
        best = want[0]
        assert got is not None
        assert got.max_time == best[0]
        assert got.bounds == best[3]  # the tie-break: min sum of squares, then the earliest ends
        assert got.stage_times == best[4] and got.stage_mem == best[5]
        checked += 1
    assert checked > 500 and infeasible > 100  # both branches are exercised


def test_required_ends_and_cut_costs():
    time = [1.0] * 6
    # Without requirements three stages of two units are best.
    free = partition_stages(time, [0.0] * 5, [0] * 6, [0] * 6, num_stages=3, in_flight=[3, 2, 1], mem_limit=1)
    assert free.bounds == [(0, 2), (2, 4), (4, 6)] and free.max_time == 2.0
    # The first three units on stage 0 and the last two on stage 2 leave one unit for the middle stage.
    req = partition_stages(time, [0.0] * 5, [0] * 6, [0] * 6, num_stages=3, in_flight=[3, 2, 1], mem_limit=1,
                           first_required=3, last_required=2)
    assert req.bounds == [(0, 3), (3, 4), (4, 6)] and req.max_time == 3.0
    # A boundary is paid by both neighbours: a cheap cut after unit 2 beats the balanced cuts.
    cut = [5.0, 5.0, 0.0, 5.0, 5.0]
    two = partition_stages(time, cut, [0] * 6, [0] * 6, num_stages=2, in_flight=[2, 1], mem_limit=1)
    assert two.bounds == [(0, 3), (3, 6)] and two.stage_times == [3.0, 3.0]
    cut = [0.0, 5.0, 5.0, 5.0, 0.0]
    two = partition_stages(time, cut, [0] * 6, [0] * 6, num_stages=2, in_flight=[2, 1], mem_limit=1)
    # Cutting after unit 0 or unit 4 ties (times 1 + 5); the earliest boundary wins.
    assert two.bounds == [(0, 1), (1, 6)] and two.stage_times == [1.0, 5.0]


def test_balanced_tie_break():
    # Several splits reach max time 4; the most balanced one (4, 3, 3) wins over (4, 4, 2) or (2, 4, 4).
    got = partition_stages([1.0] * 10, [0.0] * 9, [0] * 10, [0] * 10, num_stages=3, in_flight=[1, 1, 1],
                           mem_limit=0)
    assert got.max_time == 4.0 and got.bounds == [(0, 3), (3, 6), (6, 10)]


def test_infeasible_cases():
    args = dict(cut_time=[0.0, 0.0], static_mem=[1, 1, 1], act_mem=[1, 1, 1])
    assert partition_stages([1.0] * 3, num_stages=4, in_flight=[1] * 4, mem_limit=100, **args) is None
    assert partition_stages([1.0] * 3, num_stages=3, in_flight=[3, 2, 1], mem_limit=3, **args) is None  # 1 + 3*1
    assert partition_stages([1.0] * 3, num_stages=3, in_flight=[3, 2, 1], mem_limit=4, **args).bounds == \
        [(0, 1), (1, 2), (2, 3)]
    assert partition_stages([1.0] * 3, num_stages=2, in_flight=[1, 1], mem_limit=100, first_required=2,
                            last_required=2, **args) is None  # the required ends overlap
    # Extra memory on stage 0 (say embedding gradients) pushes units right.
    got = partition_stages([1.0] * 3, num_stages=2, in_flight=[1, 1], mem_limit=4, extra_mem=[2, 0], **args)
    assert got.bounds == [(0, 1), (1, 3)] and got.stage_mem == [4.0, 4.0]


def feasible(time, cut, static, act, p, in_flight, limit, a, z, bound) -> bool:
    """Whether some split has every stage time <= `bound` and every stage memory <= `limit`: reachability over
    stage ends, O(p · n²) and independent of the DP's min-max and tie-break (exact on integer inputs)."""
    n = len(time)
    pt, ps, pa = ([0] + list(itertools.accumulate(x)) for x in (time, static, act))

    def fits(k, s, e):
        t = pt[e] - pt[s] + (cut[s - 1] if s > 0 else 0) + (cut[e - 1] if e < n else 0)
        return t <= bound and ps[e] - ps[s] + in_flight[k] * (pa[e] - pa[s]) <= limit

    starts = {0}  # where stage k may start
    for k in range(p - 1):
        starts = {e for e in range(max(k + 1, a if k == 0 else 0), n) if any(s < e and fits(k, s, e) for s in starts)}
    return any(s < n and s <= n - z and fits(p - 1, s, n) for s in starts)


def test_feasibility_check_matches_brute_force():
    """`feasible` (the large instance's check below) against brute force: the optimum is feasible, one less is not."""
    rng = random.Random(2)
    checked = 0
    for _ in range(300):
        n, p = rng.randint(1, 7), rng.randint(1, 4)
        time = [rng.randint(0, 9) for _ in range(n)]
        cut = [rng.choice([0, 1, 3]) for _ in range(n - 1)]
        static, act = [rng.randint(0, 5) for _ in range(n)], [rng.randint(0, 4) for _ in range(n)]
        in_flight = [p - k for k in range(p)]
        limit, a, z = rng.randint(4, 40), rng.randint(0, min(2, n)), rng.randint(0, min(2, n))
        want = brute_force(time, cut, static, act, p, in_flight, limit, [0] * p, a, z)
        best = want[0][0] if want else 10**6
        assert feasible(time, cut, static, act, p, in_flight, limit, a, z, best) == bool(want)
        assert not feasible(time, cut, static, act, p, in_flight, limit, a, z, best - 1)
        checked += bool(want)
    assert checked > 100


def test_large_instance_is_optimal():
    """130 units on 64 stages (GPT-3 175B's 96 blocks at pp = 64 is this size), with memory that binds on the
    first stages: the split is valid, its times and memory are what the formulas give, and no split has a
    smaller slowest stage (integer inputs, so "smaller" is exactly max_time - 1)."""
    rng = random.Random(1)
    n, p = 130, 64
    time = [rng.randint(1000, 2000) for _ in range(n)]
    cut = [rng.randint(10, 100) for _ in range(n - 1)]
    static = [rng.randint(100, 1000) for _ in range(n)]
    act = [rng.randint(10, 60) for _ in range(n)]
    in_flight = [p - k for k in range(p)]
    limit, a, z = 6000, 1, 2
    got = partition_stages(time, cut, static, act, num_stages=p, in_flight=in_flight, mem_limit=limit,
                           first_required=a, last_required=z)
    assert got is not None and len(got.bounds) == p
    assert got.bounds[0][0] == 0 and got.bounds[-1][1] == n and got.bounds[0][1] >= a and got.bounds[-1][0] <= n - z
    assert all(s < e for s, e in got.bounds) and all(b[1] == c[0] for b, c in zip(got.bounds, got.bounds[1:]))
    for k, (s, e) in enumerate(got.bounds):
        assert got.stage_times[k] == sum(time[s:e]) + (cut[s - 1] if s > 0 else 0) + (cut[e - 1] if e < n else 0)
        assert got.stage_mem[k] == sum(static[s:e]) + in_flight[k] * sum(act[s:e]) <= limit
    assert got.max_time == max(got.stage_times)
    assert feasible(time, cut, static, act, p, in_flight, limit, a, z, got.max_time)
    assert not feasible(time, cut, static, act, p, in_flight, limit, a, z, got.max_time - 1)
    # The memory limit shapes the answer: without it the slowest stage is faster.
    free = partition_stages(time, cut, static, act, num_stages=p, in_flight=in_flight, mem_limit=float("inf"),
                            first_required=a, last_required=z)
    assert free.max_time < got.max_time


def test_larger_instances_match_the_dense_dp():
    """The banded windows and the sparse tie-break give exactly what the dense DP gives, up to p = n (where brute
    force cannot go): identical blocks with ties everywhere, random times, memory limits that bind."""
    rng = random.Random(2)
    found = 0
    for _ in range(300):
        n = rng.randint(2, 40)
        p = rng.choice([1, 2, rng.randint(1, n), n - 1, n]) or 1
        block = rng.choice([True, False])
        time = [1.0 if block else rng.uniform(0.5, 2.0) for _ in range(n)]
        time[0], time[-1] = rng.uniform(0.1, 1.0), rng.uniform(0.1, 1.0)
        cut = [rng.choice([0.0, 0.01, 0.2]) for _ in range(n - 1)]
        static = [rng.uniform(0.5, 1.5) for _ in range(n)]
        act = [rng.uniform(0.0, 1.0) for _ in range(n)]
        in_flight = [float(min(p - k, 4)) for k in range(p)]
        extra = [rng.uniform(0, 1) for _ in range(p)]
        limit = rng.choice([INF, rng.uniform(2, 3 * n / p + 3)])
        a, z = rng.randint(0, 2), rng.randint(0, 2)
        kw = dict(num_stages=p, in_flight=in_flight, mem_limit=limit, extra_mem=extra, first_required=min(a, n),
                  last_required=min(z, n))
        got, want = partition_stages(time, cut, static, act, **kw), dense_reference(time, cut, static, act, **kw)
        if want is None:
            assert got is None
            continue
        found += 1
        assert (got.bounds, got.max_time, got.stage_times, got.stage_mem) == (
            want["bounds"], want["max_time"], want["stage_times"], want["stage_mem"])
    assert found > 150


def test_free_splits_equal_partition_stages_without_a_memory_limit():
    """`FreeSplits` (one prefix DP for every stage count) returns `partition_stages`' bounds at an infinite limit,
    float times included (near-ties, cuts the program cannot make at inf), for every stage count of each input."""
    rng = random.Random(1)
    compared = splits = 0
    for trial in range(300):
        n = rng.randint(1, 24)
        if trial % 3 == 0:  # identical blocks between an embedding and a head, as a GPT's units
            block = rng.uniform(0.5, 2.0)
            time = [rng.uniform(0.1, 1.0)] + [block] * (n - 2) + [rng.uniform(0.1, 3.0)] if n > 2 else [block] * n
        else:
            time = [rng.choice([rng.randint(0, 9), rng.uniform(0, 9)]) for _ in range(n)]
        cut = [rng.choice([0.0, 0.1, 0.3, 1 / 3, INF if rng.random() < 0.1 else 0.2]) for _ in range(n - 1)]
        a, z = rng.randint(0, min(3, n)), rng.randint(0, min(3, n))
        free = FreeSplits(time, cut, first_required=a, last_required=z)
        for p in rng.sample(range(1, n + 2), min(n + 1, 8)):
            want = partition_stages(time, cut, [0.0] * n, [0.0] * n, num_stages=p, in_flight=[0.0] * p,
                                    mem_limit=INF, first_required=a, last_required=z)
            got = free.split(p)
            assert got == (None if want is None else want.bounds), (time, cut, a, z, p)
            compared += 1
            splits += want is not None
    assert compared > 1500 and splits > 1000
