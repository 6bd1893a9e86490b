"""S04 `SamplingParams`: how one request wants its next tokens chosen (vLLM names and defaults).

Everything is checked at construction, so a bad value fails with a `ValueError` naming the parameter
before any model work happens. The one check that needs the model (token ids inside the vocabulary)
is `validate_for_vocab`, called by the engine when the request is added.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields

# Below this temperature sampling is greedy (argmax): dividing by ~0 only overflows.
GREEDY_EPS = 1e-5
# OpenAI's bounds for logit_bias values; +-100 already bans or forces a token.
MAX_LOGIT_BIAS = 100.0
# llama.cpp's GGUF keys for the sampler settings a model's author recommends -> SamplingParams fields.
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                      "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}


def model_sampling_defaults(metadata: dict | None) -> dict:
    """The sampler settings a GGUF carries (`general.sampling.*`), as SamplingParams fields. Every entry
    point (Python API, CLI, server) starts from these and, for what the file does not say, from vLLM's
    defaults (temperature 1, top_p 1, top_k off, min_p 0): the dataclass defaults below."""
    out = {}
    for key, name in GGUF_SAMPLING_KEYS.items():
        value = (metadata or {}).get(key)
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            out[name] = int(value) if name == "top_k" else float(value)
    if out.get("top_k") == 0:
        out["top_k"] = -1          # llama.cpp's "off"
    SamplingParams(**out)          # a file with out-of-range values fails here, naming the field
    return out


def _number(name: str, value, *, integer: bool = False):
    """`value` as a Python int/float, or ValueError naming `name` (bools and strings are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if integer:
        if isinstance(value, numbers.Integral):
            return int(value)
        if float(value).is_integer():
            return int(value)
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


@dataclass
class StructuredOutputsParams:
    """S15 constrain the output to a grammar (vLLM's names): exactly one of
    ``json`` (a JSON Schema, dict or JSON text), ``regex``, ``choice`` (list of strings), ``grammar``
    (llama.cpp GBNF) or ``json_object=True`` (any JSON object). Compiled when the request is added."""
    json: dict | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False) or (k == "json" and self.json is False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, bool, str)):
            raise ValueError(f"structured_outputs.json must be a JSON Schema (dict or JSON text), got {self.json!r}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a bool")

    @property
    def request(self) -> tuple[str, object]:
        """(kind, spec) as `pyengine.structured.compile_grammar` takes it."""
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        return "json_object", True


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                    # -1 or 0: off
    min_p: float = 0.0
    max_tokens: int | None = 16        # None: until the context (max_model_len) is full
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None        # top-n raw logprobs per generated token (0: only the sampled one)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    speculative: bool = True           # extension (S14): False opts this request out of speculative decoding
    structured_outputs: StructuredOutputsParams | None = None
    # issue 32 (vLLM's names and semantics; enforced by layers/token_masks.py, docs/sampling.md step 4)
    min_tokens: int = 0                # EOS, stop_token_ids and stop strings wait until this many tokens
    bad_words: list[str] | None = None         # words banned as token sequences (with the leading-space form)
    allowed_token_ids: list[int] | None = None  # only these ids may be sampled
    thinking_token_budget: int | None = None   # tokens inside <think>...</think> before </think> is forced
    # vLLM's prompt_logprobs (S19, engine/prompt_logprobs.py): per prompt position the prompt token's logprob plus
    # the top-k (0: the prompt token alone), from the prefill's own forward; with it, max_tokens may be 0 (scoring)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self.n = _number("n", self.n, integer=True)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        self.temperature = _number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        self.top_p = _number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _number("top_k", self.top_k, integer=True)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}")
        self.min_p = _number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None:
            self.max_tokens = _number("max_tokens", self.max_tokens, integer=True)
            if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
                raise ValueError(f"max_tokens must be at least 1 (or None; 0 only with prompt_logprobs, to score a "
                                 f"prompt), got {self.max_tokens}")
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        if self.seed is not None:
            self.seed = _number("seed", self.seed, integer=True)
            if self.seed < 0:
                raise ValueError(f"seed must be a non-negative integer, got {self.seed}")
        if self.logprobs is not None:
            self.logprobs = _number("logprobs", self.logprobs, integer=True)
            if self.logprobs < 0:
                raise ValueError(f"logprobs must be a non-negative integer (or None), got {self.logprobs}")
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _number("prompt_logprobs", self.prompt_logprobs, integer=True)
            if self.prompt_logprobs < 0:
                raise ValueError(f"prompt_logprobs must be a non-negative integer (or None), got "
                                 f"{self.prompt_logprobs}")
        self.stop = self._stop_strings(self.stop)
        self.stop_token_ids = self._token_ids("stop_token_ids", self.stop_token_ids)
        self.logit_bias = self._logit_bias(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams (or a dict of its fields), "
                             f"got {type(self.structured_outputs).__name__}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self._check_token_fields()

    def _check_token_fields(self) -> None:
        """min_tokens, bad_words, allowed_token_ids, thinking_token_budget (issue 32)."""
        self.min_tokens = _number("min_tokens", self.min_tokens, integer=True)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be less than or equal to "
                             f"max_tokens ({self.max_tokens})")
        if self.bad_words is not None:
            words = self.bad_words
            if isinstance(words, str) or not isinstance(words, (list, tuple)) \
                    or not all(isinstance(w, str) for w in words):
                raise ValueError(f"bad_words must be a list of strings, got {words!r}")
            if any(not w.strip() for w in words):
                raise ValueError("bad_words must not contain empty or blank strings")
            self.bad_words = list(dict.fromkeys(words))
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = self._token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (leave it out to allow every token)")
        if self.thinking_token_budget is not None:
            self.thinking_token_budget = _number("thinking_token_budget", self.thinking_token_budget, integer=True)
            if self.thinking_token_budget < 0:
                raise ValueError(f"thinking_token_budget must be a non-negative integer (or None), "
                                 f"got {self.thinking_token_budget}")

    # --- normalisation of the container-valued parameters -------------------------------------
    @staticmethod
    def _stop_strings(stop) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stop):
            raise ValueError("stop must not contain the empty string")
        return list(dict.fromkeys(stop))      # drop duplicates, keep order

    @staticmethod
    def _token_ids(name: str, ids) -> list[int]:
        if ids is None:
            return []
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"{name} must be a list of token ids, got {ids!r}")
        out = [_number(name, i, integer=True) for i in ids]
        if any(i < 0 for i in out):
            raise ValueError(f"{name} must contain non-negative token ids, got {ids!r}")
        return out

    @staticmethod
    def _logit_bias(bias) -> dict[int, float]:
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict token id -> bias, got {bias!r}")
        out: dict[int, float] = {}
        for key, value in bias.items():
            # JSON objects (OpenAI API) have string keys: "50256": -100.
            if isinstance(key, str):
                if not key.strip().lstrip("-").isdigit():
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
                key = int(key)
            key = _number("logit_bias token id", key, integer=True)
            if key < 0:
                raise ValueError(f"logit_bias token id must be non-negative, got {key}")
            value = _number(f"logit_bias[{key}]", value)
            if abs(value) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{key}] must be in [-100, 100], got {value}")
            out[key] = value
        return out

    # --- derived facts ------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        """Temperature 0 (below 1e-5) means argmax: no randomness, no temperature division."""
        return self.temperature < GREEDY_EPS

    @property
    def has_token_masks(self) -> bool:
        """Whether a per-sequence token mask applies (layers/token_masks.py)."""
        return bool(self.min_tokens or self.bad_words or self.allowed_token_ids
                    or self.thinking_token_budget is not None)

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Check the token ids this request names against the model's vocabulary (the engine calls
        this in add_request). ValueError names the parameter and the offending id."""
        for tid in self.logit_bias:
            if tid >= vocab_size:
                raise ValueError(f"logit_bias token id {tid} is out of range for vocab size {vocab_size}")
        for tid in self.stop_token_ids:
            if tid >= vocab_size:
                raise ValueError(f"stop_token_ids contains {tid}, out of range for vocab size {vocab_size}")
        for tid in self.allowed_token_ids or ():
            if tid >= vocab_size:
                raise ValueError(f"allowed_token_ids contains {tid}, out of range for vocab size {vocab_size}")
        if self.logprobs is not None and self.logprobs > vocab_size:
            raise ValueError(f"logprobs={self.logprobs} exceeds the vocab size {vocab_size}")
        if self.prompt_logprobs is not None and self.prompt_logprobs > vocab_size:
            raise ValueError(f"prompt_logprobs={self.prompt_logprobs} exceeds the vocab size {vocab_size}")

    def clone(self, **changes) -> "SamplingParams":
        """A validated copy with some fields replaced (e.g. per-choice seeds for n > 1)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SamplingParams(**values)
