"""SentencePiece-style BPE with byte fallback -- `tokenizer.ggml.model == "llama"` (Gemma, Llama-2) (S02).

Spaces become "▁" (U+2581) and the text is merged as in BPE, but a GGUF of this family usually stores
no merge list: only tokens with scores. The merges are implied: (left, right) merges when left+right is
a token, and better merges come first. HF derives that order from the scores (`generate_merges`):
by the merged token's score, then the longer left part. Gemma's scores do not follow its merge order,
so for Gemma files HF ranks by the token's position in the file instead; we do the same.

Characters with no token of their own fall back to byte tokens "<0xNN>" (one per UTF-8 byte).
Rather than building ~500k merges up front, a pair's rank is computed when first seen and memoized.
"""
from __future__ import annotations

import re

import functools

from .length_bound import LONG_PIECE, PieceBound, TooManyTokens
from .merge import bpe_merge
from .word_cache import WORD_CACHE_BYTES, WORD_CACHE_MAX_CHARS, BoundedCache

# Merge ranks of the symbol pairs seen: an entry is ~250 B, and adversarial text of rare characters can
# show millions of distinct pairs.
PAIR_CACHE_BYTES = 32 << 20


def _pair_cost(key, info) -> int:
    return 250

SPACE = "\u2581"  # ▁
_RUN = re.compile(f"{SPACE}*[^{SPACE}]+|{SPACE}+")


