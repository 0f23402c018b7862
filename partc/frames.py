"""Where in the model's code something happened: the frame a one-line error or a generated comment names.

Three callers need it: errors while importing or calling the model file (`partc.model_file`), errors while tracing
(`partc.passes.export`, `partc.passes.measure`), and the source line codegen writes above each statement
(`partc.passes.codegen`). All of them skip frames of Python's standard library, of torch and of partc itself;
installed packages (``transformers``) count as model code unless the caller wants the user's own files only.
"""

from __future__ import annotations

import importlib.util
import re
import sysconfig
import traceback
from functools import cache
from pathlib import Path
from typing import Iterable

import torch


@cache
def _dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(Python's standard library, torch and partc): directories whose frames are never model code."""
    paths = sysconfig.get_paths()
    stdlib = {paths[k] for k in ("stdlib", "platstdlib") if k in paths}
    ours = {str(Path(torch.__file__).resolve().parent)}
    for package in ("partc", "partc.passes", "partc.runtime", "partc.cli"):
        spec = importlib.util.find_spec(package)  # imports the parent package only: cheap, no cycle
        for location in (spec.submodule_search_locations or []) if spec else []:
            ours.add(str(Path(location).resolve()))
    return tuple(d.rstrip("/") + "/" for d in stdlib), tuple(d.rstrip("/") + "/" for d in ours)


def is_model_code(filename: str, *, installed_packages: bool = True) -> bool:
    """False for frames of the standard library, torch and partc (and, unless `installed_packages`, of every
    installed package); True for everything else: the model file and the modules it imports."""
    if filename.startswith("<"):
        return False
    path = str(Path(filename).resolve())
    stdlib, ours = _dirs()
    if path.startswith(ours):
        return False
    if "site-packages" in path or "dist-packages" in path:  # inside a virtual environment's lib/ too
        return installed_packages
    return not path.startswith(stdlib)


def innermost(frames: Iterable[traceback.FrameSummary], *,
              installed_packages: bool = True) -> traceback.FrameSummary | None:
    """The innermost (last) frame of model code among `frames` (outermost first), or None."""
    found = None
    for frame in frames:
        if is_model_code(frame.filename, installed_packages=installed_packages):
            found = frame
    return found


def exception_frames(e: BaseException) -> list[traceback.FrameSummary]:
    return list(traceback.extract_tb(e.__traceback__))


_STACK_TRACE_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def stack_trace_frames(text: str | None) -> list[traceback.FrameSummary]:
    """The frames of an FX node's ``meta["stack_trace"]`` (outermost first)."""
    return [traceback.FrameSummary(file, int(line), name, line=code.strip())
            for file, line, name, code in _STACK_TRACE_FRAME.findall(text or "")]
