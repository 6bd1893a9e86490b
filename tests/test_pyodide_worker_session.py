"""web/pyworker.py (the Python half of the browser's Pyodide worker), run in CPython for fast feedback:
protocol events, cancel, errors. The same code runs inside Pyodide in tests/test_pyodide_generation.py
and in Chromium in e2e/test_demo.py (which also covers the chat template toggle against the golden file).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("pyworker", HERE.parent / "web" / "pyworker.py")
pyworker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pyworker)


@pytest.fixture(scope="module")
def model_bytes() -> bytes:
    from pyengine.model_files import default_model_path
    return Path(default_model_path()).read_bytes()


@pytest.fixture(scope="module")
def session(model_bytes):
    s = pyworker.WorkerSession()
    info = s.load(model_bytes)
    assert info["layers"] == 30 and info["vocabSize"] == 49152 and info["mode"] == pyworker.DEFAULT_WEIGHTS_MODE
    assert set(info["stopTokenIds"]) >= {2}       # <|im_end|> ends a SmolLM2 turn
    return s


def run_all(s) -> list[dict]:
    events = []
    while s.has_work():
        events += s.step()
    return events


def test_generate_streams_tokens_then_done(session):
    n_prompt = session.start("r1", "The capital of France is", max_tokens=5, temperature=0.0)
    assert n_prompt == 5
    events = run_all(session)
    tokens = [e for e in events if e["type"] == "token"]
    done = [e for e in events if e["type"] == "done"]
    assert len(done) == 1 and done[0]["id"] == "r1" and events[-1] is done[0]
    assert [e["tokenId"] for e in tokens] == done[0]["tokenIds"] and len(tokens) == 5
    assert "".join(e["text"] for e in tokens) == done[0]["text"]
    assert done[0]["finishReason"] == "length" and done[0]["tokensPerSecond"] > 0
    assert done[0]["promptTokens"] == 5 and done[0]["ttftMs"] > 0


def test_cancel_mid_generation(session):
    session.start("c1", "Once upon a time", max_tokens=50, temperature=0.0)
    first = session.step()
    assert [e["type"] for e in first] == ["token"]
    done = session.cancel("c1")
    assert done["finishReason"] == "abort" and done["tokenIds"] == [first[0]["tokenId"]]
    assert not session.has_work()
    assert session.cancel("c1") is None           # unknown/finished id: nothing to do


def test_bad_parameters_are_readable_errors(session):
    with pytest.raises(ValueError, match="temperature"):
        session.start("b1", "hi", temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        session.start("b2", "hi", top_p=0.0)
    assert not session.has_work()


def test_failed_load_keeps_the_previous_model(session, model_bytes):
    from pyengine import GGUFError

    before = session.info
    with pytest.raises(GGUFError, match="GGUF"):
        session.load(b"\x07" * 1000)
    with pytest.raises(GGUFError):
        session.load(model_bytes[:65536])          # valid header, truncated tensor data
    assert session.has_model() and session.info is before
    session.start("after", "The capital of France is", max_tokens=2, temperature=0.0)
    assert next(e for e in run_all(session) if e["type"] == "done")["finishReason"] == "length"


def test_no_model_yet():
    s = pyworker.WorkerSession()
    assert not s.has_model() and not s.has_work()
    with pytest.raises(ValueError, match="no model loaded"):
        s.start("x", "hi")


def test_json_schema_toggle_constrains_and_reports(session):
    """S15 through the worker's Python half: a JSON Schema constrains the output (checked with jsonschema),
    an empty schema means any JSON object, and a refused keyword is a readable error."""
    import json

    import jsonschema
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
              "size": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["city", "size"]}
    session.start("j1", "A city:", max_tokens=30, temperature=1.0, seed=3, json_schema=json.dumps(schema))
    done = [e for e in run_all(session) if e["type"] == "done"][0]
    assert done["finishReason"] == "stop" and done["json"] == "valid"
    jsonschema.validate(json.loads(done["text"]), schema)
    session.start("j2", "Data:", max_tokens=3, temperature=0.0, json_schema="")
    done = [e for e in run_all(session) if e["type"] == "done"][0]
    assert done["text"].startswith("{") and done["json"] in ("incomplete", "valid")
    with pytest.raises(ValueError, match="multipleOf"):
        session.start("j3", "x", json_schema='{"type": "integer", "multipleOf": 2}')
    with pytest.raises(ValueError, match="not valid JSON"):
        session.start("j4", "x", json_schema='{"type": ')
