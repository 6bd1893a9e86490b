"""S21 / issue 29: lean mode inside Pyodide (Node), against resident -- where the tab's lean decode spends its time.

    .venv/bin/python scripts/measure_pyodide_lean.py [--tokens 24] [--profile]

Needs scripts/setup_web.sh (the Pyodide assets tests/pyodide/harness.py uses) and the default model. Loads the
model through the browser worker's Python half (web/pyworker.py, as the tab does), decodes greedily in each mode
(lean also with its CPython form, tuning.LEAN_LAYOUT = "stream": the product before issue 29's byte-held quants)
and prints decode tokens per CPU-second (Node's process.cpuUsage: the Pyodide runtime is one thread, so on a
loaded host this is steadier than tokens per wall second), best of three runs; per quant format, CPU ms of one
row through LeanLinear as it runs (byte-held quants for Q4_0 / Q4_1 / Q8_0), its stream form, folded, and the
resident matrix;
and with --profile the lean decode's top functions by own time (cProfile).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from pyodide_harness import harness  # noqa: E402

SNIPPET = r'''
import cProfile, io, json, pstats, sys
import js
import numpy as np
sys.path.insert(0, '/work/web')
from pyworker import WorkerSession
from pyengine import tuning
from pyengine.gguf import quants
from pyengine.gguf.quants import GGMLType
from pyengine.layers.linear import DenseLinear, LeanLinear, QuantMatrix

def cpu():
    u = js.process.cpuUsage()
    return (u.user + u.system) * 1e-6

N, PROFILE = __N__, __PROFILE__
res = {"decode tokens per CPU-second": {}, "one row, CPU ms": {}}
sessions = {"resident": WorkerSession(), "lean": WorkerSession(), "lean stream": WorkerSession()}
for name, session in sessions.items():               # "lean stream": tuning.LEAN_LAYOUT's CPython form (before)
    keep = tuning.LEAN_LAYOUT
    tuning.LEAN_LAYOUT = "stream" if name == "lean stream" else keep
    session.load(MODEL_BYTES, mode=name.split()[0], max_model_len=256)
    tuning.LEAN_LAYOUT = keep


def decode(session, stream_rows):
    keep, tuning.LEAN_STREAM_MAX_ROWS = tuning.LEAN_STREAM_MAX_ROWS, stream_rows
    try:
        session.start("m", "The capital of France is", max_tokens=N + 1, temperature=0.0, chat=False)
        session.step()                                       # the prompt and the first token
        c, n = cpu(), 0
        while session.has_work():
            n += sum(e["type"] == "token" for e in session.step())
        return n / max(cpu() - c, 1e-9)
    finally:
        tuning.LEAN_STREAM_MAX_ROWS = keep


# lean folded: the lean products before the decode streams (LEAN_STREAM_MAX_ROWS = 0); alternated run by run
runs = {"resident": (sessions["resident"], 1), "lean": (sessions["lean"], 1),
        "lean stream (before)": (sessions["lean stream"], 1)}
best = dict.fromkeys(runs, 0.0)
for _ in range(3):
    for name, (session, rows) in runs.items():
        best[name] = max(best[name], decode(session, rows))
res["decode tokens per CPU-second"] = {k: round(v, 2) for k, v in best.items()}
if PROFILE:
    session = sessions["lean"]
    session.start("p", "The capital of France is", max_tokens=N, temperature=0.0, chat=False)
    prof = cProfile.Profile()
    prof.enable()
    while session.has_work():
        session.step()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue())
rng = np.random.default_rng(0)
for name, (n_out, n_in) in (("Q4_1", (1536, 576)), ("Q8_0", (1536, 576)), ("Q4_0", (1536, 576)),
                            ("Q4_K", (1536, 768)), ("Q6_K", (1536, 768))):
    t = GGMLType[name]
    raw = quants.quantizer(t)(rng.standard_normal((n_out, n_in)).astype(np.float32) * 0.05).reshape(n_out, -1)
    lin = LeanLinear(QuantMatrix([(raw, int(t))], n_in))
    lin.scratch = np.empty(lin.scratch_floats, np.float32)
    keep, tuning.LEAN_LAYOUT = tuning.LEAN_LAYOUT, "stream"
    stream = LeanLinear(QuantMatrix([(raw, int(t))], n_in))
    tuning.LEAN_LAYOUT = keep
    stream.scratch = lin.scratch
    dense = DenseLinear(lin.dense())
    x, o = rng.standard_normal((1, n_in)).astype(np.float32), np.empty((1, n_out), np.float32)

    def folded():
        keep, tuning.LEAN_STREAM_MAX_ROWS = tuning.LEAN_STREAM_MAX_ROWS, 0
        stream.matmul(x, o)
        tuning.LEAN_STREAM_MAX_ROWS = keep

    fns = {"lean": lambda: lin.matmul(x, o), "lean stream": lambda: stream.matmul(x, o), "lean folded": folded,
           "resident": lambda: dense.matmul(x, o)}
    best = dict.fromkeys(fns, 1e9)
    for _ in range(15):                                     # alternated: a loaded host slows them alike
        for k, f in fns.items():
            c = cpu()
            f()
            f()
            best[k] = min(best[k], (cpu() - c) / 2)
    res["one row, CPU ms"][f"{name} {n_out}x{n_in}"] = {k: round(v * 1e3, 3) for k, v in best.items()}
print(json.dumps(res))
'''


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    from pyengine.model_files import default_model_path
    snippet = SNIPPET.replace("__N__", str(args.tokens)).replace("__PROFILE__", str(args.profile))
    web = Path(__file__).resolve().parent.parent / "web"
    report = harness.run_in_pyodide(snippet, model=default_model_path(),
                                    files={"/work/web/pyworker.py": web / "pyworker.py"})
    if not report.get("ok"):
        print(harness.describe(report))
        return 1
    out = report["stdout"]
    lines = out.strip().splitlines()
    print("\n".join(lines[:-1]))
    print(json.dumps(json.loads(lines[-1]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
