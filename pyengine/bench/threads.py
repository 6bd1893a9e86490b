"""The ``threads`` section of `pyengine bench` (engine): BLAS threads on a quiet and on a busy host (engine/threads.py).

For 1 and 2 BLAS threads (set in this process through threadpoolctl) and for the default the engine picks: the
first-token time of a 22-token prompt (its prefill) and single-stream decode tok/s, first as the host is, then with
two busy loops this benchmark starts itself (bounded processes, ended when done). The default is picked again while
the loops run, as an engine started on a busy host would. The line to read: the busy default's first-token time
against the quiet figure (target: within 3x; OpenBLAS's own default took 12-137x).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

PROMPT_TOKENS = 22

BUSY_LOOP = "import time, sys\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


def start_busy(n: int, seconds: float) -> list[subprocess.Popen]:
    """``n`` bounded busy loops (each ends by itself after ``seconds``)."""
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(seconds)]) for _ in range(n)]


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def measure(runner, threads: int, decode_tokens: int, repeat: int) -> tuple[float, float]:
    """(first-token seconds of a 22-token prompt, median decode tok/s) with ``threads`` BLAS threads."""
    from threadpoolctl import threadpool_limits
    rng = np.random.default_rng(0)
    prompt = rng.integers(1000, 30000, PROMPT_TOKENS)
    with threadpool_limits(limits=threads, user_api="blas"):
        ttft = []
        for _ in range(repeat):
            t = time.perf_counter()
            logits = runner.run(runner.contiguous_batch(prompt, 0))
            int(np.argmax(logits[0]))
            ttft.append(time.perf_counter() - t)
        steps, pos = [], PROMPT_TOKENS
        for _ in range(decode_tokens):
            tok = int(np.argmax(logits[0]))
            t = time.perf_counter()
            logits = runner.run(runner.contiguous_batch([tok], pos))
            steps.append(time.perf_counter() - t)
            pos += 1
    return float(np.median(ttft)), 1.0 / float(np.median(steps))


def section(runner, decode_tokens: int, repeat: int, busy_loops: int = 2, max_busy_s: float = 300.0) -> None:
    """Print the quiet / busy table and the busy default's first-token time against the quiet figures."""
    from pyengine import tuning
    from pyengine.engine.threads import default_threads, usable_cores

    print(f"\nBLAS threads: {PROMPT_TOKENS}-token prompt's first token and decode tok/s, as the host is, then with "
          f"{busy_loops} busy loops started here; {usable_cores()} usable cores, DEFAULT_THREADS_MAX "
          f"{tuning.DEFAULT_THREADS_MAX}, load average {os.getloadavg()[0]:.1f}")
    measure(runner, 1, 2, 1)                    # warm-up
    rows, why = {}, {}
    for phase in ("quiet", "busy"):
        procs = start_busy(busy_loops, max_busy_s) if phase == "busy" else []
        try:
            if procs:
                time.sleep(0.5)                 # the loops are running
            default, why[phase] = default_threads(respect_env=False)   # the engine's own pick
            for label, n in (("1 thread", 1), ("2 threads", 2), (f"default={default}", default)):
                rows[(phase, label)] = measure(runner, n, decode_tokens, repeat)
        finally:
            stop_busy(procs)
    print(f"{'host':6} {'threads':12} {'first token ms':>15} {'decode tok/s':>13}")
    for (phase, label), v in rows.items():
        print(f"{phase:6} {label:12} {v[0] * 1e3:15.0f} {v[1]:13.1f}")
    pick = {ph: next(v for (p, lb), v in rows.items() if p == ph and lb.startswith("default")) for ph in why}
    print(f"default picked: quiet host: {why['quiet']}; busy host: {why['busy']}")
    print(f"busy host, default threads: first token {pick['busy'][0] * 1e3:.0f} ms, "
          f"{pick['busy'][0] / pick['quiet'][0]:.2f}x the quiet default's and "
          f"{pick['busy'][0] / rows[('quiet', '1 thread')][0]:.2f}x the quiet 1-thread figure (target: within 3x)")
