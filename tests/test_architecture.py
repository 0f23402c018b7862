"""The dependency rule: the compiler (`partc.passes`) and the runtime (`partc.runtime`) depend on the core
(`partc`), never on each other, not even through another module or an import inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

PACKAGES = {"partc": "partc", "partc.passes": "passes", "partc.runtime": "runtime", "partc.cli": "cli"}
ENTRY = {"partc.compile", "partc.compile_notes", "partc.compile_plan", "partc.compile_traces"}
"""Core modules that run the compiler's pipeline (the public API `compile_model`): the core may reach the passes
only through these."""


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """partc modules `name` imports anywhere in its source (top level or inside functions)."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known}
    return found - {name}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_compiler_and_runtime_never_import_each_other():
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    assert any(n.startswith("partc.passes.") for n in graph) and any(n.startswith("partc.runtime.") for n in graph)
    problems = []
    for name in graph:
        reached = _reachable(graph, name)
        if name.startswith("partc.runtime"):
            problems += [f"{name} -> {m}" for m in reached if m.startswith("partc.passes") or m in ENTRY]
        elif name.startswith("partc.passes"):
            problems += [f"{name} -> {m}" for m in reached if m.startswith("partc.runtime")]
        elif not name.startswith("partc.cli") and name not in ENTRY:
            problems += [f"{name} -> {m}" for m in graph[name]
                         if m.startswith(("partc.passes", "partc.runtime", "partc.cli"))]
    assert not problems, "\n".join(sorted(problems))


def test_the_rule_sees_a_violation(tmp_path):
    """The analysis finds an import inside a function, relative or absolute (so the test above can fail)."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from partc.runtime import api\n    from ..passes import cost\n")
    known = {"partc.runtime.api", "partc.runtime", "partc.passes", "partc.passes.cost"}
    assert _imports("partc.runtime.bad", bad, known) >= {"partc.runtime.api", "partc.passes.cost"}
