"""passes.tp: Megatron-LM pattern, divisibility, pins, determinism, and CP-SAT against brute force."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from ir_fixtures import MEGATRON, embedding, gpt_graph, linear, norm
from partc.cluster import PRESETS, Cluster
from partc.errors import PartcError
from partc.ir import Edge, ModelGraph, Unit
from partc.passes.tp import (_conversions, _facts, allowed_styles, evaluate_tp, megatron_style, megatron_styles,
                             representatives)
from partc.passes.tp_solve import _solve_classes, solve_tp

A100 = PRESETS["a100-80g"]
# The fixture's model is tiny (h = 256): on a real NVLink the 5 us ring-step latency outweighs its GEMMs. Without
# latency it behaves like a large model, where Megatron's pattern is the known optimum.
NO_LATENCY = Cluster.from_dict({"intra_node_latency": 0.0}, name="a100-no-latency")


COL, ROW, REP = ("R", "P", False), ("S", "S", True), ("R", "R", False)  # consumers: (input, gradient, shard_ok)


@pytest.mark.parametrize("state,needs,loss,want", [
    ("R", [COL], False, (None, "all_reduce")),  # Megatron's f: identity forward, all-reduce backward
    ("S", [ROW], False, (None, None)),  # colwise -> rowwise pair
    ("S", [("S", "S", False)], False, ("all_gather", "all_gather")),  # shards do not line up across the edge
    ("P", [REP, REP], False, ("all_reduce", None)),  # Megatron's g, once for two readers
    ("P", [ROW], False, ("all_reduce", "all_gather")),  # all-reduce, then a local split
    ("P", [ROW, REP], False, ("all_reduce", "all_gather")),  # the rowwise reader splits the all-reduced R
    ("S", [], True, ("all_gather", None)),  # colwise head: gather the logits for the loss
    ("S", [COL], False, ("all_gather", "all_reduce")),  # the P gradient whole, then the local part
    ("R", [COL, ROW, REP], False, (None, "all_reduce")),  # S and R gradients fold into the P sum
    ("R", [ROW, REP], False, (None, "all_gather")),
    ("R", [("R", None, False)], False, (None, None)),  # an Embedding reader returns no gradient
])
def test_conversion_rules(state, needs, loss, want):
    got = _conversions(state, _facts(needs, loss))
    assert (got.get("fwd"), got.get("bwd")) == want


def block_styles(sol, i: int) -> dict[str, str]:
    return {k: sol.styles[f"blocks.{i}.{k}"] for k in MEGATRON}


def assert_megatron_blocks(sol, num_blocks: int) -> None:
    for i in range(num_blocks):
        assert block_styles(sol, i) == MEGATRON
        got = Counter((c.kind, c.phase, c.src) for c in sol.collectives[f"blocks.{i}"])
        # Narayanan et al. 2021: two all-reduces forward (after proj, fc2) and two backward (into ln_1, ln_2).
        assert got == Counter({("all_reduce", "fwd", f"blocks.{i}.attn.proj"): 1,
                               ("all_reduce", "fwd", f"blocks.{i}.mlp.fc2"): 1,
                               ("all_reduce", "bwd", f"blocks.{i}.ln_1"): 1,
                               ("all_reduce", "bwd", f"blocks.{i}.ln_2"): 1})


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("residual", ["trace", "all"])
def test_megatron_pattern(tp, residual):
    graph = gpt_graph(residual=residual)  # "all": proj and fc2 feed every later norm, still one all-reduce each
    sol = solve_tp(graph, tp, NO_LATENCY, 1)
    assert_megatron_blocks(sol, 2)
    for c in sol.collectives["blocks.0"]:
        assert c.nbytes == 512 * 256 * 2 and c.reason
    assert sol.time_s == pytest.approx(evaluate_tp(graph, tp, sol.styles, NO_LATENCY, 1).time_s)
    assert sol.time_s < solve_tp(graph, 1, NO_LATENCY, 1).time_s


def test_megatron_pattern_realistic_shapes():
    graph = gpt_graph(num_blocks=2, dim=4096, heads=32, vocab=51200, seq=2048)
    sol = solve_tp(graph, 8, A100, 1)
    assert_megatron_blocks(sol, 2)


def test_tp1_replicates_everything():
    graph = gpt_graph()
    sol = solve_tp(graph, 1, A100, 4)
    assert set(sol.styles.values()) == {"replicate"} and set(sol.styles) == set(graph.layers)
    assert all(not cs for cs in sol.collectives.values()) and set(sol.collectives) == {u.fqn for u in graph.units}
    assert sol.time_s == pytest.approx(sum(sol.unit_time_s.values())) and sol.time_s > 0


def test_indivisible_heads_are_not_split():
    graph = gpt_graph(dim=400, heads=25)  # GPT-2 XL's 25 heads
    for tp in (2, 4):
        assert "colwise" not in allowed_styles(graph.layers["blocks.0.attn.qkv"], tp)
        assert "rowwise" not in allowed_styles(graph.layers["blocks.0.attn.proj"], tp)
        sol = solve_tp(graph, tp, NO_LATENCY, 1)
        for i in range(2):
            assert sol.styles[f"blocks.{i}.attn.qkv"] != "colwise"
            assert sol.styles[f"blocks.{i}.attn.proj"] != "rowwise"
            assert sol.styles[f"blocks.{i}.mlp.fc1"] == "colwise" and sol.styles[f"blocks.{i}.mlp.fc2"] == "rowwise"
        assert evaluate_tp(graph, tp, sol.styles, NO_LATENCY, 1).time_s == pytest.approx(sol.time_s)
    assert "colwise" in allowed_styles(graph.layers["blocks.0.attn.qkv"], 5)  # 25 heads split 5 ways


def test_why_layers_are_kept_whole():
    """Every layer off Megatron's pattern at tp > 1 says why: divisibility (with the sizes), a pin, cost; layers
    on the pattern and tp 1 say nothing."""
    graph = gpt_graph(dim=400, heads=25)
    sol = solve_tp(graph, 4, NO_LATENCY, 1, pinned={"blocks.1.mlp.fc1": "replicate"})
    why = sol.why
    assert why["blocks.0.attn.qkv"] == ("divisibility: colwise needs its heads (or fused pieces) (25) divisible by tp=4")
    assert why["blocks.0.attn.proj"] == "divisibility: rowwise needs its input heads (25) divisible by tp=4"
    assert why["blocks.1.mlp.fc1"] == "given: replicate was set by hand"  # pinned in one block: both blocks
    assert why["blocks.0.mlp.fc1"] == "given: replicate was set by hand"
    assert not any(k.startswith(("blocks.0.ln", "blocks.1.ln")) for k in why)  # norms are whole by nature
    assert solve_tp(graph, 1, NO_LATENCY, 1).why == {}
    megatron = solve_tp(gpt_graph(), 2, NO_LATENCY, 1)
    assert not any(k.startswith("blocks.") for k in megatron.why), megatron.why
    plan = evaluate_tp(graph, 4, {f: "replicate" for f in graph.layers}, NO_LATENCY, 1)
    assert plan.why["blocks.0.mlp.fc1"] == "given: the plan sets replicate here, not Megatron's colwise"


def one_line_error(fn) -> str:
    with pytest.raises(PartcError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_evaluate_errors():
    graph = gpt_graph(dim=400, heads=25)
    ok = {f: "replicate" for f in graph.layers}
    assert evaluate_tp(graph, 2, ok, A100, 1).collectives["blocks.0"] == []
    cases = [({**ok, "blocks.9.attn.qkv": "colwise"}, "blocks.9.attn.qkv"),  # unknown layer
             ({**ok, "blocks.0.mlp.fc1": "sequence"}, "blocks.0.mlp.fc1"),  # unknown style
             ({**ok, "blocks.0.ln_1": "colwise"}, "blocks.0.ln_1"),  # a norm is replicate only
             ({**ok, "blocks.0.attn.qkv": "colwise"}, "blocks.0.attn.qkv"),  # 25 heads over 2
             ({**ok, "blocks.1.attn.proj": "rowwise"}, "blocks.1.attn.proj"),
             ({**ok, "tok": "rowwise"}, None)]  # vocabulary 1024 over 2 is fine
    for styles, layer in cases:
        if layer is None:
            evaluate_tp(graph, 2, styles, A100, 1)
            continue
        assert layer in one_line_error(lambda: evaluate_tp(graph, 2, styles, A100, 1))
    missing = dict(ok)
    del missing["lm_head"]
    assert "lm_head" in one_line_error(lambda: evaluate_tp(graph, 2, missing, A100, 1))
    one_line_error(lambda: evaluate_tp(graph, 0, ok, A100, 1))


def test_pinned_styles():
    graph = gpt_graph()
    free = solve_tp(graph, 4, NO_LATENCY, 1)
    pinned = solve_tp(graph, 4, NO_LATENCY, 1, pinned={"blocks.1.mlp.fc1": "replicate", "tok": "rowwise"})
    for i in range(2):  # a pin covers the same layer in every identical block
        assert pinned.styles[f"blocks.{i}.mlp.fc1"] == "replicate"
        assert pinned.styles[f"blocks.{i}.attn.qkv"] == "colwise"
    assert pinned.styles["tok"] == "rowwise"
    assert any(c.src == "tok" and c.kind == "all_reduce" and c.phase == "fwd" for c in pinned.collectives["tok"])
    assert pinned.time_s >= free.time_s
    assert "blocks.0.ln_2" in one_line_error(lambda: solve_tp(graph, 4, A100, 1, pinned={"blocks.0.ln_2": "rowwise"}))
    assert "nope" in one_line_error(lambda: solve_tp(graph, 4, A100, 1, pinned={"nope": "replicate"}))
    assert "blocks.1.mlp.fc2" in one_line_error(lambda: solve_tp(
        graph, 4, A100, 1, pinned={"blocks.0.mlp.fc2": "rowwise", "blocks.1.mlp.fc2": "replicate"}))


def test_deterministic():
    runs = [solve_tp(gpt_graph(num_blocks=3), 8, A100, 8) for _ in range(3)]
    for r in runs[1:]:
        assert r.styles == runs[0].styles and r.time_s == runs[0].time_s
        assert r.collectives == runs[0].collectives


def test_many_blocks_share_styles():
    graph = gpt_graph(num_blocks=96, dim=2048, heads=16, vocab=8192, seq=1024)
    rep = representatives(graph)
    assert rep["blocks.95.mlp.fc2"] == "blocks.0.mlp.fc2" and rep["lm_head"] == "lm_head"
    sol = solve_tp(graph, 8, A100, 1)
    assert_megatron_blocks(sol, 96)


def brute_force(graph: ModelGraph, tp: int, cluster: Cluster, b: int) -> float:
    """Least time over every valid style map in which units of one signature share their styles."""
    rep = representatives(graph)
    reps = sorted(set(rep.values()))
    choices = [allowed_styles(graph.layers[r], tp) for r in reps]
    best = float("inf")
    for combo in itertools.product(*choices):
        chosen = dict(zip(reps, combo))
        styles = {f: chosen[rep[f]] for f in graph.layers}
        best = min(best, evaluate_tp(graph, tp, styles, cluster, b).time_s)
    return best


@pytest.mark.parametrize("cluster,tp,b,shard_ok", [(NO_LATENCY, 2, 1, True), (A100, 4, 16, True),
                                                    (A100, 2, 64, False), (NO_LATENCY, 8, 2, False)])
def test_gpt_matches_brute_force(cluster, tp, b, shard_ok):
    graph = gpt_graph(num_blocks=2, shard_ok=shard_ok)  # 6 free layers (tok, 4 linears, lm_head): 729 maps
    sol = solve_tp(graph, tp, cluster, b)
    assert sol.time_s == pytest.approx(brute_force(graph, tp, cluster, b), rel=1e-9, abs=1e-7)
    assert block_styles(sol, 0) == block_styles(sol, 1)


def test_summed_colwise_embeddings_convert_once():
    """GPT's token and position embeddings, added before anything reads them: both colwise, the program keeps
    their sum split and gathers it once (`passes.tp_rewrite`), so the evaluator charges one all-gather of the sum
    (it charged one per embedding), to the unit that adds them, and the CP-SAT model the same: its least time equals brute force over the
    embeddings' and the head's styles (the blocks pinned to Megatron's)."""
    graph = gpt_graph(num_blocks=2, pos=True)
    blocks = {f: style for f, style in megatron_styles(graph).items() if f.startswith("blocks.")}
    free = ["tok", "pos", "lm_head"]
    for cluster, tp, b in [(A100, 2, 1), (NO_LATENCY, 4, 8)]:
        both = evaluate_tp(graph, tp, {f: "replicate" for f in graph.layers} | blocks | {"tok": "colwise",
                                                                                          "pos": "colwise"},
                           cluster, b)
        # charged where the program adds them: the unit of the sum's first reader (the glue goes with it)
        assert not [c for c in both.collectives["tok"] if c.kind == "all_gather"]
        gathers = [c for c in both.collectives["blocks.0"] if c.kind == "all_gather" and c.src in ("tok", "pos")]
        assert [(c.phase, c.nbytes, c.src) for c in gathers] == [("fwd", graph.layers["tok"].out_bytes, "pos")]
        assert "the sum of colwise tok and pos" in gathers[0].reason
        one = evaluate_tp(graph, tp, {f: "replicate" for f in graph.layers} | blocks | {"tok": "colwise"},
                          cluster, b)
        assert [c.kind for c in one.collectives["tok"]] == ["all_gather"]  # the split tok alone: gathered too
        best = min(evaluate_tp(graph, tp, {f: "replicate" for f in graph.layers} | blocks | dict(zip(free, combo)),
                               cluster, b).time_s
                   for combo in itertools.product(*(allowed_styles(graph.layers[f], tp) for f in free)))
        assert solve_tp(graph, tp, cluster, b, pinned=blocks).time_s == pytest.approx(best, rel=1e-9, abs=1e-7)


def random_graph(rng: random.Random, size: int) -> ModelGraph:
    """A random DAG: an embedding, then linears with a norm at a random place, each its own unit; every layer reads
    the one before and some earlier ones (so outputs fan out to several consumers), shard_ok flags at random."""
    seq = rng.choice([64, 256, 1024])
    dims = [rng.choice([64, 128, 256, 512, 1024]) for _ in range(size)]
    at_norm = rng.randrange(1, size)
    layers = [embedding("e", "e", seq, 4096, dims[0])]
    for i in range(1, size):
        if i == at_norm:
            dims[i] = dims[i - 1]
            layers.append(norm(f"n{i}", f"n{i}", seq, dims[i]))
        else:
            layers.append(linear(f"l{i}", f"l{i}", seq, dims[i - 1], dims[i], col_groups=rng.choice([0, 4, 6])))
    edges = []
    for j in range(1, size):
        for i in sorted({j - 1} | {i for i in range(j - 1) if rng.random() < 0.4}):
            edges.append(Edge(src=layers[i].fqn, dst=layers[j].fqn, bytes=layers[i].out_bytes,
                              shard_ok=rng.random() < 0.5))
    units = [Unit(fqn=l.fqn, kind="module", layers=[l.fqn], num_params=l.num_params, signature=l.fqn) for l in layers]
    return ModelGraph(name="random", num_params=sum(l.num_params for l in layers), seq_len=seq, units=units,
                      layers={l.fqn: l for l in layers}, edges=edges, cut_bytes=[0] * (len(units) - 1))


def test_random_graphs_match_brute_force():
    rng = random.Random(3)
    kinds = Counter()
    for _ in range(12):
        graph = random_graph(rng, 6)
        tp, b = rng.choice([2, 4]), rng.choice([1, 8, 64])
        cluster = rng.choice([A100, NO_LATENCY])
        sol = solve_tp(graph, tp, cluster, b)
        assert sol.time_s == pytest.approx(brute_force(graph, tp, cluster, b), rel=1e-9, abs=1e-7)
        kinds.update((c.kind, c.phase) for cs in sol.collectives.values() for c in cs)
    assert len(kinds) >= 3  # more than the Megatron all-reduces are exercised


def test_model_time_equals_evaluation():
    """The CP-SAT time of every pinned style map equals evaluate_tp's (the encoding of each conversion rule)."""
    rng = random.Random(5)
    kinds = Counter()
    graphs = [random_graph(rng, 9) for _ in range(25)] + [gpt_graph(num_blocks=3, residual=r, shard_ok=ok)
                                                          for r in ("trace", "all") for ok in (True, False)] + \
        [gpt_graph(num_blocks=2, pos=True, residual=r) for r in ("trace", "all")]
    for graph in graphs:
        rep = representatives(graph)
        reps = sorted(set(rep.values()))
        for _ in range(12):
            tp, b = rng.choice([2, 4]), rng.choice([1, 16])
            pins = {r: rng.choice(allowed_styles(graph.layers[r], tp)) for r in reps}
            styles = {f: pins[rep[f]] for f in graph.layers}
            want = evaluate_tp(graph, tp, styles, A100, b)
            _, ns = _solve_classes(graph, tp, A100, b, rep, pins)
            assert ns / 1e9 == pytest.approx(want.time_s, rel=1e-9, abs=1e-7)
            kinds.update((c.kind, c.phase) for cs in want.collectives.values() for c in cs)
    # Every (collective, phase) pair the program can contain occurs (a reduce-scatter never does: the rewrite
    # all-reduces partial sums and splits locally, and the solver charges exactly that).
    assert set(kinds) == {(k, ph) for k in ("all_reduce", "all_gather") for ph in ("fwd", "bwd")}, kinds


def test_blocks_of_different_signatures_share_solves(monkeypatch):
    """The solve falls apart into components (units meet at norms): blocks whose signatures differ but whose layers
    with a choice match are solved once, to the same optimum as one model of identical blocks."""
    from ortools.sat.python import cp_model
    calls = []
    real = cp_model.CpSolver.solve
    monkeypatch.setattr(cp_model.CpSolver, "solve", lambda self, m, *a, **k: calls.append(1) or real(self, m, *a, **k))
    shared = solve_tp(gpt_graph(num_blocks=8), 4, NO_LATENCY, 1)
    shared_calls = len(calls)
    graph = gpt_graph(num_blocks=8)
    for i, u in enumerate(graph.units):
        u.signature = f"{u.signature}:{i}"  # every block its own class (as T5's block 0 or Swin's stages)
    assert len(set(representatives(graph).values())) == len(graph.layers)
    calls.clear()
    apart = solve_tp(graph, 4, NO_LATENCY, 1)
    assert apart.styles == shared.styles and apart.time_s == pytest.approx(shared.time_s)
    assert_megatron_blocks(apart, 8)
    assert len(calls) == shared_calls  # the 7 blocks after the first are the same component as the first


def test_megatron_styles_of_a_traced_llama(traced_example):
    """Megatron's pattern read off the traced data flow: q, k and v (GQA) all colwise into one rowwise o, gate and up
    into down; the vocabulary split of the embedding; norms and the head unnamed."""
    _, traced = traced_example("llama")
    want = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
            "mlp.gate": "colwise", "mlp.up": "colwise", "mlp.down": "rowwise"}
    got = megatron_styles(traced.graph)
    blocks = sum(u.kind == "block" for u in traced.graph.units)
    assert got == {"tok": "rowwise", **{f"blocks.{i}.{k}": v for i in range(blocks) for k, v in want.items()}}


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_megatron_map_by_name_agrees_with_the_data_flow(traced_example, name):
    """The map a user writes by layer name (`megatron_style`) and the pattern read off the traced data flow
    (`megatron_styles`) give every Linear of the examples the same style; with the vocabulary split, the token
    embedding is rowwise in both, and the head is colwise by name."""
    _, traced = traced_example(name)
    flow = megatron_styles(traced.graph)
    linears = [f for f, layer in traced.graph.layers.items() if layer.kind == "linear"]
    assert {f: megatron_style(f) for f in linears} == {f: flow.get(f) for f in linears}
    assert {"colwise", "rowwise"} <= set(flow.values())
    assert megatron_style("tok", vocab=True) == flow["tok"] == "rowwise" and megatron_style("tok") is None
    assert megatron_style("lm_head", vocab=True) == "colwise" and megatron_style("lm_head") is None
