"""Issue 32 item 5: min_tokens, bad_words, allowed_token_ids and priority through the engine (fake runner).

References: exact rules (a model that would say EOS first says it only after min_tokens; banned token sequences
never appear; a later request of lower priority value runs first), statistics (allowed_token_ids: every token in
the set, frequencies those of the softmax restricted to it, chi-square), and speculation (the same tokens with
and without n-gram drafts, greedy and seeded)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from engine_fakes import EOS, VOCAB, FakeRunner, FakeTokenizer, context_logits, run_all
from pyengine.engine.llm_engine import LLMEngine
from pyengine.layers.token_masks import ThinkingBudget, TokenMasks, bad_words_token_ids
from pyengine.sampling_params import SamplingParams

A, B, C = 1, 2, 3          # 'a', 'b', 'c' in the fake tokenizer


class SpacedTokenizer(FakeTokenizer):
    """The one-character vocabulary, where a space encodes to nothing (bad_words' leading-space form)."""

    def encode(self, text, add_special_tokens=False, parse_special=True):
        return super().encode(text.replace(" ", ""))


def engine_with(logits_fn, tokenizer=None, num_blocks=64, **kw):
    kw.setdefault("max_model_len", 256)
    return LLMEngine(runner=FakeRunner(num_blocks, 4, logits_fn=logits_fn, tokenizer=tokenizer or SpacedTokenizer()),
                     max_num_seqs=8, max_num_batched_tokens=64, **kw)


def constant(scores: dict[int, float]):
    row = np.zeros(VOCAB, np.float32)
    for t, v in scores.items():
        row[t] = v
    return lambda context: row.copy()


def one(engine, params, prompt=(5, 6, 7)):
    engine.add_request("r", {"prompt_token_ids": list(prompt)}, params)
    return run_all(engine)["r"].outputs[0]


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings():
    eos_first = constant({EOS: 5.0, B: 4.0, A: 3.0})
    out = one(engine_with(eos_first), SamplingParams(temperature=0, max_tokens=20))
    assert out.token_ids == [EOS] and out.finish_reason == "stop"
    out = one(engine_with(eos_first), SamplingParams(temperature=0, max_tokens=20, min_tokens=4))
    assert out.token_ids == [B, B, B, B, EOS] and out.finish_reason == "stop" and out.text == "bbbb"
    # stop_token_ids are held back too: 'b' may not end it before 3 tokens, so 'a' is taken
    out = one(engine_with(eos_first), SamplingParams(temperature=0, max_tokens=20, min_tokens=3, stop_token_ids=[B]))
    assert out.token_ids == [A, A, A, EOS]
    # stop strings (vLLM): not checked until more than min_tokens tokens are out
    out = one(engine_with(constant({B: 4.0})), SamplingParams(temperature=0, max_tokens=20, min_tokens=3, stop="b"))
    assert out.token_ids == [B, B, B, B] and out.text == "bbb" and out.stop_reason == "b"
    # sampled: no EOS among the first min_tokens tokens over many seeds, though EOS is the likeliest token
    for seed in range(20):
        out = one(engine_with(eos_first), SamplingParams(temperature=1.0, seed=seed, max_tokens=12, min_tokens=6))
        assert EOS not in out.token_ids[:6] and len(out.token_ids) >= 6


def test_allowed_token_ids_every_token_in_the_set_at_the_restricted_softmax():
    logits = np.random.default_rng(7).standard_normal(VOCAB).astype(np.float32)
    allowed = [3, 7, 11, 20]
    eng = engine_with(lambda ctx: logits.copy(), num_blocks=256)
    eng.add_request("r", {"prompt_token_ids": [5]}, SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=200, ignore_eos=True, allowed_token_ids=allowed))
    drawn = [t for o in run_all(eng)["r"].outputs for t in o.token_ids]
    n = len(drawn)
    assert n == 800 and set(drawn) <= set(allowed)
    p = np.exp(logits[allowed].astype(np.float64))
    p /= p.sum()
    counts = Counter(drawn)
    chi2 = sum((counts[t] - n * q) ** 2 / (n * q) for t, q in zip(allowed, p))
    assert chi2 < 16.27, chi2                        # chi-square, 3 degrees of freedom, p = 0.001
    # EOS is masked unless listed (vLLM's rule): listed, greedy takes it when it is the best allowed
    out = one(engine_with(constant({EOS: 9.0, A: 1.0})), SamplingParams(temperature=0, allowed_token_ids=[A, EOS]))
    assert out.token_ids == [EOS]
    out = one(engine_with(constant({EOS: 9.0, A: 1.0})), SamplingParams(temperature=0, max_tokens=5,
                                                                      allowed_token_ids=[B, C]))
    assert out.token_ids == [B] * 5 and out.finish_reason == "length"


