"""Issue 29: lean products for NumPy in wasm (Pyodide) -- the 4-bit quants held as bytes, unpacked once.

NumPy in wasm has no BLAS and no SIMD: a cast or a nibble operation costs about what the product itself does
(~0.3-0.6 ns a weight each, docs/performance.md "Pyodide lean: quants held as bytes"). The decode streams
(gguf/quants_stream.py) pay per weight, every step: the nibble unpacking, the cast to float32 of the block headers
too, short (16-value) segments in the product, and the scales. Here a Q4_0 / Q4_1 part is unpacked *once*, at
load, into one int8 a weight in weight order (exact: the quants less 8, -8..7; int8, because wasm converts signed
integers to float in one instruction and unsigned ones in several: 256x576 values, uint8 -> float32 0.55 CPU ns a
value, int8 0.30), with its block scale and offset as float32 (rows, blocks) arrays; a product then costs one
contiguous cast of a block of rows into the shared float32 scratch and one einsum over whole 32-weight blocks
against x, the scales folded per block:

    y[t, r] = sum_b d[r, b] * (q[r, b, :] . x[t, b, :]) + bias[r, b] * sum(x[t, b, :])

(bias = the Q4_1 min + 8 d; none for Q4_0, whose weights are d (q - 8).) A Q8_0 part needs no copy: its raw
rows are cast whole (block headers included, skipped by the product's view). Memory: 1 byte + 8/32 bytes a
weight of a Q4_1 part (4/32 for Q4_0) on top of the file's bytes (SmolLM2-135M: +126.6 MiB beside the 93.8 MiB
file; float32 resident holds 4 bytes a weight).

Chosen by ``tuning.LEAN_LAYOUT`` ("bytes" in Pyodide, "stream" in CPython, whose SIMD NumPy unpacks at memory
speed and keeps the file's bytes only).
"""
from __future__ import annotations

import numpy as np

from pyengine.gguf.quants import GGML_BLOCK, GGMLType

HELD_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1)      # unpacked once into bytes
VIEW_TYPES = (GGMLType.Q8_0,)                     # cast from the file's rows as they are
_HOLD_ROWS = 1024                                 # rows unpacked at a time at load (bounded temporaries)


class HeldPart:
    """One part of a lean matrix as its product needs it: ``q`` (rows, blocks, 32) int8 quants less 8 (-8..7) in
    weight order and ``scale`` / ``bias`` (rows, blocks) float32 (Q4_1; Q4_0 has no bias: w = d (q - 8)), or
    ``raw_rows(a, b)`` giving the file's Q8_0 rows (scales decoded per block of rows on use)."""

    def __init__(self, raw_rows, t: GGMLType, n_rows: int, cols: int):
        self.t, self.rows, self.cols = t, n_rows, cols
        nb = cols // 32
        ts = GGML_BLOCK[t].type_size
        if t in VIEW_TYPES:
            self.raw_rows, self.q = raw_rows, None
            self.scale = self.bias = None
            self.nbytes = 0
            return
        self.raw_rows = None
        q = np.empty((n_rows, nb, 32), np.uint8)
        self.scale = np.empty((n_rows, nb), np.float32)
        self.bias = np.empty((n_rows, nb), np.float32) if t == GGMLType.Q4_1 else None
        head = ts - 16
        for a in range(0, n_rows, _HOLD_ROWS):
            b = min(n_rows, a + _HOLD_ROWS)
            blk = np.ascontiguousarray(raw_rows(a, b)).reshape(b - a, nb, ts)
            qs = blk[..., head:]
            np.bitwise_and(qs, 15, out=q[a:b, :, :16])
            np.right_shift(qs, 4, out=q[a:b, :, 16:])
            q[a:b] -= np.uint8(8)                             # wraps: as int8, q - 8 in -8..7
            halves = blk[..., :head].view(np.uint16)          # (n, nb, head / 2): d [, m]
            np.copyto(self.scale[a:b], halves[..., 0].view(np.float16), casting="unsafe")
            if self.bias is not None:                         # d q + m = d (q - 8) + (m + 8 d)
                m = halves[..., 1].view(np.float16).astype(np.float64)
                np.copyto(self.bias[a:b], m + 8 * self.scale[a:b].astype(np.float64), casting="same_kind")
        self.q = q.view(np.int8)
        self.nbytes = self.q.nbytes + self.scale.nbytes + (0 if self.bias is None else self.bias.nbytes)


def holds(ggml_type: int) -> bool:
    """Whether a part of this format runs through the byte-held product."""
    return int(ggml_type) in (int(t) for t in HELD_TYPES + VIEW_TYPES)


def matmul_part(p: HeldPart, x: np.ndarray, buf: np.ndarray, out: np.ndarray, fold_max_rows: int) -> None:
    """out (T, rows of the part) = x (T, cols) @ the part, a block of rows at a time through the float32 scratch
    ``buf``. Up to ``fold_max_rows`` input rows fold the block scales per 32-weight block; more (a prefill
    chunk) scale the block in place and take one einsum per input row (NumPy in wasm has no BLAS: its einsum
    over contiguous rows is its fastest product, docs/performance.md "Pyodide resident layout")."""
    T, k = x.shape
    nb = k // 32
    width = k if p.q is not None else nb * 34       # floats a row takes in the scratch
    rows = max(1, buf.size // width)
    if buf.size < width:                                    # a scratch smaller than one row
        buf = np.empty(width, np.float32)
    xb = x.reshape(T, nb, 32)
    sx = xb.sum(axis=2)                                     # (T, nb)
    fold = T <= fold_max_rows
    part = np.empty((min(rows, p.rows), nb), np.float32) if fold else None
    for a in range(0, p.rows, rows):
        b = min(p.rows, a + rows)
        n = b - a
        f = buf[:n * width].reshape(n, width)
        if p.q is not None:
            np.copyto(f, p.q[a:b].reshape(n, k), casting="unsafe")
            w = f.reshape(n, nb, 32)
            scale, bias = p.scale[a:b], (None if p.bias is None else p.bias[a:b])
        else:                                               # Q8_0: the whole rows, headers skipped by the view
            raw = np.ascontiguousarray(p.raw_rows(a, b))
            np.copyto(f, raw.view(np.int8), casting="unsafe")
            w = f.reshape(n, nb, 34)[..., 2:]
            scale = raw.reshape(n, nb, 34)[..., :2].view(np.float16)[..., 0] \
                .astype(np.float32)
            bias = None
        o = out[:, a:b]
        if fold:
            pr = part[:n]
            for t in range(T):
                np.einsum("rbj,bj->rb", w, xb[t], out=pr)
                np.einsum("rb,rb->r", pr, scale, out=o[t])
                if bias is not None:
                    o[t] += bias @ sx[t]
        else:
            w *= scale[:, :, None]
            if bias is not None:
                w += bias[:, :, None]
            for t in range(T):
                np.einsum("rbj,bj->r", w, xb[t], out=o[t])
