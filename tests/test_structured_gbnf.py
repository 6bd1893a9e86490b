"""GBNF grammars against small reference parsers written here (recursive descent), Python's `re` for a
regular grammar and `json` for a JSON grammar in llama.cpp's style."""
import json
import re

import numpy as np
import pytest

from pyengine.structured import GrammarError, GrammarMatcher, compile_grammar
from structured_support import accepts_text, sample_random_model, vocab

ARITH = r"""
# integer arithmetic with precedence
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""

JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws
array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws
string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})
  )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
"""


def arith_ok(text: str) -> bool:
    """Reference recursive-descent parser for ARITH."""
    pos = 0

    def expr():
        nonlocal pos
        if not term():
            return False
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            if not term():
                return False
        return True

    def term():
        nonlocal pos
        if not factor():
            return False
        while pos < len(text) and text[pos] in "*/":
            pos += 1
            if not factor():
                return False
        return True

    def factor():
        nonlocal pos
        if pos < len(text) and text[pos].isdigit() and text[pos].isascii():
            while pos < len(text) and text[pos] in "0123456789":
                pos += 1
            return True
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not expr() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        return False

    return expr() and pos == len(text)


def matches(g, text: str) -> bool:
    m = GrammarMatcher(g)
    return (m.advance_bytes(text.encode()) if text else True) and m.is_complete()


def test_arithmetic_against_reference_parser():
    g = compile_grammar(("grammar", ARITH), vocab())
    assert g.kind == "pda"
    rng = np.random.default_rng(7)
    for _ in range(40):
        _, data = sample_random_model(g, rng, budget=12)
        assert arith_ok(data.decode()), data
    for _ in range(2000):
        text = "".join(rng.choice(list("12+-*/()"), size=int(rng.integers(0, 9))))
        assert matches(g, text) == arith_ok(text), text
    for text in ["1+2*(3-4)/5", "((7))", "12*(3+(4*(5)))"]:
        assert accepts_text(g, text)


def test_json_gbnf_against_json_module():
    g = compile_grammar(("grammar", JSON_GBNF), vocab())
    rng = np.random.default_rng(11)
    for _ in range(30):
        _, data = sample_random_model(g, rng, budget=25)
        assert isinstance(json.loads(data.decode()), dict)
    for value in [{"a": [1, -2.5, {"b": None}], "c": "x\ny"}, {}, {"k": [True, False, [], {}]}]:
        assert accepts_text(g, json.dumps(value))
        assert accepts_text(g, json.dumps(value, separators=(",", ":")))
    for text in ['{"a":1,}', "[1]", '{"a" 1}']:
        assert not accepts_text(g, text)


def test_regular_gbnf_against_re():
    grammar = 'root ::= [a-c]+ ("x" | "yz"){2,3} bang?\nbang ::= "!"'
    g = compile_grammar(("grammar", grammar), vocab())
    assert g.kind == "dfa"                       # no recursion: one DFA
    rx = re.compile(r"[a-c]+(?:x|yz){2,3}!?")
    rng = np.random.default_rng(2)
    for _ in range(2000):
        text = "".join(rng.choice(list("abcxyz!"), size=int(rng.integers(0, 9))))
        assert matches(g, text) == bool(rx.fullmatch(text)), text


def test_right_recursion_stays_flat_and_left_recursion_is_refused():
    g = compile_grammar(("grammar", 'root ::= item root?\nitem ::= "ab"'), vocab())
    assert matches(g, "ab" * 500)                # tail calls: no stack growth past the depth limit
    assert not matches(g, "ab" * 3 + "a")
    with pytest.raises(GrammarError, match="left-recursive"):
        compile_grammar(("grammar", 'root ::= root "a" | "b"'), vocab())
    for bad in ['root ::= undefined', 'root ::= "a', 'rot ::= "a"', 'root ::= [z-a]']:
        with pytest.raises(GrammarError):
            compile_grammar(("grammar", bad), vocab())