def byte_token_value(token: str) -> int | None:
    """The byte a "<0xNN>" token stands for (HF's ByteFallback decoder rule), else None."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        digits = token[3:5]
        if re.fullmatch(r"[0-9A-Fa-f]{2}|\+[0-9A-Fa-f]", digits):
            return int(digits, 16)
    return None


class SentencePieceBPE:
    """Merges by implied rank, with byte fallback. `encode_segment` handles text free of special tokens.

    tokens       -- the vocabulary as the model sees it (Gemma's space-only tokens respelled to ▁)
    rank_scores  -- per token, a score: higher merges earlier (Gemma: minus the position)
    merges       -- an explicit merge list, when the file has one (then it alone decides the order)
    prefix_space -- prepend "▁" to text at the very start of the input unless it starts with one (HF's
                    Metaspace "first", what transformers' GGUF loader builds)
    prefix_every_segment -- with prefix_space: prepend "▁" to every text segment, at the start and after each
                    special token, even before a space (llama.cpp's add_space_prefix, and the legacy
                    `Prepend("▁")` normalizer of Llama-2 / Mistral / Phi-3's own tokenizer.json)
    unk_id       -- used for characters with neither a token nor byte tokens
    """

    def __init__(self, tokens: list[str], rank_scores, merges: list[str] | None = None,
                 prefix_space: bool = False, unk_id: int | None = None, prefix_every_segment: bool = False):
        self.tokens = tokens
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.scores = [float(s) for s in rank_scores]
        self.prefix_space = prefix_space
        self.prefix_every_segment = prefix_every_segment
        self.unk_id = unk_id
        self._byte_ids = [self.vocab.get(f"<0x{b:02X}>") for b in range(256)]
        self._pairs = BoundedCache(PAIR_CACHE_BYTES, cost=_pair_cost)
        self._explicit = None
        if merges is not None:
            self._explicit = {}
            for rank, line in enumerate(merges):
                left, sep, right = line.partition(" ")
                ab = self.vocab.get(left + right)
                a, b = self.vocab.get(left), self.vocab.get(right)
                if not sep or a is None or b is None or ab is None:
                    raise ValueError(f"tokenizer.ggml.merges[{rank}] = {line!r} does not join two tokens into one")
                self._explicit[(a, b)] = (rank, ab)
        self._safe_cut = self._find_safe_cuts()
        self._cache = BoundedCache(WORD_CACHE_BYTES, WORD_CACHE_MAX_CHARS)

    # -- merge ranks -----------------------------------------------------------------------------------
    def pair_info(self, a: int, b: int):
        """(rank, merged id) of adjacent symbols a, b, or None."""
        key = (a, b)
        info = self._pairs.data.get(key, False)
        if info is False:
            if self._explicit is not None:
                info = self._explicit.get(key)
            else:
                left, right = self.tokens[a], self.tokens[b]
                ab = self.vocab.get(left + right)
                # HF's generate_merges order: merged score (desc), left length (desc), right length (desc),
                # then file order of the merged token and of the parts.
                info = None if ab is None else (
                    (-self.scores[ab], -len(left), -len(right), ab, a, b), ab)
            self._pairs.put(key, info)
        return info

    @functools.cached_property
    def bound(self) -> PieceBound | None:
        """None when a run of characters without tokens fuses into one <unk> (no bound exists)."""
        if None in self._byte_ids and self.unk_id is not None:
            return None
        return PieceBound(t.replace(SPACE, " ").encode("utf-8") for t in self.tokens)

    # -- splitting long words into independent chunks ------------------------------------------------
    def _find_safe_cuts(self):
        """Characters c after which a cut before "▁" is safe: no token contains c + "▁", so no merge can
        ever join the symbol ending in c with the "▁..." symbol after it. Cutting a paragraph (which
        SentencePiece treats as one word) into "▁word" chunks makes the per-chunk cache effective.
        Returns the blocked characters and whether byte fallback may follow a cut (None: never cut)."""
        if SPACE not in self.vocab:
            return None
        blocked = set()
        for t in self.tokens:
            i = t.find(SPACE, 1)
            while i > 0:
                if t[i - 1] != SPACE:
                    blocked.add(t[i - 1])
                i = t.find(SPACE, i + 1)
        # A character without a token becomes byte tokens "<0xNN>" (or "<unk>"), which end in ">".
        return blocked, ">" not in blocked

    def _cut_ok(self, c: str) -> bool:
        blocked, fallback_ok = self._safe_cut
        return c not in blocked and (c in self.vocab or fallback_ok)

    def _chunks(self, text: str) -> list[str]:
        if self._safe_cut is None:
            return [text]
        chunks: list[str] = []
        for m in _RUN.finditer(text):
            piece = m.group()
            if chunks and not (piece[0] == SPACE and self._cut_ok(chunks[-1][-1])):
                chunks[-1] += piece
            else:
                chunks.append(piece)
        return chunks

    # -- encoding ----------------------------------------------------------------------------------------
    def initial_symbols(self, word: str) -> list[int]:
        """Characters -> ids, unknown characters -> byte tokens, else <unk> (consecutive ones fused)."""
        ids: list[int] = []
        vocab, byte_ids = self.vocab, self._byte_ids
        pending_unk = False
        for ch in word:
            tid = vocab.get(ch)
            if tid is not None:
                if pending_unk:
                    ids.append(self.unk_id)
                    pending_unk = False
                ids.append(tid)
                continue
            fallback = [byte_ids[b] for b in ch.encode("utf-8")]
            if None not in fallback:
                ids.extend(fallback)   # (HF keeps a pending <unk> until the next known character)
                continue
            if self.unk_id is None:
                raise ValueError(f"character {ch!r} has no token, no byte tokens and there is no unknown token")
            pending_unk = True
        if pending_unk:
            ids.append(self.unk_id)
        return ids

    def encode_word(self, word: str) -> list[int]:
        ids = self._cache.data.get(word)
        if ids is None:
            ids = bpe_merge(self.initial_symbols(word), self.pair_info)
            self._cache.put(word, ids)
        return ids

    def encode_segment(self, text: str, at_start: bool = False, limit: int | None = None) -> list[int]:
        """Text between special tokens; `at_start` when it begins the input (for the prefix space). With
        `limit`: TooManyTokens as soon as more than `limit` ids are certain."""
        text = text.replace(" ", SPACE)
        if self.prefix_space and (self.prefix_every_segment or (at_start and not text.startswith(SPACE))):
            text = SPACE + text
        out: list[int] = []
        bound = self.bound if limit is not None else None
        for chunk in self._chunks(text):
            if bound is not None and len(chunk) > LONG_PIECE and chunk not in self._cache:
                bound.check(chunk.replace(SPACE, " ").encode("utf-8"), len(out), limit)
            out.extend(self.encode_word(chunk))
            if limit is not None and len(out) > limit:
                raise TooManyTokens(len(out), limit)
        return out
