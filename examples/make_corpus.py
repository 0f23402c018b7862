"""Build a byte-level training corpus from the Python standard library's own source files (on any Python install):

    python examples/make_corpus.py                      # stdlib_bytes.bin in the current directory
    python examples/make_corpus.py -o corpus.bin --max-mb 4

The ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (tests, ``site-packages`` and ``idlelib`` left out),
in sorted order, read as UTF-8 bytes and joined with a blank line, are written as one token per byte: uint16,
nanoGPT's ``.bin`` format, which ``partc run --data`` and `examples/byte_lm.py`'s ``dataset()`` read. The last
``--val-fraction`` of the bytes go to a second file (``NAME_val.bin``) for a held-out loss. The same Python version
gives the same corpus.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

import numpy as np

SKIP = {"test", "tests", "site-packages", "dist-packages", "idlelib", "__pycache__"}


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not SKIP & set(p.relative_to(root).parts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--out", default="stdlib_bytes.bin", help="output file (default stdlib_bytes.bin)")
    p.add_argument("--max-mb", type=float, default=8.0, help="stop after this many MB of source (default 8)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="held-out tail (default 0.05)")
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        print(f"{out} exists: not overwriting it", file=sys.stderr)
        return 2
    limit = int(args.max_mb * 2**20)
    parts, size, files = [], 0, 0
    for path in stdlib_files():
        data = path.read_bytes() + b"\n\n"
        parts.append(data)
        size += len(data)
        files += 1
        if size >= limit:
            break
    tokens = np.frombuffer(b"".join(parts)[:limit], dtype=np.uint8).astype(np.uint16)
    n_val = int(len(tokens) * args.val_fraction)
    train, val = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
    train.tofile(out)
    val_path = out.with_name(out.stem + "_val" + out.suffix)
    if n_val and not val_path.exists():
        val.tofile(val_path)
    print(f"{out}: {len(train):,} tokens (bytes) from {files} files of {sysconfig.get_paths()['stdlib']}"
          + (f"; {val_path}: {len(val):,}" if n_val else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
