"""Issue 32 item 7: minProperties over several additional properties, their names kept distinct at run time
(structured/distinct.py). Checked against jsonschema on the parsed object plus the duplicate-name rule
(``{"a": 1, "a": 2}`` is one property), exhaustively over small objects and with hypothesis; the run-time
mask against the byte-by-byte trie walk; rollback; nested objects with sets of their own."""
import itertools
import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pyengine.structured import GrammarMatcher, compile_grammar
from pyengine.structured.distinct import DistinctKeysRule
from pyengine.structured.ir import GrammarError
from structured_support import accepts, automaton_of, default_validator, sample_random_model, tokenizer, vocab

sys.path.insert(0, str(Path(__file__).resolve().parent))


def valid(validator, text: str) -> bool:
    """jsonschema on the parsed value, and no name twice in one object (the parser would merge them)."""
    dup = []

    def pairs(items):
        names = [k for k, _ in items]
        dup.append(len(names) != len(set(names)))
        return dict(items)

    return validator.is_valid(json.loads(text, object_pairs_hook=pairs)) and not any(dup)


def _write(pairs, escape: set) -> str:
    """An object of (name, value) pairs, compact; names in ``escape`` spelled with \\u escapes only
    (the grammar writes other characters raw: control characters have both spellings)."""
    def name(k):
        return '"' + "".join(f"\\u{ord(c):04x}" for c in k) + '"' if k in escape else json.dumps(k)
    return "{" + ",".join(f"{name(k)}:{v}" for k, v in pairs) + "}"


@pytest.mark.parametrize("lo,hi", [(2, 2), (2, 4), (3, None)])
def test_small_objects_exhaustive_against_jsonschema(lo, hi):
    schema = {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": lo}
    if hi is not None:
        schema["maxProperties"] = hi
    a = automaton_of(schema)
    assert any(isinstance(r, DistinctKeysRule) for r in a.rules.values())
    v = default_validator(schema)
    names = ["a", "b", "\n"]                # "\n" is also spelled "\u000a": one name either way
    for n in range(0, 6):
        for keys in itertools.product(names, repeat=n):
            for escape in ({}, {"\n"}):
                text = _write([(k, i) for i, k in enumerate(keys)], escape)
                assert accepts(a, text) == valid(v, text), text


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.text("ab\u00e9\"\n", min_size=0, max_size=3), st.integers(-3, 3)), max_size=5),
       st.sampled_from([(2, 3), (2, None), (4, 5)]))
