"""S14 on the real model (SmolLM2-135M Q4_1): with n-gram speculation, the joint law of the first three sampled
tokens (temperature 0.9, top-k 3) over many seeded runs is the model's own, as computed exactly from 13
unbatched forward passes (one per prefix of the 3 x 3 x 3 tree). Chi-square, fixed seeds."""
import numpy as np
import pytest

from pyengine.sampling_params import SamplingParams
from test_sampling_distribution import chi2_pvalue

pytestmark = pytest.mark.slow
TEMP, TOPK, NTOK = 0.9, 3, 3
PROMPT = "red, green, blue, red, green, blue, red, green, blue, red,"


@pytest.fixture(scope="module")
def runner():
    from pyengine.engine.model_runner import ModelRunner
    from pyengine.model_files import default_model_path
    return ModelRunner(default_model_path(), max_model_len=256, num_blocks=256, block_size=16,
                       max_num_batched_tokens=512, max_num_seqs=64, max_logits=192)


def exact_law(runner, prompt_ids):
    law = {}

    def rec(prefix, prob):
        if len(prefix) == NTOK:
            law[tuple(prefix)] = prob
            return
        x = np.array(runner.run(runner.contiguous_batch(prompt_ids + prefix, 0))[0], dtype=np.float64)
        top = np.argsort(-x)[:TOPK]
        w = np.exp((x[top] - x[top].max()) / TEMP)
        for t, pt in zip(top, w / w.sum()):
            rec(prefix + [int(t)], prob * pt)

    rec([], 1.0)
    return law


def test_sampled_first_tokens_with_ngram_speculation_follow_the_model(runner):
    from pyengine.engine.llm_engine import LLMEngine
    ids = runner.tokenizer.encode(PROMPT)
    law = exact_law(runner, ids)
    eng = LLMEngine(runner=runner, max_model_len=256, max_num_seqs=64, max_num_batched_tokens=512,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                        "prompt_lookup_max": 3, "adaptive": False})
    params = SamplingParams(n=64, temperature=TEMP, top_k=TOPK, max_tokens=NTOK, ignore_eos=True)
    for r in range(24):
        eng.add_request(f"r{r}", {"prompt_token_ids": ids}, params.clone(seed=r))
    samples = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                samples += [tuple(c.token_ids) for c in out.outputs]
    st = eng.stats()
    assert len(samples) == 1536
    assert st["spec_decode_num_drafts"] >= 750
    assert 0 < st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]
    cells = sorted(law)
    counts = [samples.count(c) for c in cells]
    assert sum(counts) == len(samples)                 # nothing outside the top-3 tree
    assert chi2_pvalue(counts, [law[c] for c in cells]) > 1e-3
