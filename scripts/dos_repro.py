"""Issue 13's denial-of-service reproduction against a real `pyengine serve` (run by hand, never by CI).

While one greedy stream runs (restarted whenever it finishes), COUNT distinct one-word prompts of SIZE
bytes are sent to /v1/completions; each is too long for the context and must be answered 400. Printed:
the server's RSS before and after the attack (VmRSS of the server process) and the running stream's worst
inter-token gap before and during the attack.

    .venv/bin/python scripts/dos_repro.py                       # this checkout
    .venv/bin/python scripts/dos_repro.py --source /tmp/before  # another tree (e.g. `git archive fb04869`)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Streamer(threading.Thread):
    """Keeps one stream running; records the worst gap between consecutive tokens, per phase."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.phase, self.stop = url, "baseline", False
        self.worst = {"baseline": 0.0, "attack": 0.0}
        self.tokens = {"baseline": 0, "attack": 0}

    def run(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=600) as c:
            while not self.stop:
                last = None
                try:
                    with c.stream("POST", self.url + "/v1/completions", json=body) as r:
                        for line in r.iter_lines():
                            if self.stop:
                                return
                            if not line.startswith("data: {"):
                                continue
                            now = time.perf_counter()
                            if last is not None:
                                phase = self.phase
                                self.worst[phase] = max(self.worst[phase], now - last)
                                self.tokens[phase] += 1
                            last = now
                except httpx.HTTPError:
                    if not self.stop:
                        raise


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default=str(ROOT), help="tree whose pyengine package is served")
    ap.add_argument("--count", type=int, default=72)
    ap.add_argument("--size", type=int, default=900_000, help="bytes per one-word prompt")
    ap.add_argument("--baseline-seconds", type=float, default=5.0)
    args = ap.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([args.source, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep), "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pyengine", "serve", "--port", str(port), "--log-level",
                             "warning"], env=env, cwd=args.source, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.5)
        streamer = Streamer(url)
        streamer.start()
        time.sleep(args.baseline_seconds)
        rss_before = rss_mib(proc.pid)
        streamer.phase = "attack"
        rng = random.Random(13)
        statuses: dict[int, int] = {}
        t0 = time.perf_counter()
        with httpx.Client(timeout=600) as c:
            for _ in range(args.count):
                word = "".join(rng.choices(string.ascii_lowercase, k=args.size))
                r = c.post(url + "/v1/completions", json={"prompt": word, "max_tokens": 4})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        attack_s = time.perf_counter() - t0
        time.sleep(1.0)
        rss_after = rss_mib(proc.pid)
        streamer.stop = True
        streamer.join(30)
        print(json.dumps({
            "prompts": args.count, "prompt_bytes": args.size, "statuses": statuses,
            "attack_seconds": round(attack_s, 1),
            "rss_before_mib": round(rss_before, 1), "rss_after_mib": round(rss_after, 1),
            "rss_growth_mib": round(rss_after - rss_before, 1),
            "baseline_worst_gap_s": round(streamer.worst["baseline"], 3),
            "attack_worst_gap_s": round(streamer.worst["attack"], 3),
            "tokens_streamed": streamer.tokens,
        }, indent=1))
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
