"""Imports run one way (issue 26): cli / server / disagg -> engine -> models -> layers -> gguf / arena.

Every module of the package is parsed (no import runs) and every import it makes, at module level and inside
functions alike, is checked against the packages its own package must not reach: an import inside a function
is still an arrow, only a later one."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "pyengine"

# package -> the pyengine packages (first component below pyengine) it must never import
FORBIDDEN = {
    "engine": {"parallel", "disagg", "cli", "server", "llm", "bench"},
    "server": {"cli"},
    "disagg": {"cli"},
    "models": {"engine", "parallel", "disagg", "cli", "server", "llm", "bench"},
    "layers": {"engine", "models", "parallel", "disagg", "cli", "server", "llm", "bench"},
    "gguf": {"engine", "models", "layers", "parallel", "disagg", "cli", "server", "llm", "bench"},
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in ``tree``, relative ones resolved."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((name, node.lineno))
            # `from pyengine import parallel`: the names may be packages themselves
            out += [(f"{name}.{a.name}", node.lineno) for a in node.names if a.name != "*"]
    return out


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        mod = module_name(path, root)
        parts = mod.split(".")
        if len(parts) < 2 or parts[1] not in FORBIDDEN:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for name, line in imported(tree, mod, path.name == "__init__.py"):
            target = name.split(".")
            if len(target) >= 2 and target[0] == "pyengine" and target[1] in FORBIDDEN[parts[1]]:
                bad.append(f"{mod}:{line} imports {'.'.join(target[:3])}")
    return sorted(set(bad))


def test_imports_run_one_way():
    assert violations() == []


def test_checker_sees_function_level_and_relative_imports(tmp_path):
    """The checker itself: an import hidden in a function, and a relative one, are both caught."""
    pkg = tmp_path / "pyengine"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "disagg").mkdir()
    for d in (pkg, pkg / "engine", pkg / "disagg"):
        (d / "__init__.py").write_text("")
    (pkg / "engine" / "loop.py").write_text("import numpy\n\ndef f():\n    from pyengine.parallel.mpi import X\n")
    (pkg / "disagg" / "boot.py").write_text("from ..cli import serve\nfrom . import router\n")
    (pkg / "engine" / "ok.py").write_text("from pyengine.engine.args import EngineArgs\nfrom . import loop\n")
    assert violations(pkg) == ["pyengine.disagg.boot:1 imports pyengine.cli", "pyengine.disagg.boot:1 imports pyengine.cli.serve",
                     "pyengine.engine.loop:4 imports pyengine.parallel.mpi"]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_every_ruled_package_exists(package):
    assert (ROOT / package).is_dir()
