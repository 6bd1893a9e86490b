"""`pyengine bench moe`: S16's claim in numbers — a mixture of experts cuts compute per token, not memory.

Three synthetic models with the same attention, differing only in their feed-forward, are written as GGUFs
(with the `gguf` package, F16) and run through ModelRunner in the same process, one after another:
  moe           E experts of F rows, top-k (default 32 experts, top-4, d=512, F=768: a Qwen3-30B-A3B /
                OLMoE shape scaled to a laptop core)
  dense-active  one gated MLP of k*F rows: the same parameters *active* per token
  dense-total   one gated MLP of E*F rows: the same parameters *held*
Printed: decode and 512-token prefill tok/s with ratios to the MoE; the share of the MoE feed-forward spent
routing, sorting, gathering and scattering (everything but the experts' own products); cost per token as the
batch grows and touches more distinct experts; bytes of weights held vs read per token and FLOPs per token;
the expert-load statistics of the run (the engine's ``stats()["expert_load"]``).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

HELP = "MoE vs dense (same active / same total parameters): tok/s, routing share, bytes and FLOPs per token"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--d", type=int, default=512, help="model width")
    p.add_argument("--expert-ffn", type=int, default=768, help="rows of one expert")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill measurement")
    p.add_argument("--decode", type=int, default=24, help="decode steps timed")
    p.add_argument("--quick", action="store_true", help="a small shape and few steps (smoke test)")


def _write(path: str, kind: str, a, rng) -> None:
    """A synthetic llama-style GGUF whose feed-forward is ``kind`` ("moe", "dense-active", "dense-total")."""
    import gguf   # dev dependency: the benchmark writes its models

    d, E, k, F, H = a.d, a.experts, a.top_k, a.expert_ffn, max(1, a.d // 64)
    vocab = 512
    w = gguf.GGUFWriter(path, "llama")
    ffn = {"moe": F, "dense-active": k * F, "dense-total": E * F}[kind]
    for key, v in (("block_count", a.layers), ("embedding_length", d), ("attention.head_count", H),
                   ("attention.head_count_kv", H), ("feed_forward_length", ffn), ("context_length", 4096)):
        w.add_uint32(f"llama.{key}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    if kind == "moe":
        w.add_uint32("llama.expert_count", E)
        w.add_uint32("llama.expert_used_count", k)
    w.add_token_list([f"t{i}" for i in range(vocab)])

    def q8(name, shape, scale):     # F16: writing it costs nothing beside quantizing 100M weights to Q8_0
        w.add_tensor(name, (rng.standard_normal(shape, np.float32) * np.float32(scale)).astype(np.float16))

    q8("token_embd.weight", (vocab, d), 1.0)
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    for i in range(a.layers):
        p = f"blk.{i}."
        for n in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + n + ".weight", np.ones(d, np.float32))
        for n in "qkv":
            q8(p + f"attn_{n}.weight", (d, d), d ** -0.5)
        q8(p + "attn_output.weight", (d, d), d ** -0.5)
        if kind == "moe":
            w.add_tensor(p + "ffn_gate_inp.weight", (rng.standard_normal((E, d)) * d ** -0.5).astype(np.float32))
            q8(p + "ffn_gate_exps.weight", (E, F, d), d ** -0.5)
            q8(p + "ffn_up_exps.weight", (E, F, d), d ** -0.5)
            q8(p + "ffn_down_exps.weight", (E, d, F), F ** -0.5)
        else:
            q8(p + "ffn_gate.weight", (ffn, d), d ** -0.5)
            q8(p + "ffn_up.weight", (ffn, d), d ** -0.5)
            q8(p + "ffn_down.weight", (d, ffn), ffn ** -0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _measure(runner, a, rng) -> dict:
    """Decode and prefill tok/s of one model (best of a few runs)."""
    ids = rng.integers(0, 512, a.prefill + a.decode + 1)
    prefill = _best(lambda: runner.run(runner.contiguous_batch(ids[:a.prefill], 0)), 2)

    def decode():
        for s in range(a.decode):
            runner.run(runner.contiguous_batch(ids[a.prefill + s:a.prefill + s + 1], a.prefill + s))
    dec = _best(decode, 2)
    return {"prefill_tok_s": a.prefill / prefill, "decode_tok_s": a.decode / dec}


def _routing_share(runner, T: int, rng, repeat: int) -> tuple[float, float, int]:
    """(seconds of one MoE feed-forward over T tokens, the share outside the experts' products, distinct
    experts touched), measured by timing the experts' calls inside the real ``moe_forward``."""
    from pyengine.layers.moe import moe_forward
    L = runner.weights.layers[0]
    m = runner.config.moe
    b = runner.buffers.rows(T)
    x = rng.standard_normal((T, runner.config.d_model)).astype(np.float32)
    out = np.empty_like(x)
    inner = {"t": 0.0}
    ffn = L.moe.experts.ffn

    def timed(*args):
        t0 = time.perf_counter()
        r = ffn(*args)
        inner["t"] += time.perf_counter() - t0
        return r
    best, share, touched = float("inf"), 0.0, 0
    L.moe.experts.ffn = timed
    try:
        for _ in range(repeat):
            inner["t"] = 0.0
            t0 = time.perf_counter()
            counts = moe_forward(L.moe, m, x, out, b.moe)
            dt = time.perf_counter() - t0
            if dt < best:
                best, share, touched = dt, 1.0 - inner["t"] / dt, int(np.count_nonzero(counts))
    finally:
        del L.moe.experts.ffn
    return best, share, touched


