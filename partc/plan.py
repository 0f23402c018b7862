"""plan.json: the readable, editable result of `partc compile` (schema_version 1).

A plan holds the choices (``parallel``, ``tp``, ``stages``) and what the cost model predicts for them
(``predicted``). `--from-plan` reads the choices back, validates them against the model and the cluster and
predicts again; the file is written with sorted keys and no timestamps, so the same inputs give the same bytes.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from partc.errors import PartcError
from partc.parallel import TP_STYLES, Parallel

SCHEMA_VERSION = 1


@dataclass(kw_only=True, slots=True)
class Stage:
    index: int
    """Model chunk index in pipeline order (0 .. pp * virtual_stages - 1)."""
    rank: int
    """Pipeline rank that runs it: index % pp."""
    modules: list[str]
    """Units the chunk owns, in execution order (block FQNs like ``blocks.3`` and top-level modules)."""
    predicted: dict = field(default_factory=dict)


@dataclass(kw_only=True, slots=True)
class Plan:
    model: dict
    cluster: dict
    parallel: Parallel
    tp: dict[str, str]
    stages: list[Stage]
    predicted: dict = field(default_factory=dict)
    alternatives: list[dict] = field(default_factory=list)
    tp_why: dict[str, str] = field(default_factory=dict)
    """At tp > 1: layer FQN -> why the plan keeps it whole or off Megatron's pattern (`partc.passes.tp.explain`);
    written for people, recomputed (not read) by ``--from-plan``."""
    tp_loss: str = ""
    """At tp > 1: ``vocab-parallel`` (the loss computed on the output layer's vocabulary shards, the logits never
    gathered; docs/vocab-parallel-loss.md) or ``gathered: <why>``; recomputed (not read) by ``--from-plan``."""

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "cluster": self.cluster,
            "parallel": self.parallel.to_dict(),
            "tp": dict(self.tp),
            "stages": [{"index": s.index, "rank": s.rank, "modules": list(s.modules), "predicted": s.predicted}
                       for s in self.stages],
            "predicted": self.predicted,
            "alternatives": self.alternatives,
            "tp_why": dict(self.tp_why),
            **({"tp_loss": self.tp_loss} if self.tp_loss else {}),
        }

    def to_json(self) -> str:
        """Strict JSON: a nan or infinite number is an error here, never ``NaN`` in the file."""
        data = self.to_dict()
        bad = _non_finite(data, "plan")
        if bad is not None:
            raise PartcError(f"{bad} is not a finite number; check the cluster's numbers (--cluster)")
        return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"


def _non_finite(value, where: str) -> str | None:
    """The path of the first nan or infinite float in `value` (dicts and lists), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where} = {value}"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, v in items:
        found = _non_finite(v, f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]")
        if found is not None:
            return found
    return None


def write_plan(plan: Plan, out_dir: str | Path) -> Path:
    """Write ``OUT/plan.json`` atomically (a crash never leaves a half-written plan)."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PartcError(f"cannot create output directory {out}: {e.strerror}") from None
    if not out.is_dir():
        raise PartcError(f"output path {out} is not a directory")
    target = out / "plan.json"
    fd, tmp = tempfile.mkstemp(prefix=".plan.", suffix=".json", dir=out)
    with os.fdopen(fd, "w") as f:
        f.write(plan.to_json())
    os.replace(tmp, target)
    return target


def _get(d: dict, key: str, typ, where: str):
    if key not in d:
        raise PartcError(f"{where}: missing field '{key}'")
    value = d[key]
    if typ is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise PartcError(f"{where}: field '{key}' must be an integer, got {value!r}")
    if typ is str and not isinstance(value, str):
        raise PartcError(f"{where}: field '{key}' must be a string, got {value!r}")
    if typ in (dict, list) and not isinstance(value, typ):
        raise PartcError(f"{where}: field '{key}' must be a JSON {typ.__name__.replace('dict', 'object')}")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def read_plan(path: str | Path) -> Plan:
    """Parse and check the structure of a plan file (the model-level checks happen in `validate`)."""
    where = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise PartcError(f"plan file {where} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PartcError(f"cannot read plan file {where}: {e}") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise PartcError(f"plan file {where} is not valid JSON (line {e.lineno}: {e.msg})") from None
    except ValueError as e:
        raise PartcError(f"plan file {where} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise PartcError(f"plan file {where} must hold a JSON object")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PartcError(f"plan file {where} has schema_version {version!r}; this partc reads {SCHEMA_VERSION}")
    parallel = Parallel.from_dict(_get(data, "parallel", dict, where), f"{where}: parallel")
    tp = _get(data, "tp", dict, where)
    for fqn, style in tp.items():
        if style not in TP_STYLES:
            raise PartcError(f"{where}: tp[{fqn!r}] must be one of {', '.join(TP_STYLES)}, got {style!r}")
    stages_raw = _get(data, "stages", list, where)
    stages = []
    for i, s in enumerate(stages_raw):
        ws = f"{where}: stages[{i}]"
        if not isinstance(s, dict):
            raise PartcError(f"{ws} must be a JSON object")
        modules = _get(s, "modules", list, ws)
        if not modules or not all(isinstance(m, str) for m in modules):
            raise PartcError(f"{ws}.modules must be a non-empty list of module names")
        stages.append(Stage(index=i, rank=i % parallel.pp, modules=modules))
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    cluster = data.get("cluster") if isinstance(data.get("cluster"), dict) else {}
    predicted = data.get("predicted") if isinstance(data.get("predicted"), dict) else {}
    return Plan(model=model, cluster=cluster, parallel=parallel, tp=dict(tp), stages=stages, predicted=predicted)
