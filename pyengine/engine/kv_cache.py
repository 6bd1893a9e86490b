"""S05/S06/S08: the paged KV cache, carved from the arena, stored in float32, float16 or ggml's Q8_0 / Q4_0 blocks.

Per layer, K and V are arrays of shape (num_blocks, block_size, Hkv, row) where a row is one head's hd values
of one token. A sequence's token at position p lives in slot ``block_table[p // block_size] * block_size +
p % block_size`` of the flattened (num_blocks * block_size, Hkv, row) view, so sequences grow block by block
without reserving max_model_len and blocks can be shared (prefix caching). Block tables come from the
BlockManager; this class only stores and reads.

``dtype`` (llama.cpp's --cache-type-k/v):
    "auto"  float32, row = hd floats (reads of consecutive slots are zero-copy slices)
    "fp16"  float16, half the bytes
    "q8_0"  ggml's Q8_0 blocks along the head dimension: 32 int8 values + a float16 scale (34 bytes per 32)
    "q4_0"  ggml's Q4_0 blocks: 32 4-bit values + a float16 scale (18 bytes per 32)
The quantized rows are the bytes ggml stores (``quants.quantize_q8_0`` / ``quantize_q4_0``, bit-exact with
ggml's reference quantizers). The model calls only ``write`` and the read methods (``read``, ``gather``,
``gather_blocks``): a read converts just the slots it returns into float32 scratch (the caller's, or this
object's own for the gathered bytes), never the whole cache. Decode attention instead takes a group's rows as
stored (``stored``: views, or whole blocks gathered) and converts them itself, a tile at a time
(layers/attention.py ``stored_decode_attention``), in ``tile_scratch``. The same memory budget holds 2x / 3.8x / 7.1x
the blocks of float32.
"""
from __future__ import annotations

import operator
from functools import partial

import numpy as np

from pyengine.arena import Arena, ArenaSpec, spec
from pyengine.gguf import quants
from pyengine.layers.attention import f16_bits_to_f32

KV_DTYPES = ("auto", "fp16", "q8_0", "q4_0")
_QUANT = {"q8_0": (quants.GGMLType.Q8_0, quants.quantize_q8_0), "q4_0": (quants.GGMLType.Q4_0, quants.quantize_q4_0)}


def check_kv_dtype(dtype: str, head_dim: int) -> str:
    if dtype not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_DTYPES)}, got {dtype!r}")
    if dtype in _QUANT and head_dim % 32:
        raise ValueError(f"kv_cache_dtype {dtype!r} needs a head dimension that is a multiple of 32, got {head_dim}")
    return dtype


def _row(dtype: str, head_dim: int) -> tuple[int, np.dtype]:
    """(elements, element dtype) of one head's row of one token."""
    if dtype == "auto":
        return head_dim, np.dtype(np.float32)
    if dtype == "fp16":
        return head_dim, np.dtype(np.float16)
    layout = quants.block_layout(_QUANT[dtype][0])
    return head_dim // layout.block_size * layout.type_size, np.dtype(np.uint8)


def _dtype_of(view: np.ndarray, head_dim: int) -> str:
    """The storage format of an arena region (a tensor-parallel worker maps rank 0's arena and infers it)."""
    for d in KV_DTYPES:
        if d in _QUANT and head_dim % 32:
            continue
        n, dt = _row(d, head_dim)
        if view.dtype == dt and view.shape[-1] == n:
            return d
    raise ValueError(f"arena KV region of dtype {view.dtype} and shape {view.shape} matches no KV cache format")


