"""S19 Serving: one API request as engine requests: choices, per-token updates, OpenAI bodies and streams.

Layer 4 of the server (errors -> request parsing -> response shaping -> serving -> app): it imports errors,
parsing (`ParsedRequest`), shaping, streaming (SSE framing) and engine_loop, never app.

A request with P prompts (completions may send several) becomes P engine requests `<api id>-<p>`, each
with the client's n (the engine runs n sequences sharing the prompt's KV blocks). Choice numbers follow
OpenAI: choice = p * n + i. All report to one asyncio.Queue; `Generation` turns their cumulative
`RequestOutput`s into per-choice updates (new text, new token ids, new logprobs), times them for the
metrics, and aborts whatever still runs when it is closed early.

`Admission` bounds what waits for the engine by sequences (a request with n=8 is 8) and prompt tokens,
not by requests: a request is waiting from its acceptance until its first output (its prefill is done).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pyengine.server import prompt_logprobs as PL
from pyengine.server import shaping as fmt
from pyengine.server.constraints import ToolPlan
from pyengine.server.engine_loop import Aborted, EngineFailure, EngineLoop, EngineUnavailable
from pyengine.server.errors import (APIError, aborted, engine_failed, engine_unavailable, overloaded,
                                    param_named_in)
from pyengine.server.parsing import ParsedRequest
from pyengine.server.reasoning import ThinkSplitter
from pyengine.server.sampling_fields import FIELDS as TOKEN_FIELDS
from pyengine.server.streaming import DONE, sse

log = logging.getLogger("pyengine.server")


def is_overloaded(exc: BaseException) -> bool:
    """The engine's EngineOverloaded (bounded waiting queue full), recognised by name so the server
    does not import the engine module just to catch it."""
    return any(c.__name__ == "EngineOverloaded" for c in type(exc).__mro__)


def is_unavailable(exc: BaseException) -> bool:
    """S17: the engine lost a parallel rank (its ParallelError, recognised by name, or EngineUnavailable)."""
    return isinstance(exc, EngineUnavailable) or any(c.__name__ == "ParallelError" for c in type(exc).__mro__)


def engine_error(exc: Exception) -> APIError:
    if is_unavailable(exc):
        return engine_unavailable(exc)
    if is_overloaded(exc):
        return overloaded(str(exc))
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), param=param_named_in(str(exc), ("prompt", "max_tokens", "logit_bias",
                                                                        "stop_token_ids", "logprobs")
                                                            + TOKEN_FIELDS))
    log.error("engine refused a request: %r", exc)
    return engine_failed()


class Admission:
    """The waiting budget: sequences and prompt tokens accepted but not yet started by the engine.
    A request that alone exceeds a bound is still admitted into an empty queue (it could never run
    otherwise); `max_tokens_per_request` and the context bound its size instead."""

    def __init__(self, max_seqs: int, max_tokens: int):
        self.max_seqs, self.max_tokens = max_seqs, max_tokens
        self.seqs = self.tokens = 0
        self._held: dict[str, tuple[int, int]] = {}

    def admit(self, request_id: str, seqs: int, tokens: int) -> None:
        if self._held and (self.seqs + seqs > self.max_seqs or self.tokens + tokens > self.max_tokens):
            raise overloaded(f"{self.seqs} sequences with {self.tokens} prompt tokens are waiting (limits: "
                             f"{self.max_seqs} sequences, --max-waiting; {self.max_tokens} tokens, "
                             f"--max-waiting-tokens); this request adds {seqs} and {tokens}")
        self._held[request_id] = (seqs, tokens)
        self.seqs += seqs
        self.tokens += tokens

    def release(self, request_id: str) -> None:
        seqs, tokens = self._held.pop(request_id, (0, 0))
        self.seqs -= seqs
        self.tokens -= tokens


@dataclass
class Update:
    choice: int
    delta: str
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None


class Generation:
    def __init__(self, loop: EngineLoop, metrics, parsed: ParsedRequest, api_id: str, arrival: float,
                 admission: Admission | None = None):
        self.loop, self.metrics, self.parsed, self.api_id, self.arrival = loop, metrics, parsed, api_id, arrival
        self.admission = admission or Admission(1 << 62, 1 << 62)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt_of = {f"{api_id}-{p}": p for p in range(len(parsed.prompts))}
        self.pending: set[str] = set()
        n_choices = len(parsed.prompts) * parsed.n
        self.tokens = [0] * n_choices          # tokens seen per choice
        self.texts = [""] * n_choices          # cumulative text per choice
        self.token_ids: list[list[int]] = [[] for _ in range(n_choices)]   # cumulative token ids per choice
        self.finish: list[str | None] = [None] * n_choices
        self.last_token_at = [0.0] * n_choices
        self.first_token_at: float | None = None
        self.failure: BaseException | None = None
        self.abort_reason: str | None = None   # why the engine dropped it (disconnect, shutdown)
        self.prompt_logprobs: dict[int, list] = {}   # prompt -> its prompt logprobs (server/prompt_logprobs.py)
        self.closed = False

    @property
    def n_choices(self) -> int:
        return len(self.tokens)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.parsed.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(self.tokens)

    def reasoning_tokens(self, tokenizer) -> int:
        """Output tokens spent thinking, summed over the choices (vLLM's count: the tags not included)."""
        p = self.parsed
        if p.reasoning is None:
            return 0
        return sum(p.reasoning.count_reasoning_tokens(tokenizer.decode, ids, p.reasoning_open)
                   for ids in self.token_ids)

    def usage(self, tokenizer) -> dict:
        """The body's ``usage``; chat's carries ``completion_tokens_details.reasoning_tokens`` as OpenAI's does."""
        if self.parsed.kind != "chat":
            return fmt.usage(self.prompt_tokens, self.completion_tokens)
        return fmt.usage(self.prompt_tokens, self.completion_tokens, self.reasoning_tokens(tokenizer))

    async def start(self) -> None:
        """Add every prompt to the engine; on any refusal, withdraw the ones already added."""
        n = self.parsed.n
        try:
            for rid, p in self.prompt_of.items():
                ids = self.parsed.prompts[p]
                self.admission.admit(rid, n, n * len(ids))
                self.pending.add(rid)
                await self.loop.add_request(rid, {"prompt_token_ids": ids}, self.parsed.params, self.queue,
                                            priority=self.parsed.priority)
        except Exception as exc:
            self.abort()
            self.closed = True
            raise exc if isinstance(exc, APIError) else engine_error(exc) from exc

    def abort(self) -> None:
        for rid in list(self.pending):
            self.loop.abort(rid)
            self.admission.release(rid)

    async def updates(self) -> AsyncIterator[Update]:
        n = self.parsed.n
        while self.pending:
            item = await self.queue.get()
            rid = item.request_id
            if rid not in self.pending:
                continue
            self.admission.release(rid)   # it has run (or ended): no longer waiting
            p = self.prompt_of[rid]
            if isinstance(item, (Aborted, EngineFailure)):
                self.pending.discard(rid)
                for c in range(p * n, p * n + n):
                    self.finish[c] = self.finish[c] or "abort"
                if isinstance(item, EngineFailure):
                    self.failure = item.exc
                else:
                    self.abort_reason = item.reason
                continue
            if item.finished:
                self.pending.discard(rid)
            if item.prompt_logprobs is not None:
                self.prompt_logprobs[p] = item.prompt_logprobs
            for comp in item.outputs:
                c = p * n + comp.index
                if self.finish[c] is not None:
                    continue
                new_ids = list(comp.token_ids[self.tokens[c]:])
                delta = comp.delta_text                 # CompletionOutput: the text this step released
                if not new_ids and not delta and comp.finish_reason is None:
                    continue  # a sibling choice moved, not this one
                self.texts[c] += delta
                lps = None
                if self.parsed.logprobs is not None and comp.logprobs is not None:
                    lps = list(comp.logprobs[self.tokens[c]:self.tokens[c] + len(new_ids)])
                if new_ids:
                    self._time_tokens(c, len(new_ids))
                self.tokens[c] += len(new_ids)
                self.token_ids[c] += new_ids
                reason = comp.finish_reason or ("stop" if item.finished else None)
                self.finish[c] = reason
                yield Update(c, delta, new_ids, lps, reason)

    def _time_tokens(self, c: int, count: int) -> None:
        # TTFT is per request (its first token of any choice); ITL per choice, spread over the tokens
        # that arrived together.
        t = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = t
            if self.metrics:
                self.metrics.observe_ttft(t - self.arrival)
        elif self.last_token_at[c] and self.metrics:
            gap = (t - self.last_token_at[c]) / count
            for _ in range(count):
                self.metrics.observe_itl(gap)
        self.last_token_at[c] = t

    def close(self) -> None:
        """Abort what still runs and account the request in the metrics (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.abort()
        if not self.metrics:
            return
        m = self.metrics
        normal = self.failure is None and all(r not in (None, "abort") for r in self.finish)
        m.observe_finished(time.perf_counter() - self.arrival if normal else None, self.prompt_tokens,
                           self.completion_tokens, [reason or "abort" for reason in self.finish])
        if self.failure is not None:     # the status the client saw (503 for a lost MPI rank, else 500)
            m.errors.labels(status=str(failure_error(self).status)).inc()


def failure_error(gen: Generation) -> APIError | None:
    """Why a generation ended without finishing, as an API error (None if it finished)."""
    if gen.failure is not None and is_unavailable(gen.failure):
        return engine_unavailable(gen.failure)
    if gen.failure is not None:
        return engine_failed()
    if gen.abort_reason is not None:
        return aborted(gen.abort_reason)
    return None


# --- non-streaming ---------------------------------------------------------------------------------
async def collect(gen: Generation, tokenizer, model_id: str, created: int) -> dict:
    p = gen.parsed
    ids: list[list[int]] = [[] for _ in range(gen.n_choices)]
    lps: list[list] = [[] for _ in range(gen.n_choices)]
    async for u in gen.updates():
        ids[u.choice] += u.token_ids
        if u.logprobs:
            lps[u.choice] += u.logprobs
    err = failure_error(gen)
    if err is not None:
        raise err
    use = gen.usage(tokenizer)
    choices = []
    for c in range(gen.n_choices):
        reason = fmt.openai_finish_reason(gen.finish[c])
        if p.kind == "chat":
            lp = fmt.chat_logprobs(tokenizer, ids[c], lps[c], p.logprobs) if p.logprobs is not None else None
            reasoning, text = None, gen.texts[c]
            if p.reasoning is not None:     # a thinking model: its <think> part is not the answer
                reasoning, text = p.reasoning.split(text, p.reasoning_open)
            choices.append(fmt.chat_choice(c, text, reason, lp))
            if p.tool_plan is not None:     # S15: a reply that is a call becomes tool_calls
                choices[-1]["message"], choices[-1]["finish_reason"] = fmt.tool_message(p.tool_plan, text, reason)
            if reasoning is not None and p.include_reasoning:
                choices[-1]["message"]["reasoning_content"] = reasoning
        else:
            prefix = p.prompt_texts[c // p.n] if p.echo else ""
            lp = (fmt.completion_logprobs(tokenizer, ids[c], lps[c], p.logprobs, len(prefix))
                  if p.logprobs is not None else None)
            if p.echo and lp is not None:      # the prompt's logprobs first (S19)
                lp = PL.joined(PL.echo_logprobs(tokenizer, p.prompts[c // p.n], gen.prompt_logprobs.get(c // p.n),
                                                p.logprobs), lp)
            choices.append(fmt.completion_choice(c, prefix + gen.texts[c], reason, lp))
    build = fmt.chat_response if p.kind == "chat" else fmt.completion_response
    return PL.decorate(build(gen.api_id, created, model_id, choices, use), p, gen.prompt_logprobs, tokenizer)


# --- streaming -------------------------------------------------------------------------------------
async def stream(gen: Generation, tokenizer, model_id: str, created: int) -> AsyncIterator[bytes]:
    """SSE events: one chunk per update that carries text or logprobs, a finish chunk per choice,
    optionally a usage chunk, then [DONE]."""
    p = gen.parsed
    chat = p.kind == "chat"
    if chat and p.tool_plan is not None:     # S15: tool calls stream as delta.tool_calls
        async for event in stream_tool_calls(gen, tokenizer, model_id, created):
            yield event
        return
    chunk = fmt.chat_chunk if chat else fmt.completion_chunk

    def event(choices: list[dict]) -> bytes:
        return sse(chunk(gen.api_id, created, model_id, choices, p.include_usage))

    splitters, offsets = None, [0] * gen.n_choices
    if chat:
        for c in range(gen.n_choices):
            yield event([fmt.chat_delta(c, {"role": "assistant", "content": ""})])
        if p.reasoning is not None:
            splitters = [ThinkSplitter(p.reasoning, p.reasoning_open) for _ in range(gen.n_choices)]
    elif p.echo:
        for c in range(gen.n_choices):
            offsets[c] = len(p.prompt_texts[c // p.n])
            if p.logprobs is None:
                yield event([fmt.completion_choice(c, p.prompt_texts[c // p.n], None, None)])
    echo_due = set(range(gen.n_choices)) if p.echo and p.logprobs is not None and not chat else set()
    async for u in gen.updates():
        if u.choice in echo_due:               # S19: the echoed prompt with its logprobs, known after its prefill
            echo_due.discard(u.choice)
            q = u.choice // p.n
            yield event([fmt.completion_choice(u.choice, p.prompt_texts[q], None, PL.echo_logprobs(
                tokenizer, p.prompts[q], gen.prompt_logprobs.get(q), p.logprobs))])
        reason = fmt.openai_finish_reason(u.finish_reason)
        if not (u.delta or u.logprobs or reason):
            continue
        if chat:
            choice = chat_stream_choice(p, tokenizer, u, reason, splitters and splitters[u.choice])
        else:
            lp = (fmt.completion_logprobs(tokenizer, u.token_ids, u.logprobs, p.logprobs, offsets[u.choice])
                  if u.logprobs else None)
            offsets[u.choice] += len(u.delta)
            choice = fmt.completion_choice(u.choice, u.delta, reason, lp)
        if choice is not None:
            yield event([choice])
    for end in stream_end(gen, tokenizer, chunk, model_id, created):
        yield end


def chat_stream_choice(p: ParsedRequest, tokenizer, u: Update, reason: str | None,
                       splitter: ThinkSplitter | None) -> dict | None:
    """One update of a chat stream as its choice delta (None: nothing to send); with a thinking model's
    `splitter`, reasoning and answer as separate delta fields."""
    lp = fmt.chat_logprobs(tokenizer, u.token_ids, u.logprobs or [], p.logprobs) if u.logprobs else None
    if splitter is None:
        return fmt.chat_delta(u.choice, {"content": u.delta} if u.delta or not reason else {}, reason, lp)
    r, a = splitter.push(u.delta)
    if reason:
        r2, a2 = splitter.flush()
        r, a = r + r2, a + a2
    delta = {**({"reasoning_content": r} if r and p.include_reasoning else {}), **({"content": a} if a else {})}
    return fmt.chat_delta(u.choice, delta, reason, lp) if delta or lp or reason else None


def stream_end(gen: Generation, tokenizer, chunk, model_id: str, created: int):
    """A stream's last events: why it failed (the client is gone if it disconnected; otherwise it learns why it
    ended), else the usage chunk when ``stream_options.include_usage`` asked for it; then [DONE]."""
    err = failure_error(gen)
    if err is not None:
        yield sse(err.body())
    elif gen.parsed.include_usage:
        final = chunk(gen.api_id, created, model_id, [], False)
        final["usage"] = gen.usage(tokenizer)
        yield sse(final)
    yield DONE


async def stream_tool_calls(gen, tokenizer, model_id: str, created: int):
    """SSE events of a chat request with a tool plan: with a named function the arguments stream as they are
    generated; with required / auto the calls are sent once the reply is complete (only then is it known to be a
    call), as ``delta.tool_calls`` chunks the official client assembles."""
    p = gen.parsed
    plan: ToolPlan = p.tool_plan

    def event(choices):
        return sse(fmt.chat_chunk(gen.api_id, created, model_id, choices, p.include_usage))

    for c in range(gen.n_choices):
        yield event([fmt.chat_delta(c, {"role": "assistant", "content": None})])
    ids = {}
    if plan.choice == "named":
        for c in range(gen.n_choices):
            ids[c] = "call_" + uuid.uuid4().hex[:24]
            yield event([fmt.chat_delta(c, {"tool_calls": [{"index": 0, "id": ids[c], "type": "function",
                                                          "function": {"name": plan.named, "arguments": ""}}]})])
    async for u in gen.updates():
        reason = fmt.openai_finish_reason(u.finish_reason)
        if plan.choice == "named":
            if u.delta:
                yield event([fmt.chat_delta(u.choice, {"tool_calls": [{"index": 0, "function": {"arguments": u.delta}}]})])
            if reason:
                yield event([fmt.chat_delta(u.choice, {}, "tool_calls" if reason == "stop" else reason)])
            continue
        if not reason:
            continue
        text = gen.texts[u.choice]
        if p.reasoning is not None:      # a thinking model: the call is read from the answer after </think>
            reasoning, text = p.reasoning.split(text, p.reasoning_open)
            if reasoning and p.include_reasoning:
                yield event([fmt.chat_delta(u.choice, {"reasoning_content": reasoning})])
        calls = plan.calls(text) if reason == "stop" else None
        if calls is None:
            if text:
                yield event([fmt.chat_delta(u.choice, {"content": text})])
            yield event([fmt.chat_delta(u.choice, {}, reason)])
            continue
        for k, call in enumerate(calls):
            yield event([fmt.chat_delta(u.choice, {"tool_calls": [{"index": k, **call}]})])
        yield event([fmt.chat_delta(u.choice, {}, "tool_calls")])
    for end in stream_end(gen, tokenizer, fmt.chat_chunk, model_id, created):
        yield end
