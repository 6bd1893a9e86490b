"""Measure the browser engines in headless Chromium against the pre-change build, in one run (issue 29 item 5).

    .venv/bin/python scripts/measure_web.py [--baseline DIR [--make-baseline COMMIT]] [--tokens 32] [--threads N]
                                            [--modes resident,lean] [--rounds 2] [--no-node]

Engines, measured alternately in each round (so all see the same load on a shared host): ts-mini on 1 thread and
on N threads (default: all cores), the Pyodide worker in each --modes, and with --baseline the same engines
of the build checked out in DIR (e.g. `git worktree add DIR 0c9021e`; --make-baseline COMMIT makes it, builds
its ts-mini and its pyengine wheel beside this tree's Pyodide runtime). Per engine: decode tok/s (wall, tokens after the first) and
tokens per CPU-second of the whole Chromium process tree during the generation (the steadier figure on a busy
host) and of the page's web worker threads alone (the engine's own CPU), then the model load time cold (empty
store, download) and on a second visit (from the Cache API). The [node] rows run this tree's engines under Node
in the same rounds (ts-mini through its worker's protocol handler, scripts/measure_web_node.mjs; the Pyodide
worker's Python half through tests/pyodide's runner), so the tab's own cost shows as tab / node ratios.
Prints the table and the ratios new/baseline. Timings on a shared machine are noisy: compare within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "e2e"))
from e2e_support import CHROMIUM, CHROMIUM_ARGS, free_port, stop_process, wait_http  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def _stat(path: str) -> tuple[str, list[str]] | None:
    try:
        raw = Path(path).read_text()
    except OSError:
        return None
    return raw[raw.index("(") + 1:raw.rindex(")")], raw[raw.rindex(")") + 2:].split()


def tree_cpu_s(root_pid: int) -> tuple[float, float]:
    """User + system CPU seconds of root_pid's descendants (Chromium: browser, renderers, their worker threads),
    and of their web workers' threads alone (Chromium names them "DedicatedWorker thread")."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(f"/proc/{d}/stat")):
            children.setdefault(int(st[1][1]), []).append(int(d))
    total = workers = 0.0
    todo = list(children.get(root_pid, []))
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        if st := _stat(f"/proc/{p}/stat"):
            total += (int(st[1][11]) + int(st[1][12])) / TICK
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            st = _stat(f"/proc/{p}/task/{t}/stat")
            if st and st[0].startswith("DedicatedWorker"):
                workers += (int(st[1][11]) + int(st[1][12])) / TICK
    return total, workers


