"""S19 OpenAI-compatible HTTP server (starlette + uvicorn, imported only when serving), in one-way layers:
each module imports only those listed below it (tests/test_import_direction.py checks the order).

app.py           create_app(engine, ...): plain handlers (request, state), ROUTE_TABLE, body limits, lifespan
guard.py         ServerLimits applied to every route: Host check, CORS, auth, 500s that close the connection
http_server.py   uvicorn with the limits applied (ConnectionGuard: header and first-byte deadlines, uploads per
                 client; connection cap), a port bound early,
                 a background-thread server (tests, benchmarks);  web.py: the S22 demo's dev server
serving.py       one API request as engine requests: updates, streaming events, final bodies
responses.py     /v1/responses on the chat pipeline
grammar_worker.py  S15 grammars compiled in a worker process, under budgets
tokenizer_process.py  prompt parsing in a worker process (its GIL is not the engine's)
engine_loop.py   the single task that steps the engine and routes outputs to per-request queues
metrics.py       Prometheus metrics on a per-app registry
streaming.py     SSE framing over raw ASGI and client-disconnect detection (cancellation)
shaping.py       engine outputs -> OpenAI JSON: bodies, choices, chunks, logprobs, tool-call messages
parsing.py       request bodies -> ParsedRequest (token ids, SamplingParams); /tokenize, /detokenize
constraints.py   response_format / structured_outputs / tools -> a grammar spec and a ToolPlan
errors.py        APIError (OpenAI's error shape) and its helpers;  limits.py, args.py (ServerArgs: the server's
                 options beside EngineArgs), engine_client.py, reasoning.py: plain data and contracts beside it
"""
