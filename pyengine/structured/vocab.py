"""S15 the vocabulary as bytes, laid out for computing token masks.

A grammar reads bytes; a model emits tokens. `TokenVocabulary` holds every token's bytes (from
``tokenizer.token_bytes``), leaving out control tokens (they are never grammar text) and empty tokens, and
keeps two layouts of them:

- the byte trie laid out level by level (all distinct 1-byte prefixes, then 2-byte ones, ...): a mask is
  one gather per level, ``state[node] = table[state[parent] * 256 + byte]``, so the work is NumPy's, not
  Python's, and each prefix shared by many tokens is stepped once;
- the same trie as nested lists for a depth-first walk in Python (the reference the tests compare with).

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
        self._build_levels()
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

    def counted_walk(self, flat_table: np.ndarray, state: int, weight: np.ndarray, escapable: np.ndarray):
        """The walk of a counted string (`counter.py`): (token ids read whole, the state each ends in, the
        characters each adds (``weight[s]`` per byte read from state s), token ids that died after passing
        an escapable state)."""
        alive, slow, ends, adds = self._walk(flat_table, state, escapable, weight)
        return alive, ends, adds, slow

    def _build_levels(self) -> None:
        """The byte trie of the vocabulary laid out level by level: node k of level j is one distinct
        (j+1)-byte token prefix, with its parent's index in level j-1 and its last byte. SmolLM2's
        332k token bytes share 100k prefixes, so a walk steps each shared prefix once."""
        index: list[dict] = []
        self.levels: list[tuple[np.ndarray, np.ndarray]] = []     # (parent index, byte) per level
        ends = []
        for i in self.order.tolist():
            b = self.token_bytes[i]
            parent = 0
            for j in range(len(b)):
                if j == len(index):
                    index.append({})
                key = b[:j + 1]
                node = index[j].get(key)
                if node is None:
                    node = index[j][key] = len(index[j])
                parent = node
            ends.append((len(b) - 1, parent))
        remap = None                                    # old -> new node ids of the previous level
        self._child_start: list[np.ndarray | None] = []
        new_ids = []
        for j, level in enumerate(index):
            par = np.zeros(len(level), dtype=np.int32)       # int32: half the memory traffic of int64
            byt = np.zeros(len(level), dtype=np.int32)
            for key, node in level.items():
                byt[node] = key[-1]
                if j:
                    par[node] = remap[index[j - 1][key[:-1]]]
            # renumber this level by parent, so the children of a node are one contiguous range
            perm = np.argsort(par, kind="stable")
            remap = np.empty(len(level), dtype=np.int64)
            remap[perm] = np.arange(len(level))
            new_ids.append(remap)
            par, byt = par[perm], byt[perm]
            self.levels.append((par, byt))
            if j:
                n_parents = len(index[j - 1])
                # intp: np.repeat takes its counts as intp only (int32 on wasm32, where int64 fails)
                self._child_start.append(np.searchsorted(par, np.arange(n_parents + 1)).astype(np.intp))
            else:
                self._child_start.append(None)
        offsets = np.cumsum([0] + [len(lv) for lv in index])
        self._level_offsets = offsets
        self._token_node = np.array([offsets[j] + new_ids[j][n] for j, n in ends], dtype=np.int64)  # per row
        self._n_nodes = int(offsets[-1])

    def _walk(self, flat_table, state, escapable, weight=None):
        """Step every trie node from its parent's state, level by level (dead stays dead: row 0 of the
        table is all zeros). A level whose parents are mostly dead steps only the children of the live
        ones (a contiguous range each). Returns (alive token ids, token ids that died after passing an
        escapable state) — the second only when ``escapable`` is given; with ``weight`` (per state) also the
        alive tokens' end states and their summed weights."""
        st = np.zeros(self._n_nodes, dtype=np.int32)
        counting = weight is not None
        cnt = np.zeros(self._n_nodes, dtype=np.int32) if counting else None
        flags = escapable is not None
        slow = np.zeros(self._n_nodes, dtype=bool) if flags else None
        passed = np.zeros(self._n_nodes, dtype=bool) if flags else None
        off = self._level_offsets
        prev = None
        for j, (par, byt) in enumerate(self.levels):
            lo, hi = off[j], off[j + 1]
            if j == 0:
                st[lo:hi] = prev = flat_table[state * 256 + byt]
                if counting:
                    cnt[lo:hi] = weight[state]
                continue
            p_lo = off[j - 1]
            active = prev != 0
            if flags:
                active |= slow[p_lo:lo]                      # slow marks flow down through dead nodes
            n_active = int(np.count_nonzero(active))
            if n_active == 0:
                break
            if len(prev) > 2048 and n_active * 16 < len(prev):  # sparse: only the live parents' children
                idx = np.flatnonzero(active)
                starts = self._child_start[j][idx]
                counts = self._child_start[j][idx + 1] - starts
                total = int(counts.sum())
                if total == 0:
                    break
                ch = np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(total)
            else:
                ch = None
            sub_par = par if ch is None else par[ch]
            parent_state = prev[sub_par]
            cur = flat_table[parent_state * 256 + (byt if ch is None else byt[ch])]
            nodes = slice(lo, hi) if ch is None else lo + ch
            st[nodes] = cur
            if counting:
                cnt[nodes] = cnt[p_lo + sub_par] + weight[parent_state]
            if flags:
                passed[nodes] = passed[p_lo + sub_par] | escapable[parent_state]
                slow[nodes] = slow[p_lo + sub_par] | ((cur == 0) & (parent_state != 0) & passed[nodes])
            if ch is None:
                prev = cur
            else:
                prev = np.zeros(hi - lo, dtype=np.int32)
                prev[ch] = cur
        alive = st[self._token_node] != 0
        out_slow = self.order[slow[self._token_node] & ~alive] if flags else None
        if counting:
            nodes = self._token_node[alive]
            return self.order[alive], out_slow, st[nodes], cnt[nodes].astype(np.int64)
        return self.order[alive], out_slow

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
