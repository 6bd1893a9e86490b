"""S05/S06: the paged KV cache, carved from the arena.

Per layer, K and V are arrays of shape (num_blocks, block_size, Hkv, hd). A sequence's token at position p
lives in slot ``block_table[p // block_size] * block_size + p % block_size`` of the flattened
(num_blocks * block_size, Hkv, hd) view, so sequences grow block by block without reserving max_model_len
and blocks can be shared (prefix caching). Block tables come from the BlockManager; this class only
stores and gathers.
"""
from __future__ import annotations

import numpy as np

from pyengine.arena import Arena, ArenaSpec, spec


class PagedKVCache:
    def __init__(self, arena: Arena, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int,
                 head_dim: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.n_layers, self.num_blocks, self.block_size = n_layers, num_blocks, block_size
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        shape = (n_layers, num_blocks, block_size, n_kv_heads, head_dim)
        # self.k[layer]: (num_blocks, block_size, Hkv, hd); carved now unless the arena was planned with them
        self.k, self.v = (arena.views[n] if n in arena.views else arena.alloc(n, shape)
                          for n in ("kv_cache.k", "kv_cache.v"))
        if self.k.shape != shape or self.v.shape != shape:
            raise ValueError(f"arena KV regions have shape {self.k.shape}, expected {shape}")
        flat = (n_layers, num_blocks * block_size, n_kv_heads, head_dim)
        self.k_slots = self.k.reshape(flat)          # views: per layer, one row per slot
        self.v_slots = self.v.reshape(flat)

    @staticmethod
    def arena_specs(n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int,
                    head_dim: int) -> list[ArenaSpec]:
        shape = (n_layers, num_blocks, block_size, n_kv_heads, head_dim)
        return [spec("kv_cache.k", shape), spec("kv_cache.v", shape)]

    @staticmethod
    def bytes_per_block(n_layers: int, block_size: int, n_kv_heads: int, head_dim: int) -> int:
        return 2 * n_layers * block_size * n_kv_heads * head_dim * 4

    def write(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store K/V rows (T, Hkv, hd) of this step's tokens into their slots."""
        self.k_slots[layer][slots] = k
        self.v_slots[layer][slots] = v

    def slots_view(self, layer: int, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) of n consecutive slots from ``start``: zero-copy views (n, Hkv, hd)."""
        return self.k_slots[layer][start:start + n], self.v_slots[layer][start:start + n]

    def gather_blocks(self, layer: int, blocks: np.ndarray, k_out: np.ndarray, v_out: np.ndarray):
        """(K, V) of whole blocks (any shape of block ids, e.g. (G, n_blocks)) gathered into k_out / v_out (as
        many slots as the blocks hold), returned shaped blocks.shape + (block_size, Hkv, hd)."""
        shape = blocks.shape + self.k.shape[2:]
        k, v = k_out.reshape(shape), v_out.reshape(shape)
        # mode="clip": ids were validated; the default "raise" mode buffers the whole output in a temporary
        np.take(self.k[layer], blocks, axis=0, out=k, mode="clip")
        np.take(self.v[layer], blocks, axis=0, out=v, mode="clip")
        return k, v

    def read(self, layer: int, view: "ContextView", k_out: np.ndarray, v_out: np.ndarray):
        """(K, V) of shape (n, Hkv, hd) for a ContextView's keys: views of the cache, or gathered into
        k_out / v_out."""
        n = view.n
        if view.start is not None:
            return self.slots_view(layer, view.start, n)
        k, v = k_out[:n], v_out[:n]
        np.take(self.k_slots[layer], view.slots, axis=0, mode="clip", out=k)
        np.take(self.v_slots[layer], view.slots, axis=0, mode="clip", out=v)
        return k, v


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
    if n == 1 or bool(np.all(np.diff(table) == 1)):
        return int(table[0]) * block_size
    return None


class ContextView:
    """Which keys one sequence reads from the cache: positions ``first`` .. context_len - 1 (first > 0 for a
    sliding window), as a slice of consecutive slots or a gather through its slots."""

    __slots__ = ("first", "n", "start", "slots")

    def __init__(self, block_table: np.ndarray, context_len: int, block_size: int, first: int = 0):
        self.first, self.n = first, context_len - first
        b0 = first // block_size
        start = contiguous_start(block_table[b0:], context_len - b0 * block_size, block_size)
        self.start = None if start is None else start + first - b0 * block_size
        self.slots = None if self.start is not None else slot_mapping(np.arange(first, context_len), block_table,
                                                                      block_size)
