"""Environment variables set for a block and put back afterwards: what torchrun's workers inherit from `partc run`,
what a model file reads when a test loads it."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Mapping


@contextmanager
def environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set `values` in ``os.environ`` for the block; on leaving it, even by an exception, every name gets back its
    value from before (a name that was unset is unset again)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
