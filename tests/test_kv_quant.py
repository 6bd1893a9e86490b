"""S08: the quantized KV cache. Stored rows against the `gguf` package's quantize + dequantize (the same ggml
block formats) and the formats' error bounds; greedy generation with fp16 KV against HF's golden tokens;
perplexity with fp16 / q8_0 KV against float32 KV (itself within 5e-7 of HF's); the engine's paged, batched,
prefix-cached and chunked paths on a q8_0 cache against each sequence run alone."""
import json
import os
import sys
from pathlib import Path

import gguf

import numpy as np
import pytest

from pyengine import perplexity as P
from pyengine.arena import Arena
from pyengine.cli import main
from pyengine.engine.kv_cache import KV_DTYPES, ContextView, PagedKVCache
from pyengine.engine.model_runner import ModelRunner
from pyengine.model_files import default_model_path

HERE = Path(__file__).parent
GEN = json.loads((HERE / "golden" / "generation_smollm2.json").read_text())["cases"]
PPL = json.loads((HERE / "golden" / "perplexity_smollm2.json").read_text())


def _kv(rng, T=40, Hkv=3, hd=64):
    k = rng.standard_normal((T, Hkv, hd)).astype(np.float32) * rng.choice([1e-3, 1, 40], (T, Hkv, 1))
    v = rng.standard_normal((T, Hkv, hd)).astype(np.float32)
    k[0] = 0                                  # all-zero rows
    k[1, 0, 5] = -500                         # an outlier in one block
    return k.astype(np.float32), v


def _cache(dtype, num_blocks=8, block_size=16, Hkv=3, hd=64, layers=2):
    specs = PagedKVCache.arena_specs(layers, num_blocks, block_size, Hkv, hd, dtype)
    return PagedKVCache(Arena.from_specs(specs), layers, num_blocks, block_size, Hkv, hd, dtype), specs


def _reference(x, dtype):
    """What the cache should hand back: float32, float16, or the gguf package's quantize -> dequantize."""
    if dtype == "auto":
        return x
    if dtype == "fp16":
        return x.astype(np.float16).astype(np.float32)
    t = gguf.GGMLQuantizationType[dtype.upper()]
    return gguf.quants.dequantize(gguf.quants.quantize(x.reshape(-1, x.shape[-1]), t), t).reshape(x.shape)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_round_trip_through_every_read_path(dtype):
    rng = np.random.default_rng(0)
    kv, specs = _cache(dtype)
    k, v = _kv(rng)
    slots = rng.permutation(8 * 16)[:40]
    kv.write(1, slots, k, v)
    want_k, want_v = _reference(k, dtype), _reference(v, dtype)
    out_k, out_v = np.zeros((128, 3, 64), np.float32), np.zeros((128, 3, 64), np.float32)
    gk, gv = kv.gather(1, slots, out_k, out_v)
    assert np.array_equal(gk, want_k) and np.array_equal(gv, want_v)
    # consecutive slots (read) and whole blocks (gather_blocks) give the same rows
    kv.write(0, np.arange(16, 56), k, v)
    rk, rv = kv.read(0, 16, 40, out_k, out_v)
    assert np.array_equal(rk, want_k) and np.array_equal(rv, want_v)
    assert np.shares_memory(rk, kv.k) == (dtype == "auto")
    bk, bv = kv.gather_blocks(0, np.array([[1, 2, 3]]), np.zeros((64, 3, 64), np.float32),
                              np.zeros((64, 3, 64), np.float32))
    assert bk.shape == (1, 48, 3, 64) and np.array_equal(bk[0, :40], want_k) and np.array_equal(bv[0, :40], want_v)
    view = ContextView(np.array([5, 1, 2, 3]), 20, 16)                 # scattered: a gather through slots
    ck, _ = view.kv(kv, 0, out_k, out_v)
    assert np.array_equal(ck[16:], want_k[:4])
    # a tensor-parallel worker maps the same arena and finds the format by itself
    assert PagedKVCache(Arena.from_specs(specs), 2, 8, 16, 3, 64).dtype == dtype


