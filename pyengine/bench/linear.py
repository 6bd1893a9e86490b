"""`pyengine bench linear`: what a few rows cost through each `Linear` kind, and a (k+1)-token verification.

S14 verifies k drafts by scoring k+1 rows in one forward: that only pays if a few rows cost about what one row
costs. OpenBLAS's sgemm packs the whole weight on every call, and a loop of matvecs reads the weight once per
row; the resident matrices (`DenseLinear`, the LM head `BlockedLinear`) are therefore held as narrow column
blocks whose products stay in OpenBLAS's small-matrix kernel (layers/linear.py). This benchmark times, for
1..12 rows, every kind the forward holds: the resident kinds through their column blocks, next to the same
matrices as plain (in, out) arrays through a row loop and through one product (the layout they replaced); the
lean mode's `LeanLinear` matrices with its row loop forced on and with one product per call (LEAN_ROW_LOOP_MAX
in pyengine/tuning.py is the largest row count at which its loop still wins). Round-robin over ``--rounds``,
minimum of each (a shared host only adds delays). ``--forward`` also times whole forwards of one sequence
(and of 8) scoring q = 1..9 tokens, as ratios to q = 1: the cost of a verification of k = q - 1 drafts, which
the back-off (engine/spec_decode.py) prices by the same ratios.
"""
from __future__ import annotations

import os
import time

import numpy as np

from pyengine import tuning

HELP = ("cost of 1..12 rows per Linear kind (column blocks, row loop, one product) and of (k+1)-token "
        "verification forwards")


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="GGUF path (default: the bundled SmolLM2-135M)")
    p.add_argument("--rows", default="1,2,3,4,5,6,7,8,9,10,12", help="row counts (default 1..10,12)")
    p.add_argument("--kinds", default="dense,head,lean", help="comma list of dense,head,lean")
    p.add_argument("--rounds", type=int, default=3, help="round-robin rounds (minimum of each)")
    p.add_argument("--forward", action="store_true", help="also time whole (k+1)-token verification forwards")
    p.add_argument("--context", type=int, default=256, help="context tokens of each sequence (--forward)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time in process CPU seconds (one BLAS thread: the work done, less moved by a shared host)")
    p.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    p.add_argument("--formats", default=None, metavar="LIST",
                   help="S21: instead, one row times a (--shape) matrix per quant format (e.g. Q4_K,Q6_K,Q8_0,Q4_0,"
                        "Q4_1): the lean product (scales folded into the activations) vs dequantize + product vs "
                        "float32 (resident)")
    p.add_argument("--shape", default="5632x2048", metavar="OUTxIN", help="matrix of --formats (default: 1.1B's gate)")


def _chains(path: str, kinds: list[str]) -> dict:
    """kind -> (the matrices a forward multiplies through that kind, their input width)."""
    from pyengine.engine.args import EngineArgs
    from pyengine.layers.linear import BlockedLinear, DenseLinear, LeanLinear
    out = {}
    if "dense" in kinds or "head" in kinds:
        m = EngineArgs(model=path, max_model_len=64, max_num_seqs=1, max_num_batched_tokens=64).create_runner().weights
        lins = [lin for _, lin in m.linears()]
        out["dense"] = [x for x in lins if isinstance(x, DenseLinear) and not isinstance(x, BlockedLinear)]
        out["head"] = [x for x in lins if isinstance(x, BlockedLinear)]
    if "lean" in kinds:
        m = EngineArgs(model=path, max_model_len=64, max_num_seqs=1, max_num_batched_tokens=64,
                       weights_mode="lean").create_runner().weights
        out["lean"] = [x for _, x in m.linears() if isinstance(x, LeanLinear)]
    return {k: v for k, v in out.items() if k in kinds and v}


