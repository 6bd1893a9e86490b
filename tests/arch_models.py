"""Tiny seeded models of the dense families of issue 30 (qwen2, qwen3, gemma2, phi3) with SmolLM2's vocabulary,
shared by tests/test_model_arch_golden.py and scripts/make_golden_arch.py (which records what HF transformers'
own model classes compute for them, tests/golden/arch_<variant>.json).

As tests/moe_models.py does for the MoE families: matrices are stored Q8_0 and HF gets their dequantized values,
so both sides multiply the very same numbers; norms, biases and RoPE factors are float32. Q/K rows are stored as
llama.cpp's converter writes them for these families (unpermuted: their RoPE is the half-split form); phi3's
Q|K|V and gate|up are stored fused, as llama.cpp's converter writes them. ``digest`` fingerprints the weights.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from moe_models import digest, tokenizer_metadata
from tiny_models import write_tensors

VOCAB = 49152                 # SmolLM2's tokenizer
COMMON = dict(d=64, heads=4, kv_heads=2, layers=3, ffn=128, ctx=4096, eps=1e-6)
VARIANTS = {
    # untied head with an output.bias (HF: lm_head given a bias)
    "qwen2": dict(arch="qwen2", head_dim=16, theta=1e6, tied=False, qkv_bias=True, head_bias=True),
    # head_dim 32 != d / H = 16, as in the real models (128 != d / H)
    "qwen3": dict(arch="qwen3", head_dim=32, theta=1e6, tied=True, qk_norm=True),
    # YaRN (Qwen3's long-context setting) x4 over an original context of 32: most pairs interpolated, the
    # attention factor 1 + 0.1 ln 4 on cos and sin
    "qwen3yarn": dict(arch="qwen3", head_dim=32, theta=1e6, tied=True, qk_norm=True,
                      rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    # window 8 (the prompts cross it), soft caps that bend the scores and logits, a query scale from metadata
    # (HF query_pre_attn_scalar 24: not a power of two) and head_dim 32 != d / H
    # (untied here: a tied random model predicts its input token, the embedding dominating the residual stream;
    # the tiny model of tests/tiny_models.py covers the tied head)
    "gemma2": dict(arch="gemma2", head_dim=32, theta=1e4, tied=False, sandwich=True, window=8, attn_softcap=4.0,
                   final_softcap=15.0, query_scalar=24, embed_scale=0.3, head_scale=0.6),
    # partial rotary (12 of 16 dims, Phi-4-mini's 0.75), LongRoPE's short factors (the engine's context is within
    # the original 4096) with the default attention factor of an 8192 context, a sliding window of 12 on every
    # layer, fused Q|K|V and gate|up
    "phi3": dict(arch="phi3", head_dim=16, rope_dim=12, theta=1e4, tied=False, ctx=8192, orig_ctx=4096, window=12,
                 fused=True),
    # LongRoPE's long factors: an original context of 4, so every prompt is past it (HF switches per forward on
    # the sequence length, the engine per max_model_len: both long here); the attention factor from metadata
    "phi3long": dict(arch="phi3", head_dim=16, rope_dim=12, theta=1e4, tied=False, ctx=4096, orig_ctx=4,
                     attn_factor=1.3, fused=True),
}
SEEDS = {"qwen2": 41, "qwen3": 42, "gemma2": 43, "phi3": 44, "phi3long": 45, "qwen3yarn": 46}


def shape(variant: str) -> dict:
    return {**COMMON, **VARIANTS[variant]}


def hf_tensors(variant: str) -> dict[str, np.ndarray]:
    """The float32 weights in llama.cpp's names (before quantizing), Q/K rows in HF's order."""
    s = shape(variant)
    rng = np.random.default_rng(SEEDS[variant])
    d, H, Hkv, hd, f = s["d"], s["heads"], s["kv_heads"], s["head_dim"], s["ffn"]

    def mat(*shape_, scale=0.2):
        return (rng.standard_normal(shape_) * scale).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": mat(VOCAB, d, scale=s.get("embed_scale", 1.0)), "output_norm.weight": norm(d)}
    if not s["tied"]:
        t["output.weight"] = mat(VOCAB, d, scale=s.get("head_scale", 0.3))
    if s.get("head_bias"):
        t["output.bias"] = mat(VOCAB, scale=0.5)
    for i in range(s["layers"]):
        p = f"blk.{i}."
        t.update({p + "attn_norm.weight": norm(d), p + "attn_q.weight": mat(H * hd, d),
                  p + "attn_k.weight": mat(Hkv * hd, d), p + "attn_v.weight": mat(Hkv * hd, d),
                  p + "attn_output.weight": mat(d, H * hd), p + "ffn_norm.weight": norm(d),
                  p + "ffn_gate.weight": mat(f, d), p + "ffn_up.weight": mat(f, d), p + "ffn_down.weight": mat(d, f)})
        if s.get("qk_norm"):
            t.update({p + "attn_q_norm.weight": norm(hd), p + "attn_k_norm.weight": norm(hd)})
        if s.get("sandwich"):
            t.update({p + "post_attention_norm.weight": norm(d), p + "post_ffw_norm.weight": norm(d)})
        if s.get("qkv_bias"):
            t.update({p + "attn_q.bias": mat(H * hd, scale=0.1), p + "attn_k.bias": mat(Hkv * hd, scale=0.1),
                      p + "attn_v.bias": mat(Hkv * hd, scale=0.1)})
    if s.get("rope_dim"):                          # LongRoPE's per-pair divisors
        half = s["rope_dim"] // 2
        t["rope_factors_short.weight"] = (1.0 + 0.2 * rng.random(half)).astype(np.float32)
        t["rope_factors_long.weight"] = (1.0 + 3.0 * rng.random(half)).astype(np.float32)
    return t


def quantized(variant: str) -> tuple[dict, dict]:
    """(stored, hf): per tensor name the bytes to write ((raw uint8, ggml type) for Q8_0, float32 otherwise)
    and the float32 values HF gets (dequantized; Gemma's norms: llama.cpp stores 1 + w, HF holds w)."""
    import gguf

    s = shape(variant)
    stored, hf = {}, {}
    for name, a in hf_tensors(variant).items():
        if a.ndim >= 2:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            hf[name] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).astype(np.float32)
            stored[name] = (q, gguf.GGMLQuantizationType.Q8_0)
        else:
            stored[name] = hf[name] = a
            if s["arch"].startswith("gemma") and name.endswith("norm.weight"):
                hf[name] = a - np.float32(1)       # exact: a is within [0.5, 2]
                assert np.all(hf[name] + np.float32(1) == a)
    if s.get("fused"):         # phi3: Q|K|V in attn_qkv, gate|up in ffn_up (Q8_0 rows quantize independently)
        for i in range(s["layers"]):
            p = f"blk.{i}."
            for fused, parts in (("attn_qkv", ("attn_q", "attn_k", "attn_v")), ("ffn_up", ("ffn_gate", "ffn_up"))):
                raws = [stored.pop(p + n + ".weight")[0] for n in parts]
                stored[p + fused + ".weight"] = (np.concatenate(raws), gguf.GGMLQuantizationType.Q8_0)
    return stored, hf