def test_hypothesis_objects(pairs, bounds):
    lo, hi = bounds
    schema = {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": lo}
    if hi is not None:
        schema["maxProperties"] = hi
    text = "{" + ",".join(f"{json.dumps(k, ensure_ascii=False)}:{v}" for k, v in pairs) + "}"
    assert accepts(_cached(json.dumps(schema)), text) == valid(default_validator(schema), text), text


_automata: dict = {}


def _cached(key):
    if key not in _automata:
        _automata[key] = automaton_of(json.loads(key))
    return _automata[key]


def test_nested_objects_keep_their_own_names():
    inner = {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}
    schema = {"type": "object", "additionalProperties": inner, "minProperties": 2}
    a = automaton_of(schema)
    v = default_validator(schema)
    for text in ['{"a":{"x":1,"y":2},"b":{"x":1,"y":2}}', '{"a":{"x":1,"x":2},"b":{"x":1,"y":2}}',
                 '{"a":{"x":1,"y":2},"a":{"x":1,"y":2}}', '{"x":{"x":1,"a":2},"a":{"a":1,"x":2}}',
                 '{"a":{"x":1,"y":2}}']:
        assert accepts(a, text) == valid(v, text), text
    c = pickle.loads(pickle.dumps(a))          # as the server's compile worker ships it
    assert accepts(c, '{"a":{"x":1,"y":2},"b":{"x":1,"y":2}}')
    assert not accepts(c, '{"a":{"x":1,"x":2},"b":{"x":1,"y":2}}')
    # sibling objects in an array: each one starts with no names
    arr = {"type": "array", "items": inner}
    b = automaton_of(arr)
    assert accepts(b, '[{"a":1,"b":2},{"a":1,"b":2}]') and not accepts(b, '[{"a":1,"b":2},{"a":1,"a":2}]')


def test_masks_match_the_byte_walk_and_rollback():
    v = vocab()
    schema = {"type": "object", "properties": {"d": {"type": "object", "additionalProperties": {"type": "integer"},
                                                     "minProperties": 2, "maxProperties": 3}}, "required": ["d"]}
    a = automaton_of(schema)
    for p in ['{"d":{"a":1,"a', '{"d":{"ab":1,"a', '{"d":{"a":1,"b":2']:
        s = a.step(a.initial(), p.encode())
        assert s, p
        assert np.array_equal(a.token_mask(s, v), a.trie_mask(s, v)), p
    quote = np.array([b is not None and b.startswith(b'"') for b in v.token_bytes])
    dup, new = (a.step(a.initial(), p.encode()) for p in ('{"d":{"a":1,"a', '{"d":{"a":1,"b'))
    assert not a.token_mask(dup, v)[:len(quote)][quote].any() and a.token_mask(new, v)[:len(quote)][quote].any()
    g = compile_grammar(("json", schema), v)
    m = GrammarMatcher(g)
    tok = tokenizer()
    for t in tok.encode('{"d":{"a":1,'):
        assert m.advance(t)
    key = tok.encode('"a"')
    n = 0
    for t in key:
        if not m.allowed_mask()[t]:
            break
        assert m.advance(t)
        n += 1
    assert n < len(key)                             # the repeated name cannot be closed
    m.rollback(n)
    for t in tok.encode('"b":2}}'):
        assert m.advance(t)
    assert m.is_complete()


def test_random_outputs_are_distinct_and_valid():
    schema = {"type": "object", "properties": {"votes": {"type": "object", "additionalProperties": {"type": "integer"},
                                                         "minProperties": 3, "maxProperties": 5}},
              "required": ["votes"]}
    g = compile_grammar(("json", schema), vocab())
    v = default_validator(schema)
    rng = np.random.default_rng(3)
    for _ in range(4):
        _, data = sample_random_model(g, rng, budget=25)
        assert valid(v, data.decode()), data


def test_a_grown_cached_matcher_is_compiled_afresh(monkeypatch):
    """Names and counts are interned as outputs are decoded; past MAX_GROWN_STATES the cached automaton is
    replaced for new requests while a running sequence keeps its own."""
    from pyengine.structured import matcher as mx
    schema = {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2,
              "maxProperties": 9}
    v = vocab()
    g = compile_grammar(("json", schema), v)
    m = GrammarMatcher(g)
    tok = tokenizer()
    for t in tok.encode('{"alpha":1,"beta":2,'):
        assert m.advance(t)
    monkeypatch.setattr(mx, "MAX_GROWN_STATES", g.automaton.num_states - 1)
    g2 = compile_grammar(("json", schema), v)
    assert g2 is not g and g2.automaton is not g.automaton
    assert compile_grammar(("json", schema), v) is g2          # cached again while it stays small
    for t in tok.encode('"gamma":3}'):
        assert m.advance(t)
    assert m.is_complete()


# --- listed properties beside two or more distinct extras ----------------------------------------------
LISTED = {"a": {"type": "string", "maxLength": 1}, "c": {"type": "boolean"}}


def _listed_schema(lo, hi, required=("a",)):
    schema = {"type": "object", "properties": LISTED, "required": list(required),
              "additionalProperties": {"type": "integer"}, "minProperties": lo}
    if hi is not None:
        schema["maxProperties"] = hi
    return schema


@pytest.mark.parametrize("lo,hi,required", [(3, None, ("a",)), (3, 3, ("a",)), (4, 5, ("a", "c")), (4, 4, ())])
def test_listed_plus_extras_exhaustive_against_jsonschema(lo, hi, required):
    """Listed names (one a string, one a boolean) and extras in any order, every value of every type at
    every name, names repeated: accepted exactly when valid and no name is written twice."""
    schema = _listed_schema(lo, hi, required)
    a = automaton_of(schema)
    assert any(isinstance(r, DistinctKeysRule) and r.listed for r in a.rules.values())
    v = default_validator(schema)
    names, values = ["a", "c", "x", "y"], ['"s"', "true", "1"]
    checked = 0
    for n in range(0, 5):
        for keys in itertools.product(names, repeat=n):
            for vals in itertools.product(values, repeat=n) if n <= 3 else [
                    tuple({"a": '"s"', "c": "true"}.get(k, "1") for k in keys)]:
                text = "{" + ",".join(f'"{k}":{x}' for k, x in zip(keys, vals)) + "}"
                assert accepts(a, text) == valid(v, text), text
                checked += 1
    assert checked > 2000


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "c", "", "x", "\u00e9", "a\n", "c\"", "ac"]),
                          st.sampled_from(['"s"', '"st"', "true", "0", "-2"])), max_size=6),
       st.sampled_from([(3, None, ("a",)), (3, 5, ("a", "c")), (4, 4, ("c",))]))
def test_hypothesis_listed_plus_extras(pairs, bounds):
    schema = _listed_schema(*bounds)
    text = "{" + ",".join(f"{json.dumps(k, ensure_ascii=False)}:{v}" for k, v in pairs) + "}"
    assert accepts(_cached(json.dumps(schema)), text) == valid(default_validator(schema), text), text


def test_listed_plus_extras_masks_and_no_dead_end():
    """The mask equals the byte walk; when maxProperties leaves room only for the missing required names
    their keys alone may start (no prefix of an extra key is allowed then); random outputs are valid."""
    v = vocab()
    schema = {"type": "object", "properties": {"d": _listed_schema(4, 4, ("a", "c"))}, "required": ["d"]}
    a = automaton_of(schema)
    for p in ['{"d":{"x":1,', '{"d":{"x":1,"y":2,', '{"d":{"x":1,"c":true,"y":2,', '{"d":{"a":"s","x',
              '{"d":{"x":1,"a":"s",']:
        s = a.step(a.initial(), p.encode())
        assert s, p
        assert np.array_equal(a.token_mask(s, v), a.trie_mask(s, v)), p
    forced = a.step(a.initial(), b'{"d":{"x":1,"y":2,')       # two slots left, "a" and "c" missing
    assert a.step(forced, b'"c":true,"a":"s"}}') and not a.step(forced, b'"z')
    assert a.step(forced, b'"a":"s",') and not a.step(forced, b'"a":"s","z')
    with pytest.raises(GrammarError, match="admits no value"):      # minProperties above maxProperties 1
        automaton_of({"type": "object", "properties": {"c": LISTED["c"]}, "additionalProperties": {"type": "integer"},
                      "minProperties": 2, "maxProperties": 1})
    c = pickle.loads(pickle.dumps(a))          # as the server's compile worker ships it
    assert accepts(c, '{"d":{"x":1,"c":true,"y":2,"a":"s"}}') and not accepts(c, '{"d":{"x":1,"c":true,"x":2,"a":"s"}}')
    g = compile_grammar(("json", schema), v)
    val = default_validator(schema)
    rng = np.random.default_rng(4)
    for _ in range(4):
        _, data = sample_random_model(g, rng, budget=25)
        assert valid(val, data.decode()), data
