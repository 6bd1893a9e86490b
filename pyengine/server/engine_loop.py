"""S19 One engine, many connections: the async driver between HTTP handlers and `LLMEngine`.

A single asyncio task owns the stepping: while the engine has work it runs `engine.step()` in a worker
thread (NumPy releases the GIL in its kernels, so the event loop keeps accepting and streaming), then
routes every `RequestOutput` to the asyncio.Queue of the HTTP request that owns it.

The engine is not thread-safe, so all engine calls are serialised by one asyncio.Lock: the stepping
task holds it across a step, `add_request` takes it between steps (asyncio.Lock is FIFO, so waiting
adds go in before the next step). Aborts are only recorded (they come from synchronous code such as a
disconnect callback) and applied before the next step, so a cancelled request frees its KV blocks
within one step.
"""
from __future__ import annotations

import asyncio
import logging

from pyengine.server.engine_client import EngineClient

log = logging.getLogger("pyengine.server")


class Aborted:
    """Queue item telling a handler its request was aborted (client gone or server stopping)."""

    def __init__(self, request_id: str, reason: str):
        self.request_id, self.reason = request_id, reason


class EngineFailure:
    """Queue item carrying an exception raised by engine.step()."""

    def __init__(self, request_id: str, exc: BaseException):
        self.request_id, self.exc = request_id, exc


class EngineUnavailable(RuntimeError):
    """The engine cannot run steps any more (S17: a parallel rank stopped answering): 503 until restarted."""


def engine_failure(engine: EngineClient) -> str | None:
    """Why the engine cannot run requests (S17: a lost parallel rank), or None."""
    status, reason = engine.health()
    return reason if status == "unhealthy" else None


class EngineLoop:
    def __init__(self, engine: EngineClient, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self._queues: dict[str, asyncio.Queue] = {}
        self._aborts: set[str] = set()
        self._lock: asyncio.Lock | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.steps = 0

    # --- lifecycle ------------------------------------------------------------------------------
    def ensure_started(self) -> None:
        """Start the stepping task on the running loop (idempotent; lazily, so a mounted app works)."""
        if self._task is None or self._task.done():
            if self._task is not None and self._task.done() and not self._task.cancelled():
                exc = self._task.exception()
                if exc is not None:
                    log.error("engine loop had died: %r; restarting", exc)
            self._lock = self._lock or asyncio.Lock()
            self._wake = self._wake or asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="pyengine-engine-loop")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self, timeout: float = 30.0) -> None:
        """End the stepping task after its current step (a step cannot be interrupted, and the engine
        must not be touched while it runs), then abort everything still registered."""
        if self._task is not None:
            self._stopping = True
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
            except Exception:
                pass
            self._task = None
            self._stopping = False
        for rid in list(self._queues):
            self._abort_in_engine(rid)
            self._queues.pop(rid).put_nowait(Aborted(rid, "server stopping"))

    # --- handler-facing API ---------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt, params, queue: asyncio.Queue, priority: int = 0) -> None:
        """Hand a request to the engine; its outputs will be put on `queue`. Engine errors (e.g.
        EngineOverloaded, ValueError) propagate to the caller, and nothing is left registered."""
        self.ensure_started()
        reason = engine_failure(self.engine)
        if reason:
            raise EngineUnavailable(reason)
        async with self._lock:
            self.engine.add_request(request_id, prompt, params, priority)
            self._queues[request_id] = queue
        self._wake.set()

    def abort(self, request_id: str, reason: str = "client disconnected") -> None:
        """Stop a request: its handler gets an `Aborted` item now, the engine drops it before its next
        step. Safe to call from synchronous code, twice, or for a finished request."""
        queue = self._queues.pop(request_id, None)
        if queue is None:
            return
        self._aborts.add(request_id)
        queue.put_nowait(Aborted(request_id, reason))
        if self._wake is not None:
            self._wake.set()

    def abort_all(self, reason: str) -> int:
        """Abort every registered request (a graceful stop's end); how many there were."""
        ids = list(self._queues)
        for rid in ids:
            self.abort(rid, reason)
        return len(ids)

    async def exclusive(self, fn):
        """fn() between two engine steps (S21: the prompt cache reads and writes KV blocks), in a thread."""
        self.ensure_started()
        async with self._lock:
            return await asyncio.to_thread(fn)

    @property
    def num_active(self) -> int:
        return len(self._queues)

    # --- the stepping task ----------------------------------------------------------------------
    def _abort_in_engine(self, rid: str) -> None:
        try:
            self.engine.abort_request(rid)
        except Exception as exc:  # an unknown/finished id is not an error worth failing over
            log.debug("abort_request(%s) failed: %r", rid, exc)

    def _apply_aborts(self) -> None:
        while self._aborts:
            self._abort_in_engine(self._aborts.pop())

    def _observe(self) -> None:
        if self.metrics is not None:
            try:
                self.metrics.observe_engine(self.engine)
            except Exception as exc:  # metrics must never take the server down
                log.debug("metrics refresh failed: %r", exc)

    async def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            while not self._stopping:
                failed = False
                async with self._lock:
                    self._apply_aborts()
                    if not self.engine.has_unfinished_requests():
                        break
                    try:
                        outputs = await asyncio.to_thread(self.engine.step)
                    except Exception as exc:
                        log.exception("engine.step() failed")
                        self._fail_all(exc)
                        outputs, failed = [], True
                    self.steps += 1
                    self._observe()
                for out in outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is None:
                        continue  # aborted while the step ran: nobody is listening
                    if out.finished:
                        del self._queues[out.request_id]
                    queue.put_nowait(out)
                # let handlers stream before the next step (and do not spin on a failing engine)
                await asyncio.sleep(0.05 if failed else 0)
            self._observe()
            await self._wake.wait()

    def _fail_all(self, exc: BaseException) -> None:
        # After a failed step the engine's state is unknown: end every request it holds.
        for rid in list(self._queues):
            self._abort_in_engine(rid)
            self._queues.pop(rid).put_nowait(EngineFailure(rid, exc))
