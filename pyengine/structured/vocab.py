"""S15 the vocabulary as bytes, laid out for computing token masks.

A grammar reads bytes; a model emits tokens. `TokenVocabulary` holds every token's bytes (from
``tokenizer.token_bytes``), leaving out control tokens (they are never grammar text) and empty tokens, and
keeps two layouts of them:

- a byte matrix, tokens sorted by length (longest first): a DFA mask is one gather per byte position
  over all still-running tokens, ``state = table[state * 256 + byte]``, so the work is NumPy's, not Python's;
- a byte trie, for the pushdown matcher: a depth-first walk steps each shared prefix once and prunes a
  whole subtree as soon as the grammar rejects its prefix.

Masks are boolean arrays of length ``size`` (the model's vocabulary, which may exceed the tokenizer's).
"""
from __future__ import annotations

import numpy as np


class TokenVocabulary:
    def __init__(self, token_bytes: list, eos_token_ids, size: int | None = None):
        self.size = int(size if size is not None else len(token_bytes))
        self.token_bytes = [b if b else None for b in token_bytes]
        self.eos_token_ids = sorted({int(t) for t in eos_token_ids})
        ids = [i for i, b in enumerate(self.token_bytes) if b is not None]
        ids.sort(key=lambda i: -len(self.token_bytes[i]))
        self.order = np.asarray(ids, dtype=np.int64)
        lens = np.array([len(self.token_bytes[i]) for i in ids], dtype=np.int64)
        self.max_len = int(lens.max()) if len(lens) else 0
        mat = np.zeros((len(ids), max(self.max_len, 1)), dtype=np.int32)
        for row, i in enumerate(ids):
            b = self.token_bytes[i]
            mat[row, :len(b)] = np.frombuffer(b, dtype=np.uint8)
        self.columns = [np.ascontiguousarray(mat[:int(np.count_nonzero(lens > j)), j])
                        for j in range(self.max_len)]
        self._trie = None
        self.key = (self.size, len(ids), hash(tuple(self.token_bytes)))

    @classmethod
    def from_tokenizer(cls, tokenizer, eos_token_ids=None, size: int | None = None) -> "TokenVocabulary":
        special = set(getattr(tokenizer, "special_ids", ()))
        if eos_token_ids is None:
            eos_token_ids = getattr(tokenizer, "stop_token_ids", None) or [tokenizer.eos_token_id]
        tb = [None if i in special else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        return cls(tb, eos_token_ids, size)

    # --- DFA masks: vectorized walk ----------------------------------------------------------------
    def dfa_mask(self, flat_table: np.ndarray, state: int) -> np.ndarray:
        """Tokens whose bytes all have a transition from ``state`` (flat (n, 256) table, 0 = dead)."""
        alive, _ = self._walk(flat_table, state, None)
        mask = np.zeros(self.size, dtype=bool)
        mask[alive] = True
        return mask

    def frame_walk(self, flat_table: np.ndarray, state: int, escapable: np.ndarray):
        """The vectorized walk inside one rule of a pushdown matcher: (tokens the rule's DFA reads whole,
        token ids that died after passing a state where the rule could return or call: those need the
        full pushdown step)."""
        return self._walk(flat_table, state, escapable)

    def _walk(self, flat_table, state, escapable):
        """Step every token's bytes through the table, one byte position at a time, keeping only the
        tokens still alive (rows are sorted longest first, so the ones long enough for position j are a
        prefix of the alive rows): after the first byte usually few are left."""
        rows = np.arange(len(self.order))                      # alive tokens (rows of the sorted layout)
        cur = np.full(len(rows), state, dtype=np.int32)
        passed = np.zeros(len(rows), dtype=bool) if escapable is not None else None
        died = []
        for j, col in enumerate(self.columns):
            m = int(np.searchsorted(rows, len(col)))           # alive rows with a byte at position j
            if m == 0:
                break
            sub = cur[:m]
            if passed is not None and j:
                passed[:m] |= escapable[sub]
            nxt = flat_table[sub * 256 + col[rows[:m]]]
            dead = nxt == 0
            if dead.any():
                if passed is not None:
                    died.append(rows[:m][dead & passed[:m]])
                keep = np.concatenate([np.flatnonzero(~dead), np.arange(m, len(rows))])
                nxt_full = np.concatenate([nxt, cur[m:]])
                rows, cur = rows[keep], nxt_full[keep]
                if passed is not None:
                    passed = passed[keep]
            else:
                cur[:m] = nxt
        slow = self.order[np.concatenate(died)] if died else np.zeros(0, dtype=np.int64)
        return self.order[rows], slow

    # --- pushdown masks: trie walk -----------------------------------------------------------------
    def _build_trie(self):
        children: list[dict] = [{}]
        ends: list[list[int]] = [[]]
        for i in self.order.tolist():
            node = 0
            for b in self.token_bytes[i]:
                nxt = children[node].get(b)
                if nxt is None:
                    nxt = len(children)
                    children[node][b] = nxt
                    children.append({})
                    ends.append([])
                node = nxt
            ends[node].append(i)
        self._trie = ([list(c.items()) for c in children], ends)
        return self._trie

    def trie_mask(self, step_byte, state: int) -> np.ndarray:
        """Tokens accepted by ``step_byte(state, byte) -> state`` (0 = dead), walking the byte trie."""
        children, ends = self._trie or self._build_trie()
        allowed: list[int] = []
        stack = [(0, state)]
        while stack:
            node, st = stack.pop()
            for b, child in children[node]:
                ns = step_byte(st, b)
                if ns:
                    if ends[child]:
                        allowed.extend(ends[child])
                    if children[child]:
                        stack.append((child, ns))
        mask = np.zeros(self.size, dtype=bool)
        if allowed:
            mask[np.asarray(allowed, dtype=np.int64)] = True
        return mask
