"""`pyengine web`: serve the browser demo (Pyodide and TypeScript engines side by side) on a dev server."""
from __future__ import annotations

import argparse

HELP = "serve the browser demo (Pyodide + TypeScript engines) with the model file; run scripts/setup_web.sh first"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="GGUF offered to the page as the default model (default: the bundled SmolLM2-135M, if installed)")
    p.add_argument("--pyodide", default=None, metavar="URL",
                   help="load Pyodide from this base URL (e.g. a CDN) instead of web/vendor/pyodide/")


def run(args) -> int:
    import uvicorn

    from pyengine.model_files import default_model_path, resolve_model
    from pyengine.web_server import WEB_ROOT, create_app

    if args.model is not None:
        model = resolve_model(args.model)
    else:
        try:
            model = default_model_path()
        except FileNotFoundError as exc:
            print(f"note: {exc}; the page will ask for a file")
            model = None
    if not (WEB_ROOT / "vendor" / "manifest.json").is_file() and args.pyodide is None:
        print("warning: web/vendor/ is not assembled; run `bash scripts/setup_web.sh` first")
    app = create_app(model=model, pyodide=args.pyodide)
    print(f"pyengine web: http://{args.host}:{args.port}/  (model: {model or 'none'})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
