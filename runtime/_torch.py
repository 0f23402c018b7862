"""The private PyTorch names the runtime uses, in one place (so a PyTorch upgrade breaks one file).

- `TorchDispatchMode`: `materialize.SeedPerTensor` sees each in-place random fill (``normal_``, ``uniform_``)
  to give every parameter its own seed, so initialization does not depend on the plan.
- `tree_map`: targets of any structure (tensor, tuple, dict) are sliced per DP rank and per micro-batch.

FSDP2, the pipelining schedules, ZeroRedundancyOptimizer and torch.distributed.checkpoint are used through
their public APIs only.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

__all__ = ["TorchDispatchMode", "tree_map"]
