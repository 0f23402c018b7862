"""`partc check OUT`: run one optimizer step of every pipeline rank of a compiled program, at the plan's world size, in
this one CPU process, and hold what it allocates and communicates against the plan's ``predicted.ranks``.

For each representative GPU (`representatives`: one per pipeline rank, at dp and tp coordinate 0; the others of
that pipeline rank run the same code on tensors of the same shapes) `check_rank`:

1. joins a fake process group of the plan's world size as that global rank
   (``torch.testing._internal.distributed.fake_pg``: its collectives move nothing and return at once) and builds
   the mesh exactly as `partc.runtime.mesh.init_world` does under torchrun;
2. under ``FakeTensorMode`` (tensors with shapes, dtypes and devices but no storage: a 175B model costs no memory),
   builds the runtime's program as `partc.runtime.api.load` does (`partc.runtime.api.build`: stages, ZeRO wrapping,
   precision, optimizers, the plan's pipeline schedule);
3. creates the optimizer states (AdamW creates them lazily in its first step, so one step on zero gradients, as
   every step after a run's first has them), then runs one step: the schedule's forwards and backwards over every
   micro-batch of this rank's slice of the global batch, the shared weights' sums, and the optimizer step.

The pipeline neighbours are not in the process. The fake process group's ``recv`` leaves the receive buffer as it is,
a tensor of the boundary's shape and dtype (`partc.runtime.train.stage_shapes`), so each stage runs on stand-ins of
its inputs and gradients. The schedule's warm-up vote (every stage says whether its shapes are static; an integer
over ``send``/``recv`` and ``.item()``, which fake tensors cannot give) is answered for the neighbours with what
they would answer: static, as every stage of a partc program is built with static shapes (checked on the local
ones).

Measured, per representative:

- traffic: the runtime's own `partc.runtime.comm.CommCounter`, the quantity of ``predicted.ranks[].comm_bytes``;
- memory: ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (every tensor's storage, by what it is),
  folded into the plan's categories (`CATEGORIES`); for each, the most it holds at any moment of the step, and the
  peak of the total. The plan's ``buffers`` (NCCL's communicator memory) has no counterpart on a CPU: it is added to
  the measured peak for the question whether the plan fits, not compared. Neither is the caching allocator's
  rounding and fragmentation, which the cluster's memory reserve is for.

A row agrees when measured and predicted differ by at most `TOLERANCE` of the larger, or by at most `SLACK_BYTES`
(``--slack-bytes``): a few KiB of a tiny model, or a category the plan expects empty, are not a disagreement.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import multiprocessing
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from partc._torch import FakeStore, InferenceMode, mod_tracker_module
from partc.cluster import Cluster
from partc.collectives import set_groups
from partc.value_sized import expected_sizes
from partc.errors import PartcError
from partc.mesh_axes import AXES_BY_NAME, MESH_AXES, SUB_AXES
from partc.parallel import SHOWN_AXES, Parallel
from partc.runtime.api import Program, build, meta_model
from partc.runtime.mesh import init_world, rank_record
from partc.runtime.optim import OptimizerConfig
from partc.runtime.parallelize import reshard
from partc.runtime.program import ProgramFiles, read_program
from partc.runtime.check_tracker import CATEGORIES, Tracker, categories

TOLERANCE = 0.10
"""A measured number agrees with the plan's when they differ by at most this fraction of the larger."""

SLACK_BYTES = 1 << 20
"""Differences up to this many bytes agree whatever the fraction (tiny test models, a loss's few bytes)."""

AXES = (*(AXES_BY_NAME[a] for a in SHOWN_AXES), *SUB_AXES)
"""The axes whose traffic is compared, in the order the rows show them: the mesh's as `partc.parallel.SHOWN_AXES`,
then the sub-axes (``ep``), each where the plan uses it (`MeshAxis.in_use`)."""


