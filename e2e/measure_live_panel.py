"""The live panel's cost to the Python engine's decode speed, in headless Chromium (issue 28: at most 5%).

One page, one model load; then rounds of greedy generation alternating panel off / on (the order flips every
round, so drift on a shared host hits both alike), each reporting the worker's decode tok/s. Prints every run
and the ratio of the medians (on / off).

    python e2e/measure_live_panel.py --rounds 6 --tokens 32
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_support import CHROMIUM, CHROMIUM_ARGS, ROOT, free_port, stop_process, wait_http  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", default="The history of the city of Paris begins")
    args = ap.parse_args()

    from playwright.sync_api import sync_playwright

    from pyengine.model_files import default_model_path
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pyengine", "web", "--host", "127.0.0.1", "--port", str(port),
                             "--model", default_model_path()], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/config.js", proc)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page()
            page.set_default_timeout(600_000)
            page.goto(base + "/")
            page.evaluate("() => window.pyengineDemo.loadModel('./model/default.gguf')")
            run = """async ([prompt, n, live]) => (await window.pyengineDemo.generate(
                {engine: 'python', prompt, maxTokens: n, temperature: 0, live})).tokensPerSecond"""
            page.evaluate(run, [args.prompt, 4, True])               # warm-up
            rates = {False: [], True: []}
            shares = []          # the snapshot's own cost in the worker / that step's time
            for k in range(args.rounds):
                for live in ((False, True) if k % 2 == 0 else (True, False)):
                    tps = page.evaluate(run, [args.prompt, args.tokens, live])
                    rates[live].append(tps)
                    note = ""
                    if live:
                        c = page.evaluate("() => window.pyengineDemo.liveCost()")
                        shares.append(c["liveMs"] / c["stepMs"])
                        note = (f" ({c['steps']} snapshots, {c['liveMs']:.1f} ms in all beside {c['stepMs']:.0f} ms "
                                f"of steps)")
                    print(f"round {k} live={'on ' if live else 'off'} {tps:.3f} tok/s{note}", flush=True)
            browser.close()
    finally:
        stop_process(proc)
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    paired = [a / b for a, b in zip(rates[True], rates[False])]
    geo = statistics.geometric_mean(paired)
    print(f"median tok/s: panel off {off:.3f}, on {on:.3f}; on/off = {on / off:.3f}; paired rounds on/off: "
          f"{', '.join(f'{r:.3f}' for r in paired)} (geometric mean {geo:.3f})")
    print(f"the snapshots' own time in the worker: median {100 * statistics.median(shares):.3f}% of the steps' "
          f"(max {100 * max(shares):.3f}%; performance.now() in a worker may be coarsened to 0.1 ms)")


if __name__ == "__main__":
    main()
