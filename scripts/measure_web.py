"""Measure the browser engines in headless Chromium (and CPython's engine on this machine, for comparison).

    .venv/bin/python scripts/measure_web.py [--tokens 32] [--prompt TEXT] [--modes resident,lean] [--no-cpython]

Prints, per engine: Pyodide start-up, model load time, decode tok/s (greedy, tokens after the first /
time since the first), time to first token, and for the Python worker the WebAssembly memory after the
load and after generating (wasm memory never shrinks, so the last figure is the peak). Needs
scripts/setup_web.sh and ts-mini built. Timings on a shared machine are noisy: compare within one run.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "e2e"))
from e2e_support import CHROMIUM, CHROMIUM_ARGS, free_port, stop_process, wait_http  # noqa: E402

MB = 1 << 20


def measure_browser(base: str, modes: list[str], prompt: str, n: int) -> list[dict]:
    from playwright.sync_api import sync_playwright

    rows = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        for k, mode in enumerate(modes):
            ctx = browser.new_context()
            page = ctx.new_page()
            page.set_default_timeout(900_000)
            page.goto(f"{base}/?pymode={mode}")
            page.evaluate("() => window.pyengineDemo.ready")
            t0 = time.perf_counter()
            infos = page.evaluate("() => window.pyengineDemo.loadModel('./model/default.gguf')")
            wall = time.perf_counter() - t0
            engines = ["python"] + (["ts"] if k == 0 and "ts" in infos else [])
            for name in engines:
                r = page.evaluate("""async ([engine, prompt, n]) => window.pyengineDemo.generate(
                    {engine, prompt, maxTokens: n, temperature: 0})""", [name, prompt, n])
                info = infos[name]
                row = {"engine": "python (pyodide)" if name == "python" else "ts-mini", "mode": mode if name == "python" else "-",
                       "boot_s": info.get("bootMs", 0) / 1e3, "load_s": info.get("loadMs", 0) / 1e3,
                       "page_load_wall_s": wall, "tok_s": r["tokensPerSecond"], "ttft_ms": r.get("ttftMs"),
                       "tokens": len(r["tokenIds"])}
                if name == "python":
                    stats = page.evaluate("() => window.pyengineDemo.stats('python')")
                    row["wasm_after_load_mb"] = info["wasmBytes"] / MB
                    row["wasm_peak_mb"] = stats["wasmPeakBytes"] / MB
                else:
                    row["arena_mb"] = info.get("arenaBytes", 0) / MB
                rows.append(row)
            ctx.close()
        browser.close()
    return rows


def measure_cpython(prompt: str, n: int, modes: list[str]) -> list[dict]:
    sys.path.insert(0, str(ROOT / "web"))
    from pyworker import WorkerSession

    from pyengine.model_files import default_model_path

    data = Path(default_model_path()).read_bytes()
    rows = []
    for mode in modes:
        s = WorkerSession()
        t0 = time.perf_counter()
        s.load(data, mode=mode)
        load = time.perf_counter() - t0
        s.start("m", prompt, max_tokens=n, temperature=0.0)
        done = None
        while s.has_work():
            for ev in s.step():
                if ev["type"] == "done":
                    done = ev
        rows.append({"engine": "python (CPython, native numpy)", "mode": mode, "boot_s": 0.0, "load_s": load,
                     "tok_s": done["tokensPerSecond"], "ttft_ms": done["ttftMs"], "tokens": len(done["tokenIds"])})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--modes", default="resident,lean", help="Python weights modes to measure in the browser")
    p.add_argument("--no-cpython", action="store_true")
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    port = free_port()
    from pyengine.model_files import default_model_path
    proc = subprocess.Popen([sys.executable, "-m", "pyengine", "web", "--port", str(port), "--model",
                             default_model_path()], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/config.js", proc)
        rows = measure_browser(base, modes, a.prompt, a.tokens)
    finally:
        stop_process(proc)
    if not a.no_cpython:
        rows += measure_cpython(a.prompt, a.tokens, modes)
    print(f"prompt {a.prompt!r}, {a.tokens} greedy tokens; tok/s = decode rate after the first token")
    print(f"{'engine':32} {'mode':9} {'boot s':>7} {'load s':>7} {'tok/s':>7} {'ttft ms':>8} {'memory':>24}")
    for r in rows:
        mem = (f"wasm {r['wasm_after_load_mb']:.0f} -> peak {r['wasm_peak_mb']:.0f} MB" if "wasm_peak_mb" in r
               else f"arena {r['arena_mb']:.0f} MB + file" if "arena_mb" in r else "")
        ttft = f"{r['ttft_ms']:.0f}" if r.get("ttft_ms") is not None else "-"
        print(f"{r['engine']:32} {r['mode']:9} {r['boot_s']:7.1f} {r['load_s']:7.1f} {r['tok_s']:7.2f} {ttft:>8} {mem:>24}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
