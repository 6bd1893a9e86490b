"""S03: RMSNorm, as Llama uses it: x / sqrt(mean(x^2) + eps) * weight (no mean subtraction, no bias)."""
from __future__ import annotations

import math
from functools import partial

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """Normalize each row of x (..., d). ``out`` (same shape, may not alias x) avoids allocating. ``weight``
    None: already folded into the next matrix at load (models/base.py `fold_norms`)."""
    if out is None:
        out = np.empty_like(x)
    np.multiply(x, x, out=out)
    ms = np.add.reduce(out, axis=-1, keepdims=True)     # (..., 1): tiny; ufunc call, no Python wrapper
    ms *= 1.0 / x.shape[-1]
    ms += eps
    np.sqrt(ms, out=ms)
    np.divide(x, ms, out=out)
    if weight is not None:
        out *= weight
    return out


def rms_norm_ops(x: np.ndarray, weight: np.ndarray | None, eps: float, out: np.ndarray, ms: np.ndarray) -> list:
    """S13: the same ufuncs as ``rms_norm``, bound to their arrays for a captured step (engine/graph_replay.py):
    ``ms`` (..., 1) is the bound scratch the eager form allocates. One row (a lone decode) is one call,
    ``rms_norm_row``: its mean square is a scalar, and NumPy's ufuncs on 0-d arrays cost ~3x those on a row."""
    if ms.size == 1 and out.flags.c_contiguous:
        ops = [partial(rms_norm_row, x, out, out.reshape(-1), ms.reshape(()), np.float32(1.0 / x.shape[-1]),
                       np.float32(eps))]
        return ops + ([partial(np.multiply, out, weight, out)] if weight is not None else [])
    # out positional and the scalars as float32 0-d arrays (the values NumPy casts them to): cheaper calls
    inv_d, eps = np.array(1.0 / x.shape[-1], np.float32), np.array(eps, np.float32)
    ops = [partial(np.multiply, x, x, out), partial(np.add.reduce, out, -1, None, ms, True),
           partial(np.multiply, ms, inv_d, ms), partial(np.add, ms, eps, ms), partial(np.sqrt, ms, ms),
           partial(np.divide, x, ms, out)]
    return ops + ([partial(np.multiply, out, weight, out)] if weight is not None else [])


def rms_norm_row(x: np.ndarray, out: np.ndarray, flat: np.ndarray, ms: np.ndarray, inv_d: np.float32,
                 eps: np.float32) -> None:
    """``rms_norm`` of one row x (1, d) into ``out`` (``flat``: its 1-D view; ``ms``: 0-d scratch), bit for bit
    (before the weight): the same squares and pairwise sum (NumPy's reduction of one contiguous row), then the
    mean, + eps and sqrt on NumPy float32 scalars; math.sqrt rounds once in float64 and once to float32 (on
    assignment), which gives the correctly rounded float32 root (float64 has more than 2 x 24 + 2 bits), as
    np.sqrt does."""
    np.multiply(x, x, out)
    np.add.reduce(flat, 0, None, ms)
    ms[()] = math.sqrt(ms[()] * inv_d + eps)
    np.divide(x, ms, out)
