"""The files of a checkpoint directory: one directory holds one run; its step folders are replaced without a
gap; and a step folder is checked against its manifest before ``torch.distributed.checkpoint`` reads it.

    DIR/partc-run.json         the run: model, data contract, optimizer (`RunRecord`)
    DIR/partc-run.lock         held (flock) by rank 0 while a run uses DIR
    DIR/step-00000004/         one checkpoint: DCP's files and partc.json, its manifest
    DIR/.tmp-step-00000006/    being written (a crash leaves it; it is never read)

One directory, one run. ``--checkpoint-dir`` must be new or empty unless ``--resume``, and ``--resume`` refuses
a directory whose `RunRecord` is not this run's. Two runs are the same run when they train the same model (the
plan's model name and the names, shapes and dtypes of the tensors a checkpoint holds) on the same data (seed,
global batch size, sequence length: step k's batch is a function of these) with the same optimizer (its state is
in the checkpoint). The plan is not part of it: a run may resume under any plan of its model (other dp, tp, pp,
ZeRO stage, micro-batch size, schedule). Neither are ``--lr``, ``--weight-decay`` and ``--steps``, which a resumed
run may change.

A step folder is written as ``.tmp-step-K`` and renamed to ``step-K`` once complete; one that exists already is
first renamed to ``.old-step-K``, then the new one takes its name, then the old one is deleted, and `latest`
reads ``.old-step-K`` where a crash came between the renames: at every moment one complete copy has the name.

Trust. DCP pickles its ``.metadata`` and the non-tensor values (the optimizer's hyperparameters), and unpickling
can run code. partc's manifest (``partc.json``) lists every file of the step folder with its size and SHA-256;
`verify` refuses a folder whose files do not match before anything in it is read. The metadata is read by
`read_metadata` (the SHA-256 again, then an unpickler that builds DCP's metadata classes and nothing else) and
handed to DCP (`SafeReader`); the values must load with ``torch.load(weights_only=True)`` (`SafePlanner`). The
manifest sits beside the files, so it catches damage and tampering, not an attacker who rewrites it too; the
restricted unpickling is what makes a crafted checkpoint harmless. So a checkpoint is data: one that is damaged,
altered or crafted is refused with one line, and loading one never runs code from it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from partc.errors import PartcError
from partc.plan import Plan

RUN_FILE = "partc-run.json"
LOCK_FILE = "partc-run.lock"
MANIFEST = "partc.json"
METADATA = ".metadata"
MANIFEST_FORMAT = 2
"""1: no ``files`` (partc before content hashes; not loaded)."""
_STEP = re.compile(r"(\.old-)?step-(\d+)")
_HASH_CHUNK = 1 << 20

# -- step folders -------------------------------------------------------------------------------------------------


def step_path(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint in DIR (a ``step-K`` folder with its manifest; ``.old-step-K`` where a
    crash left no ``step-K``), or None. Other names (``step-00000045.bak``, files) are not checkpoints."""
    root = Path(root)
    if not root.is_dir():
        return None
    found: dict[int, Path] = {}
    for p in root.iterdir():
        m = _STEP.fullmatch(p.name)
        if m and p.is_dir() and (p / MANIFEST).is_file() and (not m.group(1) or int(m.group(2)) not in found):
            found[int(m.group(2))] = p
    return found[max(found)] if found else None


def begin_step(root: str | Path, step: int) -> Path:
    """Rank 0: an empty ``DIR/.tmp-step-K`` to write into (a leftover of a crash is removed)."""
    root = Path(root)
    tmp = root / f".tmp-step-{step:08d}"
    _check_replaceable(step_path(root, step))
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _check_replaceable(path: Path) -> None:
    """A ``step-K`` (or ``.old-step-K``) that is there must be a checkpoint partc wrote (a folder with its
    manifest): anything else under that name is not partc's to replace."""
    if path.exists() and not (path.is_dir() and (path / MANIFEST).is_file()):
        raise PartcError(f"{path} exists and is not a partc checkpoint: not replacing it (move it away)")


