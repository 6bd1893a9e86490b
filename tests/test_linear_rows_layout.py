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


def test_staged_rows_are_the_same_bits_through_the_scratch(rows_layout, monkeypatch):
    """tuning.RESIDENT_STAGE_BYTES (Pyodide's): each block of rows is copied into the weights scratch and
    multiplied there. 7-row blocks over 300 outputs (the last one short): every product is bit-identical to the
    in-place rows, a captured step binds one copy and one einsum per input row for each block, and an arena
    scratch bound by the runner is the one written."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal((96, 300)).astype(np.float32)
    x = rng.standard_normal((17, 96)).astype(np.float32)
    plain = DenseLinear(w)
    assert plain.stage_rows == 0 and plain.scratch_floats == 0
    monkeypatch.setattr(tuning, "RESIDENT_STAGE_BYTES", 7 * 96 * 4 + 5)
    lin = DenseLinear(w)
    assert lin.stage_rows == 7 and lin.scratch_floats == 7 * 96
    for n in (1, 3, 17):
        assert np.array_equal(lin.matmul(x[:n]), plain.matmul(x[:n])), n
    lin.scratch = np.full(lin.scratch_floats + 8, np.nan, np.float32)          # an arena region, bound later
    out = np.empty((3, 300), np.float32)
    ops = lin.matmul_ops(x[:3], out)
    assert len(ops) == -(-300 // 7) * (1 + 3)
    for op in ops:
        op()
    assert np.array_equal(out, plain.matmul(x[:3]))
    last = 300 - 300 % 7
    assert np.array_equal(lin.scratch[:(300 - last) * 96].reshape(-1, 96), w[:, last:].T)   # the last block, staged
    monkeypatch.setattr(tuning, "RESIDENT_STAGE_BYTES", 1 << 20)
    assert DenseLinear(w).stage_rows == 300                                   # never more rows than the matrix


def test_staged_model_decodes_the_unstaged_bits_and_sizes_the_arena(rows_layout, monkeypatch, tmp_path):
    """A whole resident model in the staged rows layout: the runner binds one weights scratch (the largest block)
    that `pyengine info --memory` plans, and generation gives the very tokens and logprobs of the in-place
    rows."""
    from pyengine import LLM, SamplingParams
    from pyengine.engine.lean_mode import memory_plan
    from pyengine.gguf.random_llama import LlamaShape, write_random_llama
    from pyengine.gguf.reader import GGUFFile

    path = tmp_path / "m.gguf"
    write_random_llama(path, LlamaShape(256, 2, 4, 2, 512, 512, 256), seed=9)
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    runs = {}
    for stage in (0, 16 << 10):
        monkeypatch.setattr(tuning, "RESIDENT_STAGE_BYTES", stage)
        llm = LLM(str(path), weights_mode="resident", max_model_len=256)
        runner = llm.llm_engine.runner
        scratch = runner.arena.views["lean.scratch"]
        assert scratch.size == max(lin.scratch_floats for _, lin in runner.weights.linears())
        assert scratch.size == stage // 4                 # 16 KiB blocks: every input width divides them
        assert all(lin.scratch is scratch for _, lin in runner.weights.linears() if lin.scratch_floats)
        plan = memory_plan(GGUFFile(str(path)), "resident", 256)["buffers"]
        out = llm.generate([{"prompt_token_ids": [1, 5, 9, 200, 31]}], sp)[0].outputs[0]
        runs[stage] = (out.token_ids, out.logprobs,
                       runner.arena.nbytes, plan)
    (ids0, lp0, arena0, plan0), (ids1, lp1, arena1, plan1) = runs[0], runs[16 << 10]
    assert ids0 == ids1 and lp0 == lp1
    assert abs(arena1 - arena0 - (16 << 10)) <= 64 and abs(plan1 - plan0 - (16 << 10)) <= 64   # the scratch, planned
