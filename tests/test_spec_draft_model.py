"""S14 draft-model proposer. Over fake runners (a draft whose logits are the fake model's, perturbed): greedy
equals the no-engine reference under batching, chunking and preemption, the draft's own paged cache stays
consistent and is emptied at the end, and sampled tokens follow the model's exact law (chi-square). On the real
model: SmolLM2 drafting for itself, and a copy of its first 24 layers written with the `gguf` package's GGUFWriter, give
plain greedy's tokens; a draft with another vocabulary is refused with a clear error."""
import numpy as np
import pytest

from engine_fakes import VOCAB, FakeRunner, make_engine, reference_greedy, run_all
from pyengine.bench.spec import write_truncated
from pyengine.engine.proposers import DraftModelProposer
from pyengine.sampling_params import SamplingParams
from test_sampling_distribution import chi2_pvalue
from test_engine_fake_runner import check_against_reference
from test_spec_engine import invariants, prompts
from test_spec_rejection import NTOK, TEMP, TOPK, exact_law


class PerturbedRunner(FakeRunner):
    """A 'smaller model': the fake model's logits plus a deterministic function of them."""

    def run(self, batch):
        x = super().run(batch)
        return x + 0.9 * np.roll(x, 1, axis=-1)


def draft_engine(k=3, draft_blocks=64, **kw):
    draft = PerturbedRunner(num_blocks=draft_blocks, block_size=4)
    eng = make_engine(speculative_config={"method": "draft_model", "model": "fake", "num_speculative_tokens": k,
                                          "adaptive": False}, draft_runner=draft, **kw)
    assert isinstance(eng.spec.proposer, DraftModelProposer)
    return eng, eng.spec.proposer


def both_invariants(prop):
    def check(engine):
        invariants(engine)
        prop.bm.check_invariants([s.shadow for s in prop.states.values()])
        for st in prop.states.values():
            assert len(st.shadow.block_table) == prop.bm.blocks_for(len(st.cached))
    return check


def test_greedy_with_a_draft_model_equals_reference():
    ps = prompts(10, seed=21)
    # tight target pool (preemption) and budget (chunked prompts); a small draft cache (some rounds skip)
    eng, prop = draft_engine(3, draft_blocks=40, num_blocks=48, max_num_seqs=6, max_num_batched_tokens=32)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=30))
    final = run_all(eng, check=both_invariants(prop))
    check_against_reference(final, ps, 30)
    st = eng.stats()
    assert st["num_preemptions"] > 0
    assert 0 < st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]
    assert not prop.states and prop.bm.num_used_blocks() == 0          # released with their sequences
    # batched: the draft's decode forwards carried several sequences at once
    assert max(len(q) for q, _ in prop.runner.batches) > 1


def test_sampled_tokens_with_a_draft_model_follow_the_model():
    prompt = [5, 9, 14, 2, 33]
    law = exact_law(prompt)
    eng, prop = draft_engine(2, draft_blocks=1024, num_blocks=1024, max_num_seqs=50, max_num_batched_tokens=512)
    params = SamplingParams(n=50, temperature=TEMP, top_k=TOPK, max_tokens=NTOK, ignore_eos=True)
    for r in range(40):
        eng.add_request(f"r{r}", {"prompt_token_ids": prompt}, params.clone(seed=500 + r))
    final = run_all(eng)
    samples = [tuple(c.token_ids) for out in final.values() for c in out.outputs]
    st = eng.stats()
    assert 0 < st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]
    cells = sorted(law)
    counts = [samples.count(c) for c in cells]
    assert sum(counts) == len(samples) == 2000
    assert chi2_pvalue(counts, [law[c] for c in cells]) > 1e-3


def test_draft_vocabulary_must_match():
    class OtherVocab(FakeRunner):
        pass
    other = OtherVocab(num_blocks=16)
    other.config = type("C", (), {"vocab_size": VOCAB + 1})()
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(speculative_config={"method": "draft_model", "model": "x", "num_speculative_tokens": 2},
                    draft_runner=other)


# --- the real model ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    from pyengine.model_files import default_model_path
    path = tmp_path_factory.mktemp("draft") / "smollm2-24-layers.gguf"
    write_truncated(default_model_path(), path, 24)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["self", "truncated"])
def test_real_draft_models_give_plain_greedy_tokens(draft, small_draft):
    import json
    import os

    from pyengine.engine.llm_engine import LLMEngine
    from pyengine.engine.model_runner import ModelRunner
    from pyengine.gguf.reader import GGUFFile
    from pyengine.model_files import default_model_path
    from test_spec_greedy_real import GOLDEN, same_or_tie

    target = ModelRunner(default_model_path(), max_model_len=256, num_blocks=128, max_num_seqs=8, max_logits=48)
    model = default_model_path() if draft == "self" else small_draft
    if draft == "truncated":
        assert GGUFFile(model).get("llama.block_count") == 24
    cases = json.load(open(GOLDEN))["cases"][:5]
    prompts_ = [{"prompt_token_ids": c["prompt_ids"]} for c in cases]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(spec):
        eng = LLMEngine(runner=target, max_model_len=256, max_num_seqs=8, speculative_config=spec)
        for i, p in enumerate(prompts_):
            eng.add_request(f"q{i}", p, params)
        out = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = o.outputs[0].token_ids
        assert eng.num_used_blocks() == 0
        return [out[f"q{i}"] for i in range(len(prompts_))], eng.stats()

    plain, _ = run(None)
    spec, st = run({"method": "draft_model", "model": model, "num_speculative_tokens": 3, "adaptive": False})
    for i, p in enumerate(prompts_):
        same_or_tie(target, p["prompt_token_ids"], spec[i], plain[i], f"{draft} prompt {i}")
    rate = st["spec_decode_acceptance_rate"]
    print(f"{draft}: acceptance {rate:.2f}, mean acceptance length {st['spec_decode_mean_acceptance_length']:.2f}")
    assert rate > (0.9 if draft == "self" else 0.05)   # the 24 first of 30 layers: ~0.2


@pytest.mark.slow
def test_real_draft_with_another_vocabulary_is_refused(tmp_path):
    from pyengine.engine.llm_engine import LLMEngine
    from pyengine.model_files import default_model_path
    bad = tmp_path / "renamed.gguf"
    write_truncated(default_model_path(), bad, 2, rename_token=100)
    with pytest.raises(ValueError, match="vocabulary differs from the target's at token 100"):
        LLMEngine(default_model_path(), max_model_len=128, max_num_seqs=2,
                  speculative_config={"method": "draft_model", "model": str(bad), "num_speculative_tokens": 2})
