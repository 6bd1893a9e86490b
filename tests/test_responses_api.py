"""`POST /v1/responses` (issue 32) through the official `openai` client: `client.responses.create` and
`client.responses.stream` on SmolLM2, checked against the chat endpoint's greedy answer to the same conversation;
structured output through text.format (validated by jsonschema); function tools; a thinking model's reasoning
item (scripted runner of tests/test_reasoning.py); and the refusals of what a stateless server cannot do."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from test_reasoning import ANSWER, QWEN3_STYLE, THOUGHT, serve


@pytest.fixture(scope="module")
def server():
    from pyengine.engine.llm_engine import LLMEngine
    from pyengine.model_files import default_model_path
    from pyengine.server.app import create_app
    from pyengine.server.http_server import ServerThread
    engine = LLMEngine(default_model_path(), max_model_len=1024, max_num_seqs=4)
    with ServerThread(create_app(engine, model_id="smol")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat_answer(client, messages, **kw) -> str:
    r = client.chat.completions.create(model="smol", messages=messages, temperature=0, **kw)
    return r.choices[0].message.content


def test_create_and_stream_equal_the_chat_answer(client):
    q = "What is the capital of France?"
    want = chat_answer(client, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": q}],
                       max_tokens=24)
    r = client.responses.create(model="smol", instructions="Answer briefly.", input=q, max_output_tokens=24,
                                temperature=0)
    assert r.object == "response" and r.id.startswith("resp")
    assert r.output_text == want and r.output[0].type == "message"
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    want = chat_answer(client, [{"role": "user", "content": q}], max_tokens=64)
    deltas = []
    with client.responses.stream(model="smol", input=[{"role": "user", "content": [{"type": "input_text", "text": q}]}],
                                 max_output_tokens=64, temperature=0) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == want == final.output_text
    assert final.status == "completed" and final.output[0].status == "completed"


def test_incomplete_when_max_output_tokens_cuts(client):
    r = client.responses.create(model="smol", input="Count from one to fifty in words.", max_output_tokens=4,
                                temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 4


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    r = client.responses.create(model="smol", input="Name a city and its country as JSON.", temperature=0,
                                max_output_tokens=64,
                                text={"format": {"type": "json_schema", "name": "place", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_function_tools_and_their_results(client):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                             "additionalProperties": False}}]
    r = client.responses.create(model="smol", input="What is the weather in Paris?", tools=tools,
                                tool_choice="required", parallel_tool_calls=False, max_output_tokens=64,
                                temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    with client.responses.stream(model="smol", input="What is the weather in Paris?", tools=tools,
                                 tool_choice="required", parallel_tool_calls=False, max_output_tokens=64,
                                temperature=0) as stream:
        final = stream.get_final_response()
    assert [o.type for o in final.output] == ["function_call"]
    # the conversation goes on with the call and its output in `input`
    follow = client.responses.create(model="smol", tools=tools, max_output_tokens=16, temperature=0, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert follow.status in ("completed", "incomplete")


def test_what_a_stateless_server_refuses(server):
    for body, param in (({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"input": "hi", "background": True}, "background"),
                        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
                        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
                        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
                        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
                        ({"input": []}, "input")):
        r = httpx.post(server.url + "/v1/responses", json={"model": "smol", **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())


def test_reasoning_item_first(tokenizer):
    with serve(tokenizer, QWEN3_STYLE, f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}") as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = c.responses.create(model="qwen3-style", input="Hi!", max_output_tokens=64)
        assert [o.type for o in r.output] == ["reasoning", "message"]
        assert r.output_text == ANSWER and r.output[0].content[0].text.strip() == THOUGHT
        with c.responses.stream(model="qwen3-style", input="Hi!", max_output_tokens=64) as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
        assert "".join(deltas) == ANSWER and [o.type for o in final.output] == ["reasoning", "message"]
        assert final.output[0].id.startswith("rs_") and final.output[1].id.startswith("msg_")


@pytest.fixture(scope="module")
def tokenizer():
    from pyengine.gguf.reader import GGUFFile
    from pyengine.model_files import default_model_path
    from pyengine.tokenizer import Tokenizer
    return Tokenizer.from_gguf(GGUFFile(default_model_path()))
