"""Issue 29: Pyodide's lean products over quants held as bytes (layers/wasm_lean.py, tuning.LEAN_LAYOUT "bytes"),
checked in CPython against `gguf`'s dequantization (independent) and the float64 product: every row count through
the folded and the scaled paths, a fused matrix of Q4_0 | Q4_1 | Q8_0 parts with reordered rows, row blocks that do
not divide the rows; formats without a byte form keep the stream path."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from pyengine import tuning
from pyengine.gguf import quants
from pyengine.gguf.quants import GGMLType
from pyengine.layers import wasm_lean
from pyengine.layers.linear import LeanLinear, QuantMatrix


def _rows(t: GGMLType, n: int, k: int, seed: int) -> np.ndarray:
    w = (np.random.default_rng(seed).standard_normal((n, k)) * 0.3 + 0.05).astype(np.float32)
    return quants.quantizer(t)(w).reshape(n, -1)


@pytest.mark.parametrize("t", wasm_lean.HELD_TYPES, ids=lambda t: t.name)
def test_held_bytes_rebuild_ggml_dequantization(t):
    raw = _rows(t, 37, 512, 1)
    p = wasm_lean.HeldPart(lambda a, b: raw[a:b], t, 37, 512)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(t))).reshape(37, 512)
    w = p.q.astype(np.float32) * p.scale[:, :, None] + (0 if p.bias is None else p.bias[:, :, None])
    assert p.q.dtype == np.int8 and -8 <= p.q.min() and p.q.max() <= 7
    assert np.abs(w.reshape(37, 512) - ref).max() <= 1e-6 * np.abs(ref).max()
    assert p.nbytes == 37 * 512 * (1 + (8 if t == GGMLType.Q4_1 else 4) / 32)


def test_byte_products_equal_float64(monkeypatch):
    monkeypatch.setattr(tuning, "LEAN_LAYOUT", "bytes")
    monkeypatch.setattr(tuning, "LEAN_BLOCK_BYTES", 7 * 512 * 4)           # 7-row blocks (6 rows of Q8_0)
    parts = [(_rows(t, n, 512, i), int(t)) for i, (t, n) in
             enumerate(((GGMLType.Q4_0, 40), (GGMLType.Q4_1, 24), (GGMLType.Q8_0, 19)))]
    order = np.random.default_rng(9).permutation(24)
    m = QuantMatrix(parts, 512, [None, order, None])
    lin = LeanLinear(m)
    assert lin.held is not None
    lin.scratch = np.empty(lin.scratch_floats, np.float32)
    w = m.dequantize().astype(np.float64).T
    rng = np.random.default_rng(4)
    for n in (1, 2, tuning.LEAN_FOLD_MAX_ROWS, tuning.LEAN_FOLD_MAX_ROWS + 1, 20):
        x = rng.standard_normal((n, 512)).astype(np.float32)
        out = lin.matmul(x, np.empty((n, 83), np.float32))
        ref = x @ w
        assert np.abs(out - ref).max() <= 2e-6 * np.abs(ref).max(), n


def test_other_formats_keep_the_stream(monkeypatch):
    monkeypatch.setattr(tuning, "LEAN_LAYOUT", "bytes")
    assert LeanLinear(QuantMatrix([(_rows(GGMLType.Q4_K, 4, 512, 2), int(GGMLType.Q4_K))], 512)).held is None
    monkeypatch.setattr(tuning, "LEAN_LAYOUT", "stream")
    assert LeanLinear(QuantMatrix([(_rows(GGMLType.Q4_1, 4, 512, 2), int(GGMLType.Q4_1))], 512)).held is None
