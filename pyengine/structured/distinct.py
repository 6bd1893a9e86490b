"""S15 additional properties with distinct names, counted: ``minProperties`` over several extra members.

``{"a": 1, "a": 2}`` parses to one property, so a grammar that counts two additional members towards
``minProperties`` must not let the second repeat the first one's name. No automaton state can keep the names
written so far (they are unbounded); the schema compiler instead writes the members of such an object as a
rule of its own,

    ("xkeys", edges, accepting, value_rule, lo, hi)      # ir.py: key DFA (with quotes), lo..hi members

run by the pushdown matcher as a `DistinctKeysRule`: its frame state is an interned (phase, key DFA state,
key bytes so far, names written, members written), phases KEY (reading a key) -> COLON -> CALL (the value
rule is called) -> AFTER (``,`` starts the next key, or the frame returns once ``lo`` members are written).
The byte that closes a key is refused when the decoded name (``json.loads``: ``"a"`` and ``"\\u0061"`` are one
name) was written before in the same frame, i.e. the same object: each object calls the rule anew, so
siblings and nested objects have sets of their own, and a rollback restores an older frame state. Token
masks: inside a key, one vectorized walk of the key DFA; every token that closes a key, and every token
read from COLON / AFTER, is checked byte by byte by the pushdown matcher (the slow path it already has).

Listed properties beside them (``properties`` / ``required`` plus ``additionalProperties``, a count needing two
or more extras) are the same rule with a seventh field, ``listed``: ((name, key bytes, value rule, required),
...). The key DFA is then the listed keys' literals or an extra key (a string spelling no listed name); the
decoded name chooses the value rule (a listed name, however spelled, is that member, never an extra), every
name once, in any order. The frame also carries which key DFA it reads: when the members still allowed by
maxProperties are exactly the required names not yet written, only their keys may start (a trie of those
keys, built when first reached), so no prefix leads to a dead end; the frame returns once ``lo`` members and
every required one are written.
"""
from __future__ import annotations

import json

import numpy as np

from .counter import Lazy, dfa_table

KEY, COLON, CALL, AFTER = 0, 1, 2, 3
MAX_NAME_BYTES = 4096            # a key longer than this is refused (the frame state holds its bytes)


def _trie(keys):
    """The DFA of a finite set of byte strings, in `dfa_table`'s layout (start 1)."""
    rows = [[0] * 256, [0] * 256]
    acc = [False, False]
    for k in keys:
        s = 1
        for b in k:
            if not rows[s][b]:
                rows.append([0] * 256)
                acc.append(False)
                rows[s][b] = len(rows) - 1
            s = rows[s][b]
        acc[s] = True
    table = np.array(rows, dtype=np.int32)
    return rows, table.reshape(-1), acc, np.array(acc, dtype=bool)


