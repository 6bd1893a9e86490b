"""S03: the Gemma 3 architecture (text), over GGUF weights.

    x = embed(tokens) * sqrt(d)
    per layer:  h = Wo · attention(rope(qnorm(Wq · norm(x))), rope(knorm(Wk · norm(x))), Wv · norm(x))
                x += post_attn_norm(h)
                x += post_ffn_norm(Wdown · (gelu_tanh(Wgate · norm(x)) * Wup · norm(x)))
    logits = head · norm(x)          (head = token_embd: tied)

What differs from Llama: GeGLU (tanh GELU) instead of SwiGLU; four norms per layer plus RMSNorm of each query and
key head; the embeddings scaled by sqrt(d); queries scaled by key_length^-1/2 (llama.cpp's rule for Gemma 3
below 27B, the same as HF's query_pre_attn_scalar); five of every six layers attend only to a sliding window of
the last ``sliding_window`` positions with their own RoPE base (10000), the sixth to the whole context with the
file's base (and its RoPE scaling, if any). llama.cpp's converter stores the norm weights as (1 + w), so they are
used as stored; Q/K rows are not permuted (Gemma's RoPE is the half-split form already).
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

ARCH = "gemma3"
SWA_PATTERN = 6             # llama.cpp and HF: layers i with (i + 1) % 6 != 0 use the sliding window
SWA_ROPE_BASE = 10000.0     # RoPE base of the sliding-window layers (HF rope_local_base_freq)


@dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    sliding_window: int = 0        # keys a local layer sees (i - j < sliding_window)
    sliding_pattern: int = SWA_PATTERN
    rope_local_theta: float = SWA_ROPE_BASE
    attn_scale: float = 0.0        # query scaling

    def is_sliding(self, layer: int) -> bool:
        return (layer + 1) % self.sliding_pattern != 0


def read_config(gguf) -> Gemma3Config:
    c = ModelConfig.from_gguf(gguf)
    md = gguf.metadata

    def key(name, kind, default):
        v = md.get(f"{ARCH}.{name}", default)
        if v is None:
            raise GGUFError(f"required metadata key '{ARCH}.{name}' is missing")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)) \
                or v <= 0:
            raise GGUFError(f"metadata key '{ARCH}.{name}' = {v!r:.40} must be a positive "
                            f"{'integer' if kind is int else 'number'}")
        return kind(v)

    window = key("attention.sliding_window", int, None)
    return Gemma3Config(**c.to_dict(), sliding_window=window,
                        sliding_pattern=key("attention.sliding_window_pattern", int, SWA_PATTERN),
                        rope_local_theta=key("rope.freq_base_swa", float, SWA_ROPE_BASE),
                        attn_scale=key("attention.scale", float, c.head_dim ** -0.5))


class Gemma3Layer(NamedTuple):
    attn_norm: np.ndarray      # (d,)     before attention (stored as 1 + w)
    wqkv: Linear               # (d, (H + 2 Hkv) hd)   columns: Q | K | V
    q_norm: np.ndarray         # (hd,)    RMSNorm of each query head
    k_norm: np.ndarray         # (hd,)    RMSNorm of each key head
    wo: Linear                 # (H hd, d)
    post_attn_norm: np.ndarray  # (d,)    of the attention output, before the residual add
    ffn_norm: np.ndarray       # (d,)
    w_gate_up: Linear          # (d, 2F)  columns: gate | up (GeGLU)
    w_down: Linear             # (F, d)
    post_ffn_norm: np.ndarray  # (d,)


def load_weights(gguf, c: Gemma3Config, mode: str = "resident") -> Weights:
    r = TensorReader(gguf)
    hd, d = c.head_dim, c.d_model
    layers = []
    for i in range(c.n_layers):
        p = f"blk.{i}."
        qkv, gate_up = qkv_matrix(r, p, c, unpermute=False), gate_up_matrix(r, p, c)
        layers.append(Gemma3Layer(
            attn_norm=r.vector(p + "attn_norm.weight", d), wqkv=make_linear(qkv, mode),
            q_norm=r.vector(p + "attn_q_norm.weight", hd), k_norm=r.vector(p + "attn_k_norm.weight", hd),
            wo=make_linear(r.matrix(p + "attn_output.weight", (d, c.n_heads * hd)), mode),
            post_attn_norm=r.vector(p + "post_attention_norm.weight", d),
            ffn_norm=r.vector(p + "ffn_norm.weight", d), w_gate_up=make_linear(gate_up, mode, act="gelu_tanh"),
            w_down=make_linear(r.matrix(p + "ffn_down.weight", (d, c.ffn_dim)), mode),
            post_ffn_norm=r.vector(p + "post_ffw_norm.weight", d)))
    embed, head, tied = embedding_and_head(r, c, mode)
    return Weights(c, mode, layers, embed, r.vector("output_norm.weight", d), head, tied)


class Gemma3Model(TransformerModel):
    tp_split = {"attn_norm": "replicate", "wqkv": "qkv", "q_norm": "replicate", "k_norm": "replicate",
                "wo": "heads_rows", "post_attn_norm": "replicate", "ffn_norm": "replicate", "w_gate_up": "gate_up",
                "w_down": "ffn_rows", "post_ffn_norm": "replicate"}
    def __init__(self, config: Gemma3Config, weights: Weights):
        c = config
        local = rope_kind(c, c.sliding_window, c.rope_local_theta, scaled=False)
        full = rope_kind(c)
        kind_of = [0 if c.is_sliding(i) else 1 for i in range(c.n_layers)]
        super().__init__(config, weights, [local, full], kind_of, c.attn_scale)
        self.embed_scale = float(np.float32(c.d_model ** 0.5))

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
            q = apply_rope(rms_norm(q.reshape(T, H, hd), L.q_norm, eps), cos, sin)
            k = apply_rope(rms_norm(k.reshape(T, Hkv, hd), L.k_norm, eps), cos, sin)
            h = attention(q, k, v.reshape(T, Hkv, hd), offset=0, scale=self.scale, window=kind.window)
            x = x + rms_norm(h.reshape(T, H * hd) @ L.wo, L.post_attn_norm, eps)
            ffn = gated_activation(rms_norm(x, L.ffn_norm, eps) @ L.w_gate_up, "gelu_tanh") @ L.w_down
            x = x + rms_norm(ffn, L.post_ffn_norm, eps)
        return rms_norm(x, w.output_norm, eps) @ w.head

    def layer(self, i, L, p, slots, kv, b, ops=EAGER) -> None:
        """One layer over the step's T tokens, in place on b.x. ``p``: this kind of layer's part of the plan;
        ``ops``: runs each call now, or also records it into a captured step (S13)."""
        eps = self.config.rms_eps
        self.qk_norm_attention(i, L, p, slots, kv, b, ops=ops)
        ops.rms_norm(b.proj, L.post_attn_norm, eps, b.xn)     # post-norms scale an output: nothing to fold into
        ops.call(np.add, b.x, b.xn, b.x)
        ops.rms_norm(b.x, L.ffn_norm, eps, b.xn)
        ops.gated(L.w_gate_up, b.xn, b.ffn, b.gate_up)
        ops.matmul(L.w_down, b.ffn, b.proj)
        ops.rms_norm(b.proj, L.post_ffn_norm, eps, b.xn)
        ops.call(np.add, b.x, b.xn, b.x)


def build(gguf, mode: str = "resident"):
    """(config, weights, model) for a gemma3 GGUF."""
    c = read_config(gguf)
    w = load_weights(gguf, c, mode)
    return c, w, Gemma3Model(c, w)
