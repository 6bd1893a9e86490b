"""S02: special tokens (parse_special, add_special_tokens / BOS), stop ids, loading paths and bad input."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from model_paths import model_path
from pyengine.tokenizer import IncrementalDetokenizer, Tokenizer

HERE = Path(__file__).resolve().parent
MODELS = ("smollm2", "gemma3")


@functools.lru_cache(maxsize=None)
def tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_gguf(model_path(name))


@functools.lru_cache(maxsize=None)
def golden(name: str) -> dict:
    return json.loads((HERE / "golden" / f"tokenizer_{name}.json").read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=None)
def reference_metadata(name: str) -> dict:
    """The file's tokenizer metadata as plain Python values (lists, not arrays), as a caller of
    from_metadata might pass it. (The `gguf` package would be an independent reader, but it needs ~45 s
    to open the 262k-token Gemma vocabulary; the ids themselves are checked against HF anyway.)"""
    from pyengine.gguf.reader import GGUFFile
    md = GGUFFile(model_path(name)).metadata
    return {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in md.items()
            if k.startswith(("tokenizer.", "general."))}


@pytest.mark.parametrize("model", MODELS)
def test_special_cases_match_hf(model):
    """add_special_tokens (BOS when the file asks for it) x parse_special (HF split_special_tokens)."""
    tok = tokenizer(model)
    cases = golden(model)["special_cases"]
    assert any(c["add_special_tokens"] for c in cases) and any(not c["parse_special"] for c in cases)
    bad = [c for c in cases
           if tok.encode(c["text"], add_special_tokens=c["add_special_tokens"],
                         parse_special=c["parse_special"]) != c["ids"]]
    assert not bad, bad[:5]


@pytest.mark.parametrize("model", MODELS)
def test_every_control_token_is_one_id_or_plain_text(model):
    tok = tokenizer(model)
    md = reference_metadata(model)
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    control = [(i, t) for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3][:300]
    assert control
    for i, text in control:
        assert tok.encode(f"x{text}y") == tok.encode("x") + [i] + tok.encode("y"), text
        plain = tok.encode(text, parse_special=False)
        assert i not in plain and tok.decode(plain) == text, text
        assert tok.decode([i], skip_special_tokens=True) == ""
        assert tok.decode([i]) == text


def test_bos_follows_the_file():
    smol, gemma = tokenizer("smollm2"), tokenizer("gemma3")
    md_smol, md_gemma = reference_metadata("smollm2"), reference_metadata("gemma3")
    assert smol.add_bos_token == bool(md_smol["tokenizer.ggml.add_bos_token"]) is False
    assert smol.encode("hi", add_special_tokens=True) == smol.encode("hi")
    assert gemma.bos_token_id == md_gemma["tokenizer.ggml.bos_token_id"]
    assert gemma.encode("hi", add_special_tokens=True) == [gemma.bos_token_id] + gemma.encode("hi")


@pytest.mark.parametrize("model,end_token", [("smollm2", "<|im_end|>"), ("gemma3", "<end_of_turn>")])
def test_stop_token_ids(model, end_token):
    tok = tokenizer(model)
    md = reference_metadata(model)
    assert md["tokenizer.ggml.eos_token_id"] in tok.stop_token_ids
    assert md["tokenizer.ggml.tokens"].index(end_token) in tok.stop_token_ids
    assert all(i in tok.special_ids for i in tok.stop_token_ids)


@pytest.mark.parametrize("model", MODELS)
def test_from_bytes_and_from_metadata_agree(model):
    """from_gguf(bytes) (the Pyodide path) and from_metadata(a plain dict) give the same tokenizer as
    from_gguf(path)."""
    tok = tokenizer(model)
    data = Path(model_path(model)).read_bytes()
    from_bytes = Tokenizer.from_gguf(memoryview(data))
    from_md = Tokenizer.from_metadata(reference_metadata(model))
    for case in golden(model)["cases"][::3]:
        want = tok.encode(case["text"])
        assert from_bytes.encode(case["text"]) == want
        assert from_md.encode(case["text"]) == want
    assert from_md.vocab_size == tok.vocab_size == len(reference_metadata(model)["tokenizer.ggml.tokens"])


def test_bad_input_is_a_clear_error():
    tok = tokenizer("smollm2")
    with pytest.raises(ValueError, match="str"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="surrogate"):
        tok.encode("lone \ud800 surrogate")
    for bad in (-1, tok.vocab_size, 3.5, "7", None):
        with pytest.raises(ValueError, match="token id"):
            tok.decode([bad])
        with pytest.raises(ValueError, match="token id"):
            tok.token_bytes(bad)
        with pytest.raises(ValueError, match="token id"):
            IncrementalDetokenizer(tok).add(bad)


def test_bad_metadata_is_a_clear_error():
    md = dict(reference_metadata("smollm2"))
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        Tokenizer.from_metadata({k: v for k, v in md.items() if k != "tokenizer.ggml.model"})
    with pytest.raises(ValueError, match="not supported"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.model": "rwkv"})
    with pytest.raises(ValueError, match="tokenizer.ggml.pre"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(ValueError, match="merges"):
        Tokenizer.from_metadata({k: v for k, v in md.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(ValueError, match="merges\\[0\\]"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.merges": ["nospace"]})
    with pytest.raises(ValueError, match="eos_token_id"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.eos_token_id": 10**6})
    with pytest.raises(ValueError, match="token_type"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.token_type": [1, 2, 3]})


def test_no_chat_template_is_a_clear_error():
    gemma = tokenizer("gemma3")   # the Gemma 3 GGUF carries no template
    with pytest.raises(ValueError, match="chat template"):
        gemma.apply_chat_template([{"role": "user", "content": "hi"}])
