"""S08: ggml's quantization formats -- the block-layout table, dequantization, and quantization
(Q8_0, Q4_0, Q4_1, Q5_0 here; Q4_K and Q6_K in ``quants_k.py``).

A quantized tensor is a run of fixed-size *blocks*; each block packs ``block_size`` weights as small integers
plus one or two float16 scales (the K-quants add 6/8-bit sub-block scales). Every layout below is declared
once, as a NumPy structured dtype, so a tensor's raw bytes can be *viewed* as an array of blocks and every
field decoded for all blocks at once -- no Python loop over blocks. The arithmetic follows ggml's reference
(``dequantize_row_*`` in ggml-quants.c) operation by operation, in float32, so results are bit-exact.

The K-quant kernels (256-weight super-blocks) live in ``quants_k.py``; this module owns the table.
"""
from __future__ import annotations

import math
from enum import IntEnum
from typing import Callable, NamedTuple

import numpy as np

from pyengine.gguf import GGUFError
from pyengine.gguf import quants_k

QK_K = quants_k.QK_K  # weights per K-quant super-block


class GGMLType(IntEnum):
    """ggml tensor types as numbered in the GGUF file (gaps are ids ggml retired)."""
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


class BlockLayout(NamedTuple):
    block_size: int          # weights per block
    type_size: int           # bytes per block
    dtype: np.dtype | None   # structured view of one block (None: we can size it but not decode it)


def _block(*fields) -> np.dtype:
    return np.dtype(list(fields))


_F16 = "<f2"

