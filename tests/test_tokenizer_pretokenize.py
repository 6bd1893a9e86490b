"""S02: our `re` + `unicodedata` pre-tokenizers cut text exactly where HF tokenizers' regex engine
(Oniguruma, with real \\p{L}/\\p{N} classes) does -- golden pieces from scripts/make_golden_tokenizer.py."""
from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest

from pyengine.tokenizer.pretokenize import WHITE_SPACE, compiled, get_pretokenizer

GOLDEN = Path(__file__).resolve().parent / "golden" / "tokenizer_pretokenize.json"


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", ["gpt2", "llama-bpe", "qwen2", "smollm"])
def test_pieces_match_hf(golden, name):
    split = get_pretokenizer(name)
    bad = [c["text"][:40] for c in golden["cases"] if split(c["text"]) != c["pieces"][name]]
    assert len(golden["cases"]) >= 100
    assert not bad, f"{len(bad)} texts split differently from HF, e.g. {bad[:5]!r}"


def test_pieces_cover_the_text(golden):
    for c in golden["cases"]:
        for name in ("gpt2", "llama-bpe", "qwen2", "smollm"):
            assert "".join(get_pretokenizer(name)(c["text"])) == c["text"]


def test_unicode_classes_follow_unicodedata():
    """\\p{L} and \\p{N} as built from unicodedata, checked on every code point of the BMP and beyond."""
    letter, number = compiled(r"\p{L}"), compiled(r"\p{N}")
    for cp in list(range(0x3000)) + list(range(0x1F000, 0x1FB00)) + list(range(0x20000, 0x20100)):
        ch = chr(cp)
        if 0xD800 <= cp <= 0xDFFF:
            continue
        cat = unicodedata.category(ch)
        assert bool(letter.fullmatch(ch)) == cat.startswith("L"), hex(cp)
        assert bool(number.fullmatch(ch)) == cat.startswith("N"), hex(cp)


def test_white_space_is_unicode_white_space_not_python_isspace():
    space = compiled(r"\s")
    assert not space.fullmatch("\x1c") and "\x1c".isspace()      # Python's \s differs here
    for ch in "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u200a\u2028\u2029\u202f\u205f\u3000":
        assert space.fullmatch(ch), hex(ord(ch))
    assert not space.fullmatch("\u200b") and not space.fullmatch("\u180e")
    assert WHITE_SPACE.startswith("\t")


def test_unknown_pre_tokenizer_is_a_clear_error():
    with pytest.raises(ValueError, match="tokenizer.ggml.pre"):
        get_pretokenizer("made-up")
