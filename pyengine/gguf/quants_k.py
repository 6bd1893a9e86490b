"""S08: dequantization kernels of the K-quants (Q2_K..Q6_K), 256 weights per super-block.

Each kernel takes ``b``, a structured array of n blocks (layouts and their rationale are documented in the
table of ``quants.py``), and writes float32 weights into ``out`` of shape (n, 256). Sub-block scales are
combined with the super-block scale first (``d * sc``), then multiplied by the quants, exactly in the order
of ggml's ``dequantize_row_q*_K`` so the float32 results match bit for bit.
"""
from __future__ import annotations

import numpy as np

QK_K = 256

_SHIFT_2BIT = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)  # 4 crumbs per byte
_SHIFT_1BIT = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)         # 8 bits per byte


def _f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """(n, 64) bytes of 2-bit values -> (n, 256) in weight order: per 32-byte group, shift 0,2,4,6."""
    n = qs.shape[0]
    q = qs.reshape(n, 2, 1, 32) >> _SHIFT_2BIT
    q &= 3
    return q.reshape(n, QK_K)


def _bits(mask: np.ndarray) -> np.ndarray:
    """(n, 32) bytes -> (n, 256): bit j of byte l is weight 32*j + l."""
    n = mask.shape[0]
    h = mask.reshape(n, 1, 32) >> _SHIFT_1BIT
    h &= 1
    return h.reshape(n, QK_K)


def _nibbles_64(qs: np.ndarray) -> np.ndarray:
    """(n, 128) bytes -> (n, 256): per 32-byte group, low nibbles then high nibbles (64 weights)."""
    n = qs.shape[0]
    g = qs.reshape(n, 4, 32)
    q = np.empty((n, 4, 2, 32), np.uint8)
    np.bitwise_and(g, 15, out=q[:, :, 0])
    np.right_shift(g, 4, out=q[:, :, 1])
    return q.reshape(n, QK_K)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins, each (n, 8) uint8."""
    s = scales.reshape(-1, 3, 4)
    lo_sc, lo_m, packed = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo_sc & 63, (packed & 15) | ((lo_sc >> 2) & 48)], axis=1)
    mn = np.concatenate([lo_m & 63, (packed >> 4) | ((lo_m >> 2) & 48)], axis=1)
    return sc, mn


def dequant_q2_k(b: np.ndarray, out: np.ndarray) -> None:
    n = b.shape[0]
    sc = b["scales"]
    dl = b["d"].astype(np.float32)[:, None] * _f32(sc & 15)
    ml = b["dmin"].astype(np.float32)[:, None] * _f32(sc >> 4)
    o = out.reshape(n, 16, 16)
    np.multiply(_crumbs(b["qs"]).reshape(n, 16, 16), dl[:, :, None], out=o)
    o -= ml[:, :, None]


def dequant_q3_k(b: np.ndarray, out: np.ndarray) -> None:
    n = b.shape[0]
    s = b["scales"]
    low = np.concatenate([s[:, :8] & 15, s[:, :8] >> 4], axis=1)                    # (n, 16) 4 low bits
    high = ((s[:, 8:12].reshape(n, 1, 4) >> _SHIFT_2BIT[0, 0].reshape(1, 4, 1)) & 3).reshape(n, 16)
    sc = (low | (high << 4)).view(np.int8)
    sc -= 32
    dl = b["d"].astype(np.float32)[:, None] * _f32(sc)
    # q = low 2 bits - 4, plus 4 back when the (inverted) high bit is set: q in -4..3
    q = _crumbs(b["qs"]).view(np.int8)
    q -= 4
    q += _bits(b["hmask"]).view(np.int8) << 2
    np.multiply(q.reshape(n, 16, 16), dl[:, :, None], out=out.reshape(n, 16, 16))


def _q45_k(b: np.ndarray, q: np.ndarray, out: np.ndarray) -> None:
    n = b.shape[0]
    sc, mn = _scale_min_k4(b["scales"])
    d = b["d"].astype(np.float32)[:, None] * _f32(sc)
    m = b["dmin"].astype(np.float32)[:, None] * _f32(mn)
    o = out.reshape(n, 8, 32)
    np.multiply(q.reshape(n, 8, 32), d[:, :, None], out=o)
    o -= m[:, :, None]


def dequant_q4_k(b: np.ndarray, out: np.ndarray) -> None:
    _q45_k(b, _nibbles_64(b["qs"]), out)


def dequant_q5_k(b: np.ndarray, out: np.ndarray) -> None:
    q = _nibbles_64(b["qs"])
    q |= _bits(b["qh"]) << 4
    _q45_k(b, q, out)


def dequant_q6_k(b: np.ndarray, out: np.ndarray) -> None:
    n = b.shape[0]
    ql = b["ql"].reshape(n, 2, 64)
    q = np.empty((n, 2, 2, 64), np.uint8)      # per 128-weight half: low nibbles of 64 bytes, then high
    np.bitwise_and(ql, 15, out=q[:, :, 0])
    np.right_shift(ql, 4, out=q[:, :, 1])
    q = q.reshape(n, 2, 4, 32)
    qh = b["qh"].reshape(n, 2, 1, 32) >> _SHIFT_2BIT
    qh &= 3
    qh <<= 4
    q |= qh
    q = q.view(np.int8)
    q -= 32
    dl = b["d"].astype(np.float32)[:, None] * _f32(b["scales"])
    np.multiply(q.reshape(n, 16, 16), dl[:, :, None], out=out.reshape(n, 16, 16))
