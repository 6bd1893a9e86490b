"""S03/S08/S17: the ``Linear`` protocol — every weight matrix the forward multiplies, however it is stored.

    y = lin.matmul(x, out)            out = x @ W           x (rows, in) -> (rows, out)
    y = lin.gated(x, out, scratch)    out = act(x @ Wg) * (x @ Wu)   for a fused [gate | up] matrix (SwiGLU, GeGLU)

Implementations (the model never asks which one it holds):
  DenseLinear      float32 (in, out), dequantized once at load (resident mode); 2..8 rows run as matvecs
  BlockedLinear    float32 (in, out) kept as contiguous column blocks (the LM head, (d, V)); also gives columns
                   (tied embeddings read their rows from the head)
  LeanLinear       the GGUF's quantized rows, dequantized into shared scratch just before use (lean mode,
                   picoLM-style: one layer's worth of float32 at a time, for 32-bit browsers)
  ColumnParallelLinear, RowParallelLinear, VocabParallelHead (layers/parallel_linear.py, S17): Megatron's splits
Why (in, out) and matvecs for few rows: OpenBLAS's sgemm packs the whole weight on every call, so 2 rows cost
~2.4x one row, while its matvec streams rows ("N" layout) ~1.4x faster than the (out, in) form. Numbers in
docs/performance.md; the cut-offs live in pyengine/tuning.py.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from pyengine import tuning
from pyengine.gguf import quants
from pyengine.layers.activation import gated_activation


class QuantMatrix:
    """A (rows, cols) weight kept as quantized rows as the GGUF stores them, possibly several tensors stacked
    (a fused matrix): ``parts`` = [(raw uint8 (rows_i, row_bytes_i), ggml_type)]."""

    def __init__(self, parts: list[tuple[np.ndarray, int]], cols: int):
        self.parts = parts
        self.cols = cols
        self.shape = (sum(p.shape[0] for p, _ in parts), cols)
        self.nbytes = sum(p.nbytes for p, _ in parts)

    @classmethod
    def stack(cls, *mats: "QuantMatrix") -> "QuantMatrix":
        """Rows of several matrices one after the other (Q|K|V, gate|up)."""
        return cls([p for m in mats for p in m.parts], mats[0].cols)

    def dequantize(self, out: np.ndarray | None = None, r0: int = 0, r1: int | None = None) -> np.ndarray:
        """Rows r0..r1 as float32 (into a preallocated C-contiguous ``out``: no model-sized temporaries)."""
        r1 = self.shape[0] if r1 is None else r1
        out = np.empty((r1 - r0, self.cols), np.float32) if out is None else out
        base = 0
        for raw, t in self.parts:
            a, b = max(r0, base), min(r1, base + raw.shape[0])
            if a < b:
                quants.dequantize(raw[a - base:b - base], t, (b - a, self.cols), out=out[a - r0:b - r0])
            base += raw.shape[0]
        return out

    def rows(self, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Dequantize selected rows (embedding lookup); single-part matrices only."""
        (raw, t), = self.parts
        return quants.dequantize(np.take(raw, idx, axis=0), t, out.shape, out=out)


