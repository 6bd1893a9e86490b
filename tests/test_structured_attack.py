"""Issue 27 (S15): grammars as an attack surface, below the server. Every reproduction of the issue is a
fixed case here: numeric-range, alternation, regex and ReDoS bombs answer at once (compiled, or refused
by the state budget naming its limit); deep nesting, huge bounds and wrong types are `GrammarError`s
(HTTP 400), never RecursionError / OverflowError / TypeError; a grammar whose language is empty is refused
at compile time; refusals are cached; and a grammar failing at run time ends its own sequence
(finish_reason "error") while the batch around it decodes exactly as it does alone.

Independent references: Python's ``re`` on the test's own patterns (never the client's), integer
arithmetic for the ranges, and each request decoded alone."""
from __future__ import annotations

import random
import re

import pytest

from engine_fakes import FakeRunner
from structured_support import accepts
from pyengine.llm import LLM
from pyengine.sampling_params import SamplingParams, StructuredOutputsParams
from pyengine.structured import automaton as A
from pyengine.structured import matcher as M
from pyengine.structured.budget import Budget, GrammarTooLarge, GrammarTooSlow, compile_budget
from pyengine.structured.ir import GrammarError
from pyengine.structured.json_schema import int_range

AMBIGUOUS = 'root ::= e\ne ::= " " e "x" | " " g "y" | "b"\ng ::= " " e "z" | " " g "w" | "b"'
REF_CHAIN = {"$defs": {**{f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(600)}, "d600": {"type": "string"}},
             "$ref": "#/$defs/d0"}


def compiled(kind, spec, **budget):
    M._cache.clear()
    M._refusals.clear()
    return M.compile_automaton(kind, spec, Budget(**({"seconds": 30.0} | budget)))


# --- the bodies: each answered, none with an internal error ---------------------------------------
REFUSED = [
    ("regex", "a{1000}{1000}", GrammarTooLarge, "--max-grammar-states"),
    ("regex", r"\w{1000}", GrammarTooLarge, "--max-grammar-states"),
    ("regex", "(a|b)*a(a|b){20}", GrammarTooLarge, "DFA states"),
    ("json", {"type": "number", "minimum": 0, "maximum": 1e308}, GrammarTooLarge, "DFA states"),
    ("grammar", AMBIGUOUS, A.TooAmbiguous, "parse stacks"),
    ("regex", "(" * 5000 + "a" + ")" * 5000, GrammarError, "nested deeper"),
    ("grammar", "root ::= " + "(" * 5000 + '"a"' + ")" * 5000, GrammarError, "nested deeper"),
    ("json", "[" * 5000 + "]" * 5000, GrammarError, "nests too deeply"),
    ("json", REF_CHAIN, GrammarError, "deeper than"),
    ("json", {"type": "integer", "maximum": 10 ** 400}, GrammarError, "maximum"),
    ("json", {"$ref": 5}, GrammarError, "$ref must be a string"),
    ("json", {"properties": {"a": {"$ref": ["x"]}}}, GrammarError, "$ref must be a string"),
    ("regex", r"[^\s\S]", GrammarError, "matches nothing"),
    ("grammar", r"root ::= [^\x00-\U0010FFFF]", GrammarError, "matches nothing"),
    ("grammar", 'root ::= a\na ::= "x" a', GrammarError, "matches nothing"),
    ("grammar", 'root ::= "a"{-1}', GrammarError, "non-negative"),
    ("grammar", 'root ::= "a"{2,-1}', GrammarError, "non-negative"),
]


@pytest.mark.parametrize("kind,spec,cls,words", REFUSED, ids=[f"{k}-{i}" for i, (k, *_) in enumerate(REFUSED)])
def test_bombs_and_bad_grammars_are_refused_naming_the_limit(kind, spec, cls, words):
    with pytest.raises(cls, match=re.escape(words)):
        compiled(kind, spec)


