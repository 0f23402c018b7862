"""The device mesh: its axes, each named once, and how each divides the world.

The mesh is torchtitan's: axes `MESH` = (``pp``, ``dp``, ``cp``, ``tp``), outermost first. ``tp`` is innermost
(neighbouring ranks, the same node: the most traffic), ``pp`` outermost (point-to-point only):

    global rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

A `MeshAxis` names one axis for every layer (the `partc.parallel.Parallel` field of its degree, the plan's key, the
runtime's process group, a rank's coordinate, the CLI pin); a sub-axis (`SUB_AXES`: ``ep`` of ``dp``) divides a mesh
axis instead of the world. `Parallel` reads its rank geometry from these (`Parallel.coords`, `Parallel.degrees`,
`Parallel.spans_nodes`), and the runtime builds its device mesh and groups from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from partc.parallel import Parallel


@dataclass(frozen=True, slots=True)
class MeshAxis:
    """One axis of the device mesh. Its `name` is the one word every layer uses for it: the `Parallel` field of its
    degree, the plan's key (``parallel.<name>``, ``predicted.ranks[].comm_bytes.<name>``), the runtime mesh's
    dimension and process group (``world.groups[<name>]``), a rank's coordinate (``<name>_rank`` in `partc run`'s
    and `partc check`'s per-rank records) and the CLI pin (``--<name>``, made from the field like every pin).

    How it divides the world: the degrees of the axes of `MESH` multiply to the world size, and the axes nest in
    `MESH` order, outermost first (`Parallel.coords`): the members of one of its groups are the product of the
    degrees inside it apart (`Parallel.spans_nodes`). A sub-axis (`within`) divides another axis instead."""

    name: str
    within: str | None = None
    """None: a dimension of the device mesh (in `MESH`). Otherwise the mesh axis it is a sub-axis of (``ep`` of
    ``dp``, as torchtitan and Megatron-Core carve expert parallelism from data parallelism), not a dimension of the
    mesh: its degree divides that axis's, each group of that axis splits into groups of this many neighbours on it
    (`coordinate`), and the world size does not count it. Its groups exist, and plans and per-rank traffic carry
    it, only where its degree is above 1 (`in_use`): plans without it read as before it existed."""
    across: tuple[str, ...] = ()
    """Mesh axes besides `within` over which the ranks at one coordinate of this sub-axis hold the same parameters
    and get partial gradients of them: the group across the sub-axis (`across_degree` ranks) spans them too.
    ``ep``: ``cp``, since each context-parallel rank routes other tokens of the same samples to the same experts,
    so the experts' gradients are reduced (and ZeRO shards them) over the ``dp / ep`` x ``cp`` ranks holding
    them, as the other parameters' over ``dp`` x ``cp``."""

    @property
    def position(self) -> int:
        """Its index in the mesh, outermost first (an axis of `MESH`)."""
        return MESH_AXES.index(self.name)

    @property
    def pin(self) -> str:
        """The CLI option that fixes its degree."""
        return "--" + self.name.replace("_", "-")

    @property
    def rank_key(self) -> str:
        """The coordinate's key in per-rank records (``dp_rank``)."""
        return f"{self.name}_rank"

    def degree(self, par: Parallel) -> int:
        """How it divides the world: its degree in `par`."""
        return getattr(par, self.name)

    def in_use(self, par: Parallel) -> bool:
        """Whether `par` has this axis's groups and its traffic: every mesh axis; a sub-axis of degree above 1."""
        return self.within is None or self.degree(par) > 1

    def coordinate(self, coords: dict[str, int], par: Parallel) -> int:
        """This axis's coordinate of the rank at mesh coordinates `coords` (`Parallel.coords`): a sub-axis's is the
        place in its block of neighbours on `within` (``dp_rank % ep``)."""
        return coords[self.name] if self.within is None else coords[self.within] % self.degree(par)

    def across_degree(self, par: Parallel) -> int:
        """A sub-axis's ranks holding the same parameters of it: ``within / degree`` of its axis times the degrees
        of `across` (``ep``: ``dp / ep`` x ``cp``, `Parallel.expert_shard`)."""
        return getattr(par, self.within) // self.degree(par) * math.prod(getattr(par, a) for a in self.across)


MESH = (MeshAxis("pp"), MeshAxis("dp"), MeshAxis("cp"), MeshAxis("tp"))
"""The device mesh, outermost first: torchtitan's order. ``pp`` outermost: activations and their gradients between
neighbouring stages (point-to-point) and the sums of weights two stages share; ``dp``: gradients reduced and, with
ZeRO, parameters gathered (over ``dp`` x ``cp`` together: each context-parallel rank sees other tokens of the
same samples, torchtitan's ``dp_shard_cp``); ``cp``: each attention layer's keys and values all-gathered in forward
and their gradients reduce-scattered in backward (docs/context-parallel.md); ``tp`` innermost (neighbouring ranks, one node: the most traffic): the collectives
inside split layers and the gathers of pipeline boundaries sent 1/t a rank. A new axis is one more record here and
a `Parallel` field of the same name (docs/adding-a-dimension.md)."""

MESH_AXES = tuple(axis.name for axis in MESH)
"""The names of `MESH`, outermost first."""

MESH_BY_NAME = {axis.name: axis for axis in MESH}

SUB_AXES = (MeshAxis("ep", within="dp", across=("cp",)),)
"""The axes that divide an axis of `MESH` rather than the world (`MeshAxis.within`): ``ep``, the data-parallel
ranks among which the routed experts are divided (`Parallel.ep`), the experts' gradients reduced over the ``dp /
ep`` x ``cp`` ranks holding the same ones (`MeshAxis.across`)."""

SUB_AXES_BY_NAME = {axis.name: axis for axis in SUB_AXES}

AXES = (*MESH, *SUB_AXES)
"""Every axis with process groups of its own: the mesh's, then the sub-axes. The runtime's groups, the plan's and
the runtime's traffic per axis and `partc check`'s rows read them."""

AXES_BY_NAME = {axis.name: axis for axis in AXES}


def group_spans_nodes(size: int, stride: int, gpus_per_node: int) -> bool:
    """Whether a group of `size` ranks `stride` apart, placed on nodes of `gpus_per_node` in rank order, crosses
    nodes (``tp``: stride 1; ``dp``: stride tp; ``pp``: stride dp·tp)."""
    return size > 1 and size * stride > gpus_per_node
