"""S19 Response and chunk shaping, the OpenAI wire format out: engine results -> chat / completion bodies, choices,
stream chunks and deltas, logprobs, tool-call messages.

Layer 3 of the server (errors -> request parsing -> response shaping -> serving -> app): plain functions over
values, no engine and no asyncio; it imports request parsing (`token_text`) and nothing above. The streams that
put these chunks on the wire are serving's (serving.py, responses.py); the SSE framing is streaming.py's.
"""
from __future__ import annotations

import math
import time
import uuid

from pyengine.server.parsing import token_text


# --- ids, times, usage -----------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return {"chat": "chatcmpl-", "responses": "resp-"}.get(kind, "cmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage object; with `reasoning_tokens` (chat completions) its ``completion_tokens_details``."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def _lp_value(v) -> float:
    """An engine logprob entry may be a float or an object with `.logprob` (vLLM's Logprob)."""
    return float(getattr(v, "logprob", v))


def split_logprob_entry(entry, token_id: int) -> tuple[float, list[tuple[int, float]]]:
    """One generated token's logprob record -> (sampled token's logprob, top alternatives best first).

    Accepted shapes: {token_id: logprob-or-Logprob} (vLLM: sampled token plus the top-k), or a dict
    with keys "logprob" and "top_logprobs" / "top" (a list of (id, logprob) or {id: logprob})."""
    if isinstance(entry, dict) and "logprob" in entry:
        top = entry.get("top_logprobs", entry.get("top")) or []
        if isinstance(top, dict):
            top = list(top.items())
        pairs = [(int(i), _lp_value(v)) for i, v in top]
        return _lp_value(entry["logprob"]), sorted(pairs, key=lambda p: -p[1])
    if isinstance(entry, dict):
        pairs = [(int(i), _lp_value(v)) for i, v in entry.items()]
        ranked = sorted(pairs, key=lambda p: -p[1])
        sampled = dict(pairs).get(int(token_id), float("nan"))
        return sampled, ranked
    if isinstance(entry, (tuple, list)) and len(entry) == 2:
        return _lp_value(entry[0]), sorted([(int(i), _lp_value(v)) for i, v in entry[1]], key=lambda p: -p[1])
    return _lp_value(entry), []


def _safe_lp(x: float) -> float:
    # JSON has no -inf; OpenAI clamps to a very negative number.
    return x if math.isfinite(x) else -9999.0


def chat_logprobs(tokenizer, token_ids: list[int], entries: list, k: int) -> dict:
    content = []
    for tid, entry in zip(token_ids, entries):
        lp, top = split_logprob_entry(entry, tid)
        tok, raw = token_text(tokenizer, tid)
        alts = []
        for aid, alp in top[:k]:
            atok, araw = token_text(tokenizer, aid)
            alts.append({"token": atok, "logprob": _safe_lp(alp), "bytes": araw})
        content.append({"token": tok, "logprob": _safe_lp(lp), "bytes": raw, "top_logprobs": alts})
    return {"content": content}


def completion_logprobs(tokenizer, token_ids: list[int], entries: list, k: int, text_offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = text_offset
    for tid, entry in zip(token_ids, entries):
        lp, top = split_logprob_entry(entry, tid)
        tok, _ = token_text(tokenizer, tid)
        tokens.append(tok)
        token_lps.append(_safe_lp(lp))
        alts: dict[str, float] = {}
        for aid, alp in top[:k]:
            alts.setdefault(token_text(tokenizer, aid)[0], _safe_lp(alp))
        if not k:   # logprobs=0: the sampled token alone (as vLLM does)
            alts[tok] = _safe_lp(lp)
        tops.append(alts)
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_response(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": None, "choices": choices, "usage": use}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk(rid: str, created: int, model: str, choices: list[dict], with_usage: bool) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "system_fingerprint": None, "choices": choices}
    if with_usage:
        out["usage"] = None
    return out


def chat_delta(index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": None, "choices": choices, "usage": use}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_chunk(rid: str, created: int, model: str, choices: list[dict], with_usage: bool) -> dict:
    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "system_fingerprint": None, "choices": choices}
    if with_usage:
        out["usage"] = None
    return out


def openai_finish_reason(reason: str | None) -> str | None:
    # The engine's "abort" only reaches a client on shutdown; OpenAI has no such value, "stop" is closest.
    return {"abort": "stop"}.get(reason, reason)


def tool_message(plan, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """(the choice's message, finish_reason) of a non-streamed reply to a request with tools (`plan`: its
    constraints.ToolPlan): a reply that spells a call becomes ``tool_calls`` with finish_reason "tool_calls"."""
    calls = plan.calls(text) if finish_reason == "stop" else None
    if calls is None:
        return {"role": "assistant", "content": text, "refusal": None}, finish_reason
    return {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls}, "tool_calls"
