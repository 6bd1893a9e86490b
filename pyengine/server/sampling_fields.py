"""Issue 32's request fields on the wire: ``min_tokens``, ``bad_words``, ``allowed_token_ids``,
``thinking_token_budget`` (into `SamplingParams`) and ``priority`` (into the scheduler), as vLLM's server takes
them (top-level body fields; the official ``openai`` client sends them through ``extra_body``).

Each bad value is a 400 naming its field. ``priority`` follows vLLM's sign: a lower value is served earlier
(the scheduler's key, engine/scheduler.py; waiting requests age, so none starves); the server bounds it to
``[-MAX_PRIORITY, MAX_PRIORITY]`` so that one client cannot set a key no aging can reach.
"""
from __future__ import annotations

from pyengine.server.errors import bad_param, int_field, str_list

MAX_PRIORITY = 1000                 # aging gains 1 per --aging-steps (64) steps: 64k steps at most behind one
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
FIELDS = ("min_tokens", "bad_words", "allowed_token_ids", "thinking_token_budget")


def parse_sampling_fields(body: dict, vocab_size: int) -> dict:
    """The SamplingParams keywords of the four fields (only those given)."""
    out = {}
    min_tokens = int_field(body, "min_tokens", 0)
    if min_tokens is not None:
        cap = body.get("max_completion_tokens", body.get("max_tokens"))
        if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1 and min_tokens > cap:
            raise bad_param("min_tokens", f"min_tokens ({min_tokens}) must be less than or equal to "
                                          f"max_tokens ({cap})")
        out["min_tokens"] = min_tokens
    words = str_list(body, "bad_words", MAX_BAD_WORDS, "words")
    if words is not None:
        for w in words:
            if not w.strip() or len(w) > MAX_BAD_WORD_CHARS:
                raise bad_param("bad_words", f"bad_words entries must be non-blank strings of at most "
                                             f"{MAX_BAD_WORD_CHARS} characters, got {w[:40]!r}")
        if words:
            out["bad_words"] = words
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if not isinstance(allowed, list) or not allowed:
            raise bad_param("allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids")
        for t in allowed:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise bad_param("allowed_token_ids", f"allowed_token_ids holds {t!r}, not a token id in "
                                                     f"[0, {vocab_size})")
        out["allowed_token_ids"] = allowed
    budget = int_field(body, "thinking_token_budget", 0)
    if budget is not None:
        out["thinking_token_budget"] = budget
    return out


def parse_priority(body: dict) -> int:
    """The request's scheduling priority (0 when absent; lower is served earlier)."""
    v = int_field(body, "priority", -MAX_PRIORITY, MAX_PRIORITY)
    return 0 if v is None else v
