"""Process group and device mesh: `partc.mesh_axes.MESH` (``pp``, ``dp``, ``tp``) over the torchrun world.

torchtitan's `ParallelDims`: the degrees must multiply to the world size, and the mesh names its axes so every
later step asks for ``mesh["dp"]`` rather than computing rank arithmetic. The plan's `Parallel` owns the degrees, the
axis order and the rank arithmetic (`Parallel.coords`, `Parallel.rank_of`); this module checks the world size and
builds the mesh.

The stage files find their groups through `partc.collectives.set_groups`, which `partc.runtime.load` calls with
``world.groups`` before any stage runs (on meta or for real).

Checkpoints see a tensor-parallel shard further sharded by FSDP over dp as a DTensor on `World.tp_dp_mesh`: the
same ranks as ``mesh["dp", "tp"]`` with the axes in the other order, so that two ``Shard(0)`` placements nest the
way they do here (the tp split first, FSDP's split of that part second).

Device: CUDA (backend NCCL, one GPU per local rank) when available, else CPU (backend gloo). Nothing below
names a device type; it is chosen once here.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from partc._torch import set_pg_timeout
from partc.errors import PartcError
from partc.mesh_axes import AXES, MESH, SUB_AXES, MeshAxis
from partc.parallel import Parallel


def check_world_size(par: Parallel, world_size: int) -> None:
    """The plan's degrees must multiply to the processes torchrun started."""
    if par.world_size != world_size:
        raise PartcError(f"the plan needs {par.world_text()} processes, but {world_size} were started; run "
                         f"`partc run OUT` or torchrun --nproc-per-node {par.world_size}")


@dataclass(kw_only=True, slots=True)
class World:
    """This process's place in the run."""

    par: Parallel
    """The plan's parallel configuration: degrees and mesh order."""
    mesh: DeviceMesh
    device: torch.device
    rank: int
    coords: dict[str, int]
    """Axis (`partc.mesh_axes.AXES`: every mesh axis, and a sub-axis where `MeshAxis.in_use`) -> this rank's
    coordinate on it (`Parallel.coords`, `MeshAxis.coordinate`); also as ``world.<axis>_rank`` (0 on a sub-axis not
    in use)."""
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    """Axis (as `coords`) -> this rank's process group on it; also as ``world.<axis>_group`` (None on a sub-axis
    not in use: without expert parallelism, ``world.ep_group``)."""
    tp_dp_mesh: DeviceMesh | None = None
    """This pipeline rank's ``(tp, dp)`` mesh (the groups of ``mesh``, tp outer), for checkpoint DTensors."""
    zero_mesh: DeviceMesh | None = None
    """The mesh FSDP shards over (`zero_mesh`)."""
    across: dict[str, DeviceMesh] = field(default_factory=dict)
    """Sub-axis in use (`partc.mesh_axes.SUB_AXES`) -> the 1-D mesh of the ranks at this rank's coordinate of it in
    its ``within`` x ``across`` group (`sub_axis_groups`, `MeshAxis.across_degree` ranks): those holding the same
    parameters of the sub-axis. ``ep``: the ``dp / ep`` x ``cp`` ranks holding the same experts (torchtitan's
    ``dp_shard_mod_ep``, with cp), their gradients reduced over it and, under ZeRO 1-3, FSDP sharding them."""
    dp_shard_groups: list[dist.ProcessGroup] = field(default_factory=list)
    """Under context parallelism, the group of ``dp`` x ``cp`` FSDP reduces over (its traffic counts as ``dp``)."""

    @property
    def expert_mesh(self) -> DeviceMesh | None:
        """``across["ep"]``: the ranks holding the same experts (None without ep)."""
        return self.across.get("ep")

    @property
    def expert_dp_group(self) -> dist.ProcessGroup | None:
        """`expert_mesh`'s process group (None without ep)."""
        return self.expert_mesh.get_group() if "ep" in self.across else None

    def record(self) -> dict[str, int]:
        """This rank in a per-rank record (`partc run`'s ``--log-jsonl``, `partc check`): its global rank and its
        coordinate on each mesh axis, ``{"rank", "pp_rank", "dp_rank", "tp_rank"}``."""
        return rank_record(self.rank, self.coords)


def rank_record(rank: int, coords: dict[str, int]) -> dict[str, int]:
    """A global rank and its mesh coordinates as the per-rank records write them (`MeshAxis.rank_key`)."""
    return {"rank": rank, **{axis.rank_key: coords[axis.name] for axis in MESH}}


def _axis_property(axis: str, what: str) -> property:
    if what == "rank":
        return property(lambda self: self.coords.get(axis, 0), doc=f"This rank's coordinate on the ``{axis}`` axis.")
    return property(lambda self: self.groups.get(axis), doc=f"This rank's ``{axis}`` process group.")