def test_bad_words_token_sequences_never_appear():
    prompts = [[(7 * i + j) % (VOCAB - 1) + 1 for j in range(5 + i % 4)] for i in range(12)]

    def outputs(params):
        eng = engine_with(context_logits)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", {"prompt_token_ids": p}, params)
        return [o.outputs[0].token_ids for o in run_all(eng).values()]

    free = outputs(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    tokens = Counter(t for o in free for t in o)
    pairs = Counter(tuple(o[i:i + 2]) for o in free for i in range(len(o) - 1))
    single = tokens.most_common(1)[0][0]
    pair = next(p for p, _ in pairs.most_common() if single not in p)
    tok = SpacedTokenizer()
    words = [tok.token_bytes(single).decode(), " " + "".join(tok.token_bytes(t).decode() for t in pair)]
    for params in (SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, bad_words=words),
                   SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True, bad_words=words)):
        for o in outputs(params):
            assert single not in o
            assert all(tuple(o[i:i + 2]) != pair for i in range(len(o) - 1))


def test_bad_words_leading_space_variant_is_vllms():
    # a word and its leading-space form: both when they have as many tokens and differ in the first
    enc = {"Paris": [10], " Paris": [11], "New York": [12, 13], " New York": [14, 13], "ab": [1, 2], " ab": [5]}
    assert bad_words_token_ids(["Paris", "New York", " ab"], lambda s: enc[s]) == [[10], [11], [12, 13], [14, 13],
                                                                                 [1, 2]]


def test_masks_yield_to_a_row_they_would_empty():
    tm = TokenMasks(4, allowed_token_ids=[1, 2], min_tokens=3, stop_ids=[1, 2])
    x = tm.apply(np.array([5.0, 1.0, 2.0, 3.0]), [])
    assert np.isneginf(x[[0, 3]]).all() and np.isfinite(x[[1, 2]]).all()    # min_tokens would empty it: not applied
    grammar = np.array([0.0, -np.inf, -np.inf, 1.0])                          # a grammar allows only 0 and 3
    assert np.array_equal(TokenMasks(4, allowed_token_ids=[1, 2]).apply(grammar, []), grammar)


def test_priority_lower_value_is_scheduled_first_as_in_vllm():
    from pyengine.llm import LLM

    llm = LLM(runner=FakeRunner(num_blocks=128, block_size=4), max_num_seqs=1, max_num_batched_tokens=32)
    outs = llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8]}, {"prompt_token_ids": [9]}],
                        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), priority=[0, 5, -1])
    first = [o.metrics.first_scheduled_time for o in outs]
    assert first[2] < first[0] < first[1]            # the last one added, priority -1, ran first; 5 ran last
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["ab"], SamplingParams(max_tokens=2), priority=["high"])
    with pytest.raises(ValueError, match="priorities"):
        llm.generate(["ab", "cd"], SamplingParams(max_tokens=2), priority=[1])


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_speculation_keeps_the_masks(temperature):
    params = SamplingParams(temperature=temperature, seed=11, max_tokens=24, min_tokens=10, bad_words=["b", "cd"],
                            allowed_token_ids=list(range(0, 30)))
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 5, 6, 5, 6, 5, 6], [9, 8, 7, 9, 8, 7, 9]]
    results = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}):
        eng = engine_with(context_logits, speculative_config=spec)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", {"prompt_token_ids": p}, params)
        results.append({k: v.outputs[0].token_ids for k, v in run_all(eng).items()})
        if spec is not None:
            assert eng.stats()["spec_decode_num_draft_tokens"] > 0
    assert results[0] == results[1]
    for toks in results[0].values():
        assert B not in toks and set(toks) <= set(range(30)) and EOS not in toks[:10]
        assert all(toks[i:i + 2] != [C, 4] for i in range(len(toks) - 1))