def _dense_ffn_time(runner, T: int, rng, repeat: int) -> float:
    L = runner.weights.layers[0]
    b = runner.buffers.rows(T)
    x = rng.standard_normal((T, runner.config.d_model)).astype(np.float32)

    def ffn():
        L.w_gate_up.gated(x, out=b.ffn, scratch=b.gate_up)
        L.w_down.matmul(b.ffn, out=b.proj)
    return _best(ffn, repeat)


def run(a) -> int:
    from pyengine.engine.args import EngineArgs
    if a.quick:
        a.experts, a.top_k, a.d, a.expert_ffn, a.layers, a.prefill, a.decode = 8, 2, 128, 128, 1, 64, 4
    if not 1 <= a.top_k <= a.experts:
        raise SystemExit("--top-k must be between 1 and --experts")
    d, E, k, F = a.d, a.experts, a.top_k, a.expert_ffn
    print(f"synthetic MoE: {a.layers} layers, d={d}, {E} experts of {F} rows, top-{k}; F16 files, resident "
          "float32 weights; OPENBLAS_NUM_THREADS=" + os.environ.get("OPENBLAS_NUM_THREADS", "(unset)"))
    rng = np.random.default_rng(0)
    results, moe_extra = {}, {}
    batches = [1, 2, 4, 8, 16, 32, 64] if not a.quick else [1, 4, 16]
    repeat = 3 if a.quick else 5
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("moe", "dense-active", "dense-total"):
            path = os.path.join(tmp, kind + ".gguf")
            _write(path, kind, a, np.random.default_rng(1))
            r = EngineArgs(model=path, max_model_len=a.prefill + a.decode + 8,
                           max_num_batched_tokens=max(a.prefill, 64),
                           max_num_seqs=4, num_blocks=(a.prefill + a.decode) // 16 + 4).create_runner()
            results[kind] = _measure(r, a, rng)
            results[kind]["held"] = r.weights.nbytes
            if kind == "moe":
                moe_extra["load"] = r.model.expert_load.snapshot()
                moe_extra["share"] = {T: _routing_share(r, T, rng, repeat) for T in sorted(set(batches + [a.prefill]))}
            elif kind == "dense-active":
                moe_extra["dense"] = {T: _dense_ffn_time(r, T, rng, repeat) for T in sorted(set(batches + [a.prefill]))}
            del r
    ffn_bytes = 3 * F * d * 4                                  # one expert, float32 resident
    per_layer = {"moe": (k * ffn_bytes + d * E * 4, E * ffn_bytes + d * E * 4, 2 * (3 * F * d * k + d * E)),
                 "dense-active": (k * ffn_bytes, k * ffn_bytes, 2 * 3 * F * d * k),
                 "dense-total": (E * ffn_bytes, E * ffn_bytes, 2 * 3 * F * d * E)}
    base = results["moe"]
    print(f"\n{'model':<13} {'decode tok/s':>12} {'x moe':>6} {'prefill tok/s':>13} {'x moe':>6} "
          f"{'FFN MB held':>11} {'FFN MB read/tok':>15} {'FFN MFLOP/tok':>13} {'weights MB':>10}")
    for kind, res in results.items():
        read, held, flops = per_layer[kind]
        print(f"{kind:<13} {res['decode_tok_s']:12.1f} {res['decode_tok_s'] / base['decode_tok_s']:6.2f} "
              f"{res['prefill_tok_s']:13.1f} {res['prefill_tok_s'] / base['prefill_tok_s']:6.2f} "
              f"{held * a.layers / 1e6:11.1f} {read * a.layers / 1e6:15.2f} {flops * a.layers / 1e6:13.2f} "
              f"{res['held'] / 1e6:10.1f}")
    print("(decode reads k experts per token; a batch of T tokens reads every expert it touches once)")
    print(f"\nMoE feed-forward of one layer vs the dense-active MLP, by tokens in the step:")
    print(f"{'tokens':>6} {'experts hit':>11} {'MoE us/tok':>10} {'dense-active us/tok':>19} {'ratio':>6} "
          f"{'routing+gather share':>20}")
    for T, (t, share, touched) in moe_extra["share"].items():
        dense = moe_extra["dense"].get(T)
        dcol = f"{dense / T * 1e6:19.1f} {t / dense:6.2f}" if dense else f"{'':>19} {'':>6}"
        print(f"{T:6d} {touched:11d} {t / T * 1e6:10.1f} {dcol} {share:20.1%}")
    load = moe_extra["load"]
    print(f"\nexpert load over the run ({load['window_steps']} steps in the window): mean/max balance "
          f"{load['balance']}")
    for row in load["layers"]:
        print(f"  layer {row['layer']}: balance {row['balance']}, tokens per expert {row['tokens']}")
    return 0