def make_baseline(where: Path, commit: str) -> None:
    if not where.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(where), commit], cwd=ROOT, check=True)
    nm = where / "ts-mini" / "node_modules"
    if not nm.exists():
        nm.symlink_to(ROOT / "ts-mini" / "node_modules")
    subprocess.run(["npm", "run", "build"], cwd=where / "ts-mini", check=True, capture_output=True)
    # the same Pyodide runtime and NumPy, but the baseline's own pyengine wheel (its Python code is what is measured)
    vendor = where / "web" / "vendor"
    if vendor.is_symlink():
        vendor.unlink()
    (vendor / "wheels").mkdir(parents=True, exist_ok=True)
    if (vendor / "pyodide").is_symlink():
        (vendor / "pyodide").unlink()
    if not (vendor / "pyodide").exists():   # a copy: the server serves no symlink that leaves its web root
        shutil.copytree(ROOT / "web" / "vendor" / "pyodide", vendor / "pyodide")
    shutil.copy(ROOT / "web" / "vendor" / "manifest.json", vendor / "manifest.json")
    wheel = json.loads((vendor / "manifest.json").read_text())["pyengine"]
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(where / "pyproject.toml", tmp)
        if (where / "README.md").exists():
            shutil.copy(where / "README.md", tmp)
        shutil.copytree(where / "pyengine", Path(tmp) / "pyengine", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (vendor / wheel).unlink(missing_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", tmp, "-w", str(vendor / "wheels")],
                       check=True, capture_output=True)
    if not (vendor / wheel).exists():
        raise SystemExit(f"measure_web: building the baseline's wheel did not give {wheel}")


def start_server(web_root: Path, ts_dist: Path, model: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    code = ("import sys, uvicorn; from pyengine.server.web import create_app; "
            "uvicorn.run(create_app(model=sys.argv[1], web_root=sys.argv[2], ts_dist=sys.argv[3]), "
            "host='127.0.0.1', port=int(sys.argv[4]), log_level='warning')")
    proc = subprocess.Popen([sys.executable, "-c", code, model, str(web_root), str(ts_dist), str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/config.js", proc)
    return proc, base


def run_engine(browser, url: str, engine: str, prompt: str, n: int) -> dict:
    ctx = browser.new_context()
    page = ctx.new_page()
    page.set_default_timeout(1_800_000)
    try:
        page.goto(url)
        page.evaluate("() => window.pyengineDemo.ready")
        if engine == "python" or "engines=" not in url:   # let Pyodide finish booting before anything is timed
            page.wait_for_function("() => !window.pyengineDemo.state().python"
                                   " || window.pyengineDemo.state().python.status !== 'starting'")
        infos = page.evaluate("() => window.pyengineDemo.loadModel('./model/default.gguf')")
        page.evaluate("([e, p]) => window.pyengineDemo.generate({engine: e, prompt: p, maxTokens: 4, temperature: 0})",
                      [engine, prompt])   # warm-up (JIT)
        c0, w0 = tree_cpu_s(os.getpid())
        r = page.evaluate("([e, p, n]) => window.pyengineDemo.generate({engine: e, prompt: p, maxTokens: n, "
                          "temperature: 0})", [engine, prompt, n])
        c1, w1 = tree_cpu_s(os.getpid())
        return {"tok_s": r["tokensPerSecond"], "tok_cpu_s": rate(len(r["tokenIds"]), c1 - c0),
                "tok_worker_cpu_s": rate(len(r["tokenIds"]), w1 - w0),
                "threads": infos[engine].get("threads", 1), "ids": r["tokenIds"]}
    finally:
        ctx.close()


def rate(n: int, s: float) -> float:
    return n / s if s > 0 else float("nan")


# The Pyodide worker's Python half under Node, as web/worker.js drives it (load with the page's defaults, a
# 4-token warm-up, then one request stepped to the end); CPU of the Node process (one thread).
NODE_PY = r'''
import json, sys, time
import js
sys.path.insert(0, '/work/web')
from pyworker import WorkerSession

def cpu():
    u = js.process.cpuUsage()
    return (u.user + u.system) * 1e-6

s = WorkerSession()
s.load(MODEL_BYTES, __MODE__)
def run(n):
    s.start("r", __PROMPT__, n, 0.0)
    done = None
    while s.has_work():
        for ev in s.step():
            if ev["type"] == "done":
                done = ev
    return done
run(4)
c = cpu()
r = run(__N__)
print(json.dumps({"tok_s": r["tokensPerSecond"], "cpu_s": cpu() - c, "ids": r["tokenIds"]}))
'''


def run_node(engine: str, arg: str, prompt: str, n: int, model: str) -> dict:
    """The same engine and request under Node (the [node] rows): ts-mini through its worker's protocol handler
    (arg: threads), the Pyodide worker's Python half through tests/pyodide's runner (arg: weights mode)."""
    if engine == "ts":
        out = subprocess.run(["node", str(ROOT / "scripts" / "measure_web_node.mjs"), str(ROOT / "ts-mini" / "dist"),
                              model, prompt, str(n), arg], capture_output=True, text=True, check=True, timeout=900)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        threads = int(arg)
    else:
        sys.path.insert(0, str(ROOT / "tests"))
        from pyodide_harness import harness
        snippet = (NODE_PY.replace("__MODE__", repr(arg)).replace("__PROMPT__", repr(prompt))
                   .replace("__N__", str(n)))
        rep = harness.run_in_pyodide(snippet, model=model, files={"/work/web/pyworker.py": ROOT / "web" / "pyworker.py"})
        if not rep.get("ok"):
            raise SystemExit("measure_web: the Pyodide run under Node failed:\n" + harness.describe(rep))
        r = json.loads(rep["stdout"].strip().splitlines()[-1])
        threads = 1
    tok_cpu = rate(len(r["ids"]), r["cpu_s"])
    return {"tok_s": r["tok_s"], "tok_cpu_s": tok_cpu, "tok_worker_cpu_s": tok_cpu, "threads": threads, "ids": r["ids"]}


def load_times(browser, base: str) -> tuple[float, float, str]:
    """Cold load (empty store) and second-visit load of the default model into ts-mini, wall seconds."""
    ctx = browser.new_context()
    page = ctx.new_page()
    page.set_default_timeout(600_000)
    try:
        out = []
        for _ in range(2):
            page.goto(base + "/?engines=ts&threads=1")
            page.evaluate("() => window.pyengineDemo.ready")
            t0 = time.perf_counter()
            page.evaluate("() => window.pyengineDemo.loadModel('./model/default.gguf')")
            out.append(time.perf_counter() - t0)
            page.wait_for_function("() => /stored|from cache|not stored/.test(document.getElementById('store-status')"
                                   ".textContent)")
        return out[0], out[1], page.text_content("#store-status")
    finally:
        ctx.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--modes", default="resident,lean", help="Pyodide weights modes ('' for none)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--baseline", type=Path, default=None, help="checkout of the pre-change build")
    p.add_argument("--make-baseline", default=None, metavar="COMMIT", help="git worktree add --baseline at COMMIT")
    p.add_argument("--no-node", action="store_true", help="leave out the [node] rows (the same engines under Node)")
    a = p.parse_args(argv)
    from playwright.sync_api import sync_playwright

    from pyengine.model_files import default_model_path
    model = default_model_path()
    if a.baseline and a.make_baseline:
        make_baseline(a.baseline.resolve(), a.make_baseline)
    servers = {"new": start_server(ROOT / "web", ROOT / "ts-mini" / "dist", model)}
    if a.baseline:
        b = a.baseline.resolve()
        servers["base"] = start_server(b / "web", b / "ts-mini" / "dist", model)
    modes = [m for m in a.modes.split(",") if m]
    # (label, build, url query, engine)
    configs = []
    for build in servers:
        ts_query = "?engines=ts&threads=1" if build == "new" else "?pymode=lean"
        configs.append((f"ts-mini 1 thread [{build}]", build, ts_query, "ts"))
        if build == "new":
            configs.append((f"ts-mini {a.threads} threads [{build}]", build, f"?engines=ts&threads={a.threads}", "ts"))
        for m in modes:
            configs.append((f"pyodide {m} [{build}]", build, f"?engines=python&pymode={m}" if build == "new"
                            else f"?pymode={m}", "python"))
    if not a.no_node:   # this tree's engines outside the browser: where the tab's cost is not the engine's
        configs.append(("ts-mini 1 thread [node]", "node", "1", "ts"))
        configs.append((f"ts-mini {a.threads} threads [node]", "node", str(a.threads), "ts"))
        configs += [(f"pyodide {m} [node]", "node", m, "python") for m in modes]
    results: dict[str, list[dict]] = {c[0]: [] for c in configs}
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            for rnd in range(a.rounds):
                for label, build, query, engine in configs:
                    if build == "node":
                        r = run_node(engine, query, a.prompt, a.tokens, model)
                    else:
                        r = run_engine(browser, servers[build][1] + "/" + query, engine, a.prompt, a.tokens)
                    results[label].append(r)
                    print(f"round {rnd + 1} {label}: {r['tok_s']:.2f} tok/s wall, {r['tok_cpu_s']:.2f} tok/cpu-s, "
                          f"{r['tok_worker_cpu_s']:.2f} tok/worker-cpu-s ({r['threads']} thread(s))", flush=True)
            cold, warm, status = load_times(browser, servers["new"][1])
            browser.close()
    finally:
        for proc, _ in servers.values():
            stop_process(proc)
    best = {k: tuple(max(r[f] for r in v) for f in ("tok_s", "tok_cpu_s", "tok_worker_cpu_s"))
            for k, v in results.items()}
    ids = {tuple(r["ids"]) for v in results.values() for r in v}
    print(f"\nprompt {a.prompt!r}, {a.tokens} greedy tokens, best of {a.rounds} alternating rounds")
    print(f"{'engine':34} {'tok/s wall':>11} {'tok/cpu-s':>10} {'tok/worker-cpu-s':>17}")
    for k, (w, c, wc) in best.items():
        print(f"{k:34} {w:11.2f} {c:10.2f} {wc:17.2f}")
    for k in best:
        if k.endswith("[new]"):
            base_key = k.replace("[new]", "[base]")
            if "threads" in k:
                base_key = "ts-mini 1 thread [base]"
            if base_key in best:
                print(f"ratio {k} / {base_key}: wall {best[k][0] / best[base_key][0]:.2f}x, "
                      f"cpu {best[k][1] / best[base_key][1]:.2f}x")
            node_key = k.replace("[new]", "[node]")
            if node_key in best:
                print(f"tab / node {k[:-6]}: wall {best[k][0] / best[node_key][0]:.2f}x, "
                      f"worker cpu {best[k][2] / best[node_key][2]:.2f}x")
    print(f"greedy token sequences seen: {len(ids)} (1 = every engine and build agrees)")
    print(f"model load into ts-mini: cold {cold:.2f} s, second visit {warm:.2f} s ({warm / cold:.2f}x); "
          f"store: {status!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
