"""S19 OpenAI-compatible HTTP server (starlette + uvicorn, imported only when serving).

parsing.py       request bodies -> SamplingParams; engine outputs -> OpenAI JSON; OpenAI error shape
engine_loop.py   the single task that steps the engine and routes outputs to per-request queues
serving.py       one API request as engine requests: updates, streaming events, final bodies
streaming.py     SSE over raw ASGI and client-disconnect detection (cancellation)
metrics.py       Prometheus metrics on a per-app registry
guard.py         ServerLimits; Host check, CORS, auth on every route, 500s that close the connection
tokenizer_process.py  prompt parsing in a worker process (its GIL is not the engine's)
app.py           create_app(engine, ...): routes, body limits and timeouts, errors, lifespan, stats log
http_server.py   uvicorn with the limits applied (header deadline, connection cap), a port bound early,
                 a background-thread server (tests, benchmarks)
"""
