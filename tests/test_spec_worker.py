"""S14 in the browser worker's Python half (web/pyworker.py, run in CPython here): a speculative config given at
load drafts and verifies, streams several tokens per step as protocol events, and gives the plain worker's
greedy tokens; a bad config is a readable error that keeps the previous model. The JSON toggle (S15) speculates
too."""
from __future__ import annotations

import json

import pytest

from test_pyodide_worker_session import model_bytes, pyworker, run_all  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow
PROMPT = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,"


def test_worker_with_ngram_speculation_gives_plain_tokens(model_bytes):  # noqa: F811
    plain, spec = pyworker.WorkerSession(), pyworker.WorkerSession()
    plain.load(model_bytes, max_model_len=256)
    info = spec.load(model_bytes, max_model_len=256,
                     speculative=json.dumps({"method": "ngram", "num_speculative_tokens": 4}))
    assert info["speculative"] == "ngram" and plain.load(model_bytes, max_model_len=256)["speculative"] is None
    done = {}
    for name, s in (("plain", plain), ("spec", spec)):
        s.start("r", PROMPT, max_tokens=24, temperature=0.0)
        steps = []
        while s.has_work():
            steps.append(s.step())
        events = [e for st in steps for e in st]
        tokens = [e for e in events if e["type"] == "token"]
        done[name] = next(e for e in events if e["type"] == "done")
        assert [e["tokenId"] for e in tokens] == done[name]["tokenIds"]
        assert "".join(e["text"] for e in tokens) == done[name]["text"]
        if name == "spec":
            assert max(sum(e["type"] == "token" for e in st) for st in steps) > 1   # several tokens a step
    assert done["spec"]["tokenIds"] == done["plain"]["tokenIds"]
    assert done["spec"]["numAcceptedTokens"] > 0 and spec.stats()["spec_decode_num_drafts"] > 0
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        spec.load(model_bytes, speculative='{"method": "ngram"}')
    assert spec.info is info


def test_worker_json_schema_with_speculation(model_bytes):  # noqa: F811
    """S15 x S14 in the worker: the page's JSON toggle on a speculative session gives the plain session's greedy
    tokens, valid against the schema (jsonschema), with drafts of the constrained sequence accepted."""
    import jsonschema
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
              "age": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["name", "age"]}
    prompt = 'People: {"name":"Alice","age":31} {"name":"Bob","age":42} {"name":"Carol","age":27} {"name":"'
    plain, spec = pyworker.WorkerSession(), pyworker.WorkerSession()
    plain.load(model_bytes, max_model_len=256)
    spec.load(model_bytes, max_model_len=256, speculative=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}))
    done = {}
    for name, s in (("plain", plain), ("spec", spec)):
        s.start("j", prompt, max_tokens=40, temperature=0.0, json_schema=json.dumps(schema))
        done[name] = next(e for e in run_all(s) if e["type"] == "done")
    assert done["spec"]["tokenIds"] == done["plain"]["tokenIds"]
    assert done["spec"]["finishReason"] == "stop" and done["spec"]["json"] == "valid"
    jsonschema.validate(json.loads(done["spec"]["text"]), schema)
    assert done["spec"]["numAcceptedTokens"] > 0 and spec.stats()["spec_decode_num_grammar_cut_tokens"] > 0
