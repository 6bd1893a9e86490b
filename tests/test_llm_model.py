"""`LLM` end to end on the real SmolLM2-135M model, checked against HF transformers' golden greedy
tokens and logprobs (tests/golden/generation_smollm2.json, made by scripts/make_golden_generation.py)."""
import json
import os

import numpy as np
import pytest

from pyengine.llm import LLM
from pyengine.sampling_params import SamplingParams

GOLDEN = json.load(open(os.path.join(os.path.dirname(__file__), "golden", "generation_smollm2.json")))["cases"]
N_NEW = 8


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024, seed=0)


@pytest.fixture(scope="module")
def batched(llm):
    """All golden prompts in one generate call (continuous batching): even ones as text, odd as ids."""
    prompts = [c["prompt"] if i % 2 == 0 else {"prompt_token_ids": c["prompt_ids"]} for i, c in enumerate(GOLDEN)]
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=5)
    return llm.generate(prompts, params)


def test_batched_greedy_matches_hf(batched):
    assert len(batched) == len(GOLDEN)
    for case, out in zip(GOLDEN, batched):
        assert out.prompt_token_ids == case["prompt_ids"]            # input order kept, text encoded right
        comp = out.outputs[0]
        assert comp.token_ids == case["greedy_ids"][:N_NEW], case["prompt"][:30]
        assert comp.finish_reason == "length" and out.finished


def test_logprobs_match_hf_raw_distribution(batched):
    for case, out in zip(GOLDEN, batched):
        pos = len(case["prompt_ids"]) - 1                              # distribution of the 1st new token
        ref = next(t for t in case["top_logprobs"] if t["position"] == pos)
        first = out.outputs[0].logprobs[0]                             # {id: logprob}: top-5 + sampled
        top5 = sorted(first, key=lambda i: -first[i])[:5]
        assert top5 == ref["ids"][:5]
        np.testing.assert_allclose([first[i] for i in top5], ref["logprobs"][:5], atol=2e-3)
        # the cumulative logprob is the sum of the sampled tokens' raw logprobs
        comp = out.outputs[0]
        assert comp.cumulative_logprob == pytest.approx(
            sum(lp[t] for lp, t in zip(comp.logprobs, comp.token_ids)), abs=1e-6)


def test_text_decodes_tokens(batched, llm):
    tok = llm.get_tokenizer()
    for out in batched:
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_stop_string_on_real_text(llm):
    p = SamplingParams(temperature=0, max_tokens=8, stop=["."])
    (out,) = llm.generate("The capital of France is", p)
    assert (out.outputs[0].text, out.outputs[0].finish_reason, out.outputs[0].stop_reason) == (" Paris", "stop", ".")
    (out,) = llm.generate("The capital of France is", p.clone(include_stop_str_in_output=True))
    assert out.outputs[0].text == " Paris."


def test_stream_equals_generate_with_seed(llm):
    p = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=6, ignore_eos=True)
    (ref,) = llm.generate("Once upon a time", p)
    s = llm.stream("Once upon a time", p)
    pieces = list(s)
    assert "".join(pieces) == s.output.outputs[0].text == ref.outputs[0].text
    assert s.output.outputs[0].token_ids == ref.outputs[0].token_ids


def test_chat_uses_the_template(llm):
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    outs = llm.chat([conv, conv], SamplingParams(temperature=0, max_tokens=12))
    assert len(outs) == 2
    assert outs[0].prompt == llm.get_tokenizer().apply_chat_template(conv, add_generation_prompt=True)
    assert outs[0].prompt.endswith("<|im_start|>assistant\n")
    assert "Paris" in outs[0].outputs[0].text
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    # the reply ends at <|im_end|> (a stop id of the tokenizer) without showing it
    comp = outs[0].outputs[0]
    im_end = llm.get_tokenizer().token_to_id("<|im_end|>")
    assert (comp.finish_reason, comp.stop_reason, comp.token_ids[-1]) == ("stop", im_end, im_end)
    assert "<|im_end|>" not in comp.text and comp.text.endswith("Paris.")


def test_prompt_longer_than_context(llm):
    ids = [28] * 1100
    with pytest.raises(ValueError) as err:
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=4))
    assert "1100" in str(err.value) and "1024" in str(err.value)
    with pytest.raises(ValueError, match="49152"):
        llm.generate({"prompt_token_ids": [1, 49152]})
    assert not llm.llm_engine.has_unfinished_requests()
