"""S03: RMSNorm, as Llama uses it: x / sqrt(mean(x^2) + eps) * weight (no mean subtraction, no bias)."""
from __future__ import annotations

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
    ``ms`` (..., 1) is the bound scratch the eager form allocates."""
    # out positional and the scalars as float32 0-d arrays (the values NumPy casts them to): cheaper calls
    inv_d, eps = np.array(1.0 / x.shape[-1], np.float32), np.array(eps, np.float32)
    if ms.size == 1:            # one row: its mean square as a 0-d view (NumPy broadcasts those cheaper)
        ms = ms.reshape(())
        red = partial(np.add.reduce, out.reshape(-1), 0, None, ms)
    else:
        red = partial(np.add.reduce, out, -1, None, ms, True)
    ops = [partial(np.multiply, x, x, out), red, partial(np.multiply, ms, inv_d, ms), partial(np.add, ms, eps, ms),
           partial(np.sqrt, ms, ms), partial(np.divide, x, ms, out)]
    return ops + ([partial(np.multiply, out, weight, out)] if weight is not None else [])
