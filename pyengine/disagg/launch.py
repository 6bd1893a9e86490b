"""S18: `pyengine serve --prefill-instances P --decode-instances D` — the roles as MPI ranks.

    rank 0                  the router and the HTTP API (no model: the tokenizer only)
    next P x Tp ranks       prefill instances, Tp consecutive ranks each (each an LLMEngine with its own KV cache)
    next D x Td ranks       decode instances, Td consecutive ranks each

Tp and Td are the instances' tensor-parallel sizes (``--tensor-parallel-size T`` for both, or
``--prefill-tensor-parallel-size`` / ``--decode-tensor-parallel-size``; 1 by default): the job has 1 + P x Tp + D x Td
ranks. Each instance's ranks get a communicator of their own (``Split`` of the world); its first rank is the
instance's *leader*: it runs the instance loop (prefill_worker.py / decode_worker.py) over an LLMEngine whose runner
is tensor-parallel over that communicator (parallel/mpi.py `MPIGroup`), and the others follow its orders in
``MPIGroup.worker_loop``. The router and the instance protocol talk to leaders only (their world ranks); a
leader gathers and scatters its followers' KV heads of the blocks it ships or adopts (kv_transfer.py `KVBlocks`).
With P = D = 1, T = 2: rank 0 router, ranks 1-2 the prefill instance (leader 1), ranks 3-4 the decode one (leader 3).

On one host the command re-runs itself under the MPI wheel's ``mpiexec --with-ft ulfm -n <ranks>``
(parallel/launch.py: a rank that dies then does not end the job: the router fails its requests and the others
keep serving). Across hosts, start it yourself: ``mpiexec --with-ft ulfm -n <ranks> --hostfile H pyengine serve
--prefill-instances P --decode-instances D ...``: the hostfile's slots take the ranks in order (rank 0 first, then
each instance's ranks together), so list a host's slots as many times as the instance ranks it is to run, e.g.
``router slots=1``, ``hostA slots=2`` (the prefill instance), ``hostB slots=2`` (the decode one) with
``--map-by slot``; keep an instance's ranks on one host (their Allreduce per sub-layer wants shared memory).
Every instance is built from the same engine options (model, --max-model-len, --kv-cache-dtype, ...), so block size
and KV format agree.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
import sys
from dataclasses import dataclass

from pyengine import tuning
from pyengine.engine.args import EngineArgs, default_max_model_len
from pyengine.llm import build_engine
from pyengine.server.args import ServerArgs


def prefill_nice() -> int:
    """Niceness of a prefill rank: tuning.PREFILL_NICE, or $PYENGINE_PREFILL_NICE (docs/disaggregation.md's A/B)."""
    return int(os.environ.get("PYENGINE_PREFILL_NICE", tuning.PREFILL_NICE))


@dataclass(frozen=True)
class InstanceRanks:
    """One instance's place in the job: its role and world ranks (the first is its leader)."""
    role: str
    ranks: tuple

    @property
    def leader(self) -> int:
        return self.ranks[0]


def layout(prefill: int, decode: int, prefill_tp: int = 1, decode_tp: int = 1) -> list[InstanceRanks]:
    """Every instance's ranks, in world order after the router's rank 0; ValueError saying what to change."""
    for name, v in (("--prefill-instances", prefill), ("--decode-instances", decode)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be >= 1 when disaggregating (got {v!r}); give both, or neither")
    for name, v in (("prefill", prefill_tp), ("decode", decode_tp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"the {name} instances' tensor-parallel size must be >= 1 (got {v!r})")
    out, r = [], 1
    for role, n, tp in (("prefill", prefill, prefill_tp), ("decode", decode, decode_tp)):
        for _ in range(n):
            out.append(InstanceRanks(role, tuple(range(r, r + tp))))
            r += tp
    return out


def roles(prefill: int, decode: int, prefill_tp: int = 1, decode_tp: int = 1) -> tuple[list[int], list[int]]:
    """(prefill leaders' ranks, decode leaders' ranks)."""
    insts = layout(prefill, decode, prefill_tp, decode_tp)
    return ([i.leader for i in insts if i.role == "prefill"], [i.leader for i in insts if i.role == "decode"])


def run(eargs: EngineArgs, sargs: ServerArgs) -> int:
    """The job of a disaggregated ``pyengine serve`` (``sargs.disaggregated``): every instance is built from
    `eargs` (with its own tensor-parallel size), the router serves the API with `sargs`."""
    from pyengine.parallel.mpi import launched_under_mpi
    try:
        if eargs.pipeline_parallel_size != 1:
            raise ValueError("--prefill-instances / --decode-instances split an instance by tensor parallelism only: "
                             "drop --pipeline-parallel-size")
        tp = sargs.role_tp(eargs.tensor_parallel_size)
        insts = layout(sargs.prefill_instances, sargs.decode_instances, *tp)
        n = 1 + sum(len(i.ranks) for i in insts)
        if not launched_under_mpi():                  # one host: this command line as n ranks
            from pyengine.parallel.launch import check_split, relaunch
            from pyengine.server.http_server import bind_socket
            for t_ in sorted(set(tp)):
                check_split(eargs.model, t_, 1)
            bind_socket(sargs.host, sargs.port).close()   # a taken port fails before any rank starts
            return relaunch(n, ["-m", "pyengine"] + sys.argv[1:], grace=sargs.limits.shutdown_timeout + 30)
        from pyengine.parallel.launch import join_launcher
        join_launcher()                               # report to the launcher; leave at once if it dies
        from pyengine.disagg.kv_transfer import MPITransport
        t = MPITransport()
        if t.size != n:
            raise ValueError(f"the MPI job has {t.size} ranks, --prefill-instances {sargs.prefill_instances} x "
                             f"{tp[0]} + --decode-instances {sargs.decode_instances} x {tp[1]} need 1 + "
                             f"{sargs.prefill_instances * tp[0]} + {sargs.decode_instances * tp[1]} = {n}")
    except (ValueError, OSError) as exc:
        print(f"pyengine serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=sargs.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    mine = next((i for i in insts if t.rank in i.ranks), None)
    # every rank takes part in the split (collective): the router alone, each instance's ranks together
    comm = t.comm.Split(t.MPI.UNDEFINED if mine is None else 1 + insts.index(mine), t.rank)
    if mine is None:
        return serve_router(eargs, sargs, t, *roles(sargs.prefill_instances, sargs.decode_instances, *tp))
    run_instance(eargs, t, mine, comm)
    return 0


def run_instance(eargs: EngineArgs, t, inst: InstanceRanks, comm) -> None:
    """An instance's rank: its leader runs the instance loop, a follower its part of every step (in build_engine,
    until the leader stops it)."""
    from pyengine.disagg.decode_worker import DecodeWorker
    from pyengine.disagg.prefill_worker import PrefillWorker
    # the router bounds what waits; the instance's own ranks split it
    eargs = dataclasses.replace(eargs, max_waiting=None, tensor_parallel_size=len(inst.ranks))
    nice = prefill_nice() if inst.role == "prefill" else 0
    if nice and hasattr(os, "nice"):
        os.nice(nice)
    engine = build_engine(eargs, comm=comm)           # a follower's worker loop runs in here
    timeout = eargs.parallel_timeout or 60.0
    worker = PrefillWorker(engine, t, timeout) if inst.role == "prefill" else DecodeWorker(engine, t)
    freeze_heap()
    try:
        worker.run()
    finally:
        engine.executor.close()                       # a TP instance: its followers' STOP


def freeze_heap() -> None:
    """What start-up built (model, tokenizer tables, caches) lives as long as the process: move it out of the
    collector's reach, so that a full collection between two steps sweeps only the serving loop's objects (a
    full collection over a loaded engine took 12 ms, 0 after freezing; docs/disaggregation.md)."""
    gc.collect()
    gc.freeze()


def serve_router(eargs: EngineArgs, sargs: ServerArgs, t, pre: list[int], dec: list[int]) -> int:
    from pyengine.disagg.metrics import DisaggMetrics
    from pyengine.disagg.router import Router
    from pyengine.gguf.reader import GGUFFile
    from pyengine.model_files import resolve_model
    from pyengine.parallel.launch import exit_normally_on_signals
    from pyengine.server.app import create_app_from_args, served_names
    from pyengine.server.metrics import kv_capacity
    from pyengine.server.http_server import bind_socket, uvicorn_server
    from pyengine.tokenizer import Tokenizer

    sock = bind_socket(sargs.host, sargs.port)
    path = resolve_model(eargs.model)
    print(f"pyengine serve: loading {os.path.basename(path)} (router on rank 0; prefill ranks {pre}, "
          f"decode ranks {dec}) ...", file=sys.stderr, flush=True)
    gguf = GGUFFile(path)
    max_model_len = eargs.max_model_len or default_max_model_len(gguf)
    router = Router(t, Tokenizer.from_gguf(gguf), gguf, pre, dec, max_model_len, max_waiting=sargs.limits.max_waiting,
                    timeout=eargs.parallel_timeout or 60.0)
    try:
        router.wait_ready()
        freeze_heap()
        model_id, aliases = served_names(path, sargs.served_model_name)
        app = create_app_from_args(router, sargs, model_id=model_id, aliases=aliases, max_model_len=max_model_len,
                                   metrics=DisaggMetrics(model_name=model_id))
        kv = "; ".join(f"{i.role} rank {r}: "
                       + kv_capacity(i.info["num_blocks"], i.info["block_size"], max_model_len)
                       for r, i in router.instances.items())
        print(f"pyengine serve: model {model_id} on http://{sargs.host}:{sargs.port} (disaggregated: prefill ranks "
              f"{pre}, decode ranks {dec}; context {max_model_len}; {kv})", file=sys.stderr, flush=True)
        exit_normally_on_signals()
        uvicorn_server(app, sargs.host, sargs.port, sargs.log_level).run(sockets=[sock])
    finally:
        router.close()
    return 0