class PagedKVCache:
    def __init__(self, arena: Arena, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int,
                 head_dim: int, dtype: str | None = None):
        """``dtype`` None: the format of the arena's existing KV regions, else "auto" (float32)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.n_layers, self.num_blocks, self.block_size = n_layers, num_blocks, block_size
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        if dtype is None:
            dtype = _dtype_of(arena.views["kv_cache.k"], head_dim) if "kv_cache.k" in arena.views else "auto"
        self.dtype = check_kv_dtype(dtype, head_dim)
        row, elem = _row(self.dtype, head_dim)
        shape = (n_layers, num_blocks, block_size, n_kv_heads, row)
        # self.k[layer]: (num_blocks, block_size, Hkv, row); carved now unless the arena was planned with them
        self.k, self.v = (arena.views[n] if n in arena.views else arena.alloc(n, shape, elem)
                          for n in ("kv_cache.k", "kv_cache.v"))
        if self.k.shape != shape or self.v.shape != shape or self.k.dtype != elem:
            raise ValueError(f"arena KV regions have shape {self.k.shape} ({self.k.dtype}), expected {shape} ({elem})")
        flat = (n_layers, num_blocks * block_size, n_kv_heads, row)
        self.k_slots = self.k.reshape(flat)          # views: per layer, one row per slot
        self.v_slots = self.v.reshape(flat)
        self._raw = np.empty(0, elem)                # this process's scratch for gathered stored rows
        self._floats = np.empty(0, np.float32)       # and for their float32 tiles

    @staticmethod
    def arena_specs(n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                    dtype: str = "auto") -> list[ArenaSpec]:
        row, elem = _row(check_kv_dtype(dtype, head_dim), head_dim)
        shape = (n_layers, num_blocks, block_size, n_kv_heads, row)
        return [spec("kv_cache.k", shape, elem), spec("kv_cache.v", shape, elem)]

    @staticmethod
    def bytes_per_block(n_layers: int, block_size: int, n_kv_heads: int, head_dim: int, dtype: str = "auto") -> int:
        row, elem = _row(check_kv_dtype(dtype, head_dim), head_dim)
        return 2 * n_layers * block_size * n_kv_heads * row * elem.itemsize

    @property
    def zero_copy(self) -> bool:
        """Reads of consecutive slots return views of the cache itself (float32 storage)."""
        return self.dtype == "auto"

    # --- whole blocks, every layer at once (S18: a prompt's KV shipped between instances) ------------------
    def block_data(self, n: int, heads: int | None = None) -> np.ndarray:
        """An empty (2, n, layers, block_size, heads, row) array: K and V of ``n`` whole blocks as stored, with
        ``heads`` KV heads (default this cache's)."""
        L, _, bs, h, row = self.k.shape
        return np.empty((2, n, L, bs, h if heads is None else heads, row), self.k.dtype)

    def read_blocks(self, blocks, heads: tuple[int, int] | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """K and V of cache blocks ``blocks``, as `block_data` holds them (the inverse of `write_blocks`); ``heads``:
        only this cache's KV heads h0..h1 (S17: a tensor rank's share); ``out``: written there (e.g. a slice of a
        larger `block_data` array) and returned."""
        ids = np.asarray(blocks, np.int64)
        h0, h1 = (0, self.k.shape[3]) if heads is None else heads
        if out is None:
            out = self.block_data(len(ids), h1 - h0)
        for j, cache in enumerate((self.k, self.v)):
            out[j] = cache[:, ids, :, h0:h1].swapaxes(0, 1)
        return out

    def block_views(self, blocks) -> list[tuple[np.ndarray, np.ndarray]]:
        """(K, V) of each of cache blocks ``blocks``, each (layers, block_size, KV heads, row): views of the cache
        (no copy; S18 packs them into its block messages)."""
        return [(self.k[:, b], self.v[:, b]) for b in blocks]

    def write_blocks(self, blocks, data: np.ndarray) -> None:
        """Cache blocks ``blocks`` <- ``data`` (as `block_data` holds it, with this cache's KV heads)."""
        ids = np.asarray(blocks, np.int64)
        for j, cache in enumerate((self.k, self.v)):
            cache[:, ids] = data[j].swapaxes(0, 1)

    # --- writes -----------------------------------------------------------------------------------------
    def write(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store K/V rows (T, Hkv, hd) of this step's tokens into their slots."""
        if self.dtype in _QUANT:
            quantize = _QUANT[self.dtype][1]
            row = self.k_slots.shape[-1]
            k = quantize(k).reshape(len(slots), self.n_kv_heads, row)
            v = quantize(v).reshape(len(slots), self.n_kv_heads, row)
        self.k_slots[layer][slots] = k             # fp16: rounded to nearest on assignment
        self.v_slots[layer][slots] = v

    def write_ops(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> list | None:
        """S13: ``write`` as two bound assignments for a captured step (engine/graph_replay.py), or None for
        the quantized formats (their rows are quantized first: one call)."""
        if self.dtype in _QUANT:
            return None
        return [partial(operator.setitem, self.k_slots[layer], slots, k),
                partial(operator.setitem, self.v_slots[layer], slots, v)]

    # --- reads ------------------------------------------------------------------------------------------
    def _to_float(self, stored: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Stored rows (n, Hkv, row) -> float32 (n, Hkv, hd) in ``out`` (C-contiguous)."""
        if self.dtype in _QUANT:
            return quants.dequantize(np.ascontiguousarray(stored).reshape(-1).view(np.uint8),
                                     _QUANT[self.dtype][0], out.shape, out=out)
        # fp16 (prompt and chunk runs; decode groups convert their own tiles): 2.5x NumPy's float16 cast
        return f16_bits_to_f32(stored.view(np.uint16).reshape(out.shape), out)

    def _scratch(self, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape))
        if self._raw.size < n:
            self._raw = np.empty(n, self._raw.dtype)
        return self._raw[:n].reshape(shape)

    def read(self, layer: int, start: int, n: int, k_out: np.ndarray, v_out: np.ndarray):
        """(K, V) of the n consecutive slots from ``start``, each (n, Hkv, hd) float32: views of the cache
        (float32 storage) or converted into k_out[:n] / v_out[:n]."""
        k, v = self.k_slots[layer][start:start + n], self.v_slots[layer][start:start + n]
        if self.zero_copy:
            return k, v
        return self._to_float(k, k_out[:n]), self._to_float(v, v_out[:n])

    def gather(self, layer: int, slots: np.ndarray, k_out: np.ndarray, v_out: np.ndarray):
        """(K, V) of arbitrary slots, gathered into k_out[:n] / v_out[:n] (n = len(slots))."""
        n = len(slots)
        out = []
        for cache, dst in ((self.k_slots[layer], k_out[:n]), (self.v_slots[layer], v_out[:n])):
            if self.zero_copy:
                np.take(cache, slots, axis=0, mode="clip", out=dst)
            else:
                raw = self._scratch((n,) + cache.shape[1:])
                np.take(cache, slots, axis=0, mode="clip", out=raw)
                self._to_float(raw, dst)
            out.append(dst)
        return out[0], out[1]

    def gather_blocks(self, layer: int, blocks: np.ndarray, k_out: np.ndarray, v_out: np.ndarray):
        """(K, V) of whole blocks (G, nb) ids, each as (G, nb * block_size, Hkv, hd) float32 in the first
        G * nb * block_size rows of k_out / v_out."""
        G, nb = blocks.shape
        n = G * nb * self.block_size
        shape = (G, nb * self.block_size, self.n_kv_heads, self.head_dim)
        out = []
        for cache, dst in ((self.k[layer], k_out[:n]), (self.v[layer], v_out[:n])):
            # mode="clip": ids were validated; the default "raise" mode buffers the whole output in a temporary
            if self.zero_copy:
                np.take(cache, blocks, axis=0, mode="clip", out=dst.reshape((G, nb) + cache.shape[1:]))
            else:
                raw = self._scratch((G, nb) + cache.shape[1:])
                np.take(cache, blocks, axis=0, mode="clip", out=raw)
                self._to_float(raw, dst)
            out.append(dst.reshape(shape))
        return out[0], out[1]

    # --- stored rows, for attention that reads the formats directly (layers/attention.py) --------------------
    @property
    def converts(self) -> bool:
        """Reads must convert the stored rows (not float32): attention then reads them tile by tile as stored."""
        return self.dtype != "auto"

    def stored(self, layer: int, blocks: np.ndarray, start: int | None):
        """(K, V) stored rows (G, nb * block_size, Hkv, row) of whole blocks (G, nb) ids, as stored: views of
        the cache for one sequence whose blocks are consecutive from slot ``start``, else gathered into this
        object's scratch (valid until the next call)."""
        G, nb = blocks.shape
        n = G * nb * self.block_size
        if start is not None:
            return self.k_slots[layer][start:start + n][None], self.v_slots[layer][start:start + n][None]
        shape = (G, nb) + self.k.shape[2:]
        size = int(np.prod(shape))
        k, v = np.split(self._scratch((2 * size,)), 2)            # K and V are both read before the next call
        for cache, raw in ((self.k[layer], k), (self.v[layer], v)):
            np.take(cache, blocks, axis=0, mode="clip", out=raw.reshape(shape))
        return k.reshape((G, nb * self.block_size) + shape[3:]), v.reshape((G, nb * self.block_size) + shape[3:])

    def tile_scratch(self, n: int) -> np.ndarray:
        """This process's float32 scratch of >= n elements (the tiles of stored_decode_attention)."""
        if self._floats.size < n:
            self._floats = np.empty(n, np.float32)
        return self._floats


def slot_mapping(positions: np.ndarray, block_table: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot of each position of one sequence."""
    positions = np.asarray(positions, dtype=np.int64)
    return np.asarray(block_table, dtype=np.int64)[positions // block_size] * block_size + positions % block_size


def contiguous_start(block_table: np.ndarray, context_len: int, block_size: int) -> int | None:
    """First slot if the blocks covering ``context_len`` tokens are one consecutive run (then the context is
    a zero-copy slice of the cache), else None."""
    n = -(-context_len // block_size)
    if n == 0:
        return 0
    table = np.asarray(block_table[:n], dtype=np.int64)
    if n == 1 or bool((table[1:] - table[:-1] == 1).all()):
        return int(table[0]) * block_size
    return None


class ContextView:
    """Which keys one sequence reads from the cache: positions ``first`` .. context_len - 1 (first > 0 for a
    sliding window), as a range of consecutive slots or a gather through its slots."""

    __slots__ = ("first", "n", "start", "slots")

    def __init__(self, block_table: np.ndarray, context_len: int, block_size: int, first: int = 0):
        self.first, self.n = first, context_len - first
        b0 = first // block_size
        start = contiguous_start(block_table[b0:], context_len - b0 * block_size, block_size)
        self.start = None if start is None else start + first - b0 * block_size
        self.slots = None if self.start is not None else slot_mapping(np.arange(first, context_len), block_table,
                                                                      block_size)

    def kv(self, kv: PagedKVCache, layer: int, k_out: np.ndarray, v_out: np.ndarray):
        """(K, V) of shape (n, Hkv, hd): views of the cache, or read into k_out/v_out."""
        if self.start is not None:
            return kv.read(layer, self.start, self.n, k_out, v_out)
        return kv.gather(layer, self.slots, k_out, v_out)
