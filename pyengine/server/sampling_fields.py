"""Issue 32's request fields on the wire: ``min_tokens``, ``bad_words``, ``allowed_token_ids``,
``thinking_token_budget`` (into `SamplingParams`) and ``priority`` (into the scheduler), as vLLM's server takes
them (top-level body fields; the official ``openai`` client sends them through ``extra_body``).

Each bad value is a 400 naming its field. ``priority`` follows vLLM's sign: a lower value is served earlier
(the scheduler's key, engine/scheduler.py; waiting requests age, so none starves); the server bounds it to
``[-MAX_PRIORITY, MAX_PRIORITY]`` so that one client cannot set a key no aging can reach.
"""
from __future__ import annotations



class FieldError(ValueError):
    """A bad value of one field (parsing.py turns it into OpenAI's 400 with ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def bad_param(param: str, message: str) -> FieldError:
    return FieldError(param, message)

MAX_PRIORITY = 1000                 # aging gains 1 per --aging-steps (64) steps: 64k steps at most behind one
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
FIELDS = ("min_tokens", "bad_words", "allowed_token_ids", "thinking_token_budget")


def _int_field(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad_param(name, f"{name} must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        raise bad_param(name, f"{name} must be {'at least ' + str(lo) if hi is None else f'in [{lo}, {hi}]'}, "
                              f"got {v}")
    return v


def parse_sampling_fields(body: dict, vocab_size: int) -> dict:
    """The SamplingParams keywords of the four fields (only those given)."""
    out = {}
    min_tokens = _int_field(body, "min_tokens", 0)
    if min_tokens is not None:
        cap = body.get("max_completion_tokens", body.get("max_tokens"))
        if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1 and min_tokens > cap:
            raise bad_param("min_tokens", f"min_tokens ({min_tokens}) must be less than or equal to "
                                          f"max_tokens ({cap})")
        out["min_tokens"] = min_tokens
    words = body.get("bad_words")
    if words is not None:
        if isinstance(words, str):
            words = [words]
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise bad_param("bad_words", "bad_words must be a string or a list of strings")
        if len(words) > MAX_BAD_WORDS:
            raise bad_param("bad_words", f"bad_words may hold at most {MAX_BAD_WORDS} words, got {len(words)}")
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
    budget = _int_field(body, "thinking_token_budget", 0)
    if budget is not None:
        out["thinking_token_budget"] = budget
    return out


def parse_priority(body: dict) -> int:
    """The request's scheduling priority (0 when absent; lower is served earlier)."""
    v = _int_field(body, "priority", -MAX_PRIORITY, MAX_PRIORITY)
    return 0 if v is None else v
