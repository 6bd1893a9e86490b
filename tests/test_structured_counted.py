"""Issue 32 item 7: string lengths counted at run time (structured/counter.py) are exact at any bound.

A ``maxLength`` (or ``minLength``) whose counted automaton would not fit the state budget used to be lowered
silently (HttpUrl's 2083 became 88); now the string is a counted rule of the pushdown matcher. Checked
against jsonschema (with its format checker): boundaries L-1 / L / L+1, JSON escapes and multi-byte
characters counted as the decoded string's code points, long outputs forced with a length-loving sampler,
the counted token mask against the byte-by-byte trie walk, and the compile cost of ``maxLength: 1000000``.
"""
import json
import pickle
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from pyengine.structured import GrammarMatcher, compile_grammar
from pyengine.structured.automaton import PushdownMatcher
from pyengine.structured.counter import CountedRule
from pyengine.structured.json_schema import dumps
from structured_support import accepts, automaton_of, default_validator, vocab

sys.path.insert(0, str(Path(__file__).resolve().parent))


def counted_rules(a):
    return [r for r in getattr(a, "rules", {}).values() if isinstance(r, CountedRule)]


URI = {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083}         # pydantic's HttpUrl
EMAIL = {"type": "string", "format": "email", "maxLength": 100}
HOST = {"type": "string", "format": "hostname", "minLength": 3, "maxLength": 100}
PLAIN = {"type": "string", "minLength": 1200, "maxLength": 1500}


def _host(n):
    """A hostname of n characters (labels of at most 60)."""
    return "".join("." if i % 61 == 60 and i < n - 1 else "a" for i in range(n))


def _sizes(lo, hi):
    out = {0, 1}
    for b in (lo, hi):
        if b is not None:
            out |= {b - 1, b, b + 1}
    return sorted(n for n in out if n >= 0)


