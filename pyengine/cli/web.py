"""`pyengine web`: serve the browser demo (Pyodide and TypeScript engines side by side) on a dev server.

Needs the server extras (as `serve` does) and `bash scripts/setup_web.sh` for the assets. The port is
taken before anything else, and the URL is printed once the server listens.
"""
from __future__ import annotations

import argparse
import sys

from pyengine.cli.serve import require_server_extras, warn_if_exposed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="GGUF offered to the page as the default model (default: the bundled SmolLM2-135M, if installed)")
    p.add_argument("--pyodide", default=None, metavar="URL",
                   help="load Pyodide from this base URL (e.g. a CDN) instead of web/vendor/pyodide/")


def run(args) -> int:
    if not require_server_extras("web"):
        return 1
    from pyengine.model_files import default_model_path, resolve_model
    from pyengine.server.http_server import bind_socket, uvicorn_server
    from pyengine.server.web import WEB_ROOT, create_app

    warn_if_exposed("web", args.host, None, what="(the demo has no key; `serve --with-demo --api-key` has)")
    sock = bind_socket(args.host, args.port)
    if args.model is not None:
        model = resolve_model(args.model)
    else:
        try:
            model = default_model_path()
        except FileNotFoundError as exc:
            print(f"note: {exc}; the page will ask for a file", file=sys.stderr)
            model = None
    if not (WEB_ROOT / "vendor" / "manifest.json").is_file() and args.pyodide is None:
        print("warning: web/vendor/ is not assembled; run `bash scripts/setup_web.sh` first", file=sys.stderr)
    app = create_app(model=model, pyodide=args.pyodide)
    server = uvicorn_server(app, args.host, args.port, "warning")
    startup = server.startup

    async def announce(sockets=None):   # printed once the server listens, not before
        await startup(sockets=sockets)
        if server.started:
            print(f"pyengine web: http://{args.host}:{args.port}/  (model: {model or 'none'})", flush=True)
    server.startup = announce
    server.run(sockets=[sock])
    return 0
