"""What data parallelism keeps and moves: the model states of each ZeRO stage and the collective payload of every
axis, per GPU and step, exactly as the runtime (`partc.runtime.parallelize`: FSDP2 per unit, mixed precision) runs
them. `partc.passes.cost` turns the bytes into seconds; the plan reports them as ``predicted.ranks[].comm_bytes``
and the runtime measures the same quantity (`partc.runtime.comm`).

Model states per parameter on the GPU (Ψ after TP and PP, N = dp, c = 2 for bf16 and 4 for fp32; `partc.precision`;
every 1/N and the gathered copy of ZeRO 1 and 2 of the padded Ψ', `padded_numel` below, as FSDP allocates them):

    ======  ==========================================  ====================  ===================
    ZeRO    parameters                                  gradients (fp32)      optimizer (Adam)
    ======  ==========================================  ====================  ===================
    0       4 (fp32 master, replicated) + c (gathered)  4                     8
    1       4/N (master, sharded) + c (gathered)        4 (accumulated)       8/N
    2       4/N + c (gathered for each micro-batch)     4/N                   8/N
    3       4/N (+ two units gathered at a time)        4/N                   8/N
    ======  ==========================================  ====================  ===================

Collective payload per step on one GPU (the bytes passed to the calls: all-reduce the tensor, all-gather the
gathered output, reduce-scatter the input, send and receive the tensor). FSDP pads every parameter's dim 0 to a
multiple of N (Ψ' below, `padded_numel`):

    dp   ZeRO 0: all-reduce 4Ψ (FSDP's hybrid mode over a shard group of one: no padding, no gather)
         ZeRO 1: all-gather cΨ' + reduce-scatter 4Ψ'                        (once a step)
         ZeRO 2: m x (all-gather cΨ' + reduce-scatter 4Ψ')                  (every micro-batch)
         ZeRO 3: m x (all-gather c(2Ψ'_units + Ψ'_rest) + reduce-scatter 4Ψ')
                 (each unit gathered in its forward and again in its backward; the stage's own FSDP group, the
                 root, keeps its parameters from forward to backward, as FSDP2 does for its root)
    tp   m x b x every TP collective of the rank's units (their forward ones twice under full recomputation);
         with pp > 1, per chunk also the all-gather of the boundary it receives (forward) and of the gradient of
         the one it sends (backward): Megatron-LM's scatter/gather
    pp   m x b x per chunk: the boundary received and sent forward, the gradients sent and received backward (a
         tensor that needs no gradient, say an integer mask, crosses only forward), each 1/t of it with tp = t
         (scatter/gather); plus the fp32 gradient of a weight shared by pipeline ranks (a tied embedding and
         head), all-reduced over them once a step
"""

from __future__ import annotations

import math
from typing import Iterable, NamedTuple

from partc.parallel import Parallel
from partc.precision import compute_bytes

MASTER_BYTES = 4
"""fp32 master weights, gradients and each Adam moment (`partc.precision.MASTER_DTYPE`)."""
ADAM_BYTES = 8
"""Adam's two fp32 moments per parameter."""


