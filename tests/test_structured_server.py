"""S15 on the OpenAI server with the official `openai` client: response_format (json_object, json_schema,
`chat.completions.parse` with a Pydantic model), vLLM's structured_outputs extra body, and tools (named,
required, parallel, auto), streamed and not. Outputs are checked with jsonschema / pydantic. The same requests
on a speculative server built from `pyengine serve --speculative-config` arguments: greedy output equals the
plain server's, and its drafts of constrained sequences are accepted and cut by the grammar."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pyengine.model_files import default_model_path
from pyengine.server.app import create_app, served_names
from pyengine.server.http_server import ServerThread

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["tz"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    from pyengine.engine.llm_engine import LLMEngine
    path = default_model_path()
    engine = LLMEngine(path, max_model_len=1024, max_num_seqs=8)
    model_id, aliases = served_names(path)
    with ServerThread(create_app(engine, model_id=model_id, aliases=aliases)) as srv:
        srv.model_id = model_id
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def args_of(call, tool):
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_response_format_json_schema_and_object(client, server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
              "rank": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["city", "rank"]}
    r = client.chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": "Name a city and its rank."}],
        temperature=1.0, seed=4, max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model=server.model_id, messages=ASK, temperature=0, max_tokens=12,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")


class Capital(BaseModel):
    country: str = Field(max_length=12)
    capital: str = Field(max_length=12)
    population_millions: int = Field(ge=0, le=99)


def test_parse_with_pydantic_model(client, server):
    r = client.chat.completions.parse(model=server.model_id, response_format=Capital, temperature=0.7, seed=1,
                                      max_tokens=40,
                                      messages=[{"role": "user", "content": "Give France's capital as JSON."}])
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Capital)
    assert Capital.model_validate_json(r.choices[0].message.content) == parsed


def test_structured_outputs_extra_body_on_completions(client, server):
    r = client.completions.create(model=server.model_id, prompt="Is the sky blue? Answer:", max_tokens=5,
                                  temperature=1.0, seed=2, extra_body={"structured_outputs": {"choice": [" yes", " no"]}})
    assert r.choices[0].text in (" yes", " no")
    r = client.completions.create(model=server.model_id, prompt="A date:", max_tokens=12, temperature=1.0, seed=3,
                                  extra_body={"structured_outputs": {"regex": r" \d{4}-\d{2}-\d{2}"}})
    import re
    assert re.fullmatch(r" \d{4}-\d{2}-\d{2}", r.choices[0].text)
    r = client.completions.create(model=server.model_id, prompt="JSON:", max_tokens=6, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].text.startswith("{")


def test_tools_named_and_required(client, server):
    r = client.chat.completions.create(model=server.model_id, messages=ASK, tools=[WEATHER, TIME], max_tokens=30,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       temperature=1.0, seed=5)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args_of(call, WEATHER)
    r = client.chat.completions.create(model=server.model_id, messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
                                       tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=6)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    args_of(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])


def test_tools_streamed_as_the_client_assembles_them(client, server):
    for tool_choice in ({"type": "function", "function": {"name": "get_time"}}, "required"):
        with client.chat.completions.stream(model=server.model_id, messages=ASK, tools=[WEATHER, TIME],
                                            tool_choice=tool_choice, max_tokens=60, temperature=1.0,
                                            seed=7) as s:
            for _ in s:
                pass
            final = s.get_final_completion()
        ch = final.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
        for call in ch.message.tool_calls:
            args_of(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in ch.message.tool_calls] == ["get_time"]


def test_tools_auto_and_none_are_well_formed(client, server):
    r = client.chat.completions.create(model=server.model_id, messages=ASK, tools=[WEATHER], max_tokens=20,
                                       temperature=0)
    ch = r.choices[0]
    if ch.message.tool_calls:                      # the model chose to call
        assert ch.finish_reason == "tool_calls"
        args_of(ch.message.tool_calls[0], WEATHER)
    else:
        assert isinstance(ch.message.content, str) and ch.finish_reason in ("stop", "length")
    r = client.chat.completions.create(model=server.model_id, messages=ASK, tools=[WEATHER], tool_choice="none",
                                       max_tokens=4, temperature=0)
    assert not r.choices[0].message.tool_calls


def test_bad_structured_requests_are_400(client, server):
    cases = [dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema":
                  {"type": "integer", "multipleOf": 3}}}),
             dict(response_format={"type": "xml"}),
             dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {"regex": "a"}}),
             dict(extra_body={"structured_outputs": {"regex": "(a"}}),
             dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
             dict(tools=[{"type": "retrieval"}])]
    for kw in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server.model_id, messages=ASK, max_tokens=4, **kw)
        assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="multipleOf"):
        client.chat.completions.create(model=server.model_id, messages=ASK, max_tokens=4, **cases[0])


# --- S15 x S14: the same requests on a speculative server (`pyengine serve --speculative-config`) ------------
PEOPLE = [{"role": "user", "content": 'Here are people as JSON: {"name":"Alice","age":31} {"name":"Bob","age":42} '
                                      '{"name":"Carol","age":27}. Give one more person as JSON.'}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
          "age": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["name", "age"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def spec_server():
    import argparse

    from pyengine.cli.serve import add_arguments, make_app
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--max-model-len", "1024", "--max-num-seqs", "8", "--no-tokenizer-process",
                         "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                                             "prompt_lookup_min": 1, "adaptive": False})])
    app, engine, model_id = make_app(args)
    with ServerThread(app) as srv:
        srv.model_id, srv.engine = model_id, engine
        yield srv


def test_speculative_server_response_format_equals_plain(client, server, spec_server):
    spec_client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    before = spec_server.engine.stats()
    texts = []
    for c, srv in ((client, server), (spec_client, spec_server)):
        r = c.chat.completions.create(model=srv.model_id, messages=PEOPLE, temperature=0, max_tokens=40,
                                      response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        texts.append(r.choices[0].message.content)
    assert texts[1] == texts[0]                              # greedy: speculation changes nothing
    jsonschema.validate(json.loads(texts[1]), PERSON)
    st = spec_server.engine.stats()
    assert st["spec_decode_num_accepted_tokens"] > before["spec_decode_num_accepted_tokens"]
    assert st["spec_decode_num_grammar_cut_tokens"] > before["spec_decode_num_grammar_cut_tokens"]
    # sampled, streamed, and through the client's parse with a Pydantic model
    with spec_client.chat.completions.stream(model=spec_server.model_id, messages=PEOPLE, temperature=1.0, seed=9,
                                             max_tokens=40, response_format=fmt) as s:
        for _ in s:
            pass
        final = s.get_final_completion()
    jsonschema.validate(json.loads(final.choices[0].message.content), PERSON)
    r = spec_client.chat.completions.parse(model=spec_server.model_id, response_format=Capital, temperature=0.7,
                                           seed=1, max_tokens=40, messages=[{"role": "user", "content":
                                                                             "Give France's capital as JSON."}])
    assert isinstance(r.choices[0].message.parsed, Capital)
    r = spec_client.chat.completions.create(model=spec_server.model_id, messages=ASK, tools=[WEATHER, TIME],
                                            max_tokens=60, tool_choice="required", parallel_tool_calls=False,
                                            temperature=1.0, seed=6)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    for call in ch.message.tool_calls:
        args_of(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])
