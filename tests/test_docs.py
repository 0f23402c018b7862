"""The README and docs/: the quick start is what CI runs, links resolve, nothing points outside the repository, and
no measurement with a date sits in code (single process, fast)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))

CODE = [p for d in ("partc", "passes", "runtime", "cli", "benchmarks", "tests", "examples")
        for p in sorted((ROOT / d).rglob("*.py"))]


def _links(path: Path) -> list[tuple[str, Path]]:
    """(link, the file it names) of every relative markdown link in `path`."""
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        out.append((target, (path.parent / target.split("#")[0]).resolve()))
    return out


def test_readme_is_short():
    assert len(README.splitlines()) <= 160


def test_ci_runs_the_readme_test_command():
    """The quick start's second command is `.ci/run`'s, which runs it in a fresh virtual environment."""
    block = README.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    compile_line, test_line = block.strip().splitlines()
    assert "partc compile examples/" in compile_line
    install = re.search(r"pip install (.+?) &&", test_line).group(1)
    pytest = re.search(r"python (-m pytest.*)$", test_line).group(1)
    ci = (ROOT / ".ci" / "run").read_text().replace("pip install -q ", "pip install ")
    assert f"pip install {install} && python {pytest}\n" in ci, (test_line, ci)


def test_links_resolve():
    missing = [f"{page.relative_to(ROOT)}: {link}" for page in [ROOT / "README.md", *DOCS]
               for link, target in _links(page)
               if not target.exists()]
    assert not missing, missing


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of the headings of `path`: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)  # not the comments in code blocks
    heads = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_anchors_resolve():
    pages = [ROOT / "README.md", *DOCS]
    links = [(page, link, target) for page in pages for link, target in _links(page) if "#" in link]
    assert links
    missing = [f"{page.relative_to(ROOT)}: {link}" for page, link, target in links
               if link.split("#", 1)[1] not in _anchors(target)]
    assert not missing, missing


def test_nothing_points_outside_the_repository():
    pattern = re.compile(r"calibration\.md|shared[/]reference|\.\./shared")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in [*CODE, ROOT / "README.md", *DOCS]
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found


def test_no_dated_measurements_in_code():
    """Dated figures go to benchmarks/results/ (benchmarks/record.py writes them), not into docstrings."""
    pattern = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|load( average)? (of |about |~)?\d")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in CODE
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found


def test_benchmark_results_are_dated_and_never_overwritten(tmp_path, monkeypatch, capsys):
    import datetime
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from record import recorded

    monkeypatch.delenv("PARTC_BENCH_RESULTS", raising=False)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--fast"])
    for k in range(2):
        assert recorded("bench", lambda: print(f"| row | {k} |") or 3, directory=tmp_path) == 3
    day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    first, second = tmp_path / f"bench-{day}.md", tmp_path / f"bench-{day}-2.md"
    assert sorted(tmp_path.iterdir()) == sorted([first, second])
    assert "| row | 0 |" in first.read_text() and "| row | 1 |" in second.read_text()
    assert "bench.py --fast` (exit status 3)" in first.read_text() and "load average" in first.read_text()
    assert "| row | 1 |" in capsys.readouterr().out  # the terminal still gets it
    monkeypatch.setenv("PARTC_BENCH_RESULTS", "0")
    recorded("bench", lambda: None, directory=tmp_path)
    assert len(list(tmp_path.iterdir())) == 2
