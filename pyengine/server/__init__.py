"""S19 OpenAI-compatible HTTP server (starlette + uvicorn, imported only when serving).

protocol.py      request bodies -> SamplingParams; engine outputs -> OpenAI JSON; OpenAI error shape
engine_loop.py   the single task that steps the engine and routes outputs to per-request queues
serving.py       one API request as engine requests: updates, streaming events, final bodies
streaming.py     SSE over raw ASGI and client-disconnect detection (cancellation)
metrics.py       Prometheus metrics on a per-app registry
app.py           create_app(engine, ...): routes, auth, limits, errors, lifespan
runner.py        uvicorn in a background thread (tests, benchmarks)
"""
