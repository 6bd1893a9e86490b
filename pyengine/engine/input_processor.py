"""S09/S15/S18: the input processor (vLLM v1's seam) — prompt forms to ids, the refusals, the grammar matchers.

One object decides what a request becomes before any scheduling: `LLMEngine.add_request` and the disagg `Router`
(which must refuse what its engines would, at once) share it.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from pyengine.engine.prompt_logprobs import init_request
from pyengine.engine.request import EngineRequest
from pyengine.layers.token_masks import build_token_masks


class EngineTokenizer(Protocol):
    """What the engine asks of a tokenizer (pyengine/tokenizer/tokenizer.py `Tokenizer`; tests' fakes) beyond what
    detokenizing and stop checking use: ``vocab_size`` (None: the model's), the ids that end a sequence
    (``stop_token_ids``, None: ``eos_token_id`` alone), and the BOS a text prompt starts with when ``add_bos_token``
    (the GGUF's tokenizer.ggml.add_bos_token)."""
    vocab_size: int | None
    eos_token_id: int | None
    bos_token_id: int | None
    stop_token_ids: list[int] | None
    add_bos_token: bool

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...


@runtime_checkable
class ChatEncoder(Protocol):
    """A tokenizer that renders and encodes a conversation itself, message text kept plain (`Tokenizer.encode_chat`):
    `pyengine.llm.LLM.chat` prefers it to rendering the template then encoding the text."""

    def encode_chat(self, messages, add_generation_prompt: bool = True, **kwargs) -> tuple[str, list[int]]: ...


def check_prompt(ids: list[int], params, vocab_size: int, max_model_len: int) -> int:
    """ValueError if the prompt's ids or the params cannot run on this model; else the request's max_tokens."""
    if not ids:
        raise ValueError("prompt is empty (no tokens)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is out of range for vocab size {vocab_size}")
    params.validate_for_vocab(vocab_size)
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - len(ids)
    if max_tokens <= 0 and not (params.max_tokens == 0 and len(ids) <= max_model_len):    # 0: scoring only
        raise ValueError(f"prompt ({len(ids)} tokens) leaves no room in max_model_len ({max_model_len})")
    if params.min_tokens > max_tokens:
        raise ValueError(f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens the context leaves "
                         f"after the prompt")
    return max_tokens


def stop_token_ids(tok: EngineTokenizer) -> set[int]:
    """The ids that end a sequence: the tokenizer's stop tokens, else its EOS."""
    ids = tok.stop_token_ids
    if ids is None:
        ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return {int(t) for t in ids}


class InputProcessor:
    """``encode`` (a str, a list of ids or ``{"prompt_token_ids": [...]}`` -> (text, ids)), ``check`` (ids and
    params against the vocabulary and the context: the request's max_tokens), ``matchers`` (S15: one grammar
    matcher per sequence; a schema the compiler refuses raises ValueError here)."""

    def __init__(self, tokenizer: EngineTokenizer, vocab_size: int, max_model_len: int,
                 eos_token_ids: set[int] | None = None):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, int(vocab_size), int(max_model_len)
        self.eos_token_ids = stop_token_ids(tokenizer) if eos_token_ids is None else eos_token_ids
        self._structured = None                 # S15: built on the first constrained request

    def encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            bos = self.tokenizer.bos_token_id
            # SmolLM2/HF adds no BOS; Gemma does: follow the GGUF's tokenizer.ggml.add_bos_token flag.
            if self.tokenizer.add_bos_token and bos is not None and ids[:1] != [bos]:
                ids = [bos] + ids
            return prompt, list(ids)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError("prompt must be a str, a list of token ids or {'prompt_token_ids': [...]}, "
                         f"got {type(prompt).__name__}")

    def make_request(self, request_id: str, prompt, params, priority: int, arrival_time: float, pooling,
                     fits) -> tuple[EngineRequest, int]:
        """A new `EngineRequest` (no sequences yet) and its max_tokens, or ValueError: the prompt's form and ids,
        the params, ``fits(num_prompt_tokens, max_tokens)`` (the scheduler's room), the grammar and token masks.
        ``pooling``: S19's PoolingParams (the request then samples no token), else None."""
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        text, ids = self.encode(prompt)
        max_tokens = self.check(ids, params)
        max_tokens = 0 if pooling is not None else max_tokens
        fits(len(ids), max_tokens)
        req = EngineRequest(request_id, text, ids, params, priority, arrival_time)
        req.matchers = self.matchers(params, params.n)
        req.token_masks = self.token_masks(params, params.n, ids)
        init_request(req, params, pooling, max_tokens)
        return req, max_tokens

    def check(self, ids: list[int], params) -> int:
        return check_prompt(ids, params, self.vocab_size, self.max_model_len)

    def structured(self):
        """S15: the engine's `StructuredOutputs` (compiled grammars cached), built on first use."""
        if self._structured is None:
            from pyengine.structured.processor import StructuredOutputs     # lazy: only for constrained requests
            self._structured = StructuredOutputs(self.tokenizer, self.eos_token_ids, self.vocab_size)
        return self._structured

    def token_masks(self, params, n: int, prompt_ids: list[int]) -> list | None:
        """Issue 32: one `TokenMasks` per sequence (allowed_token_ids, bad_words, min_tokens, thinking budget),
        else None; ValueError when they cannot hold on this model."""
        return build_token_masks(params, self.tokenizer, self.eos_token_ids, self.vocab_size, prompt_ids, n)

    def matchers(self, params, n: int) -> list | None:
        """One grammar matcher per sequence of a constrained request, else None."""
        if params.structured_outputs is None:
            return None
        return self.structured().matchers(params, n)
