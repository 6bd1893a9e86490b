"""S22 dev server for the browser demo: `pyengine web` (starlette + uvicorn, both imported lazily).

    app = create_app(model="path/to.gguf")          # or mount it: Mount("/demo", app=create_app(...))

Routes:
    /                      web/index.html and the other files of web/ (app.js, worker.js, pyworker.py, css)
    /config.js             the page's configuration (which default model the server offers)
    /vendor/...            web/vendor/: Pyodide, numpy/micropip wheels, the pyengine wheel (scripts/setup_web.sh)
    /ts-mini/...           ts-mini/dist/: the TypeScript engine's worker build
    /model/default.gguf    the model file, with HTTP Range requests (206 + Content-Range) for partial reads

MIME types are set explicitly (application/wasm for .wasm, text/javascript for .js/.mjs): browsers refuse
to stream-compile wasm or run module scripts served with the wrong type, and the system `mimetypes`
table is not reliable across machines. No mount follows a symlink out of its directory. Everything is sent with `Cache-Control: no-cache` so a rebuilt
wheel or worker is picked up on reload.

Every response carries COOP `same-origin` + COEP `require-corp` (ISOLATION_HEADERS): the page is then
cross-origin isolated, which SharedArrayBuffer (the TypeScript engine's worker pool) requires. The model
route answers `If-None-Match` with 304 (its ETag is derived from size and mtime), so a revisit that has
the model stored costs one request and no bytes.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WEB_ROOT = ROOT / "web"
TS_DIST = ROOT / "ts-mini" / "dist"

MIME_TYPES = {
    ".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
    ".json": "application/json", ".map": "application/json", ".wasm": "application/wasm",
    ".zip": "application/zip", ".whl": "application/zip", ".py": "text/x-python; charset=utf-8",
    ".gguf": "application/octet-stream", ".svg": "image/svg+xml", ".png": "image/png",
}


ISOLATION_HEADERS = {"cross-origin-opener-policy": "same-origin", "cross-origin-embedder-policy": "require-corp",
                     "cross-origin-resource-policy": "same-origin"}


def isolated(app):
    """ASGI middleware: add ISOLATION_HEADERS to every HTTP response of `app` (unless already set)."""
    extra = [(k.encode(), v.encode()) for k, v in ISOLATION_HEADERS.items()]

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_isolated(message):
            if message["type"] == "http.response.start":
                have = {k.lower() for k, _ in message.get("headers", [])}
                message = dict(message, headers=list(message.get("headers", [])) + [kv for kv in extra
                                                                                   if kv[0] not in have])
            await send(message)
        return await app(scope, receive, send_isolated)
    return wrapped


def _etag_matches(if_none_match: str | None, etag: str) -> bool:
    if not if_none_match:
        return False
    if if_none_match.strip() == "*":
        return True
    bare = etag.removeprefix("W/")
    return any(tag.strip().removeprefix("W/") == bare for tag in if_none_match.split(","))


def page_config(default_model: str | None, pyodide: str | None = None) -> dict:
    """What /config.js tells the page (scripts/build_static.py writes the same object, file-based)."""
    return {"defaultModel": default_model, "pyodide": pyodide, "vendor": "./vendor/", "tsWorker": "./ts-mini/worker.js"}


def create_app(model: str | os.PathLike | None = None, web_root: str | os.PathLike | None = None,
               ts_dist: str | os.PathLike | None = None, pyodide: str | None = None):
    """The demo as an ASGI app. `model`: GGUF served at /model/default.gguf (None: the page asks the user
    for a file). `pyodide`: base URL of another Pyodide build (e.g. the CDN) instead of /vendor/pyodide/."""
    from starlette.applications import Starlette
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    web = Path(web_root) if web_root is not None else WEB_ROOT
    ts = Path(ts_dist) if ts_dist is not None else TS_DIST
    if not (web / "index.html").is_file():
        raise FileNotFoundError(f"web demo not found: {web / 'index.html'}")
    model_path = Path(model) if model is not None else None
    if model_path is not None and not model_path.is_file():
        raise FileNotFoundError(f"model file not found: {model_path}")

    class TypedStaticFiles(StaticFiles):
        """StaticFiles with our MIME table and no-cache."""
        def file_response(self, full_path, stat_result, scope, status_code=200):
            resp = super().file_response(full_path, stat_result, scope, status_code)
            media = MIME_TYPES.get(Path(full_path).suffix.lower())
            if media:
                resp.media_type = media
                resp.headers["content-type"] = media
            resp.headers["cache-control"] = "no-cache"
            return resp

    pages = _DemoPages(model_path, pyodide)
    routes = [
        Route("/config.js", pages.config_js),
        Route("/model/default.gguf", pages.default_model, methods=["GET", "HEAD"]),
    ]
    vendor = web / "vendor"
    if vendor.is_dir():
        routes.append(Mount("/vendor", app=TypedStaticFiles(directory=vendor, follow_symlink=False)))
    if ts.is_dir():
        routes.append(Mount("/ts-mini", app=TypedStaticFiles(directory=ts)))
    routes.append(Mount("/", app=TypedStaticFiles(directory=web, html=True)))
    app = Starlette(routes=routes)
    app.state.model_path = model_path
    app.add_middleware(_Isolation)
    return app


class _DemoPages:
    """The demo's two generated routes: /config.js and the default model file."""

    def __init__(self, model_path: Path | None, pyodide: str | None):
        self.model_path, self.pyodide = model_path, pyodide

    async def config_js(self, request):
        from starlette.responses import Response
        cfg = page_config("./model/default.gguf" if self.model_path else None, self.pyodide)
        return Response(f"window.PYENGINE_CONFIG = {json.dumps(cfg)};\n", media_type=MIME_TYPES[".js"],
                        headers={"cache-control": "no-cache"})

    async def default_model(self, request):
        from starlette.responses import FileResponse, PlainTextResponse, Response
        if self.model_path is None:
            return PlainTextResponse("this server has no default model (start it with --model PATH)", 404)
        # FileResponse answers Range requests itself (206 + Content-Range, 416 when unsatisfiable) and sets an
        # ETag from size + mtime; a matching If-None-Match gets 304 without a body.
        st = os.stat(self.model_path)
        etag = '"' + hashlib.sha256(f"{st.st_size}-{st.st_mtime_ns}".encode()).hexdigest()[:32] + '"'
        headers = {"cache-control": "no-cache", "etag": etag}
        if _etag_matches(request.headers.get("if-none-match"), etag):
            return Response(status_code=304, headers=headers)
        return FileResponse(self.model_path, media_type=MIME_TYPES[".gguf"], headers=headers, stat_result=st)


class _Isolation:
    """Starlette middleware form of `isolated` (keeps `app.state` and mounting working)."""

    def __init__(self, app):
        self.app = isolated(app)

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)
