"""S16: the Granite-MoE architecture (``granitemoe``, IBM Granite 3.x MoE), over GGUF weights.

    x = embed(tokens) * embedding_scale
    per layer:  x += residual_scale * Wo · attention(rope(Wq · norm(x)), rope(Wk · norm(x)), Wv · norm(x))
                      (queries scaled by attention.scale instead of head_dim^-1/2)
                x += residual_scale * sum_{e in top-k} w_e · expert_e(norm(x))   w = softmax of the top-k logits
    logits = head · norm(x) / logit_scale

Mixtral's layer (models/llama.py, reused) plus four multipliers from the metadata (``granitemoe.embedding_scale``,
``residual_scale``, ``attention.scale``, ``logit_scale``). The softmax over the k chosen logits equals the softmax
over all experts renormalised over the k, so the router is llama.cpp's softmax + ``expert_weights_norm``.
RoPE as Llama's (llama.cpp's NORM type: Q/K rows stored permuted, un-permuted at load); the experts have
``feed_forward_length`` rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pyengine.config import ModelConfig
from pyengine.gguf import GGUFError
from pyengine.layers.moe import MoEConfig
from pyengine.models import llama

ARCH = "granitemoe"


@dataclass(frozen=True)
class GraniteMoeConfig(llama.LlamaConfig):
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    attention_scale: float = 0.0
    logit_scale: float = 1.0


def read_config(gguf) -> GraniteMoeConfig:
    c = ModelConfig.from_gguf(gguf)
    md = gguf.metadata
    moe = MoEConfig.from_gguf(md, ARCH, expert_ffn_default=c.ffn_dim, norm_default=True)
    if moe is None:
        raise GGUFError(f"required metadata key '{ARCH}.expert_count' is missing")

    def scale(key, default):
        v = md.get(f"{ARCH}.{key}", default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise GGUFError(f"metadata key '{ARCH}.{key}' = {v!r:.40} must be a positive number")
        return float(v)
    return GraniteMoeConfig(**c.to_dict(), moe=moe, embedding_scale=scale("embedding_scale", 1.0),
                            residual_scale=scale("residual_scale", 1.0),
                            attention_scale=scale("attention.scale", c.head_dim ** -0.5),
                            logit_scale=scale("logit_scale", 1.0))


class GraniteMoeModel(llama.LlamaModel):
    def __init__(self, config: GraniteMoeConfig, weights):
        super().__init__(config, weights)
        self.scale = config.attention_scale
        self.embed_scale, self.residual_scale = config.embedding_scale, config.residual_scale
        self.logit_scale = config.logit_scale


def build(gguf, mode: str = "resident"):
    """(config, weights, model) for a granitemoe GGUF."""
    c = read_config(gguf)
    w = llama.load_weights(gguf, c, mode)
    return c, w, GraniteMoeModel(c, w)
