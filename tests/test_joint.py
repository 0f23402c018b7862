"""TP styles chosen with the memory they cost (docs/joint-search.md).

1. A small version of GPT 1T on 512 GPUs pinned as Megatron-LM ran it: the least-time TP solve replicates the
   token embedding (a lookup splits no GEMM, and a split costs a collective), which crowds the first pipeline stage;
   the joint search takes the embedding split by itself, for its memory, balances the stages and predicts a lower
   step time; the plan's explanation says so.
2. The joint search is exact: pruned == brute force over every style map combination the search weighs, split and
   the rest, on cases where the least-time styles lose; and no other style map of the layers that have fronts
   (every style of the embedding and the head, by hand) does better.
3. `solve_tp_choices`: the least-time map first (`solve_tp`'s), then maps that trade time for parameters, none
   dominated.
"""

from __future__ import annotations

import functools
import itertools

import pytest

from ir_fixtures import MEGATRON, gpt_graph
from partc.cluster import PRESETS, Cluster
from partc.parallel import Pins
from partc.passes import tp_solve as tp_mod
from partc.passes import assemble, cost_step
from partc.passes.search import search
from partc.passes.tp import SolveCache, allowed_styles
from partc.passes.tp_solve import _layer_params, solve_tp, solve_tp_choices

GiB = 1 << 30
PINS = Pins(tp=2, pp=4, micro_batch_size=1, recompute="full", schedule="1f1b")


def cluster(mem_gib: float) -> Cluster:
    """An A100 with little memory (a 0.25 GiB reserve, no communicator buffers)."""
    return Cluster.from_dict({**PRESETS["a100-80g"].to_dict(), "name": f"small-{mem_gib}g",
                              "memory_bytes": int(mem_gib * GiB), "memory_reserve_bytes": GiB // 4,
                              "memory_reserve_fraction": 0.0, "communicator_bytes": 0})


@functools.cache
def graph():
    """A GPT whose embedding (32K x 1024) weighs as much as two and a half of its twelve blocks, as GPT 1T's
    1.31B-parameter one outweighs a block on pipeline rank 0."""
    return gpt_graph(num_blocks=12, dim=1024, heads=8, vocab=32768, seq=256)


def least_time_search(g, clus, gpus, pins, **kw):
    """The search with each component's least-time styles only (the search before the joint choice)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tp_mod, "MAX_CHOICES", 1)
        return search(g, clus, gpus, global_batch_size=8, pins=pins, **kw)


def test_small_1t_takes_the_split_embedding_for_its_memory():
    g, clus = graph(), cluster(1.0)
    assert solve_tp(g, 2, clus, 1).styles["tok"] == "replicate"  # the least time alone
    before = least_time_search(g, clus, 8, PINS).best
    after = search(g, clus, 8, global_batch_size=8, pins=PINS).best
    assert before.tp.styles["tok"] == "replicate"
    assert after.tp.styles["tok"] != "replicate"
    assert after.tp.why["tok"].startswith("memory: ")
    assert after.step_time_s < 0.9 * before.step_time_s
    # Balanced stages: the replicated embedding leaves the first stage no room for a block, so the others take
    # five each; split, it takes three and the others at most four.
    blocks = lambda c: [sum(g.units[u].kind == "block" for u in range(lo, hi)) for lo, hi in c.bounds]  # noqa
    assert blocks(before)[0] == 0 and max(blocks(before)) == 5
    assert blocks(after)[0] >= 3 and max(blocks(after)) <= 4
    assert max(r.time_s for r in before.prediction.ranks) > 1.2 * max(r.time_s for r in after.prediction.ranks)
    # Memory is the reason: the least-time styles do not fit on the joint plan's split.
    moved = assemble.predict(g, clus, before.parallel, before.tp, after.bounds)
    assert not cost_step.fits(clus, moved.memory_per_gpu)


CASES = {  # (memory GiB, GPUs, pins): the least-time styles lose or do not fit in each
    "pinned-1.0": (1.0, 8, PINS),
    "pinned-0.9": (0.9, 8, PINS),  # the least-time styles fit no split
    "tp2-free-rest": (1.0, 8, Pins(tp=2)),
    "free-4": (1.4, 4, Pins(micro_batch_size=1)),  # only the split embedding fits
    "free-8": (0.9, 8, Pins(micro_batch_size=1)),  # the least-time styles fit no plan
}


@functools.cache
def run(case: str):
    mem, gpus, pins = CASES[case]
    g, clus = graph(), cluster(mem)
    return (search(g, clus, gpus, global_batch_size=8, pins=pins),
            search(g, clus, gpus, global_batch_size=8, pins=pins, prune=False),
            least_time_search(g, clus, gpus, pins, prune=False))


def _ranked(result):
    return [(c.parallel, c.step_time_s, c.bounds, c.tp.styles) for c in [result.best, *result.alternatives] if c]


@pytest.mark.parametrize("case", list(CASES))
def test_pruned_equals_brute_force_over_the_joint_space(case):
    pruned, brute, least = run(case)
    assert brute.evaluated == brute.considered and brute.best is not None
    assert _ranked(pruned) == _ranked(brute)
    # Built so that the least-time styles lose: none fits, or the best is slower.
    assert least.best is None or least.best.step_time_s > brute.best.step_time_s


def test_no_other_style_of_the_fronts_layers_does_better():
    """With the blocks at Megatron's styles, every style of the embedding and the head by hand (pinned): the best
    of them is the joint search's."""
    g, clus = graph(), cluster(1.0)
    blocks = {f: MEGATRON[f.split(".", 2)[2]] for f in g.layers if f.startswith("blocks.")}
    joint = search(g, clus, 8, global_batch_size=8, pins=PINS, tp_pins=blocks).best
    best = None
    for tok, head in itertools.product(allowed_styles(g.layers["tok"], 2), allowed_styles(g.layers["lm_head"], 2)):
        c = search(g, clus, 8, global_batch_size=8, pins=PINS, tp_pins={**blocks, "tok": tok, "lm_head": head}).best
        if c is not None and (best is None or c.step_time_s < best.step_time_s):
            best = c
    assert joint.step_time_s == pytest.approx(best.step_time_s, rel=1e-12)
    assert joint.tp.styles["tok"] != "replicate"


def test_choices_trade_time_for_parameters():
    g, clus = graph(), cluster(1.0)
    choices = solve_tp_choices(g, 2, clus, 1)
    assert choices[0].styles == solve_tp(g, 2, clus, 1).styles
    assert len(choices) > 1

    def params(sol):
        return sum(_layer_params(layer, sol.styles[f], 2) for f, layer in g.layers.items())

    for sol in choices[1:]:
        assert sol.time_s > choices[0].time_s and params(sol) < params(choices[0])
        assert any(w.startswith("memory: ") for w in sol.why.values())
    # Each component's front: the least time first, then fewer parameters for more time each, none dominated.
    cache = SolveCache(g, clus)
    fronts: list = []
    tp_mod._solve_classes(g, 2, clus, 1, cache.rep, {}, cache, fronts)
    assert fronts
    for front in fronts:
        assert len(front) > 1
        for (_, ns_a, p_a), (_, ns_b, p_b) in zip(front, front[1:]):
            assert ns_a < ns_b and p_a > p_b
    assert solve_tp_choices(g, 1, clus, 1)[0].styles == solve_tp(g, 1, clus, 1).styles