@pytest.mark.parametrize("dtype", ["fp16", "q8_0", "q4_0"])
@pytest.mark.parametrize("Hkv,hd,g", [(3, 64, 3), (1, 256, 4)])
def test_decode_attention_reads_the_stored_format_like_dequantize_then_attend(dtype, Hkv, hd, g, monkeypatch):
    """Decode groups on an fp16 / q8_0 / q4_0 cache (scales folded into scores and probabilities, tiles of whole
    blocks) = the reference attention over K/V dequantized by the gguf package: lone sequences read in place,
    gathered groups, speculative-verification queries (Q > 1, causal) and a sliding window; tiles smaller than the
    contexts."""
    from pyengine import tuning
    from pyengine.engine.step_plan import query_groups
    from pyengine.layers.attention import attention
    from pyengine.layers.paged_attention import group_attention
    monkeypatch.setattr(tuning, "KV_TILE_SLOTS", 48)             # 3 blocks: several tiles, a ragged last one
    rng = np.random.default_rng(7)
    bs, nblk = 16, 64
    kv, _ = _cache(dtype, num_blocks=nblk, block_size=bs, Hkv=Hkv, hd=hd)
    k, v = _kv(rng, nblk * bs, Hkv, hd)
    kv.write(1, np.arange(nblk * bs), k, v)
    want_k, want_v = _reference(k, dtype), _reference(v, dtype)
    plain, _ = _cache("auto", num_blocks=nblk, block_size=bs, Hkv=Hkv, hd=hd)   # float32 dequantize-then-attend
    plain.write(1, np.arange(nblk * bs), want_k, want_v)
    scratch = type("Scratch", (), {"scores": np.empty(1 << 20, np.float32),
                                   "k_batch": np.empty((nblk * bs, Hkv, hd), np.float32),
                                   "v_batch": np.empty((nblk * bs, Hkv, hd), np.float32)})
    worst = worst32 = 0.0
    cases = [([200], 1, None, "run"), ([37], 1, None, "scattered"), ([300, 5, 130], 1, None, "scattered"),
             ([40, 70], 3, None, "scattered"), ([150], 4, 50, "run"), ([90, 33], 2, 40, "scattered")]
    for lens, Q, window, layout in cases:
        tables = [np.arange(20 * i, 20 * i + 20) if layout == "run" else rng.permutation(nblk)[:20]
                  for i in range(len(lens))]
        seqs = [(i * Q, Q, n, t) for i, (n, t) in enumerate(zip(lens, tables))]
        groups = query_groups(seqs, bs, 10**6, window)
        assert (groups[0].start is not None) == (layout == "run")
        q = rng.standard_normal((len(lens) * Q, Hkv * g, hd)).astype(np.float32)
        got, ref32 = np.zeros_like(q), np.zeros_like(q)
        for gr in groups:
            group_attention(1, q, kv, gr, got, scratch, hd ** -0.5)
            group_attention(1, q, plain, gr, ref32, scratch, hd ** -0.5)
        for (row, _, n, t) in seqs:
            slots = t[np.arange(n) // bs] * bs + np.arange(n) % bs
            want = attention(q[row:row + Q].astype(np.float64), want_k[slots].astype(np.float64),
                             want_v[slots].astype(np.float64), scale=hd ** -0.5, window=window)
            worst = max(worst, np.abs(got[row:row + Q] - want).max())
            worst32 = max(worst32, np.abs(ref32[row:row + Q] - want).max())
    # float32 rounding of scores up to ~100 (the keys scaled by 40): the float32 path is off by ~1e-5 too
    assert worst <= 2 * worst32 + 1e-6, (worst, worst32)


def test_float16_bit_conversion_is_numpys_cast():
    """The fp16 cache's tile conversion (integer shifts and a 2^112 rescale) = NumPy's float16 -> float32 cast
    for every finite bit pattern, subnormals and signed zeros included."""
    from pyengine.layers.attention import f16_bits_to_f32
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    finite = np.isfinite(want)
    got = f16_bits_to_f32(bits, np.empty(bits.shape, np.float32))
    assert np.array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))


