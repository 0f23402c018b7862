"""One training step: data for the step, the pipeline schedule, gradient sync, optimizer step, the loss.

Data. `step` takes a global batch (every rank the same; each DP rank keeps its slice of dim 0, ``[r·G/dp,
(r+1)·G/dp)``); `step_local` takes this rank's slice only, as `partc.runtime.data` reads it (inputs on the
first stage's ranks, targets on the last's). Without data, step k uses the global batch ``torch.manual_seed(seed
+ k); x = example_inputs(G); y = example_targets(G)`` (G = the plan's global batch size), drawn on the CPU on every
rank (so the numbers do not depend on the device type or the plan). The schedule splits the slice into the plan's
micro-batches.

Pipeline. ``torch.distributed.pipelining``: one `PipelineStage` per local stage (stages r, r + pp, ... for
interleaved 1F1B), with static shapes from `stage_shapes` (the stage files run once on meta at the micro-batch
size), and `ScheduleGPipe`, `Schedule1F1B` or `ScheduleInterleaved1F1B` as the plan says, the loss on the last
stage. The stages and the interleaved schedule are `partc.runtime.schedule`'s: receive buffers held only while a
micro-batch needs them, and each chunk gathered once a step, as the plan charges. With pp = 1 the same schedule runs one stage over the same micro-batches, so every plan computes the same
numbers.

Precision. The program runs at the plan's precision (`partc.precision`): FSDP's mixed-precision policy casts the
parameters to the compute dtype, the runner a floating-point model input; the forward's casts (`partc.precision.
Autocast`) are ops of the program, so the stages exchange what the trace had (compute-dtype activations, and an fp32
tensor where the model made one), and the loss is computed in fp32 from the model's outputs upcast.

Context parallelism. Each cp rank runs its tokens of every sample (the manifest's ``cp``: chunks i and 2·cp-1-i,
`partc.collectives.cp_cut`) of the inputs and the targets; its loss is the mean over them, and FSDP averages over
dp x cp, so the gradients are those of the mean over every token (weighed by each rank's counted tokens, below, for
a cross-entropy that ignores targets). A plan with cp needs a loss proven `TOKENS` or `ELEMENTS`.

Loss and gradients. ``loss_fn`` gives each micro-batch's mean; the schedule scales gradients by 1/m
(``scale_grads``) and DP averages over dp, so the gradients are those of the mean over micro-batches and DP ranks,
and so is the returned loss: what one process computes with ``loss_fn(model(x), y)`` on the whole batch when the
loss is a mean over equally many elements per micro-batch (`partc.vocab_loss.ELEMENTS`). A cross-entropy's mean
(`partc.vocab_loss.TOKENS`: partc's default loss, ``F.cross_entropy`` with its ``ignore_index``, Hugging Face's -100
labels) divides by the tokens it counts, which differ between micro-batches and ranks when targets are ignored:
each micro-batch then starts backward from its mean times the share of its targets it counts (read from the
cross-entropy's ``total_weight``: its sum of token losses over its number of targets, the mean itself when none is
ignored), and the loss report's all-reduce sums the counts, from which the loss and the gradients are made the
mean over the batch's counted tokens before the optimizer step (Megatron-LM's and torchtitan's per-token loss): the
whole batch's mean over its counted tokens, exactly. Any other loss (a second term, label smoothing) stays the mean over
micro-batches and ranks.

Traffic. Each step counts what this rank passes to collectives by mesh axis (`partc.runtime.comm`):
`PipelineRunner.comm_bytes`, the quantity the plan predicts as ``predicted.ranks[].comm_bytes``: the pipeline
schedule, FSDP's gathers and reductions and the shared weights' sums; not the one all-reduce of 48 bytes that
reports the loss (with the tokens it counts), checks for non-finite gradients and sums the squares of the
gradients (clipping,
`partc.runtime.optim`).

Optimizer step. The learning rate of the step (`LRSchedule.lr_at`), the gradients clipped to the global norm
``max_norm`` (when set), then each optimizer's step.

With tensor parallelism every tp rank of the last stage computes the same loss from the same (gathered)
outputs and runs backward from it; the program's collectives give each rank the gradient of its shards. Where the
plan's ``tp_loss`` is vocab-parallel, the logits stay split over the vocabulary and the loss is computed from each
rank's columns (`partc.vocab_loss`): the same loss on every tp rank, the gradient of its own columns.

Non-finite numbers. Before the optimizer step every rank checks its gradients, and one all-reduce gives the
global loss and the count of non-finite gradients: if either is not finite, `step` raises `NonFiniteError` on
every rank with the weights untouched (a nan never reaches the weights, the optimizer state or a checkpoint).

Targets go through the schedule as sample indices into this rank's slice (``arange(G/dp)``, split with the
micro-batches); the loss looks the targets up, so targets may be any structure of tensors.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

from partc._torch import tree_map
from partc.collectives import cp_cut, cp_cut_targets
from partc.errors import PartcError
from partc.model_file import ModelSpec
from partc.precision import MASTER_DTYPE, cast_floating, compute_dtype
from partc.runtime.comm import CommCounter
from partc.runtime.mesh import World
from partc.runtime.optim import LRSchedule, clip_, local_sq_norm, set_lr
from partc.runtime.parallelize import reshard
from partc.runtime.program import ProgramFiles
from partc.runtime.schedule import GatherOnceInterleaved1F1B, PipeStage
from partc.sharding import TPLayout
from partc.value_sized import expected_sizes
from partc.vocab_loss import ELEMENTS, TOKENS, CountTokens, program_loss, reduction, trace_program_loss


class NonFiniteError(PartcError):
    """The loss or a gradient is nan or infinite; the step was not applied."""


SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": GatherOnceInterleaved1F1B}


def global_batch(spec: ModelSpec, seed: int, step: int, batch_size: int) -> tuple[tuple, dict, Any]:
    """(args, kwargs, targets) of step `step`: the same on every rank and under every plan (drawn on the CPU)."""
    torch.manual_seed(seed + step)
    with torch.device("cpu"):
        args, kwargs = spec.inputs(batch_size)
        targets = spec.targets(batch_size)
    return args, kwargs, targets


def flatten_inputs(args: tuple, kwargs: dict, keys: list[int | str]) -> list[Tensor]:
    """The model's tensor inputs in the program's order (manifest ``input_keys``)."""
    return [args[k] if isinstance(k, int) else kwargs[k] for k in keys]


def stage_shapes(program: ProgramFiles, model: nn.Module, spec: ModelSpec, layout: TPLayout | None = None, *,
                 last: int | None = None) -> list[tuple[tuple[Tensor, ...], ...]]:
    """(inputs, outputs) of every stage for one micro-batch (of stages 0 to `last` only: a rank needs the chain up
    to its last stage), as meta tensors: the stage files run in a chain on the meta device (no memory, no
    compute). `PipelineStage` takes them as static shapes, so no stage runs a warm-up forward on made-up
    activations (made-up token ids would index out of range). The outputs are contiguous, as `StageModule` returns
    them: torch sizes receive buffers with the strides given here, and a view (an attention mask expanded from a
    row, strides 0) cannot be received into. With tensor parallelism the parameters are this rank's shards
    (`layout`) and the collectives only compute shapes."""
    b = program.micro_batch_size
    dtype = compute_dtype(program.plan.parallel.precision)
    with torch.device("meta"):
        args, kwargs = cast_floating(spec.inputs(b), dtype)
    x = tuple(cp_inputs(program, flatten_inputs(args, kwargs, program.input_keys)))
    p = {n: _meta(t, None if layout is None else layout.local_shape(n, t.shape), dtype)
         for n, t in model.named_parameters(remove_duplicate=False)}
    p |= {n: _meta(t) for n, t in model.named_buffers(remove_duplicate=False)}
    meta = torch.device("meta")
    shapes = []
    sizes = expected_sizes(program.plan.model)  # a value-sized op (never on a boundary) at an expected size
    for st in program.stages[:None if last is None else last + 1]:
        with sizes or contextlib.nullcontext():
            out = tuple(t.contiguous() for t in st.code.forward(p, *x, device=meta))  # as `StageModule` sends them
        shapes.append((x, out))
        x = tuple(t.detach().requires_grad_(t.requires_grad) for t in out)
    return shapes


def cp_inputs(program: ProgramFiles, inputs: list[Tensor]) -> list[Tensor]:
    """Under context parallelism, this cp rank's tokens of each input that holds the sequence (the manifest's
    ``cp.input_dims``); the inputs themselves otherwise."""
    if not program.cp:
        return list(inputs)
    return [t if d is None else cp_cut(t, d, program.cp["seq_len"]) for t, d in zip(inputs, program.cp["input_dims"])]


def _meta(t: Tensor, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """A meta tensor like `t` (at `shape`; a floating-point one in `dtype`)."""
    dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
    out = torch.empty(t.shape if shape is None else shape, dtype=dtype, device="meta")
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else out


class PipelineRunner:
    """Runs training steps of this rank's stages; every rank calls `step` with the same global batch."""

    def __init__(self, program: ProgramFiles, spec: ModelSpec, world: World, modules: list[nn.Module],
                 optimizers: list[torch.optim.Optimizer], grad_sync: Callable[[], None],
                 shapes: list[tuple[tuple[Tensor, ...], ...]], counter: CommCounter):
        par = program.plan.parallel
        self.world = world
        self.program = program
        self.modules = modules
        self.counter = counter
        self.comm_bytes: dict[str, int] = {}
        """What this rank passed to collectives in the last step, by axis (``tp``, ``pp``, ``dp``, ``world``)."""
        self.optimizers = optimizers
        self.params = [p for m in modules for p in m.parameters()]
        self.grad_sync = grad_sync
        self.loss_fn = spec.loss_fn
        self.input_keys = program.input_keys
        self.global_batch_size = par.global_batch_size
        self.num_microbatches = par.num_microbatches
        self.last_code = program.stages[-1].code
        self.dtype = compute_dtype(par.precision)
        """The dtype of the model's floating-point inputs (as the trace had them)."""
        local = [st for st in program.stages if st.rank == world.pp_rank]
        self.has_first = local[0].index == 0
        self.has_last = local[-1].index == program.num_stages - 1
        self.stages = [PipeStage(mod, st.index, program.num_stages, world.device,
                                     input_args=shapes[st.index][0], output_args=shapes[st.index][1],
                                     group=world.pp_group)
                       for st, mod in zip(local, modules)]
        cls = SCHEDULES[par.schedule]
        if par.schedule == "1f1b" and self.num_microbatches < par.pp:
            # With m < p, 1F1B runs every forward before the first backward: GPipe's order (and memory, m <= p
            # micro-batches in flight). torch's Schedule1F1B refuses m < p, so run ScheduleGPipe.
            cls = ScheduleGPipe
        if par.schedule == "interleaved-1f1b":
            self.schedule = cls(self.stages, n_microbatches=self.num_microbatches, loss_fn=self._loss)
        else:
            assert len(self.stages) == 1
            self.schedule = cls(self.stages[0], n_microbatches=self.num_microbatches, loss_fn=self._loss)
        self._targets: Any = None
        self.schedule_lr: LRSchedule | None = None
        """The learning rate by step; None: the optimizers' own (constant)."""
        self.max_norm: float | None = None
        """Clip the gradients to this global norm (None: no clipping)."""
        self.grad_copies: list[tuple[nn.Parameter, float]] = []
        """(parameter, 1 / its copies in the job): the gradient norm's terms (`partc.runtime.optim.grad_copies`)."""
        self.last: dict = {}
        """The last step's ``loss``, ``grad_norm`` (before clipping), ``lr``, ``clipped``."""
        self.vocab_loss = None
        """With tp > 1 and the manifest's ``tp.vocab_loss``: the loss from this rank's vocabulary columns of the
        logits (`partc.vocab_loss`), which the last stage returns split, not gathered."""
        self.token_mean = False
        """The loss is a cross-entropy's mean over the tokens it counts (`partc.vocab_loss.TOKENS`): each
        micro-batch's loss is weighed by its tokens (`_loss`, `_global_mean`)."""
        self._counts: list[tuple[Tensor, int]] = []
        """This step's (tokens counted, targets) of each micro-batch, in the order `_loss` saw them (with
        `token_mean`)."""
        if self.has_last:
            vocab = program.tp.get("vocab_loss") if par.tp > 1 else None
            output = int(vocab["output"]) if vocab is not None else None
            with torch.device("meta"):
                targets = spec.targets(par.micro_batch_size)
                if program.cp:  # this cp rank's tokens
                    targets = cp_cut_targets(targets, program.cp["seq_len"])
            try:
                gm, n = trace_program_loss(self.loss_fn, self.last_code.outputs, list(shapes[-1][1]), targets,
                                           output, par.tp)
                kind = reduction(gm)
            except Exception as e:  # noqa: BLE001 - a loss partc cannot trace: a mean over micro-batches and ranks
                if vocab is not None:
                    raise
                kind = f"the loss could not be traced on meta tensors ({type(e).__name__})"
            if par.cp > 1 and kind not in (TOKENS, ELEMENTS):
                raise PartcError(f"context parallelism (cp {par.cp}) needs a loss that is a mean over the tokens "
                                 f"or the elements of the batch, proven at compile time, but {kind}; compile again")
            self.token_mean = kind == TOKENS
            if vocab is not None:
                self.vocab_loss = program_loss(gm, n, output, int(shapes[-1][1][output].shape[-1]) * par.tp,
                                               par.tp, par.micro_batch_size)

    def _loss(self, output: Any, index: Tensor) -> Tensor:
        """The micro-batch's loss, as backward starts from it: ``loss_fn``'s mean; with `token_mean`, that mean
        times the share of the micro-batch's targets it counts (its sum of token losses over its number of
        targets R; 0 where it counts none), which `_global_mean` makes the mean over the global batch's counted
        tokens. Where no target is ignored the share is 1: the same arithmetic as the mean alone."""
        flat = output if isinstance(output, tuple) else (output,)
        targets = tree_map(lambda t: t[index] if isinstance(t, Tensor) else t, self._targets)
        counter = CountTokens() if self.token_mean and self.vocab_loss is None else contextlib.nullcontext()
        with counter:
            if self.vocab_loss is not None:  # the logits in the compute dtype: the loss upcasts its working copy
                keep = self.vocab_loss.found.output
                loss = self.vocab_loss(tuple(t if i == keep else cast_floating(t, MASTER_DTYPE)
                                             for i, t in enumerate(flat)), targets)
            else:
                loss = self.loss_fn(self.last_code.outputs(cast_floating(flat, MASTER_DTYPE)), targets)
        if not self.token_mean:
            return loss
        found = self.vocab_loss if self.vocab_loss is not None else counter
        count = found.count.to(loss.dtype)
        self._counts.append((count, found.rows))
        return torch.where(count > 0, loss * (count / found.rows), 0.0)  # counting none: nan, times 0

    def dp_slice(self, n: int) -> slice:
        dp, r = self.world.par.dp, self.world.dp_rank
        if n % dp:
            raise ValueError(f"a global batch of {n} samples does not split over {dp} data-parallel ranks")
        return slice(r * n // dp, (r + 1) * n // dp)

    def step(self, args: tuple, kwargs: dict, targets: Any, *, step: int | None = None) -> float:
        """One optimizer step on the global batch; returns the global-batch mean loss (on every rank)."""
        return self._finish(self.forward_backward(args, kwargs, targets), step)

    def step_local(self, inputs: list[Tensor] | None, targets: Any, *, step: int | None = None) -> float:
        """One optimizer step on this rank's slice of the global batch: `inputs` (the model's tensor inputs in the
        program's order) on the first stage's ranks, `targets` on the last's (None elsewhere)."""
        return self._finish(self.forward_backward_local(inputs, targets), step)

    def _finish(self, losses: list[Tensor], step: int | None) -> float:
        loss, bad_grads, sq = self._global_mean(losses)  # the report: 48 bytes, not part of the step's traffic
        reshard(self.modules)  # the gathered copies: stale once the optimizer updates the sharded weights
        if not math.isfinite(loss) or bad_grads:
            what = f"the loss is {loss}" if not math.isfinite(loss) else \
                f"{bad_grads:.0f} gradient tensors hold nan or inf (loss {loss:.6g})"
            raise NonFiniteError(f"{what}: the step was not applied")
        norm = math.sqrt(sq)
        lr = None
        if self.schedule_lr is not None and step is not None:
            lr = self.schedule_lr.lr_at(step)
            set_lr(self.optimizers, lr)
        clipped = self.max_norm is not None and clip_(self.params, norm, self.max_norm)
        for opt in self.optimizers:
            opt.step()
        if lr is None and self.optimizers and self.optimizers[0].param_groups:
            lr = self.optimizers[0].param_groups[0]["lr"]
        self.last = {"loss": loss, "grad_norm": norm, "lr": lr, "clipped": clipped}
        return loss

    def forward_backward(self, args: tuple, kwargs: dict, targets: Any) -> list[Tensor]:
        """The step up to the optimizer on a global batch: this rank's slice of it to `forward_backward_local`."""
        inputs = flatten_inputs(args, kwargs, self.input_keys)
        n = inputs[0].shape[0]
        if n != self.global_batch_size:
            raise ValueError(f"the plan's global batch is {self.global_batch_size} samples, got {n}")
        part = self.dp_slice(n)
        local = [t[part] for t in inputs] if self.has_first else None
        mine = tree_map(lambda t: t[part] if isinstance(t, Tensor) else t, targets) if self.has_last else None
        return self.forward_backward_local(local, mine)

    def forward_backward_local(self, inputs: list[Tensor] | None, targets: Any) -> list[Tensor]:
        """The step up to the optimizer: gradients cleared, the pipeline schedule on this rank's slice of the global
        batch, the shared weights' gradients summed; counts the traffic (`comm_bytes`). Returns the last stage's
        micro-batch losses (empty on other ranks)."""
        device = self.world.device
        n = self.global_batch_size // self.world.par.dp
        if self.has_first:
            assert inputs is not None, "the first stage's ranks need the inputs"
            if inputs[0].shape[0] != n:
                raise ValueError(f"this rank's share of the global batch is {n} samples, got {inputs[0].shape[0]}")
            # The model's floating-point inputs in the compute dtype (FSDP keeps every input's dtype: apply_zero);
            # under context parallelism this cp rank's tokens of them.
            local = [cast_floating(t, self.dtype).to(device, non_blocking=True) for t in cp_inputs(self.program,
                                                                                                    inputs)]
        if self.has_last:
            assert targets is not None, "the last stage's ranks need the targets"
            if self.program.cp:
                targets = cp_cut_targets(targets, self.program.cp["seq_len"])
            self._targets = tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, Tensor) else t,
                                     targets)
        index = torch.arange(n, device=device)

        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        losses: list[Tensor] = []
        self._counts = []
        with self.counter.counting() as counted:
            if self.has_first:
                self.schedule.step(*local, target=index, losses=losses, return_outputs=False)
            else:
                self.schedule.step(target=index, losses=losses, return_outputs=False)
            self.grad_sync()
        self.comm_bytes = dict(counted)
        self._targets = None
        return losses

    def _global_mean(self, losses: list[Tensor]) -> tuple[float, float, float]:
        """(the loss: mean over micro-batches and DP ranks; how many gradient tensors hold nan or inf; the global
        gradient norm squared), on every rank: one all-reduce over the world, where only the ranks of the last stage
        contribute to the loss (each tp rank holds the same loss).

        With `token_mean` each micro-batch's loss is its sum of token losses over its R targets, and the same
        all-reduce sums the global batch's counted tokens N and targets m·dp·cp·R: the loss is the sum of token
        losses over N, and the gradients (the schedule's 1/m and FSDP's average over dp x cp applied to the
        micro-batches' losses) are multiplied by m·dp·cp·R / N here (1 when no target is ignored), the gradient of
        the mean over every counted token of the batch, as one process computes it; before any use of them (the
        norm, clipping, the step)."""
        par = self.world.par
        total = torch.zeros(6, dtype=torch.float64, device=self.world.device)
        if self.has_last:
            assert len(losses) == self.num_microbatches
            if self.token_mean:  # the ranks of other stages learn it from this all-reduce
                rows = torch.tensor([r for _, r in self._counts], dtype=torch.float64, device=total.device)
                total[0] += (torch.stack([l.detach().double() for l in losses]) * rows).sum() / par.tp
                total[3] += torch.stack([c.double() for c, _ in self._counts]).sum() / par.tp
                total[4] += 1.0
                total[5] += rows.sum() / par.tp
            else:
                total[0] += torch.stack([l.detach().double() for l in losses]).mean() / (par.dp * par.cp * par.tp)
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in self.params
                 if p.grad is not None]
        if grads:
            total[1] += torch.stack([~torch.isfinite(g).all() for g in grads]).sum()
        total[2] += local_sq_norm(self.grad_copies, self.world.device)
        dist.all_reduce(total)
        loss, bad, sq, tokens, token_mean, rows = total.tolist()
        self._counts = []
        if token_mean:
            if tokens <= 0:  # one process: a mean over no tokens
                return math.nan, bad, sq
            loss = loss / tokens
            scale = rows / tokens
            if scale != 1.0:
                for g in grads:
                    g.mul_(scale)
                sq *= scale * scale
        return loss, bad, sq
