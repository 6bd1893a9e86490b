"""The resident rows layout (tuning.RESIDENT_LAYOUT = "rows", Pyodide's: the GGUF's (out, in) rows, one np.einsum
per input row) against the float64 product, in CPython with the switch set: products of 1..40 rows and a prefill,
a row's bits independent of the row count, the head's column gather, the fold_norms scalings, the graph replay's
bound calls, and CPython's default staying column blocks. Pyodide runs it for real (tests/test_pyodide_*)."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from pyengine import tuning
from pyengine.layers.linear import BlockedLinear, DenseLinear


def test_cpython_keeps_column_blocks():
    assert tuning.RESIDENT_LAYOUT == ("rows" if sys.platform == "emscripten" else "column-blocks")


@pytest.fixture
def rows_layout(monkeypatch):
    monkeypatch.setattr(tuning, "RESIDENT_LAYOUT", "rows")


def test_rows_layout_products_scalings_and_columns(rows_layout):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((96, 300)).astype(np.float32)                # (in, out)
    lin = DenseLinear(w, act="silu")
    assert lin.blocks is None and lin.out_in.shape == (300, 96) and lin.out_in.flags.c_contiguous
    assert lin.shape == (96, 300) and lin.nbytes == w.nbytes and lin.act == "silu"
    x = rng.standard_normal((40, 96)).astype(np.float32)
    alone = np.stack([lin.matmul(x[i]) for i in range(len(x))])          # one row as a vector
    for n in (1, 2, 5, 17, 40):
        out = lin.matmul(x[:n])
        assert np.abs(out - x[:n].astype(np.float64) @ w).max() <= 1e-4
        assert np.array_equal(out, alone[:n]), n                         # a row's bits never depend on the batch
    big = rng.standard_normal((tuning.REGROUP_MIN_ROWS + 3, 96)).astype(np.float32)
    assert np.abs(lin.matmul(big) - big.astype(np.float64) @ w).max() <= 1e-4
    out = np.empty((3, 300), np.float32)
    ops = lin.matmul_ops(x[:3], out)                                      # what a captured step binds
    assert len(ops) == 3
    for op in ops:
        op()
    assert np.array_equal(out, alone[:3])
    with pytest.raises(ValueError, match="contiguous columns"):
        lin.matmul(x[:2], np.empty((300, 2), np.float32).T)
    g = rng.standard_normal(96).astype(np.float32)
    lin.scale_inputs(g)
    lin.scale_columns(150, 0.5)
    ref = w * g[:, None]
    ref[:, :150] *= np.float32(0.5)
    assert np.array_equal(lin.dense(), ref)
    head = BlockedLinear(rng.standard_normal((130, 24)).astype(np.float32))   # GGUF order (V, d)
    ids = np.array([129, 0, 4, 4, 77])
    cols = head.columns(ids, np.empty((len(ids), 24), np.float32))
    assert np.array_equal(cols, head.dense()[:, ids].T)
