"""torch.distributed.pipelining's stage and interleaved schedule, holding the memory and traffic the plan charges.

Two behaviours of torch 2.13's pipelining differ from what `partc.passes.cost` charges (and from Megatron-LM, whose
numbers the cost model is calibrated on); both were found by ``partc check`` on the default GPT-3 175B plan:

- **Receive buffers.** `PipelineStage` allocates, when the schedule starts, one receive buffer per micro-batch for
  the activations a stage receives and one for the gradients it receives, and keeps them (and each input's
  gradient, left on the buffer by backward) for the whole run: 2·m boundaries per chunk, 8.9 GB on the first rank of
  the 175B plan (m = 96). `PipeStage` allocates a micro-batch's buffer when its receive is posted and lets it go
  after that micro-batch's backward, so a rank holds the received inputs of the micro-batches in flight (which the
  plan counts with the saved activations, as the first layer saves its input) and a gradient buffer for the
  micro-batch in backward.
- **Gathered chunks.** Lowering an interleaved schedule, torch adds FSDP unshard/reshard actions that keep at most
  three of a rank's chunks gathered (``_add_unshard_reshard(max_active_stages=3)``): with v > 3 chunks a rank gathers
  a chunk again every time it comes back, 3.7x the plan's traffic at v = 6 under ZeRO 1. Under ZeRO 0 and 1 the plan
  gathers each chunk once a step and keeps it (`partc.passes.zero`), so `GatherOnceInterleaved1F1B` gathers each
  local chunk before its first action and releases them all at the end of the step. (ZeRO 2 and 3 stages are not
  FSDP modules to the schedule, `partc.runtime.parallelize.SyncEveryStep`: FSDP's own hooks gather them.)
- **The last stage's inputs.** The schedule keeps each micro-batch's loss to the end of the step (to report it).
  A loss's autograd graph outlives its backward (only the saved tensors go), and the graph ends in the gradient
  accumulator of the stage's received input, a leaf that requires a gradient: the last stage held every micro-batch's
  input to the end of the step (found by ``partc check`` on Hugging Face LLaMA-3 8B, pp 2, v 3, 128 micro-batches:
  3.6 GB, 10% more activations than the plan's). `PipeStage` detaches a loss once its backward has run.
- **The boundaries.** The stage keeps each micro-batch's output (``fwd_cache``) for its backward, and the input it
  received as the leaf its gradient accumulates in, both until that backward. Neither's data is needed there: the
  output's backward starts from the gradient received (its autograd node keeps what the ops saved), and an input
  no op saved is read by none. As Megatron-LM does (``deallocate_output_tensor``) and Meta for Llama 3, `PipeStage`
  replaces the data of each output that needs a gradient once its send is posted (the send's own reference holds
  it until the send is done), and of each received input that needs a gradient once the forward has run, by a
  one-element placeholder of the same shape, keeping the tensor and its autograd node; the backward runs from the
  same tensors as before, so the numbers are the same. A tensor is freed only where nothing else holds its data: no
  op saved it (or a view of it), and no recomputed unit keeps it for its replay
  (`partc.runtime.stage.StageModule.recompute_inputs`). The plan charges what is left
  (`partc.passes.memory._held_bytes`): the boundaries' parts that need no gradient, and the received input where an
  op saved it, with that op's saved tensors.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

from partc._torch import RESHARD, UNSHARD, PipeAction, use_counts


class PipeStage(PipelineStage):
    """`PipelineStage` whose receive buffers live from the receive to the micro-batch's backward, and whose boundaries'
    data goes once the forward has used it (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._sent: dict[int, list[torch.Tensor]] = {}
        """Forward chunk -> its outputs whose data goes once their send is posted."""

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple, kwargs: dict | None = None,
                          save_forward_output: bool = True):
        output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        if self.has_backward and torch.is_grad_enabled():
            outputs, inputs = self.fwd_cache[fwd_chunk_id]
            kept = getattr(self.submod, "recompute_inputs", set())
            if not self.is_first:
                for x in inputs:
                    if _unread(x, kept):
                        _free(x)
            if not self.is_last:
                self._sent[fwd_chunk_id] = [t for t in outputs if _unread(t, kept)]
        return output

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        ops = super().get_fwd_send_ops(fwd_chunk_id)  # each send holds its own reference to the data
        for t in self._sent.pop(fwd_chunk_id, ()):
            _free(t)
        return ops

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        super()._setup_forward_recv_info(num_microbatches, has_backward)
        for infos in self.args_recv_info.values():
            _release(infos)

    def _setup_backward_recv_info(self, num_microbatches: int) -> None:
        super()._setup_backward_recv_info(num_microbatches)
        for infos in self.grad_recv_info.values():
            _release(infos)

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        _allocate(self.args_recv_info[fwd_chunk_id], self.device)
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        _allocate(self.grad_recv_info.get(bwd_chunk_id, ()), self.device)
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def backward_one_chunk(self, bwd_chunk_id: int, loss: torch.Tensor | None = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        # The input's gradient is in the stage's send cache (or already sent); the buffers are no longer read.
        _release(self.args_recv_info.get(bwd_chunk_id, ()))
        _release(self.grad_recv_info.get(bwd_chunk_id, ()))
        if loss is not None and full_backward and not loss._is_view():
            loss.detach_()  # its graph, kept by the schedule's list of losses, would hold the received input


_LIKE = "_partc_like"
"""Attribute of a torch ``_RecvInfo``: (shape, stride, dtype) of the buffer it had, while it has none."""


def _release(infos: tuple) -> None:
    for info in infos:
        buf = info.buffer
        if buf is not None and not info.is_root_arg:
            if not hasattr(info, _LIKE):  # the first buffer's layout (a freed one's placeholder has none)
                setattr(info, _LIKE, (tuple(buf.shape), tuple(buf.stride()), buf.dtype))
            info.buffer = None


def _unread(t: object, kept: set[int]) -> bool:
    """Whether `t`, a boundary tensor the stage holds for a backward, needs a gradient and nothing but the stage's own
    references holds it or its data: no op saved it or a view of it, no recomputed unit keeps it (`kept`), nothing
    else shares its storage. Its own references are the Python object's and, for a leaf, its gradient accumulator's;
    the storage's, the tensor's and the temporary storage object's that asks."""
    if type(t) is not torch.Tensor and not isinstance(t, FakeTensor):  # DTensor and other subclasses: kept
        return False
    if not t.requires_grad or t._base is not None or t.numel() <= 1 or id(t) in kept:
        return False
    tensor, storage = use_counts(t)
    return tensor <= (2 if t.is_leaf else 1) and storage <= 2


def _free(t: torch.Tensor) -> None:
    """Megatron-LM's ``deallocate_output_tensor``: `t` keeps its shape, dtype and autograd node, its data becomes one
    element (expanded, so the backward's shape checks still hold)."""
    t.data = t.new_empty(1).expand(t.shape)


def _allocate(infos: tuple, device: torch.device) -> None:
    for info in infos:
        like = getattr(info, _LIKE, None)
        if info.buffer is None and like is not None:
            shape, stride, dtype = like
            info.buffer = torch.empty_strided(shape, stride, dtype=dtype, device=device)


class GatherOnceInterleaved1F1B(ScheduleInterleaved1F1B):
    """`ScheduleInterleaved1F1B` that gathers each local FSDP chunk once a step (module docstring)."""

    def _prepare_schedule_with_comms(self, actions: dict, format: str = "compute_only") -> None:
        super()._prepare_schedule_with_comms(actions, format)
        for rank, order in self.pipeline_order_with_comms.items():
            self.pipeline_order_with_comms[rank] = gather_once(order)


def gather_once(order: list[PipeAction]) -> list[PipeAction]:
    """A lowered schedule with its UNSHARD/RESHARD actions replaced: each stage unsharded right before its first
    compute action, all resharded at the end."""
    out: list[PipeAction] = []
    gathered: list[int] = []
    for action in order:
        if action.computation_type in (UNSHARD, RESHARD):
            continue
        stages = [a.stage_index for a in action.sub_actions] if action.sub_actions else [action.stage_index]
        if action.is_compute_op:
            for s in stages:
                if s not in gathered:
                    gathered.append(s)
                    out.append(PipeAction(s, UNSHARD, None))
        out.append(action)
    out.extend(PipeAction(s, RESHARD, None) for s in gathered)
    return out
