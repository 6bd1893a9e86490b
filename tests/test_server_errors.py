"""S19 error paths of the OpenAI server: statuses and OpenAI-shaped bodies naming the parameter.

These run against a small stand-in engine that follows the `LLMEngine` contract (add_request / step /
abort_request / EngineOverloaded), so they are fast; the real model is exercised in the other
test_server_*.py files. Bodies are checked against the OpenAI error schema with jsonschema.
"""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import jsonschema
import pytest

from pyengine.engine.outputs import CompletionOutput, RequestOutput
from pyengine.server.app import create_app
from pyengine.server.http_server import ServerThread

ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string", "minLength": 1}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}


# --- a contract-following stand-in engine ---------------------------------------------------------
class EngineOverloaded(RuntimeError):
    """Same name as the engine's: the server recognises it by name."""


class ByteTokenizer:
    """Bytes are tokens 0..255; 256 = end of sequence."""
    vocab_size = 260
    eos_token_id = 256
    bos_token_id = None
    stop_token_ids = [256]

    def encode(self, text, add_special_tokens=False, parse_special=True):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")

    def token_bytes(self, tid):
        return bytes([tid]) if tid < 256 else b""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


class FakeEngine:
    """Generates the prompt's bytes again, one token per running sequence per step; KV in 16-token blocks."""

    def __init__(self, max_model_len=512, max_waiting=None, max_num_seqs=4):
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.max_num_seqs = max_num_seqs
        self.tok = ByteTokenizer()
        self.requests: dict[str, dict] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.lock = threading.Lock()   # asserts the server never calls in concurrently
        self.calls_overlapped = False

    def get_tokenizer(self):
        return self.tok

    def health(self):
        return "ok", None

    def model_metadata(self):
        return None

    def add_request(self, request_id, prompt, params, priority=0):
        if not self.lock.acquire(blocking=False):
            self.calls_overlapped = True
            self.lock.acquire()
        try:
            if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
                raise EngineOverloaded("waiting queue is full")
            ids = list(prompt["prompt_token_ids"])
            self.requests[request_id] = {"ids": ids, "params": params, "out": [[] for _ in range(params.n)],
                                         "done": [None] * params.n}
            self.waiting.append(request_id)
        finally:
            self.lock.release()

    def abort_request(self, request_id):
        self.requests.pop(request_id, None)
        for q in (self.waiting, self.running):
            if request_id in q:
                q.remove(request_id)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def num_used_blocks(self):
        return sum(-(-(len(r["ids"]) + max(map(len, r["out"]))) // 16) * len(r["out"])
                   for rid, r in self.requests.items() if rid in self.running)

    def stats(self):
        return {"running": len(self.running), "waiting": len(self.waiting), "prefix_cache_hit_rate": 0.0}

    def step(self):
        if not self.lock.acquire(blocking=False):
            self.calls_overlapped = True
            self.lock.acquire()
        try:
            import time
            time.sleep(0.002)
            while self.waiting and len(self.running) < self.max_num_seqs:
                self.running.append(self.waiting.pop(0))
            outs = []
            for rid in list(self.running):
                r = self.requests[rid]
                comps = []
                for i, out in enumerate(r["out"]):
                    delta = ""
                    if r["done"][i] is None:
                        tid = r["ids"][len(out) % len(r["ids"])]
                        out.append(tid)
                        delta = self.tok.decode([tid])
                        if len(out) >= r["params"].max_tokens:
                            r["done"][i] = "length"
                    comps.append(CompletionOutput(i, self.tok.decode(out), list(out), None, r["done"][i],
                                                  delta_text=delta))
                finished = all(r["done"])
                outs.append(RequestOutput(rid, None, r["ids"], comps, finished))
                if finished:
                    self.running.remove(rid)
                    del self.requests[rid]
            return outs
        finally:
            self.lock.release()


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(max_model_len=512, max_waiting=3, max_num_seqs=2)
    app = create_app(engine, model_id="fake-model.Q4_1", aliases=["fake-model"], api_key="sekret",
                     max_body_bytes=1_000_000)
    with ServerThread(app) as srv:
        srv.engine = engine
        yield srv


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer sekret"}, timeout=30) as c:
        yield c


def check_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    jsonschema.validate(body, ERROR_SCHEMA)
    if param != "any":
        assert body["error"]["param"] == param, body
    return body["error"]


CHAT = {"model": "fake-model.Q4_1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMP = {"model": "fake-model.Q4_1", "prompt": "hello", "max_tokens": 4}


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("temperature", 2.5), ("temperature", "hot"), ("top_p", 2), ("top_p", 0),
    ("n", 0), ("n", 1.5), ("max_tokens", 0), ("max_completion_tokens", -3), ("presence_penalty", 3),
    ("frequency_penalty", -2.5), ("seed", "x"), ("stop", 5), ("stop", [""]), ("top_logprobs", 3),
    ("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0), ("stream", "yes"), ("ignore_eos", 1),
    ("logit_bias", {"abc": 1}), ("logit_bias", {"999": 1}), ("logit_bias", {"5": 101}), ("logit_bias", [1]),
    ("stream_options", {"include_usage": True}), ("user", 7),
])
def test_bad_chat_parameter_is_400_naming_it(client, field, value):
    err = check_error(client.post("/v1/chat/completions", json={**CHAT, field: value}), 400, field)
    assert field in err["message"]


@pytest.mark.parametrize("field,value", [("logprobs", 50), ("logprobs", -1), ("prompt", []), ("prompt", [1, 999]),
                                         ("prompt", [[1, 2], 3]), ("prompt", 5), ("echo", "no")])
def test_bad_completion_parameter_is_400(client, field, value):
    check_error(client.post("/v1/completions", json={**COMP, field: value}), 400, field)


def test_missing_messages_and_prompt(client):
    body = {k: v for k, v in CHAT.items() if k != "messages"}
    err = check_error(client.post("/v1/chat/completions", json=body), 400, "messages")
    assert "messages" in err["message"]
    check_error(client.post("/v1/completions", json={"max_tokens": 3}), 400, "prompt")
    for bad in ([], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 5}], "hi"):
        check_error(client.post("/v1/chat/completions", json={**CHAT, "messages": bad}), 400, "messages")


