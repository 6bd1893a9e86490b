"""S03/S12: causal self-attention with grouped-query heads (GQA).

Shapes: q (Tq, H, hd); k, v (Tk, Hkv, hd) with H = Hkv * g. Query row i sits at position ``offset + i``
(default Tk - Tq: the new tokens are the last ones of the context) and sees keys 0 .. offset + i, or with a
sliding ``window`` W only the last W of them (keys j with offset + i - j < W: Gemma's local layers).
Query head h uses KV head h // g (HF's repeat_kv order).

Four forms, all computing the same numbers:
  attention           readable reference: repeats K/V per query head, materializes all scores.
  grouped_attention   fast plain softmax: no repeat (q is regrouped as (Hkv, hd, Tq*g) so one matmul per KV
                      head covers its whole query group), scores written into caller scratch.
  flash_attention     S12: tiles over keys (and queries) with an online softmax (running max m and sum l),
                      so memory is O(tile^2) instead of O(Tq * Tk); fully-masked key tiles are skipped.
  decode_attention    S09: B sequences with a few new tokens each (decodes: one; speculative verification: a
                      few) at once over K/V padded to a common length plus a mask: two batched matmuls
                      instead of a Python loop of B small calls.
Scores are kept keys-major, (Hkv, Tk, Tq*g): the K operand is then a plain strided view of the KV cache
(row stride Hkv*hd), which BLAS takes directly, instead of a transposed view NumPy would copy. The softmax's
max and sum then run down the keys axis, whose rows are short (Tq*g floats); NumPy reduces such an axis one
row at a time, so long key ranges are reduced by halving instead (``_reduce_keys``; 8 queries over 4k keys:
1.6x faster attention).
"""
from __future__ import annotations

import numpy as np

