"""S03: the dense Qwen3 architecture (``qwen3``: Qwen3 0.6B .. 32B), the Qwen3-MoE layer (models/qwen3moe.py)
with a plain gated MLP.

    per layer:  x += Wo · attention(rope(qnorm(Wq · norm(x))), rope(knorm(Wk · norm(x))), Wv · norm(x))
                x += Wdown · (silu(Wgate · norm(x)) * Wup · norm(x))
    logits = head · norm(x)

What differs from Llama: RMSNorm of each query and key head before RoPE; RoPE in the half-split (NEOX) form on
unpermuted Q/K rows; head_dim from ``attention.key_length`` (128 in every size, != d / H); no biases.
"""
from __future__ import annotations

from pyengine.config import ModelConfig
from pyengine.gguf import GGUFError
from pyengine.models import qwen3moe

ARCH = "qwen3"


def read_config(gguf) -> qwen3moe.Qwen3MoeConfig:
    return qwen3moe.Qwen3MoeConfig(**ModelConfig.from_gguf(gguf).to_dict())


def build(gguf, mode: str = "resident"):
    """(config, weights, model) for a qwen3 GGUF."""
    c = read_config(gguf)
    if "blk.0.ffn_gate_inp.weight" in gguf.tensors:
        raise GGUFError("a qwen3 file holds expert routers (blk.0.ffn_gate_inp.weight): its architecture should "
                        "be 'qwen3moe'")
    w = qwen3moe.load_weights(gguf, c, mode)
    return c, w, qwen3moe.Qwen3MoeModel(c, w)
