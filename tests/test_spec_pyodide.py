"""S14 inside Pyodide: the browser worker's Python half (web/pyworker.py), loaded with an n-gram speculative
config, drafts, verifies and emits the same greedy tokens as without speculation, on the unchanged wheel; the JSON
toggle (S15) too, with its drafts checked against the grammar and the output valid JSON."""
from __future__ import annotations

from pathlib import Path

import pytest

from pyodide_harness import harness

pytestmark = [pytest.mark.pyodide, pytest.mark.slow]

HERE = Path(__file__).resolve().parent

SNIPPET = r"""
import sys
sys.path.insert(0, '/work/web')
import json
from pyworker import WorkerSession
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                     "age": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["name", "age"]})
runs = {}
FORCED = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": false}'
for name, spec in (("plain", None), ("ngram", '{"method": "ngram", "num_speculative_tokens": 4}'), ("forced", FORCED)):
    s = WorkerSession()
    info = s.load(MODEL_BYTES, max_model_len=128, speculative=spec)
    s.start('r', '1, 2, 3, 4, 1, 2, 3, 4, 1, 2,', max_tokens=12, temperature=0.0)
    events = []
    while s.has_work():
        events += s.step()
    done = [e for e in events if e['type'] == 'done'][0]
    # S15: the JSON toggle on the same session (drafts checked against the grammar)
    s.start('j', 'People: {"name":"Ann","age":31} {"name":"Bob","age":42} {"name":"', max_tokens=16,
            temperature=0.0, json_schema=SCHEMA)
    events = []
    while s.has_work():
        events += s.step()
    runs[name] = (done, s.stats(), info, [e for e in events if e['type'] == 'done'][0])
    del s
plain, ngram = runs["plain"][0], runs["ngram"][0]
st = runs["ngram"][1]
print("drafts", st["spec_decode_num_drafts"], "accepted", st["spec_decode_num_accepted_tokens"])
assert runs["ngram"][2]["speculative"] == "ngram"
assert ngram["tokenIds"] == plain["tokenIds"], (ngram["tokenIds"], plain["tokenIds"])
assert st["spec_decode_num_accepted_tokens"] > 0
# the JSON request: same greedy tokens in all three sessions; drafting forced at every decode, drafts are accepted
pj, nj = runs["plain"][3], runs["forced"][3]
print("json", nj["text"], nj["json"], "accepted", nj["numAcceptedTokens"],
      "cut", runs["forced"][1]["spec_decode_num_grammar_cut_tokens"])
assert nj["tokenIds"] == pj["tokenIds"] == runs["ngram"][3]["tokenIds"] and nj["json"] == "valid"
assert nj["numAcceptedTokens"] > 0
json.loads(nj["text"])
"""


def test_ngram_speculation_in_pyodide():
    problem = harness.missing_setup()
    if problem:
        pytest.fail(problem)
    from pyengine.model_files import default_model_path
    report = harness.run_in_pyodide(SNIPPET, model=default_model_path(),
                                    files={"/work/web/pyworker.py": HERE.parent / "web" / "pyworker.py"})
    print(report["stdout"], f"wall {report['wall_s']}s")
    assert report["ok"], harness.describe(report)
    assert "accepted" in report["stdout"]
