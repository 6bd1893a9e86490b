"""S19 POST /v1/embeddings (OpenAI's shape): a decoder language model's pooled final hidden state.

Each input runs through the engine as a prefill-only request (engine/pooling.py; not a separate model load):
its final hidden state after the final norm, pooled over its tokens — the last token's state ("last", the
default: the only state of a causal model that has seen the whole input) or their mean ("mean") — and
L2-normalized ("normalize": false keeps the raw vector). It is NOT a trained embedding model: it serves
similarity ranking of near-duplicates and topic overlap, not retrieval-tuned search.

Body: ``input`` (a string, a list of strings, a list of token ids or a list of token-id lists; at most
MAX_INPUTS items), ``model``, ``encoding_format`` ("float", default, or "base64": little-endian float32 bytes),
``dimensions`` (400 unless it is the model's hidden size: no truncation), ``user``; extensions ``pooling``
("last" | "mean") and ``normalize`` (bool). ``usage`` counts the input tokens.

    curl http://127.0.0.1:8000/v1/embeddings -H 'Content-Type: application/json' \\
         -d '{"input": ["The capital of France is Paris.", "Paris is in France."]}'
"""
from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass

import numpy as np

from pyengine.engine.pooling import POOLING_TYPES, PoolingParams
from pyengine.server import parsing as P
from pyengine.server import serving as S
from pyengine.server.engine_loop import Aborted, EngineFailure
from pyengine.server.errors import APIError, bad_param, engine_failed

MAX_INPUTS = 256


@dataclass
class EmbeddingRequest:
    prompts: list[list[int]]
    params: PoolingParams
    encoding_format: str
    user: str | None = None


def parse_embeddings(body: dict, tokenizer, limits) -> EmbeddingRequest:
    """POST /v1/embeddings body -> EmbeddingRequest (token ids per input); APIError naming the bad field."""
    limits = P._limits(limits)
    vocab = tokenizer.vocab_size
    inp = body.get("input")
    if inp is None:
        raise APIError(400, "input is required", param="input", code="missing_required_parameter")
    if isinstance(inp, str):
        inp = [inp]
    if not isinstance(inp, list) or not inp:
        raise bad_param("input", "input must be a string, a list of strings, a list of token ids or a list of "
                                   "token id lists, and not empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in inp):
        inp = [inp]
    if len(inp) > MAX_INPUTS:
        raise bad_param("input", f"input has {len(inp)} items; at most {MAX_INPUTS} per request")
    prompts = []
    for i, item in enumerate(inp):
        if isinstance(item, str):
            if not item:
                raise bad_param("input", f"input[{i}] is an empty string")
            ids = P.encode_prompt(tokenizer, item, limits.max_model_len, "input", add_special_tokens=True,
                                  parse_special=False)
            if not ids:
                raise bad_param("input", f"input[{i}] encodes to no tokens")
        elif isinstance(item, list) and item:
            ids = P._check_ids(item, vocab, f"input[{i}]", param="input")
        else:
            raise bad_param("input", f"input[{i}] must be a non-empty string or a non-empty list of token ids")
        if len(ids) >= limits.max_model_len:
            raise P._too_long(limits.max_model_len, f"input[{i}] has {len(ids)} tokens", "input")
        prompts.append(ids)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad_param("encoding_format", f"encoding_format must be 'float' or 'base64', got {fmt!r}")
    dims = P._int(body, "dimensions", 1)
    pooling = body.get("pooling", "last")
    if pooling not in POOLING_TYPES:
        raise bad_param("pooling", f"pooling must be one of {', '.join(POOLING_TYPES)}, got {pooling!r}")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_param("user", "user must be a string")
    params = PoolingParams(pooling=pooling, normalize=P._bool(body, "normalize", True), dimensions=dims)
    return EmbeddingRequest(prompts, params, fmt, user)


def encode_vector(v: np.ndarray, fmt: str):
    if fmt == "base64":
        return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in v]


async def run(state, req: EmbeddingRequest, api_id: str) -> dict:
    """Add every input to the engine (all or none), wait for their pooled states, answer in OpenAI's shape."""
    queue: asyncio.Queue = asyncio.Queue()
    rids = [f"{api_id}-{i}" for i in range(len(req.prompts))]
    pending: set[str] = set()
    try:
        for rid, ids in zip(rids, req.prompts):
            state.admission.admit(rid, 1, len(ids))
            pending.add(rid)
            await state.loop.add_request(rid, {"prompt_token_ids": ids}, req.params, queue)
    except Exception as exc:
        for rid in pending:
            state.loop.abort(rid)
            state.admission.release(rid)
        if isinstance(exc, APIError):
            raise
        err = S.engine_error(exc)
        if "dimensions" in str(exc):
            err.param = "dimensions"
        raise err from exc
    vectors: dict[str, np.ndarray] = {}
    try:
        while pending:
            item = await queue.get()
            rid = item.request_id
            if rid not in pending:
                continue
            state.admission.release(rid)
            if isinstance(item, EngineFailure):
                raise S.engine_error(item.exc) if S.is_unavailable(item.exc) else engine_failed()
            if isinstance(item, Aborted):
                raise APIError(503, f"request aborted: {item.reason}", type="server_error", code="aborted")
            if item.finished:
                pending.discard(rid)
                vectors[rid] = item.pooled
    finally:
        for rid in pending:             # an error or a cancelled handler: nothing keeps running
            state.loop.abort(rid)
            state.admission.release(rid)
    n = sum(len(p) for p in req.prompts)
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(vectors[rid], req.encoding_format)}
            for i, rid in enumerate(rids)]
    return {"object": "list", "data": data, "model": state.model_id, "usage": {"prompt_tokens": n, "total_tokens": n}}