for _axis in AXES:  # world.pp_rank, world.dp_group, world.ep_rank, ...: one of each per axis
    setattr(World, _axis.rank_key, _axis_property(_axis.name, "rank"))
    setattr(World, f"{_axis.name}_group", _axis_property(_axis.name, "group"))


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
    """Join the torchrun process group (if not joined yet) and build the mesh (`MESH`); a collective on
    any of its groups that waits longer than `timeout_s` fails (``--collective-timeout``)."""
    if not dist.is_initialized() and "RANK" not in os.environ:
        raise PartcError("partc.runtime runs under torchrun: `partc run OUT` or "
                         "`torchrun --nproc-per-node N -m partc.runtime OUT`")
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    check_world_size(par, world_size)  # before any collective
    device, backend = pick_device()
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    degrees = par.degrees()
    mesh = init_device_mesh(device.type, tuple(degrees.values()), mesh_dim_names=tuple(degrees))
    rank = dist.get_rank()
    coords = par.coords(rank)
    assert tuple(mesh.get_coordinate()) == tuple(coords.values()), (mesh.get_coordinate(), rank)
    groups = {name: mesh.get_group(name) for name in degrees}
    if dist.get_backend() != "fake":  # `partc check`'s fake process group has no timeout
        for group in groups.values():  # the mesh's groups get c10d's default timeout otherwise (30 min)
            set_pg_timeout(timedelta(seconds=timeout_s), group)
    world = World(par=par, mesh=mesh, device=device, rank=rank, coords=coords, groups=groups)
    world.zero_mesh = zero_mesh(world, par)
    for axis in SUB_AXES:  # ep: the dp groups split into blocks of ep neighbours
        if axis.in_use(par):
            world.coords[axis.name] = axis.coordinate(world.coords, par)
            world.groups[axis.name], across, members = sub_axis_groups(world, axis)
            world.across[axis.name] = DeviceMesh.from_group(across, device.type, mesh=torch.tensor(members),
                                                            mesh_dim_names=(f"across_{axis.name}",))
    world.tp_dp_mesh = tp_dp_mesh(world)
    return world


def sub_axis_groups(world: World, axis: MeshAxis) -> tuple[dist.ProcessGroup, dist.ProcessGroup, list[int]]:
    """(this rank's group of the sub-axis `axis`, its group across that sub-axis, the latter's ranks): the ranks of
    each group of ``axis.within``, at each coordinate of ``axis.across``, in blocks of ``degree`` neighbours
    (``ep``: the experts divided among them, torchtitan's ``dp_shard_in_ep``; tokens travel inside a cp coordinate),
    and those at the same coordinate of the sub-axis over ``within`` and ``across`` together, every ``degree``-th
    of ``within`` at every coordinate of ``across`` (``ep``: the ``dp / ep`` x ``cp`` ranks holding the same
    experts, torchtitan's ``dp_shard_mod_ep`` with cp), in rank order. Every rank creates every group, in the same
    order (``new_group`` is collective)."""
    par, within, n = world.par, axis.within, axis.degree(world.par)
    size = getattr(par, within)
    mine = across = None
    members: list[int] = []
    spanned = (within, *axis.across)
    others = [a.name for a in MESH if a.name not in spanned]
    for point in itertools.product(*(range(getattr(par, a)) for a in others)):
        at = dict(zip(others, point))
        for beside in itertools.product(*(range(getattr(par, a)) for a in axis.across)):
            ranks = [par.rank_of(**{within: d}, **dict(zip(axis.across, beside)), **at) for d in range(size)]
            for block in (ranks[i:i + n] for i in range(0, size, n)):
                group = dist.new_group(block)
                mine = group if world.rank in block else mine
        for e in range(n):
            same = sorted(par.rank_of(**{within: d}, **dict(zip(axis.across, beside)), **at)
                          for d in range(e, size, n)
                          for beside in itertools.product(*(range(getattr(par, a)) for a in axis.across)))
            group = dist.new_group(same)
            if world.rank in same:
                across, members = group, same
    return mine, across, members


def tp_dp_mesh(world: World) -> DeviceMesh:
    """This pipeline rank's ``(tp, dp)`` mesh for checkpoint DTensors (module docstring); under context
    parallelism its ``dp`` is the ``dp`` x ``cp`` group FSDP shards over."""
    ranks = world.mesh.mesh[world.pp_rank].reshape(-1, world.par.tp).t().contiguous()  # [tp, dp·cp] global ranks
    dp_group = world.dp_shard_groups[0] if world.dp_shard_groups else world.dp_group
    return DeviceMesh.from_group([world.tp_group, dp_group], world.device.type, ranks,
                                 mesh_dim_names=("tp", "dp"))


def dp_shard_mesh(world: World) -> DeviceMesh:
    """The ``dp`` axis, or under context parallelism ``dp`` and ``cp`` flattened into one (torchtitan's
    ``dp_shard_cp``): every cp rank holds every parameter and gets the gradient of its own tokens."""
    par = world.par
    if par.cp == 1:
        return world.mesh["dp"]
    # A group of its own (not DeviceMesh's flattening, which may hand back the cp group itself when dp is 1): its
    # traffic is counted as dp's. `new_group` is collective: every rank creates every group, in the same order.
    mine = None
    for pp in range(par.pp):
        for tp in range(par.tp):
            members = [par.rank_of(pp=pp, dp=d, cp=c, tp=tp) for d in range(par.dp) for c in range(par.cp)]
            group = dist.new_group(members)
            if world.rank in members:
                mine, ranks = group, members
    world.dp_shard_groups = [mine]
    return DeviceMesh.from_group(mine, world.device.type, mesh=torch.tensor(ranks), mesh_dim_names=("dp_cp",))


def zero_mesh(world: World, par: Parallel) -> DeviceMesh:
    """The mesh FSDP shards over: the ``dp`` axis (`dp_shard_mesh`: with ``cp``); for ZeRO-0, (that axis
    replicated, a shard group of one) (HSDP)."""
    shard = dp_shard_mesh(world)
    if par.zero > 0:
        return shard
    single, _ = dist.new_subgroups(group_size=1)  # collective: every rank creates every singleton group
    return DeviceMesh.from_group([shard.get_group(), single], world.device.type,
                                 mesh=shard.mesh.reshape(-1, 1), mesh_dim_names=("dp", "dp_shard"))

