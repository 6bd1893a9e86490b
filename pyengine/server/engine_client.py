"""S19 What the server drives: the `EngineClient` contract, met by `LLMEngine` (one engine in this process) and by
the disaggregated `Router` (S18: prefill and decode instances behind rank 0).

The server calls nothing else of its engine. All calls come from one asyncio task at a time (engine_loop.py
serialises them), `step` in a worker thread.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

# health(): (status, reason). "ok": serving; "degraded": serving, with a part missing (S18: no prefill instance,
# decode instances prefill too), reason says which; "unhealthy": cannot run requests (S17: a lost rank).
HEALTH_STATES = ("ok", "degraded", "unhealthy")


@runtime_checkable
class EngineClient(Protocol):
    max_model_len: int

    def get_tokenizer(self) -> Any: ...

    def add_request(self, request_id: str, prompt, params=None, priority: int = 0) -> Any:
        """Queue a request (prompt: text, token ids or {"prompt_token_ids": [...]}); ValueError / EngineOverloaded
        refuse it, and nothing is left behind."""

    def abort_request(self, request_id: str) -> Any: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list:
        """One step: the RequestOutputs (cumulative, per request) of the requests that moved."""

    def stats(self) -> dict: ...

    def num_used_blocks(self) -> int: ...

    def health(self) -> tuple[str, str | None]:
        """(one of HEALTH_STATES, why it is not "ok" or None)."""

    def model_metadata(self) -> dict | None:
        """The model GGUF's metadata (the server's sampling defaults come from its general.sampling.*)."""


def check_engine_client(engine) -> None:
    """TypeError naming what `engine` lacks of the contract (a clear error at create_app, not at a request)."""
    if not isinstance(engine, EngineClient):
        missing = [name for name in ("max_model_len", *(n for n in EngineClient.__dict__ if not n.startswith("_")
                                                        and callable(getattr(EngineClient, n))))
                   if not hasattr(engine, name)]
        raise TypeError(f"{type(engine).__name__} is not an EngineClient: it lacks {', '.join(missing)}")
