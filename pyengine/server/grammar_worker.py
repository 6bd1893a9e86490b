"""S15 The grammar compile worker: `GrammarCompiler` compiles a request's grammar away from the serving loop and the
engine lock, in a worker process, under a time and a state budget (docs/performance.md has the measurement that
chose a process over a thread).

Serving layer of the server (errors -> request parsing -> response shaping -> serving -> app): it imports errors,
constraints (which body field a grammar came from), parsing (`ParsedRequest`) and tokenizer_process (the worker's
parent watch), nothing above.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from pyengine.server.constraints import grammar_field
from pyengine.server.errors import bad_param
from pyengine.server.parsing import ParsedRequest
from pyengine.server.tokenizer_process import _exit_with_parent
from pyengine.structured.automaton import TooAmbiguous
from pyengine.structured.budget import DEFAULT_COMPILE_S, DEFAULT_MAX_STATES, Budget, GrammarTooLarge, GrammarTooSlow
from pyengine.structured.ir import GrammarError
from pyengine.structured.matcher import cached_automaton, compile_automaton, install, spec_key

log = logging.getLogger("pyengine.server")

HARD_KILL_GRACE_S = 2.0      # past its budget plus this, a compile the budget checks missed is killed


def _compile_job(kind: str, spec, seconds: float, max_states: int):
    """In the compile worker: ("ok", automaton) or ("refused", error class name, message, keyword)."""
    try:
        return "ok", compile_automaton(kind, spec, Budget(seconds, max_states))
    except GrammarError as e:
        return "refused", type(e).__name__, str(e), e.keyword


RESUBMITS = 3       # how often a compile job whose worker was killed for another job is submitted again
WORKER_NICE = 10     # the compile worker yields the CPU to the engine's step on a busy host


def _worker_init(parent: int) -> None:
    # a terminal's Ctrl-C reaches the whole process group: the server stops gracefully and shuts this worker
    # down (as the tokenizer worker does); a KeyboardInterrupt here would only print its traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(parent)
    try:
        os.nice(WORKER_NICE)
    except OSError:
        pass


def _ready() -> bool:
    return True


class GrammarCompiler:
    """S15 grammars compiled away from the serving loop and the engine lock, under a budget.

    `await prepare(parsed, body)` compiles the request's grammar (and, for tool_choice "auto", each tool's
    parameters schema) before the request reaches the engine, and leaves the automaton in the compile
    cache, where `LLMEngine.add_request` finds it (`pyengine.structured.matcher`). A refusal is cached
    too, so the same bad grammar is answered from the cache; identical grammars in flight share one
    compilation. A grammar past ``max_states`` automaton states or ``max_compile_s`` seconds is a 400
    naming the limit.

    ``mode``: "process" (default) compiles in a worker process: the compiler is pure Python, and in a
    thread it would take the GIL from the engine's step and the event loop (measured in
    docs/performance.md); a worker that overruns its budget is killed and replaced. "thread" is kept for
    that measurement. Pyodide has neither: there `LLMEngine.add_request` compiles synchronously, under
    the same budget.
    """

    def __init__(self, max_compile_s: float = DEFAULT_COMPILE_S, max_states: int = DEFAULT_MAX_STATES,
                 mode: str = "process"):
        if max_compile_s <= 0 or max_states <= 0:
            raise ValueError("the grammar compile limits must be positive")
        if mode not in ("process", "thread"):
            raise ValueError(f"unknown grammar compile mode {mode!r}")
        self.max_compile_s, self.max_states, self.mode = float(max_compile_s), int(max_states), mode
        self._pool: ProcessPoolExecutor | None = None
        self._inflight: dict[str, asyncio.Future] = {}
        self.compiles = self.refusals = self.kills = 0
        self._queued = 0                          # compile jobs submitted to the worker and not answered

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_worker_init, initargs=(os.getpid(),))
        return self._pool

    def _kill(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        self.kills += 1

    async def start(self) -> None:
        """Start the worker now (it imports pyengine: about a second), not on the first constrained request."""
        if self.mode == "process":
            try:
                await asyncio.get_running_loop().run_in_executor(self._executor(), _ready)
            except Exception as e:       # the server still serves: a later request retries the worker
                log.warning("grammar compile worker did not start: %r", e)
                self._pool = None

    def close(self) -> None:
        """Stop the worker and reap it before the server exits: a compile in flight is dropped (its request ends
        with the server), so a busy worker is killed first. (Not waiting left it alive after the server.)"""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        if self._inflight:
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.kill()
        pool.shutdown(wait=True, cancel_futures=True)     # joins the worker (a killed one too)

    async def _run(self, kind: str, spec):
        """One compile job in the worker. A job queued behind another grammar that overran its budget loses its
        worker with it (the pool is killed and its queue cancelled): that job is not this request's fault, so it
        is submitted again to the fresh worker, up to RESUBMITS times."""
        loop = asyncio.get_running_loop()
        for _ in range(RESUBMITS + 1):
            pool = None if self.mode == "thread" else self._executor()
            # the worker runs one job at a time and each keeps its own budget, so a job waits its turn behind
            # the ones queued before it: its deadline counts them (a deadline from submission alone would kill
            # the worker under someone else's job)
            deadline = (self.max_compile_s + HARD_KILL_GRACE_S) * (1 + (self._queued if pool is not None else 0))
            fut = loop.run_in_executor(pool, _compile_job, kind, spec, self.max_compile_s, self.max_states)
            self._queued += 1
            try:
                return await asyncio.wait_for(fut, deadline)
            except asyncio.TimeoutError:
                if self.mode == "process" and self._pool is pool:
                    self._kill()
                return "refused", "GrammarTooSlow", GrammarTooSlow.message(self.max_compile_s), None
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling() or pool is None or self._pool is pool:
                    raise                         # this request itself was cancelled
            except BrokenProcessPool:
                if self._pool is pool:            # this grammar broke it
                    self._pool = None
                    return "refused", "GrammarError", "the grammar compiler failed on this grammar", None
            finally:
                self._queued -= 1
        return "refused", "GrammarError", "the grammar compile worker was restarted too often; try again", None

    async def compile(self, kind: str, spec) -> None:
        """Compile (kind, spec) into the cache; GrammarError if it is refused (now or before)."""
        key = spec_key(kind, spec)
        if cached_automaton(key) is not None:     # raises a cached refusal
            return
        fut = self._inflight.get(key)
        if fut is None:                           # the first asker compiles; the same grammar in flight waits
            fut = self._inflight[key] = asyncio.get_running_loop().create_future()
            result = ("refused", "GrammarError", "the grammar's compilation was cancelled", None)
            try:
                result = await self._run(kind, spec)
            except Exception as e:
                result = ("refused", "GrammarError", f"the grammar could not be compiled ({type(e).__name__})",
                          None)
            finally:
                self._inflight.pop(key, None)
                fut.set_result(result)
            self.compiles += 1
        else:
            result = await asyncio.shield(fut)
        if result[0] == "ok":
            install(key, result[1])
            return
        _, name, message, keyword = result
        err = _ERRORS.get(name, GrammarError)(message, keyword)
        self.refusals += 1
        install(key, refusal=err)
        raise err

    async def prepare(self, parsed: ParsedRequest, body: dict) -> None:
        """Compile the grammars a parsed request needs; a refusal is a 400 naming the request's field."""
        so, plan = parsed.params.structured_outputs, parsed.tool_plan
        if so is not None:
            try:
                await self.compile(*so.request)
            except GrammarError as e:
                raise bad_param(grammar_field(body), str(e)) from None
        if plan is not None and plan.choice == "auto":
            for schema in plan.parameters.values():     # read back by ToolPlan.calls: compile them here
                try:
                    await self.compile("json", schema)
                except GrammarError:
                    pass                                 # such a tool's replies are not read as calls


_ERRORS = {c.__name__: c for c in (GrammarError, GrammarTooLarge, GrammarTooSlow, TooAmbiguous)}