def test_engine_refusals_name_the_field():
    eng = engine_with(context_logits)
    for params, word in ((SamplingParams(allowed_token_ids=[VOCAB]), "allowed_token_ids"),
                         (SamplingParams(max_tokens=None, min_tokens=300), "min_tokens"),
                         (SamplingParams(thinking_token_budget=8), "thinking_token_budget"),
                         (SamplingParams(allowed_token_ids=[A], bad_words=["a"]), "bad_words")):
        with pytest.raises(ValueError, match=word):
            eng.add_request("x", {"prompt_token_ids": [1, 2]}, params)
        assert not eng.has_unfinished_requests()
    with pytest.raises(ValueError, match="priority"):
        eng.add_request("x", {"prompt_token_ids": [1, 2]}, SamplingParams(), priority="1")


def test_thinking_budget_state_forces_the_close_once_spent():
    text = {1: b"<think>", 2: b"x", 3: b"</think>", 4: b"\n", 5: b"<thi", 6: b"nk>"}
    tb = ThinkingBudget(2, [3, 4, 4], text.__getitem__, open_in_prompt=False)
    for t in (5, 6, 2):                                # a tag split over two tokens opens it
        assert tb.forced_token() is None
        tb.advance(t)
    tb.advance(2)
    assert [tb.forced_token()] == [3]
    for t in (3, 4, 4):
        assert tb.forced_token() == t
        tb.advance(t)
    assert tb.forced_token() is None and tb.mode == "done"
    tb = ThinkingBudget(5, [3], text.__getitem__, open_in_prompt=True)
    for t in (2, 2, 3):                                # closed by the model inside its budget: nothing forced
        tb.advance(t)
    assert tb.mode == "done" and tb.forced_token() is None
    tb = ThinkingBudget(0, [3], text.__getitem__, open_in_prompt=False)
    tb.advance(2)                                      # an answer that does not open with <think>: no budget
    assert tb.mode == "done"


def test_cli_min_tokens_and_bad_words_on_the_real_model(capsys, monkeypatch):
    from pyengine.cli import generate as generate_cli
    from pyengine.cli import main
    from pyengine.llm import LLM

    llm = LLM(max_model_len=512)
    monkeypatch.setattr(generate_cli, "load_llm", lambda args: llm)
    paris = ["generate", "The capital of France is", "--temperature", "0", "--max-tokens", "4"]
    assert main(paris) == 0 and capsys.readouterr().out.startswith(" Paris")
    assert main(paris + ["--bad-words", "Paris", "--bad-words", "France"]) == 0
    out = capsys.readouterr().out
    assert "Paris" not in out and "France" not in out and out.strip()
    chat = ["generate", "What is 2+2?", "--chat", "--temperature", "0", "--max-tokens", "20"]
    assert main(chat) == 0
    short = capsys.readouterr()
    assert "finish stop" in short.err
    assert main(chat + ["--min-tokens", "20"]) == 0
    longer = capsys.readouterr()
    assert "finish length" in longer.err and longer.out.startswith(short.out.rstrip("\n"))
    assert main(["generate", "x", "--min-tokens", "-1"]) != 0
    assert "min_tokens" in capsys.readouterr().err
