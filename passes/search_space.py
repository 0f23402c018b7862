"""The search space: every parallel configuration the pins allow, as the fields of a `Parallel`.

Candidates are (dp, tp, pp, cp) factorizations of the GPU count (tp inside a node unless pinned; cp only where a
chunk keeps `MIN_CP_CHUNK` tokens), ep carved from dp where it divides every expert count, micro-batch sizes
dividing the per-replica batch, ZeRO stages 0-3, recomputation none/selective/full and the schedules 1F1B, GPipe
and interleaved 1F1B (v chunks a rank), and where tp > 1 sequence parallelism, its regather, and the pointwise
regions' fusion. A pin fixes its field; a value that cannot run (a sequence that does not divide) is left out here,
so the search (`passes.search`) never prices it.
"""

from __future__ import annotations

import math
from typing import Iterator

from partc.cluster import Cluster
from partc.errors import PartcError
from partc.ir import ModelGraph
from partc.parallel import RECOMPUTE, SCHEDULES, ZERO_STAGES, Parallel, Pins


MAX_VIRTUAL_STAGES = 8
"""Interleaved 1F1B tries v = 2 .. 8 model chunks a rank (Megatron-LM's runs use 2-4)."""


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending: each d <= sqrt(n) that divides n, and n // d (O(sqrt(n)) steps)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def max_stages(graph: ModelGraph) -> int:
    """The most pipeline stages (model chunks) a contiguous split can have: one unit each, except that the units
    required on the first stage (embeddings) share it, and so do those required on the last (final norm, head)."""
    n = len(graph.units)
    return max(1, n - max(len(graph.first_unit_required) - 1, 0) - max(len(graph.last_unit_required) - 1, 0))


def _configs(graph: ModelGraph, cluster: Cluster, gpus: int, global_batch: int, pins: Pins) -> Iterator[Parallel]:
    """Every Parallel the pins allow, in a fixed order (ties in the search go to the first): degrees, then the
    micro-batch size, then the memory and schedule policies."""
    for values in _config_values(graph, cluster, gpus, global_batch, pins):
        yield Parallel(**values)


