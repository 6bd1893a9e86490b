"""Issue 29 in Pyodide: lean SmolLM2 through the byte-held products (layers/wasm_lean.py: Q4_1 quants held as int8,
the Q8_0 head cast whole) reproduces HF transformers' top-20 logprobs (|d| <= 1e-3, the prefill path: blocks
scaled in place) and greedy tokens (the decode path: scales folded per block) on a golden prompt, through the
browser worker's Python half (web/pyworker.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from pyodide_harness import harness

pytestmark = [pytest.mark.pyodide, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden" / "generation_smollm2.json"
WEB = HERE.parent / "web"

SNIPPET = r"""
import json, sys
sys.path.insert(0, '/work/web')
from pyworker import WorkerSession
from golden_checks import check_greedy, check_top_logprobs, full_forward_logits
from pyengine import tuning
from pyengine.layers.linear import LeanLinear
assert tuning.LEAN_LAYOUT == 'bytes'
golden = json.load(open('/work/golden/generation_smollm2.json'))
session = WorkerSession()
info = session.load(MODEL_BYTES, mode='lean')
lean = [lin for _, lin in session.engine.runner.weights.linears() if isinstance(lin, LeanLinear)]
held = sum(lin.held is not None for lin in lean)
print(f"lean matrices {len(lean)}, held as bytes {held}")
assert info['mode'] == 'lean' and lean and held == len(lean)
stops = session.engine.get_tokenizer().stop_token_ids
bad = []
for case in golden['cases'][:1]:
    ids = case['prompt_ids'] + case['greedy_ids'][:-1]
    logits = full_forward_logits(session.engine.runner, ids, [e['position'] for e in case['top_logprobs']])
    bad += check_top_logprobs(logits, case)
    session.start('g', case['prompt'], max_tokens=8, temperature=0.0)
    events = []
    while session.has_work():
        events += session.step()
    done = [e for e in events if e['type'] == 'done']
    bad += check_greedy(done[0]['tokenIds'], case, 8, stops)
    print('case ok' if not bad else bad)
assert not bad, bad
"""


def test_lean_bytes_golden_in_pyodide():
    from pyengine.model_files import default_model_path

    report = harness.run_in_pyodide(SNIPPET, model=default_model_path(),
                                    files={"/work/golden/generation_smollm2.json": GOLDEN,
                                           "/work/web/pyworker.py": WEB / "pyworker.py"}, timeout=1200)
    assert report["ok"], harness.describe(report)
    assert report["stdout"].count("case ok") == 1, report["stdout"]
