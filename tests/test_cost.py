"""The cost model against the published formulas of docs/cost-model.md, on hand-built IR (single process, fast)."""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace
from dataclasses import dataclass, field

import pytest

from ir_fixtures import MEGATRON, gpt_block, gpt_graph
from partc.cluster import PRESETS
from partc.errors import PartcError
from partc.ir import ACTIVATION_BYTES, Gemm, ModelGraph
from partc.parallel import Parallel
from partc.passes import assemble, cost, cost_step, cost_tp, cost_types, hw, memory, schedule, zero

A100 = PRESETS["a100-80g"]


# --- stand-ins for passes.tp.TPSolution ----------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class FakeCollective:
    kind: str
    phase: str
    nbytes: int
    src: str = ""
    reason: str = ""
    reader_units: tuple[str, ...] = ()


@dataclass(kw_only=True, slots=True)
class FakeTP:
    styles: dict[str, str] = field(default_factory=dict)
    collectives: dict[str, list[FakeCollective]] = field(default_factory=dict)
    time_s: float = 0.0


def par(**kw) -> Parallel:
    base = dict(dp=1, tp=1, pp=1, zero=0, micro_batch_size=1, global_batch_size=8)
    base.update(kw)
    return Parallel(**base)


# --- a synthetic GPT (tests/ir_fixtures.py): tok -> blocks.* -> ln_f -> lm_head (tied to tok.weight) -------------


def gpt(*, L: int = 4, s: int = 32, h: int = 64, a: int = 4, V: int = 512) -> ModelGraph:
    return gpt_graph(num_blocks=L, seq=s, dim=h, heads=a, vocab=V, tied=True)


def megatron_tp(graph: ModelGraph, *, s: int, h: int) -> FakeTP:
    """Megatron TP (ir_fixtures.MEGATRON: qkv/fc1 colwise, proj/fc2 rowwise); 2 all-reduces of b·s·h forward and
    2 backward per block."""
    tp = FakeTP()
    for u in graph.units:
        for f in u.layers:
            tp.styles[f] = MEGATRON[f[len(u.fqn) + 1:]] if u.kind == "block" else "replicate"
        if u.kind == "block":
            tp.collectives[u.fqn] = [FakeCollective(kind="all_reduce", phase=ph, nbytes=2 * s * h)
                                     for ph in ("fwd", "fwd", "bwd", "bwd")]
    return tp


# --- 1. ZeRO model states (Rajbhandari et al. 2020, Figure 1) ----------------------------------------------


# The ZeRO paper's table for the 7.5B model at N_d = 64 (120 / 31.4 / 16.6 / 1.9 GB) assumes 16-bit gradients;
# partc's runtime (FSDP2, mixed precision) accumulates and reduces them in fp32, like Megatron-LM (18 bytes per
# parameter without sharding): 18Ψ, 2Ψ + 4Ψ + 12Ψ/64 (ZeRO-1's fp32 accumulation is freed unit by unit as its
# shards are reduced: never both at once), 2Ψ + 16Ψ/64, 16Ψ/64.
@pytest.mark.parametrize("zero,gb", [(0, 135.0), (1, 46.40625), (2, 16.875), (3, 1.875)])
def test_zero_table(zero, gb):
    mem = memory.model_state_bytes(7.5e9, par(dp=64, zero=zero, global_batch_size=64))
    assert mem.total / 1e9 == pytest.approx(gb)
    assert mem.activations == 0
    assert set(mem.to_dict()) == {"params", "grads", "optimizer", "activations", "buffers", "total"}


def test_zero_split_by_kind():
    psi, nd = 1e9, 8
    m3 = memory.model_state_bytes(psi, par(dp=nd, zero=3))
    assert (m3.params, m3.grads, m3.optimizer) == pytest.approx((4 * psi / nd, 4 * psi / nd, 8 * psi / nd))
    m1 = memory.model_state_bytes(psi, par(dp=nd, zero=1))
    assert (m1.params, m1.grads, m1.optimizer) == pytest.approx((2 * psi + 4 * psi / nd, 4 * psi, 8 * psi / nd))
    f0 = memory.model_state_bytes(psi, par(dp=nd, zero=0, precision="fp32"))  # no compute copy but FSDP's gather
    assert (f0.params, f0.grads, f0.optimizer) == pytest.approx((8 * psi, 4 * psi, 8 * psi))


# --- 2. Activations (Korthikanti et al. 2022, Table 2) --------------------------------------------------


def test_edge_index_is_the_graph_s_own():
    """A graph's edges indexed by layer, in edge order, made with the graph (a cache keyed by ``id(graph)`` could
    hand a new graph at a reused id the index of the old one): a copy with other edges has its own. `heads` reads
    it: the output layer, read by no layer, heads the model under rowwise."""
    g = gpt_graph(num_blocks=1)
    assert g.edges_into["lm_head"] == ["ln_f"] and "lm_head" not in g.edges_out_of
    assert [e.dst for e in g.edges if e.src == "ln_f"] == g.edges_out_of["ln_f"]
    tp = SimpleNamespace(styles={"lm_head": "rowwise"}, collectives={})
    assert cost_tp.heads(g, tp, "lm_head")
    extra = dataclasses.replace(g.edges[-1], src="lm_head", dst="ln_f")
    h = dataclasses.replace(g, edges=[*g.edges, extra])
    assert h.edges_out_of["lm_head"] == ["ln_f"] and "lm_head" not in g.edges_out_of
    assert not cost_tp.heads(h, tp, "lm_head")


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_korthikanti_activations(t):
    s, h, a, b = 256, 512, 8, 2
    unit, layers = gpt_block("blocks.0", seq=s, dim=h, heads=a)
    graph = ModelGraph(name="one", num_params=unit.num_params, seq_len=s, units=[unit],
                       layers={x.fqn: x for x in layers}, edges=[], cut_bytes=[])
    tp = megatron_tp(graph, s=s, h=h)
    sbh = s * b * h
    (none,) = memory.unit_activation_bytes(graph, par(tp=t, micro_batch_size=b), tp)
    assert none == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    (sel,) = memory.unit_activation_bytes(graph, par(tp=t, micro_batch_size=b, recompute="selective"), tp)
    assert sel == pytest.approx(sbh * (10 + 24 / t))
    (full,) = memory.unit_activation_bytes(graph, par(tp=t, micro_batch_size=b, recompute="full"), tp)
    assert full == pytest.approx(2 * sbh)
    # All-replicate: nothing is divided, even with t > 1.
    (rep,) = memory.unit_activation_bytes(graph, par(tp=t, micro_batch_size=b), FakeTP())
    assert rep == pytest.approx(sbh * (34 + 5 * a * s / h))


