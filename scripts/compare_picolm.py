"""S21: picoLM vs pyengine (lean, resident) on the same TinyLlama-1.1B-shaped GGUF, side by side (outside CI).

    python scripts/compare_picolm.py [--picolm-src DIR | --picolm BIN] [--tokens 8] [--context 2048]

Writes the seeded random model (pyengine/gguf/random_llama.py: hidden 2048, 22 layers, 32/4 heads, FFN 5632,
vocab 32000, llama.cpp's Q4_K_M type mix) unless it is there, builds picoLM from its source directory when one is
given (``make native``; picoLM's code is never part of this repository: fetch github.com/RightNow-AI/picolm
yourself), then runs each engine in its own process, one at a time, and prints for each: the generated text, CPU
seconds per token, private (anonymous) memory, load time. Greedy decoding, one thread everywhere.

How each figure is taken. CPU-s/token: picoLM runs its prompt one token at a time, so its process CPU time
(rusage, load included) over its forwards (prompt + generated tokens - 1: the last token is never fed back);
pyengine: (CPU of N tokens - CPU of 1 token) / (N - 1) in one process without prefix caching, after one warm-up
request (the first request's one-time work, the tokenizer and the captured steps, made the 1-token figure larger
than the N-token one: a negative per-token figure under load), so prompt and load are out. Private memory: the largest
"Anonymous" of /proc/PID/smaps_rollup sampled every 20 ms (the file-backed pages of the memory-mapped model,
which the OS can evict, are not in it). Note picoLM allocates its KV cache with calloc: only the pages its
positions wrote count, while pyengine's arena is written (zeroed) whole at start, as at a full context.
Load time: picoLM's wall time until it writes the "---" line that starts its generation loop (timed as the
line arrives), pyengine's LLM(...) construction.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from pyengine import LLM, SamplingParams
path, mode, kv, ctx, n, prompt = sys.argv[1:7]
llm = LLM(path, weights_mode=mode, kv_cache_dtype=kv, max_model_len=int(ctx), max_num_seqs=1,
          enable_prefix_caching=False)
load = time.perf_counter() - t0
def run(k):
    c = time.process_time()
    out = llm.generate([prompt], SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True))[0]
    return time.process_time() - c, out
run(1)                  # warm-up: the first call's one-time work (tokenizer, captured steps) is in neither figure
c1, _ = run(1)
cn, out = run(int(n))
print(json.dumps({"load_s": load, "cpu_per_token": (cn - c1) / (int(n) - 1), "text": out.outputs[0].text,
                  "token_ids": list(out.outputs[0].token_ids), "prompt_tokens": len(out.prompt_token_ids)}))
"""


