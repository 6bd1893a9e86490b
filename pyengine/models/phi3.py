"""S03: the Phi-3 architecture (``phi3``: Phi-3/3.5-mini, Phi-4-mini), over GGUF weights.

    per layer:  x += Wo · attention(rope(Wq · norm(x)), rope(Wk · norm(x)), Wv · norm(x))
                x += Wdown · (silu(Wgate · norm(x)) * Wup · norm(x))
    logits = head · norm(x)

A Llama layer (models/llama.py runs it) read from other tensors: Q|K|V fused in one ``attn_qkv`` (or three,
as some converted files hold them) and gate|up in one ``ffn_up``. What differs in the math:
  partial rotary   ``rope.dimension_count`` < head_dim (Phi-4-mini: 96 of 128): the first rope_dim dimensions
                   of each head turn, in half-split pairs, the rest pass unrotated. The loader reorders each Q/K
                   head's rows (layers/rotary.py ``partial_rotary_order``) so that apply_rope's whole-head pairs
                   are those pairs, the unrotated ones getting frequency 0: the fast path is Llama's unchanged.
  LongRoPE         the file's ``rope_factors_short`` / ``rope_factors_long`` (rope_dim/2 divisors of the
                   frequencies) and an attention factor multiplying cos and sin (``rope.scaling.attn_factor``,
                   else sqrt(1 + ln(context / orig) / ln(orig))). The long factors are used when the context the
                   engine plans (its max_model_len) exceeds the original context (``rope.scaling.
                   original_context_length``), the short ones otherwise: llama.cpp's rule, fixed per engine.
  sliding window   ``attention.sliding_window`` on every layer, when the file has one.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pyengine.config import ModelConfig
from pyengine.gguf import GGUFError
from pyengine.layers.linear import QuantMatrix, make_linear
from pyengine.layers.rotary import (longrope_attention_factor, longrope_inv_freq, partial_rotary_order,
                                    partial_rotary_pad, rope_inv_freq, yarn_attention_factor)
from pyengine.models import llama
from pyengine.models.base import LayerKind, TensorReader, TransformerModel, Weights, embedding_and_head

ARCH = "phi3"


@dataclass(frozen=True)
class Phi3Config(ModelConfig):
    sliding_window: int = 0        # keys every layer sees (i - j < sliding_window); 0: the whole context
    longrope: bool = False         # the file has rope_factors_short / rope_factors_long
    attn_factor: float = 1.0       # LongRoPE: cos and sin times this
    moe: None = None               # (a dense model: the Llama layer's MoE fields stay empty)


def read_config(gguf) -> Phi3Config:
    c = ModelConfig.from_gguf(gguf, partial_rotary=True)
    md = gguf.metadata
    window = md.get(f"{ARCH}.attention.sliding_window", 0)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise GGUFError(f"metadata key '{ARCH}.attention.sliding_window' = {window!r:.40} must be a non-negative "
                        "integer")
    names = ("rope_factors_short.weight", "rope_factors_long.weight")
    has = [n in gguf.tensors for n in names]
    if any(has) and not all(has):
        raise GGUFError(f"LongRoPE needs both tensors {names[0]!r} and {names[1]!r}; the file has only "
                        f"{names[has.index(True)]!r}")
    longrope = all(has)
    factor = md.get(f"{ARCH}.rope.scaling.attn_factor")
    if factor is None:
        factor = longrope_attention_factor(c.context_length, c.rope_orig_context) if longrope else 1.0
    elif isinstance(factor, bool) or not isinstance(factor, (int, float)) or not np.isfinite(factor) or factor <= 0:
        raise GGUFError(f"metadata key '{ARCH}.rope.scaling.attn_factor' = {factor!r:.40} must be a positive number")
    if window and window >= c.context_length:
        window = 0                 # a window as wide as the context hides nothing
    return Phi3Config(**c.to_dict(), sliding_window=window, longrope=longrope, attn_factor=float(factor))


def _qk_rows(m: QuantMatrix, heads: int, order: np.ndarray) -> QuantMatrix:
    """The rows of a Q or K matrix with each head's dimensions in ``order`` (whole quantized rows: exact)."""
    (raw, t), = m.parts
    hd = order.size
    idx = (np.arange(heads)[:, None] * hd + order[None, :]).reshape(-1)
    return QuantMatrix([(np.ascontiguousarray(raw[idx]), t)], m.cols)


