"""S16 in Pyodide: the unchanged pyengine wheel runs the tiny MoE models (qwen3moe, qwen2moe, Mixtral; built on
the host from tests/moe_models.py's seed, shipped as files) and reproduces HF transformers' top-20 logprobs
(|d| <= 1e-3) and greedy tokens (tests/golden/moe_*.json) inside Pyodide under Node: the grouped-expert path's
sorts, gathers and int widths on wasm. Greedy goes through LLMEngine (paged, two prompts batched) and, for qwen3moe,
through the browser worker's Python half (web/pyworker.py: prompt text in, events out, lean weights); the
logprobs once resident and once lean (experts dequantized per use)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pyodide_harness import harness

from moe_models import VARIANTS, write_moe

pytestmark = [pytest.mark.pyodide, pytest.mark.slow]

HERE = Path(__file__).resolve().parent

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
    golden = json.load(open(f'/work/golden/moe_{variant}.json'))
    data = open(f'/work/moe/{variant}.gguf', 'rb').read()
    case = golden['cases'][0]
    ids = case['prompt_ids'] + case['greedy_ids'][:-1]
    for mode in ('resident', 'lean'):
        r = ModelRunner(data, max_model_len=64, max_num_batched_tokens=32, max_num_seqs=2, weights_mode=mode)
        bad += [f'{variant} {mode}: {f}' for f in
                check_top_logprobs(full_forward_logits(r, ids, [e['position'] for e in case['top_logprobs']]), case)]
    if variant == 'qwen3moe':    # the browser worker's Python half: prompt text -> engine.step() events
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
        eng = session.engine
    else:
        eng = LLMEngine(data, max_model_len=64, block_size=8, max_num_seqs=2, max_num_batched_tokens=32)
        other = golden['cases'][1]
        eng.add_request('other', {'prompt_token_ids': other['prompt_ids']},
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        got = engine_greedy(eng, case['prompt_ids'], 16)
        bad += [f'{variant}: {f}' for f in check_greedy(got, case, 16)]
    print(variant, 'expert balance', eng.stats()['expert_load']['balance'])
for b in bad:
    print('FAIL', b)
assert not bad, f"{len(bad)} golden mismatches"
""".replace("VARIANTS", repr(list(VARIANTS)))


def test_moe_golden_in_pyodide(tmp_path):
    problem = harness.missing_setup()
    if problem:
        pytest.fail(problem)
    from pyengine.model_files import default_model_path

    files = {}
    for v in VARIANTS:
        golden = json.loads((HERE / "golden" / f"moe_{v}.json").read_text())
        assert write_moe(tmp_path / f"{v}.gguf", v, default_model_path()) == golden["digest"]
        files[f"/work/moe/{v}.gguf"] = tmp_path / f"{v}.gguf"
        files[f"/work/golden/moe_{v}.json"] = HERE / "golden" / f"moe_{v}.json"
    files["/work/web/pyworker.py"] = HERE.parent / "web" / "pyworker.py"
    report = harness.run_in_pyodide(SNIPPET, files=files)
    print(report["stdout"], report.get("timings_ms"), f"wall {report['wall_s']}s")
    assert report["ok"], harness.describe(report)
    assert report["stdout"].count("expert balance") == len(VARIANTS)
