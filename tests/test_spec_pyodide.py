"""S14 inside Pyodide: the browser worker's Python half (web/pyworker.py), loaded with an n-gram speculative
config, drafts, verifies and emits the same greedy tokens as without speculation, on the unchanged wheel."""
from __future__ import annotations

from pathlib import Path

import pytest

from pyodide_harness import harness

pytestmark = [pytest.mark.pyodide, pytest.mark.slow]

HERE = Path(__file__).resolve().parent

SNIPPET = r"""
import sys
sys.path.insert(0, '/work/web')
from pyworker import WorkerSession
runs = {}
for name, spec in (("plain", None), ("ngram", '{"method": "ngram", "num_speculative_tokens": 4}')):
    s = WorkerSession()
    info = s.load(MODEL_BYTES, max_model_len=128, speculative=spec)
    s.start('r', '1, 2, 3, 4, 1, 2, 3, 4, 1, 2,', max_tokens=12, temperature=0.0)
    events = []
    while s.has_work():
        events += s.step()
    done = [e for e in events if e['type'] == 'done'][0]
    runs[name] = (done, s.stats(), info)
    del s
plain, ngram = runs["plain"][0], runs["ngram"][0]
st = runs["ngram"][1]
print("drafts", st["spec_decode_num_drafts"], "accepted", st["spec_decode_num_accepted_tokens"])
assert runs["ngram"][2]["speculative"] == "ngram"
assert ngram["tokenIds"] == plain["tokenIds"], (ngram["tokenIds"], plain["tokenIds"])
assert st["spec_decode_num_accepted_tokens"] > 0
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
