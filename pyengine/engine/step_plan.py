"""S06/S09: the runner's plan of one forward step — everything the model needs that is not weights or math.

``plan_step`` turns a `ForwardBatch` (token ids, positions, block tables) into a `StepPlan`: the cache slot of
each new token, this step's RoPE rows per kind of layer, and per kind of layer an `AttentionPlan` saying how
each sequence reads its context (layers/paged_attention.py). The model then never sees a block table
(nano-vllm's shape: the runner prepares the step, attention reads the context).

Sequences with at most SHORT_QUERY_MAX new tokens (decodes; speculative verification's k+1) are grouped by
their query length and attended in batched calls over gathered, padded contexts of at most DECODE_SLOTS slots
(similar lengths together pad less); a sequence alone in its group whose blocks are consecutive reads them in
place. Longer ones (prompts, chunks) are runs, tiled (flash) from FLASH_MIN_QUERY queries. A sliding-window
kind of layer reads only the blocks of each sequence's window.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pyengine import tuning
from pyengine.engine.kv_cache import ContextView, contiguous_start, slot_mapping
from pyengine.layers.paged_attention import AttentionPlan, QueryGroup, QueryRun, group_mask


class KindPlan(NamedTuple):
    """One kind of layer (Gemma: sliding-window or global) in this step."""
    cos: np.ndarray            # (T, H + Hkv, hd/2) RoPE rows of this step, repeated per rotated head
    sin: np.ndarray
    attention: AttentionPlan


class StepPlan(NamedTuple):
    num_tokens: int            # T
    token_ids: np.ndarray      # (T,) int64
    slots: np.ndarray          # (T,) int64 cache slot of each new token
    kinds: list                # [KindPlan], indexed by the model's kind_of[layer]
    logits_indices: np.ndarray  # rows of T whose logits are wanted


def plan_step(batch, block_size: int, windows: list, rope_tables: list, rope_rows: list, max_slots: int,
              flash_min_query: int | None = None) -> StepPlan:
    """The plan of one step. ``windows``: per kind of layer its sliding window or None; ``rope_tables``: per kind
    (cos, sin) tables (max_model_len, hd/2); ``rope_rows``: per kind (cos, sin) buffers (>= T, H+Hkv, hd/2) to
    fill; ``max_slots``: padded slots a group may gather."""
    flash_min = tuning.FLASH_MIN_QUERY if flash_min_query is None else flash_min_query
    positions = np.asarray(batch.positions, dtype=np.int64)
    T = len(positions)
    short, long_, slots, start = [], [], [], 0
    for qlen, ctx, table in zip(batch.query_lens, batch.context_lens, batch.block_tables):
        slots.append(slot_mapping(positions[start:start + qlen], table, block_size))
        if 0 < qlen <= tuning.SHORT_QUERY_MAX:
            short.append((start, qlen, ctx, table))
        elif qlen:
            long_.append((start, qlen, ctx, table))
        start += qlen
    slots = np.concatenate(slots) if slots else np.zeros(0, np.int64)
    kinds = []
    for window, (tcos, tsin), (rcos, rsin) in zip(windows, rope_tables, rope_rows):
        cos, sin = rcos[:T], rsin[:T]
        # this step's cos/sin, repeated for the rotated heads once here rather than broadcast per layer
        np.copyto(cos, np.take(tcos, positions, axis=0)[:, None, :])
        np.copyto(sin, np.take(tsin, positions, axis=0)[:, None, :])
        groups = query_groups(short, block_size, max_slots, window)
        runs = []
        for a, qlen, ctx, table in long_:
            first = 0 if window is None else max(0, ctx - qlen - window + 1)
            runs.append(QueryRun(slice(a, a + qlen), ContextView(table, ctx, block_size, first),
                                 ctx - qlen - first, qlen >= flash_min))
        kinds.append(KindPlan(cos, sin, AttentionPlan(groups, runs, window)))
    return StepPlan(T, np.asarray(batch.token_ids, dtype=np.int64), slots, kinds,
                    np.asarray(batch.logits_indices, dtype=np.int64))


def query_groups(seqs, block_size: int, max_slots: int, window: int | None = None) -> list:
    """Split sequences [(first row, q_len, context_len, block_table)] into `QueryGroup`s of one query length
    whose padded contexts fit ``max_slots`` (a longer sequence forms a group of its own)."""
    out = []
    for q_len in sorted({s[1] for s in seqs}):
        same = [s for s in seqs if s[1] == q_len]
        # the blocks each sequence reads: from its window's first block (or 0) to the end of its context
        reads = [(row, ctx) + read_span(q, ctx, block_size, window) + (table,) for row, q, ctx, table in same]
        out += _split_groups(reads, q_len, block_size, max_slots, window)
    return out


def read_span(q_len: int, ctx: int, block_size: int, window: int | None) -> tuple[int, int]:
    """(first block, number of blocks) a sequence with q_len new tokens of ctx reads: from its window's first
    block (or 0) to the end of its context."""
    b0 = 0 if window is None else max(0, ctx - q_len - window + 1) // block_size
    return b0, -(-ctx // block_size) - b0


def group_arrays(reads, q_len: int, block_size: int, window, blocks: np.ndarray | None = None,
                 mask: bool = True):
    """(blocks (G, nb), lens (G,), key_starts (G,), mask, start) of one group of reads [(row, ctx, b0, n,
    table)]: block ids padded by repeating the last valid one, into ``blocks`` if given (a captured step's,
    S13, which builds its mask itself: ``mask`` False gives None)."""
    nb = max(r[3] for r in reads)
    blocks = np.empty((len(reads), nb), np.int64) if blocks is None else blocks
    for j, (_, ctx, b0, n, table) in enumerate(reads):
        blocks[j, :n] = table[b0:b0 + n]
        blocks[j, n:] = table[b0 + n - 1]
    lens = np.array([r[1] for r in reads], np.int64)
    key_starts = np.array([r[2] * block_size for r in reads], np.int64)
    start = None
    if len(reads) == 1:
        _, ctx, b0, _, table = reads[0]
        start = contiguous_start(table[b0:], ctx - b0 * block_size, block_size)
    return (blocks, lens, key_starts, group_mask(lens, key_starts, q_len, nb * block_size, window) if mask else None,
            start)


def _split_groups(reads, q_len: int, block_size: int, max_slots: int, window) -> list:
    longest = max(r[3] for r in reads) * block_size
    if len(reads) * longest > max_slots:                  # must split: similar lengths together pad less
        reads = sorted(reads, key=lambda r: r[3])
    parts, cur, cur_nb = [], [], 0
    for r in reads:
        nb = max(cur_nb, r[3])
        if cur and (len(cur) + 1) * nb * block_size > max_slots:
            parts.append(cur)
            cur, nb = [], r[3]
        cur.append(r)
        cur_nb = nb
    parts.append(cur)
    groups = []
    for g in parts:
        starts = np.array([r[0] for r in g], np.int64)
        rows = (starts[:, None] + np.arange(q_len)[None, :]).reshape(-1)
        consecutive = bool(np.all(np.diff(rows) == 1))
        blocks, lens, _, mask, start = group_arrays(g, q_len, block_size, window)
        groups.append(QueryGroup(slice(int(rows[0]), int(rows[-1]) + 1) if consecutive else rows, q_len, blocks,
                                 lens, mask, start))
    return groups
