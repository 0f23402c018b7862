"""The output directory of ``partc compile -o DIR``: what partc writes there, and what it never touches.

    DIR/plan.json            the plan
    DIR/report.html          the plan drawn (`partc.report`); ``partc check`` and ``partc report`` draw it again
    DIR/program/             manifest.json and one stage_K.py a stage, replaced whole
    DIR/partc-output.json    partc's record of the files above, each with its SHA-256

``partc compile`` writes into DIR only if DIR is new, empty, or an earlier partc output: one holding a
``partc-output.json`` that partc wrote (``"written_by": "partc compile"``). Anything else is refused before the
compile starts, so partc never deletes or overwrites a file it did not write. In an earlier output:

- ``plan.json`` and ``program/`` are replaced as long as every file in them still has a SHA-256 the record lists;
  a file changed since partc wrote it (a plan edited by hand) is replaced only with ``--force``, except the plan
  given to ``--from-plan``, which is the input and comes back with the same choices;
- ``program/`` must hold nothing but the files partc wrote (and Python's ``__pycache__/*.pyc`` of them): partc
  replaces the folder whole, so a file of yours there is refused, ``--force`` or not;
- every other name in DIR is left alone.

A crash never leaves a file the record does not know: the record first lists the old and the new SHA-256 of every
file, then ``plan.json`` is replaced (a temporary file renamed over it), then ``program/`` (a new folder renamed
over it, the old one deleted), and last the record keeps only the new SHA-256s.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from partc.errors import PartcError

RECORD = "partc-output.json"
"""The record that makes DIR an output of partc (see the module doc)."""

_WRITER = "partc compile"
_PLAN = "plan.json"
REPORT = "report.html"
_PROGRAM = "program"


def check(out_dir: str | Path, *, force: bool = False, keep: str | Path | None = None) -> None:
    """PartcError unless ``partc compile`` may write its output into `out_dir` (the rules of the module doc).
    `force` allows replacing files partc wrote that have changed since; `keep` is the ``--from-plan`` file."""
    out = Path(out_dir)
    if not out.exists() and not out.is_symlink():
        for parent in out.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise PartcError(f"-o {out}: {parent} is a file, not a directory")
                break
        return
    if not out.is_dir():
        raise PartcError(f"-o {out} is a file; pass a directory (new, empty, or an earlier output of partc compile)")
    if not any(out.iterdir()):
        return
    files = _read_record(out)
    if files is None:
        raise PartcError(f"-o {out} is not empty and is not an output of partc compile (it has no {RECORD}); partc "
                         f"writes only into a new or empty directory or its own earlier output: pass another -o")
    for path in _replaced(out):
        rel = path.relative_to(out).as_posix()
        if _is_bytecode(out, path):
            continue
        if rel not in files or path.is_symlink() or not path.is_file():
            raise PartcError(f"{path} was not written by partc, which would replace it: move it out of {out} or "
                             f"pass another -o")
        if not force and _sha256(path.read_bytes()) not in files[rel] and not _same(path, keep):
            raise PartcError(f"{path} was changed since partc wrote it; pass --force to replace it, or another -o")


def write(out_dir: str | Path, files: dict[str, str], *, force: bool = False, keep: str | Path | None = None) -> None:
    """Write ``plan.json`` and ``program/`` (`files`: path relative to DIR -> text) into `out_dir`, after `check`."""
    assert _PLAN in files and all(f in (_PLAN, REPORT) or f.startswith(_PROGRAM + "/") and f.count("/") == 1
                                  for f in files)
    out = Path(out_dir)
    check(out, force=force, keep=keep)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PartcError(f"cannot create the output directory {out}: {e.strerror}") from None
    data = {rel: text.encode("utf-8") for rel, text in files.items()}  # Python reads source files as UTF-8
    new = {rel: _sha256(b) for rel, b in data.items()}
    old = _read_record(out) or {}
    _write_file(out / RECORD, _record_text({rel: sorted(set(old.get(rel, [])) | ({new[rel]} if rel in new else set()))
                                            for rel in old.keys() | new.keys()}))
    _write_file(out / _PLAN, data[_PLAN])
    if REPORT in data:
        _write_file(out / REPORT, data[REPORT])
    _write_program(out, {rel.split("/", 1)[1]: b for rel, b in data.items() if rel not in (_PLAN, REPORT)})
    _write_file(out / RECORD, _record_text({rel: [h] for rel, h in new.items()}))


def write_report(out_dir: str | Path, text: str) -> Path:
    """Replace ``DIR/report.html`` of an earlier output (``partc check``, ``partc report``): only where partc wrote
    the one there (its SHA-256 in the record), or where there is none yet."""
    out = Path(out_dir)
    files = _read_record(out)
    if files is None:
        raise PartcError(f"{out} is not an output of partc compile (it has no {RECORD}); partc writes report.html "
                         f"only into its own output")
    target = out / REPORT
    if target.is_symlink() or target.exists() and (not target.is_file() or
                                                   _sha256(target.read_bytes()) not in files.get(REPORT, [])):
        raise PartcError(f"{target} was not written by partc or was changed since, and would be replaced: move it "
                         f"out of {out}")
    data = text.encode("utf-8")
    h = _sha256(data)
    _write_file(out / RECORD, _record_text({**files, REPORT: sorted(set(files.get(REPORT, [])) | {h})}))
    _write_file(target, data)
    _write_file(out / RECORD, _record_text({**files, REPORT: [h]}))
    return target


def _replaced(out: Path) -> list[Path]:
    """What a new output replaces: plan.json and everything under program/ (folders too), if they exist."""
    found = [p for p in (out / _PLAN, out / REPORT, out / _PROGRAM) if p.exists() or p.is_symlink()]
    program = out / _PROGRAM
    if program.is_dir() and not program.is_symlink():
        found.remove(program)
        for root, dirs, names in os.walk(program):
            found += [Path(root) / n for n in sorted(dirs + names)]
    return found


def _is_bytecode(out: Path, path: Path) -> bool:
    """``program/__pycache__`` and the ``.pyc`` files in it: Python's cache of the stage files it imported."""
    rel = path.relative_to(out).parts
    if rel == (_PROGRAM, "__pycache__"):
        return path.is_dir() and not path.is_symlink()
    return (len(rel) == 3 and rel[:2] == (_PROGRAM, "__pycache__") and rel[2].endswith(".pyc")
            and path.is_file() and not path.is_symlink())


