"""Check programs against one process: the single-process reference, and a driver that runs several programs
(of one world size) in one torchrun launch, so a test pays the start-up once:

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m partc.runtime.testing JOBS.json

JOBS.json is a list of jobs: ``{"out": OUT, "steps": N, "seed": S, "optimizer": "sgd", "lr": 0.1,
"weight_decay": 0.0, "train": {more keyword arguments of `load`: the schedule, clipping, betas} (optional),
"data": true (optional: train on the model file's dataset() through `Program.data_loader`), "init": FILE (a full state dict, loaded with Program.load_state_dict), "init_checkpoint":
FILE (the same, passed to load() as --init-checkpoint is), "result": FILE, "save": DIR (optional: a checkpoint
after the run; with "save_at": K, after step K, the run going on: one job trains on and writes the checkpoint
another job resumes), "load": DIR (optional: resume from it first), "initial": true (optional: also the full state
dict before the first step), "records": true (optional: every rank's `Program.step_record` per step, under
"records")}``. Rank 0 writes ``{"losses": [...], "state": full state dict, "start": step resumed from,
"comm": per step, every rank's comm bytes by axis, "replica_diff": the largest difference between tp ranks' copies
of a parameter the program does not split (0.0: they stay identical), "initial": the full state dict before the
first step, if asked, and with "data": "grad_norms", "lrs", "clipped" per step and "read": every rank's dataset
indices read, by rank}`` to ``result``. A job ``{"check": "collectives", "result": FILE}`` runs `check_collectives`
over all ranks instead.

The workers leave with ``os._exit`` after destroying the process group (see `partc.runtime.__main__`).
"""

from __future__ import annotations

import gc
import json
import sys
from typing import Any

import torch
import torch.distributed as dist



