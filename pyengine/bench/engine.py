"""`pyengine bench engine` (S03/S05/S12/S20): single-stream speed against the NumPy roofline, measured in
the same run, plus the KV-cache scaling claim and flash attention's memory claim.

  decode    greedy decode tok/s (one sequence, KV cache) vs a bare chain of matvecs over the same weight
            arrays (fused QKV, Wo, fused gate|up, down per layer, and the 49152x576 head): the roofline.
  prefill   tok/s for one prompt vs a bare chain of matmuls of the same shapes.
  batch     batched decode: B sequences (each ~128 tokens of context, scattered block tables) advance one
            token per step in one forward; aggregate tok/s for each B and its ratio to B=1.
  kv-cache  time per decode step at several context lengths with the cache vs recomputing the whole prefix
            each step (no cache); fitted growth exponents (per step: ~0 vs ~1; per sequence add 1).
  flash     tracemalloc peak and time of plain vs tiled flash attention for one long prefill.
  threads   a 22-token prompt's first-token time and decode tok/s with 1, 2 and the default BLAS threads, on the
            host as it is and with two busy loops the benchmark starts itself (bench/threads.py).
Timings are wall-clock medians; on a shared machine they are noisy, the ratios less so.
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import time
import tracemalloc

import numpy as np

from pyengine.bench.report import Checks, Progress, plan_line

HELP = "decode/prefill tok/s vs the NumPy roofline, KV-cache scaling, flash attention memory"
# --quick: every section at toy sizes (a smoke run of well under a minute; its ratios are not the README's)
QUICK = dict(decode_tokens=8, prefill_tokens=64, contexts="32,64", flash_tokens=256, repeat=1, batch_sizes="1,4",
             batch_context=32, batch_steps=3)


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="GGUF path (default: the bundled SmolLM2-135M)")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--contexts", default="64,128,256,512", help="context lengths for the KV-cache table")
    p.add_argument("--flash-tokens", type=int, default=2048, help="prefill length for the flash memory test")
    p.add_argument("--repeat", type=int, default=3, help="repetitions of the prefill / roofline timings")
    p.add_argument("--weights", choices=("resident", "lean"), default="resident")
    p.add_argument("--profile", action="store_true",
                   help="cProfile 16 single-stream decode steps and the largest batch's steps; print the top entries")
    p.add_argument("--batch-sizes", default="1,8,32", help="sequences per batched decode step")
    p.add_argument("--batch-context", type=int, default=128, help="context tokens of each batched sequence")
    p.add_argument("--batch-steps", type=int, default=8, help="timed batched decode steps per batch size")
    p.add_argument("--skip", default="", help="comma list of sections to skip: decode,prefill,batch,kv,flash,threads")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="BLAS threads (default: the cores this process may use, 1 when they are busy)")
    p.add_argument("--quick", action="store_true", help="toy sizes for every section (overrides the size options)")


def _median_time(fn, repeat: int) -> float:
    return _median_times(fn, repeat)[0]


def _median_times(fn, repeat: int) -> tuple[float, float]:
    """Median wall-clock and process-CPU seconds of ``fn()``. With one BLAS thread on a shared machine the
    CPU time is the steadier figure (it excludes time spent waiting for a core)."""
    wall, cpu = [], []
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return float(np.median(wall)), float(np.median(cpu))


def _load() -> str:
    try:
        return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())
    except (AttributeError, OSError):      # not on every platform (e.g. Pyodide)
        return "load average n/a"


def _layer_mats(runner):
    """The (in, out) matrices a forward multiplies, in order, plus the head (dequantized if lean)."""
    from pyengine.layers.linear import BlockedLinear
    mats = [np.ascontiguousarray(lin.dense()) for where, lin in runner.weights.linears() if where[0] == "layer"]
    head = runner.weights.head
    # the roofline is always the float32 chain: a lean head is dequantized into column blocks
    head = head if isinstance(head, BlockedLinear) else BlockedLinear(np.ascontiguousarray(head.dense().T))
    return mats, head


def roofline(mats, head, rows: int, head_rows: int = 1):
    """A function running the bare GEMM chain (rows x in) @ (in x out) over the weights, with out= buffers."""
    xs = {m.shape[0]: np.ones((rows, m.shape[0]), np.float32) for m in mats}
    ys = {m.shape: np.empty((rows, m.shape[1]), np.float32) for m in mats}
    hx = np.ones((head_rows, head.shape[0]), np.float32)
    logits = np.empty((head_rows, head.shape[1]), np.float32)

    def chain():
        for m in mats:
            np.matmul(xs[m.shape[0]], m, out=ys[m.shape])
        head.matmul(hx, logits)
    return chain


def batched_decode(runner, batch_sizes, context: int, steps: int, rng, profile=None):
    """{B: (median wall s, median cpu s) per decode step} for B sequences decoding together. Each sequence
    gets its own blocks from one shuffled pool (as a block manager hands them out) and a random prompt of
    ``context`` tokens, prefilled in ragged batches; then ``steps`` decode steps of all B are timed.
    ``profile``: a cProfile.Profile enabled around the timed steps of the largest B."""
    from pyengine.engine.forward_batch import ForwardBatch
    bs, vocab = runner.block_size, runner.config.vocab_size
    per_seq = -(-(context + steps + 2) // bs)
    results = {}
    for B in batch_sizes:
        pool = rng.permutation(runner.num_blocks)[:B * per_seq].astype(np.int32)
        tables = [pool[i * per_seq:(i + 1) * per_seq] for i in range(B)]
        per_batch = max(1, runner.max_num_batched_tokens // context)
        for s0 in range(0, B, per_batch):
            n = min(B, s0 + per_batch) - s0
            runner.run(ForwardBatch(rng.integers(0, vocab, n * context), np.tile(np.arange(context), n),
                                    [context] * n, [context] * n, tables[s0:s0 + n],
                                    np.arange(1, n + 1) * context - 1))
        walls, cpus = [], []
        for step in range(steps + 1):
            pos = np.full(B, context + step, dtype=np.int64)
            b = ForwardBatch(rng.integers(0, vocab, B), pos, [1] * B, list(pos + 1), tables, np.arange(B))
            prof = profile if profile is not None and step and B == max(batch_sizes) else None
            if prof:
                prof.enable()
            t, c = time.perf_counter(), time.process_time()
            runner.run(b)
            if prof:
                prof.disable()
            if step:                        # the first step warms up this batch size's buffers
                walls.append(time.perf_counter() - t)
                cpus.append(time.process_time() - c)
        results[B] = (float(np.median(walls)), float(np.median(cpus)))
    return results


def _estimates(runner, args, skip, contexts, batch_sizes, rng) -> dict[str, float]:
    """Seconds each section should take, from one timed decode step and one 64-token prefill."""
    vocab = runner.config.vocab_size
    runner.run(runner.contiguous_batch(rng.integers(0, vocab, 64), 0))
    t_pre = _median_time(lambda: runner.run(runner.contiguous_batch(rng.integers(0, vocab, 64), 0)), 1) / 64
    t_dec = _median_time(lambda: runner.run(runner.contiguous_batch([1], 64)), 3)
    out = {}
    if "prefill" not in skip:
        out["prefill"] = 2 * (args.repeat + 1) * args.prefill_tokens * t_pre
    if "decode" not in skip:
        out["decode"] = (args.decode_tokens + 16) * t_dec * 1.2
    if batch_sizes:
        out["batch"] = sum(B * args.batch_context * t_pre + (args.batch_steps + 1) * t_dec * max(1.0, B / 4)
                           for B in batch_sizes)
    if "kv" not in skip:
        out["kv"] = sum(2 * L * t_pre + max(5, args.repeat) * t_dec + max(1, args.repeat - 1) * L * t_pre
                        for L in contexts)
    if "flash" not in skip:   # attention grows with the square of the prompt: scale a 64-token prefill's
        out["flash"] = 2 * 64 * t_pre * (args.flash_tokens / 64) ** 2 / runner.config.n_layers
    if "threads" not in skip:  # 1, 2 and the default threads, quiet then beside two busy loops (about 2x slower)
        out["threads"] = 3 * 3 * (args.repeat * 22 * t_pre + args.decode_tokens * t_dec)
    return out


def _fit_exponent(xs, ys) -> float:
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def run(args) -> int:
    from pyengine.bench.threads import section as threads_section
    from pyengine.engine.args import EngineArgs
    from pyengine.engine.threads import apply_threads, describe
    from pyengine.layers.attention import flash_attention, grouped_attention
    from pyengine.model_files import resolve_model

    if args.quick:
        vars(args).update(QUICK)
    skip = set(filter(None, args.skip.split(",")))
    contexts = [int(c) for c in args.contexts.split(",") if c]
    path = resolve_model(args.model)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b] if "batch" not in skip else []
    max_len = max([args.prefill_tokens + 8, args.decode_tokens + 32, args.batch_context + args.batch_steps + 8]
                  + [c + 8 for c in contexts])
    # blocks: a full-length sequence for the single-stream sections, or all batched sequences at once
    per_seq = -(-(args.batch_context + args.batch_steps + 2) // 16)
    num_blocks = max(-(-max_len // 16), max(batch_sizes, default=0) * per_seq)
    print(f"model {os.path.basename(path)}; cpu_count {os.cpu_count()}; numpy {np.__version__}; "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')} "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; {_load()}")
    apply_threads(args.threads)
    print(describe())
    t = time.perf_counter()
    runner = EngineArgs(model=path, max_model_len=max_len,
                        max_num_batched_tokens=max(args.prefill_tokens, max(contexts)),
                        max_num_seqs=max(batch_sizes, default=1), num_blocks=num_blocks, block_size=16,
                        weights_mode=args.weights, kv_cache_dtype="auto").create_runner()
    print(f"load {time.perf_counter() - t:.1f} s; weights ({args.weights}) {runner.weights.nbytes / 2**20:.0f} MiB")
    print(runner.arena.summary())
    rng = np.random.default_rng(0)
    vocab = runner.config.vocab_size
    mats, head = _layer_mats(runner)
    checks = Checks()
    checks.sample_load()
    print(plan_line(_estimates(runner, args, skip, contexts, batch_sizes, rng)), flush=True)
    progress = Progress("prefill").start()

    if "prefill" not in skip:
        n = args.prefill_tokens
        prompt = rng.integers(0, vocab, n)
        batch = runner.contiguous_batch(prompt, 0)
        runner.run(batch)
        t_engine, c_engine = _median_times(lambda: runner.run(batch), args.repeat)
        chain = roofline(mats, head, n)
        chain()
        t_roof, c_roof = _median_times(chain, args.repeat)
        print(f"\nprefill {n} tokens: {n / t_engine:8.1f} tok/s ({t_engine * 1e3:.0f} ms) | roofline "
              f"{n / t_roof:8.1f} tok/s ({t_roof * 1e3:.0f} ms) | ratio {t_roof / t_engine:.2f} (target: >= 400 tok/s)")
        print(f"  cpu time: engine {c_engine * 1e3:.0f} ms = {n / c_engine:.0f} tok/s, roofline {c_roof * 1e3:.0f} ms, "
              f"ratio {c_roof / c_engine:.2f}")
        checks.not_above_roofline("prefill", t_roof / t_engine)

    if "decode" not in skip:
        progress.section = "decode"
        n = args.decode_tokens
        prompt = list(rng.integers(0, vocab, 16))
        logits = runner.run(runner.contiguous_batch(prompt, 0))
        steps, cpus = [], []
        pos = len(prompt)
        for _ in range(n):
            tok = int(np.argmax(logits[0]))
            b = runner.contiguous_batch([tok], pos)
            t, c = time.perf_counter(), time.process_time()
            logits = runner.run(b)
            steps.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
            pos += 1
        t_step, c_step = float(np.median(steps)), float(np.median(cpus))
        chain = roofline(mats, head, 1)
        chain()
        t_roof, c_roof = _median_times(chain, max(16, args.repeat))
        print(f"decode {n} tokens: {1 / t_step:8.1f} tok/s ({t_step * 1e3:.1f} ms/step, median; mean "
              f"{np.mean(steps) * 1e3:.1f}) | roofline {1 / t_roof:8.1f} tok/s ({t_roof * 1e3:.1f} ms) | "
              f"ratio {t_roof / t_step:.2f} (target: >= 0.8, ~30 tok/s)")
        glue = (c_step - c_roof) * 1e3 / runner.config.n_layers
        print(f"  cpu time: engine {c_step * 1e3:.1f} ms/step = {1 / c_step:.1f} tok/s, roofline "
              f"{c_roof * 1e3:.1f} ms, ratio {c_roof / c_step:.2f}; non-GEMM work ~{glue:.2f} ms per layer")
        checks.not_above_roofline("decode", t_roof / t_step)
        checks.positive("decode's non-GEMM work per layer", glue)
        if os.environ.get("OPENBLAS_NUM_THREADS") == "1":   # one thread: it should have had a whole core
            checks.cpu_share("decode", sum(cpus), sum(steps))
        if args.profile:
            prof = cProfile.Profile()
            batches = [runner.contiguous_batch([1], pos + i) for i in range(16)]
            prof.enable()
            for b in batches:
                runner.run(b)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
            print(s.getvalue())

    if batch_sizes:
        progress.section = "batch"
        prof = cProfile.Profile() if args.profile else None
        res = batched_decode(runner, batch_sizes, args.batch_context, args.batch_steps, rng, profile=prof)
        w1, c1 = res.get(1, (None, None))
        print(f"\nbatched decode, {args.batch_context} tokens of context each (aggregate tok/s = B / step time; "
              f"ratio = aggregate / B=1; serving target: >= 330 tok/s at B=32)")
        print(f"{'B':>4} {'step ms':>9} {'tok/s':>8} {'ratio':>6} {'cpu ms':>9} {'cpu tok/s':>10} {'cpu ratio':>9}")
        for B, (w, c) in res.items():
            rw = f"{(B / w) / (1 / w1):6.2f}" if w1 else f"{'-':>6}"
            rc = f"{(B / c) / (1 / c1):9.2f}" if c1 else f"{'-':>9}"
            print(f"{B:>4} {w * 1e3:>9.1f} {B / w:>8.1f} {rw} {c * 1e3:>9.1f} {B / c:>10.1f} {rc}")
        if w1:
            checks.batch_gains({B: (B / w) * w1 for B, (w, _) in res.items()})
        if prof is not None:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(10)
            print(f"profile of {args.batch_steps} steps at B={max(batch_sizes)}:\n{s.getvalue()}")

    if "kv" not in skip:
        progress.section = "kv"
        print("\nKV cache: ms per decode step at context L (with cache: append 1 token and attend; "
              "without: recompute all L tokens)")
        print(f"{'L':>6} {'cache ms':>10} {'no-cache ms':>12} {'speedup':>8}")
        cached, recomputed = [], []
        for L in contexts:
            prompt = rng.integers(0, vocab, L)
            runner.run(runner.contiguous_batch(prompt[:L - 1], 0))
            step = runner.contiguous_batch(prompt[L - 1:], L - 1)
            t_c = _median_time(lambda: runner.run(step), max(5, args.repeat))
            full = runner.contiguous_batch(prompt, 0)
            t_n = _median_time(lambda: runner.run(full), max(1, args.repeat - 1))
            cached.append(t_c)
            recomputed.append(t_n)
            print(f"{L:>6} {t_c * 1e3:>10.1f} {t_n * 1e3:>12.1f} {t_n / t_c:>8.1f}")
            checks.cache_helps(L, t_n / t_c)
        if len(contexts) >= 2:
            a, b = _fit_exponent(contexts, cached), _fit_exponent(contexts, recomputed)
            print(f"growth exponent per step: with cache {a:.2f}, without {b:.2f}; per generated sequence of "
                  f"length L (sum over steps): ~{a + 1:.2f} vs ~{b + 1:.2f} (linear vs quadratic)")

    if "flash" not in skip:
        progress.section = "flash"
        c = runner.config
        T = args.flash_tokens
        q = rng.standard_normal((T, c.n_heads, c.head_dim)).astype(np.float32)
        k = rng.standard_normal((T, c.n_kv_heads, c.head_dim)).astype(np.float32)
        v = rng.standard_normal((T, c.n_kv_heads, c.head_dim)).astype(np.float32)
        out = np.empty_like(q)
        results = {}
        for name, fn in (("plain", lambda: grouped_attention(q, k, v, out=out)),
                         ("flash", lambda: flash_attention(q, k, v, out=out))):
            tracemalloc.start()
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            results[name] = (peak, dt, out.copy())
        err = float(np.abs(results["plain"][2] - results["flash"][2]).max())
        print(f"\nattention for one {T}-token prefill (one layer, H={c.n_heads}, Hkv={c.n_kv_heads}): "
              f"plain peak {results['plain'][0] / 2**20:.1f} MiB, {results['plain'][1] * 1e3:.0f} ms | flash "
              f"peak {results['flash'][0] / 2**20:.1f} MiB, {results['flash'][1] * 1e3:.0f} ms | "
              f"memory ratio {results['plain'][0] / max(1, results['flash'][0]):.0f}x | max |diff| {err:.1e}")
    checks.sample_load()                        # before the threads section loads the host on purpose
    if "threads" not in skip:
        progress.section = "threads"
        threads_section(runner, args.decode_tokens, args.repeat)
        apply_threads(args.threads)             # as the run began
    progress.stop()
    print(_load())
    print(checks.verdict())
    return 0
