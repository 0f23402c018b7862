"""One training step as events per pipeline rank: the schedule walk the cost model prices and the report draws.

Every pipeline rank runs its forwards and backwards in its schedule's order (`rank_order`: GPipe, 1F1B, and
torch.distributed.pipelining's interleaved 1F1B, as `partc.passes.schedule` and the runtime order them); an action
starts when its rank is free and its input is there: the forward of the previous chunk (model chunk s - 1) or the
backward of the next (s + 1) for the same micro-batch. As in the cost model (`partc.passes.assemble.predict`,
Narayanan et al. 2021), the slowest rank sets the pace: every forward of a chunk takes F/v and every backward B/v,
F and B that rank's forward and backward per micro-batch (compute, TP collectives and the pipeline send and
receive), so a faster rank idles in part of each slot. With equal slots the walk ends at
``(m + (p - 1)/v) · (F + B)``, `pipeline_span`, the pipeline term the cost model charges (held equal by
`walk` itself and tests/test_report.py over schedules, p, v, m and F:B ratios). After the pipeline each rank
runs its exposed data-parallel traffic, then, once the slowest rank's traffic is done, its optimizer step: the
step ends at the span plus the slowest of each, the cost model's step time.

The walk visits 2·m·v actions per rank, too many for the search's inner loop: the search prices the span in
closed form (`pipeline_span`), and `walk` asserts that it ends there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple


class Action(NamedTuple):
    """One forward or backward of one micro-batch through one model chunk on one pipeline rank (a named tuple: a
    step of many micro-batches has hundreds of thousands, built in one walk)."""

    forward: bool
    chunk: int
    """Local chunk (0 .. v - 1); the model chunk is chunk · p + rank."""
    microbatch: int
    start: float
    end: float


def rank_order(schedule: str, p: int, v: int, m: int, rank: int) -> list[tuple[bool, int, int]]:
    """(is_forward, local chunk, micro-batch) of every compute action of pipeline rank `rank`, in the order its
    schedule runs them. GPipe: every forward, then every backward. 1F1B: p - 1 - rank warm-up forwards, then one
    forward and one backward at a time. Interleaved (torch 2.13's ``ScheduleInterleaved1F1B``): rounds of
    ``m // max(1, m // p)`` micro-batches, (v - 1) rounds plus 2·(p - 1 - rank) warm-up forwards."""
    if schedule == "gpipe":
        return [(True, 0, i) for i in range(m)] + [(False, 0, i) for i in range(m)]
    if v == 1:
        warmup = min(p - 1 - rank, m)
        out = [(True, 0, i) for i in range(warmup)]
        for i in range(m - warmup):
            out += [(True, 0, warmup + i), (False, 0, i)]
        return out + [(False, 0, i) for i in range(m - warmup, m)]
    per_round = m // max(1, m // p)
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
    steady = m * v - warmup

    def at(k: int, forward: bool) -> tuple[bool, int, int]:
        chunk = (k // per_round) % v
        return forward, chunk if forward else v - 1 - chunk, (k // (per_round * v)) * per_round + k % per_round

    out = [at(k, True) for k in range(warmup)]
    for k in range(warmup, warmup + steady):
        out += [at(k, True), at(k - warmup, False)]
    return out + [at(k, False) for k in range(steady, m * v)]


def pipeline_span(p: int, v: int, m: int, fwd_s: float, bwd_s: float) -> float:
    """Seconds from the first forward to the last backward when each rank's micro-batch takes `fwd_s` forward and
    `bwd_s` backward (all its chunks): (m + (p - 1)/v) · (F + B), where `walk` ends."""
    slot = fwd_s + bwd_s
    return m * slot + (p - 1) / v * slot


def walk(schedule: str, p: int, v: int, m: int, fwd_s: float, bwd_s: float) -> list[list[Action]]:
    """The pipeline part of the step: every rank's actions with their start and end (module doc), each forward of a
    chunk `fwd_s / v` seconds, each backward `bwd_s / v`."""
    orders = [rank_order(schedule, p, v, m, r) for r in range(p)]
    last = p * v - 1
    fwd_d, bwd_d = fwd_s / v, bwd_s / v
    # The end of each (model chunk, micro-batch)'s forward and backward, None until it has run.
    fwd_end: list[list[float | None]] = [[None] * m for _ in range(p * v)]
    bwd_end: list[list[float | None]] = [[None] * m for _ in range(p * v)]
    free = [0.0] * p
    pos = [0] * p
    out: list[list[Action]] = [[] for _ in range(p)]
    new = tuple.__new__  # `Action(...)` without its keyword-argument wrapper
    moved = True
    while moved:
        moved = False
        for r in range(p):
            order, k, t, acts = orders[r], pos[r], free[r], out[r]
            n = len(order)
            while k < n:
                forward, chunk, i = order[k]
                s = chunk * p + r
                if forward:
                    ready = fwd_end[s - 1][i] if s > 0 else 0.0
                else:
                    ready = bwd_end[s + 1][i] if s < last else fwd_end[s][i]
                if ready is None:
                    break
                start = t if t >= ready else ready
                if forward:
                    t = fwd_end[s][i] = start + fwd_d
                else:
                    t = bwd_end[s][i] = start + bwd_d
                acts.append(new(Action, (forward, chunk, i, start, t)))
                k += 1
            if k != pos[r]:
                pos[r], free[r] = k, t
                moved = True
    assert all(pos[r] == len(orders[r]) for r in range(p)), "schedule deadlock"
    span = max(free)
    want = pipeline_span(p, v, m, fwd_s, bwd_s)
    assert math.isclose(span, want, rel_tol=1e-9, abs_tol=1e-15), (schedule, p, v, m, span, want)
    return out


PARTS = ("compute", "tp", "pp")
"""What a forward or a backward of a rank is made of (`step`): compute, TP collectives, pipeline send/receive."""


@dataclass(kw_only=True, slots=True)
class RankSteps:
    """One pipeline rank in one step: its pipeline actions, then its data-parallel traffic and optimizer step."""

    rank: int
    actions: list[Action]
    fwd: dict[str, float]
    """Seconds of the rank's own forward of one micro-batch (all its chunks), by `PARTS`."""
    bwd: dict[str, float]
    dp: tuple[float, float]
    """(start, end) of the exposed data-parallel traffic."""
    optimizer: tuple[float, float]


@dataclass(kw_only=True, slots=True)
class Step:
    ranks: list[RankSteps]
    span_s: float
    """The pipeline part (`pipeline_span`)."""
    step_s: float
    """The end of the step: span + the slowest rank's exposed DP traffic + the slowest optimizer step."""
    slot_fwd_s: float
    slot_bwd_s: float
    """Per micro-batch and rank, the pace the slowest rank sets (all chunks)."""


def step(predicted: dict, schedule: str, p: int, v: int, m: int) -> Step:
    """The whole step of a plan from its ``predicted`` (plan.json: ``ranks[].timeline_s``)."""
    rows = [r["timeline_s"] for r in predicted["ranks"]]
    assert len(rows) == p, (len(rows), p)
    total = [sum(r["fwd"].values()) + sum(r["bwd"].values()) for r in rows]
    slow = max(range(p), key=lambda r: total[r])
    fwd_s, bwd_s = sum(rows[slow]["fwd"].values()), sum(rows[slow]["bwd"].values())
    actions = walk(schedule, p, v, m, fwd_s, bwd_s)
    span = pipeline_span(p, v, m, fwd_s, bwd_s)
    dp_end = span + max(r["dp_comm"] for r in rows)
    out = [RankSteps(rank=r, actions=actions[r], fwd=dict(rows[r]["fwd"]), bwd=dict(rows[r]["bwd"]),
                     dp=(span, span + rows[r]["dp_comm"]), optimizer=(dp_end, dp_end + rows[r]["optimizer"]))
           for r in range(p)]
    return Step(ranks=out, span_s=span, step_s=dp_end + max(r["optimizer"] for r in rows),
                slot_fwd_s=fwd_s, slot_bwd_s=bwd_s)
