"""S19 The OpenAI-compatible HTTP app (starlette): routes, auth, limits, errors; one engine loop.

    app = create_app(engine, model_id="SmolLM2-135M-Instruct.Q4_1")
    uvicorn.run(app, host="127.0.0.1", port=8000)

POST /v1/chat/completions, POST /v1/completions (SSE when "stream": true), GET /v1/models,
GET /health, GET /metrics (Prometheus text). Every error is OpenAI-shaped:
{"error": {"message", "type", "param", "code"}} with the matching HTTP status.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from pyengine.server import protocol as P
from pyengine.server import serving as S
from pyengine.server.engine_loop import EngineLoop, engine_failure
from pyengine.server.metrics import ServerMetrics
from pyengine.server.streaming import DisconnectWatcher, EventStreamResponse

log = logging.getLogger("pyengine.server")

MAX_BODY_BYTES = 1 << 20          # 1 MiB: larger bodies get 413
DRAIN_LIMIT = 64 << 20            # read (and drop) at most this much of an oversized body before answering


def served_names(model_path: str | None) -> tuple[str, list[str]]:
    """Model id clients must send, and accepted aliases: 'X.Q4_1.gguf' -> 'X.Q4_1', alias 'X'."""
    if not model_path:
        return "pyengine", []
    stem = os.path.basename(str(model_path))
    if stem.lower().endswith(".gguf"):
        stem = stem[:-5]
    return stem, sorted({stem.split(".")[0]} - {stem})


def error_response(err: P.APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class ServerState:
    def __init__(self, engine, model_id, aliases, api_key, max_model_len, max_body_bytes, metrics):
        self.engine = engine
        self.tokenizer = engine.get_tokenizer()
        self.model_id = model_id
        self.names = {model_id.lower(), *(a.lower() for a in aliases), "pyengine"}
        self.api_key = api_key
        self.max_model_len = max_model_len
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.loop = EngineLoop(engine, metrics)
        self.created = P.now()

    # --- checks in the order a client meets them: auth, size, JSON, model ------------------------
    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise P.APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                             code="invalid_api_key")

    async def read_json(self, request: Request) -> dict:
        limit = self.max_body_bytes
        too_big = P.APIError(413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large")
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > DRAIN_LIMIT:
            raise too_big
        body = bytearray()
        seen = 0
        try:
            async for chunk in request.stream():
                seen += len(chunk)
                if seen <= limit:
                    body += chunk
                elif seen > DRAIN_LIMIT:   # stop reading: the connection will be closed after the 413
                    raise too_big
        except ClientDisconnect:   # gone mid-body: nobody to answer, nothing was started
            raise P.APIError(400, "client disconnected while sending the request", code="client_disconnected")
        if seen > limit or (declared and declared.isdigit() and int(declared) > limit):
            raise too_big
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise P.APIError(400, f"Invalid JSON body: {exc}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise P.APIError(400, "The request body must be a JSON object.", code="invalid_json")
        return data

    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is None or (isinstance(model, str) and model.lower() in self.names):
            return
        if not isinstance(model, str):
            raise P.bad_param("model", "model must be a string")
        raise P.APIError(404, f"The model '{model}' does not exist; this server serves '{self.model_id}'.",
                         param="model", code="model_not_found")


def create_app(engine, *, model_id: str | None = None, aliases=(), api_key: str | None = None,
               max_model_len: int | None = None, max_body_bytes: int = MAX_BODY_BYTES, demo_app=None,
               metrics: ServerMetrics | None = None) -> Starlette:
    """The API around a ready `LLMEngine`-shaped engine. `demo_app` (an ASGI app, e.g. the web demo)
    is mounted at / so the demo and the API share one process and port."""
    max_model_len = max_model_len or getattr(engine, "max_model_len", None) or 2048
    state = ServerState(engine, model_id or "pyengine", list(aliases), api_key, int(max_model_len),
                        max_body_bytes, metrics or ServerMetrics())

    async def complete(request: Request, kind: str) -> Response:
        arrival = time.perf_counter()
        try:
            state.check_key(request)
            body = await state.read_json(request)
            state.check_model(body)
            parse = P.parse_chat if kind == "chat" else P.parse_completion
            # Tokenizing runs off the event loop: a long prompt must not stall other streams.
            try:
                parsed = await asyncio.to_thread(parse, body, state.tokenizer, state.max_model_len)
            except ValueError as exc:   # e.g. the chat template refusing a message sequence
                raise P.APIError(400, str(exc), param="messages" if kind == "chat" else "prompt") from None
            gen = S.Generation(state.loop, state.metrics, parsed, P.new_id(kind), arrival)
            await gen.start()
        except P.APIError as err:
            state.metrics.errors.labels(status=str(err.status)).inc()
            return error_response(err)
        created = P.now()
        watcher = DisconnectWatcher(request.receive, gen.abort)
        if parsed.stream:
            def on_close():   # the stream ended, failed or lost its client: abort leftovers, count it
                watcher.stop()
                gen.close()
            return EventStreamResponse(S.stream(gen, state.tokenizer, state.model_id, created), on_close=on_close)
        try:
            result = await S.collect(gen, state.tokenizer, state.model_id, created)
        except P.APIError as err:
            return error_response(err)
        finally:
            watcher.stop()
            gen.close()
        return JSONResponse(result)

    async def chat_completions(request: Request) -> Response:
        return await complete(request, "chat")

    async def completions(request: Request) -> Response:
        return await complete(request, "completion")

    async def models(request: Request) -> Response:
        try:
            state.check_key(request)
        except P.APIError as err:
            return error_response(err)
        card = {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "pyengine",
                "root": state.model_id, "max_model_len": state.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        reason = engine_failure(state.loop.engine)
        if reason:                                      # S17: a parallel rank stopped answering
            return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)
        if state.loop._task is not None and not state.loop.alive:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(request: Request) -> Response:
        data, content_type = state.metrics.render()
        return Response(data, media_type=content_type.split(";")[0], headers={"content-type": content_type})

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(P.error_body(str(exc.detail), kind, None, None), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse(P.error_body(f"internal server error: {exc!r}", "server_error", None, None),
                            status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.loop.ensure_started()
        try:
            yield
        finally:
            await state.loop.stop()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    if demo_app is not None:
        routes.append(Mount("/", app=demo_app))
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.server = state
    return app