def anonymous_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Anonymous:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_sampled(cmd: list[str], env: dict, mark: bytes | None = None) -> tuple[subprocess.CompletedProcess, int, float,
                                                                           float | None]:
    """(completed process, peak anonymous KiB, CPU seconds of the child, wall seconds from the start until the
    child wrote the stderr line ``mark`` (None if it never did)). stderr is read line by line as it comes, so the
    time is taken when the line is written, not computed from the child's own rounded figures."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    peak, seen, err = [0], [None], []

    def sample():
        while p.poll() is None:
            peak[0] = max(peak[0], anonymous_kib(p.pid))
            time.sleep(0.02)

    def read_err():
        for line in p.stderr:
            if mark is not None and seen[0] is None and line.rstrip(b"\n") == mark:
                seen[0] = time.perf_counter() - t0
            err.append(line)

    threads = [threading.Thread(target=sample, daemon=True), threading.Thread(target=read_err, daemon=True)]
    for t in threads:
        t.start()
    out = p.stdout.read()
    p.wait()
    for t in threads:
        t.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return subprocess.CompletedProcess(cmd, p.returncode, out, b"".join(err)), peak[0], cpu, seen[0]


def picolm(binary: str, model: str, prompt: str, n: int, ctx: int, env: dict) -> dict:
    cmd = [binary, model, "-p", prompt, "-n", str(n), "-t", "0", "-j", "1", "-c", str(ctx)]
    # picoLM writes "---" just before its generation loop starts its clock: the load time is the wall time until
    # then (it was the whole wall time minus picoLM's own prefill and generation times, each rounded to 10 ms
    # and taken on another clock: near-zero loads came out negative)
    p, peak, cpu, load = run_sampled(cmd, env, mark=b"---")
    err = p.stderr.decode(errors="replace")
    if p.returncode:
        raise SystemExit(f"picoLM failed ({p.returncode}): {err[-2000:]}")
    n_prompt = n_gen = 0
    for line in err.splitlines():
        if line.startswith("Prompt:"):
            n_prompt = int(line.split()[1])
        elif line.startswith("Generation:"):
            n_gen = int(line.split()[1])
    text = p.stdout.decode("utf-8", errors="replace").rstrip("\n")
    # forwards: every prompt token, then each generated token but the last (sampled, never fed back)
    forwards = max(1, n_prompt + n_gen - 1)
    return {"engine": "picoLM", "text": text, "cpu_per_token": cpu / forwards,
            "private_mib": peak / 1024, "load_s": float("nan") if load is None else load,
            "note": f"fp16 KV, {n_gen} tokens"}


def pyengine(model: str, mode: str, kv: str, prompt: str, n: int, ctx: int, env: dict) -> dict:
    p, peak, _, _ = run_sampled([sys.executable, "-c", CHILD, model, mode, kv, str(ctx), str(n), prompt], env)
    if p.returncode:
        raise SystemExit(f"pyengine {mode} failed: {p.stderr.decode(errors='replace')[-2000:]}")
    r = json.loads(p.stdout.decode().strip().splitlines()[-1])
    return {"engine": f"pyengine {mode}", "text": r["text"], "cpu_per_token": r["cpu_per_token"],
            "private_mib": peak / 1024, "load_s": r["load_s"], "note": f"{kv} KV, {n} tokens"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/pyengine-picolm", help="where the model is written")
    ap.add_argument("--picolm", default=None, help="picoLM binary")
    ap.add_argument("--picolm-src", default=None, help="picoLM source directory (built with make native)")
    ap.add_argument("--prompt", default="hello world")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default="lean:q8_0,lean:fp16,resident:auto",
                    help="pyengine runs, mode:kv_cache_dtype (comma list)")
    args = ap.parse_args(argv)

    from pyengine.gguf.random_llama import TINYLLAMA_1_1B, write_random_llama

    os.makedirs(args.dir, exist_ok=True)
    model = os.path.join(args.dir, f"tinyllama-shape-q4_k_m-seed{args.seed}.gguf")
    if not os.path.exists(model):
        t = time.perf_counter()
        n = write_random_llama(model + ".tmp", TINYLLAMA_1_1B, seed=args.seed)
        os.replace(model + ".tmp", model)
        print(f"wrote {model} ({n / 2**20:.0f} MiB) in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    binary = args.picolm
    if binary is None and args.picolm_src:
        binary = os.path.join(args.picolm_src, "picolm")
        if not os.path.exists(binary):
            subprocess.run(["make", "-C", args.picolm_src, "native"], check=True)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):     # a benchmark: the host's own OpenBLAS kernels
        env.pop(k, None)
    rows = []
    if binary:
        rows.append(picolm(binary, model, args.prompt, args.tokens, args.context, env))
    else:
        print("picoLM: no --picolm / --picolm-src given, skipped", file=sys.stderr)
    for run in args.runs.split(","):
        mode, kv = run.split(":")
        rows.append(pyengine(model, mode, kv, args.prompt, args.tokens, args.context, env))
    print(f"| | {' | '.join(r['engine'] for r in rows)} |")
    print("|---|" + "---|" * len(rows))
    print("| CPU-seconds per token | " + " | ".join(f"{r['cpu_per_token']:.2f}" for r in rows) + " |")
    print("| private (anonymous) memory | " + " | ".join(f"{r['private_mib']:.1f} MiB" for r in rows) + " |")
    print("| load time | " + " | ".join(f"{r['load_s']:.2f} s" for r in rows) + " |")
    print("| run | " + " | ".join(r["note"] for r in rows) + " |")
    ref = rows[0]["text"]
    for r in rows:
        n = min(len(ref), len(r["text"]))
        same = "same as " + rows[0]["engine"] if r["text"][:n] == ref[:n] else "DIFFERS from " + rows[0]["engine"]
        print(f"{r['engine']:>20}: {r['text']!r} ({same} over the common length)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
