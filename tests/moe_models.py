"""Tiny random mixture-of-experts models (S16) shared by scripts/make_golden_moe.py (which runs HF transformers'
own classes on them and records tests/golden/moe_*.json) and the tests (which rebuild the same GGUF from the
seed and compare pyengine's numbers with HF's).

Every weight comes from a seeded NumPy generator, in llama.cpp's GGUF names and layouts (experts stacked
(E, rows, cols), Q/K rows of a llama file permuted for interleaved RoPE, as convert_hf_to_gguf.py writes them);
matrices are stored Q8_0 and HF gets their dequantized values, so both sides multiply the very same numbers.
The tokenizer is SmolLM2's (its ``tokenizer.*`` metadata copied from the default model's GGUF), so real text
goes through. ``digest`` fingerprints the weights: the golden file records it and the tests check it, so an
RNG or quantizer change shows up as such rather than as a numeric mismatch.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from tiny_models import write_tensors

VOCAB = 49152                 # SmolLM2's tokenizer
COMMON = dict(d=64, heads=4, kv_heads=2, layers=3, experts=8, used=2, expert_ffn=64, ctx=4096, eps=1e-6)
# variant -> GGUF architecture, its own shape and options
VARIANTS = {
    "qwen3moe": dict(arch="qwen3moe", head_dim=32, ffn=128, theta=1e6, tied=True, qk_norm=True, norm=True),
    "qwen2moe": dict(arch="qwen2moe", head_dim=16, ffn=128, theta=1e6, tied=False, qkv_bias=True, norm=False,
                     shared_ffn=96),
    "mixtral": dict(arch="llama", head_dim=16, theta=1e4, tied=False, norm=True, permute=True),
    "olmoe": dict(arch="olmoe", head_dim=16, theta=1e4, tied=False, norm=False, qk_norm_whole=True),
    "granitemoe": dict(arch="granitemoe", head_dim=16, theta=1e4, tied=False, norm=True, permute=True,
                       scales={"embedding_scale": 2.0, "residual_scale": 0.5, "attention.scale": 0.15,
                               "logit_scale": 2.0}),
}
SEEDS = {"qwen3moe": 31, "qwen2moe": 32, "mixtral": 33, "olmoe": 34, "granitemoe": 35}


def shape(variant: str) -> dict:
    return {**COMMON, **VARIANTS[variant]}


def permute_for_interleaved_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's Q/K rows -> llama.cpp's stored order (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_for_interleaved_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse: llama.cpp's stored Q/K rows -> HF's."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(variant: str) -> dict[str, np.ndarray]:
    """The float32 weights in llama.cpp's names, as HF holds them (Q/K rows in HF's order), before quantizing."""
    s = shape(variant)
    rng = np.random.default_rng(SEEDS[variant])
    d, H, Hkv, hd, E, f = s["d"], s["heads"], s["kv_heads"], s["head_dim"], s["experts"], s["expert_ffn"]

    def mat(*shape_, scale=0.2):
        return (rng.standard_normal(shape_) * scale).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": mat(VOCAB, d, scale=1.0), "output_norm.weight": norm(d)}
    if not s["tied"]:
        t["output.weight"] = mat(VOCAB, d, scale=0.3)
    for i in range(s["layers"]):
        p = f"blk.{i}."
        t.update({p + "attn_norm.weight": norm(d), p + "attn_q.weight": mat(H * hd, d),
                  p + "attn_k.weight": mat(Hkv * hd, d), p + "attn_v.weight": mat(Hkv * hd, d),
                  p + "attn_output.weight": mat(d, H * hd), p + "ffn_norm.weight": norm(d),
                  p + "ffn_gate_inp.weight": mat(E, d, scale=0.5),
                  p + "ffn_gate_exps.weight": mat(E, f, d), p + "ffn_up_exps.weight": mat(E, f, d),
                  p + "ffn_down_exps.weight": mat(E, d, f)})
        if s.get("qk_norm"):
            t.update({p + "attn_q_norm.weight": norm(hd), p + "attn_k_norm.weight": norm(hd)})
        if s.get("qk_norm_whole"):             # OLMoE: over all query / all key columns
            t.update({p + "attn_q_norm.weight": norm(H * hd), p + "attn_k_norm.weight": norm(Hkv * hd)})
        if s.get("qkv_bias"):
            t.update({p + "attn_q.bias": mat(H * hd, scale=0.1), p + "attn_k.bias": mat(Hkv * hd, scale=0.1),
                      p + "attn_v.bias": mat(Hkv * hd, scale=0.1)})
        if s.get("shared_ffn"):
            fs = s["shared_ffn"]
            t.update({p + "ffn_gate_inp_shexp.weight": mat(d, scale=0.3), p + "ffn_gate_shexp.weight": mat(fs, d),
                      p + "ffn_up_shexp.weight": mat(fs, d), p + "ffn_down_shexp.weight": mat(d, fs)})
    return t


def quantized(variant: str) -> tuple[dict, dict]:
    """(stored, hf): per tensor name the bytes to write ((raw uint8, ggml type) for Q8_0, float32 otherwise)
    and the float32 values HF gets (dequantized; Q/K rows in HF's order)."""
    import gguf

    s = shape(variant)
    stored, hf = {}, {}
    for name, a in hf_tensors(variant).items():
        if a.ndim >= 2 and not name.endswith("ffn_gate_inp.weight"):
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            hf[name] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).astype(np.float32)
            if s.get("permute") and (name.endswith("attn_q.weight") or name.endswith("attn_k.weight")):
                q = permute_for_interleaved_rope(q, s["heads"] if "attn_q" in name else s["kv_heads"])
            stored[name] = (q, gguf.GGMLQuantizationType.Q8_0)
        else:                                             # norms, biases, the router: float32
            stored[name] = hf[name] = a
    return stored, hf