def model_state_bytes(num_params: float, par: Parallel, shards: int | None = None,
                      padded: float | None = None) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes per GPU for `num_params` parameters (module docstring's table),
    sharded over `shards` ranks (``dp_shard`` unless given: the packed experts' ``dp / ep`` x ``cp``). `padded`:
    their elements as FSDP allocates them over those ranks (`padded_numel`; `num_params` unless given). FSDP2
    (``FSDPParam._init_sharding_spec``) cuts dim 0 as ``torch.chunk`` does, ceil(rows / N) rows a rank, and gives
    every rank the first rank's, zero-padded: the sharded fp32 weight, the reduce-scattered gradient shard (a view
    of the padded output) and the optimizer's states (the first rank's shard is whole: the most any rank holds)
    are Ψ'/N of each parameter, and the gathered compute copy of ZeRO 1 and 2 is the padded all-gather output, Ψ'.
    The fp32 accumulation below ZeRO-2 is the unsharded parameter's own gradient (Ψ, unpadded); ZeRO-0 shards over
    a group of one (no padding)."""
    psi, n, c = float(num_params), shards or par.dp_shard, compute_bytes(par.precision)
    if par.zero == 0:
        return psi * (MASTER_BYTES + c), psi * MASTER_BYTES, psi * ADAM_BYTES
    whole = psi if padded is None else float(padded)  # Ψ': the padded tensors, gathered
    shard = whole / n  # Ψ'/N: every rank's padded shard
    if par.zero == 1:
        return shard * MASTER_BYTES + whole * c, psi * MASTER_BYTES, shard * ADAM_BYTES
    if par.zero == 2:
        return shard * MASTER_BYTES + whole * c, shard * MASTER_BYTES, shard * ADAM_BYTES
    return shard * MASTER_BYTES, shard * MASTER_BYTES, shard * ADAM_BYTES


class ExpertGroups(NamedTuple):
    """A unit's packed experts in FSDP groups of their own (ep under ZeRO 1-3, `partc.runtime.parallelize.
    shard_experts`: one group per module holding them, sharded over ``dp / ep`` x ``cp`` ranks), on one GPU."""

    held: float = 0.0
    """Their parameters (this rank's E/ep experts, in every group of the unit)."""
    padded: float = 0.0
    """Their elements as FSDP pads them over the ranks sharding them (`padded_numel`): what it gathers."""
    largest: float = 0.0
    """Parameters of the largest group."""
    largest_padded: float = 0.0
    """Padded elements of the largest group: what its reduce-scatter's input holds."""


def working_bytes(par: Parallel, unit_params: Iterable[float], *, last: bool = True,
                  padded: Iterable[float] | None = None, experts: Iterable[ExpertGroups] | None = None) -> float:
    """Transient memory of ZeRO on top of the model states, by the sizes (parameters on this GPU) of the FSDP units
    the rank runs: ZeRO-3 gathers two units at a time (the current and the prefetched one) and reduces one unit's
    gradient (compute-dtype, then fp32 for the reduce-scatter); ZeRO 2 reduces one unit's gradient each
    micro-batch; ZeRO 0 and 1 fold one unit's compute-dtype gradient into the fp32 accumulation each micro-batch
    (in place: FSDP's ``unsharded_accumulated_grad += grad``), and in the last micro-batch's backward copy a unit's
    accumulation into the fp32 input of its reduction (the larger of the two: measured by ``partc check``, 2 bytes a
    parameter of the largest unit more than the bf16 gradient alone, on the last stage of the 1T GPT at tp 8, where
    one block is 1G parameters). `last` False: below ZeRO-2, a micro-batch's backward before the last (the fold
    only). `padded`: each unit's elements as FSDP pads them (`padded_numel`, `unit_params` unless given; the
    packed experts of `experts` in it unpadded): under ZeRO 1-3 the gathered copy (the all-gather's output) and the
    reduction's fp32 input are padded tensors, the compute-dtype gradient and the accumulation are the unsharded
    parameters' own (unpadded). ZeRO-3 reshards a unit before it reduces it (FSDP2's ``post_backward``), so there
    the reduction's input is charged unpadded beside the two padded gathered units: on a 2-layer Mixtral of 4
    experts at dp 8 (the experts padded to 8 rows) ``partc check`` measured the plan's activations within 4% so,
    and 18% fewer with the input padded too; ZeRO-2 within 6% with it padded, where it measured 34% more than the
    plan unpadded (ZeRO-1: 22% more, and 51%).

    `experts` (per unit, as `unit_params`, whose counts include them): the packed experts in FSDP groups of their
    own. FSDP does not prefetch them (the unit gathers them as its forward and its backward begin), and each
    group's post-backward runs when the unit's backward is done, before the unit's own group's: it releases the
    gathered experts (ZeRO-3) and copies their gradients into the fp32 input of their reduce-scatter, whose output
    (1/n of it, n the ranks sharding them) is as large as a unit's gradient where n is small (``dp / ep``). So a
    unit with experts holds its gradients in the compute dtype beside the gathered experts (ZeRO-3, padded over
    their n ranks); the reduction of its largest group of experts (fp32 input and output) beside the compute-dtype
    gradients of the rest of the unit is a moment of its own (`reduction_bytes`). Priced as part of the unit's
    group, the gathered experts counted twice under ZeRO-3 and their reduction's output not at all
    (docs/expert-parallel.md, "Large experts")."""
    c = compute_bytes(par.precision)
    sizes, groups, own, own_padded = _own_groups(par, unit_params, padded, experts)
    fp32 = MASTER_BYTES if c != MASTER_BYTES else 0  # the reduction's fp32 input, beside a compute-dtype gradient
    if par.zero == 3:  # two padded units gathered, one unit's compute-dtype gradient and (unpadded) fp32 input
        gathered = [c * (g.padded + s) if g.held else 0.0 for s, g in zip(sizes, groups)]  # experts and gradients
        return c * sum(sorted(own_padded, reverse=True)[:2]) + max(
            max((c + fp32) * a, x) for a, x in zip(own, gathered))
    if par.zero == 2:  # one unit's compute-dtype gradient and the padded fp32 input of its reduce-scatter
        return max(max(c * a + fp32 * q, c * s) for a, q, s in zip(own, own_padded, sizes))
    if not last:
        return c * max(sizes)
    return max(max(MASTER_BYTES * q, c * s) for q, s in zip(own_padded, sizes))  # the fp32 input, or the fold


def reduction_bytes(par: Parallel, unit_params: Iterable[float], experts: Iterable[ExpertGroups] | None,
                    padded: Iterable[float] | None = None) -> float:
    """The transient memory of ZeRO while the largest group of packed experts (`ExpertGroups`) is reduced, a moment
    of its own: its fp32 gradient copied into the reduce-scatter's input, then the output (1/n of it; FSDP frees
    the gradients as it copies them, but its loop over them, ``foreach_reduce``, holds the group's last one until
    it returns, and the output stays working memory beside it). From ZeRO-2 on, each micro-batch's: when the
    backward of the unit reading them is done (its recomputed activations and its gradients inside freed), beside
    the compute-dtype gradients of the rest of the unit and under ZeRO-3 the two units gathered (padded, as
    `working_bytes`'s `padded`); the caller adds the activations in flight. Below ZeRO-2, the step's one reduction
    after the last micro-batch's backward (torch's pipeline schedule reduces every FSDP group then), when nothing
    else transient is held. 0 without such groups."""
    c = compute_bytes(par.precision)
    sizes, groups, _, own_padded = _own_groups(par, unit_params, padded, experts)
    out = MASTER_BYTES * (1 + 1 / max(1, par.expert_shard))  # per padded element: the input and the output
    moments = [out * g.largest_padded + (c * (s - g.largest) if par.zero >= 2 else 0.0)
               for s, g in zip(sizes, groups) if g.held]
    if par.zero == 0 or not moments:
        return 0.0
    return (c * sum(sorted(own_padded, reverse=True)[:2]) if par.zero == 3 else 0.0) + max(moments)


def _own_groups(par: Parallel, unit_params: Iterable[float], padded: Iterable[float] | None,
                experts: Iterable[ExpertGroups] | None
                ) -> tuple[list[float], list[ExpertGroups], list[float], list[float]]:
    """(each unit's parameters, its `ExpertGroups`, its own group's parameters and padded elements)."""
    sizes = [float(n) for n in unit_params] or [0.0]
    pads = sizes if padded is None or par.zero == 0 else [float(n) for n in padded] or [0.0]
    assert len(pads) == len(sizes), (len(pads), len(sizes))
    groups = list(experts) if experts is not None else []
    groups += [ExpertGroups()] * (len(sizes) - len(groups))
    return (sizes, groups, [s - g.held for s, g in zip(sizes, groups)],
            [q - g.held for q, g in zip(pads, groups)])


def padded_numel(shape: tuple[int, ...], n: int) -> int:
    """Elements FSDP allocates for a parameter sharded over `n` ranks: dim 0 padded to a multiple of `n`."""
    if not shape:
        return n
    rows = -(-shape[0] // n) * n
    return rows * math.prod(shape[1:])


def dp_bytes(par: Parallel, numel: float, unit_padded: float, rest_padded: float,
             shards: int | None = None) -> dict[str, float]:
    """Collective -> bytes one GPU passes over dp in a step: `numel` parameters on the GPU, `unit_padded` of them
    (padded) in FSDP units of their own and `rest_padded` in the stage's root group (module docstring), sharded
    over `shards` ranks (``dp_shard`` unless given: the packed experts' ``dp / ep`` x ``cp``)."""
    if (shards or par.dp_shard) == 1:
        return {}
    c, m = compute_bytes(par.precision), par.num_microbatches
    padded = unit_padded + rest_padded
    if par.zero == 0:
        return {"all_reduce": MASTER_BYTES * numel}
    if par.zero == 1:
        return {"all_gather": c * padded, "reduce_scatter": MASTER_BYTES * padded}
    if par.zero == 2:
        return {"all_gather": m * c * padded, "reduce_scatter": m * MASTER_BYTES * padded}
    return {"all_gather": m * c * (2 * unit_padded + rest_padded), "reduce_scatter": m * MASTER_BYTES * padded}


def dp_calls(par: Parallel, groups: int) -> dict[str, int]:
    """Collective -> calls per step over dp, for `groups` FSDP groups (each gathers and reduces as one call)."""
    if par.dp_shard == 1:
        return {}
    m = par.num_microbatches
    if par.zero == 0:
        return {"all_reduce": groups}
    if par.zero == 1:
        return {"all_gather": groups, "reduce_scatter": groups}
    return {"all_gather": m * groups * (2 if par.zero == 3 else 1), "reduce_scatter": m * groups}