def test_unknown_model_is_404_and_aliases_work(client):
    err = check_error(client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404, "model")
    assert err["code"] == "model_not_found" and "gpt-9" in err["message"]
    for name in ("fake-model", "FAKE-MODEL.q4_1"):
        r = client.post("/v1/completions", json={**COMP, "model": name})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "fake-model.Q4_1"


def test_prompt_over_context_is_400_with_lengths(client):
    long = "x" * 600   # 600 byte-tokens > max_model_len 512
    err = check_error(client.post("/v1/completions", json={**COMP, "prompt": long}), 400, "prompt")
    assert "512" in err["message"] and "600" in err["message"]
    err = check_error(client.post("/v1/completions", json={**COMP, "prompt": "x" * 500, "max_tokens": 100}),
                      400, "max_tokens")
    assert "512" in err["message"] and "500" in err["message"] and "100" in err["message"]


def test_api_key_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=headers)
        err = check_error(r, 401, None)
        assert err["code"] == "invalid_api_key"
    check_error(httpx.get(server.url + "/v1/models"), 401)
    assert httpx.get(server.url + "/health").status_code == 200   # probes need no key


def test_invalid_json_and_non_object(client):
    for raw in (b"{not json", b"\xff\xfe", b"[1, 2]", b""):
        err = check_error(client.post("/v1/chat/completions", content=raw,
                                      headers={"content-type": "application/json"}), 400)
        assert "JSON" in err["message"]


def test_body_over_limit_is_413(client):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 1_100_000}]}
    err = check_error(client.post("/v1/chat/completions", json=big), 413)
    assert "1000000" in err["message"]
    # a body just under the limit is parsed (and here rejected for its length, not its size)
    ok = {**COMP, "prompt": "x" * 900_000}
    check_error(client.post("/v1/completions", json=ok), 400, "prompt")


def test_unknown_route_is_openai_shaped_404(client):
    check_error(client.get("/v1/nothing"), 404)
    check_error(client.get("/v1/chat/completions"), 405)


