"""Column blocks inside Pyodide (no BLAS): one (rows, in) @ (in, out) product against the stacked
(rows, in) @ (out/c, in, c) product `DenseLinear` makes, for SmolLM2's matrix shapes, under Node.

    .venv/bin/python scripts/measure_pyodide_matmul.py [--layouts]

--layouts: one decode row (1, in) through each layout and call NumPy-in-wasm offers (column blocks, row-major
(in, out), the GGUF's (out, in) rows through matmul / dot / einsum / a broadcast sum, float64), best of 3 —
the evidence for tuning.RESIDENT_LAYOUT.

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

LAYOUTS = r'''
import json, time
import numpy as np
rng = np.random.default_rng(0)
def best(f, t=0.25):
    f()
    b = 1e9
    for _ in range(3):
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < t:
            f()
            n += 1
        b = min(b, (time.perf_counter() - t0) / n)
    return round(1e3 * b, 3)
res = {}
for i, o in ((576, 1536), (1536, 576), (576, 576), (576, 4096)):
    W = rng.standard_normal((i, o), dtype=np.float32)
    Wt = np.ascontiguousarray(W.T)
    c = 64 if i <= 576 else 32
    B = np.ascontiguousarray(W.reshape(i, o // c, c).transpose(1, 0, 2))
    x = rng.standard_normal((1, i), dtype=np.float32)
    xv, out = x[0], np.empty((1, o), np.float32)
    ov, W64, x64 = out[0], W.astype(np.float64), x.astype(np.float64)
    res[f"{i}x{o}"] = {
        "column blocks matmul": best(lambda: np.matmul(x, B)),
        "x @ W (in, out)": best(lambda: np.matmul(x, W, out=out)),
        "x @ rows.T": best(lambda: np.matmul(x, Wt.T, out=out)),
        "dot(rows, x)": best(lambda: np.dot(Wt, xv, out=ov)),
        "dot(x, W)": best(lambda: np.dot(xv, W, out=ov)),
        "einsum oi,i->o (rows)": best(lambda: np.einsum("oi,i->o", Wt, xv, out=ov)),
        "einsum i,io->o": best(lambda: np.einsum("i,io->o", xv, W, out=ov)),
        "(rows * x).sum(1)": best(lambda: (Wt * xv).sum(axis=1)),
        "x @ W float64": best(lambda: x64 @ W64),
    }
print(json.dumps(res))
'''


def layouts() -> None:
    report = harness.run_in_pyodide(LAYOUTS)
    if report.get("error"):
        sys.exit(report["error"])
    rows = json.loads([ln for ln in report["stdout"].splitlines() if ln.startswith("{")][-1])
    print(f"Pyodide {report['versions']['python']}, NumPy {report['versions']['numpy']}: ms per one-row product")
    for shape, t in rows.items():
        base = t["column blocks matmul"]
        print(f"  {shape}: " + ", ".join(f"{k} {v:.3f} ({base / v:.2f}x)" for k, v in t.items()))


if __name__ == "__main__":
    if "--layouts" in sys.argv[1:]:
        layouts()
        sys.exit(0)
    report = harness.run_in_pyodide(SNIPPET)
    if report.get("error"):
        sys.exit(report["error"])
    rows = json.loads([ln for ln in report["stdout"].splitlines() if ln.startswith("{")][-1])
    print(f"Pyodide {report['versions']['python']}, NumPy {report['versions']['numpy']}: ms per product")
    for shape, t in rows.items():
        print(f"  {shape:<20} one product {t['one product']:8.3f}   column blocks {t['column blocks']:8.3f}   "
              f"ratio {t['one product'] / t['column blocks']:.2f}x")
