"""Data parallelism, ZeRO, mixed precision and recomputation, applied to this rank's stage modules.

The order is torchtitan's, one ``apply_*`` a dimension in `parallelize`:

1. tensor parallelism: already in the program (the stage files hold local shards and call `partc.collectives`). A
   parameter split over tp gets the gradient of its shard; one kept whole gets the same gradient on every tp rank
   (its inputs are whole, and each whole-to-split step in the program, `copy_to_tp` or `scatter_to_tp`,
   all-reduces or all-gathers the gradient coming back), so nothing is reduced over tp here, and DP and ZeRO
   below work on the local shards over the ``dp`` axis only;
2. `apply_recompute`: ``full`` recomputes each block unit in its backward (each `UnitModule` under
   ``torch.utils.checkpoint``: only the block's inputs are kept per micro-batch); ``selective`` is in the program
   (codegen wraps the attention core in ``torch.utils.checkpoint``);
3. compile: not applied;
4. `apply_zero`: FSDP2 ``fully_shard`` on every unit of the stage and on the stage itself, with mixed precision
   (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` for ``bf16``: the sharded parameters are the fp32
   master weights, the gathered ones the bf16 compute copy, gradients are accumulated and reduced in fp32;
   `partc.precision`). Every ZeRO stage is one policy of the same machinery:

   ===== ============================================ =================================================
   ZeRO  sharded over dp                              parameters gathered / gradients reduced
   ===== ============================================ =================================================
   0     nothing (FSDP's hybrid mode: replicated      once a step / all-reduced once, after the last
         over dp, a shard group of one)                micro-batch (accumulated unsharded in fp32)
   1     optimizer states and master weights          once a step / reduce-scattered once, after the last
                                                      micro-batch (accumulated unsharded in fp32)
   2     + gradients                                  in every micro-batch's forward, kept for its
                                                      backward / reduce-scattered every micro-batch
   3     + parameters                                 in every micro-batch's forward and again in its
                                                      backward / reduce-scattered every micro-batch
   ===== ============================================ =================================================

   ZeRO 0 and 1 keep torch.distributed.pipelining's own handling of FSDP (no gradient sync until the last
   backward, then one reduction; torchtitan's). ZeRO 2 and 3 hand the pipeline a thin wrapper (`SyncEveryStep`), so
   FSDP's own hooks reduce-scatter every micro-batch's gradients, and release the gathered parameters after each
   micro-batch's backward (FSDP2 gives wrong gradients when it keeps them gathered across micro-batches while
   reducing each one: measured on torch 2.13). Gathered parameters are released after the step (`reshard`): the
   optimizer updates the sharded fp32 weights, and the next step gathers them again.

The cost model (`partc.passes.cost`) charges exactly these bytes and gathers (`partc.precision` has the table).

Shared weights (a tied embedding and LM head on different stages, Megatron's "embedding all-reduce"): after the
pipeline step the copies' gradients are summed over a process group of the pipeline ranks holding a copy (one
group per coordinate on the other mesh axes, `pipeline_group`: both layers split a tied weight alike over tp, and
FSDP shards it alike over dp, so the shards match); copies on one rank (interleaved stages) are summed locally
first. The copies start equal and get equal gradients and equal updates, so they stay equal.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from partc._torch import fsdp_post_backward, storage_key
from partc.mesh_axes import MESH_AXES
from partc.parallel import Parallel
from partc.precision import MASTER_DTYPE, compute_dtype
from partc.runtime.mesh import World
from partc.runtime.stage import StageModule

def parallelize(stages: list[StageModule], world: World, par: Parallel, blocks: set[str],
                experts: frozenset[str] = frozenset()) -> list[nn.Module]:
    """torchtitan's ``parallelize_llama`` for this rank's stage modules: one ``apply_*`` a dimension, in its order
    (module docstring), each given only what it reads. Returns the modules to hand to the pipeline. `blocks`: the
    units that are repeated blocks (recomputed under ``full``); `experts`: the packed expert parameters this rank
    holds E/ep experts of (expert parallelism)."""
    modules = []
    for stage in stages:
        # 1. tensor and expert parallelism: in the stage files (they hold local shards and experts and call
        #    `partc.collectives`).
        apply_recompute(stage, par.recompute, blocks)  # 2.
        # 3. compile: not applied.
        if par.zero > 0 and par.expert_shard > 1 and experts:  # 4. ZeRO of the packed experts over the ranks
            # holding the same ones, dp / ep x cp (none to shard over when dp is ep without cp: each rank keeps its
            # experts whole)
            shard_experts(stage, world.expert_mesh, zero=par.zero, precision=par.precision, experts=experts)
        modules.append(apply_zero(stage, world.zero_mesh, zero=par.zero, precision=par.precision,  # 4.
                                  ignored={p for n, p in stage.named_parameters()
                                           if n in experts and not isinstance(p, DTensor)}))
    return modules


def apply_recompute(stage: StageModule, mode: str, blocks: set[str]) -> None:
    """``full`` recomputation: each block unit keeps only its inputs and runs its forward again in backward
    (``selective`` is in the stage files)."""
    for fqn, unit in stage.units.items():
        unit.recompute = mode == "full" and fqn in blocks


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP's policy for the plan's precision: bf16 compute copies gathered from fp32 master weights, gradients
    reduced in fp32 (`partc.precision`); for ``fp32`` FSDP's default (everything fp32). Inputs keep their dtype: an
    fp32 tensor the trace passes between units (one the model made in fp32, or an activation it promoted) stays
    fp32, as the program and the plan have it; the runner casts the model's own floating-point inputs to the
    compute dtype."""
    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype(precision), reduce_dtype=MASTER_DTYPE,
                                cast_forward_inputs=False)


