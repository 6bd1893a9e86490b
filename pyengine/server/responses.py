"""OpenAI's Responses API, `POST /v1/responses` (S19), stateless, on the chat pipeline.

A Responses body is read into a chat body (`chat_body`) and runs exactly as `/v1/chat/completions` does
(template, limits, structured output, tools, reasoning); its result is shaped as a `response` object:

    input (a string, or items: messages with input_text / output_text parts, function_call and
    function_call_output items)      -> messages; `instructions` -> a system message first
    max_output_tokens                -> max_tokens;  temperature, top_p, parallel_tool_calls, user: as in chat
    text.format {"type": "json_schema", "name", "schema", "strict"} | {"type": "json_object"} -> response_format
    tools [{"type": "function", "name", "parameters", ...}], tool_choice -> chat tools / tool_choice
    output: a "reasoning" item (a thinking model's <think> part), a "message" item with one output_text part,
            or "function_call" items;  status "completed", or "incomplete" (reason max_output_tokens)

Streaming sends the Responses events the official client assembles: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta ..., response.output_text.done,
response.content_part.done, response.output_item.done, response.completed.

Nothing is stored: `previous_response_id` and `background` are refused with a 400 that says to send the
conversation in `input`; `store` is accepted and has no effect (there is no GET /v1/responses/{id}).

Serving layer of the server (errors -> request parsing -> response shaping -> serving -> app), after serving.py:
it imports errors, reasoning and serving, never app.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from pyengine.server.errors import APIError, bad_param
from pyengine.server.reasoning import ThinkSplitter
from pyengine.server.serving import failure_error

_PASS = ("temperature", "top_p", "parallel_tool_calls", "user", "seed", "top_k", "min_p", "stream",
         "repetition_penalty", "include_reasoning", "chat_template_kwargs", "min_tokens", "bad_words",
         "allowed_token_ids", "thinking_token_budget", "priority")
_IGNORED = ("store", "metadata", "include", "truncation", "service_tier", "prompt_cache_key", "safety_identifier",
            "reasoning")


# chat fields -> the Responses fields they came from (for error messages' `param`)
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def _bad(param: str, message: str) -> APIError:
    return bad_param(param, message)


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("input", f"{where}.content must be a string or a list of parts")
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad("input", f"{where}.content[{j}] of type {kind!r} is not supported (text parts only)")
        if not isinstance(part.get("text"), str):
            raise _bad("input", f"{where}.content[{j}].text must be a string")
        out.append(part["text"])
    return "".join(out)


def _messages(body: dict) -> list[dict]:
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions", "instructions must be a string")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("input", "input must be a string or a non-empty list of items")
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise _bad("input", f"{where} must be an object")
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad("input", f"{where}.role must be user, assistant, system or developer")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(it.get("content"), where)})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(it.get(key), str):
                    raise _bad("input", f"{where}.{key} must be a string")
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str) or not isinstance(it.get("output"), str):
                raise _bad("input", f"{where} needs call_id and output strings")
            messages.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
        elif kind == "reasoning":
            continue                       # a previous turn's thinking: the templates drop it, so do we
        else:
            raise _bad("input", f"{where} has type {kind!r}; supported: message, function_call, "
                       "function_call_output, reasoning")
    return messages


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "tools must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad("tools", f"tools[{i}] of type {kind!r} is not supported (function tools only)")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value):
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise _bad("tool_choice", "tool_choice must be auto, none, required or {\"type\": \"function\", \"name\"}")


def _response_format(body: dict):
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("text", "text must be an object")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format", "text.format must be an object")
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    raise _bad("text.format", f"text.format type {fmt.get('type')!r} is not supported "
               "(text, json_object, json_schema)")


def chat_body(body: dict) -> dict:
    """A Responses request as the chat request it runs as (APIError 400 naming the field when it cannot)."""
    if body.get("previous_response_id") is not None:
        raise _bad("previous_response_id", "this server stores no responses: send the whole conversation in "
                   "`input` (earlier messages, function_call and function_call_output items)")
    if body.get("background"):
        raise _bad("background", "background responses are not supported (nothing is stored)")
    if body.get("conversation") is not None:
        raise _bad("conversation", "conversations are not stored by this server: send the messages in `input`")
    for name in ("top_logprobs", "prompt"):
        if body.get(name):
            raise _bad(name, f"{name} is not supported on /v1/responses")
    out = {"messages": _messages(body)}
    if body.get("model") is not None:
        out["model"] = body["model"]
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    for name in _PASS:
        if body.get(name) is not None:
            out[name] = body[name]
    tools = _tools(body)
    if tools:
        out["tools"] = tools
        if body.get("tool_choice") is not None:
            out["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _response_format(body)
    if fmt is not None:
        out["response_format"] = fmt
    return out


def _usage(gen, ids: list[int]) -> dict:
    """``ids``: the output's token ids (a thinking model's reasoning tokens are counted from them)."""
    p, thought = gen.parsed, 0
    if p.reasoning is not None:
        thought = p.reasoning.count_reasoning_tokens(gen.loop.engine.get_tokenizer().decode, ids, p.reasoning_open)
    return {"input_tokens": gen.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": gen.completion_tokens, "output_tokens_details": {"reasoning_tokens": thought},
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}


class _Shape:
    """The response object's fixed fields, echoed from the request as OpenAI does."""

    def __init__(self, rid: str, created: int, model: str, body: dict):
        self.rid, self.created, self.model, self.body = rid, created, model, body

    def response(self, status: str, output: list, usage: dict | None, incomplete: str | None = None) -> dict:
        b = self.body
        fmt = (b.get("text") or {}).get("format") if isinstance(b.get("text"), dict) else None
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "usage": usage, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
                "temperature": b.get("temperature"), "top_p": b.get("top_p"),
                "parallel_tool_calls": b.get("parallel_tool_calls", True),
                "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
                "text": {"format": fmt or {"type": "text"}}, "metadata": b.get("metadata") or {},
                "previous_response_id": None, "reasoning": None, "store": False, "truncation": "disabled",
                "user": b.get("user")}


