"""S17: what the ranks of an MPI group say to each other — the orders and tags of its messages, a step plan as int64
arrays (`encode_batch` / `decode_batch`), the micro-batches of a within-step pipeline (`split_batch`), and the errors
of a group that lost a rank. Used by parallel/mpi.py (`MPIGroup`), parallel/rank_steps.py and parallel/kv_shards.py.
"""
from __future__ import annotations

import numpy as np

from pyengine.engine.forward_batch import ForwardBatch

OP_STEP, OP_STOP, OP_STATS, OP_LAUNCH, OP_FINISH = 1, 2, 3, 4, 5
OP_KV_GATHER, OP_KV_SCATTER = 6, 7     # S18: a TP instance's whole KV blocks (kv_gather / kv_scatter)
HEADER = 8                     # int64 slots: op, T, sequences, logits rows, block-table entries, discard,
                               # prompt-value rows (S19: parallel/prompt_rows.py)
TAG_ACT, TAG_BACK, TAG_STOP, TAG_PLAN = 1000, 2000, 3000, 4000
TAG_KV = 5000                  # S18: KV shards, follower -> rank 0 (gather) and rank 0 -> follower (+1, scatter)


class ParallelError(RuntimeError):
    """A rank stopped answering: the group cannot run steps any more."""


class _PeerLost(Exception):
    """A worker's step met a failed or silent rank: it stops computing and waits for rank 0's STOP."""


def encode_batch(batch: ForwardBatch, op: int = OP_STEP) -> tuple[np.ndarray, np.ndarray]:
    """(header, payload) int64 arrays of a step plan."""
    tables = [np.asarray(t, np.int64) for t in batch.block_tables]
    lens = [len(t) for t in tables]
    header = np.array([op, batch.num_tokens, batch.num_seqs, len(batch.logits_indices), sum(lens), 0, 0, 0],
                      np.int64)
    payload = np.concatenate([np.asarray(batch.token_ids, np.int64), np.asarray(batch.positions, np.int64),
                              np.asarray(batch.query_lens, np.int64), np.asarray(batch.context_lens, np.int64),
                              np.asarray(lens, np.int64)] + tables
                             + [np.asarray(batch.logits_indices, np.int64)])
    return header, payload


def decode_batch(header: np.ndarray, payload: np.ndarray) -> ForwardBatch:
    T, S, R, nt = (int(v) for v in header[1:5])
    cut = np.cumsum([T, T, S, S, S, nt])
    tok, pos, ql, cl, tl, flat, li = np.split(payload, cut)
    tables = np.split(flat.astype(np.int32), np.cumsum(tl)[:-1]) if S else []
    return ForwardBatch(tok, pos, ql.tolist(), cl.tolist(), tables, li)


def batch_cuts(T: int, n: int) -> list[int]:
    """Where ``split_batch`` cuts T tokens into (at most) ``n`` micro-batches."""
    n = max(1, min(n, T))
    return sorted({round(T * j / n) for j in range(n + 1)})


def with_rows(header: np.ndarray, payload: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """S19: a plan with the int64 rows of its prompt values (parallel/prompt_rows.py) after its payload, their
    length in header slot 6."""
    if not len(rows):
        return header, payload
    header[6] = len(rows)
    return header, np.concatenate([payload, rows])


def split_batch(batch: ForwardBatch, n: int) -> list[tuple[ForwardBatch, np.ndarray]]:
    """Cut a batch into ``n`` micro-batches of about T / n consecutive tokens; a sequence cut in two becomes a
    first piece (its context ends where the piece does) and a second. Returns [(micro-batch, sel)]: sel = the
    positions in batch.logits_indices of the micro-batch's logits rows, in its order."""
    cuts = batch_cuts(batch.num_tokens, n)
    starts = np.concatenate([[0], np.cumsum(batch.query_lens)]).astype(np.int64)
    li = np.asarray(batch.logits_indices, np.int64)
    out = []
    for a, b in zip(cuts, cuts[1:]):
        ql, cl, tabs = [], [], []
        for s, (q, c, t) in enumerate(zip(batch.query_lens, batch.context_lens, batch.block_tables)):
            s0, s1 = int(starts[s]), int(starts[s] + q)
            lo, hi = max(a, s0), min(b, s1)
            if lo < hi:
                ql.append(hi - lo)
                cl.append(c - (s1 - hi))
                tabs.append(t)
        sel = np.nonzero((li >= a) & (li < b))[0]
        out.append((ForwardBatch(batch.token_ids[a:b], batch.positions[a:b], ql, cl, tabs, li[sel] - a), sel))
    return out