@pytest.mark.parametrize("t", [2, 4, 8])
def test_sequence_parallel_activations(t):
    """Sequence parallelism divides Korthikanti et al.'s "10" too (their 34·s·b·h/t with selective recomputation),
    except what partc's colwise Linears save: their all-gathered inputs, 4·s·b·h a GPT block."""
    s, h, a, b = 256, 512, 8, 2
    unit, layers = gpt_block("blocks.0", seq=s, dim=h, heads=a)
    graph = ModelGraph(name="one", num_params=unit.num_params, seq_len=s, units=[unit],
                       layers={x.fqn: x for x in layers}, edges=[], cut_bytes=[])
    tp, sbh = megatron_tp(graph, s=s, h=h), s * b * h
    sp = par(tp=t, micro_batch_size=b, sequence_parallel=True)
    (none,) = memory.unit_activation_bytes(graph, sp, tp)
    assert none == pytest.approx(sbh * (4 + 30 / t + 5 * a * s / (h * t)))
    (sel,) = memory.unit_activation_bytes(graph, dataclasses.replace(sp, recompute="selective"), tp)
    assert sel == pytest.approx(sbh * (4 + 30 / t))
    assert sel - 4 * sbh * (1 - 1 / t) == pytest.approx(34 * sbh / t)  # Korthikanti et al.'s + the gathered inputs
    (without,) = memory.unit_activation_bytes(graph, par(tp=t, micro_batch_size=b, recompute="selective"), tp)
    assert without - sel == pytest.approx(sbh * 6 * (1 - 1 / t))
    # full recomputation keeps the block's input: 2·s·b·h, this rank's 1/t of the sequence under sequence parallelism
    (full,) = memory.unit_activation_bytes(graph, dataclasses.replace(sp, recompute="full"), tp)
    (full_tp,) = memory.unit_activation_bytes(graph, par(tp=t, micro_batch_size=b, recompute="full"), tp)
    assert full_tp == unit.input_bytes * b and full == pytest.approx(full_tp / t)


def sp_gpt(s: int, h: int):
    """The GPT graph and Megatron's TP plan, each block's collectives named by the layer they convert (the
    sequence-parallel formulas read them)."""
    g = gpt(s=s, h=h)
    tp = megatron_tp(g, s=s, h=h)
    for u in g.units:
        if u.kind == "block":
            srcs = [f"{u.fqn}.attn.proj", f"{u.fqn}.mlp.fc2", f"{u.fqn}.ln_1", f"{u.fqn}.ln_2"]
            for c, src in zip(tp.collectives[u.fqn], srcs):
                c.src = src
    return g, tp


def test_sequence_parallel_collectives():
    """Each all-reduce becomes a reduce-scatter and an all-gather of the same tensor: twice the payload as the plan
    counts it (an all-gather its output, a reduce-scatter its input), the same time on the ring; the norms' and
    the rowwise biases' gradients are all-reduced once a micro-batch."""
    s, h, t = 32, 64, 4
    g, tp = sp_gpt(s, h)
    for b in (1, 4):
        plain, sp = par(tp=t, micro_batch_size=b), par(tp=t, micro_batch_size=b, sequence_parallel=True)
        colls = cost_tp.unit_collectives(g, sp, tp, g.units[1])
        params = (4 * h + 2 * h) * ACTIVATION_BYTES  # ln_1 and ln_2, and the biases of proj and fc2
        # the token embedding is replicated here: the stream enters blocks.0's ln_1 whole and is scattered along
        # the sequence there, its gradient all-gathered backward
        enter = ("all_gather", "bwd", 2 * s * h * b)
        assert sorted(colls) == sorted([("reduce_scatter", "fwd", 2 * s * h * b), ("all_gather", "bwd", 2 * s * h * b)]
                                       * 2 + [("all_gather", "fwd", 2 * s * h * b),
                                              ("reduce_scatter", "bwd", 2 * s * h * b)] * 2
                                       + [("all_reduce", "bwd", params), enter])
        later = sorted(colls)
        later.remove(enter)
        assert sorted(cost_tp.unit_collectives(g, sp, tp, g.units[2])) == later
        assert cost.unit_time_parts(g, A100, sp, tp)[2].tp_comm_s == pytest.approx(
            cost.unit_time_parts(g, A100, plain, tp)[2].tp_comm_s + hw.collective_time(A100, "all_reduce", params, t))
        blocks = [i for i, u in enumerate(g.units) if u.kind == "block"]
        assert cost_step.tp_bytes(g, sp, tp, blocks) == pytest.approx(
            2 * cost_step.tp_bytes(g, plain, tp, blocks) + (len(blocks) * params + enter[2]) * sp.num_microbatches)


