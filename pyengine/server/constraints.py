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

Reading the reply back (`ToolPlan.calls`): the generated JSON is a call when it names a tool and its arguments
match (for "auto", checked against the tool's schema); shaping.py turns the calls into OpenAI ``tool_calls``
(ids ``call_<hex>``) with finish_reason ``tool_calls``, serving.py streams them as ``delta.tool_calls``. The
grammars themselves compile off the serving loop, in grammar_worker.py.

Layer 2 of the server (errors -> request parsing -> response shaping -> serving -> app), beside parsing.py,
which calls it: it imports errors and nothing above.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from pyengine.sampling_params import StructuredOutputsParams
from pyengine.server.errors import bad_param
from pyengine.structured.ir import GrammarError
from pyengine.structured.json_schema import dumps
from pyengine.structured.matcher import compile_automaton

MAX_TOOLS = 128
_VLLM_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


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


def _valid(args: dict, schema) -> bool:
    """For "auto" (no grammar): check a call's arguments with the grammar's own matcher-free test — the
    schema compiled to rules and matched byte by byte."""
    if schema is None:
        return True
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
        raise bad_param("tools", f"tools must be a non-empty list of at most {MAX_TOOLS} function tools")
    out, params = [], {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad_param("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_param("tools", f"tools[{i}].function.name must be a non-empty string")
        if name in params:
            raise bad_param("tools", f"tools[{i}]: function {name!r} is defined twice")
        schema = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(schema, dict):
            raise bad_param("tools", f"tools[{i}].function.parameters must be a JSON Schema object")
        params[name] = schema
        out.append({"name": name, "description": fn.get("description", ""), "parameters": schema})
    return out, params


def parse_structured(body: dict, chat: bool) -> tuple[StructuredOutputsParams | None, ToolPlan | None]:
    """The constraint (and, for chat with tools, the tool plan) a request body asks for."""
    found = []
    if body.get("response_format") is not None:
        constraint = _response_format(body["response_format"])
        if constraint is not None:
            found.append(("response_format", constraint))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    for alias, kind in _VLLM_ALIASES.items():
        if body.get(alias) is not None:
            found.append((alias, _so(body, alias, {kind: body[alias]})))
    plan = None
    if body.get("tools") and chat:
        plan, constraint = _tool_plan(body)
        if constraint is not None:
            found.append(("tool_choice", constraint))
    elif body.get("tool_choice") not in (None, "none", "auto") and not body.get("tools"):
        raise bad_param("tool_choice", "tool_choice needs tools")
    if len(found) > 1:
        raise bad_param(found[1][0], f"{found[0][0]} and {found[1][0]} both constrain the output: send one")
    return (found[0][1] if found else None), plan


def _response_format(rf) -> StructuredOutputsParams | None:
    """OpenAI's response_format (None for "text")."""
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_param("response_format", "response_format.type must be text, json_object or json_schema")
    if rf["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf["type"] == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
            raise bad_param("response_format", "response_format.json_schema must be {name, schema, strict}")
        if "name" in js and not isinstance(js["name"], str):
            raise bad_param("response_format", "response_format.json_schema.name must be a string")
        return StructuredOutputsParams(json=js.get("schema", {}))
    return None


def _structured_outputs(so) -> StructuredOutputsParams:
    """vLLM's structured_outputs object."""
    if not isinstance(so, dict):
        raise bad_param("structured_outputs", "structured_outputs must be an object")
    known = {"json", "regex", "choice", "grammar", "json_object"}
    extra = set(so) - known - {"whitespace_pattern", "disable_fallback", "disable_any_whitespace",
                               "disable_additional_properties", "backend"}
    if extra:
        raise bad_param("structured_outputs", f"structured_outputs: unknown field {sorted(extra)[0]!r}")
    return _so(so, "structured_outputs", {k: so[k] for k in known if k in so})


def _tool_plan(body: dict) -> tuple[ToolPlan | None, StructuredOutputsParams | None]:
    """A chat body's tools and tool_choice: the plan, and the constraint a named or required choice puts on the
    output (None for auto; (None, None) for "none")."""
    tools, params = _tools(body)
    names = [t["name"] for t in tools]
    tc = body.get("tool_choice", "auto")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_param("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    if isinstance(tc, dict):
        fn = tc.get("function") if tc.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in params:
            raise bad_param("tool_choice", f"tool_choice names no function of tools: {tc!r}")
        return ToolPlan("named", names, name, parallel, params), StructuredOutputsParams(json=params[name])
    if tc == "required":
        call = [{"type": "object", "properties": {"name": {"const": n}, "arguments": params[n]},
                 "required": ["name", "arguments"], "additionalProperties": False} for n in names]
        schema = {"type": "array", "items": call[0] if len(call) == 1 else {"anyOf": call}, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan("required", names, None, parallel, params), StructuredOutputsParams(json=schema)
    if tc == "auto":
        return ToolPlan("auto", names, None, parallel, params), None
    if tc != "none":
        raise bad_param("tool_choice", "tool_choice must be none, auto, required or {\"type\": \"function\", ...}")
    return None, None


def _so(holder: dict, param: str, fields: dict) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except (TypeError, ValueError) as e:
        raise bad_param(param, str(e)) from None


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
                raise bad_param("messages", "an assistant message's tool_calls must be a list")
            for c in m["tool_calls"]:
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                        or not isinstance(fn.get("arguments", ""), (str, dict)):
                    raise bad_param("messages", "each tool_calls entry must be {\"type\": \"function\", \"function\": "
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


# the body fields a constraint may come from, in the order `parse_structured` reads them
GRAMMAR_FIELDS = ("response_format", "structured_outputs", *_VLLM_ALIASES, "tool_choice", "tools")


def grammar_field(body: dict) -> str:
    """The body field a request's constraint came from (the first of them, as `parse_structured` reads)."""
    for name in GRAMMAR_FIELDS:
        if body.get(name) is not None:
            return name
    return "structured_outputs"
