"""`pyengine quantize IN OUT --type T`: requantize a GGUF model, as `llama-quantize IN OUT T` does (S08).

Every tensor is dequantized to float32 and quantized again to the type llama.cpp's default policy gives it
(``target_type``); the metadata is copied (with ``general.file_type`` updated) and the file written by
``pyengine.gguf.writer``. The policy:
- 1-D tensors (norms, biases, RoPE factors) and tensors whose name does not end in ``weight`` stay F32;
- the output head (``output.weight``, or ``token_embd.weight`` when the embeddings are tied) becomes Q6_K,
  or Q8_0 when the target is Q8_0 or its rows are not a multiple of 256;
- a K-quant target whose rows are not a multiple of 256 falls back as llama.cpp does: Q4_K -> Q5_0,
  Q6_K -> Q8_0 (SmolLM2's 576-wide rows, Gemma 3's 640-wide).
``--type Q4_K`` puts every other matrix in Q4_K: llama.cpp's Q4_K_S also gives attn_v of the first 4 layers and
ffn_down of the first n_layer/8 Q5_K (Q4_K_M: Q6_K on some), which this does not. Against llama.cpp's own
``llama_model_quantize`` of the same float32 weights, every other tensor comes out byte for byte the same
(tests/test_quantize.py, golden from scripts/make_golden_quantize.py).
"""
from __future__ import annotations

import argparse
import sys
import time

HELP = "requantize a GGUF model to Q8_0, Q4_0, Q4_1, Q4_K or Q6_K (llama.cpp's type policy)"

TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
# llama.cpp's llama_ftype of each target (general.file_type); Q4_K is recorded as MOSTLY_Q4_K_S
FILE_TYPE = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K": 14, "Q6_K": 18}
K_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}     # llama.cpp, for rows that are not whole 256-weight blocks


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", metavar="IN", help="GGUF file to read")
    p.add_argument("output", metavar="OUT", help="GGUF file to write")
    p.add_argument("--type", required=True, choices=TYPES, type=str.upper, help="target quantization type")


def target_type(name: str, shape: tuple[int, ...], target: str, tied: bool) -> str:
    """The ggml type name a tensor gets (see the module docstring)."""
    if len(shape) < 2 or not name.endswith("weight"):
        return "F32"
    row = shape[-1]
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q8_0" if target == "Q8_0" or row % 256 else "Q6_K"
    if target in K_FALLBACK and row % 256:
        return K_FALLBACK[target]
    if row % 32:
        return "F16"
    return target


def quantize_model(src, out_path: str, target: str, log=None) -> dict[str, int]:
    """Write ``src`` (a path or GGUFFile) requantized to ``target`` at ``out_path``; returns {type: tensors}."""
    from pyengine.gguf import quants
    from pyengine.gguf.reader import GGUFFile
    from pyengine.gguf.writer import TensorOut, write_gguf

    if target not in TYPES:
        raise ValueError(f"unsupported target type {target!r} (supported: {', '.join(TYPES)})")
    g = src if isinstance(src, GGUFFile) else GGUFFile(src)
    tied = "output.weight" not in g.tensors
    counts: dict[str, int] = {}
    tensors = []
    for info in g.tensors.values():
        tname = target_type(info.name, info.shape, target, tied)
        t = quants.GGMLType[tname]
        counts[tname] = counts.get(tname, 0) + 1

        def produce(info=info, t=t):
            if info.ggml_type == t and t == quants.GGMLType.F32:
                return info.data                                  # F32 stays F32: copy the bytes
            return quants.quantizer(t)(g.dequantize(info.name))
        tensors.append(TensorOut(info.name, info.shape, int(t), produce))
    metadata = dict(g.metadata)
    types = dict(g.metadata_types)
    metadata["general.file_type"] = FILE_TYPE[target]
    types["general.file_type"] = 4
    with open(out_path, "wb") as f:
        write_gguf(f, metadata, tensors, types)
    return counts


def run(args) -> int:
    import os

    if os.path.abspath(args.input) == os.path.abspath(args.output):
        raise ValueError("OUT must be a different file from IN (IN is read while OUT is written)")
    t0 = time.perf_counter()
    counts = quantize_model(args.input, args.output, args.type)
    size_in, size_out = os.path.getsize(args.input), os.path.getsize(args.output)
    kinds = ", ".join(f"{n} {t}" for t, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    print(f"wrote {args.output}: {sum(counts.values())} tensors ({kinds}); "
          f"{size_in / 2**20:.1f} MiB -> {size_out / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return 0