# ---------------------------------------------------------------------------------------------------------
# The table. Nibble order in the 32-weight formats: byte j holds weight j in its low nibble and weight j+16
# in its high nibble, so a SIMD kernel unpacks a whole block with one AND and one SHIFT of a 16-byte register
# (no interleaving shuffle). 5-bit formats keep the 4 low bits the same way and gather the 32 fifth bits in
# one little-endian uint32 ``qh`` (bit j -> weight j). "_0" formats are symmetric (w = d*q, q centred by a
# constant offset), "_1" formats store a min (w = d*q + m) for skewed blocks.
# ---------------------------------------------------------------------------------------------------------
GGML_BLOCK: dict[GGMLType, BlockLayout] = {
    GGMLType.F32: BlockLayout(1, 4, np.dtype("<f4")),
    GGMLType.F16: BlockLayout(1, 2, np.dtype("<f2")),
    # bfloat16 is the top half of a float32: decoding is a 16-bit shift.
    GGMLType.BF16: BlockLayout(1, 2, np.dtype("<u2")),
    # w = d * (q - 8), q in 0..15
    GGMLType.Q4_0: BlockLayout(32, 18, _block(("d", _F16), ("qs", "u1", 16))),
    # w = d * q + m, q in 0..15
    GGMLType.Q4_1: BlockLayout(32, 20, _block(("d", _F16), ("m", _F16), ("qs", "u1", 16))),
    # w = d * (q - 16), q = low nibble | fifth bit from qh << 4
    GGMLType.Q5_0: BlockLayout(32, 22, _block(("d", _F16), ("qh", "u1", 4), ("qs", "u1", 16))),
    # w = d * q + m, q 5-bit as in Q5_0
    GGMLType.Q5_1: BlockLayout(32, 24, _block(("d", _F16), ("m", _F16), ("qh", "u1", 4), ("qs", "u1", 16))),
    # w = d * q, q a plain int8: the simplest format, and the one activations are quantized to.
    GGMLType.Q8_0: BlockLayout(32, 34, _block(("d", _F16), ("qs", "i1", 32))),
    # Q8_1 additionally stores s = d * sum(q) for dot products; only used for activations.
    GGMLType.Q8_1: BlockLayout(32, 36, None),
    # K-quants: a 256-weight super-block split in 16 or 8 sub-blocks, each with its own small integer scale
    # (and min) that is itself scaled by the super-block's float16 d (dmin) -- two-level scaling gives
    # per-16/32-weight precision at ~0.2-0.5 bits of overhead per weight.
    # Q2_K: 16 sub-blocks of 16; scales byte = scale (low nibble) | min (high nibble); w = d*sc*q - dmin*m.
    # The 2-bit q are packed 4 per byte: byte l of a 32-byte group holds weights l, l+32, l+64, l+96.
    GGMLType.Q2_K: BlockLayout(QK_K, 84, _block(("scales", "u1", 16), ("qs", "u1", 64),
                                                 ("d", _F16), ("dmin", _F16))),
    # Q3_K: 2 low bits packed like Q2_K, the third bit in hmask (bit j of byte l -> weight 32*j + l), stored
    # inverted (bit set = no -4 offset); 16 signed 6-bit scales packed in 12 bytes (low nibbles in bytes 0-7,
    # high 2-bit pairs in bytes 8-11); w = d * (sc - 32) * q, q in -4..3.
    GGMLType.Q3_K: BlockLayout(QK_K, 110, _block(("hmask", "u1", 32), ("qs", "u1", 64),
                                                  ("scales", "u1", 12), ("d", _F16))),
    # Q4_K: 8 sub-blocks of 32; 8 scales + 8 mins of 6 bits in 12 bytes (bytes 0-3 scales 0-3, 4-7 mins 0-3,
    # 8-11 low nibbles of scales/mins 4-7 whose top 2 bits ride in the spare top bits of bytes 0-7);
    # nibbles as in Q4_0 but per 64 weights: byte l of a 32-byte group -> weights l (low) and l+32 (high).
    GGMLType.Q4_K: BlockLayout(QK_K, 144, _block(("d", _F16), ("dmin", _F16), ("scales", "u1", 12),
                                                  ("qs", "u1", 128))),
    # Q5_K: Q4_K plus a fifth bit per weight in qh (bit j of byte l -> weight 32*j + l).
    GGMLType.Q5_K: BlockLayout(QK_K, 176, _block(("d", _F16), ("dmin", _F16), ("scales", "u1", 12),
                                                  ("qh", "u1", 32), ("qs", "u1", 128))),
    # Q6_K: 16 sub-blocks of 16 with int8 scales; 4 low bits in ql (per 128 weights: ql[0:32] low nibbles ->
    # 0-31, ql[32:64] low -> 32-63, ql[0:32] high -> 64-95, ql[32:64] high -> 96-127) and 2 high bits in qh
    # (byte l holds the 2-bit pairs of weights l, l+32, l+64, l+96); w = d * sc * (q - 32).
    GGMLType.Q6_K: BlockLayout(QK_K, 210, _block(("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16),
                                                  ("d", _F16))),
    # Formats we can size (so a file holding them still loads) but do not decode.
    GGMLType.Q8_K: BlockLayout(QK_K, 4 + QK_K + QK_K // 8, None),
    GGMLType.IQ2_XXS: BlockLayout(QK_K, 2 + QK_K // 4, None),
    GGMLType.IQ2_XS: BlockLayout(QK_K, 2 + QK_K // 4 + QK_K // 32, None),
    GGMLType.IQ3_XXS: BlockLayout(QK_K, 2 + QK_K // 4 + QK_K // 8, None),
    GGMLType.IQ1_S: BlockLayout(QK_K, 2 + QK_K // 8 + QK_K // 16, None),
    GGMLType.IQ4_NL: BlockLayout(32, 18, None),
    GGMLType.IQ3_S: BlockLayout(QK_K, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4, None),
    GGMLType.IQ2_S: BlockLayout(QK_K, 2 + QK_K // 4 + QK_K // 16, None),
    GGMLType.IQ4_XS: BlockLayout(QK_K, 4 + QK_K // 2 + QK_K // 64, None),
    GGMLType.I8: BlockLayout(1, 1, None),
    GGMLType.I16: BlockLayout(1, 2, None),
    GGMLType.I32: BlockLayout(1, 4, None),
    GGMLType.I64: BlockLayout(1, 8, None),
    GGMLType.F64: BlockLayout(1, 8, None),
    GGMLType.IQ1_M: BlockLayout(QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32, None),
    GGMLType.TQ1_0: BlockLayout(QK_K, 2 + 4 * 13, None),
    GGMLType.TQ2_0: BlockLayout(QK_K, 2 + 64, None),
    GGMLType.MXFP4: BlockLayout(32, 17, None),
}


def type_name(ggml_type: int) -> str:
    """'Q4_K' for a known id, 'unknown ggml type 99' otherwise (for messages and tables)."""
    try:
        return GGMLType(ggml_type).name
    except ValueError:
        return f"unknown ggml type {ggml_type}"


def block_layout(ggml_type: int) -> BlockLayout:
    """The layout of a ggml type, or GGUFError naming the type."""
    try:
        return GGML_BLOCK[GGMLType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"unknown ggml type {ggml_type}") from None


def tensor_nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of that type and (NumPy-order) shape; its rows must be whole blocks."""
    layout = block_layout(ggml_type)
    n = math.prod(shape)
    row = shape[-1] if shape else 1
    if row % layout.block_size:
        raise GGUFError(f"row length {row} is not a multiple of the {type_name(ggml_type)} block size "
                        f"{layout.block_size}")
    return n // layout.block_size * layout.type_size


# ---------------------------------------------------------------------------------------------------------
# Kernels: f(blocks, out) with blocks a structured array of n blocks and out a float32 (n, block_size) array.
# Each writes ggml's reference result for those blocks into out.
# ---------------------------------------------------------------------------------------------------------

def _f32(b, out):
    out[:, 0] = b


def _f16(b, out):
    out[:, 0] = b          # float16 -> float32 is exact


def _bf16(b, out):
    out.view(np.uint32)[:, 0] = b.astype(np.uint32) << 16


def _nibbles(qs: np.ndarray, dtype=np.uint8) -> np.ndarray:
    """(n, 16) packed bytes -> (n, 2, 16): low nibbles are weights 0-15, high nibbles weights 16-31."""
    q = np.empty((qs.shape[0], 2, qs.shape[1]), dtype)
    np.bitwise_and(qs, 15, out=q[:, 0], casting="unsafe")
    np.right_shift(qs, 4, out=q[:, 1], casting="unsafe")
    return q


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes of a little-endian uint32 -> (n, 2, 16) uint8 holding bit j of weight j at value 16."""
    h = np.unpackbits(qh, axis=1, bitorder="little")  # (n, 32): bit j of the uint32, weight j
    h <<= 4
    return h.reshape(-1, 2, 16)


def _q4_0(b, out):
    q = _nibbles(b["qs"], np.int8)
    q -= 8
    np.multiply(q, b["d"].astype(np.float32)[:, None, None], out=out.reshape(q.shape))


def _q4_1(b, out):
    q = _nibbles(b["qs"])
    o = out.reshape(q.shape)
    np.multiply(q, b["d"].astype(np.float32)[:, None, None], out=o)
    o += b["m"].astype(np.float32)[:, None, None]


def _q5(b):
    q = _nibbles(b["qs"])
    q |= _fifth_bits(b["qh"])
    return q


def _q5_0(b, out):
    q = _q5(b).view(np.int8)
    q -= 16
    np.multiply(q, b["d"].astype(np.float32)[:, None, None], out=out.reshape(q.shape))


def _q5_1(b, out):
    q = _q5(b)
    o = out.reshape(q.shape)
    np.multiply(q, b["d"].astype(np.float32)[:, None, None], out=o)
    o += b["m"].astype(np.float32)[:, None, None]


def _q8_0(b, out):
    np.multiply(b["qs"], b["d"].astype(np.float32)[:, None], out=out)


_KERNELS: dict[GGMLType, Callable[[np.ndarray, np.ndarray], None]] = {
    GGMLType.F32: _f32, GGMLType.F16: _f16, GGMLType.BF16: _bf16,
    GGMLType.Q4_0: _q4_0, GGMLType.Q4_1: _q4_1, GGMLType.Q5_0: _q5_0, GGMLType.Q5_1: _q5_1,
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q2_K: quants_k.dequant_q2_k, GGMLType.Q3_K: quants_k.dequant_q3_k,
    GGMLType.Q4_K: quants_k.dequant_q4_k, GGMLType.Q5_K: quants_k.dequant_q5_k,
    GGMLType.Q6_K: quants_k.dequant_q6_k,
}

SUPPORTED_TYPES = tuple(_KERNELS)


# S21 folded unpacking, two kernels per format: unpack(blocks, out (n, block_size) float32) writes the raw quants
# q; scales(blocks) returns (scale, bias, group) with w = scale[:, g] * q + bias[:, g] over consecutive groups of
# ``group`` weights (bias None: none). Separate, so a product decodes the (small) scales of many rows at once.
def _unpack_nibbles(b, out):
    qs = b["qs"]
    o = out.reshape(qs.shape[0], 2, 16)
    np.bitwise_and(qs, 15, out=o[:, 0], casting="unsafe")
    np.right_shift(qs, 4, out=o[:, 1], casting="unsafe")


def _scales_q4_0(b):
    d = b["d"].astype(np.float32)[:, None]
    return d, d * np.float32(-8), 32


def _scales_q4_1(b):
    return b["d"].astype(np.float32)[:, None], b["m"].astype(np.float32)[:, None], 32


def _unpack_q8_0(b, out):
    np.copyto(out, b["qs"], casting="unsafe")


def _scales_q8_0(b):
    return b["d"].astype(np.float32)[:, None], None, 32


_UNPACK: dict[GGMLType, tuple[Callable, Callable]] = {
    GGMLType.Q4_0: (_unpack_nibbles, _scales_q4_0), GGMLType.Q4_1: (_unpack_nibbles, _scales_q4_1),
    GGMLType.Q8_0: (_unpack_q8_0, _scales_q8_0),
    GGMLType.Q4_K: (quants_k.unpack_q4_k, quants_k.scales_q4_k),
    GGMLType.Q6_K: (quants_k.unpack_q6_k, quants_k.scales_q6_k),
}
FOLDED_TYPES = tuple(_UNPACK)


def _blocks(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    return np.ascontiguousarray(raw).reshape(-1).view(GGML_BLOCK[GGMLType(ggml_type)].dtype)


def unpack_quants(raw: np.ndarray, ggml_type: int, cols: int, out: np.ndarray) -> bool:
    """S21: (n, row_bytes) raw rows -> ``out`` (n, cols) float32. A FOLDED_TYPES type writes its raw quants q
    (then w = scale * q + bias per group, see ``unpack_scales``) and returns True; any other type is dequantized
    into out (the weights themselves) and returns False."""
    kernels = _UNPACK.get(ggml_type)
    if kernels is None:
        dequantize(raw, ggml_type, (raw.shape[0], cols), out=out)
        return False
    blocks = _blocks(raw, ggml_type)
    kernels[0](blocks, out.reshape(blocks.shape[0], -1))
    return True


def unpack_scales(raw: np.ndarray, ggml_type: int, cols: int):
    """S21: (n, row_bytes) raw rows of a FOLDED_TYPES type -> (scale (n, G), bias (n, G) or None, group) with
    w[r, g*group + j] = scale[r, g] * q[r, g*group + j] + bias[r, g], G = cols // group (q from
    ``unpack_quants``). Lean products multiply by q and fold scale and bias into the activations: fewer passes
    over the weights than dequantizing."""
    n = raw.shape[0]
    with np.errstate(all="ignore"):
        scale, bias, group = _UNPACK[ggml_type][1](_blocks(raw, ggml_type))
    G = cols // group
    return scale.reshape(n, G), None if bias is None else bias.reshape(n, G), group


def unpack_rows(raw: np.ndarray, ggml_type: int, cols: int, out: np.ndarray):
    """Both at once: the quants into ``out`` and (scale, bias, group); (None, None, 0) for dequantized rows."""
    if not unpack_quants(raw, ggml_type, cols, out):
        return None, None, 0
    return unpack_scales(raw, ggml_type, cols)


# Blocks decoded per kernel call: keeps the temporaries in cache (~1 MB of output) for large tensors.
_CHUNK_WEIGHTS = 1 << 18


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...] | int,
               out: np.ndarray | None = None) -> np.ndarray:
    """Raw tensor bytes (uint8) of a ggml type -> float32 array of ``shape`` (NumPy order).

    ``out``: a preallocated C-contiguous float32 array of that shape to decode into (the lean weight mode
    decodes each layer into arena scratch this way, with no model-sized temporaries)."""
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    layout = block_layout(ggml_type)
    kernel = _KERNELS.get(GGMLType(ggml_type))
    if kernel is None:
        raise GGUFError(f"dequantization of ggml type {type_name(ggml_type)} is not supported "
                        f"(supported: {', '.join(t.name for t in SUPPORTED_TYPES)})")
    if any(s < 0 for s in shape):
        raise GGUFError(f"invalid shape {shape}")
    nbytes = tensor_nbytes(ggml_type, shape)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise GGUFError(f"raw tensor data must be uint8 bytes, got {raw.dtype}")
    if raw.size != nbytes:
        raise GGUFError(f"{type_name(ggml_type)} tensor of shape {shape} needs {nbytes} bytes, got {raw.size}")
    blocks = np.ascontiguousarray(raw).reshape(-1).view(layout.dtype)
    n_blocks = blocks.shape[0]
    if out is None:
        out = np.empty(shape, np.float32)
    elif out.dtype != np.float32 or out.shape != shape or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 array of shape {shape}")
    result, out = out, out.reshape(n_blocks, layout.block_size)
    step = max(1, _CHUNK_WEIGHTS // layout.block_size)
    with np.errstate(all="ignore"):   # inf/NaN scales in a file decode to inf/NaN, as in ggml, silently
        for start in range(0, n_blocks, step):
            kernel(blocks[start:start + step], out[start:start + step])
    return result


# ---------------------------------------------------------------------------------------------------------
# Quantization (what ggml's quantize_row_*_ref computes, in the same float32 operations).
# ---------------------------------------------------------------------------------------------------------

def _as_blocks(x, block_size: int, name: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % block_size:
        raise ValueError(f"{name}: the last dimension of x (shape {x.shape}) must be a multiple of {block_size}")
    return np.ascontiguousarray(x).reshape(-1, block_size)


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C roundf(): ties go away from zero (np.rint would round them to even). Exact in float32."""
    a = np.abs(v)
    f = np.floor(a)
    f += (a - f) >= 0.5   # a - f is exact for floats
    return np.copysign(f, v)


def quantize_q8_0(x) -> np.ndarray:
    """float array (last dim a multiple of 32) -> raw Q8_0 bytes, 1-D uint8 (34 bytes per 32 weights)."""
    blocks = _as_blocks(x, 32, "quantize_q8_0")
    d = np.abs(blocks).max(axis=1) / np.float32(127)          # so the largest |x| maps to +-127
    inv = _inverse(d)
    out = np.empty(blocks.shape[0], GGML_BLOCK[GGMLType.Q8_0].dtype)
    out["d"] = d                                                # float32 -> float16, round to nearest even
    out["qs"] = _round_half_away(blocks * inv[:, None])
    return out.view(np.uint8)


def quantize_q4_0(x) -> np.ndarray:
    """float array (last dim a multiple of 32) -> raw Q4_0 bytes, 1-D uint8 (18 bytes per 32 weights)."""
    n, d, q = _symmetric_levels(x, 8, "quantize_q4_0")
    out = np.empty(n, GGML_BLOCK[GGMLType.Q4_0].dtype)
    out["d"] = d
    out["qs"] = q[:, :16] | (q[:, 16:] << 4)
    return out.view(np.uint8)


def _nearest_max(blocks: np.ndarray) -> np.ndarray:
    """Per block, the signed value of largest magnitude (the first one on ties), as ggml's loops pick it."""
    return blocks[np.arange(blocks.shape[0]), np.abs(blocks).argmax(axis=1)]


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d)


def _symmetric_levels(x, half: int, name: str):
    """The "_0" formats' levels: (blocks, d, q (blocks, 32) uint8 in 0 .. 2*half-1). d = (the signed value of
    largest magnitude) / -half: that value maps exactly to q = 0 (-half after the offset), and the other side
    of the range gets the extra level -- the asymmetric range [-half, half-1]. q = MIN(2*half-1,
    (int8_t)(x/d + half + 0.5)): the cast truncates towards zero."""
    blocks = _as_blocks(x, 32, name)
    d = _nearest_max(blocks) / np.float32(-half)
    q = np.trunc(blocks * _inverse(d)[:, None] + np.float32(half + 0.5))
    return blocks.shape[0], d, np.minimum(q, 2 * half - 1).astype(np.uint8)


def quantize_q4_1(x) -> np.ndarray:
    """float array (last dim a multiple of 32) -> raw Q4_1 bytes (20 per 32 weights): w ~ d * q + m with
    m the block's min and d = (max - min) / 15; q = trunc((x - m) / d + 0.5), at most 15."""
    blocks = _as_blocks(x, 32, "quantize_q4_1")
    lo, hi = blocks.min(axis=1), blocks.max(axis=1)
    d = (hi - lo) / np.float32(15)
    inv = _inverse(d)
    q = np.minimum(np.trunc((blocks - lo[:, None]) * inv[:, None] + np.float32(0.5)), 15).astype(np.uint8)
    out = np.empty(blocks.shape[0], GGML_BLOCK[GGMLType.Q4_1].dtype)
    out["d"], out["m"] = d, lo
    out["qs"] = q[:, :16] | (q[:, 16:] << 4)
    return out.view(np.uint8)


def quantize_q5_0(x) -> np.ndarray:
    """float array (last dim a multiple of 32) -> raw Q5_0 bytes (22 per 32 weights): Q4_0's scheme with
    32 levels (d = the largest-magnitude value / -16), the fifth bits gathered in qh."""
    n, d, q = _symmetric_levels(x, 16, "quantize_q5_0")
    out = np.empty(n, GGML_BLOCK[GGMLType.Q5_0].dtype)
    out["d"] = d
    out["qs"] = (q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)
    out["qh"] = np.packbits(q >> 4, axis=1, bitorder="little")      # bit j of the uint32 = weight j
    return out.view(np.uint8)


def quantize_f16(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, np.float32).astype("<f2")).reshape(-1).view(np.uint8)


def quantize_f32(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype="<f4")).reshape(-1).view(np.uint8)


def quantizer(ggml_type: int) -> Callable[[np.ndarray], np.ndarray]:
    """The function float32 rows -> raw bytes of a ggml type, or GGUFError naming the type."""
    table = {GGMLType.F32: quantize_f32, GGMLType.F16: quantize_f16, GGMLType.Q8_0: quantize_q8_0,
             GGMLType.Q4_0: quantize_q4_0, GGMLType.Q4_1: quantize_q4_1, GGMLType.Q5_0: quantize_q5_0,
             GGMLType.Q4_K: quants_k.quantize_q4_k, GGMLType.Q6_K: quants_k.quantize_q6_k}
    try:
        return table[GGMLType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"quantization to {type_name(ggml_type)} is not supported "
                        f"(supported: {', '.join(t.name for t in table)})") from None