@pytest.mark.parametrize("schema,make", [
    (URI, lambda n: "http://a.b/" + "c" * (n - 11) if n >= 11 else "a:" + "b" * (n - 2) if n >= 2 else None),
    (EMAIL, lambda n: "a" * 10 + "@" + _host(n - 15) + ".com" if n >= 17 else None),
    (HOST, _host),
    (PLAIN, lambda n: "\u00e9\n\"\\" * (n // 4) + "z" * (n % 4)),   # 2-byte UTF-8, escapes: one char each
    ({"type": "string", "pattern": "^[a-z\u00e9]*$", "maxLength": 3001}, lambda n: "\u00e9" * n),
])
def test_boundaries_exact_against_jsonschema(schema, make):
    """Every length at the bounds (L-1, L, L+1) is accepted exactly when jsonschema validates it."""
    a = automaton_of(schema)
    assert isinstance(a, PushdownMatcher) and counted_rules(a), "the bound must be counted at run time"
    v = default_validator(schema)
    for n in _sizes(schema.get("minLength"), schema.get("maxLength")):
        s = make(n)
        if s is None:
            continue
        assert len(s) == n
        assert accepts(a, dumps(s)) == v.is_valid(s), (schema, n, s[:40])
    # an escape counts as the one code point it decodes to: \\u001f written as 6 bytes
    if schema is PLAIN:
        hi = schema["maxLength"]
        assert accepts(a, '"' + "\\u001f" * hi + '"') and not accepts(a, '"' + "\\u001f" * (hi + 1) + '"')


def test_counted_token_masks_match_the_byte_walk():
    """The counted rule's vectorized mask (per product state, shifted by the count) equals the pushdown
    matcher's byte-by-byte trie walk, near both bounds and in between."""
    v = vocab()
    schema = {"type": "object", "properties": {"h": HOST, "p": {"type": "string", "minLength": 1002,
                                                                "maxLength": 1010}}, "required": ["h", "p"]}
    a = automaton_of(schema)
    prefixes = ['{"h":"', '{"h":"a', '{"h":"ab', '{"h":"' + _host(98), '{"h":"' + _host(99), '{"h":"' + _host(100),
                '{"h":"abc","p":"', '{"h":"abc","p":"' + "x" * 1000, '{"h":"abc","p":"' + "x" * 1001,
                '{"h":"abc","p":"' + "x" * 1002, '{"h":"abc","p":"' + "x" * 1008, '{"h":"abc","p":"' + "x" * 1010,
                '{"h":"a-b.c', '{"h":"' + "a" * 60 + "."]
    for p in prefixes:
        st = a.step(a.initial(), p.encode())
        assert st, p
        fast, ref = a.token_mask(st, v), a.trie_mask(st, v)
        assert np.array_equal(fast, ref), (p[-20:], np.flatnonzero(fast ^ ref)[:10])


def _generate(schema, length_loving: bool, seed: int = 0, limit: int = 3000, finish_after: int | None = None):
    """Decode with a sampler that prefers long tokens inside strings (or random ones, then after
    ``finish_after`` tokens short ones and quotes): (text, n tokens)."""
    v = vocab()
    g = compile_grammar(("json", schema), v)
    m = GrammarMatcher(g)
    lens = np.array([len(b) if b is not None else 0 for b in v.token_bytes] + [0] * (v.size - len(v.token_bytes)),
                    dtype=np.float64)
    quote = np.array([b is not None and b'"' in b for b in v.token_bytes] + [False] * (v.size - len(v.token_bytes)))
    rng = np.random.default_rng(seed)
    out = []
    for i in range(limit):
        logits = rng.standard_normal(v.size)
        if finish_after is not None and i >= finish_after:
            logits = logits - 4.0 * lens + 30.0 * quote
        elif length_loving:
            logits = logits + 4.0 * lens - 50.0 * quote
        mask = m.allowed_mask()
        tid = int(np.argmax(np.where(mask, logits, -np.inf)))
        if tid in v.eos_token_ids:
            break
        assert m.advance(tid)
        out.append(tid)
    assert m.is_complete()
    return b"".join(v.token_bytes[t] for t in out).decode("utf-8"), len(out)


@pytest.mark.parametrize("schema,old_cap", [(EMAIL, 50), (URI, 88)])
def test_long_outputs_reach_past_the_old_cap_and_validate(schema, old_cap):
    text, _ = _generate({"type": "object", "properties": {"s": schema}, "required": ["s"]}, length_loving=True)
    value = json.loads(text)["s"]
    assert default_validator(schema).is_valid(value), value
    assert old_cap < len(value) <= schema["maxLength"], len(value)


def test_random_outputs_validate():
    schema = {"type": "object", "properties": {"e": EMAIL, "h": HOST, "u": URI}, "required": ["e", "h", "u"]}
    v = default_validator(schema)
    for seed in range(3):
        text, _ = _generate(schema, length_loving=False, seed=seed, limit=600, finish_after=150)
        assert v.is_valid(json.loads(text)), text


def test_huge_bounds_compile_small():
    """maxLength 1000000 (and a minLength of thousands) costs the uncounted automaton only: compile memory
    bounded, the automaton small when pickled (as the compile worker ships it), and the bounds exact."""
    tracemalloc.start()
    a = automaton_of({"type": "string", "maxLength": 1000000})
    b = automaton_of({"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$", "minLength": 5000,
                       "maxLength": 1000000})
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 << 20, peak
    assert len(pickle.dumps(a)) < 1 << 20 and len(pickle.dumps(b)) < 4 << 20
    rule = counted_rules(a)[0]              # a million characters walked on the rule (no pushdown states)
    st, y = 1, ord("y")
    for n in range(1, 1_000_002):
        st = rule.rows[st][y]
        if n >= 999_999:
            assert bool(st) == (n <= 1_000_000) and (not st or rule.accepting[st]), n
    local = "a" * 4994
    assert not accepts(b, dumps(local[:-1] + "@b.com")) and accepts(b, dumps(local + "@b.com"))
    assert not accepts(b, dumps("a@b.com"))
    c = pickle.loads(pickle.dumps(b))
    assert accepts(c, dumps(local + "@b.com"))


def test_unsatisfiable_counted_bounds_are_refused():
    from pyengine.structured import GrammarError
    for schema, keyword in [({"type": "string", "minLength": 3000, "maxLength": 2000}, "minLength"),
                            ({"type": "string", "format": "ipv4", "minLength": 2000}, "minLength")]:
        with pytest.raises(GrammarError) as e:
            compile_grammar(("json", schema), vocab())
        assert e.value.keyword == keyword, (schema, str(e.value))


def test_counted_completion_lengths_respect_gaps():
    """A pattern of even lengths under an odd bound: the counter never lets the output reach a length
    from which no completion fits (the completion bitset, not just shortest/longest)."""
    schema = {"type": "string", "pattern": "^(ab)*$", "minLength": 2101, "maxLength": 2104}
    a = automaton_of(schema)
    assert counted_rules(a)
    for n in range(2098, 2108):
        assert accepts(a, dumps("ab" * (n // 2) + "a" * (n % 2))) == (n % 2 == 0 and 2101 <= n <= 2104), n
    # the walk from an accepted prefix never dead-ends
    text, _ = _generate(schema, length_loving=True, limit=4000)
    assert len(json.loads(text)) in (2102, 2104)