def _time_chain(lins, n: int, rng, mode: str) -> float:
    """One pass over the chain: "blocks" (the resident matrices' own matmul), or "loop" / "gemm" (the resident
    matrices as (in, out) arrays, ``dense_matmul`` with its row loop on / off; lean: its own, loop forced on /
    off)."""
    from pyengine.layers.linear import LeanLinear, dense_matmul
    xs = {lin.shape[0]: rng.standard_normal((n, lin.shape[0]), dtype=np.float32) for lin, _ in lins}
    outs = {lin.shape[1]: np.empty((n, lin.shape[1]), np.float32) for lin, _ in lins}
    name = "LEAN_ROW_LOOP_MAX" if isinstance(lins[0][0], LeanLinear) else "LINEAR_ROW_LOOP_MAX"
    saved = getattr(tuning, name)
    setattr(tuning, name, 64 if mode == "loop" else 1)
    try:
        t = time.perf_counter()
        for lin, w in lins:
            x, out = xs[lin.shape[0]], outs[lin.shape[1]]
            if mode == "blocks" or w is None:
                lin.matmul(x, out)
            else:
                dense_matmul(x, w, out)
        return time.perf_counter() - t
    finally:
        setattr(tuning, name, saved)


def crossover(loop: dict[int, float], gemm: dict[int, float]) -> int:
    """The largest row count up to which the row loop is never slower than one product (1: never loop)."""
    best = 1
    for n in sorted(loop):
        if n == 1:
            continue
        if loop[n] > gemm[n]:
            break
        best = n
    return best


def _rows(args, path) -> None:
    rows = [int(r) for r in args.rows.split(",") if r]
    kinds = [k for k in args.kinds.split(",") if k]
    # each resident matrix with its (in, out) array for the layouts it replaced; lean ones run as they are
    chains = {k: [(lin, None if k == "lean" else np.ascontiguousarray(lin.dense())) for lin in lins]
              for k, lins in _chains(path, kinds).items()}
    modes = {k: ("loop", "gemm") if k == "lean" else ("blocks", "loop", "gemm") for k in chains}
    rng = np.random.default_rng(0)
    best = {(k, n, mode): float("inf") for k in chains for n in rows for mode in modes[k]}
    for _ in range(args.rounds):
        for k, lins in chains.items():
            for n in rows:
                for mode in modes[k]:
                    best[(k, n, mode)] = min(best[(k, n, mode)], _time_chain(lins, n, rng, mode))
    names = {"blocks": "column blocks", "loop": "row loop", "gemm": "one product"}
    for k, lins in chains.items():
        mb = sum(lin.nbytes for lin, _ in lins) / 2 ** 20
        print(f"\n{k}: {len(lins)} matrices, {mb:.0f} MiB held; ms per chain (x one row, first column)")
        print(f"{'rows':>4} " + " ".join(f"{names[m]:>16}" for m in modes[k]))
        one = best[(k, rows[0], modes[k][0])]
        for n in rows:
            print(f"{n:>4} " + " ".join(f"{best[(k, n, m)] * 1e3:9.1f} ({best[(k, n, m)] / one:4.2f})"
                                        for m in modes[k]))
        if k == "lean":
            x = crossover({n: best[(k, n, 'loop')] for n in rows}, {n: best[(k, n, 'gemm')] for n in rows})
            print(f"row loop up to {x} rows (LEAN_ROW_LOOP_MAX now {tuning.LEAN_ROW_LOOP_MAX})")


