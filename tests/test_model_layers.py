"""S03: RMSNorm, RoPE and SwiGLU against direct float64 formulas, the GGUF Q/K row permutation, and the
resident head's column blocks."""
import math

import numpy as np
import pytest

from pyengine.layers.activation import silu, swiglu
from pyengine.layers.norm import rms_norm
from pyengine.layers.rotary import (apply_rope, apply_rope_interleaved, interleaved_to_half, rope_cos_sin,
                                    rope_inv_freq)

RNG = np.random.default_rng(0)


def test_rms_norm():
    x = RNG.standard_normal((5, 576)).astype(np.float32) * 3
    w = RNG.standard_normal(576).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * w
    out = np.empty_like(x)
    assert rms_norm(x, w, 1e-5, out=out) is out
    assert np.abs(out - want).max() < 1e-5


def test_silu_and_swiglu():
    x = np.concatenate([RNG.standard_normal(1000) * 5, [-1e4, -100.0, 0.0, 100.0, 1e4]]).astype(np.float32)
    with np.errstate(over="ignore"):
        want = x.astype(np.float64) / (1 + np.exp(-x.astype(np.float64)))
    got = silu(x)
    assert np.all(np.isfinite(got)) and np.allclose(got, want, rtol=1e-5, atol=1e-6)
    gu = RNG.standard_normal((3, 2 * 8)).astype(np.float32)
    g, u = gu[:, :8].astype(np.float64), gu[:, 8:].astype(np.float64)
    assert np.allclose(swiglu(gu), g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)


def test_rope_is_a_rotation_with_the_expected_angles():
    inv = rope_inv_freq(64, 100000.0)
    assert inv[0] == 1.0 and math.isclose(inv[1], 100000.0 ** (-2 / 64))
    cos, sin = rope_cos_sin(np.array([0, 7]), inv)
    x = RNG.standard_normal((2, 3, 64)).astype(np.float32)
    y = apply_rope(x, cos, sin)
    assert np.allclose(y[0], x[0])                                   # position 0: identity
    assert np.allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    # dims (i, i+32) of position 7 are rotated by 7 * inv[i]
    a = 7 * inv[5]
    assert np.allclose(y[1, :, 5], x[1, :, 5] * math.cos(a) - x[1, :, 37] * math.sin(a), atol=1e-5)
    assert np.allclose(y[1, :, 37], x[1, :, 37] * math.cos(a) + x[1, :, 5] * math.sin(a), atol=1e-5)
    # tables already repeated per head (the fast forward's form) give the same rotation
    per_head = [np.ascontiguousarray(np.broadcast_to(t[:, None, :], (2, 3, 32))) for t in (cos, sin)]
    assert np.array_equal(apply_rope(x, *per_head), y)


def test_relative_position_property():
    """q·k after RoPE depends only on the distance between positions."""
    inv = rope_inv_freq(64, 10000.0)
    q = RNG.standard_normal((1, 1, 64)).astype(np.float32)
    k = RNG.standard_normal((1, 1, 64)).astype(np.float32)
    dots = []
    for p in (3, 40, 500):
        cq, sq = rope_cos_sin(np.array([p + 5]), inv)
        ck, sk = rope_cos_sin(np.array([p]), inv)
        dots.append(float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()))
    assert np.allclose(dots, dots[0], rtol=1e-4)


def test_gguf_permutation_maps_interleaved_to_half():
    """GGUF rows are permuted for interleaved RoPE; after interleaved_to_half, half-split RoPE gives the same
    q·k as interleaved RoPE on the GGUF rows (what llama.cpp computes)."""
    n_heads, hd, d = 3, 64, 16
    w = RNG.standard_normal((n_heads * hd, d)).astype(np.float32)
    x = RNG.standard_normal((4, d)).astype(np.float32)
    cos, sin = rope_cos_sin(np.arange(4) * 11, rope_inv_freq(hd, 10000.0))
    inter = apply_rope_interleaved((x @ w.T).reshape(4, n_heads, hd), cos, sin)
    half = apply_rope((x @ interleaved_to_half(w, n_heads).T).reshape(4, n_heads, hd), cos, sin)
    # the same vectors up to a fixed permutation of dims: (0,2,4,..,1,3,..)
    perm = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])
    assert np.allclose(half, inter[..., perm], atol=1e-4)
    assert np.allclose(np.einsum("thd,shd->hts", half, half), np.einsum("thd,shd->hts", inter, inter), atol=1e-3)


def test_rope_scaling():
    base = rope_inv_freq(64, 500000.0)
    assert np.allclose(rope_inv_freq(64, 500000.0, "linear", 4.0), base / 4)
    l3 = rope_inv_freq(64, 500000.0, "llama3", 8.0, orig_context=8192)
    wavelen = 2 * np.pi / base
    hi, lo = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert hi.any() and lo.any()
    assert np.allclose(l3[hi], base[hi]) and np.allclose(l3[lo], base[lo] / 8)
    mid = ~hi & ~lo
    assert np.all((l3[mid] < base[mid]) & (l3[mid] > base[mid] / 8))      # interpolated band
    assert np.allclose(rope_inv_freq(64, 500000.0, freq_factors=np.full(32, 2.0)), base / 2)
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(64, 10000.0, "yarn", 4.0)


