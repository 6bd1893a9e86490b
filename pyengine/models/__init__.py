"""S03: the model registry — one module per architecture, found by the GGUF's ``general.architecture``.

Each module (models/<arch>.py) gives ``read_config(gguf)``, ``load_weights(gguf, config, mode)``, its model class
(with the readable ``forward_reference`` and the fast ``layer``) and ``build(gguf, mode) -> (config, weights,
model)``; the shared parts are in models/base.py. Modules are imported by name on first use (mlx-lm's shape).
"""
from __future__ import annotations

import importlib

from pyengine.gguf import GGUFError

# general.architecture -> module
ARCHITECTURES = {
    "llama": "pyengine.models.llama",
    "gemma3": "pyengine.models.gemma3",
    "qwen2": "pyengine.models.qwen2",            # issue 30: the dense families people run
    "qwen3": "pyengine.models.qwen3",
    "gemma2": "pyengine.models.gemma2",
    "phi3": "pyengine.models.phi3",
    "qwen2moe": "pyengine.models.qwen2moe",      # S16: mixtures of experts (Mixtral is a llama file)
    "qwen3moe": "pyengine.models.qwen3moe",
    "olmoe": "pyengine.models.olmoe",
    "granitemoe": "pyengine.models.granitemoe",
}


def architecture(gguf):
    """The module of a GGUFFile's architecture; GGUFError listing the supported ones if it has none."""
    arch = gguf.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError("metadata key 'general.architecture' is missing or not a string")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"architecture {arch!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})")
    return importlib.import_module(ARCHITECTURES[arch])


def load_config(gguf):
    """The architecture's config (ModelConfig plus its own keys)."""
    return architecture(gguf).read_config(gguf)


def load_model(gguf, mode: str = "resident"):
    """(config, weights, model) of a GGUFFile, weights in ``mode`` ("resident" or "lean")."""
    if mode not in ("resident", "lean"):
        raise ValueError(f"weights mode must be 'resident' or 'lean', got {mode!r}")
    c, w, model = architecture(gguf).build(gguf, mode)
    if mode == "resident":
        from pyengine.models.base import fold_norms
        fold_norms(w)                  # S13: RMSNorm weights folded into the float32 matrices they feed
    return c, w, model
