"""S20 `pyengine bench serve`: Poisson load against an OpenAI-compatible server, vLLM-benchmark style.

Requests arrive as a Poisson process at --rate req/s (exponential gaps, seeded). Each is a streaming
/v1/completions call whose prompt is a list of token ids of a chosen length (so lengths are exact on any
server that accepts token prompts), optionally starting with a prefix shared by all requests, and whose
output length is forced with max_tokens + ignore_eos. Per request we time the first token (TTFT), the gaps
between streamed tokens (ITL) and the whole request (E2E); throughput is completed requests and output
tokens per second of wall time.

Without --url the server runs in this process (uvicorn in a thread) on the default model; several
--rate values and --compare (prefix-cache / chunked-prefill on vs off) run side by side in one
invocation, on one loaded model, each run on a fresh engine, and the table ends with the ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field

import numpy as np

HELP = "serving benchmark: Poisson arrivals, streaming; TTFT / ITL / E2E percentiles and throughput"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="target server (e.g. http://127.0.0.1:8000); default: in-process")
    p.add_argument("--model", default=None, help="GGUF path for the in-process server (default model otherwise)")
    p.add_argument("--served-model", default=None, help="model id to send (default: the server's first model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--rate", type=float, nargs="+", default=[2.0], help="request rates (req/s), one run each")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (mean for uniform)")
    p.add_argument("--output-len", type=int, default=16, help="output tokens (mean for uniform)")
    p.add_argument("--dist", choices=["fixed", "uniform"], default="fixed",
                   help="length distribution: fixed, or uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--range-ratio", type=float, default=0.5, help="r of --dist uniform")
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens of prefix shared by every prompt")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--compare", choices=["prefix-cache", "chunked-prefill", "disagg"], default=None,
                   help="in-process only: run every rate with the option on and off; disagg (S18): the colocated "
                        "server against 1 prefill + 1 decode rank (pyengine/bench/disagg.py)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget per engine step (bounds how long a prefill can stall decoding)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--quick", action="store_true", help="6 short requests at 8 req/s on a small engine (a smoke test; "
                   "overrides the size options)")
    from pyengine.bench import disagg
    disagg.add_arguments(p)


# --- workload ------------------------------------------------------------------------------------
@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    gaps: list[float]            # seconds before each request is sent (after the previous one)


def lengths(rng, mean: int, n: int, dist: str, ratio: float, low: int = 1) -> list[int]:
    if dist == "fixed":
        return [max(low, mean)] * n
    lo, hi = max(low, int(round(mean * (1 - ratio)))), max(low, int(round(mean * (1 + ratio))))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def make_workload(args, rate: float, vocab_lo: int = 1000, vocab_hi: int = 30000) -> Workload:
    """Token-id prompts from a seeded generator: the same workload for every configuration."""
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    shared = rng.integers(vocab_lo, vocab_hi, size=args.shared_prefix).tolist()
    plens = lengths(rng, args.prompt_len, n, args.dist, args.range_ratio, low=args.shared_prefix + 1)
    prompts = [shared + rng.integers(vocab_lo, vocab_hi, size=L - len(shared)).tolist() for L in plens]
    olens = lengths(rng, args.output_len, n, args.dist, args.range_ratio)
    gaps = rng.exponential(1.0 / rate, size=n).tolist() if rate > 0 else [0.0] * n
    return Workload(prompts, olens, gaps)


# --- client ----------------------------------------------------------------------------------------
@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    id: str = ""                 # the response id (the server's request id; S18's step trace names it too)
    arrivals: list[float] = field(default_factory=list)   # time.monotonic() of each token chunk (same host clock)


async def one_request(client, url: str, model: str, prompt: list[int], max_tokens: int, timeout: float) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    res = Result()
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "stream error")
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):      # a chunk per step that produced tokens
                    now = time.perf_counter()
                    res.arrivals.append(time.monotonic())
                    res.id = res.id or chunk.get("id", "")
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        res.ok = last is not None
        if not res.ok:
            res.error = "no tokens streamed"
    except Exception as exc:  # a benchmark reports failures, it does not stop at the first one
        res.error = repr(exc)
    return res


class Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done, self.failed, self.t0 = total, label, 0, 0, time.perf_counter()

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        width = 30
        fill = int(width * self.done / self.total)
        sys.stderr.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                         f"failed {self.failed}  {time.perf_counter() - self.t0:6.1f}s")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


async def run_load(url: str, model: str, work: Workload, timeout: float, label: str, api_key=None) -> tuple:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(work.prompts) + 4, max_keepalive_connections=len(work.prompts) + 4)
    bar = Progress(len(work.prompts), label)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        async def tracked(i):
            r = await one_request(client, url, model, work.prompts[i], work.output_lens[i], timeout)
            bar.update(r.ok)
            return r

        tasks = []
        t0 = time.perf_counter()
        for i, gap in enumerate(work.gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(tracked(i)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    bar.close()
    return results, wall


def summarize(results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itls]
    e2e = [r.e2e for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "wall_s": wall,
        "req_per_s": len(ok) / wall, "out_tok_per_s": out_tokens / wall,
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": out_tokens,
        "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
        "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
    }


def scrape(url: str, name: str) -> float | None:
    """One sample of a Prometheus metric from the server's /metrics (None if absent)."""
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except Exception:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


