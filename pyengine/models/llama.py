"""S03: the Llama architecture (SmolLM2 is a Llama), over GGUF weights.

    x = embed(tokens)
    per layer:  x += Wo · attention(rope(Wq · norm(x)), rope(Wk · norm(x)), Wv · norm(x))
                x += Wdown · (silu(Wgate · norm(x)) * Wup · norm(x))
    logits = head · norm(x)          (head = token_embd when the embeddings are tied)

Mixtral is a llama GGUF with ``llama.expert_count``: its layers' feed-forward is a mixture of experts
(layers/moe.py, S16) — softmax router, top-k renormalised — instead of the one gated MLP.

Q|K|V are fused into one matrix and gate|up into one, so a layer is four products (layers/linear.py). GGUF
stores Q/K rows permuted for llama.cpp's interleaved RoPE; the loader undoes it, so RoPE is the half-split form.
``forward_reference`` is the readable pass every fast path is tested against; ``layer`` is the fast one, run by
the shared loop of models/base.py over buffers and a plan the runner prepared (engine/step_plan.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pyengine.config import ModelConfig
from pyengine.layers.attention import attention
from pyengine.layers.linear import Linear, make_linear
from pyengine.layers.moe import MoE, MoEConfig
from pyengine.layers.norm import rms_norm
from pyengine.layers.rotary import apply_rope
from pyengine.models.base import (EAGER, TensorReader, TransformerModel, Weights, embedding_and_head,
                                  gate_up_matrix, moe_weights, qkv_matrix, rope_kind)

ARCH = "llama"


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    moe: MoEConfig | None = None   # Mixtral (and Qwen2-MoE, models/qwen2moe.py): the experts' shape


def read_config(gguf) -> LlamaConfig:
    c = ModelConfig.from_gguf(gguf)
    # llama.cpp: a llama file's experts have feed_forward_length rows and renormalised top-k weights
    return LlamaConfig(**c.to_dict(), moe=MoEConfig.from_gguf(gguf.metadata, c.arch, c.ffn_dim, norm_default=True))


class LlamaLayer(NamedTuple):
    attn_norm: np.ndarray      # (d,)
    wqkv: Linear               # (d, H*hd + 2*Hkv*hd)   columns: Q (RoPE half-split order) | K (same) | V
    wo: Linear                 # (H*hd, d)
    ffn_norm: np.ndarray       # (d,)
    w_gate_up: Linear | None   # (d, 2F)                columns: gate | up (SwiGLU); MoE: the shared expert's
    w_down: Linear | None      # (F, d)
    moe: MoE | None = None     # MoE layers: router and experts (then w_gate_up / w_down: shared expert or None)
    bqkv: np.ndarray | None = None  # ((H + 2 Hkv) hd,) Q|K|V biases (Qwen2-MoE)


def load_weights(gguf, c: LlamaConfig, mode: str = "resident", unpermute: bool = True,
                 qkv_bias: bool = False, head_bias: bool = False) -> Weights:
    """``unpermute``: Q/K rows stored for interleaved RoPE (llama); False for the half-split (NEOX) families.
    ``qkv_bias``: the layers have Q, K and V biases (required); ``head_bias``: the file may have an output.bias."""
    r = TensorReader(gguf)
    hd, d = c.head_dim, c.d_model
    layers = []
    for i in range(c.n_layers):
        p = f"blk.{i}."
        if c.moe is not None and r.has(p + "ffn_gate_inp.weight"):
            moe, gate_up, down = moe_weights(r, p, c, mode)
        else:
            moe, gate_up = None, make_linear(gate_up_matrix(r, p, c), mode, act="silu")
            down = make_linear(r.matrix(p + "ffn_down.weight", (d, c.ffn_dim)), mode)
        bias = np.concatenate([r.vector(p + f"attn_{n}.bias", rows * hd) for n, rows in
                               (("q", c.n_heads), ("k", c.n_kv_heads), ("v", c.n_kv_heads))]) if qkv_bias else None
        layers.append(LlamaLayer(
            attn_norm=r.vector(p + "attn_norm.weight", d), wqkv=make_linear(qkv_matrix(r, p, c, unpermute), mode),
            wo=make_linear(r.matrix(p + "attn_output.weight", (d, c.n_heads * hd)), mode),
            ffn_norm=r.vector(p + "ffn_norm.weight", d), w_gate_up=gate_up, w_down=down, moe=moe, bqkv=bias))
    embed, head, tied = embedding_and_head(r, c, mode)
    freq = gguf.dequantize("rope_freqs.weight") if r.has("rope_freqs.weight") else None
    bias = r.vector("output.bias", c.vocab_size) if head_bias and r.has("output.bias") else None
    return Weights(c, mode, layers, embed, r.vector("output_norm.weight", d), head, tied, freq_factors=freq,
                   head_bias=bias)


class LlamaModel(TransformerModel):
    tp_split = {"attn_norm": "replicate", "wqkv": "qkv", "wo": "heads_rows", "ffn_norm": "replicate",
                "w_gate_up": "gate_up", "w_down": "ffn_rows", "moe": "experts", "bqkv": "qkv_vector"}
    def __init__(self, config: LlamaConfig, weights: Weights):
        c = config
        kind = rope_kind(c, freq_factors=weights.freq_factors)
        super().__init__(config, weights, [kind], [0] * c.n_layers, c.head_dim ** -0.5)

    def forward_reference(self, token_ids, positions=None) -> np.ndarray:
        """Logits (T, V) for one whole sequence, recomputed from scratch: no cache, no fusion tricks."""
        c, w = self.config, self.weights
        token_ids = np.asarray(token_ids, dtype=np.int64)
        T, H, Hkv, hd = len(token_ids), c.n_heads, c.n_kv_heads, c.head_dim
        positions = np.arange(T) if positions is None else np.asarray(positions, dtype=np.int64)
        cos, sin = self.kinds[0].cos_sin(positions)
        x = w.embed(token_ids) * np.float32(self.embed_scale or 1.0)       # Granite's multipliers or 1
        res, logit = np.float32(self.residual_scale or 1.0), np.float32(self.logit_scale or 1.0)
        for L in w.layers:
            qkv = rms_norm(x, L.attn_norm, c.rms_eps) @ L.wqkv
            q, k, v = np.split(qkv if L.bqkv is None else qkv + L.bqkv, [H * hd, (H + Hkv) * hd], axis=1)
            q = apply_rope(q.reshape(T, H, hd), cos, sin)
            k = apply_rope(k.reshape(T, Hkv, hd), cos, sin)
            h = attention(q, k, v.reshape(T, Hkv, hd), offset=0, scale=self.scale,
                          window=self.kinds[0].window).reshape(T, H * hd)
            x = x + res * (h @ L.wo)
            x = x + res * self.ffn_reference(L, rms_norm(x, L.ffn_norm, c.rms_eps))
        logits = rms_norm(x, w.output_norm, c.rms_eps) @ w.head
        return (logits if w.head_bias is None else logits + w.head_bias) / logit

    def layer(self, i, L, p, slots, kv, b, ops=EAGER) -> None:
        """One layer over the step's T tokens, in place on b.x. ``p``: this kind of layer's part of the plan;
        ``ops``: runs each call now, or also records it into a captured step (S13, models/base.py EagerOps)."""
        c = self.config
        H, Hkv, hd = c.n_heads, c.n_kv_heads, c.head_dim
        T = b.x.shape[0]
        ops.rms_norm(b.x, L.attn_norm, c.rms_eps, b.xn)    # attn_norm None: folded into wqkv at load
        ops.matmul(L.wqkv, b.xn, b.qkv)
        if L.bqkv is not None:
            ops.call(np.add, b.qkv, L.bqkv, b.qkv)
        # Q and K heads are adjacent columns of qkv: rotate them in one call
        ops.rope(b.qkv[:, :(H + Hkv) * hd].reshape(T, H + Hkv, hd), p.cos, p.sin, b.qk_rot, b.rope_tmp)
        ops.call(kv.write, i, slots, b.qk_rot[:, H:], b.qkv[:, (H + Hkv) * hd:].reshape(T, Hkv, hd))
        ops.attention(i, b.qk_rot[:, :H], kv, p.attention, b.attn, b, self.scale)
        ops.matmul(L.wo, b.attn.reshape(T, H * hd), b.proj)
        self.add_residual(b, ops)                         # b.x += b.proj (Granite: scaled)
        ops.rms_norm(b.x, L.ffn_norm, c.rms_eps, b.xn)
        self.feed_forward(i, L, b, ops)                   # gated MLP, or the experts (S16)
        self.add_residual(b, ops)


def build(gguf, mode: str = "resident"):
    """(config, weights, model) for a llama GGUF."""
    c = read_config(gguf)
    w = load_weights(gguf, c, mode)
    return c, w, LlamaModel(c, w)
