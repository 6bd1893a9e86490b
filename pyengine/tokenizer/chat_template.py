"""Chat templates without a template engine (S02/S19).

A GGUF carries its chat format as a Jinja template (`tokenizer.chat_template`). The core may not depend
on jinja2, so we *recognize* the well-known templates and render them with small Python functions that
reproduce HF's output byte for byte (HF renders with trim_blocks=True, lstrip_blocks=True).

Recognition is by fingerprint, not by raw string: the template is cut into text / {{ }} / {% %}, Jinja's
whitespace rules ('-' markers, trim_blocks, lstrip_blocks) are applied to the text, code is stripped of
insignificant spaces and string literals are compared by value. So re-indenting a template or switching
quote styles keeps it recognized, while any change that alters the output does not. One slot is allowed:
the default system prompt of ChatML templates (SmolLM2's "You are a helpful AI assistant named SmolLM...").

A template we do not know is rendered by jinja2 in a sandbox like HF's, if jinja2 is installed;
otherwise it is a ValueError that says so -- never a guess.
"""
from __future__ import annotations

import functools
import json
import re
from typing import Callable

from .chat_families import FAMILY_TEMPLATES

# -- fingerprints ----------------------------------------------------------------------------------------------
_TAG = re.compile(r"\{\{([-+]?)(.*?)([-+]?)\}\}|\{%([-+]?)(.*?)([-+]?)%\}|\{#([-+]?)(.*?)([-+]?)#\}", re.S)
_CODE = re.compile(r"""'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|\s+|[A-Za-z0-9_]+|.""", re.S)
SLOT = "\u00a7SLOT\u00a7"   # stands for the default system prompt in a known template's source


def _literal(token: str) -> str:
    """A Jinja string literal -> its value (Jinja unescapes like Python)."""
    body = token[1:-1]
    return body.encode("latin-1", "backslashreplace").decode("unicode-escape") if "\\" in body else body


def _normalize_code(code: str) -> str:
    out, prev_word = [], False
    for tok in _CODE.findall(code):
        if tok.isspace():
            continue
        if tok[0] in "'\"" and len(tok) >= 2:
            out.append(json.dumps(_literal(tok), ensure_ascii=False))
            prev_word = False
            continue
        word = tok[0].isalnum() or tok[0] == "_"
        if word and prev_word:
            out.append(" ")
        out.append(tok)
        prev_word = word
    return "".join(out)


def fingerprint(template: str) -> tuple:
    """What a template renders, up to formatting: [("T", text) | ("E", expr) | ("S", statement)]."""
    template = template.replace("\r\n", "\n")
    parts = []   # (kind, content, left marker, right marker)
    pos = 0
    for m in _TAG.finditer(template):
        parts.append(("T", template[pos:m.start()], "", ""))
        if m.group(2) is not None:
            parts.append(("E", m.group(2), m.group(1), m.group(3)))
        elif m.group(5) is not None:
            parts.append(("S", m.group(5), m.group(4), m.group(6)))
        else:
            parts.append(("C", m.group(8), m.group(7), m.group(9)))
        pos = m.end()
    parts.append(("T", template[pos:], "", ""))
    out = []
    for i, (kind, body, left, right) in enumerate(parts):
        if kind == "C":
            continue
        if kind != "T":
            out.append((kind, _normalize_code(body)))
            continue
        before = parts[i - 1] if i > 0 else None
        after = parts[i + 1] if i + 1 < len(parts) else None
        text = body
        if after is not None:
            if after[2] == "-":
                text = text.rstrip()
            elif after[0] in "SC" and after[2] != "+":
                # lstrip_blocks: spaces/tabs between a line start and a block tag are dropped
                head, nl, last = text.rpartition("\n")
                if last.strip(" \t") == "" and (nl or i == 0):
                    text = head + nl
        if before is not None:
            if before[3] == "-":
                text = text.lstrip()
            elif before[0] in "SC" and before[3] != "+" and text.startswith("\n"):
                text = text[1:]   # trim_blocks: the newline after a block tag
        if text:
            out.append(("T", text))
    # Adjacent text pieces (a comment between them) render as one.
    merged = []
    for item in out:
        if merged and item[0] == "T" and merged[-1][0] == "T":
            merged[-1] = ("T", merged[-1][1] + item[1])
        else:
            merged.append(item)
    return tuple(merged)


def _match(known: tuple, candidate: tuple) -> dict | None:
    """Slot values if `candidate` equals `known` up to the slot, else None."""
    if len(known) != len(candidate):
        return None
    slots = {}
    for (k_kind, k), (c_kind, c) in zip(known, candidate):
        if k_kind != c_kind:
            return None
        if SLOT not in k:
            if k != c:
                return None
            continue
        head, _, tail = k.partition(SLOT)
        if not (c.startswith(head) and c.endswith(tail) and len(c) >= len(head) + len(tail)):
            return None
        raw = c[len(head):len(c) - len(tail)]
        try:   # the slot must be plain literal text: a JSON string body without unescaped quotes
            value = json.loads(f'"{raw}"')
        except ValueError:
            return None
        if json.dumps(value, ensure_ascii=False)[1:-1] != raw:
            return None
        if slots.get("slot", value) != value:   # a slot used twice must hold the same text both times
            return None
        slots["slot"] = value
    return slots


