"""S03: RMSNorm, as Llama uses it: x / sqrt(mean(x^2) + eps) * weight (no mean subtraction, no bias)."""
from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """Normalize each row of x (..., d). ``out`` (same shape, may not alias x) avoids allocating."""
    if out is None:
        out = np.empty_like(x)
    np.multiply(x, x, out=out)
    ms = np.add.reduce(out, axis=-1, keepdims=True)     # (..., 1): tiny; ufunc call, no Python wrapper
    ms *= 1.0 / x.shape[-1]
    ms += eps
    np.sqrt(ms, out=ms)
    np.divide(x, ms, out=out)
    out *= weight
    return out
