"""S18 `pyengine bench serve --compare disagg`: prefill/decode disaggregation against the colocated engine.

Both servers are `pyengine serve` processes on the same model and engine options, measured one after the other
with the same seeded workload from this process's client:

    colocated       one engine, chunked prefill as configured by default (both cores: its BLAS threads);
                    --colocated-args passes more serve options to it (e.g. a chunk budget or ITL target)
    disaggregated   --prefill-instances 1 --decode-instances 1: router + one prefill rank + one decode rank (one
                    core each)

Workload: --num-requests short requests (--prompt-len tokens, --output-len tokens) arrive at --rate and keep
decoding, while --long-requests long prompts (uniform in --long-prompt-len .. --long-prompt-max tokens,
--long-output-len tokens) arrive among them at Poisson rate --long-rate. Reported per server: TTFT and ITL
p50 / p99 of the short decodes and of the long prompts, the short decodes' ITL p99 / p50 (the target: <= 1.5 with
disaggregation), output throughput, goodput (share of requests meeting the SLO: TTFT <= --slo-ttft and every ITL
<= --slo-itl, 3 s and 150 ms by default), and for the disaggregated server the KV bytes moved per transferred
request and the mean transfer time (from its /metrics). Ratios are of the same run.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np


QUICK = dict(num_requests=3, rate=[4.0], output_len=24, long_requests=1, long_prompt_len=120, long_prompt_max=160,
             long_output_len=4, long_rate=2.0)


def add_arguments(p) -> None:
    g = p.add_argument_group("--compare disagg")
    g.add_argument("--long-requests", type=int, default=4, help="long prompts arriving among the short decodes")
    g.add_argument("--long-prompt-len", type=int, default=2048, help="shortest long prompt (tokens)")
    g.add_argument("--long-prompt-max", type=int, default=4096, help="longest long prompt (tokens)")
    g.add_argument("--long-output-len", type=int, default=8, help="tokens generated for each long prompt")
    g.add_argument("--long-rate", type=float, default=0.1, help="Poisson rate of the long prompts (req/s)")
    g.add_argument("--slo-ttft", type=float, default=3.0, help="goodput SLO: time to first token (s)")
    g.add_argument("--slo-itl", type=float, default=0.15, help="goodput SLO: every inter-token gap (s)")
    g.add_argument("--colocated-threads", type=int, default=2,
                   help="BLAS threads of the colocated server (default 2: both cores, as the two ranks have)")
    g.add_argument("--trace-dir", default=None, help="keep the disaggregated server's step traces here "
                   "(pyengine/disagg/step_trace.py; default: a temporary directory)")
    g.add_argument("--only", choices=["colocated", "disagg"], default=None,
                   help="run one of the two servers (no ratios): for iterating on one side")
    g.add_argument("--colocated-args", default="", help="more `pyengine serve` options for the colocated server "
                   "(one string, e.g. the chunk budget options)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`python -m pyengine serve ...` in its own session; stopped with SIGTERM to the session (all its ranks)."""

    def __init__(self, extra: list[str], threads: int, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pyengine", "serve", "--port", str(self.port), "--log-level", "warning",
               "--stats-interval", "0", *extra]
        env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), **(env or {}))
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)

    def __enter__(self):
        import httpx
        t0 = time.monotonic()
        while time.monotonic() - t0 < 300:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited: " + self.proc.stderr.read().decode()[-2000:])
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("server did not start within 300 s")

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def mixed_workload(args):
    """(workload, kinds): short decodes at --rate, long prompts at --long-rate, merged in arrival order."""
    from pyengine.bench.serve import Workload
    rng = np.random.default_rng(args.seed)
    events = []
    t = 0.0
    for _ in range(args.num_requests):
        t += rng.exponential(1.0 / args.rate[0])
        events.append((t, "short", rng.integers(1000, 30000, args.prompt_len).tolist(), args.output_len))
    t = 0.0
    for _ in range(args.long_requests):
        t += rng.exponential(1.0 / args.long_rate)
        n = int(rng.integers(args.long_prompt_len, args.long_prompt_max + 1))
        events.append((t, "long", rng.integers(1000, 30000, n).tolist(), args.long_output_len))
    events.sort(key=lambda e: e[0])
    gaps = np.diff([0.0] + [e[0] for e in events]).tolist()
    return Workload([e[2] for e in events], [e[3] for e in events], gaps), [e[1] for e in events]


