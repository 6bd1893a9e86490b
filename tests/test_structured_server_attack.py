"""Issue 27 (S15) on the wire: grammars compile off the serving loop (server/grammar_worker.GrammarCompiler), so
bombs are refused with a 400 naming the limit while running streams keep their cadence and /health stays
quick; every body of the issue that answered 500 now answers 400 naming its field; the ambiguous GBNF
beside three streams leaves them to finish normally; and a hypothesis fuzz over schemas, regexes, GBNF
and tools never gets a 5xx. Timings are compared within the run (bombs vs. idle), never to constants."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyengine.model_files import default_model_path
from pyengine.server.app import create_app, served_names
from pyengine.server.http_server import ServerThread
from pyengine.server.grammar_worker import GrammarCompiler

AMBIGUOUS = 'root ::= e\ne ::= " " e "x" | " " g "y" | "b"\ng ::= " " e "z" | " " g "w" | "b"'
ASK = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server():
    from pyengine.engine.llm_engine import LLMEngine
    path = default_model_path()
    engine = LLMEngine(path, max_model_len=512, max_num_seqs=8)
    model_id, aliases = served_names(path)
    grammars = GrammarCompiler(max_compile_s=5.0)
    with ServerThread(create_app(engine, model_id=model_id, aliases=aliases, grammars=grammars)) as srv:
        srv.grammars = grammars
        yield srv


def post(server, body, timeout=120):
    return httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **body},
                      timeout=timeout)


# --- the bodies --------------------------------------------------------------------------------
def _schema(schema):
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


REF_CHAIN = {"$defs": {**{f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(600)}, "d600": {"type": "string"}},
             "$ref": "#/$defs/d0"}
BODIES = [   # (body, the field the 400 names, words of its message)
    ({"structured_outputs": {"regex": "(" * 3000 + "a" + ")" * 3000}}, "structured_outputs", "nested deeper"),
    ({"guided_grammar": "root ::= " + "(" * 3000 + '"a"' + ")" * 3000}, "guided_grammar", "nested deeper"),
    ({"structured_outputs": {"json": "[" * 3000 + "]" * 3000}}, "structured_outputs", "nests too deeply"),
    (_schema(REF_CHAIN), "response_format", "deeper than"),
    (_schema({"type": "integer", "minimum": 0, "maximum": 10 ** 400}), "response_format", "maximum"),
    (_schema({"$ref": 5}), "response_format", "$ref must be a string"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": ["f"]}}}, "tool_choice", "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": "f"}]},
                   {"role": "user", "content": "again"}]}, "messages", "tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": "f"},
                   {"role": "user", "content": "again"}]}, "messages", "tool_calls"),
    ({"structured_outputs": {"regex": r"[^\s\S]x"}}, "structured_outputs", "matches nothing"),
    ({"structured_outputs": {"grammar": 'root ::= "a" r\nr ::= "b" r'}}, "structured_outputs", "matches nothing"),
    ({"structured_outputs": {"grammar": 'root ::= "a"{-1}'}}, "structured_outputs", "non-negative"),
    # the bombs: answered at once, naming the limit
    ({"structured_outputs": {"regex": "a{1000}{1000}"}}, "structured_outputs", "--max-grammar-states"),
    (_schema({"type": "number", "minimum": 0, "maximum": 1e308}), "response_format", "grammar too large"),
    ({"structured_outputs": {"grammar": AMBIGUOUS}}, "structured_outputs", "too ambiguous"),
]


def test_bad_bodies_are_400_naming_the_field(server):
    for body, param, words in BODIES:
        r = post(server, body)
        assert r.status_code == 400, (param, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (param, err)
    # refusals are cached: the same bomb again is not compiled again
    before = server.grammars.compiles
    r = post(server, _schema({"type": "number", "minimum": 0, "maximum": 1e308}))
    assert r.status_code == 400 and server.grammars.compiles == before
    # and a good grammar still works (the worker survived all of the above)
    r = post(server, {"structured_outputs": {"choice": ["yes", "no"]}, "max_tokens": 5})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_a_regex_pattern_property_is_not_a_redos(server):
    name = "a" * 40 + "!"
    schema = {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name],
              "patternProperties": {"^(a+)+$": {"type": "integer"}}, "additionalProperties": False}
    r = post(server, {**_schema(schema), "max_tokens": 48})
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    text = choice["message"]["content"]
    assert text.startswith('{"%s":' % name)
    if choice["finish_reason"] == "stop":
        assert all(k == name or set(k) == {"a"} for k in json.loads(text))


# --- running streams are not stalled by bombs --------------------------------------------------------------
async def _stream_gaps(client, url, tokens: int) -> tuple[list[float], str | None]:
    body = {"messages": ASK, "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    gaps, last, reason = [], None, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if last is not None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                gaps.append(now - last)
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                last = now
            if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                reason = chunk["choices"][0]["finish_reason"]
    return gaps, reason


async def _health(client, url, stop: asyncio.Event) -> list[float]:
    out = []
    while not stop.is_set():
        t = time.perf_counter()
        r = await client.get(url + "/health", timeout=60)
        out.append(time.perf_counter() - t)
        assert r.status_code == 200
        await asyncio.sleep(0.02)
    return out


def _bombs(round_: int) -> list[dict]:
    """Eight distinct bombs (distinct per round, so none is answered from the refusal cache)."""
    k = 20 + round_
    return [{"structured_outputs": {"regex": f"(a|b)*a(a|b){{{k}}}"}},
            {"structured_outputs": {"regex": f"(c|d)*c(c|d){{{k}}}"}},
            _schema({"type": "number", "minimum": 0, "maximum": 1e308 - round_ * 1e292}),
            {"structured_outputs": {"regex": f"(e|f)*e(e|f){{{k}}}"}},
            {"structured_outputs": {"regex": "a{1000}{1000}" + "b" * round_}},
            {"structured_outputs": {"regex": r"\w{1000}" + "c" * round_}},
            {"structured_outputs": {"grammar": AMBIGUOUS + f'\nh ::= "{round_}"'}},
            _schema({"type": "string", "minLength": 1000, "maxLength": 1000, "title": str(round_)})]


async def _window(url: str, bombs: list[dict] | None, tokens: int):
    async with httpx.AsyncClient() as client:
        stop = asyncio.Event()
        health = asyncio.create_task(_health(client, url, stop))
        stream = asyncio.create_task(_stream_gaps(client, url, tokens))
        statuses = []
        if bombs:
            await asyncio.sleep(0.5)          # the stream is running
            rs = await asyncio.gather(*[client.post(url + "/v1/chat/completions", timeout=300,
                                                    json={"messages": ASK, "max_tokens": 2, **b}) for b in bombs])
            statuses = [r.status_code for r in rs]
        gaps, reason = await stream
        stop.set()
        return gaps, await health, statuses, reason


def test_bombs_leave_streams_and_health_at_their_idle_cadence(server):
    """Worst inter-token gap of a running stream and worst /health latency while 8 concurrent bombs are
    refused, against the same measures with no bombs just before (2x, compared within this run). The host
    is shared, so a round spoiled by someone else's burst is retried with fresh bombs, up to three rounds
    (the old server stalled every round: 5-18 s per bomb)."""
    asyncio.run(_window(server.url, None, 8))                          # warm up
    for round_ in range(3):
        idle_gaps, idle_health, _, _ = asyncio.run(_window(server.url, None, 32))
        bomb_gaps, bomb_health, statuses, reason = asyncio.run(_window(server.url, _bombs(round_), 32))
        assert statuses == [400] * 8 and reason == "length"
        print(f"round {round_}: worst gap idle {max(idle_gaps):.3f}s bombs {max(bomb_gaps):.3f}s; "
              f"/health idle {max(idle_health):.3f}s bombs {max(bomb_health):.3f}s")
        gap_ok = max(bomb_gaps) <= 2 * max(idle_gaps)
        health_ok = max(bomb_health) <= 2 * max(idle_health)
        if gap_ok and health_ok:
            break
    assert gap_ok and health_ok


def test_jobs_queued_behind_a_killed_worker_are_compiled_not_failed():
    """A worker killed for one grammar's overrun takes the jobs queued behind it down with it; those jobs are
    other requests': they are compiled again on the fresh worker (they were cancelled, which the handler met as
    a 500, when a round of bombs ran on a loaded host)."""
    from pyengine.structured import matcher

    async def run():
        compiler = GrammarCompiler(max_compile_s=5.0)
        try:
            await compiler.start()
            slow = asyncio.create_task(compiler.compile("regex", "(a|b)*a(a|b){12}"))   # ~0.7 s in the worker
            jobs = [asyncio.create_task(compiler.compile("regex", f"q{i}[0-9]{{{i + 2}}}")) for i in range(4)]
            await asyncio.sleep(0.2)                  # submitted, queued behind the slow one
            compiler._kill()                          # as when another grammar overran its budget
            await asyncio.gather(slow, return_exceptions=True)
            return await asyncio.gather(*jobs, return_exceptions=True), compiler.kills
        finally:
            compiler.close()
    results, kills = asyncio.run(run())
    assert results == [None] * 4 and kills == 1
    assert all(matcher.cached_automaton(matcher.spec_key("regex", f"q{i}[0-9]{{{i + 2}}}")) for i in range(4))


def test_the_ambiguous_grammar_beside_three_streams(server):
    async def run():
        async with httpx.AsyncClient() as client:
            streams = [asyncio.create_task(_stream_gaps(client, server.url, 24)) for _ in range(3)]
            await asyncio.sleep(0.3)
            r = await client.post(server.url + "/v1/chat/completions", timeout=120,
                                  json={"messages": ASK, "max_tokens": 20, "stream": True,
                                        "structured_outputs": {"grammar": AMBIGUOUS}})
            return r, await asyncio.gather(*streams)
    r, results = asyncio.run(run())
    assert r.status_code == 400 and "too ambiguous" in r.json()["error"]["message"]
    assert [reason for _, reason in results] == ["length"] * 3


# --- fuzz: no body gets a 5xx ------------------------------------------------------------------------------
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 30, 10 ** 30), st.floats(allow_nan=False,
                    allow_infinity=False), st.text(max_size=8))
_keyword = st.sampled_from(["type", "enum", "const", "properties", "required", "additionalProperties", "anyOf",
                            "oneOf", "allOf", "$ref", "items", "prefixItems", "minItems", "maxItems", "minLength",
                            "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
                            "patternProperties", "propertyNames", "uniqueItems", "minProperties", "$defs"])
_type = st.sampled_from(["object", "array", "string", "number", "integer", "boolean", "null", "nope"])
_schema_st = st.recursive(
    st.one_of(_scalar, st.builds(lambda t: {"type": t}, _type), st.just({"$ref": "#"}),
              st.just({"$ref": "#/$defs/a"})),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_keyword, inner, max_size=4),
                            st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=12)
_regex = st.text(alphabet="ab()[]{}|*+?^$\\.-,0123456789dws:", max_size=24)
_GBNF_CHARS = 'ab"()[]{}|*+?r -,0123456789\\'
_gbnf = st.builds(lambda a, b: f"root ::= {a}\nr ::= {b}", st.text(alphabet=_GBNF_CHARS, max_size=16),
                  st.text(alphabet=_GBNF_CHARS, max_size=12))
_tools = st.lists(st.one_of(_scalar, st.fixed_dictionaries({"type": st.just("function"), "function": st.one_of(
    _scalar, st.fixed_dictionaries({"name": st.one_of(st.just("f"), _scalar), "parameters": _schema_st}))})),
    max_size=3)
_body = st.one_of(
    st.builds(lambda s: _schema(s), _schema_st),
    st.builds(lambda s: {"structured_outputs": {"json": s}}, _schema_st),
    st.builds(lambda r: {"structured_outputs": {"regex": r}}, _regex),
    st.builds(lambda g: {"structured_outputs": {"grammar": g}}, _gbnf),
    st.builds(lambda c: {"structured_outputs": {"choice": c}}, st.lists(_scalar, max_size=4)),
    st.builds(lambda t, c: {"tools": t, "tool_choice": c}, _tools,
              st.one_of(_scalar, st.sampled_from(["auto", "required", "none"]),
                        st.builds(lambda n: {"type": "function", "function": {"name": n}}, _scalar))),
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(body=_body)
def test_fuzz_no_5xx(server, body):
    t = time.perf_counter()
    r = post(server, {**body, "max_tokens": 1}, timeout=60)
    assert r.status_code < 500, (body, r.text[:300])
    assert time.perf_counter() - t < 30            # hang detection, not a speed target