@dataclass(kw_only=True, slots=True)
class RankCheck:
    """What one representative GPU did in one step, next to what the plan predicted for its pipeline rank."""

    rank: int
    """Global rank of the representative."""
    coords: dict[str, int]
    """Its coordinate on each mesh axis (`Parallel.coords`)."""
    comm_bytes: dict[str, int]
    """Measured collective payload by axis (the plan's axes in use, `AXES`)."""
    memory_bytes: dict[str, int]
    """Measured: the most each category (`CATEGORIES`) held at any moment of the step; ``total``: the peak."""
    predicted_comm_bytes: dict[str, float]
    predicted_memory_bytes: dict[str, float]
    """The plan's ``predicted.ranks[pp_rank].memory_bytes`` (``buffers`` included)."""
    usable_bytes: float
    """The cluster's usable memory per GPU (its size less the reserve)."""
    slack_bytes: float = SLACK_BYTES
    """Differences up to this many bytes agree whatever the fraction."""
    seconds: float
    """Wall time of this rank's check (build and step)."""

    @property
    def pp_rank(self) -> int:
        """The pipeline rank: the plan predicts per pipeline rank."""
        return self.coords["pp"]

    def rows(self) -> list[Row]:
        """Every compared quantity of this rank: memory by category, the peak, traffic by axis."""
        mem, pred = self.memory_bytes, self.predicted_memory_bytes
        out = [Row(pp_rank=self.pp_rank, what=f"memory {c}", predicted=float(pred.get(c, 0.0)),
                   measured=mem[c], slack=self.slack_bytes) for c in CATEGORIES]
        # The peak against the plan's total less the communicator buffers, which the tracker cannot see.
        out.append(Row(pp_rank=self.pp_rank, what="memory peak",
                       predicted=float(pred.get("total", 0.0)) - float(pred.get("buffers", 0.0)),
                       measured=mem["total"], slack=self.slack_bytes))
        out += [Row(pp_rank=self.pp_rank, what=f"comm {axis}", predicted=float(self.predicted_comm_bytes.get(axis, 0)),
                    measured=self.comm_bytes.get(axis, 0), slack=self.slack_bytes)
                for axis in (a.name for a in AXES) if axis in self.comm_bytes]
        return out

    @property
    def needed_bytes(self) -> float:
        """The measured peak plus the plan's communicator buffers: what the GPU must hold."""
        return self.memory_bytes["total"] + float(self.predicted_memory_bytes.get("buffers", 0.0))

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.usable_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**rank_record(self.rank, self.coords), "comm_bytes": dict(self.comm_bytes),
                "memory_bytes": dict(self.memory_bytes),
                "predicted_comm_bytes": dict(self.predicted_comm_bytes),
                "predicted_memory_bytes": dict(self.predicted_memory_bytes), "needed_bytes": self.needed_bytes,
                "usable_bytes": self.usable_bytes, "slack_bytes": self.slack_bytes, "fits": self.fits, "seconds": self.seconds,
                "rows": [r.to_dict() for r in self.rows()]}


@dataclass(kw_only=True, slots=True)
class Row:
    """One compared quantity of one pipeline rank."""

    pp_rank: int
    what: str
    """``memory CATEGORY``, ``memory peak`` or ``comm AXIS``."""
    predicted: float
    measured: float
    slack: float = SLACK_BYTES
    """Differences up to this many bytes agree whatever the fraction."""

    @property
    def error(self) -> float:
        """(measured - predicted) / the larger of the two; 0 when both are 0."""
        scale = max(abs(self.predicted), abs(self.measured))
        return (self.measured - self.predicted) / scale if scale else 0.0

    @property
    def agrees(self) -> bool:
        return abs(self.error) <= TOLERANCE or abs(self.measured - self.predicted) <= self.slack

    def to_dict(self) -> dict[str, Any]:
        return {"pp_rank": self.pp_rank, "what": self.what, "predicted": self.predicted, "measured": self.measured,
                "error": self.error, "agrees": self.agrees}


