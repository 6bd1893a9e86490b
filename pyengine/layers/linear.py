"""S03/S08/S17: the ``Linear`` protocol — every weight matrix the forward multiplies, however it is stored.

    y = lin.matmul(x, out)            out = x @ W           x (rows, in) -> (rows, out)
    y = lin.gated(x, out, scratch)    out = act(x @ Wg) * (x @ Wu)   for a fused [gate | up] matrix (SwiGLU, GeGLU)

Implementations (the model never asks which one it holds):
  DenseLinear      float32 (in, out), dequantized once at load (resident mode), held as contiguous column blocks
  BlockedLinear    the resident LM head (d, V): a DenseLinear that also gives columns (tied embeddings read
                   their rows from the head)
  LeanLinear       the GGUF's quantized rows, multiplied an L2-sized block of rows at a time with the block
                   scales folded into the activations (lean mode, picoLM-style, S21)
  ColumnParallelLinear, RowParallelLinear, VocabParallelHead (layers/parallel_linear.py, S17): Megatron's splits
Why column blocks: OpenBLAS's sgemm packs the whole weight on every call, so 2 rows cost ~2.4x one row, and a
loop of matvecs reads the weight once per row; its small-matrix kernel (M*N*K <= 100^3, no packing) multiplies
a few rows by a narrow block reading the block once, so a stack of such blocks makes 9 rows cost ~1.6x one row.
Numbers in docs/performance.md; the limits live in pyengine/tuning.py.
"""
from __future__ import annotations

import sys
from functools import partial

import numpy as np
from numpy.lib.stride_tricks import as_strided

from pyengine import tuning
from pyengine.gguf import quants, quants_stream
from pyengine.layers import wasm_lean
from pyengine.layers.activation import gated_activation


