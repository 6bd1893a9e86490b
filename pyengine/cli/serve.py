"""`pyengine serve`: the OpenAI-compatible HTTP server (S19) on one engine.

    pyengine serve --port 8000
    curl -N localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi"}], "stream": true}'
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

HELP = "serve the OpenAI-compatible API (chat/completions, streaming, /metrics) over HTTP"

# The web demo's dev-server app factory (the demo owns that module): create_app(model=path, pyodide=None).
DEMO_MODULE = "pyengine.web_server"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="GGUF path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the file name)")
    p.add_argument("--api-key", default=os.environ.get("PYENGINE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $PYENGINE_API_KEY)")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="bounded waiting queue; requests beyond it get 429 (default: 64)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="S17: ranks splitting every layer by heads / FFN columns (MPI; one Allreduce per sub-layer)")
    p.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="S17: pipeline stages of contiguous layers (MPI; N x M ranks with --tensor-parallel-size)")
    p.add_argument("--parallel-timeout", type=float, default=None,
                   help="seconds a step may wait on another rank before the server declares it stuck (default 60)")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    p.add_argument("--no-chunked-prefill", action="store_true", help="disable chunked prefill")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--with-demo", action="store_true", help="also serve the web demo at / (same process)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def build_engine(args):
    from pyengine.engine.llm_engine import LLMEngine
    from pyengine.model_files import resolve_model

    path = resolve_model(args.model)
    runner = None
    if uses_mpi(args):
        from pyengine.parallel.launch import mpi_runner
        # rank 0 gets its runner back; the other ranks compute in mpi_runner until the server stops
        runner = mpi_runner(path, args.tensor_parallel_size, args.pipeline_parallel_size, args.parallel_timeout,
                            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens)
    engine = LLMEngine(path, runner=runner, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       enable_prefix_caching=not args.no_prefix_cache,
                       enable_chunked_prefill=not args.no_chunked_prefill, max_waiting=args.max_waiting)
    return engine, path


def uses_mpi(args) -> bool:
    """S17: more than one rank (started through mpiexec)."""
    return getattr(args, "tensor_parallel_size", 1) * getattr(args, "pipeline_parallel_size", 1) > 1


def demo_app(model_path: str):
    """The web demo's ASGI app for the same model file, to be mounted at / next to the API."""
    module = importlib.import_module(DEMO_MODULE)
    return module.create_app(model=model_path)


def make_app(args):
    """Engine + API app (+ the demo) from parsed arguments; used by `serve` and `bench serve`."""
    from pyengine.server.app import create_app, served_names

    engine, path = build_engine(args)
    model_id, aliases = served_names(path)
    if getattr(args, "served_model_name", None):
        aliases, model_id = aliases + [model_id], args.served_model_name
    demo = demo_app(path) if getattr(args, "with_demo", False) else None
    app = create_app(engine, model_id=model_id, aliases=aliases, api_key=getattr(args, "api_key", None),
                     max_model_len=args.max_model_len, max_body_bytes=getattr(args, "max_body_bytes", 1 << 20),
                     demo_app=demo)
    return app, engine, model_id


def run(args) -> int:
    try:
        import uvicorn
    except ImportError:
        print("pyengine serve needs the server extras: pip install 'pyengine[server]'", file=sys.stderr)
        return 1
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    if uses_mpi(args):
        from pyengine.parallel.mpi import launched_under_mpi
        if not launched_under_mpi():          # one host: this same command line as N x M ranks
            from pyengine.parallel.launch import check_split, relaunch
            try:                              # a split the model cannot take is refused before any rank starts
                check_split(args.model, args.tensor_parallel_size, args.pipeline_parallel_size)
            except ValueError as exc:
                print(f"pyengine serve: {exc}", file=sys.stderr)
                return 2
            n = args.tensor_parallel_size * args.pipeline_parallel_size
            return relaunch(n, ["-m", "pyengine"] + sys.argv[1:])
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        app, engine, model_id = make_app(args)
    except ValueError as exc:                 # e.g. an mpiexec -n that is not N x M: say what to change
        if not uses_mpi(args):
            raise
        print(f"pyengine serve: {exc}", file=sys.stderr)
        return 2
    print(f"pyengine serve: model {model_id} on http://{args.host}:{args.port} "
          f"(prefix cache {'off' if args.no_prefix_cache else 'on'}, chunked prefill "
          f"{'off' if args.no_chunked_prefill else 'on'}, max waiting {args.max_waiting})", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, http="h11", ws="none",
                    timeout_graceful_shutdown=5)
    finally:
        engine.runner.close()                 # S17: stops every rank
    return 0