@pytest.mark.parametrize("t", [2, 4])
def test_regather_activations(t):
    """`sp_regather`: the colwise Linears keep this rank's part of their gathered inputs, so a GPT block keeps
    Korthikanti et al.'s 34·s·b·h/t with selective recomputation (4·s·b·h·(1 - 1/t) less than without it), and a
    colwise Linear's backward holds its re-gathered input beside its gradient."""
    s, h, a, b = 256, 512, 8, 2
    unit, layers = gpt_block("blocks.0", seq=s, dim=h, heads=a)
    graph = ModelGraph(name="one", num_params=unit.num_params, seq_len=s, units=[unit],
                       layers={x.fqn: x for x in layers}, edges=[], cut_bytes=[])
    tp, sbh = megatron_tp(graph, s=s, h=h), s * b * h
    sp = par(tp=t, micro_batch_size=b, sequence_parallel=True, recompute="selective")
    rg = dataclasses.replace(sp, sp_regather=True)
    (sel,), (sel_rg,) = memory.unit_activation_bytes(graph, sp, tp), memory.unit_activation_bytes(graph, rg, tp)
    assert sel_rg == pytest.approx(34 * sbh / t) and sel - sel_rg == pytest.approx(4 * sbh * (1 - 1 / t))
    full = dataclasses.replace(sp, recompute="full")
    assert memory.unit_activation_bytes(graph, full, tp) == memory.unit_activation_bytes(
        graph, dataclasses.replace(full, sp_regather=True), tp)  # a block recomputed in full keeps its input only
    (back,), (back_rg,) = memory.unit_backward_bytes(graph, sp, tp), memory.unit_backward_bytes(graph, rg, tp)
    # the largest gradient: fc2's input (4·h/t a token) or, re-gathered, a colwise input and its gradient (2·h)
    assert back_rg - back == pytest.approx(max(0.0, 2 * sbh * 2 - 4 * sbh * 2 / t))


def test_regather_collectives():
    """Each all-gather before colwise layers runs again in backward, the same bytes; its time is what the colwise
    Linears' input-gradient GEMMs do not hide."""
    s, h, t = 32, 64, 4
    g, tp = sp_gpt(s, h)
    b = 2
    sp = par(tp=t, micro_batch_size=b, sequence_parallel=True)
    rg = dataclasses.replace(sp, sp_regather=True)
    unit = g.units[1]
    extra = sorted(set(cost_tp.unit_collectives(g, rg, tp, unit)) - set(cost_tp.unit_collectives(g, sp, tp, unit)))
    assert extra == [("all_gather", cost_tp.REGATHER, 2 * s * h * b)]
    assert len(cost_tp.unit_collectives(g, rg, tp, unit)) == len(cost_tp.unit_collectives(g, sp, tp, unit)) + 2
    blocks = [i for i, u in enumerate(g.units) if u.kind == "block"]
    assert cost_step.tp_bytes(g, rg, tp, blocks) == pytest.approx(
        cost_step.tp_bytes(g, sp, tp, blocks) + len(blocks) * 2 * 2 * s * h * b * sp.num_microbatches)
    regather = 2 * hw.collective_time(A100, "all_gather", 2 * s * h * b, t)
    hidden = cost.regather_hidden_time(g, A100, rg, tp, unit)
    assert hidden > 0
    assert cost.unit_time_parts(g, A100, rg, tp)[1].tp_comm_s == pytest.approx(
        cost.unit_time_parts(g, A100, sp, tp)[1].tp_comm_s + max(0.0, regather - hidden))


def test_regather_needs_sequence_parallel():
    with pytest.raises(PartcError, match="sp_regather needs sequence_parallel"):
        par(tp=2, sp_regather=True)
    assert "sp_regather" not in par(tp=2, sequence_parallel=True).to_dict()  # plans without it read as before
    on = par(tp=2, sequence_parallel=True, sp_regather=True)
    assert Parallel.from_dict(on.to_dict()) == on and "sp+regather" in on.summary().split()


def test_sequence_parallel_needs_tp():
    with pytest.raises(PartcError, match="sequence_parallel needs tp >= 2"):
        par(tp=1, sequence_parallel=True)
    with pytest.raises(PartcError, match="must be true or false"):
        Parallel.from_dict({**par(tp=2).to_dict(), "sequence_parallel": 1})
    assert Parallel.from_dict(par(tp=2, sequence_parallel=True).to_dict()).sequence_parallel
    assert "sp" in par(tp=2, sequence_parallel=True).summary().split()


def test_recompute_only_blocks():
    g = gpt()
    acts = memory.unit_activation_bytes(g, par(recompute="full"), None)
    assert acts[0] == 0 and acts[-1] == g.units[-1].saved_bytes  # embedding, head keep their own
    assert acts[1] == g.units[1].input_bytes


# --- 3. Pipeline schedule terms (Narayanan et al.) -----------------------------------------------------------


def test_in_flight_and_bubble():
    p, m = 4, 16
    one = par(pp=p, global_batch_size=m)
    assert [memory.in_flight(one, i) for i in range(p)] == [4, 3, 2, 1]
    assert memory.in_flight(par(pp=8, global_batch_size=4), 0) == 4  # capped at m
    gp = par(pp=p, global_batch_size=m, schedule="gpipe")
    assert [memory.in_flight(gp, i) for i in range(p)] == [m] * p
    assert cost_step.bubble_fraction(one) == pytest.approx((p - 1) / (m + p - 1))
    assert cost_step.bubble_fraction(gp) == pytest.approx((p - 1) / (m + p - 1))
    v = 2
    il = par(pp=p, global_batch_size=m, schedule="interleaved-1f1b", virtual_stages=v)
    assert cost_step.bubble_fraction(il) == pytest.approx(((p - 1) / v) / (m + (p - 1) / v))
    # Rank 0: Korthikanti's p·(1 + (p - 1)/(p·v)); later ranks per Megatron's warmup count.
    assert memory.in_flight(il, 0) == pytest.approx(p * (1 + (p - 1) / (p * v)))
    assert memory.in_flight(il, p - 1) == pytest.approx(((v - 1) * p + 1) / v)
    assert all(memory.in_flight(il, i) >= memory.in_flight(il, i + 1) for i in range(p - 1))


# --- 4. Time ---------------------------------------------------------------------------------------------------


