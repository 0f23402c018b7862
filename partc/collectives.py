"""The collectives of the generated stage files, which import this module (``from partc import collectives as tp``)
and call its functions by these names. Each axis's are in a module of their own:

- `partc.collectives_tp`: tensor and sequence parallelism (Megatron-LM's conjugate functions, the pipeline
  boundaries' scatter and gather over tp, the vocabulary-parallel embedding and cross-entropy);
- `partc.collectives_cp`: context parallelism (each rank's tokens and positions, attention over the whole
  sequence);
- `partc.collectives_ep`: expert parallelism (the all-to-alls to the routed experts and back, the rows each rank's
  experts receive);
- `partc.collectives_groups`: the process group of each axis (`set_groups`, which the runtime fills from its mesh)
  and the primitives they share.
"""

from __future__ import annotations

# Re-exported: the stage code and the runtime read them as collectives.NAME.
from partc.collectives_cp import (cp_arange, cp_attention, cp_cut, cp_cut_targets, cp_rank_positions,
                                  cp_slice)
from partc.collectives_ep import (counting_expert_rows, each_expert, expert_parallel, held_experts,
                                  set_expert_imbalance)
from partc.collectives_groups import axis_group, set_groups
from partc.collectives_tp import (copy_to_tp, gather_from_previous_stage, gather_from_sp, gather_from_tp,
                                  linears_from_sp, masked_embedding, reduce_from_tp, reduce_scatter_to_sp,
                                  reduce_scatter_to_tp, scatter_to_next_stage, scatter_to_tp,
                                  vocab_parallel_cross_entropy)


def is_collective(fn) -> bool:
    """Whether `fn` is one of the functions here, which the stage code calls as ``tp.<name>``."""
    name = getattr(fn, "__name__", None)
    return isinstance(name, str) and not name.startswith("_") and globals().get(name) is fn
