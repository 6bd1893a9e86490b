"""S19 The OpenAI-compatible server on the real engine and SmolLM2, driven by real clients.

A uvicorn server runs in a background thread on a free loopback port (one model load per module).
Clients: the official `openai` package (sync and async, streaming and not, chat and completions) and
raw httpx for the wire format. Independent references: greedy ids and raw top logprobs from HF
transformers (tests/golden/generation_smollm2.json), the OpenAI error schema, and the usage numbers
the responses report (checked against /metrics).
"""
from __future__ import annotations

import asyncio
import json
import pathlib
import re
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from pyengine.server import web as web_server
from pyengine.model_files import default_model_path
from pyengine.server.app import create_app, served_names
from pyengine.server.http_server import ServerThread

GOLDEN = json.loads((pathlib.Path(__file__).parent / "golden" / "generation_smollm2.json").read_text())
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def server():
    from pyengine.engine.llm_engine import LLMEngine

    path = default_model_path()
    engine = LLMEngine(path, max_model_len=MAX_MODEL_LEN, max_num_seqs=16)
    model_id, aliases = served_names(path)
    with ServerThread(create_app(engine, model_id=model_id, aliases=aliases)) as srv:
        srv.engine, srv.model_id, srv.tok = engine, model_id, engine.get_tokenizer()
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def async_client(server) -> openai.AsyncOpenAI:
    # one per asyncio.run(): an async client is bound to the event loop it first ran on
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def safe_greedy_cases(min_margin=0.1, steps=12):
    """Golden cases whose first `steps` greedy choices win by a clear logit margin, so a float32
    reimplementation must reproduce them exactly."""
    out = []
    for case in GOLDEN["cases"]:
        margins = case["greedy_margins"][:steps]
        if len(margins) == steps and min(margins) > min_margin and len(case["prompt_ids"]) < 200:
            out.append(case)
    assert len(out) >= 2, "golden file should offer at least two clear-margin cases"
    return out


class Lockstep:
    """Streaming checked by events, not by the clock: while active, each engine step waits until the client
    has read every token produced so far. A server that buffered its stream would leave the client with
    nothing to read: the step then times out (counted in `stalls`) and lockstep ends, so the test fails
    instead of hanging. `saw(n)` is called by the client for each token it reads off the socket."""

    def __init__(self, engine, timeout: float = 30.0):
        self.engine, self.timeout = engine, timeout
        self.cond = threading.Condition()
        self.produced = self.seen = self.stalls = self.steps = 0

    def __enter__(self):
        original = self.engine.step

        def step():
            with self.cond:
                if not self.stalls and not self.cond.wait_for(lambda: self.seen >= self.produced, self.timeout):
                    self.stalls += 1
            outputs = original()
            with self.cond:
                self.produced += sum(len(o.delta_token_ids) for out in outputs for o in out.outputs)
                self.steps += 1
            return outputs

        self.engine.step = step          # the engine loop looks `step` up on every call
        return self

    def __exit__(self, *exc):
        del self.engine.step             # the class's method again

    def saw(self, n: int) -> None:
        with self.cond:
            self.seen += n
            self.cond.notify_all()


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model_id]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


LOGPROB_TOL = 1e-3      # the engine against HF in float32, as tests/test_model_golden.py