def _forward(args, path) -> None:
    from pyengine.engine.forward_batch import ForwardBatch
    from pyengine.engine.args import EngineArgs

    qs, B, ctx, bs = list(range(1, 10)), 8, args.context, 16
    per = -(-(ctx + 16) // bs)
    runner = EngineArgs(model=path, max_model_len=per * bs, max_num_seqs=B, max_num_batched_tokens=max(ctx, B * 9),
                        num_blocks=B * per, block_size=bs, max_logits=B * 9).create_runner()
    rng = np.random.default_rng(0)
    V = runner.config.vocab_size
    tables = [np.arange(s * per, (s + 1) * per, dtype=np.int32) for s in range(B)]
    for s in range(B):
        runner.run(ForwardBatch(rng.integers(0, V, ctx), np.arange(ctx), [ctx], [ctx], [tables[s]],
                                np.array([ctx - 1])))

    def step(nseq: int, q: int) -> float:
        # every sequence scores q tokens at positions ctx..ctx+q-1 (rewritten each time: a verification)
        b = ForwardBatch(rng.integers(0, V, nseq * q), np.tile(np.arange(ctx, ctx + q), nseq), [q] * nseq,
                         [ctx + q] * nseq, tables[:nseq], np.arange(nseq * q))
        clock = time.process_time if args.cpu_time else time.perf_counter
        t = clock()
        runner.run(b)
        return clock() - t

    best = {(n, q): float("inf") for n in (1, B) for q in qs}
    for _ in range(args.rounds):
        for key in best:
            best[key] = min(best[key], step(*key))
    unit = "CPU ms" if args.cpu_time else "ms"
    print(f"\nwhole forward, context {ctx}: {unit} (x q = 1) for sequences x q scored tokens (k = q - 1 drafts)")
    print(f"{'q':>4} {'1 sequence':>16} {f'{B} sequences':>16}")
    for q in qs:
        a, b = best[(1, q)], best[(B, q)]
        print(f"{q:>4} {a * 1e3:9.1f} ({a / best[(1, 1)]:4.2f}) {b * 1e3:9.1f} ({b / best[(B, 1)]:4.2f})")


def _formats(args) -> None:
    """S21: per format, CPU ms of one row times a random matrix: LeanLinear as it runs (the decode stream of
    LEAN_STREAM_TYPES, else folded), LeanLinear folded (the product before the streams), its rows dequantized
    into the same L2-sized blocks then multiplied (the lean product before S21), and the float32 matrix
    (resident); alternated round by round, so a loaded host slows them alike."""
    from pyengine.gguf import quants
    from pyengine.gguf.quants import GGMLType
    from pyengine.layers.linear import LeanLinear, QuantMatrix

    n_out, n_in = (int(v) for v in args.shape.lower().split("x"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, n_in), dtype=np.float32)
    w = (rng.standard_normal((n_out, n_in), dtype=np.float32) * 0.05)
    print(f"\none row x ({n_out} x {n_in}), CPU ms, min of {args.rounds} rounds (x float32)")
    print(f"{'format':>7} {'lean':>16} {'lean folded':>16} {'dequant + product':>18} {'float32':>10} "
          f"{'max rel err':>12}")
    for name in args.formats.split(","):
        t = GGMLType[name.strip().upper()]
        raw = quants.quantizer(t)(w).reshape(n_out, -1)
        lin = LeanLinear(QuantMatrix([(raw, int(t))], n_in))
        lin.scratch = np.empty(lin.scratch_floats, np.float32)
        dense = np.ascontiguousarray(lin.dense())
        out = np.empty((1, n_out), np.float32)

        def dequant_product():
            for r0 in range(0, n_out, lin.block_rows):
                r1 = min(n_out, r0 + lin.block_rows)
                rows = lin.q.dequantize(lin.scratch[:(r1 - r0) * n_in].reshape(r1 - r0, n_in), r0, r1)
                np.matmul(x, rows.T, out=out[:, r0:r1])

        def folded():
            keep, tuning.LEAN_STREAM_MAX_ROWS = tuning.LEAN_STREAM_MAX_ROWS, 0
            try:
                lin.matmul(x, out)
            finally:
                tuning.LEAN_STREAM_MAX_ROWS = keep

        fns = {"lean": lambda: lin.matmul(x, out), "folded": folded, "dequant": dequant_product,
               "f32": lambda: np.matmul(x, dense, out=out)}
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(args.rounds):
            for k, fn in fns.items():
                c = time.process_time()
                fn()
                best[k] = min(best[k], time.process_time() - c)
        ref = x.astype(np.float64) @ dense.astype(np.float64)
        err = np.abs(lin.matmul(x) - ref).max() / np.abs(ref).max()
        f = best["f32"]
        print(f"{t.name:>7} {best['lean'] * 1e3:9.2f} ({best['lean'] / f:4.1f}x) "
              f"{best['folded'] * 1e3:9.2f} ({best['folded'] / f:4.1f}x) "
              f"{best['dequant'] * 1e3:10.2f} ({best['dequant'] / f:4.1f}x) {f * 1e3:10.2f} {err:12.1e}")


def run(args) -> int:
    if getattr(args, "formats", None):
        load = f"; load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
        print(f"pyengine bench linear --formats{load}")
        _formats(args)
        return 0
    from pyengine.model_files import resolve_model
    path = resolve_model(args.model)
    if args.quick:
        args.rows, args.rounds, args.context = "1,2,5", 1, 32
    load = f"; load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    print(f"pyengine bench linear: {os.path.basename(path)}, {args.rounds} rounds{load}")
    _rows(args, path)
    if args.forward:
        _forward(args, path)
    return 0
