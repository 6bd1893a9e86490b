"""S19 The OpenAI-compatible HTTP app (starlette): plain handlers, one route table, the server's state.

    app = create_app(engine, model_id="SmolLM2-135M-Instruct.Q4_1")
    uvicorn.run(app, host="127.0.0.1", port=8000)

POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (SSE when "stream": true), POST /v1/embeddings
(embeddings.py), GET /v1/models, POST /tokenize, POST /detokenize (vLLM's shapes), GET /health, GET /metrics (Prometheus text),
POST /prompt_cache/{action}. Every error is OpenAI-shaped: {"error": {"message", "type", "param", "code"}} with the
matching HTTP status, and names no internals. guard.py holds the defences around the routes (Host check, CORS,
auth, 500s).

The top layer of the server; calls run down, each module importing only those below it:

    app           app.py: handlers (request, state) and ROUTE_TABLE, which both the router and the 404 text read;
                  guard.py (Host / CORS / key, 500s), http_server.py (uvicorn), web.py (the demo) beside it
    serving       serving.py, responses.py (/v1/responses), embeddings.py (/v1/embeddings), engine_loop.py,
                  metrics.py, the worker processes (tokenizer_process.py, grammar_worker.py)
    shaping       shaping.py (bodies, choices, chunks, logprobs), prompt_logprobs.py (echo and vLLM's
                  prompt_logprobs), streaming.py (SSE framing, disconnects)
    parsing       parsing.py (bodies -> ParsedRequest), constraints.py (response_format / tools -> a grammar)
    errors        errors.py (APIError and its 400 / 404 / 413 / 429 / 503 helpers); limits.py, engine_client.py,
                  reasoning.py, sampling_fields.py (plain data) beside it

tests/test_import_direction.py holds the order and checks it.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from pyengine.engine import prompt_cache
from pyengine.sampling_params import model_sampling_defaults
from pyengine.server import embeddings as EMB
from pyengine.server import errors as E
from pyengine.server import guard
from pyengine.server import parsing as P
from pyengine.server import responses as R
from pyengine.server import serving as S
from pyengine.server.args import MAX_BODY_BYTES, ServerArgs
from pyengine.server.engine_client import EngineClient, check_engine_client
from pyengine.server.engine_loop import EngineLoop
from pyengine.server.grammar_worker import GrammarCompiler
from pyengine.server.limits import ServerLimits
from pyengine.server.metrics import ServerMetrics, stats_line
from pyengine.server.shaping import new_id, now
from pyengine.server.streaming import DisconnectWatcher, EventStreamResponse
from pyengine.server.tokenizer_process import TokenizerProcess

log = logging.getLogger("pyengine.server")

DRAIN_LIMIT = 64 << 20            # read (and drop) at most this much of an oversized body before answering


def served_names(model_path: str | None, served_model_name: str | None = None) -> tuple[str, list[str]]:
    """Model id clients must send, and accepted aliases: 'X.Q4_1.gguf' -> 'X.Q4_1', alias 'X'; with
    `served_model_name` (--served-model-name) that is the id and the file's names are aliases."""
    if not model_path:
        stem, aliases = "pyengine", []
    else:
        stem = os.path.basename(str(model_path))
        if stem.lower().endswith(".gguf"):
            stem = stem[:-5]
        aliases = sorted({stem.split(".")[0]} - {stem})
    if served_model_name:
        return served_model_name, aliases + [stem]
    return stem, aliases


