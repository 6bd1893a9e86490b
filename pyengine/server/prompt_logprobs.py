"""S19 Prompt logprobs on the wire: OpenAI's legacy ``echo`` + ``logprobs`` on /v1/completions and vLLM's
``prompt_logprobs`` on both endpoints (the engine computes them in the prefill's own forward:
engine/prompt_logprobs.py).

- ``echo: true, logprobs: k`` (completions): ``choices[i].logprobs`` covers the prompt tokens, then the completion's:
  ``tokens``, ``token_logprobs`` (the first prompt token's is null: nothing predicts it), ``top_logprobs`` (the k
  most likely at each position, null for the first), ``text_offset`` (character offsets in the returned text).
  ``max_tokens: 0`` with ``echo`` scores the prompt only (finish_reason "length"): what lm-evaluation-harness's
  loglikelihood tasks send. Streaming sends the echoed prompt with its logprobs in the first chunk of each choice.
- ``prompt_logprobs: k`` (vLLM; 0..20): ``choices[i].prompt_logprobs`` (completions) or a top-level
  ``prompt_logprobs`` (chat): null, then per prompt token {token id: {"logprob", "rank", "decoded_token"}} with
  the prompt token and the top k. Not with ``stream`` (as vLLM).

A request that asks for them bypasses the prefix cache (a cached block has no logits): it computes its whole prompt.
"""
from __future__ import annotations

from pyengine.server.parsing import token_text
from pyengine.server.shaping import _safe_lp, completion_logprobs


def _entry_dict(entry) -> dict:
    return {tid: lp.logprob for tid, lp in entry.items()}


def echo_logprobs(tokenizer, prompt_ids: list[int], entries: list | None, k: int) -> dict:
    """The legacy logprobs object of the echoed prompt (first token null), offsets from 0."""
    first, _ = token_text(tokenizer, prompt_ids[0])
    rest = completion_logprobs(tokenizer, prompt_ids[1:], [_entry_dict(e) for e in (entries or [None])[1:]], k,
                                 len(first))
    return {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
            "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}


def joined(prompt_part: dict, completion_part: dict | None) -> dict:
    """The echoed prompt's logprobs followed by the completion's."""
    if completion_part is None:
        return prompt_part
    return {key: prompt_part[key] + completion_part[key] for key in prompt_part}


def vllm_prompt_logprobs(tokenizer, entries: list | None) -> list | None:
    """vLLM's JSON shape: null, then {str(id): {"logprob", "rank", "decoded_token"}} per prompt token."""
    if entries is None:
        return None
    return [None if e is None else
            {str(tid): {"logprob": _safe_lp(lp.logprob), "rank": lp.rank,
                        "decoded_token": token_text(tokenizer, tid)[0]} for tid, lp in e.items()}
            for e in entries]


def decorate(response: dict, parsed, prompt_logprobs: dict, tokenizer) -> dict:
    """Add the vLLM ``prompt_logprobs`` a request asked for to its response (per choice, or top-level for chat)."""
    if parsed.prompt_logprobs is None:
        return response
    if parsed.kind == "chat":
        response["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, prompt_logprobs.get(0))
    else:
        for choice in response["choices"]:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, prompt_logprobs.get(choice["index"] // parsed.n))
    return response
