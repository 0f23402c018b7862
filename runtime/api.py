"""The Python API, for training loops of your own (your data, your optimizer settings). Under torchrun:

    import partc.runtime

    prog = partc.runtime.load("partc_out", optimizer="adamw", lr=3e-4,    # mesh, stages, ZeRO, optimizer
                              lr_schedule="cosine", warmup_steps=10, lr_decay_steps=100, grad_clip=1.0)
    prog.load_state_dict(torch.load("init.pt", weights_only=True))         # optional: a full state dict
    loader = prog.data_loader(my_dataset)  # this rank's share of each global batch (partc.runtime.data)
    for batch in loader.batches(0, 100):
        loss = prog.step(batch)            # global-batch mean loss, on every rank
        print(prog.last_step)              # loss, grad_norm, lr, clipped
    prog.save("ckpt/", 100)                # sharded, with the data position and the schedule; prog.load("ckpt/")
                                           # under any plan of the same model, then prog.data_loader() resumes
    sd = prog.full_state_dict()             # rank 0: the model's own state_dict(); None elsewhere

``prog.step(x, y)`` also takes a whole global batch (the same on every rank; each keeps its data-parallel slice),
for a loop that makes its own batches.

`load` does, in order: read the program, join the mesh (and give the stage files its tp group), build the model
on meta (recording how its construction sets each tensor: `partc.deferred_init`), allocate and initialize this
rank's stages only (with tensor parallelism, this tp rank's shard of each split parameter), wrap each stage file
as a module, apply ZeRO, build the optimizers and the pipeline schedule.

Tensor parallelism is in the stage files: they hold local shards and call `partc.collectives`. Everything
here that meets a whole tensor (a state dict you pass or get back, a checkpoint) converts between whole tensors
and shards with `partc.sharding.TPLayout`, so none of it depends on the plan.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from partc.collectives import counting_expert_rows, set_expert_imbalance, set_groups
from partc.deferred_init import InitRecord
from partc.errors import PartcError
from partc.model_file import ModelSpec, load_model_file
from partc.runtime import checkpoint, checkpoint_dir
from partc.runtime.materialize import (build_model, canonical_names, check_initializable, init_weights,
                                       load_weights, materialize, open_checkpoint)
from partc.runtime.comm import CommCounter
from partc.runtime.mesh import World, init_world
from partc.runtime.data import Batch, Loader, check_resumable, data_state, token_dataset
from partc.runtime.optim import LRSchedule, OptimizerConfig, build_optimizers, grad_copies, no_decay
from partc.runtime.parallelize import GradSync, parallelize
from partc.runtime.program import ProgramFiles, StageFile, read_program
from partc.runtime.stage import StageModule
from partc.runtime.train import PipelineRunner, global_batch, stage_shapes
from partc.sharding import TPLayout, aliases_of


class Program:
    """A compiled program running on this rank: its stages, optimizers and pipeline schedule."""

    def __init__(self, *, files: ProgramFiles, spec: ModelSpec, world: World, model: nn.Module,
                 stages: list[StageModule], optimizers: list[torch.optim.Optimizer], runner: PipelineRunner,
                 canon: dict[str, str], layout: TPLayout, seed: int, unheld: dict[str, Tensor]):
        self.files = files
        self.plan = files.plan
        self.spec = spec
        self.world = world
        self.stages = stages
        """This rank's stage modules (FSDP-wrapped with ZeRO 2/3); parameters under the model's FQNs."""
        self.optimizers = optimizers
        self.runner = runner
        self.seed = seed
        self.layout = layout
        """Which parameters the program splits over tp, and how (`partc.sharding`)."""
        self.states = checkpoint.StateDicts(stages, optimizers, canon, layout, world)
        self._model_keys = model.state_dict(keep_vars=True)
        self._unheld = unheld
        """Buffers of the state dict no stage holds (forward does not read them): their initial values (CPU)."""
        self.next_step = 0
        """The step the next `step` trains (the schedule's step): 0, or the step of the checkpoint loaded."""
        self._data: dict | None = None
        """What the loaded checkpoint recorded of the data (`partc.runtime.data.data_state`; None: none)."""
        self.loader: Loader | None = None
        """The last `data_loader` (its position goes into `save`'s checkpoint)."""
        self.expert_rows: list[int] = []
        """Under ep: the rows this rank's experts received in each ep all-to-all of the last `step`, in order."""

    @property
    def last_step(self) -> dict:
        """The last step's ``loss``, ``grad_norm`` (the global norm, before clipping), ``lr``, ``clipped``."""
        return dict(self.runner.last)

    @property
    def schedule(self) -> LRSchedule | None:
        return self.runner.schedule_lr

    # -- data --------------------------------------------------------------------------------------------------

    def data_loader(self, dataset: Any = None, *, data_path: str | Path | None = None, seed: int | None = None,
                    shuffle: bool = True, num_workers: int | None = None) -> Loader:
        """This rank's share of each global batch of `dataset` (items ``(inputs, targets)``), of the token file
        `data_path`, or of the model file's ``dataset()`` (`partc.runtime.data`); `seed`: the order's (default:
        the program's). After `load`, it continues from the position the checkpoint recorded."""
        if dataset is None and data_path is not None:
            dataset = token_dataset(data_path, self.spec, self.files.input_keys)
        if dataset is None and self.spec.dataset is not None:
            dataset = self.spec.dataset()
        if dataset is None:
            raise PartcError(f"no data: {self.spec.name} defines no dataset(); pass --data PATH (token ids) or "
                             f"define dataset() in the model file")
        g = self.plan.parallel.global_batch_size
        seed = self.seed if seed is None else seed
        check_resumable(self._data, dataset, seed)
        start = 0 if self._data is None else self._data["position"] - self.next_step * g
        self.loader = Loader(dataset, input_keys=self.files.input_keys, global_batch_size=g,
                             dp=self.world.par.dp, dp_rank=self.world.dp_rank, inputs=self.runner.has_first,
                             targets=self.runner.has_last, seed=seed,
                             shuffle=shuffle, start=start, device=self.world.device, num_workers=num_workers)
        return self.loader

    # -- training ----------------------------------------------------------------------------------------------

    def batch(self, step: int) -> tuple[Any, Any]:
        """The runtime's own global batch for `step` (``example_inputs``/``example_targets`` under seed + step),
        as (inputs, targets) for `step`."""
        args, kwargs, targets = global_batch(self.spec, self.seed, step, self.plan.parallel.global_batch_size)
        return (args, kwargs), targets

    def step(self, inputs: Any, targets: Any = None) -> float:
        """One optimizer step; returns the global-batch mean loss on every rank. The learning rate is the
        schedule's at `next_step` (a `Batch`'s own step).

        `inputs`: this rank's `Batch` from `data_loader`; or a whole global batch as the model takes it (a tensor,
        a tuple (positional), a dict (keyword), or (args, kwargs)) and `targets`, every rank passing the same batch
        and each keeping its data-parallel slice."""
        device = self.world.device
        if device.type != "cpu":
            torch.accelerator.reset_peak_memory_stats(device)
        with counting_expert_rows() as self.expert_rows:
            if isinstance(inputs, Batch):
                self.next_step = inputs.step
                loss = self.runner.step_local(inputs.inputs, inputs.targets, step=inputs.step)
            else:
                args, kwargs = _as_args(inputs)
                loss = self.runner.step(args, kwargs, targets, step=self.next_step)
        self.next_step += 1
        return loss

    def measured_mfu(self, step_time_s: float) -> float | None:
        """The model FLOPs utilization of a step that took `step_time_s`, as the plan counts it: its predicted MFU
        times its predicted step time over the measured one (the same model FLOPs, the same peak); None if the plan
        has no prediction."""
        pred = self.plan.predicted
        mfu, t = pred.get("mfu"), pred.get("step_time_s")
        if not isinstance(mfu, (int, float)) or not isinstance(t, (int, float)) or step_time_s <= 0:
            return None
        return mfu * t / step_time_s

    def step_record(self) -> dict:
        """What this rank did in the last `step`, next to what the plan predicted for its pipeline rank: collective
        payload by mesh axis (`partc.runtime.comm`; ``predicted.ranks[].comm_bytes`` defines the quantity) and the
        peak of allocated device memory (None on a CPU, which does not report it). Under ep, also the rows its
        experts received (``expert_rows``) and its ep group's measured routing imbalance (``expert_imbalance``,
        `expert_imbalance`), next to the one the plan priced: collective (every rank calls it)."""
        device = self.world.device
        predicted = self.files.predicted_ranks
        mine = predicted[self.world.pp_rank] if predicted else {}
        record = {**self.world.record(), "comm_bytes": dict(self.runner.comm_bytes),
                  "predicted_comm_bytes": mine.get("comm_bytes"),
                  "peak_memory_bytes": None if device.type == "cpu" else torch.accelerator.max_memory_allocated(device),
                  "predicted_memory_bytes": (mine.get("memory_bytes") or {}).get("total")}
        if self.plan.parallel.ep > 1:
            record.update(expert_rows=sum(self.expert_rows), expert_imbalance=self.expert_imbalance(),
                          predicted_expert_imbalance=self.plan.parallel.imbalance)
        return record

    def expert_imbalance(self) -> float | None:
        """The last `step`'s routing imbalance in this rank's ep group, as the plan prices it
        (`partc.parallel.Parallel.imbalance`): each all-to-all waits for the rank receiving the most rows, so it is
        the sum over the step's all-to-alls of the most rows a rank of the group received over the sum of the mean
        (1.0: uniform; ep: every row to one rank). None without ep or where this stage has no experts. Collective
        over the ep group (outside the step: not counted as its traffic)."""
        group = self.world.ep_group
        if group is None or self.plan.parallel.ep == 1 or not self.expert_rows:  # the same on the whole group
            return None
        mine = torch.tensor(self.expert_rows, dtype=torch.float64, device=self.world.device)
        rows = [torch.empty_like(mine) for _ in range(self.plan.parallel.ep)]
        torch.distributed.all_gather(rows, mine, group=group)
        rows = torch.stack(rows)
        mean = rows.mean(0).sum().item()
        return rows.max(0).values.sum().item() / mean if mean > 0 else None

    def parameters(self) -> list[nn.Parameter]:
        return [p for st in self.stages for p in st.parameters()]

    # -- state -------------------------------------------------------------------------------------------------

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load a full state dict (the model's own keys; every rank passes it, each keeps its part)."""
        self.states.load_model(state, full=True)

    def full_state_dict(self) -> dict[str, Tensor] | None:
        """The model's ``state_dict()`` (same keys and shapes: tensor-parallel shards gathered) on rank 0, None
        elsewhere. Collective."""
        return checkpoint.full_state_dict(self.states, self._model_keys, self._unheld)

    def model_tensors(self) -> list[list]:
        """``[[canonical FQN, shape, dtype], ...]``: what a checkpoint holds of the model (its parameters and
        persistent buffers, a tied weight once, whole shapes), in the model's order."""
        canon = self.states.canon
        return [[k, list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in self._model_keys.items()
                if canon.get(k, k) == k]

    def save(self, directory: str | Path, step: int = 0) -> Path:
        """A sharded checkpoint (model and optimizer) in ``DIR/step-K``, with the learning-rate schedule and, if a
        `data_loader` was made, the data position of step K (what `load` restores). Collective."""
        _no_ep_checkpoints(self.plan.parallel)
        info = {"model": self.plan.model.get("name"), "parallel": self.plan.to_dict()["parallel"],
                "plan": checkpoint_dir.plan_fingerprint(self.plan)}
        if self.runner.schedule_lr is not None:
            info["schedule"] = self.runner.schedule_lr.to_dict()
        if self.loader is not None:
            info["data"] = data_state(self.loader, step)
        return checkpoint.save(directory, step, self.states, info)

    def load(self, path: str | Path) -> int:
        """Load a checkpoint written under any plan of this model: ``DIR/step-K``, or DIR for its newest one, with
        the schedule and the data position it recorded (for the next `data_loader`). Returns its step. Collective."""
        _no_ep_checkpoints(self.plan.parallel)
        path = Path(path)
        if not (path / checkpoint_dir.MANIFEST).exists():
            newest = checkpoint_dir.latest(path)
            if newest is None:
                raise PartcError(f"no checkpoint in {path}")
            path = newest
        step = checkpoint.load(path, self.states)
        manifest = checkpoint_dir.read_manifest(path)
        if isinstance(manifest.get("schedule"), dict):
            self.runner.schedule_lr = LRSchedule.from_dict(manifest["schedule"])
        data = manifest.get("data")
        self._data = dict(data) if isinstance(data, dict) and isinstance(data.get("position"), int) else None
        self.next_step = step
        return step


def load(out_dir: str | Path, *, seed: int = 0, optimizer: str = "adamw", lr: float = 3e-4,
         weight_decay: float = 0.0, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
         lr_schedule: str = "constant", warmup_steps: int = 0, lr_decay_steps: int = 0, min_lr: float = 0.0,
         grad_clip: float | None = None, init_checkpoint: str | Path | None = None,
         collective_timeout_s: float = 600.0) -> Program:
    """Set up this rank's part of the compiled program in `out_dir` (run under torchrun). A collective that
    waits longer than `collective_timeout_s` fails (every process group of the mesh). The schedule and clipping:
    `partc.runtime.optim`."""
    files = read_program(out_dir)
    opt_config = OptimizerConfig(name=optimizer, lr=lr, weight_decay=weight_decay, beta1=beta1, beta2=beta2,
                                 eps=eps)
    schedule = LRSchedule(kind=lr_schedule, lr=lr, warmup=warmup_steps, total=lr_decay_steps, min_lr=min_lr)
    if grad_clip is not None and not grad_clip > 0:
        raise PartcError(f"--grad-clip must be > 0, got {grad_clip}")
    # 1. The mesh (pp, dp, tp).
    world = init_world(files.plan.parallel, timeout_s=collective_timeout_s)
    prog = build(files, world, seed=seed, optimizer=opt_config, init_checkpoint=init_checkpoint)
    prog.runner.schedule_lr = schedule
    prog.runner.max_norm = grad_clip
    return prog


def meta_model(files: ProgramFiles) -> tuple[ModelSpec, nn.Module, InitRecord]:
    """The model file as compiled, its model built on meta, and the record of how its construction sets each
    tensor (step 2 of `load`)."""
    spec = _load_spec(files)
    return (spec, *build_model(spec))


def build(files: ProgramFiles, world: World, *, seed: int = 0, optimizer: OptimizerConfig | None = None,
          init_checkpoint: str | Path | None = None,
          model: tuple[ModelSpec, nn.Module, InitRecord] | None = None) -> Program:
    """Steps 2-5 of `load` on a mesh already joined (`partc.runtime.check` builds it outside its fake tensor mode,
    which device meshes do not run under, and passes the `meta_model` it built outside that mode too: a model's
    own construction may do what fake tensors refuse, as Hugging Face's does)."""
    par = files.plan.parallel
    opt_config = optimizer or OptimizerConfig()
    # The stage files find their groups through `collectives`.
    set_groups(world.groups)
    set_expert_imbalance(par.imbalance)

    # 2. The model with parameters on meta, which parameters the program splits over tp, and the stage shapes
    #    (the stage files chained on meta up to this rank's last stage, on this rank's shard shapes).
    spec, model, init = model if model is not None else meta_model(files)
    canon = canonical_names(model, files.tied)
    layout = TPLayout.from_manifest(files.tp, world.tp_rank, canon).with_experts(files.ep, world.ep_rank, canon)
    local = [_held(st, layout) for st in files.stages if st.rank == world.pp_rank]
    shapes = stage_shapes(files, model, spec, layout, last=local[-1].index)

    # 3. Allocate and fill this rank's stages only (of a split parameter, this tp rank's shard only).
    names = [n for st in local for n in stage_tensor_names(st, model)]
    tensors = materialize(model, names, world.device, layout)
    if init_checkpoint is not None:
        buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
        aliases = aliases_of(canon)
        unset = load_weights(tensors, aliases, open_checkpoint(init_checkpoint), where=str(init_checkpoint),
                             buffers=buffers, layout=layout)
        init_weights(init, {n: tensors[n] for n in unset}, seed, layout)
    else:
        check_initializable(init, tensors)
        init_weights(init, tensors, seed, layout)

    # The state dict's buffers that no stage reads keep their initial values, for full_state_dict.
    held = {n for st in files.stages for n in stage_tensor_names(st, model)}
    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    unheld: dict[str, Tensor] = {}
    init.replay([n for n in model.state_dict() if n in buffers and n not in held], "cpu", seed,
                lambda name, value: unheld.__setitem__(name, value.clone()))

    # 4. One module per stage file; copies of a shared weight in two local stages become separate tensors.
    stages = [StageModule(st, model, canon, world.device) for st in local]
    untie_across_stages(stages)

    # 5. Recomputation and ZeRO (torchtitan's order), optimizers, gradient sync, the pipeline schedule.
    experts = layout.expert_params([n for st in stages for n, _ in st.named_parameters()])
    modules = parallelize(stages, world, par, set(files.blocks), experts=experts)
    optimizers = build_optimizers(stages, opt_config, no_decay(model))
    holders = shared_holders(files, model, canon)
    grad_sync = GradSync(stages, world, holders=holders, canon=canon, experts=experts)
    counter = CommCounter({**{axis: [g] for axis, g in world.groups.items()}, "pp": [world.pp_group, *grad_sync.groups],
                           "dp": [world.dp_group, *world.dp_shard_groups,
                                  *([world.expert_dp_group] if world.expert_dp_group else [])]})
    runner = PipelineRunner(files, spec, world, modules, optimizers, grad_sync, shapes, counter)
    split = {n for n in canon if layout.shard(n) is not None}
    runner.grad_copies = grad_copies(stages, tp=par.tp, dp=par.dp_shard, split=split, experts=experts, ep=par.ep,
                                     holders={c: len(idx) for c, idx in holders.items()}, canon=canon)
    return Program(files=files, spec=spec, world=world, model=model, stages=stages, optimizers=optimizers,
                   runner=runner, canon=canon, layout=layout, seed=seed, unheld=unheld)


def _held(stage: StageFile, layout: TPLayout) -> StageFile:
    """`stage` as this rank holds it: without the expert modules (of a plain mixture of experts) and their
    parameters that other ep ranks hold (`TPLayout.foreign`)."""
    if not layout.routed:
        return stage
    return dataclasses.replace(stage, modules=[m for m in stage.modules if not layout.foreign(m)],
                               parameters=[n for n in stage.parameters if not layout.foreign(n)],
                               units=[u for u in stage.units if not (isinstance(u, str) and layout.foreign(u))])


def stage_tensor_names(stage: StageFile, model: nn.Module) -> list[str]:
    """FQNs of the parameters and buffers a stage holds: its units' and those its code reads (the root unit ""
    of a model of bare parameters holds all of them)."""
    names = list(stage.parameters) + list(stage.buffers)
    for unit in stage.modules:
        mod = model.get_submodule(unit)
        prefix = f"{unit}." if unit else ""
        names += [prefix + n for n, _ in mod.named_parameters(remove_duplicate=False)]
        names += [prefix + n for n, _ in mod.named_buffers(remove_duplicate=False)]
    return list(dict.fromkeys(names))


def shared_holders(files: ProgramFiles, model: nn.Module, canon: dict[str, str]) -> dict[str, list[int]]:
    """Canonical parameter FQN -> the stages holding a copy (every stage, not only this rank's)."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    holders: dict[str, list[int]] = {}
    for st in files.stages:
        held = {canon[n] for n in stage_tensor_names(st, model) if n in params}
        for c in sorted(held):
            holders.setdefault(c, []).append(st.index)
    return holders


def untie_across_stages(stages: list[StageModule]) -> None:
    """A parameter object in several local stages (interleaved stages holding a tied embedding and head) gets a
    copy per stage: each stage module (and FSDP unit, and optimizer) owns its tensors; `GradSync` sums them."""
    seen: set[int] = set()  # ids of parameters earlier stages hold (alive there, so the ids stay unique)
    for st in stages:
        here = {id(p) for p in st.parameters()}
        copies: dict[int, nn.Parameter] = {}
        for mod in st.modules():
            for key, p in mod._parameters.items():
                if p is not None and id(p) in seen:
                    if id(p) not in copies:
                        copies[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                    mod._parameters[key] = copies[id(p)]
        seen |= here


def _load_spec(files: ProgramFiles) -> ModelSpec:
    """The model file as compiled: token inputs partc synthesizes get the plan's length again. An image model
    (its spec has no length) keeps its own inputs: the plan's ``seq_len`` is then the patch count the trace saw,
    not something ``--seq-len`` set."""
    seq_len = files.plan.model.get("seq_len")
    spec = load_model_file(files.model_path, entry=files.entry)
    if seq_len and spec.seq_len is not None and spec.seq_len != seq_len \
            and not hasattr(spec.module, "example_inputs"):
        spec = load_model_file(files.model_path, entry=files.entry, seq_len=seq_len)  # synthesized HF inputs
    return spec


def _as_args(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, Tensor):
        return (inputs,), {}
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[0], tuple) \
            and isinstance(inputs[1], dict):
        return inputs
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    raise TypeError(f"inputs must be a tensor, a tuple, a dict or (args, kwargs); got {type(inputs).__name__}")


def _no_ep_checkpoints(par) -> None:
    """Sharded checkpoints do not store packed experts divided among ep ranks yet (each rank's part would be saved
    under the whole parameter's name); the full state dict (``--save-full-state-dict``) gathers them."""
    if par.ep > 1:
        raise PartcError("checkpoints of a plan with ep > 1 are not written or read yet; save the full state dict "
                         "(--save-full-state-dict) or compile with --ep 1")
