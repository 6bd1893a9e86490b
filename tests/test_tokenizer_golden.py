"""S02: our tokenizers against HF transformers' GGUF tokenizers (tests/golden/tokenizer_*.json).

Each golden case was encoded by HF from the same GGUF file (scripts/make_golden_tokenizer.py); we must
produce identical ids, decode them back to the same text, and stream the same text token by token.
"""
from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import pytest

from model_paths import model_path
from pyengine.tokenizer import IncrementalDetokenizer, Tokenizer

HERE = Path(__file__).resolve().parent
MODELS = ("smollm2", "gemma3")


@functools.lru_cache(maxsize=None)
def tokenizer(name: str, pre: str | None = None) -> Tokenizer:
    """Each model's tokenizer is built once for the whole module."""
    return Tokenizer.from_gguf(model_path(name), pre=pre)


@functools.lru_cache(maxsize=None)
def golden(name: str) -> dict:
    return json.loads((HERE / "golden" / name).read_text(encoding="utf-8"))


def _fail(failures: list[str], what: str):
    if failures:
        pytest.fail(f"{len(failures)} {what}:\n" + "\n".join(failures[:15]))


def _all_cases(g: dict) -> list[dict]:
    return g["cases"] + g["lossy_cases"]


@pytest.mark.parametrize("model", MODELS)
def test_encode_matches_hf(model):
    tok, g = tokenizer(model), golden(f"tokenizer_{model}.json")
    cases = _all_cases(g)
    assert len(cases) >= 100
    bad = []
    for k, case in enumerate(cases):
        got = tok.encode(case["text"])
        if got != case["ids"]:
            first = next((i for i, (a, b) in enumerate(zip(got, case["ids"])) if a != b), min(len(got), len(case["ids"])))
            bad.append(f"case {k} {case['text'][:40]!r}: first difference at {first}: "
                       f"got {got[first:first + 4]}, HF {case['ids'][first:first + 4]}")
    _fail(bad, "encodings differ from HF")


@pytest.mark.parametrize("model", MODELS)
def test_decode_matches_hf(model):
    tok, g = tokenizer(model), golden(f"tokenizer_{model}.json")
    bad = [f"{c['text'][:40]!r}" for c in g["cases"] if tok.decode(c["ids"]) != c["text"]]
    # lossy: HF itself cannot round-trip (bytes without a token, '▁' typed by the user); we match its output
    bad += [f"lossy {c['text'][:40]!r}" for c in g["lossy_cases"] if tok.decode(c["ids"]) != c["decoded"]]
    _fail(bad, "decodings differ from HF")


@pytest.mark.parametrize("model", MODELS)
def test_decode_id_sequences_match_hf(model):
    """Byte tokens cutting characters, invalid byte runs, special tokens, random ids; with and without
    skip_special_tokens."""
    tok, g = tokenizer(model), golden(f"tokenizer_{model}.json")
    bad = []
    for case in g["decode_cases"]:
        for skip, key in ((False, "text"), (True, "text_skip_special")):
            got = tok.decode(case["ids"], skip_special_tokens=skip)
            if got != case[key]:
                bad.append(f"ids {case['ids']} skip={skip}: got {got!r}, HF {case[key]!r}")
    _fail(bad, "decodings differ from HF")


@pytest.mark.parametrize("pre,key", [("gpt2", "ids_gpt2_pre"), ("llama-bpe", "ids_llama_bpe"), ("qwen2", "ids_qwen2")])
def test_other_pretokenizers_on_real_vocab(pre, key):
    """SmolLM2's vocabulary under the GPT-2 split (what transformers' GGUF loader uses for "smollm") and
    under the Llama-3 and Qwen2 splits HF builds for "llama-bpe" / "qwen2" files."""
    tok, g = tokenizer("smollm2", pre=pre), golden("tokenizer_smollm2.json")
    cases = _all_cases(g)
    assert any(key in c for c in cases), f"golden has no case where {pre} differs: it would test nothing new"
    bad = [f"{c['text'][:40]!r}" for c in cases if tok.encode(c["text"]) != c.get(key, c["ids"])]
    _fail(bad, f"encodings under pre={pre} differ from HF")


@pytest.mark.parametrize("model", MODELS)
def test_token_bytes_spell_the_text(model):
    tok, g = tokenizer(model), golden(f"tokenizer_{model}.json")
    bad = []
    for case in g["cases"]:
        raw = b"".join(tok.token_bytes(i) for i in case["ids"])
        if raw.decode("utf-8", errors="replace") != tok.decode(case["ids"]):
            bad.append(repr(case["text"][:40]))
    _fail(bad, "token_bytes disagree with decode")


