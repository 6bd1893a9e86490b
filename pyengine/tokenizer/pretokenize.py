"""Pre-tokenizers: cut text into the pieces BPE merges inside of (S02).

Byte-level BPE never merges across a piece boundary, so the split decides a lot: GPT-2 keeps a leading
space on words (" world"), Llama-3 caps numbers at three digits, SmolLM2 puts every digit on its own.
The reference regexes use Unicode properties (``\\p{L}`` letters, ``\\p{N}`` numbers) that Python's
``re`` lacks, so we build those classes from ``unicodedata`` once, on first use, and splice them into
ordinary ``re`` patterns. ``\\s`` is Oniguruma's (the engine behind HF tokenizers): the Unicode
White_Space property, which differs from Python's ``\\s`` on U+001C..U+001F.
"""
from __future__ import annotations

import functools
import itertools
import re
import unicodedata

# Unicode White_Space (what Oniguruma's \s matches); Python's str.isspace() adds U+001C..U+001F.
WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"

# Letters and numbers all live in planes 0-3; planes 4-13 are unassigned, 14 holds only format and
# combining characters, 15-16 private use. Scanning 0x40000 code points keeps the first call ~0.1 s.
_SCAN_LIMIT = 0x40000


def _ranges(codepoints: list[int]) -> str:
    """Code points (sorted) -> a character-class body of \\U escapes, ranges merged."""
    out, start, prev = [], None, None
    for cp in codepoints:
        if start is None:
            start = prev = cp
        elif cp == prev + 1:
            prev = cp
        else:
            out.append((start, prev))
            start = prev = cp
    if start is not None:
        out.append((start, prev))
    return "".join(f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}" for a, b in out)


@functools.lru_cache(maxsize=None)
def unicode_classes() -> dict[str, str]:
    """Class bodies for \\p{L} (letters), \\p{N} (numbers), \\p{M} (marks) and the letter subcategories
    \\p{Lu} \\p{Ll} \\p{Lt} \\p{Lm} \\p{Lo} (GPT-4o's split), for the running Python's Unicode version."""
    groups: dict[str, list[int]] = {k: [] for k in ("L", "N", "M", "Lu", "Ll", "Lt", "Lm", "Lo")}
    category = unicodedata.category
    # plane 14 holds combining marks (variation selectors supplement) but no letters or numbers
    for cp in itertools.chain(range(_SCAN_LIMIT), range(0xE0000, 0xE1000)):
        cat = category(chr(cp))
        major = cat[0]
        if major == "L":
            groups["L"].append(cp)
            groups[cat].append(cp)
        elif major in "NM":
            groups[major].append(cp)
    out = {name: _ranges(cps) for name, cps in groups.items()}
    out["s"] = WHITE_SPACE
    return out


def _expand(pattern: str) -> str:
    """Write \\p{L}, \\p{N}, \\s, \\S in terms of explicit classes (inside or outside brackets)."""
    cls = unicode_classes()
    # Inside a bracket the class body is spliced in; outside it is wrapped in brackets.
    out, i, depth = [], 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if nxt == "p" and pattern.startswith("{", i + 2):
                name = pattern[i + 3:pattern.index("}", i)]
                body = cls[name]
                out.append(body if depth else f"[{body}]")
                i = pattern.index("}", i) + 1
                continue
            if nxt == "s":
                out.append(cls["s"] if depth else f"[{cls['s']}]")
                i += 2
                continue
            if nxt == "S":
                if depth:
                    raise ValueError("\\S inside a character class is not supported")
                out.append(f"[^{cls['s']}]")
                i += 2
                continue
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[":
            depth += 1
        elif c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)


# The reference patterns, spelled as in HF tokenizers / llama.cpp.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o's o200k split (llama.cpp "gpt-4o"; Llama 4 and Phi-4-mini's vocabularies build on it): cased words keep
# their case run, contractions ride on the word, numbers in threes, '/' may end a punctuation run.
GPT4O_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# SmolLM2/StarCoder: every digit alone (HF `Digits(individual_digits=True)`), then GPT-2 on the rest.
# Written as one pass: digits are their own alternative, GPT-2's ` ?\p{N}+` can no longer match, and
# `\s+(?!\S)` treats a following digit like the end of the text -- exactly what the GPT-2 split sees
# when it runs on the digit-free stretches separately.
DIGITS_GPT2_PATTERN = r"\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"


