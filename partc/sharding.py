"""How tensors are split over the tensor-parallel axis: the layouts the compiler writes and the runtime reads.

The compiler (`partc.passes.tp_rewrite`) generates stage files that work on local shards; the runtime allocates,
initializes, checkpoints and gathers those shards. Both read the layouts from here:

- `Shard`: a parameter split along `dim` over the tp ranks, in `fused` pieces each split separately (a fused QKV
  projection: every rank gets its own heads of q, of k and of v). `shard_tensor` / `unshard_tensor` convert.
- `param_shard`: how a layer's TP style (``colwise``, ``rowwise``, ``replicate``, ``inner``) splits each of its parameters.
- `GEMM_SPLIT`: which dimension of a layer's GEMM a style splits (colwise: the output features n; rowwise: the
  inner dimension k, leaving partial sums; inner: each GEMM its own, n for the first products, k for the last).
- `TPLayout`: for one tp rank, every parameter FQN (every alias of a tied weight) -> its split, local and whole
  shapes, and `take` / `gather` between whole tensors and shards. With tp = 1 nothing is split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from partc.ir import Layer

GEMM_SPLIT = {"replicate": None, "colwise": "n", "rowwise": "k", "inner": "inner"}
"""TP style -> the GEMM dimension it splits (`partc.passes.hw.gemm_time`'s ``split``; ``inner``: each GEMM's own,
`Gemm.inner_split`)."""


@dataclass(kw_only=True, slots=True)
class Shard:
    """How a parameter is split over the tp axis: `dim`, in `fused` pieces each split separately."""

    dim: int
    fused: int = 1


def shard_tensor(full: torch.Tensor, shard: Shard, rank: int, degree: int) -> torch.Tensor:
    """This rank's part of a whole parameter (fused pieces split one by one)."""
    pieces = full.chunk(shard.fused, dim=shard.dim)
    return torch.cat([p.chunk(degree, dim=shard.dim)[rank] for p in pieces], dim=shard.dim)


def unshard_tensor(parts: list[torch.Tensor], shard: Shard) -> torch.Tensor:
    """The whole parameter from every rank's part (inverse of `shard_tensor`)."""
    split = [p.chunk(shard.fused, dim=shard.dim) for p in parts]
    return torch.cat([torch.cat([s[i] for s in split], dim=shard.dim) for i in range(shard.fused)], dim=shard.dim)


def weight_names(layer: Layer) -> tuple[str, str]:
    """(weight, bias) parameter names of a linear layer: nn.MultiheadAttention, a Linear of its packed
    in-projection (q, k and v: 3 fused pieces), holds them as ``in_proj_weight`` and ``in_proj_bias``."""
    return ("in_proj_weight", "in_proj_bias") if layer.type == "MultiheadAttention" else ("weight", "bias")


def param_shard(layer: Layer, fqn: str, style: str) -> Shard | None:
    """How `style` splits parameter `fqn` of `layer` (None: whole)."""
    name = fqn.rpartition(".")[2]
    if style == "inner":
        dim_pieces = layer.inner.get(fqn)
        return Shard(dim=dim_pieces[0], fused=dim_pieces[1]) if dim_pieces else None
    weight, bias = weight_names(layer)
    conv1d = layer.type == "Conv1D"
    fused = layer.fused if style == "colwise" else 1
    if layer.kind == "embedding":
        if name != "weight":
            return None
        return Shard(dim=0) if style == "rowwise" else Shard(dim=1) if style == "colwise" else None
    if layer.kind != "linear" or style == "replicate":
        return None
    if name == weight:
        if style == "colwise":
            return Shard(dim=1 if conv1d else 0, fused=fused)
        return Shard(dim=0 if conv1d else 1)
    if name == bias and style == "colwise":
        return Shard(dim=0, fused=fused)
    return None


