"""S21: decode streams -- a lean product's quantized rows unpacked with whole-row operations into a run of small
integers per row in the order the bytes give them, cast once to float32, and multiplied segment by segment
against the activations taken in that same order.

The folded kernels of ``quants.py`` write each row's quants in weight order, which for the nibble formats means
NumPy operations on 16- or 32-byte pieces of every block (one inner loop per piece: on this machine an inner loop
costs ~18 ns, the arithmetic of a 32-byte piece ~2 ns), with the cast to float32 buffered inside each operation.
A stream instead unpacks the *whole raw row*, block headers included, with two operations (``row & 15``,
``row >> 4``: low nibbles of every byte, then high nibbles), casts it to float32 in one pass, and leaves each weight
where its byte put it. The product does not need weight order: the segments of a stream (the weights of one group
of the format's scales, contiguous in the stream) are multiplied as one batched product against x gathered into
the same order (``x_index``), skipping the header bytes:

    d[s, r, t] = sum_l q[r, segment s, l] * x[t, x_index[s, l]]                 (one product per segment)
    y[t, r]    = sum_s scale[r, seg_group[s]] * d[s, r, t] + sum_g bias[r, g] * sum(x[t] in group g)

Q8_0's stream is the raw row viewed as int8 (no unpacking at all). Q6_K's two bit fields sit at different offsets
of a block, so its quants are assembled in weight order, from whole-block operations where the layout allows
(the 2-bit fields of qh in 8-byte lanes, already at bits 4-5).

``layout(t, cols)`` describes a format's stream for rows of ``cols`` weights (None: the format has no stream).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, NamedTuple

import numpy as np

from pyengine import tuning
from pyengine.gguf.quants import GGML_BLOCK, GGMLType


class StreamLayout(NamedTuple):
    width: int                 # stream values per row (headers included)
    tmp_bytes: int             # unpacking bytes per row (0: the stream is a view of the raw row)
    unpack: Callable           # unpack(raw (n, row_bytes) uint8, tmp (n, tmp_bytes) uint8) -> (n, width) integers
    segments: Callable         # segments(f (n, width) float32) -> (..., n, seg) view, one leading index per segment
    x_index: np.ndarray        # (S, seg) intp: the weight (x element) of every value of every segment
    seg_group: np.ndarray      # (S,) intp: the scales group of each segment (quants.unpack_scales' columns)
    scales: Callable           # scales(raw (n, row_bytes)) -> (scale (S, n) per segment, bias (G, n) or None, group)


def _nibbles(raw: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """Low nibbles of every byte of each row, then its high nibbles: (n, 2 * row_bytes) uint8. In bytes (two
    operations), or in lanes of up to tuning.LEAN_LANE_BYTES bytes (three: the high nibbles need a mask)."""
    n, rb = raw.shape
    o = tmp.reshape(n, 2, rb)
    lane = _lane(rb, tuning.LEAN_LANE_BYTES)
    if lane is np.uint8:
        np.bitwise_and(raw, 15, out=o[:, 0])
        np.right_shift(raw, 4, out=o[:, 1])
        return tmp
    m = lane(int.from_bytes(b"\x0f" * np.dtype(lane).itemsize, "little"))
    v = np.ascontiguousarray(raw).view(lane)
    lo, hi = o[:, 0].view(lane), o[:, 1].view(lane)
    np.bitwise_and(v, m, out=lo)
    np.right_shift(v, lane(4), out=hi)
    hi &= m
    return tmp


def _nibble_regions(raw: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """CPython: the low nibbles of every byte of a block of rows, then their high nibbles, each one 1-D operation
    (NumPy's SIMD loops; into the (row, nibble) halves of 2-D rows they took ~1.6x as long). The result is the
    (n, width) stream of the n rows together, (nibble, row, byte), *not* row by row (``segments`` reads it so)."""
    v = raw.reshape(-1)
    o = tmp.reshape(-1)[:2 * v.size]
    np.bitwise_and(v, 15, out=o[:v.size])
    np.right_shift(v, 4, out=o[v.size:])
    return o.reshape(raw.shape[0], -1)


def _lane(nbytes: int, most: int) -> type:
    """The widest unsigned lane of at most ``most`` bytes dividing a row of ``nbytes`` bytes."""
    return next(t for t in (np.uint64, np.uint32, np.uint16, np.uint8)
                if np.dtype(t).itemsize <= most and nbytes % np.dtype(t).itemsize == 0)


def _int8(raw: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    return raw.view(np.int8)


_Q6_SHIFTS = np.array([4, 2, 0], np.uint64).reshape(1, 1, 3, 1)
_Q6_HIGH = np.uint64(0x3030303030303030)


def _q6_k(raw: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """Q6_K quants in weight order, (n, cols) uint8 in 0..63: per 128 weights the low nibbles of 64 ql bytes, then
    their high nibbles, each OR-ed with its 2-bit field of qh moved to bits 4-5 in 8-byte lanes."""
    n, rb = raw.shape
    nb = rb // 210
    flat = tmp.reshape(-1)                              # three separate regions: quants, qh, qh's lanes
    q = flat[:n * nb * 256].reshape(n * nb, 2, 4, 32)
    h = flat[n * nb * 256:n * nb * 320].reshape(n * nb, 64)
    c = flat[n * nb * 320:n * nb * 576].view(np.uint64).reshape(n * nb, 2, 4, 4)
    b = raw.reshape(n * nb, 210)
    ql = b[:, :128].reshape(n * nb, 2, 2, 32)
    np.bitwise_and(ql, 15, out=q[:, :, 0:2])
    np.right_shift(ql, 4, out=q[:, :, 2:4])
    np.copyto(h, b[:, 128:192])
    hv = h.view(np.uint64).reshape(n * nb, 2, 1, 4)
    np.left_shift(hv, _Q6_SHIFTS, out=c[:, :, 0:3])
    np.right_shift(hv, np.uint64(2), out=c[:, :, 3:4])
    c &= _Q6_HIGH
    q |= c.view(np.uint8).reshape(n * nb, 2, 4, 32)
    return q.reshape(n, nb * 256)


_Q6_CRUMB = np.uint64(0x3030303030303030)


def _q6_k_pairs(raw: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """Q6_K quants (0..63), CPython: 1-D operations on contiguous regions (NumPy's SIMD loops; the same
    operations on 2-D views of a block of rows run ~4x slower) in the order (s, k, row, block, half h, l) --
    nibble s of ql byte 64h + 32k + l, OR-ed with its 2-bit field of qh byte 32h + l, field 2s + k, moved to
    bits 4-5 (weight 256 block + 128h + 64s + 32k + l). Only two copies work on pieces of a block: ql into
    (k, row, block, h, l) order, qh twice (k = 0, 1); then the second copy of qh is shifted right by 2 and both
    fields are found by whole-region operations in 8-byte lanes: ((p << 4) & 0x30 for s = 0, p & 0x30 for 1).
    The result is the (n, cols) stream of the n rows together, *not* row by row (``segments`` reads it so)."""
    n, rb = raw.shape
    nb = rb // 210
    m = n * nb * 128
    flat = tmp.reshape(-1)
    off = -flat.ctypes.data % 8                         # 8-byte lanes need aligned regions (tmp_bytes has room)
    q, ql, p, t = flat[off:off + 2 * m], flat[off + 2 * m:off + 3 * m], flat[off + 3 * m:off + 4 * m], \
        flat[off + 4 * m:off + 5 * m]
    b = raw.reshape(n, nb, 210)
    np.copyto(ql.reshape(2, n, nb, 2, 32), b[:, :, :128].reshape(n, nb, 2, 2, 32).transpose(3, 0, 1, 2, 4))
    np.copyto(p.reshape(2, n, nb, 64), b[None, :, :, 128:192])
    np.bitwise_and(ql, 15, out=q[:m])
    np.right_shift(ql, 4, out=q[m:])
    q64, p64, t64 = q.view(np.uint64), p.view(np.uint64), t.view(np.uint64)
    h = p64.size // 2
    p64[h:] >>= np.uint64(2)
    np.left_shift(p64, np.uint64(4), out=t64)
    t64 &= _Q6_CRUMB
    q64[:h * 2] |= t64
    np.bitwise_and(p64, _Q6_CRUMB, out=t64)
    q64[h * 2:] |= t64
    return q.reshape(n, nb * 256)


# Block scales transposed, (values per block, blocks): every NumPy operation below runs one long (strided) inner
# loop per value of a block, not one short loop per block -- decoding the scales of 45k Q4_K blocks took 2.8 ms as
# (blocks, 8) arrays, more than the unpacking.
def _halves(raw: np.ndarray, bs: int) -> np.ndarray:
    """The 16-bit halves of each block: (blocks, bs // 2) uint16 (a view of contiguous rows)."""
    return np.ascontiguousarray(raw).view(np.uint16).reshape(-1, bs // 2)


def _f16(col: np.ndarray) -> np.ndarray:
    return col.view(np.float16).astype(np.float32)


def _scales_q4_k(raw: np.ndarray, nb: int):
    n = raw.shape[0]
    h = _halves(raw, 144)
    w = np.ascontiguousarray(raw).view(np.uint32).reshape(-1, 36)
    lo_sc, lo_m, packed = w[:, 1], w[:, 2], w[:, 3]
    sc, mn = np.empty((2, n * nb), np.uint32), np.empty((2, n * nb), np.uint32)
    np.bitwise_and(lo_sc, 0x3F3F3F3F, out=sc[0])
    np.bitwise_and(packed, 0x0F0F0F0F, out=sc[1])
    sc[1] |= (lo_sc >> 2) & 0x30303030
    np.bitwise_and(lo_m, 0x3F3F3F3F, out=mn[0])
    np.right_shift(packed, 4, out=mn[1])
    mn[1] &= 0x0F0F0F0F
    mn[1] |= (lo_m >> 2) & 0x30303030
    d, dmin = _f16(h[:, 0]).reshape(n, nb).T, _f16(h[:, 1]).reshape(n, nb).T      # (nb, n)
    # sub-block 4 * half + byte = 2 j + s, cast straight into the order of the segments (s, b, j) and of the bias
    # groups (b, sub-block), then scaled there: as fast as a transposed copy afterwards, without its temporaries
    seg = np.empty((2, nb, 2, 2, n), np.float32)
    np.copyto(seg, sc.view(np.uint8).reshape(2, n, nb, 2, 2).transpose(4, 2, 0, 3, 1), casting="unsafe")
    seg *= d[None, :, None, None, :]
    bias = np.empty((nb, 2, 4, n), np.float32)
    np.copyto(bias, mn.view(np.uint8).reshape(2, n, nb, 4).transpose(2, 0, 3, 1), casting="unsafe")
    bias *= -dmin[:, None, None, :]
    return seg.reshape(-1, n), bias.reshape(-1, n), 32


def _scales_q4_01(raw: np.ndarray, nb: int, bs: int, with_min: bool):
    n = raw.shape[0]
    h = _halves(raw, bs)
    d = _f16(h[:, 0]).reshape(n, nb).T                          # (nb, n)
    seg = np.empty((2, nb, n), np.float32)
    seg[:] = d
    bias = _f16(h[:, 1]).reshape(n, nb).T if with_min else d * np.float32(-8)
    return seg.reshape(-1, n), np.ascontiguousarray(bias), 32


def _scales_q8_0(raw: np.ndarray, nb: int):
    n = raw.shape[0]
    return np.ascontiguousarray(_f16(_halves(raw, 34)[:, 0]).reshape(n, nb).T), None, 32


def _scales_q6_k(raw: np.ndarray, nb: int):
    n = raw.shape[0]
    d = _f16(_halves(raw, 210)[:, 104]).reshape(n, nb).T                             # (nb, n)
    b = np.ascontiguousarray(raw).reshape(n, nb, 210)
    seg = np.empty((nb, 16, n), np.float32)              # cast straight into the groups' order (b, sub-block)
    np.copyto(seg, b[:, :, 192:208].view(np.int8).transpose(1, 2, 0), casting="unsafe")
    seg *= d[:, None, :]
    seg = seg.reshape(-1, n)
    return seg, seg * np.float32(-32), 16


def _weights(shape, fn) -> np.ndarray:
    return np.fromfunction(fn, shape, dtype=np.intp).astype(np.intp)


def layout(ggml_type: int, cols: int) -> StreamLayout | None:
    """The decode stream of a format for rows of ``cols`` weights, or None (formats without one). Q6_K's is
    ``_q6_k_pairs`` (CPython) or ``_q6_k`` (Pyodide), the nibbles ``_nibble_regions`` or ``_nibbles``, as
    tuning.LEAN_STREAM_REGIONS says."""
    return _layout(ggml_type, cols, tuning.LEAN_STREAM_REGIONS)


@lru_cache(maxsize=64)
def _layout(ggml_type: int, cols: int, regions: bool) -> StreamLayout | None:
    t = GGMLType(ggml_type)
    bs, ts = GGML_BLOCK[t].block_size, GGML_BLOCK[t].type_size
    nb = cols // bs
    rb = nb * ts
    # regions (CPython): the nibble streams of a block of rows are (nibble, row, byte), else (row, nibble, byte)
    nibbles = _nibble_regions if regions else _nibbles
    by_nibble = (lambda f: f.reshape(2, -1, nb, ts)) if regions else \
        (lambda f: f.reshape(-1, 2, nb, ts).transpose(1, 0, 2, 3))       # (nibble, row, block, byte)
    if t == GGMLType.Q4_K:     # 16 header bytes, 4 x 32 bytes: byte l of piece j -> weights 64j + l, 64j + 32 + l
        idx = _weights((2, nb, 4, 32), lambda s, b, j, l: 256 * b + 64 * j + 32 * s + l)
        return StreamLayout(2 * rb, 2 * rb, nibbles,
                            lambda f: by_nibble(f)[..., 16:].reshape(2, -1, nb, 4, 32).transpose(0, 2, 3, 1, 4),
                            idx.reshape(-1, 32), idx[..., 0].reshape(-1) // 32,
                            lambda raw: _scales_q4_k(raw, nb))
    if t in (GGMLType.Q4_0, GGMLType.Q4_1):   # 2 / 4 header bytes, 16 bytes: byte l -> weights l, 16 + l
        head = ts - 16
        idx = _weights((2, nb, 16), lambda s, b, l: 32 * b + 16 * s + l)
        return StreamLayout(2 * rb, 2 * rb, nibbles, lambda f: by_nibble(f)[..., head:].transpose(0, 2, 1, 3),
                            idx.reshape(-1, 16), idx[..., 0].reshape(-1) // 32,
                            lambda raw: _scales_q4_01(raw, nb, ts, t == GGMLType.Q4_1))
    if t == GGMLType.Q8_0:     # 2 header bytes, 32 int8 quants
        idx = _weights((nb, 32), lambda b, l: 32 * b + l)
        return StreamLayout(rb, 0, _int8, lambda f: f.reshape(-1, nb, ts)[..., 2:].transpose(1, 0, 2),
                            idx, idx[:, 0] // 32, lambda raw: _scales_q8_0(raw, nb))
    if t == GGMLType.Q6_K and regions:   # (s, k, row, b, h, l): weight 256b + 128h + 64s + 32k + l
        idx = _weights((cols // 16, 16), lambda s, l: 16 * s + l)
        return StreamLayout(cols, nb * 640 + 8, _q6_k_pairs,
                            lambda f: f.reshape(2, 2, -1, nb, 2, 2, 16).transpose(3, 4, 0, 1, 5, 2, 6), idx,
                            idx[:, 0] // 16, lambda raw: _scales_q6_k(raw, nb))
    if t == GGMLType.Q6_K:     # weight order, scales per 16 weights
        idx = _weights((cols // 16, 16), lambda s, l: 16 * s + l)
        return StreamLayout(cols, nb * 576, _q6_k,
                            lambda f: f.reshape(-1, cols // 16, 16).transpose(1, 0, 2), idx, idx[:, 0] // 16,
                            lambda raw: _scales_q6_k(raw, nb))
    return None
