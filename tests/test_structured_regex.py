"""Regex and choice grammars against Python's `re`, and the vectorized token masks against a brute-force
walk of every token (the independent reference for the mask computation)."""
import re

import numpy as np
import pytest

from pyengine.structured import GrammarError, GrammarMatcher, compile_grammar
from pyengine.structured.regex import unicode_class
from structured_support import accepts_text, sample_random_model, tokenizer, vocab

PATTERNS = [r"\d{3}-\d{4}", r"[a-z]+@[a-z]+\.(com|org)", r"(ab|cd)*e?", r"[^0-9\n]{2,5}", r"a{2,}b{0,3}",
            r"(?:yes|no|maybe)", r"\w+\s\w+", r"[A-F0-9]{4}(:[A-F0-9]{4}){0,3}", r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
            r"^\(\d+\)$", r"x.y", r"[\u00e9\u4e2d-\u4e2f]+", r"\S+?\.txt", r"[-+*/]{1,2}", r"(a|b)(c|d){3}",
            r"[[\]]+", r"\x41\t\\"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_regex_sound_and_complete_against_re(pattern):
    from hypothesis import HealthCheck, given, settings, strategies as st
    g = compile_grammar(("regex", pattern), vocab())
    rx = re.compile(pattern)
    rng = np.random.default_rng(abs(hash(pattern)) % 2**32)
    for _ in range(15):                                   # soundness: sampled outputs fullmatch
        _, data = sample_random_model(g, rng, budget=10)
        assert rx.fullmatch(data.decode("utf-8")), (pattern, data)

    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.from_regex(rx, fullmatch=True))
    def complete(text):                                   # completeness: re's matches are accepted
        m = GrammarMatcher(g)
        assert m.advance_bytes(text.encode("utf-8")) and m.is_complete(), (pattern, text)
        tok = tokenizer()
        if tok.decode(tok.encode(text)) == text:
            assert accepts_text(g, text), (pattern, text)
    complete()

    alphabet = "ab cd-0123456789xyz.@\t(\\)é中e"          # agreement on random strings, both ways
    for _ in range(300):
        text = "".join(rng.choice(list(alphabet), size=int(rng.integers(0, 8))))
        m = GrammarMatcher(g)
        ok = m.advance_bytes(text.encode()) and m.is_complete() if text else m.is_complete()
        assert ok == bool(rx.fullmatch(text)), (pattern, text)


def test_unicode_classes_equal_python_re():
    for letter in "dwsDWS":
        ranges = unicode_class(letter)
        rx = re.compile("\\" + letter)
        inside = np.zeros(0x110000, dtype=bool)
        for lo, hi in ranges:
            inside[lo:hi + 1] = True
        for c in list(range(0, 0x3000)) + list(range(0x3000, 0x110000, 97)):
            if 0xD800 <= c <= 0xDFFF:
                continue
            assert inside[c] == bool(rx.fullmatch(chr(c))), (letter, hex(c))


def test_choice():
    g = compile_grammar(("choice", ["red", "green", "blue green"]), vocab())
    for text in ["red", "green", "blue green"]:
        assert accepts_text(g, text)
    for text in ["re", "redd", "blue", ""]:
        assert not accepts_text(g, text)
    with pytest.raises(GrammarError):
        compile_grammar(("choice", []), vocab())


@pytest.mark.parametrize("bad", [r"(a", r"a)", r"(?=a)b", r"\1", r"a\bb", r"(?i)a", r"*a", r"a{3,1}", r"a^b"])
def test_regex_refuses_what_it_cannot_enforce(bad):
    with pytest.raises(GrammarError):
        compile_grammar(("regex", bad), vocab())


def _brute_mask(automaton, state, v):
    mask = np.zeros(v.size, dtype=bool)
    for i, b in enumerate(v.token_bytes):
        if b is not None and automaton.step(state, b):
            mask[i] = True
    return mask


@pytest.mark.parametrize("spec", [("regex", r"[a-z]{1,6}( [a-z]{1,6}){0,3}\."),
                                  ("json", {"type": "object", "properties": {"a": {"type": "string"},
                                            "b": {"type": "array", "items": {"type": "integer"}}}}),
                                  ("json_object", True),
                                  ("grammar", 'root ::= "[" (root ("," root)*)? "]" | [0-9]+ | "\\"" [^"]* "\\""')])
def test_token_masks_equal_brute_force_walk(spec):
    """The vectorized DFA walk and the pushdown frame walk give exactly the tokens whose bytes the
    automaton accepts one byte at a time, at every state along sampled outputs."""
    v = vocab()
    g = compile_grammar(spec, v)
    rng = np.random.default_rng(3)
    states = set()
    for _ in range(3):
        ids, _ = sample_random_model(g, rng, budget=8)
        m = GrammarMatcher(g)
        for tid in ids:
            states.add(m.state)
            m.advance(tid)
    for state in sorted(states)[:12]:
        got = g.automaton.token_mask(state, v)
        assert np.array_equal(got, _brute_mask(g.automaton, state, v)), (spec, state)


def test_draft_acceptance_and_rollback_for_speculative_decoding():
    tok = tokenizer()
    g = compile_grammar(("regex", r"[0-9]{2}-[0-9]{2}"), vocab())
    m = GrammarMatcher(g)
    draft = tok.encode("12-3x4")
    k = m.accept_draft(draft)
    assert tok.decode(draft[:k]) in ("12-3", "12-", "12") and not m.is_complete()
    m.rollback(k)
    assert m.accept_draft(tok.encode("12-34")) == len(tok.encode("12-34")) and m.is_complete()
