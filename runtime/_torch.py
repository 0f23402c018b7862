"""The private PyTorch names the runtime uses, in one place (so a PyTorch upgrade breaks one file).

- `TorchDispatchMode`: `materialize.SeedPerTensor` sees each in-place random fill (``normal_``, ``uniform_``)
  to give every parameter its own seed, so initialization does not depend on the plan.
- `tree_map`: targets of any structure (tensor, tuple, dict) are sliced per DP rank and per micro-batch.
- `set_pg_timeout`: ``init_device_mesh`` creates the mesh's groups with c10d's default timeout (30 min, NCCL 10),
  not the one given to ``init_process_group``; `partc.runtime.mesh` sets ``--collective-timeout`` on each.

FSDP2, the pipelining schedules, ZeroRedundancyOptimizer and torch.distributed.checkpoint are used through
their public APIs only.
"""

from __future__ import annotations

from torch.distributed.distributed_c10d import _set_pg_timeout as set_pg_timeout
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

__all__ = ["TorchDispatchMode", "set_pg_timeout", "tree_map"]