def error_response(err: E.APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class ServerState:
    """What the handlers share: the engine and its loop, the operator's limits, the metrics, the workers."""

    def __init__(self, engine, model_id, aliases, max_model_len, max_body_bytes, metrics, limits: ServerLimits,
                 sampling_defaults: dict, grammars: GrammarCompiler, prompt_cache_dir: str | None = None,
                 demo: bool = False):
        self.engine = engine
        self.tokenizer = engine.get_tokenizer()
        self.model_id = model_id
        self.names = {model_id.lower(), *(a.lower() for a in aliases), "pyengine"}
        self.max_model_len = max_model_len
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.limits = limits
        self.request_limits = P.RequestPolicy(max_model_len=max_model_len,
                                              max_tokens_per_request=limits.max_tokens_per_request,
                                              special_tokens_in_content=limits.special_tokens_in_content,
                                              sampling_defaults=tuple(sampling_defaults.items()))
        self.admission = S.Admission(limits.max_waiting, limits.max_waiting_tokens or 16 * max_model_len)
        self.loop = EngineLoop(engine, metrics)
        self.grammars = grammars            # S15: grammars compile off the loop, under budgets
        self.prompt_cache_dir = prompt_cache_dir
        self.demo = demo                    # the web demo is mounted at / (the 404 text says so)
        self.created = now()
        self.stopping = False               # a graceful stop began: no new requests
        self.parser = TokenizerProcess(self.tokenizer) if limits.tokenizer_process else None

    async def parse(self, fn, body: dict):
        """fn(body, tokenizer, policy) off the event loop: in the tokenizer process when there is one (its
        GIL is not the engine's), else in a thread (its work is still bounded by the context)."""
        if self.parser is not None:
            return await self.parser.run(fn, body, self.request_limits)
        return await asyncio.to_thread(fn, body, self.tokenizer, self.request_limits)

    # --- a graceful stop (http_server.uvicorn_server's Drain) ----------------------------------------
    def stop_admissions(self) -> None:
        self.stopping = True

    def end_streams(self, reason: str) -> int:
        """End every running request now: streams get an error event and [DONE], others a 503."""
        return self.loop.abort_all(reason)

    def check_admitting(self) -> None:
        if self.stopping:
            raise E.shutting_down()

    # --- checks in the order a client meets them (auth and Host: guard.py): type, size, JSON, model -----
    async def read_json(self, request: Request) -> dict:
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise E.not_json(media)
        limit, timeout = self.max_body_bytes, self.limits.body_timeout
        declared = request.headers.get("content-length", "")
        declared = int(declared) if declared.isdigit() else None
        if declared is not None and declared > DRAIN_LIMIT:
            raise E.too_large(limit)
        body = bytearray()
        seen = 0
        try:
            async with asyncio.timeout(timeout):   # a slow or stalled upload must not hold a connection
                async for chunk in request.stream():
                    seen += len(chunk)
                    if seen <= limit:
                        body += chunk
                    elif seen > DRAIN_LIMIT:   # stop reading: the connection will be closed after the 413
                        raise E.too_large(limit)
        except TimeoutError:
            if seen > limit or (declared or 0) > limit:
                raise E.too_large(limit) from None
            raise E.body_timeout(timeout) from None
        except ClientDisconnect:   # gone mid-body: nobody to answer, nothing was started
            raise E.APIError(400, "client disconnected while sending the request", code="client_disconnected")
        if seen > limit or (declared or 0) > limit:
            raise E.too_large(limit)
        return P.parse_json_body(bytes(body))

    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is None or (isinstance(model, str) and model.lower() in self.names):
            return
        if not isinstance(model, str):
            raise E.bad_param("model", "model must be a string")
        raise E.model_not_found(model, self.model_id)


# --- the handlers: (request, state) -> response; an APIError they raise is answered by `endpoint` -------------
async def complete(request: Request, state: ServerState, kind: str) -> Response:
    """chat / completion / responses: parse, start the engine requests, then stream or collect."""
    arrival = time.perf_counter()
    state.check_admitting()
    body = await state.read_json(request)
    state.check_model(body)
    parsed = await parse_generation(state, body, kind)
    state.check_admitting()
    gen = S.Generation(state.loop, state.metrics, parsed, new_id(kind), arrival, state.admission)
    await gen.start()
    created = now()
    watcher = DisconnectWatcher(request.receive, gen.abort)
    if parsed.stream:
        def on_close():   # the stream ended, failed or lost its client: abort leftovers, count it
            watcher.stop()
            gen.close()
        events = (R.stream(gen, state.model_id, created, body) if kind == "responses"
                  else S.stream(gen, state.tokenizer, state.model_id, created))
        return EventStreamResponse(events, on_close=on_close)
    try:
        result = await (R.collect(gen, state.model_id, created, body) if kind == "responses"
                        else S.collect(gen, state.tokenizer, state.model_id, created))
    finally:
        watcher.stop()
        gen.close()
    return JSONResponse(result)


async def parse_generation(state: ServerState, body: dict, kind: str) -> P.ParsedRequest:
    """A generation body -> ParsedRequest, its grammar compiled (S15) off the loop, under budgets."""
    parse_body = R.chat_body(body) if kind == "responses" else body
    parse = P.parse_completion if kind == "completion" else P.parse_chat
    try:
        parsed = await state.parse(parse, parse_body)
        await state.grammars.prepare(parsed, parse_body)
    except E.APIError as err:   # a Responses body's fields keep their own names in errors
        if kind == "responses":
            err.param = R.PARAMS.get(err.param, err.param)
        raise
    except ValueError as exc:   # e.g. the chat template refusing a message sequence
        raise E.APIError(400, str(exc), param={"chat": "messages", "completion": "prompt"}.get(kind, "input")
                         ) from None
    return parsed


async def chat_completions(request: Request, state: ServerState) -> Response:
    return await complete(request, state, "chat")


async def completions(request: Request, state: ServerState) -> Response:
    return await complete(request, state, "completion")


async def responses(request: Request, state: ServerState) -> Response:
    return await complete(request, state, "responses")


async def embeddings(request: Request, state: ServerState) -> Response:
    """S19: POST /v1/embeddings (embeddings.py): each input a prefill-only engine request, its pooled state."""
    state.check_admitting()
    body = await state.read_json(request)
    state.check_model(body)
    parsed = await state.parse(EMB.parse_embeddings, body)
    state.check_admitting()
    return JSONResponse(await EMB.run(state, parsed, new_id("embd")))


async def tokenize(request: Request, state: ServerState) -> Response:
    body = await state.read_json(request)
    state.check_model(body)
    return JSONResponse(await state.parse(P.tokenize, body))


async def detokenize(request: Request, state: ServerState) -> Response:
    body = await state.read_json(request)
    state.check_model(body)
    return JSONResponse(P.detokenize(body, state.tokenizer))


async def models(request: Request, state: ServerState) -> Response:
    card = {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "pyengine",
            "root": state.model_id, "max_model_len": state.max_model_len}
    return JSONResponse({"object": "list", "data": [card]})


async def health(request: Request, state: ServerState) -> Response:
    if state.stopping:
        return JSONResponse({"status": "stopping"}, status_code=503)
    status, reason = state.engine.health()
    if status != "ok":           # S17: a parallel rank stopped answering; S18: an instance role is missing
        return JSONResponse({"status": status, "reason": reason}, status_code=503)
    if state.loop._task is not None and not state.loop.alive:
        return JSONResponse({"status": "engine loop stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics_endpoint(request: Request, state: ServerState) -> Response:
    data, content_type = state.metrics.render()
    return Response(data, media_type=content_type.split(";")[0], headers={"content-type": content_type})


async def prompt_cache_route(request: Request, state: ServerState) -> Response:
    """S21: POST /prompt_cache/{save,restore,erase} (engine/prompt_cache.py serve_action has the shape)."""
    body = await state.read_json(request)
    action = request.path_params["action"]
    try:
        return JSONResponse(await state.loop.exclusive(
            lambda: prompt_cache.serve_action(state.loop.engine, state.prompt_cache_dir, action, body)))
    except prompt_cache.PromptCacheError as exc:
        raise E.APIError(400, str(exc), param="filename") from None
    except FileNotFoundError as exc:
        raise E.APIError(404, str(exc), param="filename") from None


# The route table, written once: the router is built from it and the 404 text lists it.
ROUTE_TABLE = (("POST", "/v1/chat/completions", chat_completions), ("POST", "/v1/completions", completions),
               ("POST", "/v1/responses", responses), ("POST", "/v1/embeddings", embeddings),
               ("GET", "/v1/models", models), ("POST", "/tokenize", tokenize),
               ("POST", "/detokenize", detokenize), ("GET", "/health", health),
               ("GET", "/metrics", metrics_endpoint), ("POST", "/prompt_cache/{action}", prompt_cache_route))
ROUTES = tuple(f"{method} {path}" for method, path, _ in ROUTE_TABLE)


def endpoint(handler, state: ServerState):
    """A starlette endpoint running `handler(request, state)`: its APIErrors become OpenAI-shaped answers (and
    count in the metrics)."""
    async def run(request: Request) -> Response:
        try:
            return await handler(request, state)
        except E.APIError as err:
            state.metrics.errors.labels(status=str(err.status)).inc()
            return error_response(err)
    return run


async def not_found(request: Request) -> Response:
    raise HTTPException(404)


async def http_error(state: ServerState, request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        body = E.route_not_found(request.method, request.url.path, ROUTES, state.demo)
        return JSONResponse(body, status_code=404)
    return JSONResponse(E.error_body(str(exc.detail), "invalid_request_error", None, None),
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def log_stats(engine: EngineClient, interval: float) -> None:
    """vLLM's periodic line: throughput since the last line, queue sizes, KV usage, prefix hits."""
    last, then = {}, time.perf_counter()
    with contextlib.suppress(Exception):
        last = dict(engine.stats() or {})
    while True:
        await asyncio.sleep(interval)
        try:
            stats = dict(engine.stats() or {})
        except Exception:   # the engine is mid-step in another thread: try again next time
            continue
        now_ = time.perf_counter()
        if stats != last:
            log.info(stats_line(stats, last, now_ - then))
        last, then = stats, now_


@contextlib.asynccontextmanager
async def lifespan(app: Starlette):
    """Start the workers and the engine loop (and the stats line); stop them when the server stops."""
    state: ServerState = app.state.server
    if state.parser is not None:
        await state.parser.start()
    await state.grammars.start()
    state.loop.ensure_started()
    interval = state.limits.stats_interval
    stats_task = asyncio.get_running_loop().create_task(log_stats(state.engine, interval)) if interval > 0 else None
    try:
        yield
    finally:
        if stats_task is not None:
            stats_task.cancel()
        await state.loop.stop()
        if state.parser is not None:
            state.parser.close()
        state.grammars.close()


def create_app(engine: EngineClient, *, model_id: str | None = None, aliases=(), api_key: str | None = None,
               max_model_len: int | None = None, max_body_bytes: int = MAX_BODY_BYTES, demo_app=None,
               metrics: ServerMetrics | None = None, limits: ServerLimits | None = None,
               sampling_defaults: dict | None = None, prompt_cache_dir: str | None = None,
               grammars: GrammarCompiler | None = None) -> Starlette:
    """The API around a ready engine (an `EngineClient`: LLMEngine, or S18's Router). `demo_app` (an ASGI app,
    e.g. the web demo) is mounted at / so the demo and the API share one process and port. `limits`: timeouts, queue
    bounds, Host/CORS policy (guard.ServerLimits); `api_key` covers every route but /health.
    `sampling_defaults`: for fields a request leaves out (default: the model GGUF's general.sampling.*).
    `grammars`: the S15 grammar compiler (server/grammar_worker.GrammarCompiler: its budgets)."""
    check_engine_client(engine)
    max_model_len = int(max_model_len or engine.max_model_len or 2048)
    limits = limits or ServerLimits()
    if sampling_defaults is None:
        sampling_defaults = model_sampling_defaults(engine.model_metadata())
    state = ServerState(engine, model_id or "pyengine", list(aliases), max_model_len, max_body_bytes,
                        metrics or ServerMetrics(model_name=model_id or "pyengine"), limits, sampling_defaults,
                        grammars or GrammarCompiler(), prompt_cache_dir, demo_app is not None)
    routes = [Route(path, endpoint(handler, state), methods=[method]) for method, path, handler in ROUTE_TABLE]
    if demo_app is not None:   # unknown /v1 paths stay the API's clear 404, not the demo's
        routes += [Route("/v1/{rest:path}", not_found, methods=["GET", "POST", "HEAD", "PUT", "DELETE"]),
                   Mount("/", app=demo_app)]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=guard.middleware(limits, api_key),
                    exception_handlers={HTTPException: functools.partial(http_error, state)})
    app.state.server = state
    app.state.limits = limits
    app.state.drain = state
    return app


def create_app_from_args(engine: EngineClient, args: ServerArgs, *, model_id: str, aliases=(),
                         max_model_len: int | None = None, demo_app=None,
                         metrics: ServerMetrics | None = None) -> Starlette:
    """`create_app` with the options of a `ServerArgs` (what `pyengine serve` and the S18 router build)."""
    grammars = GrammarCompiler(max_compile_s=args.max_grammar_compile_s, max_states=args.max_grammar_states)
    return create_app(engine, model_id=model_id, aliases=aliases, api_key=args.api_key, max_model_len=max_model_len,
                      max_body_bytes=args.max_body_bytes, demo_app=demo_app, metrics=metrics, limits=args.limits,
                      prompt_cache_dir=args.prompt_cache_dir, grammars=grammars)