def representatives(par: Parallel, pp_ranks: Iterable[int] | None = None) -> list[int]:
    """Global ranks checked: one per pipeline rank (all of them, or those of `pp_ranks`, in order), at dp and tp
    coordinate 0."""
    if pp_ranks is None:
        chosen = range(par.pp)
    else:
        chosen = sorted(set(pp_ranks))
        outside = [r for r in chosen if not 0 <= r < par.pp]
        if not chosen:
            raise PartcError("--pp-ranks names no pipeline rank")
        if outside:
            raise PartcError(f"--pp-ranks: pipeline rank {outside[0]} is not in the plan, whose pipeline ranks are "
                             f"0 to {par.pp - 1}")
    return [par.rank_of(**{**dict.fromkeys(MESH_AXES, 0), "pp": r}) for r in chosen]


def check_program(out_dir: str, *, optimizer: str = "adamw", slack_bytes: float = SLACK_BYTES, jobs: int = 1,
                  pp_ranks: Iterable[int] | None = None,
                  progress: Callable[[int, int], None] | None = None,
                  started: Callable[[int], None] | None = None) -> list[RankCheck]:
    """Check every representative of the program in `out_dir` (`check_rank`), or those of the pipeline ranks
    `pp_ranks` (a 16-stage plan's first and last ranks hold the embeddings and the loss: checking those two takes an
    eighth of the time), `jobs` of them at a time, in processes of their own. `started(n)` is told how many there are; `progress(done, rank)` is called
    when a check starts (done: how many finished) and with rank -1 at the end."""
    if dist.is_initialized():
        raise PartcError("partc check runs in a process of its own, outside torchrun")
    if jobs < 1:
        raise PartcError(f"--jobs must be at least 1, got {jobs}")
    files = read_program(out_dir)
    predicted_ranks(files)  # user errors before minutes of work
    Cluster.from_dict(files.plan.cluster)
    ranks = representatives(files.plan.parallel, pp_ranks)
    if started is not None:
        started(len(ranks))
    tell = progress or (lambda done, rank: None)
    results: dict[int, RankCheck] = {}
    # Always in processes of their own (one with jobs = 1): a fresh process inherits no process group and no fake
    # mode, and the fake world's device meshes and groups do not outlive the check in the caller's process (a
    # program loaded there afterwards would resolve stale process-group names).
    with _processes(min(jobs, len(ranks))) as pool:
        running = {pool.submit(_check_in_worker, str(out_dir), rank, optimizer, slack_bytes): rank
                   for rank in ranks}
        tell(0, ranks[0])
        for done in concurrent.futures.as_completed(running):
            try:
                results[running[done]] = done.result()
            except concurrent.futures.BrokenExecutor:
                raise PartcError(f"global rank {running[done]} could not be checked: its process ended without "
                                 f"an answer (out of host memory, or a crash in native code)") from None
            tell(len(results), next((r for r in ranks if r not in results), -1))
    tell(len(ranks), -1)
    return [results[r] for r in ranks]


def _processes(workers: int) -> concurrent.futures.Executor:
    """`workers` spawned processes for `check_program` (the test suite swaps in processes it keeps for the session:
    a check's imports cost about as much as a tiny program's check)."""
    return concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


def _check_in_worker(out_dir: str, rank: int, optimizer: str, slack_bytes: float) -> RankCheck:
    torch.set_num_threads(1)
    files = read_program(out_dir)
    try:
        return check_rank(files, rank, optimizer=optimizer, slack_bytes=slack_bytes)
    except PartcError:
        raise
    except (Exception, SystemExit) as e:  # the program (the model's own code) failed on fake tensors: one line
        raise PartcError(f"global rank {rank} could not be checked: its program failed on fake tensors with "
                         f"{_failure(e)} (partc check runs the program without data: a program that fails here "
                         f"fails under `partc run` too, unless the failing op needs real tensor values)") from None


