"""S21: the streaming lean products — folded unpacking per format against ggml's dequantization (the `gguf`
package, an independent reference), LeanLinear against the float64 product, the L2-sized scratch."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from pyengine import tuning
from pyengine.gguf import quants, quants_stream
from pyengine.gguf.quants import GGMLType
from pyengine.layers.linear import LeanLinear, QuantMatrix

FORMATS = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q5_0)


def _rows(t: GGMLType, n: int, k: int, seed: int) -> np.ndarray:
    w = (np.random.default_rng(seed).standard_normal((n, k)) * 0.3 + 0.05).astype(np.float32)
    return quants.quantizer(t)(w).reshape(n, -1)


@pytest.mark.parametrize("t", FORMATS, ids=lambda t: t.name)
def test_unpack_rows_folds_to_ggml_dequantization(t):
    raw = _rows(t, 6, 512, 1)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(t))).reshape(6, 512)
    out = np.empty((6, 512), np.float32)
    scale, bias, g = quants.unpack_rows(raw, t, 512, out)
    if t not in quants.FOLDED_TYPES:                        # other formats: plain dequantized rows
        assert scale is None and np.array_equal(out, ref)
        return
    w = out.reshape(6, 512 // g, g) * scale[:, :, None] + (0 if bias is None else bias[:, :, None])
    assert np.abs(w.reshape(6, 512) - ref).max() <= 1e-6 * np.abs(ref).max()


@pytest.mark.parametrize("t", FORMATS, ids=lambda t: t.name)
def test_lean_products_equal_float64(t, monkeypatch):
    """Every row count through both paths (folded up to LEAN_FOLD_MAX_ROWS, scaled block + sgemm beyond),
    a fused two-part matrix, row blocks that do not divide the rows."""
    monkeypatch.setattr(tuning, "LEAN_BLOCK_BYTES", 7 * 512 * 4)           # 7-row blocks
    m = QuantMatrix([(_rows(t, 40, 512, 2), int(t)), (_rows(GGMLType.Q6_K, 24, 512, 3), int(GGMLType.Q6_K))], 512)
    lin = LeanLinear(m)
    assert lin.block_rows == 7 and lin.scratch_floats == 7 * 512
    assert_products_match_float64(lin, m)


def assert_products_match_float64(lin: LeanLinear, m: QuantMatrix) -> None:
    """``lin``'s products of 1, 2, LEAN_FOLD_MAX_ROWS (+1) and 20 input rows against the float64 product of the
    dequantized matrix (the folded path and the scaled-block path both)."""
    lin.scratch = np.empty(lin.scratch_floats, np.float32)
    w = m.dequantize().astype(np.float64).T
    rng = np.random.default_rng(4)
    for n in (1, 2, tuning.LEAN_FOLD_MAX_ROWS, tuning.LEAN_FOLD_MAX_ROWS + 1, 20):
        x = rng.standard_normal((n, w.shape[0])).astype(np.float32)
        out = lin.matmul(x, np.empty((n, w.shape[1]), np.float32))
        ref = x @ w
        assert np.abs(out - ref).max() <= 2e-6 * np.abs(ref).max(), n


def test_lean_scratch_is_l2_sized_not_matrix_sized():
    """The 1.1B shape's gate|up (2 x 5632 rows of 2048) and its 32000-row head need one block of rows each."""
    raw = np.zeros((2 * 5632, 2048 // 256 * 144), np.uint8)
    lin = LeanLinear(QuantMatrix([(raw, int(GGMLType.Q4_K))], 2048))
    assert lin.scratch_floats * 4 <= tuning.LEAN_BLOCK_BYTES
    assert lin.block_rows == tuning.LEAN_BLOCK_BYTES // (4 * 2048)


def test_memory_plan_matches_what_the_runner_allocates(tmp_path):
    """`pyengine info --memory`'s figures (engine/lean_mode.py memory_plan) against a built runner's arena and
    weights, both modes; the CLI prints them."""
    from pyengine.cli import main
    from pyengine.engine.lean_mode import memory_plan
    from pyengine.engine.model_runner import ModelRunner
    from pyengine.gguf.random_llama import LlamaShape, write_random_llama
    from pyengine.gguf.reader import GGUFFile

    path = tmp_path / "m.gguf"
    write_random_llama(path, LlamaShape(256, 2, 4, 2, 512, 512, 256), seed=5)
    g = GGUFFile(str(path))
    for mode in ("resident", "lean"):
        plan = memory_plan(g, mode, 256)
        r = ModelRunner(g, weights_mode=mode, max_model_len=256, max_num_seqs=1, max_logits=1,
                        max_num_batched_tokens=plan["max_num_batched_tokens"], kv_cache_dtype=plan["kv_cache_dtype"])
        assert plan["kv_cache"] == r.kv_cache.k.nbytes + r.kv_cache.v.nbytes
        assert 0 <= r.arena.nbytes - (plan["kv_cache"] + plan["buffers"]) <= 64 * 64      # alignment padding
        held = r.weights.nbytes if mode == "resident" else r.weights.nbytes - plan["mapped"]
        assert abs(plan["weights"] - held) <= 0.01 * max(held, 1) + 4096
    assert main(["info", str(path), "--memory", "--max-model-len", "128", "--kv-cache-dtype", "fp16"]) == 0


@pytest.mark.parametrize("t", (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0),
                         ids=lambda t: t.name)
@pytest.mark.parametrize("cols", (512, 768))
@pytest.mark.parametrize("wasm", (False, True), ids=("cpython", "wasm-form"))
def test_decode_stream_rebuilds_ggml_dequantization(t, cols, wasm, monkeypatch):
    """The decode stream of a format (gguf/quants_stream.py: whole-row unpacking, weights in byte order, block
    headers skipped by the segments) puts every weight back where `gguf` (independent) dequantizes it: value q
    of segment s, row r, lane l is weight x_index[s, l] of row r, = scale[s, r] * q + bias[group, r]. Both
    runtime forms: 1-D operations on whole regions of a block of rows, nibbles in bytes (CPython), and 2-D ones,
    nibbles in uint64 lanes, Q6_K assembled block by block (Pyodide)."""
    monkeypatch.setattr(tuning, "LEAN_LANE_BYTES", 8 if wasm else 1)
    monkeypatch.setattr(tuning, "LEAN_STREAM_REGIONS", not wasm)
    n = 5
    raw = _rows(t, n, cols, 7)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(t))).reshape(n, cols)
    lay = quants_stream.layout(int(t), cols)
    q = lay.unpack(raw, np.empty((n, lay.tmp_bytes), np.uint8))
    f = np.empty((n, lay.width), np.float32)
    np.copyto(f, q, casting="unsafe")
    seg = lay.segments(f)
    S, L = lay.x_index.shape
    seg = seg.reshape(S, n, L) if seg.flags.c_contiguous else np.ascontiguousarray(seg).reshape(S, n, L)
    scale, bias, g = lay.scales(raw)
    w = np.full((n, cols), np.nan)
    for s in range(S):
        b = 0 if bias is None else bias[lay.seg_group[s]][:, None]
        w[:, lay.x_index[s]] = scale[s][:, None] * seg[s] + b
    assert sorted(lay.x_index.reshape(-1)) == list(range(cols))       # every weight exactly once
    assert np.abs(w - ref).max() <= 1e-6 * np.abs(ref).max()


