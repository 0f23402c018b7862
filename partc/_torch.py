"""The private PyTorch names partc uses, in one place (so a PyTorch upgrade breaks one file).

- `TorchDispatchMode`: `partc.deferred_init` records every ATen op that builds the model on the meta device, and
  `partc.passes.measure` counts the bytes and FLOPs of each traced op.
- `tree_map`, `tree_flatten`: arguments and results of any structure (tensor, tuple, dict): recorded ops, targets
  sliced per DP rank and per micro-batch.
- `storage_key`: which storage a tensor views (meta tensors have storages but no data pointer).
- ``torch.nn.init._no_grad_trunc_normal_``: replaced while `partc.deferred_init` records a build (it does nothing
  on meta).
- `LazyGraphModule`, `reorder_kwargs`: `partc.passes.rebatch` makes a graph module of its copy of the traced graph
  without generating its Python code (nothing runs it), and flattens inputs in the exported program's order.
- `set_pg_timeout`: ``init_device_mesh`` creates the mesh's groups with c10d's default timeout (30 min, NCCL 10),
  not the one given to ``init_process_group``; `partc.runtime.mesh` sets ``--collective-timeout`` on each.

FSDP2, the pipelining schedules, ZeroRedundancyOptimizer and torch.distributed.checkpoint are used through
their public APIs only.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.distributed_c10d import _set_pg_timeout as set_pg_timeout
from torch.export._tree_utils import reorder_kwargs
from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["LazyGraphModule", "TorchDispatchMode", "reorder_kwargs", "set_pg_timeout", "storage_key", "tree_flatten",
           "tree_map"]


def storage_key(t: Tensor) -> int:
    """An id of the storage `t` views, the same for every view of it, while the storage lives (keep it alive to
    keep the id unique)."""
    return t.untyped_storage()._cdata
