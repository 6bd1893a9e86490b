"""S22 in Pyodide: the unchanged pyengine wheel, given the GGUF as bytes, reproduces HF transformers'
top-20 logprobs (|d| <= 1e-3) and greedy tokens (tests/golden/generation_smollm2.json) inside Pyodide.

The comparison code is tests/pyodide/golden_checks.py, the same functions the CPython side can use, and
generation goes through web/pyworker.py, the browser worker's Python half (prompt text -> engine.step()).
The resident matrices must run as Pyodide's staged rows (tuning.RESIDENT_LAYOUT, RESIDENT_STAGE_BYTES). Every
golden prompt is checked: top-20 logprobs at its 6 golden positions (one teacher-forced forward) and
16 greedy tokens through the worker (fewer when the model ends its turn: the engine stops at the end token,
which must then be HF's token there). Pyodide's NumPy has no BLAS (about 2 GFLOP/s): a few minutes in all.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pyodide_harness import harness

pytestmark = [pytest.mark.pyodide, pytest.mark.slow]

HERE = Path(__file__).resolve().parent

GOLDEN = HERE / "golden" / "generation_smollm2.json"
WEB = HERE.parent / "web"
N_CASES = len(json.loads(GOLDEN.read_text())["cases"])      # all of them (7)
N_GREEDY = 16      # per prompt, through the worker; the logprob positions reach 47 tokens past each prompt

SNIPPET = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, '/work/web')
from pyworker import WorkerSession          # the browser worker's Python half, unchanged
from golden_checks import check_greedy, check_top_logprobs, full_forward_logits
golden = json.load(open('/work/golden/generation_smollm2.json'))
t0 = time.perf_counter()
session = WorkerSession()
info = session.load(MODEL_BYTES)
print(f"engine built in {time.perf_counter() - t0:.1f}s: {info}")
stops = session.engine.get_tokenizer().stop_token_ids
bad = []
# Pyodide's resident layout: (out, in) rows, each L2-sized block staged in the arena's weights scratch
from pyengine import tuning
from pyengine.layers.linear import DenseLinear
runner = session.engine.runner
dense = [lin for _, lin in runner.weights.linears() if isinstance(lin, DenseLinear)]
if not (tuning.RESIDENT_LAYOUT == 'rows' and dense and all(lin.out_in is not None and lin.stage_rows
                                                           and lin.scratch is runner.buffers.lean for lin in dense)):
    bad.append(f"resident matrices not staged: {tuning.RESIDENT_LAYOUT}, {[lin.stage_rows for lin in dense]}")
cases = golden['cases']
assert len(cases) == N_CASES
for case in cases:
    ids = case['prompt_ids'] + case['greedy_ids'][:-1]
    t0 = time.perf_counter()
    logits = full_forward_logits(session.engine.runner, ids, [e['position'] for e in case['top_logprobs']])
    t1 = time.perf_counter()
    bad += check_top_logprobs(logits, case)
    # Greedy through the worker protocol's path: prompt text -> tokens -> engine.step() events.
    n_prompt = session.start('g', case['prompt'], max_tokens=N_GREEDY, temperature=0.0)
    if n_prompt != len(case['prompt_ids']):
        bad.append(f"{case['prompt'][:30]!r}: prompt encodes to {n_prompt} tokens, golden {len(case['prompt_ids'])}")
    events = []
    while session.has_work():
        events += session.step()
    t2 = time.perf_counter()
    done = [e for e in events if e['type'] == 'done']
    streamed = [e['tokenId'] for e in events if e['type'] == 'token']
    if len(done) != 1 or done[0]['tokenIds'] != streamed:
        bad.append(f"stream/done mismatch: {done} vs {streamed}")
        continue
    bad += check_greedy(done[0]['tokenIds'], case, N_GREEDY, stops)
    print(f"{case['prompt'][:24]!r}: forward of {len(ids)} tokens {t1 - t0:.1f}s, {len(done[0]['tokenIds'])} greedy tokens "
          f"{t2 - t1:.1f}s (decode {done[0]['tokensPerSecond']:.2f} tok/s, first token {done[0]['ttftMs']:.0f} ms)")
# cancel mid-generation: a `done` with finishReason "abort", nothing left running
session.start('c', 'Once upon a time', max_tokens=100, temperature=0.0)
for _ in range(3):
    session.step()
done = session.cancel('c')
if not done or done['finishReason'] != 'abort' or not 1 <= len(done['tokenIds']) < 100 or session.has_work():
    bad.append(f"cancel: {done}, has_work={session.has_work()}")
for b in bad:
    print('FAIL', b)
assert not bad, f"{len(bad)} golden mismatches"
""".replace("N_CASES", str(N_CASES)).replace("N_GREEDY", str(N_GREEDY))


def test_generation_golden_in_pyodide():
    problem = harness.missing_setup()
    if problem:
        pytest.fail(problem)
    from pyengine.model_files import default_model_path

    report = harness.run_in_pyodide(SNIPPET, model=default_model_path(),
                                    files={"/work/golden/generation_smollm2.json": GOLDEN,
                                           "/work/web/pyworker.py": WEB / "pyworker.py"},
                                    timeout=2400)     # 7 prompts without BLAS: minutes, more on a loaded machine
    print(report["stdout"], report["timings_ms"], f"wall {report['wall_s']}s")
    assert report["ok"], harness.describe(report)
    assert report["stdout"].count("greedy tokens") == N_CASES
    assert report["stdout"].count("forward of") == N_CASES
