"""S19 prompt logprobs and pooled states (engine/prompt_logprobs.py, engine/pooling.py) through the engine.

Independent reference: HF transformers' full-sequence log-softmax and last_hidden_state on the golden prompts
(tests/golden/prompt_outputs_smollm2.json, scripts/make_golden_prompt_outputs.py; its top-20s also in
generation_smollm2.json). The tiny seeded model's readable ``forward_reference`` (no cache, no chunks) checks
chunked prefill, batching with other requests and the prefix cache bypass.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from engine_fakes import FakeRunner, FakeTokenizer, WideTokenizer
from model_paths import model_path
from tiny_models import write_tiny
from pyengine.engine.llm_engine import LLMEngine
from pyengine.engine.pooling import EmbeddingRequestOutput, PoolingParams
from pyengine.layers.sampler import log_softmax
from pyengine.llm import LLM
from pyengine.sampling_params import SamplingParams

GOLDEN = json.loads((pathlib.Path(__file__).parent / "golden" / "prompt_outputs_smollm2.json").read_text())
TOP20 = json.loads((pathlib.Path(__file__).parent / "golden" / "generation_smollm2.json").read_text())


@pytest.fixture(scope="module")
def smol():
    # chunks of 64 tokens: the 144-token golden prompt runs in three steps, batched with the others
    return LLM(model_path("smollm2"), max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4)


def test_prompt_logprobs_match_transformers(smol):
    cases = GOLDEN["cases"]
    outs = smol.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases],
                         SamplingParams(max_tokens=0, prompt_logprobs=5))
    worst = 0.0
    for case, top20, out in zip(cases, TOP20["cases"], outs):
        pl, ids = out.prompt_logprobs, case["prompt_ids"]
        assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == []
        assert pl[0] is None and len(pl) == len(ids)
        for i in range(1, len(ids)):
            entry, ref = pl[i], case["top5"][i - 1]
            worst = max(worst, abs(entry[ids[i]].logprob - case["prompt_logprobs"][i]))
            mine = [(t, e.logprob) for t, e in entry.items() if e.rank <= 5]
            mine.sort(key=lambda p: p[0])
            theirs = sorted(zip(ref["ids"], ref["logprobs"]))
            # the same five (ties within 1e-3 may swap places at the edge)
            for (a, x), (b, y) in zip(mine, theirs):
                if a == b:
                    worst = max(worst, abs(x - y))
            assert len({a for a, _ in mine} & {b for b, _ in theirs}) >= 4
            rank1 = [t for t, e in entry.items() if e.rank == 1]
            assert rank1 and abs(entry[rank1[0]].logprob - ref["logprobs"][0]) < 1e-3
        for t in top20["top_logprobs"]:           # the other golden file's top-20s at prompt positions
            if t["position"] + 1 < len(ids):
                e = pl[t["position"] + 1]
                for tid, lp in zip(t["ids"], t["logprobs"]):
                    if tid in e:
                        worst = max(worst, abs(e[tid].logprob - lp))
    assert worst < 1e-3, worst


def test_prompt_logprobs_with_generation_and_ranks(smol):
    ids = GOLDEN["cases"][0]["prompt_ids"]
    out = smol.generate([{"prompt_token_ids": ids}],
                        SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0, logprobs=0))[0]
    assert len(out.outputs[0].token_ids) == 2
    for i in range(1, len(ids)):
        assert list(out.prompt_logprobs[i]) == [ids[i]]          # 0: the prompt token alone, with its rank
        lp = GOLDEN["cases"][0]["prompt_logprobs"][i]
        assert abs(out.prompt_logprobs[i][ids[i]].logprob - lp) < 1e-3
        assert out.prompt_logprobs[i][ids[i]].rank >= 1


def test_embeddings_match_transformers_hidden_states(smol):
    cases = GOLDEN["cases"]
    prompts = [{"prompt_token_ids": c["prompt_ids"]} for c in cases]
    for pooling, key in (("last", "embedding_last"), ("mean", "embedding_mean")):
        outs = smol.embed(prompts, PoolingParams(pooling=pooling))
        for case, out in zip(cases, outs):
            assert isinstance(out, EmbeddingRequestOutput)
            v, ref = np.asarray(out.outputs.embedding), np.asarray(case[key])
            assert abs(np.linalg.norm(v) - 1) < 1e-5
            assert np.linalg.norm(v - ref) / np.linalg.norm(ref) < 1e-3, (pooling, case["prompt"])
    raw = smol.embed("The capital of France is", PoolingParams(normalize=False))[0].outputs.embedding
    assert abs(np.linalg.norm(raw) - 1) > 0.1                  # not normalized on request


def test_multiple_choice_ranks_the_correct_answer_first(smol):
    """lm-eval's loglikelihood: the sum of a continuation's prompt logprobs given its context."""
    items = [("The capital of France is", [" Paris", " Berlin", " Madrid"]),
             ("Water freezes at zero degrees", [" Celsius", " Kelvin", " Newton"]),
             ("One, two, three, four,", [" five", " nine", " twelve"]),
             ("The opposite of hot is", [" cold", " blue", " tall"]),
             ("Monday, Tuesday,", [" Wednesday", " Friday", " Sunday"])]
    tok = smol.get_tokenizer()
    for context, choices in items:
        ctx = tok.encode(context, add_special_tokens=False)
        prompts = [{"prompt_token_ids": ctx + tok.encode(c, add_special_tokens=False)} for c in choices]
        outs = smol.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0))
        scores = [sum(e[p["prompt_token_ids"][i]].logprob for i, e in enumerate(o.prompt_logprobs) if i >= len(ctx))
                  for p, o in zip(prompts, outs)]
        assert int(np.argmax(scores)) == 0, (context, scores)


# --- the tiny model: chunks, batching, prefix cache ---------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("plp") / "tiny.gguf", "llama", seed=5))


def tiny_engine(tiny, **kw):
    kw = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 64, "block_size": 4, **kw}
    return LLM(tiny, tokenizer=WideTokenizer(), **kw)


def reference(llm, ids):
    """(prompt logprobs of ids[1:], mean hidden) from the model's readable full-sequence forward."""
    lp = log_softmax(llm.llm_engine.runner.model.forward_reference(np.asarray(ids)))
    return [lp[i - 1, ids[i]] for i in range(1, len(ids))]


