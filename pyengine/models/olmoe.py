"""S16: the OLMoE architecture (``olmoe``, AllenAI's OLMoE-1B-7B), over GGUF weights.

    per layer:  q, k = qnorm(Wq · norm(x)), knorm(Wk · norm(x))       RMSNorm over all query / all key columns
                x += Wo · attention(rope(q), rope(k), Wv · norm(x))
                x += sum_{e in top-k} p_e · expert_e(norm(x))          softmax router, top-k not renormalised

The Qwen3-MoE layer (models/qwen3moe.py, whose loader and model this module reuses) with one difference: the
q/k norms span the whole projection (d and Hkv·hd weights) rather than each head. RoPE is the half-split (NEOX)
form, Q/K stored unpermuted; the experts have ``feed_forward_length`` rows (or ``expert_feed_forward_length``);
llama.cpp leaves the top-k weights unnormalised (HF ``norm_topk_prob=False``) unless the file says otherwise.
"""
from __future__ import annotations

from pyengine.config import ModelConfig
from pyengine.gguf import GGUFError
from pyengine.layers.moe import MoEConfig
from pyengine.models import qwen3moe

ARCH = "olmoe"


def read_config(gguf) -> qwen3moe.Qwen3MoeConfig:
    c = ModelConfig.from_gguf(gguf)
    moe = MoEConfig.from_gguf(gguf.metadata, ARCH, expert_ffn_default=c.ffn_dim)
    if moe is None:
        raise GGUFError(f"required metadata key '{ARCH}.expert_count' is missing")
    return qwen3moe.Qwen3MoeConfig(**c.to_dict(), moe=moe)


class OlmoeModel(qwen3moe.Qwen3MoeModel):
    qk_norm_width = "whole"        # the reference and the fast layer norm all query / all key columns at once
    tp_split = {**qwen3moe.Qwen3MoeModel.tp_split, "q_norm": "q_heads_norm", "k_norm": "k_heads_norm"}


def build(gguf, mode: str = "resident"):
    """(config, weights, model) for an olmoe GGUF."""
    c = read_config(gguf)
    w = qwen3moe.load_weights(gguf, c, mode, qk_norm_rows=(c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim))
    return c, w, OlmoeModel(c, w)