@pytest.mark.parametrize("dtype,bound", [("fp16", "rel"), ("q8_0", 127), ("q4_0", 8)])
def test_round_trip_error_within_the_format_bound(dtype, bound):
    rng = np.random.default_rng(1)
    kv, _ = _cache(dtype)
    k, _ = _kv(rng)
    kv.write(0, np.arange(40), k, k)
    got, _ = kv.read(0, 0, 40, np.zeros((40, 3, 64), np.float32), np.zeros((40, 3, 64), np.float32))
    err = np.abs(got.astype(np.float64) - k)
    if bound == "rel":
        assert np.all(err <= np.abs(k) * 2.0 ** -11 + 2.0 ** -25)       # float16 round to nearest (and subnormals)
        return
    blocks = k.reshape(-1, 32).astype(np.float64)
    amax = np.abs(blocks).max(axis=1)
    step = amax / bound                                                 # the level spacing d
    d16 = step.astype(np.float16).astype(np.float64)
    # q8_0: half a step; q4_0: a full step at the clamped end (+7 of -8..7); both plus the float16 scale error
    assert np.all(err.reshape(-1, 32).max(axis=1) <= step * (0.5 if bound == 127 else 1.0) + bound * np.abs(step - d16)
                  + 1e-6 * amax)


def test_blocks_in_the_same_budget():
    per = {d: PagedKVCache.bytes_per_block(30, 16, 3, 64, d) for d in KV_DTYPES}
    assert per["auto"] == 2 * 30 * 16 * 3 * 64 * 4
    assert per["auto"] / per["fp16"] == 2 and per["auto"] / per["q8_0"] == 4 * 32 / 34
    assert per["auto"] / per["q4_0"] == 4 * 32 / 18
    blocks = {d: ModelRunner(default_model_path(), max_model_len=2048, max_num_seqs=64, kv_budget_bytes=256 << 20,
                             kv_cache_dtype=d).num_blocks for d in ("auto", "q8_0")}
    assert blocks["q8_0"] >= 3.5 * blocks["auto"]
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        ModelRunner(default_model_path(), max_model_len=64, kv_cache_dtype="q5_1")


def test_greedy_golden_tokens_with_fp16_kv():
    runner = ModelRunner(default_model_path(), max_model_len=256, max_num_batched_tokens=256, max_num_seqs=4,
                         num_blocks=64, kv_cache_dtype="fp16")
    for case in GEN:
        assert runner.generate_greedy(case["prompt_ids"], 48) == case["greedy_ids"], case["prompt"]


