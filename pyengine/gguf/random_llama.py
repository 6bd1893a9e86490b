"""S21: a seeded random llama GGUF of any shape in llama.cpp's Q4_K_M type mix, written with pyengine's own writer
(``writer.write_gguf``): the TinyLlama-1.1B shape for the picoLM comparison (scripts/compare_picolm.py) and tiny
ones for tests of the streaming lean mode.

The weights are random *quantized blocks* (random nibbles, random 6-bit sub-block scales and mins, float16
super-block scales chosen so a weight's standard deviation is ~``std``): drawing float32 weights first and
quantizing 1.1B of them would take many minutes, and any block is a valid weight. Q4_K_M's mix, as llama.cpp's
``llama_tensor_get_type`` picks it for llama: Q4_K everywhere except attn_v and ffn_down in the layers
``use_more_bits`` selects (the first and last eighth, and every third in between) and the output head: Q6_K.
The vocabulary is SentencePiece-style ("llama": <unk> <s> </s>, 256 byte pieces, the printable ASCII
characters and "▁", then 4-hex-digit filler pieces that no text merges into), so picoLM and pyengine tokenize
a plain ASCII prompt to the same ids.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pyengine.gguf.quants import GGML_BLOCK, GGMLType
from pyengine.gguf.writer import TensorOut, write_gguf


class LlamaShape(NamedTuple):
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab: int
    context: int


TINYLLAMA_1_1B = LlamaShape(2048, 22, 32, 4, 5632, 32000, 2048)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in the _M mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _q4_k(rng, rows: int, cols: int, std: float) -> np.ndarray:
    n = rows * cols // 256
    b = np.zeros(n, GGML_BLOCK[GGMLType.Q4_K].dtype)
    b["qs"] = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    b["scales"] = rng.integers(0, 256, (n, 12), dtype=np.uint8)       # 6-bit scales and mins, uniform 0..63
    d = std / (32 * 4.6)                     # q uniform 0..15 (std 4.6) times a scale of ~32
    b["d"] = d
    b["dmin"] = d * 7.5                      # the min cancels the mean of q (7.5) on average
    return b.view(np.uint8).reshape(rows, -1)


def _q6_k(rng, rows: int, cols: int, std: float) -> np.ndarray:
    n = rows * cols // 256
    b = np.zeros(n, GGML_BLOCK[GGMLType.Q6_K].dtype)
    b["ql"] = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    b["qh"] = rng.integers(0, 256, (n, 64), dtype=np.uint8)
    b["scales"] = rng.integers(-20, 21, (n, 16), dtype=np.int8)
    b["d"] = std / (12 * 18.5)               # (q - 32) std 18.5, scale rms 12
    return b.view(np.uint8).reshape(rows, -1)


def vocabulary(n: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of the SentencePiece-style vocabulary of ``n`` pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [2, 3, 3] + [6] * 256
    tokens += ["\u2581"] + [chr(c) for c in range(33, 127)]
    tokens += [f"{i:04x}" for i in range(n - len(tokens))]
    types += [1] * (n - len(types))
    if len(tokens) != n:
        raise ValueError(f"a vocabulary needs at least {len(types)} pieces, got {n}")
    return tokens, [0.0] * n, types


def write_random_llama(path, shape: LlamaShape = TINYLLAMA_1_1B, seed: int = 0, std: float = 0.02) -> int:
    """Write the seeded random model to ``path``; returns its size in bytes. Rows must be multiples of 256."""
    if shape.d_model % 256 or shape.ffn_dim % 256:
        raise ValueError(f"d_model and ffn_dim must be multiples of 256 (K-quant super-blocks), got {shape}")
    rng = np.random.default_rng(seed)
    d, hd = shape.d_model, shape.d_model // shape.n_heads
    kv = shape.n_kv_heads * hd
    tokens, scores, types = vocabulary(shape.vocab)
    meta = {"general.architecture": "llama", "general.name": f"random-llama-{seed}",
            "general.file_type": 15,                                        # LLAMA_FTYPE_MOSTLY_Q4_K_M
            "llama.context_length": shape.context, "llama.embedding_length": d,
            "llama.block_count": shape.n_layers, "llama.feed_forward_length": shape.ffn_dim,
            "llama.attention.head_count": shape.n_heads, "llama.attention.head_count_kv": shape.n_kv_heads,
            "llama.rope.dimension_count": hd, "llama.rope.freq_base": 10000.0,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": shape.vocab,
            "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": np.asarray(scores, np.float32),
            "tokenizer.ggml.token_type": np.asarray(types, np.int32),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.add_bos_token": True}                          # as TinyLlama (and picoLM always)
    mtypes = {k: 4 for k, v in meta.items() if type(v) is int}
    out: list[TensorOut] = []

    def mat(name, rows, cols, q6=False):
        seed_i = int(rng.integers(1 << 63))          # each tensor drawn when written: one in memory at a time
        t = GGMLType.Q6_K if q6 else GGMLType.Q4_K
        fn = _q6_k if q6 else _q4_k
        out.append(TensorOut(name, (rows, cols), int(t),
                             lambda: fn(np.random.default_rng(seed_i), rows, cols, std)))

    def norm(name):
        out.append(TensorOut(name, (d,), int(GGMLType.F32),
                             (1 + 0.05 * rng.standard_normal(d)).astype(np.float32).view(np.uint8)))

    mat("token_embd.weight", shape.vocab, d)
    for i in range(shape.n_layers):
        p, more = f"blk.{i}.", use_more_bits(i, shape.n_layers)
        norm(p + "attn_norm.weight")
        mat(p + "attn_q.weight", d, d)
        mat(p + "attn_k.weight", kv, d)
        mat(p + "attn_v.weight", kv, d, q6=more)
        mat(p + "attn_output.weight", d, d)
        norm(p + "ffn_norm.weight")
        mat(p + "ffn_gate.weight", shape.ffn_dim, d)
        mat(p + "ffn_up.weight", shape.ffn_dim, d)
        mat(p + "ffn_down.weight", d, shape.ffn_dim, q6=more)
    norm("output_norm.weight")
    mat("output.weight", shape.vocab, d, q6=True)
    with open(path, "wb") as f:
        return write_gguf(f, meta, out, mtypes)
