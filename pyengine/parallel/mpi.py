"""S17: the MPI runtime — rank 0 drives, every rank computes its part of each step.

    rank 0:  scheduler, sampling, HTTP  ->  Bcast(step plan: the ForwardBatch as one int64 array)  ->  its part
    rank r:  worker loop: receive the step, run its part, until a STOP message

One step on every rank (``MPIGroup.step``): the batch is cut into micro-batches of about T / n tokens (n = 1
without pipeline parallelism; a sequence may be cut between two: its second piece attends to the first's keys,
which the same stage wrote a moment before). Per micro-batch, stage 0 embeds the tokens, the other stages
receive the activations from the stage before (Recv), run their layers (their tensor-parallel products end with
an Allreduce over the stage's tensor ranks) and send the result on (Isend) — the last stage sends only the rows
whose logits are wanted back to stage 0, which holds the LM head (tied to the embedding in SmolLM2) and computes
the logits, gathered from its tensor ranks onto rank 0. While a later stage works on micro-batch j, the earlier
ones already work on j + 1: that is the overlap.

Every wait is a non-blocking request polled against a deadline (``timeout``): a rank that hangs mid-step makes
rank 0 raise `ParallelError` naming it instead of blocking forever; the runner then refuses every later step
(the server answers 503). Open MPI ends the whole job when a rank *dies* (its launcher kills the others), so a
dead rank ends the server too, with the launcher naming the rank. The transport is MPI's choice: shared memory
between ranks of one host, TCP (or a faster network) between hosts; ``OMPI_MCA_btl=tcp,self`` forces TCP.
"""
from __future__ import annotations

import os
import socket
import sys
import time

import numpy as np

from pyengine.engine.forward_batch import ForwardBatch
from pyengine.parallel.layout import plan_ranks

OP_STEP, OP_STOP, OP_STATS = 1, 2, 3
HEADER = 8                     # int64 slots: op, T, sequences, logits rows, block-table entries
MICRO_BATCHES_PER_STAGE = 2    # pipeline micro-batches per stage: bubble (M-1)/(2M-1) of a step with M stages
IDLE_SPIN_S = 0.005            # a worker waiting for the next step polls without sleeping this long, then sleeps
IDLE_SLEEP_S = 0.0005
DEFAULT_TIMEOUT_S = 60.0       # a step part that waits this long on another rank means that rank is stuck
TAG_ACT, TAG_BACK = 1000, 2000


class ParallelError(RuntimeError):
    """A rank stopped answering: the group cannot run steps any more."""


def launched_under_mpi() -> bool:
    """True inside a process started by mpiexec (Open MPI, MPICH / Hydra, PMIx launchers)."""
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK"))