# --- in-process server -------------------------------------------------------------------------------
class InProcess:
    """Loads the model once; each configuration gets a fresh engine (empty caches) and server."""

    def __init__(self, args):
        from pyengine.engine.args import EngineArgs
        from pyengine.model_files import resolve_model
        from pyengine.server.app import served_names

        self.args = args
        self.path = resolve_model(args.model)
        t = time.perf_counter()
        base = EngineArgs(self.path, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens).create_engine()
        self.runner, self.tokenizer = base.runner, base.get_tokenizer()
        print(f"model loaded in {time.perf_counter() - t:.1f}s", file=sys.stderr)
        self.model_id, _ = served_names(self.path)

    def serve(self, prefix_cache: bool, chunked: bool):
        from pyengine.engine.llm_engine import LLMEngine
        from pyengine.server.app import create_app
        from pyengine.server.http_server import ServerThread

        engine = LLMEngine(runner=self.runner, tokenizer=self.tokenizer, enable_prefix_caching=prefix_cache,
                           enable_chunked_prefill=chunked, max_waiting=None)
        app = create_app(engine, model_id=self.model_id, max_model_len=self.args.max_model_len)
        return ServerThread(app)  # started by `with`


def configurations(args) -> list[tuple[str, bool, bool]]:
    prefix, chunked = not args.no_prefix_cache, not args.no_chunked_prefill
    if args.compare == "prefix-cache":
        return [("prefix-cache on", True, chunked), ("prefix-cache off", False, chunked)]
    if args.compare == "chunked-prefill":
        return [("chunked on", prefix, True), ("chunked off", prefix, False)]
    return [(f"prefix-cache {'on' if prefix else 'off'}, chunked {'on' if chunked else 'off'}", prefix, chunked)]


def print_table(rows: list[dict]) -> None:
    cols = [("config", "config", "{}"), ("rate", "rate", "{:g}"), ("ok/fail", None, None),
            ("req/s", "req_per_s", "{:.2f}"), ("out tok/s", "out_tok_per_s", "{:.1f}"),
            ("TTFT p50", "ttft_p50", "{:.3f}"), ("TTFT p99", "ttft_p99", "{:.3f}"),
            ("ITL p50", "itl_p50", "{:.3f}"), ("ITL p99", "itl_p99", "{:.3f}"),
            ("E2E p50", "e2e_p50", "{:.2f}"), ("E2E p99", "e2e_p99", "{:.2f}"), ("hit rate", "hit_rate", "{}")]
    cells = []
    for r in rows:
        line = []
        for _, key, fmt in cols:
            if key is None:
                line.append(f"{r['completed']}/{r['failed']}")
            elif key == "hit_rate":
                line.append("-" if r.get("hit_rate") is None else f"{r['hit_rate']:.2f}")
            else:
                line.append(fmt.format(r[key]))
        cells.append(line)
    widths = [max(len(c[0]), *(len(line[i]) for line in cells)) for i, c in enumerate(cols)]
    print("  ".join(c[0].rjust(w) for c, w in zip(cols, widths)))
    for line in cells:
        print("  ".join(v.rjust(w) for v, w in zip(line, widths)))
    print("(seconds; TTFT = time to first token, ITL = inter-token latency, E2E = whole request)")


