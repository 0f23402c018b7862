"""partc.runtime: run a compiled program (``OUT/plan.json`` + ``OUT/program/``) under torchrun.

    torchrun --nproc-per-node 4 -m partc.runtime partc_out --steps 100     # or: partc run partc_out --steps 100

`load` returns a `Program` for training loops of your own (see `partc.runtime.api`). Importing this package is
cheap: the generated stage files import `partc.collectives`, and the rest loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from partc.runtime.api import Program, load

__all__ = ["Program", "load"]


def __getattr__(name: str):
    if name in __all__:
        from partc.runtime import api
        return getattr(api, name)
    raise AttributeError(f"module 'partc.runtime' has no attribute {name!r}")
