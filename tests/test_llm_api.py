"""`LLM` mechanics against the engine with a fake model runner (tests/engine_fakes.py), whose greedy
output has an engine-free reference. The real-model behaviour is in test_llm_model.py."""
import pytest

from engine_fakes import EOS, FakeRunner, FakeTokenizer, reference_greedy
from pyengine.llm import LLM
from pyengine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def make_llm(**kw):
    kw.setdefault("max_model_len", 64)
    return LLM(runner=FakeRunner(num_blocks=128, block_size=4), max_num_seqs=4, max_num_batched_tokens=32, **kw)


def expected(prompt_ids, max_tokens=12):
    out = reference_greedy(prompt_ids, max_tokens)
    text = FakeTokenizer().decode([t for t in out if t != EOS])
    return out, text


def test_generate_many_prompts_in_input_order():
    llm = make_llm()
    tok = llm.get_tokenizer()
    prompts = ["hello", {"prompt_token_ids": [5, 6, 7]}, "abc", "zzzzzz", "q", {"prompt_token_ids": [1]}]
    outs = llm.generate(prompts, GREEDY)
    assert len(outs) == len(prompts)
    for p, out in zip(prompts, outs):
        ids = tok.encode(p) if isinstance(p, str) else p["prompt_token_ids"]
        assert out.prompt_token_ids == ids
        assert out.prompt == (p if isinstance(p, str) else None)
        ref_ids, ref_text = expected(ids)
        assert out.finished and out.outputs[0].token_ids == ref_ids
        assert out.outputs[0].text == ref_text
        assert out.outputs[0].finish_reason == ("stop" if ref_ids[-1] == EOS else "length")
    assert not llm.llm_engine.has_unfinished_requests()
    # more prompts than max_num_seqs ran batched: the fake runner saw several sequences in one pass
    assert max(len(q) for q, _ in llm.llm_engine.runner.batches) > 1


def test_single_prompt_and_per_prompt_params():
    llm = make_llm()
    (out,) = llm.generate("abc", GREEDY)
    assert out.outputs[0].token_ids == expected(out.prompt_token_ids)[0]
    outs = llm.generate(["abc", "abc"], [SamplingParams(temperature=0, max_tokens=2),
                                         SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)])
    assert len(outs[0].outputs[0].token_ids) <= 2 and len(outs[1].outputs[0].token_ids) == 5


def test_seeded_sampling_reproducible_and_n():
    llm = make_llm()
    p = SamplingParams(temperature=1.0, seed=7, max_tokens=10, n=3, ignore_eos=True)
    a = llm.generate("hello", p)[0]
    b = llm.generate("hello", p)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len(a.outputs) == 3 and len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_stream_deltas_add_up_to_the_final_text():
    llm = make_llm()
    s = llm.stream("hello", GREEDY)
    pieces = list(s)
    assert s.output.finished
    assert "".join(pieces) == s.output.outputs[0].text == expected(s.output.prompt_token_ids)[1]
    assert all(pieces)


def test_stream_close_aborts_and_engine_stays_clean():
    llm = make_llm()
    with llm.stream("hello", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)) as s:
        first = next(s)
    assert s.output.outputs[0].finish_reason == "abort"
    assert s.output.outputs[0].text.startswith(first)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.num_used_blocks() == 0


def test_stream_interleaved_with_generate():
    llm = make_llm()
    s = llm.stream("hello", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    head = next(s)
    outs = llm.generate(["abc", "xyz"], GREEDY)         # steps the engine for all three requests
    rest = "".join(s)
    assert head + rest == s.output.outputs[0].text
    assert s.output.outputs[0].token_ids == reference_greedy(s.output.prompt_token_ids, 20, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in outs] == [expected(o.prompt_token_ids)[0] for o in outs]


@pytest.mark.parametrize("prompts, match", [
    (["abc", {"prompt_token_ids": [1, 99]}], "99"),             # unknown token id
    (["abc", {"prompt_token_ids": [1, 2.5]}], "prompt_token_ids"),
    (["abc", {"prompt_token_ids": []}], "empty"),
    (["abc", "a" * 80], "max_model_len"),                       # prompt longer than the context
    (["abc", 3], "prompt"),
    ([1, 2, 3], "prompt_token_ids"),
    ([], "empty"),
    (["abc", {"text": "x"}], "prompt"),
])
def test_bad_prompts_fail_before_any_work(prompts, match):
    llm = make_llm()
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.runner.calls == 0


def test_too_long_prompt_names_lengths():
    llm = make_llm()
    with pytest.raises(ValueError) as e:
        llm.generate("a" * 60, SamplingParams(max_tokens=10))
    assert "60" in str(e.value) and "64" in str(e.value)


def test_bad_params():
    llm = make_llm()
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY])
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate("a", {"temperature": 0})
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["a", "b"], SamplingParams(logit_bias={1000: 1.0}))
    with pytest.raises(ValueError, match="n="):
        llm.stream("a", SamplingParams(n=2))
    assert llm.llm_engine.runner.calls == 0


def test_chat_requires_messages():
    llm = make_llm()
    for bad in ([], [{"role": "user"}], [{"content": "hi"}], "hi", [[]]):
        with pytest.raises(ValueError, match="message|conversation"):
            llm.chat(bad)


def test_progress_on_stderr(capsys):
    llm = make_llm()
    outs = llm.generate(["abc", "de", "f"], GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts: 0/3" in err and "Processed prompts: 3/3" in err
    assert f"({sum(len(o.outputs[0].token_ids) for o in outs)} tokens" in err