@functools.lru_cache(maxsize=None)
def compiled(pattern: str) -> re.Pattern:
    return re.compile(_expand(pattern))


def split_isolated(pattern: re.Pattern, text: str) -> list[str]:
    """HF `Split(behavior="isolated")`: every match is a piece, and so is every gap between matches."""
    pieces, pos = [], 0
    for m in pattern.finditer(text):
        if m.start() > pos:
            pieces.append(text[pos:m.start()])
        if m.end() > m.start():
            pieces.append(m.group())
        pos = m.end()
    if pos < len(text):
        pieces.append(text[pos:])
    return pieces


class PreTokenizer:
    """A chain of regex splits; each later pattern splits the pieces of the earlier ones. `normalization`
    ("NFC" or None) is the Unicode normalization the family's tokenizer applies to text between special
    tokens before splitting; the tokenizer applies it (`normalize`), the splits here do not."""

    def __init__(self, name: str, patterns: tuple[str, ...], normalization: str | None = None):
        self.name = name
        self.patterns = patterns
        self.normalization = normalization
        self._compiled = None

    def normalize(self, text: str) -> str:
        if not self.normalization or unicodedata.is_normalized(self.normalization, text):
            return text
        return unicodedata.normalize(self.normalization, text)

    def __call__(self, text: str) -> list[str]:
        if self._compiled is None:
            self._compiled = [compiled(p) for p in self.patterns]
        first, *rest = self._compiled
        pieces = split_isolated(first, text)
        for pat in rest:
            pieces = [q for p in pieces for q in split_isolated(pat, p)]
        return pieces

    def __repr__(self) -> str:
        return f"PreTokenizer({self.name!r})"


# `tokenizer.ggml.pre` -> the split HF applies (names as llama.cpp writes them).
_GPT2 = (GPT2_PATTERN,)
_DIGITS_GPT2 = (DIGITS_GPT2_PATTERN,)
_LLAMA3 = (LLAMA3_PATTERN,)
_QWEN2 = (QWEN2_PATTERN,)
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": _GPT2, "gpt2": _GPT2, "gpt-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2, "jais": _GPT2,
    "smollm": _DIGITS_GPT2, "starcoder": _DIGITS_GPT2, "refact": _DIGITS_GPT2, "command-r": _DIGITS_GPT2,
    "codeshell": _DIGITS_GPT2, "exaone": _DIGITS_GPT2, "minerva-7b": _DIGITS_GPT2,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "falcon3": _LLAMA3, "pixtral": _LLAMA3,
    "dbrx": _LLAMA3, "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2,
    "gpt-4o": (GPT4O_PATTERN,), "llama4": (GPT4O_PATTERN,),
}


# Families whose tokenizer.json normalizes to NFC first (Qwen2/2.5/3 and their distills; HF's GGUF loader
# does the same for them). llama.cpp applies no normalization: there a decomposed "e\u0301" stays two
# characters and can give other ids than HF -- we follow HF.
NFC_PRE_TOKENIZERS = frozenset({"qwen2", "deepseek-r1-qwen"})


def normalization_for(name: str | None) -> str | None:
    """The Unicode normalization a `tokenizer.ggml.pre` family applies ("NFC") or None."""
    return "NFC" if (name or "default").lower() in NFC_PRE_TOKENIZERS else None


def get_pretokenizer(name: str | None, normalization: str | None = None) -> PreTokenizer:
    """The pre-tokenizer for a `tokenizer.ggml.pre` value; ValueError naming it if unknown. `normalization`
    replaces the family's own (a file read with another split keeps its own normalization)."""
    key = (name or "default").lower()
    if key not in PRE_TOKENIZERS:
        raise ValueError(f"tokenizer.ggml.pre = {name!r} is not supported; known: {sorted(PRE_TOKENIZERS)}")
    return PreTokenizer(key, PRE_TOKENIZERS[key], normalization_for(key) if normalization is None else normalization)
