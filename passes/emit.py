"""Python source for the generated stage files: statements, unit functions, the stage's forward, the header.

Generated code is an output of data, so nothing reaches it as pasted text: names of parameters, buffers, units and
modules are Python literals (``repr``), Python names are checked identifiers, and text from the model (module
paths, source lines, file names) goes into comments and the docstring only after `comment` / `doc_text` made it one
line that cannot end the comment or the string.
"""

from __future__ import annotations

import keyword
import math
import operator
import re
import sys

import torch
import torch.fx

from partc import collectives
from partc.errors import PartcError


def comment(text: str) -> str:
    """`text` as one comment line's content: line breaks (every kind Python or an editor honours) become spaces,
    other control characters go."""
    text = " ".join(str(text).splitlines())
    if not text.isprintable():
        text = "".join(c if c.isprintable() else " " for c in text)
    return text.strip()


def doc_text(text: str) -> str:
    """`text` for a triple-quoted docstring: one line, with backslashes and quotes escaped (no ``\"\"\"`` ends it)."""
    return comment(text).replace("\\", "\\\\").replace('"', '\\"')


def py_name(name: str, taken: set[str]) -> str:
    """A Python identifier for `name`, not a keyword and not in `taken` (which it joins)."""
    base = re.sub(r"\W", "_", name, flags=re.ASCII)
    if not base or base[0].isdigit() or keyword.iskeyword(base) or not base.isidentifier():
        base = f"v_{base}"
    out, i = base, 1
    while out in taken or keyword.iskeyword(out):
        i += 1
        out = f"{base}_{i}"
    taken.add(out)
    return out


class Emitter:
    """Python source for one node's call; `needs` collects the imports it used (``operator``, ``tp``)."""

    def __init__(self, names: dict[torch.fx.Node, str]):
        self.names = names
        self.needs: set[str] = set()

    def arg(self, a) -> str:
        if isinstance(a, torch.fx.Node):
            return self.names[a]
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.arg(x) for x in a)
            if isinstance(a, tuple):
                return f"({inner},)" if len(a) == 1 else f"({inner})"
            return f"[{inner}]"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k!r}: {self.arg(v)}" for k, v in a.items()) + "}"
        if isinstance(a, torch.device):
            return "device"
        if isinstance(a, (torch.dtype, torch.memory_format, torch.layout)):
            return str(a)  # torch.float32, torch.contiguous_format, torch.strided: names from torch itself
        if isinstance(a, float):
            if math.isinf(a):
                return "float('inf')" if a > 0 else "-float('inf')"
            if math.isnan(a):
                return "float('nan')"
            return repr(a)
        if isinstance(a, (bool, int, str)) or a is None:
            return repr(a)
        if isinstance(a, slice):
            return f"slice({self.arg(a.start)}, {self.arg(a.stop)}, {self.arg(a.step)})"
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise PartcError(f"codegen: symbolic value {a} in the graph; partc needs static shapes")
        raise PartcError(f"codegen cannot write the argument {a!r} ({type(a).__name__})")

    def function(self, node: torch.fx.Node) -> str:
        """The callee of `node` as a dotted name (from torch's own op registry or partc's collectives)."""
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            ns = t.namespace
            packet = t._overloadpacket.__name__
            return f"{'aten' if ns == 'aten' else f'torch.ops.{ns}'}.{packet}.{t._overloadname}"
        if isinstance(t, torch._ops.OpOverloadPacket):
            return f"torch.ops.{t._qualified_op_name.replace('::', '.')}"
        if collectives.is_collective(t):
            self.needs.add("tp")
            return f"tp.{t.__name__}"
        if getattr(t, "__module__", None) == "_operator" or t in vars(operator).values():
            self.needs.add("operator")
            return f"operator.{t.__name__}"
        if getattr(t, "__module__", "").startswith("torch") and hasattr(t, "__name__"):
            name = f"{t.__module__}.{t.__name__}"
            if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name, flags=re.ASCII):
                return name
        raise PartcError(f"codegen cannot call {t!r} (node {node.name}); only ATen ops and getitem are supported")

    def args(self, node: torch.fx.Node) -> str:
        return ", ".join([self.arg(a) for a in node.args] + [f"{k}={self.arg(v)}" for k, v in node.kwargs.items()])

    def call(self, node: torch.fx.Node) -> str:
        if node.target is operator.getitem:
            return f"{self.arg(node.args[0])}[{self.arg(node.args[1])}]"
        return f"{self.function(node)}({self.args(node)})"


def tuple_expr(names: list[str]) -> str:
    """``(a,)``, ``(a, b)`` or ``()``."""
    return f"({names[0]},)" if len(names) == 1 else f"({', '.join(names)})"


def structure_expr(spec, names: list[str]) -> str:
    """A Python expression rebuilding the model's output structure (a pytree spec) from flat output names. A
    dataclass-like output (Hugging Face's ``ModelOutput``) is imported by its module and name at run time."""
    it = iter(names)

    def build(s) -> str:
        if s.is_leaf():
            return next(it)
        typ = s.type
        kids = [build(c) for c in s.children()]
        if typ is tuple:
            return tuple_expr(kids)
        if typ is list:
            return f"[{', '.join(kids)}]"
        if typ is dict:
            return "{" + ", ".join(f"{k!r}: {v}" for k, v in zip(s.context, kids)) + "}"
        keys = s.context
        if isinstance(keys, (list, tuple)) and all(isinstance(k, str) for k in keys) and len(keys) == len(kids):
            if getattr(sys.modules.get(typ.__module__), typ.__name__, None) is not typ:
                raise PartcError(f"codegen cannot rebuild the model's output type {typ.__qualname__!r}: module "
                                 f"{typ.__module__!r} has no top-level name {typ.__name__!r} for it; define the "
                                 f"class at the top level of its module")
            cls = f"getattr(importlib.import_module({typ.__module__!r}), {typ.__name__!r})"
            return f"{cls}(**{{{', '.join(f'{k!r}: {v}' for k, v in zip(keys, kids))}}})"
        raise PartcError(f"codegen cannot rebuild the model output type {typ.__name__}")

    return build(spec)
