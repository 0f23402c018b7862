"""Cache keys derived from what a cached quantity reads of a `Parallel` (`Reads`), never listed by hand.

The search (`partc.passes.search_costs`) and the cost model (`partc.passes.cost`, `partc.passes.assemble`) cache
each quantity of a configuration under `Reads.key`: every field of `Parallel` but those the quantity declares it
ignores, so configurations that differ only in those share it, and a field added to `Parallel` is in every key.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass, fields
from typing import Any

from partc.parallel import Parallel


@dataclass(frozen=True, slots=True)
class Reads:
    """What a cached quantity reads of a `Parallel`, and so its cache key: the values of every field except the
    ones it declares it `ignores`. A field added to `Parallel` is therefore part of every key until a quantity
    declares itself independent of it (no key lists the fields it reads, so none can leave a new one out).

    A quantity that reads a function of ignored fields (whether the pipeline has more than one rank, the
    micro-batch count) passes that value to `key` as `derived`. `key_of` reads the fields through a getter (the
    search keys configurations before it builds their `Parallel`)."""

    name: str
    """The key's first element: keeps the quantities in one cache apart."""
    ignores: frozenset[str]
    """Fields of `Parallel` the quantity does not depend on (given as any iterable)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ignores", frozenset(self.ignores))
        unknown = self.ignores - {f.name for f in fields(Parallel)}
        assert not unknown, f"{self.name}: not fields of Parallel: {sorted(unknown)}"

    def key(self, par: Parallel, *derived: Any) -> tuple:
        # The search asks one configuration for many keys in a row: those of the last `Parallel` asked (the same
        # object, frozen) are kept, so each is read once per configuration, not once per quantity.
        last = _LAST_KEYS[0]
        if last[0] is not par:
            last = _LAST_KEYS[0] = (par, {})
        known = last[1].get(self.name)
        if known is None or known[0] is not self:
            known = last[1][self.name] = (self, (self.name, _token(_read_getter(type(par), self.ignores)(par))))
        return known[1] + derived if derived else known[1]

    def key_of(self, get, *derived: Any, cls: type | None = None) -> tuple:
        """`key` of the configuration whose field `f` is ``get(f)``."""
        return (self.name, _token(tuple(map(get, _read_fields(cls or Parallel, self.ignores)))), *derived)


_LAST_KEYS: list[tuple[Any, dict[str, tuple[Reads, tuple]]]] = [(None, {})]
"""The last `Parallel` `Reads.key` read, with its keys (one entry: a reference to that object keeps its id its
own)."""


_TOKENS: dict[tuple, int] = {}
_NEXT_TOKEN = itertools.count()
_MAX_TOKENS = 1 << 18  # a search of tiny-8 by brute force makes about 3,500


def _token(values: tuple) -> int:
    """A number for the field values `values` that no other values get, while this process runs: a key holds it
    instead of the values, so the caches hash two items, not a dozen. When the table is full it starts again with
    new numbers (values seen before get a new one: a cache misses, it never confuses two configurations)."""
    token = _TOKENS.get(values)
    if token is None:
        if len(_TOKENS) >= _MAX_TOKENS:
            _TOKENS.clear()
        token = _TOKENS[values] = next(_NEXT_TOKEN)
    return token


@functools.cache
def _read_fields(cls: type, ignores: frozenset[str]) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if f.name not in ignores)


@functools.cache
def _read_getter(cls: type, ignores: frozenset[str]):
    """The values of `_read_fields` as a tuple, read at once (the search keys thousands of configurations)."""
    names = _read_fields(cls, ignores)
    if len(names) > 1:
        return operator.attrgetter(*names)
    return lambda par: tuple(getattr(par, name) for name in names)
