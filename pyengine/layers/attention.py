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
``softcap`` c (Gemma 2): every form caps the scaled scores as c * tanh(s / c) before the mask and softmax.
Scores are kept keys-major, (Hkv, Tk, Tq*g): the K operand is then a plain strided view of the KV cache
(row stride Hkv*hd), which BLAS takes directly, instead of a transposed view NumPy would copy. The softmax's
max and sum then run down the keys axis, whose rows are short (Tq*g floats); NumPy reduces such an axis one
row at a time, so long key ranges are reduced by halving instead (``_reduce_keys``; 8 queries over 4k keys:
1.6x faster attention).
"""
from __future__ import annotations

import functools

import numpy as np

from pyengine import tuning


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, offset: int | None = None,
              scale: float | None = None, window: int | None = None, softcap: float | None = None) -> np.ndarray:
    """Reference causal attention (allocates freely; for tests and forward_reference)."""
    Tq, H, hd = q.shape
    Tk, Hkv, _ = k.shape
    offset = Tk - Tq if offset is None else offset
    scale = hd ** -0.5 if scale is None else scale
    k = np.repeat(k, H // Hkv, axis=1)                                   # (Tk, H, hd)
    v = np.repeat(v, H // Hkv, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * scale                    # (H, Tq, Tk)
    if softcap:
        scores = np.tanh(scores / softcap) * softcap
    qpos = (offset + np.arange(Tq))[:, None]
    masked = np.arange(Tk)[None, :] > qpos                              # key after the query
    if window is not None:
        masked |= qpos - np.arange(Tk)[None, :] >= window                # key out of the sliding window
    scores = np.where(masked, -np.inf, scores)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v).astype(q.dtype)


def cap_scores(s: np.ndarray, softcap: float | None) -> None:
    """Gemma 2's attention-logit soft-capping in place: s = c * tanh(s / c) (nothing when c is None or 0)."""
    if softcap:
        c = np.float32(softcap)
        np.divide(s, c, out=s)
        np.tanh(s, out=s)
        np.multiply(s, c, out=s)


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
                      scratch: np.ndarray | None = None, window: int | None = None,
                      softcap: float | None = None) -> np.ndarray:
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
    cap_scores(s, softcap)
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
                    window: int | None = None, softcap: float | None = None) -> np.ndarray:
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
            cap_scores(s, softcap)
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


def _decode_setup(q: np.ndarray, L: int, Hkv: int, lens, scale, out, scratch, pad):
    """What both decode forms share: shapes, the validated mask, the output, the (B, Hkv, g*Q, L) scores in
    scratch and the scaled queries qg (B, Hkv, g*Q, hd) (column gi*Q + j is query j of head kv*g + gi)."""
    one = q.ndim == 3
    B, Q, H, hd = (q.shape[0], 1) + q.shape[1:] if one else q.shape
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
    qg = (q.reshape(B, Q, Hkv, g, hd).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, g * Q, hd) * np.float32(scale))
    return pad, out, s, qg


