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
import os
import pickle
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

_TOKENIZER = None   # the worker's copy
PARENT_POLL_S = 0.5  # how often a worker checks that the server process is still its parent


def _load(blob: bytes, parent: int) -> None:
    global _TOKENIZER
    # a terminal's Ctrl-C reaches the whole process group: the server decides how to stop (gracefully) and
    # shuts this worker down; a KeyboardInterrupt here would only print its traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _TOKENIZER = pickle.loads(blob)
    _exit_with_parent(parent)


def _exit_with_parent(parent: int) -> None:
    """End this worker when the server process is gone. A pool worker blocks reading its call queue, whose
    pipe it also holds open for writing, so a server killed without shutting the pool down (SIGKILL, a crash,
    an MPI job's rank 0 ended by its launcher) would leave it waiting forever, orphaned."""
    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="pyengine-parent-watch", daemon=True).start()


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
                                             initializer=_load, initargs=(self._blob, os.getpid()))
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
        """Stop the worker: queued calls are cancelled, a running one (at most a prompt's parse) ends first."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