def commit_step(tmp: Path, step: int, manifest: dict) -> Path:
    """Rank 0: write the manifest into `tmp` and give it the name ``step-K``, replacing an earlier ``step-K``
    without a moment where neither exists (see the module docstring)."""
    (tmp / MANIFEST).write_text(json.dumps({"format": MANIFEST_FORMAT, "step": step, **manifest}, indent=2,
                                           sort_keys=True) + "\n")
    final = step_path(tmp.parent, step)
    old = tmp.parent / f".old-{final.name}"
    _check_replaceable(final)
    _check_replaceable(old)
    if final.exists():
        if old.exists():
            shutil.rmtree(old)  # a leftover of a crash after the last replacement: step-K is complete
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def list_files(folder: Path) -> list[str]:
    """The files of a step folder other than the manifest, as relative POSIX paths, sorted."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()
                  and p.relative_to(folder).as_posix() != MANIFEST)


def hash_file(path: Path) -> dict:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": h.hexdigest()}


def read_manifest(folder: Path) -> dict:
    """The manifest of a step folder, checked for shape (not yet against the files: `verify`)."""
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PartcError(f"{folder} is not a partc checkpoint (no {MANIFEST})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PartcError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("step"), int) or isinstance(data.get("step"), bool):
        raise PartcError(f"{path} has no integer 'step': not a partc checkpoint manifest")
    files = data.get("files")
    if files is None:
        raise PartcError(f"{path} lists no content hashes (a checkpoint of partc before format "
                         f"{MANIFEST_FORMAT}): partc does not load it")
    if not isinstance(files, dict) or METADATA not in files:
        raise PartcError(f"{path}: 'files' must map file names to their size and sha256, {METADATA} included")
    for name, entry in files.items():
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts or name != rel.as_posix() or name == MANIFEST:
            raise PartcError(f"{path}: file name {name!r} is not inside the checkpoint folder")
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])):
            raise PartcError(f"{path}: files[{name!r}] must be {{\"bytes\": int, \"sha256\": 64 hex digits}}")
    return data


def verify(folder: Path, files: dict, names: list[str]) -> str | None:
    """Check `names` (of the manifest's `files`) against their size and SHA-256; the first problem, or None."""
    for name in names:
        path, want = folder / name, files[name]
        why = None
        if not path.is_file():
            why = "missing"
        elif path.stat().st_size != want["bytes"]:
            why = f"{path.stat().st_size} bytes, the manifest says {want['bytes']}"
        elif hash_file(path)["sha256"] != want["sha256"]:
            why = "its SHA-256 differs from the manifest's"
        if why:
            return f"{path} does not match the checkpoint's manifest ({why}): altered or damaged, not loading it"
    return None


# -- reading DCP's pickles safely ---------------------------------------------------------------------------------

_META_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
      ("torch.serialization", "_get_layout")} | {
    (m, n) for m in ("pathlib", "pathlib._local") for n in ("PosixPath", "WindowsPath", "PurePosixPath",
                                                             "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata (dataclasses, sizes, dtypes, paths) and refuses every other global."""

    def find_class(self, module: str, name: str):
        if (module, name) in _META_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not part of DCP's metadata")


def read_metadata(folder: Path, sha256: str):
    """DCP's metadata of a step folder: its bytes must have the manifest's SHA-256, and `_MetadataUnpickler`
    builds it (DCP's metadata classes and nothing else)."""
    path = folder / METADATA
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise PartcError(f"{path} does not match the checkpoint's manifest: altered, not loading it")
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise PartcError(f"{path} is not a checkpoint partc reads: {e}") from None


class SafeReader(FileSystemReader):
    """DCP's file reader, given the metadata `read_metadata` read (DCP would unpickle the file itself)."""

    def __init__(self, path: Path, metadata):
        super().__init__(str(path))
        self.metadata = metadata

    def read_metadata(self):
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner; a non-tensor value must load with ``torch.load(weights_only=True)`` (DCP's own
    ``weights_only=False`` then reads the same checked bytes)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:
            raise PartcError(f"checkpoint value {read_item.dest_index.fqn!r} is not plain data: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        value.seek(0)
        super().load_bytes(read_item, value)


# -- one directory, one run ---------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class RunRecord:
    """What makes two runs the same run (``DIR/partc-run.json``; see the module docstring)."""

    model: str | None
    """The plan's model name."""
    tensors: list | None
    """``[[canonical FQN, shape, dtype], ...]``: what a checkpoint holds of the model (parameters and persistent
    buffers, a tied weight once). None where not known: `partc run` checks before any model is built."""
    seed: int
    global_batch_size: int
    seq_len: int | None
    """Tokens per sample (the plan's; None for models without tokens)."""
    optimizer: str
    plan: str
    """SHA-256 of the choices of the plan that started the run. Recorded, not compared: a run may resume under
    another plan."""

    @classmethod
    def of(cls, plan: Plan, *, seed: int, optimizer: str, tensors: list | None = None) -> RunRecord:
        return cls(model=plan.model.get("name"), tensors=tensors, seed=seed,
                   global_batch_size=plan.parallel.global_batch_size, seq_len=plan.model.get("seq_len"),
                   optimizer=optimizer, plan=plan_fingerprint(plan))

    def differences(self, other: RunRecord) -> list[str]:
        """What differs, as ``<field> <value> there, <value> here`` (self: the directory's run)."""
        out = [f"{label} {a!r} there, {b!r} here" for label, a, b in (
            ("model", self.model, other.model), ("seed", self.seed, other.seed),
            ("global batch size", self.global_batch_size, other.global_batch_size),
            ("sequence length", self.seq_len, other.seq_len), ("optimizer", self.optimizer, other.optimizer))
            if a != b]
        if self.tensors is not None and other.tensors is not None and self.tensors != other.tensors:
            mine, theirs = {t[0]: t[1:] for t in self.tensors}, {t[0]: t[1:] for t in other.tensors}
            name = next(n for n in [*mine, *theirs] if mine.get(n) != theirs.get(n))
            out.append(f"model tensor {name!r} is {_tensor_text(mine.get(name))} there, "
                       f"{_tensor_text(theirs.get(name))} here")
        return out


def _tensor_text(t: list | None) -> str:
    return "absent" if t is None else f"{list(t[0])} {t[1]}"


def plan_fingerprint(plan: Plan) -> str:
    choices = {"parallel": plan.parallel.to_dict(), "tp": plan.tp, "stages": [s.modules for s in plan.stages]}
    return hashlib.sha256(json.dumps(choices, sort_keys=True).encode()).hexdigest()


def read_record(root: Path) -> RunRecord | None:
    path = root / RUN_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        return RunRecord(**{k: data[k] for k in RunRecord.__dataclass_fields__})
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise PartcError(f"cannot read {path} ({type(e).__name__}: {e}); it is not a partc run record") from None


def check(directory: str | Path, record: RunRecord, *, resume: bool) -> None:
    """Refuse a directory that is not this run's (no side effect): without `resume` it must be new or empty;
    with it, empty or holding this run (`RunRecord.differences`)."""
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise PartcError(f"--checkpoint-dir {root} is a file, not a directory")
    entries = sorted(p.name for p in root.iterdir() if p.name != LOCK_FILE) if root.is_dir() else []
    if not entries:
        return
    newest = latest(root)
    held = f"newest checkpoint {newest.name}" if newest else f"{len(entries)} entries, e.g. {entries[0]!r}"
    if not resume:
        raise PartcError(f"--checkpoint-dir {root} is not empty ({held}): add --resume to continue its run, "
                         f"or pass a new directory")
    theirs = read_record(root)
    if theirs is None:
        raise PartcError(f"--checkpoint-dir {root} has no {RUN_FILE} ({held}): not a directory of `partc run`, "
                         f"not resuming from it")
    diffs = theirs.differences(record)
    if diffs:
        raise PartcError(f"--checkpoint-dir {root} belongs to another run: {'; '.join(diffs)}")


_held_locks: dict[Path, int] = {}


def claim(directory: str | Path, record: RunRecord, *, resume: bool) -> None:
    """Rank 0: `check` the directory (a refusal leaves it as it was), lock it for this process's lifetime
    (another run using it is refused), check it again under the lock, and record the run if it holds none yet."""
    root = Path(directory)
    check(root, record, resume=resume)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PartcError(f"cannot create --checkpoint-dir {root}: {e.strerror}") from None
    _lock(root / LOCK_FILE)
    check(root, record, resume=resume)
    if read_record(root) is None:
        tmp = root / f".{RUN_FILE}.tmp"
        tmp.write_text(json.dumps(asdict(record), sort_keys=True) + "\n")
        os.replace(tmp, root / RUN_FILE)


def _lock(path: Path) -> None:
    try:
        import fcntl
    except ImportError:  # pragma: no cover (not Unix): no lock
        return
    if path.resolve() in _held_locks:
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 100).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise PartcError(f"--checkpoint-dir {path.parent} is in use by another partc run ({holder})") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode())
    _held_locks[path.resolve()] = fd
