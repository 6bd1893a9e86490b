"""`pyengine serve`: the OpenAI-compatible HTTP server (S19) on one engine.

    pyengine serve --port 8000
    curl -N localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi"}], "stream": true}'

The port is taken before the model loads (a busy port fails at once). With --api-key every route but
/health needs the key (the demo's pages too: a browser asks for it as a password). Bound to loopback,
only loopback Host names are served (DNS rebinding protection; --allowed-hosts adds names); CORS is
off unless --allowed-origins.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys

from pyengine.cli.generate import add_model_arguments, add_speculative_argument, add_target_itl_argument
from pyengine.engine.args import EngineArgs
from pyengine.server.args import ServerArgs

# The web demo's dev-server app factory (the demo owns that module): create_app(model=path, pyodide=None).
DEMO_MODULE = "pyengine.server.web"
SERVER_MODULES = ("uvicorn", "starlette", "prometheus_client")


def server_extras_hint() -> str:
    """How to get starlette/uvicorn (model_files.extras_hint: from this checkout when run from one)."""
    from pyengine.model_files import extras_hint
    return extras_hint("server")


def require_server_extras(command: str) -> bool:
    """True when the server packages import; else prints the fix and returns False."""
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        print(f"pyengine {command} needs the server extras ({', '.join(missing)} missing): "
              f"{server_extras_hint()}", file=sys.stderr)
    return not missing


def warn_if_exposed(command: str, host: str, api_key: str | None, what: str = "without --api-key") -> None:
    from pyengine.server.guard import is_loopback
    if not is_loopback(host) and not api_key:
        print(f"warning: pyengine {command} on {host} {what}: anyone who can reach it can use it",
              file=sys.stderr)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The server's flags (`ServerArgs`) around the engine's (`EngineArgs`), in the order --help lists them."""
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:                                      # printed as is (not rewrapped: the command stays whole)
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        p.epilog = f"note: serving needs the server extras ({', '.join(missing)} missing): {server_extras_hint()}"
    ServerArgs.add_cli_args(p, ("listen",))
    add_model_arguments(p)
    ServerArgs.add_cli_args(p, ("api",))
    EngineArgs.add_cli_args(p, ("batching", "parallel"))
    ServerArgs.add_cli_args(p, ("disagg",))
    add_speculative_argument(p)
    add_target_itl_argument(p)
    ServerArgs.add_cli_args(p, ("limits",))


def engine_args(args) -> EngineArgs:
    """The engine's options of a parsed serve command line, checked (a bad --speculative-config or
    --target-itl-ms fails before the model loads)."""
    from pyengine.cli.generate import check_target_itl
    check_target_itl(args)
    return EngineArgs.from_cli_args(args).validate()


def start_engine(eargs: EngineArgs):
    """(engine, model path) of checked engine options; ``eargs`` is resolved in place (its max_model_len is the
    context the engine got)."""
    from pyengine.llm import build_engine as build
    path = eargs.model = eargs.model_path()
    return build(eargs), path


def build_engine(args):
    """(engine, model path) of a parsed serve command line; ``args.max_model_len`` is set to the resolved context."""
    eargs = engine_args(args)
    engine, path = start_engine(eargs)
    args.max_model_len = eargs.max_model_len
    return engine, path


def demo_app(model_path: str):
    """The web demo's ASGI app for the same model file, to be mounted at / next to the API."""
    module = importlib.import_module(DEMO_MODULE)
    return module.create_app(model=model_path)


def parallel_layout(eargs: EngineArgs) -> str:
    tp, pp = eargs.tensor_parallel_size, eargs.pipeline_parallel_size
    if tp * pp == 1:
        return "one process"
    parts = [f"tensor-parallel {tp}"] * (tp > 1) + [f"pipeline-parallel {pp}"] * (pp > 1)
    return " x ".join(parts) + f" over {tp * pp} MPI ranks"


def say(text: str) -> None:
    print(f"pyengine serve: {text}", file=sys.stderr, flush=True)


def make_app(args):
    """Engine + API app (+ the demo) from a parsed serve command line: (app, engine, model id)."""
    return serve_app(engine_args(args), ServerArgs.from_cli_args(args).validate())


