"""S22 in Pyodide: Gemma 3 270M through the unchanged wheel and the browser worker's Python half (web/pyworker.py):
top-20 log-probabilities within 1e-3 of HF transformers at every recorded position of every golden prompt
(tests/golden/generation_gemma3.json), the 1524-token prompt past the 512-token sliding window included, and
greedy tokens through the worker's prompt -> engine.step() path (the shortest prompt; all of them in CPython). The worker picks lean weights for Gemma (its
float32 weights exceed pyworker.RESIDENT_MAX_BYTES); the report's wasm heap size is printed."""
from __future__ import annotations

from pathlib import Path

import pytest

from pyodide_harness import harness

from model_paths import model_path

pytestmark = [pytest.mark.pyodide, pytest.mark.slow]

HERE = Path(__file__).resolve().parent

SNIPPET = r"""
import json, sys, time
sys.path.insert(0, '/work/web')
from pyworker import WorkerSession
from golden_checks import check_top_logprobs, full_forward_logits
golden = json.load(open('/work/golden/generation_gemma3.json'))
MARGIN = 0.01
session = WorkerSession()
t0 = time.perf_counter()
info = session.load(MODEL_BYTES, max_model_len=2048)
print(f"engine built in {time.perf_counter() - t0:.1f}s: mode {info['mode']}, {info['kvBlocks']} KV blocks")
bad = [] if info['mode'] == 'lean' else [f"expected lean weights for Gemma, got {info['mode']}"]
cases = golden['cases']
for case in cases:
    ids = case['prompt_ids'] + case['greedy_ids'][:-1]
    t0 = time.perf_counter()
    logits = full_forward_logits(session.engine.runner, ids, [e['position'] for e in case['top_logprobs']])
    bad += check_top_logprobs(logits, case)
    print(f"{len(case['prompt_ids']):5d} prompt tokens: logprobs checked in {time.perf_counter() - t0:.1f}s")
for case, n in ((cases[0], 16),):          # the long prompt's logits are checked above; its greedy run in CPython
    n_prompt = session.start('g', case['prompt'], max_tokens=n, temperature=0.0)
    if n_prompt != len(case['prompt_ids']):
        bad.append(f"{case['prompt'][:30]!r}: {n_prompt} prompt tokens, golden {len(case['prompt_ids'])}")
    events = []
    t0 = time.perf_counter()
    while session.has_work():
        events += session.step()
    done = [e for e in events if e['type'] == 'done']
    got, want = done[0]['tokenIds'], case['greedy_ids'][:n]
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if len(got) != n or (first is not None and case['greedy_margins'][first] >= MARGIN):
        bad.append(f"{case['prompt'][:30]!r}: greedy {got} want {want}")
    print(f"{n} greedy tokens after {len(case['prompt_ids'])} prompt tokens in {time.perf_counter() - t0:.1f}s")
for b in bad:
    print('FAIL', b)
assert not bad, f"{len(bad)} golden mismatches"
"""


def test_gemma3_golden_inside_pyodide():
    golden = HERE / "golden" / "generation_gemma3.json"
    report = harness.run_in_pyodide(SNIPPET, files={"/work/golden/generation_gemma3.json": golden,
                                                    "/work/web/pyworker.py": HERE.parent / "web" / "pyworker.py"},
                                    model=model_path("gemma3"), timeout=1800)
    print(report.get("stdout", ""), f"wasm heap {report.get('wasm_memory_mb')} MB", report.get("timings_ms"))
    assert report.get("ok"), harness.describe(report)
