"""S03: the gated MLP's activations: SwiGLU (Llama: silu(gate) * up) and GeGLU (Gemma: gelu_tanh(gate) * up)."""
from __future__ import annotations

import numpy as np

_SQRT_2_OVER_PI = np.float32(np.sqrt(2.0 / np.pi))


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


def gelu_tanh(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    if out is None:
        out = np.empty_like(x)
    np.multiply(x, x, out=out)
    out *= np.float32(0.044715)
    out += 1.0
    out *= x
    out *= _SQRT_2_OVER_PI
    np.tanh(out, out=out)
    out += 1.0
    out *= 0.5
    out *= x
    return out


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}


def gated_activation(gate_up: np.ndarray, act: str, out: np.ndarray | None = None) -> np.ndarray:
    """act(gate) * up for the fused (..., 2F) projection [gate | up] -> (..., F)."""
    f = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :f], gate_up[..., f:]
    out = ACTIVATIONS[act](gate, out=out)
    out *= up
    return out


def swiglu(gate_up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """silu(gate) * up (Llama's MLP)."""
    return gated_activation(gate_up, "silu", out=out)