def test_tp_collectives_in_unit_time():
    s, h = 32, 64
    g = gpt(s=s, h=h)
    tp = megatron_tp(g, s=s, h=h)
    for b in (1, 4):
        p_ = par(tp=4, micro_batch_size=b)
        parts = cost.unit_time_parts(g, A100, p_, tp)
        want = 4 * hw.collective_time(A100, "all_reduce", 2 * s * h * b, 4)
        assert parts[1].tp_comm_s == pytest.approx(want)
        assert parts[0].tp_comm_s == 0
        assert cost.unit_times(g, A100, p_, tp)[1] == pytest.approx(parts[1].compute_s + want)
        # Full recompute replays the two forward all-reduces.
        full = cost.unit_time_parts(g, A100, dataclasses.replace(p_, recompute="full"), tp)
        assert full[1].tp_comm_s == pytest.approx(want * 6 / 4)
    # Messages 8x larger add 7x the bandwidth term 2(n-1)/n · S/B of each all-reduce, not its latency.
    big = megatron_tp(g, s=s, h=h)
    for c in big.collectives["blocks.0"]:
        c.nbytes *= 8
    t_small = cost.unit_time_parts(g, A100, par(tp=4), tp)[1].tp_comm_s
    t_big = cost.unit_time_parts(g, A100, par(tp=4), big)[1].tp_comm_s
    bw, _ = hw.link(A100, spans_nodes=False)
    assert t_big - t_small == pytest.approx(4 * 2 * 3 / 4 * 7 * 2 * s * h / bw)
    assert cost.unit_time_parts(g, A100, par(tp=8), tp)[1].tp_comm_s > t_small  # more ranks, more ring steps


def test_unit_time_compute_and_recompute():
    g = gpt()
    base = cost.unit_time_parts(g, A100, par(), None)
    fwd = base[1].compute_s / 3
    gemms = sum(hw.gemm_time(A100, x) for f in g.units[1].layers for x in g.layers[f].gemms)
    core = sum(hw.gemm_time(A100, x) for x in g.units[1].core_gemms)
    mem = hw.memory_time(A100, sum(g.layers[f].memory_bytes for f in g.units[1].layers) + g.units[1].memory_bytes)
    assert fwd == pytest.approx(gemms + core + mem)
    full = cost.unit_time_parts(g, A100, par(recompute="full"), None)
    assert full[1].compute_s == pytest.approx(4 * fwd)
    sel = cost.unit_time_parts(g, A100, par(recompute="selective"), None)
    assert sel[1].compute_s == pytest.approx(3 * fwd + core)
    # TP shards the work: each GPU does less, though not t times less (GEMM efficiency, replicated norms).
    sharded = cost.unit_time_parts(g, A100, par(tp=4), megatron_tp(g, s=32, h=64))
    assert base[1].compute_s / 4 < sharded[1].compute_s < base[1].compute_s


# --- 5. Parameters ---------------------------------------------------------------------------------------------


