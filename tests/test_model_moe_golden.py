"""S16: mixture-of-experts models against HF transformers' own classes (tests/golden/moe_*.json, recorded by
scripts/make_golden_moe.py on the tiny random models of tests/moe_models.py, rebuilt here from the seed).

For qwen3moe, qwen2moe (shared expert, QKV biases) and Mixtral (a llama file with experts): top-20
log-probabilities within 1e-3 at the golden positions, resident and lean weights; greedy tokens identical
through the paged engine (LLMEngine), the prompts batched with each other and with an unrelated sequence, their
prefills chunked, then again served from the prefix cache, resident and lean (a divergence only after a step whose HF top-2 margin
is below 0.005); the engine's expert-load statistics count every routed token.
"""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "pyodide"))
from golden_checks import check_greedy, check_top_logprobs, full_forward_logits
from moe_models import VARIANTS, shape, write_moe
from pyengine import SamplingParams
from pyengine.engine.llm_engine import LLMEngine
from pyengine.engine.model_runner import ModelRunner
from pyengine.model_files import default_model_path

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
N_GREEDY = 16


@pytest.fixture(scope="module", params=list(VARIANTS))
def moe(request, tmp_path_factory):
    variant = request.param
    with open(os.path.join(GOLDEN, f"moe_{variant}.json")) as f:
        golden = json.load(f)
    path = tmp_path_factory.mktemp(variant) / f"{variant}.gguf"
    digest = write_moe(path, variant, default_model_path())
    assert digest == golden["digest"], "the seeded weights differ from the ones HF saw: rerun the golden script"
    return variant, str(path), golden


@pytest.mark.parametrize("mode", ["resident", "lean"])
def test_top_logprobs_match_hf(moe, mode):
    variant, path, golden = moe
    r = ModelRunner(path, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4, weights_mode=mode)
    assert r.config.arch == shape(variant)["arch"] and r.config.moe.n_experts == shape(variant)["experts"]
    bad = []
    for case in golden["cases"]:
        ids = case["prompt_ids"] + case["greedy_ids"][:-1]
        bad += check_top_logprobs(full_forward_logits(r, ids, [e["position"] for e in case["top_logprobs"]]), case)
    assert not bad, bad


@pytest.mark.parametrize("mode", ["resident", "lean"])
def test_engine_greedy_batched_chunked_and_prefix_cached_matches_hf(moe, mode):
    """All prompts at once plus an unrelated 40-token sequence, prefill chunks of at most 8 tokens, blocks of 4;
    then each prompt again, its full blocks now served from the prefix cache."""
    variant, path, golden = moe
    eng = LLMEngine(path, max_model_len=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=8,
                    weights_mode=mode, kv_cache_dtype="auto")    # float32 KV: lean's default is q8_0 (S21)
    cases = golden["cases"]
    params = SamplingParams(temperature=0.0, max_tokens=N_GREEDY, ignore_eos=True)
    filler = np.random.default_rng(5).integers(3, 40000, 40).tolist()
    for rnd in range(2):
        for k, case in enumerate(cases):
            eng.add_request(f"{rnd}-{k}", {"prompt_token_ids": case["prompt_ids"]}, params)
        if rnd == 0:
            eng.add_request("filler", {"prompt_token_ids": filler}, params)
        got = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                got[out.request_id] = list(out.outputs[0].token_ids)
        bad = [f for k, case in enumerate(cases) for f in check_greedy(got[f"{rnd}-{k}"], case, N_GREEDY)]
        assert not bad, (rnd, bad)
    stats = eng.stats()
    # each prompt's full blocks but the one holding its last token (which must be computed) are reused
    assert stats["prefix_cache_hit_tokens"] >= sum((len(c["prompt_ids"]) - 1) // 4 * 4 for c in cases) > 0
    load = stats["expert_load"]
    s = shape(variant)
    assert [row["layer"] for row in load["layers"]] == list(range(s["layers"]))
    # every token computed in the window was routed to `used` experts in every layer
    assert len({sum(row["tokens"]) for row in load["layers"]}) == 1
    assert sum(load["layers"][0]["tokens"]) % s["used"] == 0
    assert 0 < load["balance"] <= 1


def test_mixtral_with_one_tensor_per_expert_matches_hf(tmp_path):
    """Mixtral files converted before llama.cpp stacked the experts hold blk.N.ffn_gate.E.weight etc.: the
    same weights in that layout give HF's numbers too."""
    with open(os.path.join(GOLDEN, "moe_mixtral.json")) as f:
        golden = json.load(f)
    path = tmp_path / "split.gguf"
    assert write_moe(path, "mixtral", default_model_path(), split_experts=True) == golden["digest"]
    from pyengine.gguf.reader import GGUFFile
    names = GGUFFile(str(path)).tensors
    assert "blk.0.ffn_gate.7.weight" in names and "blk.0.ffn_gate_exps.weight" not in names
    r = ModelRunner(str(path), max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4)
    case = golden["cases"][0]
    ids = case["prompt_ids"] + case["greedy_ids"][:-1]
    bad = check_top_logprobs(full_forward_logits(r, ids, [e["position"] for e in case["top_logprobs"]]), case)
    assert not bad, bad