def shard_experts(stage: StageModule, mesh: DeviceMesh, *, zero: int, precision: str,
                  experts: frozenset[str]) -> None:
    """FSDP2 on each module holding packed experts, over `mesh` (`World.expert_mesh`: the ``dp / ep`` x ``cp``
    ranks holding the same experts), under ZeRO stage `zero`: their fp32 weights, gradients and optimizer states
    are sharded over that group as the other parameters are over ``dp`` x ``cp`` (torchtitan's
    ``dp_shard_mod_ep``). Before `apply_zero`, which then leaves them to these groups.

    The stage code reads the experts' tensors without calling their module, so the unit holding them does what
    FSDP does around a module it calls: it gathers them before its forward (`FSDPModule.unshard`), and runs their
    group's post-backward when its own backward is done (`_PostBackward`), as the unit's own group does: ZeRO 2 and 3
    reduce-scatter their gradients and ZeRO-3 releases them there, ZeRO 0 and 1 add the compute-dtype gradient to
    the fp32 one. Left to FSDP's end-of-backward callback (which still runs it where no input of the unit needs a
    gradient), every unit's gathered experts and their compute-dtype gradients stayed to the end of the stage's
    backward (measured by `partc check` under ZeRO-3; docs/expert-parallel.md, "Large experts").
    Each rank's expert gradient sums the tokens of its ep group: FSDP averages it over
    the ``dp / ep`` x ``cp`` holders, and `GradSync` divides it by ``ep`` (``dp`` x ``cp`` in all, as FSDP's average
    of the others: the mean loss's gradient; a divide factor of FSDP's own would need PREMUL_SUM, which gloo
    lacks)."""
    owners: dict[str, nn.Module] = {}
    for name, _ in stage.named_parameters():
        if name in experts:
            owners.setdefault(name.rsplit(".", 1)[0], stage.get_submodule(name.rsplit(".", 1)[0]))
    for path, owner in owners.items():
        assert all(f"{path}.{n}" in experts for n, _ in owner.named_parameters()), path
        fully_shard(owner, mesh=mesh, mp_policy=mixed_precision(precision), reshard_after_forward=zero == 3)
        unit = next((u for fqn, u in stage.units.items() if path.startswith(fqn + ".")), stage)
        unit.register_forward_pre_hook(partial(_gather_for_forward, owner=owner))
        unit.register_forward_hook(partial(_regather_in_backward, owner=owner, reshard=zero == 3))


def _gather_for_forward(module: nn.Module, inputs: tuple, *, owner: FSDPModule) -> tuple:
    """Before the forward of a unit holding packed experts: gather them, and pass the unit's inputs that need a
    gradient through `_PostBackward`, so that the experts' post-backward runs once the unit's backward has given
    their gradients (FSDP's ``RegisterPostBackwardFunction`` for the modules it calls)."""
    owner.unshard()
    if not torch.is_grad_enabled():
        return inputs
    at = [i for i, t in enumerate(inputs) if isinstance(t, Tensor) and t.requires_grad]
    if not at:
        return inputs
    out = list(inputs)
    for i, t in zip(at, _PostBackward.apply(owner, *(inputs[i] for i in at))):
        out[i] = t
    return tuple(out)


