"""S15 the cost of a grammar is bounded: a compile time budget and an automaton state budget per request.

A grammar arrives from a client, so its compilation is an attack surface: a 13-byte regex such as
``a{1000}{1000}`` asks for a million automaton states. Every compilation runs under a `Budget`:

    with compile_budget(Budget(seconds=5.0, max_states=200_000)):
        automaton = compile_rules(rules, root)

The compiler calls `check_time()` in its loops and `charge(n)` before it builds n automaton states (the
IR's size is estimated before the NFA is built, so a bomb is refused at once, not after the states are
made). Past a limit it raises `GrammarTooLarge` or `GrammarTooSlow`, both `GrammarError`s whose message
names the limit (the server's option), so the client's 400 says what to change.

The budget is carried in a ContextVar: a compile thread, the compile process and Pyodide's synchronous
path each see their own. Without one in force (the offline engine, Pyodide) the state budget applies
and no time limit: a compile there blocks only its own caller.
"""
from __future__ import annotations

import contextvars
import time
from contextlib import contextmanager

from .ir import GrammarError

DEFAULT_MAX_STATES = 200_000        # NFA states of one grammar (~100 bytes each while compiling)
DEFAULT_COMPILE_S = 20.0            # the server's --max-grammar-compile-s default (a backstop: bombs
                                    # are refused by the state budget first, in well under a second)


class GrammarTooLarge(GrammarError):
    """The grammar's automaton would exceed the state budget."""


class GrammarTooSlow(GrammarError):
    """The grammar did not compile within the time budget."""

    @staticmethod
    def message(seconds: float) -> str:
        return (f"grammar too slow to compile (more than {seconds:g} s; the server's limit is "
                "--max-grammar-compile-s)")


class Budget:
    def __init__(self, seconds: float | None = None, max_states: int = DEFAULT_MAX_STATES):
        self.seconds = seconds
        self.max_states = int(max_states)
        self.deadline = None if seconds is None else time.monotonic() + seconds

    def check_time(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise GrammarTooSlow(GrammarTooSlow.message(self.seconds))

    def too_large(self, what: str) -> GrammarTooLarge:
        return GrammarTooLarge(f"grammar too large ({what}; the limit is {self.max_states} automaton states, "
                               "the server's --max-grammar-states)")


_current: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("pyengine_grammar_budget", default=None)


def current() -> Budget:
    b = _current.get()
    return b if b is not None else Budget()


@contextmanager
def compile_budget(budget: Budget):
    token = _current.set(budget)
    try:
        yield budget
    finally:
        _current.reset(token)