def load_weights(gguf, c: Phi3Config, mode: str = "resident") -> Weights:
    r = TensorReader(gguf)
    H, Hkv, hd, d, F = c.n_heads, c.n_kv_heads, c.head_dim, c.d_model, c.ffn_dim
    order = partial_rotary_order(hd, c.rope_dim)
    layers = []
    for i in range(c.n_layers):
        p = f"blk.{i}."
        if r.has(p + "attn_qkv.weight"):
            (raw, t), = r.matrix(p + "attn_qkv.weight", ((H + 2 * Hkv) * hd, d)).parts
            q, k, v = (QuantMatrix([(raw[a:b], t)], d) for a, b in
                       ((0, H * hd), (H * hd, (H + Hkv) * hd), ((H + Hkv) * hd, (H + 2 * Hkv) * hd)))
        else:
            q, k, v = (r.matrix(p + f"attn_{n}.weight", (rows * hd, d)) for n, rows in (("q", H), ("k", Hkv),
                                                                                       ("v", Hkv)))
        qkv = QuantMatrix.stack(_qk_rows(q, H, order), _qk_rows(k, Hkv, order), v)
        if r.has(p + "ffn_gate.weight"):
            gate_up = QuantMatrix.stack(r.matrix(p + "ffn_gate.weight", (F, d)), r.matrix(p + "ffn_up.weight", (F, d)))
        else:                                  # fused: rows gate | up
            gate_up = r.matrix(p + "ffn_up.weight", (2 * F, d))
        layers.append(llama.LlamaLayer(
            attn_norm=r.vector(p + "attn_norm.weight", d), wqkv=make_linear(qkv, mode),
            wo=make_linear(r.matrix(p + "attn_output.weight", (d, H * hd)), mode),
            ffn_norm=r.vector(p + "ffn_norm.weight", d), w_gate_up=make_linear(gate_up, mode, act="silu"),
            w_down=make_linear(r.matrix(p + "ffn_down.weight", (d, F)), mode)))
    embed, head, tied = embedding_and_head(r, c, mode)
    factors = {}
    if c.longrope:
        factors = {n: r.vector(f"rope_factors_{n}.weight", c.rope_dim // 2) for n in ("short", "long")}
    return Weights(c, mode, layers, embed, r.vector("output_norm.weight", d), head, tied, rope_factors=factors)


class Phi3Model(llama.LlamaModel):
    def __init__(self, config: Phi3Config, weights: Weights):
        c = self.config = config
        self.rope_kinds = {}
        for which in ("short", "long") if c.longrope else ("none",):
            factor = c.attn_factor
            if c.longrope:
                inv = longrope_inv_freq(c.rope_dim, c.rope_theta, weights.rope_factors[which])
            else:
                inv = rope_inv_freq(c.rope_dim, c.rope_theta, c.rope_scaling_type, c.rope_scaling_factor,
                                    c.rope_orig_context, beta_fast=c.rope_beta_fast, beta_slow=c.rope_beta_slow)
                if c.rope_scaling_type == "yarn":
                    factor = yarn_attention_factor(c.rope_scaling_factor, c.attn_factor)
            m = partial_rotary_pad(np.full(inv.size, factor), c.head_dim, 1.0) if factor != 1.0 else None
            self.rope_kinds[which] = LayerKind(c.sliding_window or None, partial_rotary_pad(inv, c.head_dim, 0.0), m)
        TransformerModel.__init__(self, config, weights, [self.kind_for(c.context_length)], [0] * c.n_layers,
                                  c.head_dim ** -0.5)

    def kind_for(self, context: int) -> LayerKind:
        """The RoPE of an engine planning ``context`` positions: LongRoPE's long factors past the original
        context, else the short ones."""
        if not self.config.longrope:
            return self.rope_kinds["none"]
        return self.rope_kinds["long" if context > self.config.rope_orig_context else "short"]

    def prepare(self, b) -> None:
        self.kinds = [self.kind_for(b.rope_tables[0][0].shape[0])]     # the engine's max_model_len
        super().prepare(b)


def build(gguf, mode: str = "resident"):
    """(config, weights, model) for a phi3 GGUF."""
    c = read_config(gguf)
    w = load_weights(gguf, c, mode)
    return c, w, Phi3Model(c, w)
