"""S19 prompt logprobs (echo + logprobs, vLLM's prompt_logprobs) and /v1/embeddings on the real SmolLM2 server,
driven by the official `openai` client and raw httpx. Reference: HF transformers' full-sequence log-softmax and
last_hidden_state (tests/golden/prompt_outputs_smollm2.json, scripts/make_golden_prompt_outputs.py).
"""
from __future__ import annotations

import base64
import json
import pathlib

import httpx
import numpy as np
import openai
import pytest

from pyengine.model_files import default_model_path
from pyengine.server.app import create_app, served_names
from pyengine.server.http_server import ServerThread

GOLDEN = json.loads((pathlib.Path(__file__).parent / "golden" / "prompt_outputs_smollm2.json").read_text())
CASES = [c for c in GOLDEN["cases"] if len(c["prompt_ids"]) <= 40]


@pytest.fixture(scope="module")
def server():
    from pyengine.engine.llm_engine import LLMEngine

    path = default_model_path()
    engine = LLMEngine(path, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256)
    model_id, aliases = served_names(path)
    with ServerThread(create_app(engine, model_id=model_id, aliases=aliases)) as srv:
        srv.model_id, srv.tok = model_id, engine.get_tokenizer()
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_echo_logprobs_scoring_only_matches_transformers(server, client):
    case = CASES[0]
    r = client.completions.create(model=server.model_id, prompt=case["prompt"], echo=True, logprobs=5, max_tokens=0)
    ch = r.choices[0]
    assert ch.text == case["prompt"] and ch.finish_reason == "length"
    lp = ch.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == case["prompt"] and len(lp.tokens) == len(case["prompt_ids"])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    err = max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], case["prompt_logprobs"][1:]))
    assert err < 1e-3, err
    for i, top in enumerate(lp.top_logprobs[1:]):
        assert len(top) == 5
        assert abs(max(top.values()) - case["top5"][i]["logprobs"][0]) < 1e-3
    assert r.usage.prompt_tokens == len(case["prompt_ids"]) and r.usage.completion_tokens == 0


def test_multiple_choice_by_echo_ranks_the_correct_answer_first(server, client):
    """lm-evaluation-harness's loglikelihood request: echo the context + continuation, sum the continuation's."""
    items = [("The capital of France is", [" Paris", " Berlin", " Madrid"]),
             ("Water freezes at zero degrees", [" Celsius", " Kelvin", " Newton"]),
             ("One, two, three, four,", [" five", " nine", " twelve"]),
             ("The opposite of hot is", [" cold", " blue", " tall"]),
             ("Monday, Tuesday,", [" Wednesday", " Friday", " Sunday"])]
    for context, choices in items:
        ctx = server.tok.encode(context, add_special_tokens=False)
        prompts = [ctx + server.tok.encode(c, add_special_tokens=False) for c in choices]
        r = client.completions.create(model=server.model_id, prompt=prompts, echo=True, logprobs=0, max_tokens=0)
        scores = [sum(ch.logprobs.token_logprobs[len(ctx):]) for ch in sorted(r.choices, key=lambda c: c.index)]
        assert int(np.argmax(scores)) == 0, (context, scores)


def test_echo_logprobs_with_completion_stream_and_not(server, client):
    case = CASES[1]
    kw = dict(model=server.model_id, prompt=case["prompt_ids"], echo=True, logprobs=2, max_tokens=3, temperature=0)
    r = client.completions.create(**kw)
    lp, n = r.choices[0].logprobs, len(case["prompt_ids"])
    assert len(lp.tokens) == n + 3 and lp.token_logprobs[0] is None
    assert all(x is not None for x in lp.token_logprobs[1:])
    assert abs(lp.token_logprobs[n - 1] - case["prompt_logprobs"][n - 1]) < 1e-3
    prompt_text = server.tok.decode(case["prompt_ids"])
    assert r.choices[0].text.startswith(prompt_text) and lp.text_offset[n] == len(prompt_text)
    chunks = list(client.completions.create(stream=True, **kw))
    first = chunks[0].choices[0]
    assert first.text == prompt_text and first.logprobs.token_logprobs[1:] == lp.token_logprobs[1:n]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text