def aliases_of(canon: dict[str, str]) -> dict[str, list[str]]:
    """Canonical FQN -> every FQN of the same (tied) tensor, from a map of every FQN to its canonical one."""
    out: dict[str, list[str]] = {}
    for name, c in canon.items():
        out.setdefault(c, []).append(name)
    return out


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
    ep_degree: int = 1
    """Expert-parallel ranks (`partc.parallel.Parallel.ep`)."""
    ep_rank: int = 0
    """This process's place in its ep group: it holds experts [ep_rank·E/ep, (ep_rank+1)·E/ep)."""
    experts: frozenset[str] = frozenset()
    """Packed expert parameters (every alias), divided among the ep ranks along dim 0 (before any tp split, which
    is along another dim)."""
    routed: dict[str, int] = field(default_factory=dict)
    """Expert modules of a plain-PyTorch mixture of experts (an ``nn.ModuleList``'s elements) -> the ep rank
    holding it: whole, on that rank only (`partc.passes.experts_routed.routed_splits`)."""

    @classmethod
    def from_manifest(cls, tp: dict, rank: int, canon: dict[str, str]) -> TPLayout:
        """`tp`: the manifest's ``tp`` section; `canon`: every parameter FQN -> its canonical name (so that an
        entry under one alias of a tied weight covers all of them)."""
        aliases = aliases_of(canon)

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

    def with_experts(self, ep: dict, rank: int, canon: dict[str, str]) -> TPLayout:
        """This layout with the manifest's ``ep`` section: `rank` is this process's place in its ep group."""
        aliases = aliases_of(canon)
        names = {a for n in ep.get("experts", []) for a in aliases.get(canon.get(n, n), [n])}
        self.ep_degree, self.ep_rank = ep.get("degree", 1), rank
        self.experts = frozenset(names if self.ep_degree > 1 else ())
        self.routed = dict(ep.get("routed", {})) if self.ep_degree > 1 else {}
        return self

    def holder(self, fqn: str) -> int | None:
        """The ep rank holding the expert module `fqn` is (or is in), for the experts of a plain mixture of
        experts; None for every other module and tensor."""
        parts = fqn.split(".")
        for i in range(len(parts), 0, -1):
            rank = self.routed.get(".".join(parts[:i]))
            if rank is not None:
                return rank
        return None

    def foreign(self, fqn: str) -> bool:
        """Whether `fqn` (a module or tensor) belongs to an expert another ep rank holds: not on this rank."""
        rank = self.holder(fqn)
        return rank is not None and rank != self.ep_rank

    def expert_params(self, names) -> frozenset[str]:
        """Of the tensor FQNs `names` (this rank's), the experts' under ep: the packed ones and the parameters of
        the expert modules this rank holds. Their gradients are reduced over the ranks holding the same experts."""
        return self.experts | frozenset(n for n in names if self.holder(n) is not None)

    def splits(self, fqn: str) -> bool:
        """Whether this rank holds only a part of the parameter (over tp, or its experts over ep)."""
        return fqn in self.shards or fqn in self.experts

    def fused(self, fqn: str) -> tuple[int, int] | None:
        return self.fused_params.get(fqn)

    def local_shape(self, fqn: str, full: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        shape = list(full)
        sh = self.shards.get(fqn)
        if sh is not None:
            assert shape[sh.dim] % (sh.fused * self.degree) == 0, (fqn, shape, sh)
            shape[sh.dim] //= self.degree
        if fqn in self.experts:
            assert shape[0] % self.ep_degree == 0, (fqn, shape, self.ep_degree)
            shape[0] //= self.ep_degree
        return tuple(shape)

    def full_shape(self, fqn: str, local: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        shape = list(local)
        sh = self.shards.get(fqn)
        if sh is not None:
            shape[sh.dim] *= self.degree
        if fqn in self.experts:
            shape[0] *= self.ep_degree
        return tuple(shape)

    def take(self, fqn: str, full: Tensor) -> Tensor:
        """This rank's part of the whole tensor `full` (a view where possible, else a copy)."""
        if fqn in self.experts:
            full = full.chunk(self.ep_degree, dim=0)[self.ep_rank]
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

    def gather_experts(self, fqn: str, local: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        """Every expert of a packed parameter from the ep group's parts (a collective over `group`, the ``ep``
        group, for a packed expert parameter; every rank of the group gets it)."""
        if fqn not in self.experts:
            return local
        parts = [torch.empty_like(local) for _ in range(self.ep_degree)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=0)
