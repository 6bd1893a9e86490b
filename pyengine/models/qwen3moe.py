"""S16: the Qwen3-MoE architecture (``qwen3moe``), over GGUF weights.

    per layer:  x += Wo · attention(rope(qnorm(Wq · norm(x))), rope(knorm(Wk · norm(x))), Wv · norm(x))
                x += sum_{e in top-k} w_e · expert_e(norm(x))      w = softmax router, top-k renormalised
    logits = head · norm(x)

What differs from Llama: RMSNorm of each query and key head before RoPE (as Gemma 3); RoPE in the half-split
(NEOX) form, Q/K rows stored unpermuted; head_dim from ``attention.key_length`` (128 != d / H in the real
models); every layer's feed-forward is a mixture of experts (layers/moe.py) with ``expert_feed_forward_length``
rows per expert and no shared expert; llama.cpp renormalises the top-k weights (HF ``norm_topk_prob=True``)
unless the file's ``qwen3moe.expert_weights_norm`` says otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pyengine.config import ModelConfig
from pyengine.gguf import GGUFError
from pyengine.layers.attention import attention
from pyengine.layers.linear import Linear, make_linear
from pyengine.layers.moe import MoE, MoEConfig
from pyengine.layers.norm import rms_norm
from pyengine.layers.rotary import apply_rope
from pyengine.models.base import (EAGER, TensorReader, TransformerModel, Weights, embedding_and_head,
                                  gate_up_matrix, moe_weights, qkv_matrix, rope_kind)

ARCH = "qwen3moe"


@dataclass(frozen=True)
class Qwen3MoeConfig(ModelConfig):
    moe: MoEConfig | None = None


def read_config(gguf) -> Qwen3MoeConfig:
    c = ModelConfig.from_gguf(gguf)
    moe = MoEConfig.from_gguf(gguf.metadata, ARCH, norm_default=True)
    if moe is None:
        raise GGUFError(f"required metadata key '{ARCH}.expert_count' is missing")
    return Qwen3MoeConfig(**c.to_dict(), moe=moe)


class Qwen3MoeLayer(NamedTuple):
    attn_norm: np.ndarray      # (d,)
    wqkv: Linear               # (d, (H + 2 Hkv) hd)   columns: Q | K | V
    q_norm: np.ndarray         # (hd,)  RMSNorm of each query head
    k_norm: np.ndarray         # (hd,)  RMSNorm of each key head
    wo: Linear                 # (H hd, d)
    ffn_norm: np.ndarray       # (d,)
    moe: MoE | None            # router and experts (None: a dense layer, then w_gate_up / w_down)
    w_gate_up: Linear | None
    w_down: Linear | None


def load_weights(gguf, c: Qwen3MoeConfig, mode: str = "resident", qk_norm_rows: tuple | None = None) -> Weights:
    """``qk_norm_rows``: sizes of the q and k norms ((hd, hd): per head; OLMoE's span the whole projection)."""
    r = TensorReader(gguf)
    hd, d = c.head_dim, c.d_model
    nq, nk = qk_norm_rows or (hd, hd)
    layers = []
    for i in range(c.n_layers):
        p = f"blk.{i}."
        if r.has(p + "ffn_gate_inp.weight"):
            moe, gate_up, down = moe_weights(r, p, c, mode)
        else:                   # HF's mlp_only_layers: a plain gated MLP of feed_forward_length rows
            moe, gate_up = None, make_linear(gate_up_matrix(r, p, c), mode, act="silu")
            down = make_linear(r.matrix(p + "ffn_down.weight", (d, c.ffn_dim)), mode)
        layers.append(Qwen3MoeLayer(
            attn_norm=r.vector(p + "attn_norm.weight", d), wqkv=make_linear(qkv_matrix(r, p, c, False), mode),
            q_norm=r.vector(p + "attn_q_norm.weight", nq), k_norm=r.vector(p + "attn_k_norm.weight", nk),
            wo=make_linear(r.matrix(p + "attn_output.weight", (d, c.n_heads * hd)), mode),
            ffn_norm=r.vector(p + "ffn_norm.weight", d), moe=moe, w_gate_up=gate_up, w_down=down))
    embed, head, tied = embedding_and_head(r, c, mode)
    return Weights(c, mode, layers, embed, r.vector("output_norm.weight", d), head, tied)


class Qwen3MoeModel(TransformerModel):
    qk_norm_width = "head"         # OLMoE (models/olmoe.py): "whole"
    tp_split = {"attn_norm": "replicate", "wqkv": "qkv", "q_norm": "replicate", "k_norm": "replicate",
                "wo": "heads_rows", "ffn_norm": "replicate", "moe": "experts", "w_gate_up": "gate_up",
                "w_down": "ffn_rows"}

    def __init__(self, config: Qwen3MoeConfig, weights: Weights):
        c = config
        super().__init__(config, weights, [rope_kind(c)], [0] * c.n_layers, c.head_dim ** -0.5)

    def forward_reference(self, token_ids, positions=None) -> np.ndarray:
        """Logits (T, V) for one whole sequence, recomputed from scratch: no cache, no fusion tricks."""
        c, w = self.config, self.weights
        token_ids = np.asarray(token_ids, dtype=np.int64)
        T, H, Hkv, hd, eps = len(token_ids), c.n_heads, c.n_kv_heads, c.head_dim, c.rms_eps
        positions = np.arange(T) if positions is None else np.asarray(positions, dtype=np.int64)
        cos, sin = self.kinds[0].cos_sin(positions)
        x = w.embed(token_ids)
        for L in w.layers:
            q, k, v = np.split(rms_norm(x, L.attn_norm, eps) @ L.wqkv, [H * hd, (H + Hkv) * hd], axis=1)
            if self.qk_norm_width == "whole":
                q, k = rms_norm(q, L.q_norm, eps), rms_norm(k, L.k_norm, eps)
            else:
                q, k = rms_norm(q.reshape(T, H, hd), L.q_norm, eps), rms_norm(k.reshape(T, Hkv, hd), L.k_norm, eps)
            q = apply_rope(q.reshape(T, H, hd), cos, sin)
            k = apply_rope(k.reshape(T, Hkv, hd), cos, sin)
            x = x + attention(q, k, v.reshape(T, Hkv, hd), offset=0).reshape(T, H * hd) @ L.wo
            x = x + self.ffn_reference(L, rms_norm(x, L.ffn_norm, eps))
        return rms_norm(x, w.output_norm, eps) @ w.head

    def layer(self, i, L, p, slots, kv, b, ops=EAGER) -> None:
        """One layer over the step's T tokens, in place on b.x. ``p``: this kind of layer's part of the plan;
        ``ops``: runs each call now, or also records it into a captured step (S13)."""
        self.qk_norm_attention(i, L, p, slots, kv, b, whole=self.qk_norm_width == "whole", ops=ops)
        ops.call(np.add, b.x, b.proj, b.x)
        ops.rms_norm(b.x, L.ffn_norm, self.config.rms_eps, b.xn)
        self.feed_forward(i, L, b, ops)
        ops.call(np.add, b.x, b.proj, b.x)


def build(gguf, mode: str = "resident"):
    """(config, weights, model) for a qwen3moe GGUF."""
    c = read_config(gguf)
    w = load_weights(gguf, c, mode)
    return c, w, Qwen3MoeModel(c, w)
