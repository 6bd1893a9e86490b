"""Byte-level BPE (GPT-2 family: SmolLM2, Llama-3, Qwen2) -- `tokenizer.ggml.model == "gpt2"` (S02).

Text -> UTF-8 bytes -> each byte spelled as one printable character (GPT-2's byte-to-unicode table, so
" " becomes "Ġ") -> merges applied by rank inside each pre-tokenized piece. When every byte has a token
(SmolLM2 lacks a few unusual ones), any string encodes and decoding is lossless.
"""
from __future__ import annotations

import functools

from .length_bound import LONG_PIECE, PieceBound, TooManyTokens
from .merge import bpe_merge
from .pretokenize import PreTokenizer
from .word_cache import WORD_CACHE_BYTES, WORD_CACHE_MAX_CHARS, BoundedCache


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: printable Latin-1 bytes stand for themselves, the other 68 move to U+0100 and up."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}
_SPELL = str.maketrans({chr(b): c for b, c in BYTE_TO_CHAR.items()})  # latin-1 char -> byte-level char


def byte_level_spelling(token: str) -> bytes:
    """Raw bytes of a vocab entry: its characters mapped back to bytes; an entry using any character
    outside the byte alphabet stands for its own UTF-8 (as HF's ByteLevel decoder does)."""
    try:
        return bytes(CHAR_TO_BYTE[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


class ByteLevelBPE:
    """Vocabulary + ranked merges + pre-tokenizer. `encode_segment` handles text free of special tokens."""

    def __init__(self, tokens: list[str], merges: list[str], pretokenizer: PreTokenizer):
        # A token spelled outside the byte alphabet is respelled from its UTF-8 (HF does the same).
        alphabet = set(CHAR_TO_BYTE)
        self.vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            key = t if set(t) <= alphabet else "".join(BYTE_TO_CHAR[b] for b in t.encode("utf-8"))
            self.vocab[key] = i
        self.ranks: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, line in enumerate(merges):
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(f"tokenizer.ggml.merges[{rank}] = {line!r} is not 'left right'")
            left, right = parts
            a, b, ab = self.vocab.get(left), self.vocab.get(right), self.vocab.get(left + right)
            if a is None or b is None or ab is None:
                raise ValueError(f"tokenizer.ggml.merges[{rank}] = {line!r} uses a token not in the vocabulary")
            self.ranks[(a, b)] = (rank, ab)   # a repeated pair: the later rank wins, as in HF
        self.pretokenizer = pretokenizer
        # SmolLM2 lacks tokens for 21 bytes (rare control bytes, 0xC0/0xC1/0xF5.. never occur in UTF-8).
        # HF's BPE has no unknown token here and silently drops such bytes; so do we.
        self._char_id = {c: self.vocab[c] for c in BYTE_TO_CHAR.values() if c in self.vocab}
        self.missing_bytes = bytes(b for b, c in BYTE_TO_CHAR.items() if c not in self.vocab)
        self._cache = BoundedCache(WORD_CACHE_BYTES, WORD_CACHE_MAX_CHARS)

    def pair_info(self, a: int, b: int):
        return self.ranks.get((a, b))

    @functools.cached_property
    def bound(self) -> PieceBound:
        return PieceBound(bytes(CHAR_TO_BYTE[c] for c in key) for key in self.vocab)

    def encode_word(self, piece: str) -> list[int]:
        """One pre-tokenized piece -> ids (memoized: natural text repeats words a lot)."""
        ids = self._cache.data.get(piece)
        if ids is None:
            spelled = piece.encode("utf-8").decode("latin-1").translate(_SPELL)
            char_id = self._char_id
            if self.missing_bytes:
                spelled = "".join(c for c in spelled if c in char_id)
            ids = bpe_merge([char_id[c] for c in spelled], self.pair_info)
            self._cache.put(piece, ids)
        return ids

    def encode_segment(self, text: str, limit: int | None = None) -> list[int]:
        """Ids of text free of special tokens. With `limit`: TooManyTokens as soon as more than `limit`
        ids are certain (a long piece is bounded before it is merged)."""
        out: list[int] = []
        cache, encode_word = self._cache.data, self.encode_word
        for piece in self.pretokenizer(self.pretokenizer.normalize(text)):
            ids = cache.get(piece)
            if ids is None:
                if limit is not None and len(piece) > LONG_PIECE:
                    self.bound.check(piece.encode("utf-8").translate(None, self.missing_bytes), len(out), limit)
                ids = encode_word(piece)
            out += ids
            if limit is not None and len(out) > limit:
                raise TooManyTokens(len(out), limit)
        return out
