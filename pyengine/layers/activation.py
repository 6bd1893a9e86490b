"""S03: the gated MLP's activations: SwiGLU (Llama: silu(gate) * up) and GeGLU (Gemma: gelu_tanh(gate) * up)."""
from __future__ import annotations

from functools import partial

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


# the bound forms' scalars as float32 0-d arrays (the values NumPy casts the Python floats to): cheaper calls
_F32 = {c: np.array(c, np.float32) for c in (0.5, 1.0, 0.044715)}
_F32_SQRT_2_OVER_PI = np.array(_SQRT_2_OVER_PI)

def silu_half(h: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """silu(2h), for a gate whose weights were halved at load (models/base.py ``fold_norms``, S13): silu(x) =
    (x/2)(1 + tanh(x/2)) with h = x/2, so the two multiplies by 0.5 of ``silu`` are gone. Halving weights is
    exact in binary floating point (so is every product and sum of them), and the result is bit for bit silu's
    barring subnormal gates."""
    if out is None:
        out = np.empty_like(h)
    np.tanh(h, out=out)
    out += 1.0
    out *= h
    return out


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh, "silu_half": silu_half}


def gated_activation(gate_up: np.ndarray, act: str, out: np.ndarray | None = None) -> np.ndarray:
    """act(gate) * up for the fused (..., 2F) projection [gate | up] -> (..., F)."""
    f = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :f], gate_up[..., f:]
    out = ACTIVATIONS[act](gate, out=out)
    out *= up
    return out


def gated_activation_ops(gate_up: np.ndarray, act: str, out: np.ndarray) -> list:
    """S13: the ufuncs of ``gated_activation`` (and of its activation), bound for a captured step."""
    f = gate_up.shape[-1] // 2
    x, up = gate_up[..., :f], gate_up[..., f:]
    half, one = _F32[0.5], _F32[1.0]
    if act == "silu_half":
        ops = [partial(np.tanh, x, out), partial(np.add, out, one, out), partial(np.multiply, out, x, out)]
    elif act == "silu":
        ops = [partial(np.multiply, x, half, out), partial(np.tanh, out, out), partial(np.add, out, one, out),
               partial(np.multiply, out, half, out), partial(np.multiply, out, x, out)]
    elif act == "gelu_tanh":
        ops = [partial(np.multiply, x, x, out), partial(np.multiply, out, _F32[0.044715], out),
               partial(np.add, out, one, out), partial(np.multiply, out, x, out),
               partial(np.multiply, out, _F32_SQRT_2_OVER_PI, out), partial(np.tanh, out, out),
               partial(np.add, out, one, out), partial(np.multiply, out, half, out),
               partial(np.multiply, out, x, out)]
    else:
        raise ValueError(f"activation {act!r} has no bound form (known: {', '.join(ACTIVATIONS)})")
    return ops + [partial(np.multiply, out, up, out)]


def swiglu(gate_up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """silu(gate) * up (Llama's MLP)."""
    return gated_activation(gate_up, "silu", out=out)
