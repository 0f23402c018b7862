"""Importing a user's Python file and calling its functions, with every exception turned into one line that names
the user's file and line (`PartcError`).

Apart from `partc.model_file` (the contract a model file meets) because it is about any user file partc runs: the
model file and the modules it imports, a benchmark's or a test's model file (`import_file`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from partc.errors import PartcError
from partc.frames import exception_frames, innermost


def import_file(path: str | Path) -> ModuleType:
    """The Python file at `path` imported once per process (later calls return the first import), as
    `load_model_file` imports it. For benchmarks and tests that build on a model file's code."""
    file = Path(path).resolve()
    return sys.modules.get(_module_name(file)) or _import_file(file, _shown(file))


def _module_name(file: Path) -> str:
    stem = re.sub(r"\W", "_", file.stem)
    return f"_partc_model_{stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:10]}"


def _import_file(file: Path, shown: str) -> ModuleType:
    """Imports `file` under a name unique to its path, with its directory first on sys.path during the import.

    Sibling modules it imports (``from gpt import GPT``) land in sys.modules under their own names, as in
    ``python model.py``; only imports at the file's top level see the directory on sys.path.
    """
    name = _module_name(file)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved_path = list(sys.path)
    sys.path.insert(0, str(file.parent))
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        if isinstance(e, SystemExit):  # not partc's exit code: a compile that ends without a word, or a plan
            raise PartcError(f"{_where(e, shown)}: the model file called sys.exit({e.code!r}) while partc imported "
                             f"it; put script code under `if __name__ == \"__main__\":`") from None
        if isinstance(e, Exception):
            raise _import_error(e, shown) from None
        raise
    finally:
        sys.path[:] = saved_path
    return module


def _import_error(e: Exception, shown: str) -> PartcError:
    if isinstance(e, SyntaxError):
        where = f"{_shown(Path(e.filename))}:{e.lineno}" if e.filename else shown
        return PartcError(f"{where}: syntax error: {e.msg}; fix the model file")
    if isinstance(e, ModuleNotFoundError) and e.name:
        return PartcError(f"{_where(e, shown)}: no module named '{e.name}'; install it or fix the import")
    if isinstance(e, ImportError):
        return PartcError(f"{_where(e, shown)}: {_one_line(e)}; fix the import")
    return PartcError(f"{_where(e, shown)}: {_describe(e)} (raised while importing {shown})")


def _where(e: BaseException, shown: str) -> str:
    """Where an import failed: 'file:line', naming the model file too when the line is in a module it imports."""
    where = _user_frame(e)
    if where is None:
        return f"importing {shown}"
    return where if where.rpartition(":")[0] == shown else f"{where} (imported by {shown})"


def _callables(module: ModuleType) -> list[str]:
    """Public functions and classes defined in the file itself (not imported into it)."""
    return sorted(k for k, v in vars(module).items()
                  if not k.startswith("_") and callable(v) and getattr(v, "__module__", None) == module.__name__)


# ---------------------------------------------------------------------------------------------------------------
# Calling user code


def _call_user(fn: Callable, what: str, shown: str, *args: Any) -> Any:
    """Calls a function of the file, turning its exceptions into one line with the user's file:line."""
    try:
        return fn(*args)
    except PartcError:
        raise
    except (Exception, SystemExit) as e:  # sys.exit() in the file is its error, not partc's exit code
        where = _user_frame(e) or shown
        raise PartcError(f"{where}: {what} raised {_describe(e)}") from None


def _user_frame(e: BaseException) -> str | None:
    """'file:line' of the innermost frame of `e` in the user's own files (not the standard library, an installed
    package, torch or partc); None if there is none."""
    frame = innermost(exception_frames(e), installed_packages=False)
    return None if frame is None else f"{_shown(Path(frame.filename).resolve())}:{frame.lineno}"


def _shown(file: Path) -> str:
    """A path as the user would write it: relative to the working directory when under it."""
    try:
        return str(file.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(file)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _describe(e: BaseException) -> str:
    text = _one_line(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
