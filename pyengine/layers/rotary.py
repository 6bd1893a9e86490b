"""S03: rotary position embeddings (RoPE).

Each head vector is split in pairs of dimensions; pair i is rotated by the angle position * inv_freq[i].
Two pairings exist: llama.cpp's "normal" mode rotates adjacent dims (2i, 2i+1) ("interleaved"), while HF
transformers rotates dim i with dim i + hd/2 ("half", rotate_half). They are the same rotation up to a fixed
permutation of the head dimensions, which is why llama.cpp's converter stores Q/K weight rows permuted.
We un-permute Q/K rows at load (models/llama.py) and use the half-split form: its two halves are
contiguous slices, so the rotation is a few vectorized multiplies.
"""
from __future__ import annotations

import math
from functools import partial

import numpy as np


def rope_inv_freq(head_dim: int, theta: float, scaling_type: str = "none", factor: float = 1.0,
                  orig_context: int | None = None, low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                  freq_factors: np.ndarray | None = None, beta_fast: float = 32.0,
                  beta_slow: float = 1.0) -> np.ndarray:
    """(head_dim/2,) float64 inverse frequencies theta^(-2i/hd), adjusted for context-extension scaling.

    linear: positions are divided by ``factor`` (= inv_freq / factor).
    llama3: long wavelengths (> orig/low_freq_factor) are divided by ``factor``, short ones (< orig/high)
            kept, and the band in between interpolated smoothly (Llama 3.1's recipe).
    yarn:   YaRN (Qwen2.5 / Qwen3 long-context files): per pair, a blend of the original frequency
            (extrapolation, for pairs turning more than ``beta_fast`` times over the original context) and the
            frequency / ``factor`` (interpolation, fewer than ``beta_slow`` turns), linear in the pair index in
            between; the attention factor that goes with it is ``yarn_attention_factor``'s.
    freq_factors: llama.cpp's per-dimension divisors (tensor rope_freqs.weight), applied on top.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    kind = (scaling_type or "none").lower()
    if kind in ("none", "") or factor == 1.0 and kind == "linear":
        pass
    elif kind == "linear":
        inv = inv / factor
    elif kind == "llama3":
        if not orig_context:
            raise ValueError("llama3 RoPE scaling needs the original context length")
        low_wavelen = orig_context / low_freq_factor
        high_wavelen = orig_context / high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (orig_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        mid = (1 - smooth) * inv / factor + smooth * inv
        inv = np.where(wavelen < high_wavelen, inv, np.where(wavelen > low_wavelen, inv / factor, mid))
    elif kind == "yarn":
        if not orig_context:
            raise ValueError("yarn RoPE scaling needs the original context length")

        def turns_dim(turns):        # the (fractional) pair dimension whose wavelength fits orig / turns times
            return head_dim * math.log(orig_context / (turns * 2 * math.pi)) / (2 * math.log(theta))
        low = max(math.floor(turns_dim(beta_fast)), 0)
        high = min(math.ceil(turns_dim(beta_slow)), head_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        inv = inv / factor * ramp + inv * (1.0 - ramp)
    else:
        raise ValueError(f"RoPE scaling type {scaling_type!r} is not supported (supported: none, linear, llama3, "
                         "yarn)")
    if freq_factors is not None:
        freq_factors = np.asarray(freq_factors, dtype=np.float64).reshape(-1)
        if freq_factors.shape != inv.shape:
            raise ValueError(f"rope freq_factors must have {inv.size} entries, got {freq_factors.size}")
        inv = inv / freq_factors
    return inv


def yarn_attention_factor(factor: float, attn_factor: float = 1.0) -> float:
    """YaRN's scaling of cos and sin: 1 + 0.1 ln(factor) for a context extended ``factor`` times (1 if not
    extended), times the file's ``rope.scaling.attn_factor`` (llama.cpp's multiplier; 1 by default)."""
    return attn_factor * (1.0 if factor <= 1.0 else 0.1 * math.log(factor) + 1.0)


def rope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables (len(positions), hd/2) float32. Angles are computed in float64 (rounded once at
    the end) so large positions stay accurate; float32 angles would lose ~1e-5 rad at position 200."""
    angles = np.outer(np.asarray(positions, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, out: np.ndarray | None = None,
               tmp: np.ndarray | None = None) -> np.ndarray:
    """Rotate x (T, n_heads, hd) half-split style with cos/sin (T, hd/2), or (T, n_heads, hd/2) already
    repeated per head (NumPy multiplies those faster than a broadcast over the heads axis, so the fast forward
    repeats them once per step for all layers). ``out`` must not alias x; ``tmp`` (T, n_heads, hd/2)
    is scratch so that no array is allocated."""
    half = x.shape[-1] // 2
    if out is None:
        out = np.empty(x.shape, dtype=x.dtype)
    if tmp is None:
        tmp = np.empty(x.shape[:-1] + (half,), dtype=x.dtype)
    c, s = (cos, sin) if cos.ndim == 3 else (cos[:, None, :], sin[:, None, :])
    x1, x2 = x[..., :half], x[..., half:]
    o1, o2 = out[..., :half], out[..., half:]
    np.multiply(x1, c, out=o1)          # o1 = x1 cos - x2 sin
    np.multiply(x2, s, out=tmp)
    o1 -= tmp
    np.multiply(x2, c, out=o2)          # o2 = x2 cos + x1 sin
    np.multiply(x1, s, out=tmp)
    o2 += tmp
    return out


def rope_rows_ops(tables, positions: np.ndarray, rows, n_heads: int | None, scale: float | None, own) -> list:
    """S13: the bound calls gathering a step's rows for ``apply_rope_ops`` from one kind's (max_len, hd/2)
    tables: [cos | cos] and [-sin | sin] (T, heads, hd) for every rotated head, the first ``n_heads`` (the
    queries) times ``scale`` when given (a power of two). Each is one gather and one broadcast multiply by a
    (heads, 2, 1) pattern of +-1 / +-scale: exact."""
    n = rows[0].shape[1]
    f = np.ones((n, 1, 1), np.float32)
    if scale is not None:
        f[:n_heads] = np.float32(scale)
    ops = []
    for table, full, sign in zip(tables, rows, (np.float32([1, 1]), np.float32([-1, 1]))):
        tmp = own((len(positions), table.shape[1]))
        ops += [partial(np.take, table, positions, 0, tmp, "clip"),
                partial(np.multiply, tmp[:, None, None, :], f * sign[:, None],
                        full.reshape(full.shape[:2] + (2, table.shape[1])))]
    return ops


def apply_rope_ops(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, out: np.ndarray, tmp: np.ndarray) -> list:
    """S13: ``apply_rope`` as three bound calls for a captured step (engine/graph_replay.py), exactly:
    out = x [cos | cos] + swap(x) [-sin | sin] with swap(x) = [x2 | x1] a view, so o1 = x1 cos + x2 (-sin) =
    x1 cos - x2 sin and o2 = x2 cos + x1 sin, the same roundings. cos, sin: (T, heads, hd) rows (from
    ``rope_rows_ops``); tmp: scratch of x's shape."""
    T, n, hd = x.shape
    four = (T, n, 2, hd // 2)
    x4 = x.reshape(four, copy=False)
    o4, t4 = out.reshape(four, copy=False), tmp.reshape(four, copy=False)
    return [partial(np.multiply, x4, cos.reshape(four), o4),
            partial(np.multiply, x4[:, :, ::-1], sin.reshape(four), t4), partial(np.add, o4, t4, o4)]


def apply_rope_interleaved(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """llama.cpp's normal mode: rotate adjacent pairs (2i, 2i+1). Readable reference (allocates)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x2 * c + x1 * s
    return out


def interleaved_to_half(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder the output rows of a Q/K weight (n_heads*hd, ...) stored for interleaved RoPE (as in GGUF)
    so the half-split RoPE gives the same attention scores: per head, rows (0,2,4,...,1,3,5,...)."""
    rows = w.shape[0]
    hd = rows // n_heads
    return (w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def longrope_inv_freq(rope_dim: int, theta: float, factors) -> np.ndarray:
    """LongRoPE (Phi-3/3.5/4-mini): (rope_dim/2,) inverse frequencies theta^(-2i/rope_dim) divided by the
    per-dimension ``factors`` (the file's rope_factors_short or rope_factors_long)."""
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape != (rope_dim // 2,):
        raise ValueError(f"LongRoPE factors must have {rope_dim // 2} entries (rope dims / 2), got {factors.size}")
    if not np.all(np.isfinite(factors)) or np.any(factors <= 0):
        raise ValueError("LongRoPE factors must be positive numbers")
    return 1.0 / (factors * theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim))


def longrope_attention_factor(context: int, orig_context: int) -> float:
    """LongRoPE's scaling of cos and sin when the context was extended (HF's and llama.cpp's converter's default):
    sqrt(1 + ln(context / orig) / ln(orig)), 1 without extension."""
    factor = context / orig_context
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig_context))


def partial_rotary_order(head_dim: int, rope_dim: int) -> np.ndarray:
    """Partial rotary (rope_dim < head_dim: only the first rope_dim dimensions of each head turn, in half-split
    pairs (i, i + rope_dim/2)): the order of a head's dimensions that makes them pairs (i, i + head_dim/2) of the
    whole head, as ``apply_rope`` rotates: [rotated first half | unrotated first half | rotated second half |
    unrotated second half]. Applied to the rows of Q and K (the same order on both leaves every q . k as it
    is), with ``partial_rotary_pad``'s frequencies 0 on the unrotated pairs (cos 1, sin 0: left as they are)."""
    if rope_dim % 2 or (head_dim - rope_dim) % 2 or not 0 < rope_dim <= head_dim:
        raise ValueError(f"rotary dims {rope_dim} must be even, positive and at most the head dim {head_dim} "
                         "(with an even remainder)")
    r, u = rope_dim // 2, (head_dim - rope_dim) // 2
    return np.concatenate([np.arange(r), rope_dim + np.arange(u), r + np.arange(r), rope_dim + u + np.arange(u)])


def partial_rotary_pad(values: np.ndarray, head_dim: int, fill: float) -> np.ndarray:
    """(rope_dim/2,) per-pair values (inverse frequencies, or cos/sin scales) extended to the head_dim/2 pairs of
    ``partial_rotary_order``: ``fill`` on the unrotated pairs (0 for frequencies, 1 for scales)."""
    values = np.asarray(values, dtype=np.float64)
    return np.concatenate([values, np.full(head_dim // 2 - values.size, fill)])

