"""`pyengine perplexity --file TEXT`: llama-perplexity's figure for a model on a text (S08).

Non-overlapping windows of --ctx tokens, the second half of each scored (see `pyengine.perplexity`); a
progress bar with the running estimate on stderr, then ``Final estimate: PPL = ... +/- ...`` on stdout.
``--kl-divergence-base FILE`` also saves the scored log-probabilities (uint16 per vocabulary entry); a later
run with ``--kl-divergence-base FILE --kl-divergence`` (another quantization of the weights or the KV cache)
is compared against them on the same windows: KL divergence, top-token agreement, PPL ratio.
"""
from __future__ import annotations

import argparse
import sys
import time

from pyengine.engine.args import WEIGHTS_MODES, EngineArgs

HELP = "perplexity of a model on a text file (llama.cpp's method); KL divergence against a saved base run"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH", default=None, help="GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--file", "-f", required=True, metavar="TEXT", help="UTF-8 text file to score")
    p.add_argument("--ctx", "-c", type=int, default=None, metavar="N",
                   help="window size in tokens (default 512, or the base file's with --kl-divergence)")
    p.add_argument("--chunks", type=int, default=None, metavar="N", help="score at most N windows")
    from pyengine.engine.kv_cache import KV_DTYPES
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_DTYPES,
                   help="KV cache storage: auto (float32), fp16, q8_0, q4_0")
    p.add_argument("--weights", dest="weights_mode", default="resident", choices=WEIGHTS_MODES,
                   help="resident: float32 weights (fastest); lean: quantized, dequantized per matrix (S21)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="BLAS threads (default: the cores this process may use, 1 when they are busy)")
    p.add_argument("--kl-divergence-base", metavar="FILE", default=None,
                   help="save the scored log-probs here (or, with --kl-divergence, read them)")
    p.add_argument("--kl-divergence", action="store_true", help="compare against --kl-divergence-base FILE")


def _bar(i: int, n: int, text: str, width: int = 30) -> str:
    done = int(width * (i + 1) / n)
    return f"\r[{'#' * done}{'.' * (width - done)}] {i + 1}/{n} {text}"


def make_runner(model, ctx: int, kv_cache_dtype: str = "auto", weights_mode: str = "resident", threads=None):
    """A runner sized for one window at a time (the scored half of the logits kept in the arena)."""
    from pyengine.engine.threads import apply_threads

    eargs = EngineArgs(model=model, max_model_len=ctx, max_num_batched_tokens=min(ctx, 2048), max_num_seqs=1,
                       max_logits=ctx // 2, weights_mode=weights_mode, kv_cache_dtype=kv_cache_dtype, threads=threads)
    gguf = eargs.load_model()
    apply_threads(eargs.threads)
    return eargs.create_runner(gguf)


def run(args) -> int:
    import numpy as np

    from pyengine import perplexity as P
    from pyengine.model_files import resolve_model

    if args.kl_divergence and not args.kl_divergence_base:
        raise ValueError("--kl-divergence needs --kl-divergence-base FILE (made by a run without --kl-divergence)")
    if args.chunks is not None and args.chunks < 1:
        raise ValueError(f"--chunks must be >= 1, got {args.chunks}")
    t0 = time.perf_counter()
    base = None
    if args.kl_divergence:
        base_file = open(args.kl_divergence_base, "rb")
        base = P.KLBase(base_file)
        if args.ctx not in (None, base.ctx):
            raise ValueError(f"--ctx {args.ctx} differs from the base file's {base.ctx}")
        args.ctx = base.ctx
    else:
        args.ctx = args.ctx or 512
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    runner = make_runner(resolve_model(args.model), args.ctx, args.kv_cache_dtype, args.weights_mode,
                         getattr(args, "threads", None))
    print(f"model loaded in {time.perf_counter() - t0:.1f} s; KV cache {args.kv_cache_dtype}", file=sys.stderr)

    if base is not None:
        if args.chunks:
            base.wins = base.wins[:args.chunks]

        def progress(i, n, stats):
            sys.stderr.write(_bar(i, n, f"PPL {P.ppl_estimate(np.concatenate(stats.nll)).ppl:.4f}"))
        try:
            summary = P.kl_divergence(runner, base, on_window=progress)
        finally:
            base_file.close()
        sys.stderr.write("\n")
        print(P.format_kl(summary))
        print(f"Final estimate: PPL = {summary['ppl']:.4f} +/- {summary['ppl_err']:.5f}")
        return 0

    tok = runner.tokenizer
    ids = tok.encode(text, add_special_tokens=True, parse_special=False)
    bos = tok.bos_token_id if tok.add_bos_token else None
    wins = P.windows(ids, args.ctx, bos)[:args.chunks]
    print(f"{len(ids)} tokens, {len(wins)} windows of {args.ctx}, {len(wins) * (args.ctx - 1 - args.ctx // 2)} "
          f"scored", file=sys.stderr)
    writer = out = None
    if args.kl_divergence_base:
        out = open(args.kl_divergence_base, "wb")
        writer = P.KLBaseWriter(out, wins, runner.config.vocab_size)
    try:
        final = P.perplexity(runner, wins, on_logits=writer and writer.add,
                             on_window=lambda i, n, est: sys.stderr.write(
                                 _bar(i, n, f"PPL {est.ppl:.4f} +/- {est.err:.4f}")))
    finally:
        if out is not None:
            out.close()
    sys.stderr.write("\n")
    print(f"Final estimate: PPL = {final.ppl:.4f} +/- {final.err:.5f}")
    print(f"({final.n_tokens} tokens scored in {time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return 0
