"""The pipeline schedule as the cost model walks it (`partc.passes.schedule`) and as the runtime lowers it
(`partc.runtime.schedule`), against torch.distributed.pipelining's own."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from torch.distributed.pipelining import ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _add_send_recv

from partc._torch import RESHARD, UNSHARD
from partc.passes import schedule
from partc.runtime.schedule import gather_once


def torch_order(p: int, v: int, m: int, rank: int) -> list:
    ns = SimpleNamespace(n_local_stages=v, microbatches_per_round=m // max(1, m // p), pp_group_size=p,
                         _n_microbatches=m)
    return [a for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(ns, rank) if a is not None]


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 4, 8), (4, 2, 8), (4, 3, 4), (3, 2, 9), (4, 6, 16), (8, 3, 8),
                                   (4, 2, 6)])
def test_interleaved_order_is_torchs(p, v, m):
    for rank in range(p):
        want = [(a.computation_type.value == "F", a.stage_index // p) for a in torch_order(p, v, m, rank)]
        assert schedule.interleaved_order(p, v, m, rank) == want, rank


def test_peak_walks_the_order():
    """The peak equals a direct walk of the order (each forward adds its chunk's bytes, each backward first adds
    the gradient buffer, then frees both), for chunks of unequal size."""
    p, v, m = 4, 3, 8
    rng = np.random.default_rng(0)
    for rank in range(p):
        held, grad = rng.uniform(1, 10, v), rng.uniform(0, 1, v)
        live = peak = 0.0
        for forward, j in schedule.interleaved_order(p, v, m, rank):
            if forward:
                live += held[j]
            else:
                peak = max(peak, live + grad[j])
                live -= held[j]
        assert schedule.peak_bytes(p, v, m, rank, held, grad) == pytest.approx(peak)
    # equal chunks: the number in flight at the peak times one chunk, the cost model's `in_flight` for v > 1
    from partc.passes.memory import in_flight
    from partc.parallel import Parallel
    par = Parallel(dp=1, tp=1, pp=p, zero=0, micro_batch_size=1, global_batch_size=m, schedule="interleaved-1f1b",
                   virtual_stages=v)
    for rank in range(p):
        assert schedule.peak_bytes(p, v, m, rank, [1.0] * v, [0.0] * v) == pytest.approx(in_flight(par, rank) * v)


@pytest.mark.parametrize("p,v", [(2, 2), (3, 4), (4, 3), (8, 2), (5, 8)])
def test_states_before_backwards_walk_the_order(p, v):
    """`peak_bytes`'s candidate states (computed as arrays) are those of a walk of `interleaved_order`: each chunk's
    forwards in flight just before each backward, and that backward's chunk, for micro-batch counts that are and
    are not multiples of p."""
    for m in [1, p - 1, p, p + 1, 2 * p, 3 * p + 1, 5 * p]:
        for rank in range(p):
            live, rows = [0] * v, set()
            for forward, j in schedule.interleaved_order(p, v, m, rank):
                if forward:
                    live[j] += 1
                else:
                    rows.add((*live, j))
                    live[j] -= 1
            counts, chunk = schedule._before_backwards(p, v, m, rank)
            assert sorted(rows) == [(*map(int, c), int(j)) for c, j in zip(counts, chunk)], (m, rank)


def test_each_chunk_gathered_once_a_step():
    """torch keeps at most 3 chunks gathered (FSDP unshard/reshard in the lowered schedule); with v = 4 it gathers a
    chunk again each time it comes back. `gather_once`: one UNSHARD per local chunk, before its first compute
    action, every RESHARD at the end, the other actions in torch's order."""
    p, v, m = 2, 4, 4
    from torch.distributed.pipelining.schedules import _add_unshard_reshard
    orders = {r: _add_unshard_reshard(torch_order(p, v, m, r)) for r in range(p)}
    lowered = _add_send_recv(orders, stage_to_rank=lambda s: s % p, num_stages=p * v)
    assert sum(a.computation_type == UNSHARD for a in lowered[0]) > v  # torch's: regathers
    for rank, order in lowered.items():
        out = gather_once(order)
        kinds = [a.computation_type for a in out]
        assert kinds.count(UNSHARD) == v and kinds.count(RESHARD) == v
        assert all(k == RESHARD for k in kinds[-v:])
        assert [a for a in out if a.computation_type not in (UNSHARD, RESHARD)] == \
               [a for a in order if a.computation_type not in (UNSHARD, RESHARD)]
        for i, a in enumerate(out):
            if a.computation_type == UNSHARD:
                first = next(b for b in out if b.is_compute_op and b.stage_index == a.stage_index)
                assert out.index(first) > i


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 4, 8), (4, 2, 8), (4, 3, 4), (16, 8, 16), (4, 2, 6)])
def test_gradients_held_follow_torchs_reductions(p, v, m):
    """Below ZeRO-2 a chunk's accumulation lives from its first backward to the ``REDUCE_GRAD`` torch schedules right
    after its last one; then only its shards: the walk of torch's order with those actions gives the same most."""
    from torch.distributed.pipelining.schedules import _add_reduce_grad
    acc, shard = [float(10 ** j) for j in range(v)], [0.5 * 10 ** j for j in range(v)]
    for rank in range(p):
        held, most = {}, 0.0
        for a in _add_reduce_grad(torch_order(p, v, m, rank), m):
            kind, j = a.computation_type.value, a.stage_index // p
            if kind == "B" and j not in held:
                held[j] = acc[j]
            elif kind == "REDUCE_GRAD":
                held[j] = shard[j]
            most = max(most, sum(held.values()))
        assert schedule.most_gradient_bytes(p, v, m, rank, acc, shard) == most, rank
    if m <= p:  # a chunk's backwards run one after another: never two accumulations at once
        assert schedule.most_gradient_bytes(p, v, m, 0, [1.0] * v, [0.0] * v) == 1.0
