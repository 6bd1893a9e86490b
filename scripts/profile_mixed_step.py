"""S11: where the time of a mixed step goes (issue 19 item 0), against a calm step and the unchunked prefill.

Runs, interleaved, on one ModelRunner (plain steps, no capture, so each call can be timed):
  calm    8 decodes (40-token contexts)
  chunk   a C-token chunk of an N-token prompt from position S, alone
  mixed   the 8 decodes and that chunk in one step
and the whole N-token prompt in one step (unchunked), and prints per component (linear layers, LM head, the
chunk's attention run, the decodes' attention group, RoPE, norms, the plan, ...) the median process CPU time, the
mixed step minus the chunk alone (what the decodes add to a step with prompt work) and C x the unchunked cost per
token. CPU time, one BLAS thread recommended (OPENBLAS_NUM_THREADS=1): on a shared host it is the steadier clock.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/profile_mixed_step.py --prompt 2048 --chunk 48 --start 1536
"""
from __future__ import annotations

import argparse
import collections
import time

import numpy as np

from pyengine.engine.args import EngineArgs
from pyengine.engine.forward_batch import ForwardBatch
from pyengine.layers import paged_attention as pa
from pyengine.models import base as mbase

acc: dict = collections.defaultdict(float)


class TimingOps(mbase.EagerOps):
    """EagerOps that adds each call's CPU time to ``acc`` under its component's name."""

    def _timed(self, name, f, *args):
        t0 = time.process_time()
        f(*args)
        acc[name] += time.process_time() - t0

    def call(self, f, *args):
        self._timed("call:" + getattr(f, "__name__", type(f).__name__), f, *args)

    def rms_norm(self, x, w, eps, out):
        self._timed("rms_norm", super().rms_norm, x, w, eps, out)

    def matmul(self, lin, x, out):
        self._timed("lm_head" if lin.shape[1] > 10000 else "linear", super().matmul, lin, x, out)

    def gated(self, lin, x, out, scratch):
        self._timed("linear", super().gated, lin, x, out, scratch)

    def rope(self, *args):
        self._timed("rope", super().rope, *args)

    def attention(self, i, q, kv, plan, out, scratch, scale):
        for g in plan.groups:
            self._timed("attention: decode groups", pa.group_attention, i, q, kv, g, out, scratch, scale)
        for r in plan.runs:
            self._timed("attention: chunk run", pa.run_attention, i, q, kv, r, out, scratch, scale, plan.window)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt", type=int, default=2048, help="N: the long prompt's tokens")
    ap.add_argument("--chunk", type=int, default=48, help="C: the chunk's tokens")
    ap.add_argument("--start", type=int, default=None, help="S: the chunk's first position (default 3N/4)")
    ap.add_argument("--decodes", type=int, default=8)
    ap.add_argument("--reps", type=int, default=12)
    a = ap.parse_args()
    N, C, D = a.prompt, a.chunk, a.decodes
    S = 3 * N // 4 if a.start is None else a.start
    runner = EngineArgs(model=a.model, max_model_len=N + 64, max_num_batched_tokens=N + D + 16, max_num_seqs=D + 1,
                        enforce_eager=True).create_runner()
    bs, nb = runner.block_size, runner.num_blocks
    rng = np.random.default_rng(2)
    long_ids = rng.integers(1000, 30000, size=N)
    long_table = np.arange(-(-N // bs), dtype=np.int32)                 # one consecutive run, as the allocator gives
    ctx = 40
    dec_tables = [np.arange(nb - (j + 1) * 4, nb - j * 4, dtype=np.int32) for j in range(D)]
    dec_ids = rng.integers(1000, 30000, size=(D, ctx))

    def batch(decodes: bool, chunk: tuple | None) -> ForwardBatch:
        tok, pos, ql, cl, bt, li = [], [], [], [], [], []
        if decodes:
            for j in range(D):
                tok.append(dec_ids[j][-1]); pos.append(ctx - 1); ql.append(1); cl.append(ctx)
                bt.append(dec_tables[j]); li.append(len(tok) - 1)
        if chunk is not None:
            s, n = chunk
            tok.extend(long_ids[s:s + n]); pos.extend(range(s, s + n)); ql.append(n); cl.append(s + n)
            bt.append(long_table)                                        # a mid-prompt chunk: no logits row
        return ForwardBatch(token_ids=np.array(tok, np.int64), positions=np.array(pos, np.int64), query_lens=ql,
                            context_lens=cl, block_tables=bt, logits_indices=np.array(li, np.int64))

    ops = TimingOps()

    def run(b: ForwardBatch, timed: bool = True) -> dict:
        acc.clear()
        t0 = time.process_time()
        b.validate(runner.block_size, runner.num_blocks, runner.config.vocab_size)
        plan = runner.plan(b)
        acc["plan"] += time.process_time() - t0
        runner.model.forward(plan, runner.kv_cache, runner.buffers.rows(plan.num_tokens),
                             ops=ops if timed else mbase.EAGER)
        acc["step"] = time.process_time() - t0
        return dict(acc)

    for s in range(0, N, 512):                                            # real K/V for the prompt's prefix
        run(batch(False, (s, min(512, N - s))), timed=False)
    rows: dict = collections.defaultdict(list)
    for r in range(a.reps):
        for name, b in (("calm", batch(True, None)), ("chunk", batch(False, (S, C))), ("mixed", batch(True, (S, C)))):
            rows[name].append(run(b))
        if r % 4 == 0:
            rows["unchunked"].append(run(batch(False, (0, N))))
    first = ["step", "linear", "lm_head", "attention: chunk run", "attention: decode groups", "rope", "rms_norm",
             "plan"]
    keys = first + sorted({k for v in rows.values() for r in v for k in r} - set(first))
    med = {n: {k: float(np.median([r.get(k, 0.0) for r in v])) for k in keys} for n, v in rows.items()}
    print(f"{D} decodes (context {ctx}); chunk of {C} tokens from position {S} of a {N}-token prompt; median CPU ms "
          f"over {a.reps} interleaved repetitions ({len(rows['unchunked'])} of the unchunked prompt)")
    print(f"  {'component':<26}{'calm':>9}{'chunk':>9}{'mixed':>9}{'mixed-chunk':>12}{'C x unch.':>10}")
    for k in keys:
        m = {n: 1000 * med[n][k] for n in med}
        print(f"  {k:<26}{m['calm']:9.2f}{m['chunk']:9.2f}{m['mixed']:9.2f}{m['mixed'] - m['chunk']:12.2f}"
              f"{C * m['unchunked'] / N:10.2f}")
    d, mx, ch, u = (med[n]["step"] for n in ("calm", "mixed", "chunk", "unchunked"))
    print(f"  what the decodes add to a step with prompt work: {(mx - ch) / d:.2f} x their own step; the chunk alone: "
          f"{ch / (C * u / N):.2f} x its tokens' share of the unchunked prefill (attention there averages over "
          f"{N // 2} keys, here {S + C // 2}); mixed - C x unchunked per token = {(mx - C * u / N) / d:.2f} x the "
          f"decodes' step")


if __name__ == "__main__":
    main()