def dense_matmul(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = x @ w for (rows, in) x and (in, out) w; few rows run as matvecs (sgemm's per-call cost)."""
    n = x.shape[0]
    if 1 < n <= tuning.LINEAR_ROW_LOOP_MAX:
        for r in range(n):
            np.matmul(x[r], w, out=out[r])
    else:
        np.matmul(x, w, out=out)
    return out


def dense_matmul_ops(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> list:
    """S13: ``dense_matmul``'s calls (the same row-loop rule), bound for a captured step. As ``np.dot``: for
    these 1-D / 2-D float32 operands it makes the same BLAS call (sgemv, sgemm) as ``np.matmul``, the same bits
    (tests/test_graph_replay.py), without the generalized ufunc's per-call set-up (~1 us of a d=64 product)."""
    n = x.shape[0]
    if 1 < n <= tuning.LINEAR_ROW_LOOP_MAX:
        return [partial(_product(x[r], w, out[r]), x[r], w, out[r]) for r in range(n)]
    return [partial(_product(x, w, out), x, w, out)]


def _product(x: np.ndarray, w: np.ndarray, out: np.ndarray):
    """np.dot for C-contiguous operands (which both hand to BLAS as they are; np.dot also writes only such an
    ``out``), else np.matmul."""
    return np.dot if x.flags.c_contiguous and w.flags.c_contiguous and out.flags.c_contiguous else np.matmul


class Linear:
    """The shared part of every implementation: ``shape`` (in, out), ``nbytes`` held, ``act`` of a gated
    [gate | up] matrix ("silu", "gelu_tanh" or None), and ``gated`` as matmul then the activation."""
    shape: tuple[int, int]
    nbytes: int
    act: str | None = None
    __array_ufunc__ = None                                  # ``x @ lin`` defers to __rmatmul__

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        raise NotImplementedError

    def matmul_ops(self, x: np.ndarray, out: np.ndarray) -> list:
        """S13: ``matmul(x, out)`` as bound calls for a captured step (engine/graph_replay.py); by default the
        one call itself (lean and parallel matrices: their dequantization / messages stay inside it)."""
        return [partial(self.matmul, x, out)]

    def gated(self, x: np.ndarray, out: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
        """out (rows, F) = act(x @ W[:, :F]) * (x @ W[:, F:]) through the (rows, 2F) ``scratch``."""
        gate_up = self.matmul(x, scratch)
        return gated_activation(gate_up, self.act, out=out)

    def dense(self) -> np.ndarray:
        """The whole matrix as a float32 (in, out) array (references and benchmarks; may allocate)."""
        raise NotImplementedError

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:      # ``x @ lin`` in the readable reference forwards
        return self.matmul(np.ascontiguousarray(x, dtype=np.float32))


class DenseLinear(Linear):
    """A float32 (in, out) matrix (resident mode)."""

    def __init__(self, w: np.ndarray, act: str | None = None):
        self.w = np.ascontiguousarray(w, dtype=np.float32)
        self.shape, self.nbytes, self.act = self.w.shape, self.w.nbytes, act

    @classmethod
    def from_quant(cls, m: QuantMatrix, act: str | None = None) -> "DenseLinear":
        return cls(m.dequantize().T, act)             # the (out, in) copy is freed right away

    def matmul(self, x, out=None):
        out = np.empty((x.shape[0], self.shape[1]), np.float32) if out is None else out
        return dense_matmul(x, self.w, out)

    def matmul_ops(self, x, out):
        return dense_matmul_ops(x, self.w, out)

    def dense(self):
        return self.w


class BlockedLinear(Linear):
    """A float32 (in, out) matrix as contiguous column blocks of ``width`` columns (the resident LM head, (d, V)):
    with the whole matrix's long rows OpenBLAS multiplies 8-32 rows 1.3-1.5x slower than block by block, and up
    to HEAD_ROW_LOOP_MAX rows run as matvecs over one block at a time (it stays in cache across the rows)."""

    def __init__(self, out_in_rows: np.ndarray, width: int | None = None):
        """``out_in_rows``: the (out, in) matrix as GGUF stores it (one row per output column)."""
        cols, rows = out_in_rows.shape
        self.width = width = width or tuning.HEAD_COL_CHUNK
        self.blocks = [np.ascontiguousarray(out_in_rows[c:c + width].T) for c in range(0, cols, width)]
        self.shape = (rows, cols)
        self.nbytes = sum(b.nbytes for b in self.blocks)

    def matmul(self, x, out=None):
        out = np.empty(x.shape[:-1] + (self.shape[1],), np.float32) if out is None else out
        n = x.shape[0] if x.ndim == 2 else 1
        for i, b in enumerate(self.blocks):
            o = out[..., i * self.width:i * self.width + b.shape[1]]
            if x.ndim == 2 and 1 < n <= tuning.HEAD_ROW_LOOP_MAX:
                for r in range(n):
                    np.matmul(x[r], b, out=o[r])
            else:
                np.matmul(x, b, out=o)
        return out

    def matmul_ops(self, x, out):
        ops, n = [], x.shape[0]
        for i, b in enumerate(self.blocks):
            o = out[:, i * self.width:i * self.width + b.shape[1]]
            if 1 < n <= tuning.HEAD_ROW_LOOP_MAX:          # np.dot: as in dense_matmul_ops
                ops += [partial(_product(x[r], b, o[r]), x[r], b, o[r]) for r in range(n)]
            else:
                ops.append(partial(_product(x, b, o), x, b, o))
        return ops

    def columns(self, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out[t] = W[:, idx[t]] for (T,) indices: out is (T, in)."""
        idx = np.asarray(idx, dtype=np.int64)
        which, col = np.divmod(idx, self.width)
        for i in np.unique(which).tolist():
            sel = which == i
            out[sel] = self.blocks[i][:, col[sel]].T          # (in, k) gather: k*in floats, small
        return out

    def dense(self):
        return np.concatenate(self.blocks, axis=1)


class LeanLinear(Linear):
    """Quantized (out, in) rows dequantized into ``scratch`` (a flat float32 buffer shared by every lean matrix:
    layers run one after another) just before each product; matrices with more rows than ``chunk_rows`` (the LM
    head) go in chunks of rows so the scratch stays small."""

    def __init__(self, m: QuantMatrix, act: str | None = None, chunk_rows: int | None = None):
        self.q = m
        self.shape, self.nbytes, self.act = (m.shape[1], m.shape[0]), m.nbytes, act
        self.chunk_rows = min(m.shape[0], chunk_rows or m.shape[0])
        self.scratch: np.ndarray | None = None           # bound by the runner (arena region "lean.scratch")

    @property
    def scratch_floats(self) -> int:
        return self.chunk_rows * self.q.cols

    def matmul(self, x, out=None):
        out = np.empty((x.shape[0], self.shape[1]), np.float32) if out is None else out
        n, k = self.q.shape
        buf = (np.empty(self.scratch_floats, np.float32) if self.scratch is None else self.scratch)
        for r0 in range(0, n, self.chunk_rows):
            r1 = min(n, r0 + self.chunk_rows)
            rows = self.q.dequantize(buf[:(r1 - r0) * k].reshape(r1 - r0, k), r0, r1)
            if 1 < x.shape[0] <= tuning.LEAN_ROW_LOOP_MAX:       # the fresh rows are still in cache
                for r in range(x.shape[0]):
                    np.matmul(x[r], rows.T, out=out[r, r0:r1])
            else:
                np.matmul(x, rows.T, out=out[:, r0:r1])
        return out

    def rows(self, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
        return self.q.rows(idx, out)

    def dense(self):
        return self.q.dequantize().T


class Embedding:
    """Token rows of the (V, d) embedding: read from the head's columns when tied (resident), from a float32
    (d, V) array (resident, untied), or dequantized from the quantized rows (lean)."""

    def __init__(self, source, d: int):
        self.source, self.d = source, d

    def __call__(self, token_ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty((len(token_ids), self.d), np.float32) if out is None else out
        s = self.source
        if isinstance(s, np.ndarray):                 # (d, V): a (d, T) gather, small
            np.copyto(out, s[:, token_ids].T)
            return out
        if hasattr(s, "columns"):                     # tied resident head, or a column-parallel one
            return s.columns(token_ids, out)
        return s.rows(token_ids, out)                 # QuantMatrix / LeanLinear

    def ops(self, token_ids: np.ndarray, out: np.ndarray) -> list | None:
        """S13: the lookup as one bound gather for a captured step, when the rows come from one float32 (d, V)
        array (untied, or a tied head of one column block); else None (then the lookup is one call)."""
        s = self.source
        blocks = getattr(s, "blocks", None)
        table = s if isinstance(s, np.ndarray) else blocks[0] if blocks is not None and len(blocks) == 1 else None
        if table is None:
            return None
        return [partial(np.take, table, token_ids, 1, out.T, "clip")]


def make_linear(m: QuantMatrix, mode: str, act: str | None = None) -> Linear:
    """The Linear for a weight in the given weights mode."""
    if mode == "resident":
        return DenseLinear.from_quant(m, act)
    if mode == "lean":
        return LeanLinear(m, act)
    raise ValueError(f"weights mode must be 'resident' or 'lean', got {mode!r}")


def make_head(m: QuantMatrix, mode: str) -> Linear:
    """The LM head: column blocks (resident) or lean rows in chunks."""
    if mode == "resident":
        return BlockedLinear(m.dequantize())
    return LeanLinear(m, chunk_rows=tuning.LEAN_HEAD_ROWS)