def _explode(tok, ids: list[int], rng: random.Random) -> list[int]:
    """Replace random tokens by one token per byte, so characters straddle several tokens."""
    if tok.kind == "bpe":
        from pyengine.tokenizer.bpe import BYTE_TO_CHAR
        byte_id = {b: tok.model.vocab.get(c) for b, c in BYTE_TO_CHAR.items()}
    else:
        byte_id = {b: tok.model.vocab.get(f"<0x{b:02X}>") for b in range(256)}
    out = []
    for i in ids:
        pieces = [byte_id.get(b) for b in tok.token_bytes(i)]
        if i not in tok.special_ids and rng.random() < 0.5 and pieces and None not in pieces:
            out.extend(pieces)
        else:
            out.append(i)
    return out


def _stream(tok, ids: list[int], skip: bool = False) -> tuple[list[str], str]:
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = [det.add(i) for i in ids]
    return deltas, det.flush()


@pytest.mark.parametrize("model", MODELS)
def test_incremental_detokenizer(model):
    """Deltas never show a broken character (the text so far is always a prefix of the final text) and
    add up to decode(ids) -- on the corpus with characters split across byte tokens at random places,
    and on HF's decode cases (invalid byte runs included)."""
    tok, g = tokenizer(model), golden(f"tokenizer_{model}.json")
    rng = random.Random(0)
    sequences = [(c["ids"], c["text"]) for c in g["cases"]]
    sequences += [(_explode(tok, c["ids"], rng), c["text"]) for c in g["cases"] for _ in range(2)]
    sequences += [(c["ids"], c["text"]) for c in g["decode_cases"]]
    exploded_multibyte = 0
    bad = []
    for ids, text in sequences:
        full = tok.decode(ids)
        if full != text:
            bad.append(f"decode of {text[:30]!r} (exploded) is {full[:30]!r}")
            continue
        deltas, tail = _stream(tok, ids)
        seen = ""
        for d in deltas:
            seen += d
            if not full.startswith(seen):
                bad.append(f"{text[:30]!r}: streamed {seen[-10:]!r} is not a prefix of the text")
                break
        else:
            if seen + tail != full:
                bad.append(f"{text[:30]!r}: stream {seen + tail!r} != decode {full!r}")
        exploded_multibyte += sum(1 for d in deltas if d == "") > 0
    assert exploded_multibyte > 20, "too few sequences held text back: the property was barely exercised"
    _fail(bad, "streaming problems")


@pytest.mark.parametrize("model", MODELS)
def test_incremental_detokenizer_skip_special(model):
    tok, g = tokenizer(model), golden(f"tokenizer_{model}.json")
    bad = []
    for case in g["decode_cases"]:
        deltas, tail = _stream(tok, case["ids"], skip=True)
        if "".join(deltas) + tail != case["text_skip_special"]:
            bad.append(f"{case['ids']}")
    _fail(bad, "skip_special_tokens streams differ from HF")


def test_long_single_word_round_trips():
    """A single 'word' of 50k characters (one pre-tokenizer piece) goes through the heap merge, not a
    quadratic loop; the result still decodes back. (Speed itself is measured by `pyengine bench tokenizer`.)"""
    for model in MODELS:
        tok = tokenizer(model)
        text = "ab" * 25_000
        assert tok.decode(tok.encode(text)) == text


def test_sentencepiece_llama_path_matches_hf():
    """The generic SentencePiece path (a `llama` vocabulary that is not Gemma's: prefix space at the start,
    merges ordered by score with HF's tie-breaks, decoder dropping the prefix space), on Gemma 3's
    vocabulary read as general.architecture = "llama" -- against HF's LlamaTokenizer built the same way."""
    from pyengine.gguf.reader import GGUFFile
    md = dict(GGUFFile(model_path("gemma3")).metadata)
    md["general.architecture"] = "llama"
    tok = Tokenizer.from_metadata(md)
    bad = []
    for c in golden("tokenizer_spm_llama.json")["cases"]:
        if tok.encode(c["text"]) != c["ids"]:
            bad.append(f"encode {c['text'][:40]!r}")
        if tok.decode(c["ids"]) != c["decoded"] or \
                tok.decode(c["ids"], skip_special_tokens=True) != c["decoded_skip_special"]:
            bad.append(f"decode {c['text'][:40]!r}")
    _fail(bad, "differences from HF's LlamaTokenizer path")
