"""S03: the Gemma 2 architecture (``gemma2``: Gemma 2 2B, 9B, 27B), over GGUF weights.

    x = embed(tokens) * sqrt(d)
    per layer:  x += postnorm(Wo · attention(rope(Wq · norm(x)), rope(Wk · norm(x)), Wv · norm(x)))
                x += postnorm(Wdown · (gelu_tanh(Wgate · norm(x)) * Wup · norm(x)))
    logits = c_f * tanh(head · norm(x) / c_f)

What differs from Llama: the embeddings times sqrt(d); "sandwich" norms (each sub-layer's output normalized
before its residual add); GeGLU; the sliding window on every other layer (layers 0, 2, 4, ...: HF's and
llama.cpp's pattern 2), one RoPE base for both kinds; attention-logit soft-capping (scores c_a * tanh(s / c_a),
after the query scale and before the mask, in every attention path) and final-logit soft-capping. The query
scale: ``gemma2.attention.scale`` when the file has it, else llama.cpp's rule (1/sqrt(d / H) for the 46-layer
27B, 1/sqrt(head_dim) otherwise). llama.cpp's converter stores the norm weights as (1 + w) and the Q/K rows
unpermuted (half-split RoPE), so both are used as stored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pyengine.config import ModelConfig
from pyengine.gguf import GGUFError
from pyengine.layers.activation import gated_activation
from pyengine.layers.attention import attention
from pyengine.layers.linear import Linear, make_linear
from pyengine.layers.norm import rms_norm
from pyengine.layers.rotary import apply_rope
from pyengine.models.base import (EAGER, TensorReader, TransformerModel, Weights, embedding_and_head,
                                  gate_up_matrix, qkv_matrix, rope_kind)

ARCH = "gemma2"
SWA_PATTERN = 2                 # layers i with (i + 1) % 2 != 0 (even i) use the sliding window


@dataclass(frozen=True)
class Gemma2Config(ModelConfig):
    sliding_window: int = 4096     # keys a local layer sees (i - j < sliding_window)
    attn_softcap: float = 50.0     # attention-logit soft-capping c_a (0: none)
    final_softcap: float = 30.0    # final-logit soft-capping c_f (0: none)
    attn_scale: float = 0.0        # query scaling

    def is_sliding(self, layer: int) -> bool:
        return (layer + 1) % SWA_PATTERN != 0


def read_config(gguf) -> Gemma2Config:
    c = ModelConfig.from_gguf(gguf)
    md = gguf.metadata

    def key(name, kind, default):
        v = md.get(f"{ARCH}.{name}", default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)) \
                or not np.isfinite(v) or v < 0 or (v == 0 and kind is int):
            raise GGUFError(f"metadata key '{ARCH}.{name}' = {v!r:.40} must be a positive "
                            f"{'integer' if kind is int else 'number'}")
        return kind(v)

    scale = (c.d_model // c.n_heads) ** -0.5 if c.n_layers == 46 else c.head_dim ** -0.5
    return Gemma2Config(**c.to_dict(), sliding_window=key("attention.sliding_window", int, 4096),
                        attn_softcap=key("attn_logit_softcapping", float, 50.0),
                        final_softcap=key("final_logit_softcapping", float, 30.0),
                        attn_scale=key("attention.scale", float, scale))


class Gemma2Layer(NamedTuple):
    attn_norm: np.ndarray      # (d,)     before attention (stored as 1 + w)
    wqkv: Linear               # (d, (H + 2 Hkv) hd)   columns: Q | K | V
    wo: Linear                 # (H hd, d)
    post_attn_norm: np.ndarray  # (d,)    of the attention output, before the residual add
    ffn_norm: np.ndarray       # (d,)
    w_gate_up: Linear          # (d, 2F)  columns: gate | up (GeGLU)
    w_down: Linear             # (F, d)
    post_ffn_norm: np.ndarray  # (d,)


def load_weights(gguf, c: Gemma2Config, mode: str = "resident") -> Weights:
    r = TensorReader(gguf)
    d = c.d_model
    layers = []
    for i in range(c.n_layers):
        p = f"blk.{i}."
        layers.append(Gemma2Layer(
            attn_norm=r.vector(p + "attn_norm.weight", d), wqkv=make_linear(qkv_matrix(r, p, c, False), mode),
            wo=make_linear(r.matrix(p + "attn_output.weight", (d, c.n_heads * c.head_dim)), mode),
            post_attn_norm=r.vector(p + "post_attention_norm.weight", d),
            ffn_norm=r.vector(p + "ffn_norm.weight", d),
            w_gate_up=make_linear(gate_up_matrix(r, p, c), mode, act="gelu_tanh"),
            w_down=make_linear(r.matrix(p + "ffn_down.weight", (d, c.ffn_dim)), mode),
            post_ffn_norm=r.vector(p + "post_ffw_norm.weight", d)))
    embed, head, tied = embedding_and_head(r, c, mode)
    return Weights(c, mode, layers, embed, r.vector("output_norm.weight", d), head, tied)


class Gemma2Model(TransformerModel):
    tp_split = {"attn_norm": "replicate", "wqkv": "qkv", "wo": "heads_rows", "post_attn_norm": "replicate",
                "ffn_norm": "replicate", "w_gate_up": "gate_up", "w_down": "ffn_rows", "post_ffn_norm": "replicate"}
    def __init__(self, config: Gemma2Config, weights: Weights):
        c = config
        kinds = [rope_kind(c, c.sliding_window), rope_kind(c)]
        super().__init__(config, weights, kinds, [0 if c.is_sliding(i) else 1 for i in range(c.n_layers)],
                         c.attn_scale)
        self.embed_scale = float(np.float32(c.d_model ** 0.5))
        self.attn_softcap = c.attn_softcap or None
        self.final_softcap = c.final_softcap or None

    def forward_reference(self, token_ids, positions=None) -> np.ndarray:
        """Logits (T, V) for one whole sequence, recomputed from scratch: no cache, no fusion tricks."""
        c, w = self.config, self.weights
        token_ids = np.asarray(token_ids, dtype=np.int64)
        T, H, Hkv, hd, eps = len(token_ids), c.n_heads, c.n_kv_heads, c.head_dim, c.rms_eps
        positions = np.arange(T) if positions is None else np.asarray(positions, dtype=np.int64)
        x = w.embed(token_ids) * np.float32(self.embed_scale)
        for i, L in enumerate(w.layers):
            kind = self.kinds[self.kind_of[i]]
            cos, sin = kind.cos_sin(positions)
            q, k, v = np.split(rms_norm(x, L.attn_norm, eps) @ L.wqkv, [H * hd, (H + Hkv) * hd], axis=1)
            q, k = apply_rope(q.reshape(T, H, hd), cos, sin), apply_rope(k.reshape(T, Hkv, hd), cos, sin)
            h = attention(q, k, v.reshape(T, Hkv, hd), offset=0, scale=self.scale, window=kind.window,
                          softcap=self.attn_softcap)
            x = x + rms_norm(h.reshape(T, H * hd) @ L.wo, L.post_attn_norm, eps)
            ffn = gated_activation(rms_norm(x, L.ffn_norm, eps) @ L.w_gate_up, "gelu_tanh") @ L.w_down
            x = x + rms_norm(ffn, L.post_ffn_norm, eps)
        logits = rms_norm(x, w.output_norm, eps) @ w.head
        if self.final_softcap:
            logits = np.tanh(logits / np.float32(self.final_softcap)) * np.float32(self.final_softcap)
        return logits

    def layer(self, i, L, p, slots, kv, b, ops=EAGER) -> None:
        """One layer over the step's T tokens, in place on b.x. ``p``: this kind of layer's part of the plan;
        ``ops``: runs each call now, or also records it into a captured step (S13)."""
        c = self.config
        H, Hkv, hd, eps = c.n_heads, c.n_kv_heads, c.head_dim, c.rms_eps
        T = b.x.shape[0]
        ops.rms_norm(b.x, L.attn_norm, eps, b.xn)          # attn_norm None: folded into wqkv at load
        ops.matmul(L.wqkv, b.xn, b.qkv)
        ops.rope(b.qkv[:, :(H + Hkv) * hd].reshape(T, H + Hkv, hd), p.cos, p.sin, b.qk_rot, b.rope_tmp)
        ops.call(kv.write, i, slots, b.qk_rot[:, H:], b.qkv[:, (H + Hkv) * hd:].reshape(T, Hkv, hd))
        ops.attention(i, b.qk_rot[:, :H], kv, p.attention, b.attn, b, self.scale, self.attn_softcap)
        ops.matmul(L.wo, b.attn.reshape(T, H * hd), b.proj)
        ops.rms_norm(b.proj, L.post_attn_norm, eps, b.xn)     # post-norms scale an output: nothing to fold into
        ops.call(np.add, b.x, b.xn, b.x)
        ops.rms_norm(b.x, L.ffn_norm, eps, b.xn)
        ops.gated(L.w_gate_up, b.xn, b.ffn, b.gate_up)
        ops.matmul(L.w_down, b.ffn, b.proj)
        ops.rms_norm(b.proj, L.post_ffn_norm, eps, b.xn)
        ops.call(np.add, b.x, b.xn, b.x)


def build(gguf, mode: str = "resident"):
    """(config, weights, model) for a gemma2 GGUF."""
    c = read_config(gguf)
    w = load_weights(gguf, c, mode)
    return c, w, Gemma2Model(c, w)
