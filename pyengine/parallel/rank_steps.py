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
from pyengine.parallel.wire import (OP_FINISH, OP_KV_GATHER, OP_KV_SCATTER, OP_LAUNCH, OP_STATS, OP_STEP, TAG_ACT,
                                    TAG_BACK, _PeerLost, encode_batch, split_batch)

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
    def step(self, runner, batch: ForwardBatch):
        """One step at a time: this rank's part of it; rank 0 returns the logits (len(logits_indices), V)."""
        return self._timed(self._step, runner, batch)

    def launch(self, runner, batch: ForwardBatch) -> int:
        """Rank 0, cross-step: start a step (its plan to every rank, stage 0's layers, activations sent on) and
        return at once; ``finish`` it later, steps in launch order."""
        self._post(*encode_batch(batch, OP_LAUNCH))
        self._timed(self._stage_part, runner, batch)
        rows = len(batch.logits_indices)
        self._open.append(rows)
        return rows

    def finish(self, runner, discard: bool = False) -> np.ndarray | None:
        """Rank 0, cross-step: the logits of the oldest launched step, once the last stage sends its rows
        (``discard``: only take the rows back)."""
        rows = self._open.pop(0)
        if self.tp > 1:                   # the stage's other tensor ranks compute their columns of the head
            self._post(self._order(OP_FINISH, rows, int(discard)), ranks=range(1, self.tp))
        return self._timed(self._head_part, runner, rows, 0, 0, discard, count=False)

    def _stage_part(self, runner, batch: ForwardBatch, j: int = 0) -> None:
        """This stage's layers over ``batch`` (micro-batch ``j``): embed or receive, run, send on (not waited)."""
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

    def _step(self, runner, batch):
        p = self.part
        if self.pp == 1:
            return runner.run_part(batch)
        mbs = split_batch(batch, MICRO_BATCHES_PER_STAGE * self.pp)
        for j, (mb, _) in enumerate(mbs):
            self._stage_part(runner, mb, j)
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
            order = np.concatenate([sel for _, sel in mbs])
            if R and not np.array_equal(order, np.arange(R)):
                out = np.empty_like(logits)
                out[order] = logits
                logits = out
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
                    self._timed(self._head_part, runner, int(header[3]), 0, 0, bool(header[5]), count=False)
                else:
                    batch = self.recv_plan(header)
                    self._timed(self._step if op == OP_STEP else self._stage_part, runner, batch)
        except _PeerLost as exc:
            self._failure = str(exc)
            print(f"pyengine rank {self.rank}: {exc}; waiting for rank 0 to stop", file=sys.stderr, flush=True)
            self.await_stop()
