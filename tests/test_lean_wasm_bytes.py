"""Issue 29: Pyodide's lean products over quants held as bytes (layers/wasm_lean.py, tuning.LEAN_LAYOUT "bytes"),
checked in CPython against `gguf`'s dequantization (independent) and the float64 product: every row count through
the folded and the scaled paths, a fused matrix of Q4_0 | Q4_1 | Q8_0 parts with reordered rows, row blocks that do
not divide the rows; formats without a byte form keep the stream path."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from pyengine import tuning
from pyengine.gguf.quants import GGMLType
from pyengine.layers import wasm_lean
from pyengine.layers.linear import LeanLinear, QuantMatrix
from test_lean_stream import _rows, assert_products_match_float64


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
    assert_products_match_float64(lin, m)


def test_other_formats_keep_the_stream(monkeypatch):
    monkeypatch.setattr(tuning, "LEAN_LAYOUT", "bytes")
    assert LeanLinear(QuantMatrix([(_rows(GGMLType.Q4_K, 4, 512, 2), int(GGMLType.Q4_K))], 512)).held is None
    monkeypatch.setattr(tuning, "LEAN_LAYOUT", "stream")
    assert LeanLinear(QuantMatrix([(_rows(GGMLType.Q4_1, 4, 512, 2), int(GGMLType.Q4_1))], 512)).held is None