class QuantMatrix:
    """A (rows, cols) weight kept as quantized rows as the GGUF stores them, possibly several tensors stacked
    (a fused matrix): ``parts`` = [(raw uint8 (rows_i, row_bytes_i), ggml_type)], views of the file (never
    copied). ``orders``: per part None, or the file rows in model order (llama's Q/K rows reordered for
    half-split RoPE): those rows are gathered a block at a time when used, so the file is still never copied."""

    def __init__(self, parts: list[tuple[np.ndarray, int]], cols: int, orders: list | None = None):
        self.parts = parts
        self.orders = orders or [None] * len(parts)
        self.cols = cols
        self.shape = (sum(p.shape[0] for p, _ in parts), cols)
        self.nbytes = sum(p.nbytes for p, _ in parts)

    @classmethod
    def stack(cls, *mats: "QuantMatrix") -> "QuantMatrix":
        """Rows of several matrices one after the other (Q|K|V, gate|up)."""
        return cls([p for m in mats for p in m.parts], mats[0].cols, [o for m in mats for o in m.orders])

    def part_rows(self, i: int, a: int, b: int) -> np.ndarray:
        """Rows a..b (model order) of part i: a view of the file, or a gather of those rows when reordered."""
        raw, order = self.parts[i][0], self.orders[i]
        return raw[a:b] if order is None else np.take(raw, order[a:b], axis=0)

    def dequantize(self, out: np.ndarray | None = None, r0: int = 0, r1: int | None = None) -> np.ndarray:
        """Rows r0..r1 as float32 (into a preallocated C-contiguous ``out``: no model-sized temporaries)."""
        r1 = self.shape[0] if r1 is None else r1
        out = np.empty((r1 - r0, self.cols), np.float32) if out is None else out
        base = 0
        for i, (raw, t) in enumerate(self.parts):
            a, b = max(r0, base), min(r1, base + raw.shape[0])
            if a < b:
                quants.dequantize(self.part_rows(i, a - base, b - base), t, (b - a, self.cols),
                                  out=out[a - r0:b - r0])
            base += raw.shape[0]
        return out

    def rows(self, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Dequantize selected rows (embedding lookup); single-part matrices only."""
        (raw, t), = self.parts
        idx = idx if self.orders[0] is None else self.orders[0][idx]
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


def col_block(n_in: int) -> int:
    """Columns per block of a resident matrix with ``n_in`` inputs: the widest of 64, 32, 16 for which a
    product of SMALL_GEMM_ROWS rows stays within OpenBLAS's small-matrix kernel (M * N * K <= SMALL_GEMM_MNK)."""
    for c in (64, 32):
        if tuning.SMALL_GEMM_ROWS * c * n_in <= tuning.SMALL_GEMM_MNK:
            return c
    return 16


def stage_rows(n_out: int, n_in: int) -> int:
    """Rows per staged block of a resident matrix in the rows layout (tuning.RESIDENT_STAGE_BYTES; 0: unstaged)."""
    if tuning.RESIDENT_LAYOUT != "rows" or not tuning.RESIDENT_STAGE_BYTES:
        return 0
    return min(n_out, max(1, tuning.RESIDENT_STAGE_BYTES // (4 * n_in)))


# A one-row product runs as two rows (the second a zero pad) so that it takes the very kernel, and rounding,
# of a few-row one: a decode row and a verification row of the same sequence are then bit-identical, and
# greedy speculative output is the plain output by construction. Not in Pyodide: its NumPy has no BLAS, and
# its plain loops would pay for the pad row in full.
PAD_SINGLE_ROW = sys.platform != "emscripten"


def _column_blocks_view(out: np.ndarray, nb: int, c: int) -> np.ndarray:
    """``out`` (rows, >= nb*c columns, unit column stride) as (nb, rows, c): block b is out[:, b*c:(b+1)*c]."""
    s0, s1 = out.strides
    return as_strided(out, (nb, out.shape[0], c), (c * s1, s0, s1))


class DenseLinear(Linear):
    """A float32 (in, out) matrix (resident mode), held as contiguous column blocks ``blocks`` (nb, in, c) plus
    the ``tail`` columns (in, out - nb*c) when c does not divide out.

    Why blocks: ``x @ W`` for a few rows through one sgemm packs the whole weight on every call (2 rows ~2.4x
    one row) and a row loop re-reads it once per row, while one stacked ``np.matmul(x, blocks)`` makes nb small
    products, each within OpenBLAS's small-matrix kernel, which reads each block once for every row: 9 rows
    cost ~1.6x one row instead of ~3.5x (docs/performance.md, "Column blocks")."""

    def __init__(self, w: np.ndarray, act: str | None = None):
        """``w``: the (in, out) matrix; a transposed view of the GGUF's (out, in) rows is copied only once.
        With ``tuning.RESIDENT_LAYOUT == "rows"`` (Pyodide) it is held as those (out, in) rows instead
        (``self.out_in``; ``blocks`` and ``tail`` are None) and multiplied by ``np.einsum`` one input row at a time,
        ``stage_rows`` rows at a time copied first into ``scratch`` (tuning.RESIDENT_STAGE_BYTES; the arena's
        weights scratch, bound by the runner like the lean matrices'; 0 rows: in place)."""
        rows = np.asarray(w, dtype=np.float32).T                     # (out, in): block b is rows b*c..b*c+c-1
        n_out, n_in = rows.shape
        self.stage_rows, self.scratch = stage_rows(n_out, n_in), None     # 0 unless the rows layout stages
        if tuning.RESIDENT_LAYOUT == "rows":
            self.out_in = np.ascontiguousarray(rows)
            self.blocks = self.tail = None
            self.shape, self.act, self.nbytes = (n_in, n_out), act, self.out_in.nbytes
            return
        self.out_in = None
        c = col_block(n_in)
        nb = n_out // c
        self.blocks = np.ascontiguousarray(rows[:nb * c].reshape(nb, c, n_in).transpose(0, 2, 1))
        self.tail = np.ascontiguousarray(rows[nb * c:].T) if nb * c < n_out else None
        self.shape, self.act = (n_in, n_out), act
        self.nbytes = self.blocks.nbytes + (self.tail.nbytes if self.tail is not None else 0)

    @classmethod
    def from_quant(cls, m: QuantMatrix, act: str | None = None) -> "DenseLinear":
        return cls(m.dequantize().T, act)             # the (out, in) copy is freed right away

    def _ops(self, x: np.ndarray, out: np.ndarray) -> list:
        if out.strides[1] != out.itemsize:
            raise ValueError("DenseLinear.matmul needs an output with contiguous columns")
        if self.out_in is not None:          # rows layout: a contiguous dot per output, NumPy's einsum loop
            if not self.stage_rows:
                return [partial(np.einsum, "oi,i->o", self.out_in, x[r], out=out[r]) for r in range(x.shape[0])]
            return self._staged_ops(x, out)
        nb, _, c = self.blocks.shape
        # prefill-sized row counts: sgemm over regrouped columns (through the small kernel in row chunks,
        # Gemma's 1.5k-token golden prompt was 1.5x further from HF's logits: max 1.28e-3); wide batches (32
        # decodes, a prompt chunk beside them): the small kernel in chunks of <= SMALL_GEMM_ROWS rows, which
        # re-reads each block per chunk but skips the packing (32 rows 1.4x faster than one packed sgemm per
        # block); a few rows: one stacked product
        rows = x.shape[0]
        if rows >= tuning.REGROUP_MIN_ROWS:
            ops = [partial(self._regrouped, x, out)]
            chunks = [(0, rows)]
        else:
            size = max(rows, 1)
            # from SMALL_GEMM_CHUNK_MIN rows, or as soon as one product would leave the small kernel (21-23 rows
            # of a 1536-input block: packed, slower, and rounded differently from the same rows in chunks)
            if rows >= tuning.SMALL_GEMM_CHUNK_MIN or (
                    rows > tuning.SMALL_GEMM_ROWS and rows * x.shape[1] * c > tuning.SMALL_GEMM_MNK):
                n = -(-rows // tuning.SMALL_GEMM_ROWS)
                size = -(-rows // n)
            chunks = [(r, min(rows, r + size)) for r in range(0, rows, size)]
            ops = [partial(np.matmul, x[a:b], self.blocks, _column_blocks_view(out[a:b], nb, c)) for a, b in chunks]
        if self.tail is not None:            # in the same chunks: a row's bits do not depend on the batch
            ops += [partial(np.matmul, x[a:b], self.tail, out[a:b, nb * c:]) for a, b in chunks]
        return ops

    @property
    def scratch_floats(self) -> int:
        """Floats of the weights scratch the staged rows layout multiplies from (0: none)."""
        return self.stage_rows * self.shape[0]

    def _staged_ops(self, x: np.ndarray, out: np.ndarray) -> list:
        """Rows layout, staged: per block of ``stage_rows`` rows, one copy into the scratch (in cache) then the
        einsum of every input row from there. Each output is the same contiguous dot as in place: same bits."""
        n_out, n_in = self.out_in.shape
        buf = np.empty(self.scratch_floats, np.float32) if self.scratch is None else self.scratch
        ops = []
        for a in range(0, n_out, self.stage_rows):
            b = min(n_out, a + self.stage_rows)
            s = buf[:(b - a) * n_in].reshape(b - a, n_in)
            ops.append(partial(np.copyto, s, self.out_in[a:b]))
            ops += [partial(np.einsum, "oi,i->o", s, x[r], out=out[r, a:b]) for r in range(x.shape[0])]
        return ops

    def _regrouped(self, x: np.ndarray, out: np.ndarray) -> None:
        """out = x @ W for many rows: REGROUP_COLS columns at a time copied back to one (in, cols) array (in
        cache) and multiplied by one sgemm, which packs x once per group instead of once per narrow block."""
        nb, n_in, c = self.blocks.shape
        g = max(1, tuning.REGROUP_COLS // c)
        scratch = np.empty((n_in, min(g, nb) * c), np.float32)
        for b0 in range(0, nb, g):
            b1 = min(nb, b0 + g)
            s = scratch[:, :(b1 - b0) * c]
            np.copyto(s.reshape(n_in, b1 - b0, c), self.blocks[b0:b1].transpose(1, 0, 2))
            np.matmul(x, s, out=out[:, b0 * c:b1 * c])

    def matmul_ops(self, x, out):
        if x.shape[0] == 1 and PAD_SINGLE_ROW:
            x2 = np.zeros((2, self.shape[0]), np.float32)
            o2 = np.empty((2, self.shape[1]), np.float32)
            return ([partial(np.copyto, x2[0], x[0])] + self._ops(x2, o2) + [partial(np.copyto, out[0], o2[0])])
        return self._ops(x, out)

    def matmul(self, x, out=None):
        out = np.empty(x.shape[:-1] + (self.shape[1],), np.float32) if out is None else out
        if x.ndim == 1:                                        # one row as a vector
            self.matmul(x[None], out[None])
            return out
        for op in self.matmul_ops(x, out):
            op()
        return out

    def scale_inputs(self, g: np.ndarray) -> None:
        """W <- diag(g) W (an RMSNorm weight folded in at load, models/base.py fold_norms)."""
        if self.out_in is not None:
            self.out_in *= g[None, :]
            return
        self.blocks *= g[None, :, None]
        if self.tail is not None:
            self.tail *= g[:, None]

    def scale_columns(self, stop: int, f: float) -> None:
        """W[:, :stop] *= f (SiLU's halving folded into the gate columns)."""
        if self.out_in is not None:
            self.out_in[:stop] *= np.float32(f)
            return
        nb, _, c = self.blocks.shape
        full = min(stop // c, nb)
        self.blocks[:full] *= np.float32(f)
        rest = stop - full * c
        if rest and full < nb:
            self.blocks[full, :, :rest] *= np.float32(f)
        if self.tail is not None and stop > nb * c:
            self.tail[:, :stop - nb * c] *= np.float32(f)

    def dense(self):
        if self.out_in is not None:
            return self.out_in.T
        nb, n_in, c = self.blocks.shape
        w = self.blocks.transpose(1, 0, 2).reshape(n_in, nb * c)
        return w if self.tail is None else np.concatenate([w, self.tail], axis=1)


class BlockedLinear(DenseLinear):
    """The resident LM head (d, V): a `DenseLinear` built from the GGUF's (V, d) rows, that also gives columns
    (tied embeddings read their rows from the head)."""

    def __init__(self, out_in_rows: np.ndarray):
        """``out_in_rows``: the (out, in) matrix as GGUF stores it (one row per output column)."""
        super().__init__(out_in_rows.T)

    def columns(self, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out[t] = W[:, idx[t]] for (T,) indices: out is (T, in)."""
        idx = np.asarray(idx, dtype=np.int64)
        if self.out_in is not None:
            out[:] = self.out_in[idx]
            return out
        nb, _, c = self.blocks.shape
        inside = idx < nb * c
        out[inside] = self.blocks[idx[inside] // c, :, idx[inside] % c]     # (k, in) gather: k*in floats, small
        if not inside.all():
            out[~inside] = self.tail[:, idx[~inside] - nb * c].T
        return out


class LeanLinear(Linear):
    """S21 streaming lean matrix: the GGUF's quantized (out, in) rows (views of the memory-mapped file, never
    copied), multiplied a block of ``block_rows`` rows at a time through ``scratch`` (a flat float32 buffer of
    the arena shared by every lean matrix: layers run one after another). The block is L2-sized
    (tuning.LEAN_BLOCK_BYTES of float32 rows), never matrix-sized, so the scratch stays small at any model size.

    The product folds the block formats' scales into the activations (quants.unpack_rows): the raw quants are
    cast straight into the scratch (no scale pass over the weights), per-group dot products run as one batched
    product, the (rows, groups) partial sums are scaled there, and the mins / offsets become one small product
    with the per-group sums of x: y[r] = sum_g scale[r,g] * (q[r,g] . x[g]) + bias[r,g] * sum(x[g]). Up to
    LEAN_FOLD_MAX_ROWS input rows; more (prefill) scale the block in place and take one sgemm. One row (a decode)
    of a LEAN_STREAM_TYPES part goes through its decode stream instead (``_stream``, gguf/quants_stream.py)."""

    def __init__(self, m: QuantMatrix, act: str | None = None, chunk_rows: int | None = None):
        self.q = m
        self.shape, self.nbytes, self.act = (m.shape[1], m.shape[0]), m.nbytes, act
        rows = chunk_rows or max(1, tuning.LEAN_BLOCK_BYTES // (4 * m.cols))
        self.block_rows = min(m.shape[0], rows)
        self.scratch: np.ndarray | None = None           # bound by the runner (arena region "lean.scratch")
        # Pyodide (tuning.LEAN_LAYOUT == "bytes"): Q4_0 / Q4_1 parts unpacked once into bytes (layers/wasm_lean.py)
        self.held = ([wasm_lean.HeldPart(partial(m.part_rows, i), quants.GGMLType(t), raw.shape[0], m.cols)
                      for i, (raw, t) in enumerate(m.parts)]
                     if tuning.LEAN_LAYOUT == "bytes" and m.cols % 32 == 0
                     and all(wasm_lean.holds(t) for _, t in m.parts) else None)

    @property
    def scratch_floats(self) -> int:
        return self.block_rows * self.q.cols

    def matmul(self, x, out=None):
        out = np.empty((x.shape[0], self.shape[1]), np.float32) if out is None else out
        T, k, br = x.shape[0], self.q.cols, self.block_rows
        buf = (np.empty(self.scratch_floats, np.float32) if self.scratch is None else self.scratch)
        if self.held is not None:
            base = 0
            for p in self.held:
                wasm_lean.matmul_part(p, x, buf, out[:, base:base + p.rows], tuning.LEAN_FOLD_MAX_ROWS)
                base += p.rows
            return out
        fold = T <= tuning.LEAN_FOLD_MAX_ROWS
        per_group: dict[int, tuple] = {}                 # group size -> (x as (G, group, T), per-group sums (T, G))
        span = br * tuning.LEAN_SCALE_BLOCKS             # rows whose scales are decoded at once (small arrays)
        base = 0
        for i, (raw, t) in enumerate(self.q.parts):
            stream = (quants_stream.layout(t, k) if T <= tuning.LEAN_STREAM_MAX_ROWS
                      and quants.type_name(t) in tuning.LEAN_STREAM_TYPES else None)
            if stream is not None:
                self._stream(i, t, stream, x, buf, out[:, base:base + raw.shape[0]])
                base += raw.shape[0]
                continue
            folded = t in quants.FOLDED_TYPES
            for c0 in range(0, raw.shape[0], span):
                c1 = min(raw.shape[0], c0 + span)
                if folded:
                    scales, biases, g = quants.unpack_scales(self.q.part_rows(i, c0, c1), t, k)
                    if g not in per_group:
                        xg = x.reshape(T, k // g, g)
                        per_group[g] = (np.ascontiguousarray(xg.transpose(1, 2, 0)), xg.sum(axis=2))
                for a in range(c0, c1, br):
                    b = min(c1, a + br)
                    n = b - a
                    w = buf[:n * k].reshape(n, k)
                    quants.unpack_quants(self.q.part_rows(i, a, b), t, k, w)
                    o = out[:, base + a:base + b]
                    if not folded:                                  # other formats: dequantized rows
                        self._product(x, w, o)
                    elif fold:
                        part = np.matmul(w.reshape(n, k // g, g).transpose(1, 0, 2), per_group[g][0])  # (G, n, T)
                        np.copyto(o, np.matmul(scales[a - c0:b - c0, None, :], part.transpose(1, 0, 2))[:, 0].T)
                    else:                                           # prefill: the block dequantized, one sgemm
                        wg = w.reshape(n, k // g, g)
                        wg *= scales[a - c0:b - c0, :, None]
                        if biases is not None:   # mins inside the weights, as dequantization has them: adding
                            wg += biases[a - c0:b - c0, :, None]   # them after the product cancels over long rows
                        self._product(x, w, o)
                if folded and fold and biases is not None:
                    out[:, base + c0:base + c1] += per_group[g][1] @ biases.T
            base += raw.shape[0]
        return out

    def _stream(self, i: int, t: int, lay: "quants_stream.StreamLayout", x: np.ndarray, buf: np.ndarray,
                out: np.ndarray) -> None:
        """out (T, rows of part i) = x @ part i through its decode stream (gguf/quants_stream.py): per block of
        rows, the raw rows unpacked with whole-row operations, cast once into the float32 scratch, multiplied
        segment by segment (one batched product) against x in stream order, the (segments, rows) sums scaled
        and added up; the mins / offsets as one small product with the per-group sums of x. The scratch holds as
        many rows of stream (plus their unpacking bytes) as it holds float32 rows of weights."""
        k, T = self.q.cols, x.shape[0]
        n_rows = self.q.parts[i][0].shape[0]
        rows = max(1, buf.nbytes // (4 * lay.width + lay.tmp_bytes))
        floats = buf[:rows * lay.width]
        tmp = buf[rows * lay.width:].view(np.uint8)
        if floats.size < rows * lay.width or tmp.size < rows * lay.tmp_bytes:   # a scratch smaller than one row
            floats, tmp = np.empty(rows * lay.width, np.float32), np.empty(rows * lay.tmp_bytes, np.uint8)
        S, L = lay.x_index.shape
        xg = np.ascontiguousarray(x[:, lay.x_index].transpose(1, 2, 0))          # (S, L, T): x in stream order
        span = rows * tuning.LEAN_SCALE_BLOCKS
        views: dict[int, tuple] = {}
        for c0 in range(0, n_rows, span):
            c1 = min(n_rows, c0 + span)
            with np.errstate(all="ignore"):              # inf / NaN scales in a file stay inf / NaN, silently
                seg_scale, bias_t, g = lay.scales(self.q.part_rows(i, c0, c1))      # (S, rows), (G, rows)
            for a in range(c0, c1, rows):
                b = min(c1, a + rows)
                n = b - a
                if n not in views:                      # views of the scratch per block size, made once a call
                    f = floats[:n * lay.width].reshape(n, lay.width)
                    v = lay.segments(f)
                    views[n] = (tmp[:n * lay.tmp_bytes].reshape(n, lay.tmp_bytes), f, v,
                                xg.reshape(v.shape[:-2] + (L, T)), np.empty(v.shape[:-1] + (T,), np.float32))
                tb, f, v, xb, d = views[n]
                q = lay.unpack(self.q.part_rows(i, a, b), tb)
                if tuning.WASM and q.dtype == np.uint8:  # values < 128: wasm converts int8 in one instruction
                    q = q.view(np.int8)
                np.copyto(f, q, casting="unsafe")
                np.matmul(v, xb, out=d)
                s = seg_scale[:, a - c0:b - c0]
                ds = d.reshape(S, n, T)
                for r in range(T):
                    dr = ds[:, :, r]
                    dr *= s
                    np.add.reduce(dr, axis=0, out=out[r, a:b])
            if bias_t is not None:
                out[:, c0:c1] += x.reshape(T, k // g, g).sum(axis=2) @ bias_t

    @staticmethod
    def _product(x: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
        if 1 < x.shape[0] <= tuning.LEAN_ROW_LOOP_MAX:       # the fresh rows are still in cache
            for r in range(x.shape[0]):
                np.matmul(x[r], rows.T, out=out[r])
        else:
            np.matmul(x, rows.T, out=out)

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
        array (untied, resident); else None (then the lookup is one call: a tied head's columns are spread over
        its column blocks and tail)."""
        if not isinstance(self.source, np.ndarray):
            return None
        return [partial(np.take, self.source, token_ids, 1, out.T, "clip")]


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
    return LeanLinear(m)
