"""The Python half of the browser worker (S22): turns worker-protocol messages into pyengine calls.

web/worker.js runs this file inside Pyodide and drives it: ``load`` once per model, ``start`` per
``generate`` message, then ``step`` from a JavaScript loop that yields to the event loop between steps
(so ``cancel`` messages are handled mid-generation). Only the public pyengine API is used, and the
model arrives as bytes: the package is the unchanged wheel and never sees a file system.
Each method returns plain dicts/lists that JavaScript posts as protocol messages.
"""
from __future__ import annotations

import json
import time

# One tab generates for one user: a small batch keeps the KV cache and the activation arena small (the
# defaults size them for a server); long prompts are prefilled in chunks of max_num_batched_tokens.
BROWSER_LIMITS = {"max_num_seqs": 2, "max_num_batched_tokens": 256}
# Chosen by measurement (scripts/measure_web.py, headless Chromium, SmolLM2-135M Q4_1, 32 greedy tokens):
#   resident (fp32 weights): wasm memory ~1000 MB, decode 9.4 tok/s on a quiet host (rows staged a block at a
#   time, tuning.RESIDENT_STAGE_BYTES); lean: Q4_0/Q4_1 quants held as int8 bytes (tuning.LEAN_LAYOUT), ~450 MB,
#   decode 7.7 tok/s (docs/performance.md, "The final table (session 12)")
# Decode speed is what a user watches, and ~1000 MB fits a desktop tab's 4 GB wasm32 limit, so resident is the
# default; the page asks for lean on devices reporting < 4 GB (navigator.deviceMemory) or with ?pymode=lean.
DEFAULT_WEIGHTS_MODE = "resident"
# ...for models whose float32 weights fit this budget; larger ones default to lean. Gemma 3 270M's 262144-token
# head alone is 671 MB in float32 (1.07 GB of weights in all, beside the file's own 253 MB in the heap).
RESIDENT_MAX_BYTES = 768 << 20


def choose_mode(gguf, mode: str | None) -> str:
    """The weights mode: the one asked for, else resident when the float32 weights fit RESIDENT_MAX_BYTES."""
    if mode:
        return mode
    float32_bytes = 4 * sum(t.n_elements for t in gguf.tensors.values())
    return DEFAULT_WEIGHTS_MODE if float32_bytes <= RESIDENT_MAX_BYTES else "lean"