def reference_run(model_path: str, init_state: dict[str, torch.Tensor], *, steps: int, seed: int,
                  global_batch_size: int, optimizer: str = "sgd", lr: float = 0.1, weight_decay: float = 0.0,
                  entry: str = "model", start: int = 0, seq_len: int | None = None, precision: str = "fp32",
                  micro_batch_size: int | None = None, untied: bool = False, train: dict | None = None,
                  data: bool = False, stats: dict | None = None
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train the whole model in this process on the runtime's batches (steps `start` .. `steps` - 1) from
    `init_state`, under the runtime's precision policy (`partc.precision`); returns the losses and the final state
    dict. The model's parameters are the fp32 master weights; each micro-batch (`micro_batch_size` samples, in
    order; the whole batch by default) runs forward and backward on a copy in the compute dtype, from
    floating-point inputs in that dtype, under the forward's casts (`partc.precision.forward_casts`), the loss in
    fp32 on the outputs upcast; the gradients are summed in fp32, divided by the number of micro-batches, and the
    optimizer steps the fp32 weights. This is the runtime's
    arithmetic up to the order of the fp32 sums over micro-batches and data-parallel ranks. `untied`: each use of a
    tied weight gets its own compute copy, whose gradients are summed in fp32 (as the runtime does when the uses
    are on different pipeline ranks; one stage holding both sums them in the compute dtype, as here by default).

    `train`: `load`'s schedule, clipping and AdamW settings (``torch.nn.utils.clip_grad_norm_`` here); `data`: the
    model file's ``dataset()`` in the runtime's order (`partc.runtime.data.GlobalOrder`) instead of random
    batches; `stats` (a dict) gets ``grad_norms``, ``lrs`` per step."""
    import copy

    from partc._torch import tree_map
    from partc.model_file import load_model_file
    from partc.precision import MASTER_DTYPE, cast_floating, cast_parameters, compute_dtype, forward_casts
    from partc.runtime.data import GlobalOrder
    from partc.runtime.optim import LRSchedule, OptimizerConfig, no_decay, param_groups
    from partc.runtime.train import global_batch

    spec = load_model_file(model_path, entry=entry, seq_len=seq_len)
    master = spec.build()
    master.load_state_dict(init_state)
    master.train()
    dtype = compute_dtype(precision)
    work = cast_parameters(copy.deepcopy(master), dtype) if dtype != MASTER_DTYPE else master
    pairs = [(mp, wp) for (_, mp), (_, wp) in zip(master.named_parameters(), work.named_parameters())]
    if untied and work is not master:
        seen: set[int] = set()
        for module in work.modules():
            for key, wp in module._parameters.items():
                if wp is not None and id(wp) in seen:
                    module._parameters[key] = copy_ = torch.nn.Parameter(wp.detach().clone())
                    pairs.append((next(mp for mp, w in pairs if w is wp), copy_))
                elif wp is not None:
                    seen.add(id(wp))
    train = dict(train or {})
    clip = train.pop("grad_clip", None)
    schedule = LRSchedule(kind=train.pop("lr_schedule", "constant"), lr=lr, warmup=train.pop("warmup_steps", 0),
                          total=train.pop("lr_decay_steps", 0), min_lr=train.pop("min_lr", 0.0))
    config = OptimizerConfig(name=optimizer, lr=lr, weight_decay=weight_decay, **train)
    cls, kwargs = config.optimizer_class()
    opt = cls(param_groups(master, no_decay(master), weight_decay), **kwargs)
    if data:
        dataset = spec.dataset()
        order = GlobalOrder(len(dataset), seed)

        def batch_at(k: int) -> tuple[tuple, dict, object]:
            items = [dataset[order(k * global_batch_size + j)] for j in range(global_batch_size)]
            xs, ys = zip(*items)
            x = xs[0]
            if isinstance(x, dict):
                return (), {n: torch.stack([v[n] for v in xs]) for n in x}, torch.utils.data.default_collate(ys)
            if isinstance(x, tuple):
                return tuple(torch.stack(v) for v in zip(*xs)), {}, torch.utils.data.default_collate(ys)
            return (torch.stack(xs),), {}, torch.utils.data.default_collate(ys)
    else:
        def batch_at(k: int) -> tuple[tuple, dict, object]:
            return global_batch(spec, seed, k, global_batch_size)
    stats = stats if stats is not None else {}
    stats.update(grad_norms=[], lrs=[])
    b = micro_batch_size or global_batch_size
    micro = range(0, global_batch_size, b)
    losses = []
    for k in range(start, steps):
        args, kw, targets = batch_at(k)
        opt.zero_grad()
        total = 0.0
        for i in micro:
            def take(x, i=i):
                return x[i:i + b] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == global_batch_size else x
            if work is not master:
                with torch.no_grad():
                    for mp, wp in pairs:
                        wp.copy_(mp)
            a, kw_b = cast_floating((tree_map(take, args), tree_map(take, kw)), dtype)
            with forward_casts(precision):
                out = work(*a, **kw_b)
            loss = spec.loss_fn(cast_floating(out, MASTER_DTYPE), tree_map(take, targets))
            loss.backward()
            total += loss.item()
            if work is not master:
                for mp, wp in pairs:
                    if wp.grad is not None:
                        grad = wp.grad.to(MASTER_DTYPE)
                        mp.grad = grad if mp.grad is None else mp.grad + grad
                        wp.grad = None
        for mp in master.parameters():
            if mp.grad is not None:
                mp.grad /= len(micro)
        for group in opt.param_groups:
            group["lr"] = schedule.lr_at(k)
        stats["lrs"].append(schedule.lr_at(k))
        if clip is not None:
            stats["grad_norms"].append(float(torch.nn.utils.clip_grad_norm_(master.parameters(), clip)))
        opt.step()
        losses.append(total / len(micro))
    return losses, {k: v.detach().clone() for k, v in master.state_dict().items()}


def run_job(job: dict[str, Any]) -> None:
    from partc.runtime import api

    if job.get("check") == "collectives":
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        check_collectives(dist.group.WORLD)
        if dist.get_rank() == 0:
            torch.save({"ok": True}, job["result"])
        return

    prog = api.load(job["out"], seed=job.get("seed", 0), optimizer=job.get("optimizer", "sgd"),
                    lr=job.get("lr", 0.1), weight_decay=job.get("weight_decay", 0.0),
                    init_checkpoint=job.get("init_checkpoint"), **job.get("train", {}))
    if job.get("init"):
        prog.load_state_dict(torch.load(job["init"], weights_only=True))
    start = prog.load(job["load"]) if job.get("load") else 0
    initial = prog.full_state_dict() if job.get("initial") else None
    losses, comm = [], []
    extra: dict[str, list] = {"grad_norms": [], "lrs": [], "clipped": []}
    batches = prog.data_loader().batches(start, job["steps"]) if job.get("data") else None
    for k in range(start, job["steps"]):
        if batches is not None:
            losses.append(prog.step(next(batches)))
        else:
            inputs, targets = prog.batch(k)
            losses.append(prog.step(inputs, targets))
        for key, name in (("grad_norms", "grad_norm"), ("lrs", "lr"), ("clipped", "clipped")):
            extra[key].append(prog.last_step[name])
        ranks: list = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, prog.runner.comm_bytes)
        comm.append(ranks)
        if job.get("records"):  # `Program.step_record` of every rank, as `partc run --log-jsonl` gathers them
            records: list = [None] * dist.get_world_size()
            dist.all_gather_object(records, prog.step_record())
            extra.setdefault("records", []).append(records)
        if job.get("save") and k + 1 == job.get("save_at"):
            prog.save(job["save"], k + 1)
    if job.get("data"):
        read: list = [None] * dist.get_world_size()
        dist.all_gather_object(read, {"read": list(prog.loader.read), "pp_rank": prog.world.pp_rank,
                                      "dp_rank": prog.world.dp_rank, "first": prog.runner.has_first,
                                      "last": prog.runner.has_last})
        extra["read"] = read
    if job.get("save") and job.get("save_at") is None:
        prog.save(job["save"], job["steps"])
    state = prog.full_state_dict()
    diff = replica_diff(prog)
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "state": state, "start": start, "replica_diff": diff, "initial": initial,
                    "comm": comm, **extra},
                   job["result"])


def replica_diff(prog) -> float:
    """The largest absolute difference between the tp ranks' copies of any parameter the program keeps whole
    (norm weights, biases after a row split, replicated layers), over all ranks. Collective."""
    from torch.distributed.tensor import DTensor

    world = prog.world
    worst = torch.zeros((), dtype=torch.float64, device=world.device)
    if world.par.tp > 1:
        for st in prog.stages:
            for name, p in st.named_parameters():
                if prog.layout.shard(name) is not None:
                    continue
                local = (p.to_local() if isinstance(p, DTensor) else p).detach().contiguous()
                parts = [torch.empty_like(local) for _ in range(world.par.tp)]
                dist.all_gather(parts, local, group=world.tp_group)
                for q in parts[1:]:
                    if q.numel():
                        worst = torch.maximum(worst, (q.double() - parts[0].double()).abs().max())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def check_collectives(group: dist.ProcessGroup) -> None:
    """Megatron's conjugate functions (`partc.collectives`) over `group`: forward values and input
    gradients against what they must be; raises AssertionError."""
    from partc import collectives as C

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    C.set_groups({"tp": group})
    try:
        xs = [torch.arange(12.0).reshape(3, 4) * (r + 1) for r in range(world)]  # every rank's input
        gs = [torch.full((3, 4), float(r + 1)) for r in range(world)]  # every rank's output gradient

        def run(fn, *args, grad_shape=None):
            x = xs[rank].clone().requires_grad_(True)
            y = fn(x, *args)
            g = gs[rank] if grad_shape is None else torch.full(grad_shape, float(rank + 1))
            y.backward(g)
            return y.detach(), x.grad

        y, dx = run(C.copy_to_tp)
        assert torch.equal(y, xs[rank]) and torch.equal(dx, sum(gs)), "copy_to_tp"
        y, dx = run(C.reduce_from_tp)
        assert torch.equal(y, sum(xs)) and torch.equal(dx, gs[rank]), "reduce_from_tp"
        y, dx = run(C.gather_from_tp, 1, grad_shape=(3, 4 * world))
        assert torch.equal(y, torch.cat(xs, 1)) and torch.equal(dx, torch.full((3, 4), float(rank + 1))), \
            "gather_from_tp"
        y, dx = run(C.scatter_to_tp, 1, grad_shape=(3, 4 // world))
        want_dx = torch.cat([torch.full((3, 4 // world), float(r + 1)) for r in range(world)], 1)
        assert torch.equal(y, xs[rank].chunk(world, 1)[rank]) and torch.equal(dx, want_dx), "scatter_to_tp"
        y, dx = run(C.reduce_scatter_to_tp, 1, grad_shape=(3, 4 // world))
        assert torch.equal(y, sum(xs).chunk(world, 1)[rank]) and torch.equal(dx, want_dx), "reduce_scatter_to_tp"
        y, dx = run(C.reduce_scatter_to_sp, 1, grad_shape=(3, 4 // world))
        assert torch.equal(y, sum(xs).chunk(world, 1)[rank]) and torch.equal(dx, want_dx), "reduce_scatter_to_sp"
        y, dx = run(C.gather_from_sp, 1, grad_shape=(3, 4 * world))
        want_dx = sum(torch.full((3, 4 * world), float(r + 1)) for r in range(world)).chunk(world, 1)[rank]
        assert torch.equal(y, torch.cat(xs, 1)) and torch.equal(dx, want_dx), "gather_from_sp"
        m = torch.empty(3, 4, device="meta")  # shapes only (the runtime's meta pass over the stage files)
        assert C.gather_from_tp(m, 0).shape == (3 * world, 4) and C.reduce_from_tp(m).shape == (3, 4)
        assert C.reduce_scatter_to_tp(m, 1).shape == (3, 4 // world)
    finally:
        C.set_groups({})


def free_groups() -> None:
    """Destroy every process group but the world's once a job is done (every rank has passed the barrier after
    it). A gloo group keeps its threads while it lives, and each of them wakes up many times a second: the groups of
    the jobs before would otherwise cost every later job of the launch CPU time on every rank."""
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    from partc.collectives import set_groups

    set_groups({})
    # DTensor's caches hold specs with the job's meshes: a later job's equal spec would find a mesh whose groups
    # are gone
    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()
    world = dist.group.WORLD
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)
    gc.collect()  # the job's meshes and modules hold the groups in reference cycles: their threads end here


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    jobs = json.loads(open(argv[0]).read())
    gc.freeze()  # what is imported by now lives as long as the process: `free_groups`'s collections skip it
    try:
        for job in jobs:
            run_job(job)
            dist.barrier()
            free_groups()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from partc.runtime.__main__ import exit_now

    exit_now(main(sys.argv[1:]))