def test_vllm_prompt_logprobs_on_both_endpoints(server, client):
    case = CASES[0]
    r = client.completions.create(model=server.model_id, prompt=case["prompt_ids"], max_tokens=1,
                                  extra_body={"prompt_logprobs": 2})
    pl = r.choices[0].model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(case["prompt_ids"])
    for i in range(1, len(pl)):
        entry = pl[i][str(case["prompt_ids"][i])]
        assert abs(entry["logprob"] - case["prompt_logprobs"][i]) < 1e-3 and entry["rank"] >= 1
        assert {e["rank"] for e in pl[i].values()} >= {1, 2}
    chat = client.chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=1, extra_body={"prompt_logprobs": 0})
    pl = chat.model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == chat.usage.prompt_tokens
    assert all(len(e) == 1 and next(iter(e.values()))["decoded_token"] for e in pl[1:])


@pytest.mark.parametrize("body", [
    {"logprobs": -1, "echo": True}, {"logprobs": 21, "echo": True}, {"prompt_logprobs": -1},
    {"prompt_logprobs": 21}, {"prompt_logprobs": "2"}, {"max_tokens": 0}, {"max_tokens": -1, "echo": True},
    {"prompt_logprobs": 1, "stream": True}])
def test_bad_values_are_400(server, body):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", **body}, timeout=60)
    assert r.status_code == 400, r.text
    param = r.json()["error"]["param"]
    assert param in body, (param, body)


def test_embeddings_match_transformers_through_openai_client(server, client):
    inputs = [c["prompt_ids"] for c in CASES]
    r = client.embeddings.create(model=server.model_id, input=inputs)         # the client asks for base64
    assert [d.index for d in r.data] == list(range(len(inputs)))
    for case, d in zip(CASES, r.data):
        v, ref = np.asarray(d.embedding), np.asarray(case["embedding_last"])
        assert v.shape == ref.shape and np.linalg.norm(v - ref) / np.linalg.norm(ref) < 1e-3
    n = sum(len(i) for i in inputs)
    assert r.usage.prompt_tokens == n and r.usage.total_tokens == n
    mean = client.embeddings.create(model=server.model_id, input=inputs[0], encoding_format="float",
                                    extra_body={"pooling": "mean"})
    ref = np.asarray(CASES[0]["embedding_mean"])
    assert np.linalg.norm(np.asarray(mean.data[0].embedding) - ref) / np.linalg.norm(ref) < 1e-3
    same = client.embeddings.create(model=server.model_id, input=inputs[0], dimensions=len(ref))
    assert len(same.data[0].embedding) == len(ref)


def test_embeddings_wire_format_and_errors(server):
    url = server.url + "/v1/embeddings"
    texts = ["The capital of France is Paris.", "Paris is the capital of France.", "Bananas are yellow."]
    f = httpx.post(url, json={"input": texts}, timeout=60).json()
    b = httpx.post(url, json={"input": texts, "encoding_format": "base64"}, timeout=60).json()
    assert f["object"] == "list" and f["data"][0]["object"] == "embedding"
    vs = [np.asarray(d["embedding"], np.float32) for d in f["data"]]
    for d, v in zip(b["data"], vs):
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(d["embedding"]), "<f4"), v)
    assert vs[0] @ vs[1] > vs[0] @ vs[2]             # the paraphrase is nearer than the banana
    for body, param in (({"input": texts, "dimensions": 64}, "dimensions"), ({"input": ""}, "input"),
                        ({"input": []}, "input"), ({"input": [[1, 10 ** 7]]}, "input"),
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "x", "pooling": "cls"}, "pooling"), ({}, "input")):
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    again = httpx.post(url, json={"input": texts[:1]}, timeout=60).json()      # nothing was left behind
    assert again["data"][0]["embedding"] == f["data"][0]["embedding"]
