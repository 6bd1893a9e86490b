"""S03: SiLU and SwiGLU (the gated MLP of Llama: down(silu(gate(x)) * up(x)))."""
from __future__ import annotations

import numpy as np


def silu(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x * sigmoid(x), written with tanh (sigmoid(x) = (1 + tanh(x/2)) / 2) so no exp can overflow."""
    if out is None:
        out = np.empty_like(x)
    np.multiply(x, 0.5, out=out)
    np.tanh(out, out=out)
    out += 1.0
    out *= 0.5
    out *= x
    return out


def swiglu(gate_up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """silu(gate) * up for the fused (..., 2F) projection [gate | up] -> (..., F)."""
    f = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :f], gate_up[..., f:]
    out = silu(gate, out=out)
    out *= up
    return out