def encode_batch(batch: ForwardBatch) -> tuple[np.ndarray, np.ndarray]:
    """(header, payload) int64 arrays of a step plan."""
    tables = [np.asarray(t, np.int64) for t in batch.block_tables]
    lens = [len(t) for t in tables]
    header = np.array([OP_STEP, batch.num_tokens, batch.num_seqs, len(batch.logits_indices), sum(lens), 0, 0, 0],
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


def split_batch(batch: ForwardBatch, n: int) -> list[tuple[ForwardBatch, np.ndarray]]:
    """Cut a batch into ``n`` micro-batches of about T / n consecutive tokens; a sequence cut in two becomes a
    first piece (its context ends where the piece does) and a second. Returns [(micro-batch, sel)]: sel = the
    positions in batch.logits_indices of the micro-batch's logits rows, in its order."""
    T = batch.num_tokens
    n = max(1, min(n, T))
    cuts = sorted({round(T * j / n) for j in range(n + 1)})
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


class MPIGroup:
    """This process's place in the MPI job and the messages of each step. ``tp`` x ``pp`` ranks; ``setup(config)``
    plans every rank's part (layout.plan_ranks) once the model's config is known."""

    def __init__(self, tp: int = 1, pp: int = 1, timeout: float = DEFAULT_TIMEOUT_S, comm=None):
        from mpi4py import MPI            # lazy: the core never needs it
        self.MPI = MPI
        self.world = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        self.tp, self.pp, self.timeout = int(tp), int(pp), float(timeout)
        if self.size != self.tp * self.pp:
            raise ValueError(f"the MPI job has {self.size} ranks but tensor_parallel_size {tp} x "
                             f"pipeline_parallel_size {pp} = {self.tp * self.pp}: start it with "
                             f"mpiexec -n {self.tp * self.pp} (or change the sizes); a hostfile must give that "
                             f"many slots")
        self.failure: str | None = None
        self.comm_s = 0.0                 # time spent waiting for messages (all kinds), since the last reset
        self.busy_s = 0.0                 # time computing this rank's part of steps
        self.steps = 0
        # who is where: (host, pid) of every rank, to name a stuck one
        self.where = self.world.allgather((socket.gethostname(), os.getpid()))
        if self.rank == 0:                # a driver that exits without closing its runner still sends STOP
            import atexit
            atexit.register(self.stop)

    # --- layout -----------------------------------------------------------------------------------
    def setup(self, config) -> None:
        self.parts = plan_ranks(config, self.tp, self.pp)
        self.part = p = self.parts[self.rank]
        self.tp_comm = self.world.Split(p.stage, p.tp_rank)
        self.vocab_bounds = [q.vocab[0] for q in self.parts[:self.tp]] + [config.vocab_size]
        self.next = self.rank + self.tp if p.stage < self.pp - 1 else p.tp_rank   # the last stage: back to 0
        self.prev = self.rank - self.tp if p.stage > 0 else None

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # --- waiting with a deadline ------------------------------------------------------------------
    def _wait(self, reqs, what: str, idle: bool = False) -> None:
        t0 = time.perf_counter()
        MPI = self.MPI
        done = MPI.Request.Testall(reqs) if isinstance(reqs, list) else reqs.Test()
        while not done:
            now = time.perf_counter()
            if idle and now - t0 > IDLE_SPIN_S:
                time.sleep(IDLE_SLEEP_S)
            elif not idle and now - t0 > self.timeout:
                self._stuck(what)
            done = MPI.Request.Testall(reqs) if isinstance(reqs, list) else reqs.Test()
        if not idle:
            self.comm_s += time.perf_counter() - t0

    def _stuck(self, what: str):
        if not self.is_driver:            # a worker never gives up (rank 0 decides; its exit ends the job)
            while True:
                time.sleep(1.0)
        host = socket.gethostname()
        named = []
        for r, (h, pid) in enumerate(self.where):
            if r and h == host:
                state = _proc_state(pid)
                if state in ("gone", "Z", "T", "t", "X"):
                    named.append(f"rank {r} (pid {pid}: {'stopped' if state in 'Tt' else 'dead'})")
        who = ", ".join(named) or f"one of ranks 1..{self.size - 1} (hosts: " \
                                 f"{', '.join(sorted({h for h, _ in self.where}))})"
        self.failure = f"{who} did not answer within {self.timeout:g} s ({what})"
        raise ParallelError(self.failure)

    # --- the collectives the parallel layers call ---------------------------------------------------
    def allreduce(self, buf: np.ndarray) -> None:
        """In-place sum over the stage's tensor ranks (RowParallelLinear)."""
        if self.tp > 1:
            self._wait(self.tp_comm.Iallreduce(self.MPI.IN_PLACE, buf), "allreduce")

    def gather_columns(self, part: np.ndarray, out: np.ndarray, bounds: list[int]) -> None:
        """Rank 0 of the tensor group gets every rank's columns of the logits (VocabParallelHead)."""
        if self.tp == 1:
            return
        if self.part.tp_rank != 0:
            self._wait(self.tp_comm.Isend(np.ascontiguousarray(part), 0, 7), "logits gather")
            return
        rows = out.shape[0]
        bufs = [np.empty((rows, bounds[r + 1] - bounds[r]), np.float32) for r in range(1, self.tp)]
        self._wait([self.tp_comm.Irecv(b, r + 1, 7) for r, b in enumerate(bufs)], "logits gather")
        for r, b in enumerate(bufs, start=1):
            out[:, bounds[r]:bounds[r + 1]] = b

    # --- the per-step plan --------------------------------------------------------------------------
    def send_step(self, batch: ForwardBatch) -> None:
        if self.failure:
            raise ParallelError(self.failure)
        header, payload = encode_batch(batch)
        self._wait(self.world.Ibcast(header, 0), "step broadcast")
        self._wait(self.world.Ibcast(payload, 0), "step broadcast")

    def recv_step(self):
        """A worker's next message: a ForwardBatch, OP_STATS or None (stop)."""
        header = np.empty(HEADER, np.int64)
        self._wait(self.world.Ibcast(header, 0), "idle", idle=True)
        op = int(header[0])
        if op == OP_STOP:
            return None
        if op == OP_STATS:
            return OP_STATS
        T, S, R, nt = (int(v) for v in header[1:5])
        payload = np.empty(2 * T + 3 * S + nt + R, np.int64)
        self._wait(self.world.Ibcast(payload, 0), "step broadcast")
        return decode_batch(header, payload)

    def stop(self) -> None:
        """Rank 0: send the workers home (every rank then leaves its loop). Idempotent."""
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        if self.failure:
            self.world.Abort(1)           # a stuck rank cannot take a message: end the job
        self._wait(self.world.Ibcast(np.array([OP_STOP] + [0] * (HEADER - 1), np.int64), 0), "stop")

    def stats(self) -> list[dict]:
        """Rank 0: every rank's counters since the last call (then reset): steps, busy and waiting seconds."""
        if self.is_driver:
            # (non-blocking on both sides: a blocking and a non-blocking collective never match)
            self._wait(self.world.Ibcast(np.array([OP_STATS] + [0] * (HEADER - 1), np.int64), 0), "stats")
        mine = {"rank": self.rank, "stage": self.part.stage, "tp_rank": self.part.tp_rank, "steps": self.steps,
                "busy_s": self.busy_s, "comm_s": self.comm_s, **getattr(self, "held", {})}
        self.busy_s = self.comm_s = 0.0
        self.steps = 0
        return self.world.gather(mine, 0)

    # --- one step on this rank ---------------------------------------------------------------------
    def step(self, runner, batch: ForwardBatch):
        """This rank's part of a step; rank 0 returns the logits (len(logits_indices), V)."""
        t0 = time.perf_counter()
        c0 = self.comm_s
        try:
            return self._step(runner, batch)
        finally:
            self.steps += 1
            self.busy_s += time.perf_counter() - t0 - (self.comm_s - c0)

    def _step(self, runner, batch):
        model, kv, p = runner.model, runner.kv_cache, self.part
        if self.pp == 1:
            plan = runner.plan(batch)
            return model.forward(plan, kv, runner.buffers.rows(plan.num_tokens))
        d = runner.config.d_model
        mbs = split_batch(batch, MICRO_BATCHES_PER_STAGE * self.pp)
        sends = []
        for j, (mb, _) in enumerate(mbs):
            plan = runner.plan(mb)
            b = runner.buffers.rows(plan.num_tokens)
            if p.stage == 0:
                model.embed(plan.token_ids, b.x)
            else:
                self._wait(self.world.Irecv(b.x, self.prev, TAG_ACT + j), "activations")
            model.run_layers(plan, kv, b)
            if p.stage < self.pp - 1:
                sends.append(self.world.Isend(b.x.copy(), self.next, TAG_ACT + j))
            else:
                sends.append(self.world.Isend(np.take(b.x, plan.logits_indices, axis=0), self.next, TAG_BACK + j))
        logits = None
        if p.stage == 0:
            b, R = runner.buffers, len(batch.logits_indices)
            logits = b.logits[:R] if R <= b.logits.shape[0] else np.empty((R, runner.config.vocab_size), np.float32)
            first = 0
            for j, (mb, sel) in enumerate(mbs):
                hx = np.empty((len(sel), d), np.float32)
                self._wait(self.world.Irecv(hx, self.rank + (self.pp - 1) * self.tp, TAG_BACK + j), "last stage")
                part = model.logits(hx, np.arange(len(sel)), b, first)
                if R > b.logits.shape[0]:                 # more rows than planned: not in b.logits
                    logits[first:first + len(sel)] = part
                first += len(sel)
            order = np.concatenate([sel for _, sel in mbs])
            if R and not np.array_equal(order, np.arange(R)):
                out = np.empty_like(logits)
                out[order] = logits
                logits = out
        self._wait(sends, "activations sent")
        return logits

    def worker_loop(self, runner) -> None:
        """A worker rank: run steps until rank 0 says stop."""
        while True:
            msg = self.recv_step()
            if msg is None:
                return
            if msg is OP_STATS:
                self.stats()
                continue
            self.step(runner, msg)


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def mpiexec_path() -> str | None:
    """The mpiexec of the MPI wheel installed next to this Python (the `parallel` extra), else on PATH."""
    import shutil
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.access(here, os.X_OK) else shutil.which("mpiexec")