def _same(path: Path, other: str | Path | None) -> bool:
    try:
        return other is not None and os.path.samefile(path, other)
    except OSError:
        return False


def _read_record(out: Path) -> dict[str, list[str]] | None:
    """The record's ``files`` (path relative to DIR -> the SHA-256s partc wrote there); None if DIR has no record
    that partc wrote."""
    path = out / RECORD
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    files = data.get("files") if isinstance(data, dict) and data.get("written_by") == _WRITER else None
    if not isinstance(files, dict) or not all(isinstance(v, list) and all(isinstance(h, str) for h in v)
                                              for v in files.values()):
        return None
    return files


def _record_text(files: dict[str, list[str]]) -> bytes:
    return (json.dumps({"written_by": _WRITER, "files": files}, indent=2, sort_keys=True) + "\n").encode()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_file(target: Path, data: bytes) -> None:
    """Replace `target` atomically: a temporary file in its folder, renamed over it (with the permissions of a
    new file, not mkstemp's owner-only ones)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_program(out: Path, files: dict[str, bytes]) -> None:
    """Replace ``DIR/program`` atomically: a new folder, renamed over the old one (moved aside, then deleted)."""
    final = out / _PROGRAM
    tmp = Path(tempfile.mkdtemp(prefix=".program.", dir=out))
    os.chmod(tmp, 0o777 & ~_umask())
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    if not final.exists() and not final.is_symlink():
        os.rename(tmp, final)
        return
    old = Path(tempfile.mkdtemp(prefix=".program-old.", dir=out))
    os.rename(final, old / _PROGRAM)
    os.rename(tmp, final)
    shutil.rmtree(old)
