"""S19 Request parsing, the OpenAI wire format in: request bodies -> `ParsedRequest` (token ids, `SamplingParams`,
the tool plan and reasoning parser the reply will be read with); /tokenize and /detokenize.

Layer 2 of the server (errors -> request parsing -> response shaping -> serving -> app): it imports errors,
constraints (response_format / tools -> a grammar) and reasoning, never a layer above. Everything here is plain
functions over dicts so it can be read (and tested) without a server, and run in the tokenizer worker process. Bad
input raises `APIError` carrying the HTTP status and the OpenAI error body, naming the offending parameter.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from pyengine.sampling_params import SamplingParams
from pyengine.server.constraints import parse_structured, prepare_chat
from pyengine.server.errors import APIError, bad_param, missing_param, param_named_in
from pyengine.server.errors import int_field as _int
from pyengine.server.errors import str_list
from pyengine.server.reasoning import parser_for
from pyengine.server.sampling_fields import parse_priority, parse_sampling_fields
from pyengine.tokenizer.length_bound import TooManyTokens

MAX_N = 32                  # choices per request: each one is a sequence in the batch
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 300
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's legacy default; chat defaults to "rest of the context"
MAX_JSON_DEPTH = 64         # no OpenAI body nests deeper than ~6; deep nesting only costs recursion


# --- the body: JSON that is safe to read ------------------------------------------------------------
def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_json_body(raw: bytes) -> dict:
    """Request bytes -> a JSON object, or a 400 saying what is wrong with the input (never an internal
    message): invalid UTF-8 or syntax, NaN/Infinity literals, numbers past Python's 4300-digit limit,
    nesting deeper than MAX_JSON_DEPTH, and strings holding lone surrogates (\\ud800 escapes), which
    cannot be encoded back to UTF-8 anywhere downstream."""
    def invalid(why: str) -> APIError:
        return APIError(400, f"Invalid JSON body: {why}.", code="invalid_json")

    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise invalid("it is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise invalid(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise invalid(f"it nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:   # NaN/Infinity (ours), or an integer over the int-string digit limit
        text = str(exc)
        raise invalid(text if text.endswith("is not JSON") else "a number has too many digits") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise invalid(f"it nests deeper than {MAX_JSON_DEPTH} levels")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            for s in (key, item):
                if isinstance(s, str) and not s.isascii():
                    try:
                        s.encode("utf-8")
                    except UnicodeEncodeError:
                        raise invalid("a string holds a lone surrogate (an unpaired \\ud800-\\udfff escape)") from None
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1))
    return data


# --- field readers: each names its parameter in the error -------------------------------------
def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _float(body: dict, name: str, lo: float, hi: float, *, lo_open: bool = False):
    v = body.get(name)
    if v is None:
        return None
    if not _is_number(v) or not math.isfinite(v):
        raise bad_param(name, f"{name} must be a number, got {v!r}")
    if v < lo or v > hi or (lo_open and v == lo):
        lo_s = f"({lo}" if lo_open else f"[{lo}"
        raise bad_param(name, f"{name} must be in {lo_s}, {hi}], got {v}")
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_param(name, f"{name} must be a boolean, got {v!r}")
    return v


def _stop(body: dict):
    v = str_list(body, "stop", MAX_STOP)
    if v is None:
        return None
    if any(s == "" for s in v):
        raise bad_param("stop", "stop strings must not be empty")
    return v


def _logit_bias(body: dict, vocab_size: int):
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad_param("logit_bias", "logit_bias must be an object mapping token ids to biases")
    if len(v) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_param("logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    out: dict[int, float] = {}
    for key, bias in v.items():
        try:
            tid = int(key)  # JSON keys are strings: {"50256": -100}
        except ValueError:
            raise bad_param("logit_bias", f"logit_bias key {key!r} is not a token id") from None
        if not 0 <= tid < vocab_size:
            raise bad_param("logit_bias", f"logit_bias token id {tid} is outside the vocabulary [0, {vocab_size})")
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise bad_param("logit_bias", f"logit_bias[{key}] must be a number in [-100, 100], got {bias!r}")
        out[tid] = float(bias)
    return out


# --- parsed requests ----------------------------------------------------------------------------
@dataclass
class ParsedRequest:
    kind: str                       # "chat" | "completion"
    model: str | None
    prompts: list[list[int]]        # token ids per prompt (completions may send several)
    prompt_texts: list[str | None]  # for echo
    params: SamplingParams          # with the client's n: the engine runs n sequences per prompt
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None            # top-k alternatives per token (0: only the sampled token); None: off
    echo: bool = False
    user: str | None = None
    tool_plan: object = None        # S15: how a reply to a request with tools is read (server/constraints.py)
    reasoning: object = None        # a thinking model's ReasoningParser (server/reasoning.py), else None
    reasoning_open: bool = False    # the prompt leaves the model inside an open <think>
    include_reasoning: bool = True  # return the reasoning as reasoning_content (else drop it)
    priority: int = 0               # the scheduler's priority (vLLM's sign: lower is earlier; sampling_fields.py)
    prompt_logprobs: int | None = None   # vLLM's prompt_logprobs the client asked for (server/prompt_logprobs.py)


def _common(body: dict, vocab_size: int, chat: bool = False) -> dict:
    """Sampling fields shared by both endpoints, validated with OpenAI's ranges and names."""
    n = _int(body, "n", 1, MAX_N)
    best_of = _int(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of != (n or 1):
        raise bad_param("best_of", "best_of other than n is not supported")
    max_completion = _int(body, "max_completion_tokens", 1)
    max_tokens = _int(body, "max_tokens", 0 if not chat and body.get("echo") is True else 1)   # 0: echo scores
    seed = _int(body, "seed", -(1 << 63), (1 << 64) - 1)
    for unsupported in ("functions", "suffix") + (() if chat else ("tools",)):
        if body.get(unsupported):
            raise bad_param(unsupported, f"{unsupported} is not supported by this server")
    structured, tool_plan = parse_structured(body, chat)
    top_k = _int(body, "top_k", -1, vocab_size)
    kw = dict(
        n=n or 1,
        temperature=_float(body, "temperature", 0.0, 2.0),
        top_p=_float(body, "top_p", 0.0, 1.0, lo_open=True),
        top_k=top_k,
        min_p=_float(body, "min_p", 0.0, 1.0),
        max_tokens=max_completion if max_completion is not None else max_tokens,
        stop=_stop(body),
        seed=None if seed is None else seed % (1 << 63),  # numpy wants a non-negative seed
        presence_penalty=_float(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=_float(body, "frequency_penalty", -2.0, 2.0),
        repetition_penalty=_float(body, "repetition_penalty", 0.0, 10.0, lo_open=True),
        logit_bias=_logit_bias(body, vocab_size),
        ignore_eos=_bool(body, "ignore_eos"),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output"),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        speculative=_bool(body, "speculative", True),    # extension: false opts out of speculative decoding
        structured_outputs=structured,
    )
    kw.update(parse_sampling_fields(body, vocab_size))   # issue 32: min_tokens, bad_words, allowed_token_ids, ...
    priority = parse_priority(body)
    stream = _bool(body, "stream")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_param("stream_options", "stream_options must be an object")
        if not stream:
            raise bad_param("stream_options", "stream_options is only allowed when stream is true")
    include_usage = bool(so and _bool(so, "include_usage"))
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_param("user", "user must be a string")
    budget_param = "max_completion_tokens" if max_completion is not None else "max_tokens"
    return dict(kw=kw, n=n or 1, stream=stream, include_usage=include_usage, user=user, budget_param=budget_param,
                tool_plan=tool_plan, priority=priority)


def _make_params(kw: dict, defaults=()) -> SamplingParams:
    # max_tokens stays None when absent: _fit_context fills it once the prompt length is known.
    given = {**dict(defaults), **{k: v for k, v in kw.items() if v is not None or k == "max_tokens"}}
    try:
        return SamplingParams(**given)
    except ValueError as exc:  # a rule the server did not pre-check: pass SamplingParams' words on
        raise APIError(400, str(exc), param=param_named_in(str(exc), given), code="invalid_value") from None


def _check_model(body: dict) -> str | None:
    m = body.get("model")
    if m is not None and not isinstance(m, str):
        raise bad_param("model", "model must be a string")
    return m


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise missing_param("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_param("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_param("messages", f"{where} must be an object")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_param("messages", f"{where}.role must be system, developer, user, assistant or tool, "
                                        f"got {role!r}")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):  # content parts: only text parts are meaningful to this model
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_param("messages", f"{where}.content parts must be {{\"type\": \"text\", \"text\": str}}")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise bad_param("messages", f"{where}.content must be a string or a list of text parts")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _check_ids(ids: list, vocab_size: int, where: str, param: str = "prompt") -> list[int]:
    if not ids:
        raise bad_param(param, f"{where} must not be empty")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise bad_param(param, f"{where} holds {t!r}, not a token id in [0, {vocab_size})")
    return list(ids)


@dataclass(frozen=True)
class RequestPolicy:
    """What the operator allows one request, and what it gets by default (`pyengine serve` options)."""
    max_model_len: int = 2048
    max_tokens_per_request: int | None = None   # n x max_tokens summed over prompts (--max-tokens-per-request)
    special_tokens_in_content: bool = False     # chat: read control-token strings in messages as tokens
    sampling_defaults: tuple = ()               # (field, value) pairs for fields the client leaves out


def _limits(limits) -> RequestPolicy:
    return limits if isinstance(limits, RequestPolicy) else RequestPolicy(max_model_len=int(limits))


def _too_long(max_model_len: int, what: str, param: str) -> APIError:
    return APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                         f"prompt {what}; no room is left for the completion. (The server's --max-model-len "
                         f"sets the context length.)", param=param, code="context_length_exceeded")


def encode_prompt(tokenizer, text: str, max_model_len: int, param: str, **encode_kw) -> list[int]:
    """Encode with the work bounded by the context: a prompt whose bytes cannot fit is refused before
    tokenizing (`Tokenizer.min_tokens`), and tokenizing stops once past the context (`limit=`)."""
    if not hasattr(tokenizer, "min_tokens"):    # a tokenizer without the bounds (tests' stand-ins)
        return tokenizer.encode(text, **encode_kw)
    at_least = tokenizer.min_tokens(text)
    if at_least >= max_model_len:
        raise _too_long(max_model_len, f"is {len(text.encode())} bytes, which is at least {at_least} tokens",
                        param)
    try:
        return tokenizer.encode(text, limit=max_model_len, **encode_kw)
    except TooManyTokens as exc:      # stopped early: the exact count was not worth computing
        raise _too_long(max_model_len, f"has at least {exc.at_least} tokens", param) from None


def _fit_context(params: SamplingParams, prompt_lens: list[int], limits: RequestPolicy, default_max: int | None,
                 param: str, budget_param: str, n: int) -> SamplingParams:
    """OpenAI-style context checks naming both lengths; fills max_tokens when the client left it out.
    The operator's max_tokens_per_request caps n x max_tokens over all prompts."""
    max_model_len = limits.max_model_len
    longest = max(prompt_lens)
    if longest >= max_model_len:
        raise _too_long(max_model_len, f"has {longest} tokens", param)
    room = max_model_len - longest
    sequences = n * len(prompt_lens)
    cap = limits.max_tokens_per_request
    if params.max_tokens is None:
        want = room if default_max is None else min(default_max, room)
        if cap is not None:
            want = max(1, min(want, cap // sequences))
        return params.clone(max_tokens=want)
    if longest + params.max_tokens > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {longest + params.max_tokens} tokens ({longest} in the prompt, "
                            f"{params.max_tokens} for the completion).",
                       param=budget_param, code="context_length_exceeded")
    if cap is not None and sequences * params.max_tokens > cap:
        raise APIError(400, f"This request asks for {sequences} x {params.max_tokens} = "
                            f"{sequences * params.max_tokens} completion tokens; this server allows at most "
                            f"{cap} per request (its --max-tokens-per-request).",
                       param=budget_param, code="max_tokens_per_request_exceeded")
    return params


def _finish(kind, body, common, prompts, prompt_texts, tokenizer, limits, logprobs, echo, param):
    params = _make_params(common["kw"], limits.sampling_defaults)
    default_max = COMPLETIONS_DEFAULT_MAX_TOKENS if kind == "completion" else None
    try:
        params = _fit_context(params, [len(p) for p in prompts], limits, default_max, param,
                              common["budget_param"], common["n"])
    except ValueError as exc:       # the room left for max_tokens is below min_tokens
        raise bad_param("min_tokens", str(exc)) from None
    if logprobs is not None:
        params = params.clone(logprobs=logprobs)
    return ParsedRequest(kind=kind, model=_check_model(body), prompts=prompts, prompt_texts=prompt_texts,
                         params=params, n=common["n"], stream=common["stream"],
                         include_usage=common["include_usage"], logprobs=logprobs, echo=echo,
                         user=common["user"], tool_plan=common["tool_plan"], priority=common["priority"])


# what a client's chat_template_kwargs may not set: the template's own inputs and the tokenizer's tokens
_TEMPLATE_RESERVED = {"messages", "add_generation_prompt", "chat_template", "tools", "documents", "tokenize",
                      "continue_final_message", "raise_exception", "strftime_now", "default_system"}


def _chat_template_kwargs(body: dict) -> dict:
    """vLLM's chat_template_kwargs (e.g. {"enable_thinking": false}): named scalar variables for the template."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_param("chat_template_kwargs", "chat_template_kwargs must be an object")
    for key, v in value.items():
        if not key.isidentifier() or key in _TEMPLATE_RESERVED or key.endswith("_token"):
            raise bad_param("chat_template_kwargs", f"chat_template_kwargs may not set {key!r}")
        if not isinstance(v, (bool, int, float, str)) or (isinstance(v, str) and len(v) > 1000):
            raise bad_param("chat_template_kwargs", f"chat_template_kwargs[{key!r}] must be a boolean, a number "
                            "or a string of at most 1000 characters")
    return dict(value)


def encode_messages(tokenizer, messages: list[dict], limits: RequestPolicy, add_generation_prompt: bool = True,
                    param: str = "messages", template_kwargs: dict | None = None) -> tuple[str, list[int]]:
    """The conversation as (text, ids) with the message text read as plain text (unless the operator's
    special_tokens_in_content), refused before rendering when its text alone cannot fit."""
    if hasattr(tokenizer, "min_tokens"):
        at_least = sum(tokenizer.min_tokens(m["content"]) for m in messages)
        if at_least >= limits.max_model_len:
            raise _too_long(limits.max_model_len, f"holds at least {at_least} tokens of message text", param)
    template_kwargs = template_kwargs or {}
    if not hasattr(tokenizer, "encode_chat"):   # a stand-in tokenizer: render, then encode
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **template_kwargs)
        return text, tokenizer.encode(text, add_special_tokens=False, parse_special=True)
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt,
                                     special_tokens_in_content=limits.special_tokens_in_content,
                                     limit=limits.max_model_len, **template_kwargs)
    except TooManyTokens as exc:
        raise _too_long(limits.max_model_len, f"has at least {exc.at_least} tokens", param) from None


def parse_chat(body: dict, tokenizer, limits: RequestPolicy | int) -> ParsedRequest:
    """POST /v1/chat/completions body -> ParsedRequest (prompt rendered with the model's chat template).
    `limits`: a RequestPolicy, or just max_model_len."""
    limits = _limits(limits)
    _check_model(body)
    messages = _messages(prepare_chat(body, None))
    common = _common(body, tokenizer.vocab_size, chat=True)
    if common["tool_plan"] is not None:
        messages = _messages(prepare_chat(body, common["tool_plan"]))
    logprobs = None
    if _bool(body, "logprobs"):
        logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    elif body.get("top_logprobs") is not None:
        _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        raise bad_param("top_logprobs", "top_logprobs requires logprobs: true")
    text, ids = encode_messages(tokenizer, messages, limits, template_kwargs=_chat_template_kwargs(body))
    asked = parse_prompt_logprobs(body, common, False, None)
    parsed = _finish("chat", body, common, [ids], [text], tokenizer, limits, logprobs, False, "messages")
    parsed.prompt_logprobs = asked
    parser = parser_for(getattr(tokenizer, "chat_template", None))
    if parser is not None:
        parsed.reasoning, parsed.reasoning_open = parser, parser.opens_in_prompt(text)
        parsed.include_reasoning = _bool(body, "include_reasoning", True)
    elif body.get("include_reasoning") is not None:
        _bool(body, "include_reasoning", True)
    return parsed


def parse_completion(body: dict, tokenizer, limits: RequestPolicy | int) -> ParsedRequest:
    """POST /v1/completions body -> ParsedRequest. prompt: str, [str], [int] or [[int]]."""
    limits = _limits(limits)
    vocab = tokenizer.vocab_size
    prompt = body.get("prompt")
    if prompt is None:
        raise missing_param("prompt")
    common = _common(body, vocab)
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad_param("prompt", "prompt must be a string, a list of strings, a list of token ids "
                                  "or a list of token id lists")
    prompts: list[list[int]] = []
    texts: list[str | None] = []
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        prompts.append(_check_ids(prompt, vocab, "prompt"))
        texts.append(None)
    else:
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                ids = encode_prompt(tokenizer, p, limits.max_model_len, "prompt", add_special_tokens=True,
                                    parse_special=True)
                if not ids:
                    raise bad_param("prompt", f"prompt[{i}] encodes to no tokens")
                prompts.append(ids)
                texts.append(p)
            elif isinstance(p, list):
                prompts.append(_check_ids(p, vocab, f"prompt[{i}]"))
                texts.append(None)
            else:
                raise bad_param("prompt", f"prompt[{i}] must be a string or a list of token ids")
    if len(prompts) * common["n"] > MAX_N:
        raise bad_param("n", f"prompts x n must be at most {MAX_N}, got {len(prompts) * common['n']}")
    logprobs = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    echo = _bool(body, "echo")
    asked = parse_prompt_logprobs(body, common, echo, logprobs)     # echo + logprobs, vLLM's prompt_logprobs
    if echo:
        texts = [t if t is not None else tokenizer.decode(ids) for t, ids in zip(texts, prompts)]
    parsed = _finish("completion", body, common, prompts, texts, tokenizer, limits, logprobs, echo, "prompt")
    parsed.prompt_logprobs = asked
    return parsed


# --- /tokenize and /detokenize (vLLM's shapes) -------------------------------------------------------
def tokenize(body: dict, tokenizer, limits: RequestPolicy | int) -> dict:
    """{"prompt": str, "add_special_tokens": true} or {"messages": [...], "add_generation_prompt": true}
    -> {"count", "max_model_len", "tokens", "token_strs"}. Counting stops at the context length, as for
    a completion (a prompt that cannot fit is a 400)."""
    limits = _limits(limits)
    want_strs = _bool(body, "return_token_strs")
    if body.get("messages") is not None:
        messages = _messages(body)
        _, ids = encode_messages(tokenizer, messages, limits, _bool(body, "add_generation_prompt", True),
                                 template_kwargs=_chat_template_kwargs(body))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise missing_param("prompt", "tokenize needs prompt (a string) or messages")
        ids = encode_prompt(tokenizer, prompt, limits.max_model_len, "prompt",
                            add_special_tokens=_bool(body, "add_special_tokens", True), parse_special=True)
    strs = [token_text(tokenizer, t)[0] for t in ids] if want_strs else None
    return {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: dict, tokenizer) -> dict:
    """{"tokens": [int, ...]} -> {"prompt": text}."""
    tokens = body.get("tokens")
    if tokens is None:
        raise missing_param("tokens")
    if not isinstance(tokens, list):
        raise bad_param("tokens", "tokens must be a list of token ids")
    if tokens:
        _check_ids(tokens, tokenizer.vocab_size, "tokens", param="tokens")
    return {"prompt": tokenizer.decode(tokens)}


def token_text(tokenizer, tid: int) -> tuple[str, list[int]]:
    """A token's text (invalid UTF-8 replaced) and its raw bytes."""
    raw = tokenizer.token_bytes(tid)
    return raw.decode("utf-8", errors="replace"), list(raw)


def parse_prompt_logprobs(body: dict, common: dict, echo: bool, logprobs: int | None) -> int | None:
    """Set the engine's prompt_logprobs in ``common["kw"]`` from a request body (echo + logprobs, vLLM's
    ``prompt_logprobs``; shaped by server/prompt_logprobs.py); returns the ``prompt_logprobs`` the client
    asked for (None: not asked). APIError for bad values."""
    asked = _int(body, "prompt_logprobs", 0, MAX_TOP_LOGPROBS)
    if asked is not None and common["stream"]:
        raise bad_param("prompt_logprobs", "prompt_logprobs is not available with stream: true")
    kw = common["kw"]
    want = [k for k in (asked, logprobs if echo else None) if k is not None]
    if echo and kw.get("max_tokens") == 0 and not want:
        want = [0]                        # scoring the prompt: the engine still runs it for its logprobs
    kw["prompt_logprobs"] = max(want) if want else None
    return asked
