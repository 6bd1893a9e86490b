"""S03: the Qwen2 architecture (``qwen2``: Qwen2, Qwen2.5 incl. Coder and Math, DeepSeek-R1-Distill-Qwen), a
Llama layer with Q|K|V biases.

    per layer:  x += Wo · attention(rope(Wq · norm(x) + bq), rope(Wk · norm(x) + bk), Wv · norm(x) + bv)
                x += Wdown · (silu(Wgate · norm(x)) * Wup · norm(x))
    logits = head · norm(x) (+ output.bias, when the file has one)

What differs from Llama (models/llama.py, whose layer it runs): the biases; RoPE is the half-split (NEOX) form,
so llama.cpp stores the Q/K rows unpermuted; the head is tied (0.5B, 1.5B, 3B) or untied (7B and up).
"""
from __future__ import annotations

from pyengine.config import ModelConfig
from pyengine.models import llama

ARCH = "qwen2"


def read_config(gguf) -> llama.LlamaConfig:
    return llama.LlamaConfig(**ModelConfig.from_gguf(gguf).to_dict())


def build(gguf, mode: str = "resident"):
    """(config, weights, model) for a qwen2 GGUF."""
    c = read_config(gguf)
    w = llama.load_weights(gguf, c, mode, unpermute=False, qkv_bias=True, head_bias=True)
    return c, w, llama.LlamaModel(c, w)
