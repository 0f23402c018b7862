"""Checkpoints: sharded (``torch.distributed.checkpoint``), plan-independent, written atomically; and the
gathered full state dict.

Layout independence. Every rank contributes its stages' model and optimizer state dicts as returned by
``torch.distributed.checkpoint.state_dict`` (FQN keys; FSDP's DTensor shards; for ZeRO-1 the partition the rank
owns), flattened (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``). A tied weight is stored once, under its
canonical name (the one ``model.named_parameters()`` gives), whichever stages hold copies. DCP stores each tensor
by its global shape and reshards on load, so a checkpoint written under one plan (pp=2, dp=2, ZeRO-1) loads under
any other of the same model (pp=1, dp=4, ZeRO-3, tp=2).

What DCP sees of a parameter (and of its optimizer states, which have its shape), `checkpoint_view`:

- the model's own shape, except that a fused projection's parameter (manifest ``tp.fused``: GPT-2's ``c_attn``,
  whatever the plan's style for it) is viewed as ``[..., pieces, rows / pieces, ...]``, so that the per-piece
  tensor-parallel split is a plain split;
- a tensor-parallel shard is a DTensor on the ``(tp, dp)`` mesh with ``Shard(d)`` over tp (d the split dim, in
  that view) and, under FSDP (ZeRO 2/3), FSDP's ``Shard(0)`` over dp nested inside (tp first); without FSDP it is
  ``Replicate()`` over dp and DCP writes one copy;
- one case is not a box: FSDP's dim-0 slice of a fused parameter viewed as pieces (its rows may straddle q and
  k). That tensor is gathered over dp when saving (``full_tensor``) and written back to FSDP's slice after
  loading, so under ZeRO 2/3 a rank holds its tp shard of every fused parameter (and of its optimizer states)
  whole while DCP writes or reads: a fraction of the stage (QKV is a quarter of a GPT block), not the model.

So a checkpoint saved under tp=2 loads under tp=1 or tp=4 and the other way round, with any dp, pp and ZeRO stage.
Checkpoints written before fused parameters were stored as pieces do not load (their shapes differ).

Atomicity. All ranks write ``DIR/.tmp-step-K``; after DCP's final barrier the ranks hash its files (each a
share), and rank 0 adds ``partc.json`` (the step, the plan, every file's size and SHA-256) and renames the
directory to ``DIR/step-K``. A crash mid-write leaves only a ``.tmp-`` directory, which `latest` ignores. Before
DCP reads a checkpoint every file is checked against ``partc.json`` (each rank a share) and nothing in it is
unpickled but DCP's metadata classes and plain values (`partc.runtime.checkpoint_dir`). (Across nodes DIR must be
a shared file system.)
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from partc.errors import PartcError
from partc.runtime import checkpoint_dir as files
from partc.runtime.mesh import World
from partc.sharding import TPLayout
from partc.runtime.train import NonFiniteError

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_PREFIXES = ("state.", "param_groups.")


def _canon_key(key: str, canon: dict[str, str]) -> str:
    """``state.lm_head.weight.exp_avg`` -> ``state.tok.weight.exp_avg`` (a model key: ``lm_head.weight`` ->
    ``tok.weight``)."""
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            fqn, _, leaf = key[len(prefix):].rpartition(".")
            return f"{prefix}{canon.get(fqn, fqn)}.{leaf}"
    return canon.get(key, key)


class StateDicts:
    """The model and optimizer state of this rank's stages, keyed by canonical FQN."""

    def __init__(self, stages: list[nn.Module], optimizers: list[torch.optim.Optimizer], canon: dict[str, str],
                 layout: TPLayout | None = None, world: World | None = None):
        self.stages, self.optimizers, self.canon = stages, optimizers, canon
        self.layout = layout if layout is not None else TPLayout(degree=1, rank=0)
        self.world = world
        self.shapes = {canon.get(n, n): tuple(p.shape) for st in stages for n, p in st.named_parameters()}
        """Canonical parameter FQN -> its shape on this tp rank (FSDP's DTensors: before FSDP's split)."""

    def model(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for st in self.stages:
            for k, v in get_model_state_dict(st).items():
                out.setdefault(_canon_key(k, self.canon), v)
        return out

    def optimizer(self) -> dict:
        out: dict = {}
        for st, opt in zip(self.stages, self.optimizers):
            for k, v in get_optimizer_state_dict(st, opt, options=_FLAT).items():
                out.setdefault(_canon_key(k, self.canon), v)
        return out

    def load_model(self, state: dict[str, Tensor], *, full: bool = False, where: str = "the state dict") -> None:
        """Set every stage's tensors from `state` (canonical keys, this rank's shards; or for `full` the model's
        own keys and whole tensors, of which each rank takes its part: every rank holds them all, so each cuts its
        FSDP shard out of its own copy, with no collective)."""
        for st in self.stages:
            mine = {}
            for k, current in get_model_state_dict(st).items():
                key = _canon_key(k, self.canon)
                if key not in state and full:
                    key = next((a for a, c in self.canon.items() if c == key and a in state), key)
                if key not in state:
                    raise PartcError(f"{where} has no {key!r}")
                mine[k] = self.layout.take(key, state[key]).contiguous() if full else state[key]
                if full and isinstance(current, DTensor):
                    mine[k] = distribute_tensor(mine[k].detach().to(current.device), current.device_mesh,
                                                current.placements, src_data_rank=None)
            set_model_state_dict(st, mine, options=StateDictOptions(strict=True))

    def load_optimizer(self, state: dict) -> None:
        for st, opt in zip(self.stages, self.optimizers):
            local = opt
            mine = {k: state[_canon_key(k, self.canon)] for k in get_optimizer_state_dict(st, local, options=_FLAT)}
            set_optimizer_state_dict(st, local, mine, options=_FLAT)

    def checkpoint_view(self, flat: dict, *, for_load: bool) -> tuple[dict, list[Callable[[], None]]]:
        """What DCP saves or loads for `flat` (from `model` or `optimizer`): see the module docstring. Returns the
        view (sharing storage with `flat`'s tensors, so loading into it loads into them) and the write-backs to
        run after loading (for tensors gathered over dp)."""
        view: dict = {}
        after: list[Callable[[], None]] = []
        for key, v in flat.items():
            view[key], back = self._view(key, v, for_load)
            if back is not None:
                after.append(back)
        return view, after

    def _view(self, key: str, v: Any, for_load: bool) -> tuple[Any, Callable[[], None] | None]:
        fqn = _param_of(key)
        if fqn is None or not isinstance(v, Tensor) or tuple(v.shape) != self.shapes.get(fqn):
            return v, None  # a buffer, a step count, a hyperparameter
        shard, fused = self.layout.shard(fqn), self.layout.fused(fqn)
        if shard is None and fused is None:
            return v, None
        fsdp = _dp_sharded(v)
        gather = fsdp and fused is not None and fused[0] == 0  # FSDP's rows of a [pieces, rows, ...] view
        back = None
        if gather and for_load:
            local = torch.empty(v.shape, dtype=v.dtype, device=v.to_local().device)
            back = functools.partial(_write_dp_slice, v, local, self.world)
        elif gather:
            local = v.full_tensor()  # collective over dp: every dp rank walks the same keys in the same order
        else:
            local = v.to_local() if isinstance(v, DTensor) else v
        full = list(self.layout.full_shape(fqn, v.shape))
        dim = None if shard is None else shard.dim
        if fused is not None:
            fd, pieces = fused
            local = local.unflatten(fd, (pieces, -1))
            full[fd:fd + 1] = [pieces, full[fd] // pieces]
            if dim is not None and dim >= fd:
                assert dim > fd or shard.fused == pieces, (fqn, shard, fused)
                dim += 1
        dp_split = fsdp and not gather
        if dim is None and not dp_split:
            return local, back  # whole on every rank of this stage: DCP writes one copy
        placements = [Replicate() if dim is None else Shard(dim), Shard(0) if dp_split else Replicate()]
        stride = torch.empty(full, device="meta").stride()
        return DTensor.from_local(local, self.world.tp_dp_mesh, placements, run_check=False, shape=torch.Size(full),
                                  stride=stride), back


def _dp_sharded(v: Any) -> bool:
    """Whether `v` is an FSDP DTensor split over dp (not ZeRO-0's replicas, not a data-parallel group of one)."""
    return isinstance(v, DTensor) and any(isinstance(pl, Shard) and v.device_mesh.size(i) > 1
                                          for i, pl in enumerate(v.placements))


def _param_of(key: str) -> str | None:
    """The parameter (or buffer) FQN a flat state key is about: ``state.<fqn>.exp_avg`` -> fqn; a model key is its
    own; ``param_groups.*`` -> None."""
    if key.startswith("param_groups."):
        return None
    if key.startswith("state."):
        return key[len("state."):].rpartition(".")[0]
    return key


def _write_dp_slice(dt: DTensor, whole: Tensor, world: World) -> None:
    """Copy this dp rank's FSDP slice (``torch.chunk`` of dim 0, as DTensor's ``Shard(0)``) of `whole` into
    `dt`'s local shard."""
    chunks = whole.chunk(world.par.dp, dim=0)
    local = dt.to_local()
    src = chunks[world.dp_rank] if world.dp_rank < len(chunks) else whole[:0]
    assert src.shape == local.shape, (src.shape, local.shape)
    with torch.no_grad():
        local.copy_(src)


def save(directory: str | Path, step: int, states: StateDicts, info: dict) -> Path:
    """Write ``DIR/step-K`` (sharded, every rank its part; replacing an earlier ``step-K``); returns its path."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim = states.model(), states.optimizer()
    check_finite([*model.values(), *optim.values()], "the model or optimizer state", states.world.device)
    box = [files.begin_step(directory, step) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    tmp: Path = box[0]
    model, _ = states.checkpoint_view(model, for_load=False)
    optim, _ = states.checkpoint_view(optim, for_load=False)
    dcp.save({"model": model, "optim": optim}, checkpoint_id=str(tmp))
    del model, optim
    dist.barrier()
    box = [files.list_files(tmp) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    mine = {name: files.hash_file(tmp / name) for name in box[0][rank::world]}
    hashes: list | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, hashes, dst=0)
    final = files.step_path(directory, step)
    if rank == 0:
        listed = {name: h for part in hashes for name, h in part.items()}
        files.commit_step(tmp, step, {**info, "files": dict(sorted(listed.items()))})
    dist.barrier()
    return final


def check_finite(values: list, what: str, device: torch.device) -> None:
    """Raise `NonFiniteError` on every rank if a floating-point tensor of `values` on any rank holds nan or inf
    (one all-reduce). A finite gradient times a large learning rate can overflow a weight or Adam's second
    moment, so the step's own check (`partc.runtime.train`) is not enough before a save."""
    tensors = [v.to_local() if isinstance(v, DTensor) else v for v in values if isinstance(v, Tensor)]
    bad = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        if t.is_floating_point():
            bad += ~torch.isfinite(t).all()
    dist.all_reduce(bad)
    if bad.item():
        raise NonFiniteError(f"{what} holds nan or inf ({bad.item():.0f} tensors): not saving it")


def load(path: str | Path, states: StateDicts) -> int:
    """Load a checkpoint written under any plan of this model, once its files match its manifest; returns its
    step. Collective."""
    path = Path(path)
    manifest = files.read_manifest(path)
    names = sorted(manifest["files"])
    rank, world = dist.get_rank(), dist.get_world_size()
    problems: list = [None] * world
    dist.all_gather_object(problems, files.verify(path, manifest["files"], names[rank::world]))
    problem = next((p for p in problems if p), None)
    if problem:
        raise PartcError(problem)
    metadata = files.read_metadata(path, manifest["files"][files.METADATA]["sha256"])
    model, optim = states.model(), states.optimizer()
    model_view, model_after = states.checkpoint_view(model, for_load=True)
    optim_view, optim_after = states.checkpoint_view(optim, for_load=True)
    reader = files.SafeReader(path, metadata)
    dcp.load({"model": model_view, "optim": optim_view}, storage_reader=reader, planner=files.SafePlanner())
    for write_back in model_after + optim_after:
        write_back()
    states.load_model(model)
    states.load_optimizer(optim)
    return manifest["step"]


def full_state_dict(states: StateDicts, model_keys: dict[str, Tensor],
                    unheld: dict[str, Tensor]) -> dict[str, Tensor] | None:
    """The model's own ``state_dict()`` (same keys, order and shapes), gathered on rank 0 (None elsewhere):
    FSDP's shards over dp, then tensor-parallel shards over tp (`TPLayout.gather`), then the stages.

    `model_keys`: the meta-built model's ``state_dict(keep_vars=True)`` (the key order); `unheld`: the values of
    buffers no stage holds (the ones the model's construction gives them). Collective: every rank must call it.
    """
    world, layout = states.world, states.layout
    local: dict[str, Tensor] = {}
    for st in states.stages:  # FSDP all-gathers over dp here: every dp rank takes part
        for k, v in get_model_state_dict(st, options=StateDictOptions(full_state_dict=True)).items():
            c = _canon_key(k, states.canon)
            if c in local:
                continue
            routed = layout.holder(c) is not None  # an expert module of a plain mixture: on its ep rank only
            if world.dp_rank == 0 and c not in layout.experts and not routed:  # the tp group of dp rank 0 gathers
                local[c] = layout.gather(c, v.detach(), world.tp_group)  # its shards
            if routed and world.dp_rank < layout.ep_degree:  # each rank of dp rank 0's ep group its own experts
                local[c] = layout.gather(c, v.detach(), world.tp_group)
            if c in layout.experts and world.dp_rank < layout.ep_degree:  # and its ep group their experts
                whole = layout.gather_experts(c, layout.gather(c, v.detach(), world.tp_group), world.ep_group)
                if world.dp_rank == 0:
                    local[c] = whole
            if c in local:
                local[c] = local[c].cpu()
    sender = world.tp_rank == 0 and (world.dp_rank == 0 or (bool(layout.routed) and world.dp_rank < layout.ep_degree))
    gathered: list = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local if sender else None, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, Tensor] = {}
    for part in gathered:
        merged.update(part or {})
    merged.update({k: v for k, v in unheld.items() if k not in merged})
    missing = [k for k in model_keys if states.canon.get(k, k) not in merged]
    if missing:
        raise PartcError(f"no stage holds {missing[0]}; the program does not use this parameter")
    return {key: merged[states.canon.get(key, key)] for key in model_keys}
