"""S14 in the browser worker's Python half (web/pyworker.py, run in CPython here): a speculative config given at
load drafts and verifies, streams several tokens per step as protocol events, and gives the plain worker's
greedy tokens; a bad config is a readable error that keeps the previous model."""
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