def print_ratios(rows: list[dict], configs: list[str]) -> None:
    """Same-run ratios of the two configurations at each rate (> 1: the first one is better)."""
    if len(configs) != 2:
        return
    a, b = configs
    for rate in sorted({r["rate"] for r in rows}):
        ra = next((r for r in rows if r["rate"] == rate and r["config"] == a), None)
        rb = next((r for r in rows if r["rate"] == rate and r["config"] == b), None)
        if not (ra and rb and ra["completed"] and rb["completed"]):
            continue
        ratio = lambda key: rb[key] / ra[key] if ra[key] > 0 else float("nan")  # noqa: E731
        print(f"rate {rate:g}, [{b}] / [{a}]: TTFT p50 {ratio('ttft_p50'):.2f}x, TTFT p99 {ratio('ttft_p99'):.2f}x, "
              f"E2E p50 {ratio('e2e_p50'):.2f}x; output tok/s [{a}] / [{b}] "
              f"{ra['out_tok_per_s'] / max(rb['out_tok_per_s'], 1e-9):.2f}x")


QUICK = dict(num_requests=6, rate=[8.0], prompt_len=32, output_len=4, max_model_len=256, max_num_seqs=8,
             max_num_batched_tokens=256)


def run(args) -> int:
    if args.quick:
        vars(args).update(QUICK)
    if args.compare == "disagg":
        from pyengine.bench import disagg
        if args.quick:
            vars(args).update(disagg.QUICK)
        return disagg.run(args)
    if args.num_requests < 1 or any(r <= 0 for r in args.rate):
        raise ValueError("--num-requests must be >= 1 and every --rate > 0")
    if args.shared_prefix >= args.prompt_len * (1 - (args.range_ratio if args.dist == "uniform" else 0)):
        raise ValueError("--shared-prefix must be shorter than the shortest prompt")
    rows = []
    print(f"workload: {args.num_requests} requests, prompt {args.prompt_len} ({args.dist}), output "
          f"{args.output_len}, shared prefix {args.shared_prefix}; machine timings are noisy", file=sys.stderr)
    configs = []
    if args.url:
        if args.compare:
            raise ValueError("--compare needs the in-process server (drop --url)")
        import httpx
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = args.served_model or httpx.get(args.url + "/v1/models", timeout=10,
                                               headers=headers).json()["data"][0]["id"]
        for rate in args.rate:
            results, wall = asyncio.run(run_load(args.url, model, make_workload(args, rate), args.timeout,
                                                 f"rate {rate:g}", args.api_key))
            rows.append({"config": args.url, "rate": rate, **summarize(results, wall),
                         "hit_rate": scrape(args.url, "pyengine_prefix_cache_hit_rate")})
    else:
        inproc = InProcess(args)
        configs = configurations(args)
        for label, prefix, chunked in configs:
            for rate in args.rate:
                with inproc.serve(prefix, chunked) as server:
                    # warm-up: first calls pay one-time costs (allocations, caches) nobody should time
                    asyncio.run(run_load(server.url, inproc.model_id,
                                         Workload([[1000 + i for i in range(8)]], [2], [0.0]), args.timeout,
                                         "warm-up"))
                    results, wall = asyncio.run(run_load(server.url, inproc.model_id, make_workload(args, rate),
                                                         args.timeout, f"{label}, rate {rate:g}"))
                    rows.append({"config": label, "rate": rate, **summarize(results, wall),
                                 "hit_rate": scrape(server.url, "pyengine_prefix_cache_hit_rate")})
    print_table(rows)
    print_ratios(rows, [c[0] for c in configs])
    for r in rows:
        if r["errors"]:
            print(f"errors ({r['config']}, rate {r['rate']:g}): {r['errors']}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0 if all(r["failed"] == 0 for r in rows) else 1
