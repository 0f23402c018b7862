"""`partc run OUT [args]`: start torchrun on this machine with the plan's world size.

    partc run partc_out --steps 100
    # = python -m torch.distributed.run --standalone --nproc-per-node W -m partc.runtime partc_out --steps 100

W = dp x tp x pp from ``OUT/plan.json``. ``--standalone`` rendezvouses on a free local port, so several runs can
share a machine. For several machines, call torchrun yourself (``--nnodes``, ``--rdzv-endpoint``) with
``-m partc.runtime OUT``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from partc.errors import PartcError
from partc.plan import read_plan


def torchrun_command(out_dir: str, extra: list[str], nproc_per_node: int | None = None) -> list[str]:
    plan = read_plan(Path(out_dir) / "plan.json")
    world = plan.parallel.world_size
    if nproc_per_node is not None and nproc_per_node != world:
        raise PartcError(f"the plan needs {plan.parallel.world_text()} processes, not --nproc-per-node "
                         f"{nproc_per_node}; compile a plan for {nproc_per_node} GPUs")
    try:
        import torch
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:  # pragma: no cover
        gpus = 0
    if gpus and gpus < world:
        raise PartcError(f"the plan needs {world} GPUs but this machine has {gpus}; run torchrun on several "
                         f"machines (--nnodes) with -m partc.runtime {out_dir}")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
            "-m", "partc.runtime", out_dir, *extra]


def run(out_dir: str, extra: list[str], nproc_per_node: int | None = None) -> int:
    """Run torchrun in the foreground; returns its exit status."""
    cmd = torchrun_command(out_dir, extra, nproc_per_node)
    return subprocess.call(cmd)