def _config_values(graph: ModelGraph, cluster: Cluster, gpus: int, global_batch: int,
                   pins: Pins) -> Iterator[dict]:
    """`_configs`' fields, without building (and validating) a `Parallel`: the search builds one only for the
    configurations it reaches (a few thousand of 62,244 at 529.6B)."""
    n_units = len(graph.units)
    pinned = pins.pinned().items()
    precision = pins.precision or "bf16"
    imbalance = pins.expert_imbalance or 1.0  # an assumption stated, not searched
    experts = _expert_counts(graph)
    for dp, tp, pp, cp in _degrees(cluster, gpus, global_batch, pins, n_units, cp_degrees(graph, gpus, pins)):
        sp_choices = sequence_parallel_choices(graph, tp, pins, cp)
        if not sp_choices:
            continue
        per_replica = global_batch // dp
        for ep in _ep_degrees(pins, dp, experts):  # ep is carved from dp (at each cp coordinate)
            for b in divisors(per_replica):
                for zero, recompute, schedule, v in _policies(pins, dp, pp, per_replica // b, n_units):
                    for sp in sp_choices:
                        for regather in regather_choices(sp, pins):
                            for fused in fuse_choices(graph, recompute, pins):
                                values = dict(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, micro_batch_size=b,
                                              global_batch_size=global_batch, schedule=schedule, virtual_stages=v,
                                              recompute=recompute, precision=precision, sequence_parallel=sp,
                                              ep=ep, sp_regather=regather, expert_imbalance=imbalance,
                                              fuse_pointwise=fused)
                                if all(values[name] == value for name, value in pinned):
                                    yield values


def sequence_parallel_choices(graph: ModelGraph, tp: int, pins: Pins, cp: int = 1) -> tuple[bool, ...]:
    """The values of ``sequence_parallel`` the search weighs at TP degree `tp` and context-parallel degree `cp`:
    the pin, where given (True needs tp >= 2); else both under tp > 1 when the model has a sequence whose s/cp tokens
    a rank holds divide over tp (the program splits them along it), and off otherwise. Neither dominates: sequence
    parallelism moves the same bytes in two collectives (two latencies) and all-reduces the norms' gradients, for
    activations 1/t between the layers. Under cp a pinned ``--sequence-parallel`` whose s/cp tokens do not divide
    over tp is refused in one line where cp is pinned too, and skips that cp where the search chooses it."""
    local = graph.seq_len // cp if graph.seq_len and graph.seq_len % cp == 0 else 0
    if pins.sequence_parallel is not None:
        if pins.sequence_parallel and tp > 1 and cp > 1 and local % tp:
            if pins.cp is not None:
                raise PartcError(f"sequence parallelism: a cp rank's {graph.seq_len}/{cp} = {graph.seq_len / cp:g} "
                                 f"tokens do not divide over tp={tp}; compile with --no-sequence-parallel, another "
                                 f"--cp or another --tp")
            return ()
        return (pins.sequence_parallel,) if tp > 1 or not pins.sequence_parallel else ()
    if tp > 1 and local > 1 and local % tp == 0:
        return (False, True)
    return (False,)


def regather_choices(sequence_parallel: bool, pins: Pins) -> tuple[bool, ...]:
    """The values of ``sp_regather`` the search weighs: off without sequence parallelism; the pin, where given; else
    both. Neither dominates: gathering the colwise layers' inputs again in backward divides what they keep by t,
    for one more all-gather each (hidden behind the input gradient's GEMMs where those are longer)."""
    if not sequence_parallel:
        return (False,)
    return (pins.sp_regather,) if pins.sp_regather is not None else (False, True)


def fuse_choices(graph: ModelGraph, recompute: str, pins: Pins) -> tuple[bool, ...]:
    """The values of ``fuse_pointwise`` the search weighs: the pin, where given; else both where the model has a
    pointwise region or a repeated key and value to keep smaller and the blocks are not recomputed in full (which
    keeps only their inputs anyway); off otherwise. Neither dominates: it keeps less for the replay of the
    regions' memory-bound forward in backward, so a plan that fits without it is faster without it."""
    if pins.fuse_pointwise is not None:
        return (pins.fuse_pointwise,)
    if recompute != "full" and any(u.fused_saved_bytes + u.fused_gqa_saved_bytes > 0 for u in graph.units):
        return (False, True)
    return (False,)


def _expert_counts(graph: ModelGraph) -> list[int]:
    """The expert counts of the model's layers of packed experts (`Layer.inner`: their first grouped product's
    batch), which ep must divide."""
    return [g.batch for layer in graph.layers.values() if layer.inner
            for g in layer.gemms[:1] if g.inner_split == "n"] + [len(r.experts) for r in graph.routed_experts]


def _ep_degrees(pins: Pins, dp: int, experts: list[int]) -> list[int]:
    """The ep degrees to try at `dp`: the pinned one where it divides dp; else 1 and, for a model of packed experts,
    every divisor of dp that divides each layer's expert count (`Parallel.ep`)."""
    if pins.ep is not None:
        return [pins.ep] if dp % pins.ep == 0 else []
    return [e for e in divisors(dp) if e == 1 or (experts and all(n % e == 0 for n in experts))]


MIN_CP_CHUNK = 1024
"""The fewest tokens of a context-parallel chunk the search considers unpinned (each rank holds two chunks of
s/(2·cp)): below it the keys' and values' gathers and the smaller GEMMs cost more than cp saves (Llama 3 and
torchtitan use cp for sequences of tens of thousands of tokens). A pin (``--cp``) is taken as given."""


def cp_degrees(graph: ModelGraph, gpus: int, pins: Pins) -> list[int]:
    """The context-parallel degrees to search: the pinned one; else 1, and, for a model with causal attention
    (`Unit.cp_kv`), each divisor of the GPU count that cuts the sequence in chunks of `MIN_CP_CHUNK` tokens or
    more."""
    if pins.cp is not None:
        return [pins.cp]
    if not any(u.cp_kv for u in graph.units) or not graph.seq_len:
        return [1]
    return [cp for cp in divisors(gpus) if cp == 1 or (graph.seq_len % (2 * cp) == 0
                                                       and graph.seq_len // (2 * cp) >= MIN_CP_CHUNK)]


def _degrees(cluster: Cluster, gpus: int, global_batch: int, pins: Pins, n_units: int, cps: list[int]):
    """(dp, tp, pp, cp) with dp * tp * pp * cp = gpus: cp of `cps` (`cp_degrees`), tp inside a node unless pinned,
    pp at most one unit a stage, dp dividing the global batch."""
    for cp in cps:
        if gpus % cp:
            continue
        for tp in divisors(gpus // cp):
            if pins.tp is None and tp > cluster.gpus_per_node:
                continue
            for pp in divisors(gpus // (cp * tp)):
                dp = gpus // (cp * tp * pp)
                if pp <= n_units and global_batch % dp == 0:
                    yield dp, tp, pp, cp


def _policies(pins: Pins, dp: int, pp: int, m: int, n_units: int):
    """(zero, recompute, schedule, v) for one (dp, pp) and m micro-batches. Unpinned, the choices that change
    nothing are skipped: ZeRO without data parallelism, and any schedule but 1F1B without a pipeline."""
    for zero in ZERO_STAGES:
        if pins.zero is None and dp == 1 and zero:
            continue
        for recompute in RECOMPUTE:
            for schedule in SCHEDULES:
                if pins.schedule is None and pp == 1 and schedule != "1f1b":
                    continue
                if schedule != "interleaved-1f1b":
                    yield zero, recompute, schedule, 1
                elif pp >= 2 and m % pp == 0:
                    for v in range(2, MAX_VIRTUAL_STAGES + 1):
                        if n_units >= pp * v:
                            yield zero, recompute, schedule, v

