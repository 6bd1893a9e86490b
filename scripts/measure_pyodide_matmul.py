"""Column blocks inside Pyodide (no BLAS): one (rows, in) @ (in, out) product against the stacked
(rows, in) @ (out/c, in, c) product `DenseLinear` makes, for SmolLM2's matrix shapes, under Node.

    .venv/bin/python scripts/measure_pyodide_matmul.py

Needs scripts/setup_web.sh (the Pyodide assets tests/pyodide/harness.py uses). Prints ms per product.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from pyodide_harness import harness  # noqa: E402

SNIPPET = r'''
import json, time
import numpy as np
rng = np.random.default_rng(0)
res = {}
for i, o, c in ((576, 1536, 64), (1536, 576, 32), (576, 576, 64)):
    W = rng.standard_normal((i, o), dtype=np.float32)
    B = np.ascontiguousarray(W.reshape(i, o // c, c).transpose(1, 0, 2))
    for rows in (1, 2, 8):
        x = rng.standard_normal((rows, i), dtype=np.float32)
        out = {}
        for name, f in (("one product", lambda: x @ W), ("column blocks", lambda: np.matmul(x, B))):
            f()
            t0, n = time.perf_counter(), 0
            while time.perf_counter() - t0 < 0.3:
                f()
                n += 1
            out[name] = round(1e3 * (time.perf_counter() - t0) / n, 3)
        res[f"{i}x{o}, {rows} rows"] = out
print(json.dumps(res))
'''

if __name__ == "__main__":
    report = harness.run_in_pyodide(SNIPPET)
    if report.get("error"):
        sys.exit(report["error"])
    rows = json.loads([ln for ln in report["stdout"].splitlines() if ln.startswith("{")][-1])
    print(f"Pyodide {report['versions']['python']}, NumPy {report['versions']['numpy']}: ms per product")
    for shape, t in rows.items():
        print(f"  {shape:<20} one product {t['one product']:8.3f}   column blocks {t['column blocks']:8.3f}   "
              f"ratio {t['one product'] / t['column blocks']:.2f}x")