@pytest.fixture(scope="module")
def ppl():
    wins = [np.array(w) for w in PPL["windows"][:2]]            # 254 scored tokens
    out = {}
    for d in ("auto", "fp16", "q8_0", "q4_0"):
        runner = ModelRunner(default_model_path(), max_model_len=PPL["ctx"], max_num_batched_tokens=PPL["ctx"],
                             max_num_seqs=1, max_logits=PPL["ctx"] // 2, kv_cache_dtype=d)
        out[d] = P.perplexity(runner, wins).ppl
    return out


def test_perplexity_with_quantized_kv(ppl):
    hf = np.exp(np.mean(PPL["hf"]["window_mean_nll"][:2]))     # HF's PPL over the same two windows
    assert abs(ppl["auto"] / hf - 1) < 1e-3
    assert abs(ppl["fp16"] / ppl["auto"] - 1) < 5e-4
    assert abs(ppl["q8_0"] / ppl["auto"] - 1) < 5e-3
    assert ppl["q4_0"] > ppl["q8_0"] * (1 - 5e-3)          # 4 bits cost more than 8 (and stay finite)
    assert np.isfinite(ppl["q4_0"]) and ppl["q4_0"] < 1.5 * ppl["auto"]


def _greedy_with_margins(runner, ids, n):
    """runner.generate_greedy, also returning each step's top-1 minus top-2 logit."""
    tokens, margins = [], []
    logits = runner.run(runner.contiguous_batch(ids, 0))
    for _ in range(n):
        top2 = np.sort(logits[0])[-2:]
        tokens.append(int(np.argmax(logits[0])))
        margins.append(float(top2[1] - top2[0]))
        logits = runner.run(runner.contiguous_batch([tokens[-1]], len(ids) + len(tokens) - 1))
    return tokens, margins


def test_engine_paths_on_a_q8_0_cache():
    """Batched, paged, prefix-cached and chunked generation on a q8_0 cache = each prompt alone (greedy)."""
    from pyengine import LLM, SamplingParams
    prompts = [c["prompt_ids"] for c in GEN[:4]]
    shared = GEN[3]["prompt_ids"][:40]
    prompts += [shared + [13, 1032], shared + [198]]                   # a shared prefix: cached blocks
    llm = LLM(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, num_blocks=96, kv_cache_dtype="q8_0")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    alone = ModelRunner(default_model_path(), max_model_len=512, max_num_batched_tokens=256, max_num_seqs=1,
                        num_blocks=64, kv_cache_dtype="q8_0")
    compared = 0
    for p, o in zip(prompts, outs):
        tokens, margins = _greedy_with_margins(alone, p, 12)
        # Batching changes float32 GEMM rounding in the last bits; a K/V value that sits on a rounding boundary
        # of its Q8_0 block then lands one level (1/254 of the block's range) away, so the two runs may part at
        # a near-tie of the argmax: compare up to the first step whose top-2 logit margin is under 0.1 (prompts
        # here parted at margins of 0.025 and, once wide batches ran as row chunks, 0.07).
        k = next((j for j, m in enumerate(margins) if m < 0.1), len(tokens))
        assert o.outputs[0].token_ids[:k] == tokens[:k]
        compared += k
    assert compared >= 0.4 * 12 * len(prompts)                       # 32 of 72 tokens here
    assert llm.llm_engine.runner.kv_cache.dtype == "q8_0"
    assert llm.llm_engine.stats()["prefix_cache_hit_rate"] > 0


def test_cli_generate_with_q4_0_kv(capsys):
    assert main(["generate", "The capital of France is", "--temperature", "0", "--max-tokens", "4",
                 "--kv-cache-dtype", "q4_0"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out and "(q4_0)" in captured.err
    with pytest.raises(SystemExit):
        main(["generate", "x", "--kv-cache-dtype", "int3"])


@pytest.mark.slow
def test_tensor_parallel_ranks_read_the_quantized_cache(tmp_path):
    """Two MPI ranks (S17: each holds its KV heads, stored q8_0): a prompt, then a decode, a 24- and a 100-token
    pass. The last-bit differences of split products move a few K/V values across a Q8_0 level, and each move
    changes every later activation a little (as any change of batch shape does, in llama.cpp too), so the ranks
    are held to the error one process makes with the same cache: against float32 KV, the two-rank q8_0 run is
    off by no more than about what the one-process q8_0 run is (a scale or block bug would be far larger)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from test_mpi_parallel import KW, reference, run_mpi
    kw = dict(KW, kv_cache_dtype="q8_0")
    _, ranks = run_mpi(tmp_path, default_model_path(), 2, 1, kw=kw)
    one, _ = reference(default_model_path(), kw=kw)
    exact, _ = reference(default_model_path())

    def logprobs(x):
        x = np.asarray(x, np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    for r, o, e in zip(ranks, one, exact):
        le = logprobs(e)
        top = np.argsort(-le, axis=-1)[:, :20]                           # where the probability is

        def err(x):
            return np.abs(np.take_along_axis(logprobs(x), top, -1) - np.take_along_axis(le, top, -1)).max()
        assert err(r) <= 2 * err(o) + 0.02, (err(r), err(o))
        assert np.mean(np.asarray(r).argmax(-1) == np.asarray(e).argmax(-1)) >= 0.9


def test_browser_worker_session_takes_a_kv_dtype():
    """web/pyworker.py (run in CPython, as tests/test_pyodide_worker_session.py does): load.kvCacheDtype."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("pyworker", HERE.parent / "web" / "pyworker.py")
    pyworker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pyworker)
    s = pyworker.WorkerSession()
    data = Path(default_model_path()).read_bytes()
    plain = s.load(data, max_model_len=256)["kvBlocks"]
    info = s.load(data, max_model_len=256, kv_cache_dtype="q8_0")
    assert info["kvCacheDtype"] == "q8_0" and info["kvBlocks"] == plain      # the same blocks in less memory
    s.start("r", "The capital of France is", max_tokens=3, temperature=0.0)
    events = []
    while s.has_work():
        events += s.step()
    assert "Paris" in events[-1]["text"]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        s.load(data, kv_cache_dtype="q2")
    assert s.info["kvCacheDtype"] == "q8_0"                                     # the previous model stays


def test_serve_and_chat_take_the_kv_dtype():
    import argparse

    from pyengine.cli import chat, serve
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    engine, _ = serve.build_engine(p.parse_args(["--kv-cache-dtype", "fp16", "--max-model-len", "256",
                                                 "--max-num-seqs", "2"]))
    assert engine.runner.kv_cache.dtype == "fp16" and engine.runner.kv_cache.k.dtype == np.float16
    p = argparse.ArgumentParser()
    chat.add_arguments(p)
    assert p.parse_args(["--kv-cache-dtype", "q4_0"]).kv_cache_dtype == "q4_0"
