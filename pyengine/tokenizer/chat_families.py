"""Chat templates of the families S21 added, as jinja-free Python twins (S02/S21): Qwen2.5's (tools), Qwen3's
(tools, `<think>` reasoning, `enable_thinking`) and Phi-3.5's. Gemma 2 uses Gemma 1's template ("gemma").

Each renderer reproduces what jinja2 renders from the published template in HF's environment
(trim_blocks, lstrip_blocks, `tojson` without ASCII escaping), on messages whose None-valued keys were
dropped first (HF does that). Jinja's rules are kept where a conversation can reach them:
- a missing key is *undefined*: printing it gives "", testing it is false, joining it with `+` is an error;
- `{{ value }}` prints Python's str() of a non-string (True, 3, {'a': 1});
- `a + b` on a non-string is an error (a list content, a number), as jinja raises.
Where jinja would raise, the renderers raise ValueError with the message index. tests/test_chat_families.py
checks them against jinja2 on the published templates over a set of conversations.
"""
from __future__ import annotations

import json

SLOT = "\u00a7SLOT\u00a7"   # stands for the default system prompt (chat_template.SLOT)


class _Undefined:
    """A missing key, as jinja2's Undefined behaves in these templates."""

    def __bool__(self):
        return False

    def __repr__(self):
        return "Undefined"


UNDEF = _Undefined()


def _get(obj, key):
    """`obj.key` / `obj['key']` in jinja: a dict's item, else undefined."""
    if isinstance(obj, dict):
        return obj.get(key, UNDEF)
    return UNDEF


def _show(value) -> str:
    """`{{ value }}`."""
    if value is UNDEF:
        return ""
    return value if isinstance(value, str) else str(value)


def _cat(where: str, *parts) -> str:
    """`a + b + ...` on strings; jinja raises for an undefined or non-string operand."""
    for p in parts:
        if not isinstance(p, str):
            what = "missing" if p is UNDEF else f"a {type(p).__name__}, not a string"
            raise ValueError(f"chat template error: {where} is {what}")
    return "".join(parts)


def _tojson(value, where: str) -> str:
    """HF's `tojson` filter: json.dumps without ASCII escaping."""
    if value is UNDEF:
        raise ValueError(f"chat template error: {where} is missing")
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"chat template error: {where} is not JSON-serializable ({e})") from None


def _iterate(value, where: str) -> list:
    if value is UNDEF:
        return []
    try:
        return list(value)
    except TypeError:
        raise ValueError(f"chat template error: {where} is not a list") from None


def _tools(tools) -> list:
    if tools is None:
        return []
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools must be a list of JSON tool definitions (dicts)")
    return list(tools)


def _tool_list(tools) -> str:
    return "".join("\n" + _tojson(t, f"tools[{i}]") for i, t in enumerate(tools))


_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}\n</tool_call><|im_end|>\n")


def _tool_responses(messages, i: int, m) -> str:
    """A run of tool messages becomes one user turn of <tool_response> blocks (both Qwen templates)."""
    out = []
    if i == 0 or _get(messages[i - 1], "role") != "tool":
        out.append("<|im_start|>user")
    out.append("\n<tool_response>\n" + _show(_get(m, "content")) + "\n</tool_response>")
    if i == len(messages) - 1 or _get(messages[i + 1], "role") != "tool":
        out.append("<|im_end|>\n")
    return "".join(out)


# -- Qwen2.5 (Instruct, Coder, Math: the same template with its own default system prompt) ----------------------
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- '""" + SLOT + """' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\n""" + SLOT + """<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def render_qwen25(messages, add_generation_prompt, default_system, tools=None, **_):
    tools = _tools(tools)
    first = messages[0]
    out = []
    if tools:
        out.append("<|im_start|>system\n")
        out.append(_show(_get(first, "content")) if first["role"] == "system" else default_system)
        out.append("\n\n" + _TOOLS_HEAD + _tool_list(tools) + _TOOLS_TAIL)
    elif first["role"] == "system":
        out.append(_cat("messages[0]['content']", "<|im_start|>system\n", _get(first, "content"), "<|im_end|>\n"))
    else:
        out.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    for i, m in enumerate(messages):
        role, content, calls = m["role"], _get(m, "content"), _get(m, "tool_calls")
        where = f"messages[{i}]['content']"
        if role == "user" or (role == "system" and i > 0) or (role == "assistant" and not calls):
            out.append(_cat(where, "<|im_start|>", role, "\n", content, "<|im_end|>\n"))
        elif role == "assistant":
            out.append("<|im_start|>assistant")
            if content:
                out.append(_cat(where, "\n", content))
            for k, call in enumerate(_iterate(calls, f"messages[{i}]['tool_calls']")):
                function = _get(call, "function")
                if function is not UNDEF:
                    call = function
                out.append('\n<tool_call>\n{"name": "' + _show(_get(call, "name")) + '", "arguments": '
                           + _tojson(_get(call, "arguments"), f"messages[{i}]['tool_calls'][{k}] arguments")
                           + "}\n</tool_call>")
            out.append("<|im_end|>\n")
        elif role == "tool":
            out.append(_tool_responses(messages, i, m))
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