def _decode_softmax(s: np.ndarray, pad: np.ndarray) -> np.ndarray:
    """Unnormalized softmax of the scores s (B, Hkv, g*Q, L) in place; returns the sums (B, Hkv, g*Q, 1).
    Masked keys get -inf by assignment: exact zeros after exp, whatever their scores were."""
    B, Hkv, gq, L = s.shape
    Q = pad.shape[3] if pad.ndim == 5 else 1
    np.copyto(s.reshape(B, Hkv, gq // Q, Q, L), np.float32(-np.inf), where=pad.reshape(B, 1, 1, Q, L))
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    return s.sum(axis=-1, keepdims=True)


def _decode_write(acc: np.ndarray, out: np.ndarray) -> np.ndarray:
    """acc (B, Hkv, g*Q, hd) -> out (B, H, hd) or (B, Q, H, hd)."""
    B, Hkv, gq, hd = acc.shape
    if out.ndim == 3:
        np.copyto(out, acc.reshape(out.shape))
    else:
        Q, H = out.shape[1], out.shape[2]
        np.copyto(out, acc.reshape(B, Hkv, H // Hkv, Q, hd).transpose(0, 3, 1, 2, 4).reshape(B, Q, H, hd))
    return out


def decode_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, lens: np.ndarray | None = None,
                     scale: float | None = None, out: np.ndarray | None = None, scratch: np.ndarray | None = None,
                     pad: np.ndarray | None = None, softcap: float | None = None) -> np.ndarray:
    """A few queries per sequence (one for a decode), for B sequences at once over padded contexts.

    q (B, H, hd), one query at the last position of each context, or (B, Q, H, hd); k, v (B, L, Hkv, hd) padded
    contexts. Masked keys get zero weight (they must only be finite, e.g. stale cache blocks). The mask: ``lens``
    (B,) context lengths in 1..L (one query each), or ``pad`` = padding_mask(lens, L) (B, 1, 1, L), or in general
    ``pad`` (B, 1, 1, Q, L) True where key l is hidden from query j (causal order, padding, sliding window).
    ``scratch``: float32 buffer of >= B*H*Q*L elements for the scores.
    """
    _, L, Hkv, _ = k.shape
    pad, out, s, qg = _decode_setup(q, L, Hkv, lens, scale, out, scratch, pad)
    # Each (sequence, KV head) pair is a (g*Q x hd) @ (hd x keys) product: tiny M. OpenBLAS runs such products
    # in a fast unpacked kernel only up to a size (here ~400 keys; beyond, 3-4x slower per flop), so keys go
    # in chunks of DECODE_KEY_CHUNK.
    chunk = tuning.DECODE_KEY_CHUNK
    kt, vt = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)          # strided views of the padded K/V
    for l0 in range(0, L, chunk):
        l1 = min(L, l0 + chunk)
        np.matmul(qg, kt[..., l0:l1], out=s[..., l0:l1])                  # (B, Hkv, g*Q, keys)
    cap_scores(s, softcap)
    denom = _decode_softmax(s, pad)                                       # (B, Hkv, g*Q, 1)
    acc = np.matmul(s[..., :chunk], vt[:, :, :chunk])                     # (B, Hkv, g*Q, hd): small
    for l0 in range(chunk, L, chunk):
        acc += np.matmul(s[..., l0:l0 + chunk], vt[:, :, l0:l0 + chunk])
    acc /= denom
    return _decode_write(acc, out)


# --- S08: decode attention straight from the stored KV formats --------------------------------------------
# A stored row (one head of one token) splits along the head dimension into segments that share one scale:
# float16 (one segment of hd values, no scale), Q8_0 (hd/32 blocks: a float16 scale d, then 32 int8 n),
# Q4_0 (hd/32 blocks: d, then 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31; w = d (n - 8)).
# The scale of key j's block b is folded into the scores and into the probabilities instead of into the keys:
#     q . k_j = sum_b d_jb (q_b . n_jb)
#     sum_j p_j v_j = sum_j (p_j d_jb) n_jb        for block b of the output
# so a tile of stored rows needs only a contiguous cast to float32 (Q4_0: after unpacking the nibbles), of all
# its bytes, the scale bytes too: the contiguous cast is ~1.5x faster than a strided one skipping them, and the
# matmuls read past them; scaling the keys instead would cost one more broadcast pass over every value, ~2x the
# cast: the fold wins at head sizes 64 and 256 alike (`pyengine bench kv --only scales`, docs/performance.md).

def _block_bytes(fmt: str) -> int:
    return {"q8_0": 34, "q4_0": 18}[fmt]


def stored_row(fmt: str, hd: int) -> int:
    """Elements of one stored head row: hd float16 values, or hd / 32 ggml blocks of bytes."""
    return hd if fmt == "fp16" else hd // 32 * _block_bytes(fmt)


def stored_scratch_floats(fmt: str, B: int, L: int, tile: int, Hkv: int, hd: int, gq: int) -> int:
    """float32 elements of the scratch stored_decode_attention needs: B contexts of L keys visited in tiles of
    ``tile`` keys, with gq = g * Q query columns per KV head."""
    vals = B * tile * Hkv * stored_row(fmt, hd) * (2 if fmt == "q4_0" else 1)   # Q4_0: low and high nibbles
    if fmt == "fp16":
        return vals
    nib = -(-vals // 4) if fmt == "q4_0" else 0                                 # the nibbles as bytes
    segs = hd // 16 if fmt == "q4_0" else hd // 32
    return vals + nib + B * L * Hkv * gq * segs + 2 * B * L * Hkv * (hd // 32)


def f16_bits_to_f32(h: np.ndarray, out: np.ndarray) -> np.ndarray:
    """float16 bit patterns (uint16) -> float32 values in ``out`` (uint32-viewable), 2.5x faster than NumPy's
    float16 cast: the exponent and mantissa shifted into float32's places, times 2^112 to re-bias the exponent
    (exact for normal and subnormal values; a float16 infinity or NaN reads as +-2^16 (1 + mantissa))."""
    u = out.view(np.uint32)
    np.copyto(u, h)
    np.left_shift(u, 13, out=u)
    sign = np.bitwise_and(u, np.uint32(1 << 28))
    np.bitwise_and(u, np.uint32(0x0FFFE000), out=u)
    np.multiply(out, np.float32(2.0 ** 112), out=out)
    np.left_shift(sign, 3, out=sign)
    np.bitwise_or(u, sign, out=u)
    return out


@functools.cache
def _f16_table() -> np.ndarray:
    """float32 value of every float16 bit pattern (256 KiB): the block scales are looked up, not cast."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def _tile_values(fmt: str, raw: np.ndarray, vals: np.ndarray, nib: np.ndarray | None) -> np.ndarray:
    """Stored rows raw (B, t, Hkv, row) -> their values as float32 views into ``vals``, keys-major:
    (B, Hkv, t, hd) for fp16, (B, Hkv, nb, t, 32) for Q8_0, (B, Hkv, nb, 2, t, 16) for Q4_0 (low, high)."""
    B, t, Hkv, row = raw.shape
    if fmt == "fp16":
        f = f16_bits_to_f32(raw.view(np.uint16), vals[:raw.size].reshape(raw.shape))
        return f.transpose(0, 2, 1, 3)
    bl = _block_bytes(fmt)
    blocks = raw.reshape(B, t, Hkv, row // bl, bl)
    if fmt == "q8_0":
        f = vals[:raw.size].reshape(blocks.shape)
        np.copyto(f, blocks.view(np.int8), casting="unsafe")
        return f[..., 2:].transpose(0, 2, 3, 1, 4)
    n = nib[:2 * raw.size].reshape((2,) + blocks.shape)
    np.bitwise_and(blocks, 15, out=n[0])
    np.right_shift(blocks, 4, out=n[1])
    n = n.view(np.int8)
    np.subtract(n, np.int8(8), out=n)          # the offset in the integers: exact (folded later, q . n would cancel)
    f = vals[:2 * raw.size].reshape(n.shape)
    np.copyto(f, n, casting="unsafe")
    return f[..., 2:].transpose(1, 3, 4, 0, 2, 5)


def _block_scales(raw: np.ndarray, bl: int, out: np.ndarray) -> np.ndarray:
    """The float16 scales d of stored rows raw (B, L, Hkv, row) as float32 (B, Hkv, nb, L), contiguous (the
    folds then run 1.6-2x faster than over a transposed view), in ``out`` (>= 2 B L Hkv nb floats)."""
    B, L, Hkv, row = raw.shape
    n = raw.size // bl
    d = out[n:2 * n].reshape(B, L, Hkv, row // bl)
    np.take(_f16_table(), raw.reshape(B, L, Hkv, row // bl, bl)[..., :2].view(np.uint16)[..., 0], out=d)
    dt = out[:n].reshape(B, Hkv, row // bl, L)
    np.copyto(dt, d.transpose(0, 2, 3, 1))
    return dt


def stored_decode_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, fmt: str, pad: np.ndarray, tile: int,
                            scale: float | None = None, out: np.ndarray | None = None,
                            scratch: np.ndarray | None = None, tile_scratch: np.ndarray | None = None,
                            softcap: float | None = None) -> np.ndarray:
    """decode_attention over K/V stored as ``fmt`` ("fp16", "q8_0", "q4_0"): k, v the stored rows
    (B, L, Hkv, row) of padded contexts (views of the cache or gathered copies), converted ``tile`` keys at a
    time and never as a whole. ``tile_scratch``: float32 buffer of >= stored_scratch_floats(...) elements."""
    B, L, Hkv, _ = k.shape
    pad, out, s, qg = _decode_setup(q, L, Hkv, None, scale, out, scratch, pad)
    gq, hd = qg.shape[2:]
    nb = hd // 32
    need = stored_scratch_floats(fmt, B, L, tile, Hkv, hd, gq)
    buf = np.empty(need, np.float32) if tile_scratch is None or tile_scratch.size < need else tile_scratch
    nvals = B * tile * Hkv * stored_row(fmt, hd) * (2 if fmt == "q4_0" else 1)
    vals, rest = buf[:nvals], buf[nvals:]
    nib = None
    if fmt == "q4_0":
        nib, rest = rest[:-(-nvals // 4)].view(np.uint8), rest[-(-nvals // 4):]
    tiles = [(l0, min(L, l0 + tile)) for l0 in range(0, L, tile)]
    chunk = tuning.DECODE_KEY_CHUNK               # (gq x W) @ (W x keys) products stay in OpenBLAS's fast kernel
    half = fmt == "q4_0"
    if fmt == "fp16":
        qs, parts = qg, s
    else:                  # queries per block (B, Hkv, nb, gq, 32) or half block (B, Hkv, nb, 2, gq, 16)
        qs = qg.reshape(B, Hkv, gq, nb, 2, 16).transpose(0, 1, 3, 4, 2, 5) if half else \
            qg.reshape(B, Hkv, gq, nb, 32).transpose(0, 1, 3, 2, 4)
        parts = rest[:B * Hkv * nb * (2 if half else 1) * gq * L].reshape(qs.shape[:-1] + (L,))  # per block
        rest = rest[parts.size:]
    for l0, l1 in tiles:
        kt = _tile_values(fmt, k[:, l0:l1], vals, nib).swapaxes(-1, -2)
        for c0 in range(l0, l1, chunk):
            c1 = min(l1, c0 + chunk)
            np.matmul(qs, kt[..., c0 - l0:c1 - l0], out=parts[..., c0:c1])
    if fmt != "fp16":
        p = np.add(parts[:, :, :, 0], parts[:, :, :, 1], out=parts[:, :, :, 0]) if half else parts
        np.einsum("xhbgl,xhbl->xhgl", p, _block_scales(k, _block_bytes(fmt), rest), out=s)   # sum_b d_jb p_b
    cap_scores(s, softcap)
    denom = _decode_softmax(s, pad)
    if fmt == "fp16":
        pd = s
    else:
        pd = parts.reshape(-1)[:B * Hkv * nb * gq * L].reshape(B, Hkv, nb, gq, L)
        np.multiply(s[:, :, None], _block_scales(v, _block_bytes(fmt), rest)[:, :, :, None], out=pd)   # p_j d_jb
        if half:
            pd = pd[:, :, :, None]
    acc = None
    for l0, l1 in tiles:
        part = np.matmul(pd[..., l0:l1], _tile_values(fmt, v[:, l0:l1], vals, nib))   # (.., gq, W)
        acc = part if acc is None else np.add(acc, part, out=acc)
    if half:
        acc = acc.transpose(0, 1, 4, 2, 3, 5).reshape(B, Hkv, gq, hd)
    elif fmt == "q8_0":
        acc = acc.transpose(0, 1, 3, 2, 4).reshape(B, Hkv, gq, hd)
    acc /= denom
    return _decode_write(acc, out)
