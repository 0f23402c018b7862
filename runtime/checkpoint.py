"""Checkpoints: sharded (``torch.distributed.checkpoint``), plan-independent, written atomically; and the
gathered full state dict.

Layout independence. Every rank contributes its stages' model and optimizer state dicts as returned by
``torch.distributed.checkpoint.state_dict`` (FQN keys; FSDP's DTensor shards; for ZeRO-1 the partition the rank
owns), flattened (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``). A tied weight is stored once, under its
canonical name (the one ``model.named_parameters()`` gives), whichever stages hold copies. DCP stores each tensor
by its global shape and reshards on load, so a checkpoint written under one plan (pp=2, dp=2, ZeRO-1) loads under
any other of the same model (pp=1, dp=4, ZeRO-3).

Atomicity. All ranks write ``DIR/.tmp-step-K``; after DCP's final barrier rank 0 adds ``partc.json`` (the step
and the plan) and renames the directory to ``DIR/step-K``. A crash mid-write leaves only a ``.tmp-`` directory,
which `latest` ignores. (Across nodes DIR must be a shared file system.)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from partc.errors import PartcError
from partc.runtime.parallelize import local_optimizer

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

    def __init__(self, stages: list[nn.Module], optimizers: list[torch.optim.Optimizer], canon: dict[str, str]):
        self.stages, self.optimizers, self.canon = stages, optimizers, canon

    def model(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for st in self.stages:
            for k, v in get_model_state_dict(st).items():
                out.setdefault(_canon_key(k, self.canon), v)
        return out

    def optimizer(self) -> dict:
        out: dict = {}
        for st, opt in zip(self.stages, self.optimizers):
            for k, v in get_optimizer_state_dict(st, local_optimizer(opt), options=_FLAT).items():
                out.setdefault(_canon_key(k, self.canon), v)
        return out

    def load_model(self, state: dict[str, Tensor], *, full: bool = False, where: str = "the state dict") -> None:
        """Set every stage's tensors from `state` (canonical keys, or the model's own keys for `full`)."""
        for st in self.stages:
            mine = {}
            for k in get_model_state_dict(st):
                key = _canon_key(k, self.canon)
                if key not in state and full:
                    key = next((a for a, c in self.canon.items() if c == key and a in state), key)
                if key not in state:
                    raise PartcError(f"{where} has no {key!r}")
                mine[k] = state[key]
            set_model_state_dict(st, mine, options=StateDictOptions(full_state_dict=full, strict=True))

    def load_optimizer(self, state: dict) -> None:
        for st, opt in zip(self.stages, self.optimizers):
            local = local_optimizer(opt)
            mine = {k: state[_canon_key(k, self.canon)] for k in get_optimizer_state_dict(st, local, options=_FLAT)}
            set_optimizer_state_dict(st, local, mine, options=_FLAT)


def save(directory: str | Path, step: int, states: StateDicts, info: dict) -> Path:
    """Write ``DIR/step-K`` (sharded, every rank its part); returns its path."""
    root = Path(directory)
    final, tmp = root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    dcp.save({"model": states.model(), "optim": states.optimizer()}, checkpoint_id=str(tmp))
    if dist.get_rank() == 0:
        (tmp / "partc.json").write_text(json.dumps({"step": step, **info}, indent=2, sort_keys=True) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    dist.barrier()
    return final


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in DIR (``step-K`` with ``partc.json``), or None."""
    root = Path(directory)
    if not root.is_dir():
        return None
    done = [p for p in root.glob("step-*") if (p / "partc.json").exists()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def load(path: str | Path, states: StateDicts) -> int:
    """Load a checkpoint written under any plan of this model; returns its step."""
    path = Path(path)
    meta = path / "partc.json"
    if not meta.exists():
        raise PartcError(f"{path} is not a partc checkpoint (no partc.json)")
    step = int(json.loads(meta.read_text())["step"])
    state = {"model": states.model(), "optim": states.optimizer()}
    dcp.load(state, checkpoint_id=str(path))
    states.load_model(state["model"])
    states.load_optimizer(state["optim"])
    return step


def full_state_dict(states: StateDicts, world, model_keys: dict[str, Tensor]) -> dict[str, Tensor] | None:
    """The model's own ``state_dict()`` (same keys, order and shapes), gathered on rank 0 (None elsewhere).

    `model_keys`: the meta-built model's ``state_dict(keep_vars=True)``: the key order, and the values of
    buffers no stage holds. Collective: every rank must call it.
    """
    local: dict[str, Tensor] = {}
    for st in states.stages:  # FSDP all-gathers over dp here: every dp rank takes part
        for k, v in get_model_state_dict(st, options=StateDictOptions(full_state_dict=True)).items():
            local.setdefault(_canon_key(k, states.canon), v.detach().cpu())
    sender = world.dp_rank == 0 and world.tp_rank == 0
    gathered: list = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local if sender else None, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, Tensor] = {}
    for part in gathered:
        merged.update(part or {})
    out = {}
    for key, ref in model_keys.items():
        c = states.canon.get(key, key)
        if c in merged:
            out[key] = merged[c]
        elif not ref.is_meta:
            out[key] = ref.detach().cpu()  # a buffer no stage reads: the value __init__ computed
        else:
            raise PartcError(f"no stage holds {key}; the program does not use this parameter")
    return out