def test_decode_stream_equals_folded_product(monkeypatch):
    """One row through the decode streams and through the folded products (the path before them) of a fused
    matrix whose parts are the stream formats: the same product to float32 rounding, a scratch of 3-row blocks."""
    parts = [(_rows(t, 19, 512, i), int(t)) for i, t in enumerate((GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q4_0,
                                                                    GGMLType.Q4_1, GGMLType.Q8_0))]
    lin = LeanLinear(QuantMatrix(parts, 512), chunk_rows=3)
    lin.scratch = np.empty(lin.scratch_floats, np.float32)
    x = np.random.default_rng(5).standard_normal((1, 512)).astype(np.float32)
    monkeypatch.setattr(tuning, "LEAN_STREAM_TYPES", ("Q4_K", "Q6_K", "Q4_0", "Q4_1", "Q8_0"))
    stream = lin.matmul(x, np.empty((1, lin.shape[1]), np.float32))
    monkeypatch.setattr(tuning, "LEAN_STREAM_MAX_ROWS", 0)
    folded = lin.matmul(x, np.empty((1, lin.shape[1]), np.float32))
    ref = x.astype(np.float64) @ lin.dense().astype(np.float64)
    assert np.abs(stream - ref).max() <= 2e-6 * np.abs(ref).max()
    assert np.abs(stream - folded).max() <= 2e-6 * np.abs(ref).max()



def test_stored_kv_cache_needs_no_float32_context_copy(tmp_path):
    """Over an fp16 / q8_0 / q4_0 cache the query groups attend over the stored rows tile by tile, so the
    runner holds no float32 k_batch / v_batch (4 MiB at the 1.1B shape's 2048 context) yet batches as many
    context slots as over a float32 cache; two prompts decoded together get the tokens each gets alone."""
    from pyengine import LLM, SamplingParams
    from pyengine.engine.model_runner import ModelRunner
    from pyengine.gguf.random_llama import LlamaShape, write_random_llama
    from pyengine.gguf.reader import GGUFFile

    path = tmp_path / "m.gguf"
    write_random_llama(path, LlamaShape(256, 2, 4, 2, 512, 512, 256), seed=7)
    g = GGUFFile(str(path))
    slots = {}
    for kv in ("auto", "q8_0"):
        r = ModelRunner(g, weights_mode="lean", max_model_len=256, max_num_seqs=4, kv_cache_dtype=kv)
        slots[kv] = (r.arena["attn.k_batch"].shape[0], r.arena["attn.v_batch"].shape[0], r.max_slots)
    assert slots["q8_0"][:2] == (0, 0) and slots["auto"][0] >= 256
    assert slots["q8_0"][2] == slots["auto"][2]
    llm = LLM(str(path), weights_mode="lean", kv_cache_dtype="q8_0", max_model_len=256, max_num_seqs=2,
              enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = ["hello world", "a longer prompt than the other one"]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
