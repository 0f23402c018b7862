"""The private PyTorch names partc uses, in one place (so a PyTorch upgrade breaks one file).

- `TorchDispatchMode`: `partc.deferred_init` records every ATen op that builds the model on the meta device, and
  `partc.passes.measure` counts the bytes and FLOPs of each traced op, and the runtime reads the token count of
  the loss's cross-entropy (`partc.vocab_loss.CountTokens`).
- `tree_map`, `tree_flatten`, `tree_unflatten`: arguments and results of any structure (tensor, tuple, dict): recorded
  ops, targets sliced per DP rank and per micro-batch, the loss traced on the model's outputs (`partc.vocab_loss`).
- `storage_key`: which storage a tensor views (meta tensors have storages but no data pointer).
- ``torch.nn.init._no_grad_trunc_normal_``: replaced while `partc.deferred_init` records a build (it does nothing
  on meta).
- `LazyGraphModule`, `reorder_kwargs`: `partc.passes.rebatch` makes a graph module of its copy of the traced graph
  without generating its Python code (nothing runs it), and flattens inputs in the exported program's order.
- `set_pg_timeout`: ``init_device_mesh`` creates the mesh's groups with c10d's default timeout (30 min, NCCL 10),
  not the one given to ``init_process_group``; `partc.runtime.mesh` sets ``--collective-timeout`` on each.
- `partc check` (`partc.runtime.check`): `FakeStore` (the fake process group's store), `FSDPMemTracker` with its kinds
  `FSDPRefType` and `TRACKER_TOTAL` (its private hooks ``_update_snap``, ``_update_peak_stats``,
  ``_instrument_optimizer``, ``_fsdp_param_group_post_backward`` are overridden there), and `InferenceMode` with the
  pipeline schedule's ``_warmup_p2p`` and the stage's ``_user_meta`` / ``_inference_mode`` (the warm-up vote it
  answers for absent neighbours), and `mod_tracker_module` (the tracker's ``ModTracker`` module, whose
  ``register_multi_grad_hook`` the check wraps to remove its hooks after each micro-batch's backward).
- `PipeAction`, `UNSHARD`, `RESHARD` (a lowered pipeline schedule's actions) and the hooks of ``PipelineStage``
  (``_setup_forward_recv_info``, ``_setup_backward_recv_info``, ``args_recv_info``, ``grad_recv_info``) and of
  ``ScheduleInterleaved1F1B`` (``_prepare_schedule_with_comms``, ``pipeline_order_with_comms``) that
  `partc.runtime.schedule` overrides, so the pipeline holds the memory and traffic the plan charges; with the stage's
  ``fwd_cache``, `use_counts` (``Tensor._use_count``, ``torch._C._storage_Use_Count``: whether anything else holds a
  pipeline boundary's data before `partc.runtime.schedule` frees it).
- `fsdp_post_backward`: the runtime runs the FSDP post-backward of the packed experts' group when the backward of
  the unit that read their tensors is done (`partc.runtime.parallelize.shard_experts`: the stage code does not call
  their module, whose forward would have registered it).
- Used where they are, named here: ``ShardingPropagator._propagate_tensor_meta_non_cached`` (`partc check` does not
  track the fake tensors DTensor's sharding propagation makes), ``Adam._init_group`` (`partc check` makes AdamW's
  states without an update on fake tensors), ``record_function.run_callbacks_on_exit`` (the check skips profiler
  labels under its fake mode), and in the test driver `partc.runtime.testing`, c10d's ``_world.pg_map`` and DTensor's
  ``_clear_sharding_prop_cache`` / ``clear_redistribute_planner_cache`` (a launch frees each job's groups).

FSDP2, the pipelining schedules otherwise, ZeroRedundancyOptimizer and torch.distributed.checkpoint are used through
their public APIs only.
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import _set_pg_timeout as set_pg_timeout
from torch.export._tree_utils import reorder_kwargs
from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["LazyGraphModule", "TorchDispatchMode", "fsdp_post_backward", "mod_tracker_module", "reorder_kwargs",
           "set_pg_timeout", "storage_key", "tree_flatten", "tree_map", "tree_unflatten",
           "use_counts"]  # and _LAZY's names


def storage_key(t: Tensor) -> int:
    """An id of the storage `t` views, the same for every view of it, while the storage lives (keep it alive to
    keep the id unique)."""
    return t.untyped_storage()._cdata


def use_counts(t: Tensor) -> tuple[int, int]:
    """References to `t`'s tensor (its Python object's, an autograd node's that saved it, a leaf's gradient
    accumulator's) and to its storage (each tensor's viewing it, and the storage object this call makes)."""
    return t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def fsdp_post_backward(module) -> None:
    """FSDP2's post-backward of `module`'s parameter group (an ``FSDPModule``): reduce-scatter (or accumulate) its
    gradients and reshard it, as when the gradients of a forward's inputs arrive. Looked up when called: `partc
    check`'s tracker replaces it on the group."""
    module._get_fsdp_state()._fsdp_param_group.post_backward()


# `partc check`'s and the pipeline's names, imported when first asked for (torch.distributed._tools alone takes seconds to import).
_LAZY = {
    "FSDPMemTracker": ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker"),
    "FSDPRefType": ("torch.distributed._tools.fsdp2_mem_tracker", "_FSDPRefType"),
    "FSDPModMemStats": ("torch.distributed._tools.fsdp2_mem_tracker", "_FSDPModMemStats"),
    "TRACKER_TOTAL": ("torch.distributed._tools.mem_tracker", "_TOTAL_KEY"),
    "InferenceMode": ("torch.distributed.pipelining._utils", "InferenceMode"),
    "FakeStore": ("torch.testing._internal.distributed.fake_pg", "FakeStore"),
    "PipeAction": ("torch.distributed.pipelining.schedules", "_Action"),
    "UNSHARD": ("torch.distributed.pipelining.schedules", "UNSHARD"),
    "RESHARD": ("torch.distributed.pipelining.schedules", "RESHARD"),
}
__all__ += list(_LAZY)


def mod_tracker_module():
    """``torch.distributed._tools.mod_tracker`` (imported when first asked for)."""
    return importlib.import_module("torch.distributed._tools.mod_tracker")


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)
