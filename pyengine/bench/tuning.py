"""`pyengine bench tuning`: sweep one constant of pyengine/tuning.py in a running engine.

For each value the same workloads run — single-stream decode, a batched decode step of B sequences, and a
prefill — and the table prints each value's median time as a ratio to the first value's, measured in the same
run (values are cycled round-robin, so the machine's drift spreads over all of them). The evidence behind the
constants in docs/performance.md comes from such sweeps.
"""
from __future__ import annotations

import os
import time

import numpy as np

from pyengine import tuning

HELP = "sweep a tuning constant (pyengine/tuning.py) and print each value's step times as ratios"


def add_arguments(p) -> None:
    p.add_argument("--param", required=True, choices=tuning.SWEEPABLE)
    p.add_argument("--values", required=True, help="comma list of values (the first is the baseline)")
    p.add_argument("--model", default=None, help="GGUF path (default: the bundled SmolLM2-135M)")
    p.add_argument("--batch", type=int, default=32, help="sequences of the batched decode step")
    p.add_argument("--context", type=int, default=256, help="context tokens of each sequence")
    p.add_argument("--prefill-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5, help="round-robin rounds over the values")
    p.add_argument("--quick", action="store_true", help="a short run (smoke test)")


def run(args) -> int:
    from pyengine.engine.forward_batch import ForwardBatch
    from pyengine.engine.args import EngineArgs
    from pyengine.model_files import resolve_model

    values = [int(v) for v in args.values.split(",") if v]
    if not values:
        raise SystemExit("--values needs at least one value")
    if args.quick:
        args.batch, args.context, args.rounds, args.prefill_tokens = 4, 48, 2, 24
    bs = 16
    per = -(-(args.context + args.rounds * len(values) * 2 + 2) // bs)
    runner = EngineArgs(model=resolve_model(args.model), max_model_len=args.context + per * bs,
                        max_num_batched_tokens=max(args.context, args.prefill_tokens), max_num_seqs=args.batch,
                        num_blocks=(args.batch + 1) * per, block_size=bs).create_runner()
    rng = np.random.default_rng(0)
    V = runner.config.vocab_size
    tables = [np.arange(s * per, (s + 1) * per, dtype=np.int32) for s in range(args.batch + 1)]
    for s in range(args.batch + 1):            # prefill every sequence's context once
        runner.run(ForwardBatch(rng.integers(0, V, args.context), np.arange(args.context), [args.context],
                                [args.context], [tables[s]], np.array([args.context - 1])))
    pos = [args.context] * (args.batch + 1)

    def decode(seqs):
        b = ForwardBatch(rng.integers(0, V, len(seqs)), np.array([pos[s] for s in seqs]), [1] * len(seqs),
                         [pos[s] + 1 for s in seqs], [tables[s] for s in seqs], np.arange(len(seqs)))
        t = time.perf_counter()
        runner.run(b)
        for s in seqs:
            pos[s] += 1
        return time.perf_counter() - t

    def prefill():
        n = args.prefill_tokens
        b = ForwardBatch(rng.integers(0, V, n), np.arange(n), [n], [n], [tables[0]], np.array([n - 1]))
        t = time.perf_counter()
        runner.run(b)
        return time.perf_counter() - t

    old = getattr(tuning, args.param)
    times = {v: {"single": [], "batch": [], "prefill": []} for v in values}
    load = f"; load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    print(f"sweep {args.param} over {values} (now {old}); {args.rounds} rounds{load}")
    try:
        for _ in range(args.rounds):
            for v in values:
                setattr(tuning, args.param, v)
                decode([args.batch])                                  # warm-up of this value's path
                times[v]["single"].append(decode([args.batch]))
                times[v]["batch"].append(decode(list(range(args.batch))))
                times[v]["prefill"].append(prefill())
    finally:
        setattr(tuning, args.param, old)
    base = {k: float(np.median(t)) for k, t in times[values[0]].items()}
    print(f"{'value':>8} {'single ms':>10} {'ratio':>6} {f'B={args.batch} ms':>10} {'ratio':>6} "
          f"{'prefill ms':>10} {'ratio':>6}")
    for v in values:
        med = {k: float(np.median(t)) for k, t in times[v].items()}
        print(f"{v:>8} {med['single'] * 1e3:10.2f} {med['single'] / base['single']:6.2f} "
              f"{med['batch'] * 1e3:10.2f} {med['batch'] / base['batch']:6.2f} "
              f"{med['prefill'] * 1e3:10.2f} {med['prefill'] / base['prefill']:6.2f}")
    return 0
