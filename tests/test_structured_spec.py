"""S15 x S14: speculative drafts of constrained sequences are checked against the grammar.

Over the fake runner of the engine tests (exact arithmetic, so greedy must be token-identical):
- greedy constrained decoding (regex, choice, GBNF, JSON Schema) with n-gram and with draft-model speculation,
  batched with unconstrained and sampled sequences and with n > 1, emits exactly the tokens of the same
  requests without speculation; outputs validate with Python's `re`, jsonschema or a hand parser; drafts of
  the constrained sequences are counted, accepted and cut by the grammar;
- sampled: the joint law of the first three tokens under a choice grammar, computed by hand from the choice
  strings and the fake model's logits (no grammar engine), is what the engine samples with drafters that
  ignore the grammar (one-hot guesses, or distributions q over the whole vocabulary) and with a draft model
  that masks its own guesses (chi-square over seeded runs);
- negative controls: verification rows left unmasked fail the greedy test; rejection against the unmasked
  draft distribution fails the chi-square test.
"""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

import engine_fakes
from engine_fakes import EOS, VOCAB, FakeTokenizer, context_logits, make_engine, run_all
from pyengine.structured import processor
from pyengine.sampling_params import SamplingParams, StructuredOutputsParams as SO
from sampling_reference import chi2_pvalue
from test_spec_draft_model import PerturbedRunner

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
DRAFT = {"method": "draft_model", "model": "fake", "num_speculative_tokens": 3, "adaptive": False}
JSON_CHARS = '{}[]":,0123456789abcdefghijklmnopqrstuvwxyz -.E'      # 47 one-byte tokens (ids 1..47)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["ab", "cd"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def anbn(text: str) -> bool:
    """The hand parser of the GBNF case: x b^n a c^n y."""
    m = re.fullmatch(r"x(b*)a(c*)y", text)
    return bool(m) and len(m.group(1)) == len(m.group(2))


# name -> (constraint, prompt, validity check of a finished output's text)
CASES = {
    "regex": (SO(regex="(ab|cd|abc)+x{1,3}"), "abcdabxabcdcdabcxabcab",
              lambda t: re.fullmatch("(ab|cd|abc)+x{1,3}", t) is not None),
    "choice": (SO(choice=["abcabc", "abcab", "cabcab", "bcbcbc"]), "abcabcabcabcab",
               lambda t: t in ("abcabc", "abcab", "cabcab", "bcbcbc")),
    "gbnf": (SO(grammar='root ::= "x" expr "y"\nexpr ::= "a" | "b" expr "c"\n'), "xbbaccyxbacyxbbb", anbn),
    "json": (SO(json=SCHEMA), '{"name":"abc","age":12,"tags":["ab","cd"]}{"name":"ab',
             lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
}


@pytest.fixture
def alphabet(monkeypatch):
    """The fake tokenizer's 47 characters; the JSON case needs braces, quotes and digits."""
    def use(name):
        if name == "json":
            monkeypatch.setattr(engine_fakes, "_CHARS", JSON_CHARS)
    return use


def requests(name):
    so, prompt, _ = CASES[name]
    greedy = SamplingParams(temperature=0.0, max_tokens=48, n=2, logprobs=2, structured_outputs=so)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=48, structured_outputs=so)
    free = SamplingParams(temperature=0.0, max_tokens=20)
    return [(prompt, greedy), (prompt[::-1], free), (prompt, sampled), (prompt[3:], greedy)]


def generate(reqs, spec=None, **kw):
    tok = FakeTokenizer()
    draft = PerturbedRunner(num_blocks=256, block_size=4) if spec is DRAFT else None
    eng = make_engine(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=96, speculative_config=spec,
                      draft_runner=draft, **kw)
    for i, (prompt, params) in enumerate(reqs):
        eng.add_request(f"r{i}", {"prompt_token_ids": tok.encode(prompt)}, params)
    final = run_all(eng)
    assert eng.num_used_blocks() == 0
    return [final[f"r{i}"] for i in range(len(reqs))], eng


def tokens(outs, skip=()):
    return [[c.token_ids for c in o.outputs] for i, o in enumerate(outs) if i not in skip]


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft_model"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_constrained_speculation_equals_plain(name, spec, alphabet):
    alphabet(name)
    reqs = requests(name)
    plain, _ = generate(reqs)
    outs, eng = generate(reqs, spec)
    # greedy rows (constrained with n = 2, and free) are token-identical; the sampled one is only valid
    assert tokens(outs, skip={2}) == tokens(plain, skip={2})
    # logprobs are the model's raw distribution in both (not the masked rows')
    assert [c.logprobs for c in outs[0].outputs] == [c.logprobs for c in plain[0].outputs]
    check = CASES[name][2]
    finished = [c for i in (0, 2, 3) for c in outs[i].outputs if c.finish_reason == "stop"]
    assert finished and all(check(c.text) for c in finished)
    # the constrained sequences were speculated on and their drafts counted (per request and in the engine)
    m = outs[0].metrics
    assert m.num_draft_tokens > 0 and 0 < m.num_accepted_tokens <= m.num_draft_tokens
    st = eng.stats()
    assert st["spec_decode_num_draft_tokens"] >= sum(o.metrics.num_draft_tokens for o in outs)
    if spec is NGRAM:               # prompt lookup ignores the grammar: some drafts are cut by it
        assert st["spec_decode_num_grammar_cut_tokens"] > 0
    else:                           # the draft model masks its own guesses: nothing to cut
        assert st["spec_decode_num_grammar_cut_tokens"] == 0


