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


# The server's layers, lowest first (issue 26 item 4; app.py's docstring and docs/architecture.md draw them).
# A module imports only modules of lower layers, or of its own layer listed before it: calls run down,
# app -> serving -> shaping -> parsing -> errors, and never back.
SERVER_LAYERS = (
    ("errors", "limits", "args", "engine_client", "reasoning", "sampling_fields"),   # errors; plain data beside
    ("constraints", "parsing"),                                           # request parsing
    ("shaping", "prompt_logprobs", "streaming"),                          # response and chunk shaping, SSE
    ("metrics", "engine_loop", "tokenizer_process", "grammar_worker", "serving", "responses",   # serving
     "embeddings"),
    ("guard", "http_server", "web", "app"),                               # HTTP: defences, uvicorn, handlers
)


def layer_violations(root: Path = ROOT, layers=SERVER_LAYERS) -> list[str]:
    order = {name: i for i, name in enumerate(m for layer in layers for m in layer)}
    bad = []
    for path in sorted((root / "server").glob("*.py")):
        mod = module_name(path, root)
        name = mod.split(".")[-1]
        if name == "server":        # the package's __init__: imports nothing of its own
            order_of = -1
        elif name not in order:
            bad.append(f"{mod} has no place in SERVER_LAYERS")
            continue
        else:
            order_of = order[name]
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for target, line in imported(tree, mod, path.name == "__init__.py"):
            parts = target.split(".")
            if parts[:2] != ["pyengine", "server"] or len(parts) < 3:
                continue
            if order.get(parts[2], len(order)) >= order_of:
                bad.append(f"{mod}:{line} imports {'.'.join(parts[:3])}, which is not below it")
    return sorted(set(bad))


def test_server_layers_run_one_way():
    assert layer_violations() == []


def test_layer_checker_sees_upward_and_unplaced_modules(tmp_path):
    """The checker itself: a lower module importing a higher one (even inside a function, even relatively), a
    module importing its own layer's later module, and a module the layers do not place are all caught."""
    server = tmp_path / "pyengine" / "server"
    server.mkdir(parents=True)
    (server / "__init__.py").write_text("")
    (server / "errors.py").write_text("def f():\n    from pyengine.server.app import create_app\n")
    (server / "parsing.py").write_text("from . import errors\nfrom .shaping import usage\n")
    (server / "shaping.py").write_text("from pyengine.server import parsing\n")
    (server / "app.py").write_text("from pyengine.server import errors, parsing, shaping\n")
    (server / "extra.py").write_text("")
    layers = (("errors",), ("parsing", "shaping"), ("app",))
    assert layer_violations(tmp_path / "pyengine", layers) == [
        "pyengine.server.errors:2 imports pyengine.server.app, which is not below it",
        "pyengine.server.extra has no place in SERVER_LAYERS",
        "pyengine.server.parsing:2 imports pyengine.server.shaping, which is not below it"]
