"""S06: attention over the paged KV cache, as the runner planned it for this step.

The model calls ``paged_attention(layer, q, kv, plan, out, scratch, scale)`` and never sees a block table: the
runner (engine/step_plan.py) has already turned the batch's block tables into an `AttentionPlan` of
  QueryGroup  sequences with a few new tokens each (decodes: 1; speculative verification: a few), attended
              together in one batched call over their contexts' blocks, gathered into padded scratch (or read
              in place for a lone sequence whose blocks are consecutive);
  QueryRun    a sequence with many new tokens (a prompt or a chunk), attended alone, plain or tiled (flash).
One plan per kind of layer: Gemma's sliding-window layers read only the blocks of their window.
``kv`` is the paged cache (engine/kv_cache.py): ``read(layer, start, n, k_out, v_out)``, ``gather`` and
``gather_blocks(layer, blocks, k_out, v_out)`` (float32 views or converted rows, whatever the cache stores), and
for query groups on an fp16 / q8_0 / q4_0 cache ``stored(layer, blocks, start)`` (the rows as stored, which
stored_decode_attention converts tile by tile, the Q8_0 / Q4_0 scales folded into scores and probabilities);
``scratch`` has the fields k_ctx, v_ctx, k_batch, v_batch and scores.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pyengine import tuning
from pyengine.layers.attention import (decode_attention, flash_attention, grouped_attention, stored_decode_attention,
                                      stored_scratch_floats)


class QueryGroup(NamedTuple):
    """Sequences with ``q_len`` new tokens each, attended in one batched call (built once per step)."""
    rows: slice | np.ndarray   # their q_len * G rows in the batch, sequence after sequence: a slice if consecutive
    q_len: int                 # new tokens per sequence (1 for decodes)
    blocks: np.ndarray         # (G, n_blocks) block ids read; padding repeats the last valid block (read but masked)
    lens: np.ndarray           # (G,) context lengths
    mask: np.ndarray           # (G, 1, 1, n_blocks * block_size) (q_len 1, no window) or (G, 1, 1, q_len, n*bs):
    #                            True where a key is hidden (padding, causal order, sliding window)
    start: int | None          # a lone sequence with consecutive blocks: its first cache slot (no gather)


class QueryRun(NamedTuple):
    """A sequence with many new tokens, attended alone."""
    rows: slice                # its rows in the batch
    keys: object               # how it reads its keys from the cache (engine.kv_cache.ContextView)
    offset: int                # position of its first query counted from the first key read
    flash: bool                # tiled online softmax (long queries) or one plain softmax


class AttentionPlan(NamedTuple):
    """How one kind of layer attends in this step."""
    groups: list               # [QueryGroup]
    runs: list                 # [QueryRun]
    window: int | None         # sliding window (keys j visible to position i when i - j < window), or None


def group_mask(lens: np.ndarray, key_starts: np.ndarray, q_len: int, L: int, window: int | None) -> np.ndarray:
    """The mask of a QueryGroup: key l of sequence b (absolute position key_starts[b] + l) is hidden from its
    query j (position lens[b] - q_len + j) if it comes later, or is out of the window."""
    lens = np.asarray(lens, dtype=np.int64)
    key_starts = np.asarray(key_starts, dtype=np.int64)
    if lens.ndim != 1 or (lens.size and (int((lens - key_starts).min()) < 1 or int((lens - key_starts).max()) > L)):
        raise ValueError(f"attention context lengths must be in [1, {L}] keys, got {lens - key_starts}")
    keys = key_starts[:, None, None] + np.arange(L)[None, None, :]              # (G, 1, L)
    qpos = (lens[:, None] - q_len + np.arange(q_len)[None, :])[:, :, None]    # (G, Q, 1)
    hidden = keys > qpos
    if window is not None:
        hidden |= qpos - keys >= window
    if q_len == 1 and window is None:
        return hidden[:, None, :, :]                                            # (G, 1, 1, L)
    return hidden[:, None, None, :, :]


def group_attention(layer: int, q: np.ndarray, kv, group: QueryGroup, out: np.ndarray, scratch,
                    scale: float, softcap: float | None = None) -> None:
    """One QueryGroup: its context blocks gathered (whole blocks, into scratch) into a padded
    (G, n_blocks * block_size, Hkv, hd) buffer, or a lone sequence's consecutive blocks read in place; a cache
    stored as fp16 / q8_0 / q4_0 is read as stored, in tiles of whole blocks (stored_decode_attention)."""
    G, nb = group.blocks.shape
    bs = kv.block_size
    n = G * nb * bs
    Q = group.q_len
    qs = q[group.rows]
    if Q > 1:
        qs = qs.reshape((G, Q) + q.shape[1:])
    o = out[group.rows].reshape(qs.shape) if isinstance(group.rows, slice) else None
    if kv.converts:
        k, v = kv.stored(layer, group.blocks, group.start)
        tile = tuning.KV_TILE_SLOTS // G or 1
        need = stored_scratch_floats(kv.dtype, G, n // G, tile, kv.n_kv_heads, kv.head_dim,
                                     q.shape[1] // kv.n_kv_heads * Q)
        res = stored_decode_attention(qs, k, v, kv.dtype, group.mask, tile, scale=scale, out=o,
                                      scratch=scratch.scores, tile_scratch=kv.tile_scratch(need), softcap=softcap)
    else:
        if group.start is not None:             # zero-copy
            k, v = kv.read(layer, group.start, n, scratch.k_batch, scratch.v_batch)
        else:
            k, v = kv.gather_blocks(layer, group.blocks, scratch.k_batch[:n], scratch.v_batch[:n])
        shape = (G, nb * bs) + k.shape[-2:]
        res = decode_attention(qs, k.reshape(shape), v.reshape(shape), scale=scale, scratch=scratch.scores,
                               pad=group.mask, out=o, softcap=softcap)
    if not isinstance(group.rows, slice):
        out[group.rows] = res.reshape((G * Q,) + q.shape[1:])


def run_attention(layer: int, q: np.ndarray, kv, run: QueryRun, out: np.ndarray, scratch, scale: float,
                  window: int | None, softcap: float | None = None) -> None:
    """One QueryRun: plain softmax, or tiled flash attention for long queries."""
    k, v = run.keys.kv(kv, layer, scratch.k_ctx, scratch.v_ctx)
    qs, o = q[run.rows], out[run.rows]
    if run.flash:
        flash_attention(qs, k, v, offset=run.offset, scale=scale, tile=tuning.FLASH_TILE,
                        q_tile=tuning.FLASH_Q_TILE, out=o, scratch=scratch.scores, window=window, softcap=softcap)
    else:
        grouped_attention(qs, k, v, offset=run.offset, scale=scale, out=o, scratch=scratch.scores, window=window,
                          softcap=softcap)


def paged_attention(layer: int, q: np.ndarray, kv, plan: AttentionPlan, out: np.ndarray, scratch,
                    scale: float, softcap: float | None = None) -> np.ndarray:
    """out (T, H, hd) = attention of every sequence's new queries q (T, H, hd) over its cached context (this
    layer's K/V of the new tokens already written); ``softcap``: Gemma 2's attention-logit soft-capping."""
    for group in plan.groups:
        group_attention(layer, q, kv, group, out, scratch, scale, softcap)
    for run in plan.runs:
        run_attention(layer, q, kv, run, out, scratch, scale, plan.window, softcap)
    return out
