"""S06/S07 BlockManager: allocation, prefix-cache hits, refcounts, LRU eviction, and no leaks under churn."""
import random

import pytest

from pyengine.engine.block_manager import BlockManager, hash_block
from pyengine.engine.sequence import Sequence

BS = 4


def make_seq(i, ids):
    return Sequence(i, f"r{i}", 0, ids)


def admit(bm, seq, reserve=0):
    """Admit like the scheduler does: prefix lookup, then blocks for the rest of the tokens."""
    cached = bm.get_computed_blocks(seq)
    n = seq.num_tokens - len(cached) * bm.block_size
    if not bm.can_allocate(seq, cached, n, reserve):
        return False
    bm.allocate(seq, cached, n)
    return True


def compute(bm, seq):
    """Pretend the runner computed every scheduled token, as Scheduler.on_step_done does."""
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)


def test_hash_chain_is_deterministic_and_position_sensitive():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert len(a) == 32
    # Same tokens under a different parent are a different block (the chain names the whole prefix).
    assert hash_block(a, [1, 2, 3, 4]) != a
    assert hash_block(a, [1, 2, 3, 4]) != hash_block(hash_block(None, [9, 9, 9, 9]), [1, 2, 3, 4])
    # Known value pins the format (sha256 over 32 zero bytes + little-endian int64 ids): stable across runs.
    import hashlib
    import struct
    assert a == hashlib.sha256(b"\0" * 32 + struct.pack("<4q", 1, 2, 3, 4)).digest()


def test_allocate_covers_tokens_and_free_returns_everything():
    bm = BlockManager(10, BS)
    s = make_seq(0, list(range(1, 10)))            # 9 tokens -> 3 blocks
    assert admit(bm, s)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert bm.num_used_blocks() == 3 and bm.num_free_blocks() == 7
    compute(bm, s)
    s.append_token(50)                              # decode: token 10 fits in block 3 (slot 9 of 12)
    bm.append_slots(s, 1)
    assert len(s.block_table) == 3
    s.num_computed_tokens += 1
    for t in range(3):                              # tokens 11..13: the 4th block is needed at token 13
        s.append_token(60 + t)
        bm.append_slots(s, 1)
        s.num_computed_tokens += 1
    assert len(s.block_table) == 4
    bm.check_invariants([s])
    bm.free(s)
    assert bm.num_used_blocks() == 0 and bm.num_free_blocks() == 10
    bm.check_invariants([])


def test_prefix_hit_shares_only_full_computed_blocks():
    bm = BlockManager(16, BS)
    prefix = [7, 7, 7, 7, 8, 8, 8, 8]
    a = make_seq(0, prefix + [1, 2])
    assert admit(bm, a)
    b = make_seq(1, prefix + [3])
    # Not computed yet: nothing is in the cache, so b gets no hit and its own blocks.
    assert bm.get_computed_blocks(b) == []
    compute(bm, a)
    assert bm.num_cached_blocks() == 2              # only the two full blocks
    assert admit(bm, b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table    # the partial tail is private
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert [bm.ref_counts[x] for x in a.block_table[:2]] == [2, 2]
    assert bm.hits == 2 and bm.misses == 2          # a: 2 misses (eligible full blocks), b: 2 hits
    assert bm.hit_rate() == 0.5
    bm.check_invariants([a, b])


def test_at_least_one_token_is_computed():
    bm = BlockManager(16, BS)
    a = make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8])       # exactly two full blocks
    admit(bm, a)
    compute(bm, a)
    b = make_seq(1, [1, 2, 3, 4, 5, 6, 7, 8])
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 1                           # the last block holds the last token: recomputed
    assert admit(bm, b)
    assert b.num_computed_tokens == 4
    assert b.block_table[1] != a.block_table[1]


def test_cached_block_survives_free_and_is_revived():
    bm = BlockManager(8, BS)
    a = make_seq(0, [1, 2, 3, 4, 5])
    admit(bm, a)
    compute(bm, a)
    first = a.block_table[0]
    bm.free(a)
    assert bm.num_used_blocks() == 0                 # refcount 0: counted as free ...
    assert bm.num_cached_blocks() == 1               # ... but still reusable
    b = make_seq(1, [1, 2, 3, 4, 9])
    assert admit(bm, b)
    assert b.block_table[0] == first and bm.ref_counts[first] == 1
    bm.check_invariants([b])