def test_numeric_ranges_are_exact_and_linear_in_digits():
    # the ranges compile (the builder recursed twice per digit: 2^digits)
    for lo, hi in ((0, 10 ** 19), (-(2 ** 53 - 1), 2 ** 53 - 1), (10 ** 30 + 7, 10 ** 40 - 3)):
        a = A.compile_rules({"root": int_range(lo, hi)}, "root")
        for v in (lo, hi, lo + 1, hi - 1, (lo + hi) // 2, 0, 1, -1):
            assert accepts(a, str(v)) == (lo <= v <= hi), v
        for v in (lo - 1, hi + 1, hi * 10, -0):
            assert accepts(a, str(v)) == (lo <= v <= hi), v
        assert not accepts(a, "-0") and not accepts(a, "01")
    rng = random.Random(27)
    for _ in range(60):       # random bounds against integer comparison
        lo = rng.randint(-10 ** rng.randint(0, 12), 10 ** rng.randint(0, 12))
        hi = lo + rng.randint(0, 10 ** rng.randint(0, 12))
        a = A.compile_rules({"root": int_range(lo, hi)}, "root")
        for v in [lo - 1, lo, hi, hi + 1] + [rng.randint(lo - 50, hi + 50) for _ in range(20)]:
            assert accepts(a, str(v)) == (lo <= v <= hi), (lo, hi, v)
    schema = {"type": "integer", "minimum": 0, "maximum": 10 ** 19}
    assert accepts(compiled("json", schema), str(10 ** 19))


def test_choice_and_enum_are_tries():
    words = ["", "a", "ab", "abc", "b", "xyz", "xyw", "é", "a\"b"]
    a = compiled("choice", [w for w in words if w] + ["a"])          # duplicates are fine
    for w in words[1:] + ["abcd", "x", "xy", "c", "e"]:
        assert accepts(a, w) == (w in words[1:]), w
    e = compiled("json", {"enum": ["red", "green", 1, None, {"k": [1, 2]}, "re"]})
    for text, ok in (('"red"', True), ('"re"', True), ('"r"', False), ("1", True), ("null", True),
                     ('{"k":[1,2]}', True), ('"green"', True), ('"greens"', False)):
        assert accepts(e, text) == ok, text
    # 100k literals: the trie is linear; the automaton is then refused by the state budget at once, or built
    many = [f"item-{i}-{i * 7919 % 100003}" for i in range(100_000)]
    try:
        big = compiled("choice", many)
    except GrammarTooLarge as err:
        assert "states" in str(err)
    else:
        assert accepts(big, many[12345]) and not accepts(big, "item-")


def test_pattern_properties_use_the_projects_regex_engine():
    # the ReDoS: re.search("^(a+)+$", "a" * 30 + "!") backtracks for minutes
    name = "a" * 40 + "!"
    schema = {"type": "object", "patternProperties": {"^(a+)+$": {"type": "integer"}},
              "properties": {name: {"type": "string"}}, "additionalProperties": False}
    a = compiled("json", schema)
    assert accepts(a, '{"%s":"v"}' % name) and accepts(a, '{"%s":"v","aaa":3}' % name)
    assert not accepts(a, '{"%s":"v","aab":3}' % name)
    # the listed name matching a pattern is still found (same answers as re.search on these patterns)
    for pattern, listed in (("^x[0-9]+$", "x12"), ("b", "abc"), ("^q$", "q\n")):
        assert re.search(pattern, listed)
        with pytest.raises(GrammarError, match="matches a listed property"):
            compiled("json", {"type": "object", "patternProperties": {pattern: {"type": "integer"}},
                              "properties": {listed: {"type": "string"}}})
    pn = {"type": "object", "propertyNames": {"pattern": "^(a|aa)+$"}, "additionalProperties": {"type": "integer"}}
    a = compiled("json", pn)
    assert accepts(a, '{"aaaa":1}') and not accepts(a, '{"aab":1}')
    with pytest.raises(GrammarError, match="propertyNames"):
        compiled("json", {"type": "object", "propertyNames": {"pattern": "(?=a)"}})


def test_refusals_are_cached(monkeypatch):
    calls = []
    real = M.grammar_rules
    monkeypatch.setattr(M, "grammar_rules", lambda kind, spec: (calls.append(kind), real(kind, spec))[1])
    M._refusals.clear()
    M._cache.clear()
    for _ in range(3):
        with pytest.raises(GrammarTooLarge, match="automaton states"):
            M.compile_automaton("regex", "a{1000}{1000}")
    assert calls == ["regex"]
    for _ in range(2):
        M.compile_automaton("regex", "[ab]{3}")
    assert calls == ["regex", "regex"]


def test_the_time_and_state_budgets():
    with pytest.raises(GrammarTooSlow, match="--max-grammar-compile-s"):
        with compile_budget(Budget(seconds=0.0)):
            A.compile_rules(*M.grammar_rules("regex", "(a|b)*a(a|b){12}"))
    with pytest.raises(GrammarTooLarge, match="the limit is 20 automaton states"):
        compiled("regex", "[a-z]{40}", max_states=20)
    assert accepts(compiled("regex", "[a-z]{40}"), "q" * 40)


# --- run time: a grammar's failure is its sequence's ----------------------------------------------------
def fake_llm():
    return LLM(runner=FakeRunner(num_blocks=256, block_size=4), max_model_len=64, max_num_seqs=8,
               max_num_batched_tokens=64)


def test_a_grammar_failing_at_run_time_ends_only_its_sequence(monkeypatch):
    """The ambiguous grammar is let through compile time (no probe) with a stack budget of 1: its first
    token ("s", the only one allowed) needs more stacks and fails. That sequence finishes with "error";
    three neighbours in the same batch give exactly what they give alone."""
    ambiguous = 'root ::= e\ne ::= "s" e "x" | "s" g "y" | "sb"\ng ::= "s" e "z" | "s" g "w" | "sb"'
    neighbours = [SamplingParams(temperature=0, max_tokens=12),
                  SamplingParams(temperature=0.8, seed=3, max_tokens=12),
                  SamplingParams(temperature=0, max_tokens=12,
                                 structured_outputs=StructuredOutputsParams(regex="[a-f]{3,9}"))]
    prompts = ["abc", "hello", "xyz"]
    alone = [fake_llm().generate([p], sp)[0].outputs[0] for p, sp in zip(prompts, neighbours)]
    monkeypatch.setattr(A, "PROBE_STATES", 0)
    monkeypatch.setattr(A, "MAX_STACKS", 1)
    M._cache.clear()
    M._cache.clear()
    M._refusals.clear()
    bad = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(grammar=ambiguous))
    llm = fake_llm()
    outs = llm.generate(prompts[:2] + ["q"] + prompts[2:], neighbours[:2] + [bad] + neighbours[2:])
    assert outs[2].outputs[0].finish_reason == "error"
    for got, want in zip(outs[:2] + outs[3:], alone):
        assert got.outputs[0].token_ids == want.token_ids and got.outputs[0].finish_reason == want.finish_reason
    assert not llm.llm_engine.has_unfinished_requests()
    M._cache.clear()
    M._cache.clear()


def test_a_failed_matcher_takes_every_token_and_rolls_back(monkeypatch):
    """The speculative paths (draft masks, a drafter's mask_after) roll back what they advanced: a matcher
    whose grammar failed mid-draft must still roll back cleanly and allow only EOS."""
    from structured_support import vocab
    monkeypatch.setattr(A, "PROBE_STATES", 0)
    monkeypatch.setattr(A, "MAX_STACKS", 1)
    M._cache.clear()
    M._refusals.clear()
    v = vocab()
    g = M.CompiledGrammar(M.compile_automaton("grammar", 'root ::= e\ne ::= "s" e "x" | "s" g "y" | "sb"\n'
                                              'g ::= "s" e "z" | "s" g "w" | "sb"'), v)
    m = M.GrammarMatcher(g)
    s_tok = next(t for t, b in enumerate(v.token_bytes) if b == b"s")
    masks = m.draft_masks([s_tok, s_tok])
    assert m.error is not None and "too ambiguous" in m.error and not m.history
    assert masks[-1].nonzero()[0].tolist() == sorted(v.eos_token_ids)
    assert m.mask_after([s_tok]).nonzero()[0].tolist() == sorted(v.eos_token_ids) and not m.history
    M._cache.clear()