def test_completion_logprobs_match_transformers(server, client):
    """Every golden position of every golden case: the prompt is the golden tokens up to that position
    (HF's greedy continuation teacher-forced past the prompt), logprobs=5 on the one generated token. The
    top-5 must be HF's top-5 ids (read through the token text the API returns) with HF's values to 1e-3, and
    the sampled (greedy) token HF's argmax with its logprob."""
    tok = server.tok

    def text_of(i: int) -> str:          # how the completions API names a token
        return tok.token_bytes(i).decode("utf-8", errors="replace")

    checked = 0
    for case in GOLDEN["cases"]:
        ids = case["prompt_ids"] + case["greedy_ids"]
        for ref in case["top_logprobs"]:
            p = ref["position"]
            r = client.completions.create(model=server.model_id, prompt=ids[:p + 1], max_tokens=1, temperature=0,
                                          logprobs=5, extra_body={"ignore_eos": True})
            lp = r.choices[0].logprobs
            assert len(lp.tokens) == 1 and lp.text_offset == [0]
            top = lp.top_logprobs[0]
            want = dict(zip(ref["ids"][:5], ref["logprobs"][:5]))
            names = [text_of(i) for i in want]
            where = f"{case['prompt'][:24]!r} position {p}"
            if len(set(names)) == 5:         # five distinct token texts: the ids are recoverable exactly
                near_tie = ref["logprobs"][4] - ref["logprobs"][5] < LOGPROB_TOL
                assert set(top) == set(names) or near_tie, (where, top, names)
            for i, v in want.items():
                if text_of(i) in top and names.count(text_of(i)) == 1:
                    assert top[text_of(i)] == pytest.approx(v, abs=LOGPROB_TOL), (where, i)
            if ref["logprobs"][0] - ref["logprobs"][1] > LOGPROB_TOL:      # a clear argmax
                assert lp.tokens[0] == names[0], where
                assert lp.token_logprobs[0] == pytest.approx(ref["logprobs"][0], abs=LOGPROB_TOL), where
            checked += 1
    assert checked == sum(len(c["top_logprobs"]) for c in GOLDEN["cases"]) == 42


def test_chat_stream_equals_nonstream_and_usage(server, client):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three colours."}]

    def nonstream():
        return client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=6,
                                              temperature=0)

    def stream():
        return list(client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=6,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True}))

    with ThreadPoolExecutor(2) as pool:   # both in flight at once (one sync client, two threads)
        full_f, chunks_f = pool.submit(nonstream), pool.submit(stream)
        full, chunks = full_f.result(), chunks_f.result()
    text = full.choices[0].message.content
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    prompt = server.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert full.usage.prompt_tokens == len(server.tok.encode(prompt, add_special_tokens=False))
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert 1 <= full.usage.completion_tokens <= 6

    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)


def test_sse_one_event_per_token(server):
    """curl -N style: raw SSE events reach the client as the tokens are generated (in lockstep with the
    engine's steps), one token per event, then [DONE]."""
    body = {"model": server.model_id, "prompt": GOLDEN["cases"][0]["prompt"], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 0}
    received = ""
    with Lockstep(server.engine) as lock, \
            httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for raw in r.iter_raw():   # what a client reads off the socket, as it arrives
            received += raw.decode()
            *complete, received_tail = received.split("\n\n")
            for event in complete:
                if event != "data: [DONE]":
                    lock.saw(len(json.loads(event.removeprefix("data: "))["choices"][0]["logprobs"]["tokens"]))
            received = received_tail
    assert lock.stalls == 0, "the stream was buffered: the client had nothing to read while the engine waited"
    assert lock.seen == lock.produced == 8 and lock.steps >= 8
    assert received == ""