def test_burst_over_waiting_limit_gets_429_and_nothing_is_lost(server):
    """max_waiting=3, max_num_seqs=2: a burst of 40 must see some 429s, and every accepted request
    must end with a full completion; the engine then holds nothing."""
    async def burst():
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": "Bearer sekret"},
                                     timeout=60) as c:
            async def one(i):
                stream = i % 2 == 0
                body = {**COMP, "prompt": f"req{i:03d}", "max_tokens": 6, "stream": stream}
                if not stream:
                    return await c.post("/v1/completions", json=body), None
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    text = (await r.aread()).decode()
                    return r, text
            return await asyncio.gather(*(one(i) for i in range(40)))

    results = asyncio.run(burst())
    statuses = [r.status_code for r, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) > 0 and statuses.count(200) >= 3
    for i, (r, text) in enumerate(results):
        expected = f"req{i:03d}"
        if r.status_code == 429:
            err = check_error(httpx.Response(429, content=(text or r.text).encode()), 429, None) \
                if text is not None else check_error(r, 429, None)
            assert err["code"] == "engine_overloaded"
            assert r.headers.get("retry-after") == "1"
        elif text is None:
            choice = r.json()["choices"][0]
            assert choice["text"] == expected[:6] and choice["finish_reason"] == "length"
        else:
            events = [e for e in text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
            assert "".join(c["choices"][0]["text"] for c in chunks) == expected[:6]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert not server.engine.requests and server.engine.num_used_blocks() == 0
    assert not server.engine.calls_overlapped


def test_n_and_multiple_prompts_numbering(client):
    r = client.post("/v1/completions", json={**COMP, "prompt": ["abc", "xyz"], "n": 2, "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["abc", "abc", "xyz", "xyz"]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 12, "total_tokens": 18}


class FlakyEngine(FakeEngine):
    """Its next step raises once `fail_next` is set (an engine bug, say)."""
    fail_next = False

    def step(self):
        if self.fail_next:
            self.fail_next = False
            for rid in list(self.requests):
                self.abort_request(rid)
            raise RuntimeError("kaboom")
        return super().step()


def test_engine_failure_is_500_and_server_recovers():
    engine = FlakyEngine()
    with ServerThread(create_app(engine, model_id="m")) as srv:
        engine.fail_next = True
        err = check_error(httpx.post(srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3}), 500)
        assert err["type"] == "server_error" and err["code"] == "engine_error"
        assert "kaboom" not in err["message"]          # the exception's text stays in the server's log
        engine.fail_next = True
        with httpx.stream("POST", srv.url + "/v1/completions",
                          json={"prompt": "abc", "max_tokens": 3, "stream": True}) as r:
            assert r.status_code == 200     # headers were sent before the engine failed
            events = [e for e in r.read().decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        jsonschema.validate(json.loads(events[-2].removeprefix("data: ")), ERROR_SCHEMA)
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "abc"
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}


class BlockedEngine(FakeEngine):
    """Its first step does not return until the test says so: a long step (a big prefill, say), made
    deterministic by an event instead of a sleep."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.in_step, self.release = threading.Event(), threading.Event()

    def step(self):
        self.in_step.set()
        assert self.release.wait(timeout=120), "the test never released the step"
        return super().step()


def test_event_loop_keeps_serving_during_a_step():
    engine = BlockedEngine()
    with ServerThread(create_app(engine, model_id="m")) as srv:
        async def go():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                gen = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}))
                while not engine.in_step.is_set():
                    await asyncio.sleep(0.005)
                health = await c.get("/health")         # step() is still blocked: it runs in a worker thread
                still_in_step = not engine.release.is_set()
                engine.release.set()
                return health.status_code, still_in_step, (await gen).json()
        status, during, body = asyncio.run(go())
    assert status == 200 and during       # /health answered while step() was still running
    assert body["choices"][0]["text"] == "ab"


def test_served_names():
    from pyengine.server.app import served_names
    assert served_names("/m/SmolLM2-135M-Instruct.Q4_1.gguf") == ("SmolLM2-135M-Instruct.Q4_1",
                                                                 ["SmolLM2-135M-Instruct"])
    assert served_names("/m/gemma.GGUF") == ("gemma", [])
    assert served_names(None) == ("pyengine", [])