def digest(stored: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(stored):
        v = stored[name]
        h.update(name.encode() + np.ascontiguousarray(v[0] if isinstance(v, tuple) else v).tobytes())
    return h.hexdigest()[:16]


def tokenizer_metadata(tokenizer_gguf) -> dict:
    """The ``tokenizer.*`` keys of a GGUF (SmolLM2's), to copy into the tiny models."""
    from pyengine.gguf.reader import GGUFFile
    md = GGUFFile(str(tokenizer_gguf)).metadata
    return {k: v for k, v in md.items() if k.startswith("tokenizer.")}


def write_moe(path: Path, variant: str, tokenizer_gguf, split_experts: bool = False) -> str:
    """Write the variant's GGUF at ``path``; returns the weights' digest. ``split_experts``: one tensor per
    expert (``blk.N.ffn_gate.E.weight``), the layout of Mixtral files converted before llama.cpp stacked them."""
    import gguf

    s = shape(variant)
    arch = s["arch"]
    stored, _ = quantized(variant)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", s["layers"])
    w.add_uint32(f"{arch}.embedding_length", s["d"])
    w.add_uint32(f"{arch}.attention.head_count", s["heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", s["kv_heads"])
    w.add_uint32(f"{arch}.attention.key_length", s["head_dim"])
    w.add_uint32(f"{arch}.attention.value_length", s["head_dim"])
    w.add_uint32(f"{arch}.context_length", s["ctx"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", s["eps"])
    w.add_float32(f"{arch}.rope.freq_base", s["theta"])
    w.add_uint32(f"{arch}.expert_count", s["experts"])
    w.add_uint32(f"{arch}.expert_used_count", s["used"])
    for key, value in s.get("scales", {}).items():      # Granite's multipliers
        w.add_float32(f"{arch}.{key}", value)
    if arch in ("llama", "olmoe", "granitemoe"):    # the experts' rows are feed_forward_length
        w.add_uint32(f"{arch}.feed_forward_length", s["expert_ffn"])
    else:
        w.add_uint32(f"{arch}.feed_forward_length", s["ffn"])
        w.add_uint32(f"{arch}.expert_feed_forward_length", s["expert_ffn"])
    if s.get("shared_ffn"):
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", s["shared_ffn"])
    for key, value in tokenizer_metadata(tokenizer_gguf).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, [int(x) for x in value] if isinstance(value, np.ndarray) else list(value))
    tensors = {}
    for name, v in stored.items():
        if split_experts and name.endswith("_exps.weight"):
            tensors.update({f"{name[:-len('_exps.weight')]}.{e}.weight": (v[0][e], v[1]) for e in range(len(v[0]))})
        else:
            tensors[name] = v
    write_tensors(w, tensors)
    return digest(stored)