def _items(p, text: str, reason: str | None) -> tuple[list[dict], str | None]:
    """The output items of one finished choice, and the incomplete reason (None when completed)."""
    items = []
    if p.reasoning is not None:
        reasoning, text = p.reasoning.split(text, p.reasoning_open)
        if reasoning and p.include_reasoning:
            items.append({"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
                          "content": [{"type": "reasoning_text", "text": reasoning}], "status": "completed"})
    calls = p.tool_plan.calls(text) if (p.tool_plan is not None and reason == "stop") else None
    if calls:
        for call in calls:
            items.append({"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call["id"],
                          "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                          "status": "completed"})
    else:
        items.append(_message(text, "completed" if reason != "length" else "incomplete"))
    return items, ("max_output_tokens" if reason == "length" else None)


def _message(text: str, status: str, mid: str | None = None) -> dict:
    return {"type": "message", "id": mid or "msg_" + uuid.uuid4().hex, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


async def collect(gen, model_id: str, created: int, body: dict) -> dict:
    ids: list[int] = []
    async for u in gen.updates():
        ids += u.token_ids
    err = failure_error(gen)
    if err is not None:
        raise err
    items, incomplete = _items(gen.parsed, gen.texts[0], gen.finish[0])
    shape = _Shape("resp_" + gen.api_id.split("-", 1)[-1], created, model_id, body)
    return shape.response("incomplete" if incomplete else "completed", items, _usage(gen, ids), incomplete)


class _Events:
    """One streamed response's SSE events, numbered, and its output items in the order (= output_index) the
    client was told of them."""

    def __init__(self, shape: "_Shape"):
        self.shape, self.seq = shape, -1
        self.placed: list[dict] = []
        self.message: dict | None = None           # the streamed message item
        self.reasoning_id = "rs_" + uuid.uuid4().hex

    def event(self, kind: str, **fields) -> bytes:
        self.seq += 1
        data = json.dumps({"type": kind, "sequence_number": self.seq, **fields}, separators=(",", ":"),
                          ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def whole(self, item: dict) -> list[bytes]:
        """An item sent whole (a reasoning item, a tool call)."""
        self.placed.append(item)
        i = len(self.placed) - 1
        return [self.event("response.output_item.added", output_index=i, item=item),
                self.event("response.output_item.done", output_index=i, item=item)]

    def reasoning(self, text: str) -> list[bytes]:
        return self.whole({"type": "reasoning", "id": self.reasoning_id, "summary": [],
                           "content": [{"type": "reasoning_text", "text": text}], "status": "completed"})

    def text(self, delta: str) -> list[bytes]:
        """Answer text; the message item opens with its first visible text."""
        out = []
        if self.message is None:
            self.message = _message("", "in_progress")
            self.message["content"] = []
            self.placed.append(self.message)
            out += [self.event("response.output_item.added", output_index=len(self.placed) - 1, item=self.message),
                    self.event("response.content_part.added", item_id=self.message["id"],
                               output_index=len(self.placed) - 1, content_index=0,
                               part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]
        out.append(self.event("response.output_text.delta", item_id=self.message["id"],
                              output_index=self.placed.index(self.message), content_index=0, delta=delta, logprobs=[]))
        return out

    def finish(self, items: list[dict]) -> list[bytes]:
        """The final items: the streamed message closed with its whole text, the others sent whole."""
        out = []
        for item in items:
            if item["type"] == "reasoning" and self.placed and self.placed[0]["id"] == self.reasoning_id:
                continue                      # sent already, whole
            if item["type"] == "message" and self.message is not None:
                index = self.placed.index(self.message)
                item["id"] = self.message["id"]
                self.placed[index] = item
                out += [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=item["content"][0]["text"], logprobs=[]),
                        self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=item["content"][0]),
                        self.event("response.output_item.done", output_index=index, item=item)]
                continue
            if item["type"] == "reasoning":
                item["id"] = self.reasoning_id
            out += self.whole(item)
        return out


async def stream(gen, model_id: str, created: int, body: dict) -> AsyncIterator[bytes]:
    """Responses SSE events. Text streams as it is decided; a thinking model's reasoning item is sent whole when
    its answer starts; with tools the items are sent when the choice finishes (a reply is a call only once whole)."""
    p = gen.parsed
    ev = _Events(_Shape("resp_" + gen.api_id.split("-", 1)[-1], created, model_id, body))
    yield ev.event("response.created", response=ev.shape.response("in_progress", [], None))
    yield ev.event("response.in_progress", response=ev.shape.response("in_progress", [], None))
    splitter = ThinkSplitter(p.reasoning, p.reasoning_open) if p.reasoning is not None else None
    thought = ""
    async for u in gen.updates():
        if p.tool_plan is not None or not u.delta:
            continue
        delta = u.delta
        if splitter is not None:
            r, delta = splitter.push(delta)
            thought += r
            if not delta:
                continue
            if thought and p.include_reasoning and not ev.placed:      # the reasoning ended: send it whole
                for e in ev.reasoning(thought):
                    yield e
        for e in ev.text(delta):
            yield e
    err = failure_error(gen)
    if err is not None:
        yield ev.event("error", code=err.code or "server_error", message=err.message, param=None)
        return
    items, incomplete = _items(p, gen.texts[0], gen.finish[0])
    for e in ev.finish(items):
        yield e
    final = ev.shape.response("incomplete" if incomplete else "completed", ev.placed, _usage(gen, gen.token_ids[0]),
                              incomplete)
    yield ev.event("response.incomplete" if incomplete else "response.completed", response=final)
