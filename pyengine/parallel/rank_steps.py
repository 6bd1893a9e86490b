"""S17: this rank's part of each step (`RankSteps`, a part of `MPIGroup`) — one step at a time (micro-batched stages
with pp >= 2) or, cross-step, rank 0's ``launch`` / ``finish`` of the steps of M groups in flight; a worker's loop
of rank 0's orders. The rank's runner is used only through its `RankRunner` surface (engine/executor.py); the
messages and their tags are parallel/wire.py's; waiting, orders and failures are `MPIGroup`'s (parallel/mpi.py).
"""
from __future__ import annotations

import sys
import time

import numpy as np

from pyengine.engine.forward_batch import ForwardBatch
from pyengine.parallel.prompt_rows import encode_rows, split_rows
from pyengine.parallel.wire import (OP_FINISH, OP_KV_GATHER, OP_KV_SCATTER, OP_LAUNCH, OP_STATS, OP_STEP, TAG_ACT,
                                    TAG_BACK, _PeerLost, batch_cuts, encode_batch, split_batch, with_rows)

MICRO_BATCHES_PER_STAGE = 2    # within-step: 2M micro-batches per step, bubble (M-1)/(3M-1) (docs/performance.md)


class RankSteps:
    # --- this rank's part of a step -------------------------------------------------------------------
    def _timed(self, fn, *args, count: bool = True):
        """Run a part of a step, counting it in ``steps`` and its time, less the waits, in ``busy_s``."""
        t0, c0 = time.perf_counter(), self.comm_s
        self._in_step = True
        try:
            return fn(*args)
        finally:
            self._in_step = False
            self.steps += count
            self.busy_s += time.perf_counter() - t0 - (self.comm_s - c0)

    # A rank's runner is used through engine/executor.py's `RankRunner` surface only (plan and run a step or a
    # stage's parts, whole KV blocks): the runner never calls the group back.
    def step(self, runner, batch: ForwardBatch, prompt_rows=None):
        """One step at a time: this rank's part of it; rank 0 returns the logits (len(logits_indices), V).
        ``prompt_rows``: S19's `PromptRows` of the step (their values: ``prompt_result``, parallel/prompt_rows.py)."""
        return self._timed(self._step, runner, batch, prompt_rows)

    def launch(self, runner, batch: ForwardBatch, prompt_rows=None) -> int:
        """Rank 0, cross-step: start a step (its plan to every rank, stage 0's layers, activations sent on) and
        return at once; ``finish`` it later, steps in launch order."""
        self._post(*with_rows(*encode_batch(batch, OP_LAUNCH), encode_rows(prompt_rows)))
        self._timed(self._stage_part, runner, batch, 0, None if prompt_rows is None else prompt_rows.rows)
        rows = len(batch.logits_indices)
        self._open.append(rows)
        self._open_rows.append(prompt_rows)
        return rows

    def finish(self, runner, discard: bool = False) -> np.ndarray | None:
        """Rank 0, cross-step: the logits of the oldest launched step, once the last stage sends its rows
        (``discard``: only take the rows back)."""
        rows = self._open.pop(0)
        if self.tp > 1:                   # the stage's other tensor ranks compute their columns of the head
            self._post(self._order(OP_FINISH, rows, int(discard)), ranks=range(1, self.tp))
        return self._timed(self._finish_part, runner, rows, self._open_rows.pop(0), discard, count=False)

    def _finish_part(self, runner, rows: int, prompt_rows, discard: bool):
        """Stage 0, cross-step: the head over the oldest step's rows, then its S19 prompt rows (reduced)."""
        logits = self._head_part(runner, rows, 0, 0, discard)
        if prompt_rows is not None:
            hidden = self.recv_rows(len(prompt_rows.rows), 0)
            if not discard:
                self.prompt_values(runner, hidden, prompt_rows)
        return logits

    def _stage_part(self, runner, batch: ForwardBatch, j: int = 0, rows: np.ndarray | None = None) -> None:
        """This stage's layers over ``batch`` (micro-batch ``j``): embed or receive, run, send on (not waited);
        the last stage also sends back S19's residual ``rows``."""
        p = self.part
        step = runner.stage_input(batch)
        if p.stage == 0:
            runner.embed(step)
        else:
            self._wait(self.world.Irecv(step.x, self.prev, TAG_ACT + j), "activations")
        runner.run_layers(step)
        if p.stage < self.pp - 1:
            out, tag = step.x.copy(), TAG_ACT + j
        else:                             # the last stage: the rows whose logits are wanted, back to stage 0
            out, tag = np.take(step.x, step.logits_indices, axis=0), TAG_BACK + j
            self.send_rows(runner, step.x, rows, j)
        self._sending.append((self.world.Isend(out, self.next, tag), out))
        self._reap()

    def _head_part(self, runner, rows: int, j: int = 0, first: int = 0, discard: bool = False):
        """Stage 0: receive ``rows`` rows from the last stage, then the LM head over them (its tensor ranks'
        columns gathered onto rank 0: rank 0's logits at buffers.logits[first:], or new ones if more rows);
        ``discard``: only take the rows (a step still in flight at stop)."""
        hx = np.empty((rows, self.d_model), np.float32)
        self._wait(self.world.Irecv(hx, self.rank + (self.pp - 1) * self.tp, TAG_BACK + j), "last stage")
        if discard:
            return None
        return runner.head(hx, first)

    def _step(self, runner, batch, prompt_rows=None):
        p = self.part
        if self.pp == 1:
            logits = runner.run_part(batch)
            if prompt_rows is not None:   # S19: every rank holds the final residual rows
                self.prompt_values(runner, runner.run_rows(prompt_rows.rows), prompt_rows)
            return logits
        mbs = split_batch(batch, MICRO_BATCHES_PER_STAGE * self.pp)
        extra = None if prompt_rows is None else \
            split_rows(prompt_rows.rows, batch_cuts(batch.num_tokens, MICRO_BATCHES_PER_STAGE * self.pp))
        for j, (mb, _) in enumerate(mbs):
            self._stage_part(runner, mb, j, None if extra is None else extra[j][0])
        logits = None
        if p.stage == 0:
            R = len(batch.logits_indices)
            logits = planned = runner.logits_rows(R)      # the head writes into the runner's rows
            first = 0
            for j, (mb, sel) in enumerate(mbs):
                part = self._head_part(runner, len(sel), j, first)
                if planned is None:                       # more rows than planned: not in the runner's rows
                    if logits is None:
                        logits = np.empty((R, part.shape[1]), np.float32)
                    logits[first:first + len(sel)] = part
                first += len(sel)
                if extra is not None:                     # S19: this micro-batch's prompt rows
                    if j == 0:
                        hidden = np.empty((len(prompt_rows.rows), self.d_model), np.float32)
                    hidden[extra[j][1]] = self.recv_rows(len(extra[j][0]), j)
            order = np.concatenate([sel for _, sel in mbs])
            if R and not np.array_equal(order, np.arange(R)):
                out = np.empty_like(logits)
                out[order] = logits
                logits = out
            if extra is not None:
                self.prompt_values(runner, hidden, prompt_rows)
        self._reap(wait=True)
        return logits

    def worker_loop(self, runner) -> None:
        """A worker rank: follow rank 0's orders until it says stop."""
        self.held = runner.held                   # what this rank holds (weights, KV cache), in its stats
        try:
            while True:
                header = self.recv_step()
                if header is None:
                    return
                op = int(header[0])
                if op == OP_STATS:
                    self.stats()
                elif op in (OP_KV_GATHER, OP_KV_SCATTER):     # S18: a disaggregated instance's KV blocks
                    self._kv_follow(runner, op, int(header[1]))
                elif op == OP_FINISH:     # stage 0's other tensor ranks: their columns of the LM head
                    self._timed(self._finish_part, runner, int(header[3]), self._open_rows.pop(0),
                                bool(header[5]), count=False)
                else:
                    batch = self.recv_plan(header)
                    rows = self.plan_rows             # S19's prompt rows of the step, or None
                    if op == OP_STEP:
                        self._timed(self._step, runner, batch, rows)
                    else:
                        if self.part.stage == 0:      # its head part comes with rank 0's OP_FINISH
                            self._open_rows.append(rows)
                        self._timed(self._stage_part, runner, batch, 0, None if rows is None else rows.rows)
        except _PeerLost as exc:
            self._failure = str(exc)
            print(f"pyengine rank {self.rank}: {exc}; waiting for rank 0 to stop", file=sys.stderr, flush=True)
            self.await_stop()