def test_greedy_constrained_speculation_under_a_tight_budget_and_preemption(alphabet):
    """Drafts trimmed by the scheduler (token budget 12) and sequences preempted (few blocks) still give
    plain constrained decoding's tokens (JSON: the longest outputs)."""
    alphabet("json")
    reqs = requests("json")
    plain, _ = generate(reqs)
    tok = FakeTokenizer()
    eng = make_engine(num_blocks=28, max_num_seqs=6, max_num_batched_tokens=12, speculative_config=NGRAM)
    for i, (prompt, params) in enumerate(reqs):
        eng.add_request(f"r{i}", {"prompt_token_ids": tok.encode(prompt)}, params)
    final = run_all(eng)
    outs = [final[f"r{i}"] for i in range(len(reqs))]
    assert tokens(outs, skip={2}) == tokens(plain, skip={2})
    st = eng.stats()
    assert st["num_preemptions"] > 0 and st["spec_decode_num_accepted_tokens"] > 0
    assert eng.num_used_blocks() == 0


def test_negative_control_unmasked_verification_rows_fail(monkeypatch, alphabet):
    """Rows scored without the grammar's mask: the correction tokens leave the grammar (the engine refuses
    them) or the output differs from plain constrained decoding."""
    monkeypatch.setattr(processor, "mask_rows", lambda rows, masks: rows)
    for name in ("regex", "choice"):
        reqs = requests(name)[:1]
        plain, _ = generate(reqs)
        try:
            outs, _ = generate(reqs, NGRAM)
        except RuntimeError as exc:
            assert "outside the grammar" in str(exc)
            continue
        assert tokens(outs) != tokens(plain)


def test_matcher_draft_masks_roll_back():
    """`draft_masks` stops at the first forbidden token, gives the mask after each allowed prefix and leaves
    the matcher where it was; `mask_after` refuses a forbidden prefix."""
    from pyengine.structured import TokenVocabulary, compile_grammar, GrammarMatcher
    tok = FakeTokenizer()
    vocab = TokenVocabulary.from_tokenizer(tok)
    m = GrammarMatcher(compile_grammar(("regex", "ab(c|d)"), vocab))
    m.advance(tok.encode("a")[0])
    state, hist = m.state, list(m.history)
    masks = m.draft_masks(tok.encode("bdx") + [EOS])
    assert len(masks) == 3                                  # "b", "d" allowed; "x" is not
    assert [np.flatnonzero(x).tolist() for x in masks] == [tok.encode("b"), tok.encode("cd"), [EOS]]
    assert m.state == state and m.history == hist and not m.terminated
    assert m.draft_masks(tok.encode("bc") + [EOS, EOS])[-1].tolist() == masks[-1].tolist()
    assert m.state == state and not m.terminated
    assert np.flatnonzero(m.mask_after(tok.encode("b"))).tolist() == tok.encode("cd")
    with pytest.raises(ValueError, match="outside the grammar"):
        m.mask_after(tok.encode("bb"))
    assert m.state == state


# --- sampled: the exact law of the first tokens under a choice grammar ------------------------------------
CHOICES = ["aab", "aba", "abb", "abc", "baa", "bab", "bca", "cab", "ccab", "abca"]
TEMP, NTOK, RUNS, N = 0.9, 3, 40, 50
ALPHA = 1e-3


def choice_law(prompt, top_k=0):
    """P(t1, t2, t3) by hand: at each prefix, softmax(logits / T) over the next characters of the choice
    strings that extend it (the fake model's logits; no grammar engine), the ``top_k`` best of them if set."""
    tok = FakeTokenizer()
    law = {}

    def rec(ctx, prefix, prob):
        if len(prefix) == NTOK:
            law[tuple(tok.encode(prefix))] = prob
            return
        nxt = sorted({s[len(prefix)] for s in CHOICES if s.startswith(prefix) and len(s) > len(prefix)})
        ids = [tok.encode(c)[0] for c in nxt]
        if top_k:
            keep = sorted(range(len(ids)), key=lambda j: -context_logits(ctx)[ids[j]])[:top_k]
            nxt, ids = [nxt[j] for j in keep], [ids[j] for j in keep]
        x = context_logits(ctx).astype(np.float64)[ids] / TEMP
        w = np.exp(x - x.max())
        for c, i, pc in zip(nxt, ids, w / w.sum()):
            rec(ctx + [i], prefix + c, prob * pc)

    rec(list(prompt), "", 1.0)
    return law