class _PostBackward(torch.autograd.Function):
    """The identity on a unit's inputs; its backward, reached when the unit's backward is done, runs the FSDP
    post-backward of the packed experts the unit read (`fsdp_post_backward`)."""

    @staticmethod
    def forward(ctx, owner: FSDPModule, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.owner = owner
        return inputs

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple:
        fsdp_post_backward(ctx.owner)
        return (None, *grads)


def _regather_in_backward(module: nn.Module, inputs: tuple, outputs: tuple, *, owner: FSDPModule,
                          reshard: bool) -> None:
    """After the forward of a unit holding packed experts: under ZeRO-3 release them (FSDP's
    ``reshard_after_forward``), and gather them again when the unit's backward begins (the gradient of any of its
    outputs arrives), as FSDP's pre-backward does for a module it calls; a no-op where they are still gathered."""
    if not torch.is_grad_enabled():
        return
    if reshard:
        owner.reshard()
    for t in outputs if isinstance(outputs, tuple) else (outputs,):
        if isinstance(t, Tensor) and t.requires_grad:
            t.register_hook(lambda grad: owner.unshard())


def apply_zero(stage: StageModule, mesh: DeviceMesh, *, zero: int, precision: str,
               ignored: set[nn.Parameter] | None = None) -> nn.Module:
    """FSDP2 on each unit and on the stage over `mesh` (`World.zero_mesh`), under ZeRO stage `zero` and the plan's
    `precision` (module docstring). `ignored`: parameters FSDP leaves alone (packed experts under ep: each rank
    holds its own experts, their gradients reduced by `GradSync` over the ranks holding the same ones)."""
    mp = mixed_precision(precision)
    # A parameter shared by two units (a tied embedding and head on one stage) can be in one FSDP group only: those
    # units stay in the stage's root group (as `partc.passes.memory.fsdp_groups` charges).
    # So can a unit whose tensors other code of the stage reads (`StageFile.foreign_reads`).
    holders = Counter(id(p) for unit in stage.units.values() for p in unit.parameters())
    foreign = stage.foreign_reads
    units = [unit for fqn, unit in stage.units.items()
             if all(holders[id(p)] == 1 for p in unit.parameters())
             and not any(name.startswith(fqn + ".") for name in foreign)]
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=zero == 3, ignored_params=ignored)
    fully_shard(stage, mesh=mesh, mp_policy=mp, reshard_after_forward=zero == 3, ignored_params=ignored)
    # In backward each unit prefetches the one before it (FSDP2's default picks the module that ran forward before
    # it, which across micro-batches in flight is the previous micro-batch's last unit: an extra gather). The first
    # unit names itself, a no-op, so that no default prefetch crosses into another micro-batch.
    for i, unit in enumerate(units):
        unit.set_modules_to_backward_prefetch([units[i - 1] if i else unit])
    return SyncEveryStep(stage) if zero >= 2 else stage


