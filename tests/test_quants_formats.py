"""S08: every supported ggml format dequantizes bit-exactly like the `gguf` package's reference (itself a
transcription of ggml-quants.c); Q8_0/Q4_0 quantization produces the reference bytes and stays within each
format's error bound."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from pyengine.gguf import GGUFError
from pyengine.gguf import quants
from pyengine.gguf.quants import GGML_BLOCK, GGMLType, dequantize, quantize_q4_0, quantize_q8_0

import gguf

FORMATS = list(quants.SUPPORTED_TYPES)
N_BLOCKS = 776   # a multiple of 8, so 32-weight blocks fill rows of 256


def _random_raw(t: GGMLType, n_blocks: int, rng: np.random.Generator, sane: bool = True) -> np.ndarray:
    """n_blocks of random bytes; with ``sane`` the float16 scale fields get finite random values."""
    layout = GGML_BLOCK[t]
    raw = rng.integers(0, 256, n_blocks * layout.type_size, dtype=np.uint8)
    if not sane:
        return raw
    if t == GGMLType.F32:
        raw.view(np.float32)[:] = rng.standard_normal(n_blocks).astype(np.float32)
    elif t == GGMLType.F16:
        raw.view(np.float16)[:] = rng.standard_normal(n_blocks).astype(np.float16)
    elif t == GGMLType.BF16:
        raw.view(np.uint16)[:] = rng.standard_normal(n_blocks).astype(np.float32).view(np.uint32) >> 16
    else:
        blocks = raw.view(layout.dtype)
        for name in layout.dtype.names:
            if layout.dtype[name] == np.dtype("<f2"):
                blocks[name] = (rng.standard_normal(n_blocks) * rng.choice([1e-3, 1e-1, 10], n_blocks)).astype(
                    np.float16)
    return raw


def _reference(raw: np.ndarray, t: GGMLType, shape) -> np.ndarray:
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    out = gguf.quants.dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType(int(t)))
    return np.asarray(out, np.float32).reshape(shape)


def _bits_equal(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_supported_formats():
    assert {t.name for t in FORMATS} == {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                                         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}


def test_block_table_matches_reference():
    for t, layout in GGML_BLOCK.items():
        if t == GGMLType.Q8_1:   # gguf-py still lists the old float32 d/s (40 bytes); ggml's block_q8_1 is 36
            assert layout.type_size == 2 + 2 + 32
            continue
        assert (layout.block_size, layout.type_size) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t))], t
        if layout.dtype is not None:
            assert layout.dtype.itemsize == layout.type_size, t


@pytest.mark.parametrize("t", FORMATS, ids=lambda t: t.name)
def test_random_blocks_bit_exact(t):
    rng = np.random.default_rng(int(t))
    bs = GGML_BLOCK[t].block_size
    shape = (N_BLOCKS * bs // 256, 256) if bs > 1 else (8, N_BLOCKS // 8)
    raw = _random_raw(t, N_BLOCKS, rng)
    ours = dequantize(raw, t, shape)
    assert ours.dtype == np.float32 and ours.shape == shape
    assert _bits_equal(ours, _reference(raw, t, shape))


@pytest.mark.parametrize("t", FORMATS, ids=lambda t: t.name)
def test_arbitrary_bytes_match_with_nan_equality(t):
    """Fully random bytes (inf/NaN scales included): same values, NaN where the reference has NaN."""
    rng = np.random.default_rng(1000 + int(t))
    bs = GGML_BLOCK[t].block_size
    n = 256 if bs > 1 else 4096
    raw = _random_raw(t, n, rng, sane=False)
    shape = (n * bs,)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # ours decodes inf/NaN scales silently, like ggml
        ours = dequantize(raw, t, shape)
    with np.errstate(all="ignore"):
        want = _reference(raw, t, shape)
    assert np.array_equal(ours, want, equal_nan=True)


@pytest.mark.parametrize("t", [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q6_K], ids=lambda t: t.name)
def test_dequantize_into_preallocated_out(t):
    """The lean weight mode decodes into arena scratch: out= gives the same bits and returns that very array."""
    rng = np.random.default_rng(11)
    bs = GGML_BLOCK[t].block_size
    shape = (N_BLOCKS * bs // 256, 256)
    raw = _random_raw(t, N_BLOCKS, rng)
    out = np.full(shape, np.nan, np.float32)
    assert dequantize(raw, t, shape, out=out) is out
    assert _bits_equal(out, _reference(raw, t, shape))
    with pytest.raises(ValueError, match="out must be"):
        dequantize(raw, t, shape, out=np.empty(shape[::-1], np.float32))


@pytest.mark.parametrize("t", [GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.F16], ids=lambda t: t.name)
def test_many_chunks(t):
    """Large tensors are decoded in chunks of blocks; the seams must not show."""
    rng = np.random.default_rng(7)
    bs = GGML_BLOCK[t].block_size
    n_blocks = (quants._CHUNK_WEIGHTS // bs) * 2 + 8
    raw = _random_raw(t, n_blocks, rng)
    shape = (n_blocks * bs // 256, 256) if bs > 1 else (n_blocks,)
    assert _bits_equal(dequantize(raw, t, shape), _reference(raw, t, shape))


def test_dequantize_errors_name_the_type():
    with pytest.raises(GGUFError, match="99"):
        dequantize(np.zeros(18, np.uint8), 99, (32,))
    with pytest.raises(GGUFError, match="IQ2_XXS"):
        dequantize(np.zeros(66, np.uint8), GGMLType.IQ2_XXS, (256,))
    with pytest.raises(GGUFError, match="Q4_0.*needs 18 bytes"):
        dequantize(np.zeros(17, np.uint8), GGMLType.Q4_0, (32,))
    with pytest.raises(GGUFError, match="block size 32"):
        dequantize(np.zeros(18, np.uint8), GGMLType.Q4_0, (2, 16))
    with pytest.raises(GGUFError, match="uint8"):
        dequantize(np.zeros(9, np.float16), GGMLType.Q4_0, (32,))


# ---------------------------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------------------------

def _test_inputs(rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((64, 256)).astype(np.float32) * rng.choice([1e-4, 1, 300], (64, 1)).astype(np.float32)
    x[0] = 0                                   # all-zero block: d = 0
    x[1, :32] = -7.0                           # constant negative block
    x[2, :32] = np.arange(32) - 16.5           # negative max magnitude, exact half steps
    x[3, :32] = np.linspace(-127, 127, 32)     # Q8_0 ties: x*id lands on .5 values
    x[4, :32] = (np.arange(32) - 16) * 0.5     # Q4_0 ties around x/d + 8.5
    x[5, 5] = -x[5].__abs__().max() * 2        # a lone negative outlier
    return x


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])
def test_quantize_matches_reference_bytes(name):
    rng = np.random.default_rng(3)
    x = _test_inputs(rng)
    ours = {"Q8_0": quantize_q8_0, "Q4_0": quantize_q4_0}[name](x)
    want = np.asarray(gguf.quants.quantize(x, gguf.GGMLQuantizationType[name]), np.uint8).reshape(-1)
    assert ours.dtype == np.uint8 and ours.ndim == 1
    assert np.array_equal(ours, want)


def test_q8_0_round_trip_error_bound():
    rng = np.random.default_rng(4)
    x = _test_inputs(rng)
    raw = quantize_q8_0(x)
    y = dequantize(raw, GGMLType.Q8_0, x.shape)
    blocks = x.reshape(-1, 32).astype(np.float64)
    d = np.abs(blocks).max(axis=1) / 127                      # exact scale
    d16 = raw.view(GGML_BLOCK[GGMLType.Q8_0].dtype)["d"].astype(np.float64)   # stored scale
    # rounding to the nearest level costs <= d/2; storing d as float16 moves level q by |q| * |d - d16|
    bound = d / 2 + 127 * np.abs(d - d16) + 1e-6 * d
    err = np.abs(blocks - y.reshape(-1, 32)).max(axis=1)
    assert np.all(err <= bound)
    assert np.array_equal(y[0], np.zeros(256, np.float32))


def test_q4_0_round_trip_error_bound():
    rng = np.random.default_rng(5)
    x = _test_inputs(rng)
    raw = quantize_q4_0(x)
    y = dequantize(raw, GGMLType.Q4_0, x.shape).reshape(-1, 32).astype(np.float64)
    blocks = x.reshape(-1, 32).astype(np.float64)
    amax = np.abs(blocks).max(axis=1)
    d = amax / 8                                              # |d| = amax / 8 (sign is the max's)
    d16 = np.abs(raw.view(GGML_BLOCK[GGMLType.Q4_0].dtype)["d"].astype(np.float64))
    # 16 levels -8..7 of step d: the value of largest magnitude is exact (level -8); others round to the
    # nearest level (<= d/2) except the far end, which clamps to level 7 (<= d); plus float16 storage of d.
    bound = d + 8 * np.abs(d - d16) + 1e-6 * amax
    err = np.abs(blocks - y)
    assert np.all(err.max(axis=1) <= bound)
    inner = np.abs(blocks) < amax[:, None] * (7 / 8)          # away from the clamped end: half a step
    half_step = (d / 2 + 8 * np.abs(d - d16) + 1e-6 * amax)[:, None]
    assert np.all((err <= half_step) | ~inner)
    # the largest-magnitude value of each block is reproduced up to float16 rounding of d
    idx = np.abs(blocks).argmax(axis=1)
    rows = np.arange(len(blocks))
    assert np.all(np.abs(y[rows, idx] - blocks[rows, idx]) <= 8 * np.abs(d - d16) + 1e-6 * amax)


def test_quantize_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(np.zeros(33, np.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q4_0(np.float32(1.0))