def check_messages(messages) -> list[dict]:
    """A conversation from the page: a non-empty list of {"role": "system"|"user"|"assistant", "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be {{role: system|user|assistant, content: string}}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


class WorkerSession:
    def __init__(self):
        self.engine = None
        self.info: dict = {}
        self.requests: dict[str, dict] = {}   # id -> {"t0", "t_first", "n"}

    # load -------------------------------------------------------------------------------------------
    def load(self, data, mode: str | None = None, max_model_len: int = 1024, speculative=None,
             kv_cache_dtype: str | None = None) -> dict:
        """Build an engine from GGUF bytes. The previous engine is replaced only if this one loads, so
        a corrupt file leaves a working page behind. `mode`: "resident" (weights dequantized once, fastest)
        or "lean" (quantized weights, dequantized per layer per step: less memory). `speculative` (S14):
        vLLM's speculative_config as a dict or JSON text, e.g. {"method": "ngram", "num_speculative_tokens": 4}
        (a draft_model's "model" must then be the draft GGUF's bytes: the worker has no file system)."""
        from pyengine import GGUFFile
        from pyengine.engine.args import EngineArgs

        args = EngineArgs(max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype or "auto",
                          speculative_config=speculative, **BROWSER_LIMITS).validate()   # fails before parsing
        t0 = time.perf_counter()
        gguf = GGUFFile(data)                 # zero-copy views into `data`; GGUFError if malformed
        t_parse = time.perf_counter() - t0
        args.model, args.weights_mode = gguf, choose_mode(gguf, mode)
        engine = args.create_engine()         # the same path as LLM, the CLI and the server (one thread here)
        runner, mode = engine.runner, args.weights_mode
        cfg = engine.runner.config
        self.abort_all()
        self.engine = engine
        self.info = {
            "engine": "python",
            "arch": cfg.arch, "layers": cfg.n_layers, "dModel": cfg.d_model, "vocabSize": cfg.vocab_size,
            "params": int(getattr(cfg, "n_params", 0) or 0), "tensors": len(gguf.tensors),
            "name": str(gguf.get("general.name", "") or ""), "mode": mode, "kvBlocks": runner.num_blocks,
            "kvCacheDtype": runner.kv_cache_dtype,
            "stopTokenIds": sorted(int(t) for t in engine.get_tokenizer().stop_token_ids),
            "speculative": None if engine.spec is None else engine.spec.config.method,
            "parseMs": round(t_parse * 1e3, 1), "loadMs": round((time.perf_counter() - t0) * 1e3, 1),
        }
        return self.info

    # generate ---------------------------------------------------------------------------------------
    def start(self, req_id: str, prompt: str, max_tokens: int = 64, temperature: float = 1.0,
              top_p: float = 1.0, top_k: int = -1, seed=None, chat: bool = False, json_schema=None,
              messages=None, speculative=None) -> int:
        """Queue a request; returns its prompt length in tokens. ValueError for bad parameters.
        ``json_schema`` (S15, the page's JSON toggle): a JSON Schema as JSON text (or a dict) constrains the
        output to it; "" or "{}" means any JSON object; None leaves the output free. A schema the grammar
        compiler refuses is a ValueError naming the keyword. ``messages`` (the page's multi-turn chat): the
        whole conversation as [{"role", "content"}, ...] (JSON text or a list), rendered with the model's chat
        template in place of ``prompt``. ``speculative`` (S14): False opts this request out of the engine's
        speculative decoding, True (or None) lets it draft when the engine was loaded with a speculative config."""
        from pyengine import SamplingParams, StructuredOutputsParams

        if self.engine is None:
            raise ValueError("no model loaded: load a GGUF file first")
        if messages is not None:
            messages = check_messages(json.loads(messages) if isinstance(messages, str) else messages)
            text, ids = self.engine.get_tokenizer().encode_chat(messages)
            prompt = {"prompt": text, "prompt_token_ids": ids}
        elif chat:                            # the message's text is plain text: no forged turn (S02)
            text, ids = self.engine.get_tokenizer().encode_chat([{"role": "user", "content": prompt}])
            prompt = {"prompt": text, "prompt_token_ids": ids}
        structured = None
        if json_schema is not None:
            if isinstance(json_schema, str) and json_schema.strip() in ("", "{}"):
                structured = StructuredOutputsParams(json_object=True)
            else:
                if isinstance(json_schema, str):
                    try:
                        json_schema = json.loads(json_schema)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
                structured = StructuredOutputsParams(json=json_schema)
        params = SamplingParams(max_tokens=int(max_tokens), temperature=float(temperature), top_p=float(top_p),
                                top_k=int(top_k), seed=None if seed is None else int(seed),
                                structured_outputs=structured,
                                speculative=True if speculative is None else bool(speculative))
        self.engine.add_request(req_id, prompt, params)
        self.requests[req_id] = {"t0": time.perf_counter(), "t_first": None, "n": 0, "json": structured is not None}
        return len(self.engine.requests[req_id].prompt_token_ids)

    def has_model(self) -> bool:
        return self.engine is not None

    def has_work(self) -> bool:
        return self.engine is not None and self.engine.has_unfinished_requests()

    def step(self) -> list[dict]:
        """One engine step -> protocol events (`token` per new token, `done` per finished request)."""
        events = []
        outputs = self.engine.step()
        now = time.perf_counter()
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue
            comp = out.outputs[0]
            for k, tok in enumerate(comp.delta_token_ids):
                state["n"] += 1
                if state["t_first"] is None:
                    state["t_first"] = now
                events.append({"type": "token", "id": out.request_id, "tokenId": int(tok),
                               "text": comp.delta_text if k == len(comp.delta_token_ids) - 1 else ""})
            if out.finished:
                events.append(self._done(out))
        return events

    def cancel(self, req_id: str) -> dict | None:
        out = self.engine.abort_request(req_id) if self.engine is not None else None
        return None if out is None else self._done(out)

    def abort_all(self) -> None:
        if self.engine is not None:
            for req_id in list(self.engine.requests):
                self.engine.abort_request(req_id)
        self.requests.clear()

    def stats(self) -> dict:
        """The engine's counters (spec_decode_* among them), for the page's status line."""
        return self.engine.stats() if self.engine is not None else {}

    def live(self) -> dict:
        """The engine as the page's live panel draws it, once per step (LLMEngine.snapshot in the page's
        words): KV blocks by state and owner, scheduler queues, prefix-cache and speculative counters, each
        request's reuse / drafts / grammar mask size, and the latest step's time split."""
        snap = self.engine.snapshot()
        return {
            "type": "live", "step": snap["steps"], "mode": self.info.get("mode"), "kvCacheDtype": self.info.get("kvCacheDtype"),
            "running": snap["running"], "waiting": snap["waiting"],
            "blockSize": snap["block_size"], "blocks": snap["blocks"], "owners": snap["owners"],
            "usedBlocks": snap["used_blocks"], "freeBlocks": snap["free_blocks"],
            "cachedBlocks": snap["cached_blocks"], "totalBlocks": snap["total_blocks"],
            "prefixHitTokens": snap["prefix_cache_hit_tokens"], "prefixQueryTokens": snap["prefix_cache_query_tokens"],
            "specDraftTokens": snap["spec_decode_num_draft_tokens"],
            "specAcceptedTokens": snap["spec_decode_num_accepted_tokens"],
            "requests": {rid: {"promptTokens": r["prompt_tokens"], "cachedTokens": r["cached_tokens"],
                               "admitted": r["admitted"], "draftTokens": r["draft_tokens"],
                               "acceptedTokens": r["accepted_tokens"], "grammarMaskSize": r["grammar_mask_size"]}
                         for rid, r in snap["requests"].items()},
            "vocabSize": self.info.get("vocabSize"),
            "stepMs": snap["step_ms"],
        }

    def _done(self, out) -> dict:
        """tokensPerSecond is the decode rate (tokens after the first / time since the first), the figure
        comparable across engines; ttftMs holds the prompt's cost."""
        state = self.requests.pop(out.request_id, None) or {"t0": time.perf_counter(), "t_first": None, "n": 0}
        comp = out.outputs[0]
        end = time.perf_counter()
        n = len(comp.token_ids)
        decode_s = end - state["t_first"] if state["t_first"] is not None else 0.0
        event = {"type": "done", "id": out.request_id, "tokenIds": [int(t) for t in comp.token_ids],
                "text": comp.text, "finishReason": comp.finish_reason,
                "tokensPerSecond": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
                "ttftMs": None if state["t_first"] is None else (state["t_first"] - state["t0"]) * 1e3,
                "promptTokens": len(out.prompt_token_ids or []),
                "cachedTokens": out.metrics.num_cached_tokens if out.metrics else 0,
                "numDraftTokens": out.metrics.num_draft_tokens if out.metrics else 0,
                "numAcceptedTokens": out.metrics.num_accepted_tokens if out.metrics else 0}
        if state.get("json"):
            # S15: the grammar ended the text (finish "stop") and json.loads reads it back
            try:
                json.loads(comp.text)
                event["json"] = "valid" if comp.finish_reason == "stop" else "incomplete"
            except json.JSONDecodeError:
                event["json"] = "incomplete" if comp.finish_reason != "stop" else "invalid"
        return event
