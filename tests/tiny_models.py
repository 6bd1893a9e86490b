"""Tiny random GGUFs of every architecture in the registry, written by the tests themselves (gguf.GGUFWriter),
seeded, a few hundred kB: the contract tests (tests/test_model_contracts.py) build each one and check the same
properties, so a new architecture gets them by adding its shape here.

Matrices are stored Q8_0 (real quantized rows: lean mode dequantizes them), norms F32, with llama.cpp's tensor
names and metadata keys for the architecture.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

D, H, HKV, HD, F, VOCAB, LAYERS = 64, 4, 2, 16, 96, 320, 3
SLIDING_WINDOW = 24          # gemma3: small, so that contexts of ~60 tokens cross it
N_EXPERTS, N_USED, EXPERT_F, SHARED_F = 8, 2, 32, 64    # MoE variants (S16)
# variant -> GGUF general.architecture (Mixtral is a llama file with llama.expert_count)
ARCH_OF = {"llama": "llama", "gemma3": "gemma3", "qwen3moe": "qwen3moe", "qwen2moe": "qwen2moe",
           "mixtral": "llama", "olmoe": "olmoe", "granitemoe": "granitemoe", "qwen2": "qwen2", "qwen3": "qwen3",
           "gemma2": "gemma2", "phi3": "phi3"}
NEW = ("qwen2", "qwen3", "gemma2", "phi3")   # issue 30's dense families: TP/PP run together (test_model_contracts.py)
PHI3_ROPE_DIM, PHI3_ORIG_CTX, PHI3_WINDOW = 8, 64, 40    # partial rotary (8 of 16); LongRoPE past 64 positions
HEAD_DIM = {"gemma3": HD, "qwen3moe": HD, "qwen3": 2 * HD}     # from attention.key_length; others: D / H
MOE = ("qwen3moe", "qwen2moe", "mixtral", "olmoe", "granitemoe")


def _arch_tensors(arch: str, rng) -> dict[str, np.ndarray]:
    def mat(rows, cols, scale=0.2):
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm(n, base=1.0):
        return (base + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": mat(VOCAB, D, 0.5), "output_norm.weight": norm(D)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        hd = HEAD_DIM.get(arch, D // H)
        t.update({p + "attn_norm.weight": norm(D), p + "attn_q.weight": mat(H * hd, D),
                  p + "attn_k.weight": mat(HKV * hd, D), p + "attn_v.weight": mat(HKV * hd, D),
                  p + "attn_output.weight": mat(D, H * hd), p + "ffn_norm.weight": norm(D)})
        if arch in MOE and not (arch == "qwen3moe" and i == 1):       # qwen3moe: layer 1 dense (mlp_only)
            t.update({p + "ffn_gate_inp.weight": mat(N_EXPERTS, D, 0.5),
                      p + "ffn_gate_exps.weight": rng.standard_normal((N_EXPERTS, EXPERT_F, D)) * 0.2,
                      p + "ffn_up_exps.weight": rng.standard_normal((N_EXPERTS, EXPERT_F, D)) * 0.2,
                      p + "ffn_down_exps.weight": rng.standard_normal((N_EXPERTS, D, EXPERT_F)) * 0.2})
        else:
            t.update({p + "ffn_gate.weight": mat(F, D), p + "ffn_up.weight": mat(F, D),
                      p + "ffn_down.weight": mat(D, F)})
        if arch in ("gemma3", "qwen3moe", "qwen3"):
            t.update({p + "attn_q_norm.weight": norm(hd), p + "attn_k_norm.weight": norm(hd)})
        if arch == "olmoe":                  # over the whole projection, not per head
            t.update({p + "attn_q_norm.weight": norm(H * hd), p + "attn_k_norm.weight": norm(HKV * hd)})
        if arch in ("gemma3", "gemma2"):
            t.update({p + "post_attention_norm.weight": norm(D), p + "post_ffw_norm.weight": norm(D)})
        if arch in ("qwen2moe", "qwen2"):
            t.update({p + "attn_q.bias": norm(H * hd, 0.0), p + "attn_k.bias": norm(HKV * hd, 0.0),
                      p + "attn_v.bias": norm(HKV * hd, 0.0)})
        if arch == "qwen2moe":
            t.update({p + "ffn_gate_inp_shexp.weight": norm(D, 0.0),
                      p + "ffn_gate_shexp.weight": mat(SHARED_F, D), p + "ffn_up_shexp.weight": mat(SHARED_F, D),
                      p + "ffn_down_shexp.weight": mat(D, SHARED_F)})
    if arch == "phi3":             # fused Q|K|V and gate|up, as llama.cpp's converter writes them; LongRoPE factors
        for i in range(LAYERS):
            p = f"blk.{i}."
            t[p + "attn_qkv.weight"] = np.concatenate([t.pop(p + f"attn_{n}.weight") for n in "qkv"])
            t[p + "ffn_up.weight"] = np.concatenate([t.pop(p + "ffn_gate.weight"), t.pop(p + "ffn_up.weight")])
        t["rope_factors_short.weight"] = norm(PHI3_ROPE_DIM // 2)
        t["rope_factors_long.weight"] = norm(PHI3_ROPE_DIM // 2, 4.0)
    if arch in ("llama", "mixtral", "qwen2moe", "qwen2", "phi3"):
        t["output.weight"] = mat(VOCAB, D, 0.3)        # untied (gemma3 ties its head to the embedding)
    if arch == "qwen2":
        t["output.bias"] = norm(VOCAB, 0.0)
    return t


def write_tiny(path: Path, variant: str, seed: int = 0, extra_meta: dict | None = None, edit=None) -> Path:
    """A tiny random GGUF of ``variant`` (a key of ARCH_OF) at ``path``; ``extra_meta``: more uint32 keys (bad
    input tests), ``edit(tensors)``: changes the tensors before they are written."""
    import gguf

    rng = np.random.default_rng(seed)
    arch = ARCH_OF[variant]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", LAYERS)
    w.add_uint32(f"{arch}.embedding_length", D)
    w.add_uint32(f"{arch}.attention.head_count", H)
    w.add_uint32(f"{arch}.attention.head_count_kv", HKV)
    if variant not in ("mixtral", "olmoe", "granitemoe"):
        w.add_uint32(f"{arch}.feed_forward_length", F)
    if variant == "granitemoe":
        for key, v in (("embedding_scale", 3.0), ("residual_scale", 0.5), ("attention.scale", 0.2),
                       ("logit_scale", 2.5)):
            w.add_float32(f"{arch}.{key}", v)
    w.add_uint32(f"{arch}.context_length", 512)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0 if arch == "llama" else 1e6)
    if variant in MOE:
        w.add_uint32(f"{arch}.expert_count", N_EXPERTS)
        w.add_uint32(f"{arch}.expert_used_count", N_USED)
        if variant in ("mixtral", "olmoe", "granitemoe"):   # llama.cpp: the experts have feed_forward_length rows
            w.add_uint32(f"{arch}.feed_forward_length", EXPERT_F)
        else:
            w.add_uint32(f"{arch}.expert_feed_forward_length", EXPERT_F)
        if variant == "qwen2moe":
            w.add_uint32(f"{arch}.expert_shared_feed_forward_length", SHARED_F)
    if variant in ("qwen3moe", "qwen3"):
        w.add_uint32(f"{arch}.attention.key_length", HEAD_DIM[arch])
        w.add_uint32(f"{arch}.attention.value_length", HEAD_DIM[arch])
    if arch == "phi3":
        w.add_uint32(f"{arch}.rope.dimension_count", PHI3_ROPE_DIM)
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", PHI3_ORIG_CTX)
        w.add_uint32(f"{arch}.attention.sliding_window", PHI3_WINDOW)
    if arch == "gemma2":         # soft caps small enough to bend the tiny model's scores and logits
        w.add_uint32(f"{arch}.attention.sliding_window", SLIDING_WINDOW)
        w.add_float32(f"{arch}.attn_logit_softcapping", 2.0)
        w.add_float32(f"{arch}.final_logit_softcapping", 3.0)
    if arch == "gemma3":
        w.add_uint32(f"{arch}.attention.key_length", HD)
        w.add_uint32(f"{arch}.attention.value_length", HD)
        w.add_uint32(f"{arch}.attention.sliding_window", SLIDING_WINDOW)
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", 3)    # layers 0, 1 local; 2 global
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, value in (extra_meta or {}).items():
        w.add_uint32(key, value)
    tensors = _arch_tensors(variant, rng)
    if edit is not None:
        edit(tensors)
    q8 = gguf.GGMLQuantizationType.Q8_0
    write_tensors(w, {name: (gguf.quants.quantize(a.astype(np.float32), q8), q8) if a.ndim >= 2 else
                      a.astype(np.float32) for name, a in tensors.items()})
    return path


def write_tensors(w, tensors: dict) -> None:
    """Add ``tensors`` (name -> float32 array, or (raw quantized bytes, ggml type)) to a GGUFWriter and write
    the file."""
    for name, v in tensors.items():
        if isinstance(v, tuple):
            w.add_tensor(name, v[0], raw_shape=v[0].shape, raw_dtype=v[1])
        else:
            w.add_tensor(name, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


ARCHS = tuple(ARCH_OF)
