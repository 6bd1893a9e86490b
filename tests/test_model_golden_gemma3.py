"""S03: Gemma 3 270M (GeGLU, q/k norms, sliding-window layers, a 262144-token vocabulary) against HF
transformers' golden outputs (tests/golden/generation_gemma3.json, scripts/make_golden_gemma3.py: the GGUF
dequantized to float32, greedy tokens from a loop without KV cache).

Top-20 log-probabilities within 1e-3 at every recorded position (past the 512-token sliding window for the long
prompt), and greedy tokens identical through the paged runner with all prompts decoding together in scattered
blocks; where a greedy token differs, HF's own top-2 margin there must be below 0.01 (fp32 near-ties).
"""
import json
from pathlib import Path

import numpy as np
import pytest

from model_paths import model_path
from pyengine.engine.forward_batch import ForwardBatch
from pyengine.engine.model_runner import ModelRunner

GOLDEN = Path(__file__).resolve().parent / "golden" / "generation_gemma3.json"
TOL = 1e-3
MARGIN = 0.01

import sys
sys.path.insert(0, str(Path(__file__).resolve().parent / "pyodide"))
from golden_checks import check_top_logprobs, full_forward_logits  # noqa: E402


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(model_path("gemma3"), max_model_len=2048, max_num_batched_tokens=2048, max_num_seqs=8,
                       num_blocks=720, block_size=16, max_logits=8)


def greedy_failures(got: list[int], case: dict) -> list[str]:
    want = case["greedy_ids"]
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if first is None or case["greedy_margins"][first] < MARGIN:
        return []
    return [f"{case['prompt'][:30]!r}: greedy differs at step {first} (HF margin {case['greedy_margins'][first]}):"
            f" got {got[first:first + 5]} want {want[first:first + 5]}"]


def test_golden_file_covers_the_sliding_window(golden):
    cases = golden["cases"]
    assert len(cases) >= 6 and golden["config"]["sliding_window"] == 512
    assert golden["config"]["final_logit_softcapping"] is None
    assert max(len(c["prompt_ids"]) for c in cases) > 1000
    assert any(e["position"] > 512 for c in cases for e in c["top_logprobs"])
    assert all(c["prompt_ids"][0] == 2 for c in cases)                 # Gemma's tokenizer adds BOS


def test_top_logprobs_match_hf(runner, golden):
    bad = []
    for case in golden["cases"]:
        ids = case["prompt_ids"] + case["greedy_ids"][:-1]
        logits = full_forward_logits(runner, ids, [e["position"] for e in case["top_logprobs"]])
        bad += check_top_logprobs(logits, case, TOL)
    assert not bad, bad


def test_prompt_ids_match_our_tokenizer(runner, golden):
    tok = runner.tokenizer
    for case in golden["cases"]:
        assert tok.encode(case["prompt"], add_special_tokens=True) == case["prompt_ids"], case["prompt"][:30]


def test_batched_greedy_in_scattered_blocks_matches_hf(runner, golden):
    """Every prompt prefilled in one ragged batch through shuffled block tables, then all decode together."""
    cases = golden["cases"]
    n, bs, steps = len(cases), runner.block_size, len(cases[0]["greedy_ids"])
    per_seq = -(-(max(len(c["prompt_ids"]) for c in cases) + steps) // bs)
    order = np.random.default_rng(0).permutation(runner.num_blocks)[:n * per_seq].astype(np.int32)
    tables = [order[i * per_seq:(i + 1) * per_seq] for i in range(n)]
    prompts = [c["prompt_ids"] for c in cases]
    lens = [len(p) for p in prompts]
    logits = runner.run(ForwardBatch(np.concatenate(prompts), np.concatenate([np.arange(m) for m in lens]),
                                     lens, lens, tables, np.cumsum(lens) - 1))
    out = [[] for _ in range(n)]
    for step in range(steps):
        toks = np.argmax(logits, axis=-1)
        for s in range(n):
            out[s].append(int(toks[s]))
        if step == steps - 1:
            break
        pos = np.array([m + step for m in lens])
        logits = runner.run(ForwardBatch(toks.astype(np.int64), pos, [1] * n, list(pos + 1), tables, np.arange(n)))
    bad = [f for s, case in enumerate(cases) for f in greedy_failures(out[s], case)]
    assert not bad, bad


def test_long_prompt_chunked_equals_one_pass(runner, golden):
    """The long prompt prefilled in 200-token chunks (each sliding-window layer reading only its window's blocks)
    gives the logits of one pass."""
    ids = max(golden["cases"], key=lambda c: len(c["prompt_ids"]))["prompt_ids"]
    one = runner.run(runner.contiguous_batch(ids, 0)).copy()
    pos = 0
    while pos < len(ids):
        chunk = ids[pos:pos + 200]
        logits = runner.run(runner.contiguous_batch(chunk, pos))
        pos += len(chunk)
    assert np.abs(logits - one).max() <= 2e-4 * max(1.0, np.abs(one).max())


def test_llm_api_serves_gemma(golden):
    """Reachable from the Python API: LLM(model=...) greedy text continues as HF's."""
    from pyengine import LLM, SamplingParams
    case = golden["cases"][0]
    llm = LLM(model=model_path("gemma3"), max_model_len=256, max_num_seqs=2, weights_mode="lean")
    out = llm.generate([case["prompt"]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert list(out[0].outputs[0].token_ids) == case["greedy_ids"][:8]


def test_cli_generate_and_serve_reach_gemma(golden, tmp_path):
    """`pyengine generate --model` prints HF's greedy continuation; `pyengine serve --model` answers a completion
    with it (the OpenAI route, over loopback)."""
    import subprocess
    import sys

    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))
    from e2e_support import free_port, stop_process, wait_http
    from pyengine.tokenizer import Tokenizer
    case = golden["cases"][0]
    want = Tokenizer.from_gguf(model_path("gemma3")).decode(case["greedy_ids"][:8])
    out = subprocess.run([sys.executable, "-m", "pyengine", "generate", case["prompt"], "--model", model_path("gemma3"),
                          "--temperature", "0", "--max-tokens", "8", "--max-model-len", "256"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert want in out.stdout, (out.stdout, want)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pyengine", "serve", "--model", model_path("gemma3"), "--port",
                             str(port), "--max-model-len", "256"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, timeout=300)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300,
                       json={"model": "gemma-3-270m-q4_k_m", "prompt": case["prompt"], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    finally:
        stop_process(proc)