def goodput(results, ttft: float, itl: float) -> float:
    ok = [r.ok and r.ttft <= ttft and all(x <= itl for x in r.itls) for r in results]
    return sum(ok) / len(ok) if ok else float("nan")


SAME_STEP_S = 0.010   # tokens of one engine step reach the client within this of each other (one router batch)


def pct(xs, q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def long_windows(results, kinds) -> list[tuple[float, float]]:
    """When each long sequence was in the decode batch, on the client's clock: from its second token (the first
    decode step that held it; its first token ends the prefill) to its last."""
    return [(r.arrivals[1] - SAME_STEP_S, r.arrivals[-1] + SAME_STEP_S) for r, k in zip(results, kinds)
            if k == "long" and r.ok and len(r.arrivals) >= 2]


def split_itls(results, kinds) -> tuple[list[float], list[float], list[float]]:
    """The short decodes' inter-token gaps as (without, with) a long sequence in the batch that produced the token,
    and each one's first gap (first -> second token) apart: disaggregated, that gap is the request's own hand-off
    (its KV shipped and adopted, then a decode step), not a running decode's. 'Without' keeps every gap a long
    prompt's arrival caused (its prefill chunks beside the decodes colocated; its KV adoption disaggregated):
    issue 19's target is their p99 / p50."""
    windows = long_windows(results, kinds)
    without, with_long, first = [], [], []
    for r, k in zip(results, kinds):
        if k != "short" or not r.ok:
            continue
        for j, (a0, a1) in enumerate(zip(r.arrivals, r.arrivals[1:])):
            if j == 0:
                first.append(a1 - a0)
            else:
                (with_long if any(s <= a1 <= e for s, e in windows) else without).append(a1 - a0)
    return without, with_long, first


def join_trace(results, kinds, steps: list[dict], long_len: int,
               router: list[dict] = ()) -> tuple[list[dict], int]:
    """Each short decode's gap between two tokens of the decode rank, joined with the steps that produced them
    (its trace, step_trace.py): the client's gap, the rank's step-to-step time, the delivery (step end ->
    client) and the step's parts; with the router's trace, the delivery split into ``router`` (step end -> the
    router handed it to the server) and ``http`` (-> the client read it). Requests whose chunk count does not
    match their steps are skipped (counted)."""
    handed = {(rid, rec["t_step"]): rec["t_out"] for rec in router for rid in rec["rids"]}
    by_rid: dict[str, list[dict]] = {}
    for st in steps:
        for rid in st["rids"]:
            by_rid.setdefault(rid, []).append(st)
    gaps, skipped = [], 0
    for r, k in zip(results, kinds):
        if k != "short" or not r.ok:
            continue
        mine = by_rid.get(r.id + "-0", [])             # the server names a completion's only choice <id>-0
        if len(mine) != len(r.arrivals) - 1:           # arrival 0 is the prefill rank's first token
            skipped += 1
            continue
        for j in range(2, len(r.arrivals)):
            st, prev = mine[j - 1], mine[j - 2]
            g = {"client": r.arrivals[j] - r.arrivals[j - 1], "engine": st["t1"] - prev["t1"],
                 "delivery": r.arrivals[j] - st["t1"], "wall": st["t1"] - st["t0"], "cpu": st["cpu"],
                 "adopt": st["adopt_s"], "gc": st["gc_s"], "loop": st["loop_s"], "long": st["ctx"] >= long_len}
            t_out = handed.get((r.id + "-0", st["t1"]))
            if t_out is not None:
                g["router"], g["http"] = t_out - st["t1"], r.arrivals[j] - t_out
            gaps.append(g)
    return gaps, skipped


def slow_gap_causes(gaps: list[dict], factor: float = 1.5) -> dict:
    """The gaps over ``factor`` x the median client gap, each named by the part that grew most over its median:
    the step itself (``wall``; ``wall, core taken`` when its CPU time did not grow with it), the KV adoption
    before it, the garbage collector, the rest of the loop, or the delivery to the client (with the router's
    trace: its MPI + router part or its HTTP + client part)."""
    if not gaps:
        return {}
    keys = ("client", "wall", "cpu", "loop", "delivery", "router", "http")
    med = {k: pct([g[k] for g in gaps if k in g], 50) for k in keys}
    causes: dict[str, int] = {}
    for g in gaps:
        if g["client"] <= factor * med["client"]:
            continue
        excess = {"step wall": g["wall"] - med["wall"], "adoption": g["adopt"], "gc": g["gc"],
                  "loop": g["loop"] - med["loop"], "delivery": g["delivery"] - med["delivery"]}
        if "router" in g:
            del excess["delivery"]
            excess["delivery: MPI + router"] = g["router"] - med["router"]
            excess["delivery: HTTP + client"] = g["http"] - med["http"]
        why = max(excess, key=excess.get)
        if why == "step wall" and g["cpu"] - med["cpu"] < 0.5 * excess["step wall"]:
            why = "step wall, core taken"
        causes[why] = causes.get(why, 0) + 1
    return causes


def print_trace_report(gaps: list[dict], skipped: int) -> None:
    print(f"decode rank, short decodes' gaps joined with its step trace ({len(gaps)} gaps; {skipped} requests not "
          "joinable); seconds, p50 / p99:")
    head = ("batch", "gaps", "client ITL", "step to step", "delivery", "router / http p99", "step wall", "cpu/wall",
            "adopt p99", "gc p99", "loop p99")
    lines = []
    for name, sel in (("no long sequence", [g for g in gaps if not g["long"]]),
                      ("a long sequence", [g for g in gaps if g["long"]])):
        if not sel:
            continue
        col = lambda k: [g[k] for g in sel]  # noqa: E731
        two = lambda k: f"{pct(col(k), 50):.3f} / {pct(col(k), 99):.3f}"  # noqa: E731
        split = [g for g in sel if "router" in g]
        lines.append((name, str(len(sel)), two("client"), two("engine"), two("delivery"),
                      f"{pct([g['router'] for g in split], 99):.3f} / {pct([g['http'] for g in split], 99):.3f}"
                      if split else "-", two("wall"),
                      f"{np.median([g['cpu'] / g['wall'] for g in sel if g['wall'] > 0]):.2f}",
                      f"{pct(col('adopt'), 99):.4f}", f"{pct(col('gc'), 99):.4f}", f"{pct(col('loop'), 99):.4f}"))
        causes = slow_gap_causes(sel)
        lines.append(("  gaps > 1.5x median", str(sum(causes.values())),
                      ", ".join(f"{k}: {v}" for k, v in sorted(causes.items(), key=lambda kv: -kv[1])) or "-",
                      "", "", "", "", "", "", "", ""))
    widths = [max(len(h), *(len(x[i]) for x in lines if i < 2 or x[3])) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for x in lines:
        if not x[3]:
            print(f"{x[0].rjust(widths[0])}  {x[1].rjust(widths[1])}  cause: {x[2]}")
        else:
            print("  ".join(v.rjust(w) for v, w in zip(x, widths)))
    own = [g["cpu"] + g["adopt"] + g["gc"] for g in gaps if not g["long"]]
    if own:
        print(f"the decode rank's own CPU time per gap without a long sequence (step + adoption + GC): p50 "
              f"{pct(own, 50):.3f} s, p99 {pct(own, 99):.3f} s, p99/p50 {pct(own, 99) / pct(own, 50):.2f}x (its "
              "ITL ratio with a core to itself; the rest of the client's ratio is the core taken and the delivery)")


def measure(args, label: str, server: ServeProcess, work, kinds, trace_dir: str | None = None) -> dict:
    from pyengine.bench.serve import Workload, run_load, scrape, summarize
    model = "pyengine"
    asyncio.run(run_load(server.url, model, Workload([[1000 + i for i in range(8)]], [2], [0.0]), args.timeout,
                         "warm-up"))
    b0 = scrape(server.url, "pyengine_kv_transfer_bytes_total") or 0.0
    s0 = scrape(server.url, "pyengine_kv_transfer_seconds_sum") or 0.0
    n0 = scrape(server.url, "pyengine_kv_transfer_seconds_count") or 0.0
    results, wall = asyncio.run(run_load(server.url, model, work, args.timeout, label))
    row = {"config": label, **summarize(results, wall)}
    for kind in ("short", "long"):
        sel = [r for r, k in zip(results, kinds) if k == kind]
        s = summarize(sel, wall)
        row.update({f"{kind}_{k}": s[k] for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "completed")})
        row[f"{kind}_goodput"] = goodput(sel, args.slo_ttft, args.slo_itl)
    row["goodput"] = goodput(results, args.slo_ttft, args.slo_itl)
    row["short_itl_p99_over_p50"] = row["short_itl_p99"] / row["short_itl_p50"] if row["short_itl_p50"] else float("nan")
    without, with_long, first = split_itls(results, kinds)
    row.update(itl_nolong_p50=pct(without, 50), itl_nolong_p99=pct(without, 99), itl_nolong_n=len(without),
               itl_long_p50=pct(with_long, 50), itl_long_p99=pct(with_long, 99), itl_long_n=len(with_long),
               first_gap_p50=pct(first, 50), first_gap_max=max(first, default=float("nan")))
    row["itl_nolong_ratio"] = row["itl_nolong_p99"] / row["itl_nolong_p50"] if without else float("nan")
    row["requests"] = [{"id": r.id, "kind": k, "ok": r.ok, "arrivals": r.arrivals} for r, k in zip(results, kinds)]
    if trace_dir is not None:
        from pyengine.disagg.step_trace import read
        files = sorted(os.listdir(trace_dir))
        steps = [st for f in files if f.endswith("-decode.jsonl") for st in read(os.path.join(trace_dir, f))]
        router = read(os.path.join(trace_dir, "rank0-router.jsonl")) if "rank0-router.jsonl" in files else []
        row["trace_gaps"], row["trace_skipped"] = join_trace(results, kinds, steps, args.long_prompt_len, router)
    n = (scrape(server.url, "pyengine_kv_transfer_seconds_count") or 0.0) - n0
    row["kv_bytes_per_request"] = ((scrape(server.url, "pyengine_kv_transfer_bytes_total") or 0.0) - b0) / n if n else None
    row["transfer_s_mean"] = ((scrape(server.url, "pyengine_kv_transfer_seconds_sum") or 0.0) - s0) / n if n else None
    return row


def print_rows(rows: list[dict]) -> None:
    cols = [("config", "config", "{}"), ("ok/fail", None, None), ("out tok/s", "out_tok_per_s", "{:.1f}"),
            ("short TTFT p50", "short_ttft_p50", "{:.2f}"), ("short TTFT p99", "short_ttft_p99", "{:.2f}"),
            ("short ITL p50", "short_itl_p50", "{:.3f}"), ("short ITL p99", "short_itl_p99", "{:.3f}"),
            ("p99/p50", "short_itl_p99_over_p50", "{:.2f}"), ("long TTFT p50", "long_ttft_p50", "{:.2f}"),
            ("long TTFT p99", "long_ttft_p99", "{:.2f}"), ("goodput", "goodput", "{:.2f}"),
            ("short / long goodput", None, None), ("KV MB/req", "kv_bytes_per_request", "{:.1f}"),
            ("transfer s", "transfer_s_mean", "{:.3f}")]
    cells = []
    for r in rows:
        line = []
        for name, key, fmt in cols:
            if name == "ok/fail":
                line.append(f"{r['completed']}/{r['failed']}")
            elif key is None:
                line.append(f"{r['short_goodput']:.2f} / {r['long_goodput']:.2f}")
            elif r.get(key) is None:
                line.append("-")
            else:
                line.append(fmt.format(r[key] / 1e6 if key == "kv_bytes_per_request" else r[key]))
        cells.append(line)
    widths = [max(len(c[0]), *(len(line[i]) for line in cells)) for i, c in enumerate(cols)]
    print("  ".join(c[0].rjust(w) for c, w in zip(cols, widths)))
    for line in cells:
        print("  ".join(v.rjust(w) for v, w in zip(line, widths)))


def run(args) -> int:
    if args.url:
        raise ValueError("--compare disagg starts its own servers (drop --url)")
    common = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--served-model-name", "pyengine"]
    if args.model:
        common += ["--model", args.model]
    if args.no_prefix_cache:
        common.append("--no-prefix-cache")
    if args.long_prompt_max + args.long_output_len > args.max_model_len:
        raise ValueError(f"--long-prompt-max + --long-output-len exceeds --max-model-len {args.max_model_len}")
    work, kinds = mixed_workload(args)
    print(f"workload: {kinds.count('short')} short ({args.prompt_len} -> {args.output_len} tokens) at {args.rate[0]:g}/s, "
          f"{kinds.count('long')} long ({args.long_prompt_len}-{args.long_prompt_max} -> {args.long_output_len}) at "
          f"{args.long_rate:g}/s; SLO TTFT <= {args.slo_ttft:g} s, every ITL <= {args.slo_itl:g} s", file=sys.stderr)
    rows = []
    configs = [(f"colocated (chunked prefill, {args.colocated_threads} threads)",
                common + args.colocated_args.split(), args.colocated_threads),
               ("disaggregated (1 prefill + 1 decode rank)",
                common + ["--prefill-instances", "1", "--decode-instances", "1"], 1)]
    if args.only:
        configs = [c for c in configs if ("--prefill-instances" in c[1]) == (args.only == "disagg")]
    import tempfile
    with tempfile.TemporaryDirectory(prefix="pyengine-trace-") as tmp:
        for i, (label, extra, threads) in enumerate(configs):
            trace_dir = os.path.join(args.trace_dir or tmp, str(i)) if "--prefill-instances" in extra else None
            env = {"PYENGINE_STEP_TRACE": trace_dir} if trace_dir else None
            with ServeProcess(extra, threads, env) as server:
                rows.append(measure(args, label, server, work, kinds, trace_dir))
    print_rows(rows)
    if len(rows) == 2:
        a, b = rows
        ratio = lambda k: a[k] / b[k] if b.get(k) else float("nan")  # noqa: E731
        print(f"[colocated] / [disaggregated]: short ITL p99 {ratio('short_itl_p99'):.2f}x, short ITL p50 "
              f"{ratio('short_itl_p50'):.2f}x, short TTFT p99 {ratio('short_ttft_p99'):.2f}x, long TTFT p50 "
              f"{ratio('long_ttft_p50'):.2f}x, output tok/s {ratio('out_tok_per_s'):.2f}x; goodput "
              f"{a['goodput']:.2f} vs {b['goodput']:.2f}")
    print(f"(SLO: TTFT <= {args.slo_ttft:g} s and every ITL <= {args.slo_itl:g} s; p99/p50 = the short decodes' "
          "ITL p99 over their median)")
    print("running short decodes' ITL by what the batch held (a long sequence decoding makes every step's attention "
          "longer; issue 19's target is the ratio without one, <= 1.5 disaggregated), and their first gap apart:")
    for r in rows:
        print(f"  [{r['config']}] no long sequence {r['itl_nolong_p50']:.3f} / {r['itl_nolong_p99']:.3f} s "
              f"(p99/p50 {r['itl_nolong_ratio']:.2f}x, {r['itl_nolong_n']} gaps); with one {r['itl_long_p50']:.3f} "
              f"/ {r['itl_long_p99']:.3f} s ({r['itl_long_n']} gaps); first gap p50 {r['first_gap_p50']:.3f} s, "
              f"max {r['first_gap_max']:.3f} s")
    for r in rows:
        if "trace_gaps" in r:
            print_trace_report(r["trace_gaps"], r["trace_skipped"])
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1, default=str)
    return 0 if all(r["failed"] == 0 for r in rows) else 1
