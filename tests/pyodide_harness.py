"""tests/pyodide/harness.py (run a snippet inside Pyodide under Node), loaded once for every Pyodide test:
``from pyodide_harness import harness`` (tests/ is on sys.path; tests/pyodide/ is not a package)."""
import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("pyodide_harness_impl",
                                               Path(__file__).resolve().parent / "pyodide" / "harness.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)