def _failure(e: BaseException) -> str:
    """``Type: first line`` of `e`, and of the exception that caused it at the end of its chain: the pipeline
    schedule wraps what a stage raised in a ``RuntimeError`` whose own message names only the stage."""
    def line(x: BaseException) -> str:
        return f"{type(x).__name__}: {(str(x).strip().splitlines() or [''])[0].strip()[:300]}"

    root = e
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    return line(e) if root is e else f"{line(e)} caused by {line(root)}"


def check_rank(files: ProgramFiles, rank: int, *, optimizer: str = "adamw",
               slack_bytes: float = SLACK_BYTES) -> RankCheck:
    """One step of global rank `rank` of the program on fake tensors and a fake process group (module docstring)."""
    par = files.plan.parallel
    start = time.perf_counter()
    model = meta_model(files)  # outside the fake mode: a model's own construction may do what fake tensors refuse
    with _fake_world(par, rank):
        world = init_world(par)
        # a value-sized op (a mixture's routing: fake tensors hold no values) at the plan's expected size
        with FakeTensorMode(allow_non_fake_inputs=True), _no_profiler_labels(), \
                expected_sizes(files.plan.model, par.micro_batch_size) or contextlib.nullcontext():
            prog = build(files, world, optimizer=OptimizerConfig(name=optimizer), model=model)
            _answer_warmup_vote(prog)
            _create_optimizer_states(prog)
            (args, kwargs), targets = prog.batch(0)
            tracker = Tracker(prog, categories(par.zero))
            with tracker, _tracker_hooks_released(prog), tracker.sharding_propagation_untracked():
                prog.runner.forward_backward(args, kwargs, targets)
                reshard(prog.runner.modules)
                for opt in prog.optimizers:
                    opt.step()
            memory = tracker.categories()
    mine = predicted_ranks(files)[world.pp_rank]
    return RankCheck(rank=rank, coords=dict(world.coords),
                     comm_bytes={a.name: int(prog.runner.comm_bytes.get(a.name, 0))
                                 for a in AXES if a.in_use(files.plan.parallel)},
                     memory_bytes=memory, predicted_comm_bytes=mine["comm_bytes"],
                     predicted_memory_bytes=mine["memory_bytes"],
                     usable_bytes=float(Cluster.from_dict(files.plan.cluster).usable_memory_bytes),
                     slack_bytes=slack_bytes, seconds=time.perf_counter() - start)


def predicted_ranks(files: ProgramFiles) -> list[dict[str, dict[str, float]]]:
    """The plan's ``predicted.ranks``: per pipeline rank, ``memory_bytes`` and ``comm_bytes`` (name -> bytes)."""
    where = files.out_dir / "plan.json"
    ranks = files.plan.predicted.get("ranks")
    pp = files.plan.parallel.pp
    if not isinstance(ranks, list) or len(ranks) != pp:
        raise PartcError(f"{where}: predicted.ranks must list {pp} pipeline ranks; compile again")
    out = []
    axes = tuple(a.name for a in AXES if a.in_use(files.plan.parallel))
    for i, entry in enumerate(ranks):
        got = {}
        for key, names in (("memory_bytes", (*CATEGORIES, "buffers", "total")), ("comm_bytes", axes)):
            value = entry.get(key) if isinstance(entry, dict) else None
            if not isinstance(value, dict) or not all(
                    isinstance(value.get(n), (int, float)) and not isinstance(value.get(n), bool)
                    and math.isfinite(value[n]) and value[n] >= 0 for n in names):
                raise PartcError(f"{where}: predicted.ranks[{i}].{key} must give {', '.join(names)} as bytes "
                                 f"(numbers >= 0); compile again")
            got[key] = {n: float(value[n]) for n in names}
        out.append(got)
    return out


