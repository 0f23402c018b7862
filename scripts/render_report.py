"""Render a partc report.html in a real browser (headless Chromium, Debian's ``chromium`` package) to PNG pictures.

    python scripts/render_report.py OUT/report.html docs/images [--prefix gpt3_175b_512]

writes PREFIX_timeline.png, PREFIX_memory.png and PREFIX_alternatives.png: each a page of its own holding the
report's pictures of that section (its SVGs and legend, cut out of the report as they are), the window sized to
them. Prints one line per picture; exits 1 when Chromium fails or prints to the console.

The docs' pictures (docs/report.md) were made with:

    partc compile examples/gpt3_175b.py --gpus 512 -o /tmp/gpt3
    python scripts/render_report.py /tmp/gpt3/report.html docs/images --prefix gpt3_175b_512
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PICTURES = {
    # name: rows of SVG ids (the SVGs of one row side by side), and the section whose legend comes first
    "timeline": ("s-timeline", [["timeline"], ["timeline-start", "timeline-end"]]),
    "memory": ("s-memory", [["memory"]]),
    "alternatives": ("s-alternatives", [["alternatives"]]),
}
MARGIN = 8
LEGEND_H = 24
LEGEND_W = 720
"""The legend's width on one line (the memory's five categories)."""
GAP = 10

PAGE_CSS = f"""
body {{ margin: {MARGIN}px; font-family: "DejaVu Sans", Helvetica, Arial, sans-serif; color: #222; }}
.legend {{ font-size: 11px; height: {LEGEND_H - 6}px; margin-bottom: 6px; white-space: nowrap; overflow: hidden; }}
.legend span {{ display: inline-block; margin-right: 12px; }}
.legend i {{ display: inline-block; width: 10px; height: 10px; margin-right: 4px; vertical-align: -1px;
             border: 1px solid #0002; }}
.row {{ display: flex; gap: {GAP}px; margin-bottom: {GAP}px; }} svg {{ display: block; }}
"""


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def run_chromium(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Headless Chromium with `args`; console output goes to stderr (``INFO:CONSOLE`` lines)."""
    exe = chromium()
    if exe is None:
        raise SystemExit("chromium is not installed (Debian: apt-get install chromium)")
    return subprocess.run([exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--enable-logging=stderr", "--v=0", *args], capture_output=True, text=True,
                          timeout=timeout)


def console_lines(stderr: str) -> list[str]:
    """What the page printed to the console (a script's output, an error): none is expected of a report."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def _svg(report: str, id_: str) -> tuple[str, int, int]:
    match = re.search(rf'<svg id="{re.escape(id_)}"[^>]*\bwidth="(\d+)" height="(\d+)".*?</svg>', report, re.S)
    if match is None:
        raise SystemExit(f"the report has no <svg id={id_!r}>")
    return match.group(0), int(match.group(1)), int(match.group(2))


def picture_page(report: str, name: str) -> tuple[str, int, int]:
    """A page of the pictures `name` of the report, and its width and height in pixels."""
    section, rows = PICTURES[name]
    found = re.search(rf'<section id="{section}">.*?</section>', report, re.S)
    if found is None:
        raise SystemExit(f"the report has no section {section!r}")
    legend = re.search(r'<div class="legend">.*?</div>', found.group(0), re.S)
    parts, width, height = [legend.group(0) if legend else ""], 0, 2 * MARGIN + (LEGEND_H if legend else 0)
    for row in rows:
        svgs = [_svg(report, i) for i in row if f'<svg id="{i}"' in report]
        if not svgs:
            continue
        parts.append('<div class="row">' + "".join(s for s, _, _ in svgs) + "</div>")
        width = max(width, sum(w for _, w, _ in svgs) + GAP * (len(svgs) - 1))
        height += max(h for _, _, h in svgs) + GAP
    page = (f'<!DOCTYPE html><html><head><meta charset="utf-8"><style>{PAGE_CSS}</style></head><body>'
            + "".join(parts) + "</body></html>")
    return page, max(width, LEGEND_W if legend else 0) + 2 * MARGIN, height - GAP


def render(report_path: Path, out_dir: Path, prefix: str, names: list[str] | None = None) -> list[Path]:
    """Write `out_dir`/PREFIX_NAME.png for each picture of `names` (all of `PICTURES` by default)."""
    report = report_path.read_text(encoding="utf-8")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names or list(PICTURES):
            page, width, height = picture_page(report, name)
            src = Path(tmp) / f"{name}.html"
            src.write_text(page, encoding="utf-8")
            png = out_dir / f"{prefix}_{name}.png"
            done = run_chromium([f"--screenshot={png}", f"--window-size={width},{height}", src.as_uri()])
            printed = console_lines(done.stderr)
            if done.returncode != 0 or printed or not png.exists():
                sys.stderr.write(done.stderr)
                raise SystemExit(f"chromium failed on {name} (exit {done.returncode})")
            print(f"{png}  {width}x{height}  {png.stat().st_size / 1024:.0f} KiB")
            written.append(png)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--prefix", default="report")
    args = ap.parse_args(argv)
    render(args.report, args.out_dir, args.prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