def test_param_counts_tp_and_tied():
    h, V = 64, 512
    g = gpt(h=h, V=V)
    counts = memory.unit_param_counts(g, par(), None)
    assert counts[0] == V * h and counts[-1] == V * h  # tied head counted on its unit too
    assert sum(counts) == g.num_params + V * h
    assert memory.stage_param_count(g, par(), None, range(len(g.units))) == g.num_params  # once per stage
    tp = megatron_tp(g, s=32, h=h)
    tp.styles["tok"], tp.styles["lm_head"] = "rowwise", "colwise"
    t = 4
    block = memory.unit_param_counts(g, par(tp=t), tp)[1]
    want = (2 * 2 * h                               # two norms, replicated
            + (3 * h * h + 3 * h) // t              # qkv colwise: weight and bias sharded
            + h * h // t + h                        # proj rowwise: bias replicated
            + (4 * h * h + 4 * h) // t
            + 4 * h * h // t + h)
    assert block == want
    assert memory.unit_param_counts(g, par(tp=t), tp)[0] == V * h // t


# --- 6. Data parallel, p2p, fits -------------------------------------------------------------------------------


def test_dp_comm_volumes():
    """What each ZeRO stage moves (partc.passes.zero): ZeRO-0 all-reduces fp32 gradients once; ZeRO-1 gathers bf16
    parameters and reduce-scatters fp32 gradients once a step, ZeRO-2 every micro-batch, ZeRO-3 gathers twice a
    micro-batch."""
    psi, m = 1e8, 4
    step = dict(dp=8, global_batch_size=8 * m)
    assert zero.dp_bytes(par(zero=0, **step), psi, psi, 0) == {"all_reduce": 4 * psi}
    assert zero.dp_bytes(par(zero=1, **step), psi, psi, 0) == {"all_gather": 2 * psi, "reduce_scatter": 4 * psi}
    assert zero.dp_bytes(par(zero=2, **step), psi, psi, 0) == {"all_gather": m * 2 * psi,
                                                               "reduce_scatter": m * 4 * psi}
    assert zero.dp_bytes(par(zero=3, **step), psi, 0.9 * psi, 0.1 * psi) == pytest.approx(
        {"all_gather": m * 2 * (2 * 0.9 + 0.1) * psi, "reduce_scatter": m * 4 * psi})  # the root gathers once
    assert zero.dp_bytes(par(zero=1, dp=1), psi, psi, 0) == {}
    t0 = cost_step.dp_comm_time(A100, par(zero=0, **step), psi, False)
    t1 = cost_step.dp_comm_time(A100, par(zero=1, **step), psi, False)
    assert t0 == pytest.approx(hw.collective_time(A100, "all_reduce", 4 * psi, 8))
    assert t1 == pytest.approx(hw.collective_time(A100, "all_gather", 2 * psi, 8)
                               + hw.collective_time(A100, "reduce_scatter", 4 * psi, 8))
    assert cost_step.dp_comm_time(A100, par(zero=2, **step), psi, False) == pytest.approx(
        m * t1, rel=0.01)  # m calls each: m times the bytes and the latency
    assert cost_step.dp_comm_time(A100, par(dp=1), psi, False) == 0
    hidden = dataclasses.replace(A100, dp_overlap=0.75)
    assert cost_step.dp_comm_time(hidden, par(zero=0, **step), psi, False) == pytest.approx(0.25 * t0)
    assert cost_step.dp_comm_time(A100, par(zero=0, **step), psi, True) > t0
    # FSDP pads dim 0 of every parameter to a multiple of the ranks.
    assert zero.padded_numel((10, 3), 4) == 12 * 3 and zero.padded_numel((8, 3), 4) == 24


def test_p2p_and_fits():
    n = 2 * 2 * 32 * 64  # a micro-batch of 2 samples
    one = cost_step.p2p_time(A100, par(pp=2, micro_batch_size=2), n, False)
    assert one == pytest.approx(2 * hw.collective_time(A100, "p2p", n, 2))
    il = par(pp=2, micro_batch_size=2, schedule="interleaved-1f1b", virtual_stages=3)
    assert cost_step.p2p_time(A100, il, n, False) == pytest.approx(3 * one)
    assert cost_step.p2p_time(A100, par(), n, False) == 0
    # A boundary whose tensors need no gradient crosses only forward.
    assert cost_step.p2p_round_trip(A100, par(pp=2, micro_batch_size=2), n, False, 0.0) == pytest.approx(one / 2)
    cap = A100.usable_memory_bytes
    assert cap == pytest.approx(A100.memory_bytes * 0.95 - 1024**3)
    assert cost_step.fits(A100, cost_types.Memory(params=cap))
    assert not cost_step.fits(A100, cost_types.Memory(params=cap, activations=1))


# --- 7. The whole step -----------------------------------------------------------------------------------------


def test_predict_consistent():
    s, h, a, V, L = 32, 64, 4, 512, 4
    g = gpt(L=L, s=s, h=h, a=a, V=V)
    tp = megatron_tp(g, s=s, h=h)
    p_ = par(dp=2, tp=2, pp=2, zero=1, micro_batch_size=2, global_batch_size=32)
    m = p_.num_microbatches
    pred = assemble.predict(g, A100, p_, tp, [(0, 3), (3, 7)])
    t_max = max(st.time_s for st in pred.ranks)
    assert len(pred.ranks) == 2
    assert pred.step_time_s >= (m + 1) * t_max
    parts = (pred.compute_s + pred.tp_comm_s + pred.pp_comm_s + pred.bubble_s + pred.dp_comm_s
             + pred.optimizer_s)
    assert pred.step_time_s == pytest.approx(parts)
    assert pred.tokens_per_s == pytest.approx(32 * s / pred.step_time_s)
    assert 0 < pred.mfu <= 1
    assert pred.bubble_fraction == pytest.approx(1 / (m + 1))
    assert pred.memory_per_gpu.total == max(st.memory.total for st in pred.ranks)
    assert pred.pp_comm_s > 0 and pred.tp_comm_s > 0 and pred.dp_comm_s > 0
    # Model FLOPs equal Megatron's 72·B·L·s·h²·(1 + s/(6h) + V/(12·h·L)) for this GPT (GEMMs only).
    mf = 72 * 32 * L * s * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    assert pred.model_tflops_per_gpu * 1e12 * pred.step_time_s * p_.world_size == pytest.approx(mf)
    # Stage memory: states of its (tied-dedup) params + in-flight micro-batches (saved activations; the boundary
    # the stage sends needs a gradient, and its data goes once sent) + extras. At ZeRO-1 the backwards before the last
    # micro-batch's fold a unit's bf16 gradient (2 bytes a parameter); the last one's, with one micro-batch in
    # flight, also makes the reduction's fp32 input (4 bytes a parameter, what `stage_extra_bytes` charges).
    acts = memory.unit_activation_bytes(g, p_, tp)
    st0 = pred.ranks[0]
    states = memory.model_state_bytes(st0.num_params, p_)
    extra = memory.stage_extra_bytes(g, p_, tp, [0, 1, 2])
    largest = max(memory.unit_param_counts(g, p_, tp)[:3])
    held = sum(acts[:3])
    assert st0.memory.total == pytest.approx(states.total + max(2 * held + extra - 2 * largest, held + extra)
                                             + st0.memory.buffers)
    assert pred.ranks[1].memory.activations >= g.layers["lm_head"].out_bytes / 2 * 2 * memory.LOSS_BYTES  # the loss
    assert st0.memory.buffers == 5 * A100.communicator_bytes  # world, tp, dp, pp, the tied embedding's group
    assert pred.to_dict()["memory_per_gpu"]["total"] == int(round(pred.memory_per_gpu.total))


def test_copied_value_all_reduced_on_each_stage_that_reads_it():
    """A value read by colwise layers of two stages is copied (`copy_to_tp`) on each: its gradient's all-reduce runs
    once on every stage holding a reader, not once on the source's stage (`cost_step.copy_moves`)."""
    s, h, n = 32, 64, 1000
    g = gpt(L=4, s=s, h=h)
    p_ = par(tp=2, pp=2, micro_batch_size=2, global_batch_size=8)
    bounds = [(0, 3), (3, 7)]
    once = hw.collective_time(A100, "all_reduce", n * 2, 2)

    def predict(readers):
        tp = megatron_tp(g, s=s, h=h)
        tp.collectives["blocks.0"].append(FakeCollective(kind="all_reduce", phase="bwd", nbytes=n,
                                                         reader_units=readers))
        return assemble.predict(g, A100, p_, tp, bounds).ranks

    m = p_.num_microbatches
    base = predict(())  # charged to blocks.0's stage, as one stage holding every reader runs it
    assert [r.comm_bytes["tp"] for r in predict(("blocks.0", "blocks.1"))] == [r.comm_bytes["tp"] for r in base]
    both = predict(("blocks.1", "blocks.3"))  # stage 0 copies, stage 1 copies again
    assert both[0].comm_bytes["tp"] == base[0].comm_bytes["tp"]
    assert both[1].comm_bytes["tp"] == base[1].comm_bytes["tp"] + n * 2 * m
    assert both[1].time_s == pytest.approx(base[1].time_s + once)
    later = predict(("blocks.3",))  # only stage 1 reads it: the one all-reduce runs there
    assert later[0].comm_bytes["tp"] == base[0].comm_bytes["tp"] - n * 2 * m
    assert later[1].comm_bytes["tp"] == base[1].comm_bytes["tp"] + n * 2 * m
    assert later[0].time_s == pytest.approx(base[0].time_s - once)


@pytest.mark.parametrize("zero_stage,bounds", [(3, [(0, 3), (3, 7)]), (1, [(0, 1), (1, 6), (6, 7)])])
def test_predict_with_the_search_caches_equals_predict_without(zero_stage, bounds):
    """The per-unit lists the search passes in (`unit_param_shards`, `unit_local_shapes`, ...) give the prediction
    predict computes alone: tied embedding and head on different ranks, FSDP groups, TP."""
    g = gpt(L=4, s=32, h=64, a=4, V=512)
    tp = megatron_tp(g, s=32, h=64)
    p_ = par(dp=2, tp=2, pp=len(bounds), zero=zero_stage, micro_batch_size=2, global_batch_size=32)
    alone = assemble.predict(g, A100, p_, tp, bounds)
    cached = assemble.predict(g, A100, p_, tp, bounds, parts=cost.unit_time_parts(g, A100, p_, tp),
                          acts=memory.unit_activation_bytes(g, p_, tp), shards=memory.unit_param_shards(g, p_, tp),
                          local_shapes=memory.unit_local_shapes(g, p_, tp))
    assert cached.to_dict() == alone.to_dict()
    assert alone.ranks[0].comm_bytes["pp"] > 0 and alone.ranks[-1].memory.activations > 0
    units = list(range(bounds[0][0], bounds[0][1]))
    assert (memory.stage_extra_bytes(g, p_, tp, units, memory.unit_param_shards(g, p_, tp))
            == memory.stage_extra_bytes(g, p_, tp, units))


def test_predict_single_gpu_no_comm():
    g = gpt()
    pred = assemble.predict(g, A100, par(global_batch_size=4), None, [(0, len(g.units))])
    assert pred.tp_comm_s == pred.pp_comm_s == pred.dp_comm_s == pred.bubble_s == 0
    t = sum(cost.unit_times(g, A100, par(global_batch_size=4), None))
    assert pred.step_time_s == pytest.approx(4 * t + pred.optimizer_s)
    # One stage holds the tied weight once.
    assert pred.ranks[0].num_params == g.num_params


def test_predict_interleaved():
    g = gpt(L=6)
    p_ = par(pp=2, global_batch_size=8, schedule="interleaved-1f1b", virtual_stages=2)
    bounds = [(0, 2), (2, 4), (4, 6), (6, 9)]
    pred = assemble.predict(g, A100, p_, None, bounds)
    assert pred.ranks[0].chunks == [(0, 2), (4, 6)] and pred.ranks[1].chunks == [(2, 4), (6, 9)]
    t_max = max(st.time_s for st in pred.ranks)
    assert pred.bubble_s == pytest.approx((2 - 1) / 2 * t_max)
    assert pred.step_time_s == pytest.approx((8 + 1 / 2) * t_max + pred.dp_comm_s + pred.optimizer_s)
    # Rank 1 holds the head and the embedding's tied weight is on rank 0: counted on both.
    assert pred.ranks[1].num_params >= g.layers["tok"].num_params


def test_predict_bad_bounds():
    g = gpt()
    n = len(g.units)
    with pytest.raises(PartcError):
        assemble.predict(g, A100, par(pp=2), None, [(0, n)])
    with pytest.raises(PartcError):
        assemble.predict(g, A100, par(pp=2), None, [(0, 2), (3, n)])
    with pytest.raises(PartcError):
        assemble.predict(g, A100, par(pp=2), None, [(0, 2), (2, n - 1)])


# --- 8. Hardware profile: GEMM roofline, wave quantization, aggregated InfiniBand --------------------------------


def test_gemm_roofline_and_waves():
    big = Gemm(batch=1, m=8192, n=8192, k=8192, batch_scales=False)
    t = hw.gemm_time(A100, big)
    eff = big.flops / t / A100.peak_flops
    assert 0.70 < eff <= A100.gemm_efficiency <= 0.85  # plausible A100 fp16 GEMM (about 226 TFLOP/s)
    # Wave quantization: W = m·n / (tile · SMs) waves, W / (W + 1/2) of the SMs busy on average; a large product
    # takes the largest tile.
    waves = 8192 * 8192 / (256 * 128 * A100.num_sms)
    k_factor = 8192 / (8192 + A100.gemm_half_size)
    assert hw.gemm_efficiency(A100, 8192, 8192, 8192) == pytest.approx(
        A100.gemm_efficiency * waves / (waves + 0.5) * k_factor)
    # Fewer tiles, lower efficiency: a TP-split GEMM at b = 1 runs slower per FLOP than at b = 8.
    assert hw.gemm_efficiency(A100, 2048, 4608, 12288) < hw.gemm_efficiency(A100, 16384, 4608, 12288)
    # A small product takes small tiles to fill the SMs (better than a fraction of a wave of large ones).
    k_factor = 4096 / (4096 + A100.gemm_half_size)
    large = 512 * 768 / (256 * 128 * A100.num_sms)
    small = 512 * 768 / (64 * 64 * A100.num_sms)
    assert hw.gemm_efficiency(A100, 512, 768, 4096) == pytest.approx(
        A100.gemm_efficiency * 0.65 * small / (small + 0.5) * k_factor)
    assert hw.gemm_efficiency(A100, 512, 768, 4096) > A100.gemm_efficiency * large / (large + 0.5) * k_factor
    # Attention scores (k = head dim 128): the roofline's memory side, 16-bit operands and product.
    scores = Gemm(batch=32, m=2048, n=2048, k=128, batch_scales=True)
    mem = hw.memory_time(A100, hw.gemm_bytes(32, 2048, 2048, 128))
    assert hw.gemm_time(A100, scores) >= mem
    assert hw.gemm_time(A100, scores) == pytest.approx(
        max(mem, scores.flops / (A100.peak_flops * hw.gemm_efficiency(A100, 2048, 2048, 128, 32))))
    # Memory-bound kernels run below the datasheet bandwidth.
    assert hw.memory_time(A100, 2.039e12) == pytest.approx(1 / A100.memory_efficiency)


def test_profile_is_physically_plausible():
    for name in ("a100-80g", "h100-80g", "h200-141g"):
        c = PRESETS[name]
        assert c.gemm_efficiency <= 0.85 and c.memory_efficiency <= 0.95
        assert c.intra_node_bandwidth * c.intra_node_efficiency <= 450e9
        assert c.inter_node_bandwidth * c.inter_node_efficiency <= 50e9
        assert c.usable_memory_bytes <= c.memory_bytes - 4 * 1024**3  # context, workspaces, fragmentation
    assert A100.intra_node_bandwidth * A100.intra_node_efficiency <= 300e9
    assert A100.inter_node_bandwidth * A100.inter_node_efficiency <= 25e9


def test_collectives_across_nodes_use_every_adapter():
    nbytes = 1e9
    one = hw.collective_time(A100, "all_reduce", nbytes, 32, spans_nodes=True)
    eight = hw.collective_time(A100, "all_reduce", nbytes, 32, spans_nodes=True, ranks_per_node=8)
    bw1, _ = hw.link(A100, spans_nodes=True)
    bw8, _ = hw.link(A100, spans_nodes=True, ranks_per_node=8)
    assert bw8 == pytest.approx(min(8 * bw1, hw.link(A100, spans_nodes=False)[0]))  # capped by NVLink
    assert eight < one
    # The DP group of (dp=32, tp=1) has 8 members a node; of (dp=32, tp=8), one.
    assert par(dp=32, global_batch_size=32).ranks_per_node("dp", A100.gpus_per_node) == 8
    assert par(dp=32, tp=8, global_batch_size=32).ranks_per_node("dp", A100.gpus_per_node) == 1
    assert par(dp=32, tp=2, global_batch_size=32).ranks_per_node("dp", A100.gpus_per_node) == 4
    assert par(dp=2, tp=2).ranks_per_node("dp", A100.gpus_per_node) == 2
    assert cost_step.dp_comm_time(A100, par(dp=32, global_batch_size=32), 1e9, True) == pytest.approx(
        hw.collective_time(A100, "all_reduce", 4e9, 32, spans_nodes=True, ranks_per_node=8))


# --- 9. Interleaved 1F1B and scatter/gather p2p (Narayanan et al. 2021) ----------------------------------------


def test_p2p_scatter_gather():
    """With TP degree t each TP rank sends b·s·h/t to the next stage, which all-gathers it over NVLink (the program's
    `scatter_to_next_stage` / `gather_from_previous_stage`)."""
    n = 2 * 2 * 2048 * 4096  # a micro-batch of 2 samples
    p_ = par(tp=8, pp=4, micro_batch_size=2, global_batch_size=8)
    want = 2 * (hw.collective_time(A100, "p2p", n / 8, 2, spans_nodes=True)
                + hw.collective_time(A100, "all_gather", n, 8))
    assert cost_step.p2p_time(A100, p_, n, True) == pytest.approx(want)
    assert cost_step.p2p_time(A100, p_, n, True) < cost_step.p2p_time(A100, dataclasses.replace(p_, tp=1), n, True)
    il = dataclasses.replace(p_, schedule="interleaved-1f1b", virtual_stages=2)
    assert cost_step.p2p_time(A100, il, n, True) == pytest.approx(2 * want)  # v times the traffic


def test_scatter_gather_bytes():
    """Per micro-batch a middle chunk receives and sends 1/t of each boundary (and of its gradient) over pp, and
    all-gathers over tp what it receives forward and the gradient of what it sends backward."""
    graph = ModelGraph(name="g", num_params=0, seq_len=1, units=[], layers={}, edges=[], cut_bytes=[100, 200, 300])
    p_ = par(tp=2, pp=2, micro_batch_size=1, global_batch_size=4)  # m = 4
    assert cost_step.pp_bytes(graph, p_, [(1, 2)]) == 4 * (100 + 200) * 2 / 2
    assert cost_step.gather_bytes(graph, p_, [(1, 2)]) == 4 * (100 + 200)
    assert cost_step.gather_bytes(graph, dataclasses.replace(p_, tp=1), [(1, 2)]) == 0


def test_interleaved_bubble_and_microbatches():
    from partc.parallel import Pins
    from partc.passes.search_space import _configs

    p, m = 4, 8
    for v in (2, 4):
        il = par(pp=p, global_batch_size=m, schedule="interleaved-1f1b", virtual_stages=v)
        assert cost_step.bubble_fraction(il) * (m + (p - 1) / v) == pytest.approx((p - 1) / v)  # (1/v)(p-1)/m ideal
        assert cost_step.bubble_fraction(il) < cost_step.bubble_fraction(par(pp=p, global_batch_size=m))
    with pytest.raises(PartcError, match="multiple of pp"):
        par(pp=4, global_batch_size=6, schedule="interleaved-1f1b", virtual_stages=2)
    g = gpt(L=8)
    configs = list(_configs(g, A100, 8, 24, Pins(schedule="interleaved-1f1b")))
    assert configs and all(c.num_microbatches % c.pp == 0 and c.virtual_stages >= 2 for c in configs)


def test_unit_times_reuse_only_truly_identical_units(traced_example):
    """unit_time_parts computes identical blocks once; a block that also carries glue ops (blocks.0 holds the
    embedding sum) must still get its own time."""
    graph = traced_example("gpt")[1].graph
    par = Parallel(dp=1, tp=1, pp=1, zero=0, micro_batch_size=4, global_batch_size=4)
    parts = cost.unit_time_parts(graph, PRESETS["a100-80g"], par, None)
    for i, unit in enumerate(graph.units):
        fwd, _ = cost._forward_times(graph, PRESETS["a100-80g"], par, None, unit)
        launch = cost.launch_time(PRESETS["a100-80g"], unit, "none")  # the floor of a unit of tiny kernels
        assert parts[i].compute_s == pytest.approx(max(3 * fwd, launch), rel=1e-12), unit.fqn
    assert parts[2].compute_s != parts[3].compute_s  # blocks.0 (with the embedding sum) vs blocks.1


@pytest.mark.parametrize("pp,v", [(1, 1), (2, 1), (2, 2), (3, 1)])
def test_predict_per_rank_sums_equal_the_stage_functions(pp, v):
    """`predict` sums per-unit sizes over a rank's units (one memo shared by every split, as in the search); a
    tied parameter held twice falls back to the merge. Each rank's parameters, working memory, FSDP traffic and
    shared-weight traffic equal `stage_param_count`, `stage_extra_bytes`, `fsdp_groups` and `shared_weights`
    computed for that split alone, on every split of a tied GPT."""
    g = gpt(L=4, s=32, h=64, a=4, V=512)
    n, k = len(g.units), pp * v
    tp = megatron_tp(g, s=32, h=64)
    memo: dict = {}
    checked = 0
    for zero_stage, recompute in [(1, "full"), (3, "selective")]:
        p_ = par(dp=2, tp=2, pp=pp, zero=zero_stage, micro_batch_size=2, global_batch_size=32,
                 schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v, recompute=recompute)
        for cuts in itertools.combinations(range(1, n), k - 1):
            ends = [*cuts, n]
            bounds = list(zip([0, *cuts], ends))
            pred = assemble.predict(g, A100, p_, tp, bounds, memo=memo)
            shared = cost_step.shared_weights(g, p_, tp, bounds)
            for r in pred.ranks:
                idx = [i for lo, hi in r.chunks for i in range(lo, hi)]
                assert r.num_params == memory.stage_param_count(g, p_, tp, idx)
                acts = memory.unit_activation_bytes(g, p_, tp)
                want = memory._in_flight_bytes(g, p_, r.rank, r.chunks, acts) + memory.stage_extra_bytes(g, p_, tp, idx)
                if zero_stage < 2 and v == 1 and memory.in_flight(p_, r.rank) > 1:  # the last micro-batch's peak
                    want = max(memory._in_flight_bytes(g, p_, r.rank, r.chunks, acts)
                               + memory.stage_extra_bytes(g, p_, tp, idx, last=False),
                               memory._held_bytes(g, p_, r.chunks, acts)[0] + memory.stage_extra_bytes(g, p_, tp, idx))
                elif zero_stage < 2 and v > 1:  # each backward with its chunk's working memory; each reduction
                    held = memory._held_bytes(g, p_, r.chunks, acts)
                    own_extra = [memory.stage_extra_bytes(g, p_, tp, range(lo, hi), last=False) for lo, hi in r.chunks]
                    at = schedule.held_at_reductions(pp, v, p_.num_microbatches, r.rank, held)
                    want = schedule.peak_bytes(pp, v, p_.num_microbatches, r.rank, held, [
                        g.boundary_grad_bytes(hi - 1, cost_types.tokens(p_)) / p_.tp + e
                        for (lo, hi), e in zip(r.chunks, own_extra)])
                    for j, (lo, hi) in enumerate(r.chunks):
                        own = [memory.stage_param_count(g, p_, tp, [i]) for i in range(lo, hi)]
                        want = max(want, at[j] + own_extra[j] + zero.working_bytes(p_, own)
                                   - zero.working_bytes(p_, own, last=False))
                assert r.memory.activations == pytest.approx(want, rel=1e-12)
                groups = [memory.fsdp_groups(g, p_, tp, range(lo, hi)) for lo, hi in r.chunks]
                padded = (sum(x[1] for x in groups), sum(x[2] for x in groups))
                assert r.comm_bytes["dp"] == sum(zero.dp_bytes(p_, r.num_params, *padded).values())
                assert r.comm_bytes["pp"] == cost_step.pp_bytes(g, p_, r.chunks) + shared.get(r.rank, 0.0)
                checked += 1
    assert checked >= 2 * pp


def test_sequence_parallel_full_recompute_counts_the_received_input_once():
    """Under sequence parallelism a block recomputed in full keeps its input, this rank's part of the sequence, and
    that is the tensor the pipeline stage received (nothing gathers it): a chunk starting at such a block holds it
    once (Llama 3 405B, pp 16, v 8: 32 MiB a micro-batch and chunk too many, 14.27 against the 9.70 GiB ``partc
    check`` measured on the first rank). Without it the block keeps the gathered whole, and the received part, which
    no op saved, goes once the forward has run, as does the sent output (`partc.runtime.schedule.PipeStage`)."""
    g = gpt(L=4, s=32, h=64, a=4, V=512)
    tp = megatron_tp(g, s=32, h=64)
    i = next(k for k, u in enumerate(g.units) if k > 0 and u.kind == "block")
    for sp in (True, False):
        p_ = par(tp=2, pp=2, micro_batch_size=2, recompute="full", sequence_parallel=sp)
        acts = memory.unit_activation_bytes(g, p_, tp)
        received, sent = (g.boundary_bytes(k, cost_types.tokens(p_)) / 2 for k in (i - 1, i))
        assert acts[i] == (received if sp else 2 * received)
        assert sent > 0
        assert memory._held_bytes(g, p_, [(i, i + 1)], acts) == [acts[i]], sp
