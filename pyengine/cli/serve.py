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
from pathlib import Path

from pyengine.cli.generate import add_model_arguments, add_speculative_argument, add_target_itl_argument
from pyengine.engine.args import EngineArgs
from pyengine.structured.budget import DEFAULT_COMPILE_S, DEFAULT_MAX_STATES

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
    from pyengine.server.limits import ServerLimits     # starlette-free: --help works without the extras
    d = ServerLimits()
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:                                      # printed as is (not rewrapped: the command stays whole)
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        p.epilog = f"note: serving needs the server extras ({', '.join(missing)} missing): {server_extras_hint()}"
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    add_model_arguments(p)
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the file name)")
    p.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                   help="S21: POST /prompt_cache/{save,restore,erase} keep prompt KV files in DIR (off without it)")
    p.add_argument("--api-key", default=os.environ.get("PYENGINE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $PYENGINE_API_KEY)")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help=f"sequences (n counts) that may wait for the engine; more get 429 (default {d.max_waiting})")
    p.add_argument("--max-waiting-tokens", type=int, default=None,
                   help="prompt tokens that may wait for the engine (default 16 x max-model-len)")
    p.add_argument("--max-tokens-per-request", type=int, default=d.max_tokens_per_request,
                   help=f"n x max_tokens one request may ask for; 0 = unlimited (default {d.max_tokens_per_request})")
    EngineArgs.add_cli_args(p, ("batching", "parallel"))
    p.add_argument("--prefill-instances", type=int, default=0,
                   help="S18: prefill engines (MPI ranks) computing prompts and shipping their KV blocks; with "
                        "--decode-instances: 1 + P x Tp + D x Td ranks, the router on rank 0, then each prefill "
                        "instance's Tp ranks, then each decode instance's Td (T: --tensor-parallel-size, or the "
                        "role's own below)")
    p.add_argument("--decode-instances", type=int, default=0,
                   help="S18: decode engines adopting the shipped KV blocks and streaming the rest")
    p.add_argument("--prefill-tensor-parallel-size", type=int, default=None,
                   help="S18: ranks of each prefill instance (default --tensor-parallel-size)")
    p.add_argument("--decode-tensor-parallel-size", type=int, default=None,
                   help="S18: ranks of each decode instance (default --tensor-parallel-size)")
    add_speculative_argument(p)
    add_target_itl_argument(p)
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help=f"seconds for a request body to arrive (408 otherwise; default {d.body_timeout:g})")
    p.add_argument("--header-timeout", type=float, default=d.header_timeout,
                   help=f"seconds for a connection to send its request headers (default {d.header_timeout:g})")
    p.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout,
                   help=f"idle keep-alive connections are closed after this (default {d.keep_alive_timeout:g} s)")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help=f"connections served at once; requests beyond get 503 (default {d.max_connections})")
    p.add_argument("--body-first-byte-timeout", type=float, default=d.body_first_byte_timeout,
                   help=f"seconds for a request body's first byte to arrive (408 otherwise; default "
                        f"{d.body_first_byte_timeout:g})")
    p.add_argument("--max-uploads-per-client", type=int, default=d.max_uploads_per_client,
                   help=f"connections of one client address (IPv6: its /64) whose body is still arriving; one "
                        f"more gets 429 (default {d.max_uploads_per_client})")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help=f"on SIGTERM / Ctrl-C: seconds running requests may take to finish before their streams "
                        f"are ended with an error event (default {d.shutdown_timeout:g})")
    p.add_argument("--allowed-hosts", nargs="+", default=[], metavar="NAME",
                   help="extra Host names accepted ('*': any); on loopback only loopback names are by default")
    p.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="browser origins allowed cross-origin access (CORS; default none)")
    p.add_argument("--max-grammar-compile-s", type=float, default=DEFAULT_COMPILE_S,
                   help="S15: seconds a request's grammar (JSON schema, regex, GBNF, choice) may take to compile; "
                        f"slower ones get 400 (default {DEFAULT_COMPILE_S:g})")
    p.add_argument("--max-grammar-states", type=int, default=DEFAULT_MAX_STATES,
                   help="S15: automaton states a request's grammar may need; larger ones get 400 "
                        f"(default {DEFAULT_MAX_STATES})")
    p.add_argument("--special-tokens-in-content", action="store_true",
                   help="read control-token strings inside chat messages as control tokens (lets any client "
                        "forge turns; off by default)")
    p.add_argument("--no-tokenizer-process", action="store_true",
                   help="tokenize prompts in the server's process (default: a worker process, so a long prompt "
                        "cannot slow the engine)")
    p.add_argument("--stats-interval", type=float, default=d.stats_interval,
                   help=f"seconds between stats log lines; 0 = none (default {d.stats_interval:g})")
    p.add_argument("--with-demo", action="store_true", help="also serve the web demo at / (same process)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def build_engine(args):
    """(engine, model path) of a parsed serve command line, through `EngineArgs` (a disaggregated instance's ranks:
    ``args.mpi_comm``); ``args.max_model_len`` is set to the resolved context length."""
    from pyengine.cli.generate import check_target_itl
    from pyengine.llm import build_engine as build

    check_target_itl(args)
    eargs = EngineArgs.from_cli_args(args).validate()      # a bad speculative config fails before the model loads
    path = eargs.model = eargs.model_path()
    engine = build(eargs, comm=getattr(args, "mpi_comm", None))
    args.max_model_len = eargs.max_model_len
    return engine, path


def uses_mpi(args) -> bool:
    """S17: more than one rank (started through mpiexec)."""
    return getattr(args, "tensor_parallel_size", 1) * getattr(args, "pipeline_parallel_size", 1) > 1


def demo_app(model_path: str):
    """The web demo's ASGI app for the same model file, to be mounted at / next to the API."""
    module = importlib.import_module(DEMO_MODULE)
    return module.create_app(model=model_path)


def parallel_layout(args) -> str:
    tp, pp = getattr(args, "tensor_parallel_size", 1), getattr(args, "pipeline_parallel_size", 1)
    if tp * pp == 1:
        return "one process"
    parts = [f"tensor-parallel {tp}"] * (tp > 1) + [f"pipeline-parallel {pp}"] * (pp > 1)
    return " x ".join(parts) + f" over {tp * pp} MPI ranks"


def say(text: str) -> None:
    print(f"pyengine serve: {text}", file=sys.stderr, flush=True)


def server_limits(args):
    from pyengine.server.guard import limits_from_args
    return limits_from_args(args)


def grammar_compiler(args):
    from pyengine.server.grammar_worker import GrammarCompiler
    return GrammarCompiler(max_compile_s=getattr(args, "max_grammar_compile_s", DEFAULT_COMPILE_S),
                           max_states=getattr(args, "max_grammar_states", DEFAULT_MAX_STATES))


def make_app(args):
    """Engine + API app (+ the demo) from parsed arguments."""
    from pyengine.server.app import create_app, served_names

    engine, path = build_engine(args)
    model_id, aliases = served_names(path)
    if getattr(args, "served_model_name", None):
        aliases, model_id = aliases + [model_id], args.served_model_name
    demo = demo_app(path) if getattr(args, "with_demo", False) else None
    app = create_app(engine, model_id=model_id, aliases=aliases, api_key=getattr(args, "api_key", None),
                     max_model_len=args.max_model_len, max_body_bytes=getattr(args, "max_body_bytes", 1 << 20),
                     demo_app=demo, limits=server_limits(args),
                     prompt_cache_dir=getattr(args, "prompt_cache_dir", None), grammars=grammar_compiler(args))
    return app, engine, model_id


def run(args) -> int:
    if not require_server_extras("serve"):
        return 1
    from pyengine.server.http_server import bind_socket, uvicorn_server

    from pyengine.server.metrics import kv_capacity
    warn_if_exposed("serve", args.host, args.api_key)
    from pyengine.disagg.launch import uses_disagg
    if uses_disagg(args):                     # S18: router + prefill and decode instances as MPI ranks
        from pyengine.disagg.launch import run as run_disagg
        return run_disagg(args)
    if uses_mpi(args):
        from pyengine.parallel.mpi import launched_under_mpi
        if not launched_under_mpi():          # one host: this same command line as N x M ranks
            from pyengine.parallel.launch import check_split, relaunch
            try:                              # a split the model cannot take is refused before any rank starts
                check_split(args.model, args.tensor_parallel_size, args.pipeline_parallel_size)
            except ValueError as exc:
                print(f"pyengine serve: {exc}", file=sys.stderr)
                return 2
            bind_socket(args.host, args.port).close()     # a taken port fails before any rank starts
            n = args.tensor_parallel_size * args.pipeline_parallel_size
            return relaunch(n, ["-m", "pyengine"] + sys.argv[1:], grace=getattr(args, "shutdown_timeout", 30.0) + 30)
        from pyengine.parallel.launch import join_launcher
        join_launcher()                       # report to the launcher; leave at once if it dies
    # only the HTTP rank listens (rank 0 of an MPI job); before the model loads, so a taken port fails at once
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0"))) if uses_mpi(args) else 0
    sock = bind_socket(args.host, args.port) if rank == 0 else None
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if rank == 0:                             # loading takes seconds: say so at once (after the checks that are quick)
        from pyengine.cli.generate import check_target_itl
        from pyengine.engine.spec_decode import parse_speculative_config
        from pyengine.model_files import resolve_model
        parse_speculative_config(getattr(args, "speculative_config", None))
        check_target_itl(args)
        say(f"loading {os.path.basename(resolve_model(args.model))} ({parallel_layout(args)}) ...")
    try:
        app, engine, model_id = make_app(args)
    except ValueError as exc:                 # e.g. an mpiexec -n that is not N x M: say what to change
        if not uses_mpi(args):
            raise
        print(f"pyengine serve: {exc}", file=sys.stderr)
        return 2
    from pyengine.engine.threads import describe
    kv = kv_capacity(engine.block_manager.num_blocks, engine.block_manager.block_size, args.max_model_len)
    say(f"model {model_id} on http://{args.host}:{args.port} "
        f"(context {args.max_model_len}, prefix cache {'off' if args.no_prefix_cache else 'on'}, chunked prefill "
        f"{'off' if args.no_chunked_prefill else 'on'}, max waiting {args.max_waiting} sequences; "
        f"{kv}; {parallel_layout(args)}; {describe()})")
    if uses_mpi(args):
        from pyengine.parallel.launch import exit_normally_on_signals
        exit_normally_on_signals()
    try:
        uvicorn_server(app, args.host, args.port, args.log_level).run(sockets=[sock])
    finally:
        engine.executor.close()               # S17: stops every rank
    return 0