# -- the known templates (sources as their models publish them) -----------------------------------------------
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
ZEPHYR_TEMPLATE = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
GEMMA_TEMPLATE = (   # Gemma 1 and 2
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
# ChatML that opens with a default system prompt when the conversation has none (SmolLM2 and others).
CHATML_SYSTEM_TEMPLATE = SMOLLM2_TEMPLATE.replace(
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face", SLOT)


# -- renderers: Python twins of the templates above -------------------------------------------------------------
def _text(message: dict, i: int) -> str:
    content = message["content"]
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}]['content'] must be a string for this chat template, "
                         f"got {type(content).__name__}")
    return content


def _alternation(messages: list[dict], offset: int = 0) -> None:
    for k, m in enumerate(messages):
        if (m["role"] == "user") != (k % 2 == 0):
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/... "
                             f"(messages[{k + offset}] has role {m['role']!r})")


def render_chatml(messages, add_generation_prompt, default_system=None, **_):
    out = []
    if default_system is not None and messages[0]["role"] != "system":
        out.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    for i, m in enumerate(messages):
        out.append(f"<|im_start|>{m['role']}\n{_text(m, i)}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def render_zephyr(messages, add_generation_prompt, eos_token, **_):
    out = []
    for i, m in enumerate(messages):
        tag = {"user": "<|user|>", "system": "<|system|>", "assistant": "<|assistant|>"}.get(m["role"])
        if tag is not None:   # other roles render nothing
            out.append(f"{tag}\n{_text(m, i)}{eos_token}\n")
    if add_generation_prompt:
        out.append("<|assistant|>\n")
    return "".join(out)


def render_llama2(messages, add_generation_prompt, bos_token, eos_token, **_):
    system, offset = None, 0
    if messages[0]["role"] == "system":
        system, offset = _text(messages[0], 0), 1
    turns = messages[offset:]
    _alternation(turns, offset)
    out = []
    for k, m in enumerate(turns):
        content = _text(m, k + offset)
        if k == 0 and system is not None:
            content = f"<<SYS>>\n{system}\n<</SYS>>\n\n{content}"
        if m["role"] == "user":
            out.append(f"{bos_token}[INST] {content.strip()} [/INST]")
        elif m["role"] == "assistant":
            out.append(f" {content.strip()} {eos_token}")
    return "".join(out)


def render_llama3(messages, add_generation_prompt, bos_token, **_):
    out = [bos_token] if messages else []
    for i, m in enumerate(messages):
        out.append(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{_text(m, i).strip()}<|eot_id|>")
    if add_generation_prompt:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


def render_gemma(messages, add_generation_prompt, bos_token, **_):
    if messages[0]["role"] == "system":
        raise ValueError("System role not supported")
    _alternation(messages)
    out = [bos_token]
    for i, m in enumerate(messages):
        role = "model" if m["role"] == "assistant" else m["role"]
        out.append(f"<start_of_turn>{role}\n{_text(m, i).strip()}<end_of_turn>\n")
    if add_generation_prompt:
        out.append("<start_of_turn>model\n")
    return "".join(out)


def _gemma3_content(content, where: str) -> str:
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):
        out = []
        for k, item in enumerate(content):
            if not isinstance(item, dict):
                raise ValueError(f"{where}[{k}] must be a dict with 'type' ('text' or 'image')")
            if item.get("type") == "image":
                out.append("<start_of_image>")
            elif item.get("type") == "text":
                text = item.get("text", "")
                if not isinstance(text, str):
                    raise ValueError(f"{where}[{k}]['text'] must be a string")
                out.append(text.strip())
        return "".join(out)
    raise ValueError("Invalid content type")


def render_gemma3(messages, add_generation_prompt, bos_token, **_):
    prefix, offset = "", 0
    if messages[0]["role"] == "system":
        content = messages[0]["content"]
        if isinstance(content, str):
            prefix = content + "\n\n"
        else:
            try:
                prefix = content[0]["text"] + "\n\n"
            except (IndexError, KeyError, TypeError):
                raise ValueError("messages[0]['content'] must be a string or a list starting with a text part") from None
        offset = 1
    turns = messages[offset:]
    _alternation(turns, offset)
    out = [bos_token]
    for k, m in enumerate(turns):
        role = "model" if m["role"] == "assistant" else m["role"]
        out.append(f"<start_of_turn>{role}\n{prefix if k == 0 else ''}")
        out.append(_gemma3_content(m["content"], f"messages[{k + offset}]['content']"))
        out.append("<end_of_turn>\n")
    if add_generation_prompt:
        out.append("<start_of_turn>model\n")
    return "".join(out)


# name -> (template source, renderer, content may be a list of parts)
KNOWN_TEMPLATES: dict[str, tuple[str, Callable, bool]] = {
    "chatml-system": (CHATML_SYSTEM_TEMPLATE, render_chatml, False),
    "chatml": (CHATML_TEMPLATE, render_chatml, False),
    "zephyr": (ZEPHYR_TEMPLATE, render_zephyr, False),
    "llama2": (LLAMA2_TEMPLATE, render_llama2, False),
    "llama3": (LLAMA3_TEMPLATE, render_llama3, False),
    "gemma": (GEMMA_TEMPLATE, render_gemma, False),
    "gemma3": (GEMMA3_TEMPLATE, render_gemma3, True),
}


@functools.lru_cache(maxsize=None)
def _known_fingerprints() -> dict[str, tuple]:
    known = {name: fingerprint(src) for name, (src, _, _) in KNOWN_TEMPLATES.items()}
    known.update((name, fingerprint(entry[0])) for name, entry in FAMILY_TEMPLATES.items())
    return known


@functools.lru_cache(maxsize=64)
def recognize(template: str) -> tuple[str, dict] | None:
    """(name, slot values) of a known template, or None."""
    fp = fingerprint(template)
    for name, known in _known_fingerprints().items():
        slots = _match(known, fp)
        if slots is not None:
            return name, slots
    return None


# -- entry point ----------------------------------------------------------------------------------------------
def _check_messages(messages, parts_ok: bool, content: bool = True) -> list[dict]:
    """The messages with their None values dropped (as HF does); ValueError naming the first bad one. With
    ``content`` False a message's content may be missing or of any type (the template decides)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}   # HF drops None values first
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] needs a string 'role'")
        if content and "content" not in m:
            raise ValueError(f"messages[{i}] needs a 'content'")
        if content and not isinstance(m["content"], str) and not (parts_ok and isinstance(m["content"], list)):
            raise ValueError(f"messages[{i}]['content'] must be a string"
                             + (" or a list of parts" if parts_ok else ""))
        out.append(m)
    return out


def render_chat(template: str, messages, add_generation_prompt: bool = True, **variables) -> str:
    """Render `messages` with `template` as HF would; `variables` are bos_token, eos_token, ..."""
    if not isinstance(template, str) or not template:
        raise ValueError("chat_template must be a non-empty string")
    found = recognize(template)
    if found is not None and found[0] in FAMILY_TEMPLATES:
        return _render_family(found[0], found[1], messages, add_generation_prompt, variables)
    if variables.get("tools"):
        if found is not None:
            raise ValueError(f"the {found[0]} chat template does not take tools (templates that do: "
                             + ", ".join(n for n, e in FAMILY_TEMPLATES.items() if "tools" in e[3]) + ")")
    else:
        variables.pop("tools", None)
    if found is not None:
        name, slots = found
        _, renderer, parts_ok = KNOWN_TEMPLATES[name]
        messages = _check_messages(messages, parts_ok)
        needed = {"zephyr": ("eos_token",), "llama2": ("bos_token", "eos_token"), "llama3": ("bos_token",),
                  "gemma": ("bos_token",), "gemma3": ("bos_token",)}.get(name, ())
        for key in needed:
            if not isinstance(variables.get(key), str):
                raise ValueError(f"the {name} chat template needs {key}, which this tokenizer lacks")
        if name == "chatml-system":
            variables["default_system"] = slots["slot"]
        return renderer(messages, bool(add_generation_prompt), **variables)
    return _render_with_jinja(template, messages, add_generation_prompt, variables)


def _render_family(name, slots, messages, add_generation_prompt, variables) -> str:
    """The S21 families' templates (chat_families.py): content may be missing or of any type there (the
    template decides, as jinja would: a tool-calling assistant turn has no text); roles must be strings."""
    _, renderer, _, options = FAMILY_TEMPLATES[name]
    checked = _check_messages(messages, parts_ok=True, content=False)
    if variables.get("tools") and "tools" not in options:
        raise ValueError(f"the {name} chat template does not take tools")
    if name == "phi3.5" and not isinstance(variables.get("eos_token"), str):
        raise ValueError("the phi3.5 chat template needs eos_token, which this tokenizer lacks")
    if "slot" in slots:
        variables["default_system"] = slots["slot"]
    return renderer(checked, bool(add_generation_prompt), **variables)


def _render_with_jinja(template, messages, add_generation_prompt, variables) -> str:
    try:
        import jinja2  # optional: only for templates we do not recognize
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ValueError("chat template not recognized (not one of: " + ", ".join(KNOWN_TEMPLATES)
                         + f"; starts {template[:60]!r}) and jinja2 is not installed to render it") from None
    import datetime
    from jinja2.ext import loopcontrols

    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of dicts")
    if not all(isinstance(m, dict) for m in messages):
        raise ValueError("every message must be a dict")
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **{"tools": None, "documents": None, **variables})
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template error: {e}") from None
