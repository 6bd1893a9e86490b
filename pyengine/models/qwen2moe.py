"""S16: the Qwen1.5/Qwen2-MoE architecture (``qwen2moe``): a Llama layer with Q|K|V biases whose feed-forward
is a mixture of experts plus a shared expert.

    per layer:  x += Wo · attention(rope(Wq · norm(x) + bq), rope(Wk · norm(x) + bk), Wv · norm(x) + bv)
                x += sum_{e in top-k} p_e · expert_e(norm(x)) + sigmoid(g · norm(x)) · shared(norm(x))

What differs from Llama (models/llama.py, whose layer it reuses): the biases; RoPE is the half-split (NEOX) form
and llama.cpp stores Q/K rows unpermuted; the router's top-k softmax weights are not renormalised (llama.cpp's
rule for qwen2moe, HF's ``norm_topk_prob=False``) unless the file says ``qwen2moe.expert_weights_norm``; every
expert has ``expert_feed_forward_length`` rows and the shared one ``expert_shared_feed_forward_length``.
"""
from __future__ import annotations

from pyengine.config import ModelConfig
from pyengine.gguf import GGUFError
from pyengine.layers.moe import MoEConfig
from pyengine.models import llama

ARCH = "qwen2moe"


def read_config(gguf) -> llama.LlamaConfig:
    c = ModelConfig.from_gguf(gguf)
    moe = MoEConfig.from_gguf(gguf.metadata, ARCH)
    if moe is None:
        raise GGUFError(f"required metadata key '{ARCH}.expert_count' is missing")
    return llama.LlamaConfig(**c.to_dict(), moe=moe)


def build(gguf, mode: str = "resident"):
    """(config, weights, model) for a qwen2moe GGUF."""
    c = read_config(gguf)
    w = llama.load_weights(gguf, c, mode, unpermute=False, qkv_bias=True)
    return c, w, llama.LlamaModel(c, w)
