"""The README's chapter map and docs/ts-map.md point at real homes: every file they name exists and every symbol
named after a file (`file.py` (`Symbol.method`)) occurs in that file as an identifier."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TICKS = re.compile(r"`([^`]+)`")
FILE = re.compile(r"^[\w./-]+\.(py|ts|js|mjs|md)$")
IDENT = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _rows(text: str, heading: str) -> list[list[str]]:
    part = text.split(heading, 1)[1]
    rows = []
    for line in part.splitlines()[1:]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            break
    return [r for r in rows if not set(r[0]) <= {"-", " "}]


def _check_cell(cell: str, base: Path, problems: list[str]) -> None:
    current = None
    for token in TICKS.findall(cell):
        token = token.strip()
        name = token.split()[0].rstrip(":,")
        if name.endswith("/"):                                   # a folder: the files after it live there
            folder = ROOT / name if (ROOT / name).is_dir() else base / name
            if not folder.is_dir():
                problems.append(f"missing folder {name}")
            current = folder / "__init__.py"
            continue
        if "*" in name or name.startswith(("tokenizer.ggml.", "general.")):   # patterns and GGUF metadata keys
            continue
        if FILE.match(name):
            path = (base / name) if not name.startswith(("pyengine/", "ts-mini/", "web/", "tests/", "scripts/",
                                                          "docs/", "e2e/")) else ROOT / name
            if not path.is_file() and current is not None:        # `rotary.py` beside the previous file
                path = current.parent / name
            if not path.is_file():
                problems.append(f"missing file {name}")
                current = None
                continue
            current = path
            continue
        m = IDENT.match(name)
        if current is None or not m or current.suffix == ".md" or not current.is_file():
            continue
        source = current.read_text()
        for part in m.group(0).split("."):
            if not re.search(rf"\b{re.escape(part)}\b", source):
                problems.append(f"{current.relative_to(ROOT)} has no {part!r} (from `{token}`)")


def test_readme_chapter_map_points_at_real_homes():
    problems: list[str] = []
    for row in _rows((ROOT / "README.md").read_text(), "## Chapter map"):
        _check_cell(row[1], ROOT, problems)
    assert not problems, problems


@pytest.mark.parametrize("column,base", [(1, ROOT / "pyengine"), (2, ROOT / "ts-mini" / "src")])
def test_ts_map_points_at_real_homes(column, base):
    problems: list[str] = []
    for row in _rows((ROOT / "docs" / "ts-map.md").read_text(), "## Files and functions"):
        _check_cell(row[column], base, problems)
    assert not problems, problems
