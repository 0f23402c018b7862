"""The outer search (passes/search.py) and the TP solver on traced models.

1. Pruning never loses the optimum: `search` equals `search(..., prune=False)` (every candidate evaluated) on small
   traced GPTs, over GPU counts 1-8, clusters whose memory rules out many configurations, and pins; and the
   pruning bound is below the step time of every candidate.
2. The chosen plans fit: every stage's memory is under the limit, and its model states are ZeRO's formulas
   (Rajbhandari et al. 2020: 2Ψ + 2Ψ + 12Ψ, divided by N_d from stage 1, 2, 3 on) for the parameters the stage
   holds, counted here from the real ``nn.Module``.
3. Megatron's pattern (Shoeybi et al. 2019) on real traced transformers: QKV and fc1 colwise, attention-out and fc2
   rowwise, two all-reduces forward and two backward per block; divisibility by heads and KV heads respected.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from helpers import EXAMPLES, GiB
from partc.cluster import PRESETS, Cluster
from partc.passes import assemble, cost, cost_step, memory
from partc.model_file import build_on_meta, load_model_file
from partc.parallel import TP_STYLES, Parallel, Pins
from partc.reads import Reads
from partc.passes import search_costs, search_space
from partc.passes.search import search
from partc.passes.search_costs import _Costs
from partc.passes.search_space import _configs
from partc.passes.tp import allowed_styles, style_error
from partc.passes.tp_solve import solve_tp
from partc.passes.trace import trace

A100 = PRESETS["a100-80g"]


def _gpt_module():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PARTC_GPT_SIZE", raising=False)
        return load_model_file(str(EXAMPLES / "gpt.py")).module


def _trace(model, seq_len, vocab, name):
    with torch.device("meta"):
        ids = torch.randint(0, vocab, (1, seq_len))
    return trace(model, (ids,), {}, name=name, seq_len=seq_len).graph


@functools.cache
def gpt_graph(name: str):
    """Small GPTs traced on meta. "long": attention-heavy (s 2048); "wide": parameter-heavy (h 2048); "tied": the
    head shares the token embedding (one tensor on the first and the last stage)."""
    gpt = _gpt_module()
    configs = {
        "tiny": gpt.GPTConfig(),
        "long": gpt.GPTConfig(vocab_size=8192, seq_len=2048, hidden=1024, heads=16, layers=6),
        "wide": gpt.GPTConfig(vocab_size=8192, seq_len=256, hidden=2048, heads=16, layers=6),
        "tied": gpt.GPTConfig(vocab_size=8192, seq_len=256, hidden=512, heads=8, layers=4, tie_weights=True),
    }
    cfg = configs[name]
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    return _trace(model, cfg.seq_len, cfg.vocab_size, f"gpt-{name}")


def small_cluster(mem_gib: float, *, gpus_per_node: int = 8, inter_node_bandwidth: float = 25e9) -> Cluster:
    """An A100 cluster with little memory (a 0.25 GiB reserve, no communicator buffers) and, optionally, small nodes
    and a slow network."""
    return Cluster.from_dict({**A100.to_dict(), "name": f"small-{mem_gib}g", "memory_bytes": int(mem_gib * GiB),
                              "memory_reserve_bytes": GiB // 4, "memory_reserve_fraction": 0.0,
                              "communicator_bytes": 0, "gpus_per_node": gpus_per_node,
                              "inter_node_bandwidth": inter_node_bandwidth})


# ---------------------------------------------------------------------------------------------------------------
# 1. Pruned search == brute force


@dataclass(frozen=True)
class Case:
    graph: str
    mem_gib: float
    gpus: int
    gbs: int = 16
    gpus_per_node: int = 8
    inter_node_bandwidth: float = 25e9
    pins: Pins | None = None

    @property
    def cluster(self) -> Cluster:
        return small_cluster(self.mem_gib, gpus_per_node=self.gpus_per_node,
                             inter_node_bandwidth=self.inter_node_bandwidth)


CASES = {
    "tiny-1": Case("tiny", 0.3, 1, gbs=64),
    "tiny-8": Case("tiny", 0.3, 8, gbs=256),
    "long-1-recompute": Case("long", 2, 1),            # activations of s=2048 force recomputation on one GPU
    "long-2": Case("long", 2, 2),
    "long-4": Case("long", 2, 4),
    "long-8": Case("long", 2, 8),
    "long-1-nofit": Case("long", 1, 1),                # nothing fits: both report the least memory any plan needs
    "long-4-tight": Case("long", 1.2, 4),              # tp and pp needed to fit
    "long-8-tight": Case("long", 1, 8),
    "long-8-small-nodes": Case("long", 4, 8, gpus_per_node=2, inter_node_bandwidth=1e9),
    "wide-4": Case("wide", 2, 4, gbs=32),
    "wide-8-nodes": Case("wide", 3, 8, gpus_per_node=4, inter_node_bandwidth=2e9),
    "wide-8-pin-tp": Case("wide", 3, 8, pins=Pins(tp=2)),
    "wide-8-pin-pp-interleaved": Case("wide", 4, 8, gbs=32, pins=Pins(pp=2, schedule="interleaved-1f1b")),
    "long-8-pin-zero3-mb": Case("long", 2, 8, pins=Pins(zero=3, micro_batch_size=2)),
    "long-8-pin-dp-gpipe": Case("long", 3, 8, pins=Pins(dp=2, schedule="gpipe", recompute="selective")),
    "tied-2": Case("tied", 80, 2),                     # a tied tensor is counted once by the pruning bound
    "tied-4": Case("tied", 80, 4),
    "tied-8-small": Case("tied", 2, 8),
    "tied-4-small-nodes": Case("tied", 4, 4, gpus_per_node=2, inter_node_bandwidth=1e9),
}


SLOW_BRUTE_FORCE = {"tiny-8"}
"""Cases whose brute force alone takes about 10 s, the fast tier's longest test (tiny-8: 3330 configurations, each
with its style maps, all priced): their equality test is in the slow tier. The tests that read only the pruned
search (`pruned_case`) run them in the fast tier."""


@functools.cache
def pruned_case(case_id: str):
    case = CASES[case_id]
    return search(gpt_graph(case.graph), case.cluster, case.gpus, global_batch_size=case.gbs, pins=case.pins)


@functools.cache
def brute_case(case_id: str):
    case = CASES[case_id]
    return search(gpt_graph(case.graph), case.cluster, case.gpus, global_batch_size=case.gbs, pins=case.pins,
                  prune=False)


def _ranked(result):
    return [c for c in [result.best, *result.alternatives] if c is not None]


def _key(c):
    return (c.parallel, c.step_time_s, c.bounds, c.tp.styles)


@pytest.mark.parametrize("case_id", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_BRUTE_FORCE else k
                                     for k in CASES])
def test_pruned_search_equals_brute_force(case_id):
    case = CASES[case_id]
    pruned, brute = pruned_case(case_id), brute_case(case_id)
    assert brute.evaluated == brute.considered  # prune=False evaluates every configuration
    assert pruned.considered == brute.considered and pruned.evaluated <= brute.evaluated
    assert [_key(c) for c in _ranked(pruned)] == [_key(c) for c in _ranked(brute)]
    assert pruned.least_memory == brute.least_memory
    if case.pins is not None:
        assert _ranked(pruned), "a pinned case must have plans to check the pins on"
        for c in _ranked(pruned):
            for field in ("tp", "pp", "dp", "zero", "micro_batch_size", "recompute", "schedule"):
                want = getattr(case.pins, field)
                assert want is None or getattr(c.parallel, field) == want, (field, c.parallel)


@pytest.mark.parametrize("case_id", ["long-4-tight", "long-8-tight", "wide-8-pin-pp-interleaved", "tied-8-small"])
def test_cached_split_equals_the_constrained_dp(case_id):
    """`_Costs.split_stages` reuses the memory-free split when it fits; it must equal the DP run with the limit."""
    from partc.passes.stages import partition_stages

    case = CASES[case_id]
    graph, cluster = gpt_graph(case.graph), case.cluster
    costs = _Costs(graph, cluster, None)
    limit = cluster.usable_memory_bytes
    checked = 0
    for par in _configs(graph, cluster, case.gpus, case.gbs, case.pins or Pins()):
        v = par.chunks_per_rank
        chunks = par.pp * v
        static = [memory.model_state_bytes(1, par).total * n for n in costs.params(par)]
        extra_any, extra_last = costs.extra(par)
        buffers = cluster.communicator_bytes * cost_step.communicators(par, shares_weights=False)
        direct = partition_stages(costs.times(par), costs.cut_time(par), static, costs.acts(par),
                                  num_stages=chunks, in_flight=[memory.in_flight(par, k % par.pp) for k in range(chunks)],
                                  mem_limit=(limit - buffers) / v, extra_mem=[extra_any] * (chunks - 1) + [extra_last],
                                  first_required=len(graph.first_unit_required),
                                  last_required=len(graph.last_unit_required))
        want = None if direct is None else [tuple(b) for b in direct.bounds]
        assert costs.split_stages(par, mem_limit=limit) == want, par
        checked += want is not None
    assert checked > 0


def test_brute_force_cases_are_not_trivial():
    """The cases above choose different kinds of plans, so agreeing on them means something (the pruned search's
    choices: `test_pruned_search_equals_brute_force` holds them equal to the brute force's)."""
    chosen = [pruned_case(k).best for k in CASES]
    plans = [c.parallel for c in chosen if c is not None]
    assert any(c is None for c in chosen)
    assert any(p.tp > 1 for p in plans) and any(p.pp > 1 for p in plans) and any(p.dp > 1 for p in plans)
    assert any(p.recompute != "none" for p in plans) and any(p.zero > 0 for p in plans)
    assert any(p.micro_batch_size > 1 for p in plans) and any(p.schedule != "1f1b" for p in plans)
    assert any(pruned_case(k).evaluated < pruned_case(k).considered / 4 for k in CASES)  # pruning prunes


def test_search_weighs_sequence_parallelism():
    """Unpinned, every configuration with tp > 1 is tried with and without sequence parallelism (a sequence that
    does not divide over tp, or tp 1, only without); pinned, only as pinned. A case whose memory is tight takes it:
    its activations are smaller than the same plan's without it, and the best plan without it is slower."""
    graph = gpt_graph("long")
    seen = {(p.tp, p.sequence_parallel) for p in _configs(graph, A100, 4, 16, Pins())}
    assert seen == {(1, False), (2, False), (2, True), (4, False), (4, True)}
    assert {(p.tp, p.sequence_parallel) for p in _configs(graph, A100, 4, 16, Pins(sequence_parallel=True))} == \
        {(2, True), (4, True)}
    assert {p.sequence_parallel for p in _configs(graph, A100, 4, 16, Pins(sequence_parallel=False))} == {False}
    odd = SimpleNamespace(seq_len=6)
    assert search_space.sequence_parallel_choices(odd, 4, Pins()) == (False,)
    assert search_space.sequence_parallel_choices(odd, 2, Pins()) == (False, True)
    assert search_space.sequence_parallel_choices(odd, 1, Pins(sequence_parallel=True)) == ()

    case = CASES["long-4-tight"]
    best = pruned_case("long-4-tight").best
    assert best.parallel.sequence_parallel
    plain = dataclasses.replace(best.parallel, sequence_parallel=False, sp_regather=False)
    without = assemble.predict(graph, case.cluster, plain, best.tp, best.bounds)
    assert without.memory_per_gpu.activations > best.prediction.memory_per_gpu.activations
    off = search(graph, case.cluster, case.gpus, global_batch_size=case.gbs,
                 pins=Pins(sequence_parallel=False)).best
    assert off is None or off.step_time_s > best.step_time_s


@pytest.mark.parametrize("case_id", ["long-8", "wide-8-nodes", "long-8-small-nodes", "tied-4", "tied-8-small"])
def test_pruning_bound_is_below_every_step_time(case_id):
    """The bounds `search` prunes with never exceed the step time of the best stage split of a configuration:
    before the TP solve (`floor_bound`), before the split (`lower_bound`) and after it (`split_bound`, which skips
    `assemble.predict`)."""
    case = CASES[case_id]
    graph, cluster = gpt_graph(case.graph), case.cluster
    costs = _Costs(graph, cluster, None)
    limit = cluster.usable_memory_bytes
    checked = 0
    for par in _configs(graph, cluster, case.gpus, case.gbs, Pins()):
        bounds = costs.split_stages(par, mem_limit=limit)
        if bounds is None:
            continue
        step = assemble.predict(graph, cluster, par, costs.tp(par), bounds).step_time_s
        assert costs.floor_bound(par) <= costs.lower_bound(par) <= step * (1 + 1e-9), par
        assert costs.lower_bound(par) <= costs.split_bound(par, bounds) <= step * (1 + 1e-9), par
        checked += 1
    assert checked > 50


@pytest.mark.parametrize("case", [CASES["long-8-tight"], CASES["wide-8-nodes"], Case("tied", 0.5, 8)])
def test_state_floor_is_below_every_plans_memory(case):
    """`state_floor` (how the search drops a configuration before its TP solve) never exceeds the memory a GPU
    needs under any TP styles and stage split (the least-time split, the solver's styles and random ones), and it
    drops some configurations of these cases."""
    graph = gpt_graph(case.graph)
    cluster = Cluster.from_dict({**case.cluster.to_dict(), "communicator_bytes": 2**20})
    costs = _Costs(graph, cluster, None)
    rng = random.Random(0)
    checked = dropped = 0
    for par in _configs(graph, cluster, case.gpus, case.gbs, case.pins or Pins()):
        floor = costs.state_floor(par.__getattribute__, lambda: par)
        dropped += floor > cluster.usable_memory_bytes
        bounds = costs.free_split(par, par.num_stages)
        if bounds is None:
            continue
        plans = [costs.tp(par), SimpleNamespace(styles={f: rng.choice(TP_STYLES) for f in graph.layers},
                                                collectives={})]
        for plan in plans:
            mem = assemble.predict(graph, cluster, par, plan, bounds).memory_per_gpu.total
            assert floor <= mem * (1 + 1e-12), (par, floor, mem)
            checked += 1
    assert checked > 50 and dropped > 0


@pytest.mark.parametrize("name", ["long", "wide", "tied"])
def test_unit_time_floor_is_below_any_tp_styles(name):
    """`cost.unit_time_floor` (what `floor_bound` orders configurations by before any TP solve) is at most each
    unit's time under any TP styles: random ones, all replicated, and the solver's."""
    graph = gpt_graph(name)
    rng = random.Random(0)
    checked = 0
    for t, b, recompute in [(1, 1, "none"), (2, 1, "selective"), (4, 2, "full"), (8, 4, "none")]:
        par = Parallel(dp=1, tp=t, pp=1, zero=0, micro_batch_size=b, global_batch_size=b, recompute=recompute)
        floor = cost.unit_time_floor(graph, A100, par)
        plans = [SimpleNamespace(styles={f: rng.choice(TP_STYLES) for f in graph.layers}, collectives={})
                 for _ in range(20)]
        plans += [None, solve_tp(graph, t, A100, b)]
        for plan in plans:
            times = cost.unit_times(graph, A100, par, plan)
            assert all(lo <= x for lo, x in zip(floor, times)), (t, b, recompute)
            checked += 1
    assert checked == 4 * 22


@pytest.mark.parametrize("name,mem_gib,gpus", [("long", 1, 8), ("long", 1.2, 4), ("tied", 0.9, 8)])
def test_fits_memory_equals_predict(name, mem_gib, gpus):
    """`fits_memory` (how the search rules out a least-time split without `predict`) says what `predict`'s memory
    says, for every configuration's least-time split, on clusters where some fit and some do not."""
    graph, cluster = gpt_graph(name), small_cluster(mem_gib)
    costs = _Costs(graph, cluster, None)
    seen = set()
    for par in _configs(graph, cluster, gpus, 16, Pins()):
        loose = costs.free_split(par, par.num_stages)
        if loose is not None:
            fits = cost_step.fits(cluster, costs.predict(par, loose).memory_per_gpu)
            assert costs.fits_memory(par, loose) == fits, par
            seen.add(fits)
    assert seen == {True, False}


def test_cache_keys_miss_no_dependency():
    """Every cached quantity of the search, computed through one cache shared by all configurations, equals the
    same quantity computed for that configuration alone: no cache key leaves out a choice it depends on (a field
    of `Parallel` is in every key unless a quantity declares itself independent of it)."""
    graph, cluster = gpt_graph("tied"), small_cluster(2, gpus_per_node=2)
    limit = cluster.usable_memory_bytes
    shared = _Costs(graph, cluster, None)
    configs = list(_configs(graph, cluster, 8, 32, Pins()))

    def values(costs, par):
        return (costs.tp(par).styles, costs.parts(par), costs.times(par), costs.shards(par), costs.params(par),
                costs.params_all(par), costs.acts(par), costs.extra(par), costs.cut_time(par),
                costs.free_split(par, par.num_stages), costs.split_stages(par, mem_limit=limit),
                costs.lower_bound(par))

    for par in configs[::7]:
        assert values(shared, par) == values(_Costs(graph, cluster, None), par), par
    assert len({(p.dp, p.tp, p.pp, p.zero, p.recompute, p.schedule) for p in configs[::7]}) > 20


def test_cache_keys_see_a_new_field():
    """No cache key of the search or the cost model lists the fields it reads: each is made by a `Reads` from what
    the quantity ignores, so a field added to `Parallel` (here ``xp``, a new dimension) tells every key apart; and
    every key a search leaves in its caches is one of those (none written by hand)."""
    wide = dataclasses.make_dataclass("Wide", [("xp", int, dataclasses.field(default=1))], bases=(Parallel,),
                                      kw_only=True, slots=True, frozen=True)
    reads = [r for module in (search_costs, cost, assemble) for r in vars(module).values() if isinstance(r, Reads)]
    assert len({r.name for r in reads}) == len(reads) > 20
    base = dict(dp=2, tp=2, pp=2, zero=1, micro_batch_size=1, global_batch_size=8)
    one, two = wide(xp=1, **base), wide(xp=2, **base)
    for r in reads:
        assert r.key(one) != r.key(two), r.name
        assert r.key_of(one.__getattribute__, cls=wide) != r.key_of(two.__getattribute__, cls=wide), r.name
        assert r.key(Parallel(**base)) == r.key_of(dict(base, cp=1, schedule="1f1b", virtual_stages=1,
                                                        recompute="none", precision="bf16",
                                                        sequence_parallel=False, ep=1,
                                                        expert_imbalance=1.0,
                                                        sp_regather=False, fuse_pointwise=False).__getitem__), r.name

    graph, cluster = gpt_graph("tied"), small_cluster(2, gpus_per_node=2)
    costs = _Costs(graph, cluster, None)
    for par in list(_configs(graph, cluster, 8, 32, Pins()))[::13]:
        costs.floor_bound(par)
        costs.state_floor(par.__getattribute__, lambda: par)
        bounds = costs.split_stages(par, mem_limit=cluster.usable_memory_bytes)
        if bounds is not None:
            costs.predict(par, bounds)
    names = {r.name for r in reads}
    assert {key[0] for key in costs._cache} <= names
    assert {key[0] for key in costs._memo if key != "floor_keys"} <= names  # "floor_keys": the graph's alone


# ---------------------------------------------------------------------------------------------------------------
# 2. Memory of the chosen plans


@pytest.mark.parametrize("case_id", list(CASES))
def test_chosen_plans_fit_and_predictions_are_reproducible(case_id):
    case = CASES[case_id]
    pruned = pruned_case(case_id)
    graph, cluster = gpt_graph(case.graph), case.cluster
    limit = cluster.usable_memory_bytes
    for c in _ranked(pruned):
        assert c.prediction.memory_per_gpu.total <= limit
        assert all(r.memory.total <= limit for r in c.prediction.ranks)
        assert c.prediction.memory_per_gpu.total == max(r.memory.total for r in c.prediction.ranks)
        again = assemble.predict(graph, cluster, c.parallel, c.tp, c.bounds)
        assert again.step_time_s == c.step_time_s
    if pruned.best is None:
        assert pruned.least_memory > limit  # the least any plan needs, for the error message


def _stage_params(model, styles: dict[str, str], units: list[str], tp: int) -> int:
    """Ψ of one GPU of a stage, from the real module: colwise splits every parameter of a layer, rowwise its weight
    (the bias is added after the reduction), a tied tensor counts once per stage."""
    held: dict[int, int] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not any(name.startswith(u + ".") for u in units):
            continue
        style = styles.get(name.rpartition(".")[0], "replicate")
        n = p.numel()
        if tp > 1 and (style == "colwise" or (style == "rowwise" and p.dim() >= 2)):
            assert n % tp == 0
            n //= tp
        held[id(p)] = max(held.get(id(p), 0), n)
    return sum(held.values())


MEGATRON_PINS = {"blocks.0.attn.qkv": "colwise", "blocks.0.attn.proj": "rowwise", "blocks.0.mlp.fc1": "colwise",
                 "blocks.0.mlp.fc2": "rowwise", "lm_head": "colwise"}


@pytest.fixture(scope="module")
def tied_tiny():
    """The tiny GPT with its head tied to the token embedding: the tied tensor lives on the first and last stage."""
    gpt = _gpt_module()
    cfg = gpt.GPTConfig(tie_weights=True)
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    return model, _trace(model, cfg.seq_len, cfg.vocab_size, "gpt-tied")


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_memory_per_stage_equals_the_formulas(zero, tied_tiny):
    model, graph = tied_tiny
    par_pins = Pins(dp=2, tp=2, pp=2, zero=zero)
    result = search(graph, A100, 8, global_batch_size=64, pins=par_pins, tp_pins=MEGATRON_PINS)
    best = result.best
    par, styles = best.parallel, best.tp.styles
    assert (par.dp, par.tp, par.pp, par.zero) == (2, 2, 2, zero)
    assert styles["blocks.3.attn.qkv"] == "colwise" and styles["blocks.3.mlp.fc2"] == "rowwise"  # pins apply to
    assert styles["lm_head"] == "colwise"                                                          # every block
    nd = par.dp
    stages = best.prediction.ranks
    assert len(stages) == 2
    for stage in stages:
        units = [graph.units[i].fqn for lo, hi in stage.chunks for i in range(lo, hi)]
        psi = _stage_params(model, styles, units, par.tp)
        assert stage.num_params == psi
        mem = stage.memory
        # partc.passes.zero's table: fp32 master weights (sharded from ZeRO-1), the bf16 copy the step gathers
        # (not kept by ZeRO-3), fp32 gradients (accumulated whole by ZeRO 0 and 1), Adam's moments.
        assert mem.params == pytest.approx((4 / (nd if zero >= 1 else 1) + (2 if zero < 3 else 0)) * psi)
        assert mem.grads == pytest.approx((4 / nd if zero >= 2 else 4) * psi)
        assert mem.optimizer == pytest.approx(8 * psi / (nd if zero >= 1 else 1))
        assert mem.total == pytest.approx(mem.params + mem.grads + mem.optimizer + mem.activations + mem.buffers)
        assert mem.activations > 0
    # the tied embedding / head weight is held by both pipeline ranks
    first = [graph.units[i].fqn for lo, hi in stages[0].chunks for i in range(lo, hi)]
    last = [graph.units[i].fqn for lo, hi in stages[1].chunks for i in range(lo, hi)]
    assert "tok" in first and "lm_head" in last


def test_zero_stages_shrink_model_states(tied_tiny):
    _, graph = tied_tiny
    states = []
    for zero in range(4):
        best = search(graph, A100, 8, global_batch_size=64, pins=Pins(dp=8, zero=zero, micro_batch_size=1)).best
        mem = best.prediction.memory_per_gpu
        states.append(mem.params + mem.grads + mem.optimizer)
        psi = graph.num_params
        assert states[-1] == pytest.approx(memory.model_state_bytes(psi, best.parallel).total)
    assert states[0] == pytest.approx(18 * graph.num_params)  # bf16 compute, fp32 master, grads and moments
    assert states[0] > states[1] > states[2] > states[3] == pytest.approx(16 * graph.num_params / 8)


# ---------------------------------------------------------------------------------------------------------------
# 3. TP styles on real traced transformers


@pytest.fixture(scope="module")
def gpt_1_7b():
    """examples/gpt.py at Megatron's 1.7B size (24 heads, h 2304, 24 blocks, s 2048), traced on meta."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PARTC_GPT_SIZE", "1.7b")
        spec = load_model_file(str(EXAMPLES / "gpt.py"))
        model = build_on_meta(spec)
        with torch.device("meta"):
            args, kwargs = spec.inputs(1)
        return spec.module.config(), trace(model, args, kwargs, name="gpt-1.7b", seq_len=spec.seq_len).graph


def _assert_megatron(graph, solution, blocks, names):
    """Every block: colwise / rowwise pairs and exactly 2 all-reduces forward, 2 backward (Megatron's f and g)."""
    qkv, proj, fc1, fc2 = names
    for b in blocks:
        styles = {m[len(b) + 1:]: solution.styles[m] for m in graph.unit(b).layers}
        assert styles[qkv] == "colwise" and styles[fc1] == "colwise", b
        assert styles[proj] == "rowwise" and styles[fc2] == "rowwise", b
        assert all(s == "replicate" for m, s in styles.items() if m not in names), b
        kinds = sorted((c.phase, c.kind) for c in solution.collectives[b])
        assert kinds == [("bwd", "all_reduce")] * 2 + [("fwd", "all_reduce")] * 2, b


def test_megatron_pattern_on_gpt_1_7b(gpt_1_7b):
    cfg, graph = gpt_1_7b
    assert cfg.heads % 8 == 0
    blocks = [u.fqn for u in graph.units if u.kind == "block"]
    assert len(blocks) == cfg.layers
    best = search(graph, A100, 64, global_batch_size=512, pins=Pins(tp=8)).best
    assert best.parallel.tp == 8
    _assert_megatron(graph, best.tp, blocks, ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"))
    fwd = [c for c in best.tp.collectives["blocks.5"] if c.phase == "fwd"]
    assert {c.src for c in fwd} == {"blocks.5.attn.proj", "blocks.5.mlp.fc2"}  # after the rowwise layers
    assert all(c.nbytes == cfg.seq_len * cfg.hidden * 2 for c in fwd)  # b·s·h in 16-bit per sample
    for tp in (2, 4):
        _assert_megatron(graph, solve_tp(graph, tp, A100, 1), blocks, ("attn.qkv", "attn.proj", "mlp.fc1",
                                                                        "mlp.fc2"))


@pytest.fixture(scope="module")
def gpt2_xl_like():
    """Hugging Face GPT-2 with GPT-2 XL's width (25 heads, h 1600) and two layers, traced on meta."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=1600, n_head=25, vocab_size=50257, n_positions=1024)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
        ids = torch.randint(0, config.vocab_size, (1, 1024))
    return trace(model, (), {"input_ids": ids, "use_cache": False}, name="gpt2-xl-like", seq_len=1024).graph


def test_gpt2_xl_heads_not_divisible(gpt2_xl_like):
    graph = gpt2_xl_like
    blocks = [u.fqn for u in graph.units if u.kind == "block"]
    assert len(blocks) == 2
    for tp in (2, 4):
        sol = solve_tp(graph, tp, A100, 1)
        for b in blocks:
            # 25 heads cannot be split 2 or 4 ways: q/k/v are not colwise, the attention output not rowwise
            assert sol.styles[f"{b}.attn.c_attn"] != "colwise"
            assert sol.styles[f"{b}.attn.c_proj"] != "rowwise"
            # the MLP (6400 features) still gets Megatron's split
            assert sol.styles[f"{b}.mlp.c_fc"] == "colwise" and sol.styles[f"{b}.mlp.c_proj"] == "rowwise"
        for fqn, style in sol.styles.items():
            assert style_error(graph.layers[fqn], style, tp) is None
    # 5 divides 25: the whole block is Megatron's again
    _assert_megatron(graph, solve_tp(graph, 5, A100, 1), blocks, ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                   "mlp.c_proj"))


def test_llama_gqa_kv_heads_not_split_beyond_their_count():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PARTC_LLAMA_SIZE", raising=False)
        llama = load_model_file(str(EXAMPLES / "llama.py")).module
    cfg = llama.LlamaConfig(vocab_size=32000, seq_len=1024, hidden=2048, heads=16, kv_heads=2, layers=2,
                            ffn_hidden=5632)
    with torch.device("meta"):
        model = llama.Llama(cfg)
    graph = _trace(model, cfg.seq_len, cfg.vocab_size, "llama-gqa")
    blocks = [u.fqn for u in graph.units if u.kind == "block"]
    assert len(blocks) == cfg.layers
    k = graph.layers["blocks.0.attn.k"]
    assert "colwise" in allowed_styles(k, 2) and "colwise" not in allowed_styles(k, 4)
    for tp in (4, 8):
        sol = solve_tp(graph, tp, A100, 1)
        for b in blocks:
            # 2 KV heads cannot be split 4 or 8 ways
            assert sol.styles[f"{b}.attn.k"] != "colwise" and sol.styles[f"{b}.attn.v"] != "colwise"
            # ... but the block is still split somewhere: TP at 4 or 8 is not all-replicate
            assert any(sol.styles[m] != "replicate" for m in graph.unit(b).layers)
        for fqn, style in sol.styles.items():
            assert style_error(graph.layers[fqn], style, tp) is None
