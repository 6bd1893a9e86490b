"""S19 Parsing prompts in a worker process, away from the engine's GIL.

Tokenizing is pure Python and holds the GIL. In the server's own process a long prompt (one the context
bound cannot refuse before tokenizing, since it might fit) then slows every engine step: each NumPy call
of the forward pass waits its turn for the interpreter. vLLM splits the same way: its API server
tokenizes while the engine core runs in another process. Here a worker process holds a copy of the
tokenizer and runs the protocol's parse functions; a request body goes in, a ParsedRequest comes out
(about a millisecond of pickling for a chat request).
"""
from __future__ import annotations

import asyncio
import multiprocessing
import pickle
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

_TOKENIZER = None   # the worker's copy


def _load(blob: bytes) -> None:
    global _TOKENIZER
    _TOKENIZER = pickle.loads(blob)


def _call(fn, body, policy):
    return fn(body, _TOKENIZER, policy)


def _ready() -> bool:
    return _TOKENIZER is not None


class TokenizerProcess:
    """`await run(parse_fn, body, policy)` = parse_fn(body, tokenizer, policy) in the worker. A worker
    that died is replaced on the next call (the call that met it fails)."""

    def __init__(self, tokenizer, workers: int = 1):
        self._blob = pickle.dumps(tokenizer)
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn, not fork: a fork would copy a process whose engine and server threads hold locks
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_load, initargs=(self._blob,))
        return self._pool

    async def start(self) -> None:
        """Start the worker now (it imports pyengine and unpickles the tokenizer: about a second)."""
        await asyncio.get_running_loop().run_in_executor(self._executor(), _ready)

    async def run(self, fn, body, policy):
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor(), _call, fn, body, policy)
        except BrokenProcessPool:
            self._pool = None
            raise

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
