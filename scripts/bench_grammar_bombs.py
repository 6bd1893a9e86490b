"""Issue 27's bomb set against a live server: for each bomb, its answer time, the worst /health latency and
the worst inter-token gap of a stream running meanwhile, and the server's RSS growth; the same with no
bomb first (the idle row), so the figures compare within one run.

    .venv/bin/python scripts/bench_grammar_bombs.py [--cap 30] [--mode process|thread]

Runs against whichever `pyengine` is importable (PYTHONPATH=<an older tree> for a before/after table);
a bomb that has not answered after --cap seconds is reported as "> cap" and the next one starts (an old
server stuck in a compile cannot be stopped: the run ends there).
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import resource
import time

import httpx

ASK = [{"role": "user", "content": "Say something."}]
AMBIGUOUS = 'root ::= e\ne ::= " " e "x" | " " g "y" | "b"\ng ::= " " e "z" | " " g "w" | "b"'


def schema(s):
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}


BOMBS = [     # the old server's freezes last (a frozen old server cannot answer the bombs after it)
    ("regex a{1000}{1000}", {"structured_outputs": {"regex": "a{1000}{1000}"}}),
    ("regex \\w{1000}", {"structured_outputs": {"regex": r"\w{1000}"}}),
    ("regex (a|b)*a(a|b){20}", {"structured_outputs": {"regex": "(a|b)*a(a|b){20}"}}),
    ("minLength=maxLength=1000", schema({"type": "string", "minLength": 1000, "maxLength": 1000})),
    ("ambiguous GBNF", {"structured_outputs": {"grammar": AMBIGUOUS}}),
    ("choice 10k", {"structured_outputs": {"choice": [f"option-{i}" for i in range(10_000)]}}),
    ("integer +-2^53", schema({"type": "integer", "minimum": -(2 ** 53 - 1), "maximum": 2 ** 53 - 1})),
    ("ReDoS patternProperties", schema({"type": "object", "patternProperties": {"^(a+)+$": {"type": "string"}},
                                        "properties": {"a" * 30 + "!": {"type": "string"}}})),
    ("integer 0..10^19", schema({"type": "integer", "minimum": 0, "maximum": 10 ** 19})),
    ("choice 30k", {"structured_outputs": {"choice": [f"option-{i}" for i in range(30_000)]}}),
    ("number 0..1e308", schema({"type": "number", "minimum": 0, "maximum": 1e308})),
]


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def window(url: str, body: dict | None, cap: float):
    async with httpx.AsyncClient() as client:
        stop = asyncio.Event()
        health: list[float] = []
        gaps: list[float] = []

        async def poll():
            while not stop.is_set():
                t = time.perf_counter()
                try:
                    await client.get(url + "/health", timeout=cap)
                except httpx.HTTPError:
                    pass
                health.append(time.perf_counter() - t)
                await asyncio.sleep(0.02)

        async def stream():
            last = time.perf_counter()
            req = {"messages": ASK, "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True}
            try:
                async with client.stream("POST", url + "/v1/chat/completions", json=req, timeout=cap) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            now = time.perf_counter()
                            gaps.append(now - last)
                            last = now
            except httpx.HTTPError:            # no token for `cap` seconds: the gap is at least that
                gaps.append(time.perf_counter() - last)

        tasks = [asyncio.create_task(poll()), asyncio.create_task(stream())]
        await asyncio.sleep(0.5)
        status, answer = "-", 0.0
        if body is not None:
            t = time.perf_counter()
            try:
                r = await client.post(url + "/v1/chat/completions", timeout=cap,
                                      json={"messages": ASK, "max_tokens": 2, **body})
                status = str(r.status_code)
            except httpx.TimeoutException:
                status = "timeout"
            answer = time.perf_counter() - t
        try:
            await asyncio.wait_for(tasks[1], cap + 60)
        except (asyncio.TimeoutError, httpx.HTTPError):
            pass
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        return status, answer, max(health, default=0.0), max(gaps, default=0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cap", type=float, default=30.0)
    ap.add_argument("--mode", default="process", choices=["process", "thread"])
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    from pyengine.engine.llm_engine import LLMEngine
    from pyengine.model_files import default_model_path
    from pyengine.server.app import create_app, served_names
    from pyengine.server.http_server import ServerThread

    path = default_model_path()
    engine = LLMEngine(path, max_model_len=512, max_num_seqs=8)
    model_id, aliases = served_names(path)
    kw = {}
    if "grammars" in inspect.signature(create_app).parameters:
        from pyengine.server.grammar_worker import GrammarCompiler
        kw["grammars"] = GrammarCompiler(mode=args.mode)
    with ServerThread(create_app(engine, model_id=model_id, aliases=aliases, **kw)) as srv:
        asyncio.run(window(srv.url, None, args.cap))       # warm up
        rows = [("idle",) + asyncio.run(window(srv.url, None, args.cap)) + (0.0,)]
        for name, body in BOMBS:
            if args.only and name not in args.only:
                continue
            before = rss_mib()
            status, answer, health, gap = asyncio.run(window(srv.url, body, args.cap))
            rows.append((name, status, answer, health, gap, rss_mib() - before))
            print(json.dumps(rows[-1]), flush=True)
            if status == "timeout":
                break
    print(f"\n| bomb | status | answer s | /health worst s | stream worst gap s | RSS growth MiB |")
    print("|---|---|---|---|---|---|")
    for name, status, answer, health, gap, rss in rows:
        print(f"| {name} | {status} | {answer:.2f} | {health:.3f} | {gap:.3f} | {rss:+.0f} |")


if __name__ == "__main__":
    main()
