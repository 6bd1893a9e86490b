"""S19 under S17: prompt logprobs and pooled states of a step run by the ranks of an MPI group.

The engine names the rows of a step whose values it wants (engine/prompt_logprobs.py `PromptRows`: rows whose
prompt logprobs are wanted, with the ids they predict and the top k, and rows whose final state is pooled); they
go with the step's plan to every rank (``encode_rows``: appended to the plan's payload, their length in the
header). Where the final residual rows are:

    one stage (tensor parallelism only)  every rank holds them after the step (the residual is replicated)
    pipeline stages                       the last stage sends them back to stage 0 (TAG_ROWS, beside the rows
                                          whose logits are sampled), each of its tensor ranks to its peer there

Stage 0's tensor ranks then reduce them (`PromptRowsSteps.prompt_values`): each computes its columns of the
logits (the LM head is split by vocabulary) in slices of at most PROMPT_LOGITS_BYTES, the row's target logit is
summed over them (one float per row), and each sends rank 0 only its max, its sum of exponentials, how many of
its logits beat the target and its top-k (3 + 2k numbers per row, never a vocabulary row); rank 0 merges them
into the entries one process computes (`merge_stats`). Pooled rows need only the final norm: rank 0 applies it.
"""
from __future__ import annotations

import numpy as np

from pyengine.engine.prompt_logprobs import (PROMPT_LOGITS_BYTES, PromptRows, PromptValues, column_stats,
                                             merge_stats, target_logits)

TAG_ROWS = 6000                # + micro-batch: the last stage's residual rows wanted for prompt values
TAG_STATS = 9                  # on the tensor communicator: a rank's column statistics, to its rank 0


def encode_rows(rows: PromptRows | None) -> np.ndarray:
    """int64 [k, logprob rows, hidden rows, logprob rows..., next ids..., hidden rows...] (empty: none)."""
    if rows is None:
        return np.zeros(0, np.int64)
    return np.concatenate([np.array([rows.k, len(rows.logprob_rows), len(rows.hidden_rows)], np.int64),
                           rows.logprob_rows, rows.next_ids, rows.hidden_rows]).astype(np.int64)


def decode_rows(a: np.ndarray) -> PromptRows | None:
    if not len(a):
        return None
    k, n, h = (int(v) for v in a[:3])
    return PromptRows(a[3:3 + n], a[3 + n:3 + 2 * n], k, a[3 + 2 * n:3 + 2 * n + h])


def split_rows(rows: np.ndarray, cuts: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per micro-batch [cuts[j], cuts[j+1]) (wire.split_batch's): (its rows, local to it; their positions in
    ``rows``)."""
    out = []
    for a, b in zip(cuts, cuts[1:]):
        sel = np.nonzero((rows >= a) & (rows < b))[0]
        out.append((rows[sel] - a, sel))
    return out


class PromptRowsSteps:
    """A part of `MPIGroup` (as `RankSteps`): the rows of a step and their reduction on stage 0's tensor ranks."""

    prompt_result: PromptValues | None = None     # rank 0: the values of the step run or finished last

    def send_rows(self, runner, x: np.ndarray, rows: np.ndarray | None, j: int) -> None:
        """The last stage: residual rows ``rows`` of ``x`` back to this tensor rank's peer on stage 0."""
        if rows is not None and len(rows):
            out = np.take(x, rows, axis=0)
            self._sending.append((self.world.Isend(out, self.next, TAG_ROWS + j), out))

    def recv_rows(self, n: int, j: int) -> np.ndarray:
        """Stage 0: ``n`` residual rows of micro-batch ``j`` from the last stage."""
        hx = np.empty((n, self.d_model), np.float32)
        if n:
            self._wait(self.world.Irecv(hx, self.rank + (self.pp - 1) * self.tp, TAG_ROWS + j), "last stage rows")
        return hx

    def prompt_values(self, runner, hidden: np.ndarray, rows: PromptRows) -> None:
        """Stage 0's tensor ranks, all of them, in the same order: reduce the final residual rows ``hidden``
        (logprob rows first, then hidden rows); rank 0 keeps the values in ``prompt_result``."""
        n = len(rows.logprob_rows)
        lead = self.part.tp_rank == 0
        entries: list = []
        step = max(1, PROMPT_LOGITS_BYTES // (4 * self.vocab_bounds[-1]))
        for a in range(0, n, step):
            v0, cols = runner.logit_columns(hidden[a:min(n, a + step)])
            ids = rows.next_ids[a:a + len(cols)]
            target = target_logits(cols, v0, ids)
            self.allreduce(target)
            parts = self._gather_stats(column_stats(cols, v0, target, rows.k))
            if lead:
                entries.extend(merge_stats(parts, target, ids, rows.k))
        if self.is_driver:
            pooled = runner.final_states(hidden[n:]) if len(rows.hidden_rows) else None
            self.prompt_result = PromptValues(entries, pooled)

    def _gather_stats(self, mine: np.ndarray) -> list | None:
        """Tensor rank 0: every tensor rank's statistics (its own first); the others send theirs."""
        if self.tp == 1:
            return [mine]
        if self.part.tp_rank != 0:
            self._wait(self.tp_comm.Isend(np.ascontiguousarray(mine), 0, TAG_STATS), "prompt logprobs")
            return None
        bufs = [np.empty_like(mine) for _ in range(1, self.tp)]
        self._wait([self.tp_comm.Irecv(b, r, TAG_STATS) for r, b in enumerate(bufs, start=1)], "prompt logprobs")
        return [mine] + bufs
