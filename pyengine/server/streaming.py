"""S19 Server-sent events over raw ASGI, and noticing that a client went away.

Starlette's StreamingResponse only notices a disconnect on its next send, and uvicorn silently drops
sends to a closed socket, so a stalled generator would keep its KV blocks until it finished. Here the
handler owns `receive` once the body is read: a watcher task waits for `http.disconnect` and calls back
at once (the callback aborts the engine requests), independent of whether tokens are flowing.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable


def sse(payload: dict | str) -> bytes:
    """One SSE event: `data: {...}\\n\\n` (the OpenAI stream format)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


DONE = sse("[DONE]")


class DisconnectWatcher:
    """Calls `on_disconnect()` once if the client disconnects before `stop()`."""

    def __init__(self, receive, on_disconnect: Callable[[], None]):
        self._receive = receive
        self._on_disconnect = on_disconnect
        self.disconnected = False
        self._task = asyncio.get_running_loop().create_task(self._listen())

    async def _listen(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                self._on_disconnect()
                return

    def stop(self) -> None:
        self._task.cancel()


class EventStreamResponse:
    """ASGI response sending each chunk of `events` as it is produced (no buffering)."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict | None = None,
                 on_close: Callable[[], None] | None = None):
        self.events = events
        self.on_close = on_close
        self.headers = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache",
                        "x-accel-buffering": "no", **(headers or {})}

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(k.encode(), v.encode()) for k, v in self.headers.items()]})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await self.events.aclose()  # runs the generator's cleanup (abort, metrics) even on error
            if self.on_close is not None:
                self.on_close()         # also when the generator never started
        await send({"type": "http.response.body", "body": b"", "more_body": False})