from pyengine import tuning


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, offset: int | None = None,
              scale: float | None = None, window: int | None = None) -> np.ndarray:
    """Reference causal attention (allocates freely; for tests and forward_reference)."""
    Tq, H, hd = q.shape
    Tk, Hkv, _ = k.shape
    offset = Tk - Tq if offset is None else offset
    scale = hd ** -0.5 if scale is None else scale
    k = np.repeat(k, H // Hkv, axis=1)                                   # (Tk, H, hd)
    v = np.repeat(v, H // Hkv, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * scale                    # (H, Tq, Tk)
    qpos = (offset + np.arange(Tq))[:, None]
    masked = np.arange(Tk)[None, :] > qpos                              # key after the query
    if window is not None:
        masked |= qpos - np.arange(Tk)[None, :] >= window                # key out of the sliding window
    scores = np.where(masked, -np.inf, scores)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v).astype(q.dtype)


def _regroup_q(q: np.ndarray, n_kv: int, scale: float) -> np.ndarray:
    """(Tq, H, hd) -> scaled (Hkv, hd, Tq*g); column i*g + j is query i, head (kv*g + j)."""
    Tq, H, hd = q.shape
    qT = q.reshape(Tq, n_kv, H // n_kv, hd).transpose(1, 3, 0, 2).reshape(n_kv, hd, Tq * (H // n_kv))
    return qT * np.float32(scale)


def _write_out(acc: np.ndarray, out: np.ndarray, n_kv: int, hd_first: bool = False) -> None:
    """(Hkv, Tq*g, hd), or (Hkv, hd, Tq*g) with ``hd_first`` -> out (Tq, H, hd)."""
    Tq, H, hd = out.shape
    g = H // n_kv
    dest = out.reshape(Tq, n_kv, g, hd)
    if not hd_first:
        np.copyto(dest, acc.reshape(n_kv, Tq, g, hd).transpose(1, 0, 2, 3))
    else:
        np.copyto(dest, acc.reshape(n_kv, hd, Tq, g).transpose(2, 0, 3, 1))


def _reduce_keys(op, s: np.ndarray, tmp: np.ndarray | None = None) -> np.ndarray:
    """``op``-reduce s (Hkv, Tk, C) over the keys axis -> new (Hkv, 1, C) array, by halving: each round
    combines the first and second half of what is left, one ufunc call over contiguous (n/2)*C runs.
    ``tmp``: float32 scratch of >= Hkv * ceil(Tk/2) * C elements (else allocated)."""
    H, n, C = s.shape
    if n < tuning.KEY_TREE_MIN or C >= tuning.KEY_TREE_MAX_ROW:
        return op.reduce(s, axis=1, keepdims=True)
    need = H * (n - n // 2) * C
    t = (np.empty(need, np.float32) if tmp is None or tmp.size < need else tmp.reshape(-1)[:need])
    t = t.reshape(H, n - n // 2, C)
    src = s
    while n > 1:
        h = n // 2
        op(src[:, :h], src[:, h:2 * h], out=t[:, :h])
        if n - h > h:                                   # odd count: the middle row passes through
            t[:, h] = src[:, 2 * h]
        src, n = t, n - h
    return t[:, :1].copy()


def _causal_bias(k0: int, k1: int, q0: int, q1: int, offset: int, g: int,
                 window: int | None = None) -> np.ndarray | None:
    """(k1-k0, (q1-q0)*g) additive mask for keys k0..k1 and queries q0..q1, or None if nothing is masked."""
    in_window = window is None or offset + q1 - 1 - k0 < window
    if k1 - 1 <= offset + q0 and in_window:
        return None
    keys = np.arange(k0, k1)[:, None, None]
    qpos = offset + np.arange(q0, q1)[None, :, None]
    masked = keys > qpos
    if window is not None:
        masked |= qpos - keys >= window
    bias = np.where(masked, np.float32(-np.inf), np.float32(0))
    return np.broadcast_to(bias, (k1 - k0, q1 - q0, g)).reshape(k1 - k0, (q1 - q0) * g)


def grouped_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, offset: int | None = None,
                      scale: float | None = None, out: np.ndarray | None = None,
                      scratch: np.ndarray | None = None, window: int | None = None) -> np.ndarray:
    """Plain softmax GQA attention. ``scratch``: float32 buffer of >= Hkv*Tk*Tq*g elements for the scores
    (with half as much again, the key reductions use it too instead of allocating)."""
    Tq, H, hd = q.shape
    Tk, Hkv, _ = k.shape
    g = H // Hkv
    offset = Tk - Tq if offset is None else offset
    scale = hd ** -0.5 if scale is None else scale
    if out is None:
        out = np.empty(q.shape, np.float32)
    n = Hkv * Tk * Tq * g
    if scratch is not None and scratch.size < n:
        raise ValueError(f"grouped_attention scratch has {scratch.size} floats, {Tq}x{Tk} scores need {n}")
    s = (np.empty(n, np.float32) if scratch is None else scratch.reshape(-1)[:n]).reshape(Hkv, Tk, Tq * g)
    tmp = None if scratch is None else scratch.reshape(-1)[n:]
    np.matmul(k.transpose(1, 0, 2), _regroup_q(q, Hkv, scale), out=s)   # (Hkv, Tk, Tq*g)
    # keys before k0 are visible to every query (with a window, none is known to be)
    k0 = max(0, offset + 1) if window is None else 0
    bias = _causal_bias(k0, Tk, 0, Tq, offset, g, window)
    if bias is not None:
        s[:, k0:] += bias
    s -= _reduce_keys(np.maximum, s, tmp)
    np.exp(s, out=s)
    denom = _reduce_keys(np.add, s, tmp)                                 # (Hkv, 1, Tq*g)
    # V^T @ P rather than P^T @ V: for few queries over many keys OpenBLAS runs it ~2x faster (8 x 4k: 0.4 vs 0.8 ms)
    acc_t = np.matmul(v.transpose(1, 2, 0), s)                          # (Hkv, hd, Tq*g): small
    acc_t /= denom
    _write_out(acc_t, out, Hkv, hd_first=True)
    return out


def flash_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, offset: int | None = None,
                    scale: float | None = None, tile: int = 256, q_tile: int | None = 128,
                    out: np.ndarray | None = None, scratch: np.ndarray | None = None,
                    window: int | None = None) -> np.ndarray:
    """Tiled online-softmax attention; never holds more than a (Hkv, tile, q_tile*g) block of scores.

    For each query tile, key tiles are visited left to right (key 0 is visible to every query, so the running
    max m is finite after the first tile); each tile rescales the partial sums by exp(m_old - m_new).
    ``scratch``: float32 buffer of >= Hkv*tile*q_tile*g elements (else one is allocated); half as much
    again serves the key reductions.
    """
    Tq, H, hd = q.shape
    Tk, Hkv, _ = k.shape
    g = H // Hkv
    offset = Tk - Tq if offset is None else offset
    scale = hd ** -0.5 if scale is None else scale
    if tile < 1 or (q_tile is not None and q_tile < 1):
        raise ValueError(f"flash_attention tiles must be >= 1, got tile={tile}, q_tile={q_tile}")
    q_tile = Tq if q_tile is None else min(q_tile, Tq)
    if out is None:
        out = np.empty(q.shape, np.float32)
    need = Hkv * min(tile, Tk) * q_tile * g
    buf = np.empty(need, np.float32) if scratch is None else scratch.reshape(-1)
    if buf.size < need:
        raise ValueError(f"flash_attention scratch has {buf.size} floats, tiles need {need}")
    tmp = buf[need:]                                                     # for the key reductions, if room
    qT = _regroup_q(q, Hkv, scale)                                       # (Hkv, hd, Tq*g)
    kt, vt = k.transpose(1, 0, 2), v.transpose(1, 0, 2)                 # (Hkv, Tk, hd) views
    # a tile's causal bias depends only on its shape and where the diagonal crosses it: the tiles along the
    # diagonal repeat, so each distinct one is built once per call
    biases: dict[tuple[int, int, int], np.ndarray | None] = {}
    for q0 in range(0, Tq, q_tile):
        q1 = min(Tq, q0 + q_tile)
        cols = (q1 - q0) * g
        qblk = qT[:, :, q0 * g:q1 * g]
        # a finite floor, not -inf: with a sliding window a query may see no key of the first tiles visited
        m = np.full((Hkv, 1, cols), np.finfo(np.float32).min, np.float32)
        l = np.zeros((Hkv, 1, cols), np.float32)
        acc = np.zeros((Hkv, cols, hd), np.float32)
        k_end = min(Tk, offset + q1)                # keys after the tile's last query are never seen
        k_start = 0 if window is None else max(0, offset + q0 - window + 1)   # nor keys before its window
        for k0 in range(k_start, k_end, tile):
            k1 = min(k_end, k0 + tile)
            s = buf[:Hkv * (k1 - k0) * cols].reshape(Hkv, k1 - k0, cols)
            np.matmul(kt[:, k0:k1], qblk, out=s)
            where = (k1 - k0, q1 - q0, offset + q0 - k0)
            if where not in biases:
                biases[where] = _causal_bias(k0, k1, q0, q1, offset, g, window)
            bias = biases[where]
            if bias is not None:
                s += bias
            m_new = np.maximum(m, _reduce_keys(np.maximum, s, tmp))
            corr = np.exp(m - m_new)                # rescales what was accumulated under the old max
            s -= m_new
            np.exp(s, out=s)
            l *= corr
            l += _reduce_keys(np.add, s, tmp)
            acc *= corr.transpose(0, 2, 1)
            # P^T @ V here (unlike grouped_attention): with a full query tile (384 columns) it is the faster one
            acc += np.matmul(s.transpose(0, 2, 1), vt[:, k0:k1])        # (Hkv, cols, hd)
            m = m_new
        acc /= l.transpose(0, 2, 1)
        _write_out(acc, out[q0:q1], Hkv)
    return out


def padding_mask(lens: np.ndarray, L: int) -> np.ndarray:
    """(B, 1, 1, L) True where key l >= lens[b]: the padding keys of decode_attention's contexts. Validates
    lens (B,) in 1..L; a caller running many layers over the same contexts builds it once."""
    lens = np.asarray(lens)
    if lens.ndim != 1 or (lens.size and (int(lens.min()) < 1 or int(lens.max()) > L)):
        raise ValueError(f"decode_attention lens must be context lengths in [1, {L}], got {lens}")
    return (np.arange(L) >= lens[:, None])[:, None, None, :]


def decode_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, lens: np.ndarray | None = None,
                     scale: float | None = None, out: np.ndarray | None = None, scratch: np.ndarray | None = None,
                     pad: np.ndarray | None = None) -> np.ndarray:
    """A few queries per sequence (one for a decode), for B sequences at once over padded contexts.

    q (B, H, hd), one query at the last position of each context, or (B, Q, H, hd); k, v (B, L, Hkv, hd) padded
    contexts. Masked keys get zero weight (they must only be finite, e.g. stale cache blocks). The mask: ``lens``
    (B,) context lengths in 1..L (one query each), or ``pad`` = padding_mask(lens, L) (B, 1, 1, L), or in general
    ``pad`` (B, 1, 1, Q, L) True where key l is hidden from query j (causal order, padding, sliding window).
    ``scratch``: float32 buffer of >= B*H*Q*L elements for the scores.
    """
    one = q.ndim == 3
    B, Q, H, hd = (q.shape[0], 1) + q.shape[1:] if one else q.shape
    _, L, Hkv, _ = k.shape
    g = H // Hkv
    scale = hd ** -0.5 if scale is None else scale
    pad = padding_mask(lens, L) if pad is None else pad
    if pad.shape not in ((B, 1, 1, Q, L),) + (((B, 1, 1, L),) if Q == 1 else ()):
        raise ValueError(f"decode_attention needs {B} context lengths over {L} keys (a mask of shape "
                         f"{(B, 1, 1, Q, L)} for {Q} queries each), got a mask of shape {pad.shape}")
    if out is None:
        out = np.empty(q.shape, np.float32)
    n = B * H * Q * L
    if scratch is not None and scratch.size < n:
        raise ValueError(f"decode_attention scratch has {scratch.size} floats, {B}x{H}x{Q}x{L} scores need {n}")
    s = (np.empty(n, np.float32) if scratch is None else scratch.reshape(-1)[:n]).reshape(B, Hkv, g * Q, L)
    # (B, Hkv, g*Q, hd): column gi*Q + j is query j of head (kv*g + gi); small
    qg = (q.reshape(B, Q, Hkv, g, hd).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, g * Q, hd) * np.float32(scale))
    # Each (sequence, KV head) pair is a (g*Q x hd) @ (hd x keys) product: tiny M. OpenBLAS runs such products
    # in a fast unpacked kernel only up to a size (here ~400 keys; beyond, 3-4x slower per flop), so keys go
    # in chunks of DECODE_KEY_CHUNK.
    chunk = tuning.DECODE_KEY_CHUNK
    kt, vt = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)          # strided views of the padded K/V
    for l0 in range(0, L, chunk):
        l1 = min(L, l0 + chunk)
        np.matmul(qg, kt[..., l0:l1], out=s[..., l0:l1])                  # (B, Hkv, g*Q, keys)
    # masked keys get -inf by assignment: exact zeros after exp, whatever their scores were
    np.copyto(s.reshape(B, Hkv, g, Q, L), np.float32(-np.inf), where=pad.reshape(B, 1, 1, Q, L))
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    denom = s.sum(axis=-1, keepdims=True)                                 # (B, Hkv, g*Q, 1)
    acc = np.matmul(s[..., :chunk], vt[:, :, :chunk])                     # (B, Hkv, g*Q, hd): small
    for l0 in range(chunk, L, chunk):
        acc += np.matmul(s[..., l0:l0 + chunk], vt[:, :, l0:l0 + chunk])
    acc /= denom
    if one:
        np.copyto(out, acc.reshape(B, H, hd))
    else:
        np.copyto(out, acc.reshape(B, Hkv, g, Q, hd).transpose(0, 3, 1, 2, 4).reshape(B, Q, H, hd))
    return out