class LetterProposer:
    """Guesses letters that ignore the grammar, each position independently from a fixed q over a few
    letters ("U" is never allowed), and reports q (``report_q``) or only the guesses (one-hot)."""
    free = True
    relative_cost = 0.0

    def __init__(self, weights: dict, report_q: bool = True):
        tok = FakeTokenizer()
        self.ids = [tok.encode(c)[0] for c in weights]
        self.q = np.zeros(VOCAB)
        self.q[self.ids] = np.array(list(weights.values())) / sum(weights.values())
        self.report_q = report_q

    def propose(self, seqs, ks, rngs=None):
        return [([int(rng.choice(VOCAB, p=self.q)) for _ in range(k)],
                 np.tile(self.q, (k, 1)) if k and self.report_q else None) for k, rng in zip(ks, rngs)]

    def release(self, seq):
        pass


# against the unmasked q, rejection sampling draws "a" too rarely: half of its q is on a forbidden letter
SKEWED = {"a": 0.5, "U": 0.5}
LETTERS = {"a": 0.4, "b": 0.3, "c": 0.2, "U": 0.1}


def sampled_law(prompt, spec, proposer=None, top_k=0):
    eng = make_engine(num_blocks=1024, max_num_seqs=N, max_num_batched_tokens=512, speculative_config=spec,
                      draft_runner=PerturbedRunner(num_blocks=1024, block_size=4) if spec is DRAFT2 else None)
    if proposer is not None:
        eng.spec.proposer = proposer
    # room for the choice to end (its EOS): drafts of k = 2 then cover tokens 2 and 3
    params = SamplingParams(n=N, temperature=TEMP, top_k=top_k, max_tokens=NTOK + 2,
                            structured_outputs=SO(choice=CHOICES))
    for r in range(RUNS):
        eng.add_request(f"r{r}", {"prompt_token_ids": prompt}, params.clone(seed=3000 + r))
    final = run_all(eng)
    outs = [c for out in final.values() for c in out.outputs]
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in outs)
    return [tuple(c.token_ids[:NTOK]) for c in outs], eng.stats()


DRAFT2 = {**DRAFT, "num_speculative_tokens": 2}
ORACLE = {**NGRAM, "num_speculative_tokens": 2}
PROMPT = [5, 9, 14, 2, 33]


def fits(samples, law) -> bool:
    cells = sorted(law)
    counts = [samples.count(c) for c in cells]
    return sum(counts) == len(samples) and chi2_pvalue(counts, [law[c] for c in cells]) > ALPHA


@pytest.mark.parametrize("drafter", ["one_hot", "sampled_q", "skewed", "draft_model"])
def test_sampled_first_tokens_follow_the_constrained_law(drafter):
    law = choice_law(PROMPT)
    proposer = {"one_hot": LetterProposer(LETTERS, report_q=False), "sampled_q": LetterProposer(LETTERS),
                "skewed": LetterProposer(SKEWED), "draft_model": None}[drafter]
    samples, st = sampled_law(PROMPT, DRAFT2 if drafter == "draft_model" else ORACLE, proposer)
    assert len(samples) == RUNS * N
    assert st["spec_decode_num_drafts"] >= len(samples) // 3
    if drafter != "skewed":         # row 2 masked with the state after an accepted draft
        assert st["spec_decode_num_accepted_tokens_per_pos"][1] > 100
    assert 0 < st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]
    assert (st["spec_decode_num_grammar_cut_tokens"] == 0) == (drafter == "draft_model")
    assert fits(samples, law)


@pytest.mark.parametrize("drafter", ["sampled_q", "draft_model"])
def test_sampled_law_with_top_k_after_the_mask(drafter):
    """top-k 2 acts on the allowed tokens (mask first, as plain constrained sampling does)."""
    law = choice_law(PROMPT, top_k=2)
    samples, st = sampled_law(PROMPT, DRAFT2 if drafter == "draft_model" else ORACLE,
                              LetterProposer(LETTERS) if drafter == "sampled_q" else None, top_k=2)
    assert st["spec_decode_num_accepted_tokens"] > 500
    assert fits(samples, law)


def test_negative_control_unmasked_draft_distribution_fails(monkeypatch):
    """Cut drafts, but rejection against the drafter's unmasked q: the law is off."""
    def unmasked(matcher, draft_ids, draft_probs):
        masks = matcher.draft_masks(draft_ids)
        k = len(masks) - 1
        return list(draft_ids[:k]), (None if draft_probs is None or k == 0 else draft_probs[:k]), masks
    monkeypatch.setattr(processor, "check_draft", unmasked)
    law = choice_law(PROMPT)
    samples, _ = sampled_law(PROMPT, ORACLE, LetterProposer(SKEWED))
    assert not fits(samples, law)