# -- Qwen3 (dense and MoE; reasoning in <think>, `enable_thinking=False` closes it empty) -------------------------
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


def _str_method(value, where: str) -> str:
    """`value.startswith(...)` etc.: jinja raises unless value is a string."""
    if not isinstance(value, str):
        raise ValueError(f"chat template error: {where} is {'missing' if value is UNDEF else 'not a string'}")
    return value


def _contains(needle: str, haystack, where: str) -> bool:
    """`needle in haystack` in jinja: undefined holds nothing; a list or dict is searched as Python does."""
    if haystack is UNDEF:
        return False
    try:
        return needle in haystack
    except TypeError:
        raise ValueError(f"chat template error: {where} is a {type(haystack).__name__}") from None


def render_qwen3(messages, add_generation_prompt, tools=None, enable_thinking=UNDEF, **_):
    tools = _tools(tools)
    first = messages[0]
    out = []
    if tools:
        out.append("<|im_start|>system\n")
        if first["role"] == "system":
            out.append(_cat("messages[0]['content']", _get(first, "content"), "\n\n"))
        out.append(_TOOLS_HEAD + _tool_list(tools) + _TOOLS_TAIL)
    elif first["role"] == "system":
        out.append(_cat("messages[0]['content']", "<|im_start|>system\n", _get(first, "content"), "<|im_end|>\n"))
    # the last user query that is not a tool response: reasoning is shown only after it
    last_query = len(messages) - 1
    for index in range(len(messages) - 1, -1, -1):
        m = messages[index]
        if m["role"] == "user":
            c = _str_method(_get(m, "content"), f"messages[{index}]['content']")
            if not (c.startswith("<tool_response>") and c.endswith("</tool_response>")):
                last_query = index
                break
    for i, m in enumerate(messages):
        role, where = m["role"], f"messages[{i}]['content']"
        if role == "user" or (role == "system" and i > 0):
            out.append(_cat(where, "<|im_start|>", role, "\n", _get(m, "content"), "<|im_end|>\n"))
        elif role == "assistant":
            content = raw = _get(m, "content")
            reasoning = _get(m, "reasoning_content")
            if reasoning is UNDEF:
                reasoning = ""
                if _contains("</think>", raw, where):
                    text = _str_method(raw, where)
                    content = text.split("</think>")[-1].lstrip("\n")
                    reasoning = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            if i > last_query and (i == len(messages) - 1 or reasoning):
                out.append(_cat(where, "<|im_start|>assistant\n<think>\n",
                                _str_method(reasoning, f"messages[{i}]['reasoning_content']").strip("\n"),
                                "\n</think>\n\n", _str_method(content, where).lstrip("\n")))
            else:
                out.append(_cat(where, "<|im_start|>assistant\n", content))
            calls = _get(m, "tool_calls")
            if calls:
                for k, call in enumerate(_iterate(calls, f"messages[{i}]['tool_calls']")):
                    if (k == 0 and content) or k > 0:
                        out.append("\n")
                    function = _get(call, "function")
                    if function:
                        call = function
                    args = _get(call, "arguments")
                    out.append('<tool_call>\n{"name": "' + _show(_get(call, "name")) + '", "arguments": '
                               + (args if isinstance(args, str)
                                  else _tojson(args, f"messages[{i}]['tool_calls'][{k}] arguments"))
                               + "}\n</tool_call>")
            out.append("<|im_end|>\n")
        elif role == "tool":
            out.append(_tool_responses(messages, i, m))
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
        if enable_thinking is False:
            out.append("<think>\n\n</think>\n\n")
    return "".join(out)


# -- Phi-3.5-mini (and Phi-3-mini-128k's later revision) -----------------------------------------------------
PHI35_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
                  "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
                  "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
                  "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")


def render_phi35(messages, add_generation_prompt, eos_token, **_):
    out = []
    tags = {"user": "<|user|>", "assistant": "<|assistant|>"}
    for i, m in enumerate(messages):
        role, content, where = m["role"], _get(m, "content"), f"messages[{i}]['content']"
        if role == "system" and content:
            out.append(_cat(where, "<|system|>\n", content, "<|end|>\n"))
        elif role in tags:
            out.append(_cat(where, tags[role], "\n", content, "<|end|>\n"))
    out.append("<|assistant|>\n" if add_generation_prompt else eos_token)
    return "".join(out)


# name -> (source, renderer, content may be a list of parts / missing, keyword arguments it takes)
FAMILY_TEMPLATES = {
    "qwen2.5": (QWEN25_TEMPLATE, render_qwen25, True, ("tools",)),
    "qwen3": (QWEN3_TEMPLATE, render_qwen3, True, ("tools", "enable_thinking")),
    "phi3.5": (PHI35_TEMPLATE, render_phi35, True, ()),
}
