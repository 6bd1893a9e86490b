"""Issue 30 in Pyodide: the unchanged pyengine wheel runs the tiny models of the new dense families (qwen2,
qwen3, gemma2, phi3; built on the host from tests/arch_models.py's seed, shipped as files) and reproduces HF
transformers' top-20 logprobs (|d| <= 1e-3, every position of a prompt and its continuation) and greedy tokens
(tests/golden/arch_*.json) inside Pyodide under Node: Q/K/V and output biases, per-head q/k norms, soft-capping
and sliding windows, partial rotary with LongRoPE on wasm. Logprobs with resident weights; greedy through
LLMEngine (paged, two prompts batched, lean weights) and, for qwen3, through the browser worker's Python half
(web/pyworker.py: prompt text in, events out)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from arch_models import write_arch
from pyodide_harness import harness

pytestmark = [pytest.mark.pyodide, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
VARIANTS = ["qwen2", "qwen3", "gemma2", "phi3"]          # one case per architecture

SNIPPET = r"""
import json, sys
sys.path.insert(0, '/work/web')
from pyworker import WorkerSession          # the browser worker's Python half, unchanged
from pyengine import SamplingParams
from golden_checks import check_greedy, check_top_logprobs, engine_greedy, full_forward_logits
from pyengine.engine.llm_engine import LLMEngine
from pyengine.engine.model_runner import ModelRunner
bad = []
for variant in VARIANTS:
    golden = json.load(open(f'/work/golden/arch_{variant}.json'))
    data = open(f'/work/arch/{variant}.gguf', 'rb').read()
    case = golden['cases'][0]
    ids = case['prompt_ids'] + case['greedy_ids'][:-1]
    r = ModelRunner(data, max_model_len=64, max_num_batched_tokens=32, max_num_seqs=2)
    bad += [f'{variant}: {f}' for f in
            check_top_logprobs(full_forward_logits(r, ids, list(range(len(ids)))), case)]
    if variant == 'qwen3':    # the browser worker's Python half: prompt text -> engine.step() events
        session = WorkerSession()
        session.load(data, mode='lean')
        stops = session.engine.get_tokenizer().stop_token_ids
        for k, c in enumerate(golden['cases'][:2]):          # two prompts batched
            session.start(f'g{k}', c['prompt'], max_tokens=16, temperature=0.0)
        events = []
        while session.has_work():
            events += session.step()
        done = {e['id']: e['tokenIds'] for e in events if e['type'] == 'done'}
        for k, c in enumerate(golden['cases'][:2]):
            bad += [f'{variant} worker: {f}' for f in check_greedy(done[f'g{k}'], c, 16, stops)]
    else:
        eng = LLMEngine(data, max_model_len=64, block_size=8, max_num_seqs=2, max_num_batched_tokens=32,
                        weights_mode='lean', kv_cache_dtype='auto')     # float32 KV (lean's default is q8_0)
        other = golden['cases'][1]
        eng.add_request('other', {'prompt_token_ids': other['prompt_ids']},
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        got = engine_greedy(eng, case['prompt_ids'], 16)
        bad += [f'{variant}: {f}' for f in check_greedy(got, case, 16)]
    print(variant, 'checked')
for b in bad:
    print('FAIL', b)
assert not bad, f"{len(bad)} golden mismatches"
""".replace("VARIANTS", repr(VARIANTS))


def test_new_architectures_golden_in_pyodide(tmp_path):
    problem = harness.missing_setup()
    if problem:
        pytest.fail(problem)
    from pyengine.model_files import default_model_path

    files = {}
    for v in VARIANTS:
        golden = json.loads((HERE / "golden" / f"arch_{v}.json").read_text())
        assert write_arch(tmp_path / f"{v}.gguf", v, default_model_path()) == golden["digest"]
        files[f"/work/arch/{v}.gguf"] = tmp_path / f"{v}.gguf"
        files[f"/work/golden/arch_{v}.json"] = HERE / "golden" / f"arch_{v}.json"
    files["/work/web/pyworker.py"] = HERE.parent / "web" / "pyworker.py"
    report = harness.run_in_pyodide(SNIPPET, files=files)
    print(report["stdout"], report.get("timings_ms"), f"wall {report['wall_s']}s")
    assert report["ok"], harness.describe(report)
    assert report["stdout"].count("checked") == len(VARIANTS)