class SyncEveryStep(nn.Module):
    """The FSDP stage as the pipeline sees it under ZeRO 2 and 3: not an ``FSDPModule``, so
    torch.distributed.pipelining does not defer gradient reduction to the last micro-batch, and FSDP's own hooks
    reduce-scatter after every micro-batch's backward."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        return self.stage(*inputs)


def reshard(modules: list[nn.Module]) -> None:
    """Release every gathered parameter (after the step: the optimizer updated the sharded ones)."""
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()


@dataclass(kw_only=True, slots=True)
class SharedGroup:
    """The local copies of shared weights held by one set of pipeline ranks, and the group to sum over."""

    names: list[str]
    """Canonical FQNs, in a fixed order (the same on every rank of the group)."""
    copies: dict[str, list[tuple[nn.Module, str]]] = field(default_factory=dict)
    """Canonical FQN -> (module, attribute) of each local copy (one per local stage holding it)."""
    group: dist.ProcessGroup | None = None
    """None when every copy is on this rank."""


class GradSync:
    """What happens to gradients between the pipeline step and the optimizer step, besides FSDP's reduction over
    dp: the copies of shared weights summed over the pipeline ranks holding them."""

    def __init__(self, stages: list[StageModule], world: World, *, holders: dict[str, list[int]],
                 canon: dict[str, str], experts: frozenset[str] = frozenset()):
        """`holders`: canonical FQN -> indices of the stages (all of them, not only local) holding a copy;
        `experts`: the packed expert parameters under ep."""
        self.stages = stages
        self.world = world
        self.experts = [p for st in stages for n, p in st.named_parameters()
                        if n in experts and not isinstance(p, DTensor)]
        """This rank's packed expert parameters (ep): each holds the gradient of its experts from every token of
        its ep group; summed over the ranks holding the same experts (``dp / ep`` x ``cp``) and divided by ``dp`` x
        ``cp``, it is the gradient of the mean loss, as FSDP's average over ``dp`` x ``cp`` gives the others. (Under
        ZeRO 1-3 FSDP reduces them instead, `shard_experts`.)"""
        self.sharded_experts = [p for st in stages for n, p in st.named_parameters()
                                if n in experts and isinstance(p, DTensor)]
        """The packed experts FSDP shards over the ranks holding them (ZeRO 1-3): FSDP averages their
        gradients over those ranks; divided by ``ep`` here, they are the mean loss's gradient."""
        self.groups: list[dist.ProcessGroup] = []
        """Every group this rank sums shared weights over (the comm counter counts them as ``pp``)."""
        self.shared: list[SharedGroup] = []
        pp = world.par.pp
        by_ranks: dict[tuple[int, ...], list[str]] = {}
        for name, idx in sorted(holders.items()):
            if len(idx) > 1:
                by_ranks.setdefault(tuple(sorted({i % pp for i in idx})), []).append(name)
        for ranks, names in sorted(by_ranks.items()):
            sg = SharedGroup(names=names)
            if len(ranks) > 1:  # every rank creates every group (`pipeline_group`)
                sg.group = pipeline_group(world, ranks)
                if sg.group is not None:
                    self.groups.append(sg.group)
            if world.pp_rank in ranks:
                for name in names:
                    sg.copies[name] = [loc for st in stages for loc in _locations(st, name, canon)]
                self.shared.append(sg)

    @torch.no_grad()
    def __call__(self) -> None:
        grads = [p.grad for p in self.experts if p.grad is not None]
        if grads:
            if dist.get_world_size(self.world.expert_dp_group) > 1:
                _all_reduce(grads, self.world.expert_dp_group, average=False)
            for g in grads:
                g.div_(self.world.par.dp_shard)
        for p in self.sharded_experts:
            if p.grad is not None:
                _local(p.grad).div_(self.world.par.ep)
        for sg in self.shared:
            grads = []
            for name in sg.names:
                copies = [getattr(m, attr) for m, attr in sg.copies[name]]
                for c in copies:
                    if c.grad is None:  # a stage that holds the weight but did not use it in this step
                        c.grad = torch.zeros_like(c)
                total = _local(copies[0].grad)
                for c in copies[1:]:
                    total.add_(_local(c.grad))
                grads.append(total)
            if sg.group is not None:
                _all_reduce(grads, sg.group, average=False)
            for name, g in zip(sg.names, grads):
                for m, attr in sg.copies[name]:
                    dst = _local(getattr(m, attr).grad)
                    if (storage_key(dst), dst.storage_offset()) != (storage_key(g), g.storage_offset()):
                        dst.copy_(g)


def pipeline_group(world: World, pp_ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
    """This rank's group of the pipeline ranks `pp_ranks` at its own coordinates on the other mesh axes (None when
    its pipeline rank is not one of them). Every rank creates every such group (one per coordinate of the other
    axes), in the same order: ``new_group`` is collective."""
    others = [axis for axis in MESH_AXES if axis != "pp"]
    mine = None
    for point in itertools.product(*(range(getattr(world.par, axis)) for axis in others)):
        members = [world.par.rank_of(pp=r, **dict(zip(others, point))) for r in pp_ranks]
        group = dist.new_group(members)
        if world.rank in members:
            mine = group
    return mine


def _locations(st: nn.Module, canonical: str, canon: dict[str, str]) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of the copy of `canonical` in stage module `st` (at most one: ties inside a stage
    are one Parameter)."""
    for name, p in st.named_parameters():
        if canon.get(name, name) == canonical:
            *path, attr = name.split(".")
            return [(st.get_submodule(".".join(path)), attr)]
    return []


def _local(t: Tensor) -> Tensor:
    assert t is not None, "a shared weight has no gradient"
    return t.to_local() if isinstance(t, DTensor) else t


BUCKET_BYTES = 64 * 2**20
"""Gradients are all-reduced through flat buckets of about this size (DDP's default is 25 MB)."""


def _all_reduce(tensors: list[Tensor], group: dist.ProcessGroup, *, average: bool) -> None:
    """All-reduce `tensors` in place through flat buckets (one collective per bucket, not one per tensor)."""
    size = dist.get_world_size(group)
    buckets: list[list[Tensor]] = []
    filled: dict[torch.dtype, tuple[list[Tensor], int]] = {}
    for t in (_local(t) for t in tensors):
        bucket, nbytes = filled.get(t.dtype, ([], 0))
        if not bucket:
            buckets.append(bucket)
        bucket.append(t)
        nbytes += t.numel() * t.element_size()
        filled[t.dtype] = ([], 0) if nbytes >= BUCKET_BYTES else (bucket, nbytes)
    for ts in buckets:
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.all_reduce(flat, group=group)
        if average:
            flat.div_(size)
        offset = 0
        for t in ts:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