def write_arch(path: Path, variant: str, tokenizer_gguf) -> str:
    """Write the variant's GGUF at ``path``; returns the weights' digest."""
    import gguf

    s = shape(variant)
    arch = s["arch"]
    stored, _ = quantized(variant)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", s["layers"])
    w.add_uint32(f"{arch}.embedding_length", s["d"])
    w.add_uint32(f"{arch}.feed_forward_length", s["ffn"])
    w.add_uint32(f"{arch}.attention.head_count", s["heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", s["kv_heads"])
    w.add_uint32(f"{arch}.attention.key_length", s["head_dim"])
    w.add_uint32(f"{arch}.attention.value_length", s["head_dim"])
    w.add_uint32(f"{arch}.context_length", s["ctx"])
    if s.get("rope_dim"):
        w.add_uint32(f"{arch}.rope.dimension_count", s["rope_dim"])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", s["orig_ctx"])
    if arch == "phi3" and s.get("window"):
        w.add_uint32(f"{arch}.attention.sliding_window", s["window"])
    if s.get("rope", {}).get("rope_type") == "yarn":
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", s["rope"]["factor"])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", s["rope"]["original_max_position_embeddings"])
    if s.get("attn_factor"):
        w.add_float32(f"{arch}.rope.scaling.attn_factor", s["attn_factor"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", s["eps"])
    w.add_float32(f"{arch}.rope.freq_base", s["theta"])
    if arch == "gemma2":
        w.add_uint32(f"{arch}.attention.sliding_window", s["window"])
        w.add_float32(f"{arch}.attn_logit_softcapping", s["attn_softcap"])
        w.add_float32(f"{arch}.final_logit_softcapping", s["final_softcap"])
        w.add_float32(f"{arch}.attention.scale", s["query_scalar"] ** -0.5)
    for key, value in tokenizer_metadata(tokenizer_gguf).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, [int(x) for x in value] if isinstance(value, np.ndarray) else list(value))
    write_tensors(w, stored)
    return digest(stored)
