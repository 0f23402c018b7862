"""Read a compiled program: ``OUT/plan.json`` and ``OUT/program/`` (the manifest and one ``stage_K.py`` a stage).

The files are written by ``partc compile`` (`partc.passes.codegen`); this module only checks that they fit
together (stage ``k`` receives exactly what stage ``k - 1`` sends, each stage runs on the plan's pipeline rank)
and imports the stage files. A stage file defines::

    INPUTS, OUTPUTS, PARAMETERS, BUFFERS, MODULES   # lists of names
    def forward(p, *inputs, device): ...             # p: FQN -> tensor; returns a tuple (len(OUTPUTS))
    def outputs(flat): ...                           # last stage only: the model's output structure
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from partc.errors import PartcError
from partc.plan import Plan, read_plan

_LISTS = ("INPUTS", "OUTPUTS", "PARAMETERS", "BUFFERS", "MODULES", "UNITS")


@dataclass(kw_only=True, slots=True)
class StageFile:
    index: int
    """Stage (model chunk) index in pipeline order."""
    rank: int
    """Pipeline rank that runs it: index % pp."""
    path: Path
    code: ModuleType
    """The imported ``stage_K.py``."""
    inputs: list[str]
    outputs: list[str]
    parameters: list[str]
    """Parameter FQNs the code reads (for a tied weight: the alias this stage's own modules hold)."""
    buffers: list[str]
    modules: list[str]
    """Unit FQNs the stage owns (as in ``plan.json``)."""
    units: list
    """What ``forward`` runs, in order: a unit FQN, or a list of FQNs run as one function."""
    foreign_reads: set[str] = field(default_factory=set)
    """Parameter and buffer names the code reads outside the function of the unit they belong to (DeBERTa's
    relative-position table, read by every layer): `partc.runtime.parallelize` keeps their units in the stage's
    own FSDP group, gathered for the whole stage."""


@dataclass(kw_only=True, slots=True)
class ProgramFiles:
    """A compiled program as read from disk: the plan, the manifest's facts and the imported stage files."""

    out_dir: Path
    plan: Plan
    model_path: str
    """Absolute path of the model file (from the manifest)."""
    entry: str
    micro_batch_size: int
    stages: list[StageFile]
    tied: list[list[str]]
    """Groups of parameter FQNs that are one parameter in the model (may span stages)."""
    blocks: list[str]
    """The units that are repeated blocks (full recomputation applies to them)."""
    inputs: list[str]
    """Names of the model's flattened tensor inputs (stage 0's INPUTS)."""
    input_keys: list[int | str]
    """For each flattened input: its positional index (int) or keyword (str) in ``example_inputs``."""
    tp: dict
    """The manifest's ``tp`` section: ``degree``; ``shards``: parameter FQN (every alias) -> ``{"dim": d,
    "fused": n}``, how the stage files split it over tp; ``fused``: parameter FQN -> ``{"dim": d, "pieces": n}``
    for the parameters of fused projections, whatever their style (`partc.sharding.TPLayout`)."""

    ep: dict = field(default_factory=dict)
    """The manifest's ``ep`` section (absent without expert parallelism): ``degree``; ``experts``: the packed
    parameters (every alias) of which each ep rank holds E/ep experts along dim 0."""
    cp: dict = field(default_factory=dict)
    """The manifest's ``cp`` section under context parallelism (empty otherwise): ``degree``, ``seq_len`` (tokens
    per sample, whole) and ``input_dims`` (each flattened input's sequence dim, or None): how each cp rank cuts
    its tokens out of every sample (`partc.collectives.cp_cut`)."""
    predicted_ranks: list[dict] = field(default_factory=list)
    """``plan.json``'s ``predicted.ranks`` (one per pipeline rank: ``comm_bytes``, ``memory_bytes``), for the
    run's log to show next to what it measures; empty if the plan has none."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)


def read_program(out_dir: str | Path) -> ProgramFiles:
    """Parse ``OUT/plan.json`` and ``OUT/program/manifest.json`` and import every stage file."""
    out = Path(out_dir)
    if not out.is_dir():
        raise PartcError(f"{out} is not a directory; pass the output directory of `partc compile`")
    plan = read_plan(out / "plan.json")
    manifest_path = out / "program" / "manifest.json"
    if not manifest_path.exists():
        raise PartcError(f"{manifest_path} does not exist; `partc compile` writes the program next to plan.json")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        raise PartcError(f"{manifest_path} is not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(manifest, dict):
        raise PartcError(f"{manifest_path} must hold a JSON object; compile the model again")
    for key in ("model_path", "entry", "micro_batch_size", "stages", "inputs", "input_keys"):
        if key not in manifest:
            raise PartcError(f"{manifest_path}: missing field '{key}'; compile the model again")
    if not isinstance(manifest["stages"], list):
        raise PartcError(f"{manifest_path}: 'stages' must be a list; compile the model again")
    par = plan.parallel
    if manifest["micro_batch_size"] != par.micro_batch_size:
        raise PartcError(f"{manifest_path} was generated for micro-batch size {manifest['micro_batch_size']} but "
                         f"plan.json says {par.micro_batch_size}; compile again")
    if len(manifest["stages"]) != len(plan.stages) or len(plan.stages) != par.num_stages:
        raise PartcError(f"{manifest_path} has {len(manifest['stages'])} stages, plan.json {len(plan.stages)} and "
                         f"pp x virtual_stages = {par.num_stages}; compile again")
    stages = []
    for k, entry in enumerate(manifest["stages"]):
        if not isinstance(entry, dict) or entry.get("index") != k or entry.get("rank") != k % par.pp:
            raise PartcError(f"{manifest_path}: stage {k} must have index {k} and rank {k % par.pp}")
        # The file name is fixed, not taken from the manifest: a stage file is always program/stage_K.py, never a
        # path elsewhere (`../../x.py`, `/abs/x.py`).
        if entry.get("file") != f"stage_{k}.py":
            raise PartcError(f"{manifest_path}: stage {k}'s file must be 'stage_{k}.py' (in {out / 'program'}), "
                             f"got {entry.get('file')!r}")
        path = out / "program" / f"stage_{k}.py"
        code = import_stage(path)
        lists = {name: list(getattr(code, name)) for name in _LISTS}
        if lists["MODULES"] != plan.stages[k].modules:
            raise PartcError(f"{path} owns {lists['MODULES']} but plan.json stage {k} says "
                             f"{plan.stages[k].modules}; compile again")
        stages.append(StageFile(index=k, rank=entry["rank"], path=path, code=code, inputs=lists["INPUTS"],
                                outputs=lists["OUTPUTS"], parameters=lists["PARAMETERS"],
                                buffers=lists["BUFFERS"], modules=lists["MODULES"], units=lists["UNITS"],
                                foreign_reads=foreign_reads(path.read_text())))
    if stages[0].inputs != list(manifest["inputs"]):
        raise PartcError(f"{stages[0].path}: INPUTS {stages[0].inputs} differ from the manifest's model inputs "
                         f"{manifest['inputs']}")
    for prev, cur in zip(stages, stages[1:]):
        if cur.inputs != prev.outputs:
            raise PartcError(f"{cur.path}: INPUTS {cur.inputs} must be stage {prev.index}'s OUTPUTS {prev.outputs}")
    tp = manifest.get("tp", {"degree": 1, "shards": {}, "fused": {}})
    if tp.get("degree", 1) != par.tp:
        raise PartcError(f"{manifest_path} was generated for tp={tp.get('degree')} but plan.json says tp={par.tp}; "
                         f"compile again")
    ep = manifest.get("ep", {"degree": 1, "experts": []})
    if ep.get("degree", 1) != par.ep:
        raise PartcError(f"{manifest_path} was generated for ep={ep.get('degree')} but plan.json says ep={par.ep}; "
                         f"compile again")
    cp = manifest.get("cp", {})
    if cp.get("degree", 1) != par.cp:
        raise PartcError(f"{manifest_path} was generated for cp={cp.get('degree', 1)} but plan.json says cp={par.cp}; "
                         f"compile again")
    if not hasattr(stages[-1].code, "outputs"):
        raise PartcError(f"{stages[-1].path}: the last stage must define outputs(flat)")
    return ProgramFiles(out_dir=out, plan=plan, model_path=manifest["model_path"], entry=manifest["entry"],
                   micro_batch_size=manifest["micro_batch_size"], stages=stages,
                   tied=[list(g) for g in manifest.get("tied", [])], blocks=list(manifest.get("blocks", [])), inputs=list(manifest["inputs"]),
                   input_keys=list(manifest["input_keys"]), tp=dict(tp), ep=dict(ep), cp=dict(cp),
                   predicted_ranks=_predicted_ranks(out / "plan.json", plan.parallel.pp))


def _predicted_ranks(path: Path, pp: int) -> list[dict]:
    """The plan's per-rank predictions, if it has them for every pipeline rank as numbers (else none: they are
    only shown, never acted on)."""
    data = json.loads(path.read_text())
    predicted = data.get("predicted") if isinstance(data, dict) else None
    ranks = predicted.get("ranks") if isinstance(predicted, dict) else None
    if not isinstance(ranks, list) or len(ranks) != pp:
        return []
    out = []
    for r in ranks:
        comm, memory = (r.get("comm_bytes"), r.get("memory_bytes")) if isinstance(r, dict) else (None, None)
        if not (isinstance(comm, dict) and isinstance(memory, dict)):
            return []
        numbers = [*comm.values(), *memory.values()]
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in numbers):
            return []
        out.append({"comm_bytes": dict(comm), "memory_bytes": dict(memory)})
    return out


def foreign_reads(source: str) -> set[str]:
    """The names a stage file reads as ``p['name']`` outside the function of the unit that owns them: in ``forward``
    itself, or in another unit's function (``run('unit', fn, ...)`` names which function is whose)."""
    tree = ast.parse(source)
    functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}

    def reads(node: ast.AST) -> set[str]:
        return {n.slice.value for n in ast.walk(node) if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)
                and n.value.id == "p" and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str)}

    forward = functions.get("forward")
    if forward is None:
        return set()
    out = reads(forward)
    for call in ast.walk(forward):
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "run"
                and len(call.args) >= 2 and isinstance(call.args[1], ast.Name) and call.args[1].id in functions):
            owner = call.args[0].value if isinstance(call.args[0], ast.Constant) else None
            units = [owner] if isinstance(owner, str) else []
            out |= {n for n in reads(functions[call.args[1].id])
                    if not any(n.startswith(u + ".") for u in units)}
    return out


def import_stage(path: Path) -> ModuleType:
    """Import a stage file under a name unique to its path (several programs may be loaded in one process)."""
    if not path.exists():
        raise PartcError(f"stage file {path} does not exist; compile the model again")
    name = f"_partc_stage_{path.stem}_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise PartcError(f"{path}: {type(e).__name__}: {e} (while importing the stage file)") from None
    missing = [n for n in (*_LISTS, "forward") if not hasattr(module, n)]
    if missing:
        raise PartcError(f"{path} does not define {', '.join(missing)}; compile the model again")
    return module
