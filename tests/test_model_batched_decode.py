"""S09: batched decode (B sequences, one new token each, or a few: speculative verification) in one forward:
attention batched over sequences through the step plan's query groups, few-row GEMMs as matvecs. Everything
equals the per-sequence path."""
import tracemalloc

import numpy as np
import pytest

from pyengine.engine.forward_batch import ForwardBatch
from pyengine.engine.model_runner import ModelRunner
from pyengine.layers.attention import grouped_attention
from pyengine.model_files import default_model_path
from pyengine.engine.step_plan import query_groups
from pyengine.layers.paged_attention import group_attention
from pyengine.tuning import LINEAR_ROW_LOOP_MAX, SMALL_GEMM_ROWS

LENS = [37, 130, 5, 64, 101]


@pytest.fixture(scope="module")
def state():
    """A runner (max_num_seqs=2: its batched-decode scratch holds 2 full contexts, so 5 sequences are split
    into groups) with 5 prompts prefilled in one ragged batch through shuffled block tables."""
    r = ModelRunner(default_model_path(), max_model_len=256, max_num_batched_tokens=400, max_num_seqs=2,
                    num_blocks=96, max_logits=8)
    rng = np.random.default_rng(5)
    bs = r.block_size
    per = -(-(max(LENS) + 4) // bs)
    order = rng.permutation(80)[:len(LENS) * per].astype(np.int32)     # blocks 80..95 stay free
    tables = [order[i * per:(i + 1) * per] for i in range(len(LENS))]
    prompts = [rng.integers(0, r.config.vocab_size, n) for n in LENS]
    logits = r.run(ForwardBatch(np.concatenate(prompts), np.concatenate([np.arange(n) for n in LENS]), LENS, LENS,
                                tables, np.cumsum(LENS) - 1))
    return r, tables, np.argmax(logits, axis=-1)


def decode_batch(tables, toks, idx, lens):
    pos = np.array([lens[s] for s in idx])
    return ForwardBatch(np.asarray([toks[s] for s in idx], np.int64), pos, [1] * len(idx), list(pos + 1),
                        [tables[s] for s in idx], np.arange(len(idx)))


def test_decode_groups_cover_every_sequence_within_budget(state):
    r, tables, _ = state
    bs, slots = r.block_size, r.arena["attn.k_batch"].shape[0]
    decodes = [(i, 1, n + 1, tables[i]) for i, n in enumerate(LENS)]
    groups = query_groups(decodes, bs, slots)
    assert len(groups) > 1                                    # the budget forces a split here
    seen = []
    for rows, q_len, blocks, lens, pad, _ in groups:
        assert q_len == 1 and pad.shape == (len(lens), 1, 1, blocks.shape[1] * bs)
        assert list(pad.sum(axis=-1).ravel()) == list(blocks.shape[1] * bs - lens)
        rows = np.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows
        assert blocks.size * bs <= slots and len(rows) == len(lens) == blocks.shape[0]
        for row, n, blk in zip(rows, lens, blocks):
            need = -(-n // bs)
            assert n == LENS[row] + 1 and list(blk[:need]) == list(tables[row][:need])
        seen += list(rows)
    assert sorted(seen) == list(range(len(LENS)))
    # a budget below the longest context: that sequence gets a group of its own, nobody is dropped
    small = (max(LENS) + 1) // 2
    groups = query_groups(decodes, bs, small)
    rows = [i for g in groups for i in (range(g.rows.start, g.rows.stop) if isinstance(g.rows, slice) else g.rows)]
    assert sorted(rows) == list(range(len(LENS)))
    assert all(len(g.lens) == 1 for g in groups if g.blocks.size * bs > small)
    # when everything fits: one group in batch order (rows a slice), padded to the longest context
    (rows, _, blocks, lens, _, start), = query_groups(decodes, bs, 10**6)
    assert rows == slice(0, len(LENS)) and list(lens) == [n + 1 for n in LENS] and start is None
    assert blocks.shape == (len(LENS), -(-(max(LENS) + 1) // bs))


def test_batched_attention_equals_per_sequence_on_the_cache(state):
    """Inside the model, on the real (scattered) KV cache of every layer: the batched decode attention of all
    sequences = grouped attention of each sequence over its own gathered context, within 1e-5."""
    r, tables, _ = state
    m, kv, b = r.model, r.kv_cache, r.buffers
    B = len(LENS)
    rng = np.random.default_rng(1)
    q_rot = rng.standard_normal((B, 9, 64)).astype(np.float32)
    lens = [n - 2 for n in LENS]                               # attend over a cached prefix of each sequence
    groups = query_groups([(i, 1, lens[i], tables[i]) for i in range(B)], kv.block_size, b.k_batch.shape[0])
    for layer in (0, 17, 29):
        got = np.zeros((B, 9, 64), np.float32)
        for g in groups:
            group_attention(layer, q_rot, kv, g, got, b, m.scale)
        for s in range(B):
            slots = tables[s][np.arange(lens[s]) // kv.block_size] * kv.block_size + np.arange(lens[s]) % kv.block_size
            k, v = kv.k_slots[layer][slots], kv.v_slots[layer][slots]
            want = grouped_attention(q_rot[s:s + 1], k, v, scale=m.scale)[0]
            assert np.abs(got[s] - want).max() <= 1e-5, (layer, s)


def test_lone_decode_with_consecutive_blocks_reads_the_cache_in_place(state):
    """A decode alone in its group whose blocks are consecutive attends over a zero-copy slice of the cache
    (no gather), with the same result as through a scattered table holding the same K/V."""
    r, tables, _ = state
    m, kv, b = r.model, r.kv_cache, r.buffers
    s, bs = 1, kv.block_size
    n = LENS[s]
    need = -(-n // bs)
    run = np.arange(80, 80 + need, dtype=np.int32)                # blocks no table uses
    for layer in range(kv.n_layers):
        kv.k[layer][run] = kv.k[layer][tables[s][:need]]
        kv.v[layer][run] = kv.v[layer][tables[s][:need]]
    (in_place,) = query_groups([(0, 1, n, run)], bs, 10**6)
    (gathered,) = query_groups([(0, 1, n, tables[s])], bs, 10**6)
    assert in_place.start == 80 * bs and gathered.start is None
    q = np.random.default_rng(3).standard_normal((1, 9, 64)).astype(np.float32)
    for layer in (0, 29):
        x, y = np.zeros_like(q), np.zeros_like(q)
        group_attention(layer, q, kv, in_place, x, b, m.scale)
        group_attention(layer, q, kv, gathered, y, b, m.scale)
        assert np.abs(x - y).max() <= 1e-6


def test_batched_decode_step_equals_each_alone(state):
    """One decode step of all 5 sequences (in budget-split groups, shuffled batch order) = each one alone;
    then the next step too, through the K/V the batched step wrote."""
    r, tables, toks = state
    order = [3, 0, 4, 1, 2]
    together = r.run(decode_batch(tables, toks, order, LENS)).copy()
    alone = np.stack([r.run(decode_batch(tables, toks, [s], LENS))[0].copy() for s in order])
    assert np.abs(together - alone).max() <= 1e-4
    assert list(np.argmax(together, -1)) == list(np.argmax(alone, -1))
    nxt = np.argmax(together, -1)
    toks2 = {s: int(t) for s, t in zip(order, nxt)}
    lens2 = [n + 1 for n in LENS]
    together = r.run(decode_batch(tables, toks2, order, lens2)).copy()
    alone = np.stack([r.run(decode_batch(tables, toks2, [s], lens2))[0].copy() for s in order])
    assert np.abs(together - alone).max() <= 1e-4


def test_batched_decode_allocates_nothing_model_sized(state):
    r, tables, toks = state
    idx = list(range(len(LENS)))
    r.run(decode_batch(tables, toks, idx, LENS))           # warm-up
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        r.run(decode_batch(tables, toks, idx, LENS))
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < r.weights.layers[0].wo.nbytes / 4, peak


def test_few_row_matvecs_equal_gemm(state):
    r, _, _ = state
    rng = np.random.default_rng(2)
    w = r.weights.layers[3].w_gate_up
    for n in range(1, LINEAR_ROW_LOOP_MAX + 3):
        x = rng.standard_normal((n, w.shape[0])).astype(np.float32)
        out = np.empty((n, w.shape[1]), np.float32)
        assert w.matmul(x, out) is out
        assert np.abs(out - x.astype(np.float64) @ w.dense()).max() <= 1e-4
    head = r.weights.head
    for n in (1, 2, SMALL_GEMM_ROWS, SMALL_GEMM_ROWS + 1):
        h = rng.standard_normal((n, head.shape[0])).astype(np.float32)
        out = np.empty((n, head.shape[1]), np.float32)
        assert head.matmul(h, out) is out
        assert np.abs(out - h.astype(np.float64) @ head.dense().astype(np.float64)).max() <= 1e-4


def test_short_multi_token_queries_are_batched_like_decodes(state):
    """Sequences with a few new tokens each (2..16, as speculative verification sends) go into query groups,
    not the prefill path, and their logits at every new position equal each sequence run alone (on copies of
    the same cache blocks, so the two runs see the same context)."""
    r, tables, toks = state
    rng = np.random.default_rng(9)
    q_lens = [3, 1, 5, 3, 2]                                  # mixed: groups per query length, and a decode
    idx = [0, 2, 1, 4, 3]
    ids = [rng.integers(0, r.config.vocab_size, q_lens[k]) for k in range(len(idx))]
    starts = [LENS[s] for s in idx]
    batch = ForwardBatch(np.concatenate(ids), np.concatenate([np.arange(a, a + q) for a, q in zip(starts, q_lens)]),
                         q_lens, [a + q for a, q in zip(starts, q_lens)], [tables[s] for s in idx],
                         np.arange(sum(q_lens)))
    plan = r.plan(batch)
    (kind,) = plan.kinds
    assert not kind.attention.runs and sorted(g.q_len for g in kind.attention.groups) == [1, 2, 3, 5]
    together = r.run(batch).copy()
    row = 0
    for k, s in enumerate(idx):
        alone = r.run(ForwardBatch(ids[k], np.arange(starts[k], starts[k] + q_lens[k]), [q_lens[k]],
                                   [starts[k] + q_lens[k]], [tables[s]], np.arange(q_lens[k])))
        # float rounding only (5 rows alone run as one sgemm, as matvecs in the batch): a mask error is O(1)
        assert np.abs(together[row:row + q_lens[k]] - alone).max() <= 3e-4, s
        assert list(np.argmax(together[row:row + q_lens[k]], -1)) == list(np.argmax(alone, -1))
        row += q_lens[k]