def test_sse_events_split_one_token_each(server):
    body = {"model": server.model_id, "prompt": GOLDEN["cases"][0]["prompt"], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        events = r.read().decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    texts = [p["choices"][0]["text"] for p in payloads]
    assert sum(1 for t in texts if t) >= 6         # ~one event per generated token (held-back UTF-8 aside)


def test_greedy_matches_transformers_async_concurrent(server):
    """Async client, token-id prompts at temperature 0, streamed and not, plus a chat stream, all in flight
    together (the engine batches them): each text is HF's greedy continuation and usage is exact."""
    cases = safe_greedy_cases()[:2]
    k = 8

    async def go():
        aclient = async_client(server)

        async def nonstream(case):
            r = await aclient.completions.create(model=server.model_id, prompt=case["prompt_ids"], max_tokens=k,
                                                 temperature=0, extra_body={"ignore_eos": True})
            assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == server.model_id
            assert r.choices[0].finish_reason == "length"
            return r.choices[0].text, r.usage

        async def stream(case):
            parts, use = [], None
            async for chunk in await aclient.completions.create(
                    model=server.model_id, prompt=case["prompt_ids"], max_tokens=k, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                parts += [c.text for c in chunk.choices]
                use = chunk.usage or use
            return "".join(parts), use

        async def chat_stream():
            stream = await aclient.chat.completions.create(
                model=server.model_id, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4,
                temperature=0, stream=True)
            return [c async for c in stream]

        async def chat():
            r = await aclient.chat.completions.create(
                model=server.model_id, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4,
                temperature=0)
            return r.choices[0].message.content

        async with aclient:
            return await asyncio.gather(chat_stream(), chat(), *(f(c) for c in cases for f in (nonstream, stream)))

    chunks, chat_text, *got = asyncio.run(go())
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_text   # same greedy reply
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    want = [server.tok.decode(c["greedy_ids"][:k], skip_special_tokens=True) for c in cases for _ in range(2)]
    assert [text for text, _ in got] == want
    for (_, use), case in zip(got, [c for c in cases for _ in range(2)]):
        n = len(case["prompt_ids"])
        assert (use.prompt_tokens, use.completion_tokens, use.total_tokens) == (n, k, n + k)


def test_curl_n_streams_chat_tokens_as_they_come(server):
    """`curl -N` (no buffering) sees the chat deltas line by line as the engine produces them (lockstep with
    the engine's steps), before [DONE]."""
    curl = shutil.which("curl")
    assert curl, "curl is missing: scripts/test.sh installs it"
    body = json.dumps({"model": server.model_id, "messages": [{"role": "user", "content": "Tell me a story."}],
                       "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": True})
    lines = []
    with Lockstep(server.engine) as lock:
        proc = subprocess.Popen([curl, "-sN", server.url + "/v1/chat/completions", "-H",
                                 "content-type: application/json", "-d", body], stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:   # read as curl prints
            if line.strip():
                lines.append(line.strip())
                if line.strip() != "data: [DONE]":
                    choices = json.loads(line.strip().removeprefix("data: "))["choices"]
                    lp = choices[0].get("logprobs") if choices else None
                    lock.saw(len(lp["content"]) if lp else 0)
        assert proc.wait(timeout=120) == 0
    assert lock.stalls == 0, "curl -N got the deltas in one burst at the end, not as they were generated"
    assert lock.seen == lock.produced == 6
    assert lines[-1] == "data: [DONE]"
    deltas = [json.loads(ln.removeprefix("data: "))["choices"][0]["delta"].get("content") for ln in lines[:-1]]
    assert sum(1 for d in deltas if d) >= 4


def reference_choices(prompt_ids: list[int], params, steps: int) -> list[list[tuple[int, float]]]:
    """The engine's sampling pipeline done by hand, one choice after the other: choice i draws from its own
    seeded stream (sampler.make_rng), every token from a fresh unbatched, uncached forward pass of
    prompt + the choice's tokens so far (a separate runner), through sampler.sample_row with the prompt and
    output ids for the penalties. Returns per choice [(token id, raw logprob)]."""
    from pyengine.engine.model_runner import ModelRunner
    from pyengine.layers.sampler import log_softmax, make_rng, sample_row

    runner = ModelRunner(default_model_path(), max_model_len=256, num_blocks=16, max_num_batched_tokens=256,
                         max_num_seqs=1, weights_mode="lean")
    choices = []
    for i in range(params.n):
        rng = make_rng(params, None, i)
        out: list[tuple[int, float]] = []
        for _ in range(steps):
            ids = [t for t, _ in out]
            logits = np.array(runner.run(runner.contiguous_batch(prompt_ids + ids, 0))[0], dtype=np.float32)
            t = sample_row(logits, params, rng, prompt_ids, ids)
            out.append((t, float(log_softmax(logits)[t])))
        choices.append(out)
    return choices


def test_n_choices_seeded_and_logprobs(server, client):
    from pyengine.sampling_params import SamplingParams

    messages = [{"role": "user", "content": "Write a word."}]
    kw = dict(model=server.model_id, messages=messages, max_tokens=4,
              temperature=1.0, seed=1234, n=3, logprobs=True, top_logprobs=2, top_p=0.95, presence_penalty=0.5,
              frequency_penalty=0.3, user="tester", stop="\n\n",
              extra_body={"top_k": 40, "min_p": 0.02, "repetition_penalty": 1.1})
    with ThreadPoolExecutor(2) as pool:   # the same seeded request twice, concurrently
        a, b = pool.map(lambda _: client.chat.completions.create(**kw), range(2))
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]   # seeded
    # ... and each choice is what the sampler gives by hand for that choice's seed stream
    params = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1234, top_p=0.95, top_k=40, min_p=0.02,
                            presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1, stop=["\n\n"])
    prompt = server.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = server.tok.encode(prompt, add_special_tokens=False)
    assert a.usage.prompt_tokens == len(prompt_ids)
    reference = reference_choices(prompt_ids, params, 4)
    stops = set(server.tok.stop_token_ids)
    for choice, ref in zip(a.choices, reference):
        content = choice.logprobs.content
        n = len(content)
        assert [e.bytes for e in content] == [list(server.tok.token_bytes(t)) for t, _ in ref[:n]], choice.index
        for entry, (_, lp) in zip(content, ref):
            assert entry.logprob == pytest.approx(lp, abs=1e-3)
        if choice.finish_reason == "length":
            assert n == 4
        else:                     # ended early: at a stop token, or at the stop string
            assert choice.finish_reason == "stop" and (ref[n - 1][0] in stops or "\n\n" in
                                                        server.tok.decode([t for t, _ in ref[:n]]))
    assert len({tuple(t for t, _ in r) for r in reference}) > 1          # the three streams differ
    counted = 0
    for choice in a.choices:
        content = choice.logprobs.content
        counted += len(content)
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= -1e30
            assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6
    assert a.usage.completion_tokens == counted


def test_stop_string_and_length(server, client):
    case = safe_greedy_cases()[0]
    base = server.tok.decode(case["greedy_ids"][:10], skip_special_tokens=True)   # HF's greedy text
    words = re.findall(r"[A-Za-z]{3,}", base)
    assert words, base
    stop = words[-1]
    cut = client.completions.create(model=server.model_id, prompt=case["prompt_ids"], max_tokens=10,
                                    temperature=0, stop=[stop, "zzzq"], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == base[:base.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logit_bias_forces_a_token(server, client):
    tid = server.tok.encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(model=server.model_id, prompt="I like", max_tokens=3, temperature=0,
                                  logit_bias={str(tid): 100}, logprobs=0)
    tok_text = server.tok.token_bytes(tid).decode()
    assert r.choices[0].logprobs.tokens == [tok_text] * 3
    assert [list(d) for d in r.choices[0].logprobs.top_logprobs] == [[tok_text]] * 3   # logprobs=0: sampled only
    assert r.choices[0].text == tok_text * 3


def test_context_limit_names_lengths(server):
    ids = [1000 + (i % 500) for i in range(MAX_MODEL_LEN + 5)]
    r = httpx.post(server.url + "/v1/completions", json={"model": server.model_id, "prompt": ids, "max_tokens": 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and str(MAX_MODEL_LEN) in err["message"] and str(len(ids)) in err["message"]
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": server.model_id, "prompt": ids[:1000], "max_tokens": 100})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_metrics_counters_equal_usage(server, client):
    before = httpx.get(server.url + "/metrics").text
    def completion(max_tokens, prompt):
        r = client.completions.create(model=server.model_id, prompt=prompt, max_tokens=max_tokens,
                                      temperature=0, extra_body={"ignore_eos": True})
        return r.usage, [r.choices[0].finish_reason]

    def completion_stream(max_tokens, prompt):
        chunks = list(client.completions.create(model=server.model_id, prompt=prompt, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 2
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return chunks[-1].usage, reasons

    def chat():
        chunks = list(client.chat.completions.create(
            model=server.model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
            stream=True, stream_options={"include_usage": True}))
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return chunks[-1].usage, reasons

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(completion, 3, "One, two,"), pool.submit(completion_stream, 4, "The sky is"),
                   pool.submit(chat)]
        done = [f.result() for f in futures]
    usages = [u for u, _ in done]
    reasons = [r for _, rs in done for r in rs]
    # a request's latency histograms are recorded once its response is complete, which a client can see
    # first: wait for that event (the three e2e observations), not for a fixed time
    deadline = time.monotonic() + 60
    while True:
        after = httpx.get(server.url + "/metrics").text
        delta = lambda name, labels="": metric(after, name, labels) - metric(before, name, labels)  # noqa: E731
        if delta("pyengine_e2e_request_latency_seconds_count") >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert delta("pyengine_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("pyengine_generation_tokens_total") == sum(u.completion_tokens for u in usages)
    for reason in set(reasons):
        assert delta("pyengine_request_success_total", f'{{finish_reason="{reason}"}}') == reasons.count(reason)
    assert delta("pyengine_time_to_first_token_seconds_count") == 3
    assert delta("pyengine_e2e_request_latency_seconds_count") == 3
    assert delta("pyengine_inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in usages)
    for gauge in ("pyengine_num_requests_running", "pyengine_num_requests_waiting", "pyengine_kv_cache_used_blocks",
                  "pyengine_prefix_cache_hit_rate"):
        assert re.search(rf"^{gauge} \S+$", after, re.M), gauge
    assert metric(after, "pyengine_kv_cache_used_blocks") == 0


def test_vllm_metric_names_beside_ours(server, client):
    """Gateways scrape vLLM's names: the same measurements under `vllm:*`, labelled model_name, with vLLM v1's
    histogram buckets, parsed by prometheus_client's own parser; counters move with usage and the prefix cache."""
    from prometheus_client.parser import text_string_to_metric_families

    from pyengine.server.metrics import VLLM_ITL_BUCKETS, VLLM_REQUEST_LATENCY_BUCKETS, VLLM_TTFT_BUCKETS

    def families():
        return {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}

    def value(fams, family, sample, **labels):
        return sum(s.value for s in fams[family].samples
                   if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))

    before = families()
    prompt = "Prefix caching reuses the key and value blocks of a prompt it has seen before. " * 3
    usages = [client.completions.create(model=server.model_id, prompt=prompt, max_tokens=4, temperature=0,
                                        extra_body={"ignore_eos": True}).usage for _ in range(2)]
    deadline = time.monotonic() + 60
    while True:
        after = families()
        if (value(after, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count")
                - value(before, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count")
                >= 2 or time.monotonic() > deadline):
            break
        time.sleep(0.01)
    kinds = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
             "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
             "vllm:prefix_cache_hits": "counter", "vllm:prompt_tokens": "counter",
             "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
             "vllm:num_preemptions": "counter", "vllm:time_to_first_token_seconds": "histogram",
             "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram"}
    for name, kind in kinds.items():
        assert after[name].type == kind, name
        assert {s.labels.get("model_name") for s in after[name].samples} == {server.model_id}, name
    for name, buckets in (("vllm:time_to_first_token_seconds", VLLM_TTFT_BUCKETS),
                          ("vllm:inter_token_latency_seconds", VLLM_ITL_BUCKETS),
                          ("vllm:e2e_request_latency_seconds", VLLM_REQUEST_LATENCY_BUCKETS)):
        les = [float(s.labels["le"]) for s in after[name].samples if s.name == name + "_bucket"]
        assert les[:-1] == list(buckets) and les[-1] == float("inf"), name
    d = lambda fam, sample, **lab: value(after, fam, sample, **lab) - value(before, fam, sample, **lab)  # noqa
    assert d("vllm:prompt_tokens", "vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert d("vllm:generation_tokens", "vllm:generation_tokens_total") == 8
    assert d("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 2
    assert d("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 2
    assert d("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 6
    # the second request found the first one's full prompt blocks: hits counted in tokens, as vLLM counts them
    stats = server.engine.stats()
    assert value(after, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == \
        stats["prefix_cache_query_tokens"]
    assert value(after, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == stats["prefix_cache_hit_tokens"]
    assert d("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") >= 16
    assert 0 <= value(after, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") <= 1


def test_demo_and_api_in_one_process(server):
    """The web demo's app mounted under the API app: one process, one port, both answer."""
    demo = web_server.create_app(model=default_model_path())
    app = create_app(server.engine, model_id=server.model_id, demo_app=demo)
    with ServerThread(app) as srv:
        page = httpx.get(srv.url + "/")
        assert page.status_code == 200 and "<html" in page.text.lower()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
