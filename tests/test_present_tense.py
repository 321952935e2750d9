"""Reference text stays in the present tense (issue #42): no dates, session numbers or paths
outside the repository in the package's docstrings and comments or in ``docs/*.md``.

Docstrings and comments say what the code does and why; when something was tried, measured or
changed belongs in commit messages and ``benchmarks/results/`` (with its ``INDEX.md``), which are
not scanned. A path outside the repository (``../shared/…``, ``.gpurun/…``, ``papers/…``) names
a file a clean clone lacks.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

DATE = re.compile(r"(?<!\d)\d{4}-\d{2}-\d{2}(?!\d)")
SESSION = re.compile(r"\bsessions?[ _]?\d+", re.IGNORECASE)
OUTSIDE = re.compile(r"(?<![\w./-])(?:\.\./)*(?:\.gpurun|shared|papers)/")
"""Folders of the workspace around the repository (or local-only, as ``.gpurun/``), named as the
start of a path."""
UP = re.compile(r"(?<![\w.])(?:\.\./)+[\w./-]*")
"""A relative path that climbs (``../x``): outside where it leaves the repository, climbing from
a Markdown file's folder (its links are relative to it) or from the repository's root (a
docstring names paths from there)."""

def problems(text: str, where: Path) -> list[str]:
    """What in one line of reference text is history or a path outside the repository."""
    found = [f"date {m.group()}" for m in DATE.finditer(text)]
    found += [f"{m.group()!r}" for m in SESSION.finditer(text)]
    found += [f"path {m.group()}…" for m in OUTSIDE.finditer(text)]
    base = where.parent if where.suffix == ".md" else ROOT
    found += [f"path {m.group()}" for m in UP.finditer(text) if not (base / m.group()).resolve().is_relative_to(ROOT)]
    return found


def reference_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of ``path``'s reference text: every line of a Markdown file; of a
    Python module, the lines of its comments and of its string statements (docstrings, and the
    attribute docstrings after assignments)."""
    source = path.read_text(encoding="utf-8")
    if path.suffix == ".md":
        return list(enumerate(source.splitlines(), 1))
    lines = source.splitlines()
    numbers = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
               if tok.type == tokenize.COMMENT}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            numbers.update(range(node.lineno, node.end_lineno + 1))
    return [(n, lines[n - 1]) for n in sorted(numbers)]


def scanned() -> list[Path]:
    return sorted(ROOT.glob("chainexec/**/*.py")) + sorted(ROOT.glob("docs/*.md"))


def findings(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    return [f"{rel}:{n}: {', '.join(found)}" for n, text in reference_lines(path)
            if (found := problems(text, path))]


def test_reference_text_is_in_the_present_tense():
    lines = [line for path in scanned() for line in findings(path)]
    assert not lines, "history or outside paths in reference text:\n" + "\n".join(lines)


@pytest.mark.parametrize("text, expected", [
    ("measured 2026-11-27 on the host", ["date 2026-11-27"]),
    ("as in session 22's trace", ["'session 22'"]),
    ("see ``benchmarks/results/session21_x.json``", ["'session21'"]),
    ("(``../shared/papers/x.txt``)", ["path ../shared/…"]),
    ("(``../../elsewhere/x.txt``)", ["path ../../elsewhere/x.txt"]),
    ("``shared/benchmarks/tccg.json`` and ``papers/x.txt``", ["path shared/…", "path papers/…"]),
    ("(``.gpurun/s28/reg.py``)", ["path .gpurun/…"]),
    ("[INDEX](../benchmarks/results/INDEX.md), ``../benchmarks/results/machine_*.json``", []),
    ("55 GB/s from page-locked memory, s4/s8 layouts", []),
])
def test_what_counts_as_history(text, expected):
    assert problems(text, ROOT / "docs" / "x.md") == expected
