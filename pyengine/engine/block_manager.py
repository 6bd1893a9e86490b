"""S06/S07: the paged KV-cache allocator with automatic prefix caching.

The KV cache is a pool of ``num_blocks`` blocks of ``block_size`` token slots. Each sequence owns a
*block table* (list of block ids); token at position p lives in slot
``block_table[p // block_size] * block_size + p % block_size`` (the runner's side of the contract).

Prefix caching (S07): a *full* block whose K/V have been computed is named by a hash chained over its
parent block's hash and its own token ids, so equal prefixes give equal names no matter which request
computed them. A later sequence whose leading blocks hash the same reuses them (reference count + 1)
instead of recomputing. Only full, already-computed blocks are ever shared, and a sequence only writes at
positions >= its ``num_computed_tokens`` (always inside a private block), so no block is written by two
sequences. When a cached block's reference count drops to 0 it stays in the cache, reusable, until the
allocator needs the memory: then the least recently released cached block is evicted (LRU). Blocks
without a hash (partial, or duplicates of an already cached block) are handed out before any eviction.

Which free block (contiguity): a sequence whose blocks are consecutive ids reads its context as a zero-copy
slice of the cache instead of a gather (the runner checks; a chunked 4k-token prompt re-reads its whole
context every chunk). So a growing sequence takes the block right after its last one when that is free; a
prompt starting a new run takes the first free run long enough for the rest of it; a decode that cannot
extend its run takes the highest free block, away from the low runs prompts are given.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

import numpy as np

from pyengine.engine.sequence import Sequence


def hash_block(parent_hash: bytes | None, token_ids) -> bytes:
    """Deterministic (across runs and machines) name of a full block: sha256(parent || int64 ids)."""
    h = hashlib.sha256(parent_hash or b"\0" * 32)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


class BlockManager:
    """Block tables, reference counts and the prefix cache. Pure bookkeeping: never touches K/V data."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple | None] = [None] * num_blocks   # verified on a hit (no trust in hashes alone)
        self.cached: dict[bytes, int] = {}                            # hash -> block id
        self.free_mask = np.ones(num_blocks, dtype=bool)              # refcount 0, no hash: used first
        self.num_free_uncached = num_blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()        # refcount 0, cached: LRU first
        # counters (blocks): a *query* is each full prompt block that could have been a hit
        self.hits = 0
        self.misses = 0
        self.hit_tokens = 0
        self.query_tokens = 0
        self.evictions = 0

    # accounting ----------------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return self.num_free_uncached + len(self.evictable)

    @property
    def free_uncached(self) -> list[int]:
        """Ids of the free blocks that hold no cached prefix (handed out before any eviction)."""
        return np.flatnonzero(self.free_mask).tolist()

    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks()

    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # hashing -------------------------------------------------------------------------------------
    def _update_hashes(self, seq: Sequence, num_full: int) -> None:
        """Extend seq.block_hashes to its first ``num_full`` full blocks (tokens never change once written)."""
        bs = self.block_size
        ids = seq.token_ids
        hashes = seq.block_hashes
        while len(hashes) < num_full:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, ids[i * bs:(i + 1) * bs]))

    # prefix lookup -------------------------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Leading cached blocks of ``seq``'s tokens. Never covers the last token, so at least one token
        is computed and the step has logits to sample from. None for a sequence that skips the cache (S19)."""
        if not self.enable_prefix_caching or seq.skip_prefix_cache:
            return []
        bs = self.block_size
        num_full = (seq.num_tokens - 1) // bs
        self._update_hashes(seq, num_full)
        ids = seq.token_ids
        found = []
        for i in range(num_full):
            b = self.cached.get(seq.block_hashes[i])
            if b is None or self.block_tokens[b] != tuple(ids[i * bs:(i + 1) * bs]):
                break
            found.append(b)
        return found

    # allocation ----------------------------------------------------------------------------------
    def _num_new_blocks(self, seq: Sequence, num_tokens_after: int) -> int:
        return max(0, self.blocks_for(num_tokens_after) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, cached_blocks: list[int], num_new_tokens: int,
                     reserve: int = 0) -> bool:
        """Room to admit ``seq`` with ``cached_blocks`` hits plus ``num_new_tokens`` to compute, leaving
        ``reserve`` blocks free (the scheduler's watermark)."""
        need = self.blocks_for(len(cached_blocks) * self.block_size + num_new_tokens) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)  # hits that leave the free pool
        return self.num_free_blocks() - revived - need >= reserve

    def allocate(self, seq: Sequence, cached_blocks: list[int], num_new_tokens: int) -> None:
        """Give a waiting/preempted ``seq`` its block table: the prefix-cache hits, then fresh blocks for
        ``num_new_tokens``. Sets ``seq.num_computed_tokens`` to the number of cached tokens."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        if not self.can_allocate(seq, cached_blocks, num_new_tokens):
            raise ValueError(f"not enough free KV blocks to allocate sequence {seq.seq_id}")
        for b in cached_blocks:
            if self.ref_counts[b] == 0:
                del self.evictable[b]
            self.ref_counts[b] += 1
        seq.block_table = list(cached_blocks)
        seq.num_cached_tokens = len(cached_blocks) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        seq.num_registered_blocks = len(cached_blocks)
        if self.enable_prefix_caching:
            eligible = (seq.num_tokens - 1) // self.block_size
            self.hits += len(cached_blocks)
            self.misses += eligible - len(cached_blocks)
            self.hit_tokens += seq.num_cached_tokens
            self.query_tokens += seq.num_tokens
        self.append_slots(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._num_new_blocks(seq, seq.num_computed_tokens + num_new_tokens) <= self.num_free_blocks()

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq``'s block table to hold ``num_new_tokens`` more tokens (decode: 1; prefill: a chunk)."""
        need = self._num_new_blocks(seq, seq.num_computed_tokens + num_new_tokens)
        if need > self.num_free_blocks():
            raise ValueError(f"not enough free KV blocks for sequence {seq.seq_id}: need {need}")
        # blocks this sequence will want from here on (a chunked prompt: the rest of it, not just this chunk)
        want = max(need, self._num_new_blocks(seq, seq.num_tokens))
        table = seq.block_table
        for i in range(need):
            table.append(self._take_free_block(table[-1] if table else None, want - i))

    def _pick_uncached(self, prev: int | None, want: int) -> int:
        """A free uncached block for a sequence whose last block is ``prev`` and that needs ``want`` more."""
        mask = self.free_mask
        if prev is not None and prev + 1 < self.num_blocks and mask[prev + 1]:
            return prev + 1                                # extend the run
        if want <= 1:
            return self.num_blocks - 1 - int(np.argmax(mask[::-1]))   # highest free block
        edges = np.diff(np.concatenate(([False], mask, [False])).view(np.int8))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        lengths = ends - starts
        fits = np.flatnonzero(lengths >= want)
        return int(starts[fits[0]] if fits.size else starts[np.argmax(lengths)])

    def _take_free_block(self, prev: int | None = None, want: int = 1) -> int:
        if self.num_free_uncached:
            b = self._pick_uncached(prev, want)
            self.free_mask[b] = False
            self.num_free_uncached -= 1
        else:
            b, _ = self.evictable.popitem(last=False)      # least recently released cached block
            del self.cached[self.block_hash[b]]
            self.block_hash[b] = None
            self.block_tokens[b] = None
            self.evictions += 1
        self.ref_counts[b] = 1
        return b

    def free(self, seq: Sequence) -> None:
        """Release all of ``seq``'s blocks at once (finish, abort or preemption)."""
        # Tail first: the deepest blocks of a chain are the least reusable, so they are evicted first.
        for b in reversed(seq.block_table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] < 0:
                raise RuntimeError(f"block {b} reference count went negative")
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is not None:
                    self.evictable[b] = None
                else:
                    self._release_uncached(b)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the tail blocks of ``seq`` beyond the first ``num_tokens`` positions (S14: rejected drafts'
        slots). Those blocks were never full of computed tokens, so none of them is in the prefix cache."""
        keep = self.blocks_for(num_tokens)
        table = seq.block_table
        while len(table) > keep:
            b = table.pop()
            if self.block_hash[b] is not None or self.ref_counts[b] != 1:
                raise RuntimeError(f"block {b} beyond sequence {seq.seq_id}'s computed tokens is shared or cached")
            self.ref_counts[b] = 0
            self._release_uncached(b)

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """After a step: offer ``seq``'s newly completed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        if num_full <= seq.num_registered_blocks:
            return
        self._update_hashes(seq, num_full)
        ids = seq.token_ids
        for i in range(seq.num_registered_blocks, num_full):
            b = seq.block_table[i]
            h = seq.block_hashes[i]
            if self.block_hash[b] is None and h not in self.cached:
                # (if h is already cached elsewhere, another sequence computed the same block in
                # parallel; this copy stays private and returns to the uncached pool when freed)
                self.cached[h] = b
                self.block_hash[b] = h
                self.block_tokens[b] = tuple(ids[i * bs:(i + 1) * bs])
        seq.num_registered_blocks = num_full

    def adopt_block(self, h: bytes, tokens) -> int | None:
        """S21 (prompt cache): a free block named ``h`` for ``tokens``, entered in the prefix cache unreferenced
        (evictable like any released cached block) for its K/V to be written from elsewhere; None when prefix
        caching is off, ``h`` is already cached or no block is free."""
        if not self.enable_prefix_caching or h in self.cached or not self.num_free_blocks():
            return None
        b = self._take_free_block()
        self.ref_counts[b] = 0
        self.cached[h], self.block_hash[b], self.block_tokens[b] = b, h, tuple(tokens)
        self.evictable[b] = None
        return b

    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached block from the cache (returns how many)."""
        n = len(self.evictable)
        while self.evictable:
            b, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_hash[b]]
            self.block_hash[b] = None
            self.block_tokens[b] = None
            self._release_uncached(b)
        return n

    def _release_uncached(self, b: int) -> None:
        self.free_mask[b] = True
        self.num_free_uncached += 1

    # self-check used by the tests ----------------------------------------------------------------
    def check_invariants(self, live: list[Sequence] | None = None) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent; with ``live`` sequences, also check that
        every reference count equals the number of live block tables holding the block."""
        free_u, evict = set(self.free_uncached), set(self.evictable)
        assert len(free_u) == self.num_free_uncached, "free block count disagrees with the free mask"
        assert not free_u & evict, "block both free and evictable"
        assert self.num_used_blocks() + self.num_free_blocks() == self.num_blocks
        for b in range(self.num_blocks):
            rc = self.ref_counts[b]
            assert rc >= 0, f"block {b} has negative refcount"
            assert (rc == 0) == (b in free_u or b in evict), f"block {b}: refcount {rc} vs free lists"
            assert (b in evict) <= (self.block_hash[b] is not None), f"evictable block {b} has no hash"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"cache entry for block {b} disagrees with its hash"
        assert sum(h is not None for h in self.block_hash) == len(self.cached)
        if live is not None:
            counts = [0] * self.num_blocks
            for s in live:
                assert len(set(s.block_table)) == len(s.block_table), f"seq {s.seq_id} repeats a block"
                for b in s.block_table:
                    counts[b] += 1
            assert counts == self.ref_counts, "reference counts disagree with live block tables"