def serve_app(eargs: EngineArgs, sargs: ServerArgs):
    """Engine + API app (+ the demo) from the two option objects: (app, engine, model id)."""
    from pyengine.server.app import create_app_from_args, served_names

    engine, path = start_engine(eargs)
    model_id, aliases = served_names(path, sargs.served_model_name)
    demo = demo_app(path) if sargs.with_demo else None
    app = create_app_from_args(engine, sargs, model_id=model_id, aliases=aliases, max_model_len=eargs.max_model_len,
                               demo_app=demo)
    return app, engine, model_id


def run(args) -> int:
    if not require_server_extras("serve"):
        return 1
    from pyengine.server.http_server import bind_socket, uvicorn_server

    sargs = ServerArgs.from_cli_args(args).validate()
    warn_if_exposed("serve", sargs.host, sargs.api_key)
    eargs = engine_args(args)                 # checked before any rank starts or the model loads
    if sargs.disaggregated:                   # S18: router + prefill and decode instances as MPI ranks
        from pyengine.disagg.launch import run as run_disagg
        return run_disagg(eargs, sargs)
    if eargs.num_ranks > 1:
        code = join_mpi_job(eargs, sargs)
        if code is not None:
            return code
    # only the HTTP rank listens (rank 0 of an MPI job); before the model loads, so a taken port fails at once
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0"))) if eargs.num_ranks > 1 else 0
    sock = bind_socket(sargs.host, sargs.port) if rank == 0 else None
    logging.basicConfig(level=sargs.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if rank == 0:                             # loading takes seconds: say so at once (after the checks that are quick)
        from pyengine.model_files import resolve_model
        say(f"loading {os.path.basename(resolve_model(eargs.model))} ({parallel_layout(eargs)}) ...")
    try:
        app, engine, model_id = serve_app(eargs, sargs)
    except ValueError as exc:                 # e.g. an mpiexec -n that is not N x M: say what to change
        if eargs.num_ranks == 1:
            raise
        print(f"pyengine serve: {exc}", file=sys.stderr)
        return 2
    announce(engine, model_id, eargs, sargs)
    if eargs.num_ranks > 1:
        from pyengine.parallel.launch import exit_normally_on_signals
        exit_normally_on_signals()
    try:
        uvicorn_server(app, sargs.host, sargs.port, sargs.log_level).run(sockets=[sock])
    finally:
        engine.executor.close()               # S17: stops every rank
    return 0


def join_mpi_job(eargs: EngineArgs, sargs: ServerArgs) -> int | None:
    """S17, more than one rank: outside mpiexec, this same command line re-run as N x M ranks (its exit code);
    under it, report to the launcher and return None."""
    from pyengine.parallel.launch import join_launcher
    from pyengine.parallel.mpi import launched_under_mpi
    from pyengine.server.http_server import bind_socket
    if not launched_under_mpi():              # one host: this same command line as N x M ranks
        from pyengine.parallel.launch import check_split, relaunch
        try:                                  # a split the model cannot take is refused before any rank starts
            check_split(eargs.model, eargs.tensor_parallel_size, eargs.pipeline_parallel_size)
        except ValueError as exc:
            print(f"pyengine serve: {exc}", file=sys.stderr)
            return 2
        bind_socket(sargs.host, sargs.port).close()     # a taken port fails before any rank starts
        return relaunch(eargs.num_ranks, ["-m", "pyengine"] + sys.argv[1:], grace=sargs.limits.shutdown_timeout + 30)
    join_launcher()                           # report to the launcher; leave at once if it dies
    return None


def announce(engine, model_id: str, eargs: EngineArgs, sargs: ServerArgs) -> None:
    from pyengine.engine.threads import describe
    from pyengine.server.metrics import kv_capacity
    bm = engine.block_manager
    say(f"model {model_id} on http://{sargs.host}:{sargs.port} "
        f"(context {eargs.max_model_len}, prefix cache {'on' if eargs.enable_prefix_caching else 'off'}, chunked "
        f"prefill {'on' if eargs.enable_chunked_prefill else 'off'}, max waiting {sargs.limits.max_waiting} "
        f"sequences; {kv_capacity(bm.num_blocks, bm.block_size, eargs.max_model_len)}; {parallel_layout(eargs)}; "
        f"{describe()})")