def test_lru_eviction_order_and_uncached_blocks_go_first():
    bm = BlockManager(4, BS)
    seqs = []
    for i in range(3):                               # three one-block prompts + 1 token each -> 2 blocks
        s = make_seq(i, [10 * (i + 1)] * 4 + [1])
        seqs.append(s)
    for s in seqs[:2]:
        admit(bm, s)
        compute(bm, s)
    assert bm.num_free_blocks() == 0
    bm.free(seqs[0])                                 # released first -> least recently used
    bm.free(seqs[1])
    assert bm.num_cached_blocks() == 2 and bm.num_free_blocks() == 4
    # seqs[2] needs 2 blocks: the 2 uncached tails are used before any cached block is evicted.
    admit(bm, seqs[2])
    assert bm.evictions == 0 and bm.num_cached_blocks() == 2
    compute(bm, seqs[2])
    bm.free(seqs[2])
    # Reuse seqs[1]'s prefix: it moves out of the LRU list; the next eviction takes seqs[0]'s block.
    again = make_seq(5, [20] * 4 + [2])
    admit(bm, again)
    assert again.num_cached_tokens == 4
    victim_hash = seqs[0].block_hashes[0]
    assert victim_hash in bm.cached
    # free now: seqs[0]'s and seqs[2]'s cached blocks only (the uncached tail went to `again`)
    assert not bm.free_uncached
    assert list(bm.evictable) == [bm.cached[victim_hash], bm.cached[seqs[2].block_hashes[0]]]
    big = make_seq(6, [99] * 3)                      # one block: evicts the least recently released one
    admit(bm, big)
    assert bm.evictions == 1
    assert victim_hash not in bm.cached              # the least recently released block went first
    assert seqs[2].block_hashes[0] in bm.cached
    bm.check_invariants([again, big])


def test_eviction_takes_chain_tails_first():
    bm = BlockManager(4, BS)
    a = make_seq(0, list(range(1, 13)) + [99])       # 3 full blocks + 1 partial = 4 blocks
    admit(bm, a)
    compute(bm, a)
    h = list(a.block_hashes[:3])
    bm.free(a)
    b = make_seq(1, [50] * 5)                        # 2 blocks: the uncached tail, then one eviction
    admit(bm, b)
    assert h[2] not in bm.cached and h[0] in bm.cached and h[1] in bm.cached


def test_can_allocate_counts_revived_hits_and_reserve():
    bm = BlockManager(3, BS)
    a = make_seq(0, [1, 2, 3, 4, 5])
    admit(bm, a)
    compute(bm, a)
    bm.free(a)
    b = make_seq(1, [1, 2, 3, 4] + [6] * 8)          # 1 hit (revived from the free pool) + 2 new blocks
    cached = bm.get_computed_blocks(b)
    assert len(cached) == 1
    assert bm.can_allocate(b, cached, 8)
    assert not bm.can_allocate(b, cached, 9)         # would need a 4th block
    assert not bm.can_allocate(b, cached, 8, reserve=1)
    with pytest.raises(ValueError, match="not enough free KV blocks"):
        bm.allocate(b, cached, 9)
    bm.check_invariants([])


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_disabled_prefix_caching_never_shares():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = make_seq(0, [1, 2, 3, 4, 5])
    admit(bm, a)
    compute(bm, a)
    b = make_seq(1, [1, 2, 3, 4, 5])
    admit(bm, b)
    assert not set(a.block_table) & set(b.block_table)
    assert bm.num_cached_blocks() == 0 and bm.hits == 0 and bm.misses == 0


