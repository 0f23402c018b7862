"""Process group and device mesh: ``(pp, dp, tp)`` over the torchrun world.

torchtitan's `ParallelDims`: the degrees must multiply to the world size, and the mesh names its axes so every
later step asks for ``mesh["dp"]`` rather than computing rank arithmetic. The axis order puts ``tp`` innermost
(neighbouring ranks, the same node: the most traffic), then ``dp``, then ``pp`` outermost (point-to-point only):

    global rank = (pp_rank * dp + dp_rank) * tp + tp_rank

The stage files find the ``tp`` group through `partc.collectives.set_tp_group`, which `partc.runtime.load`
calls with ``world.tp_group`` before any stage runs (on meta or for real).

Checkpoints see a tensor-parallel shard further sharded by FSDP over dp as a DTensor on `World.tp_dp_mesh`: the
same ranks as ``mesh["dp", "tp"]`` with the axes in the other order, so that two ``Shard(0)`` placements nest the
way they do here (the tp split first, FSDP's split of that part second).

Device: CUDA (backend NCCL, one GPU per local rank) when available, else CPU (backend gloo). Nothing below
names a device type; it is chosen once here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from partc.errors import PartcError
from partc.parallel import Parallel


@dataclass(kw_only=True, slots=True)
class ParallelDims:
    pp: int
    """Pipeline ranks (mesh axis ``pp``)."""
    dp: int
    """Data-parallel replicas (mesh axis ``dp``); ZeRO shards over this axis."""
    tp: int
    """Tensor-parallel ranks (mesh axis ``tp``); the stage files call collectives over it."""
    world_size: int
    """Processes started by torchrun."""

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp"):
            if getattr(self, name) < 1:
                raise PartcError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.pp * self.dp * self.tp != self.world_size:
            raise PartcError(f"the plan needs dp x tp x pp = {self.dp} x {self.tp} x {self.pp} = "
                             f"{self.pp * self.dp * self.tp} processes, but {self.world_size} were started; run "
                             f"`partc run OUT` or torchrun --nproc-per-node {self.pp * self.dp * self.tp}")

    @classmethod
    def from_plan(cls, par: Parallel, world_size: int) -> ParallelDims:
        return cls(pp=par.pp, dp=par.dp, tp=par.tp, world_size=world_size)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank


@dataclass(kw_only=True, slots=True)
class World:
    """This process's place in the run."""

    dims: ParallelDims
    mesh: DeviceMesh
    device: torch.device
    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    """One process group per mesh axis: ``pp``, ``dp``, ``tp``."""
    tp_dp_mesh: DeviceMesh | None = None
    """This pipeline rank's ``(tp, dp)`` mesh (the groups of ``mesh``, tp outer), for checkpoint DTensors."""

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.groups["pp"]

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.groups["dp"]

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.groups["tp"]


def pick_device() -> tuple[torch.device, str]:
    """(device of this process, process-group backend): a CUDA GPU per local rank with NCCL, else CPU with gloo."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise PartcError(f"local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()}; "
                             f"start at most {torch.cuda.device_count()} processes per node")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def init_world(par: Parallel, *, timeout_s: float = 600.0) -> World:
    """Join the torchrun process group (if not joined yet) and build the ``(pp, dp, tp)`` mesh."""
    if not dist.is_initialized() and "RANK" not in os.environ:
        raise PartcError("partc.runtime runs under torchrun: `partc run OUT` or "
                         "`torchrun --nproc-per-node N -m partc.runtime OUT`")
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    dims = ParallelDims.from_plan(par, world_size)  # raises before any collective if the world size is wrong
    device, backend = pick_device()
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=("pp", "dp", "tp"))
    rank = dist.get_rank()
    pp_rank, dp_rank, tp_rank = dims.coords(rank)
    assert tuple(mesh.get_coordinate()) == (pp_rank, dp_rank, tp_rank), (mesh.get_coordinate(), rank)
    groups = {name: mesh.get_group(name) for name in ("pp", "dp", "tp")}
    ranks = mesh.mesh[pp_rank].t().contiguous()  # [tp, dp] global ranks of this pipeline rank
    tp_dp = DeviceMesh.from_group([groups["tp"], groups["dp"]], device.type, ranks, mesh_dim_names=("tp", "dp"))
    return World(dims=dims, mesh=mesh, device=device, rank=rank, pp_rank=pp_rank, dp_rank=dp_rank,
                 tp_rank=tp_rank, groups=groups, tp_dp_mesh=tp_dp)
