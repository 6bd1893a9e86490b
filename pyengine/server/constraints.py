"""S15 structured output on the wire: ``response_format``, vLLM's ``structured_outputs`` and ``tools``.

Request side (`parse_structured`, `prepare_chat`): the body's constraint becomes the request's
`StructuredOutputsParams`:

    response_format {"type": "json_object"}                      -> any JSON object
    response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object"}   (vLLM's extra body;
                                                                   guided_json & co. are read too)
    tools + tool_choice "required"      -> a JSON array of {"name", "arguments"} calls, one schema per
                                          function (one call at most when parallel_tool_calls is false)
    tools + tool_choice {"type": "function", "function": {"name"}} -> the function's arguments object
    tools + tool_choice "auto"          -> no constraint: the model decides; a reply that is a valid call
                                          ({"name", "arguments"} or a list of them) becomes tool_calls
    tool_choice "none"                  -> tools are not shown and no call is made

SmolLM2's chat template has no notion of tools (it renders role + content only), so the server presents
them itself in the system message, as JSON with the reply format; a model whose template does know tools
would get them the same way (the core's template renderer takes no ``tools=``). Assistant turns that
carried ``tool_calls`` are replayed as that JSON; ``tool`` turns keep their role.

Response side (`ToolPlan.message`, `stream_tool_calls`): the generated JSON becomes OpenAI ``tool_calls``
(ids ``call_<hex>``, arguments as JSON text validated by the grammar) with finish_reason ``tool_calls``.
Streaming sends the calls as ``delta.tool_calls`` chunks the official client assembles: with a named
function the arguments stream as they are generated; with required/auto the calls are sent once the
reply is complete (only then is it known to be a call).
"""
from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import uuid
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

from pyengine.sampling_params import StructuredOutputsParams
from pyengine.structured.automaton import TooAmbiguous
from pyengine.structured.budget import DEFAULT_COMPILE_S, DEFAULT_MAX_STATES, Budget, GrammarTooLarge, GrammarTooSlow
from pyengine.structured.ir import GrammarError
from pyengine.structured.matcher import cached_automaton, compile_automaton, install, spec_key

log = logging.getLogger("pyengine.server")

MAX_TOOLS = 128
_VLLM_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def _bad(param: str, message: str):
    from pyengine.server.parsing import bad_param
    return bad_param(param, message)


@dataclass
class ToolPlan:
    """How the reply of a request with tools is read back."""
    choice: str                                   # "auto" | "required" | "named"
    names: list[str]
    named: str | None = None
    parallel: bool = True
    parameters: dict = field(default_factory=dict)

    def calls(self, text: str) -> list[dict] | None:
        """The tool calls a complete reply spells, or None if it is not a call."""
        if self.choice == "named":
            try:
                json.loads(text)
            except json.JSONDecodeError:
                return None
            return [_call(self.named, text)]
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        items = value if isinstance(value, list) else [value]
        out = []
        for it in items:
            if not (isinstance(it, dict) and set(it) == {"name", "arguments"} and it["name"] in self.names
                    and isinstance(it["arguments"], dict)):
                return None
            if self.choice == "auto" and not _valid(it["arguments"], self.parameters.get(it["name"])):
                return None
            out.append(_call(it["name"], json.dumps(it["arguments"], ensure_ascii=False)))
        if not out or (not self.parallel and len(out) > 1):
            return None
        return out

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the choice's message, finish_reason) for a non-streamed reply."""
        calls = self.calls(text) if finish_reason == "stop" else None
        if calls is None:
            return {"role": "assistant", "content": text, "refusal": None}, finish_reason
        return {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls}, "tool_calls"


def _valid(args: dict, schema) -> bool:
    """For "auto" (no grammar): check a call's arguments with the grammar's own matcher-free test — the
    schema compiled to rules and matched byte by byte."""
    if schema is None:
        return True
    from pyengine.structured.json_schema import dumps
    try:     # compiled (or refused) off the loop by `GrammarCompiler.prepare`: this is a cache hit
        automaton = compile_automaton("json", schema)
    except GrammarError:
        return False
    state = automaton.step(automaton.initial(), dumps(args).encode())
    return bool(state) and automaton.is_accepting(state)


