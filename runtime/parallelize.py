"""Data parallelism, ZeRO, shared weights and the optimizer, applied to this rank's stage modules.

The order is torchtitan's, one step a line in `parallelize`:

1. tensor parallelism: already in the program (the stage files hold local shards and call `collectives`). A
   parameter split over tp gets the gradient of its shard; one kept whole gets the same gradient on every tp rank
   (its inputs are whole, and each whole-to-split step in the program, `copy_to_tp` or `scatter_to_tp`,
   all-reduces or all-gathers the gradient coming back), so nothing is reduced over tp here, and DP and ZeRO
   below work on the local shards over the ``dp`` axis only;
2. activation checkpointing: ``recompute == "full"`` recomputes each stage's forward in backward (the stage
   file is one function, so "full" keeps only the stage inputs per micro-batch); ``selective`` is in the program
   (codegen wraps the attention core in ``torch.utils.checkpoint``);
3. compile: not applied;
4. data parallelism over the mesh's ``dp`` axis, by ZeRO stage:

   ===== ======================================================== ==========================================
   ZeRO  what is sharded over dp                                  how
   ===== ======================================================== ==========================================
   0     nothing                                                  gradients all-reduced (averaged) after the
                                                                  pipeline step (`GradSync`)
   1     optimizer states                                         the same all-reduce, then
                                                                  ``ZeroRedundancyOptimizer`` over dp
   2     + gradients                                              FSDP2 ``fully_shard(reshard_after_forward
                                                                  =False)``: reduce-scatter, no re-gather for
                                                                  backward (parameters are sharded between
                                                                  steps too: FSDP2 has no ZeRO-2 proper)
   3     + parameters                                             FSDP2 ``fully_shard(reshard_after_forward
                                                                  =True)``
   ===== ======================================================== ==========================================

   FSDP wraps each stage module as one unit: the stage file is one straight-line function, so there are no
   per-block module calls for FSDP's hooks to gather around. For the same reason a rank allocates and
   initializes its whole stage before sharding it: FSDP gathers the whole stage at every forward and backward
   anyway, so this does not raise the peak.

Shared weights (a tied embedding and LM head on different stages, Megatron's "embedding all-reduce"): after the
pipeline step the copies' gradients are summed over a process group of the pipeline ranks holding a copy (one
group per dp and tp coordinate: both layers split a tied weight alike, so the tp ranks' shards match); copies on
one rank (interleaved stages) are summed locally first. The copies start equal and get equal gradients and equal
updates, so they stay equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from partc.errors import PartcError
from partc.runtime.mesh import World
from partc.runtime.stage import StageModule

OPTIMIZERS = ("adamw", "sgd")


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    name: str = "adamw"
    """``adamw`` (torch.optim.AdamW) or ``sgd`` (torch.optim.SGD, no momentum)."""
    lr: float = 3e-4
    """Learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise PartcError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
        if self.lr < 0 or self.weight_decay < 0:
            raise PartcError("--lr and --weight-decay must be >= 0")

    def optimizer_class(self) -> tuple[type[torch.optim.Optimizer], dict]:
        if self.name == "sgd":
            return torch.optim.SGD, {"lr": self.lr, "weight_decay": self.weight_decay}
        return torch.optim.AdamW, {"lr": self.lr, "weight_decay": self.weight_decay}


def parallelize(stages: list[StageModule], world: World, *, zero: int, recompute: str) -> list[nn.Module]:
    """Apply recomputation and ZeRO to each stage module (in place); returns the modules to hand to the
    pipeline (FSDP turns a module into an ``FSDPModule`` of the same object)."""
    for st in stages:
        # 1. tensor parallelism: in the stage files.
        # 2. activation checkpointing
        if recompute == "full":
            st.recompute = True
        # 3. compile: none.
        # 4. data parallelism / ZeRO over dp
        if zero >= 2 and world.par.dp > 1:
            fully_shard(st, mesh=world.mesh["dp"], reshard_after_forward=zero == 3)
    return list(stages)


def build_optimizers(stages: list[nn.Module], world: World, config: OptimizerConfig,
                     zero: int) -> list[torch.optim.Optimizer]:
    """One optimizer per stage module (torchtitan's per-model-part optimizers): its state dict is keyed by that
    module's FQNs. ZeRO-1 wraps it in ``ZeroRedundancyOptimizer`` over the dp group."""
    cls, kwargs = config.optimizer_class()
    out = []
    for st in stages:
        params = [p for p in st.parameters() if p.requires_grad]
        if zero == 1 and world.par.dp > 1:
            out.append(ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=world.dp_group,
                                               **kwargs))
        else:
            out.append(cls(params, **kwargs))
    return out


def local_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's states (the partition's for ZeRO-1)."""
    return opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt


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
    """Everything that happens to gradients between the pipeline step and the optimizer step."""

    def __init__(self, stages: list[StageModule], world: World, *, zero: int,
                 holders: dict[str, list[int]], canon: dict[str, str]):
        """`holders`: canonical FQN -> indices of the stages (all of them, not only local) holding a copy."""
        self.stages = stages
        self.world = world
        self.all_reduce_dp = zero <= 1 and world.par.dp > 1
        self.shared: list[SharedGroup] = []
        pp = world.par.pp
        by_ranks: dict[tuple[int, ...], list[str]] = {}
        for name, idx in sorted(holders.items()):
            if len(idx) > 1:
                by_ranks.setdefault(tuple(sorted({i % pp for i in idx})), []).append(name)
        for ranks, names in sorted(by_ranks.items()):
            sg = SharedGroup(names=names)
            if len(ranks) > 1:  # every rank creates every group, in the same order (new_group is collective)
                for dp_r in range(world.par.dp):
                    for tp_r in range(world.par.tp):
                        members = [world.par.rank_of(pp=r, dp=dp_r, tp=tp_r) for r in ranks]
                        group = dist.new_group(members)
                        if world.rank in members:
                            sg.group = group
            if world.pp_rank in ranks:
                for name in names:
                    sg.copies[name] = [loc for st in stages for loc in _locations(st, name, canon)]
                self.shared.append(sg)

    @torch.no_grad()
    def __call__(self) -> None:
        if self.all_reduce_dp:
            _all_reduce([p.grad for st in self.stages for p in st.parameters() if p.grad is not None],
                        self.world.dp_group, average=True)
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
                    if dst.data_ptr() != g.data_ptr():
                        dst.copy_(g)


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

