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
"""
from __future__ import annotations

import json

import numpy as np

KEY, COLON, CALL, AFTER = 0, 1, 2, 3
MAX_NAME_BYTES = 4096            # a key longer than this is refused (the frame state holds its bytes)


class _Lazy:
    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, i):
        return self.fn(i)


class DistinctKeysRule:
    """A rule of the pushdown matcher: lo..hi object members whose names are pairwise distinct."""

    counted = True                  # its masks come from frame_mask, not from a flat DFA walk

    def __init__(self, node):
        _, edges, accepting, value_rule, lo, hi = node
        q = len(edges) + 1
        table = np.zeros((q, 256), dtype=np.int32)
        for s, out in enumerate(edges, start=1):
            for mask, t in out:
                bits = np.unpackbits(np.frombuffer(int(mask).to_bytes(32, "little"), dtype=np.uint8),
                                     bitorder="little").astype(bool)
                table[s, bits] = t + 1
        self.key_rows = table.tolist()
        self.key_flat = table.reshape(-1)
        self.key_acc = [False] + [bool(a) for a in accepting]
        self.key_acc_np = np.array(self.key_acc, dtype=bool)
        self.value_rule = value_rule
        self.lo, self.hi = int(lo), (None if hi is None else int(hi))
        self._states: list = [None, (KEY, 1, b"", frozenset(), 0)]
        self._ids: dict = {self._states[1]: 1}
        self._first: dict = {}
        self._bind()

    def _bind(self):
        self.rows = _Lazy(self._row)
        self.accepting = _Lazy(self._accepting)
        self.has_bytes = _Lazy(lambda s: self._states[s][0] != CALL)
        self.calls = _Lazy(self._calls)
        self.final_only = _Lazy(lambda s: False)

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

    def _next(self, s: int, b: int) -> int:
        phase, kq, key, seen, n = self._states[s]
        if phase == KEY:
            kq2 = self.key_rows[kq][b]
            if not kq2 or len(key) >= MAX_NAME_BYTES:
                return 0
            key2 = key + bytes((b,))
            if self.key_acc[kq2]:                   # the key is closed: a name written before is refused
                try:
                    name = json.loads(key2)
                except ValueError:
                    return 0
                if name in seen:
                    return 0
                return self._intern((COLON, 0, b"", seen | {name}, n))
            return self._intern((KEY, kq2, key2, seen, n))
        if phase == COLON:
            return self._intern((CALL, 0, b"", seen, n)) if b == 0x3A else 0
        if phase == AFTER:
            if b == 0x2C and (self.hi is None or n < self.hi):
                return self._intern((KEY, 1, b"", seen, n))
            return 0
        return 0

    def _row(self, s: int):
        return _Lazy(lambda b: self._next(s, b))

    def _accepting(self, s: int) -> bool:
        phase, _, _, _, n = self._states[s]
        return (phase == AFTER and n >= self.lo) or (s == 1 and self.lo == 0)

    def _calls(self, s: int):
        phase, _, _, seen, n = self._states[s]
        if phase != CALL:
            return ()
        return ((self.value_rule, self._intern((AFTER, 0, b"", seen, n + 1))),)

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
        phase, kq, _, _, _ = self._states[s]
        if phase == KEY:
            ids, ends, _, slow = vocab.counted_walk(self.key_flat, kq, np.zeros(len(self.key_acc), np.int32),
                                                    self.key_acc_np)
            closes = self.key_acc_np[ends]
            return ids[~closes], np.concatenate([slow, ids[closes]])
        if phase == COLON:
            return np.zeros(0, dtype=np.int64), self._first_byte(vocab, 0x3A)
        if phase == AFTER:
            return np.zeros(0, dtype=np.int64), self._first_byte(vocab, 0x2C)
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
