"""S18: `pyengine serve --prefill-instances P --decode-instances D` — the roles as 1 + P + D MPI ranks.

    rank 0           the router and the HTTP API (no model: the tokenizer only)
    ranks 1 .. P     prefill instances (each an LLMEngine with its own KV cache)
    ranks P+1 .. P+D decode instances

On one host the command re-runs itself under the MPI wheel's ``mpiexec --with-ft ulfm -n 1+P+D`` (parallel/launch.py:
a rank that dies then does not end the job: the router fails its requests and the others keep serving). Across hosts,
start it yourself: ``mpiexec --with-ft ulfm -n 1+P+D --hostfile H pyengine serve --prefill-instances P
--decode-instances D ...`` (the hostfile's order places the ranks: rank 0 first). Every instance is built from the
same engine options (model, --max-model-len, --kv-cache-dtype, ...), so block size and KV format agree.
"""
from __future__ import annotations

import gc
import logging
import os
import sys

# One host usually has fewer cores than ranks + their client: when they compete, the scheduler should give the
# core to the decode rank and the router (the latency targets: ITL, token delivery) and take it from the prefill
# rank (throughput work). 5 steps of niceness is 1/3 of the CPU weight (Linux CFS); docs/disaggregation.md.
# $PYENGINE_PREFILL_NICE overrides it (0: the prefill rank competes as an equal; that page's A/B runs both).
PREFILL_NICE = int(os.environ.get("PYENGINE_PREFILL_NICE", "5"))


def roles(prefill: int, decode: int) -> tuple[list[int], list[int]]:
    """(prefill ranks, decode ranks); ValueError saying what to change."""
    for name, v in (("--prefill-instances", prefill), ("--decode-instances", decode)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be >= 1 when disaggregating (got {v!r}); give both, or neither")
    return list(range(1, 1 + prefill)), list(range(1 + prefill, 1 + prefill + decode))


def uses_disagg(args) -> bool:
    return bool(getattr(args, "prefill_instances", 0) or getattr(args, "decode_instances", 0))


def run(args) -> int:
    from pyengine.cli.serve import uses_mpi
    from pyengine.parallel.mpi import launched_under_mpi
    try:
        pre, dec = roles(args.prefill_instances, args.decode_instances)
        if uses_mpi(args):
            raise ValueError("--prefill-instances / --decode-instances run each instance in one process: drop "
                             "--tensor-parallel-size / --pipeline-parallel-size")
        n = 1 + len(pre) + len(dec)
        if not launched_under_mpi():                  # one host: this command line as 1 + P + D ranks
            from pyengine.parallel.launch import check_split, relaunch
            from pyengine.server.runner import bind_socket
            check_split(args.model, 1, 1)
            bind_socket(args.host, args.port).close()     # a taken port fails before any rank starts
            return relaunch(n, ["-m", "pyengine"] + sys.argv[1:])
        from pyengine.disagg.kv_transfer import MPITransport
        t = MPITransport()
        if t.size != n:
            raise ValueError(f"the MPI job has {t.size} ranks, --prefill-instances {len(pre)} + "
                             f"--decode-instances {len(dec)} need 1 + {len(pre)} + {len(dec)} = {n}")
    except (ValueError, OSError) as exc:
        print(f"pyengine serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if t.rank == 0:
        return serve_router(args, t, pre, dec)
    run_instance(args, t, "prefill" if t.rank in pre else "decode")
    return 0


def run_instance(args, t, role: str) -> None:
    from pyengine.cli.serve import build_engine
    from pyengine.disagg.decode_worker import DecodeWorker
    from pyengine.disagg.prefill_worker import PrefillWorker
    args.max_waiting = None                           # the router bounds what waits
    engine, _ = build_engine(args)
    if role == "prefill" and PREFILL_NICE and hasattr(os, "nice"):
        os.nice(PREFILL_NICE)
    timeout = args.parallel_timeout or 60.0
    worker = PrefillWorker(engine, t, timeout) if role == "prefill" else DecodeWorker(engine, t)
    freeze_heap()
    worker.run()


def freeze_heap() -> None:
    """What start-up built (model, tokenizer tables, caches) lives as long as the process: move it out of the
    collector's reach, so that a full collection between two steps sweeps only the serving loop's objects (a
    full collection over a loaded engine took 12 ms, 0 after freezing; docs/disaggregation.md)."""
    gc.collect()
    gc.freeze()


def serve_router(args, t, pre: list[int], dec: list[int]) -> int:
    from pyengine.cli.generate import default_max_model_len
    from pyengine.cli.serve import server_limits
    from pyengine.disagg.metrics import DisaggMetrics
    from pyengine.disagg.router import Router
    from pyengine.gguf.reader import GGUFFile
    from pyengine.model_files import resolve_model
    from pyengine.parallel.launch import exit_normally_on_signals
    from pyengine.server.app import create_app, served_names
    from pyengine.server.runner import bind_socket, uvicorn_server
    from pyengine.tokenizer import Tokenizer

    sock = bind_socket(args.host, args.port)
    path = resolve_model(args.model)
    gguf = GGUFFile(path)
    if getattr(args, "max_model_len", None) is None:
        args.max_model_len = default_max_model_len(gguf)
    router = Router(t, Tokenizer.from_gguf(gguf), gguf, pre, dec, args.max_model_len, max_waiting=args.max_waiting,
                    timeout=args.parallel_timeout or 60.0)
    try:
        router.wait_ready()
        freeze_heap()
        model_id, aliases = served_names(path)
        if getattr(args, "served_model_name", None):
            aliases, model_id = aliases + [model_id], args.served_model_name
        app = create_app(router, model_id=model_id, aliases=aliases, api_key=args.api_key,
                         max_model_len=args.max_model_len, max_body_bytes=args.max_body_bytes,
                         metrics=DisaggMetrics(), limits=server_limits(args))
        print(f"pyengine serve: model {model_id} on http://{args.host}:{args.port} (disaggregated: prefill ranks "
              f"{pre}, decode ranks {dec}; context {args.max_model_len})", file=sys.stderr)
        exit_normally_on_signals()
        uvicorn_server(app, args.host, args.port, args.log_level).run(sockets=[sock])
    finally:
        router.close()
    return 0