def test_blocked_linear_equals_the_dense_matrix():
    """The resident head's column blocks (and the narrower tail) multiply and gather like the dense matrix."""
    from pyengine.layers.linear import BlockedLinear, col_block
    rng = np.random.default_rng(5)
    c = col_block(3)
    rows_out_in = rng.standard_normal((2 * c + 22, 3)).astype(np.float32)   # GGUF order: (cols, rows)
    dense = rows_out_in.T                                                # (3, 2c + 22)
    m = BlockedLinear(rows_out_in)
    assert m.shape == dense.shape and m.blocks.shape == (2, 3, c) and m.tail.shape == (3, 22)
    assert m.blocks.flags.c_contiguous and m.nbytes == dense.nbytes
    x = rng.standard_normal((5, 3)).astype(np.float32)
    assert np.allclose(m.matmul(x), x @ dense, atol=1e-6)
    assert np.allclose(m.matmul(x[0]), x[0] @ dense, atol=1e-6)         # one row as a vector
    out = np.empty((5, dense.shape[1]), np.float32)
    assert m.matmul(x, out) is out
    ids = np.array([2 * c + 21, 0, 4, 4, c + 7, 2 * c, 3])
    cols = m.columns(ids, np.empty((len(ids), 3), np.float32))
    assert np.array_equal(cols, dense[:, ids].T)
    assert np.array_equal(m.dense(), dense)


def test_dense_linear_rows_do_not_depend_on_the_row_count():
    """A row's product is the same bits alone (the padded one-row path) as among any number of rows below
    REGROUP_MIN_ROWS: up to SMALL_GEMM_ROWS rows (S14's verification rows equal the decode rows), one product
    in the small kernel, and row chunks from SMALL_GEMM_CHUNK_MIN rows or wherever one product would leave
    that kernel; every row count (regrouped columns for prefill) matches float64;
    scaling folds (fold_norms) equal scaling the dense matrix."""
    from pyengine import tuning
    from pyengine.layers.linear import PAD_SINGLE_ROW, DenseLinear
    rng = np.random.default_rng(6)
    w = rng.standard_normal((96, 300)).astype(np.float32)               # (in, out): blocks and a tail
    lin = DenseLinear(w)
    x = rng.standard_normal((2 * tuning.SMALL_GEMM_ROWS + 3, 96)).astype(np.float32)
    alone = np.stack([lin.matmul(x[i:i + 1])[0] for i in range(len(x))])
    for n in range(1, len(x) + 1):
        out = lin.matmul(x[:n])
        assert np.abs(out - x[:n].astype(np.float64) @ w).max() <= 1e-4
        if PAD_SINGLE_ROW:
            assert np.array_equal(out, alone[:n]), n
    # SmolLM2's shapes, where one packed sgemm would round a wide batch's rows differently: 576 inputs, and
    # the down projection's 1536 (32-column blocks), whose 21-23-row product would leave the small kernel
    for n_in, n_out in ((576, 1536), (1536, 576)):
        wide = DenseLinear(rng.standard_normal((n_in, n_out)).astype(np.float32))
        xw = rng.standard_normal((40, n_in)).astype(np.float32)
        alone = np.stack([wide.matmul(xw[i:i + 1])[0] for i in range(len(xw))])
        for n in range(2, len(xw) + 1) if PAD_SINGLE_ROW else ():
            assert np.array_equal(wide.matmul(xw[:n]), alone[:n]), (n_in, n)
    big = rng.standard_normal((tuning.REGROUP_MIN_ROWS + 5, 96)).astype(np.float32)    # prefill: regrouped
    assert np.abs(lin.matmul(big) - big.astype(np.float64) @ w).max() <= 1e-4
    g = rng.standard_normal(96).astype(np.float32)
    lin.scale_inputs(g)
    lin.scale_columns(150, 0.5)
    ref = w * g[:, None]
    ref[:, :150] *= np.float32(0.5)
    assert np.array_equal(lin.dense(), ref)


def test_embedding_bound_lookup_equals_the_plain_one():
    """S13's bound gather (Embedding.ops) gives the plain lookup's rows, for untied tables and for tied column-block
    heads whose vocabulary is one block plus a tail (token ids past the first block must not be clipped into it)."""
    from pyengine.layers.linear import BlockedLinear, Embedding
    rng = np.random.default_rng(8)
    for vocab in (64, 100, 300):
        rows = rng.standard_normal((vocab, 64)).astype(np.float32)
        ids = np.array([0, 63, vocab - 1, vocab // 2])
        for source in (np.ascontiguousarray(rows.T), BlockedLinear(rows)):
            emb, out = Embedding(source, 64), np.empty((len(ids), 64), np.float32)
            ops = emb.ops(ids, out)
            if ops is None:
                emb(ids, out)
            else:
                for op in ops:
                    op()
            assert np.array_equal(out, rows[ids]), (vocab, type(source).__name__)
