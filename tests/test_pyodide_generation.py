"""S22 in Pyodide: the unchanged pyengine wheel, given the GGUF as bytes, reproduces HF transformers'
top-20 logprobs (|d| <= 1e-3) and greedy tokens (tests/golden/generation_smollm2.json) inside Pyodide.

The comparison code is tests/pyodide/golden_checks.py, the same functions the CPython side can use.
Pyodide's NumPy has no BLAS (about 2 GFLOP/s), so this checks the two shortest prompts: enough to catch
a wasm-specific difference (float32 accumulation, int widths, byte order) in every layer.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.pyodide, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("pyodide_harness", HERE / "pyodide" / "harness.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

GOLDEN = HERE / "golden" / "generation_smollm2.json"
N_CASES = 2
N_GREEDY = 32

SNIPPET = r"""
import json, time
import numpy as np
from pyengine import LLMEngine
from golden_checks import check_top_logprobs, check_greedy, engine_greedy, full_forward_logits
golden = json.load(open('/work/golden/generation_smollm2.json'))
cases = sorted(golden['cases'], key=lambda c: len(c['prompt_ids']))[:N_CASES]
t0 = time.perf_counter()
engine = LLMEngine(model=MODEL_BYTES, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=256)
runner = engine.runner
print(f"engine built in {time.perf_counter() - t0:.1f}s")
bad = []
for case in cases:
    ids = case['prompt_ids'] + case['greedy_ids'][:-1]
    positions = [e['position'] for e in case['top_logprobs']]
    t0 = time.perf_counter()
    logits = full_forward_logits(runner, ids, positions)
    t1 = time.perf_counter()
    bad += check_top_logprobs(dict(zip(positions, logits)), case)
    got = engine_greedy(engine, case['prompt_ids'], N_GREEDY)
    t2 = time.perf_counter()
    bad += check_greedy(got, case, N_GREEDY)
    print(f"{case['prompt'][:24]!r}: forward of {len(ids)} tokens {t1 - t0:.1f}s, "
          f"{N_GREEDY} greedy tokens {t2 - t1:.1f}s ({N_GREEDY / (t2 - t1):.2f} tok/s incl. prefill)")
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
                                    files={"/work/golden/generation_smollm2.json": GOLDEN})
    print(report["stdout"], report["timings_ms"], f"wall {report['wall_s']}s")
    assert report["ok"], harness.describe(report)
    assert report["stdout"].count("greedy tokens") == N_CASES
