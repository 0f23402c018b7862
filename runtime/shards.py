"""How this rank holds each parameter under tensor parallelism (the manifest's ``tp`` section), in one place.

The stage files were generated for local shards (`partc.passes.tp_rewrite`): a parameter split ``Shard(dim,
fused)`` is held by tp rank r as ``shard_tensor(full, shard, r, t)``: its rows (or columns) ``[r/t, (r+1)/t)``,
and for a fused projection (q, k and v in one weight) that part of each piece, so every rank has its own heads of
q, of k and of v. `TPLayout` answers, for any FQN of the model (every alias of a tied weight):

- `shard`, `local_shape`, `full_shape`: the split and the shapes on this rank and in the model;
- `take` / `gather`: this rank's part of a whole tensor, and the whole tensor from every rank's part;
- `fused`: ``(dim, pieces)`` of a fused projection's parameter, whatever the plan's style for it (checkpoints
  store these viewed as ``[..., pieces, rows / pieces, ...]``, where the per-piece split is a plain split).

With tp = 1 nothing is split and every method is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from partc.passes.tp_rewrite import Shard, shard_tensor, unshard_tensor


@dataclass(kw_only=True, slots=True)
class TPLayout:
    degree: int
    """Tensor-parallel ranks (the mesh's ``tp`` axis)."""
    rank: int
    """This process's ``tp`` coordinate."""
    shards: dict[str, Shard] = field(default_factory=dict)
    """Parameter FQN (every alias) -> its split; parameters not listed are whole on every tp rank."""
    fused_params: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Parameter FQN (every alias) -> (dim, pieces) of a fused projection's parameter."""

    @classmethod
    def from_manifest(cls, tp: dict, rank: int, canon: dict[str, str]) -> TPLayout:
        """`tp`: the manifest's ``tp`` section; `canon`: every parameter FQN -> its canonical name (so that an
        entry under one alias of a tied weight covers all of them)."""
        aliases: dict[str, list[str]] = {}
        for name, c in canon.items():
            aliases.setdefault(c, []).append(name)

        def every_alias(table: dict) -> dict:
            out = {}
            for name, value in table.items():
                for alias in aliases.get(canon.get(name, name), [name]):
                    out[alias] = value
            return out

        shards = every_alias({k: Shard(dim=v["dim"], fused=v.get("fused", 1)) for k, v in tp.get("shards", {}).items()})
        fused = every_alias({k: (v["dim"], v["pieces"]) for k, v in tp.get("fused", {}).items()})
        return cls(degree=tp.get("degree", 1), rank=rank, shards=shards if tp.get("degree", 1) > 1 else {},
                   fused_params=fused)

    def shard(self, fqn: str) -> Shard | None:
        return self.shards.get(fqn)

    def fused(self, fqn: str) -> tuple[int, int] | None:
        return self.fused_params.get(fqn)

    def local_shape(self, fqn: str, full: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        shape = list(full)
        sh = self.shards.get(fqn)
        if sh is not None:
            assert shape[sh.dim] % (sh.fused * self.degree) == 0, (fqn, shape, sh)
            shape[sh.dim] //= self.degree
        return tuple(shape)

    def full_shape(self, fqn: str, local: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        shape = list(local)
        sh = self.shards.get(fqn)
        if sh is not None:
            shape[sh.dim] *= self.degree
        return tuple(shape)

    def take(self, fqn: str, full: Tensor) -> Tensor:
        """This rank's part of the whole tensor `full` (a view where possible, else a copy)."""
        sh = self.shards.get(fqn)
        if sh is None:
            return full
        if sh.fused == 1:
            return full.chunk(self.degree, dim=sh.dim)[self.rank]
        return shard_tensor(full, sh, self.rank, self.degree)

    def gather(self, fqn: str, local: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        """The whole tensor from every tp rank's `local` part (a collective over `group` for a split tensor;
        every rank of the group gets it)."""
        sh = self.shards.get(fqn)
        if sh is None:
            return local
        parts = [torch.empty_like(local) for _ in range(self.degree)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return unshard_tensor(parts, sh)