def test_random_churn_with_prefix_sharing_never_leaks():
    """1000 random add / decode / abort / finish operations over shared prefixes: refcounts always equal
    the live block tables, never negative, used + free == total, and everything returns at the end."""
    rng = random.Random(1234)
    bm = BlockManager(40, BS)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.choice([4, 8, 12]))] for _ in range(4)]
    live: list[Sequence] = []
    next_id = 0
    for op in range(1000):
        r = rng.random()
        if r < 0.4 or not live:
            ids = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))]
            s = make_seq(next_id, ids)
            next_id += 1
            if admit(bm, s, reserve=rng.choice([0, 2])):
                # a partially computed prefill (chunked) or a fully computed one
                s.num_computed_tokens = rng.randrange(s.num_computed_tokens, s.num_tokens + 1)
                bm.cache_computed_blocks(s)
                live.append(s)
        elif r < 0.75:
            s = rng.choice(live)
            if s.num_computed_tokens < s.num_tokens:
                s.num_computed_tokens = s.num_tokens
                bm.cache_computed_blocks(s)
            s.append_token(rng.randrange(1, 50))
            if bm.can_append(s, 1):
                bm.append_slots(s, 1)
                s.num_computed_tokens += 1
                bm.cache_computed_blocks(s)
            else:                                    # out of blocks: preempt it (free everything)
                bm.free(s)
                live.remove(s)
        else:                                        # abort or finish: same for the allocator
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        bm.check_invariants(live)
        # no block is writable by two sequences: a shared block is full and computed by every holder
        owners: dict[int, list[Sequence]] = {}
        for s in live:
            for i, b in enumerate(s.block_table):
                owners.setdefault(b, []).append((s, i))
        for b, holders in owners.items():
            if len(holders) > 1:
                for s, i in holders:
                    assert (i + 1) * BS <= s.num_computed_tokens, f"shared block {b} not full/computed"
    assert bm.hits > 0 and bm.misses > 0 and bm.evictions > 0
    for s in live:
        bm.free(s)
    bm.check_invariants([])
    assert bm.num_used_blocks() == 0 and bm.num_free_blocks() == bm.num_blocks


def _consecutive(table):
    return all(b == a + 1 for a, b in zip(table, table[1:]))


def test_chunked_prompt_gets_consecutive_blocks_beside_growing_decodes():
    """A long prompt prefilled in chunks while decodes grow every step still ends up with consecutive block
    ids (so the runner reads its context as a zero-copy slice), and a lone sequence grows in place."""
    bm = BlockManager(128, BS, enable_prefix_caching=False)
    decoders = [make_seq(i, [7] * 3) for i in range(4)]
    for d in decoders:
        assert admit(bm, d)
        d.num_computed_tokens = d.num_tokens
    long = make_seq(9, list(range(100, 160)))               # 60 tokens = 15 blocks, 2 tokens per step
    bm.allocate(long, [], 2)
    while long.num_computed_tokens < long.num_tokens:
        long.num_computed_tokens += 2
        for d in decoders:                                  # each decode writes one token per step
            bm.append_slots(d, 1)
            d.num_computed_tokens += 1
            d.append_token(5)
        if long.num_computed_tokens < long.num_tokens:
            bm.append_slots(long, 2)
    assert len(long.block_table) == 15 and _consecutive(long.block_table)
    assert sum(len(d.block_table) for d in decoders) > 15    # the decodes did take blocks meanwhile
    bm.check_invariants(decoders + [long])
    solo = make_seq(20, [3] * 9)
    assert admit(bm, solo)
    solo.num_computed_tokens = solo.num_tokens
    for _ in range(30):
        bm.append_slots(solo, 1)
        solo.num_computed_tokens += 1
        solo.append_token(4)
    assert _consecutive(solo.block_table)
    bm.check_invariants(decoders + [long, solo])


def test_fragmented_pool_still_allocates_every_free_block():
    """No run is long enough: the allocator falls back to the longest run, then any block, down to the last."""
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    holes = [make_seq(i, [1] * BS) for i in range(16)]
    for s in holes:
        assert admit(bm, s)
    freed = sorted(s.block_table[0] for s in holes[::2])
    assert [b + 1 for b in freed[:-1]] != freed[1:]         # not one run
    for s in holes[::2]:                                    # free every other sequence's block
        bm.free(s)
    big = make_seq(99, [2] * (8 * BS))
    assert admit(bm, big)
    assert sorted(big.block_table) == freed
    assert bm.num_free_blocks() == 0
    bm.check_invariants(holes[1::2] + [big])
