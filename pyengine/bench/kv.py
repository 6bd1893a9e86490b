"""`pyengine bench kv` (S08): where the error of fewer bits lands, and what the bits buy, in one run.

Table 1, per KV cache dtype (auto = float32, fp16, q8_0, q4_0), per model:
  bytes/token    K+V bytes of one token over all layers
  blocks         KV blocks the default budget holds (ModelRunner's DEFAULT_KV_BUDGET_BYTES, 16-token blocks)
  2k seqs        2048-token sequences those blocks hold at once
  PPL, KL        perplexity on the sample text (pyengine.bench.corpus: Genesis, KJV) and the mean KL
                 divergence / top-1 agreement against the float32 cache's run on the same windows
  decode 512 / 2048   single-stream decode tok/s with that many tokens of context
  32 x ctx       aggregate decode tok/s of 32 sequences with ``--batch-context`` tokens each
The decode timings fill the cache with random K/V instead of a prefill (the time of a step depends on the
context length, not on what it holds) so that 32 long sequences take seconds, not minutes. One runner times
every dtype (its float32 cache swapped for one of each other dtype in turn), alternating with float32 in
``--rounds`` rounds per shape and keeping each one's best: the decode ratios compare runs under the same load.
``--decode-only`` skips PPL / KL (a speed check).

Table 2, per weight format written by `pyengine quantize` from the model file: size, PPL and KL against the
original file (float32 KV), single-stream decode tok/s in the resident and lean weight modes.

``--only scales`` (no model): per head shape, the K and V sides of one decode group over Q8_0 keys with the
block scales folded into scores / probabilities against casting the values and scaling them in place: the
measurement behind layers/attention.py folding them at every head size.
Ratios against the first row are measured in the same run; absolute figures drift with the shared machine.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np

HELP = "KV cache dtypes and weight formats: bytes, sequences per budget, PPL / KL, decode speed"
KV_DTYPES = ("auto", "fp16", "q8_0", "q4_0")
WEIGHT_TYPES = ("Q8_0", "Q6_K", "Q4_K", "Q4_1", "Q4_0")


def add_arguments(p) -> None:
    p.add_argument("--model", action="append", default=None, metavar="PATH",
                   help="GGUF file (repeatable; default: SmolLM2-135M and, if assembled, Gemma 3 270M)")
    p.add_argument("--quick", action="store_true", help="fewer windows and steps (about a minute per table)")
    p.add_argument("--only", choices=("kv", "weights", "scales"), default=None,
                   help="one table only (scales: the Q8_0 scale-folding measurement, no model)")
    p.add_argument("--ctx", type=int, default=None, help="perplexity window (default 512; --quick 256)")
    p.add_argument("--windows", type=int, default=None, help="perplexity windows (default 8; --quick 2)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps (default 16; --quick 4)")
    p.add_argument("--batch-context", type=int, default=None,
                   help="context of each of the 32 sequences (default 2048; --quick 512)")
    p.add_argument("--dtypes", default=",".join(KV_DTYPES))
    p.add_argument("--rounds", type=int, default=None,
                   help="alternating timing rounds per decode shape, best kept (default 3; --quick 1)")
    p.add_argument("--decode-only", action="store_true",
                   help="table 1 without PPL / KL: the decode columns only (a speed check)")
    p.add_argument("--types", default=",".join(WEIGHT_TYPES), help="weight formats of table 2")


def _models(args) -> list[str]:
    from pyengine.model_files import resolve_model
    if args.model:
        return [resolve_model(m) for m in args.model]
    out = [resolve_model(None)]
    gemma = os.path.join(os.path.dirname(__file__), "..", "..", ".cache", "models", "gemma-3-270m-q4_k_m.gguf")
    if os.path.isfile(gemma):
        out.append(os.path.abspath(gemma))
    return out


def _text_windows(runner, ctx: int, n: int) -> list[np.ndarray]:
    from pyengine import perplexity as P
    from pyengine.bench.corpus import sample_text
    tok = runner.tokenizer
    ids = tok.encode(sample_text(), add_special_tokens=True, parse_special=False)
    return P.windows(ids, ctx, tok.bos_token_id if tok.add_bos_token else None)[:n]


def _ppl_kl(runner, wins, base_path: str | None, base_out: str | None):
    """(PPL, KL summary or None): with ``base_out`` the log-probs are saved there (this is the base run)."""
    from pyengine import perplexity as P
    if base_out is not None:
        with open(base_out, "wb") as f:
            writer = P.KLBaseWriter(f, wins, runner.config.vocab_size)
            return P.perplexity(runner, wins, on_logits=writer.add).ppl, None
    with open(base_path, "rb") as f:
        s = P.kl_divergence(runner, P.KLBase(f))
    return s["ppl"], s


def _fill_random(kv, n_slots: int, rng) -> None:
    """Random K/V in the first n_slots slots of every layer (in chunks: quantized writes take temporaries)."""
    step = 4096
    for layer in range(kv.n_layers):
        for s in range(0, n_slots, step):
            slots = np.arange(s, min(n_slots, s + step))
            k = rng.standard_normal((len(slots), kv.n_kv_heads, kv.head_dim), dtype=np.float32)
            kv.write(layer, slots, k, k)


def _decode_rate(runner, n_seqs: int, context: int, steps: int, rng, fill: bool = True) -> float:
    """Aggregate decode tok/s of n_seqs sequences with ``context`` tokens each (consecutive block runs from
    block 0; ``fill`` False: the cache's first slots already hold K/V)."""
    from pyengine.engine.forward_batch import ForwardBatch
    bs = runner.block_size
    nb = -(-(context + steps + 1) // bs)
    if fill:
        _fill_random(runner.kv_cache, n_seqs * nb * bs, rng)
    tables = [np.arange(s * nb, (s + 1) * nb, dtype=np.int32) for s in range(n_seqs)]
    tokens = rng.integers(100, 20000, size=n_seqs)

    def step(i):
        ctx = context + i
        runner.run(ForwardBatch(tokens, np.full(n_seqs, ctx), [1] * n_seqs, [ctx + 1] * n_seqs, tables,
                                np.arange(n_seqs)))
    step(0)                                                  # warm-up (first touch of the scratch)
    t = time.perf_counter()
    for i in range(1, steps + 1):
        step(i)
    return n_seqs * steps / (time.perf_counter() - t)


def _decode_table(g, c, args, rng) -> tuple[dict, dict]:
    """({dtype: {shape: tok/s}}, {dtype: {shape: tok/s / float32's tok/s}}) for the shapes (1, 512),
    (1, 2048), (32, batch_context). One runner (float32 KV) whose cache is swapped for one of each other dtype
    in turn (K/V random, filled once); the two are timed in alternating rounds, each shape ``args.rounds``
    times, keeping each one's best: on a shared machine the load changes between rounds, and alternating puts
    both dtypes under the same load."""
    from pyengine.arena import Arena
    from pyengine.engine.kv_cache import PagedKVCache
    from pyengine.engine.args import EngineArgs
    shapes = [(1, 512, args.steps), (1, 2048, args.steps), (32, args.batch_context, max(2, args.steps // 2))]
    bs = 16
    nb_seq = -(-(max(2048, args.batch_context) + args.steps + 2) // bs)
    runner = EngineArgs(model=g, max_model_len=nb_seq * bs, max_num_batched_tokens=32, max_num_seqs=32,
                        num_blocks=32 * nb_seq, kv_cache_dtype="auto").create_runner()
    base = runner.kv_cache
    _fill_random(base, base.num_blocks * bs, rng)
    best = {d: {} for d in set(args.dtypes) | {"auto"}}
    ratio = {d: {} for d in args.dtypes}
    for dtype in args.dtypes:
        if dtype == "auto":
            caches = {"auto": base}
        else:
            kv = PagedKVCache(Arena.from_specs(PagedKVCache.arena_specs(c.n_layers, base.num_blocks, bs,
                                                                        c.n_kv_heads, c.head_dim, dtype)),
                              c.n_layers, base.num_blocks, bs, c.n_kv_heads, c.head_dim, dtype)
            _fill_random(kv, kv.num_blocks * bs, rng)
            caches = {"auto": base, dtype: kv}
        for shape in shapes:
            pair = dict.fromkeys(caches, 0.0)
            for _ in range(args.rounds):
                for d, kv in caches.items():
                    runner.kv_cache = kv
                    pair[d] = max(pair[d], _decode_rate(runner, *shape, rng, fill=False))
            for d, r in pair.items():
                best[d][shape[:2]] = max(best[d].get(shape[:2], 0.0), r)
            ratio[dtype][shape[:2]] = pair[dtype] / pair["auto"]
        runner.kv_cache = base
        del caches
    return best, ratio


def _fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def kv_table(path: str, args, tmp: str) -> None:
    from pyengine.config import ModelConfig
    from pyengine.engine.kv_cache import PagedKVCache
    from pyengine.engine.args import DEFAULT_KV_BUDGET_BYTES, EngineArgs
    from pyengine.gguf.reader import GGUFFile

    g = GGUFFile(path)
    c = ModelConfig.from_gguf(g)
    print(f"\n== KV cache dtypes: {os.path.basename(path)} ({c.n_layers} layers, {c.n_kv_heads} KV heads x "
          f"{c.head_dim}); PPL over {args.windows} windows of {args.ctx}; decode {args.steps} steps x {args.rounds} "
          f"rounds ==")
    try:
        EngineArgs(model=g, max_model_len=64, num_blocks=8, max_num_seqs=1, max_num_batched_tokens=64).create_runner()
    except ValueError as exc:
        print(f"  skipped: {exc}")
        return
    base = os.path.join(tmp, "kv_base.kld")
    head = (f"  {'dtype':6} {'bytes/tok':>9} {'blocks':>7} {'2k seqs':>7} {'PPL':>8} {'dPPL%':>7} {'KL':>9} "
            f"{'top1%':>6} {'tok/s@512':>9} {'tok/s@2048':>10} {f'32x{args.batch_context}':>9}")
    print(head)
    rows, first = [], None
    rng = np.random.default_rng(0)
    rates, ratios = _decode_table(g, c, args, rng)
    for dtype in args.dtypes:
        per_block = PagedKVCache.bytes_per_block(c.n_layers, 16, c.n_kv_heads, c.head_dim, dtype)
        blocks = DEFAULT_KV_BUDGET_BYTES // per_block                  # the runner's default, before its floor
        ppl, kl = None, None
        if not args.decode_only:
            runner = EngineArgs(model=g, max_model_len=args.ctx, max_num_batched_tokens=args.ctx,
                                max_num_seqs=1, max_logits=args.ctx // 2, kv_cache_dtype=dtype).create_runner()
            wins = _text_windows(runner, args.ctx, args.windows)
            ppl, kl = _ppl_kl(runner, wins, base, base if first is None else None)
            del runner
        d512, d2048, dbatch = (rates[dtype][s] for s in ((1, 512), (1, 2048), (32, args.batch_context)))
        row = dict(dtype=dtype, bpt=per_block // 16, blocks=blocks, seqs=blocks * 16 // 2048, ppl=ppl,
                   kl=kl and kl["kl_mean"], top=kl and 100 * kl["same_top"], d512=d512, d2048=d2048, dbatch=dbatch,
                   ratios=ratios[dtype])
        first = first or row
        row["dppl"] = None if ppl is None else 100 * (ppl / first["ppl"] - 1)
        rows.append(row)
        print(f"  {dtype:6} {row['bpt']:9d} {blocks:7d} {row['seqs']:7d} {_fmt(ppl, '8.4f'):>8} "
              f"{_fmt(row['dppl'], '+7.3f'):>7} "
              f"{_fmt(row['kl'], '.6f'):>9} {_fmt(row['top'], '.2f'):>6} {d512:9.1f} {d2048:10.1f} {dbatch:9.1f}",
              flush=True)
    print(f"  ratios to the first row (same run; decode: to float32 KV timed in alternating rounds, best of "
          f"{args.rounds}):")
    for r in rows[1:]:
        x = r["ratios"]
        print(f"    {r['dtype']:6} blocks x{r['blocks'] / first['blocks']:.2f}  PPL {_fmt(r['dppl'], '+.3f')}%  "
              f"decode@512 x{x[1, 512]:.2f}  @2048 x{x[1, 2048]:.2f}  "
              f"32x{args.batch_context} x{x[32, args.batch_context]:.2f}")


def weights_table(path: str, args, tmp: str) -> None:
    from pyengine.cli.quantize import quantize_model
    from pyengine.engine.args import EngineArgs

    print(f"\n== weight formats by `pyengine quantize` from {os.path.basename(path)}: PPL over {args.windows} "
          f"windows of {args.ctx}, KL vs the original file, decode at 128 tokens of context ==")
    print(f"  {'weights':10} {'MiB':>7} {'PPL':>8} {'dPPL%':>7} {'KL':>9} {'top1%':>6} {'resident':>9} {'lean':>7}")
    base = os.path.join(tmp, "w_base.kld")
    rng = np.random.default_rng(1)
    files = [("original", path)]
    for t in args.types:
        out = os.path.join(tmp, f"w-{t}.gguf")
        t0 = time.perf_counter()
        quantize_model(path, out, t)
        print(f"  (quantized {t} in {time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
        files.append((t, out))
    first = None
    for name, f in files:
        rates = {}
        for mode in ("resident", "lean"):
            runner = EngineArgs(model=f, max_model_len=max(args.ctx, 256), max_num_batched_tokens=args.ctx,
                                max_num_seqs=1, max_logits=args.ctx // 2, weights_mode=mode,
                                kv_cache_dtype="auto").create_runner()
            if mode == "resident":
                wins = _text_windows(runner, args.ctx, args.windows)
                ppl, kl = _ppl_kl(runner, wins, base, base if first is None else None)
            rates[mode] = _decode_rate(runner, 1, 128, args.steps, rng)
            del runner
        first = first or ppl
        print(f"  {name:10} {os.path.getsize(f) / 2**20:7.1f} {ppl:8.4f} {100 * (ppl / first - 1):+7.3f} "
              f"{_fmt(kl and kl['kl_mean'], '.6f'):>9} {_fmt(kl and 100 * kl['same_top'], '.2f'):>6} "
              f"{rates['resident']:9.1f} {rates['lean']:7.1f}", flush=True)


# --- --only scales: the measured rule behind folding the Q8_0 scales (layers/attention.py) ------------------
SCALE_SHAPES = (("SmolLM2-135M", 3, 64, 3), ("Gemma 3 270M", 1, 256, 4))   # (KV heads, head_dim, queries per KV head)


def _best(fns: dict, rounds: int) -> dict:
    """Best time (µs) of each callable, timed in alternating rounds (each round calls every one once)."""
    for f in fns.values():
        f()
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            t = time.perf_counter()
            f()
            best[name] = min(best[name], (time.perf_counter() - t) * 1e6)
    return best


def scales_table(args) -> None:
    """One decode query group over 2048 Q8_0 keys per head shape, in 1024-key tiles (data in cache): the K
    and V sides with the block scales folded into scores / probabilities (what stored_decode_attention does)
    against casting the values and scaling them in place (then one product per key chunk, as float32 KV)."""
    from pyengine import tuning
    from pyengine.gguf.quants import quantize_q8_0
    from pyengine.layers.attention import _block_scales, _tile_values
    L, t, chunk = 2048, 1024, tuning.DECODE_KEY_CHUNK
    rounds = 20 if args.quick else 200
    print(f"\n== Q8_0 block scales: fold vs cast-then-scale, {L} keys in {t}-key tiles, best of {rounds} "
          f"alternating rounds (µs) ==")
    print(f"  {'head shape':28} {'K fold':>8} {'K scale':>8} {'V fold':>8} {'V scale':>8} {'f32 K':>7} {'f32 V':>7}"
          "   fold / cast-then-scale")
    rng = np.random.default_rng(0)
    for name, Hkv, hd, g in SCALE_SHAPES:
        nb = hd // 32
        x = rng.standard_normal((2, L * Hkv, hd)).astype(np.float32)
        raw = [np.asarray(quantize_q8_0(x[i])).reshape(1, L, Hkv, nb * 34) for i in range(2)]
        kf, vf = (x[i].reshape(1, L, Hkv, hd) for i in range(2))
        q = rng.standard_normal((1, Hkv, g, hd)).astype(np.float32)
        qs = q.reshape(1, Hkv, g, nb, 32).transpose(0, 1, 3, 2, 4)
        vals = np.empty(t * Hkv * nb * 34, np.float32)
        cast = np.empty((1, t, Hkv, nb, 32), np.float32)
        sbuf = np.empty(2 * L * Hkv * nb, np.float32)
        s, parts = np.empty((1, Hkv, g, L), np.float32), np.empty((1, Hkv, nb, g, L), np.float32)
        p = rng.random((1, Hkv, g, L), dtype=np.float32)
        res = {}

        def k_fold():
            for l0 in range(0, L, t):
                kt = _tile_values("q8_0", raw[0][:, l0:l0 + t], vals, None).swapaxes(-1, -2)
                for c in range(l0, l0 + t, chunk):
                    np.matmul(qs, kt[..., c - l0:c - l0 + chunk], out=parts[..., c:c + chunk])
            res["K fold"] = np.einsum("xhbgl,xhbl->xhgl", parts, _block_scales(raw[0], 34, sbuf), out=s).copy()

        def scaled_tile(r, l0):      # values of tile l0 cast (strided: the scale bytes skipped), times d in place
            blocks = r[:, l0:l0 + t].reshape(1, t, Hkv, nb, 34)
            np.copyto(cast, blocks[..., 2:].view(np.int8), casting="unsafe")
            d = _block_scales(r[:, l0:l0 + t], 34, sbuf)                        # (1, Hkv, nb, t)
            np.multiply(cast, d.transpose(0, 3, 1, 2)[..., None], out=cast)
            return cast.reshape(1, t, Hkv, hd)

        def k_scale():
            for l0 in range(0, L, t):
                kt = scaled_tile(raw[0], l0).transpose(0, 2, 3, 1)
                for c in range(l0, l0 + t, chunk):
                    np.matmul(q, kt[..., c - l0:c - l0 + chunk], out=s[..., c:c + chunk])
            res["K scale"] = s.copy()

        def v_fold():
            pd = parts
            np.multiply(p[:, :, None], _block_scales(raw[1], 34, sbuf)[:, :, :, None], out=pd)
            acc = sum(np.matmul(pd[..., l0:l0 + t], _tile_values("q8_0", raw[1][:, l0:l0 + t], vals, None))
                      for l0 in range(0, L, t))
            res["V fold"] = acc.transpose(0, 1, 3, 2, 4).reshape(1, Hkv, g, hd)

        def v_scale():
            res["V scale"] = sum(np.matmul(p[..., l0:l0 + t], scaled_tile(raw[1], l0).transpose(0, 2, 1, 3))
                                 for l0 in range(0, L, t))

        kt32, vt32 = kf.transpose(0, 2, 3, 1), vf.transpose(0, 2, 1, 3)

        def k_f32():
            for c in range(0, L, chunk):
                np.matmul(q, kt32[..., c:c + chunk], out=s[..., c:c + chunk])

        def v_f32():
            return sum(np.matmul(p[..., c:c + chunk], vt32[:, :, c:c + chunk]) for c in range(0, L, chunk))

        us = _best({"K fold": k_fold, "K scale": k_scale, "V fold": v_fold, "V scale": v_scale,
                    "f32 K": k_f32, "f32 V": v_f32}, rounds)
        for side in ("K", "V"):                       # both orders compute the same numbers (float rounding)
            a, b = res[f"{side} fold"], res[f"{side} scale"]
            if not np.allclose(a, b, rtol=1e-4, atol=1e-3 * float(np.abs(b).max())):
                raise AssertionError(f"{name}: the {side} side's two orders disagree")
        print(f"  {name + f' ({Hkv} x {hd}, g={g})':28} " + " ".join(
            f"{us[c]:{8 if c[0] != 'f' else 7}.0f}" for c in ("K fold", "K scale", "V fold", "V scale", "f32 K",
                                                             "f32 V"))
              + f"   K x{us['K fold'] / us['K scale']:.2f}  V x{us['V fold'] / us['V scale']:.2f}")


def run(args) -> int:
    args.ctx = args.ctx or (256 if args.quick else 512)
    args.windows = args.windows or (2 if args.quick else 8)
    args.steps = args.steps or (4 if args.quick else 16)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.batch_context = args.batch_context or (512 if args.quick else 2048)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    bad = [d for d in args.dtypes if d not in KV_DTYPES] + [t for t in args.types if t not in WEIGHT_TYPES]
    if bad:
        raise ValueError(f"unknown KV dtype / weight type: {', '.join(bad)}")
    t0 = time.perf_counter()
    if args.only == "scales":
        scales_table(args)
        print(f"\n(total {time.perf_counter() - t0:.0f} s)")
        return 0
    with tempfile.TemporaryDirectory(prefix="pyengine-bench-kv-") as tmp:
        models = _models(args)
        if args.only != "weights":
            for m in models:
                kv_table(m, args, tmp)
        if args.only != "kv":
            weights_table(models[0], args, tmp)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    return 0