@contextlib.contextmanager
def _fake_world(par: Parallel, rank: int) -> Iterator[None]:
    """This process as global rank `rank` of a fake process group of the plan's world size."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=par.world_size)
    try:
        yield
    finally:
        set_groups({})
        dist.destroy_process_group()


@contextlib.contextmanager
def _no_profiler_labels() -> Iterator[None]:
    """``record_function`` labels (FSDP's, the pipeline schedule's, the optimizer's step) that mark nothing: no
    profiler runs in the check. Each label is two ops (``profiler._record_function_enter_new`` and its exit), which
    the fake tensor mode and the memory tracker dispatch as any other (about a millisecond the pair), on no tensor:
    they neither allocate nor communicate."""
    label = torch.autograd.profiler.record_function
    enter = label.__enter__

    def skip(self: Any) -> Any:
        self.run_callbacks_on_exit = False  # ``__exit__`` then returns before its op
        return self

    label.__enter__ = skip
    try:
        yield
    finally:
        label.__enter__ = enter


def _answer_warmup_vote(prog: Program) -> None:
    """The pipeline schedule's warm-up vote, answered for the absent neighbours (module docstring)."""
    schedule = prog.runner.schedule

    def vote(stages: list, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            assert not InferenceMode.needs_dynamic(stage._user_meta, has_backward), stage.stage_index
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = vote


@contextlib.contextmanager
def _tracker_hooks_released(prog: Program) -> Iterator[None]:
    """Let each micro-batch's autograd graph go after its backward, as it does without the tracker. The tracker's
    module hooks (``ModTracker``: ``register_multi_grad_hook`` on the inputs and outputs of every module) put on
    each such tensor a hook whose closure holds the tensor's gradient node: a cycle through C++ that Python's
    collector cannot see, so the nodes stayed alive to the end of the step, and with them the leaves they end in,
    the received inputs (measured: one boundary per micro-batch and chunk more than a run without the tracker
    holds, the received 1/t part under tensor parallelism). Here the hooks registered during a micro-batch's
    forward are removed after its backward, when they have fired."""
    module = mod_tracker_module()
    register = module.register_multi_grad_hook
    handles: dict[tuple[int, int], list] = {}
    current: list[tuple[int, int] | None] = [None]

    def recorded(*args: Any, **kwargs: Any) -> Any:
        handle = register(*args, **kwargs)
        if current[0] is not None:
            handles.setdefault(current[0], []).append(handle)
        return handle

    originals = []
    for stage in prog.runner.stages:
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
        originals.append((stage, forward, backward))

        def forward_one_chunk(fwd_chunk_id: int, *args: Any, _stage: Any = stage, _forward: Any = forward,
                              **kwargs: Any) -> Any:
            current[0] = (_stage.stage_index, fwd_chunk_id)
            try:
                return _forward(fwd_chunk_id, *args, **kwargs)
            finally:
                current[0] = None

        def backward_one_chunk(bwd_chunk_id: int, *args: Any, _stage: Any = stage, _backward: Any = backward,
                               **kwargs: Any) -> Any:
            out = _backward(bwd_chunk_id, *args, **kwargs)
            for handle in handles.pop((_stage.stage_index, bwd_chunk_id), ()):
                handle.remove()
            return out

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
    module.register_multi_grad_hook = recorded
    try:
        yield
    finally:
        module.register_multi_grad_hook = register
        for stage, forward, backward in originals:
            stage.forward_one_chunk, stage.backward_one_chunk = forward, backward


@torch.no_grad()
def _create_optimizer_states(prog: Program) -> None:
    """The states every step after a run's first holds, made as the optimizer's first step makes them. AdamW (an
    ``Adam``) makes them in its own ``_init_group``, which is called alone: the update that follows it in a step
    would cost the check as many fake-tensor ops as the measured step's, for values fake tensors do not hold. SGD
    without momentum holds no state; any other optimizer takes one step on zero gradients."""
    for opt in prog.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        if isinstance(opt, torch.optim.Adam):
            for group in opt.param_groups:
                opt._init_group(group, [], [], [], [], [], [])
        elif not (isinstance(opt, torch.optim.SGD) and all(g["momentum"] == 0 for g in opt.param_groups)):
            opt.step()
        opt.zero_grad(set_to_none=True)