def _call(name: str, arguments: str) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _tools(body: dict) -> tuple[list[dict], dict]:
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise _bad("tools", f"tools must be a non-empty list of at most {MAX_TOOLS} function tools")
    out, params = [], {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise _bad("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise _bad("tools", f"tools[{i}].function.name must be a non-empty string")
        if name in params:
            raise _bad("tools", f"tools[{i}]: function {name!r} is defined twice")
        schema = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(schema, dict):
            raise _bad("tools", f"tools[{i}].function.parameters must be a JSON Schema object")
        params[name] = schema
        out.append({"name": name, "description": fn.get("description", ""), "parameters": schema})
    return out, params


def parse_structured(body: dict, chat: bool) -> tuple[StructuredOutputsParams | None, ToolPlan | None]:
    """The constraint (and, for chat with tools, the tool plan) a request body asks for."""
    found = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise _bad("response_format", "response_format.type must be text, json_object or json_schema")
        if rf["type"] == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
                raise _bad("response_format", "response_format.json_schema must be {name, schema, strict}")
            if "name" in js and not isinstance(js["name"], str):
                raise _bad("response_format", "response_format.json_schema.name must be a string")
            found.append(("response_format", StructuredOutputsParams(json=js.get("schema", {}))))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("structured_outputs", "structured_outputs must be an object")
        known = {"json", "regex", "choice", "grammar", "json_object"}
        extra = set(so) - known - {"whitespace_pattern", "disable_fallback", "disable_any_whitespace",
                                   "disable_additional_properties", "backend"}
        if extra:
            raise _bad("structured_outputs", f"structured_outputs: unknown field {sorted(extra)[0]!r}")
        found.append(("structured_outputs", _so(so, "structured_outputs", {k: so[k] for k in known if k in so})))
    for alias, kind in _VLLM_ALIASES.items():
        if body.get(alias) is not None:
            found.append((alias, _so(body, alias, {kind: body[alias]})))
    plan = None
    if body.get("tools") and chat:
        tools, params = _tools(body)
        names = [t["name"] for t in tools]
        tc = body.get("tool_choice", "auto")
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise _bad("parallel_tool_calls", "parallel_tool_calls must be a boolean")
        if isinstance(tc, dict):
            fn = tc.get("function") if tc.get("type") == "function" else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str) or name not in params:
                raise _bad("tool_choice", f"tool_choice names no function of tools: {tc!r}")
            plan = ToolPlan("named", names, name, parallel, params)
            found.append(("tool_choice", StructuredOutputsParams(json=params[name])))
        elif tc == "required":
            call = [{"type": "object", "properties": {"name": {"const": n}, "arguments": params[n]},
                     "required": ["name", "arguments"], "additionalProperties": False} for n in names]
            schema = {"type": "array", "items": call[0] if len(call) == 1 else {"anyOf": call}, "minItems": 1}
            if not parallel:
                schema["maxItems"] = 1
            plan = ToolPlan("required", names, None, parallel, params)
            found.append(("tool_choice", StructuredOutputsParams(json=schema)))
        elif tc == "auto":
            plan = ToolPlan("auto", names, None, parallel, params)
        elif tc != "none":
            raise _bad("tool_choice", "tool_choice must be none, auto, required or {\"type\": \"function\", ...}")
    elif body.get("tool_choice") not in (None, "none", "auto") and not body.get("tools"):
        raise _bad("tool_choice", "tool_choice needs tools")
    if len(found) > 1:
        raise _bad(found[1][0], f"{found[0][0]} and {found[1][0]} both constrain the output: send one")
    return (found[0][1] if found else None), plan


def _so(holder: dict, param: str, fields: dict) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except (TypeError, ValueError) as e:
        raise _bad(param, str(e)) from None


def prepare_chat(body: dict, plan: ToolPlan | None) -> dict:
    """The body with tools presented in the system message and past tool calls replayed as JSON text."""
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return body
    out = []
    for m in msgs:
        if isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            if not isinstance(m["tool_calls"], list):
                raise _bad("messages", "an assistant message's tool_calls must be a list")
            for c in m["tool_calls"]:
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                        or not isinstance(fn.get("arguments", ""), (str, dict)):
                    raise _bad("messages", "each tool_calls entry must be {\"type\": \"function\", \"function\": "
                                           "{\"name\": <string>, \"arguments\": <JSON text>}}")
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except (TypeError, ValueError, RecursionError):
                    args = fn.get("arguments")
                calls.append({"name": fn.get("name"), "arguments": args})
            m = {"role": "assistant", "content": json.dumps(calls if len(calls) > 1 else calls[0])}
        out.append(m)
    if plan is not None:
        tools = [{"name": n, "parameters": plan.parameters[n]} for n in plan.names]
        for t, src in zip(tools, body.get("tools", [])):
            t["description"] = src.get("function", {}).get("description", "")
        if plan.choice == "named":
            how = f"Reply with the JSON arguments of a call to {plan.named}."
        else:
            how = ('To call a function, reply with JSON only: {"name": <function name>, "arguments": {...}}'
                   + (" (or a list of such calls)" if plan.parallel else "") + ".")
        text = "You can call these functions:\n" + json.dumps(tools, ensure_ascii=False) + "\n" + how
        if out and isinstance(out[0], dict) and out[0].get("role") in ("system", "developer") \
                and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return {**body, "messages": out}


# --- compilation off the serving loop --------------------------------------------------------------
GRAMMAR_FIELDS = ("response_format", "structured_outputs", *_VLLM_ALIASES, "tool_choice", "tools")
HARD_KILL_GRACE_S = 2.0      # past its budget plus this, a compile the budget checks missed is killed


def _compile_job(kind: str, spec, seconds: float, max_states: int):
    """In the compile worker: ("ok", automaton) or ("refused", error class name, message, keyword)."""
    try:
        return "ok", compile_automaton(kind, spec, Budget(seconds, max_states))
    except GrammarError as e:
        return "refused", type(e).__name__, str(e), e.keyword


WORKER_NICE = 10     # the compile worker yields the CPU to the engine's step on a busy host


def _worker_init(parent: int) -> None:
    import signal

    from pyengine.server.tokenizer_process import _exit_with_parent
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
        loop = asyncio.get_running_loop()
        pool = None if self.mode == "thread" else self._executor()
        fut = loop.run_in_executor(pool, _compile_job, kind, spec, self.max_compile_s, self.max_states)
        try:
            return await asyncio.wait_for(fut, self.max_compile_s + HARD_KILL_GRACE_S)
        except asyncio.TimeoutError:
            if self.mode == "process":
                self._kill()
            return "refused", "GrammarTooSlow", GrammarTooSlow.message(self.max_compile_s), None
        except BrokenProcessPool:
            self._pool = None
            return "refused", "GrammarError", "the grammar compiler failed on this grammar", None

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

    async def prepare(self, parsed, body: dict) -> None:
        """Compile the grammars a parsed request needs; a refusal is a 400 naming the request's field."""
        so = getattr(parsed.params, "structured_outputs", None)
        plan = getattr(parsed, "tool_plan", None)
        if so is not None:
            try:
                await self.compile(*so.request)
            except GrammarError as e:
                raise _bad(grammar_field(body), str(e)) from None
        if plan is not None and plan.choice == "auto":
            for schema in plan.parameters.values():     # read back by ToolPlan.calls: compile them here
                try:
                    await self.compile("json", schema)
                except GrammarError:
                    pass                                 # such a tool's replies are not read as calls


_ERRORS = {c.__name__: c for c in (GrammarError, GrammarTooLarge, GrammarTooSlow, TooAmbiguous)}


def grammar_field(body: dict) -> str:
    """The body field a request's constraint came from (the first of them, as `parse_structured` reads)."""
    for name in GRAMMAR_FIELDS:
        if body.get(name) is not None:
            return name
    return "structured_outputs"


# --- streaming -------------------------------------------------------------------------------------
async def stream_tool_calls(gen, model_id: str, created: int):
    """SSE events of a chat request with a tool plan (see the module docstring)."""
    from pyengine.server import parsing as P
    from pyengine.server.serving import _failure_error
    from pyengine.server.streaming import DONE, sse

    p = gen.parsed
    plan: ToolPlan = p.tool_plan

    def event(choices):
        return sse(P.chat_chunk(gen.api_id, created, model_id, choices, p.include_usage))

    for c in range(gen.n_choices):
        yield event([P.chat_delta(c, {"role": "assistant", "content": None})])
    ids = {}
    if plan.choice == "named":
        for c in range(gen.n_choices):
            ids[c] = "call_" + uuid.uuid4().hex[:24]
            yield event([P.chat_delta(c, {"tool_calls": [{"index": 0, "id": ids[c], "type": "function",
                                                          "function": {"name": plan.named, "arguments": ""}}]})])
    async for u in gen.updates():
        reason = P.openai_finish_reason(u.finish_reason)
        if plan.choice == "named":
            if u.delta:
                yield event([P.chat_delta(u.choice, {"tool_calls": [{"index": 0, "function": {"arguments": u.delta}}]})])
            if reason:
                yield event([P.chat_delta(u.choice, {}, "tool_calls" if reason == "stop" else reason)])
            continue
        if not reason:
            continue
        text = gen.texts[u.choice]
        if p.reasoning is not None:      # a thinking model: the call is read from the answer after </think>
            reasoning, text = p.reasoning.split(text, p.reasoning_open)
            if reasoning and p.include_reasoning:
                yield event([P.chat_delta(u.choice, {"reasoning_content": reasoning})])
        calls = plan.calls(text) if reason == "stop" else None
        if calls is None:
            if text:
                yield event([P.chat_delta(u.choice, {"content": text})])
            yield event([P.chat_delta(u.choice, {}, reason)])
            continue
        for k, call in enumerate(calls):
            yield event([P.chat_delta(u.choice, {"tool_calls": [{"index": k, **call}]})])
        yield event([P.chat_delta(u.choice, {}, "tool_calls")])
    err = _failure_error(gen)
    if err is not None:
        yield sse(err.body())
    elif p.include_usage:
        final = P.chat_chunk(gen.api_id, created, model_id, [], False)
        final["usage"] = P.usage(gen.prompt_tokens, gen.completion_tokens)
        yield sse(final)
    yield DONE
