"""Run a Python snippet inside Pyodide under Node (tests/pyodide/run.mjs) and return its JSON report.

Used by tests/test_pyodide_*.py. The snippet sees `MODEL_BYTES` (when a model is given) and the files
shipped to the paths it asked for; tests/pyodide/golden_checks.py is always shipped to /work/tests/.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "tests" / "pyodide" / "run.mjs"
VENDOR = ROOT / "web" / "vendor"
CHECKS = ROOT / "tests" / "pyodide" / "golden_checks.py"

PRELUDE = "import sys\nsys.path.insert(0, '/work/tests')\n"


def missing_setup() -> str | None:
    """Why the harness cannot run, or None. Missing assets are a set-up error, reported as such."""
    if shutil.which("node") is None:
        return "node is not installed"
    if not (VENDOR / "manifest.json").is_file():
        return "web/vendor/manifest.json missing: run `bash scripts/setup_web.sh`"
    return None


def ensure_fresh_wheel() -> None:
    """Rebuild web/vendor/wheels/pyengine-*.whl when pyengine/ changed after it was built, so the
    Pyodide tests always exercise the current sources (as an unchanged, installed wheel)."""
    wheels = sorted((VENDOR / "wheels").glob("pyengine-*.whl"))
    built = wheels[-1].stat().st_mtime if wheels else 0.0
    newest = max((p.stat().st_mtime for p in (ROOT / "pyengine").rglob("*.py")), default=0.0)
    newest = max(newest, (ROOT / "pyproject.toml").stat().st_mtime)
    if newest > built:
        subprocess.run(["bash", str(ROOT / "scripts" / "setup_web.sh"), "--wheel-only"], check=True,
                       capture_output=True, timeout=300)


def run_in_pyodide(snippet: str, files: dict[str, str | os.PathLike] | None = None,
                   model: str | os.PathLike | None = None, timeout: float = 900) -> dict:
    """files maps a destination path inside Pyodide to a host file. Returns the runner's report plus
    `wall_s` (host wall time including Node start-up)."""
    problem = missing_setup()
    if problem:
        raise RuntimeError(problem)
    ensure_fresh_wheel()
    shipped = {"/work/tests/golden_checks.py": CHECKS, **(files or {})}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(PRELUDE + snippet)
        path = f.name
    cmd = ["node", str(RUNNER), "--snippet", path, "--vendor", str(VENDOR)]
    for dest, src in shipped.items():
        cmd += ["--file", f"{src}={dest}"]
    if model is not None:
        cmd += ["--model", str(model)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    finally:
        os.unlink(path)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"runner produced no report (exit {proc.returncode}): {proc.stderr[-2000:]}")
    report = json.loads(lines[-1])
    report["wall_s"] = round(wall, 2)
    return report


def describe(report: dict) -> str:
    """Everything a failing assertion should show."""
    return (f"error: {report.get('error')}\n--- stdout ---\n{report.get('stdout', '')[-4000:]}\n"
            f"--- stderr ---\n{report.get('stderr', '')[-2000:]}\ntimings: {report.get('timings_ms')}")
