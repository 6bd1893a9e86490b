"""S09: the metadata of one ragged forward batch.

Continuous batching runs prefills and decodes of many sequences in one forward pass: their new tokens are
concatenated into one (T,) array, so every weight is applied in one GEMM. The per-sequence lists say where
each sequence's rows start and which KV-cache blocks hold its context.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ForwardBatch:
    token_ids: np.ndarray            # (T,) int64: new tokens of all sequences, concatenated
    positions: np.ndarray            # (T,) int64: position of each token in its sequence
    query_lens: list[int]            # new tokens per sequence; sum == T
    context_lens: list[int]          # cached tokens per sequence after this step (= first position + query_len)
    block_tables: list[np.ndarray]   # per sequence, int32 block ids covering context_lens
    logits_indices: np.ndarray       # rows of T whose logits are wanted (usually each sequence's last token)

    @property
    def num_tokens(self) -> int:
        return int(len(self.token_ids))

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def validate(self, block_size: int, num_blocks: int, vocab_size: int | None = None) -> None:
        """ValueError naming the field if the batch is inconsistent (cheap: O(T + blocks))."""
        T = len(self.token_ids)
        if np.ndim(self.token_ids) != 1 or np.ndim(self.positions) != 1 or len(self.positions) != T:
            raise ValueError(f"token_ids and positions must be 1-D of equal length, got "
                             f"{np.shape(self.token_ids)} and {np.shape(self.positions)}")
        n = len(self.query_lens)
        if len(self.context_lens) != n or len(self.block_tables) != n:
            raise ValueError(f"query_lens, context_lens and block_tables must have one entry per sequence, got "
                             f"{n}, {len(self.context_lens)}, {len(self.block_tables)}")
        if sum(self.query_lens) != T:
            raise ValueError(f"sum(query_lens) = {sum(self.query_lens)} != number of tokens {T}")
        if T and vocab_size is not None:
            lo, hi = int(np.min(self.token_ids)), int(np.max(self.token_ids))
            if lo < 0 or hi >= vocab_size:
                raise ValueError(f"token_ids must be in [0, {vocab_size}), got {lo if lo < 0 else hi}")
        start = 0
        for s, (q, c, table) in enumerate(zip(self.query_lens, self.context_lens, self.block_tables)):
            if q < 0 or c < q:
                raise ValueError(f"sequence {s}: query_len {q} / context_len {c} invalid (need 0 <= q <= c)")
            if q and (int(self.positions[start]) != c - q or int(self.positions[start + q - 1]) != c - 1):
                raise ValueError(f"sequence {s}: positions must run from context_len - query_len = {c - q} "
                                 f"to {c - 1}")
            need = -(-c // block_size)
            if len(table) < need:
                raise ValueError(f"sequence {s}: block_tables[{s}] has {len(table)} blocks, context_len {c} "
                                 f"needs {need}")
            if need and (int(np.min(table[:need])) < 0 or int(np.max(table[:need])) >= num_blocks):
                raise ValueError(f"sequence {s}: block_tables[{s}] has block ids outside [0, {num_blocks})")
            start += q
        li = np.asarray(self.logits_indices)
        if li.ndim != 1 or (li.size and (int(li.min()) < 0 or int(li.max()) >= T)):
            raise ValueError(f"logits_indices must be a 1-D array of rows in [0, {T})")


def build_batch(sched, scores_only=lambda seq: False) -> tuple[ForwardBatch, list]:
    """The ragged batch of a scheduler output (engine/scheduler.py `SchedulerOutput`) and the sequences it samples:
    those whose known tokens (prompt, recompute) it completes, with k + 1 logits rows each for k drafts (S14),
    unless ``scores_only(seq)`` (S19: a request that only scores its prompt, or pools it)."""
    token_ids: list[int] = []
    positions: list[int] = []
    query_lens, context_lens, block_tables, logits_indices, sampled = [], [], [], [], []
    for seq, n in sched.scheduled:
        start = seq.num_computed_tokens
        k = len(seq.spec_token_ids)          # S14: a decode's drafts ride behind its last token
        token_ids.extend(seq.token_ids[start:start + n - k])
        token_ids.extend(seq.spec_token_ids)
        positions.extend(range(start, start + n))
        query_lens.append(n)
        context_lens.append(start + n)
        block_tables.append(np.asarray(seq.block_table, dtype=np.int32))
        if start + n - k == seq.num_tokens and not scores_only(seq):   # complete: sample the next token
            logits_indices.extend(range(len(token_ids) - k - 1, len(token_ids)))   # k + 1 rows to verify
            sampled.append(seq)
    batch = ForwardBatch(token_ids=np.asarray(token_ids, dtype=np.int64),
                         positions=np.asarray(positions, dtype=np.int64),
                         query_lens=query_lens, context_lens=context_lens, block_tables=block_tables,
                         logits_indices=np.asarray(logits_indices, dtype=np.int64))
    return batch, sampled