class DistinctKeysRule:
    """A rule of the pushdown matcher: lo..hi object members whose names are pairwise distinct (listed
    members among them when the node has a ``listed`` field)."""

    counted = True                  # its masks come from frame_mask, not from a flat DFA walk

    def __init__(self, node):
        _, edges, accepting, value_rule, lo, hi = node[:6]
        listed = node[6] if len(node) > 6 else ()
        self.full = dfa_table(edges, accepting)
        self.key_rows, self.key_flat, self.key_acc, self.key_acc_np = self.full
        self.value_rule = value_rule
        self.listed = {name: rule for name, _, rule, _ in listed}
        self.required = frozenset(name for name, _, _, req in listed if req)
        self.req_keys = {name: bytes(key) for name, key, _, req in listed if req}
        self._forced: dict = {}     # missing required names -> trie of their keys
        self.lo, self.hi = int(lo), (None if hi is None else int(hi))
        self._states: list = [None]
        self._ids: dict = {}
        self._intern(self._key_state(frozenset(), 0))
        self._first: dict = {}
        self._bind()

    def _bind(self):
        self.rows = Lazy(self._row)
        self.accepting = Lazy(self._accepting)
        self.has_bytes = Lazy(lambda s: self._states[s][0] != CALL)
        self.calls = Lazy(self._calls)
        self.final_only = Lazy(lambda s: False)

    def __getstate__(self):
        state = dict(self.__dict__)
        for k in ("rows", "accepting", "has_bytes", "calls", "final_only"):
            state.pop(k)
        state["_first"] = {}
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._bind()

    def _intern(self, st) -> int:
        i = self._ids.get(st)
        if i is None:
            i = self._ids[st] = len(self._states)
            self._states.append(st)
        return i

    def _key_state(self, seen, n):
        """The KEY state after ``n`` members named ``seen``: the full key DFA, or only the missing required
        keys when maxProperties leaves room for nothing else."""
        missing = self.required - seen
        sel = missing if missing and self.hi is not None and self.hi - n <= len(missing) else None
        return (KEY, 1, b"", seen, n, sel)

    def _dfa(self, sel):
        if sel is None:
            return self.full
        hit = self._forced.get(sel)
        if hit is None:
            hit = self._forced[sel] = _trie(sorted(self.req_keys[m] for m in sel))
        return hit

    def _next(self, s: int, b: int) -> int:
        phase, kq, key, seen, n, sel = self._states[s]
        if phase == KEY:
            rows, _, acc, _ = self._dfa(sel)
            kq2 = rows[kq][b]
            if not kq2 or len(key) >= MAX_NAME_BYTES:
                return 0
            key2 = key + bytes((b,))
            if acc[kq2]:                            # the key is closed: a name written before is refused
                try:
                    name = json.loads(key2)
                except ValueError:
                    return 0
                if name in seen:
                    return 0
                seen2 = seen | {name}
                if self.hi is not None and n + 1 + len(self.required - seen2) > self.hi:
                    return 0                        # the required names left would not fit
                return self._intern((COLON, 0, b"", seen2, n, self.listed.get(name, self.value_rule)))
            return self._intern((KEY, kq2, key2, seen, n, sel))
        if phase == COLON:
            return self._intern((CALL, 0, b"", seen, n, sel)) if b == 0x3A else 0
        if phase == AFTER:
            if b == 0x2C and (self.hi is None or n < self.hi):
                return self._intern(self._key_state(seen, n))
            return 0
        return 0

    def _row(self, s: int):
        return Lazy(lambda b: self._next(s, b))

    def _accepting(self, s: int) -> bool:
        phase, _, _, seen, n, _ = self._states[s]
        if s == 1:
            return self.lo == 0 and not self.required
        return phase == AFTER and n >= self.lo and self.required <= seen

    def _calls(self, s: int):
        phase, _, _, seen, n, rule = self._states[s]
        if phase != CALL:
            return ()
        return ((rule, self._intern((AFTER, 0, b"", seen, n + 1, None))),)

    # --- token masks ----------------------------------------------------------------------------------
    def _first_byte(self, vocab, b: int) -> np.ndarray:
        key = (vocab.key, b)
        hit = self._first.get(key)
        if hit is None:
            hit = self._first[key] = np.asarray([i for i, t in enumerate(vocab.token_bytes)
                                                 if t is not None and t[0] == b], dtype=np.int64)
        return hit

    def frame_mask(self, s: int, vocab):
        """(token ids read whole inside a key that do not close it, token ids the pushdown matcher must
        step byte by byte: those closing a key, and every token read after a key or a value)."""
        phase, kq, _, _, _, sel = self._states[s]
        if phase == KEY:
            _, flat, acc, acc_np = self._dfa(sel)
            ids, ends, _, slow = vocab.counted_walk(flat, kq, np.zeros(len(acc), np.int32), acc_np)
            closes = acc_np[ends]
            return ids[~closes], np.concatenate([slow, ids[closes]])
        if phase == COLON:
            return np.zeros(0, dtype=np.int64), self._first_byte(vocab, 0x3A)
        if phase == AFTER:
            return np.zeros(0, dtype=np.int64), self._first_byte(vocab, 0x2C)
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