def test_chunked_prefill_equals_one_chunk_and_reference(tiny, monkeypatch):
    from pyengine.engine import prompt_logprobs
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 300, size=n).tolist() for n in (50, 7, 33)]
    params = [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=k) for k in (3, 1, 3)]
    one = tiny_engine(tiny, max_num_batched_tokens=256)
    chunked = tiny_engine(tiny, max_num_batched_tokens=16, max_num_seqs=2)
    a = one.generate([{"prompt_token_ids": p} for p in prompts], params)
    monkeypatch.setattr(prompt_logprobs, "PROMPT_LOGITS_BYTES", 4 * 320 * 5)     # head slices of 5 rows
    b = chunked.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, x, y, sp in zip(prompts, a, b, params):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert all(len(e) in (sp.prompt_logprobs, sp.prompt_logprobs + 1) for e in y.prompt_logprobs[1:])
        assert len(x.prompt_logprobs) == len(y.prompt_logprobs) == len(p)
        ref = reference(one, p)
        for i in range(1, len(p)):
            assert x.prompt_logprobs[i].keys() == y.prompt_logprobs[i].keys()
            for t in x.prompt_logprobs[i]:
                assert abs(x.prompt_logprobs[i][t].logprob - y.prompt_logprobs[i][t].logprob) < 1e-4
            assert abs(x.prompt_logprobs[i][p[i]].logprob - ref[i - 1]) < 1e-4
    pa = one.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(pooling="mean"))
    pb = chunked.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(pooling="mean"))
    for x, y in zip(pa, pb):
        np.testing.assert_allclose(x.outputs.embedding, y.outputs.embedding, atol=1e-5)


def test_prefix_cache_is_bypassed_not_lost(tiny):
    llm = tiny_engine(tiny, enable_prefix_caching=True)
    ids = list(range(10, 50))
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1))          # caches the prefix
    out = llm.generate([{"prompt_token_ids": ids + [7]}], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == 41
    ref = reference(llm, ids + [7])
    assert max(abs(out.prompt_logprobs[i][t].logprob - ref[i - 1])
               for i, t in enumerate(ids + [7]) if i) < 1e-4
    again = llm.generate([{"prompt_token_ids": ids + [8]}], SamplingParams(max_tokens=1))[0]
    assert again.num_cached_tokens > 0                     # its blocks still serve plain requests


def test_bad_values_are_refused(tiny):
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="pooling"):
        PoolingParams(pooling="cls")
    eng = LLMEngine(runner=FakeRunner(num_blocks=64, block_size=4), tokenizer=FakeTokenizer(), max_num_seqs=4,
                    max_num_batched_tokens=32)
    for what, params in (("prompt_logprobs", SamplingParams(prompt_logprobs=1)), ("embeddings", PoolingParams())):
        with pytest.raises(ValueError, match=f"{what} need one local model runner"):   # no hidden states there
            eng.add_request("a", "abc", params)
    assert not eng.has_unfinished_requests()
    eng = tiny_engine(tiny).llm_engine
    with pytest.raises(ValueError, match="prompt_logprobs=1000000 exceeds the vocab size"):
        eng.add_request("a", [1, 2], SamplingParams(prompt_logprobs=10 ** 6))
    with pytest.raises(ValueError, match="n=1"):
        eng.add_request("b", [1, 2], SamplingParams(n=2, max_tokens=0, prompt_logprobs=1))
    assert not eng.has_unfinished_requests()
    from pyengine.engine.prompt_logprobs import routed_params    # the S18 router's check (tests/test_disagg_s19.py)
    with pytest.raises(ValueError, match="dimensions=8"):
        routed_params(PoolingParams(dimensions=8), 64)


def test_dimensions_other_than_the_models_are_refused(tiny):
    llm = tiny_engine(tiny)
    with pytest.raises(ValueError, match="dimensions=8"):
        llm.embed([{"prompt_token_ids": [1, 2, 3]}], PoolingParams(dimensions=8))
    assert len(llm.embed([{"prompt_token_ids": [1, 2, 3]}], PoolingParams(dimensions=64))[0].outputs.embedding) == 64
